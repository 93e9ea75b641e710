"""Hugging Face checkpoint loading: the tiny fixtures, dtypes, skipped tensors and clear errors on bad checkpoints."""

from __future__ import annotations

import functools
import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dflash_jax as dj
from conftest import FIXTURES, TINY
from dflash_jax.config import FULL, ConfigError
from dflash_jax.models import loader, qwen36
from dflash_jax.models.loader import CheckpointError

LM = "model.language_model."


@functools.lru_cache(maxsize=None)
def _target(name: str, dtype: str = "float32") -> dj.Target:
    return dj.load_target(os.path.join(FIXTURES, name), dtype=dtype)


@functools.lru_cache(maxsize=None)
def _raw_a() -> dict[str, np.ndarray]:
    return load_file(os.path.join(FIXTURES, "qwen36_tiny_a", "model.safetensors"))


def _raw_tensors(name: str) -> dict[str, np.ndarray]:
    d = os.path.join(FIXTURES, name)
    out: dict[str, np.ndarray] = {}
    for fn in loader.checkpoint_files(d):
        out.update(load_file(fn))
    return out


def _write_ckpt(dst, tensors: dict[str, np.ndarray], config: dict | None = None) -> str:
    """A single-file checkpoint in ``dst`` with tiny_a's config (or ``config``)."""
    dst = str(dst)
    os.makedirs(dst, exist_ok=True)
    src = os.path.join(FIXTURES, "qwen36_tiny_a")
    if config is None:
        shutil.copy(os.path.join(src, "config.json"), dst)
    else:
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    shutil.copy(os.path.join(src, "generation_config.json"), dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def _tiny_a_config() -> dict:
    with open(os.path.join(FIXTURES, "qwen36_tiny_a", "config.json")) as f:
        return json.load(f)


def _assert_trees_equal(a, b):
    chex.assert_trees_all_equal_structs(a, b)
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
    chex.assert_trees_all_equal(a, b)


def _raises(path, exc_type, *needles, **kw):
    with pytest.raises(exc_type) as ei:
        dj.load_target(path, **kw)
    assert ei.type is exc_type, ei.type  # exactly this type, not a sibling ValueError
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)
    return msg


# ---- the fixtures ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_load_fp32_shapes(name):
    t = _target(name)
    cfg = t.config
    chex.assert_trees_all_equal_shapes_and_dtypes(t.params, qwen36.param_shapes(cfg, jnp.float32))
    leaves = jax.tree_util.tree_leaves(t.params)
    assert all(isinstance(x, jax.Array) for x in leaves)
    chex.assert_tree_all_finite(t.params)
    assert isinstance(t.params["layers"], tuple) and len(t.params["layers"]) == cfg.num_layers
    for lt, layer in zip(cfg.layer_types, t.params["layers"]):
        assert ("attn" in layer) == (lt == FULL) and ("gdn" in layer) == (lt != FULL)
    assert t.eos_token_ids == cfg.eos_token_ids  # generation_config's eos equals text_config's here
    assert t.path == os.path.join(FIXTURES, name)


@pytest.mark.parametrize("name", TINY)
def test_values_match_checkpoint_and_vision_skipped(name):
    """Every text tensor lands at its place unchanged; vision tensors exist in the file but are never placed."""
    path = os.path.join(FIXTURES, name)
    raw = _raw_tensors(name)
    visual = [k for k in raw if k.startswith("model.visual.")]
    assert visual, "fixture should carry a vision tower"
    cfg = dj.TargetConfig.from_file(path)
    placed: list[tuple] = []

    def place(p, host):
        placed.append(p)
        return jax.device_put(host)

    params = loader.load_params(path, cfg, jnp.float32, place=place)
    text = [k for k in raw if not k.startswith("model.visual.")]
    assert len(placed) == len(set(placed)) == len(text) == len(jax.tree_util.tree_leaves(params))
    names = loader.hf_name_map(cfg)
    for full in text:
        p = names[full[len(LM):] if full.startswith(LM) else full]
        want = raw[full]
        if p[-1] == "conv":
            assert want.shape[1] == 1
            want = want[:, 0, :]
        np.testing.assert_array_equal(np.asarray(loader._get(params, p)), want, err_msg=full)
    assert not any("visual" in jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_leaves_with_path(params))


def test_sharded_fixture_is_sharded():
    d = os.path.join(FIXTURES, "qwen36_tiny_b")
    files = loader.checkpoint_files(d)
    assert len(files) > 1 and all(os.path.exists(f) for f in files)
    assert not os.path.exists(os.path.join(d, "model.safetensors"))


@pytest.mark.parametrize("name", TINY)
def test_load_bf16(name):
    t32, t16 = _target(name), _target(name, "bfloat16")
    cfg = t16.config
    chex.assert_trees_all_equal_shapes_and_dtypes(t16.params, qwen36.param_shapes(cfg, jnp.bfloat16))
    p = t16.params
    assert p["embed"].dtype == p["lm_head"].dtype == jnp.bfloat16 and p["final_norm"].dtype == jnp.float32
    for layer in p["layers"]:
        assert layer["input_norm"].dtype == layer["post_norm"].dtype == jnp.float32
        assert all(v.dtype == jnp.bfloat16 for v in layer["mlp"].values())
        if "attn" in layer:
            a = layer["attn"]
            assert all(a[k].dtype == jnp.bfloat16 for k in "qkvo")
            assert a["q_norm"].dtype == a["k_norm"].dtype == jnp.float32
        else:
            g = layer["gdn"]
            assert all(g[k].dtype == jnp.bfloat16 for k in ("qkv", "z", "b", "a", "conv", "out"))
            assert all(g[k].dtype == jnp.float32 for k in ("A_log", "dt_bias", "norm"))
    # same values up to the bf16 rounding of the matrices; fp32 leaves exact
    for a, b in zip(jax.tree_util.tree_leaves(t32.params), jax.tree_util.tree_leaves(t16.params)):
        if b.dtype == jnp.float32:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


def test_bad_dtype():
    with pytest.raises(ValueError, match="int8"):
        dj.load_target(os.path.join(FIXTURES, "qwen36_tiny_a"), dtype="int8")


# ---- tensors that are skipped, alternative naming ----------------------------------------------------------------
def test_mtp_tensors_skipped(tmp_path):
    raw = dict(_raw_a())
    rng = np.random.default_rng(0)
    d = raw[LM + "embed_tokens.weight"].shape[1]
    raw["mtp.fc.weight"] = rng.standard_normal((d, 2 * d)).astype(np.float32)
    raw["mtp.norm.weight"] = np.zeros((d,), np.float32)
    raw["mtp.layers.0.self_attn.q_proj.weight"] = np.zeros((7, 3), np.float32)  # any shape: never checked
    raw["model.mtp.layers.0.mlp.up_proj.weight"] = np.zeros((5,), np.float32)
    path = _write_ckpt(tmp_path / "mtp", raw)
    _assert_trees_equal(dj.load_target(path).params, _target("qwen36_tiny_a").params)


@pytest.mark.parametrize("flat_config", [False, True], ids=["nested_config", "text_only_config"])
def test_text_only_naming(tmp_path, flat_config):
    raw = {("model." + k[len(LM):] if k.startswith(LM) else k): v for k, v in _raw_a().items()
           if not k.startswith("model.visual.")}
    assert not any(k.startswith(LM) for k in raw) and "model.embed_tokens.weight" in raw
    cfg = _tiny_a_config()["text_config"] if flat_config else None
    path = _write_ckpt(tmp_path / "text", raw, cfg)
    t = dj.load_target(path)
    ref = _target("qwen36_tiny_a")
    assert t.config == ref.config
    _assert_trees_equal(t.params, ref.params)


def test_tied_embeddings_skip_lm_head(tmp_path):
    cfg = _tiny_a_config()
    cfg["tie_word_embeddings"] = True
    cfg["text_config"]["tie_word_embeddings"] = True
    path = _write_ckpt(tmp_path / "tied", dict(_raw_a()), cfg)  # lm_head.weight present but ignored
    t = dj.load_target(path)
    assert t.config.tie_word_embeddings
    np.testing.assert_array_equal(np.asarray(t.params["lm_head"]), _raw_a()[LM + "embed_tokens.weight"])
    raw = {k: v for k, v in _raw_a().items() if k != "lm_head.weight"}
    t2 = dj.load_target(_write_ckpt(tmp_path / "tied2", raw, cfg))
    _assert_trees_equal(t.params, t2.params)


# ---- bad checkpoints --------------------------------------------------------------------------------------------
def test_missing_tensor(tmp_path):
    raw = dict(_raw_a())
    del raw[LM + "layers.2.linear_attn.A_log"]
    path = _write_ckpt(tmp_path / "ck", raw)
    _raises(path, CheckpointError, "missing", "layers.2.linear_attn.A_log", path)


def test_many_missing_tensors(tmp_path):
    raw = {k: v for k, v in _raw_a().items() if ".layers.1." not in k}
    msg = _raises(_write_ckpt(tmp_path / "ck", raw), CheckpointError, "missing", "layers.1.", "more")
    assert "layers.0." not in msg


def test_missing_lm_head(tmp_path):
    raw = {k: v for k, v in _raw_a().items() if k != "lm_head.weight"}
    _raises(_write_ckpt(tmp_path / "ck", raw), CheckpointError, "missing", "lm_head.weight")


@pytest.mark.parametrize("name,shape", [
    (LM + "layers.0.linear_attn.in_proj_z.weight", (191, 64)),
    (LM + "layers.3.self_attn.q_proj.weight", (128, 64)),  # no output gate rows
    (LM + "layers.1.linear_attn.conv1d.weight", (320, 1, 3)),  # wrong kernel size
    (LM + "norm.weight", (65,)),
    ("lm_head.weight", (255, 64)),
])
def test_wrong_shape(tmp_path, name, shape):
    raw = dict(_raw_a())
    raw[name] = np.zeros(shape, np.float32)
    want = list(_raw_a()[name].shape)
    if "conv1d" in name:
        want, shape = [want[0], want[2]], (shape[0], shape[2])  # reported after squeezing dim 1
    _raises(_write_ckpt(tmp_path / "ck", raw), CheckpointError, repr(name), str(list(shape)), str(want))


@pytest.mark.parametrize("extra,needles", [
    (LM + "layers.0.self_attn.q_proj.weight", ["unexpected tensor"]),  # attention weight on a GDN layer
    (LM + "layers.3.linear_attn.A_log", ["unexpected tensor"]),  # GDN weight on an attention layer
    (LM + "layers.0.mlp.gate_proj.bias", ["unexpected tensor"]),
    (LM + "layers.4.input_layernorm.weight", ["layer index beyond", "num_hidden_layers=4"]),
    ("model.language_model.rotary_emb.inv_freq", ["unexpected tensor"]),
])
def test_unexpected_tensor(tmp_path, extra, needles):
    raw = dict(_raw_a())
    raw[extra] = np.zeros((6,), np.float32)
    _raises(_write_ckpt(tmp_path / "ck", raw), CheckpointError, repr(extra), *needles)


def test_duplicate_tensor_across_naming(tmp_path):
    raw = dict(_raw_a())
    raw["model.norm.weight"] = raw[LM + "norm.weight"]  # the same tensor under both prefixes
    _raises(_write_ckpt(tmp_path / "ck", raw), CheckpointError, "appears twice", "norm.weight")


def _write_sharded(dst, tensors: dict[str, np.ndarray], n_shards: int = 3) -> str:
    dst = str(dst)
    os.makedirs(dst)
    shutil.copy(os.path.join(FIXTURES, "qwen36_tiny_a", "config.json"), dst)
    names = sorted(tensors)
    wm = {}
    for i in range(n_shards):
        fn = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::n_shards]}
        save_file(part, os.path.join(dst, fn))
        wm.update(dict.fromkeys(part, fn))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return dst


def test_sharded_copy_loads(tmp_path):
    path = _write_sharded(tmp_path / "sh", dict(_raw_a()))
    _assert_trees_equal(dj.load_target(path).params, _target("qwen36_tiny_a").params)


def test_index_points_to_missing_shard(tmp_path):
    path = _write_sharded(tmp_path / "sh", dict(_raw_a()))
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    _raises(path, CheckpointError, "model-00002-of-00003.safetensors", "missing", "index")


def test_index_without_weight_map(tmp_path):
    path = _write_sharded(tmp_path / "sh", dict(_raw_a()))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}}, f)
    _raises(path, CheckpointError, "weight_map")


def test_index_not_json(tmp_path):
    path = _write_sharded(tmp_path / "sh", dict(_raw_a()))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        f.write('{"weight_map": {')
    _raises(path, CheckpointError, "model.safetensors.index.json", "not valid JSON")


def test_no_weights(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    shutil.copy(os.path.join(FIXTURES, "qwen36_tiny_a", "config.json"), d)
    _raises(str(d), CheckpointError, "no model.safetensors", "model.safetensors.index.json", str(d))


def test_no_config(tmp_path):
    d = tmp_path / "noconfig"
    d.mkdir()
    save_file(dict(_raw_a()), str(d / "model.safetensors"))
    _raises(str(d), ConfigError, "no config.json")


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_unsupported_model_type(tmp_path, model_type):
    cfg = _tiny_a_config()
    cfg["model_type"] = model_type
    path = _write_ckpt(tmp_path / "ck", dict(_raw_a()), cfg)
    _raises(path, ConfigError, "model_type", repr(model_type))


def test_config_checkpoint_mismatch(tmp_path):
    """A config from one fixture with the weights of the other: a shape error, not a crash later."""
    cfg = _tiny_a_config()
    cfg["text_config"]["hidden_size"] = 128
    _raises(_write_ckpt(tmp_path / "ck", dict(_raw_a()), cfg), CheckpointError, "expected", "from config.json")
