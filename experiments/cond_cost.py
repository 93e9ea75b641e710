"""What the steps' device-side branches cost: any ``python -m dflash_jax.bench`` command, run as it is or with every
``jax.lax.cond`` traced as a select (both branches computed, the result picked by ``jnp.where``).

On a GPU, XLA runs a conditional outside a command buffer by copying its predicate to the host and waiting for
the stream (``ConditionalThunk``: ``Memcpy`` + ``BlockHostUntilDone``; XLA's default command buffers take no
conditionals), so each top-level ``lax.cond`` of a step (penalties, sampling, logprobs; the blocked prefill
attention's skipped blocks) drains the launch queue once. A select has no such wait but always pays for both
branches: cheap on the tiny set's 4K vocabulary, not on the 27B's 248K. Compare ``tok_s`` of the two runs:

    python experiments/cond_cost.py -- concurrency --model dflash_jax/assets/tiny/target \\
        --drafter dflash_jax/assets/tiny/drafter --prompts held-out --dtype bfloat16 --concurrency 1 \\
        --requests 8 --repeats 2 --output-len 128 --cohort-yield-min 0
    python experiments/cond_cost.py --select -- concurrency ...   (the same arguments)

The patch is applied before anything is traced, so it reaches every step the bench compiles.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import jax
import jax.numpy as jnp


def select_cond(pred, true_fun, false_fun, *operands):
    """``jax.lax.cond``'s contract (two branches, boolean or integer predicate) as a select of both branches."""
    t = true_fun(*operands)
    f = false_fun(*operands)
    p = jnp.asarray(pred) != 0
    return jax.tree_util.tree_map(lambda a, b: jnp.where(p, a, b), t, f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--select", action="store_true", help="trace every lax.cond as a select")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then a bench command and its arguments")
    args = ap.parse_args(argv)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        ap.error("give a bench command after --, e.g. -- concurrency --model ...")
    if args.select:
        jax.lax.cond = select_cond
    from dflash_jax.bench import results
    from dflash_jax.bench.__main__ import main as bench_main

    write = results.write_result
    command = shlex.join(["python", "experiments/cond_cost.py"] + (["--select"] if args.select else [])
                         + ["--", *bench])

    def write_result(bench_name, figures, _command, *a, **kw):  # the JSON records this command, not the bench's
        return write(bench_name, figures, command, *a, **kw)

    results.write_result = write_result
    return bench_main(bench)


if __name__ == "__main__":
    sys.exit(main())
