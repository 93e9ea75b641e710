"""Paged decode attention over fp8 pages read as uint16 pairs of e4m3 bytes: what op ``"paged_decode"``'s
``"pallas_triton"`` implementation runs for fp8 pages on CUDA (:func:`pallas_kernels.paged_decode.paged_decode_pallas`).

Why: the library kernel (:mod:`pallas_kernels.paged_decode.kernel`) reads fp8 rows as 8-bit tiles, which Triton moves
from shared memory with scalar loads and address arithmetic and converts e4m3 -> f16 -> bf16 (a quarter-rate ``F2F``
per value): ~900 SASS instructions a 64-key block against bf16 pages' ~280 a 32-key block (the same bytes;
``experiments/triton_offline.py``). Here a page row of D channels is read as D / 2 uint16, each two adjacent
channels (:func:`pack_pairs`: a view of the same bytes), so the tiles are 16-bit and reach the MMA operands by
``ldmatrix``; an inline-PTX step turns each pair into the even and the odd channel's value. Scores are
``q_even . k_even + q_odd . k_odd`` (two dots), the output is kept as even / odd halves and interleaved after the
kernel. ``dots``: ``"float16"`` (one ``cvt.rn.f16x2.e4m3x2`` per two values; the value scales go into the
probabilities relative to the block's largest, since f16 has bf16's range only down to 6e-5, and that scale
multiplies the f32 product) or ``"bfloat16"`` (each byte's bits placed into a bf16: the value times 2^-120, exact,
no conversion unit; 2^60 back on each side of the dots, so q and the probabilities stay bf16). On an H100
(``experiments/paged_decode_fp8_pairs.py``, two runs, B16 x 16K / B1 x 16K / B16 x 4K / B1 x 4K): f16 dots
334, 267 / 32.5, 36.5 / 95.2, 93.1 / 15.2 us against the 8-bit tile kernel's 369, 355 / 38.7, 41.8 / 136, 133 /
17.0 (bf16 pages 421-426 / 59 / 175 / 17.0); the pages viewed as pairs inside the call timed as pre-packed ones
(289.6 / 37.3 / 92.0 / 14.2), so XLA:GPU keeps the view a bitcast; the 27B at C16 x 4K with fp8 pages: 721 vs 704
tok/s. The f16 dots are the default (faster at B16 x 16K: 267-334 vs 316-326 us).

Grid, partitions and the flash-decoding merge are the library kernel's (:func:`block_plan`,
:func:`merge_partitions`); in interpret mode the pair conversion is jnp (bitcast to e4m3, cast).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.paged_decode.kernel import (LOG2E, MASK_VALUE, block_plan, group_rows, kv_block_rows,
                                                merge_partitions)

DOTS = ("float16", "bfloat16")

# $1: two uint16 elements in one register (bytes b0 b1 | b2 b3). float16: permuted to (b0 b2 | b1 b3), then the
# even channels' pair (b0, b2) or the odd channels' (b1, b3) converted to f16x2. bfloat16: each byte of the pair
# placed in the high byte of a 16-bit half (prmt: even 0x2404, odd 0x3414), its 7 magnitude bits shifted to the
# bf16 exponent's low bits and mantissa, the sign kept: the bf16 equals the e4m3 value times 2^-120, subnormals
# too (exact; no conversion unit), which OFFSET undoes on both dots.
_PAIR_ASM = {
    "float16": ("{ .reg .b32 t; .reg .b16 lo, hi;\n prmt.b32 t, $1, 0, 0x3120;\n mov.b32 {lo, hi}, t;\n"
                " cvt.rn.f16x2.e4m3x2 $0, %s;\n}", ("lo", "hi")),
    "bfloat16": ("{ .reg .b32 y, s;\n prmt.b32 y, $1, 0, %s;\n shr.b32 s, y, 4;\n and.b32 s, s, 0x07F007F0;\n"
                 " and.b32 y, y, 0x80008000;\n or.b32 $0, s, y;\n}", ("0x2404", "0x3414")),
}
OFFSET = 2.0 ** 60  # bfloat16 pairs read as value * 2^-120: 2^60 goes on each side of a dot


def pack_pairs(data: jax.Array) -> jax.Array:
    """fp8 rows ``[..., D]`` -> ``[..., D / 2]`` uint16, channel ``2j`` in the low byte. XLA:GPU keeps it a view of
    the same bytes inside a step (H100: the kernel over viewed pages timed as over pre-packed ones); XLA:CPU
    expands it into shifts over the whole array, a copy (interpret-mode tests only)."""
    return lax.bitcast_convert_type(data.reshape(*data.shape[:-1], data.shape[-1] // 2, 2), jnp.uint16)


def pair_halves(u: jax.Array, dots: str, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """``u [.., n]`` uint16 -> (even, odd) channel values in ``dots`` (float16: the values; bfloat16: the values
    times 2^-120); inline PTX on the GPU, jnp in interpret mode."""
    if not interpret:
        asm, args = _PAIR_ASM[dots]
        shape = [jax.ShapeDtypeStruct(u.shape, jnp.dtype(dots))]
        return tuple(plt.elementwise_inline_asm(asm % arg, args=[u], constraints="=r,r", pack=2,
                                                result_shape_dtypes=shape)[0] for arg in args)
    unit = 1.0 if dots == "float16" else 2.0 ** -120

    def value(byte):
        x = lax.bitcast_convert_type(byte.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
        return (x * unit).astype(dots)

    return value(u & 0xFF), value(u >> 8)


def _kernel(qe_ref, qo_ref, k_ref, v_ref, ks_ref, vs_ref, pt_ref, len_ref, o_ref, *lse_ref, page_size: int,
            block_k: int, blocks_per_partition: int, scale_log2: float, dots: str, interpret: bool):
    # qe_ref, qo_ref [G, D/2] f16 (even / odd channels); k_ref, v_ref [rows, D/2] uint16; ks_ref, vs_ref [rows];
    # lse_ref [G] only with partitions to merge
    part = pl.program_id(2)
    g, dh = qe_ref.shape
    rows = group_rows(g)
    length = jnp.clip(len_ref[0], 0, pt_ref.shape[0] * page_size)
    first = part * blocks_per_partition
    n_iter = jnp.maximum(jnp.minimum(first + blocks_per_partition, (length + block_k - 1) // block_k) - first, 0)
    qe, qo = qe_ref[rows], qo_ref[rows]

    def body(i, carry):
        oe, oo, m, l = carry
        r, visible = kv_block_rows(pt_ref, first + i, length, block_k=block_k, page_size=page_size)
        ke, ko = pair_halves(k_ref[r], dots, interpret)
        s = plt.dot(qe, ke, trans_b=True) + plt.dot(qo, ko, trans_b=True)
        unit = 1.0 if dots == "float16" else OFFSET * OFFSET
        s = jnp.where(visible[None, :], s * (ks_ref[r] * (scale_log2 * unit))[None, :], MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(visible[None, :], jnp.exp2(s - m_new[:, None]), 0.0)
        l = alpha * l + p.sum(axis=-1)
        vsc = vs_ref[r]
        if dots == "float16":  # f16 has bf16's range only down to 6e-5: scales relative to the block's largest
            top = jnp.max(jnp.where(visible, vsc, 0.0))
            top = jnp.where(top > 0, top, 1.0)
            vsc = vsc / top
        else:  # the outputs are kept 2^60 too small (alpha and the products are linear in them): undone at the end
            top, vsc = 1.0, vsc * OFFSET
        pp = (p * vsc[None, :]).astype(dots)
        ve, vo = pair_halves(v_ref[r], dots, interpret)
        pve, pvo = plt.dot(pp, ve), plt.dot(pp, vo)
        oe = alpha[:, None] * oe + (pve if dots == "bfloat16" else pve * top)
        oo = alpha[:, None] * oo + (pvo if dots == "bfloat16" else pvo * top)
        return oe, oo, m_new, l

    z = jnp.zeros((qe.shape[0], dh), jnp.float32)
    oe, oo, m, l = lax.fori_loop(0, n_iter, body, (z, z, jnp.full((qe.shape[0],), MASK_VALUE, jnp.float32),
                                                   jnp.zeros((qe.shape[0],), jnp.float32)))
    has = l > 0
    inv = (1.0 if dots == "float16" else OFFSET) / jnp.where(has, l, 1.0)
    o_ref[rows, 0, :] = (oe * inv[:, None]).astype(o_ref.dtype)
    o_ref[rows, 1, :] = (oo * inv[:, None]).astype(o_ref.dtype)
    if lse_ref:
        lse_ref[0][rows] = jnp.where(has, m + jnp.log2(jnp.where(has, l, 1.0)), MASK_VALUE)


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "num_partitions", "num_warps", "num_stages",
                                             "dots", "interpret"))
def paged_decode_pairs(q, k_pairs, v_pairs, page_table, lengths, scale: float, k_scale, v_scale, *,
                       pages_per_block: int = 4, num_partitions: int | None = None, num_warps: int = 8,
                       num_stages: int = 2, dots: str = "float16", interpret: bool = False) -> jax.Array:
    """q [B, H, D]; k_pairs, v_pairs [n_pages, page_size, Hkv, D/2] uint16 (:func:`pack_pairs` of fp8 pages);
    page_table [B, W]; lengths [B]; k_scale, v_scale [n_pages, page_size, Hkv] f32 -> [B, H, D] in q's dtype
    (the library kernel's argument order, with the scales last). ``dots``: float16 (the e4m3 -> f16 conversion
    instruction; value scales relative to each block's largest) or bfloat16 (bit placement, no conversion
    unit; q and the probabilities stay bf16)."""
    if dots not in _PAIR_ASM:
        raise ValueError(f"dots={dots!r}: float16 or bfloat16")
    b, h, d = q.shape
    n_pages, page_size, hkv, dh = k_pairs.shape
    plan = block_plan(batch=b, n_heads=h, n_kv_heads=hkv, head_dim=d, page_size=page_size,
                      width=page_table.shape[1], dtype=jnp.float8_e4m3fn, pages_per_block=pages_per_block,
                      num_partitions=num_partitions, num_stages=num_stages, compute_dtype=jnp.dtype(dots))
    g, s = plan["g"], plan["n_partitions"]
    rows = n_pages * page_size
    qg = q.astype(dots).reshape(b, hkv, g, dh, 2)
    kernel = functools.partial(_kernel, page_size=page_size, block_k=plan["block_k"],
                               blocks_per_partition=plan["blocks_per_partition"], scale_log2=float(scale) * LOG2E,
                               dots=dots, interpret=interpret)
    q_spec = pl.BlockSpec((None, None, g, dh), lambda i, j, p: (i, j, 0, 0))
    row_spec = pl.BlockSpec((rows, None, dh), lambda i, j, p: (0, j, 0))
    scale_spec = pl.BlockSpec((rows, None), lambda i, j, p: (0, j))
    split = s > 1
    outs = pl.pallas_call(
        kernel, grid=(b, hkv, s),
        in_specs=[q_spec, q_spec, row_spec, row_spec, scale_spec, scale_spec,
                  pl.BlockSpec((None, page_table.shape[1]), lambda i, j, p: (i, 0)),
                  pl.BlockSpec((None, 1), lambda i, j, p: (i, 0))],
        out_specs=[pl.BlockSpec((None, None, None, g, 2, dh), lambda i, j, p: (i, j, p, 0, 0, 0))]
        + [pl.BlockSpec((None, None, None, g), lambda i, j, p: (i, j, p, 0))] * split,
        out_shape=[jax.ShapeDtypeStruct((b, hkv, s, g, 2, dh), q.dtype)]
        + [jax.ShapeDtypeStruct((b, hkv, s, g), jnp.float32)] * split,
        interpret=interpret, compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_decode_fp8_pairs_{dots}_bk{plan['block_k']}_s{s}",
    )(qg[..., 0], qg[..., 1], k_pairs.reshape(rows, hkv, dh), v_pairs.reshape(rows, hkv, dh),
      k_scale.reshape(rows, hkv), v_scale.reshape(rows, hkv), page_table.astype(jnp.int32),
      lengths.astype(jnp.int32)[:, None])
    o = outs[0].swapaxes(-1, -2).reshape(b, hkv, s, g, d)  # even / odd halves -> channels
    o = merge_partitions(o, outs[1], axis=2) if split else o[:, :, 0]  # one partition is already normalised
    return o.reshape(b, h, d).astype(q.dtype)

