"""Packed tree attention over fp8 pages with e4m3 tensor-core products on both sides (opt-in, to time against the
pair kernel, :mod:`pallas_kernels.tree_attention.pairs`).

The pages' e4m3 rows go from shared memory straight into Hopper's fp8 MMA: no key or value is converted or staged
again. The other operand of each product is split into two e4m3 parts, ``x ~ hi + lo`` (:func:`split_e4m3`: each
row scaled so its largest magnitude is 224, ``hi`` its e4m3 rounding, ``lo`` the residual's), which together keep
about bf16's 8 significant bits, and both parts are multiplied, accumulating into one f32 tile
(:func:`pallas_kernels.dot_acc.dot_acc`). So the products cost what one f16 product costs (fp8 runs at twice the
rate) and the numbers stay those of bf16 q and probabilities against the fp8 pages:

- scores: ``q . k = (hi . k + lo . k) / sq`` per row (q split once per program), times the key scale;
- values: ``p v`` with ``p' = p * value scale * 224 / top`` (``top`` the block's largest value scale, as in the pair
  kernel) split per block, the output kept in units of the last block's ``224 / top`` (the change rides on the
  softmax's rescale).

Hopper's fp8 MMA sums in a narrower accumulator; each product adds at most 128 of its terms there before Triton adds
them into the f32 tile (``max_num_imprecise_acc``: without it Triton will not use the fp8 MMA for an f32 result).
The tree's own K/V (bf16 scratch) are dotted in bf16 as in the library kernel. Rows, tiles, grid, partitions and the
merge are the library kernel's (:func:`~pallas_kernels.tree_attention.kernel.block_plan`,
:func:`~pallas_kernels.tree_attention.kernel.tree_pallas_call`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.dot_acc import dot_acc
from pallas_kernels.paged_decode.kernel import (MASK_VALUE, N_SM_TARGET, kv_block_rows, merge_partitions,
                                                softmax_step)
from pallas_kernels.tree_attention.kernel import check_tree_args, kernel_statics, launch_plan, tree_pallas_call

E4M3 = jnp.float8_e4m3fn
TOP = 224.0  # the largest magnitude a row is scaled to before its e4m3 split (e4m3's largest is 448)
CHUNK = 128  # products an fp8 MMA may sum in its own accumulator (DeepSeek-V3's promotion interval)


def split_e4m3(x: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x * scale`` ``[..., K]`` as two e4m3 parts (hi, lo) with ``hi + lo ~ x * scale`` to about 8 significant
    bits of the row's largest: ``hi`` the e4m3 rounding, ``lo`` the residual's (below 2^-4 of hi, so e4m3's own
    4 bits cover it; what falls under e4m3's smallest step, 2^-9, is below 2^-16 of the row's largest)."""
    y = x.astype(jnp.float32) * scale
    hi = y.astype(E4M3)
    return hi, (y - hi.astype(jnp.float32)).astype(E4M3)


def row_scale(x: jax.Array) -> jax.Array:
    """``[M, K]`` -> ``[M]`` f32: what brings each row's largest magnitude to 224 (1 for a zero row)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    return jnp.where(amax > 0, TOP / jnp.where(amax > 0, amax, 1.0), 1.0)


def products(hi, lo, b, acc, *, trans_b: bool = False):
    """``acc + (hi + lo) @ b`` by two e4m3 tensor-core products."""
    acc = dot_acc(hi, b, acc, trans_b=trans_b, imprecise_acc=CHUNK)
    return dot_acc(lo, b, acc, trans_b=trans_b, imprecise_acc=CHUNK)


def prefix_block(carry, q_hi, q_lo, q_inv, k_ref, v_ref, ks_ref, vs_ref, pt_ref, blk, length, *, block_k: int,
                 page_size: int, scale_log2: float):
    """One key block of the paged prefix. carry (o [M, D] f32 in units of ``1 / unit``, m, l [M], unit, this
    block's value rows [block_k, D] e4m3); q_hi, q_lo [M, D] e4m3 and q_inv [M] (q = (hi + lo) * q_inv); k_ref,
    v_ref [n_pages * page_size, D] e4m3 and ks_ref, vs_ref [n_pages * page_size] f32 of one KV head."""
    o, m, l, unit, v = carry
    r, visible = kv_block_rows(pt_ref, blk, length, block_k=block_k, page_size=page_size)
    r_next, _ = kv_block_rows(pt_ref, blk + 1, length, block_k=block_k, page_size=page_size)
    v_next = v_ref[r_next]  # the next block's values, a block ahead (see _kernel)
    s = products(q_hi, q_lo, k_ref[r], jnp.zeros((q_hi.shape[0], block_k), jnp.float32), trans_b=True)
    s = s * q_inv[:, None] * (ks_ref[r] * scale_log2)[None, :]
    alpha, p, m, l = softmax_step(m, l, s, visible[None, :])
    vsc = vs_ref[r]
    top = jnp.max(jnp.where(visible, vsc, 0.0))
    new_unit = TOP / jnp.where(top > 0, top, 1.0)  # p * vsc <= top: p * vsc * new_unit <= 224
    p_hi, p_lo = split_e4m3(p * vsc[None, :], new_unit)
    o = products(p_hi, p_lo, v, (alpha * (new_unit / unit))[:, None] * o)
    return o, m, l, new_unit, v_next


def _kernel(q_ref, k_ref, v_ref, ks_ref, vs_ref, kt_ref, vt_ref, pt_ref, len_ref, anc_ref, *out_refs, n_tree: int,
            group: int, n_kv_heads: int, block_m: int, page_size: int, block_k: int, blocks_per_partition: int,
            n_splits: int, block_t: int, n_tree_tiles: int, scale_log2: float, precision):
    # q_ref [N*H, D] (sequence b, rows i*H + h); k_ref, v_ref [n_pages*page_size, D] e4m3 and ks_ref, vs_ref
    # [n_pages*page_size] (KV head j); kt_ref, vt_ref [N, D] (sequence b, KV head j); pt_ref [W]; len_ref [1];
    # anc_ref [N*N] int32 (1 = key j visible to node i); outputs rows as q's
    tile, split, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head = c % n_kv_heads
    d = q_ref.shape[-1]
    rr = jnp.minimum(tile * block_m + jnp.arange(block_m, dtype=jnp.int32), n_tree * group - 1)
    node = rr // group
    q_rows = node * (n_kv_heads * group) + kv_head * group + rr % group
    q = q_ref[q_rows]  # [BM, D]
    sq = row_scale(q)
    q_hi, q_lo = split_e4m3(q, sq[:, None])

    length = jnp.clip(len_ref[0], 0, pt_ref.shape[0] * page_size)
    first = split * blocks_per_partition
    n_iter = jnp.maximum(jnp.minimum(first + blocks_per_partition, (length + block_k - 1) // block_k) - first, 0)
    # The values are the second operand of an fp8 product along the keys, which Hopper's fp8 MMA reads only
    # key-major: Triton restages each value tile through registers, with a plain load its pipeliner does not issue
    # early, so the loop loads the next block's rows itself, a block ahead.
    r0, _ = kv_block_rows(pt_ref, first, length, block_k=block_k, page_size=page_size)
    carry = (jnp.zeros((block_m, d), jnp.float32), jnp.full((block_m,), MASK_VALUE, jnp.float32),
             jnp.zeros((block_m,), jnp.float32), jnp.float32(1.0), v_ref[r0])
    step = functools.partial(prefix_block, q_hi=q_hi, q_lo=q_lo, q_inv=1.0 / sq, k_ref=k_ref, v_ref=v_ref,
                             ks_ref=ks_ref, vs_ref=vs_ref, pt_ref=pt_ref, length=length, block_k=block_k,
                             page_size=page_size, scale_log2=scale_log2)
    o, m, l, unit, _ = lax.fori_loop(0, n_iter, lambda i, cr: step(cr, blk=first + i), carry)
    o = o / unit

    is_last = split == n_splits - 1  # the tree's own keys, in the last partition only
    tq = q.astype(kt_ref.dtype)
    for t in range(n_tree_tiles):
        col = t * block_t + jnp.arange(block_t, dtype=jnp.int32)
        colc = jnp.minimum(col, n_tree - 1)
        s = plt.dot(tq, kt_ref[colc], trans_b=True, precision=precision) * scale_log2
        visible = (anc_ref[node[:, None] * n_tree + colc[None, :]] != 0) & (col < n_tree)[None, :] & is_last
        alpha, p, m, l = softmax_step(m, l, s, visible)
        o = dot_acc(p.astype(vt_ref.dtype), vt_ref[colc], alpha[:, None] * o, precision=precision)

    has = l > 0
    o_ref = out_refs[0]
    if n_splits > 1:
        out_refs[1][q_rows] = jnp.where(has, m + jnp.log2(jnp.where(has, l, 1.0)), MASK_VALUE)
    o_ref[q_rows] = (o / jnp.where(has, l, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_m", "pages_per_block", "num_partitions", "num_warps",
                                             "num_stages", "target_programs", "interpret", "smem_budget"))
def tree_attention_fp8(q: jax.Array, k_rows: jax.Array, v_rows: jax.Array, page_table: jax.Array,
                       start: jax.Array, k_tree: jax.Array, v_tree: jax.Array, ancestors: jax.Array, scale: float,
                       k_scale: jax.Array, v_scale: jax.Array, *, block_m: int, pages_per_block: int,
                       num_partitions: int | None = 1, num_warps: int | None = None, num_stages: int | None = None,
                       target_programs: int = 2 * N_SM_TARGET, interpret: bool = False,
                       smem_budget: int | None = None) -> jax.Array:
    """:func:`pallas_kernels.tree_attention.kernel.tree_attention` over fp8 pages with e4m3 products.

    q [B, N, H, D]; k_rows, v_rows [n_pages, page_size, Hkv, D] float8_e4m3fn (``QuantizedPages.data``);
    page_table [B, W] int32 (entry < 0: non-resident page); start [B] prefix lengths; k_tree, v_tree
    [B, N, Hkv, D] (dotted in their dtype); ancestors [B, N, N] bool; k_scale, v_scale [n_pages, page_size, Hkv]
    f32. Returns [B, N, H, D] in q's dtype; a row with no visible key is zero. block_m, pages_per_block,
    num_partitions, num_warps, num_stages, target_programs, smem_budget: as there. Raises ValueError before lowering
    for tiles Triton cannot take."""
    b, n, h, d = q.shape
    n_pages, page_size, hkv, dk = k_rows.shape
    if v_rows.shape != k_rows.shape or dk != d or k_rows.dtype != E4M3 or v_rows.dtype != E4M3:
        raise ValueError(f"tree_attention_fp8: q {q.shape}, k_rows {k_rows.shape} {k_rows.dtype}, v_rows "
                         f"{v_rows.shape} {v_rows.dtype} disagree (pages are [n_pages, page_size, Hkv, D] e4m3)")
    if k_scale.shape != k_rows.shape[:3] or v_scale.shape != k_scale.shape:
        raise ValueError(f"tree_attention_fp8: scales {k_scale.shape} / {v_scale.shape} vs pages {k_rows.shape}")
    check_tree_args("tree_attention_fp8", q, hkv, k_tree, v_tree, ancestors, page_table, start)
    width = page_table.shape[1]
    num_warps, num_stages, plan = launch_plan(
        q, page_size=page_size, hkv=hkv, width=width, dtype=E4M3, compute_dtype=E4M3, quantized=True,
        block_m=block_m, pages_per_block=pages_per_block, num_partitions=num_partitions, num_warps=num_warps,
        num_stages=num_stages, target_programs=target_programs, smem_budget=smem_budget)
    s, bm = plan["n_partitions"], plan["block_m"]
    rows = n_pages * page_size
    kernel = functools.partial(_kernel, **kernel_statics(plan, n=n, hkv=hkv, page_size=page_size, scale=scale,
                                                         dtype=k_tree.dtype))
    outs = tree_pallas_call(
        kernel, b=b, n=n, h=h, hkv=hkv, rows=rows, width=width, s=s, n_row_tiles=plan["n_row_tiles"],
        row_tail=(d,), page_tail=(d,), n_scales=2, out_dtype=q.dtype, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret,
        name=f"tree_attention_fp8_products_bm{bm}_d{d}_bk{plan['block_k']}_t{plan['n_tree_p']}_s{s}",
    )(q.reshape(b, n * h, d), k_rows.reshape(rows, hkv, d), v_rows.reshape(rows, hkv, d), k_scale.reshape(rows, hkv),
      v_scale.reshape(rows, hkv), k_tree, v_tree, page_table.astype(jnp.int32), start.astype(jnp.int32)[:, None],
      ancestors.astype(jnp.int32).reshape(b, n * n))
    o = merge_partitions(*outs, axis=1) if s > 1 else outs[0]
    return o.reshape(b, n, h, d).astype(q.dtype)
