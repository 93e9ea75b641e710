"""Which part of a quantized KV page costs greedy agreement: keys or values, fp8 or int8, with attention-sink tokens
kept exact, with the keys Hadamard-rotated before they are rounded, with the keys centred, or with each key's
rounding error steered away from where the queries look.

Each variant round-trips the new keys and / or values through :func:`dflash_jax.kv.quant.quantize_rows` (the
rounding quantized pages apply) just before they are written to ordinary pages, so every attention path reads
them as a quantized page would, and the engine is otherwise the reference one. ``rot`` variants round
``H k`` (``H`` the orthonormal Hadamard matrix of the head size) and write ``H^T round(H k)``: the same scores as
rounding rotated keys and rotating the queries alike. ``centred`` variants write ``round(k - mu)``: ``mu [Hkv, D]``
a per-layer mean of the (rotated, normed) keys, calibrated on training-split text (``--calib-rows`` rows of this
interpreter's standard-library files outside the model set's held-out ones); every score of a query then moves by
the same ``q . mu``, which softmax ignores, so only the rounding changes (``none.centred`` checks that). ``gptq``
variants round a key one channel at a time and push each channel's error into the channels not yet rounded, so
as to minimise ``e^T M e`` (``M`` the mean ``q q^T`` of the queries that read that KV head, per layer, calibrated
on the same training rows) instead of ``|e|^2``: GPTQ's error feedback, applied to one key vector as it is written
(with ``rot``, in the rotated space, ``M`` becoming ``H M H^T``). The measure is ``bench quality``'s: the reference
engine's greedy continuations (``--agree-tokens`` after ``--agree-prefix``) teacher-forced through the variant, the
fraction of positions whose most likely token is the reference's.

Figures ``<variant>.greedy_agreement`` (and ``.greedy_agreement_positions``), written as
``kv_quant_parts_<device>_<yyyymmdd-hhmm>.json`` under ``--out-dir``.

    python experiments/kv_quant_parts.py                 # the shipped target, 64 rows: ~3 min on 2 CPU cores
    python experiments/kv_quant_parts.py --rows 2 --variants none k_fp8 --no-write   # smoke
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dflash_jax as dj  # noqa: E402
from dflash_jax.bench import quality, results  # noqa: E402
from dflash_jax.bench.acceptance import held_out_files, held_out_rows  # noqa: E402
from dflash_jax.kv import quant as kv_quant  # noqa: E402
from dflash_jax.kv.calibrate import training_files  # noqa: E402
from dflash_jax.kv.calibration import error_factors, hadamard  # noqa: E402
from dflash_jax.models import attention  # noqa: E402
from dflash_jax.models.tokenizer import Tokenizer  # noqa: E402

F8, I8 = jnp.float8_e4m3fn, jnp.int8


class Variant(NamedTuple):
    k_dtype: object  # key format (None: unrounded)
    v_dtype: object  # value format
    sink: int  # leading tokens kept exact
    rotate: bool  # keys Hadamard-rotated before rounding
    centre: bool  # keys centred
    weighted: bool  # query-weighted key rounding
    block: int = 1  # channels rounded together before their error is fed forward (1: channel by channel)


VARIANTS = {name: Variant(*v) for name, v in {
    "none": (None, None, 0, False, False, False),
    "k_fp8": (F8, None, 0, False, False, False),
    "v_fp8": (None, F8, 0, False, False, False),
    "kv_fp8": (F8, F8, 0, False, False, False),
    "kv_fp8.sink4": (F8, F8, 4, False, False, False),
    "kv_fp8.sink16": (F8, F8, 16, False, False, False),
    "k_fp8.rot": (F8, None, 0, True, False, False),
    "kv_fp8.rot": (F8, F8, 0, True, False, False),
    "k_int8.v_fp8": (I8, F8, 0, False, False, False),
    "kv_int8": (I8, I8, 0, False, False, False),
    "none.centred": (None, None, 0, False, True, False),
    "k_fp8.centred": (F8, None, 0, False, True, False),
    "kv_fp8.centred": (F8, F8, 0, False, True, False),
    "kv_fp8.centred.rot": (F8, F8, 0, True, True, False),
    "k_fp8.gptq": (F8, None, 0, False, False, True),
    "kv_fp8.gptq": (F8, F8, 0, False, False, True),
    "kv_fp8.centred.gptq": (F8, F8, 0, False, True, True),
    "k_int8.gptq": (I8, None, 0, False, False, True),
    "kv_fp8.centred.rot.gptq": (F8, F8, 0, True, True, True),
    **{f"kv_fp8.centred.rot.gptq{b}": (F8, F8, 0, True, True, True, b) for b in (8, 16, 32)},
}.items()}


def round_trip(x, dtype):
    """``x [..., D]`` rounded as a quantized page row of ``dtype`` stores it (None: unchanged), in x's dtype."""
    if dtype is None:
        return x
    return kv_quant.dequantize(*kv_quant.quantize_rows(x, dtype), x.dtype)


def round_trip_feedback(x, dtype, u):
    """``x [..., Hkv, D]`` rounded as quantized key pages with a key calibration round it
    (:func:`dflash_jax.kv.quant.quantize_rows_feedback`, the feedback of ``u``, the factor of
    :func:`dflash_jax.kv.calibration.error_factors`), read back in float32."""
    g = jnp.asarray(kv_quant.feedback_matrix(u))
    return kv_quant.dequantize(*kv_quant.quantize_rows_feedback(x, dtype, g), jnp.float32)


def blocked_feedback_matrix(u: np.ndarray, block: int) -> np.ndarray:
    """``G [..., D, D]`` for rounding ``block`` channels at once: the rows of block ``[a, a + block)`` hold
    ``U_bb^-1 U_b,rest`` after the block (GPTQ's block update), zero elsewhere; ``block`` 1 is
    :func:`dflash_jax.kv.quant.feedback_matrix`."""
    u = np.asarray(u, np.float64)
    d = u.shape[-1]
    g = np.zeros_like(u)
    for a in range(0, d - block, block):
        b = slice(a, a + block)
        g[..., b, a + block:] = np.linalg.solve(u[..., b, b], u[..., b, a + block:])
    return g.astype(np.float32)


def round_trip_blocked(x, dtype, g, block):
    """``x [..., Hkv, D]`` rounded ``block`` channels at a time (no feedback within a block; each block's error fed
    to the channels after it through ``g`` of :func:`blocked_feedback_matrix`), read back in x's dtype: the form
    a GPU could run in ``D / block`` matrix steps, measured against channel-by-channel feedback."""
    qmax = kv_quant.QMAX[jnp.dtype(dtype)]
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    w, d, ys = xf / scale, x.shape[-1], []
    for a in range(0, d, block):
        wb = jnp.clip(w[..., a:a + block], -qmax, qmax)
        yb = jnp.round(wb) if jnp.issubdtype(dtype, jnp.integer) else wb.astype(dtype).astype(jnp.float32)
        ys.append(yb)
        if a + block < d:
            w = w + jnp.einsum("...hb,hbd->...hd", yb - w[..., a:a + block], jnp.asarray(g)[:, a:a + block],
                               precision=jax.lax.Precision.HIGHEST)
    return (jnp.concatenate(ys, axis=-1) * scale).astype(x.dtype)


def key_means(n_layers: int, run) -> np.ndarray:
    """``[n_layers, Hkv, D]`` mean of the keys written by each attention layer while ``run()`` serves prompts (the
    layers write in order within every traced step, so the call count names the layer)."""
    plain, calls = attention.write_kv, itertools.count()
    sums: dict[int, np.ndarray] = {}
    counts = np.zeros(n_layers)

    def write(k_pages, v_pages, k, v, page_table, positions, valid, *rest):
        layer = next(calls) % n_layers

        def acc(kk, vv):
            kk, vv = np.asarray(kk, np.float64), np.asarray(vv, bool)
            sums[layer] = sums.get(layer, 0.0) + kk[vv].sum(0)
            counts[layer] += vv.sum()

        jax.debug.callback(acc, k.astype(jnp.float32).reshape((-1,) + k.shape[2:]), valid.reshape(-1))
        return plain(k_pages, v_pages, k, v, page_table, positions, valid, *rest)

    attention.write_kv = write
    try:
        run()
    finally:
        attention.write_kv = plain
    return np.stack([sums[i] / max(1.0, counts[i]) for i in range(n_layers)]).astype(np.float32)


def query_moments(n_layers: int, n_kv_heads: int, run) -> np.ndarray:
    """``[n_layers, Hkv, D, D]``: per attention layer and KV head, the mean over the tokens served while ``run()``
    runs of ``sum_g q_g q_g^T`` over the query heads ``g`` that read that KV head (rotated queries). A key's rounding
    error ``e`` moves those queries' scores by ``q_g . e``, whose mean square is ``e^T M e``."""
    plain_write, plain_attn = attention.write_kv, attention.paged_attention
    calls, last_valid = itertools.count(), []
    sums: dict[int, np.ndarray] = {}
    counts = np.zeros(n_layers)

    def write(k_pages, v_pages, k, v, page_table, positions, valid, *rest):
        last_valid[:] = [valid]
        return plain_write(k_pages, v_pages, k, v, page_table, positions, valid, *rest)

    def attend(q, k_pages, v_pages, page_table, q_positions, scale):
        layer = next(calls) % n_layers

        def acc(qq, vv):
            qq, vv = np.asarray(qq, np.float64)[np.asarray(vv, bool)], np.asarray(vv, bool)  # [n, H, D]
            qq = qq.reshape(len(qq), n_kv_heads, -1, qq.shape[-1])  # [n, Hkv, G, D]
            sums[layer] = sums.get(layer, 0.0) + np.einsum("njgd,njge->jde", qq, qq)
            counts[layer] += vv.sum()

        jax.debug.callback(acc, q.astype(jnp.float32).reshape((-1,) + q.shape[2:]), last_valid[0].reshape(-1))
        return plain_attn(q, k_pages, v_pages, page_table, q_positions, scale)

    attention.write_kv, attention.paged_attention = write, attend
    try:
        run()
    finally:
        attention.write_kv, attention.paged_attention = plain_write, plain_attn
    return np.stack([sums[i] / max(1.0, counts[i]) for i in range(n_layers)]).astype(np.float32)


def rounding_write_kv(variant: Variant, write_kv=attention.write_kv, mu: np.ndarray | None = None,
                      factors: np.ndarray | None = None):
    """``attention.write_kv`` that rounds new keys / values as ``variant`` says before writing them (``mu``
    ``[n_layers, Hkv, D]``: the key means of the centred variants; ``factors``: the query-weighted variants'
    :func:`dflash_jax.kv.calibration.error_factors` ``[n_layers, Hkv, D, D]`` of the query moments ``M`` and of the
    rotated ``H M H^T``)."""
    k_dtype, v_dtype, sink, rotate, centre, weighted, block = variant
    calls = itertools.count()

    def write(k_pages, v_pages, k, v, page_table, positions, valid, *rest):
        layer = next(calls)
        if centre:
            k = (k.astype(jnp.float32) - jnp.asarray(mu[layer % len(mu)])).astype(k.dtype)
        if weighted and rotate and k_dtype is not None:  # factors of the rotated moments H M H^T
            h = jnp.asarray(hadamard(k.shape[-1]))
            u = factors[1][layer % len(factors[1])]
            kr = k.astype(jnp.float32) @ h.T
            if block > 1:  # blocks of channels rounded at once, each block's error fed forward
                kr = round_trip_blocked(kr, k_dtype, blocked_feedback_matrix(u, block), block)
            else:
                kr = round_trip_feedback(kr, k_dtype, u)
            kq = (kr @ h).astype(k.dtype)
        elif weighted and k_dtype is not None:
            kq = round_trip_feedback(k, k_dtype, factors[0][layer % len(factors[0])]).astype(k.dtype)
        elif rotate and k_dtype is not None:
            h = jnp.asarray(hadamard(k.shape[-1]))
            kq = (round_trip(k.astype(jnp.float32) @ h.T, k_dtype) @ h).astype(k.dtype)
        else:
            kq = round_trip(k, k_dtype)
        vq = round_trip(v, v_dtype)
        if sink:
            exact = (positions < sink)[..., None, None]
            kq, vq = jnp.where(exact, k, kq), jnp.where(exact, v, vq)
        return write_kv(k_pages, v_pages, kq, vq, page_table, positions, valid, *rest)

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
    p.add_argument("--calib-rows", type=int, default=16, help="training-split rows the centred variants' means use")
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
    mu = factors = None
    n_attn = len(target.config.attn_layers)
    if any(VARIANTS[n].centre or VARIANTS[n].weighted for n in a.variants):
        calib = held_out_rows(tok, training_files(a.model), a.calib_rows, a.row_len)
        figures["calib_rows"] = int(len(calib))

        def calib_run():
            quality.continuations(quality._engine(target, tok, max_len, None), calib, a.row_len - 1, 1)

        if any(VARIANTS[n].centre for n in a.variants):
            mu = key_means(n_attn, calib_run)
            figures["key_mean_norm"] = float(np.linalg.norm(mu, axis=-1).mean())  # the keys' own norm: sqrt(D)
        if any(VARIANTS[n].weighted for n in a.variants):
            moments = query_moments(n_attn, target.config.num_kv_heads, calib_run)
            h = hadamard(moments.shape[-1]).astype(np.float64)
            factors = (error_factors(moments), error_factors(h @ moments @ h.T))
    plain = attention.write_kv
    try:
        for name in a.variants:
            attention.write_kv = rounding_write_kv(VARIANTS[name], plain, mu, factors)
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
