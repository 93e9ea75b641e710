"""Fused input projections (``qwen36.fuse_projections``): the model computes the same thing from either layout (prefill,
decode, tree verification), quantized matrices fuse only with their own kind, the engine fuses by default and the
parts' buffers are freed, and a fused target refuses to be sharded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models import quant, qwen36
from dflash_jax.sharding import ShardingError
from dflash_jax.state import KVPages, RecurrentSlots, StepInput
from test_tree_verify import PAGE, WIDTH, _tree_input, _verify, target


def _copy(params):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), params)


def test_fused_keys_and_shapes():
    t = target("qwen36_tiny_a")
    fused = qwen36.fuse_projections(t.params)
    cfg = t.config
    for lt, layer in zip(cfg.layer_types, fused["layers"]):
        assert set(layer["mlp"]) == {"gate+up", "down"}
        assert layer["mlp"]["gate+up"].shape == (2 * cfg.intermediate_size, cfg.hidden_size)
        if "gdn" in layer:
            hv = cfg.lin_num_v_heads
            assert "qkv+z+b+a" in layer["gdn"] and not {"qkv", "z", "b", "a"} & set(layer["gdn"])
            assert layer["gdn"]["qkv+z+b+a"].shape[0] == cfg.conv_dim + cfg.value_dim + 2 * hv
        else:
            assert {"q+k+v", "o", "q_norm", "k_norm"} == set(layer["attn"])
    assert qwen36.fuse_projections(fused)["layers"][0].keys() == fused["layers"][0].keys()  # idempotent


def test_forward_prefill_decode_and_tree_equal_with_fused_params():
    t = target("qwen36_tiny_a")
    cfg = t.config
    fused = qwen36.fuse_projections(t.params)
    rng = np.random.default_rng(0)
    fwd = jax.jit(lambda p, i, kv, r: qwen36.forward(p, cfg, i, kv, r), static_argnums=())
    tok = rng.integers(0, cfg.vocab_size, (1, 24)).astype(np.int32)
    pt = jnp.arange(1, WIDTH + 1, dtype=jnp.int32)[None]
    pre = StepInput(tokens=jnp.asarray(tok), positions=jnp.arange(24, dtype=jnp.int32)[None],
                    n_valid=jnp.asarray([21], jnp.int32), slots=jnp.ones((1,), jnp.int32), page_table=pt)
    dec = StepInput(tokens=jnp.asarray([[5]], jnp.int32), positions=jnp.asarray([[21]], jnp.int32),
                    n_valid=jnp.ones((1,), jnp.int32), slots=jnp.ones((1,), jnp.int32), page_table=pt)
    outs = []
    for params in (t.params, fused):
        kv = KVPages.zeros(cfg, WIDTH + 1, PAGE, jnp.float32)
        rec = RecurrentSlots.zeros(cfg, 2, jnp.float32)
        h1, kv, rec, _ = fwd(params, pre, kv, rec)
        h2, kv, rec, _ = fwd(params, dec, kv, rec)
        logits, _ = _verify(params, cfg, _tree_input([7, 8, 9, 10], [-1, 0, 0, 1], 22), kv, rec)
        outs.append([np.asarray(x) for x in (h1, h2, logits, *rec.ssm)])
    for a, b in zip(*outs):
        # one matmul instead of several sums the same products in another order: float32 rounding, ~1e-5 of the
        # output's scale after 8 layers (a wrong split or order of the fused rows differs at the scale itself)
        np.testing.assert_allclose(b, a, atol=5e-5 * max(1.0, float(np.abs(a).max())), rtol=1e-5)


def test_quantized_parts_join_only_their_own_kind():
    t = target("qwen36_tiny_a")
    q = quant.quantize_params(t.params, "fp8")
    fused = qwen36.fuse_projections(q)
    gdn = next(layer["gdn"] for layer in fused["layers"] if "gdn" in layer)
    assert {"qkv+z", "b+a"} <= set(gdn)  # fp8 qkv / z; b, a stay plain (not quantized): two matmuls
    assert quant.is_quantized(gdn["qkv+z"]) and gdn["qkv+z"].scale.shape == (gdn["qkv+z"].shape[0],)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, t.config.hidden_size)), jnp.float32)
    layer = next(layer["gdn"] for layer in q["layers"] if "gdn" in layer)
    hv = t.config.lin_num_v_heads
    sizes = {"qkv": t.config.conv_dim, "z": t.config.value_dim, "b": hv, "a": hv}
    got = qwen36.project(gdn, x, sizes)
    for name in sizes:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(qwen36.linear(x, layer[name])), atol=1e-5)
    a = quant.QuantizedWeight(jnp.zeros((48, 64), jnp.float8_e4m3fn), jnp.ones((1, 1)), block=(128, 128),
                              dtype=jnp.float32)
    assert not qwen36.joinable(a, a)  # a 48-row block-scaled part would put the seam inside a scale block


def test_engine_fuses_a_copy_target_fuses_in_place_and_a_fused_target_cannot_be_sharded():
    import dflash_jax as dj
    from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
    from dflash_jax.target import shard_target

    t = target("qwen36_tiny_a")
    prompt = np.random.default_rng(2).integers(0, t.config.vocab_size, 9).tolist()
    eng = Engine(t, options=EngineOptions(max_batch=2, max_model_len=64))
    assert "gate+up" in eng.target.params["layers"][0]["mlp"] and "gate" in t.params["layers"][0]["mlp"]
    [out] = eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    assert out.token_ids == t.greedy(prompt, 4)
    assert "gate" in Engine(t, options=EngineOptions(max_batch=2, fuse_projections=False)).target.params["layers"][0]["mlp"]

    own = dj.Target(t.config, _copy(t.params), t.eos_token_ids)
    gate = own.params["layers"][0]["mlp"]["gate"]
    want = own.logits(prompt)
    assert own.fuse_projections() is own and gate.is_deleted() and qwen36.is_fused(own.params)
    np.testing.assert_allclose(np.asarray(own.logits(prompt)), np.asarray(want), atol=2e-5)
    assert Engine(own, options=EngineOptions(max_batch=2)).target.params is own.params  # nothing to fuse again
    with pytest.raises(ShardingError, match="fused"):
        shard_target(own, 1, 2)
    with pytest.raises(ValueError, match="already fused"):
        Engine(own, options=EngineOptions(max_batch=2, quantization="fp8"))
    q = dj.Target(t.config, quant.quantize_params(_copy(t.params), "fp8"), t.eos_token_ids).fuse_projections()
    assert qwen36.fused_unquantized(q.params) == []  # quantized at load, then fused ("b+a" stays plain)
    eng = Engine(q, options=EngineOptions(max_batch=2, max_model_len=64, quantization="fp8"))  # as from_pretrained
    assert eng.target.params["layers"][0]["mlp"]["gate+up"] is q.params["layers"][0]["mlp"]["gate+up"]
