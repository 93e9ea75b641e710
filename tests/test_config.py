"""TargetConfig parsing: the real Qwen3.6-27B config.json, derived values, and strict rejection of bad configs."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest

from dflash_jax.config import FULL, LINEAR, ConfigError, TargetConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG_27B = os.path.join(REPO, "configs", "qwen36_27b.json")


@pytest.fixture(scope="module")
def raw27() -> dict:
    with open(CFG_27B) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def cfg27() -> TargetConfig:
    return TargetConfig.from_file(CFG_27B)


# ---- the real 27B config ------------------------------------------------------------------------------------------
def test_27b_file_layout(raw27):
    assert raw27["model_type"] == "qwen3_5"
    assert raw27["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert raw27["eos_token_id"] == 248046 and raw27["text_config"]["eos_token_id"] == 248044
    assert raw27["text_config"]["model_type"] == "qwen3_5_text"
    assert raw27["vision_config"]["out_hidden_size"] == raw27["text_config"]["hidden_size"] == 5120
    assert (raw27["image_token_id"], raw27["video_token_id"]) == (248056, 248057)
    assert (raw27["vision_start_token_id"], raw27["vision_end_token_id"]) == (248053, 248054)
    rope = raw27["text_config"]["rope_parameters"]
    assert rope == {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                    "mrope_section": [11, 11, 10], "mrope_interleaved": True}


def test_27b_values(cfg27):
    c = cfg27
    assert c.hidden_size == 5120 and c.num_layers == 64 and c.vocab_size == 248320
    assert c.intermediate_size == 17408
    assert c.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 16
    assert c.attn_layers == tuple(range(3, 64, 4)) and c.attn_layers[-1] == 63
    assert len(c.gdn_layers) == 48 and set(c.gdn_layers) | set(c.attn_layers) == set(range(64))
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (24, 4, 256)
    assert c.rotary_dim == 64 and c.rope_theta == 1e7
    assert c.attn_output_gate and c.q_proj_dim == 12288
    assert (c.lin_num_k_heads, c.lin_num_v_heads, c.lin_k_dim, c.lin_v_dim) == (16, 48, 128, 128)
    assert c.key_dim == 2048 and c.value_dim == 6144 and c.conv_dim == 10240
    assert c.gva_ratio == 3 and c.conv_kernel == 4
    assert c.rms_norm_eps == 1e-6 and not c.tie_word_embeddings
    assert c.max_position_embeddings == 262144
    assert c.eos_token_ids == (248044,)  # the text_config's, not the top level's
    assert c.pad_token_id is None


def test_27b_memory(cfg27):
    # K and V, 16 full layers, 4 kv heads x 256, bf16
    assert cfg27.kv_bytes_per_token(2) == 2 * 16 * 4 * 256 * 2 == 64 * 1024
    assert cfg27.kv_bytes_per_token(4) == 128 * 1024
    ssm = 48 * 48 * 128 * 128 * 4  # fp32 [Hv, dk, dv] per GDN layer
    conv = 48 * 3 * 10240 * 2  # bf16 [K-1, conv_dim] per GDN layer
    assert ssm == 150_994_944 and conv == 2_949_120  # ~151 MB + ~2.9 MB
    assert cfg27.recurrent_bytes_per_seq() == ssm + conv == 153_944_064
    assert cfg27.recurrent_bytes_per_seq(conv_itemsize=4) == ssm + 2 * conv


def test_config_is_hashable_and_frozen(cfg27):
    # used as a static jit argument
    assert hash(cfg27) == hash(TargetConfig.from_file(CFG_27B))
    with pytest.raises(Exception):
        cfg27.hidden_size = 1  # type: ignore[misc]


def test_from_checkpoint_dir(tmp_path, raw27):
    (tmp_path / "config.json").write_text(json.dumps(raw27))
    assert TargetConfig.from_file(tmp_path) == TargetConfig.from_file(CFG_27B)


# ---- variants ---------------------------------------------------------------------------------------------------
def test_layer_types_derived_from_interval(raw27, cfg27):
    raw = copy.deepcopy(raw27)
    del raw["text_config"]["layer_types"]
    assert TargetConfig.from_hf_dict(raw) == cfg27  # interval 4
    del raw["text_config"]["full_attention_interval"]
    assert TargetConfig.from_hf_dict(raw) == cfg27  # default interval is 4
    raw["text_config"]["full_attention_interval"] = 2
    c = TargetConfig.from_hf_dict(raw)
    assert c.layer_types == (LINEAR, FULL) * 32 and c.attn_layers == tuple(range(1, 64, 2))


def test_text_only_config(raw27, cfg27):
    flat = copy.deepcopy(raw27["text_config"])
    assert flat["model_type"] == "qwen3_5_text" and "text_config" not in flat
    assert TargetConfig.from_hf_dict(flat) == cfg27
    # a top-level qwen3_5 without nesting is also read flat
    flat2 = dict(flat, model_type="qwen3_5")
    assert TargetConfig.from_hf_dict(flat2) == cfg27


def test_top_level_eos_used_when_text_config_has_none(raw27):
    raw = copy.deepcopy(raw27)
    del raw["text_config"]["eos_token_id"]
    assert TargetConfig.from_hf_dict(raw).eos_token_ids == (248046,)
    raw["text_config"]["eos_token_id"] = [248044, 248046]
    assert TargetConfig.from_hf_dict(raw).eos_token_ids == (248044, 248046)


def test_legacy_rope_keys(raw27, cfg27):
    raw = copy.deepcopy(raw27)
    tc = raw["text_config"]
    del tc["rope_parameters"]
    tc["rope_theta"] = 10000000
    tc["partial_rotary_factor"] = 0.25
    c = TargetConfig.from_hf_dict(raw)
    assert c.rotary_dim == 64 and c.rope_theta == 1e7 and c == cfg27


def test_yarn_scaling(raw27, cfg27):
    """Qwen3.6's documented long-context setting (YaRN, factor 4 over 262144 trained positions), resolved with
    transformers' defaults, and what it does to each rotary pair's frequency."""
    raw = copy.deepcopy(raw27)
    rp = raw["text_config"]["rope_parameters"]
    rp.update(rope_type="yarn", factor=4.0, original_max_position_embeddings=262144)
    c = TargetConfig.from_hf_dict(raw)
    y = c.rope_scaling
    assert cfg27.rope_scaling is None and c != cfg27
    assert (y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow, y.truncate) == (
        4.0, 262144, 32.0, 1.0, True)
    assert y.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    keep = y.keep(c.rotary_dim, c.rope_theta)
    assert len(keep) == c.rotary_dim // 2
    # fast pairs (many turns over 262144 positions) keep their frequency, slow ones are all scaled, between
    # falls monotonically
    assert keep[0] == 1.0 and keep[-1] == 0.0 and all(a >= b for a, b in zip(keep, keep[1:]))
    for j, share in enumerate(keep):
        turns = 262144 / (2 * math.pi * c.rope_theta ** (2 * j / c.rotary_dim))
        if turns > 32 * 1.5:
            assert share == 1.0, (j, turns)
        if turns < 1 / 1.5:
            assert share == 0.0, (j, turns)
    # defaults: the factor from max_position_embeddings / original, an explicit attention factor, mscale ratio
    rp.pop("factor")
    raw["text_config"]["max_position_embeddings"] = 1048576
    assert TargetConfig.from_hf_dict(raw).rope_scaling.factor == 4.0
    rp.update(factor=4.0, attention_factor=1.0)
    assert TargetConfig.from_hf_dict(raw).rope_scaling.attention_factor == 1.0
    rp.pop("attention_factor")
    rp.update(mscale=1.0, mscale_all_dim=1.0)
    assert TargetConfig.from_hf_dict(raw).rope_scaling.attention_factor == 1.0
    # to_hf gives the same scaling back
    raw["text_config"]["rope_parameters"] = {**{k: rp[k] for k in ("rope_theta", "partial_rotary_factor",
                                                                   "mrope_section")}, **y.to_hf()}
    raw["text_config"]["max_position_embeddings"] = raw27["text_config"]["max_position_embeddings"]
    assert TargetConfig.from_hf_dict(raw) == c


# ---- bad configs -----------------------------------------------------------------------------------------------
def _set(path, value):
    """Edit of the 27B raw dict: set (or delete, for value=_DEL) a key given as a tuple path."""

    def edit(raw):
        node = raw
        for k in path[:-1]:
            node = node[k]
        if value is _DEL:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return edit


_DEL = object()
TC = "text_config"

BAD = [
    ("llama", _set(("model_type",), "llama"), ["model_type", "'llama'"]),
    ("qwen3_next", _set(("model_type",), "qwen3_next"), ["model_type", "'qwen3_next'"]),
    ("no_model_type", _set(("model_type",), _DEL), ["model_type", "None"]),
    ("missing_hidden_size", _set((TC, "hidden_size"), _DEL), ["'hidden_size'", "missing"]),
    ("missing_num_layers", _set((TC, "num_hidden_layers"), _DEL), ["'num_hidden_layers'", "missing"]),
    ("hidden_size_str", _set((TC, "hidden_size"), "5120"), ["'hidden_size'", "int"]),
    ("hidden_size_bool", _set((TC, "hidden_size"), True), ["'hidden_size'", "int"]),
    ("hidden_size_zero", _set((TC, "hidden_size"), 0), ["'hidden_size'", "> 0"]),
    ("layer_types_short", _set((TC, "layer_types"), [LINEAR, LINEAR, LINEAR, FULL] * 15),
     ["'layer_types'", "64"]),
    ("layer_types_unknown", _set((TC, "layer_types"), [LINEAR, LINEAR, "sliding_attention", FULL] * 16),
     ["'layer_types'", "sliding_attention"]),
    ("bad_interval", lambda r: (r[TC].pop("layer_types"), r[TC].update(full_attention_interval=0)),
     ["'full_attention_interval'"]),
    ("heads_not_multiple", _set((TC, "num_key_value_heads"), 5), ["num_attention_heads", "num_key_value_heads"]),
    ("lin_heads_not_multiple", _set((TC, "linear_num_key_heads"), 20),
     ["linear_num_value_heads", "linear_num_key_heads"]),
    ("rope_linear", _set((TC, "rope_parameters", "rope_type"), "linear"), ["rope_type", "'linear'", "'yarn'"]),
    ("yarn_factor_below_1", _set((TC, "rope_parameters"), {"rope_type": "yarn", "rope_theta": 1e7, "factor": 0.5,
                                                            "original_max_position_embeddings": 262144}),
     ["factor", ">= 1"]),
    ("yarn_orig_str", _set((TC, "rope_parameters"), {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0,
                                                      "original_max_position_embeddings": "262144"}),
     ["original_max_position_embeddings", "int"]),
    ("yarn_betas", _set((TC, "rope_parameters"), {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0,
                                                  "beta_fast": 1, "beta_slow": 32}), ["beta_fast", "beta_slow"]),
    ("yarn_no_factor", lambda r: (r[TC].pop("max_position_embeddings"), r[TC].update(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e7, "original_max_position_embeddings": 262144})),
     ["factor", "is missing", "max_position_embeddings"]),
    ("yarn_theta_1", _set((TC, "rope_parameters"), {"rope_type": "yarn", "rope_theta": 1, "factor": 4.0}),
     ["rope_theta", "> 1"]),
    ("yarn_truncate", _set((TC, "rope_parameters"), {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0,
                                                     "truncate": "yes"}), ["truncate"]),
    ("rope_theta_missing", _set((TC, "rope_parameters", "rope_theta"), _DEL), ["rope_theta"]),
    ("mrope_sum", _set((TC, "rope_parameters", "mrope_section"), [11, 11, 11]), ["mrope_section", "32"]),
    ("mrope_not_list", _set((TC, "rope_parameters", "mrope_section"), "11,11,10"), ["mrope_section", "list"]),
    ("conv_kernel_str", _set((TC, "linear_conv_kernel_dim"), "4"), ["'linear_conv_kernel_dim'", "int"]),
    ("conv_kernel_zero", _set((TC, "linear_conv_kernel_dim"), 0), ["'linear_conv_kernel_dim'", "> 0"]),
    ("prf_zero", _set((TC, "rope_parameters", "partial_rotary_factor"), 0.0), ["partial_rotary_factor"]),
    ("gelu", _set((TC, "hidden_act"), "gelu"), ["'hidden_act'", "'gelu'"]),
    ("attention_bias", _set((TC, "attention_bias"), True), ["'attention_bias'"]),
    ("moe", _set((TC, "num_experts"), 256), ["'num_experts'"]),
    ("mlp_only_layers", _set((TC, "mlp_only_layers"), [0]), ["'mlp_only_layers'"]),
    ("text_config_not_object", _set((TC,), [1, 2]), ["'text_config'"]),
]


@pytest.mark.parametrize("edit,needles", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config(raw27, edit, needles):
    raw = copy.deepcopy(raw27)
    edit(raw)
    with pytest.raises(ConfigError) as ei:
        TargetConfig.from_hf_dict(raw)
    assert ei.type is ConfigError
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)


def test_top_level_not_object(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError) as ei:
        TargetConfig.from_file(p)
    assert ei.type is ConfigError and "JSON object" in str(ei.value)


def test_bad_config_via_file(tmp_path, raw27):
    raw = copy.deepcopy(raw27)
    raw["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        TargetConfig.from_file(tmp_path)


def test_invalid_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "qwen3_5", ')
    with pytest.raises(ConfigError) as ei:
        TargetConfig.from_file(p)
    assert ei.type is ConfigError
    assert "not valid JSON" in str(ei.value) and str(p) in str(ei.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError) as ei:
        TargetConfig.from_file(tmp_path)
    assert ei.type is ConfigError
    assert "no config.json" in str(ei.value) and str(tmp_path) in str(ei.value)
    with pytest.raises(ConfigError, match="no config.json"):
        TargetConfig.from_file(tmp_path / "nope.json")


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
