"""``python -m dflash_jax.bench linear``: one 27B-shaped matmul weight at decode batch, XLA vs the Pallas skinny
matmul, bf16 vs fp8 / int8 / int4.

For each weight shape (the 27B's MLP gate/up and down, GDN qkv and out, attention q) and batch B, a jitted step
multiplies ``--copies`` distinct weights of that shape (so the weights stream from HBM, not L2) and sums the
outputs. Variants: ``bf16`` (dense, XLA), ``bf16_pallas`` (dense through ``pallas_kernels.skinny_matmul``),
``fp8`` (per-output-channel scales, the on-the-fly format, XLA's fused convert + dot), ``fp8_dynamic`` (the
same weights with the activations quantized per token to e4m3: an fp8 x fp8 dot), ``fp8_block128``
(128x128 block scales, the layout of Qwen's FP8 checkpoints, XLA), ``fp8_pallas`` (per-channel through the
Pallas kernel), ``int8`` (Q8_0 blocks: a scale per 32 inputs, XLA: per-block partial sums at decode batch) and
``int4`` (packed Q4_0 blocks: two 4-bit values per byte and a float16 scale per 32 inputs, unpacked inside the
jitted matmul; ``.gbps`` counts the packed bytes, so it reaches the copy bandwidth only if XLA fuses the unpack
into the dot). The XLA variants run ``qwen36.linear`` with the ``skinny_matmul`` op held at its reference, the
Pallas ones call the kernel with its ``default_config`` (the ``gemv`` form at batches <= 4). Figures per variant:
``{variant}.{shape}.b{B}.us`` (microseconds per matrix) and ``.gbps`` (weight bytes read per second), and ``{variant}_speedup.{shape}.b{B}``
= bf16 time / variant time (``fp8_speedup`` for ``fp8``).

``--sweep`` also times each Pallas variant over a pruned launch grid (:data:`SWEEP_GRID`: form (``gemv`` at
batches <= 4, ``dot``), block_n, block_k, split_k (None = auto), num_warps, num_stages; configs failing the
static tile check or resolving to a config already timed are skipped) per shape and batch, with ``--sweep-copies`` weights; each (variant, shape, batch)
sweep gets an even share of what is left of ``--budget-s`` (the whole command's wall-time target, 170 s: the
default config is always timed first, the rest in :data:`SWEEP_GRID` order until the share is spent). It records
``{variant}.{shape}.b{B}.best_us`` / ``.best_gbps`` / ``.best_speedup`` (bf16 XLA time / best), and in the
JSON's extra ``best_configs`` (the winning config, split_k resolved) and ``sweep`` (every timed config).
Failures of a Pallas launch are recorded under ``errors``, never fatal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import jax
import jax.numpy as jnp

from dflash_jax.bench import results
from dflash_jax.bench.timing import median_seconds
from dflash_jax.models import quant, qwen36
from pallas_kernels import registry
from pallas_kernels import skinny_matmul as sm

SHAPES = {"mlp_gate": (17408, 5120), "mlp_down": (5120, 17408), "gdn_qkv": (10240, 5120),
          "gdn_out": (5120, 6144), "attn_q": (12288, 5120), "tiny": (128, 512)}  # tiny: a CPU smoke test
VARIANTS = ("bf16", "bf16_pallas", "fp8", "fp8_dynamic", "fp8_block128", "fp8_pallas", "int8", "int4")
PALLAS = ("bf16_pallas", "fp8_pallas")
# (form, block_n, block_k, split_k (None: auto), num_warps, num_stages). "gemv" (batches <= sm.GEMV_MAX_M; the
# static check skips it above): tile widths around the default's one 128-bit load per thread, then warps and
# pipeline depth. "dot": pruned from block_n 32/64/128 x block_k 128/256/512 x split_k auto/1/2/4/8 x warps 4/8 x
# stages 2/3/4 to 16, most telling first (a sweep cut short by its time share keeps those): the split-K
# extremes, the tile sizes at 3 stages, then deeper / shallower pipelines.
SWEEP_GRID = (
    ("gemv", 16, 512, None, 4, 2), ("gemv", 32, 512, None, 4, 2), ("gemv", 64, 512, None, 4, 2),
    ("gemv", 32, 1024, None, 4, 2), ("gemv", 32, 512, None, 8, 2), ("gemv", 32, 512, None, 4, 3),
    ("gemv", 32, 512, None, 4, 1), ("gemv", 16, 1024, None, 4, 2), ("gemv", 32, 256, None, 4, 3),
    ("gemv", 32, 512, 1, 4, 2), ("gemv", 32, 512, 8, 4, 2), ("gemv", 64, 256, None, 8, 2),
    ("dot", 64, 256, None, 4, 3), ("dot", 64, 256, 1, 4, 3), ("dot", 64, 512, None, 4, 2),
    ("dot", 128, 256, None, 8, 3), ("dot", 32, 256, None, 4, 3), ("dot", 64, 256, 8, 4, 3),
    ("dot", 64, 128, None, 4, 4), ("dot", 64, 512, None, 8, 3), ("dot", 64, 256, 2, 4, 3),
    ("dot", 64, 256, 4, 4, 3), ("dot", 32, 512, None, 4, 3), ("dot", 128, 512, None, 8, 2),
    ("dot", 64, 256, None, 8, 4), ("dot", 32, 128, None, 4, 4), ("dot", 128, 128, None, 8, 4),
    ("dot", 32, 256, None, 4, 4),
)
CONFIG_KEYS = ("form", "block_n", "block_k", "split_k", "num_warps", "num_stages")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=[n for n in SHAPES if n != "tiny"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--copies", type=int, default=16, help="distinct weights per step (defeats caching)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="time the Pallas variants over SWEEP_GRID per shape/batch")
    p.add_argument("--sweep-copies", type=int, default=4, help="distinct weights per step in the sweep")
    p.add_argument("--budget-s", type=float, default=170.0,
                   help="with --sweep: wall-time target of the whole command; each (variant, shape, batch) sweep gets "
                        "an even share of what is left (its default config is always timed)")


def _weights(variant: str, shape: tuple[int, int], copies: int):
    out = []
    for i in range(copies):
        w = (jax.random.normal(jax.random.key(i), shape, jnp.float32) * shape[1] ** -0.5).astype(jnp.bfloat16)
        if variant in ("fp8", "fp8_pallas"):
            w = quant.quantize_fp8(w)
        elif variant == "fp8_dynamic":
            w = quant.quantize_fp8(w, act="fp8")
        elif variant == "fp8_block128":
            w = quant.quantize_fp8(w, (128, 128))
        elif variant == "int8":
            w = quant.quantize_int8(w)
        elif variant == "int4":
            w = quant.quantize_int4(w)
        out.append(w)
    return out


@contextlib.contextmanager
def _xla_linear():
    """``qwen36.linear`` traced with the ``skinny_matmul`` op held at its reference (XLA's dot), whatever
    ``DFLASH_KERNELS`` says for it."""
    old = os.environ.get(registry.ENV_VAR)
    ov = registry.parse_overrides(old)
    ov["skinny_matmul"] = "reference"
    os.environ[registry.ENV_VAR] = ",".join(f"{k}={v}" for k, v in ov.items())
    try:
        yield
    finally:
        if old is None:
            del os.environ[registry.ENV_VAR]
        else:
            os.environ[registry.ENV_VAR] = old


@jax.jit
def _xla_step(ws, x):
    return sum(qwen36.linear(x, w).astype(jnp.float32) for w in ws)


def _pallas_one(x, w, cfg: dict):
    if quant.is_quantized(w):
        return sm.skinny_matmul_pallas(x, w.data, w.scale, **cfg)
    return sm.skinny_matmul_pallas(x, w, None, **cfg)


@jax.jit(static_argnames=("cfg",))
def _pallas_step(ws, x, cfg: tuple = ()):
    return sum(_pallas_one(x, w, dict(cfg)) for w in ws)


def _resolved(shape: tuple[int, int], b: int, w_dtype, cfg: dict) -> dict:
    """``cfg`` with split_k resolved (ValueError when it fails the static tile check)."""
    n, k = shape
    plan = sm.block_plan(b, n, k, x_dtype=jnp.bfloat16, w_dtype=w_dtype, block_n=cfg["block_n"],
                         block_k=cfg["block_k"], split_k=cfg["split_k"], num_stages=cfg["num_stages"],
                         form=cfg["form"])
    return {**cfg, "split_k": plan["split_k"]}


def _w_dtype(variant: str):
    return jnp.float8_e4m3fn if variant.startswith("fp8") else jnp.bfloat16


def _time(variant: str, ws, x, iters: int, cfg: dict | None = None) -> float:
    if variant in PALLAS:
        frozen = tuple(sorted((cfg or {}).items()))
        return median_seconds(lambda: _pallas_step(ws, x, cfg=frozen), iters)
    with _xla_linear():
        return median_seconds(lambda: _xla_step(ws, x), iters)


def _sweep(variant: str, name: str, ws, b: int, iters: int, budget_s: float, figures: dict, extra: dict,
           errors: dict) -> None:
    shape = SHAPES[name]
    key = f"{variant}.{name}.b{b}"
    x = jax.random.normal(jax.random.key(99), (b, shape[1]), jnp.float32).astype(jnp.bfloat16)
    nbytes = sum(w.nbytes for w in ws)
    default = sm.default_config(*shape, b, _w_dtype(variant))
    cands = ([default] if default else []) + [dict(zip(CONFIG_KEYS, c)) for c in SWEEP_GRID]
    seen, timed = set(), []
    t0 = time.perf_counter()
    for cfg in cands:
        if timed and time.perf_counter() - t0 > budget_s:
            extra["sweep_truncated"].append(key)
            break
        try:
            cfg = _resolved(shape, b, _w_dtype(variant), cfg)
        except ValueError:
            continue  # fails the static tile check (or does not divide the shape)
        if tuple(cfg.values()) in seen:
            continue
        seen.add(tuple(cfg.values()))
        try:
            sec = _time(variant, ws, x, iters, cfg) / len(ws)
        except Exception as e:  # noqa: BLE001 - one launch failing must not cost the sweep
            errors[f"{key}.{'_'.join(str(v) for v in cfg.values())}"] = f"{type(e).__name__}: {e}"[:500]
            continue
        timed.append({**cfg, "us": 1e6 * sec})
    extra["sweep"][key] = timed
    if not timed:
        return
    best = min(timed, key=lambda r: r["us"])
    figures[f"{key}.best_us"] = best["us"]
    figures[f"{key}.best_gbps"] = nbytes / len(ws) / (best["us"] * 1e-6) / 1e9
    extra["best_configs"][key] = {k: best[k] for k in CONFIG_KEYS}
    print(f"{variant:>13} {name:>9} B={b:<3} best {best['us']:8.1f} us/matrix "
          f"{figures[f'{key}.best_gbps']:7.0f} GB/s  {extra['best_configs'][key]}  ({len(timed)} configs)",
          flush=True)


def run(args: argparse.Namespace, command: str) -> int:
    figures: dict[str, float] = {}
    errors: dict[str, str] = {}
    extra: dict = {"sweep": {}, "best_configs": {}, "sweep_truncated": []}
    sweeps = [v for v in args.variants if v in PALLAS] if args.sweep else []
    n_sweeps = len(sweeps) * len(args.shapes) * len(args.batch)
    t_start = time.perf_counter()
    for name in args.shapes:
        shape = SHAPES[name]
        for v in args.variants:
            ws = _weights(v, shape, args.copies)
            nbytes = sum(w.nbytes for w in ws)
            for b in args.batch:
                x = jax.random.normal(jax.random.key(99), (b, shape[1]), jnp.float32).astype(jnp.bfloat16)
                try:
                    sec = _time(v, ws, x, args.iters)
                except Exception as e:  # noqa: BLE001 - an uncompiled kernel must not cost the other figures
                    if v not in PALLAS:
                        raise
                    errors[f"{v}.{name}.b{b}"] = f"{type(e).__name__}: {e}"[:2000]
                    print(f"{v} {name} B={b} failed: {errors[f'{v}.{name}.b{b}'][:300]}", flush=True)
                    continue
                figures[f"{v}.{name}.b{b}.us"] = 1e6 * sec / args.copies
                figures[f"{v}.{name}.b{b}.gbps"] = nbytes / sec / 1e9
                print(f"{v:>13} {name:>9} B={b:<3} {1e6 * sec / args.copies:8.1f} us/matrix "
                      f"{nbytes / sec / 1e9:7.0f} GB/s", flush=True)
            if v in sweeps:
                ws = ws[:args.sweep_copies]
                for b in args.batch:
                    left = args.budget_s - (time.perf_counter() - t_start)
                    _sweep(v, name, ws, b, args.iters, max(0.0, left) / n_sweeps, figures, extra, errors)
                    n_sweeps -= 1
            del ws
        for b in args.batch:
            base = figures.get(f"bf16.{name}.b{b}.us")
            if base is None:
                continue
            for v in VARIANTS[1:]:
                sp = "fp8_speedup" if v == "fp8" else f"{v}_speedup"
                if f"{v}.{name}.b{b}.us" in figures:
                    figures[f"{sp}.{name}.b{b}"] = base / figures[f"{v}.{name}.b{b}.us"]
                if f"{v}.{name}.b{b}.best_us" in figures:
                    figures[f"{v}.{name}.b{b}.best_speedup"] = base / figures[f"{v}.{name}.b{b}.best_us"]
    results.print_table(figures)
    print(f"linear: {time.perf_counter() - t_start:.0f} s", flush=True)
    if not args.no_write:
        extra.update({"shapes": {n: SHAPES[n] for n in args.shapes}, "batches": args.batch, "copies": args.copies,
                      "sweep_copies": args.sweep_copies, "iters": args.iters, "device": str(jax.devices()[0]),
                      "errors": errors, "wall_s": time.perf_counter() - t_start})
        if not args.sweep:
            for k in ("sweep", "best_configs", "sweep_truncated"):
                extra.pop(k)
        print("wrote", results.write_result("linear", figures, command, extra, out_dir=args.out_dir))
    return 0
