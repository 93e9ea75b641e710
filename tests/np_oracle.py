"""Independent float64 NumPy oracle for the Qwen3.5/3.6 hybrid text model (HF ``model_type`` ``qwen3_5``).

This is a deliberately plain, slow re-derivation of the forward pass written from the equations in
``shared/reference/model_and_algorithms.md`` (sections 1 and 2). It must not import anything from
``dflash_jax``: tests use it as an exact reference for the code under test.

* Everything is float64.
* The Gated DeltaNet is evaluated in its token-by-token recurrent form (no chunking).
* Full attention is plain causal softmax attention over the whole sequence (no cache).

Public API
----------
``load_checkpoint(path) -> (cfg, weights)``
    ``cfg`` is the ``text_config`` dict (``layer_types`` filled in if missing); ``weights`` maps the
    text-model tensor names with the ``model.language_model.`` prefix stripped (``embed_tokens.weight``,
    ``layers.N.…``, ``norm.weight``) plus ``lm_head.weight`` to float64 arrays.
``forward(cfg, weights, ids) -> (logits [T, V], hidden [L+1, T, D])``
    ``hidden[0]`` is the embedding output, ``hidden[l+1]`` the output of decoder layer ``l`` -- except
    the last entry ``hidden[L]``, which (like transformers' ``output_hidden_states``) is after the
    final norm.
``greedy(cfg, weights, ids, n) -> list[int]``
    Greedy continuation of ``n`` tokens (re-runs ``forward`` on the growing sequence).
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import load_file

PREFIX = "model.language_model."


# ---------------------------------------------------------------------------------------------------
# checkpoint loading
# ---------------------------------------------------------------------------------------------------


def _text_config(config: dict) -> dict:
    cfg = dict(config.get("text_config", config))
    if not cfg.get("layer_types"):
        interval = cfg.get("full_attention_interval", 4)
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
    return cfg


def load_checkpoint(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """Read an HF Qwen3.5/3.6 checkpoint directory (single file or sharded) as float64."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = _text_config(json.load(f))

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]

    weights: dict[str, np.ndarray] = {}
    for fname in files:
        for name, arr in load_file(os.path.join(path, fname)).items():
            if name == "lm_head.weight":
                weights[name] = arr.astype(np.float64)
            elif name.startswith(PREFIX):
                weights[name[len(PREFIX):]] = arr.astype(np.float64)
            # model.visual.*, mtp.*: not part of the text forward pass
    if "lm_head.weight" not in weights:  # tied embeddings (not the case for Qwen3.6, kept for safety)
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    return cfg, weights


# ---------------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------------


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def rms_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rmsnorm_zc(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w)."""
    return rms_normalize(x, eps) * (1.0 + w)


def rmsnorm_plain(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Plain RMSNorm: w * (x * rsqrt(mean(x^2) + eps))."""
    return w * rms_normalize(x, eps)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """PyTorch-style weight [out, in]: y = x W^T."""
    return x @ w.T


# ---------------------------------------------------------------------------------------------------
# gated full attention
# ---------------------------------------------------------------------------------------------------


def yarn_inv_freq(inv_freq: np.ndarray, rotary_dim: int, theta: float, rp: dict, max_pos: int
                  ) -> tuple[np.ndarray, float]:
    """YaRN (``rope_type: yarn``): pair j whose wavelength fits more than beta_fast turns into the original
    context keeps its frequency, fewer than beta_slow turns divides it by the factor, linear in j between (the
    bounds floored / ceiled to whole pairs); cos and sin scale by 0.1 ln(factor) + 1 unless given."""
    orig = rp.get("original_max_position_embeddings", max_pos)
    s = rp.get("factor") or max_pos / orig
    # pair index at which a frequency turns n times over the original context: L / (2 pi base^(2j/d)) = n
    j_at = lambda n: rotary_dim / 2 * np.log(orig / (2 * np.pi * n)) / np.log(theta)  # noqa: E731
    lo = max(np.floor(j_at(rp.get("beta_fast", 32))), 0)
    hi = min(np.ceil(j_at(rp.get("beta_slow", 1))), rotary_dim - 1)
    hi = hi + 0.001 if hi == lo else hi
    scaled_share = np.clip((np.arange(rotary_dim // 2) - lo) / (hi - lo), 0.0, 1.0)
    mix = inv_freq / s * scaled_share + inv_freq * (1 - scaled_share)
    return mix, rp.get("attention_factor") or (0.1 * np.log(s) + 1.0)


def rope(x: np.ndarray, rotary_dim: int, theta: float, rp: dict | None = None, max_pos: int = 0) -> np.ndarray:
    """Partial NEOX RoPE on the first ``rotary_dim`` dims of x [T, H, Dh]; positions 0..T-1
    (YaRN-scaled when ``rp``, the config's rope_parameters, says ``rope_type: yarn``)."""
    T = x.shape[0]
    half = rotary_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)  # [half]
    mscale = 1.0
    if rp and rp.get("rope_type") == "yarn":
        inv_freq, mscale = yarn_inv_freq(inv_freq, rotary_dim, theta, rp, max_pos)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]  # [T, half]
    cos = mscale * np.cos(ang)[:, None, :]  # [T, 1, half]
    sin = mscale * np.sin(ang)[:, None, :]
    a = x[..., :half]
    b = x[..., half:rotary_dim]
    out = x.copy()
    # pairs (j, j + half): [a, b] -> [a cos - b sin, b cos + a sin]
    out[..., :half] = a * cos - b * sin
    out[..., half:rotary_dim] = b * cos + a * sin
    return out


def full_attention(cfg: dict, w: dict, p: str, u: np.ndarray) -> np.ndarray:
    T = u.shape[0]
    H = cfg["num_attention_heads"]
    Hkv = cfg["num_key_value_heads"]
    Dh = cfg.get("head_dim") or cfg["hidden_size"] // H
    eps = cfg["rms_norm_eps"]
    rp = cfg.get("rope_parameters") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary_dim = int(Dh * prf)

    P = linear(u, w[p + "q_proj.weight"]).reshape(T, H, 2 * Dh)
    q, gate = P[..., :Dh], P[..., Dh:]  # per head: [q_h | gate_h]
    k = linear(u, w[p + "k_proj.weight"]).reshape(T, Hkv, Dh)
    v = linear(u, w[p + "v_proj.weight"]).reshape(T, Hkv, Dh)

    q = rmsnorm_zc(q, w[p + "q_norm.weight"], eps)
    k = rmsnorm_zc(k, w[p + "k_norm.weight"], eps)
    q = rope(q, rotary_dim, theta, rp, cfg.get("max_position_embeddings", 0))
    k = rope(k, rotary_dim, theta, rp, cfg.get("max_position_embeddings", 0))

    group = H // Hkv
    scale = 1.0 / np.sqrt(Dh)
    causal = np.tril(np.ones((T, T), dtype=bool))
    out = np.zeros((T, H, Dh))
    for h in range(H):
        kv = h // group
        s = (q[:, h, :] @ k[:, kv, :].T) * scale  # [T, T]
        s = np.where(causal, s, -np.inf)
        s = s - s.max(axis=-1, keepdims=True)
        pr = np.exp(s)
        pr /= pr.sum(axis=-1, keepdims=True)
        out[:, h, :] = pr @ v[:, kv, :]

    out = out * sigmoid(gate)
    return linear(out.reshape(T, H * Dh), w[p + "o_proj.weight"])


# ---------------------------------------------------------------------------------------------------
# Gated DeltaNet (recurrent form)
# ---------------------------------------------------------------------------------------------------


def gated_deltanet(cfg: dict, w: dict, p: str, u: np.ndarray) -> np.ndarray:
    T = u.shape[0]
    Hk = cfg["linear_num_key_heads"]
    Hv = cfg["linear_num_value_heads"]
    dk = cfg["linear_key_head_dim"]
    dv = cfg["linear_value_head_dim"]
    eps = cfg["rms_norm_eps"]
    key_dim, value_dim = Hk * dk, Hv * dv

    X = linear(u, w[p + "in_proj_qkv.weight"])  # [T, 2*key_dim + value_dim]
    Z = linear(u, w[p + "in_proj_z.weight"]).reshape(T, Hv, dv)
    b = linear(u, w[p + "in_proj_b.weight"])  # [T, Hv]
    a = linear(u, w[p + "in_proj_a.weight"])  # [T, Hv]

    # causal depthwise conv (zero history), w[:, K-1] multiplies the current token, then SiLU
    cw = w[p + "conv1d.weight"][:, 0, :]  # [C, K]
    K = cw.shape[1]
    Xpad = np.concatenate([np.zeros((K - 1, X.shape[1])), X], axis=0)
    C = np.zeros_like(X)
    for t in range(T):
        C[t] = np.sum(cw.T * Xpad[t : t + K], axis=0)
    C = silu(C)

    q = l2norm(C[:, :key_dim].reshape(T, Hk, dk))
    k = l2norm(C[:, key_dim : 2 * key_dim].reshape(T, Hk, dk))
    v = C[:, 2 * key_dim :].reshape(T, Hv, dv)

    beta = sigmoid(b)  # [T, Hv]
    g = -np.exp(w[p + "A_log"]) * softplus(a + w[p + "dt_bias"])  # [T, Hv]
    qs = 1.0 / np.sqrt(dk)

    ratio = Hv // Hk
    o = np.zeros((T, Hv, dv))
    for j in range(Hv):
        kh = j // ratio
        S = np.zeros((dk, dv))
        for t in range(T):
            S = np.exp(g[t, j]) * S
            r = S.T @ k[t, kh]
            delta = beta[t, j] * (v[t, j] - r)
            S = S + np.outer(k[t, kh], delta)
            o[t, j] = S.T @ (q[t, kh] * qs)

    y = rmsnorm_plain(o, w[p + "norm.weight"], eps) * silu(Z)
    return linear(y.reshape(T, value_dim), w[p + "out_proj.weight"])


# ---------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------


def mlp(w: dict, p: str, x: np.ndarray) -> np.ndarray:
    return linear(silu(linear(x, w[p + "gate_proj.weight"])) * linear(x, w[p + "up_proj.weight"]),
                  w[p + "down_proj.weight"])


def forward(cfg: dict, weights: dict, ids) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    eps = cfg["rms_norm_eps"]
    h = weights["embed_tokens.weight"][ids]  # [T, D], no scaling
    hidden = [h]
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{i}."
        u = rmsnorm_zc(h, weights[p + "input_layernorm.weight"], eps)
        if kind == "full_attention":
            h = h + full_attention(cfg, weights, p + "self_attn.", u)
        elif kind == "linear_attention":
            h = h + gated_deltanet(cfg, weights, p + "linear_attn.", u)
        else:
            raise ValueError(f"unknown layer type {kind!r}")
        h = h + mlp(weights, p + "mlp.", rmsnorm_zc(h, weights[p + "post_attention_layernorm.weight"], eps))
        hidden.append(h)
    hn = rmsnorm_zc(h, weights["norm.weight"], eps)
    hidden[-1] = hn  # mirrors transformers' output_hidden_states
    logits = hn @ weights["lm_head.weight"].T
    return logits, np.stack(hidden)


def greedy(cfg: dict, weights: dict, ids, n: int) -> list[int]:
    seq = [int(t) for t in np.asarray(ids).reshape(-1)]
    out: list[int] = []
    for _ in range(n):
        logits, _ = forward(cfg, weights, np.array(seq))
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
        seq.append(nxt)
    return out
