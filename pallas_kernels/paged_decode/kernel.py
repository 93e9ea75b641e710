"""Pallas (Triton lowering) kernel for single-token paged decode attention, GQA-grouped.

Layout is the engine's: ``k_pages, v_pages [n_pages, page_size, Hkv, D]`` (token-major, KV heads
interleaved), ``page_table [B, W]`` with page 0 the null page, ``lengths [B]`` valid tokens.

Grid ``(B, Hkv, S)``: one program per (sequence, KV head, KV partition). A program holds the
G = H / Hkv query heads of its group as the rows of one ``[Gp, D]`` tile (G padded to a power of two
>= 16, since ``tl.dot`` needs M >= 16), so each KV head's pages are read once for the whole group.
It walks its partition's pages ``pages_per_block`` at a time (gathering them by page index from the
page table, which is an ordinary input: the Triton lowering has no scalar prefetch), stopping at
the sequence's last page, with an online softmax in base 2 (bf16 or f32 in, f32 accumulate).

With S = 1 the program normalises and writes the output. With S > 1 (flash-decoding, for long
contexts and small batches) each program writes unnormalised partial ``(o, m, l)`` in f32 and a
small jnp step merges the partitions; partitions past a sequence's end do no work.

Facts taken from jax's (deprecated) ``pallas/ops/gpu/paged_attention.py`` and ``decode_attention.py``:
a whole-array BlockSpec for the pages (Triton refs are HBM pointers, a big block costs nothing),
vector-index gathers ``ref[page_ids]`` reshaped to ``[block_k, D]``, a finite mask value, split-K
merged outside the kernel.
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

from pallas_kernels.registry import check_block_shapes, current_backend

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: exp2(mask - m) is 0, never NaN
LOG2E = math.log2(math.e)
MIN_DOT = 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def padded_group(g: int) -> int:
    """Rows of the q tile: the GQA group size padded to a power of two >= 16."""
    return max(MIN_DOT, _next_pow2(g))


def _kernel(q_ref, k_ref, v_ref, pt_ref, len_ref, *out_refs, page_size: int, pages_per_block: int,
            pages_per_partition: int, scale_log2: float, split: bool, precision):
    # q_ref [Gp, D]; k_ref, v_ref [n_pages, page_size, D] (this KV head); pt_ref [Wp]; len_ref [1]
    part = pl.program_id(2)
    gp, d = q_ref.shape
    block_k = pages_per_block * page_size
    length = len_ref[0]
    n_pages_seq = (length + page_size - 1) // page_size
    start = part * pages_per_partition
    end = jnp.minimum(start + pages_per_partition, n_pages_seq)
    n_iter = jnp.maximum((end - start + pages_per_block - 1) // pages_per_block, 0)
    q = q_ref[...]

    def body(i, carry):
        o, m, l = carry
        first = start + i * pages_per_block
        pages = pt_ref[pl.ds(first, pages_per_block)]
        # Pages past the sequence's end (inside its last block) and non-resident pages (entry < 0)
        # read the null page, whatever the table holds there: their keys are masked, and the load
        # stays in bounds.
        pages = jnp.where((first + jnp.arange(pages_per_block) < n_pages_seq) & (pages >= 0), pages, 0)
        k = k_ref[pages].reshape(block_k, d)
        v = v_ref[pages].reshape(block_k, d)
        s = plt.dot(q, k, trans_b=True, precision=precision) * scale_log2  # [Gp, block_k] f32, log2 units
        tok = first * page_size + jnp.arange(block_k)
        tok_page = pt_ref[first + jnp.arange(block_k) // page_size]  # each key's table entry
        visible = ((tok < length) & (tok_page >= 0))[None, :]
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(visible, jnp.exp2(s - m_new[:, None]), 0.0)  # a block with no visible key adds nothing
        l = alpha * l + p.sum(axis=-1)
        o = alpha[:, None] * o + plt.dot(p.astype(v.dtype), v, precision=precision)
        return o, m_new, l

    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), MASK_VALUE, jnp.float32), jnp.zeros((gp,), jnp.float32))
    o, m, l = lax.fori_loop(0, n_iter, body, init)
    if split:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l
    else:
        (o_ref,) = out_refs
        o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def auto_partitions(batch: int, n_kv_heads: int, n_blocks: int, *, target_programs: int = 264) -> int:
    """Flash-decoding split: enough partitions for ~``target_programs`` programs (2 per SM on a
    132-SM H200), never more than the page blocks of the widest sequence."""
    return int(max(1, min(n_blocks, -(-target_programs // max(1, batch * n_kv_heads)))))


def default_config(head_dim: int, page_size: int, dtype, *, backend: str | None = None) -> dict:
    """Tuning defaults by backend and shape: pages_per_block, num_warps, num_stages."""
    b = backend or current_backend()
    itemsize = jnp.dtype(dtype).itemsize
    target_k = 64 if head_dim * itemsize <= 256 else 32  # tokens per block: K+V tiles of ~32 KiB per stage
    if b == "rocm":
        target_k = min(target_k, 32)
    ppb = _next_pow2(max(1, target_k // page_size, -(-MIN_DOT // page_size)))  # block_k >= 16 for the PV dot
    return dict(pages_per_block=ppb, num_warps=4 if head_dim <= 64 else 8,
                num_stages=1 if b == "rocm" else 2)


def block_plan(*, batch: int, n_heads: int, n_kv_heads: int, head_dim: int, page_size: int, width: int,
               dtype, pages_per_block: int, num_partitions: int | None, num_stages: int,
               smem_budget: int | None = None, backend: str | None = None) -> dict:
    """Static shapes of a launch, checked with :func:`check_block_shapes` (raises ValueError)."""
    if n_heads % n_kv_heads:
        raise ValueError(f"paged_decode: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if pages_per_block < 1:
        raise ValueError(f"paged_decode: pages_per_block={pages_per_block} must be >= 1")
    g = n_heads // n_kv_heads
    gp = padded_group(g)
    block_k = pages_per_block * page_size
    isz = jnp.dtype(dtype).itemsize
    n_blocks = -(-width // pages_per_block)
    s = auto_partitions(batch, n_kv_heads, n_blocks) if num_partitions is None else int(num_partitions)
    if s < 1:
        raise ValueError(f"paged_decode: num_partitions={num_partitions} must be >= 1")
    s = min(s, n_blocks)
    blocks_per_part = -(-n_blocks // s)
    s = -(-n_blocks // blocks_per_part)  # drop partitions that would be empty for every sequence
    smem = {
        "k": num_stages * block_k * head_dim * isz,
        "v": num_stages * block_k * head_dim * isz,
        "q": gp * head_dim * isz,
        "p": gp * block_k * isz,  # the probabilities go through shared memory as the PV dot's A operand
    }
    total = check_block_shapes(
        "paged_decode",
        {"q": (gp, head_dim), "k": (pages_per_block, page_size, head_dim), "v": (pages_per_block, page_size, head_dim),
         "page_ids": (pages_per_block,), "scores": (gp, block_k), "o": (gp, head_dim)},
        dots={"qk": (gp, block_k, head_dim), "pv": (gp, head_dim, block_k)},
        smem=smem, smem_budget=smem_budget, backend=backend)
    return dict(g=g, gp=gp, block_k=block_k, n_partitions=s, pages_per_partition=blocks_per_part * pages_per_block,
                padded_width=s * blocks_per_part * pages_per_block, smem_bytes=total)


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "num_partitions", "num_warps",
                                             "num_stages", "interpret", "smem_budget"))
def paged_decode(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                 lengths: jax.Array, scale: float, *, pages_per_block: int, num_partitions: int | None = 1,
                 num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False,
                 smem_budget: int | None = None) -> jax.Array:
    """Single-token paged GQA decode attention.

    q [B, H, D]; k_pages, v_pages [n_pages, page_size, Hkv, D]; page_table [B, W] int32 (an entry < 0
    is a non-resident page: its keys are masked and it is never read); lengths [B] int32 valid KV
    tokens (key j visible iff j < length and its page is resident; lengths are clipped to
    [0, W*page_size]; a row with no visible key returns zeros). Returns [B, H, D] in q's dtype.

    pages_per_block: pages gathered per inner step (block_k = pages_per_block * page_size tokens, a
    power of two >= 16). num_partitions: KV partitions per sequence (flash-decoding); None picks
    one by batch size. Raises ValueError (before lowering) for shapes Triton cannot take.
    """
    b, h, d = q.shape
    n_pages, page_size, hkv, dk = k_pages.shape
    if k_pages.shape != v_pages.shape or dk != d:
        raise ValueError(f"paged_decode: q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape} disagree")
    if page_table.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"paged_decode: page_table {page_table.shape} / lengths {lengths.shape} vs batch {b}")
    backend = None  # current backend; off GPU (interpret mode) the checks use the H200 target's budget
    cfg = default_config(d, page_size, k_pages.dtype, backend=backend)
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    width = page_table.shape[1]
    plan = block_plan(batch=b, n_heads=h, n_kv_heads=hkv, head_dim=d, page_size=page_size, width=width,
                      dtype=k_pages.dtype, pages_per_block=pages_per_block, num_partitions=num_partitions,
                      num_stages=num_stages, smem_budget=smem_budget, backend=backend)
    g, gp, s = plan["g"], plan["gp"], plan["n_partitions"]
    ppp, wp = plan["pages_per_partition"], plan["padded_width"]

    qg = q.reshape(b, hkv, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    pt = page_table.astype(jnp.int32)
    if wp != width:
        pt = jnp.pad(pt, ((0, 0), (0, wp - width)))  # null page
    lens = jnp.clip(lengths.astype(jnp.int32), 0, width * page_size)[:, None]  # [B, 1]

    split = s > 1
    precision = lax.Precision.HIGHEST if k_pages.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, page_size=page_size, pages_per_block=pages_per_block,
                               pages_per_partition=ppp, scale_log2=float(scale) * LOG2E, split=split,
                               precision=precision)
    in_specs = [
        pl.BlockSpec((None, None, gp, d), lambda i, j, p: (i, j, 0, 0)),                  # q
        pl.BlockSpec((n_pages, page_size, None, d), lambda i, j, p: (0, 0, j, 0)),       # k_pages (head j)
        pl.BlockSpec((n_pages, page_size, None, d), lambda i, j, p: (0, 0, j, 0)),       # v_pages (head j)
        pl.BlockSpec((None, wp), lambda i, j, p: (i, 0)),                                # page table row
        pl.BlockSpec((None, 1), lambda i, j, p: (i, 0)),                                 # length
    ]
    if split:
        out_shape = [jax.ShapeDtypeStruct((b, hkv, s, gp, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, s, gp), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, s, gp), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, gp, d), lambda i, j, p: (i, j, p, 0, 0)),
                     pl.BlockSpec((None, None, None, gp), lambda i, j, p: (i, j, p, 0)),
                     pl.BlockSpec((None, None, None, gp), lambda i, j, p: (i, j, p, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, hkv, gp, d), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, gp, d), lambda i, j, p: (i, j, 0, 0))]

    outs = pl.pallas_call(
        kernel,
        grid=(b, hkv, s),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_decode_gp{gp}_d{d}_bk{plan['block_k']}_s{s}",
    )(qg, k_pages, v_pages, pt, lens)

    if split:
        o, m, l = outs
        m_max = m.max(axis=2, keepdims=True)
        a = jnp.exp2(m - m_max)                                   # [B, Hkv, S, Gp]; 0 for empty partitions
        l_tot = (a * l).sum(axis=2)                               # [B, Hkv, Gp]
        o = (a[..., None] * o).sum(axis=2) / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]
    else:
        (o,) = outs
    return o[:, :, :g].reshape(b, h, d).astype(q.dtype)
