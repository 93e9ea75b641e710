"""Time the DDTree pop loop (op ``ddtree_build``): the XLA reference (a while loop of small kernels per pop) against
the Pallas kernel (the whole loop in one launch), per batch and tree kind, at the engine's shapes.

    python experiments/ddtree_build_cost.py [--batch 1 8 16 64] [--budget 22] [--depth 16] [--iters 50]
                                            [--out-dir experiments/results]

Inputs: sorted top-K lists ``[B, L, K]`` (K = budget) from random drafter log-probs. Each implementation runs
``UNROLL`` times in one jitted call (each call's input shifted by 0 x the previous output, so none is hoisted; no
while loop around the calls, whose per-iteration host sync would be charged to a microsecond-scale kernel); time
per build = median wall time of that call / ``UNROLL``. Both implementations' trees must be equal (checked first).
Figures per batch B and tree kind (``best_first``: the engine's drafter trees; ``chain``: the oracle's chain-seeded
ones): ``ddtree_build.bB.<kind>.reference_us``, ``.kernel_us``, ``.speedup`` (reference / kernel). Off a GPU the
kernel runs in interpret mode (a check that the script works, not a timing).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.bench import results  # noqa: E402
from dflash_jax.bench.timing import median_seconds  # noqa: E402
from dflash_jax.spec import ddtree, topk  # noqa: E402
from pallas_kernels import registry  # noqa: E402

UNROLL = 8
KINDS = {"best_first": False, "chain": True}


def top_lists(b: int, depth: int, budget: int, vocab: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Sorted top-``budget`` log-probs / ids ``[b, depth, budget]`` of random drafter marginals."""
    x = jax.random.normal(jax.random.key(seed), (b, depth, vocab)) * 3.0
    return topk.top_k(jax.nn.log_softmax(x, axis=-1), budget)


def chained(fn, budget: int, chain_seed: bool):
    """``UNROLL`` builds in one jitted call, each input shifted by 0 x the previous tree's scores."""
    def run(lp, tok):
        acc = jnp.zeros((), jnp.float32)
        for _ in range(UNROLL):
            out = fn(lp + acc * 0.0, tok, budget, chain_seed)
            acc = acc + jnp.sum(jnp.where(out["valid"] != 0, out["score"], 0.0))
        return acc
    return jax.jit(run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 64])
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--depth", type=int, default=16, help="the drafter's block positions L")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary of the random marginals (only their top-K "
                                                             "lists reach the builder)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out-dir", default="experiments/results")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)

    impls = {"reference": registry.get("ddtree_build", "reference"),
             "kernel": registry.get("ddtree_build", "pallas_triton")}
    figures: dict[str, float] = {}
    for b in a.batch:
        lp, tok = top_lists(b, a.depth, a.budget, a.vocab, seed=b)
        for kind, chain_seed in KINDS.items():
            outs = {name: fn(lp, tok, a.budget, chain_seed) for name, fn in impls.items()}
            for f in ddtree.TREE_FIELDS:
                if not np.array_equal(np.asarray(outs["kernel"][f]), np.asarray(outs["reference"][f])):
                    raise SystemExit(f"ddtree_build: the kernel's {f} differs from the reference at B{b} {kind}")
            tag = f"ddtree_build.b{b}.{kind}"
            for name, fn in impls.items():
                call = chained(fn, a.budget, chain_seed)
                jax.block_until_ready(call(lp, tok))
                figures[f"{tag}.{name}_us"] = 1e6 * median_seconds(
                    lambda: jax.block_until_ready(call(lp, tok)), a.iters) / UNROLL
            figures[f"{tag}.speedup"] = figures[f"{tag}.reference_us"] / figures[f"{tag}.kernel_us"]
            print(f"{tag}: reference {figures[f'{tag}.reference_us']:.1f} us, kernel {figures[f'{tag}.kernel_us']:.1f}"
                  f" us, {figures[f'{tag}.speedup']:.2f}x", flush=True)
    if not a.no_write:
        command = "python experiments/ddtree_build_cost.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        print("wrote", results.write_result("ddtree_build_cost", figures, command.strip(),
                                            {"budget": a.budget, "depth": a.depth, "vocab": a.vocab,
                                             "unroll": UNROLL}, out_dir=a.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
