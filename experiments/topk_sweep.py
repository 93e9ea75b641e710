"""Selections over a vocabulary's size: the drafter's top-k (``jax.lax.top_k`` against the two-stage
``spec.topk.top_k``) and the sampling filter (the sorting ``sampling.filtered_sorted`` against ``sampling.kept``).

    python experiments/topk_sweep.py [--vocab 248320] [--positions 15] [--batch 1 4 16] [--k 22]
                                     [--chunks 64 128 256] [--sampler-rows 1 16 368] [--iters 50]
                                     [--out-dir experiments/results]

A DDTree round takes the top ``k`` (= the budget) of each of the drafter's ``positions`` log-probability rows; above
k = 16 XLA's GPU top-k becomes a sort of the whole vocabulary. Times both on ``[B, positions, vocab]`` float32 and
checks they agree. Figures ``topk.b<B>.{lax_us,two_stage_us,speedup}`` (the default chunk) and
``topk.b<B>.chunk<C>.us``.

A sampled row (temperature > 0) draws from the tokens min-p, top-k and top-p keep; ``--sampler-rows`` rows of
``[R, vocab]`` logits (16 = an AR step at C16, 368 = a C16 speculative round's 16 x 23 tree nodes) with mixed
settings (top-k 0 / 50, top-p 0.95 / 1, min-p 0 / 0.05), both filters timed, their kept sets compared (equal up to
a few tokens at a large top-p set's boundary: float32 rounding of the running mass). Figures
``sampler.r<R>.{sort_us,kept_us,speedup,rows_differing,max_kept_difference,mean_kept}``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.bench import results, timing  # noqa: E402
from dflash_jax.engine import sampling  # noqa: E402
from dflash_jax.spec import topk  # noqa: E402


def time_us(fn, x, iters: int) -> float:
    """Median wall time of ``fn(x)`` in microseconds, each call waited for."""
    return timing.median_seconds(lambda: fn(x), iters) * 1e6


def sampler_figures(figures: dict[str, float], rows: int, vocab: int, iters: int) -> None:
    """Time the sorting and the sort-free sampling filters on ``[rows, vocab]`` logits; their kept sets must agree
    (top-p < 1 rows only: at top-p 1 the sorting filter drops tail tokens whose float32 running mass rounds to 1)."""
    key = jax.random.key(rows)
    x = jax.random.normal(key, (rows, vocab)) * 4
    i = np.arange(rows)
    top_k = jnp.asarray(np.where(i % 2, 50, 0), jnp.int32)
    top_p = jnp.asarray(np.where(i % 3 == 2, 1.0, 0.95), jnp.float32)
    min_p = jnp.asarray(np.where(i % 4 == 3, 0.05, 0.0), jnp.float32)
    ones = jnp.ones(rows, jnp.float32)

    def by_sort(x):
        order, masked = sampling.filtered_sorted(x, ones, top_k, top_p, min_p)
        return jnp.zeros(x.shape, bool).at[jnp.arange(rows)[:, None], order].set(jnp.isfinite(masked))

    sort_fn = jax.jit(by_sort)
    kept_fn = jax.jit(lambda x: sampling.kept(x, top_k, top_p, min_p))
    a, b = np.asarray(sort_fn(x)), np.asarray(kept_fn(x))
    rows_p = np.asarray(top_p) < 1
    na, nb = a.sum(-1)[rows_p], b.sum(-1)[rows_p]
    nested = ((a & ~b).sum(-1) == 0) | ((b & ~a).sum(-1) == 0)  # both are prefixes of one order
    diff = np.abs(na - nb)
    if not nested[rows_p].all() or np.any(diff > 2 + 0.01 * np.maximum(na, nb)):
        raise SystemExit(f"the sampling filters keep different tokens at {rows} rows: kept {na.tolist()} vs "
                         f"{nb.tolist()}")
    # the boundary of a top-p set with thousands of tokens moves by a few tokens with the float32 rounding of its
    # running mass (the sorting filter's cumulative sum over the vocabulary; ``kept``'s tree-reduced masses)
    figures[f"sampler.r{rows}.rows_differing"] = int(np.sum(diff > 0))
    figures[f"sampler.r{rows}.max_kept_difference"] = int(diff.max(initial=0))
    figures[f"sampler.r{rows}.mean_kept"] = float(nb.mean()) if nb.size else 0.0
    figures[f"sampler.r{rows}.sort_us"] = time_us(sort_fn, x, iters)
    figures[f"sampler.r{rows}.kept_us"] = time_us(kept_fn, x, iters)
    figures[f"sampler.r{rows}.speedup"] = figures[f"sampler.r{rows}.sort_us"] / figures[f"sampler.r{rows}.kept_us"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--positions", type=int, default=15)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--k", type=int, default=22)
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, topk.CHUNK, 256])
    ap.add_argument("--sampler-rows", type=int, nargs="*", default=[1, 16, 368])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out-dir", default="experiments/results")
    args = ap.parse_args(argv)

    lax_fn = jax.jit(lambda x: jax.lax.top_k(x, args.k))
    figures: dict[str, float] = {}
    for b in args.batch:
        x = jax.nn.log_softmax(jax.random.normal(jax.random.key(b), (b, args.positions, args.vocab)) * 3, axis=-1)
        want_v, want_i = lax_fn(x)
        figures[f"topk.b{b}.lax_us"] = time_us(lax_fn, x, args.iters)
        for c in args.chunks:
            fn = jax.jit(functools.partial(topk.top_k, k=args.k, chunk=c))
            got_v, got_i = fn(x)
            if not (np.array_equal(np.asarray(got_i), np.asarray(want_i))
                    and np.array_equal(np.asarray(got_v), np.asarray(want_v))):
                raise SystemExit(f"two-stage top-k (chunk {c}) differs from jax.lax.top_k at B={b}")
            figures[f"topk.b{b}.chunk{c}.us"] = time_us(fn, x, args.iters)
        figures[f"topk.b{b}.two_stage_us"] = figures[f"topk.b{b}.chunk{topk.CHUNK}.us"]
        figures[f"topk.b{b}.speedup"] = figures[f"topk.b{b}.lax_us"] / figures[f"topk.b{b}.two_stage_us"]
    for r in args.sampler_rows:
        sampler_figures(figures, r, args.vocab, args.iters)
    results.print_table(figures)
    extra = {"vocab": args.vocab, "positions": args.positions, "k": args.k, "iters": args.iters,
             "sampler_rows": args.sampler_rows}
    print("wrote", results.write_result("topk", figures, results.script_command(__file__, argv), extra,
                                        out_dir=args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
