"""Op ``key_round`` on the current device: the Pallas kernel against the reference (equality and time; both
against a NumPy channel loop, and the reference's loop rounding by the fp8 cast instead), at the
27B's attention shapes (Hkv 4, D 256) for decode (N = batch rows) and a prefill chunk. Figures
``key_round.n{N}.{impl}_us`` and ``key_round.n{N}.max_diff``, JSON under ``--out-dir``.

    PYTHONPATH=. python experiments/key_round_gpu.py [--sweep] --out-dir experiments/results
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench import results
from dflash_jax.kv import calibration as kvc
from dflash_jax.kv import quant as kvq
from pallas_kernels import registry
from pallas_kernels.key_round import grid_round, key_round_pallas


def _time(fn, *args, iters: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e6


def cast_reference(w: jax.Array, g: jax.Array, dtype) -> jax.Array:
    """The reference's loop rounding by the f32 -> fp8 -> f32 cast (``grid_round``) instead of arithmetic: whether
    the backend keeps that convert pair."""
    def step(i, carry):
        w, y = carry
        wi = jax.lax.dynamic_index_in_dim(w, i, axis=-1, keepdims=False)
        yi = grid_round(wi, dtype)
        w = w + (yi - wi)[..., None] * jax.lax.dynamic_index_in_dim(g, i, axis=1, keepdims=False)[None]
        return w, jax.lax.dynamic_update_index_in_dim(y, yi, i, axis=-1)

    return jax.lax.fori_loop(0, w.shape[-1], step, (w, jnp.zeros_like(w)))[1]


def numpy_oracle(w: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The reference's arithmetic in NumPy float32 (the fp8 cast through ml_dtypes)."""
    import ml_dtypes

    w = w.astype(np.float32).copy()
    y = np.zeros_like(w)
    for i in range(w.shape[-1]):
        wi = np.clip(w[..., i], -448, 448)
        yi = wi.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        y[..., i] = yi
        w = w + (yi - w[..., i])[..., None] * g[None, :, i, :]
    return y


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 2048])
    p.add_argument("--hkv", type=int, default=4)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--sweep", action="store_true",
                   help="also time the kernel's launch configs (block_n x block_d x num_warps) at each N, each checked "
                        "against the reference")
    p.add_argument("--budget-s", type=float, default=150.0, help="start no sweep launch after this many seconds")
    p.add_argument("--out-dir", default="experiments/results")
    a = p.parse_args(argv)
    deadline = time.perf_counter() + a.budget_s
    rng = np.random.default_rng(0)
    m = rng.normal(size=(a.hkv, a.d, a.d)) * np.linspace(0.05, 1, a.d) ** 3
    m = np.einsum("hij,hkj->hik", m, m) + 0.01 * np.eye(a.d)
    g = jnp.asarray(kvq.feedback_matrix(kvc.error_factors(m)))
    figures: dict[str, float] = {}
    for n in a.rows:
        w = jnp.asarray(rng.normal(size=(n, a.hkv, a.d)) * 100, jnp.float32)
        outs = {}
        for impl in ("reference", "pallas_triton", "reference_cast"):
            f = cast_reference if impl == "reference_cast" else registry.get("key_round", impl=impl)
            fn = jax.jit(lambda w, g, f=f: f(w, g, jnp.float8_e4m3fn))
            try:
                outs[impl] = np.asarray(fn(w, g))
                figures[f"key_round.n{n}.{impl}_us"] = _time(fn, w, g, iters=5 if impl == "reference" else 50)
            except Exception as e:  # noqa: BLE001
                print(f"n={n} {impl}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
        if n <= 64:  # a NumPy channel loop decides which implementation is off
            oracle = numpy_oracle(np.asarray(w), np.asarray(g))
            for impl, y in outs.items():
                figures[f"key_round.n{n}.{impl}.oracle_mismatch_fraction"] = float(np.mean(y != oracle))
            if n == 1:
                print("w[0,0,:6]", np.asarray(w)[0, 0, :6], "oracle", oracle[0, 0, :6],
                      {k: v[0, 0, :6] for k, v in outs.items()}, flush=True)
        if "reference" in outs and "pallas_triton" in outs:
            figures[f"key_round.n{n}.max_diff"] = float(np.abs(outs["reference"] - outs["pallas_triton"]).max())
            figures[f"key_round.n{n}.mismatch_fraction"] = float(np.mean(outs["reference"] != outs["pallas_triton"]))
        if a.sweep and "reference" in outs and n <= 64:  # decode-sized N: one launch's latency
            best = None
            for bn in (1, 2, 4, 8, 16):
                for bd in (32, 64, 128, 256):
                    for nw in (1, 2, 4):
                        if bn > n or bd > a.d or bn * bd < 32 * nw or time.perf_counter() > deadline:
                            continue
                        fn = jax.jit(functools.partial(key_round_pallas, dtype=jnp.float8_e4m3fn, block_n=bn,
                                                       block_d=bd, num_warps=nw))
                        try:
                            ok = bool(np.array_equal(np.asarray(fn(w, g)), outs["reference"]))
                            t = _time(fn, w, g, iters=20)
                        except Exception as e:  # noqa: BLE001
                            print(f"n={n} bn{bn} bd{bd} w{nw}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                            continue
                        figures[f"key_round.n{n}.bn{bn}.bd{bd}.w{nw}_us"] = t
                        figures[f"key_round.n{n}.bn{bn}.bd{bd}.w{nw}.equal"] = int(ok)
                        if ok and (best is None or t < best[0]):
                            best = (t, bn, bd, nw)
            if best:
                print(f"n={n} best: {best[0]:.1f} us at block_n {best[1]}, block_d {best[2]}, {best[3]} warps",
                      flush=True)
                figures[f"key_round.n{n}.best_us"] = best[0]
        print(n, {k: v for k, v in figures.items() if f".n{n}." in k and ".bn" not in k}, flush=True)
    print("wrote", results.write_result("key_round", figures, "python experiments/key_round_gpu.py " +
                                        " ".join(sys.argv[1:]), {"hkv": a.hkv, "d": a.d}, out_dir=a.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
