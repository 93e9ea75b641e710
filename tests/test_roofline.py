"""Roofline arithmetic against hand-computed figures of the 27B shapes."""

import os

import pytest

from dflash_jax.bench import roofline
from dflash_jax.config import FULL, LINEAR, TargetConfig

CFG_PATH = os.path.join(os.path.dirname(__file__), "..", "configs", "qwen36_27b.json")


def _cfg_27b_direct() -> TargetConfig:
    return TargetConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_layers=64,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 16,
        num_heads=24, num_kv_heads=4, head_dim=256, rotary_dim=64, rope_theta=1e7, attn_output_gate=True,
        lin_num_k_heads=16, lin_num_v_heads=48, lin_k_dim=128, lin_v_dim=128, conv_kernel=4)


@pytest.fixture(scope="module")
def cfg() -> TargetConfig:
    if os.path.exists(CFG_PATH):
        c = TargetConfig.from_file(CFG_PATH)
        d = _cfg_27b_direct()
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "layer_types", "num_heads",
                  "num_kv_heads", "head_dim", "attn_output_gate", "lin_num_k_heads", "lin_num_v_heads",
                  "lin_k_dim", "lin_v_dim", "conv_kernel"):
            assert getattr(c, f) == getattr(d, f), f
        return c
    return _cfg_27b_direct()


def _hand_weight_elements() -> int:
    d, f, v = 5120, 17408, 248320
    mlp = 3 * f * d
    attn = (24 * 256 * 2) * d + 2 * (4 * 256) * d + d * (24 * 256)       # q (with gate), k, v, o
    key_dim, value_dim = 16 * 128, 48 * 128
    conv_dim = 2 * key_dim + value_dim
    gdn = conv_dim * d + value_dim * d + 2 * 48 * d + d * value_dim + conv_dim * 4  # qkv, z, b, a, out, conv
    return 64 * mlp + 16 * attn + 48 * gdn + v * d                        # + LM head, no embedding


def test_weight_bytes_27b(cfg):
    hand = _hand_weight_elements()
    assert roofline.weight_elements(cfg) == hand
    wb = roofline.weight_bytes(cfg)
    assert wb == 2 * hand
    assert 51.2e9 <= wb <= 54e9
    assert roofline.weight_bytes(cfg, itemsize=4) == 2 * wb


def test_kv_bytes_27b(cfg):
    assert cfg.kv_bytes_per_token(2) == 64 * 1024
    assert roofline.kv_bytes_read(cfg, context_tokens=1, batch=1) == 64 * 1024
    assert roofline.kv_bytes_read(cfg, context_tokens=4096, batch=16) == 16 * 4096 * 64 * 1024
    assert roofline.kv_bytes_read(cfg, 100, 2, itemsize=1) == 2 * 100 * 32 * 1024


def test_recurrent_bytes_27b(cfg):
    ssm = 48 * 48 * 128 * 128 * 4
    conv = 48 * 3 * (2 * 16 * 128 + 48 * 128) * 2
    assert ssm == pytest.approx(151e6, rel=0.01)
    assert roofline.recurrent_bytes(cfg, batch=1) == 2 * (ssm + conv)      # read + write
    assert roofline.recurrent_bytes(cfg, batch=8) == 8 * 2 * (ssm + conv)


def test_decode_step_and_roofline(cfg):
    b, ctx = 16, 2048
    total = roofline.decode_step_bytes(cfg, b, ctx)
    expect = (roofline.weight_bytes(cfg) + roofline.kv_bytes_read(cfg, ctx, b)
              + roofline.recurrent_bytes(cfg, b) + b * (5120 * 2 + 64 * 1024))
    assert total == expect
    assert roofline.roofline_tok_s(cfg, b, ctx) == pytest.approx(b / (total / 4.8e12))
    # B=1, no context: about 4.8e12 / 51.6e9 ~ 93 tok/s
    assert 90 < roofline.roofline_tok_s(cfg, 1, 0) < 95
    # more context and more state never make it faster per token
    assert roofline.roofline_tok_s(cfg, 1, 100_000) < roofline.roofline_tok_s(cfg, 1, 0)
    assert roofline.roofline_tok_s(cfg, 64, 0, hbm_bytes_per_s=2.4e12) == pytest.approx(
        roofline.roofline_tok_s(cfg, 64, 0) / 2)


def test_device_hbm_peak_by_kind():
    assert roofline.device_hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert roofline.device_hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert roofline.device_hbm_bytes_per_s("NVIDIA H100 PCIe") == 2.0e12
    # unknown devices (CPU here) fall back to the H200, which the default roofline uses
    assert roofline.device_hbm_bytes_per_s("cpu") == roofline.H200_HBM_BYTES_PER_S
    assert roofline.device_hbm_bytes_per_s() == roofline.H200_HBM_BYTES_PER_S
