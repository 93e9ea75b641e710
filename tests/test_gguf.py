"""GGUF loading (llama.cpp ``qwen35`` layout): names, the converter's norm / A_log / conv changes and its value-head
re-order undone, F32/F16/Q8_0/Q4_0/Q4_K/Q5_K/Q6_K dequantized, MTP blocks skipped, clear errors for the rest; Q8_0 kept
as int8 and Q4_0 as packed int4 with the file's own values."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

import dflash_jax as dj  # noqa: E402
import gguf_fixture as fx  # noqa: E402
from conftest import FIXTURES  # noqa: E402
from dflash_jax.config import TargetConfig  # noqa: E402
from dflash_jax.models import gguf_loader, loader, quant, qwen36  # noqa: E402
from dflash_jax.models.gguf_loader import GGUFError  # noqa: E402

pytestmark = pytest.mark.xdist_group("gguf")
A = os.path.join(FIXTURES, "qwen36_tiny_a")
IDS = [int(i) for i in np.random.default_rng(1).integers(0, 256, 70)]


def _kl(p_logits, q_logits) -> float:
    lp, lq = jax.nn.log_softmax(p_logits, -1), jax.nn.log_softmax(q_logits, -1)
    return float(jnp.mean(jnp.sum(jnp.exp(lp) * (lp - lq), -1)))


def test_value_heads_are_tiled_the_way_the_converter_writes_them():
    """HF groups value heads by key head (head j reads key head j // r); GGUF tiles them: position t holds HF
    head (t % K) * r + t // K. With K=2, r=3: GGUF order = HF heads [0, 3, 1, 4, 2, 5]."""
    hf = np.arange(6, dtype=np.float32)
    tiled = gguf_loader.grouped_to_tiled(hf, 0, 2, 3, 1)
    np.testing.assert_array_equal(tiled, [0, 3, 1, 4, 2, 5])
    np.testing.assert_array_equal(gguf_loader.tiled_to_grouped(tiled, 0, 2, 3, 1), hf)
    rows = np.repeat(hf, 4)[:, None] * np.ones((1, 5))  # head_dim 4 rows of 5 columns
    back = gguf_loader.tiled_to_grouped(gguf_loader.grouped_to_tiled(rows, 0, 2, 3, 4), 0, 2, 3, 4)
    np.testing.assert_array_equal(back, rows)
    np.testing.assert_array_equal(gguf_loader.grouped_to_tiled(rows, 0, 2, 3, 4)[4:8, 0], 3)


# relative error (Frobenius) a tensor may show after its format's round trip (random normal weights)
BOUND = {"Q4_K": 0.12, "Q4_0": 0.12, "Q5_K": 0.06, "Q6_K": 0.03, "Q8_0": 0.01, "F16": 1e-3, "F32": 1e-6}


@settings(max_examples=30, deadline=None)
@given(qtype=st.sampled_from(["Q4_K", "Q4_0", "Q5_K", "Q6_K", "Q8_0", "F16"]), rows=st.integers(1, 4),
       blocks=st.integers(1, 3), seed=st.integers(0, 999), scale=st.floats(1e-3, 1e2), offset=st.floats(-1, 1))
def test_format_round_trips_through_ggufs_dequantizer_within_bound(qtype, rows, blocks, seed, scale, offset):
    """What the loader relies on: each format's bytes decode (``gguf.quants.dequantize``) to the values within
    the format's error (element-wise: half a quantization step of the block's range)."""
    rng = np.random.default_rng(seed)
    a = ((rng.standard_normal((rows, 256 * blocks)) + offset) * scale).astype(np.float32)
    data, raw = fx.encode(a, qtype)
    back = (data.astype(np.float32) if raw is None else gguf.quants.dequantize(data, raw)).reshape(a.shape)
    assert back.dtype == np.float32 and np.all(np.isfinite(back))
    assert np.linalg.norm(back - a) <= BOUND[qtype] * np.linalg.norm(a) + 1e-30
    bits = {"Q4_K": 4, "Q4_0": 4, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8, "F16": 11}[qtype]
    # no element off by more than ~one step of a 2^bits grid over the row's range (scales are 6-bit / fp16)
    step = (a.max(1, keepdims=True) - np.minimum(a.min(1, keepdims=True), 0)) / (2 ** bits - 1)
    assert np.all(np.abs(back - a) <= 2.5 * step + 1e-6 * scale)


@functools.lru_cache(maxsize=None)
def _hf(path: str) -> dj.Target:
    return dj.load_target(path, dtype="float32")


def _write(tmp_path, src: str, qtype_of, name="m.gguf", **kw) -> tuple[str, dict]:
    cfg = TargetConfig.from_file(src)
    dst = str(tmp_path / name)
    decoded = fx.write_gguf(dst, cfg, fx.hf_to_gguf_arrays(src, cfg), qtype_of, **kw)
    return dst, decoded


def test_f32_gguf_loads_to_the_hf_params_and_logits(tmp_path):
    path, _ = _write(tmp_path, A, lambda n, a: "F32", mtp_layers=1)
    g, h = dj.load_target(path, dtype="float32"), _hf(A)
    assert g.config == h.config
    for (p, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(g.params)[0],
                              jax.tree_util.tree_flatten_with_path(h.params)[0]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(p))
    np.testing.assert_allclose(np.asarray(g.logits(IDS)), np.asarray(h.logits(IDS)), rtol=1e-5, atol=1e-5)
    assert g.eos_token_ids == h.config.eos_token_ids


def test_yarn_gguf_loads_with_the_hf_configs_scaling(tmp_path):
    """A file whose ``rope.scaling.*`` says YaRN loads to the same config (factor, original context, default
    attention factor) and logits as the HF checkpoint it came from; other scaling types and attention-factor keys
    are refused by name."""
    src = str(tmp_path / "yarn_hf")
    import shutil

    shutil.copytree(A, src)
    raw = json.load(open(os.path.join(src, "config.json")))
    raw["text_config"]["rope_parameters"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)
    json.dump(raw, open(os.path.join(src, "config.json"), "w"))
    path, _ = _write(tmp_path, src, lambda n, a: "F32")
    g, h = dj.load_target(path, dtype="float32"), _hf(src)
    assert g.config == h.config and g.config.rope_scaling.factor == 4.0
    np.testing.assert_allclose(np.asarray(g.logits(IDS)), np.asarray(h.logits(IDS)), rtol=1e-5, atol=1e-5)
    meta = {f"{gguf_loader.ARCH}.rope.scaling.type": "linear"}
    with pytest.raises(GGUFError, match="'linear' is not supported"):
        gguf_loader._rope_scaling(meta, "m.gguf")
    meta = {f"{gguf_loader.ARCH}.rope.scaling.type": "yarn", f"{gguf_loader.ARCH}.rope.scaling.attn_factor": 1.2}
    with pytest.raises(GGUFError, match="attn_factor"):
        gguf_loader._rope_scaling(meta, "m.gguf")


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> str:
    """A random HF checkpoint of tiny_a's layout whose rows are multiples of 256 (so K-quants apply)."""
    cfg_json = json.load(open(os.path.join(A, "config.json")))
    tc = cfg_json["text_config"]
    tc.update(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=6)
    tc["rope_parameters"]["mrope_section"] = [4, 2, 2]
    dst = str(tmp_path_factory.mktemp("wide"))
    cfg = TargetConfig.from_hf_dict(cfg_json)
    params = qwen36.init_params(cfg, jax.random.key(3), jnp.float32)
    params = jax.tree_util.tree_map_with_path(  # norm weights away from their init so the +-1 matters
        lambda p, a: a + 0.1 * jax.random.normal(jax.random.key(len(str(p))), a.shape) if a.ndim == 1 else a, params)
    loader.save_checkpoint(dst, loader.hf_name_map(cfg), params, qwen36.param_shapes(cfg, jnp.float32),
                           lambda: cfg_json,
                           rename=lambda n: n if n == "lm_head.weight" else "model.language_model." + n)
    return dst


def test_k_quant_gguf_loads_within_each_formats_error_and_close_logits(tmp_path, wide):
    types: dict[str, str] = {}

    def qtype_of(n, a):
        types[n] = fx.mixed_types(n, a)
        return types[n]

    path, _ = _write(tmp_path, wide, qtype_of)
    assert {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16"} <= set(types.values())
    g, h = dj.load_target(path, dtype="float32"), _hf(wide)
    names = gguf_loader.name_map(g.config)
    for gname, (p, _) in names.items():
        a = np.asarray(loader._get(g.params, p))
        b = np.asarray(loader._get(h.params, p))
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
        assert err < BOUND[types.get(gname, "F32")], (gname, types.get(gname), err)
    # end to end: Q4_K's ~8 % weight error moves this random-weight model's next-token distributions a little;
    # a wrong name or head order would fail the per-tensor bounds above by O(1)
    got, want = g.logits(IDS), h.logits(IDS)
    assert _kl(want, got) < 0.15
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.4
    # kept as int8 Q8_0 blocks: the Q8_0 tensors' values exactly as the file holds them (no second rounding)
    q8 = dj.load_target(path, dtype="float32", quantization="int8")
    for gname, (p, _) in names.items():
        leaf = loader._get(q8.params, p)
        if types.get(gname) == "Q8_0" and quant.is_quantized(leaf):
            np.testing.assert_allclose(np.asarray(quant.dequantize(leaf)), np.asarray(loader._get(g.params, p)),
                                       rtol=1e-6, atol=1e-7)
    # kept as packed int4: Q4_K's asymmetric sub-blocks re-rounded onto the symmetric 32-block grid. On random
    # normal rows that is 11.4 % rms from the original weights (Q4_K alone 7.8 %, int4 of the original 8.6 %):
    # at most half a new step per element on top of Q4_K's error, ~8.3 % rms of the Q4_K values
    q4 = dj.load_target(path, dtype="float32", quantization="int4")
    for gname, (p, _) in names.items():
        leaf = loader._get(q4.params, p)
        if types.get(gname) == "Q4_K":
            assert quant.is_quantized(leaf) and leaf.packing == "int4", gname
            a, b = np.asarray(quant.dequantize(leaf)), np.asarray(loader._get(h.params, p))
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.15, gname
            k = np.asarray(loader._get(g.params, p))
            assert np.linalg.norm(a - k) / np.linalg.norm(k) < 0.1, gname
    assert _kl(want, q4.logits(IDS)) < 0.3
    # and re-quantized to fp8 on the device as it loads
    q = dj.load_target(path, dtype="float32", quantization="fp8")
    assert quant.is_quantized(q.params["layers"][0]["gdn"]["qkv"])
    assert _kl(want, q.logits(IDS)) < 0.2


def _q4_0_values(reader, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_0 tensor's own (values int8 [rows, cols] in [-8, 7], scales float16 [rows, cols / 32]) from its bytes:
    per 32-block 2 bytes of float16 d, then 16 bytes whose low nibbles are inputs 0-15 and high nibbles 16-31,
    stored + 8."""
    [t] = [t for t in reader.tensors if t.name == name]
    assert gguf.GGMLQuantizationType(t.tensor_type).name == "Q4_0"
    rows = int(t.shape[-1])
    blocks = np.asarray(t.data).reshape(rows, -1, 18)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    qs = blocks[..., 2:]
    v = np.concatenate([qs & 0x0F, qs >> 4], -1).astype(np.int8) - 8
    return v.reshape(rows, -1), d


def test_q4_0_gguf_keeps_its_own_4bit_values_packed_with_int4(tmp_path):
    """A Q4_0 tensor loaded with quantization="int4" holds the file's 4-bit values and float16 scales exactly
    (float32: the same weights as the dequantized load; bfloat16: the same values, scales rounded to bfloat16)."""
    path, _ = _write(tmp_path, A, lambda n, a: "Q4_0" if a.shape[-1] % 32 == 0 else "F32")
    reader = gguf.GGUFReader(path)
    g = dj.load_target(path, dtype="float32")
    q4 = dj.load_target(path, dtype="float32", quantization="int4")
    n = 0
    for gname, (p, _) in gguf_loader.name_map(g.config).items():
        leaf = loader._get(q4.params, p)
        if quant.path_name(p) in quant.MATMUL_NAMES:
            assert quant.is_quantized(leaf) and leaf.packing == "int4", gname
            np.testing.assert_array_equal(np.asarray(quant.dequantize(leaf)), np.asarray(loader._get(g.params, p)),
                                          err_msg=gname)
            n += 1
    assert n > 0
    ids = IDS[:30]
    np.testing.assert_allclose(np.asarray(q4.logits(ids)), np.asarray(g.logits(ids)), rtol=1e-4, atol=1e-4)
    v, d = _q4_0_values(reader, "blk.0.ffn_gate.weight")  # a tensor the converter leaves in place
    for dtype in ("float32", "bfloat16"):
        leaf = (q4 if dtype == "float32" else dj.load_target(path, dtype=dtype, quantization="int4")
                ).params["layers"][0]["mlp"]["gate"]
        np.testing.assert_array_equal(np.asarray(quant.values(leaf).astype(jnp.int8)), v)
        want = d if dtype == "float32" else d.astype(jnp.bfloat16).astype(np.float16)
        np.testing.assert_array_equal(np.asarray(leaf.scale), want)


def test_unsupported_tensor_type_is_named(tmp_path):
    path, _ = _write(tmp_path, A, lambda n, a: "Q4_1" if n == "blk.0.ffn_up.weight" else "F32")
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_up\.weight' has type Q4_1"):
        dj.load_target(path)


def test_unsupported_architecture_is_named(tmp_path):
    path, _ = _write(tmp_path, A, lambda n, a: "F32", arch="qwen3next")
    with pytest.raises(GGUFError, match="qwen3next"):
        dj.load_target(path)
