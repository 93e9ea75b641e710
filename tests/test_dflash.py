"""DFlash drafter: config parsing, shapes, the inference/training masks, checkpoint round trip, loss."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import np_oracle
from conftest import FIXTURES
from dflash_jax.config import FULL, SLIDING, ConfigError, DrafterConfig, TargetConfig, build_target_layer_ids
from dflash_jax.models import dflash, quant
from dflash_jax.models.dflash_loader import hf_name_map, load_drafter, save_drafter
from dflash_jax.models.loader import CheckpointError

V = 384
MASK = 383

NANO = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 5,
    "layer_types": [SLIDING] * 4 + [FULL],
    "sliding_window": 8,
    "use_sliding_window": True,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "block_size": 16,
    "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 2, 3, 4, 5]},
    "num_target_layers": 8,
    "vocab_size": V,
    "hidden_act": "silu",
    "attention_bias": False,
}


def nano(**over) -> DrafterConfig:
    return dataclasses.replace(DrafterConfig.from_hf_dict(NANO), **over)


@functools.lru_cache(maxsize=None)
def _params(cfg: DrafterConfig, dtype=jnp.float32):
    return dflash.init_params(cfg, jax.random.PRNGKey(0), dtype, norm_noise=0.1)


@functools.lru_cache(maxsize=None)
def _shared(d: int = 64):
    """The target's embedding and LM head (host arrays, so a jitted caller never caches a tracer)."""
    rng = np.random.default_rng(1)
    return (rng.standard_normal((V, d)).astype(np.float32),
            (rng.standard_normal((V, d)) * d ** -0.5).astype(np.float32))


def _feats(key, *shape) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(key), shape + (5 * 64,), jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _draft(cfg, params, feats, ctx_pos, ctx_valid, tokens, start):
    """draft_forward from raw features [B, C, 5D] (jitted: one compile per config and shape)."""
    embed, head = _shared()
    ks, vs = dflash.context_kv(params, cfg, dflash.fuse(params, cfg, feats), ctx_pos)
    return dflash.draft_forward(params, cfg, embed.astype(params["fc"].dtype), head.astype(params["fc"].dtype),
                                tokens, start, ks, vs, ctx_pos, ctx_valid)


@functools.partial(jax.jit, static_argnums=0)
def _train_j(cfg, params, feats, tokens, anchors, seq_valid):
    embed, head = _shared()
    return dflash.train_forward(params, cfg, embed, head, feats, tokens, anchors, seq_valid)


def _train(cfg, params, feats, tokens, anchors, seq_valid=None):
    """train_forward, always with an explicit seq_valid (so all calls share one compile)."""
    if seq_valid is None:
        seq_valid = jnp.ones(tokens.shape, bool)
    return _train_j(cfg, params, feats, tokens, anchors, seq_valid)


def _draft_cut(cfg, params, feats, anchor_tok, a):
    """Reference: one draft step per row with the context cut to positions [0, a[b]): the features from a[b] on
    are zeroed and marked invalid, so nothing at or after the anchor can leak in. feats [B, S, 5D]; a [B]."""
    b, s = feats.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    valid = pos < a[:, None]
    f = jnp.where(valid[..., None], feats, 0.0)
    toks = dflash.make_blocks(cfg, anchor_tok.astype(jnp.int32))
    return _draft(cfg, params, f, pos, valid, toks, a.astype(jnp.int32))


# ---- config ---------------------------------------------------------------------------------------------------------
def test_nano_config_values():
    c = DrafterConfig.from_hf_dict(NANO)
    assert (c.hidden_size, c.intermediate_size, c.num_layers) == (64, 192, 5)
    assert c.layer_types == (SLIDING,) * 4 + (FULL,) and c.sliding_layers == (0, 1, 2, 3)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.sliding_window) == (4, 2, 16, 8)
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (16, MASK, (1, 2, 3, 4, 5))
    assert c.n_features == 5 and c.fc_in == 320 and c.rope_theta == 1e4
    assert [c.layer_window(i) for i in range(5)] == [8, 8, 8, 8, None]
    assert [c.layer_causal(i) for i in range(5)] == [True] * 4 + [False]
    assert DrafterConfig.from_hf_dict(c.to_hf_dict()) == c
    assert hash(c) == hash(DrafterConfig.from_hf_dict(copy.deepcopy(NANO)))
    with pytest.raises(Exception):
        c.hidden_size = 1  # type: ignore[misc]


def test_config_variants():
    raw = copy.deepcopy(NANO)
    del raw["layer_types"], raw["sliding_window"], raw["use_sliding_window"], raw["block_size"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7}
    raw["dflash_config"] = {"mask_token_id": 7, "block_size": 8}
    raw["num_target_layers"] = 12
    c = DrafterConfig.from_hf_dict(raw)
    assert c.layer_types == (FULL,) * 5 and c.sliding_layers == () and c.rope_theta == 1e7
    assert c.block_size == 8 and c.target_layer_ids == (1, 3, 5, 7, 9)
    assert build_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert build_target_layer_ids(10, 1) == (5,)
    assert c.ddtree_level_bonus == 0.0 and "ddtree_level_bonus" not in c.to_hf_dict()["dflash_config"]


def test_config_carries_a_calibrated_level_bonus():
    raw = copy.deepcopy(NANO)
    raw["dflash_config"]["ddtree_level_bonus"] = 0.3
    c = DrafterConfig.from_hf_dict(raw)
    assert c.ddtree_level_bonus == 0.3
    assert c.to_hf_dict()["dflash_config"]["ddtree_level_bonus"] == 0.3
    assert DrafterConfig.from_hf_dict(c.to_hf_dict()) == c


def _mut(path: str, value=None, delete=False):
    def f(d):
        *head, last = path.split(".")
        node = d
        for k in head:
            node = node[k]
        if delete:
            del node[last]
        else:
            node[last] = value
    return f


@pytest.mark.parametrize("mutate,key", [
    (_mut("hidden_size", delete=True), "hidden_size"),
    (_mut("model_type", "qwen3_5"), "model_type"),
    (_mut("num_hidden_layers", 0), "num_hidden_layers"),
    (_mut("layer_types", [SLIDING] * 4), "layer_types"),
    (_mut("layer_types", ["linear_attention"] * 5), "layer_types"),
    (_mut("sliding_window", None), "sliding_window"),
    (_mut("use_sliding_window", False), "use_sliding_window"),
    (_mut("num_key_value_heads", 3), "num_key_value_heads"),
    (_mut("head_dim", 15), "head_dim"),
    (_mut("rope_theta", delete=True), "rope_theta"),
    (_mut("rope_scaling", {"rope_type": "linear", "factor": 4.0}), "rope_type"),
    (_mut("hidden_act", "gelu"), "hidden_act"),
    (_mut("attention_bias", True), "attention_bias"),
    (_mut("block_size", 1), "block_size"),
    (_mut("dflash_config.block_size", 8), "block_size"),
    (_mut("dflash_config.mask_token_id", delete=True), "mask_token_id"),
    (_mut("dflash_config.mask_token_id", "<|mask|>"), "mask_token_id"),
    (_mut("dflash_config.target_layer_ids", "1,2"), "target_layer_ids"),
    (_mut("dflash_config.target_layer_ids", [1, 2, 3, 4, 9]), "target_layer_ids"),
    (_mut("dflash_config.target_layer_ids", [1, 1, 2, 3, 4]), "target_layer_ids"),
    (_mut("dflash_config.selector_rank", 16), "selector_rank"),
    (_mut("dflash_config", []), "dflash_config"),
    (_mut("num_target_layers", -1), "num_target_layers"),
    (_mut("is_causal", "yes"), "is_causal"),
    (_mut("dflash_config.ddtree_level_bonus", "0.3"), "ddtree_level_bonus"),
    (_mut("dflash_config.ddtree_level_bonus", float("nan")), "ddtree_level_bonus"),
])
def test_config_errors_name_the_key(mutate, key):
    raw = copy.deepcopy(NANO)
    mutate(raw)
    with pytest.raises(ConfigError, match=key):
        DrafterConfig.from_hf_dict(raw)


def test_config_missing_target_layer_ids():
    raw = copy.deepcopy(NANO)
    del raw["dflash_config"]["target_layer_ids"], raw["num_target_layers"]
    with pytest.raises(ConfigError, match="target_layer_ids"):
        DrafterConfig.from_hf_dict(raw)


def test_config_from_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        DrafterConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        DrafterConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(NANO))
    assert DrafterConfig.from_file(tmp_path) == nano()


def test_validate_against_target():
    tgt = TargetConfig.from_file(os.path.join(FIXTURES, "qwen36_tiny_a"))  # hidden 64, 4 layers, vocab 256
    ok = nano(target_layer_ids=(0, 1, 2, 3), num_target_layers=4, vocab_size=256, mask_token_id=250)
    ok.validate_against(tgt)
    with pytest.raises(ConfigError, match="target_layer_ids"):
        nano(num_target_layers=None, vocab_size=None, mask_token_id=250).validate_against(tgt)
    for bad, key in [(dict(hidden_size=32), "hidden_size"), (dict(num_target_layers=8), "num_target_layers"),
                     (dict(vocab_size=384), "vocab_size"), (dict(mask_token_id=300), "mask_token_id")]:
        with pytest.raises(ConfigError, match=key):
            dataclasses.replace(ok, **bad).validate_against(tgt)


# ---- shapes and dtypes ------------------------------------------------------------------------------------------------
S = 40  # sequence / padded context length used by every model-level test (one compile per config)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shapes_and_dtypes(dtype):
    cfg = nano()
    params = dflash.init_params(cfg, jax.random.PRNGKey(0), dtype)
    chex.assert_trees_all_equal_shapes_and_dtypes(params, dflash.param_shapes(cfg, dtype))
    chex.assert_shape(params["fc"], (64, 320))
    assert params["hidden_norm"].dtype == jnp.float32 and params["layers"][0]["attn"]["q"].shape == (64, 64)
    assert params["layers"][0]["attn"]["k"].shape == (32, 64) and params["layers"][4]["attn"]["o"].shape == (64, 64)
    assert len(params["layers"]) == 5 and params["layers"][2]["mlp"]["down"].shape == (64, 192)
    b, blk = 2, cfg.block_size
    feats = _feats(2, b, S)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (b, S))

    @jax.jit
    def ctx_fn(params, feats, pos):
        ctx = dflash.fuse(params, cfg, feats)
        return ctx, dflash.context_kv(params, cfg, ctx, pos), dflash.context_kv(params, cfg, ctx[1], pos[1])

    ctx, (ks, vs), (ku, vu) = ctx_fn(params, feats, pos)
    chex.assert_shape(ctx, (b, S, 64))
    chex.assert_type(ctx, dtype)
    assert len(ks) == len(vs) == 5
    chex.assert_shape(list(ks) + list(vs), (b, S, 2, 16))
    chex.assert_type(list(ks) + list(vs), dtype)
    chex.assert_shape(list(ku) + list(vu), (S, 2, 16))
    chex.assert_trees_all_close(ku, tuple(k[1] for k in ks))
    toks = dflash.make_blocks(cfg, jnp.array([5, 9], jnp.int32))
    chex.assert_shape(toks, (b, blk))
    assert (toks[:, 1:] == MASK).all() and list(toks[:, 0]) == [5, 9]
    logits = _draft(cfg, params, feats, pos, jnp.ones((b, S), bool), toks, jnp.array([S, 10], jnp.int32))
    chex.assert_shape(logits, (b, blk, V))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)
    if dtype == jnp.float32:
        tokens = jax.random.randint(jax.random.PRNGKey(3), (b, S), 0, V)
        tl = _train(cfg, params, feats, tokens, jnp.array([[0, 7, 20, 39], [3, 4, 23, 30]], jnp.int32))
        chex.assert_shape(tl, (b, 4, blk, V))
        chex.assert_type(tl, jnp.float32)
        chex.assert_tree_all_finite(tl)


# ---- an independent numpy oracle (z-lab's formulation: one key sequence [context ; block], index masks) -------------
def _np_rms(x, w, eps=1e-6):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def _np_rope(x, pos, theta, rp=None):  # x [T, H, d]; rotate_half NEOX over all d dims; rp: YaRN rope_parameters
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    mscale = 1.0
    if rp is not None:
        inv, mscale = np_oracle.yarn_inv_freq(inv, d, theta, rp, 0)
    ang = pos[:, None] * inv[None]
    cos = mscale * np.cos(np.concatenate([ang, ang], -1))[:, None]
    sin = mscale * np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def _np_draft(cfg, params, embed, head, feats, tokens, rp=None):
    """Logits [blk, V] of one block right after a context of C = len(feats) positions (float64); rp: the
    config's YaRN rope_parameters (None: plain rotary)."""
    P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    c, blk, hd = feats.shape[0], len(tokens), cfg.head_dim
    ctx = _np_rms(np.asarray(feats, np.float64) @ P["fc"].T, P["hidden_norm"])
    h = np.asarray(embed, np.float64)[tokens]
    qpos, kpos = np.arange(c, c + blk), np.arange(c + blk)
    for i, L in enumerate(P["layers"]):
        a = L["attn"]
        u = _np_rms(h, L["input_norm"])
        q = _np_rope(_np_rms((u @ a["q"].T).reshape(blk, -1, hd), a["q_norm"]), qpos, cfg.rope_theta, rp)
        x = np.concatenate([ctx, u])
        k = _np_rope(_np_rms((x @ a["k"].T).reshape(c + blk, -1, hd), a["k_norm"]), kpos, cfg.rope_theta, rp)
        v = (x @ a["v"].T).reshape(c + blk, -1, hd)
        vis = np.ones((blk, c + blk), bool)
        if cfg.layer_causal(i):
            vis &= kpos[None] <= qpos[:, None]
        if cfg.layer_window(i) is not None:
            vis &= qpos[:, None] - kpos[None] < cfg.layer_window(i)
        g = cfg.num_heads // cfg.num_kv_heads
        out = np.zeros((blk, cfg.num_heads, hd))
        for hh in range(cfg.num_heads):
            sc = q[:, hh] @ k[:, hh // g].T / np.sqrt(hd)
            sc = np.where(vis, sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            out[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, hh // g]
        h = h + out.reshape(blk, -1) @ a["o"].T
        m = L["mlp"]
        y = _np_rms(h, L["post_norm"])
        gate = y @ m["gate"].T
        h = h + (gate / (1 + np.exp(-gate)) * (y @ m["up"].T)) @ m["down"].T
    return _np_rms(h, P["norm"]) @ np.asarray(head, np.float64).T


YARN_RP = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}  # S = 40 > 16 positions


@pytest.mark.parametrize("layers", ["nano", "all_full", "yarn"])
def test_draft_forward_matches_numpy_oracle(layers):
    """The drafter against an independent float64 forward; ``yarn``: a YaRN drafter config (x4 over 16 positions)
    against the oracle's own YaRN frequencies and attention factor."""
    rp = YARN_RP if layers == "yarn" else None
    cfg = (nano() if layers == "nano" else nano(layer_types=(FULL,) * 5) if layers == "all_full"
           else DrafterConfig.from_hf_dict({**NANO, "rope_scaling": rp}))
    params = _params(cfg)
    embed, head = _shared()
    feats = _feats(15, 2, S)
    toks = jnp.array([[11] + [MASK] * 15, list(range(100, 116))], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (2, S))
    out = _draft(cfg, params, feats, pos, jnp.ones((2, S), bool), toks, jnp.array([S, S], jnp.int32))
    for b in range(2):
        ref = _np_draft(cfg, params, embed, head, np.asarray(feats[b]), np.asarray(toks[b]), rp)
        np.testing.assert_allclose(np.asarray(out[b]), ref, rtol=2e-4, atol=2e-4)
    if rp is not None:  # the scaling is applied, not just parsed: the plain drafter's logits differ
        plain = _draft(nano(), params, feats, pos, jnp.ones((2, S), bool), toks, jnp.array([S, S], jnp.int32))
        assert float(jnp.abs(plain - out).max()) > 1e-2


def test_yarn_config_round_trips():
    c = DrafterConfig.from_hf_dict({**NANO, "rope_scaling": YARN_RP})
    y = c.rope_scaling
    assert (y.factor, y.original_max_position_embeddings) == (4.0, 16)
    assert y.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert DrafterConfig.from_hf_dict(c.to_hf_dict()) == c and nano().rope_scaling is None


# ---- the key property: the parallel training mask == the inference forward block by block -------------------------
ANCHORS = jnp.array([[0, 5, 17, 30], [3, 9, 25, 39]], jnp.int32)  # anchor 0: no context; 39: block runs past S


def test_train_forward_equals_blockwise_draft():
    cfg = nano()  # 4 sliding layers with W=8 < block (the window bounds context and block) + 1 full layer
    params = _params(cfg)
    feats = _feats(5, 2, S)
    tokens = jax.random.randint(jax.random.PRNGKey(6), (2, S), 0, V - 1)
    tl = _train(cfg, params, feats, tokens, ANCHORS)
    for n in range(ANCHORS.shape[1]):
        a = ANCHORS[:, n]
        ref = _draft_cut(cfg, params, feats, jnp.take_along_axis(tokens, a[:, None], 1)[:, 0], a)
        np.testing.assert_allclose(np.asarray(tl[:, n]), np.asarray(ref), rtol=1e-4, atol=1e-4,
                                   err_msg=f"anchors {a}")


def test_train_forward_blocks_are_independent_and_see_only_earlier_context():
    cfg = nano()
    params = _params(cfg)
    feats = _feats(7, 2, S)
    tokens = jax.random.randint(jax.random.PRNGKey(8), (2, S), 0, V - 1)
    base = _train(cfg, params, feats, tokens, ANCHORS)
    # row 0: features from position 5 on and the tokens of the other blocks change; block 1 (anchor 5) and
    # block 0 (anchor 0) do not see them
    f2 = feats.at[0, 5:].set(feats[0, 5:] * -3.0 + 1.0)
    t2 = tokens.at[0, 17].add(1).at[0, 30].add(1)
    out = _train(cfg, params, f2, t2, ANCHORS)
    np.testing.assert_allclose(out[0, :2], base[0, :2], rtol=1e-5, atol=1e-5)
    assert not np.allclose(out[0, 2:], base[0, 2:], atol=1e-3)
    np.testing.assert_allclose(out[1], base[1], rtol=1e-5, atol=1e-5)
    # seq_valid hides context positions: hiding 10.. equals zeroing them out and hiding them
    valid = jnp.ones((2, S), bool).at[:, 10:].set(False)
    hidden = _train(cfg, params, f2, t2, ANCHORS, valid)
    zeroed = _train(cfg, params, jnp.where(valid[..., None], f2, 0.0), t2, ANCHORS, valid)
    np.testing.assert_allclose(hidden, zeroed, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hidden[:, :1], out[:, :1], rtol=1e-5, atol=1e-5)  # anchors 0 and 3 < 10


# ---- masks ------------------------------------------------------------------------------------------------------------
def test_mask_sets():
    blk, w = 16, 8
    start = 30
    pos = jnp.arange(start + 5, dtype=jnp.int32)[None]
    valid = jnp.ones_like(pos, bool)
    full = dflash.context_mask(pos, valid, jnp.array([[start]]), blk, None)[0, 0]
    slid = dflash.context_mask(pos, valid, jnp.array([[start]]), blk, w)[0, 0]
    chex.assert_shape([full, slid], (blk, start + 5))
    for o in range(blk):
        assert set(np.nonzero(np.asarray(full[o]))[0]) == set(range(start))
        assert set(np.nonzero(np.asarray(slid[o]))[0]) == set(range(max(0, start + o - (w - 1)), start))
    bf = np.asarray(dflash.block_mask(blk, False, None))
    bs = np.asarray(dflash.block_mask(blk, True, w))
    assert bf.all()
    for o in range(blk):
        assert set(np.nonzero(bs[o])[0]) == set(range(max(0, o - (w - 1)), o + 1))
    assert np.asarray(dflash.block_mask(blk, True, 64)).tolist() == np.tril(np.ones((blk, blk), bool)).tolist()
    # is_causal overrides the per-layer default
    assert [nano(is_causal=True).layer_causal(i) for i in range(5)] == [True] * 5
    assert [nano(is_causal=False).layer_causal(i) for i in range(5)] == [False] * 5


ALL_SLIDING = (SLIDING,) * 5


def test_sliding_differs_from_unbounded_only_past_the_window():
    w = 32  # >= block size, so the window bound sits in the context only
    cfg_w, cfg_inf = nano(layer_types=ALL_SLIDING, sliding_window=w), nano(layer_types=ALL_SLIDING,
                                                                               sliding_window=10 ** 6)
    params = _params(cfg_w)
    feats = _feats(9, 2, S)
    toks = jnp.array([7, 8], jnp.int32)
    # the last block query (offset 15) sees context >= start + 15 - (w - 1): all of it iff start <= 16
    for starts, same in [((16, 10), (True, True)), ((17, 30), (False, False))]:
        a = jnp.array(starts, jnp.int32)
        x, y = _draft_cut(cfg_w, params, feats, toks, a), _draft_cut(cfg_inf, params, feats, toks, a)
        for b in range(2):
            assert np.allclose(x[b], y[b], atol=1e-5) == same[b], starts[b]
            np.testing.assert_allclose(x[b, :1], y[b, :1], atol=1e-5)  # offset 0 sees all of <= 31 back


def test_full_layers_bidirectional_sliding_causal():
    feats = _feats(10, 2, S)
    toks = jax.random.randint(jax.random.PRNGKey(11), (2, 16), 0, V)
    toks2 = toks.at[:, 10].set((toks[:, 10] + 1) % V)
    start = jnp.array([6, 20], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (2, S))
    valid = jnp.ones((2, S), bool)
    for cfg, causal in [(nano(layer_types=(FULL,) * 5), False),
                        (nano(layer_types=ALL_SLIDING, sliding_window=10 ** 6), True)]:
        params = _params(cfg)
        a = _draft(cfg, params, feats, pos, valid, toks, start)
        b = _draft(cfg, params, feats, pos, valid, toks2, start)
        assert np.allclose(a[:, :10], b[:, :10], atol=1e-5) == causal
        assert not np.allclose(a[:, 10:], b[:, 10:], atol=1e-3)


# ---- padded / stale context --------------------------------------------------------------------------------------------
def test_padded_context_does_not_change_logits():
    cfg = nano()
    params = _params(cfg)
    feats = _feats(12, 2, S)
    garbage = _feats(13, 2, S) * 5
    lens = jnp.array([20, 20], jnp.int32)
    tokens = jnp.array([3, 4], jnp.int32)
    toks = dflash.make_blocks(cfg, tokens)
    # reference: the exact, unpadded context of each row
    refs = _draft(cfg, params, feats[:, :20], jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20)),
                  jnp.ones((2, 20), bool), toks, lens)
    # padding: garbage features at junk positions, ctx_valid False
    idx = jnp.arange(S)
    valid = idx[None, :] < lens[:, None]
    f = jnp.where(valid[..., None], feats, garbage)
    pos = jnp.where(valid, idx[None, :], 7).astype(jnp.int32)
    out = _draft(cfg, params, f, pos, valid, toks, lens)
    # stale entries (valid, but at positions >= block_start, e.g. after a rollback) are not seen either
    pos2 = jnp.broadcast_to(idx, (2, S)).astype(jnp.int32)
    out2 = _draft(cfg, params, f, pos2, jnp.ones((2, S), bool), toks, lens)
    # the context may also sit anywhere in the buffer: keys are found by position, not by index
    perm = jax.random.permutation(jax.random.PRNGKey(14), S)
    out3 = _draft(cfg, params, f[:, perm], pos[:, perm], valid[:, perm], toks, lens)
    for b in range(2):
        for o in (out, out2, out3):
            np.testing.assert_allclose(o[b], refs[b], rtol=1e-4, atol=1e-4)


# ---- checkpoints -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_load_round_trip(tmp_path, dtype):
    cfg = nano()
    params = dflash.init_params(cfg, jax.random.PRNGKey(2), dtype, norm_noise=0.1)
    save_drafter(tmp_path, cfg, params)
    raw = load_file(str(tmp_path / "model.safetensors"))
    assert set(raw) == set(hf_name_map(cfg)) and len(raw) == 3 + 11 * 5
    assert raw["fc.weight"].shape == (64, 320) and raw["layers.4.self_attn.q_norm.weight"].shape == (16,)
    cfg2, p2 = load_drafter(tmp_path, dtype)
    assert cfg2 == cfg
    chex.assert_trees_all_equal_shapes_and_dtypes(p2, params)
    chex.assert_trees_all_equal(p2, params)  # bit-exact
    # an optional "model." prefix and the target's embedding / head copies are accepted
    d2 = tmp_path / "prefixed"
    d2.mkdir()
    (d2 / "config.json").write_text((tmp_path / "config.json").read_text())
    save_file({"model." + k: v for k, v in raw.items()} | {"lm_head.weight": np.zeros((V, 64), np.float32)},
              str(d2 / "model.safetensors"))
    chex.assert_trees_all_equal(load_drafter(d2, dtype)[1], params)


def _bad_ckpt(tmp_path, edit) -> str:
    cfg = nano()
    src = tmp_path / "good"
    if not src.exists():
        save_drafter(src, cfg, dflash.init_params(cfg, jax.random.PRNGKey(2), jnp.float32))
    raw = load_file(str(src / "model.safetensors"))
    edit(raw)
    dst = tmp_path / f"bad{len(os.listdir(tmp_path))}"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(raw, str(dst / "model.safetensors"))
    return str(dst)


@pytest.mark.parametrize("edit,pattern", [
    (lambda r: r.pop("layers.2.self_attn.k_norm.weight"), r"missing.*layers\.2\.self_attn\.k_norm\.weight"),
    (lambda r: r.update({"fc.weight": r["fc.weight"].T.copy()}), r"fc\.weight.*\[320, 64\].*\[64, 320\]"),
    (lambda r: r.update({"layers.1.mlp.up_proj.weight": r["layers.1.mlp.up_proj.weight"][:100]}),
     r"layers\.1\.mlp\.up_proj\.weight.*\[100, 64\].*\[192, 64\]"),
    (lambda r: r.update({"layers.0.self_attn.gate_proj.weight": np.zeros((4, 4), np.float32)}),
     r"unexpected tensor 'layers\.0\.self_attn\.gate_proj\.weight'"),
    (lambda r: r.update({"layers.5.input_layernorm.weight": np.zeros((64,), np.float32)}),
     r"layers\.5\.input_layernorm\.weight.*num_hidden_layers=5"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, edit, pattern):
    with pytest.raises(CheckpointError, match=pattern):
        load_drafter(_bad_ckpt(tmp_path, edit), jnp.float32)


def test_no_checkpoint_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(NANO))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_drafter(tmp_path)


# ---- training objective --------------------------------------------------------------------------------------------------
def test_loss_weights_decay():
    w = np.asarray(dflash.loss_weights(16, 7.0))
    assert w.shape == (16,) and w[0] == 0.0 and w[1] == pytest.approx(1.0)
    for k in range(1, 16):
        assert w[k] == pytest.approx(math.exp(-(k - 1) / 7.0), rel=1e-6)
    assert np.all(np.diff(w[1:]) < 0)


def test_dflash_loss():
    blk = 16
    loss_fn = jax.jit(dflash.dflash_loss, static_argnames="gamma")
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, blk, V))
    labels = jax.random.randint(jax.random.PRNGKey(1), (2, 3, blk), 0, V)
    valid = jnp.ones((2, 3, blk), bool).at[1, 2, 9:].set(False)
    loss = loss_fn(logits, labels, valid, gamma=7.0)
    x = np.asarray(logits, np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.asarray(labels)[..., None], -1)[..., 0]
    w = np.asarray(dflash.loss_weights(blk, 7.0))[None, None] * np.asarray(valid)
    assert float(loss) == pytest.approx(float((w * ce).sum() / w.sum()), rel=1e-5)
    # offset 0 is unsupervised: its logits and label do not matter, its gradient is zero
    l2 = loss_fn(logits.at[..., 0, :].set(0.0), labels.at[..., 0].set(0), valid)
    assert float(l2) == pytest.approx(float(loss), rel=1e-6)
    g = jax.jit(jax.grad(lambda x: dflash.dflash_loss(x, labels, valid)))(logits)
    assert float(jnp.abs(g[..., 0, :]).max()) == 0.0 and float(jnp.abs(g[..., 1, :]).max()) > 0
    assert float(jnp.abs(g[1, 2, 9:]).max()) == 0.0
    # perfect predictions -> ~0 loss, acceptance length = blk
    perfect = jax.nn.one_hot(labels, V) * 100.0
    assert float(loss_fn(perfect, labels, jnp.ones_like(valid))) < 1e-6
    assert (np.asarray(dflash.acceptance_length(perfect, labels)) == blk).all()
    wrong = perfect.at[..., 4, :].set(-perfect[..., 4, :])
    assert (np.asarray(dflash.acceptance_length(wrong, labels)) == 4).all()


def test_anchors_labels_and_gradient():
    cfg = nano()
    s = 40
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, s), 0, V - 1)
    loss_mask = jnp.zeros((2, s), bool).at[0, 10:35].set(True).at[1, 30:32].set(True)
    anchors, ok = dflash.sample_anchors(jax.random.PRNGKey(1), loss_mask, 6)
    chex.assert_shape([anchors, ok], (2, 6))
    a0 = np.asarray(anchors[0])
    assert ok[0].all() and len(set(a0)) == 6 and list(a0) == sorted(a0)
    assert all(10 <= a <= 33 for a in a0)
    assert list(np.asarray(ok[1])) == [True] + [False] * 5 and int(anchors[1, 0]) == 30
    labels, valid = dflash.block_labels(cfg, tokens, anchors, loss_mask, ok)
    chex.assert_shape([labels, valid], (2, 6, 16))
    a = int(anchors[0, 0])
    assert list(np.asarray(labels[0, 0])) == list(np.asarray(tokens[0, a:a + 16]))
    assert list(np.asarray(valid[1, 0])) == [True, True] + [False] * 14 and not valid[1, 1:].any()
    lab2, val2 = dflash.block_labels(cfg, tokens, jnp.array([[30], [38]], jnp.int32))
    assert np.asarray(val2[1, 0]).sum() == 2  # positions 38, 39 inside the sequence
    # one training step's gradient (1-layer drafter, to keep the compile short) is finite and reaches every parameter
    small = nano(num_layers=1, layer_types=(SLIDING,))
    params = _params(small)
    embed, head = _shared()
    feats = _feats(3, 2, s)

    @jax.jit
    @jax.value_and_grad
    def loss_and_grad(p):
        logits = dflash.train_forward(p, small, embed, head, feats, tokens, anchors)
        return dflash.dflash_loss(logits, labels, valid)

    loss, g = loss_and_grad(params)
    assert np.isfinite(float(loss))
    chex.assert_tree_all_finite(g)
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree_util.tree_leaves(g))


def test_fused_context_kv_equals_the_per_layer_projections():
    """fuse_context_kv: every layer's context K/V from one matmul over the joined k / v matrices equal the per-layer
    projections (float32, and fp8 weights joined with their scales); mixed formats are left unjoined."""
    cfg = nano()
    params = _params(cfg)
    ctx = jnp.asarray(np.random.default_rng(0).standard_normal((2, 7, cfg.hidden_size)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(3, 10, dtype=jnp.int32), (2, 7))
    for p in (params, quant.quantize_params(params, "fp8")):
        fused = dflash.fuse_context_kv(p)
        n = 2 * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers
        assert fused[dflash.CONTEXT_KV].shape == (n, cfg.hidden_size) and dflash.fuse_context_kv(fused) is fused
        for a, b in zip(jax.tree.leaves(dflash.context_kv(fused, cfg, ctx, pos)),
                        jax.tree.leaves(dflash.context_kv(p, cfg, ctx, pos))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    layers = list(params["layers"])
    layers[1] = {**layers[1], "attn": {**layers[1]["attn"], "k": quant.quantize_fp8(layers[1]["attn"]["k"])}}
    mixed = {**params, "layers": tuple(layers)}
    assert dflash.CONTEXT_KV not in dflash.fuse_context_kv(mixed)
