"""The Qwen3 dense scorer model: shapes, chunked prefill == one full pass, tail attention, HF round trip, errors."""

from __future__ import annotations

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import np_oracle
from dflash_jax.config import ConfigError
from dflash_jax.models import dense, dense_scoring
from dflash_jax.models.loader import CheckpointError
from dflash_jax.models.qwen36 import rms_norm

CFG = dense.DenseConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=8, rope_theta=1e4)
TIED = dense.DenseConfig(**{**CFG.__dict__, "tie_word_embeddings": True})
YARN_RP = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}  # T = 37 > 16 positions
YARN = dense.DenseConfig.from_hf_dict({**CFG.to_hf_dict(), "rope_scaling": YARN_RP})
T = 37  # not a multiple of any chunk used


@pytest.fixture(scope="module")
def params():
    return dense.init_params(CFG, jax.random.key(0), jnp.float32, norm_noise=0.1)


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, T).astype(np.int32)


@pytest.fixture(scope="module")
def full(params, ids):
    return dense.forward(params, CFG, ids)


def _hf(**over):
    d = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
         "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
         "head_dim": 128, "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
         "rope_scaling": None, "tie_word_embeddings": True, "max_position_embeddings": 40960,
         "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28, "torch_dtype": "bfloat16"}
    d.update(over)
    return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()


# ---- config --------------------------------------------------------------------------------------------------------
def test_config_parses_qwen3_0_6b_and_round_trips():
    cfg = dense.DenseConfig.from_hf_dict(_hf())
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (28, 16, 8, 128)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 1e6
    assert dense.DenseConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert dense.DenseConfig.from_hf_dict(_hf(head_dim=_DROP)).head_dim == 1024 // 16
    assert cfg.rope_scaling is None


def test_config_parses_yarn_as_qwen3_documents_it():
    """Qwen3's model card extends 32K to 128K with ``rope_scaling: {rope_type: yarn, factor: 4.0,
    original_max_position_embeddings: 32768}``."""
    cfg = dense.DenseConfig.from_hf_dict(_hf(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 32768},
                                             max_position_embeddings=131072))
    y = cfg.rope_scaling
    assert (y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow) == (4.0, 32768, 32.0, 1.0)
    assert y.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1.0)
    assert dense.DenseConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("over, key", [
    ({"model_type": "qwen3_5"}, "model_type"),
    ({"vocab_size": _DROP}, "vocab_size"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention"] * 28}, "layer_types"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope_type"),
    ({"dflash_config": {"mask_token_id": 1}}, "dflash_config"),
    ({"head_dim": 7}, "head_dim"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"num_experts": 8}, "num_experts"),
])
def test_bad_config_names_the_key(over, key):
    with pytest.raises(ConfigError, match=key):
        dense.DenseConfig.from_hf_dict(_hf(**over))


# ---- shapes --------------------------------------------------------------------------------------------------------
def test_param_shapes_and_init(params):
    chex.assert_trees_all_equal_shapes_and_dtypes(params, dense.param_shapes(CFG, jnp.float32))
    tied = dense.init_params(TIED, jax.random.key(1), jnp.bfloat16)
    assert tied["lm_head"] is tied["embed"]
    assert tied["layers"][0]["attn"]["q_norm"].dtype == jnp.float32 and tied["embed"].dtype == jnp.bfloat16


def test_forward_shapes(full):
    logits, k, v = full
    chex.assert_shape(logits, (T, CFG.vocab_size))
    chex.assert_shape([k, v], (CFG.num_layers, T, CFG.num_kv_heads, CFG.head_dim))
    chex.assert_tree_all_finite(full)


# ---- chunked prefill -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_chunked_prefill_equals_full_pass(params, ids, full, chunk):
    logits, k, v = full
    last, cache = dense.prefill_chunked(params, CFG, ids, chunk=chunk)
    assert cache.length == T and cache.k.shape[1] % chunk == 0 and cache.k.shape[1] >= T
    chex.assert_shape(last, (CFG.vocab_size,))
    np.testing.assert_allclose(last, logits[-1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cache.k[:, :T], k, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cache.v[:, :T], v, rtol=1e-4, atol=1e-4)


def test_prefill_capacity_and_id_errors(params, ids):
    assert dense.capacity_for(T, 4) == 48 and dense.capacity_for(1, 4) == 4 and dense.capacity_for(33, 1) == 48
    with pytest.raises(ValueError, match="capacity"):
        dense.prefill_chunked(params, CFG, ids, chunk=16, capacity=40)
    with pytest.raises(ValueError, match="vocab_size"):
        dense.prefill_chunked(params, CFG, np.array([1, CFG.vocab_size]), chunk=16)
    with pytest.raises(ValueError, match="chunk"):
        dense.prefill_chunked(params, CFG, ids, chunk=0)


# ---- tail attention ------------------------------------------------------------------------------------------------
def _layer0_reference(params, ids, nq, nope, rp=None):
    """Tail probabilities of layer 0 from a plain T x T computation (its input is the embedding), rotated by
    ``np_oracle.rope`` (float64; ``rp``: YaRN rope_parameters)."""
    a = params["layers"][0]["attn"]
    u = rms_norm(params["embed"][ids], params["layers"][0]["input_norm"], CFG.rms_norm_eps)
    pos = jnp.arange(T)
    q = rms_norm((u @ a["q"].T).reshape(T, CFG.num_heads, -1), a["q_norm"], CFG.rms_norm_eps)
    k = rms_norm((u @ a["k"].T).reshape(T, CFG.num_kv_heads, -1), a["k_norm"], CFG.rms_norm_eps)
    if not nope:
        hd = CFG.head_dim
        q, k = (jnp.asarray(np_oracle.rope(np.asarray(x, np.float64), hd, CFG.rope_theta, rp), jnp.float32)
                for x in (q, k))
    k = jnp.repeat(k, CFG.num_heads // CFG.num_kv_heads, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) * CFG.head_dim ** -0.5
    s = jnp.where(pos[None, :] <= pos[:, None], s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1)[:, T - nq:]


@pytest.mark.parametrize("nope", [False, True])
@pytest.mark.parametrize("yarn", [False, True])
def test_tail_attention_rows_causal_and_match_reference(params, ids, nope, yarn):
    """Layer 0 against a T x T reference rotated by the float64 oracle; a YaRN scorer's NoPE scores undo the
    scaling too (its attention factor is divided out, not squared), so they equal the plain scorer's at layer 0."""
    nq, cfg, rp = 8, YARN if yarn else CFG, YARN_RP if yarn else None
    att = dense.tail_attention(params, cfg, ids, n_query=nq, chunk=8, nope=nope)
    chex.assert_shape(att, (cfg.num_layers, cfg.num_heads, nq, T))
    np.testing.assert_allclose(att.sum(-1), 1.0, atol=1e-5)
    for i in range(nq):
        assert float(jnp.abs(att[:, :, i, T - nq + i + 1:]).max(initial=0.0)) == 0.0  # nothing after the query
    assert float(att.min()) >= 0.0
    np.testing.assert_allclose(att[0], _layer0_reference(params, ids, nq, nope, rp), rtol=1e-4, atol=1e-6)
    # the last n_layers only, and independent of the prefill chunk
    last2 = dense.tail_attention(params, cfg, ids, n_query=nq, n_layers=2, chunk=16, nope=nope)
    np.testing.assert_allclose(last2, att[1:], rtol=1e-4, atol=1e-6)
    if yarn and not nope:  # the scaling is applied: the plain scorer's layer 0 differs
        plain = dense.tail_attention(params, CFG, ids, n_query=nq, n_layers=CFG.num_layers, chunk=8)
        assert float(jnp.abs(plain[0] - att[0]).max()) > 1e-3


def test_unrope_inverts_rope_with_yarn():
    x = jax.random.normal(jax.random.key(3), (T, 2, CFG.head_dim), jnp.float32)
    pos = jnp.arange(T, dtype=jnp.int32) * 5
    for scaling in (None, YARN.rope_scaling):
        y = dense._rope1(x, pos, CFG.rope_theta, scaling)
        np.testing.assert_allclose(dense._unrope1(y, pos, CFG.rope_theta, scaling), x, rtol=1e-5, atol=1e-5)


def test_tail_attention_short_prompt_and_errors(params, ids):
    att = dense.tail_attention(params, CFG, ids[:5], n_query=8, chunk=4)
    chex.assert_shape(att, (CFG.num_layers, CFG.num_heads, 5, 5))
    np.testing.assert_allclose(att.sum(-1), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="n_layers"):
        dense.tail_attention(params, CFG, ids, n_layers=CFG.num_layers + 1)
    with pytest.raises(ValueError, match="n_query"):
        dense.tail_attention(params, CFG, ids, n_query=0)


# ---- the scoring pass's causal attention ---------------------------------------------------------------------------
def _naive_causal(q, k, v):
    t, h, d = q.shape
    k, v = (jnp.repeat(a.astype(jnp.float32), h // a.shape[1], axis=1) for a in (k, v))
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k) * d ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("block", [8, 16, 48])
def test_causal_attention_xla_blocks_equal_naive(dtype, tol, block):
    kq, kk, kv = jax.random.split(jax.random.key(4), 3)
    t = 48
    q = jax.random.normal(kq, (t, 4, 8)).astype(dtype)
    k = jax.random.normal(kk, (t, 2, 8)).astype(dtype)
    v = jax.random.normal(kv, (t, 2, 8)).astype(dtype)
    o = jax.jit(dense_scoring.causal_attention, static_argnums=(3, 4))(q, k, v, "xla", block)
    assert o.dtype == dtype and o.shape == q.shape
    np.testing.assert_allclose(np.asarray(o, np.float32), _naive_causal(q, k, v), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="multiple"):
        dense_scoring.causal_attention(q[:40], k[:40], v[:40], "xla", 16)
    with pytest.raises(ValueError, match="cudnn"):
        dense_scoring.causal_attention(q, k, v, "flash", 16)


def test_cudnn_attention_lowers_to_causal_flash_attention(monkeypatch):
    """Off GPU the cuDNN path cannot run, but it lowers for CUDA: one fused flash-attention call with the causal mask
    over the whole prompt, GQA heads passed as they are (the version/capability checks are stubbed)."""
    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fa, "check_compute_capability", lambda _: True)
    t = 4096
    q = jax.ShapeDtypeStruct((t, 16, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((t, 8, 128), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: dense_scoring.causal_attention(q, k, v, "cudnn", 512))
    txt = f.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text().replace("\\22", '"')
    assert txt.count("custom_call @__cudnn$fmha") == 1
    assert '"is_flash_attention": true' in txt and '"mask_type": "CAUSAL"' in txt
    assert "tensor<1x4096x8x128xbf16>" in txt


@pytest.mark.parametrize("cfg", [CFG, YARN], ids=["plain", "yarn"])
def test_tail_max_attention_equals_max_of_tail_attention(params, ids, cfg):
    att = dense.tail_attention(params, cfg, ids, n_query=8, n_layers=2, chunk=8, nope=True)
    run, t = dense_scoring.tail_max_attention(params, cfg, ids, n_query=8, n_layers=2, nope=True, block=16)
    assert t == T and run.shape == (8, dense.capacity_for(T, 16))
    np.testing.assert_allclose(run[:, :T], att.max(axis=(0, 1)), rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(run[:, T:]).max()) == 0.0  # padding rows are never attended
    with pytest.raises(ValueError, match="resolve"):
        dense_scoring.tail_max_attention(params, CFG, ids, attention="auto")



@pytest.mark.parametrize("heads", [1, 2])
def test_sliced_layers_equal_one_dispatch_per_layer(params, ids, heads):
    """Slicing a layer into q/k/v, per-head-group attention and output dispatches changes nothing but the count."""
    tp = dense.capacity_for(T, 16)
    budget = dense_scoring.attention_flops(tp, CFG.head_dim, heads)
    assert dense_scoring.dispatch_heads(CFG, tp, budget) == heads
    whole, sliced = [], []
    ref, _ = dense_scoring.tail_max_attention(params, CFG, ids, n_layers=2, block=16, max_dispatch_flops=None,
                                              step_times=whole)
    run, _ = dense_scoring.tail_max_attention(params, CFG, ids, n_layers=2, block=16, max_dispatch_flops=budget,
                                              step_times=sliced)
    np.testing.assert_allclose(run, ref, rtol=1e-5, atol=1e-7)
    assert len(whole) == 1 + CFG.num_layers
    # embedding, (q/k/v + H / heads attention dispatches + output) per layer but the last, the last layer whole
    assert len(sliced) == 1 + (CFG.num_layers - 1) * (2 + CFG.num_heads // heads) + 1


@settings(max_examples=60, deadline=None)
@given(hkv=st.sampled_from([1, 2, 4, 8]), group=st.sampled_from([1, 2, 3, 4, 8]), hd=st.sampled_from([32, 128]),
       rows=st.sampled_from([512, 8192, 32768, 131072]), log_budget=st.floats(8.0, 14.0))
def test_dispatch_heads_is_the_most_heads_within_the_budget(hkv, group, hd, rows, log_budget):
    cfg = dense.DenseConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=hkv * group,
                            num_kv_heads=hkv, head_dim=hd, rope_theta=1e4)
    budget = 10.0 ** log_budget
    d = dense_scoring.dispatch_heads(cfg, rows, budget)
    h = cfg.num_heads
    assert h % d == 0 and (d % group == 0 or group % d == 0)  # whole KV heads per dispatch
    fits = dense_scoring.attention_flops(rows, hd, d) <= budget
    assert fits or d == 1
    bigger = [e for e in range(d + 1, h + 1) if h % e == 0 and (e % group == 0 or group % e == 0)]
    assert all(dense_scoring.attention_flops(rows, hd, e) > budget for e in bigger)
    assert dense_scoring.dispatch_heads(cfg, rows, None) == h
    with pytest.raises(ValueError, match="positive"):
        dense_scoring.dispatch_heads(cfg, rows, 0.0)


@pytest.mark.parametrize("pace", [True, False])
def test_a_paced_scorer_waits_for_every_dispatch_before_the_next(monkeypatch, params, ids, pace):
    """Pacing keeps at most one scorer dispatch ahead of whatever else the device runs (a decode step)."""
    waited, calls = [], []
    real_wait = dense_scoring._wait

    def wait(x):
        waited.append(len(calls))
        return real_wait(x)

    for name in ("_start", "_layer", "_layer_qkv", "_layer_heads", "_layer_out"):
        f = getattr(dense_scoring, name)
        monkeypatch.setattr(dense_scoring, name, lambda *a, _f=f, **kw: (calls.append(1), _f(*a, **kw))[1])
    monkeypatch.setattr(dense_scoring, "_wait", wait)
    budget = dense_scoring.attention_flops(dense.capacity_for(T, 16), CFG.head_dim, 1)
    dense_scoring.tail_max_attention(params, CFG, ids, block=16, max_dispatch_flops=budget, pace=pace)
    assert len(calls) == 1 + (CFG.num_layers - 1) * (2 + CFG.num_heads) + 1
    # paced: a wait right after each dispatch, before the next one is issued; unpaced: none
    assert waited == (list(range(1, len(calls) + 1)) if pace else [])

# ---- checkpoints ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["untied", "tied"])
def test_save_load_round_trip(tmp_path, cfg):
    p = dense.init_params(cfg, jax.random.key(2), jnp.float32, norm_noise=0.1)
    dense.save_dense(tmp_path, cfg, p)
    names = set(load_file(os.path.join(tmp_path, "model.safetensors")))
    assert "model.embed_tokens.weight" in names and "model.layers.2.self_attn.k_norm.weight" in names
    assert ("lm_head.weight" in names) != cfg.tie_word_embeddings
    cfg2, p2 = dense.load_dense(tmp_path, jnp.float32)
    assert cfg2 == cfg
    chex.assert_trees_all_equal(p2, p)
    if cfg.tie_word_embeddings:
        assert p2["lm_head"] is p2["embed"]
    _, bf = dense.load_dense(tmp_path, jnp.bfloat16)
    assert bf["embed"].dtype == jnp.bfloat16 and bf["final_norm"].dtype == jnp.float32


def _rewrite(tmp_path, edit):
    src = os.path.join(tmp_path, "model.safetensors")
    t = load_file(src)
    edit(t)
    save_file(t, src)


def test_tied_checkpoint_with_lm_head_copy_loads(tmp_path):
    p = dense.init_params(TIED, jax.random.key(3), jnp.float32)
    dense.save_dense(tmp_path, TIED, p)
    _rewrite(tmp_path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"]))
    _, p2 = dense.load_dense(tmp_path, jnp.float32)
    assert p2["lm_head"] is p2["embed"]


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight"[6:]),
    (lambda t: t.__setitem__("model.norm.weight", np.ones(5, np.float32)), "model.norm.weight"),
    (lambda t: t.__setitem__("model.extra.weight", np.ones(2, np.float32)), "model.extra.weight"),
    (lambda t: t.__setitem__("model.layers.3.input_layernorm.weight", np.ones(32, np.float32)), "num_hidden_layers"),
    (lambda t: t.pop("lm_head.weight"), "lm_head.weight"),
])
def test_bad_checkpoint_errors(tmp_path, params, edit, needle):
    dense.save_dense(tmp_path, CFG, params)
    _rewrite(tmp_path, edit)
    with pytest.raises(CheckpointError, match=needle.replace(".", r"\.")):
        dense.load_dense(tmp_path, jnp.float32)


def test_bad_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        dense.load_dense(tmp_path)
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(_hf(num_hidden_layers=0), f)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        dense.load_dense(tmp_path)
