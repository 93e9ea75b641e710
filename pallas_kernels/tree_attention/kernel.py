"""Pallas (Triton lowering) kernel for packed tree attention over paged KV, GQA-grouped.

For every sequence b of a packed batch, the N tree queries attend to the committed paged prefix
(keys at positions < start[b] on resident pages, read through page_table[b]) and to the tree's own
K/V under the ancestor mask, in one softmax. Layout is the engine's: ``k_pages, v_pages
[n_pages, page_size, Hkv, D]``; a page-table entry < 0 is a non-resident page (keys masked, never read).

The rows of a program are (tree token, q head of the group) pairs, ``r = i * G + g``, so every row of
a tile belongs to one KV head and the pages it reads serve all G query heads of the group. The
N * G rows are cut into tiles of ``block_m`` (a power of two >= 16, padded). Grid
``(row_tiles, S, B * Hkv)``: the row tiles of one (sequence, KV head) are neighbours in launch order,
so when there is more than one the pages are re-read from L2, not HBM.

A program walks its partition of the prefix ``pages_per_block`` pages at a time (gathering them by
page index; the Triton lowering has no scalar prefetch), then, in the last partition only, the tree
keys in chunks of ``block_t`` under the ancestor mask. Online softmax in base 2 with a finite mask
value; probabilities of invisible keys are zeroed, so a row with no visible key returns zeros.
With S > 1 (small batch, long prefix) each partition writes unnormalised f32 ``(o, m, l)`` and a
small jnp step merges them, as in flash-decoding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.paged_decode.kernel import LOG2E, MASK_VALUE, MIN_DOT, _next_pow2
from pallas_kernels.registry import check_block_shapes, current_backend


def _online_update(carry, s, visible, v, precision):
    """One online-softmax step: s [M, K] logits in log2 units, visible [M, K] or [1, K], v [K, D]."""
    o, m, l = carry
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.where(visible, jnp.exp2(s - m_new[:, None]), 0.0)
    l = alpha * l + p.sum(axis=-1)
    o = alpha[:, None] * o + plt.dot(p.astype(v.dtype), v, precision=precision)
    return o, m_new, l


def _kernel(q_ref, k_ref, v_ref, kt_ref, vt_ref, pt_ref, len_ref, mask_ref, *out_refs, page_size: int,
            pages_per_block: int, pages_per_partition: int, n_splits: int, block_t: int, scale_log2: float,
            precision):
    # q_ref [BM, D]; k_ref, v_ref [n_pages, page_size, D] (this KV head); kt_ref, vt_ref [Np, D];
    # pt_ref [Wp]; len_ref [1]; mask_ref [BM, Np] int32 (1 = tree key visible to the row)
    split = pl.program_id(1)
    bm, d = q_ref.shape
    n_tree = kt_ref.shape[0]
    block_k = pages_per_block * page_size
    length = len_ref[0]
    n_pages_seq = (length + page_size - 1) // page_size
    first_page = split * pages_per_partition
    end = jnp.minimum(first_page + pages_per_partition, n_pages_seq)
    n_iter = jnp.maximum((end - first_page + pages_per_block - 1) // pages_per_block, 0)
    q = q_ref[...]

    def prefix_block(i, carry):
        first = first_page + i * pages_per_block
        pages = pt_ref[pl.ds(first, pages_per_block)]
        pages = jnp.where((first + jnp.arange(pages_per_block) < n_pages_seq) & (pages >= 0), pages, 0)
        k = k_ref[pages].reshape(block_k, d)
        v = v_ref[pages].reshape(block_k, d)
        s = plt.dot(q, k, trans_b=True, precision=precision) * scale_log2  # [BM, block_k] f32
        tok = first * page_size + jnp.arange(block_k)
        tok_page = pt_ref[first + jnp.arange(block_k) // page_size]
        visible = ((tok < length) & (tok_page >= 0))[None, :]
        return _online_update(carry, s, visible, v, precision)

    carry = (jnp.zeros((bm, d), jnp.float32), jnp.full((bm,), MASK_VALUE, jnp.float32),
             jnp.zeros((bm,), jnp.float32))
    carry = lax.fori_loop(0, n_iter, prefix_block, carry)

    is_last = split == n_splits - 1
    for c in range(n_tree // block_t):  # the tree's own keys, in the last partition only
        kt = kt_ref[pl.ds(c * block_t, block_t), :]
        vt = vt_ref[pl.ds(c * block_t, block_t), :]
        s = plt.dot(q, kt, trans_b=True, precision=precision) * scale_log2  # [BM, block_t]
        visible = (mask_ref[:, pl.ds(c * block_t, block_t)] != 0) & is_last
        carry = _online_update(carry, s, visible, vt, precision)

    o, m, l = carry
    if n_splits > 1:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l
    else:
        (o_ref,) = out_refs
        o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def default_config(head_dim: int, page_size: int, dtype, *, backend: str | None = None) -> dict:
    """Tuning defaults by backend and shape: block_m, pages_per_block, num_warps, num_stages."""
    b = backend or current_backend()
    itemsize = jnp.dtype(dtype).itemsize
    wide = head_dim * itemsize > 256
    target_k = 32 if wide else 64
    block_m = 64 if wide else 128
    if b == "rocm":  # 64 KiB of LDS per workgroup
        target_k, block_m = min(target_k, 32), min(block_m, 32 if wide else 64)
    ppb = _next_pow2(max(1, target_k // page_size, -(-MIN_DOT // page_size)))
    return dict(block_m=block_m, pages_per_block=ppb, num_warps=4 if head_dim <= 64 else 8,
                num_stages=1 if b == "rocm" else 2)


def auto_partitions(programs: int, n_blocks: int, *, target_programs: int = 264) -> int:
    """Prefix partitions so that ``programs`` (row tiles x B x Hkv) reach ~``target_programs``."""
    return int(max(1, min(n_blocks, -(-target_programs // max(1, programs)))))


def block_plan(*, batch: int, n_tree: int, n_heads: int, n_kv_heads: int, head_dim: int, page_size: int,
               width: int, dtype, block_m: int, pages_per_block: int, num_partitions: int | None,
               num_stages: int, smem_budget: int | None = None, backend: str | None = None) -> dict:
    """Static shapes of a launch, checked with :func:`check_block_shapes` (raises ValueError)."""
    if n_heads % n_kv_heads:
        raise ValueError(f"tree_attention: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if pages_per_block < 1 or block_m < 1:
        raise ValueError(f"tree_attention: pages_per_block={pages_per_block} and block_m={block_m} must be >= 1")
    g = n_heads // n_kv_heads
    rows = n_tree * g
    n_row_tiles = -(-rows // block_m)
    n_tree_p = max(MIN_DOT, _next_pow2(n_tree))
    block_k = pages_per_block * page_size
    block_t = min(n_tree_p, max(MIN_DOT, _next_pow2(block_k)))
    isz = jnp.dtype(dtype).itemsize
    n_blocks = max(1, -(-width // pages_per_block))
    s = (auto_partitions(n_row_tiles * batch * n_kv_heads, n_blocks) if num_partitions is None
         else int(num_partitions))
    if s < 1:
        raise ValueError(f"tree_attention: num_partitions={num_partitions} must be >= 1")
    s = min(s, n_blocks)
    blocks_per_part = -(-n_blocks // s)
    s = -(-n_blocks // blocks_per_part)
    loop = num_stages * 2 * block_k * head_dim * isz + block_m * block_k * isz
    tree = 2 * block_t * head_dim * isz + block_m * block_t * (isz + 4)
    smem = {"q": block_m * head_dim * isz, "kv_loop_or_tree": max(loop, tree)}
    total = check_block_shapes(
        "tree_attention",
        {"q": (block_m, head_dim), "k": (pages_per_block, page_size, head_dim), "page_ids": (pages_per_block,),
         "scores": (block_m, block_k), "tree_k": (block_t, head_dim), "tree_mask": (block_m, block_t),
         "o": (block_m, head_dim)},
        dots={"qk": (block_m, block_k, head_dim), "pv": (block_m, head_dim, block_k),
              "q_tree_k": (block_m, block_t, head_dim), "p_tree_v": (block_m, head_dim, block_t)},
        smem=smem, smem_budget=smem_budget, backend=backend)
    return dict(g=g, rows=rows, n_row_tiles=n_row_tiles, n_tree_p=n_tree_p, block_k=block_k, block_t=block_t,
                n_partitions=s, pages_per_partition=blocks_per_part * pages_per_block,
                padded_width=s * blocks_per_part * pages_per_block, smem_bytes=total)


@functools.partial(jax.jit, static_argnames=("scale", "block_m", "pages_per_block", "num_partitions", "num_warps",
                                             "num_stages", "interpret", "smem_budget"))
def tree_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, start: jax.Array,
                   k_tree: jax.Array, v_tree: jax.Array, ancestors: jax.Array, scale: float, *, block_m: int,
                   pages_per_block: int, num_partitions: int | None = 1, num_warps: int | None = None,
                   num_stages: int | None = None, interpret: bool = False,
                   smem_budget: int | None = None) -> jax.Array:
    """Tree queries over each sequence's paged prefix plus its own tree (``tree_attention_reference``'s contract).

    q [B, N, H, D]; k_pages, v_pages [n_pages, page_size, Hkv, D]; page_table [B, W] int32 (entry < 0:
    non-resident page); start [B] prefix lengths (clipped to [0, W*page_size]); k_tree, v_tree
    [B, N, Hkv, D]; ancestors [B, N, N] bool (tree key j visible to slot i iff ancestors[b, i, j]).
    Returns [B, N, H, D] in q's dtype; a row with no visible key is zero. Computes in k_pages' dtype with
    f32 accumulation. block_m: rows (tree token x q head) per program; pages_per_block: pages gathered per
    step; num_partitions: prefix partitions (None: chosen by grid size). Raises ValueError before
    lowering for tiles Triton cannot take.
    """
    b, n, h, d = q.shape
    n_pages, page_size, hkv, dk = k_pages.shape
    if k_pages.shape != v_pages.shape or dk != d:
        raise ValueError(f"tree_attention: q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape} disagree")
    if k_tree.shape != (b, n, hkv, d) or v_tree.shape != k_tree.shape or ancestors.shape != (b, n, n):
        raise ValueError(f"tree_attention: k_tree {k_tree.shape}, v_tree {v_tree.shape}, ancestors "
                         f"{ancestors.shape} do not fit q {q.shape} with {hkv} KV heads")
    if page_table.shape[0] != b or start.shape != (b,):
        raise ValueError(f"tree_attention: page_table {page_table.shape} / start {start.shape} vs batch {b}")
    cfg = default_config(d, page_size, k_pages.dtype)
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    width = page_table.shape[1]
    plan = block_plan(batch=b, n_tree=n, n_heads=h, n_kv_heads=hkv, head_dim=d, page_size=page_size, width=width,
                      dtype=k_pages.dtype, block_m=block_m, pages_per_block=pages_per_block,
                      num_partitions=num_partitions, num_stages=num_stages, smem_budget=smem_budget)
    g, rows, n_rt, n_tp = plan["g"], plan["rows"], plan["n_row_tiles"], plan["n_tree_p"]
    s, wp = plan["n_partitions"], plan["padded_width"]
    rows_p = n_rt * block_m
    dt = k_pages.dtype

    # rows r = i * G + g of KV head j: [B, Hkv, N*G, D], padded to whole row tiles
    qr = q.astype(dt).reshape(b, n, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_p - rows), (0, 0)))
    pad_t = ((0, 0), (0, n_tp - n), (0, 0), (0, 0))
    kt = jnp.pad(k_tree.astype(dt), pad_t)
    vt = jnp.pad(v_tree.astype(v_pages.dtype), pad_t)
    mask = jnp.repeat(ancestors.astype(jnp.int32), g, axis=1)  # [B, N*G, N]
    mask = jnp.pad(mask, ((0, 0), (0, rows_p - rows), (0, n_tp - n)))
    pt = page_table.astype(jnp.int32)
    if wp != width:
        pt = jnp.pad(pt, ((0, 0), (0, wp - width)))  # null page, past every prefix
    lens = jnp.clip(start.astype(jnp.int32), 0, width * page_size)[:, None]  # [B, 1]

    precision = lax.Precision.HIGHEST if dt == jnp.float32 else None
    kernel = functools.partial(_kernel, page_size=page_size, pages_per_block=pages_per_block,
                               pages_per_partition=plan["pages_per_partition"], n_splits=s,
                               block_t=plan["block_t"], scale_log2=float(scale) * LOG2E, precision=precision)
    # grid (row tile r, partition p, sequence * KV head c)
    in_specs = [
        pl.BlockSpec((None, None, block_m, d), lambda r, p, c: (c // hkv, c % hkv, r, 0)),   # q rows
        pl.BlockSpec((n_pages, page_size, None, d), lambda r, p, c: (0, 0, c % hkv, 0)),     # k_pages (head)
        pl.BlockSpec((n_pages, page_size, None, d), lambda r, p, c: (0, 0, c % hkv, 0)),     # v_pages (head)
        pl.BlockSpec((None, n_tp, None, d), lambda r, p, c: (c // hkv, 0, c % hkv, 0)),      # k_tree
        pl.BlockSpec((None, n_tp, None, d), lambda r, p, c: (c // hkv, 0, c % hkv, 0)),      # v_tree
        pl.BlockSpec((None, wp), lambda r, p, c: (c // hkv, 0)),                             # page table row
        pl.BlockSpec((None, 1), lambda r, p, c: (c // hkv, 0)),                              # prefix length
        pl.BlockSpec((None, block_m, n_tp), lambda r, p, c: (c // hkv, r, 0)),               # ancestor mask rows
    ]
    if s > 1:
        out_shape = [jax.ShapeDtypeStruct((b, hkv, s, rows_p, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, s, rows_p), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, s, rows_p), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, block_m, d), lambda r, p, c: (c // hkv, c % hkv, p, r, 0)),
                     pl.BlockSpec((None, None, None, block_m), lambda r, p, c: (c // hkv, c % hkv, p, r)),
                     pl.BlockSpec((None, None, None, block_m), lambda r, p, c: (c // hkv, c % hkv, p, r))]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, hkv, rows_p, d), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, block_m, d), lambda r, p, c: (c // hkv, c % hkv, r, 0))]

    outs = pl.pallas_call(
        kernel,
        grid=(n_rt, s, b * hkv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"tree_attention_bm{block_m}_d{d}_bk{plan['block_k']}_t{n_tp}_s{s}",
    )(qr, k_pages, v_pages, kt, vt, pt, lens, mask)

    if s > 1:
        o, m, l = outs
        m_max = m.max(axis=2, keepdims=True)
        a = jnp.exp2(m - m_max)                                     # [B, Hkv, S, R]
        l_tot = (a * l).sum(axis=2)
        o = (a[..., None] * o).sum(axis=2) / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]
    else:
        (o,) = outs
    o = o[:, :, :rows].reshape(b, hkv, n, g, d).transpose(0, 2, 1, 3, 4)
    return o.reshape(b, n, h, d).astype(q.dtype)
