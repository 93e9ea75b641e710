"""Paged attention entry points for the full-attention layers.

K/V live in pages (``KVPages``): ``k_pages, v_pages: [n_pages, page_size, n_kv_heads, head_dim]``.
A sequence's page table ``[W]`` lists its physical pages in logical order, 0-padded (page 0 is null).
A negative entry marks a logical page that is not resident (bounded KV residency): its keys are
masked, nothing is read from or written to it (reads and writes go to the null page instead).

``paged_attention`` and ``tree_attention`` dispatch through :mod:`pallas_kernels.registry`
(ops ``"paged_decode"`` for the T = 1 case and ``"tree_attention"``): the pure-``jnp`` bodies are
``paged_attention_reference`` / ``tree_attention_reference``, the default off GPU; on a GPU the
Pallas kernels are the default; ``DFLASH_KERNELS=op=impl`` overrides either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.kv import quant as kv_quant

_NEG = -1e30  # finite, so a fully masked (padding) row gives a finite mean instead of NaN


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, page_table: jax.Array,
             positions: jax.Array, valid: jax.Array, key_feedback: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V into pages.

    k, v: [B, T, Hkv, D]; page_table: [B, W]; positions, valid: [B, T]. Padding tokens, tokens whose logical page
    is not resident (table entry < 0) and tokens of the null page (entry 0) are not written (``kv.scatter``).
    key_feedback [Hkv, D, D]: quantized key pages round with this error feedback (``kv.calibration``).
    """
    ps = k_pages.shape[1]
    page = jnp.take_along_axis(page_table, jnp.clip(positions // ps, 0, page_table.shape[1] - 1), axis=1)
    keep = valid & (page > 0)
    off = positions % ps
    k_pages = kv_quant.set_rows(k_pages, page, off, k, keep, key_feedback)
    v_pages = kv_quant.set_rows(v_pages, page, off, v, keep)
    return k_pages, v_pages


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """[n_pages, ps, Hkv, D] x [B, W] -> the logical view [B, W*ps, Hkv, D] (non-resident pages read as the null
    page; quantized pages dequantized)."""
    g = kv_quant.take(pages, jnp.maximum(page_table, 0))  # [B, W, ps, Hkv, D]
    b, w, ps = g.shape[:3]
    return g.reshape((b, w * ps) + g.shape[3:])


def resident_tokens(page_table: jax.Array, page_size: int) -> jax.Array:
    """[B, W] page table -> [B, W*page_size] bool: the token's logical page is resident (entry >= 0)."""
    return jnp.repeat(page_table >= 0, page_size, axis=1)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                              q_positions: jax.Array, scale: float) -> jax.Array:
    """Causal GQA attention of new queries over a sequence's paged K/V (already holding them).

    q: [B, T, H, D]; q_positions: [B, T] absolute positions; key j is visible iff j <= q_position and
    its page is resident. Returns [B, T, H, D] in q's dtype. Softmax in float32.
    """
    k = gather_pages(k_pages, page_table)
    v = gather_pages(v_pages, page_table)
    b, t, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, h // hkv, d)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=acc) * scale
    kv_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    mask = (kv_pos[None, None, :] <= q_positions[:, :, None]) & resident_tokens(page_table, k_pages.shape[1])[:, None]
    s = jnp.where(mask[:, None, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=acc)
    return o.reshape(b, t, h, d).astype(q.dtype)


def paged_attention_blocked(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                            q_positions: jax.Array, scale: float, block_pages: int = 64) -> jax.Array:
    """:func:`paged_attention_reference`'s contract in blocks of ``block_pages`` pages with an online softmax,
    visiting only the blocks up to the batch's furthest query position (the others skipped), so a prefill
    chunk costs O(prefix) instead of O(page-table width)."""
    b, t, h, d = q.shape
    ps, hkv = k_pages.shape[1], k_pages.shape[2]
    w = page_table.shape[1]
    bp = max(1, min(block_pages, w))
    n_blocks = -(-w // bp)
    table = jnp.pad(page_table, ((0, 0), (0, n_blocks * bp - w)), constant_values=-1)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.reshape(b, t, hkv, h // hkv, d)
    need = jnp.minimum((jnp.max(q_positions) + bp * ps) // (bp * ps), n_blocks).astype(jnp.int32)

    def body(i, carry):
        m, l, o = carry
        tbl = jax.lax.dynamic_slice_in_dim(table, i * bp, bp, axis=1)  # [B, bp]
        k = gather_pages(k_pages, tbl)  # [B, bp*ps, Hkv, D]
        v = gather_pages(v_pages, tbl)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=acc) * scale
        kv_pos = i * bp * ps + jnp.arange(bp * ps, dtype=jnp.int32)
        mask = (kv_pos[None, None, :] <= q_positions[:, :, None]) & resident_tokens(tbl, ps)[:, None]
        s = jnp.where(mask[:, None, None], s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(-1)
        o = alpha[..., None] * o + jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=acc)
        return m_new, l, o

    g = h // hkv
    init = (jnp.full((b, hkv, g, t), _NEG, acc), jnp.zeros((b, hkv, g, t), acc), jnp.zeros((b, hkv, g, t, d), acc))
    # a scan over every block with the ones past ``need`` skipped by a cond: the trip count stays static, so the
    # function remains differentiable (training runs it), while the skipped blocks cost nothing
    def step(carry, i):
        return jax.lax.cond(i < need, body, lambda _, c: c, i, carry), None

    (_, l, o), _ = jax.lax.scan(step, init, jnp.arange(n_blocks, dtype=jnp.int32))
    o = o / l[..., None]
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, t, h, d).astype(q.dtype)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                    q_positions: jax.Array, scale: float) -> jax.Array:
    """:func:`paged_attention_reference`'s contract; a single new token (T = 1) runs the registry's
    ``"paged_decode"`` op (length = q_position + 1; plain or quantized pages) when it resolves to a kernel;
    everything else (prefill chunks, decode where the registry picks the reference) :func:`paged_attention_blocked`."""
    if q.shape[1] == 1:
        from pallas_kernels import registry

        impl = registry.resolve("paged_decode")
        if impl.name != "reference":
            lengths = q_positions[:, 0].astype(jnp.int32) + 1
            return impl.fn(q[:, 0], k_pages, v_pages, page_table, lengths, scale)[:, None]
    return paged_attention_blocked(q, k_pages, v_pages, page_table, q_positions, scale)


def tree_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                             start: jax.Array, k_tree: jax.Array, v_tree: jax.Array, ancestors: jax.Array,
                             scale: float) -> jax.Array:
    """Tree queries over each sequence's committed paged prefix plus its own tree.

    q: [B, N, H, D]; the prefix is keys at positions < start [B] (on resident pages) read through
    page_table [B, W]; k_tree, v_tree: [B, N, Hkv, D] the tree's own K/V, visible to slot i iff
    ancestors[b, i, j]. One softmax over prefix and tree keys together. Returns [B, N, H, D] in q's dtype.
    """
    kp = gather_pages(k_pages, page_table)
    vp = gather_pages(v_pages, page_table)
    b, n, h, d = q.shape
    hkv = kp.shape[2]
    acc = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.reshape(b, n, hkv, h // hkv, d)
    s_pre = jnp.einsum("btkgd,bskd->bkgts", qg, kp, preferred_element_type=acc) * scale
    s_tree = jnp.einsum("btkgd,bskd->bkgts", qg, k_tree.astype(q.dtype), preferred_element_type=acc) * scale
    pre_mask = ((jnp.arange(kp.shape[1], dtype=jnp.int32)[None, :] < start[:, None])
                & resident_tokens(page_table, k_pages.shape[1]))  # [B, S]
    s_pre = jnp.where(pre_mask[:, None, None, None, :], s_pre, _NEG)
    s_tree = jnp.where(ancestors[:, None, None], s_tree, _NEG)
    p = jax.nn.softmax(jnp.concatenate([s_pre, s_tree], axis=-1), axis=-1)
    v_all = jnp.concatenate([vp, v_tree.astype(vp.dtype)], axis=1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v_all.dtype), v_all, preferred_element_type=acc)
    return o.reshape(b, n, h, d).astype(q.dtype)


def tree_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, start: jax.Array,
                   k_tree: jax.Array, v_tree: jax.Array, ancestors: jax.Array, scale: float) -> jax.Array:
    """:func:`tree_attention_reference`'s contract, run by the registry's ``"tree_attention"`` op (plain or
    quantized pages; the reference dequantizes quantized pages as it gathers, the kernel as it loads them)."""
    from pallas_kernels import registry

    return registry.get("tree_attention")(q, k_pages, v_pages, page_table, start, k_tree, v_tree, ancestors, scale)
