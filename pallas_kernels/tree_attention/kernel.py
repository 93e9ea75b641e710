"""Pallas (Triton lowering) kernel for packed tree attention over paged KV, GQA-grouped.

For every sequence b of a packed batch, the N tree queries attend to the committed paged prefix
(keys at positions < start[b] on resident pages, read through page_table[b]) and to the tree's own
K/V under the ancestor mask, in one softmax. Layout is the engine's: ``k_pages, v_pages
[n_pages, page_size, Hkv, D]``; a page-table entry < 0 is a non-resident page (keys masked, never read).

The rows of a program are (tree token, q head of the group) pairs, ``r = i * G + g``, so every row of
a tile belongs to one KV head and the pages it reads serve all G query heads of the group. The
N * G rows are cut into tiles of ``block_m`` rows (a power of two >= 16; the tile shrinks to the
rows there are, so a 16-node tree of the 27B, 96 rows, is one 128-row tile and every prefix page is read
once per KV head). Rows are gathered straight from q ``[B, N, H, D]`` and written straight to the output
(padding rows repeat the last real row: same inputs, same values), so there is no transpose or pad of q,
the output, the tree K/V or the ancestor mask around the kernel. Grid ``(row_tiles, S, B * Hkv)``: the
programs of one (sequence, KV head) are neighbours in launch order, so a second row tile re-reads the
pages from L2, not HBM.

A program walks its partition of the prefix ``block_k = pages_per_block * page_size`` tokens at a time
(:func:`pallas_kernels.paged_decode.kernel.paged_prefix_loop`: K/V as one ``[block_k, D]`` row gather each,
page ids from the page table, optional hand-written prefetch), then, in the last partition only, the tree
keys in chunks of ``block_t`` under the ancestor mask. Online softmax in base 2 with a finite mask
value; probabilities of invisible keys are zeroed, so a row with no visible key returns zeros.
With S > 1 (small batch, long prefix) each partition writes its normalised partial output (q's dtype) and
f32 log2-sum-exp, and a small jnp step merges them, as in flash-decoding.

Quantized pages (``QuantizedPages``, fp8 / int8 + per-token f32 scales) are read as stored and dequantized in
the prefix loop (see :mod:`pallas_kernels.paged_decode.kernel`); the tree's own K/V are in the compute dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.paged_decode.kernel import (LOG2E, MASK_VALUE, MIN_DOT, N_SM_TARGET, _next_pow2,
                                                merge_partitions, online_update, page_arrays, paged_prefix_loop,
                                                split_blocks)
from pallas_kernels.registry import check_block_shapes, current_backend


def _kernel(q_ref, k_ref, v_ref, *refs, n_tree: int, group: int, n_kv_heads: int, block_m: int, page_size: int,
            block_k: int, blocks_per_partition: int, n_splits: int, block_t: int, n_tree_tiles: int,
            scale_log2: float, prefetch: bool, quantized: bool, precision):
    # q_ref [N*H, D] (sequence b, rows i*H + h); k_ref, v_ref [n_pages*page_size, D] (KV head j); quantized:
    # ks_ref, vs_ref [n_pages*page_size] (KV head j's scales); kt_ref, vt_ref [N, D] (sequence b, KV head j);
    # pt_ref [W]; len_ref [1]; anc_ref [N*N] int32 (1 = key j visible to node i)
    ks_ref, vs_ref, kt_ref, vt_ref, pt_ref, len_ref, anc_ref, *out_refs = refs if quantized else (None, None, *refs)
    tile, split, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head = c % n_kv_heads
    d = q_ref.shape[-1]
    rr = jnp.minimum(tile * block_m + jnp.arange(block_m, dtype=jnp.int32), n_tree * group - 1)
    node = rr // group
    q_rows = node * (n_kv_heads * group) + kv_head * group + rr % group  # rows of q / out viewed [N*H, D]
    q = q_ref[q_rows]  # [BM, D]

    length = jnp.clip(len_ref[0], 0, pt_ref.shape[0] * page_size)
    n_blocks_seq = (length + block_k - 1) // block_k
    first = split * blocks_per_partition
    n_iter = jnp.maximum(jnp.minimum(first + blocks_per_partition, n_blocks_seq) - first, 0)
    carry = (jnp.zeros((block_m, d), jnp.float32), jnp.full((block_m,), MASK_VALUE, jnp.float32),
             jnp.zeros((block_m,), jnp.float32))
    carry = paged_prefix_loop(q, k_ref, v_ref, pt_ref, length, carry, first, n_iter, block_k=block_k,
                              page_size=page_size, scale_log2=scale_log2, prefetch=prefetch, precision=precision,
                              ks_ref=ks_ref, vs_ref=vs_ref)

    is_last = split == n_splits - 1
    for t in range(n_tree_tiles):  # the tree's own keys, in the last partition only
        col = t * block_t + jnp.arange(block_t, dtype=jnp.int32)
        colc = jnp.minimum(col, n_tree - 1)
        kt = kt_ref[colc]
        vt = vt_ref[colc]
        s = plt.dot(q, kt, trans_b=True, precision=precision) * scale_log2  # [BM, block_t]
        anc = anc_ref[node[:, None] * n_tree + colc[None, :]]
        visible = (anc != 0) & (col < n_tree)[None, :] & is_last
        carry = online_update(carry, s, visible, vt, precision)

    o, m, l = carry
    has = l > 0
    o = o / jnp.where(has, l, 1.0)[:, None]
    if n_splits > 1:
        o_ref, lse_ref = out_refs
        lse_ref[q_rows] = jnp.where(has, m + jnp.log2(jnp.where(has, l, 1.0)), MASK_VALUE)
    else:
        (o_ref,) = out_refs
    o_ref[q_rows] = o.astype(o_ref.dtype)


def default_config(head_dim: int, page_size: int, dtype, *, backend: str | None = None,
                   quantized: bool = False) -> dict:
    """Tuning defaults by backend and shape: block_m (the most rows per tile), pages_per_block, num_warps,
    num_stages, prefetch, target_programs. ``dtype`` is the compute dtype; ``quantized``: fp8 / int8 pages.

    From the H200 sweep (experiments/results/kernels_nvidia-h200_20261203-0523.json, 256-dim bf16 heads, 16-token
    pages): the hand prefetch of the next K/V block is the best config at both swept cases (200 vs 245 us at
    B=16 x 16 nodes, 1120 vs 1399 us at B=64 x 32), so it is on for bf16 pages on NVIDIA; quantized pages take
    64-key blocks, the bytes per block of bf16's 32 keys (fp8: 0.83x -> 1.01x of the bf16-page kernel)."""
    b = backend or current_backend()
    itemsize = jnp.dtype(dtype).itemsize
    wide = head_dim * itemsize > 256
    target_k = 32 if wide else 64
    block_m = 128 if head_dim * itemsize <= 512 else 64  # f32 256-dim heads: a 128-row q tile alone is 128 KiB
    if b == "rocm":  # 64 KiB of LDS per workgroup
        target_k, block_m = min(target_k, 32), 32 if wide else 64
    elif quantized:
        target_k *= 2
    ppb = _next_pow2(max(1, target_k // page_size, -(-MIN_DOT // page_size)))
    return dict(block_m=block_m, pages_per_block=ppb, num_warps=4 if head_dim <= 64 else 8,
                num_stages=1 if b == "rocm" else 2, prefetch=b == "cuda" and not quantized,
                target_programs=2 * N_SM_TARGET)


def auto_partitions(programs: int, n_blocks: int, *, target_programs: int = 2 * N_SM_TARGET,
                    n_row_tiles: int = 1) -> int:
    """Prefix partitions: the most that keep ``programs`` (row tiles x B x Hkv) x partitions within
    ``target_programs`` (rounded down, as in :func:`pallas_kernels.paged_decode.kernel.auto_partitions`), or within
    half of it when a tree has more than one row tile: its tiles already re-read each prefix block (from L2), and
    at B16 x 32 nodes (two tiles) 132 programs beat 264 at every prefix (H100: 2K / 4K / 8K / 16K 1.02 / 1.14 /
    1.09 / 1.05x), while one-tile trees (16 nodes) keep 264 (1.04x over 132 at 4K)."""
    target = target_programs if n_row_tiles <= 1 else target_programs // 2
    return int(max(1, min(n_blocks, target // max(1, programs))))


def block_plan(*, batch: int, n_tree: int, n_heads: int, n_kv_heads: int, head_dim: int, page_size: int,
               width: int, dtype, block_m: int, pages_per_block: int, num_partitions: int | None,
               num_stages: int, target_programs: int = 2 * N_SM_TARGET, smem_budget: int | None = None,
               backend: str | None = None, compute_dtype=None) -> dict:
    """Static shapes of a launch, checked with :func:`check_block_shapes` (raises ValueError). ``block_m`` is the
    most rows per tile: a tree with fewer rows gets one tile of their power of two (>= 16). ``dtype`` is the
    pages' storage dtype, ``compute_dtype`` (None: the same) the dots' (quantized pages: fp8 / int8 storage)."""
    if n_heads % n_kv_heads:
        raise ValueError(f"tree_attention: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if pages_per_block < 1 or block_m < 1:
        raise ValueError(f"tree_attention: pages_per_block={pages_per_block} and block_m={block_m} must be >= 1")
    check_block_shapes("tree_attention", {"q": (block_m, head_dim)})
    g = n_heads // n_kv_heads
    rows = n_tree * g
    block_m = min(block_m, max(MIN_DOT, _next_pow2(rows)))
    n_row_tiles = -(-rows // block_m)
    n_tree_p = max(MIN_DOT, _next_pow2(n_tree))
    block_k = pages_per_block * page_size
    block_t = min(n_tree_p, max(MIN_DOT, _next_pow2(block_k)))
    kvsz = jnp.dtype(dtype).itemsize
    isz = jnp.dtype(compute_dtype or dtype).itemsize
    n_blocks = max(1, -(-width * page_size // block_k))
    s, blocks_per_part = split_blocks(
        n_blocks, auto_partitions(n_row_tiles * batch * n_kv_heads, n_blocks, target_programs=target_programs,
                                  n_row_tiles=n_row_tiles) if num_partitions is None else int(num_partitions),
        "tree_attention")
    loop = num_stages * 2 * block_k * head_dim * kvsz + block_m * block_k * isz
    if kvsz != isz:  # quantized pages: the tiles cast to the compute dtype (the dots' operands) and the scales;
        # the stored rows are staged only when the loop is pipelined (as in paged_decode.kernel.block_plan)
        loop += 2 * block_k * head_dim * isz + num_stages * 2 * block_k * 4
        loop -= 0 if num_stages > 1 else 2 * block_k * head_dim * kvsz
    tree = 2 * block_t * head_dim * isz + block_m * block_t * (isz + 4)
    smem = {"q": block_m * head_dim * isz, "kv_loop_or_tree": max(loop, tree)}
    total = check_block_shapes(
        "tree_attention",
        {"q": (block_m, head_dim), "k": (block_k, head_dim), "key_rows": (block_k,),
         "scores": (block_m, block_k), "tree_k": (block_t, head_dim), "tree_mask": (block_m, block_t),
         "o": (block_m, head_dim)},
        dots={"qk": (block_m, block_k, head_dim), "pv": (block_m, head_dim, block_k),
              "q_tree_k": (block_m, block_t, head_dim), "p_tree_v": (block_m, head_dim, block_t)},
        smem=smem, smem_budget=smem_budget, backend=backend)
    return dict(g=g, rows=rows, block_m=block_m, n_row_tiles=n_row_tiles, n_tree_p=n_tree_p, block_k=block_k,
                block_t=block_t, n_partitions=s, blocks_per_partition=blocks_per_part,
                pages_per_partition=blocks_per_part * pages_per_block, smem_bytes=total,
                programs=n_row_tiles * s * batch * n_kv_heads)


def check_tree_args(name: str, q, hkv: int, k_tree, v_tree, ancestors, page_table, start) -> None:
    """Raise ValueError unless the tree K/V ``[B, N, Hkv, D]``, the ancestor mask ``[B, N, N]``, the page table
    ``[B, W]`` and the prefix lengths ``[B]`` fit q ``[B, N, H, D]`` (the pages are each kernel's own check)."""
    b, n, _, d = q.shape
    if k_tree.shape != (b, n, hkv, d) or v_tree.shape != k_tree.shape or ancestors.shape != (b, n, n):
        raise ValueError(f"{name}: k_tree {k_tree.shape}, v_tree {v_tree.shape}, ancestors "
                         f"{ancestors.shape} do not fit q {q.shape} with {hkv} KV heads")
    if page_table.shape[0] != b or start.shape != (b,):
        raise ValueError(f"{name}: page_table {page_table.shape} / start {start.shape} vs batch {b}")


def launch_plan(q, *, page_size: int, hkv: int, width: int, dtype, compute_dtype, quantized: bool, block_m: int,
                pages_per_block: int, num_partitions: int | None, num_warps: int | None, num_stages: int | None,
                target_programs: int, smem_budget: int | None) -> tuple[int, int, dict]:
    """(num_warps, num_stages, :func:`block_plan`) of a launch: warps / stages left None take
    :func:`default_config`'s for ``compute_dtype``; ``dtype`` is the pages' storage dtype."""
    b, n, h, d = q.shape
    cfg = default_config(d, page_size, compute_dtype, quantized=quantized)
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    plan = block_plan(batch=b, n_tree=n, n_heads=h, n_kv_heads=hkv, head_dim=d, page_size=page_size, width=width,
                      dtype=dtype, block_m=block_m, pages_per_block=pages_per_block, num_partitions=num_partitions,
                      num_stages=num_stages, target_programs=target_programs, smem_budget=smem_budget,
                      compute_dtype=compute_dtype)
    return num_warps, num_stages, plan


def kernel_statics(plan: dict, *, n: int, hkv: int, page_size: int, scale: float, dtype) -> dict:
    """The static arguments every tree-attention kernel body takes, from its :func:`block_plan`; ``dtype``: the
    tree K/V's (f32 dots at HIGHEST)."""
    return dict(n_tree=n, group=plan["g"], n_kv_heads=hkv, block_m=plan["block_m"], page_size=page_size,
                block_k=plan["block_k"], blocks_per_partition=plan["blocks_per_partition"],
                n_splits=plan["n_partitions"], block_t=plan["block_t"],
                n_tree_tiles=plan["n_tree_p"] // plan["block_t"], scale_log2=float(scale) * LOG2E,
                precision=lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None)


def tree_pallas_call(kernel, *, b: int, n: int, h: int, hkv: int, rows: int, width: int, s: int, n_row_tiles: int,
                     row_tail: tuple[int, ...], page_tail: tuple[int, ...], n_scales: int, out_dtype,
                     num_warps: int, num_stages: int, interpret: bool, name: str,
                     k_tail: tuple[int, ...] | None = None, extra_row_tails: tuple[tuple[int, ...], ...] = ()):
    """The ``pallas_call`` of a tree-attention kernel over grid (row tile r, partition p, sequence * KV head c).

    Its arguments: q rows ``[B, N*H, *row_tail]``; one more q-row input ``[B, N*H, *tail]`` for each of
    ``extra_row_tails``; K / V page rows ``[n_pages * page_size, Hkv, *page_tail]`` (K's trailing shape ``k_tail``
    when given);
    ``n_scales`` (0 or 2) K / V scale rows ``[n_pages * page_size, Hkv]``; the tree's K / V
    ``[B, N, Hkv, *row_tail]``; the page table ``[B, W]``; prefix lengths ``[B, 1]``; the ancestor mask
    ``[B, N*N]``. Outputs: ``[B, N*H, *row_tail]`` in ``out_dtype``, or with S > 1 partitions the partials
    ``[B, S, N*H, *row_tail]`` and their f32 log2-sum-exp ``[B, S, N*H]``. Every program writes only its own rows
    of the sequence's block (the KV heads share it)."""
    zr = (0,) * len(row_tail)

    def q_spec(tail):
        return pl.BlockSpec((None, n * h, *tail), lambda r, p, c: (c // hkv, 0, *(0,) * len(tail)))

    def page_spec(tail):
        return pl.BlockSpec((rows, None, *tail), lambda r, p, c: (0, c % hkv, *(0,) * len(tail)))

    in_specs = [
        q_spec(row_tail), *map(q_spec, extra_row_tails),                                        # q rows
        page_spec(page_tail if k_tail is None else k_tail), page_spec(page_tail),               # k, v (head)
        *[pl.BlockSpec((rows, None), lambda r, p, c: (0, c % hkv))] * n_scales,                 # k, v scales
        *[pl.BlockSpec((None, n, None, *row_tail), lambda r, p, c: (c // hkv, 0, c % hkv, *zr))] * 2,  # tree k, v
        pl.BlockSpec((None, width), lambda r, p, c: (c // hkv, 0)),                             # page table row
        pl.BlockSpec((None, 1), lambda r, p, c: (c // hkv, 0)),                                 # prefix length
        pl.BlockSpec((None, n * n), lambda r, p, c: (c // hkv, 0)),                             # ancestor mask
    ]
    if s > 1:
        out_shape = [jax.ShapeDtypeStruct((b, s, n * h, *row_tail), out_dtype),
                     jax.ShapeDtypeStruct((b, s, n * h), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, n * h, *row_tail), lambda r, p, c: (c // hkv, p, 0, *zr)),
                     pl.BlockSpec((None, None, n * h), lambda r, p, c: (c // hkv, p, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, n * h, *row_tail), out_dtype)]
        out_specs = [pl.BlockSpec((None, n * h, *row_tail), lambda r, p, c: (c // hkv, 0, *zr))]
    return pl.pallas_call(
        kernel, grid=(n_row_tiles, s, b * hkv), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=name)


@functools.partial(jax.jit, static_argnames=("scale", "block_m", "pages_per_block", "num_partitions", "num_warps",
                                             "num_stages", "prefetch", "target_programs", "interpret",
                                             "smem_budget"))
def tree_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, start: jax.Array,
                   k_tree: jax.Array, v_tree: jax.Array, ancestors: jax.Array, scale: float, *, block_m: int,
                   pages_per_block: int, num_partitions: int | None = 1, num_warps: int | None = None,
                   num_stages: int | None = None, prefetch: bool = False,
                   target_programs: int = 2 * N_SM_TARGET, interpret: bool = False,
                   smem_budget: int | None = None) -> jax.Array:
    """Tree queries over each sequence's paged prefix plus its own tree (``tree_attention_reference``'s contract).

    q [B, N, H, D]; k_pages, v_pages [n_pages, page_size, Hkv, D] arrays, or ``QuantizedPages`` (fp8 / int8
    rows read as stored, dequantized in the kernel); page_table [B, W] int32 (entry < 0: non-resident page);
    start [B] prefix lengths (clipped to [0, W*page_size]); k_tree, v_tree [B, N, Hkv, D]; ancestors [B, N, N]
    bool (tree key j visible to slot i iff ancestors[b, i, j]).
    Returns [B, N, H, D] in q's dtype; a row with no visible key is zero. Computes in k_pages' dtype (quantized
    pages: their compute dtype) with
    f32 accumulation. block_m: the most rows (tree token x q head) per program; pages_per_block: pages
    gathered per step; num_partitions: prefix partitions (None: chosen by grid size, ~target_programs
    programs); prefetch: hand-written double buffering of the K/V gathers. Raises ValueError before
    lowering for tiles Triton cannot take.
    """
    b, n, h, d = q.shape
    n_pages, page_size, hkv, dk = k_pages.shape
    if k_pages.shape != v_pages.shape or dk != d or type(k_pages) is not type(v_pages):
        raise ValueError(f"tree_attention: q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape} disagree")
    check_tree_args("tree_attention", q, hkv, k_tree, v_tree, ancestors, page_table, start)
    k_data, k_scale, dt = page_arrays(k_pages)
    v_data, v_scale, _ = page_arrays(v_pages)
    quantized = k_scale is not None
    width = page_table.shape[1]
    num_warps, num_stages, plan = launch_plan(
        q, page_size=page_size, hkv=hkv, width=width, dtype=k_data.dtype, compute_dtype=dt, quantized=quantized,
        block_m=block_m, pages_per_block=pages_per_block, num_partitions=num_partitions, num_warps=num_warps,
        num_stages=num_stages, target_programs=target_programs, smem_budget=smem_budget)
    s, bm = plan["n_partitions"], plan["block_m"]
    rows = n_pages * page_size

    # Free views: q / out rows [B, N*H, D], pages (and scales) as token rows, the mask flat per sequence.
    qr = q.astype(dt).reshape(b, n * h, d)
    kr = k_data.reshape(rows, hkv, d)
    vr = v_data.reshape(rows, hkv, d)
    scales = (k_scale.reshape(rows, hkv), v_scale.reshape(rows, hkv)) if quantized else ()
    kt = k_tree.astype(dt)
    vt = v_tree.astype(dt)
    anc = ancestors.astype(jnp.int32).reshape(b, n * n)
    pt = page_table.astype(jnp.int32)
    lens = start.astype(jnp.int32)[:, None]  # [B, 1]

    kernel = functools.partial(_kernel, **kernel_statics(plan, n=n, hkv=hkv, page_size=page_size, scale=scale,
                                                         dtype=dt), prefetch=prefetch, quantized=quantized)
    outs = tree_pallas_call(
        kernel, b=b, n=n, h=h, hkv=hkv, rows=rows, width=width, s=s, n_row_tiles=plan["n_row_tiles"],
        row_tail=(d,), page_tail=(d,), n_scales=len(scales), out_dtype=q.dtype, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret,
        name=f"tree_attention_bm{bm}_d{d}_bk{plan['block_k']}_t{plan['n_tree_p']}_s{s}{'_pf' if prefetch else ''}"
             f"{'_kv' + k_data.dtype.name if quantized else ''}",
    )(qr, kr, vr, *scales, kt, vt, pt, lens, anc)

    o = merge_partitions(*outs, axis=1) if s > 1 else outs[0]
    return o.reshape(b, n, h, d).astype(q.dtype)
