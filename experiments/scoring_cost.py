"""The device cost of one KVFlash re-ranking call, ``shadow`` against ``bounds``, at any model's attention shapes
without a model: ``kv/kvflash_scoring.DeviceScorer`` over random keys and queries, timed as the engine calls it
(``score`` of S sequences of N candidate pages each, scores back on the host).

The engine re-ranks a sequence when its protected pages change (a new page every ``page_size`` tokens) or every
``rescore_every`` steps, so at C16 in lockstep about one 16-row call per 16 decode steps: this call's time over 16
is what scoring adds to a decode step. ``--shapes`` are the target's attention layers, query heads, KV heads and
head dim (default: the 27B's 16 x 24 / 4 x 256).

Figures ``<kind>.s<S>.n<N>.ms`` (median of ``--iters`` timed calls after a warm one), ``shadow_vs_bounds.s<S>.n<N>``
(the time ratio), ``<kind>.table_bytes_per_page``; written as ``scoring_cost_<device>_<yyyymmdd-hhmm>.json`` under
``--out-dir``.

    python experiments/scoring_cost.py                                   # 27B shapes (an H200: seconds)
    python experiments/scoring_cost.py --shapes 2 4 2 64 --pages 16 64   # the shipped tiny target's
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash_jax.kv.kvflash_scoring import KINDS, DeviceScorer  # noqa: E402

QUERY_TAIL = 16  # the engine's KVFLASH_QUERY_TAIL


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=int, nargs=4, default=(16, 24, 4, 256), metavar=("L", "H", "HKV", "D"))
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="sequences re-ranked in one call")
    p.add_argument("--pages", type=int, nargs="+", default=[128, 256], help="candidate pages per sequence")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="K/V page dtype")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="experiments/results")
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, float]:
    n_layers, n_heads, n_kv, d = args.shapes
    ps, dtype = args.page_size, jnp.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    n_ids = max(args.rows) * max(args.pages)
    phys = 64  # physical pages the tables are written from (their keys repeat over the ids; scores do not care)
    keys = [jnp.asarray(rng.normal(size=(phys, ps, n_kv, d)), dtype) for _ in range(n_layers)]
    state = types.SimpleNamespace(kv=types.SimpleNamespace(k=keys))
    figures: dict[str, float] = {}
    for kind in args.kinds:
        sc = DeviceScorer(state, n_ids=n_ids, n_slots=max(args.rows) + 1, n_heads=n_heads, window=QUERY_TAIL,
                          max_pages=max(args.pages), kind=kind)
        for lo in range(0, n_ids, 64):
            ids = list(range(lo, min(n_ids, lo + 64)))
            sc.write(state, [i % phys for i in ids], ids)
        q = jnp.asarray(rng.normal(size=(max(args.rows), QUERY_TAIL, n_layers, n_heads, d)), jnp.float32)
        sc.push(q, list(range(1, max(args.rows) + 1)), [QUERY_TAIL] * max(args.rows))
        figures[f"{kind}.table_bytes_per_page"] = float(sum(t.nbytes for t in sc.table) / n_ids)
        for s in args.rows:
            for n in args.pages:
                items = [(1 + r, QUERY_TAIL, (r * n + np.arange(n - 5)).astype(np.int32),
                          (r * n + np.arange(n - 5, n)).astype(np.int32)) for r in range(s)]  # 5 protected pages
                sc.score(items)  # compiles this bucket
                times = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    sc.score(items)
                    times.append(time.perf_counter() - t0)
                figures[f"{kind}.s{s}.n{n}.ms"] = 1e3 * float(np.median(times))
    if set(args.kinds) == set(KINDS):
        for s in args.rows:
            for n in args.pages:
                ms = lambda kind: figures[f"{kind}.s{s}.n{n}.ms"]
                figures[f"shadow_vs_bounds.s{s}.n{n}"] = ms("shadow") / ms("bounds")
    return figures


def main(argv=None) -> dict[str, float]:
    args = parse(argv)
    figures = measure(args)
    for k, v in figures.items():
        print(f"{k:32s} {v:.3f}")
    if not args.no_write:
        from dflash_jax.bench.results import script_command, settings, write_result

        command = script_command(__file__, argv)
        extra = {"settings": settings(args),
                 "device": str(jax.devices()[0])}
        print("wrote", write_result("scoring_cost", figures, command, extra, out_dir=args.out_dir))
    return figures


if __name__ == "__main__":
    main()
