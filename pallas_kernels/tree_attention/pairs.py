"""Packed tree attention over fp8 pages read as uint16 pairs of e4m3 bytes: what op ``"tree_attention"``'s
``"pallas_triton"`` implementation runs for fp8 pages on CUDA
(:func:`pallas_kernels.tree_attention.tree_attention_pallas`).

The prefix loop is :mod:`pallas_kernels.paged_decode.pairs`'s: a page row of D channels is read as D / 2 uint16
(:func:`~pallas_kernels.paged_decode.pairs.pack_pairs`, a view of the same bytes), so the tiles are 16-bit, and
one inline-PTX step (:func:`~pallas_kernels.paged_decode.pairs.pair_halves`) turns each pair into the even and the
odd channel's f16 value. Scores are ``q_even . k_even + q_odd . k_odd`` (f16 dots, f32 accumulation, the key
scales on the f32 scores); the value scales go into the probabilities relative to the block's largest, since f16
has bf16's range only down to 6e-5, and the f32 output is kept in units of the last block's largest (the rescale
rides on the softmax's own, so a block costs no extra [M, D] multiply at M = 128 rows). q is read as f16 (the
scale and the key scales on the f32 scores), as there.

So the whole kernel works in halves: q, the tree's own K/V and the output are split into even / odd channels
outside the kernel (``[.., D] -> [.., 2, D / 2]``) and the output interleaved after it. The tree's K/V (bf16
scratch) are dotted in their own dtype, as in :mod:`pallas_kernels.tree_attention.kernel` (q's f16 halves cast
back to it: exact in f16's normal range), so their values need no f16 range. Rows, tiles, grid, partitions and
the merge are the library kernel's (:func:`~pallas_kernels.tree_attention.kernel.block_plan`); there is no hand
prefetch (quantized pages run without it there too). In interpret mode the pair conversion is jnp.

Compiled for sm_90a offline (``experiments/triton_offline.py --op tree_attention_pairs``; the 27B's heads, B16 x
16 nodes x 16K, the fp8 defaults: 128-row tile, 64-key blocks, 8 warps, 2 stages): the prefix loop is 1111 SASS
instructions a 64-key block with no spill in it, against 1306 (101 of them spill loads / stores) for the 8-bit
tile kernel on fp8 pages and 734 a 32-key block (164 spill) for bf16 pages; 255 registers in each, the spills
(448 / 344 B) outside the loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.paged_decode.kernel import (MASK_VALUE, N_SM_TARGET, kv_block_rows, merge_partitions,
                                                softmax_step)
from pallas_kernels.dot_acc import dot_acc
from pallas_kernels.paged_decode.pairs import pair_halves
from pallas_kernels.tree_attention.fp8 import products, row_scale, split_e4m3
from pallas_kernels.tree_attention.kernel import check_tree_args, kernel_statics, launch_plan, tree_pallas_call

DOTS = "float16"


def halves(x: jax.Array) -> jax.Array:
    """``[..., D]`` -> ``[..., 2, D / 2]``: the even channels, then the odd ones."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2).swapaxes(-1, -2)


def interleave(x: jax.Array) -> jax.Array:
    """:func:`halves`' inverse: ``[..., 2, D / 2]`` -> ``[..., D]``."""
    return x.swapaxes(-1, -2).reshape(*x.shape[:-2], 2 * x.shape[-1])


def prefix_block(carry, qe, qo, q8, k_ref, v_ref, ks_ref, vs_ref, pt_ref, blk, length, *, block_k: int,
                 page_size: int, scale_log2: float, interpret: bool):
    """One key block of the paged prefix. carry (oe, oo [M, D/2] f32: the output over ``unit``, m, l [M], unit
    f32); qe, qo [M, D/2] f16; k_ref, v_ref [n_pages * page_size, D/2] uint16 pairs and ks_ref, vs_ref
    [n_pages * page_size] f32 scales of one KV head. ``q8`` (keys as fp8 rows: k_ref [n_pages * page_size, D]
    e4m3): (q_hi, q_lo [M, D] e4m3, q_inv [M] f32) with q = (hi + lo) * q_inv
    (:func:`pallas_kernels.tree_attention.fp8.split_e4m3`); None: keys as pairs.

    The value scales enter the f16 probabilities relative to the block's largest (``top``); the output is kept in
    units of the last block's ``top``, so the change of unit joins the softmax's rescale ``alpha`` (a [M] multiply)
    instead of scaling the block's product (a [M, D] multiply)."""
    oe, oo, m, l, unit = carry
    r, visible = kv_block_rows(pt_ref, blk, length, block_k=block_k, page_size=page_size)
    if q8 is None:
        ke, ko = pair_halves(k_ref[r], DOTS, interpret)
        s = dot_acc(qo, ko, plt.dot(qe, ke, trans_b=True), trans_b=True)
    else:  # fp8 key rows straight from shared memory into e4m3 products with q's two e4m3 parts
        q_hi, q_lo, q_inv = q8
        s = products(q_hi, q_lo, k_ref[r], jnp.zeros((q_hi.shape[0], block_k), jnp.float32), trans_b=True)
        s = s * q_inv[:, None]
    alpha, p, m, l = softmax_step(m, l, s * (ks_ref[r] * scale_log2)[None, :], visible[None, :])
    vsc = vs_ref[r]
    top = jnp.max(jnp.where(visible, vsc, 0.0))
    top = jnp.where(top > 0, top, 1.0)
    pp = (p * (vsc / top)[None, :]).astype(DOTS)
    ve, vo = pair_halves(v_ref[r], DOTS, interpret)
    alpha = alpha * (unit / top)
    oe = dot_acc(pp, ve, alpha[:, None] * oe)
    oo = dot_acc(pp, vo, alpha[:, None] * oo)
    return oe, oo, m, l, top


def tree_block(carry, qe, qo, kt_ref, vt_ref, anc_ref, node, t, is_last, *, n_tree: int, block_t: int,
               scale_log2: float, precision):
    """Tree keys ``t * block_t ..`` under the ancestor mask. qe, qo [M, D/2] in the tree K/V's dtype; kt_ref,
    vt_ref [N, 2, D/2] (one sequence and KV head, in halves); anc_ref [N*N]; node [M] tree slot of each row."""
    oe, oo, m, l = carry
    col = t * block_t + jnp.arange(block_t, dtype=jnp.int32)
    colc = jnp.minimum(col, n_tree - 1)
    s = dot_acc(qo, kt_ref[colc, 1, :], plt.dot(qe, kt_ref[colc, 0, :], trans_b=True, precision=precision),
                trans_b=True, precision=precision) * scale_log2
    anc = anc_ref[node[:, None] * n_tree + colc[None, :]]
    visible = (anc != 0) & (col < n_tree)[None, :] & is_last
    alpha, p, m, l = softmax_step(m, l, s, visible)
    p = p.astype(vt_ref.dtype)
    oe = dot_acc(p, vt_ref[colc, 0, :], alpha[:, None] * oe, precision=precision)
    oo = dot_acc(p, vt_ref[colc, 1, :], alpha[:, None] * oo, precision=precision)
    return oe, oo, m, l


def _kernel(q_ref, *refs, n_tree: int, group: int, n_kv_heads: int, block_m: int, page_size: int, block_k: int,
            blocks_per_partition: int, n_splits: int, block_t: int, n_tree_tiles: int, scale_log2: float,
            interpret: bool, precision, fp8_keys: bool):
    # q_ref [N*H, 2, D/2] f16 (sequence b, rows i*H + h); k_ref, v_ref [n_pages*page_size, D/2] uint16 and ks_ref,
    # vs_ref [n_pages*page_size] (KV head j); kt_ref, vt_ref [N, 2, D/2] (sequence b, KV head j); pt_ref [W];
    # len_ref [1]; anc_ref [N*N] int32 (1 = key j visible to node i); outputs in halves, rows as q's. fp8_keys:
    # qh_ref, ql_ref [N*H, D] e4m3 and qi_ref [N*H] f32 after q_ref (fp8.split_e4m3), k_ref [n_pages*page_size, D]
    # e4m3
    qh_ref, ql_ref, qi_ref = refs[:3] if fp8_keys else (None, None, None)
    (k_ref, v_ref, ks_ref, vs_ref, kt_ref, vt_ref, pt_ref, len_ref, anc_ref, *out_refs) = refs[3:] if fp8_keys else refs
    tile, split, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head = c % n_kv_heads
    dh = q_ref.shape[-1]
    rr = jnp.minimum(tile * block_m + jnp.arange(block_m, dtype=jnp.int32), n_tree * group - 1)
    node = rr // group
    q_rows = node * (n_kv_heads * group) + kv_head * group + rr % group
    qe, qo = q_ref[q_rows, 0, :], q_ref[q_rows, 1, :]  # [BM, D/2]

    length = jnp.clip(len_ref[0], 0, pt_ref.shape[0] * page_size)
    first = split * blocks_per_partition
    n_iter = jnp.maximum(jnp.minimum(first + blocks_per_partition, (length + block_k - 1) // block_k) - first, 0)
    z = jnp.zeros((block_m, dh), jnp.float32)
    carry = (z, z, jnp.full((block_m,), MASK_VALUE, jnp.float32), jnp.zeros((block_m,), jnp.float32),
             jnp.float32(1.0))
    q8 = (qh_ref[q_rows], ql_ref[q_rows], qi_ref[q_rows]) if fp8_keys else None
    step = functools.partial(prefix_block, qe=qe, qo=qo, q8=q8, k_ref=k_ref, v_ref=v_ref, ks_ref=ks_ref, vs_ref=vs_ref,
                             pt_ref=pt_ref, length=length, block_k=block_k, page_size=page_size,
                             scale_log2=scale_log2, interpret=interpret)
    oe, oo, m, l, unit = lax.fori_loop(0, n_iter, lambda i, cr: step(cr, blk=first + i), carry)
    carry = (oe * unit, oo * unit, m, l)

    is_last = split == n_splits - 1  # the tree's own keys, in the last partition only
    tqe, tqo = qe.astype(kt_ref.dtype), qo.astype(kt_ref.dtype)
    for t in range(n_tree_tiles):
        carry = tree_block(carry, tqe, tqo, kt_ref, vt_ref, anc_ref, node, t, is_last, n_tree=n_tree,
                           block_t=block_t, scale_log2=scale_log2, precision=precision)

    oe, oo, m, l = carry
    has = l > 0
    inv = 1.0 / jnp.where(has, l, 1.0)
    o_ref = out_refs[0]
    if n_splits > 1:
        out_refs[1][q_rows] = jnp.where(has, m + jnp.log2(jnp.where(has, l, 1.0)), MASK_VALUE)
    o_ref[q_rows, 0, :] = (oe * inv[:, None]).astype(o_ref.dtype)
    o_ref[q_rows, 1, :] = (oo * inv[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_m", "pages_per_block", "num_partitions", "num_warps",
                                             "num_stages", "target_programs", "interpret", "smem_budget",
                                             "fp8_keys"))
def tree_attention_pairs(q: jax.Array, k_pairs: jax.Array, v_pairs: jax.Array, page_table: jax.Array,
                         start: jax.Array, k_tree: jax.Array, v_tree: jax.Array, ancestors: jax.Array, scale: float,
                         k_scale: jax.Array, v_scale: jax.Array, *, block_m: int, pages_per_block: int,
                         num_partitions: int | None = 1, num_warps: int | None = None, num_stages: int | None = None,
                         target_programs: int = 2 * N_SM_TARGET, interpret: bool = False,
                         smem_budget: int | None = None, fp8_keys: bool = False) -> jax.Array:
    """:func:`pallas_kernels.tree_attention.kernel.tree_attention` over fp8 pages given as uint16 pairs.

    q [B, N, H, D]; k_pairs, v_pairs [n_pages, page_size, Hkv, D/2] uint16 (``pack_pairs`` of fp8 e4m3 pages);
    page_table [B, W] int32 (entry < 0: non-resident page); start [B] prefix lengths; k_tree, v_tree
    [B, N, Hkv, D] (dotted in their dtype); ancestors [B, N, N] bool; k_scale, v_scale [n_pages, page_size, Hkv]
    f32 (the library kernel's argument order, with the scales last). Returns [B, N, H, D] in q's dtype; a row with
    no visible key is zero. block_m, pages_per_block, num_partitions, num_warps, num_stages, target_programs,
    smem_budget: as there. ``fp8_keys`` (opt-in, to time against): ``k_pairs`` is instead the fp8 key rows
    ``[n_pages, page_size, Hkv, D]`` e4m3, read straight into e4m3 tensor-core products with q's two e4m3 parts
    (:func:`pallas_kernels.tree_attention.fp8.split_e4m3`: ~bf16's 8 significant bits of q), so no key is
    converted or restaged in shared memory;
    values stay pairs. Raises ValueError before lowering for tiles Triton cannot take."""
    b, n, h, d = q.shape
    n_pages, page_size, hkv, dh = v_pairs.shape
    k_want = ((n_pages, page_size, hkv, d), jnp.float8_e4m3fn) if fp8_keys else (v_pairs.shape, jnp.uint16)
    if (k_pairs.shape, k_pairs.dtype) != k_want or 2 * dh != d or v_pairs.dtype != jnp.uint16:
        raise ValueError(f"tree_attention_pairs: q {q.shape}, k_pairs {k_pairs.shape} {k_pairs.dtype}, v_pairs "
                         f"{v_pairs.shape} {v_pairs.dtype} disagree (pairs are [n_pages, page_size, Hkv, D/2] uint16; "
                         "with fp8_keys the keys are [n_pages, page_size, Hkv, D] float8_e4m3fn)")
    if k_scale.shape != v_pairs.shape[:3] or v_scale.shape != k_scale.shape:
        raise ValueError(f"tree_attention_pairs: scales {k_scale.shape} / {v_scale.shape} vs pages {v_pairs.shape}")
    check_tree_args("tree_attention_pairs", q, hkv, k_tree, v_tree, ancestors, page_table, start)
    width = page_table.shape[1]
    num_warps, num_stages, plan = launch_plan(
        q, page_size=page_size, hkv=hkv, width=width, dtype=jnp.float8_e4m3fn, compute_dtype=jnp.dtype(DOTS),
        quantized=True, block_m=block_m, pages_per_block=pages_per_block, num_partitions=num_partitions,
        num_warps=num_warps, num_stages=num_stages, target_programs=target_programs, smem_budget=smem_budget)
    s, bm = plan["n_partitions"], plan["block_m"]
    rows = n_pages * page_size
    kernel = functools.partial(_kernel, **kernel_statics(plan, n=n, hkv=hkv, page_size=page_size, scale=scale,
                                                         dtype=k_tree.dtype), interpret=interpret, fp8_keys=fp8_keys)
    if fp8_keys:
        sq = row_scale(q.reshape(b, n * h, d))
        q8 = (*split_e4m3(q.reshape(b, n * h, d), sq[..., None]), 1.0 / sq)
    else:
        q8 = ()
    outs = tree_pallas_call(
        kernel, b=b, n=n, h=h, hkv=hkv, rows=rows, width=width, s=s, n_row_tiles=plan["n_row_tiles"],
        row_tail=(2, dh), page_tail=(dh,), n_scales=2, out_dtype=q.dtype, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, k_tail=(d,) if fp8_keys else None,
        extra_row_tails=((d,), (d,), ()) if fp8_keys else (),
        name=f"tree_attention_fp8_pairs_bm{bm}_d{d}_bk{plan['block_k']}_t{plan['n_tree_p']}_s{s}"
             f"{'_k8' if fp8_keys else ''}",
    )(halves(q.astype(DOTS)).reshape(b, n * h, 2, dh), *q8, k_pairs.reshape(rows, hkv, -1),
      v_pairs.reshape(rows, hkv, dh), k_scale.reshape(rows, hkv), v_scale.reshape(rows, hkv), halves(k_tree),
      halves(v_tree), page_table.astype(jnp.int32), start.astype(jnp.int32)[:, None],
      ancestors.astype(jnp.int32).reshape(b, n * n))

    o = interleave(outs[0])  # [B, (S,) N*H, D]
    o = merge_partitions(o, outs[1], axis=1) if s > 1 else o  # one partition is already normalised
    return o.reshape(b, n, h, d).astype(q.dtype)
