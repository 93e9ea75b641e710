"""Where the chunked gated-delta-rule kernel's time goes: the XLA reference, the kernel's chunk-local pass (XLA
batched matmuls) alone, and the whole kernel (chunk-local + the Pallas state pass) over launch configs and dot
precisions, at the 27B's GDN shapes (48 value heads x 128) by default.

Figures, per batch ``b<B>`` and input dtype (``f32`` / ``bf16``), all at ``--tokens`` tokens:
``<dt>.b<B>.reference_ms``, ``<dt>.b<B>.local.<precision>_ms`` (the chunk-local pass),
``<dt>.b<B>.kernel.<config>_ms`` with ``.rel_err`` (max |kernel - reference| / max |reference|, output and state),
and ``<dt>.b<B>.best_speedup`` (reference over the fastest kernel config within tolerance). Written as
``gdn_chunked_parts_<device>_<yyyymmdd-hhmm>.json`` under ``--out-dir``.

    python experiments/gdn_chunked_parts.py                      # an H200: ~2 min
    python experiments/gdn_chunked_parts.py --tokens 96 --heads 2 --dim 32 --batches 1 --iters 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash_jax.bench.kernels import TOL, _rel_err, gdn_problem  # noqa: E402
from dflash_jax.bench.timing import median_seconds  # noqa: E402
from dflash_jax.models.gdn import gdn_chunked_reference  # noqa: E402
from pallas_kernels.gdn import kernel as gk  # noqa: E402

# (name, kernel keyword arguments); the dtype's default precision unless named
CONFIGS = [
    ("default", {}),
    ("bv64.w4", dict(block_v=64, num_warps=4)),
    ("bv32.w8", dict(block_v=32, num_warps=8)),
    ("bv64.w8", dict(block_v=64, num_warps=8)),
    ("bv16.w4", dict(block_v=16, num_warps=4)),
    ("bv16.w2", dict(block_v=16, num_warps=2)),
    ("c32.bv32.w4", dict(chunk=32, block_v=32, num_warps=4)),
    ("c32.bv64.w4", dict(chunk=32, block_v=64, num_warps=4)),
    ("bv128.w8", dict(block_v=128, num_warps=8)),
    ("c32.bv128.w8", dict(chunk=32, block_v=128, num_warps=8)),
    ("st2", dict(num_stages=2)),
]
F32_EXTRA = [("tf32x3", dict(precision="tf32x3")),
             ("tf32x3.c32", dict(chunk=32, block_v=32, num_warps=4, precision="tf32x3")),
             ("tf32x3.bv32.w8", dict(block_v=32, num_warps=8, precision="tf32x3")),
             ("tf32x3.c32.bv64", dict(chunk=32, block_v=64, num_warps=4, precision="tf32x3")),
             ("bf16ops", dict(precision="bf16"))]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=48)
    p.add_argument("--dim", type=int, default=128, help="key and value head dim")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"))
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--configs", nargs="+", default=None, help="config names to time (default: all)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop timing after this many seconds (what was measured is still written)")
    p.add_argument("--out-dir", default="experiments/results")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    known = [name for name, _ in CONFIGS + F32_EXTRA]
    unknown = sorted(set(args.configs or ()) - set(known))
    if unknown:
        p.error(f"unknown --configs {unknown}; choose from {known}")
    return args


def measure(args: argparse.Namespace) -> dict[str, float]:
    deadline = time.perf_counter() + (args.budget_s if args.budget_s is not None else float("inf"))
    interpret = jax.default_backend() == "cpu"
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    figures: dict[str, float] = {}
    for dt in args.dtypes:
        short = "f32" if dt == "float32" else "bf16"
        for b in args.batches:
            tag = f"{short}.b{b}"
            prob = gdn_problem(jax.random.key(b), b, args.tokens, args.heads, args.dim, args.dim,
                               dtype=jnp.dtype(dt))
            a = prob.args
            ref_fn = jax.jit(gdn_chunked_reference)
            ref = jax.block_until_ready(ref_fn(*a))
            figures[f"{tag}.reference_ms"] = 1e3 * median_seconds(lambda: ref_fn(*a), args.iters)
            precisions = [gk.default_precision(a[0].dtype)] + (["bf16"] if dt == "float32" else [])
            for prec in precisions:
                local = jax.jit(lambda q, k, v, beta, g, prec=prec: gk.chunk_local(
                    q, k, v, beta, g, chunk=64, precision=prec))
                figures[f"{tag}.local.{prec}_ms"] = 1e3 * median_seconds(
                    lambda: local(*a[:5]), args.iters)  # T a multiple of 64 at the default sizes
            best = None
            configs = CONFIGS + (F32_EXTRA if dt == "float32" else [])
            for name, cfg in configs:
                if (cfg.get("precision") == "tf32x3" and not on_gpu) or (args.configs and name not in args.configs):
                    continue
                if time.perf_counter() > deadline:
                    figures[f"{tag}.kernel.{name}.skipped"] = 1
                    continue
                fn = lambda cfg=cfg: gk.gdn_chunked(*a, interpret=interpret, **cfg)  # noqa: E731
                try:
                    out = jax.block_until_ready(fn())
                except Exception as e:  # a config the compiler refuses: recorded, the sweep goes on
                    print(f"{tag} {name}: {type(e).__name__}: {str(e)[:200]}")
                    figures[f"{tag}.kernel.{name}.failed"] = 1
                    continue
                err = max(_rel_err(o, r) for o, r in zip(out, ref))
                ms = 1e3 * median_seconds(fn, args.iters)
                figures[f"{tag}.kernel.{name}_ms"] = ms
                figures[f"{tag}.kernel.{name}.rel_err"] = err
                print(f"{tag} {name:14s} {ms:10.3f} ms  rel_err {err:.2e}", flush=True)
                if err <= TOL[dt] and (best is None or ms < best):
                    best = ms
            if best is not None:
                figures[f"{tag}.best_speedup"] = figures[f"{tag}.reference_ms"] / best
            print(f"{tag} reference {figures[f'{tag}.reference_ms']:.3f} ms", flush=True)
    return figures


def main(argv=None) -> dict[str, float]:
    args = parse(argv)
    figures = measure(args)
    if not args.no_write:
        from dflash_jax.bench.results import script_command, settings, write_result

        command = script_command(__file__, argv)
        extra = {"settings": settings(args),
                 "device": str(jax.devices()[0])}
        print("wrote", write_result("gdn_chunked_parts", figures, command, extra, out_dir=args.out_dir))
    return figures


if __name__ == "__main__":
    main()
