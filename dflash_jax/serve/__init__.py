"""OpenAI-compatible HTTP server: python -m dflash_jax.serve."""
