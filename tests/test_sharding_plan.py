"""The tensor-parallel plan and load-time re-layouts, on one device (the 8-device cases are in test_sharding.py)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FIXTURES
from dflash_jax.config import TargetConfig
from dflash_jax.models import qwen36
from dflash_jax.sharding import (ShardingError, ShardPlan, make_mesh, param_sharding, param_spec, qkv_permutation,
                                 relayout)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_qwen36_27b_splits_fully_at_tp_2_4_8():
    cfg = TargetConfig.from_file(os.path.join(ROOT, "configs", "qwen36_27b.json"))
    for tp in (2, 4, 8):
        p = ShardPlan.for_config(cfg, tp)
        assert p.attn and p.gdn and p.mlp and p.vocab
        assert p.kv_repeat == max(1, tp // cfg.num_kv_heads)
    assert ShardPlan.for_config(cfg, 8).model_config(cfg).num_kv_heads == 8
    p16 = ShardPlan.for_config(cfg, 16)  # 24 query heads do not split over 16
    assert not p16.attn and p16.gdn and any("attention replicated" in n for n in p16.notes)


def test_specs_are_megatron_column_then_row():
    cfg = TargetConfig.from_file(os.path.join(FIXTURES, "qwen36_tiny_b"))
    p = ShardPlan.for_config(cfg, 2)
    assert param_spec(("layers", 0, "gdn", "qkv"), p) == jax.sharding.PartitionSpec("model", None)
    assert param_spec(("layers", 0, "gdn", "out"), p) == jax.sharding.PartitionSpec(None, "model")
    assert param_spec(("layers", 3, "attn", "o"), p) == jax.sharding.PartitionSpec(None, "model")
    assert param_spec(("layers", 3, "mlp", "down"), p) == jax.sharding.PartitionSpec(None, "model")
    assert param_spec(("embed",), p) == jax.sharding.PartitionSpec("model", None)
    assert param_spec(("layers", 3, "attn", "q_norm"), p) == jax.sharding.PartitionSpec()


@settings(max_examples=40, deadline=None)
@given(hk=st.integers(1, 4), r=st.integers(1, 3), dk=st.integers(1, 4), dv=st.integers(1, 4),
       g=st.sampled_from([1, 2, 4]))
def test_qkv_permutation_gives_each_group_whole_heads_of_q_k_and_v(hk, r, dk, dv, g):
    hk *= g  # key heads divisible by the group count
    cfg = dataclasses.replace(TargetConfig.from_file(os.path.join(FIXTURES, "qwen36_tiny_a")),
                              lin_num_k_heads=hk, lin_num_v_heads=hk * r, lin_k_dim=dk, lin_v_dim=dv)
    perm = qkv_permutation(cfg, g)
    assert sorted(perm.tolist()) == list(range(cfg.conv_dim))
    kd, vd = cfg.key_dim // g, cfg.value_dim // g
    for j, block in enumerate(np.split(perm, g)):
        q, k, v = block[:kd], block[kd:2 * kd], block[2 * kd:]
        assert set(q // dk) == set(range(j * hk // g, (j + 1) * hk // g))  # key heads of group j
        assert set((k - cfg.key_dim) // dk) == set(q // dk)
        # the value heads of group j read exactly the key heads of group j (value head i reads key head i // r)
        assert set((v - 2 * cfg.key_dim) // dv // r) == set(q // dk)
        assert len(v) == vd


@pytest.mark.parametrize("tp", [2, 4])
def test_grouped_qkv_layout_gives_the_same_delta_rule_inputs(tp):
    base = TargetConfig.from_file(os.path.join(FIXTURES, "qwen36_tiny_a"))
    cfg = dataclasses.replace(base, lin_num_k_heads=4, lin_num_v_heads=8)
    plan = ShardPlan.for_config(cfg, tp)
    assert plan.gdn
    mcfg = plan.model_config(cfg)
    rng = np.random.default_rng(tp)
    c = jnp.asarray(rng.standard_normal((2, 3, cfg.conv_dim)), jnp.float32)
    braw = jnp.asarray(rng.standard_normal((2, 3, cfg.lin_num_v_heads)), jnp.float32)
    p = {"A_log": jnp.zeros(cfg.lin_num_v_heads), "dt_bias": jnp.zeros(cfg.lin_num_v_heads)}
    valid = jnp.ones((2, 3), bool)
    want = qwen36.gdn_inputs(p, cfg, c, braw, braw, valid)
    got = qwen36.gdn_inputs(p, mcfg, c[..., qkv_permutation(cfg, tp)], braw, braw, valid)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_repeated_kv_heads_copy_each_head_to_its_query_group():
    cfg = TargetConfig.from_file(os.path.join(FIXTURES, "qwen36_tiny_a"))  # 4 heads, 2 KV heads
    plan = ShardPlan.for_config(cfg, 4)
    assert plan.kv_repeat == 2
    w = np.arange(cfg.num_kv_heads * cfg.head_dim * 3, dtype=np.float32).reshape(-1, 3)
    out = relayout(("layers", 3, "attn", "k"), w, cfg, plan).reshape(4, cfg.head_dim, 3)
    heads = w.reshape(cfg.num_kv_heads, cfg.head_dim, 3)
    for e in range(4):  # stored head e serves query head e (4 heads over 4 devices) = KV head e // 2
        np.testing.assert_array_equal(out[e], heads[e // 2])


def test_param_sharding_on_a_one_device_mesh_replicates():
    cfg = TargetConfig.from_file(os.path.join(FIXTURES, "qwen36_tiny_b"))
    sh = param_sharding(("layers", 0, "gdn", "qkv"), (cfg.conv_dim, cfg.hidden_size), cfg, make_mesh(1, 1))
    assert sh.spec == jax.sharding.PartitionSpec() and sh.mesh.shape == {"data": 1, "model": 1}


def test_more_devices_than_visible_is_a_clear_error():
    with pytest.raises(ShardingError, match="xla_force_host_platform_device_count"):
        make_mesh(tp=len(jax.devices()) + 1)
