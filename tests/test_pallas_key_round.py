"""The key-rounding kernel (``pallas_kernels.key_round``, op ``key_round``): its cast-free grid rounding equals the
fp8 cast / int8 round bit for bit, in interpret mode it equals the reference exactly (fp8 and int8, rows not a
multiple of the block, one row, one or two KV heads, g = 0), it is the GPU default, it refuses a D that is not a
power of two, and it lowers to Triton IR for an H200 and an MI300 at the 27B's shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import registry
from pallas_kernels.key_round import (QMAX, grid_round, grid_round_f32, key_round_pallas, key_round_reference,
                                      key_round_triton)

from test_pallas_lowering import CFG, TARGETS, lower

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

DTYPES = [jnp.float8_e4m3fn, jnp.int8]


def inputs(seed: int, n: int, hkv: int, d: int, dtype, g_scale: float = 0.1) -> tuple[jax.Array, jax.Array]:
    """``w [n, hkv, d]`` spread over the format's range (a few values past it, to be clipped) and a random strictly
    upper-triangular ``g [hkv, d, d]`` scaled by ``g_scale`` (0: no feedback)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(n, hkv, d)) * QMAX[jnp.dtype(dtype)] / 2.5
    g = np.triu(rng.normal(size=(hkv, d, d)), k=1) * g_scale
    return jnp.asarray(w, jnp.float32), jnp.asarray(g, jnp.float32)


def assert_same(got: jax.Array, want: jax.Array, msg: str = "") -> None:
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=msg)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grid_round_f32_equals_the_cast_bit_for_bit(dtype):
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)))
    grid = grid[np.isfinite(grid)] if dtype == jnp.float8_e4m3fn else np.arange(128, dtype=np.float32)
    mids = (grid[1:] + grid[:-1]) / 2  # ties: half to even
    x = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), [2.0 ** -10, 2.0 ** -11,
                        1e-30, 0.0, 500.0, 1e6, np.inf], np.random.default_rng(0).uniform(0, 460, 4096)])
    x = jnp.asarray(np.concatenate([x, -x]), jnp.float32)
    got, want = jax.jit(grid_round_f32, static_argnums=1)(x, dtype), grid_round(x, dtype)
    np.testing.assert_array_equal(np.asarray(got).view(np.int32), np.asarray(want).view(np.int32))  # -0.0 too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hkv,d,block_n,block_d", [(37, 2, 16, 16, None), (1, 1, 64, None, None),
                                                     (100, 1, 64, 32, 16), (5, 2, 16, 8, 8), (20, 2, 64, 8, 64)])
def test_kernel_equals_the_reference(dtype, n, hkv, d, block_n, block_d):
    w, g = inputs(n * d + hkv, n, hkv, d, dtype)
    got = key_round_pallas(w, g, dtype, block_n=block_n, block_d=block_d, interpret=True)
    assert_same(got, key_round_reference(w, g, dtype))
    assert not np.array_equal(np.asarray(got), np.asarray(grid_round(w, dtype)))  # the feedback did something


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 70), hkv=st.integers(1, 3), d=st.sampled_from([16, 32, 64]), dtype=st.sampled_from(DTYPES),
       g_scale=st.sampled_from([0.0, 0.1, 0.5]), seed=st.integers(0, 2**31 - 1))
def test_kernel_equals_the_reference_on_random_shapes(n, hkv, d, dtype, g_scale, seed):
    w, g = inputs(seed, n, hkv, d, dtype, g_scale)
    assert_same(key_round_pallas(w, g, dtype, interpret=True), key_round_reference(w, g, dtype),
                f"n={n} hkv={hkv} d={d} {jnp.dtype(dtype)} g_scale={g_scale}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_feedback_is_plain_rounding(dtype):
    w, g = inputs(3, 19, 2, 64, dtype, g_scale=0.0)
    got = key_round_pallas(w, g, dtype, interpret=True)
    qmax = QMAX[jnp.dtype(dtype)]
    want = jnp.clip(w, -qmax, qmax).astype(dtype).astype(jnp.float32) if dtype == jnp.float8_e4m3fn else \
        jnp.round(jnp.clip(w, -qmax, qmax))
    assert_same(got, want)


def test_g_below_the_diagonal_changes_nothing():
    """What the reference computes whatever g holds on and below its diagonal (the kernel never reads it)."""
    w, g = inputs(4, 9, 1, 16, jnp.int8)
    lower_part = jnp.asarray(np.tril(np.random.default_rng(5).normal(size=g.shape)), jnp.float32)
    assert_same(key_round_pallas(w, g + lower_part, jnp.int8, interpret=True), key_round_reference(w, g, jnp.int8))
    assert_same(key_round_reference(w, g + lower_part, jnp.int8), key_round_reference(w, g, jnp.int8))


def test_the_kernel_is_the_gpu_default_and_runs_in_interpret_mode_off_gpu():
    assert registry.resolve("key_round", backend="cuda").name == "pallas_triton"
    assert registry.resolve("key_round", backend="rocm").name == "pallas_triton"
    assert registry.resolve("key_round", backend="cpu").name == "reference"
    w, g = inputs(6, 3, 2, 16, jnp.float8_e4m3fn)
    fn = registry.get("key_round", impl="pallas_triton")
    assert_same(fn(w, g, jnp.float8_e4m3fn), key_round_reference(w, g, jnp.float8_e4m3fn))


def test_a_head_dim_that_is_not_a_power_of_two_is_refused_and_the_registered_kernel_falls_back():
    w, g = inputs(7, 4, 1, 24, jnp.int8)
    with pytest.raises(ValueError, match="key_round: block 'w' .* not a power of two"):
        key_round_pallas(w, g, jnp.int8, interpret=True)
    with pytest.raises(ValueError, match="not a power of two"):
        key_round_pallas(*inputs(7, 4, 1, 16, jnp.int8), jnp.int8, block_n=12, interpret=True)
    with pytest.raises(ValueError, match="block_d=32 is wider than D=16"):
        key_round_pallas(*inputs(7, 4, 1, 16, jnp.int8), jnp.int8, block_d=32, interpret=True)
    with pytest.warns(RuntimeWarning, match="key_round: the Pallas kernel cannot take"):
        got = key_round_triton(w, g, jnp.int8)
    assert_same(got, key_round_reference(w, g, jnp.int8))


def test_bad_arguments_are_refused():
    w, g = inputs(8, 4, 2, 16, jnp.int8)
    with pytest.raises(ValueError, match="dtype"):
        key_round_pallas(w, g, jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match=r"g \(1, 16, 16\)"):
        key_round_pallas(w, g[:1], jnp.int8, interpret=True)


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 100003])
def test_kernel_lowers(platform, dtype, n):
    hkv, d = CFG.num_kv_heads, CFG.head_dim
    fn = lambda w, g: key_round_pallas(w, g, dtype, interpret=False)  # noqa: E731
    text = lower(platform, fn, jax.ShapeDtypeStruct((n, hkv, d), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, d, d), jnp.float32))
    assert "__gpu$xla.gpu.triton" in text and f"key_round_{jnp.dtype(dtype).name}_d{d}" in text
