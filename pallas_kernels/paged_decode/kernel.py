"""Pallas (Triton lowering) kernel for single-token paged decode attention, GQA-grouped.

Layout is the engine's: ``k_pages, v_pages [n_pages, page_size, Hkv, D]`` (token-major, KV heads
interleaved), ``page_table [B, W]`` with page 0 the null page, ``lengths [B]`` valid tokens.

Grid ``(B, Hkv, S)``: one program per (sequence, KV head, KV partition). A program holds the
G = H / Hkv query heads of its group as the rows of one ``[Gp, D]`` tile (G padded to a power of two
>= 16, since ``tl.dot`` needs M >= 16; the padding rows repeat the group's last head, so q is read
unpadded and the output is written without a slice), so each KV head's pages are read once for the
whole group. The pages are viewed as token rows ``[n_pages * page_size, D]`` of one KV head, and a
program walks its partition ``block_k = pages_per_block * page_size`` tokens at a time: it gathers the
block's page ids from the page table (an ordinary input: the Triton lowering has no scalar prefetch)
and loads K and V as one ``[block_k, D]`` row gather each (no reshape between the load and the dot,
so Triton's pipeliner can stage the loads; ``prefetch=True`` instead issues the next block's loads
before the current block's dots, by hand). Online softmax in base 2, bf16 or f32 in, f32 accumulate.

Quantized pages (``dflash_jax.kv.quant.QuantizedPages``: fp8 e4m3 or int8 rows + one f32 scale per token and
KV head) are read as stored, so a block moves about half the bytes of bf16: the block's K/V rows in the storage
dtype plus their ``[block_k]`` scales. The rows are cast to the compute dtype (exact: e4m3 and int8 values are
bf16 values) and the per-key scales are applied to the f32 scores (K) and to the probabilities (V), which is
the dequantized product without a ``[block_k, D]`` multiply.

With S = 1 the program normalises and writes the output. With S > 1 (flash-decoding: long contexts,
small batches) each program writes its normalised partial output (in q's dtype, G rows only) and its
log2-sum-exp in f32, and one small jnp step merges the partitions; partitions past a sequence's end
do no work. The default S gives ~2 programs per SM (:func:`auto_partitions`).

Facts taken from jax's (deprecated) ``pallas/ops/gpu/paged_attention.py`` and ``decode_attention.py``:
a whole-array BlockSpec for the pages (Triton refs are HBM pointers, a big block costs nothing),
vector-index gathers, a finite mask value, split-K merged outside the kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dflash_jax.kv.quant import QuantizedPages
from pallas_kernels.registry import check_block_shapes, current_backend
from pallas_kernels.dot_acc import dot_acc

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: exp2(mask - m) is 0, never NaN
LOG2E = math.log2(math.e)
MIN_DOT = 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def padded_group(g: int) -> int:
    """Rows of the q tile: the GQA group size padded to a power of two >= 16."""
    return max(MIN_DOT, _next_pow2(g))


def group_rows(g: int) -> jax.Array:
    """[Gp] row index of each q-tile row into the G real rows: padding rows repeat row G - 1 (same inputs, same
    outputs, so storing them again writes the same values)."""
    return jnp.minimum(jnp.arange(padded_group(g), dtype=jnp.int32), g - 1)


def kv_block_rows(pt_ref, blk, length, *, block_k: int, page_size: int):
    """Token rows (into pages viewed as ``[n_pages * page_size, D]``) of key block ``blk`` and their visibility.

    pt_ref [W] page-table row; a key is visible iff it lies before ``length`` on a resident page (entry >= 0).
    Invisible keys (past the end, or non-resident) read the null page 0, so every load stays in bounds."""
    width = pt_ref.shape[0]
    tok = blk * block_k + jnp.arange(block_k, dtype=jnp.int32)
    page = pt_ref[jnp.minimum(tok // page_size, width - 1)]
    visible = (tok < length) & (page >= 0)
    return jnp.where(visible, page, 0) * page_size + tok % page_size, visible


def page_arrays(pages) -> tuple[jax.Array, jax.Array | None, jnp.dtype]:
    """Pages ``[n_pages, page_size, Hkv, D]`` -> (values as stored, per-token scales ``[n_pages, page_size, Hkv]``
    or None, compute dtype): a plain array computes in its own dtype, ``QuantizedPages`` in its compute dtype."""
    if isinstance(pages, QuantizedPages):
        return pages.data, pages.scale, jnp.dtype(pages.compute_dtype)
    return pages, None, jnp.dtype(pages.dtype)


def check_page_dtype(op: str, pages, backend: str | None = None) -> None:
    """Raise ValueError when ``backend`` cannot read ``pages``' storage dtype in a kernel: fp8 e4m3fn
    (``--kv-dtype fp8``) on ROCm, whose MI300 (gfx942) Triton backend converts only the e4m3fnuz fp8 variant
    (int8 pages are read there)."""
    data = pages.data if isinstance(pages, QuantizedPages) else pages
    if (backend or current_backend()) == "rocm" and jnp.dtype(data.dtype) == jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"{op}: fp8 e4m3fn KV pages are not supported by the ROCm Triton backend (MI300 converts "
                         "only e4m3fnuz); use --kv-dtype int8 or bf16 on ROCm")


def softmax_step(m, l, s, visible):
    """Online softmax over one key block: m, l [M] running max / sum, s [M, K] f32 logits in log2 units, visible
    [M, K] or [1, K] -> (alpha [M] rescale of the old output, p [M, K], new m, new l)."""
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.where(visible, jnp.exp2(s - m_new[:, None]), 0.0)  # a block with no visible key adds nothing
    return alpha, p, m_new, alpha * l + p.sum(axis=-1)


def online_update(carry, s, visible, v, precision, v_scale=None):
    """One online-softmax step: s [M, K] logits in log2 units, visible [M, K] or [1, K], v [K, D] (in the
    compute dtype); v_scale [K] f32 per-key value scales of quantized pages (None: v as is)."""
    o, m, l = carry
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.where(visible, jnp.exp2(s - m_new[:, None]), 0.0)  # a block with no visible key adds nothing
    l = alpha * l + p.sum(axis=-1)
    pv = p if v_scale is None else p * v_scale[None, :]  # (p * scale) @ v == p @ (scale * v)
    o = dot_acc(pv.astype(v.dtype), v, alpha[:, None] * o, precision=precision)
    return o, m_new, l


def paged_prefix_loop(q, k_ref, v_ref, pt_ref, length, carry, first_blk, n_iter, *, block_k: int, page_size: int,
                      scale_log2: float, prefetch: bool, precision, ks_ref=None, vs_ref=None):
    """Online softmax of the q tile [M, D] over key blocks ``first_blk .. first_blk + n_iter - 1`` of one sequence's
    paged KV (k_ref, v_ref [n_pages * page_size, D] of one KV head). ``prefetch`` loads block i + 1 before the
    dots of block i (a register double buffer), for when Triton's pipeliner does not stage the gathers.
    Quantized pages: ks_ref, vs_ref [n_pages * page_size] f32 per-token scales of the head (k_ref / v_ref hold
    the fp8 / int8 rows, cast to q's dtype after the load); None for plain pages."""
    quantized = ks_ref is not None

    def load(blk):
        rows, visible = kv_block_rows(pt_ref, blk, length, block_k=block_k, page_size=page_size)
        if quantized:
            return k_ref[rows], v_ref[rows], visible, ks_ref[rows], vs_ref[rows]
        return k_ref[rows], v_ref[rows], visible

    def step(carry, k, v, visible, k_scale=None, v_scale=None):
        s = plt.dot(q, k.astype(q.dtype), trans_b=True, precision=precision)  # [M, block_k] f32
        s = s * scale_log2 if k_scale is None else s * (k_scale * scale_log2)[None, :]  # log2 units
        return online_update(carry, s, visible[None, :], v.astype(q.dtype), precision, v_scale)

    if not prefetch:
        return lax.fori_loop(0, n_iter, lambda i, c: step(c, *load(first_blk + i)), carry)

    def body(i, c):
        c, cur = c[:3], c[3:]
        nxt = load(first_blk + i + 1)  # past the last block: the null page, never used
        return (*step(tuple(c), *cur), *nxt)

    out = lax.fori_loop(0, n_iter, body, (*carry, *load(first_blk)))
    return tuple(out[:3])


def _kernel(q_ref, k_ref, v_ref, *refs, page_size: int, block_k: int, blocks_per_partition: int,
            scale_log2: float, split: bool, prefetch: bool, quantized: bool, precision):
    # q_ref [G, D]; k_ref, v_ref [n_pages * page_size, D] (this KV head); quantized: ks_ref, vs_ref
    # [n_pages * page_size] (this KV head's scales); pt_ref [W]; len_ref [1]
    ks_ref, vs_ref, pt_ref, len_ref, *out_refs = refs if quantized else (None, None, *refs)
    part = pl.program_id(2)
    g, d = q_ref.shape
    rows = group_rows(g)
    length = jnp.clip(len_ref[0], 0, pt_ref.shape[0] * page_size)
    n_blocks_seq = (length + block_k - 1) // block_k
    start = part * blocks_per_partition
    n_iter = jnp.maximum(jnp.minimum(start + blocks_per_partition, n_blocks_seq) - start, 0)
    q = q_ref[rows]  # [Gp, D]
    gp = q.shape[0]
    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), MASK_VALUE, jnp.float32), jnp.zeros((gp,), jnp.float32))
    o, m, l = paged_prefix_loop(q, k_ref, v_ref, pt_ref, length, init, start, n_iter, block_k=block_k,
                                page_size=page_size, scale_log2=scale_log2, prefetch=prefetch, precision=precision,
                                ks_ref=ks_ref, vs_ref=vs_ref)
    has = l > 0
    o = o / jnp.where(has, l, 1.0)[:, None]
    if split:
        o_ref, lse_ref = out_refs
        lse_ref[rows] = jnp.where(has, m + jnp.log2(jnp.where(has, l, 1.0)), MASK_VALUE)
    else:
        (o_ref,) = out_refs
    o_ref[rows] = o.astype(o_ref.dtype)


def merge_partitions(o: jax.Array, lse: jax.Array, axis: int) -> jax.Array:
    """Flash-decoding merge: o [..., S, ..., D] normalised partial outputs, lse [..., S, ...] their log2-sum-exp
    (MASK_VALUE for an empty partition) along ``axis``; returns the f32 merged output (zeros if all are empty)."""
    w = jnp.exp2(lse - lse.max(axis=axis, keepdims=True))
    return (w[..., None] * o.astype(jnp.float32)).sum(axis=axis) / w.sum(axis=axis)[..., None]


N_SM_TARGET = 132  # H200 SMs; the split heuristics aim at a couple of programs per SM


def auto_partitions(batch: int, n_kv_heads: int, n_blocks: int, *, target_programs: int = 2 * N_SM_TARGET) -> int:
    """Flash-decoding split: the most partitions that keep the grid within ``target_programs`` programs (the
    programs resident at once: 2 per SM on a 132-SM H200), never more than the key blocks of the widest
    sequence, and 1 when (sequence, KV head) pairs alone fill the target.

    Rounding down is deliberate: a memory-bound grid slightly over the resident capacity runs a second, mostly
    empty wave (e.g. 512 programs on 396 slots take ~2 waves' time for 1.3 waves of work)."""
    return int(max(1, min(n_blocks, target_programs // max(1, batch * n_kv_heads))))


def default_config(head_dim: int, page_size: int, dtype, *, backend: str | None = None,
                   quantized: bool = False) -> dict:
    """Tuning defaults by backend and shape: pages_per_block, num_warps, num_stages, prefetch, target_programs.

    32 keys per block for 256-dim bf16 heads: K and V tiles of 16 KiB each per stage, ~73 KiB of shared memory
    with 2 stages, so 3 programs fit an SM's 228 KiB and the default grid (2 programs per SM) is resident in
    one wave, each program with 64 KiB of loads in flight. ``dtype`` is the compute dtype (for quantized pages
    too: their fp8 / int8 tiles are cast to it before the dots). ``quantized`` (fp8 / int8 pages): 64-key
    blocks, the bytes per block of bf16's 32 keys (H200, B=1 at 16K: fp8 1.35x -> 1.44x of the bf16-page
    kernel, int8 1.19x -> 1.32x; experiments/results/kernels_nvidia-h200_20261203-0523.json)."""
    b = backend or current_backend()
    itemsize = jnp.dtype(dtype).itemsize
    target_k = 64 if head_dim * itemsize <= 256 else 32
    if b == "rocm":
        target_k = min(target_k, 32)
    elif quantized:
        target_k *= 2
    ppb = _next_pow2(max(1, target_k // page_size, -(-MIN_DOT // page_size)))  # block_k >= 16 for the PV dot
    return dict(pages_per_block=ppb, num_warps=4 if head_dim <= 64 else 8, num_stages=1 if b == "rocm" else 2,
                prefetch=False, target_programs=2 * N_SM_TARGET)


def split_blocks(n_blocks: int, partitions: int, op: str) -> tuple[int, int]:
    """``n_blocks`` key blocks over ``partitions`` (>= 1, else ValueError naming ``op``) -> (partitions, blocks per
    partition): at most one partition a block, the blocks spread evenly, and partitions that would be empty for
    every sequence dropped."""
    if partitions < 1:
        raise ValueError(f"{op}: num_partitions={partitions} must be >= 1")
    per = -(-n_blocks // min(partitions, n_blocks))
    return -(-n_blocks // per), per


def block_plan(*, batch: int, n_heads: int, n_kv_heads: int, head_dim: int, page_size: int, width: int,
               dtype, pages_per_block: int, num_partitions: int | None, num_stages: int,
               target_programs: int = 2 * N_SM_TARGET, prefetch: bool = False,
               smem_budget: int | None = None, backend: str | None = None, compute_dtype=None) -> dict:
    """Static shapes of a launch, checked with :func:`check_block_shapes` (raises ValueError). ``dtype`` is the
    pages' storage dtype, ``compute_dtype`` (None: the same) the dots' (quantized pages: fp8 / int8 storage)."""
    if n_heads % n_kv_heads:
        raise ValueError(f"paged_decode: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if pages_per_block < 1:
        raise ValueError(f"paged_decode: pages_per_block={pages_per_block} must be >= 1")
    g = n_heads // n_kv_heads
    gp = padded_group(g)
    block_k = pages_per_block * page_size
    isz = jnp.dtype(dtype).itemsize
    csz = jnp.dtype(compute_dtype or dtype).itemsize
    n_blocks = max(1, -(-width * page_size // block_k))
    s, blocks_per_part = split_blocks(
        n_blocks, auto_partitions(batch, n_kv_heads, n_blocks, target_programs=target_programs)
        if num_partitions is None else int(num_partitions), "paged_decode")
    kv_tile = block_k * head_dim * isz
    # Quantized pages: the tile cast to the compute dtype is the dot's operand; the stored rows are staged in
    # shared memory only when the loop is pipelined (num_stages > 1).
    kv_smem = (num_stages * kv_tile if csz == isz else
               block_k * head_dim * csz + (num_stages * kv_tile if num_stages > 1 else 0))
    smem = {
        "k": kv_smem,
        "v": kv_smem,
        "q": gp * head_dim * csz,
        "p": gp * block_k * csz,  # the probabilities go through shared memory as the PV dot's A operand
    }
    if csz != isz:
        smem["kv_scales"] = num_stages * 2 * block_k * 4
    total = check_block_shapes(
        "paged_decode",
        {"q": (gp, head_dim), "k": (block_k, head_dim), "v": (block_k, head_dim), "key_rows": (block_k,),
         "scores": (gp, block_k), "o": (gp, head_dim)},
        dots={"qk": (gp, block_k, head_dim), "pv": (gp, head_dim, block_k)},
        smem=smem, smem_budget=smem_budget, backend=backend)
    return dict(g=g, gp=gp, block_k=block_k, n_partitions=s, blocks_per_partition=blocks_per_part,
                pages_per_partition=blocks_per_part * pages_per_block, smem_bytes=total,
                kv_bytes_per_block=2 * kv_tile + (2 * block_k * 4 if csz != isz else 0),
                programs=batch * n_kv_heads * s)


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "num_partitions", "num_warps",
                                             "num_stages", "prefetch", "target_programs", "interpret", "smem_budget"))
def paged_decode(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                 lengths: jax.Array, scale: float, *, pages_per_block: int, num_partitions: int | None = 1,
                 num_warps: int | None = None, num_stages: int | None = None, prefetch: bool = False,
                 target_programs: int = 2 * N_SM_TARGET, interpret: bool = False,
                 smem_budget: int | None = None) -> jax.Array:
    """Single-token paged GQA decode attention.

    q [B, H, D]; k_pages, v_pages [n_pages, page_size, Hkv, D] arrays, or ``QuantizedPages`` (fp8 / int8 rows
    read as stored, dequantized in the kernel: computes in their compute dtype); page_table [B, W] int32 (an entry < 0
    is a non-resident page: its keys are masked and it is never read); lengths [B] int32 valid KV
    tokens (key j visible iff j < length and its page is resident; lengths are clipped to
    [0, W*page_size]; a row with no visible key returns zeros). Returns [B, H, D] in q's dtype.

    pages_per_block: pages gathered per inner step (block_k = pages_per_block * page_size tokens, a
    power of two >= 16). num_partitions: KV partitions per sequence (flash-decoding); None picks
    one by grid size (~target_programs programs). prefetch: hand-written double buffering of the K/V
    gathers. Raises ValueError (before lowering) for shapes Triton cannot take.
    """
    b, h, d = q.shape
    n_pages, page_size, hkv, dk = k_pages.shape
    if k_pages.shape != v_pages.shape or dk != d or type(k_pages) is not type(v_pages):
        raise ValueError(f"paged_decode: q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape} disagree")
    if page_table.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"paged_decode: page_table {page_table.shape} / lengths {lengths.shape} vs batch {b}")
    k_data, k_scale, cd = page_arrays(k_pages)
    v_data, v_scale, _ = page_arrays(v_pages)
    quantized = k_scale is not None
    backend = None  # current backend; off GPU (interpret mode) the checks use the H200 target's budget
    cfg = default_config(d, page_size, cd, backend=backend, quantized=quantized)
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    width = page_table.shape[1]
    plan = block_plan(batch=b, n_heads=h, n_kv_heads=hkv, head_dim=d, page_size=page_size, width=width,
                      dtype=k_data.dtype, pages_per_block=pages_per_block, num_partitions=num_partitions,
                      num_stages=num_stages, target_programs=target_programs, prefetch=prefetch,
                      smem_budget=smem_budget, backend=backend, compute_dtype=cd)
    g, s = plan["g"], plan["n_partitions"]

    # Free views (no copies): q rows of a group, pages (and scales) as token rows, lengths as [B, 1].
    rows = n_pages * page_size
    qg = q.astype(cd).reshape(b, hkv, g, d)
    kr = k_data.reshape(rows, hkv, d)
    vr = v_data.reshape(rows, hkv, d)
    scales = (k_scale.reshape(rows, hkv), v_scale.reshape(rows, hkv)) if quantized else ()
    pt = page_table.astype(jnp.int32)
    lens = lengths.astype(jnp.int32)[:, None]

    split = s > 1
    precision = lax.Precision.HIGHEST if cd == jnp.float32 else None
    kernel = functools.partial(_kernel, page_size=page_size, block_k=plan["block_k"],
                               blocks_per_partition=plan["blocks_per_partition"], scale_log2=float(scale) * LOG2E,
                               split=split, prefetch=prefetch, quantized=quantized, precision=precision)
    in_specs = [
        pl.BlockSpec((None, None, g, d), lambda i, j, p: (i, j, 0, 0)),                   # q rows of group j
        pl.BlockSpec((rows, None, d), lambda i, j, p: (0, j, 0)),                        # k token rows (head j)
        pl.BlockSpec((rows, None, d), lambda i, j, p: (0, j, 0)),                        # v token rows (head j)
        *[pl.BlockSpec((rows, None), lambda i, j, p: (0, j))] * len(scales),           # k, v scales (head j)
        pl.BlockSpec((None, width), lambda i, j, p: (i, 0)),                             # page table row
        pl.BlockSpec((None, 1), lambda i, j, p: (i, 0)),                                 # length
    ]
    if split:  # normalised partials in q's dtype (f32 for f32 inputs) and their f32 log2-sum-exp
        out_shape = [jax.ShapeDtypeStruct((b, hkv, s, g, d), q.dtype),
                     jax.ShapeDtypeStruct((b, hkv, s, g), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, g, d), lambda i, j, p: (i, j, p, 0, 0)),
                     pl.BlockSpec((None, None, None, g), lambda i, j, p: (i, j, p, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, g, d), lambda i, j, p: (i, j, 0, 0))]

    outs = pl.pallas_call(
        kernel,
        grid=(b, hkv, s),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=(f"paged_decode_gp{plan['gp']}_d{d}_bk{plan['block_k']}_s{s}{'_pf' if prefetch else ''}"
              f"{'_kv' + k_data.dtype.name if quantized else ''}"),
    )(qg, kr, vr, *scales, pt, lens)

    o = merge_partitions(*outs, axis=2) if split else outs[0]
    return o.reshape(b, h, d).astype(q.dtype)
