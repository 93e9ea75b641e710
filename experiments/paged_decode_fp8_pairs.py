"""Prototype: paged decode over fp8 pages stored as uint16 pairs of e4m3 bytes, dots in float16.

Why (``experiments/triton_offline.py``, sm_90a, B16 x 16K, the 27B's heads): the library kernel reads fp8 rows as
8-bit tensors, which Triton moves from shared memory with scalar ``LDS`` and address arithmetic and converts
e4m3 -> f16 -> bf16 (``F2F``, a quarter-rate unit): 898 SASS instructions a 64-key block against bf16 pages' 277 a
32-key block (the same bytes), 3.2x the instructions a byte. Here a page row is ``D / 2`` uint16, each two
adjacent channels: the tiles are 16-bit, so they reach the MMA operands by ``ldmatrix``, and a two-instruction
inline-PTX step (a byte permute, then ``cvt.rn.f16x2.e4m3x2``) turns a pair of them into the even channels'
f16 pair and the odd channels'. Scores are ``q_even . k_even + q_odd . k_odd`` (two dots), outputs are kept as
even / odd halves and interleaved after the kernel. Value scales go into the probabilities relative to the
block's largest (f16 has bf16's range only down to 6e-5), and that largest scale multiplies the f32 product:
465 loop instructions a 64-key block, no ``F2F``. ``dots="bfloat16"`` instead places each byte's bits into a bf16
(the value times 2^-120, exact, no conversion unit; 2^60 back on each side of the dots), so q and the
probabilities stay bf16 and no block-wide maximum (a cross-warp reduction a block) is taken: 590 instructions.
(The f16 dots of d5a62c0 over the 8-bit tiles were timed slower than the bf16 path in session 27, 406 vs 311 us
at B16 x 16K, though they drop the ``F2F`` too: one suspect is that block-wide maximum; both variants are timed.)

Not in the engine: the pool would have to be stored as uint16 pairs, since XLA copies a whole fp8 array to view
it as uint16 (a size-changing ``bitcast_convert_type`` is expanded into shifts), which the engine's writes,
gathers and KVFlash copies would then have to follow. This file times it against the library kernel first.

    PYTHONPATH=. python experiments/paged_decode_fp8_pairs.py --check                 # CPU: interpret mode vs reference
    PYTHONPATH=. python experiments/paged_decode_fp8_pairs.py --out-dir $OUT          # GPU: both variants vs the library
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.paged_decode.kernel import (LOG2E, MASK_VALUE, block_plan, group_rows, kv_block_rows,
                                                merge_partitions)

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
    """fp8 rows ``[..., D]`` -> ``[..., D / 2]`` uint16, channel ``2j`` in the low byte (a copy: do it once)."""
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


def _kernel(qe_ref, qo_ref, k_ref, v_ref, ks_ref, vs_ref, pt_ref, len_ref, o_ref, lse_ref, *, page_size: int,
            block_k: int, blocks_per_partition: int, scale_log2: float, dots: str, interpret: bool):
    # qe_ref, qo_ref [G, D/2] f16 (even / odd channels); k_ref, v_ref [rows, D/2] uint16; ks_ref, vs_ref [rows]
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
    lse_ref[rows] = jnp.where(has, m + jnp.log2(jnp.where(has, l, 1.0)), MASK_VALUE)


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
    o, lse = pl.pallas_call(
        kernel, grid=(b, hkv, s),
        in_specs=[q_spec, q_spec, row_spec, row_spec, scale_spec, scale_spec,
                  pl.BlockSpec((None, page_table.shape[1]), lambda i, j, p: (i, 0)),
                  pl.BlockSpec((None, 1), lambda i, j, p: (i, 0))],
        out_specs=[pl.BlockSpec((None, None, None, g, 2, dh), lambda i, j, p: (i, j, p, 0, 0, 0)),
                   pl.BlockSpec((None, None, None, g), lambda i, j, p: (i, j, p, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, s, g, 2, dh), q.dtype),
                   jax.ShapeDtypeStruct((b, hkv, s, g), jnp.float32)],
        interpret=interpret, compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_decode_fp8_pairs_{dots}_bk{plan['block_k']}_s{s}",
    )(qg[..., 0], qg[..., 1], k_pairs.reshape(rows, hkv, dh), v_pairs.reshape(rows, hkv, dh),
      k_scale.reshape(rows, hkv), v_scale.reshape(rows, hkv), page_table.astype(jnp.int32),
      lengths.astype(jnp.int32)[:, None])
    o = o.swapaxes(-1, -2).reshape(b, hkv, s, g, d)  # even / odd halves -> channels
    return merge_partitions(o, lse, axis=2).reshape(b, h, d).astype(q.dtype)


DOTS = ("float16", "bfloat16")


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from dflash_jax.bench import kernels as bk
    from dflash_jax.bench import results
    from pallas_kernels.paged_decode import paged_decode_reference
    from pallas_kernels.registry import GPU_BACKENDS, current_backend

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare with the reference (small shapes)")
    p.add_argument("--cases", nargs="+", default=["16:16384", "1:16384", "16:4096"], help="batch:prefix")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", default="experiments/results")
    a = p.parse_args(argv)
    interpret = current_backend() not in GPU_BACKENDS
    rng = np.random.default_rng(0)
    figures = {}
    cases = [(3, [40, 1, 100])] if a.check else [(int(c.split(":")[0]), [int(c.split(":")[1])] * int(c.split(":")[0]))
                                                for c in a.cases]
    for b, lengths in cases:
        prob = bk.decode_problem(rng, jax.random.PRNGKey(0), b, 24, 4, 256, 16, lengths, jnp.bfloat16, n_sets=2)
        fp8 = bk.quantized_problem(prob, "fp8")
        q, k, v, pt, ln, sc = fp8.args
        kp, vp = pack_pairs(k.data), pack_pairs(v.data)
        ref = paged_decode_reference(q, k, v, pt, ln, sc).astype(jnp.float32)
        tag = f"paged_decode.b{b}.p{max(lengths)}"
        for dots in DOTS:
            out = paged_decode_pairs(q, kp, vp, pt, ln, sc, k.scale, v.scale, dots=dots,
                                     interpret=interpret).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(out - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))
            figures[f"{tag}.pairs_{dots}.rel_err"] = err
            print(f"{tag}: pairs in {dots}, rel err vs reference {err:.2e}", flush=True)
            if err > 2e-2:
                return 1
        if a.check:
            continue
        pallas_fn = bk.implementations("paged_decode")[0]
        pairs = bk.Problem((q, kp, vp, pt, ln, sc, k.scale, v.scale), fp8.tables, 0, fp8.nbytes)  # table at 3
        times = {"bf16": bk.time_call(pallas_fn, prob, a.repeats), "fp8": bk.time_call(pallas_fn, fp8, a.repeats)}
        for dots in DOTS:
            fn = functools.partial(paged_decode_pairs, dots=dots, interpret=interpret)
            times[f"pairs_{dots}"] = bk.time_call(fn, pairs, a.repeats)

        def viewed(q, k, v, pt, ln, sc):  # fp8 pages in, viewed as pairs inside the jitted call
            return paged_decode_pairs(q, pack_pairs(k.data), pack_pairs(v.data), pt, ln, sc, k.scale, v.scale,
                                      dots="float16", interpret=interpret)

        times["pairs_float16_viewed"] = bk.time_call(viewed, fp8, a.repeats)
        # the process's first timing can run on a cold GPU: bf16 pages again last, the faster one is the baseline
        times["bf16"] = min(times["bf16"], bk.time_call(pallas_fn, prob, a.repeats))
        for name, t in times.items():
            figures[f"{tag}.{name}_us"] = t * 1e6
            if name != "bf16":
                figures[f"{tag}.{name}.speedup"] = times["bf16"] / t
        print(f"{tag}: " + ", ".join(f"{n} {t * 1e6:.1f} us ({times['bf16'] / t:.2f}x)" for n, t in times.items()),
              flush=True)
    if not a.check:  # is viewing fp8 pages as uint16 a copy on this backend? (XLA:CPU expands it into shifts;
        # ``pairs_float16_viewed`` above times the view inside the timed call, next to the pre-packed pages)
        big = jnp.zeros((4096, 16, 4, 256), jnp.float8_e4m3fn)
        packed = jax.jit(pack_pairs).lower(big).compile()
        text = packed.as_text()
        figures["pack_pairs.hlo_has_fusion"] = float("fusion" in text)
        jax.block_until_ready(packed(big))
        import time

        t0 = time.perf_counter()
        for _ in range(10):
            out = packed(big)
        jax.block_until_ready(out)
        figures["pack_pairs.us_per_64MiB"] = (time.perf_counter() - t0) / 10 * 1e6
        print(f"pack_pairs over 64 MiB: fusion in HLO {bool(figures['pack_pairs.hlo_has_fusion'])}, "
              f"{figures['pack_pairs.us_per_64MiB']:.1f} us", flush=True)
        command = "PYTHONPATH=. python experiments/paged_decode_fp8_pairs.py " + " ".join(
            argv if argv is not None else sys.argv[1:])
        print("wrote", results.write_result("paged_decode_fp8_pairs", figures, command, out_dir=a.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
