"""The weight-streaming skinny matmul (``pallas_kernels.skinny_matmul``) in interpret mode: equal to the reference
for bf16 / f32 and per-channel fp8 weights, any M (padded tiles, several M tiles), both forms (``dot``; ``gemv``
at M <= 4), split-K 1 and > 1; the auto
split-K rule; the static tile check; and the model's routing (``DFLASH_KERNELS=skinny_matmul=pallas_triton``),
kept off tensor-parallel meshes."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dflash_jax as dj
from conftest import FIXTURES
from dflash_jax import target as target_mod
from dflash_jax.models import quant, qwen36
from pallas_kernels import registry
from pallas_kernels import skinny_matmul as sm

pytestmark = [pytest.mark.xdist_group("pallas_skinny_matmul"),
              pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")]


def _operands(m: int, n: int, k: int, weight: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    if weight == "fp8":
        q = quant.quantize_fp8(w)
        return x, q.data, q.scale
    return x, w.astype(jnp.bfloat16), None


@pytest.mark.parametrize("weight", ["bf16", "fp8"])
@pytest.mark.parametrize("m,form", [(1, "gemv"), (3, "gemv"), (4, "gemv"), (1, "dot"), (3, "dot"), (16, "dot"),
                                    (40, "dot")])
@pytest.mark.parametrize("split_k", [1, 4])
def test_kernel_equals_reference(weight, m, form, split_k):
    x, w, s = _operands(m, 64, 512, weight, seed=m)
    got = sm.skinny_matmul_pallas(x, w, s, block_n=32, block_k=64, split_k=split_k, form=form)
    chex.assert_shape(got, (m, 64))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(sm.skinny_matmul_reference(x, w, s)),
                               rtol=1e-4, atol=1e-3)


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 80), n_blocks=st.integers(1, 3), k_blocks=st.sampled_from([1, 2, 4]),
       weight=st.sampled_from(["bf16", "f32", "fp8"]), split=st.sampled_from([None, 1, 2]))
def test_kernel_equals_reference_property(m, n_blocks, k_blocks, weight, split):
    k = 32 * k_blocks
    split = None if split is None else min(split, k_blocks)
    x, w, s = _operands(m, 16 * n_blocks, k, "fp8" if weight == "fp8" else "bf16", seed=m)
    if weight == "f32":
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    got = sm.skinny_matmul_pallas(x, w, s, block_n=16, block_k=32, split_k=split)  # the default form for m
    np.testing.assert_allclose(np.asarray(got), np.asarray(sm.skinny_matmul_reference(x, w, s)),
                               rtol=1e-4, atol=1e-3)


def test_auto_split_k_fills_two_programs_per_sm():
    # the 27B's decode shapes at block_n 64, block_k 256
    assert sm.auto_split_k(5120, 17408, block_n=64, block_k=256) == 4     # mlp_down: 80 -> 320 programs
    assert sm.auto_split_k(5120, 6144, block_n=64, block_k=256) == 4      # gdn_out
    assert sm.auto_split_k(10240, 5120, block_n=64, block_k=256) == 2     # gdn_qkv: 160 -> 320
    assert sm.auto_split_k(17408, 5120, block_n=64, block_k=256) == 1     # mlp_gate: 272 already
    assert sm.auto_split_k(5120, 17408, block_n=64, block_k=256, m_tiles=4) == 1
    assert sm.auto_split_k(128, 256, block_n=64, block_k=256) == 1       # K cannot split: stays whole
    assert sm.auto_split_k(128, 1024, block_n=64, block_k=128) == 8      # capped where K stops dividing
    for n, k in [(5120, 17408), (10240, 5120), (12288, 5120), (248320, 5120)]:
        cfg = sm.default_config(n, k, 1, jnp.bfloat16)
        s = sm.block_plan(1, n, k, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, block_n=cfg["block_n"],
                          block_k=cfg["block_k"], split_k=None, num_stages=cfg["num_stages"])["split_k"]
        assert (n // cfg["block_n"]) * s >= sm.TARGET_PROGRAMS and k % (s * cfg["block_k"]) == 0


def test_static_check_names_the_block():
    with pytest.raises(ValueError, match="block 'w'.*power of two"):
        sm.block_plan(1, 96, 512, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, block_n=48, block_k=128,
                      split_k=1, num_stages=3)
    with pytest.raises(ValueError, match="dot 'xw' has K=8"):
        sm.block_plan(1, 64, 64, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, block_n=32, block_k=8,
                      split_k=1, num_stages=3)
    with pytest.raises(ValueError, match="shared memory"):
        sm.block_plan(64, 1024, 4096, x_dtype=jnp.float32, w_dtype=jnp.float32, block_n=128, block_k=512,
                      split_k=1, num_stages=4)
    with pytest.raises(ValueError, match="multiples of block_n"):
        sm.block_plan(1, 100, 512, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, block_n=64, block_k=128,
                      split_k=1, num_stages=3)
    with pytest.raises(ValueError, match="split_k=3"):
        sm.block_plan(1, 64, 512, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, block_n=64, block_k=128,
                      split_k=3, num_stages=3)
    with pytest.raises(ValueError, match="gemv form takes 1..4 rows"):
        sm.block_plan(5, 64, 512, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, block_n=32, block_k=128,
                      split_k=1, num_stages=2, form="gemv")
    with pytest.raises(ValueError, match="form 'mma'"):
        sm.block_plan(1, 64, 512, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, block_n=32, block_k=128,
                      split_k=1, num_stages=2, form="mma")
    # the gemv form has no dot: K steps below tl.dot's 16 pass its check
    assert sm.block_plan(2, 64, 64, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, block_n=32, block_k=8,
                         split_k=1, num_stages=2, form="gemv")["bm"] == 2
    x, w, _ = _operands(1, 64, 128, "fp8")
    with pytest.raises(ValueError, match="needs its per-output-channel scale"):
        sm.skinny_matmul_pallas(x, w)


def test_default_config_and_supports():
    assert sm.default_config(48, 5120, 8) == dict(form="dot", block_n=16, block_k=256, split_k=None, num_warps=4,
                                                  num_stages=3)
    assert sm.default_config(17408, 5120, 8, jnp.float8_e4m3fn)["block_k"] == 512
    # gemv up to 4 rows: one 128-bit load per thread of a warp per K step (256 bf16 / 512 fp8 weights)
    assert sm.default_config(17408, 5120) == dict(form="gemv", block_n=16, block_k=256, split_k=None, num_warps=4,
                                                  num_stages=2)
    assert sm.default_config(5120, 17408, 4, jnp.float8_e4m3fn)["block_k"] == 512
    assert [sm.default_form(m) for m in (1, 4, 5, 64)] == ["gemv", "gemv", "dot", "dot"]
    assert sm.default_config(100, 5120) is None  # N without a power-of-two divisor >= 16
    assert sm.default_config(5120, 17408, 64, jnp.float8_e4m3fn)["block_k"] == 256  # fits 64 rows
    assert sm.supports(64, 5120, 17408, jnp.bfloat16, jnp.float8_e4m3fn)
    assert not sm.supports(65, 5120, 17408, jnp.bfloat16, jnp.bfloat16)  # prefill: XLA
    assert not sm.supports(1, 5120, 17408, jnp.float64, jnp.float64)


def _counting(monkeypatch) -> list:
    """Select the kernel through the environment and count its calls."""
    calls: list = []
    impl = registry.resolve("skinny_matmul", "pallas_triton")
    counting = lambda *a, **kw: calls.append(a[1].shape) or impl.fn(*a, **kw)  # noqa: E731
    monkeypatch.setitem(registry._REGISTRY["skinny_matmul"],  # resolve() loaded the op
                        "pallas_triton", dataclasses.replace(impl, fn=counting))
    monkeypatch.setenv(registry.ENV_VAR, "skinny_matmul=pallas_triton")
    return calls


@pytest.mark.parametrize("weight", ["bf16", "fp8"])
def test_linear_routes_through_the_kernel(monkeypatch, weight):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((128, 256)), jnp.bfloat16)
    w = quant.quantize_fp8(w) if weight == "fp8" else w
    x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.bfloat16)
    want = qwen36.linear(x, w)
    calls = _counting(monkeypatch)
    got = qwen36.linear(x, w)
    assert calls == [(128, 256)] and got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    assert qwen36.linear(x, w, jnp.float32).dtype == jnp.float32
    calls.clear()
    qwen36.linear(jnp.zeros((65, 256), jnp.bfloat16), w)                    # > 64 tokens: XLA
    qwen36.linear(x, jnp.zeros((48, 256), jnp.bfloat16))                    # narrow (GDN b/a gates): XLA
    mesh = jax.sharding.AbstractMesh((2,), ("model",))
    with jax.sharding.use_abstract_mesh(mesh):                              # tensor-parallel context: XLA
        jax.jit(qwen36.linear).trace(x, w)
    assert calls == []


def test_multi_row_route_leaves_one_row_matmuls_to_xla(monkeypatch):
    """``skinny_matmul=pallas_triton_multi_row``: a verify tree's or draft block's rows (2-64) go to the kernel, a
    one-row decode matmul stays on XLA's dot."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((128, 256)), jnp.bfloat16)
    calls: list = []
    impl = registry.resolve("skinny_matmul", "pallas_triton_multi_row")
    counting = lambda *a, **kw: calls.append(a[0].shape[0]) or impl.fn(*a, **kw)  # noqa: E731
    monkeypatch.setitem(registry._REGISTRY["skinny_matmul"], "pallas_triton_multi_row",
                        dataclasses.replace(impl, fn=counting))
    monkeypatch.setenv(registry.ENV_VAR, "skinny_matmul=pallas_triton_multi_row")
    x23 = jnp.asarray(rng.standard_normal((1, 23, 256)), jnp.bfloat16)
    got = qwen36.linear(x23, w)
    qwen36.linear(jnp.ones((1, 1, 256), jnp.bfloat16), w)
    assert calls == [23]
    monkeypatch.delenv(registry.ENV_VAR)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(qwen36.linear(x23, w), np.float32),
                               rtol=1e-2, atol=1e-2)


def test_model_with_the_kernel_equals_xla(monkeypatch):
    t = dj.load_target(f"{FIXTURES}/qwen36_tiny_a", dtype="float32")
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 256, 12)]   # one 64-token bucket: M = 64
    want = t.logits(ids)
    calls = _counting(monkeypatch)
    target_mod._full_pass.clear_cache()
    try:
        got = t.logits(ids)
    finally:
        target_mod._full_pass.clear_cache()
    assert len(calls) >= 4 * t.config.num_layers  # every large matmul of every layer, and the LM head
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_engine_warns_when_the_kernel_meets_tensor_parallelism(monkeypatch):
    import warnings

    from dflash_jax.engine import loop

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop._warn_skinny_matmul_under_tp()  # not selected: silent
    monkeypatch.setenv(registry.ENV_VAR, "skinny_matmul=pallas_triton")
    with pytest.warns(RuntimeWarning, match="tensor_parallel > 1"):
        loop._warn_skinny_matmul_under_tp()


def test_fp8_weights_stay_on_xla_on_rocm(monkeypatch):
    """MI300's Triton converts only e4m3fnuz: an e4m3fn weight is never routed to the kernel there."""
    assert sm.supports(1, 64, 128, jnp.bfloat16, jnp.float8_e4m3fn)
    monkeypatch.setattr(sm.registry, "current_backend", lambda: "rocm")
    assert not sm.supports(1, 64, 128, jnp.bfloat16, jnp.float8_e4m3fn)
    assert sm.supports(1, 64, 128, jnp.bfloat16, jnp.bfloat16)
