"""What a step's host-driven control flow costs on a GPU: any ``python -m dflash_jax.bench`` command, run as it is,
with every ``jax.lax.cond`` traced as a select (``--select-conds``), or with the DDTree builder's best-first loop
unrolled (``--unroll-tree``).

On a GPU, XLA runs a conditional outside a command buffer by copying its predicate to the host and waiting for
the stream (``ConditionalThunk``: ``Memcpy`` + ``BlockHostUntilDone``; XLA's default command buffers take neither
conditionals nor while loops), so each top-level ``lax.cond`` of a step (penalties, sampling, logprobs; the blocked
prefill attention's skipped blocks) drains the launch queue once, and a ``fori_loop`` (the tree builder's
``budget`` pops) is driven from the host, its body's kernels launched one iteration at a time. A select has no
wait but pays for both branches: cheap on the tiny set's 4K vocabulary, not on the 27B's 248K. An unrolled loop is
one straight sequence of fusions XLA can fuse across iterations and capture in a command buffer.

    C="concurrency --model dflash_jax/assets/tiny/target --drafter dflash_jax/assets/tiny/drafter \\
       --prompts held-out --dtype bfloat16 --concurrency 1 8 --requests 8 --repeats 2 --output-len 128 \\
       --cohort-yield-min 0"
    python experiments/control_flow_cost.py -- $C
    python experiments/control_flow_cost.py --select-conds -- $C
    python experiments/control_flow_cost.py --unroll-tree -- $C

The patches are applied before anything is traced, so they reach every step the bench compiles; the result JSON
records this script's command line.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, as `python experiments/...`


def select_cond(pred, true_fun, false_fun, *operands):
    """``jax.lax.cond``'s contract (two branches, boolean or integer predicate) as a select of both branches."""
    t = true_fun(*operands)
    f = false_fun(*operands)
    p = jnp.asarray(pred) != 0
    return jax.tree_util.tree_map(lambda a, b: jnp.where(p, a, b), t, f)


def unroll_tree_loop() -> None:
    """Unroll every ``jax.lax.fori_loop`` whose body comes from ``spec.ddtree`` (the builder's pops; static bounds)."""
    rolled = jax.lax.fori_loop

    def fori_loop(lower, upper, body, init, **kw):
        if getattr(body, "__module__", None) == "dflash_jax.spec.ddtree":
            kw["unroll"] = True
        return rolled(lower, upper, body, init, **kw)

    jax.lax.fori_loop = fori_loop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--select-conds", action="store_true", help="trace every lax.cond as a select")
    ap.add_argument("--unroll-tree", action="store_true", help="unroll the DDTree builder's best-first loop")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then a bench command and its arguments")
    args = ap.parse_args(argv)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        ap.error("give a bench command after --, e.g. -- concurrency --model ...")
    if args.select_conds:
        jax.lax.cond = select_cond
    if args.unroll_tree:
        unroll_tree_loop()
    from dflash_jax.bench import results
    from dflash_jax.bench.__main__ import main as bench_main

    write = results.write_result
    flags = [f for f, on in (("--select-conds", args.select_conds), ("--unroll-tree", args.unroll_tree)) if on]
    command = shlex.join(["python", "experiments/control_flow_cost.py", *flags, "--", *bench])

    def write_result(bench_name, figures, _command, *a, **kw):  # the JSON records this command, not the bench's
        return write(bench_name, figures, command, *a, **kw)

    results.write_result = write_result
    return bench_main(bench)


if __name__ == "__main__":
    sys.exit(main())
