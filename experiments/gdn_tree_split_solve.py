"""The gated tree GDN kernel with T solved in every program against T solved in a first launch of few warps.

At the 27B's GDN shapes (16 key / 48 value heads x 128, post-conv rows bf16, gates fp32) and a verify tree of
``--nodes`` slots (a random tree), times ``pallas_kernels.gdn.gdn_tree_gated`` at its default config with
``solve_warps`` None and each of ``--solve-warps``, after checking each split result against the whole one.
Writes ``gdn_tree_split_solve_<device>_<stamp>.json`` with figures ``b<B>.whole_us``, ``b<B>.split<W>_us``,
``b<B>.split<W>.speedup`` and ``check.max_rel_err``.

    PYTHONPATH=. python experiments/gdn_tree_split_solve.py --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.results import script_command, write_result
from dflash_jax.bench.timing import median_seconds


def tree_ancestors(rng, b: int, n: int) -> np.ndarray:
    """[B, N, N] bool: random trees, parents before children, reflexive."""
    anc = np.zeros((b, n, n), bool)
    for r in range(b):
        for i in range(n):
            anc[r, i, i] = True
            if i:
                p = int(rng.integers(max(0, i - 4), i))
                anc[r, i] |= anc[r, p]
    return anc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--nodes", type=int, default=23)
    ap.add_argument("--solve-warps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out-dir", default="experiments/results")
    a = ap.parse_args(argv)

    from pallas_kernels import gdn as pg
    from pallas_kernels import registry

    backend = registry.current_backend()
    interpret = backend not in registry.GPU_BACKENDS
    hk, hv, d, n = 16, 48, 128, a.nodes
    cfg = pg.tree_default_config(n, d, d, dtype=jnp.float32, backend=backend)
    cfg["precision"] = pg.launch_precision(jnp.float32, backend)
    rng = np.random.default_rng(0)
    figures: dict[str, float] = {}
    worst = 0.0
    for b in a.batches:
        c = jnp.asarray(rng.standard_normal((b, n, 2 * hk * d + hv * d)), jnp.bfloat16)
        braw, araw = (jnp.asarray(rng.standard_normal((b, n, hv)), jnp.float32) for _ in range(2))
        a_log = jnp.asarray(rng.uniform(-1, 1, hv), jnp.float32)
        dt_bias = jnp.asarray(rng.uniform(-1, 1, hv), jnp.float32)
        valid = jnp.ones((b, n), bool)
        anc = jnp.asarray(tree_ancestors(rng, b, n))
        pool = jnp.asarray(rng.standard_normal((b + 1, hv, d, d)) * 0.1, jnp.float32)
        slots = jnp.arange(1, b + 1, dtype=jnp.int32)
        args = (c, braw, araw, a_log, dt_bias, valid, pool, anc, slots)

        def run(w):
            return pg.gdn_tree_gated(*args, n_k_heads=hk, solve_warps=w, interpret=interpret, **cfg)

        whole = jax.block_until_ready(run(None))
        figures[f"b{b}.whole_us"] = t0 = median_seconds(lambda: run(None), a.iters) * 1e6
        print(f"B{b} x {n} nodes: whole {t0:.1f} us", flush=True)
        for w in a.solve_warps:
            out = jax.block_until_ready(run(w))
            for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(whole)):
                x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
                worst = max(worst, float(np.abs(x - y).max() / max(1e-6, np.abs(y).max())))
            t = median_seconds(lambda: run(w), a.iters) * 1e6
            figures[f"b{b}.split{w}_us"] = t
            figures[f"b{b}.split{w}.speedup"] = t0 / t
            print(f"  split, {w} warp(s): {t:.1f} us ({t0 / t:.2f}x)", flush=True)
    figures["check.max_rel_err"] = worst
    print(f"split vs whole: max relative error {worst:.2e}")
    path = write_result("gdn_tree_split_solve", figures, script_command(__file__, argv),
                        extra={"config": {k: v for k, v in cfg.items()}, "nodes": n}, out_dir=a.out_dir)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
