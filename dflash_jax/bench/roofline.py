"""Bandwidth roofline of a decode step, from the config alone (pure arithmetic, nothing runs).

A decode step of B sequences, one new token each, is bound by HBM reads:

    bytes(B, ctx) = W                                   every weight matrix once (LM head included)
                  + B * ctx * kv_per_token              K and V of every full-attention layer
                  + 2 * B * R                           recurrent state, read and written back
                  + B * (D + kv_per_token) * itemsize   the B embedding rows and the new K/V (small)

    tok/s = B / (bytes / hbm_bytes_per_s)

with ``kv_per_token = 2 * n_full * Hkv * hd * itemsize`` and
``R = n_gdn * (Hv * dk * dv * 4 + (K - 1) * conv_dim * conv_itemsize)``.
Activations and norm/bias vectors are ignored (well under 0.1 % of W).
"""

from __future__ import annotations

import math

import jax

from dflash_jax.config import TargetConfig
from dflash_jax.models import qwen36

H200_HBM_BYTES_PER_S = 4.8e12  # datasheet peak of the H200 (HBM3e)
# datasheet HBM peaks by a substring of ``device_kind``; the first match wins
_HBM_PEAKS = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12))


def device_hbm_bytes_per_s(device_kind: str | None = None) -> float:
    """Datasheet HBM bandwidth of ``device_kind`` (default: the first JAX device's); the H200's when unknown."""
    kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    return next((peak for name, peak in _HBM_PEAKS if name in kind), H200_HBM_BYTES_PER_S)


def weight_elements(cfg: TargetConfig) -> int:
    """Elements of every matrix (2-D leaf) of ``qwen36.param_shapes`` except the embedding.

    Decode reads only B rows of the embedding, so it is left out; the LM head is counted once
    (whether or not it is tied to the embedding, decode reads all of it). The depthwise conv weight
    [conv_dim, K] is a 2-D leaf and is counted (it is read every step, and tiny).
    """
    shapes = qwen36.param_shapes(cfg)
    n = math.prod(shapes["lm_head"].shape)
    for layer in shapes["layers"]:
        for leaf in jax.tree_util.tree_leaves(layer):
            if len(leaf.shape) == 2:
                n += math.prod(leaf.shape)
    return n


def weight_bytes(cfg: TargetConfig, itemsize: float = 2) -> int:
    """W = weight_elements(cfg) * itemsize: the bytes one decode step must stream from HBM (``itemsize`` may be
    fractional: fp8 weights with their scales, ``quant.weight_itemsize(params)``)."""
    return int(weight_elements(cfg) * itemsize)


def kv_bytes_read(cfg: TargetConfig, context_tokens: int, batch: int, itemsize: int = 2) -> int:
    """B * ctx * kv_per_token: K and V of ``context_tokens`` tokens for every full-attention layer.

    ``kv_per_token = 2 * n_full_layers * num_kv_heads * head_dim * itemsize`` (64 KiB for 27B bf16).
    ``context_tokens`` is the number of tokens each sequence attends over.
    """
    return batch * context_tokens * cfg.kv_bytes_per_token(itemsize)


def recurrent_bytes(cfg: TargetConfig, batch: int, conv_itemsize: int = 2) -> int:
    """2 * B * R: the GDN state of every sequence is read and written back once per step.

    ``R = n_gdn * (Hv * dk * dv * 4 + (K - 1) * conv_dim * conv_itemsize)`` (fp32 SSM state plus the
    conv window in the activation dtype; 27B: 151.0 MB + 2.9 MB per sequence).
    """
    return 2 * batch * cfg.recurrent_bytes_per_seq(conv_itemsize)


def decode_step_bytes(cfg: TargetConfig, batch: int, context: int, itemsize: int = 2,
                      weight_itemsize: float | None = None, kv_itemsize: float | None = None) -> int:
    """HBM bytes of one decode step of ``batch`` sequences attending over ``context`` tokens each.

    ``W + B*ctx*kv_per_token + 2*B*R + B*(D*itemsize + kv_per_token)``: weights, KV read, recurrent
    state read+write, and the small per-token terms (embedding rows read, new K/V written). Weights take
    ``weight_itemsize`` bytes an element (default ``itemsize``; ~1 for fp8 weights), K/V ``kv_itemsize``
    (default ``itemsize``; ~1 + 4/head_dim for fp8/int8 pages with their scales).
    """
    kvi = itemsize if kv_itemsize is None else kv_itemsize
    small = batch * (cfg.hidden_size * itemsize + cfg.kv_bytes_per_token(kvi))
    w = weight_bytes(cfg, itemsize if weight_itemsize is None else weight_itemsize)
    return int(w + kv_bytes_read(cfg, context, batch, kvi) + recurrent_bytes(cfg, batch, itemsize) + small)


def roofline_tok_s(cfg: TargetConfig, batch: int, context: int,
                   hbm_bytes_per_s: float | None = None, itemsize: int = 2,
                   weight_itemsize: float | None = None, kv_itemsize: float | None = None) -> float:
    """Upper bound on decode throughput: ``B / (decode_step_bytes / hbm_bytes_per_s)`` tokens/s.

    ``hbm_bytes_per_s`` defaults to the datasheet peak of the device in use (``device_hbm_bytes_per_s``)."""
    if hbm_bytes_per_s is None:
        hbm_bytes_per_s = device_hbm_bytes_per_s()
    return batch * hbm_bytes_per_s / decode_step_bytes(cfg, batch, context, itemsize, weight_itemsize, kv_itemsize)
