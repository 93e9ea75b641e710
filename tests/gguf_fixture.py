"""Writes small ``qwen35`` GGUF files from Hugging Face checkpoints with ``gguf``'s writer, the way llama.cpp's
converter lays them out (names, ``1 + w`` norms, ``-exp(A_log)``, squeezed conv, tiled value heads), with tensors
in F32 / F16 / Q8_0 / Q4_K / Q5_K / Q6_K. ``gguf`` only dequantizes the K-quants, so they are encoded here
(plain min/max scales per sub-block, not llama.cpp's search): the bytes must decode through ``gguf``'s own
dequantizer, which makes this an independent check of the loader's use of it."""

from __future__ import annotations

import math
from typing import Callable

import gguf
import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.models import gguf_loader, loader

QK = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


def _scale_min_k4(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K super-block scales: x [n, 8, 32] -> (d, dmin [n], sc, m [n, 8] 6-bit, q [n, 8, 32])."""
    lo = np.minimum(x.min(-1), 0.0)
    hi = x.max(-1)
    scale = (hi - lo) / levels  # [n, 8]
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_safe_div(-lo, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    q = np.clip(np.round(_safe_div(x + (dmin[:, None] * m)[..., None], step[..., None])), 0, levels)
    return d, dmin, sc, m, q.astype(np.uint8)


def _pack_scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> 12 bytes (low 6 bits of 0..3 in bytes 0-3 / 4-7, their top 2 bits carrying
    bits 4-5 of 4..7, whose low nibbles fill bytes 8-11)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] (4 low bits used) -> 128 bytes: sub-blocks 2g / 2g+1 in the low / high nibbles of group g."""
    q = q.reshape(-1, 4, 2, 32) & 0x0F
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _scale_min_k4(x.reshape(-1, 8, 32), 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_k4(sc, m), _nibbles(q)], 1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _scale_min_k4(x.reshape(-1, 8, 32), 31)
    qh = sum(((q[:, j] >> 4) & 1).astype(np.uint8) << j for j in range(8))  # [n, 32]: bit j = 5th bit of sub-block j
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_k4(sc, m), qh.astype(np.uint8),
                           _nibbles(q)], 1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31  # [n, 16]
    d = (np.abs(scale).max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = (np.clip(np.round(_safe_div(x, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(-1, 8, 32)
    # element f of the block sits at row f // 32 = 4h + 2s + b of q; low nibble in byte 64h + 32b + c (shift 4s)
    lo = (q & 0x0F).reshape(-1, 2, 2, 2, 32)  # [n, h, s, b, c]
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    hi = ((q >> 4) & 3).reshape(-1, 2, 4, 32)  # [n, h, t, c]: 2 bits at shift 2t of byte 32h + c
    qh = sum(hi[:, :, t] << (2 * t) for t in range(4)).astype(np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], 1)


_ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def encode(a: np.ndarray, qtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """A float32 [rows, cols] array -> (the array to hand the writer, its raw dtype)."""
    if qtype == "F32":
        return a.astype(np.float32), None
    if qtype == "F16":
        return a.astype(np.float16), None
    t = gguf.GGMLQuantizationType[qtype]
    if qtype not in _ENCODERS:  # Q8_0 and the other types gguf itself can encode
        return gguf.quants.quantize(a.astype(np.float32), t), t
    rows = a.reshape(-1, a.shape[-1])
    if rows.shape[-1] % QK:
        raise ValueError(f"{qtype} needs rows of a multiple of {QK} values, got {rows.shape[-1]}")
    blocks = _ENCODERS[qtype](rows.reshape(-1, QK).astype(np.float32))
    return blocks.reshape(rows.shape[0], -1), t


def hf_to_gguf_arrays(src: str, cfg: TargetConfig) -> dict[str, np.ndarray]:
    """The converter's float32 tensors (GGUF names, changes applied) of the HF checkpoint ``src``."""
    hf_to_path = loader.hf_name_map(cfg)
    path_to_gguf = {p: (n, fix) for n, (p, fix) in gguf_loader.name_map(cfg).items()}
    nk, r, dv = cfg.lin_num_k_heads, cfg.gva_ratio, cfg.lin_v_dim
    tile = lambda a, axis, hd: gguf_loader.grouped_to_tiled(a, axis, nk, r, hd)
    out = {}
    for full, arr in loader.iter_tensors(src):
        name = loader._strip(full)
        if name is None or name not in hf_to_path:
            continue
        gname, fix = path_to_gguf[hf_to_path[name]]
        a = np.asarray(arr, np.float32)
        if a.ndim == 3:
            a = a[:, 0, :]  # conv [C, 1, K] -> [C, K]
        if fix == "norm":
            a = a + 1.0
        elif fix == "a_log":
            a = -np.exp(tile(a, 0, 1))
        elif fix == "head_rows":
            a = tile(a, 0, 1)
        elif fix == "v_rows":
            a = tile(a, 0, dv)
        elif fix == "v_cols":
            a = tile(a, 1, dv)
        elif fix in ("qkv_rows", "conv_rows"):
            a = np.concatenate([a[:2 * cfg.key_dim], tile(a[2 * cfg.key_dim:], 0, dv)], 0)
        out[gname] = a
    return out


def write_gguf(dst: str, cfg: TargetConfig, arrays: dict[str, np.ndarray],
               qtype_of: Callable[[str, np.ndarray], str], arch: str = gguf_loader.ARCH,
               mtp_layers: int = 0) -> dict[str, np.ndarray]:
    """Write ``arrays`` (GGUF name -> float32) with the metadata llama.cpp's converter writes for ``cfg``.
    ``mtp_layers`` extra blocks are appended (copies of the last layer) as MTP blocks. Returns what each tensor
    decodes back to (float32), for comparisons."""
    w = gguf.GGUFWriter(dst, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers + mtp_layers)
    if mtp_layers:
        w.add_nextn_predict_layers(mtp_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.rotary_dim)
    if cfg.rope_scaling is not None:  # as the converter writes YaRN (the attention factor left to its default)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope_scaling.factor)
        w.add_rope_scaling_orig_ctx_len(cfg.rope_scaling.original_max_position_embeddings)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_state_size(cfg.lin_k_dim)
    w.add_ssm_group_count(cfg.lin_num_k_heads)
    w.add_ssm_time_step_rank(cfg.lin_num_v_heads)
    w.add_ssm_inner_size(cfg.lin_v_dim * cfg.lin_num_v_heads)
    w.add_full_attention_interval(4)
    if cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])
    if cfg.pad_token_id is not None:
        w.add_pad_token_id(cfg.pad_token_id)
    arrays = dict(arrays)
    last = cfg.num_layers - 1
    for j in range(mtp_layers):
        for n, a in list(arrays.items()):
            if n.startswith(f"blk.{last}."):
                arrays[n.replace(f"blk.{last}.", f"blk.{cfg.num_layers + j}.")] = a
    decoded = {}
    for name, a in arrays.items():
        qt = qtype_of(name, a) if a.ndim == 2 else "F32"
        data, raw = encode(a, qt)
        w.add_tensor(name, data, raw_dtype=raw)
        back = data.astype(np.float32) if raw is None else gguf.quants.dequantize(data, raw)
        decoded[name] = np.asarray(back, np.float32).reshape(a.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


def mixed_types(name: str, a: np.ndarray) -> str:
    """A K-quant mix like llama.cpp's Q4_K_M where rows allow (multiples of 256), Q8_0 / F16 elsewhere."""
    if a.shape[-1] % 32 == 0 and ("token_embd" in name or "attn_q." in name or "attn_k." in name):
        return "Q8_0"
    if a.shape[-1] % QK == 0:
        if "ffn_down" in name or "attn_v" in name or name == "output.weight":
            return "Q6_K"
        if "ffn_" in name:
            return "Q4_K"
        return "Q5_K"
    return "Q8_0" if a.shape[-1] % 32 == 0 and math.prod(a.shape) > 4096 else "F16"
