"""The Pallas tree commit (CPU interpret mode) against ``gdn.tree_commit_reference``: the accepted node's state written
into each row's slot in place, over random trees and nodes (hypothesis), several value blocks, the null slot and
rows that accepted nothing left as they were, a bf16 state pool; registration and fallback; the whole speculative
commit with the kernel equals the reference (``test_pallas_gdn_tree``'s model test runs both kernels)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_jax.models import gdn
from pallas_kernels import registry
from pallas_kernels.gdn import commit, gdn_tree_commit_reference
from conftest import FAST_COMPILE
from test_tree_gdn import make_inputs, np_ancestors, random_parents

pytestmark = pytest.mark.xdist_group("pallas_gdn_tree")

reference = jax.jit(gdn_tree_commit_reference, compiler_options=FAST_COMPILE)
tree = jax.jit(gdn.gdn_tree_reference, compiler_options=FAST_COMPILE)


def kernel(ssm_all, slots, cache, node, **static):
    args = (ssm_all, slots, cache.k, cache.vp, cache.gam, cache.decay, node)
    return commit.gdn_tree_commit.lower(*args, interpret=True, **static).compile(
        compiler_options=FAST_COMPILE)(*args)


def case(seed, b, n, h, dk, dv, n_slots, pad=0.2, state_dtype=jnp.float32):
    """B trees verified from the states their slots hold: (ssm_all, slots, cache)."""
    rng = np.random.default_rng(seed)
    q, k, v, beta, g, _ = make_inputs(seed, b, n, h, dk, dv, "mixed", 1.0, jnp.float32)
    ssm_all = jnp.asarray(rng.standard_normal((n_slots, h, dk, dv)), state_dtype)
    slots = jnp.asarray(rng.permutation(np.arange(1, n_slots))[:b], jnp.int32)
    anc = jnp.asarray(np_ancestors(random_parents(rng, b, n, pad)))
    _, cache = tree(q, k, v, beta, g, ssm_all[slots].astype(jnp.float32), anc)
    return ssm_all, slots, cache


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), b=st.integers(1, 3), n=st.integers(1, 33), data=st.data())
def test_commit_matches_reference(seed, b, n, data):
    ssm_all, slots, cache = case(seed, b, n, 2, 16, 32, n_slots=5)
    node = jnp.asarray(data.draw(st.lists(st.integers(-1, n - 1), min_size=b, max_size=b)), jnp.int32)
    ref = reference(ssm_all, slots, cache, node)
    out = kernel(ssm_all, slots, cache, node, block_v=16)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_untouched_rows_and_the_null_slot_stay_bit_equal():
    """Rows whose slot is 0 or whose node is -1 write nothing; every other slot of the pool is left as it was."""
    ssm_all, slots, cache = case(7, 3, 9, 2, 16, 32, n_slots=6)
    slots = slots.at[1].set(0)
    node = jnp.asarray([4, 3, -1], jnp.int32)
    before = np.asarray(ssm_all)
    out = np.asarray(kernel(ssm_all, slots, cache, node, block_v=32))
    written = {int(slots[0])}
    for s in range(before.shape[0]):
        if s not in written:
            np.testing.assert_array_equal(out[s], before[s])
    assert not np.array_equal(out[int(slots[0])], before[int(slots[0])])
    np.testing.assert_allclose(out, np.asarray(reference(ssm_all, slots, cache, node)), rtol=1e-5, atol=1e-5)


def test_bf16_state_pool():
    ssm_all, slots, cache = case(3, 2, 23, 2, 16, 32, n_slots=4, state_dtype=jnp.bfloat16)
    node = jnp.asarray([22, 5], jnp.int32)
    out = kernel(ssm_all, slots, cache, node, block_v=16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference(ssm_all, slots, cache, node),
                                                                       np.float32), rtol=1e-2, atol=1e-2)


def test_block_plan_defaults_and_errors():
    assert commit.block_plan(n=23, dk=128, dv=128, block_v=32) == dict(n_pad=32, n_v_blocks=4)
    assert commit.default_config(128) == dict(block_v=64, num_warps=8)
    with pytest.raises(ValueError, match="> 64"):
        commit.block_plan(n=65, dk=16, dv=16, block_v=16)
    with pytest.raises(ValueError, match="not a multiple"):
        commit.block_plan(n=8, dk=16, dv=48, block_v=32)
    ssm_all, slots, cache = case(0, 1, 4, 1, 16, 16, n_slots=3)
    with pytest.raises(ValueError, match="disagree"):
        commit.gdn_tree_commit(ssm_all[:, :, :8], slots, cache.k, cache.vp, cache.gam, cache.decay,
                               jnp.zeros((1,), jnp.int32), block_v=16, interpret=True)


def test_registration_dispatch_and_fallback(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    assert registry.resolve("gdn_tree_commit", backend="cpu").name == "reference"
    for b in ("cuda", "rocm"):
        assert registry.resolve("gdn_tree_commit", backend=b).name == "pallas_triton"
    ssm_all, slots, cache = case(5, 2, 6, 2, 16, 32, n_slots=4)
    node = jnp.asarray([5, 2], jnp.int32)
    ref = jax.jit(gdn.tree_commit)(ssm_all, slots, cache, node)
    monkeypatch.setenv(registry.ENV_VAR, "gdn_tree_commit=pallas_triton")
    out = jax.jit(gdn.tree_commit)(ssm_all, slots, cache, node)  # a fresh jit: chosen at trace time
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    odd_all, odd_slots, odd_cache = case(2, 1, 4, 1, 24, 16, n_slots=3)  # dk = 24: no power-of-two tile
    with pytest.warns(RuntimeWarning, match="gdn_tree_commit: the Pallas kernel cannot take"):
        out = gdn.tree_commit(odd_all, odd_slots, odd_cache, jnp.asarray([3], jnp.int32))
    np.testing.assert_allclose(np.asarray(out), np.asarray(gdn_tree_commit_reference(
        odd_all, odd_slots, odd_cache, jnp.asarray([3], jnp.int32))), rtol=1e-6)
