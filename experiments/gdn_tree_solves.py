"""Time the tree GDN kernel's solves against each other at the 27B's B1 verify launch (B1 x 23 slots, 48 value heads
x 128, block_v 64, 8 warps, tf32x3), with their largest relative error against the jnp reference. The time is the
wall time a call over back-to-back dispatches (best of 3 x ``--iters``): a launch shorter than the dispatch rate
reads as that rate, so compare short solves with ``bench kernels --ops gdn_tree`` too.

    PYTHONPATH=. python experiments/gdn_tree_solves.py --solves substitution doubling blocked --out-dir experiments/results
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp


def tree_ancestors(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random tree of n slots (slot 0 the root, each parent earlier): ``[n, n]`` bool, j an ancestor of i or i."""
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        anc[i] |= anc[rng.integers(0, i)]
    return anc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--solves", nargs="+", default=["substitution", "doubling", "blocked"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tree", type=int, default=23)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out-dir", default=None)
    a = p.parse_args(argv)
    from dflash_jax.bench import results
    from dflash_jax.models.gdn import gdn_tree_reference
    from pallas_kernels.gdn import tree

    b, n, h, dk, dv = a.batch, a.tree, 48, 128, 128
    rng = np.random.default_rng(0)
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (b, n, h, dk))) * dk ** -0.5
    k = unit(jax.random.normal(ks[1], (b, n, h, dk)))
    v = jax.random.normal(ks[2], (b, n, h, dv))
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (b, n, h)))
    g = -jax.nn.softplus(jax.random.normal(ks[4], (b, n, h)))
    s0 = 0.1 * jax.random.normal(ks[5], (b, h, dk, dv))
    anc = jnp.asarray(np.stack([tree_ancestors(n, rng) for _ in range(b)]))
    args = (q, k, v, beta, g, s0, anc)
    ref = jax.jit(gdn_tree_reference)(*args)
    figures = {}
    for solve in a.solves:
        fn = jax.jit(lambda *x, solve=solve: tree.gdn_tree(*x, block_v=64, num_warps=8, precision="tf32x3",
                                                           solve=solve))
        out = jax.block_until_ready(fn(*args))
        err = max(float(jnp.abs(o - r).max() / jnp.maximum(1.0, jnp.abs(r).max()))
                  for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(a.iters):
                out = fn(*args)
            jax.block_until_ready(out)
            best = min(best, (time.perf_counter() - t0) / a.iters)
        figures[f"gdn_tree.b{b}.t{n}.{solve}.kernel_us"] = best * 1e6
        figures[f"gdn_tree.b{b}.t{n}.{solve}.rel_err"] = err
        print(f"{solve}: {best * 1e6:.1f} us, rel err {err:.2e}", flush=True)
    if a.out_dir:
        command = "PYTHONPATH=. python experiments/gdn_tree_solves.py " + " ".join(sys.argv[1:] if argv is None else argv)
        print("wrote", results.write_result("gdn_tree_solves", figures, command, {}, out_dir=a.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
