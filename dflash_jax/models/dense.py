"""A plain Qwen3 dense causal LM (HF ``model_type`` ``qwen3``) as pure functions over a parameter pytree.

Used as the PFlash prompt scorer (reference §5: a small same-tokenizer model prefills the whole prompt and the
attention of its last prompt tokens ranks the earlier ones). Architecture: plain RMSNorm ``w * x / rms(x)``,
per-head q/k RMSNorm before RoPE, full-dim NEOX RoPE, GQA, SwiGLU MLP, tied or untied embeddings.

Parameters (weights in the checkpoint's ``[out, in]`` layout, layers unrolled):

  embed [V, D], lm_head [V, D] (the embedding itself when tied), final_norm [D]
  layers[i]: input_norm [D], post_norm [D],
    attn {q [H*hd, D], k [Hkv*hd, D], v [Hkv*hd, D], o [D, H*hd], q_norm [hd], k_norm [hd]},
    mlp  {gate [F, D], up [F, D], down [D, F]}

Norm weights are float32 (float64 for a float64 model); matrices use the model dtype.

Long prompts run through ``prefill_chunked``: fixed-size chunks against a contiguous (non-paged) K/V cache
``[L, capacity, Hkv, hd]`` with blockwise online-softmax attention, so memory is O(capacity) for the cache plus
O(chunk^2) per layer for scores — never T x T. ``tail_attention`` returns the attention probabilities of the last
``n_query`` prompt positions over all positions ``<=`` theirs, computed from the cached K at the end (the
reference for the PFlash scorer; the fast scoring pass is ``models.dense_scoring``, layer-major without a cache).
HF checkpoints (``model.*`` names, ``lm_head.weight`` unless tied) load with ``load_dense``; ``save_dense`` writes one.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax.config import (FULL, ConfigError, YarnScaling, _check_dense_silu, _qwen3_attention, _read_config_json,
                               _req_positive, _rms_norm_eps, _top_object)
from dflash_jax.models.loader import _ATTN, _LAYER, Placer, load_checkpoint, save_checkpoint, stream_params
from dflash_jax.models.qwen3_layers import qwen3_layer_shapes, random_params
from dflash_jax.models.qwen36 import acc_dtype, linear, mlp, rms_norm, rope

Params = dict[str, Any]
F32 = jnp.float32
_NEG = -1e30  # finite, so a fully masked row never produces NaN

DENSE_MODEL_TYPES = ("qwen3",)


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DenseConfig:
    """A Qwen3 dense causal LM (``Qwen3ForCausalLM``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    rope_scaling: YarnScaling | None = None  # YaRN (e.g. Qwen3's 32K -> 128K); None: plain rotary at rope_theta

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """Cached K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> "DenseConfig":
        w = "scorer config.json"
        _top_object(raw, w)
        mt = raw.get("model_type")
        if mt not in DENSE_MODEL_TYPES:
            raise ConfigError(f"{w}: key 'model_type' = {mt!r} is not supported for the dense scorer; expected one of "
                              f"{DENSE_MODEL_TYPES} (Qwen3 dense causal LMs)")
        if "dflash_config" in raw or "DFlashDraftModel" in (raw.get("architectures") or ()):
            raise ConfigError(f"{w}: key 'dflash_config'/'architectures' says this is a DFlash drafter, not a Qwen3 "
                              "causal LM (a drafter has no embedding or LM head of its own)")
        n_layers = _req_positive(raw, "num_hidden_layers", w)
        layer_types = raw.get("layer_types")
        if layer_types is not None:
            if not isinstance(layer_types, list) or len(layer_types) != n_layers:
                raise ConfigError(f"{w}: key 'layer_types' must list {n_layers} entries (num_hidden_layers)")
            bad = sorted({t for t in layer_types if t != FULL}, key=str)
            if bad:
                raise ConfigError(f"{w}: key 'layer_types' has unsupported entries {bad}; only {FULL!r}")
        if raw.get("use_sliding_window", False):
            raise ConfigError(f"{w}: key 'use_sliding_window' = true is not supported (full attention only)")
        _check_dense_silu(raw, w)
        for key in ("num_experts", "moe_intermediate_size"):
            if raw.get(key):
                raise ConfigError(f"{w}: key {key!r} is set; mixture-of-experts models are not supported")
        attention = _qwen3_attention(raw, w, "hidden_size ({hidden}) is not a multiple of num_attention_heads ({nh})")
        eps = _rms_norm_eps(raw, w)
        tie = raw.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ConfigError(f"{w}: key 'tie_word_embeddings' must be a bool, got {tie!r}")
        mpe = raw.get("max_position_embeddings", 40960)
        if isinstance(mpe, bool) or not isinstance(mpe, int) or mpe <= 0:
            raise ConfigError(f"{w}: key 'max_position_embeddings' must be a positive int, got {mpe!r}")
        return cls(
            vocab_size=_req_positive(raw, "vocab_size", w),
            **attention,
            intermediate_size=_req_positive(raw, "intermediate_size", w),
            num_layers=n_layers,
            rms_norm_eps=eps,
            tie_word_embeddings=tie,
            max_position_embeddings=mpe,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` of this model (``from_hf_dict(to_hf_dict()) == self``)."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "attention_bias": False,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling and self.rope_scaling.to_hf(),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
        }

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "DenseConfig":
        """From a config.json file, or a checkpoint directory holding one."""
        return cls.from_hf_dict(_read_config_json(path, "Qwen3 scorer"))


# ---------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------
def param_shapes(cfg: DenseConfig, dtype=jnp.bfloat16) -> Params:
    """The parameter pytree as ``jax.ShapeDtypeStruct`` leaves (``lm_head`` present even when tied)."""
    S = jax.ShapeDtypeStruct
    vec = acc_dtype(dtype)
    d, layers = cfg.hidden_size, qwen3_layer_shapes(cfg, dtype, vec)
    return {"embed": S((cfg.vocab_size, d), dtype), "lm_head": S((cfg.vocab_size, d), dtype),
            "final_norm": S((d,), vec), "layers": layers}


def init_params(cfg: DenseConfig, key: jax.Array, dtype=jnp.bfloat16, norm_noise: float = 0.0) -> Params:
    """Random weights: matrices ``normal * fan_in**-0.5``, norm weights 1 (+ ``norm_noise * normal``).

    With tied embeddings ``lm_head`` is the embedding array itself.
    """
    params = random_params(param_shapes(cfg, dtype), key, norm_noise)
    if cfg.tie_word_embeddings:
        params["lm_head"] = params["embed"]
    return params


def model_dtype(params: Params) -> jnp.dtype:
    return params["embed"].dtype


# ---------------------------------------------------------------------------------------------
# building blocks (unbatched: one sequence, tokens on axis 0)
# ---------------------------------------------------------------------------------------------
def _rope1(x: jax.Array, positions: jax.Array, theta: float, scaling: YarnScaling | None = None) -> jax.Array:
    """Full-dim NEOX RoPE on x [T, H, hd] at positions [T] (``scaling``: YaRN)."""
    return rope(x[None], positions[None], x.shape[-1], theta, scaling)[0]


def _unrope1(x: jax.Array, positions: jax.Array, theta: float, scaling: YarnScaling | None = None) -> jax.Array:
    """The inverse of :func:`_rope1`: x [T, H, hd] rotated at positions [T] back to its pre-RoPE value (YaRN's
    attention factor divided out, not applied a second time)."""
    if scaling is None:
        return _rope1(x, -positions, theta)
    plain = dataclasses.replace(scaling, attention_factor=1.0)
    return _rope1(x, -positions, theta, plain) / jnp.asarray(scaling.attention_factor, x.dtype)


def _qkv(p: Params, cfg: DenseConfig, u: jax.Array, positions: jax.Array):
    """u [T, D] -> q [T, H, hd], k, v [T, Hkv, hd] (q/k normed per head, then rotated)."""
    t = u.shape[0]
    hd, eps = cfg.head_dim, cfg.rms_norm_eps
    q = linear(u, p["q"]).reshape(t, cfg.num_heads, hd)
    k = linear(u, p["k"]).reshape(t, cfg.num_kv_heads, hd)
    v = linear(u, p["v"]).reshape(t, cfg.num_kv_heads, hd)
    q = _rope1(rms_norm(q, p["q_norm"], eps), positions, cfg.rope_theta, cfg.rope_scaling)
    k = _rope1(rms_norm(k, p["k_norm"], eps), positions, cfg.rope_theta, cfg.rope_scaling)
    return q, k, v


def _block_attention(q: jax.Array, k_all: jax.Array, v_all: jax.Array, q_pos: jax.Array, n_keys: jax.Array,
                     key_block: int) -> jax.Array:
    """Causal GQA attention of q [C, H, hd] (positions q_pos [C]) over the first ``n_keys`` rows of a contiguous
    cache k_all, v_all [cap, Hkv, hd], one key block of ``key_block`` rows at a time with an online softmax.

    ``cap`` must be a multiple of ``key_block`` and ``n_keys <= cap``; key j is visible to query i iff
    ``j <= q_pos[i]``. Key 0 is visible to every query, so every row has a finite maximum after block 0.
    Both matmuls take operands in the model dtype (bf16 runs on tensor cores) and accumulate in float32; the
    softmax statistics are float32.
    """
    c, h, hd = q.shape
    hkv = k_all.shape[1]
    a = acc_dtype(q.dtype)
    qg = q.reshape(c, hkv, h // hkv, hd)
    scale = hd ** -0.5

    def body(j, carry):
        m, l, acc = carry  # [Hkv, G, C], [Hkv, G, C], [Hkv, G, C, hd]
        kj = lax.dynamic_slice_in_dim(k_all, j * key_block, key_block, 0).astype(q.dtype)
        vj = lax.dynamic_slice_in_dim(v_all, j * key_block, key_block, 0).astype(q.dtype)
        s = jnp.einsum("ckgd,nkd->kgcn", qg, kj, preferred_element_type=a) * scale
        kpos = j * key_block + jnp.arange(key_block)
        s = jnp.where(kpos[None, :] <= q_pos[:, None], s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        pr = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + pr.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("kgcn,nkd->kgcd", pr.astype(q.dtype), vj,
                                                 preferred_element_type=a)
        return m_new, l, acc

    g = h // hkv
    init = (jnp.full((hkv, g, c), _NEG, a), jnp.zeros((hkv, g, c), a), jnp.zeros((hkv, g, c, hd), a))
    n_blocks = (n_keys + key_block - 1) // key_block
    _, l, acc = lax.fori_loop(0, n_blocks, body, init)
    o = acc / l[..., None]  # [Hkv, G, C, hd]
    return jnp.transpose(o, (2, 0, 1, 3)).reshape(c, h, hd).astype(q.dtype)


class DenseCache(NamedTuple):
    """Contiguous K/V of one sequence: k, v [L, capacity, Hkv, hd]; rows ``>= length`` hold no valid tokens."""

    k: jax.Array
    v: jax.Array
    length: int


def _chunk_forward(params: Params, cfg: DenseConfig, ids: jax.Array, start: jax.Array, k_cache: jax.Array,
                   v_cache: jax.Array, key_block: int, q_layers: tuple[int, ...] = ()):
    """Run the C tokens ``ids`` at positions ``start..start+C-1`` through every layer, writing their K/V into the
    cache and attending over cache rows ``< start+C`` (causally). Returns ``(h [C, D] after the final norm, k_cache,
    v_cache, qs)`` where ``qs`` is ``[len(q_layers), C, H, hd]`` (the rotated queries of those layers) or None."""
    c = ids.shape[0]
    pos = start + jnp.arange(c, dtype=jnp.int32)
    eps = cfg.rms_norm_eps
    h = jnp.take(params["embed"], ids, axis=0)
    qs = []
    for i, p in enumerate(params["layers"]):
        u = rms_norm(h, p["input_norm"], eps)
        q, k, v = _qkv(p["attn"], cfg, u, pos)
        k_cache = lax.dynamic_update_slice(k_cache, k[None].astype(k_cache.dtype), (i, start, 0, 0))
        v_cache = lax.dynamic_update_slice(v_cache, v[None].astype(v_cache.dtype), (i, start, 0, 0))
        if i in q_layers:
            qs.append(q)
        o = _block_attention(q, k_cache[i], v_cache[i], pos, start + c, key_block)
        h = h + linear(o.reshape(c, -1), p["attn"]["o"])
        h = h + mlp(p["mlp"], rms_norm(h, p["post_norm"], eps))
    h = rms_norm(h, params["final_norm"], eps)
    return h, k_cache, v_cache, (jnp.stack(qs) if qs else None)


_chunk_step = jax.jit(_chunk_forward, static_argnames=("cfg", "key_block", "q_layers"),
                      donate_argnames=("k_cache", "v_cache"))


def _bucket_chunks(n: int) -> int:
    """Round a chunk count up to 2^k or 3*2^(k-1), so prompt lengths share compiled shapes (<= 33% extra rows)."""
    b = 1
    while b < n:
        if b >= 2 and b // 2 * 3 >= n:
            return b // 2 * 3
        b *= 2
    return b


def capacity_for(n_tokens: int, chunk: int) -> int:
    """Cache rows ``prefill_chunked`` allocates for ``n_tokens``: a bucketed multiple of ``chunk``."""
    return _bucket_chunks(max(1, -(-n_tokens // chunk))) * chunk


def empty_cache(cfg: DenseConfig, capacity: int, dtype) -> DenseCache:
    shape = (cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim)
    return DenseCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), 0)


def _check_ids(cfg: DenseConfig, ids: Any) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"ids must be a non-empty 1-D token id sequence, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"ids must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must be in [0, {cfg.vocab_size}) (the scorer's vocab_size), got "
                         f"[{arr.min()}, {arr.max()}]")
    return arr.astype(np.int32)


def _prefill(params: Params, cfg: DenseConfig, ids: np.ndarray, chunk: int, cache: DenseCache):
    """Chunked prefill of ``ids`` (host int32) into ``cache`` from row 0. Returns (h of the last token [D], cache)."""
    t = ids.shape[0]
    k, v = cache.k, cache.v
    h_last = None
    for s in range(0, t, chunk):
        piece = ids[s:s + chunk]
        n = piece.shape[0]
        if n < chunk:
            piece = np.concatenate([piece, np.zeros(chunk - n, np.int32)])
        h, k, v, _ = _chunk_step(params, cfg, jnp.asarray(piece), jnp.int32(s), k, v, key_block=chunk)
        h_last = h[n - 1]
    return h_last, DenseCache(k, v, t)


def _check_chunk(chunk: int) -> None:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")


def prefill_chunked(params: Params, cfg: DenseConfig, ids: Any, chunk: int = 512,
                    capacity: int | None = None) -> tuple[jax.Array, DenseCache]:
    """Prefill a (long) prompt ``ids [T]`` ``chunk`` tokens at a time into a contiguous K/V cache.

    Returns ``(logits of the last prompt token [V] float32, DenseCache)``. The cache has ``capacity`` rows (default
    ``capacity_for(T, chunk)``; a given one must be a multiple of ``chunk`` and >= T rounded up to a chunk). Each
    chunk is one compiled call whose attention walks the cached keys in ``chunk``-row blocks, so no T x T array
    exists; the cache buffers are donated from call to call.
    """
    _check_chunk(chunk)
    arr = _check_ids(cfg, ids)
    t = arr.shape[0]
    need = -(-t // chunk) * chunk
    cap = capacity_for(t, chunk) if capacity is None else capacity
    if cap % chunk or cap < need:
        raise ValueError(f"capacity {cap} must be a multiple of chunk {chunk} and >= {need}")
    h, cache = _prefill(params, cfg, arr, chunk, empty_cache(cfg, cap, model_dtype(params)))
    logits = linear(h.astype(F32), params["lm_head"].astype(F32))
    return logits, cache


def forward(params: Params, cfg: DenseConfig, ids: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One full causal pass (materialises T x T; the reference for short inputs).

    Returns ``(logits [T, V] float32, k [L, T, Hkv, hd], v [L, T, Hkv, hd])``.
    """
    ids = jnp.asarray(_check_ids(cfg, ids))
    return _forward_jit(params, cfg, ids)


def _full(params: Params, cfg: DenseConfig, ids: jax.Array):
    """One sequence, one causal pass: ids [T] -> (h [T, D] after the final norm, k, v [L, T, Hkv, hd])."""
    t = ids.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    eps = cfg.rms_norm_eps
    h = jnp.take(params["embed"], ids, axis=0)
    causal = pos[None, :] <= pos[:, None]
    ks, vs = [], []
    for p in params["layers"]:
        u = rms_norm(h, p["input_norm"], eps)
        q, k, v = _qkv(p["attn"], cfg, u, pos)
        ks.append(k)
        vs.append(v)
        a = acc_dtype(q.dtype)
        g = cfg.num_heads // cfg.num_kv_heads
        qg = q.reshape(t, cfg.num_kv_heads, g, cfg.head_dim).astype(a)
        s = jnp.einsum("ckgd,nkd->kgcn", qg, k.astype(a)) * cfg.head_dim ** -0.5
        pr = jax.nn.softmax(jnp.where(causal, s, _NEG), axis=-1)
        o = jnp.einsum("kgcn,nkd->ckgd", pr, v.astype(a)).reshape(t, -1).astype(h.dtype)
        h = h + linear(o, p["attn"]["o"])
        h = h + mlp(p["mlp"], rms_norm(h, p["post_norm"], eps))
    return rms_norm(h, params["final_norm"], eps), jnp.stack(ks), jnp.stack(vs)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward_jit(params: Params, cfg: DenseConfig, ids: jax.Array):
    h, k, v = _full(params, cfg, ids)
    return linear(h.astype(F32), params["lm_head"].astype(F32)), k, v


def hidden_states(params: Params, cfg: DenseConfig, tokens: jax.Array) -> jax.Array:
    """Batched full causal pass for training and evaluation: tokens [B, T] -> final-normed hidden [B, T, D]
    (differentiable; the LM head is left to the caller)."""
    return jax.vmap(lambda ids: _full(params, cfg, ids)[0])(tokens)


# ---------------------------------------------------------------------------------------------
# attention of the last prompt tokens
# ---------------------------------------------------------------------------------------------
def _layer_ids(cfg: DenseConfig, n_layers: int | None) -> tuple[int, ...]:
    n = cfg.num_layers if n_layers is None else n_layers
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cfg.num_layers:
        raise ValueError(f"n_layers must be in [1, {cfg.num_layers}] (the scorer's num_hidden_layers), got {n!r}")
    return tuple(range(cfg.num_layers - n, cfg.num_layers))


def tail_queries(params: Params, cfg: DenseConfig, ids: Any, *, n_query: int = 8, n_layers: int | None = None,
                 chunk: int = 512) -> tuple[jax.Array, DenseCache, int]:
    """Prefill ``ids [T]`` and return the rotated queries of its last ``n_query`` tokens at the last ``n_layers``
    layers: ``(q [n_layers, nq, H, hd], cache holding all T tokens, q_start = T - nq)`` with ``nq = min(n_query, T)``.

    The first ``T - nq`` tokens go through ``prefill_chunked``'s chunk loop; the last ``nq`` run as one more step
    that records its queries.
    """
    _check_chunk(chunk)
    if isinstance(n_query, bool) or not isinstance(n_query, int) or n_query <= 0:
        raise ValueError(f"n_query must be a positive int, got {n_query!r}")
    layers = _layer_ids(cfg, n_layers)
    arr = _check_ids(cfg, ids)
    t = arr.shape[0]
    nq = min(n_query, t)
    cap = capacity_for(t, chunk)
    cache = empty_cache(cfg, cap, model_dtype(params))
    if t > nq:
        _, cache = _prefill(params, cfg, arr[:t - nq], chunk, cache)
    _, k, v, qs = _chunk_step(params, cfg, jnp.asarray(arr[t - nq:]), jnp.int32(t - nq), cache.k, cache.v,
                              key_block=chunk, q_layers=layers)
    return qs, DenseCache(k, v, t), t - nq


def tail_probs(q: jax.Array, k: jax.Array, q_start: jax.Array, theta: float, nope: bool = False,
               scaling: YarnScaling | None = None) -> jax.Array:
    """Softmax attention of tail queries over a layer's cached keys.

    q [nq, H, hd] (rotated, at positions ``q_start + i``); k [cap, Hkv, hd] (rotated, row = position). Returns
    ``[H, nq, cap]`` float32 probabilities, zero for keys after each query (and hence for rows >= T). With ``nope``
    both sides are rotated back to their pre-RoPE values first (lucebox's default "NoPE" scoring, which removes
    RoPE's distance decay); ``scaling``: the YaRN the cache was rotated with (``nope`` undoes it too).
    """
    nq, h, hd = q.shape
    cap, hkv = k.shape[:2]
    a = acc_dtype(q.dtype)
    q_pos = q_start + jnp.arange(nq, dtype=jnp.int32)
    if nope:
        q = _unrope1(q.astype(a), q_pos, theta, scaling)
        k = _unrope1(k.astype(a), jnp.arange(cap, dtype=jnp.int32), theta, scaling)
    qg = q.astype(a).reshape(nq, hkv, h // hkv, hd)
    s = jnp.einsum("ckgd,nkd->kgcn", qg, k.astype(a)) * hd ** -0.5  # [Hkv, G, nq, cap]
    s = jnp.where(jnp.arange(cap)[None, :] <= q_pos[:, None], s, _NEG)
    return jax.nn.softmax(s, axis=-1).reshape(h, nq, cap)


@functools.partial(jax.jit, static_argnames=("layers", "theta", "nope", "scaling"))
def _all_tail_probs(qs: jax.Array, k: jax.Array, q_start: jax.Array, layers: tuple[int, ...], theta: float,
                    nope: bool, scaling: YarnScaling | None) -> jax.Array:
    return jnp.stack([tail_probs(qs[j], k[li], q_start, theta, nope, scaling) for j, li in enumerate(layers)])


def tail_attention(params: Params, cfg: DenseConfig, ids: Any, *, n_query: int = 8, n_layers: int | None = None,
                   chunk: int = 512, nope: bool = False) -> jax.Array:
    """Attention probabilities of the last ``n_query`` prompt positions over all positions up to their own, at the
    last ``n_layers`` layers (default: all): ``[n_layers, H, nq, T]`` float32 with ``nq = min(n_query, T)``.

    Row i (position ``T - nq + i``) sums to 1 and is zero after position ``T - nq + i``. Computed from the cache K
    after a chunked prefill (see ``tail_queries``); ``nope`` scores with pre-RoPE q/k (``tail_probs``).
    """
    qs, cache, q_start = tail_queries(params, cfg, ids, n_query=n_query, n_layers=n_layers, chunk=chunk)
    layers = _layer_ids(cfg, n_layers)
    p = _all_tail_probs(qs, cache.k, jnp.int32(q_start), layers, cfg.rope_theta, nope, cfg.rope_scaling)
    return p[..., :cache.length]


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# ---------------------------------------------------------------------------------------------
_LAYER_NAMES = _LAYER | _ATTN


def hf_name_map(cfg: DenseConfig) -> dict[str, tuple[Any, ...]]:
    """Checkpoint tensor name (``model.`` prefix stripped) -> path into the parameter pytree."""
    m: dict[str, tuple[Any, ...]] = {"embed_tokens.weight": ("embed",), "norm.weight": ("final_norm",)}
    for i in range(cfg.num_layers):
        for suffix, path in _LAYER_NAMES.items():
            m[f"layers.{i}.{suffix}"] = ("layers", i) + path
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head",)
    return m


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def load_dense_params(path: str, cfg: DenseConfig, dtype=jnp.bfloat16, place: Placer | None = None) -> Params:
    """Stream a Qwen3 checkpoint into a parameter pytree (one tensor on the host at a time).

    With tied embeddings a stored ``lm_head.weight`` copy is skipped and ``lm_head`` is the embedding.
    """
    tied = cfg.tie_word_embeddings
    tree = stream_params(path, param_shapes(cfg, dtype), hf_name_map(cfg), _strip, place,
                         skip=lambda name: tied and name == "lm_head.weight", where="scorer checkpoint",
                         config="the scorer's config.json")
    if tied:
        tree["lm_head"] = tree["embed"]
    return tree


def load_dense(path: str | os.PathLike, dtype=jnp.bfloat16, place: Placer | None = None
               ) -> tuple[DenseConfig, Params]:
    """A Qwen3 checkpoint directory -> ``(DenseConfig, params)``."""
    return load_checkpoint(path, DenseConfig.from_file, load_dense_params, dtype, place)


def save_dense(path: str | os.PathLike, cfg: DenseConfig, params: Params) -> None:
    """Write ``config.json`` + ``model.safetensors`` (HF layout, ``model.*`` names, arrays in their own dtypes)."""
    save_checkpoint(path, hf_name_map(cfg), params, param_shapes(cfg, jnp.float32),
                    lambda: {**cfg.to_hf_dict(), "dtype": str(jnp.dtype(model_dtype(params)))},
                    rename=lambda name: name if name == "lm_head.weight" else "model." + name)
