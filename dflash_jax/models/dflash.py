"""The DFlash block drafter as pure functions over a parameter pytree (reference §3).

Parameters (weights in the checkpoint's ``[out, in]`` layout, layers unrolled; no embedding / LM head, which
are the target's and are passed in):

  fc [D, n_feat*D], hidden_norm [D], norm [D]
  layers[i]: input_norm [D], post_norm [D],
    attn {q [H*hd, D], k [Hkv*hd, D], v [Hkv*hd, D], o [D, H*hd], q_norm [hd], k_norm [hd]},
    mlp  {gate [F, D], up [F, D], down [D, F]}

Norm weights are float32 (float64 for a float64 model) and every norm is the *plain* RMSNorm ``w * x / rms(x)``.

One draft step (``draft_forward``) runs a block ``[anchor, mask x (blk-1)]`` at positions ``start..start+blk-1``
of B sequences against each sequence's cached context K/V (``context_kv`` of the fused target features,
``fuse``). Visibility of block query ``o`` (position ``start+o``):

* context key at position ``p`` (valid): ``p < start``, and in a sliding layer also ``p >= start+o-(W-1)``;
* block key at offset ``o'``: all offsets in a full layer (bidirectional); ``o-(W-1) <= o' <= o`` in a
  sliding layer (causal; the left bound only bites when W < blk). ``cfg.is_causal`` overrides causality.

``train_forward`` runs N anchor blocks of a sequence in one pass with the same visibility per block (context
strictly before the block's anchor, its own block only), so it equals ``draft_forward`` block by block.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig
from dflash_jax.models import quant
from dflash_jax.models.qwen3_layers import qwen3_layer_shapes, random_params
from dflash_jax.models.qwen36 import acc_dtype, concat_out, joinable, linear, mlp, rms_norm, rope

Params = dict[str, Any]
F32 = jnp.float32
_NEG = -1e30  # finite, so a fully masked (padding) row gives a finite mean instead of NaN


# ---------------------------------------------------------------------------------------------
# parameter shapes and random initialisation
# ---------------------------------------------------------------------------------------------
def param_shapes(cfg: DrafterConfig, dtype=jnp.bfloat16) -> Params:
    """The parameter pytree as ``jax.ShapeDtypeStruct`` leaves."""
    S = jax.ShapeDtypeStruct
    vec = acc_dtype(dtype)
    d, layers = cfg.hidden_size, qwen3_layer_shapes(cfg, dtype, vec)
    return {"fc": S((d, cfg.fc_in), dtype), "hidden_norm": S((d,), vec), "norm": S((d,), vec), "layers": layers}


def init_params(cfg: DrafterConfig, key: jax.Array, dtype=jnp.bfloat16, norm_noise: float = 0.0,
                quantization: str | None = None) -> Params:
    """Random weights: matrices ``normal * fan_in**-0.5``, norm weights 1 (+ ``norm_noise * normal``); with
    ``quantization="fp8"`` the matmul weights are then quantized (per output channel).

    A non-zero ``norm_noise`` makes every norm weight matter (useful in tests).
    """
    return quant.quantize_params(random_params(param_shapes(cfg, dtype), key, norm_noise), quantization)


def model_dtype(params: Params) -> jnp.dtype:
    return params["fc"].dtype


# ---------------------------------------------------------------------------------------------
# context: fused target features -> per-layer K/V
# ---------------------------------------------------------------------------------------------
def fuse(params: Params, cfg: DrafterConfig, feats: jax.Array) -> jax.Array:
    """Target features ``[..., C, n_feat*D]`` (layer outputs concatenated in ``target_layer_ids`` order)
    -> fused context ``[..., C, D]`` = RMSNorm(feats @ fc^T; hidden_norm), in the model dtype."""
    x = linear(feats.astype(model_dtype(params)), params["fc"])
    return rms_norm(x, params["hidden_norm"], cfg.rms_norm_eps)


def _project_kv(p: Params, cfg: DrafterConfig, x: jax.Array, positions: jax.Array, kv: jax.Array | None = None):
    """x [B, T, D], positions [B, T] -> K (k_norm + RoPE), V: [B, T, Hkv, hd]. ``kv`` [B, T, 2 * Hkv * hd]: the k
    and v projections of x already computed (a slice of the :data:`CONTEXT_KV` matmul)."""
    b, t, _ = x.shape
    n = cfg.num_kv_heads * cfg.head_dim
    k = linear(x, p["k"]) if kv is None else kv[..., :n]
    v = linear(x, p["v"]) if kv is None else kv[..., n:]
    k = rope(rms_norm(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), p["k_norm"], cfg.rms_norm_eps), positions,
             cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return k, v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)


CONTEXT_KV = "context_kv"  # every layer's k and v projections, concatenated along out: [L * 2 * Hkv * hd, D]


def fuse_context_kv(params: Params) -> Params:
    """The drafter's params plus :data:`CONTEXT_KV`, so :func:`context_kv` projects a context for every layer in
    one matmul (without it XLA concatenates the 2L weights on every call: 49 us a round for the 27B's drafter on
    an H100). The per-layer k / v stay (a block's own keys use them); the copy costs their bytes once more (~100 MB
    at the 27B). Unchanged where the matrices cannot join (mixed formats) or are joined already."""
    ws = [w for layer in params["layers"] for w in (layer["attn"]["k"], layer["attn"]["v"])]
    if CONTEXT_KV in params or not all(joinable(ws[0], w) for w in ws[1:]):
        return params
    return {**params, CONTEXT_KV: concat_out(ws)}


def context_kv(params: Params, cfg: DrafterConfig, ctx: jax.Array, ctx_positions: jax.Array):
    """Per-layer K/V of a fused context: ``ctx [B, C, D]`` (or ``[C, D]``) at ``ctx_positions [B, C]`` (or
    ``[C]``) -> ``(ks, vs)``, tuples of ``num_layers`` arrays ``[B, C, Hkv, hd]`` (``[C, Hkv, hd]`` unbatched).

    The same k/v projections as the block, applied to the fused context itself (no per-layer input norm),
    with k_norm and RoPE at the context's absolute positions: constant once computed, so cacheable per slot.
    """
    unbatched = ctx.ndim == 2
    if unbatched:
        ctx, ctx_positions = ctx[None], ctx_positions[None]
    ctx = ctx.astype(model_dtype(params))
    fused = linear(ctx, params[CONTEXT_KV]) if CONTEXT_KV in params else None
    n = 2 * cfg.num_kv_heads * cfg.head_dim
    ks, vs = [], []
    for i, p in enumerate(params["layers"]):
        k, v = _project_kv(p["attn"], cfg, ctx, ctx_positions, None if fused is None else fused[..., i * n:(i + 1) * n])
        ks.append(k[0] if unbatched else k)
        vs.append(v[0] if unbatched else v)
    return tuple(ks), tuple(vs)


# ---------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------
def context_mask(ctx_positions: jax.Array, ctx_valid: jax.Array, anchors: jax.Array, blk: int,
                 window: int | None) -> jax.Array:
    """Visibility of context keys to block queries: ``[B, N, blk, C]``.

    ctx_positions, ctx_valid: [B, C]; anchors: [B, N] (the block start positions).
    """
    qpos = anchors[:, :, None] + jnp.arange(blk, dtype=anchors.dtype)  # [B, N, blk]
    cp = ctx_positions[:, None, None, :]
    m = ctx_valid[:, None, None, :] & (cp < anchors[:, :, None, None])
    if window is not None:
        m = m & (cp >= qpos[..., None] - (window - 1))
    return jnp.broadcast_to(m, qpos.shape + ctx_positions.shape[-1:])


def block_mask(blk: int, causal: bool, window: int | None) -> jax.Array:
    """Visibility of a block's own keys to its queries: ``[blk (query), blk (key)]``."""
    o = jnp.arange(blk)
    m = jnp.ones((blk, blk), bool)
    if causal:
        m = m & (o[None, :] <= o[:, None])
    if window is not None:
        m = m & (o[None, :] >= o[:, None] - (window - 1))
    return m


# ---------------------------------------------------------------------------------------------
# the layers over N blocks
# ---------------------------------------------------------------------------------------------
def _attend(q: jax.Array, kc: jax.Array, vc: jax.Array, cmask: jax.Array, kb: jax.Array, vb: jax.Array,
            bmask: jax.Array) -> jax.Array:
    """GQA attention of block queries over context keys plus their own block's keys, one softmax.

    q [B,N,T,H,hd]; kc, vc [B,C,Hkv,hd]; cmask [B,N,T,C]; kb, vb [B,N,T,Hkv,hd]; bmask [T,T] -> [B,N,T,H,hd].
    """
    b, n, t, h, hd = q.shape
    hkv = kc.shape[2]
    a = acc_dtype(q.dtype)
    qg = q.reshape(b, n, t, hkv, h // hkv, hd)
    scale = hd ** -0.5
    sc = jnp.einsum("bnqkgd,bskd->bnkgqs", qg, kc, preferred_element_type=a) * scale
    sb = jnp.einsum("bnqkgd,bnpkd->bnkgqp", qg, kb, preferred_element_type=a) * scale
    sc = jnp.where(cmask[:, :, None, None], sc, _NEG)
    sb = jnp.where(bmask[None, None, None, None], sb, _NEG)
    # one softmax over context and block keys, without concatenating the two score arrays
    m = jnp.maximum(jnp.max(sc, axis=-1, keepdims=True), jnp.max(sb, axis=-1, keepdims=True))
    ec, eb = jnp.exp(sc - m), jnp.exp(sb - m)
    den = jnp.sum(ec, axis=-1, keepdims=True) + jnp.sum(eb, axis=-1, keepdims=True)
    pc, pb = ec / den, eb / den
    o = (jnp.einsum("bnkgqs,bskd->bnqkgd", pc.astype(vc.dtype), vc, preferred_element_type=a)
         + jnp.einsum("bnkgqp,bnpkd->bnqkgd", pb.astype(vb.dtype), vb, preferred_element_type=a))
    return o.reshape(b, n, t, h, hd).astype(q.dtype)


def anchor_query(cfg: DrafterConfig, qs: list[jax.Array]) -> jax.Array:
    """The anchor's (block 0, offset 0) queries of the full-attention layers, one vector per KV group.

    qs: per full layer ``[B, N*blk, H, hd]`` (after q_norm and RoPE) -> float32 ``[B, n_full*Hkv*hd]``: each
    group's queries summed over its heads and scaled by ``hd**-0.5``, so that its dot product with a page's mean
    context keys (``[n_full, Hkv, hd]`` flattened) is the summed attention logits of the anchor over that mean key.
    """
    if not qs:
        raise ValueError("the drafter has no full-attention layer: it has no anchor query over the whole context")
    hkv, hd = cfg.num_kv_heads, cfg.head_dim
    out = [q[:, 0].astype(F32).reshape(q.shape[0], hkv, -1, hd).sum(axis=2).reshape(q.shape[0], hkv * hd)
           for q in qs]
    return jnp.concatenate(out, axis=1) * hd ** -0.5


def _per_layer(x, cfg: DrafterConfig, dtype=None) -> tuple:
    """A context array given once (``[B, C]``, every layer's) or per layer (a tuple) -> one per layer, cast to
    ``dtype``; a layer's entry is the same object as every other layer's it equals (the masks key on it)."""
    if not isinstance(x, (tuple, list)):
        x = x if dtype is None else x.astype(dtype)
        return (x,) * cfg.num_layers
    cast: dict[int, jax.Array] = {}
    for a in x:
        if id(a) not in cast:
            cast[id(a)] = a if dtype is None else a.astype(dtype)
    return tuple(cast[id(a)] for a in x)


def _blocks(params: Params, cfg: DrafterConfig, h: jax.Array, anchors: jax.Array, ctx_k, ctx_v,
            ctx_positions, ctx_valid, with_query: bool = False):
    """Run N blocks per sequence through every layer. h [B,N,blk,D] (embedded block tokens); anchors [B,N];
    ctx_k[i], ctx_v[i] [B,C,Hkv,hd]; ctx_positions, ctx_valid [B,C], or tuples of them per layer (layer i's
    context, ``[B, C_i]``: e.g. only a sliding layer's window). Returns RMSNorm(h; norm) [B,N,blk,D]; with
    ``with_query`` also the first block's ``anchor_query`` [B, n_full*Hkv*hd] (the layers' arithmetic is the same
    either way)."""
    b, n, blk, d = h.shape
    hq, hd, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    full_qs: list[jax.Array] = []
    pos = (anchors[:, :, None] + jnp.arange(blk, dtype=anchors.dtype)).reshape(b, n * blk)
    ctx_positions, ctx_valid = _per_layer(ctx_positions, cfg), _per_layer(ctx_valid, cfg)
    cmasks: dict[tuple[int | None, int, int], jax.Array] = {}  # layers of one window over one context share one
    bmasks: dict[tuple[bool, int | None], jax.Array] = {}
    for i, p in enumerate(params["layers"]):
        w, causal = cfg.layer_window(i), cfg.layer_causal(i)
        ckey = (w, id(ctx_positions[i]), id(ctx_valid[i]))
        if ckey not in cmasks:
            cmasks[ckey] = context_mask(ctx_positions[i], ctx_valid[i], anchors, blk, w)
        if (causal, w) not in bmasks:
            bmasks[(causal, w)] = block_mask(blk, causal, w)
        a = p["attn"]
        u = rms_norm(h, p["input_norm"], eps).reshape(b, n * blk, d)
        q = linear(u, a["q"]).reshape(b, n * blk, hq, hd)
        q = rope(rms_norm(q, a["q_norm"], eps), pos, hd, cfg.rope_theta, cfg.rope_scaling)
        if with_query and i in cfg.full_layers:
            full_qs.append(q)
        kb, vb = _project_kv(a, cfg, u, pos)
        o = _attend(q.reshape(b, n, blk, hq, hd), ctx_k[i], ctx_v[i], cmasks[ckey],
                    kb.reshape(b, n, blk, cfg.num_kv_heads, hd), vb.reshape(b, n, blk, cfg.num_kv_heads, hd),
                    bmasks[(causal, w)])
        h = h + linear(o.reshape(b, n, blk, hq * hd), a["o"])
        h = h + mlp(p["mlp"], rms_norm(h, p["post_norm"], eps))
    h = rms_norm(h, params["norm"], eps)
    return (h, anchor_query(cfg, full_qs)) if with_query else h


def _logits(h: jax.Array, lm_head: jax.Array) -> jax.Array:
    return linear(h, lm_head, acc_dtype(h.dtype))


def make_blocks(cfg: DrafterConfig, anchor_tokens: jax.Array) -> jax.Array:
    """``[...]`` anchor token ids -> ``[..., blk]`` blocks ``[anchor, mask, ..., mask]``."""
    rest = jnp.full(anchor_tokens.shape + (cfg.block_size - 1,), cfg.mask_token_id, anchor_tokens.dtype)
    return jnp.concatenate([anchor_tokens[..., None], rest], axis=-1)


# ---------------------------------------------------------------------------------------------
# inference: one draft step for B sequences
# ---------------------------------------------------------------------------------------------
def draft_hidden(params: Params, cfg: DrafterConfig, embed: jax.Array, block_tokens: jax.Array,
                 block_start: jax.Array, ctx_k, ctx_v, ctx_positions, ctx_valid, with_query: bool = False):
    """``draft_forward`` up to the final norm: ``[B, blk, D]`` (and the ``anchor_query`` with ``with_query``)."""
    h = jnp.asarray(embed)[block_tokens].astype(model_dtype(params))[:, None]  # [B, 1, blk, D]
    ctx_positions = _per_layer(ctx_positions, cfg, jnp.int32)
    ctx_valid = _per_layer(ctx_valid, cfg, bool)
    out = _blocks(params, cfg, h, block_start[:, None].astype(jnp.int32), ctx_k, ctx_v, ctx_positions, ctx_valid,
                  with_query)
    return (out[0][:, 0], out[1]) if with_query else out[:, 0]


def draft_forward(params: Params, cfg: DrafterConfig, embed: jax.Array, lm_head: jax.Array,
                  block_tokens: jax.Array, block_start: jax.Array, ctx_k, ctx_v, ctx_positions, ctx_valid,
                  with_query: bool = False):
    """One draft step of B sequences -> float32 logits ``[B, blk, V]``.

    embed, lm_head: the TARGET's ``[V, D]`` embedding and LM head. block_tokens ``[B, blk]`` (normally
    ``[anchor, mask...]``, see ``make_blocks``) at positions ``block_start[b] + 0..blk-1``; ``block_start [B]``.
    ctx_k[i], ctx_v[i] ``[B, C, Hkv, hd]`` (from ``context_kv``, padded to a static C); ctx_positions ``[B, C]``
    and ctx_valid ``[B, C]`` (padding False), or tuples of them per layer (each layer's own ``C_i``, e.g. a
    sliding layer's window only). Only valid context keys with position < block_start are seen.
    Drafts are the argmax/samples at offsets 1..blk-1. ``with_query``: returns ``(logits, anchor_query [B, F])``
    (the anchor's full-layer queries per KV group, for KVFlash's drafter scoring), the logits unchanged.
    """
    out = draft_hidden(params, cfg, embed, block_tokens, block_start, ctx_k, ctx_v, ctx_positions, ctx_valid,
                       with_query)
    return (_logits(out[0], lm_head), out[1]) if with_query else _logits(out, lm_head)


# ---------------------------------------------------------------------------------------------
# training: N anchor blocks per sequence in one pass
# ---------------------------------------------------------------------------------------------
def train_forward(params: Params, cfg: DrafterConfig, embed: jax.Array, lm_head: jax.Array, feats: jax.Array,
                  tokens: jax.Array, anchors: jax.Array, seq_valid: jax.Array | None = None) -> jax.Array:
    """The training forward (§3.3) -> float32 logits ``[B, N, blk, V]``.

    feats ``[B, S, n_feat*D]`` (or ``[S, ...]``): target features of every position (teacher forcing);
    tokens ``[B, S]``: the sequence; anchors ``[B, N]``: block start positions (< S). Block n is
    ``[tokens[a_n], mask...]`` at positions ``a_n..a_n+blk-1``; it sees context positions ``< a_n`` (within
    the window in sliding layers), its own block, and nothing of other blocks. seq_valid ``[B, S]``
    (default all True) hides padding positions of the context.
    """
    if feats.ndim == 2:
        feats, tokens, anchors = feats[None], tokens[None], anchors[None]
        seq_valid = None if seq_valid is None else seq_valid[None]
    b, s = tokens.shape
    anchors = anchors.astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    valid = jnp.ones((b, s), bool) if seq_valid is None else seq_valid.astype(bool)
    ks, vs = context_kv(params, cfg, fuse(params, cfg, feats), positions)
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, N]
    h = jnp.asarray(embed)[make_blocks(cfg, anchor_tok)].astype(model_dtype(params))  # [B, N, blk, D]
    return _logits(_blocks(params, cfg, h, anchors, ks, vs, positions, valid), lm_head)


def sample_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int) -> tuple[jax.Array, jax.Array]:
    """Up to ``num_anchors`` distinct anchors per row, uniformly among positions a with
    ``loss_mask[a] & loss_mask[a+1]``, sorted. loss_mask ``[B, S]`` -> (anchors ``[B, N]`` int32,
    anchor_valid ``[B, N]``; invalid entries have anchor 0 and are placed last)."""
    b, s = loss_mask.shape
    lm = loss_mask.astype(bool)
    ok = jnp.concatenate([lm[:, :-1] & lm[:, 1:], jnp.zeros((b, 1), bool)], axis=1)
    score = jnp.where(ok, jax.random.uniform(key, (b, s)), -1.0)
    top, idx = jax.lax.top_k(score, num_anchors)
    valid = top >= 0
    order = jnp.argsort(jnp.where(valid, idx, s + idx), axis=1)  # valid sorted by position, then the rest
    anchors = jnp.take_along_axis(jnp.where(valid, idx, 0), order, axis=1).astype(jnp.int32)
    return anchors, jnp.take_along_axis(valid, order, axis=1)


def block_labels(cfg: DrafterConfig, tokens: jax.Array, anchors: jax.Array, loss_mask: jax.Array | None = None,
                 anchor_valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Labels and validity for ``train_forward``'s logits: label at offset k of block n is
    ``tokens[a_n + k]``; valid iff ``a_n + k < S``, ``loss_mask[a_n + k]`` and the anchor is valid
    (offset 0 is returned valid-as-data but carries zero loss weight). -> (labels, valid) ``[B, N, blk]``."""
    b, s = tokens.shape
    pos = anchors[:, :, None] + jnp.arange(cfg.block_size)  # [B, N, blk]
    inside = pos < s
    pc = jnp.clip(pos, 0, s - 1).reshape(b, -1)
    labels = jnp.take_along_axis(tokens, pc, axis=1).reshape(pos.shape)
    valid = inside
    if loss_mask is not None:
        valid = valid & jnp.take_along_axis(loss_mask.astype(bool), pc, axis=1).reshape(pos.shape)
    if anchor_valid is not None:
        valid = valid & anchor_valid[:, :, None]
    return labels, valid


def loss_weights(blk: int, gamma: float = 7.0) -> jax.Array:
    """Per-offset loss weights ``[blk]``: 0 at offset 0, ``exp(-(k-1)/gamma)`` at offset k >= 1."""
    k = jnp.arange(blk, dtype=F32)
    return jnp.where(k >= 1, jnp.exp(-(k - 1) / gamma), 0.0)


def dflash_loss(logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None,
                gamma: float = 7.0) -> jax.Array:
    """The DFlash objective: ``sum w_k m CE(logits, labels) / sum w_k m`` (0 if nothing is supervised).

    logits ``[..., blk, V]``; labels ``[..., blk]``; weights ``[..., blk]`` the per-label validity / loss mask
    (bool or float, default all 1), multiplied by the position decay ``loss_weights(blk, gamma)`` (offset 0
    unsupervised).
    """
    blk = logits.shape[-2]
    w = jnp.broadcast_to(loss_weights(blk, gamma), labels.shape)
    if weights is not None:
        w = w * weights.astype(F32)
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-9)


def acceptance_length(logits: jax.Array, labels: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Greedy acceptance length per block ``[...]``: 1 + the length of the correct prefix of the drafts at
    offsets 1..blk-1 (an invalid label ends the prefix)."""
    hit = jnp.argmax(logits, axis=-1) == labels
    if valid is not None:
        hit = hit & valid.astype(bool)
    return 1 + jnp.sum(jnp.cumprod(hit[..., 1:].astype(jnp.int32), axis=-1), axis=-1)
