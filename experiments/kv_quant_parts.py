"""Which part of a quantized KV page costs greedy agreement: keys or values, fp8 or int8, with attention-sink tokens
kept exact, or with the keys Hadamard-rotated before they are rounded.

Each variant round-trips the new keys and / or values through :func:`dflash_jax.kv.quant.quantize_rows` (the
rounding quantized pages apply) just before they are written to ordinary pages, so every attention path reads
them as a quantized page would, and the engine is otherwise the reference one. ``rot`` variants round
``H k`` (``H`` the orthonormal Hadamard matrix of the head size) and write ``H^T round(H k)``: the same scores as
rounding rotated keys and rotating the queries alike. The measure is ``bench quality``'s: the reference engine's
greedy continuations (``--agree-tokens`` after ``--agree-prefix``) teacher-forced through the variant, the fraction
of positions whose most likely token is the reference's.

Figures ``<variant>.greedy_agreement`` (and ``.greedy_agreement_positions``), written as
``kv_quant_parts_<device>_<yyyymmdd-hhmm>.json`` under ``--out-dir``.

    python experiments/kv_quant_parts.py                 # the shipped target, 64 rows: ~3 min on 2 CPU cores
    python experiments/kv_quant_parts.py --rows 2 --variants none k_fp8 --no-write   # smoke
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dflash_jax as dj  # noqa: E402
from dflash_jax.bench import quality, results  # noqa: E402
from dflash_jax.bench.acceptance import held_out_files, held_out_rows  # noqa: E402
from dflash_jax.kv import quant as kv_quant  # noqa: E402
from dflash_jax.models import attention  # noqa: E402
from dflash_jax.models.tokenizer import Tokenizer  # noqa: E402

F8, I8 = jnp.float8_e4m3fn, jnp.int8
# name -> (key format, value format, leading tokens kept exact, rotate keys)
VARIANTS = {
    "none": (None, None, 0, False),
    "k_fp8": (F8, None, 0, False),
    "v_fp8": (None, F8, 0, False),
    "kv_fp8": (F8, F8, 0, False),
    "kv_fp8.sink4": (F8, F8, 4, False),
    "kv_fp8.sink16": (F8, F8, 16, False),
    "k_fp8.rot": (F8, None, 0, True),
    "kv_fp8.rot": (F8, F8, 0, True),
    "k_int8.v_fp8": (I8, F8, 0, False),
    "kv_int8": (I8, I8, 0, False),
}


def hadamard(n: int) -> jnp.ndarray:
    """The orthonormal Sylvester-Hadamard matrix ``[n, n]`` (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head size, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return jnp.asarray(h / np.sqrt(n), jnp.float32)


def round_trip(x, dtype):
    """``x [..., D]`` rounded as a quantized page row of ``dtype`` stores it (None: unchanged), in x's dtype."""
    if dtype is None:
        return x
    return kv_quant.dequantize(*kv_quant.quantize_rows(x, dtype), x.dtype)


def rounding_write_kv(variant: tuple, write_kv=attention.write_kv):
    """``attention.write_kv`` that rounds new keys / values as ``variant`` says before writing them."""
    k_dtype, v_dtype, sink, rotate = variant

    def write(k_pages, v_pages, k, v, page_table, positions, valid):
        if rotate and k_dtype is not None:
            h = hadamard(k.shape[-1])
            kq = (round_trip(k.astype(jnp.float32) @ h.T, k_dtype) @ h).astype(k.dtype)
        else:
            kq = round_trip(k, k_dtype)
        vq = round_trip(v, v_dtype)
        if sink:
            exact = (positions < sink)[..., None, None]
            kq, vq = jnp.where(exact, k, kq), jnp.where(exact, v, vq)
        return write_kv(k_pages, v_pages, kq, vq, page_table, positions, valid)

    return write


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(dj.SHIPPED_MODELS, "target"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--row-len", type=int, default=512)
    p.add_argument("--agree-prefix", type=int, default=256)
    p.add_argument("--agree-tokens", type=int, default=64)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--out-dir", default="experiments/results")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)

    tok = Tokenizer.from_dir(a.model)
    rows = held_out_rows(tok, held_out_files(a.model, None), a.rows, a.row_len)
    target = dj.load_target(a.model, dtype=a.dtype)
    target.fuse_projections()
    max_len = -(-(max(a.row_len, a.agree_prefix + a.agree_tokens) + 32) // 64) * 64
    reference = quality.continuations(quality._engine(target, tok, max_len, None), rows, a.agree_prefix,
                                      a.agree_tokens)
    figures: dict[str, float] = {"rows": int(len(rows))}
    plain = attention.write_kv
    try:
        for name in a.variants:
            attention.write_kv = rounding_write_kv(VARIANTS[name], plain)
            frac, n = quality.agreement(quality._engine(target, tok, max_len, None), reference, a.agree_prefix)
            figures[f"{name}.greedy_agreement"], figures[f"{name}.greedy_agreement_positions"] = frac, n
            print(f"{name:14s} greedy agreement {frac:.4f} of {n}", flush=True)
    finally:
        attention.write_kv = plain
    if not a.no_write:
        command = "python experiments/kv_quant_parts.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        print("wrote", results.write_result("kv_quant_parts", figures, command.strip(),
                                            {"model": a.model, "dtype": a.dtype, "agree_prefix": a.agree_prefix,
                                             "agree_tokens": a.agree_tokens}, out_dir=a.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
