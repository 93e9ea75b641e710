"""``python -m dflash_jax.bench linear``: one 27B-shaped matmul weight, bf16 vs fp8, at small batch.

For each weight shape (the 27B's MLP gate/up and down, GDN qkv and out, attention q) and batch B, a jitted step
applies ``qwen36.linear`` to ``--copies`` distinct weights of that shape (so the weights stream from HBM, not
L2) and sums the outputs. Variants: ``bf16`` (dense), ``fp8`` (per-output-channel scales, the on-the-fly
format), ``fp8_block128`` (128x128 block scales, the layout of Qwen's FP8 checkpoints) and ``fp8_pallas`` (the
per-channel format through the Pallas kernel ``pallas_kernels.fp8_matmul``). Figures per variant:
``{variant}.{shape}.b{B}.us`` (microseconds per matrix) and ``.gbps`` (weight bytes read per second), and
``fp8_speedup.{shape}.b{B}`` = bf16 time / fp8 time.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from dflash_jax.bench import results
from dflash_jax.bench.timing import median_seconds
from dflash_jax.models import quant, qwen36

SHAPES = {"mlp_gate": (17408, 5120), "mlp_down": (5120, 17408), "gdn_qkv": (10240, 5120),
          "gdn_out": (5120, 6144), "attn_q": (12288, 5120), "tiny": (128, 512)}  # tiny: a CPU smoke test
VARIANTS = ("bf16", "fp8", "fp8_block128", "fp8_pallas")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=[n for n in SHAPES if n != "tiny"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--copies", type=int, default=16, help="distinct weights per step (defeats caching)")
    p.add_argument("--iters", type=int, default=20)


def _weights(variant: str, shape: tuple[int, int], copies: int):
    out = []
    for i in range(copies):
        w = (jax.random.normal(jax.random.key(i), shape, jnp.float32) * shape[1] ** -0.5).astype(jnp.bfloat16)
        if variant in ("fp8", "fp8_pallas"):
            w = quant.quantize_fp8(w)
        elif variant == "fp8_block128":
            w = quant.quantize_fp8(w, (128, 128))
        out.append(w)
    return out


def _time(fn, ws, x, iters: int) -> float:
    return median_seconds(lambda: fn(ws, x), iters)


def _step(ws, x):
    return sum(qwen36.linear(x, w).astype(jnp.float32) for w in ws)


def _pallas_step(ws, x):
    from pallas_kernels.fp8_matmul import fp8_matmul_pallas

    return sum(fp8_matmul_pallas(x, w.data, w.scale) for w in ws)


def run(args: argparse.Namespace, command: str) -> int:
    fns = {v: jax.jit(_pallas_step if v == "fp8_pallas" else _step) for v in VARIANTS}
    figures: dict[str, float] = {}
    errors: dict[str, str] = {}
    for name in args.shapes:
        shape = SHAPES[name]
        for v in args.variants:
            ws = _weights(v, shape, args.copies)
            nbytes = sum(w.nbytes for w in ws)
            for b in args.batch:
                x = jax.random.normal(jax.random.key(99), (b, shape[1]), jnp.float32).astype(jnp.bfloat16)
                try:
                    sec = _time(fns[v], ws, x, args.iters)
                except Exception as e:  # noqa: BLE001 - an uncompiled kernel must not cost the other figures
                    if v != "fp8_pallas":
                        raise
                    errors[f"{v}.{name}.b{b}"] = f"{type(e).__name__}: {e}"[:2000]
                    print(f"{v} {name} B={b} failed: {errors[f'{v}.{name}.b{b}'][:300]}", flush=True)
                    continue
                figures[f"{v}.{name}.b{b}.us"] = 1e6 * sec / args.copies
                figures[f"{v}.{name}.b{b}.gbps"] = nbytes / sec / 1e9
                print(f"{v:>13} {name:>9} B={b:<3} {1e6 * sec / args.copies:8.1f} us/matrix "
                      f"{nbytes / sec / 1e9:7.0f} GB/s", flush=True)
            del ws
        for b in args.batch:
            if "bf16" in args.variants and "fp8" in args.variants:
                figures[f"fp8_speedup.{name}.b{b}"] = figures[f"bf16.{name}.b{b}.us"] / figures[f"fp8.{name}.b{b}.us"]
            for v in ("fp8_block128", "fp8_pallas"):
                if "bf16" in args.variants and f"{v}.{name}.b{b}.us" in figures:
                    figures[f"{v}_speedup.{name}.b{b}"] = figures[f"bf16.{name}.b{b}.us"] / figures[f"{v}.{name}.b{b}.us"]
    results.print_table(figures)
    if not args.no_write:
        extra = {"shapes": {n: SHAPES[n] for n in args.shapes}, "batches": args.batch, "copies": args.copies,
                 "iters": args.iters, "device": str(jax.devices()[0]), "errors": errors}
        print("wrote", results.write_result("linear", figures, command, extra, out_dir=args.out_dir))
    return 0
