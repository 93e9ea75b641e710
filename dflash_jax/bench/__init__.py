"""Benchmarks: ``python -m dflash_jax.bench <subcommand>`` (see ``__main__``)."""
