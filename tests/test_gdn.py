"""Gated DeltaNet kernels: chunked (WY) == recurrent == float64 NumPy, masking, and the streaming causal conv."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import FAST_COMPILE
from dflash_jax.models import gdn
from dflash_jax.models.qwen36 import causal_conv

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
RTOL = ATOL = 1e-4

# Every new shape compiles; these tests are compile-bound on CPU, so skip the expensive LLVM passes (the numerics
# of the HLO are unchanged) to stay well inside the time budget.
gdn_recurrent = jax.jit(gdn.gdn_recurrent, compiler_options=FAST_COMPILE)
gdn_chunked = jax.jit(gdn.gdn_chunked, static_argnames="chunk", compiler_options=FAST_COMPILE)
conv = jax.jit(causal_conv, compiler_options=FAST_COMPILE)


# ---- inputs --------------------------------------------------------------------------------------------------------
def make_inputs(seed, b, t, h, dk, dv, g_mode="mixed", state_scale=1.0):
    """float32 q, k, v, beta, g, state as the layer feeds them (unit-norm k, q scaled by dk^-0.5)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dk ** -0.5
    k = rng.standard_normal((b, t, h, dk))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, h, dv))
    beta = rng.uniform(1e-3, 1 - 1e-3, (b, t, h))
    if g_mode == "mild":
        g = -rng.uniform(0.0, 0.5, (b, t, h))
    elif g_mode == "strong":
        g = -rng.uniform(0.0, 20.0, (b, t, h))
    elif g_mode == "zero":
        g = np.zeros((b, t, h))
    else:  # mostly mild, some exact zeros, some strongly negative down to -20
        g = -rng.uniform(0.0, 0.5, (b, t, h))
        r = rng.uniform(size=(b, t, h))
        g = np.where(r < 0.15, -rng.uniform(5.0, 20.0, (b, t, h)), np.where(r < 0.3, 0.0, g))
    s0 = state_scale * rng.standard_normal((b, h, dk, dv))
    return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v, beta, g, s0))


def np_gdn(q, k, v, beta, g, s):
    """float64 reference straight from the recurrence: S <- e^g S; S += k (beta (v - S^T k))^T; o = S^T q."""
    q, k, v, beta, g, s = (np.asarray(a, np.float64) for a in (q, k, v, beta, g, s))
    s = s.copy()
    o = np.zeros(q.shape[:3] + (v.shape[-1],))
    for t in range(q.shape[1]):
        s *= np.exp(g[:, t])[..., None, None]
        read = np.einsum("bhkv,bhk->bhv", s, k[:, t])
        s += k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - read))[:, :, None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    return o, s


def assert_close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)


shapes = st.fixed_dictionaries({
    "b": st.integers(1, 2), "t": st.integers(1, 70), "h": st.integers(1, 3),
    "dk": st.integers(4, 16), "dv": st.integers(4, 16),
})


# ---- chunked == recurrent ----------------------------------------------------------------------------------------
@settings(SETTINGS, max_examples=14)
@given(shp=shapes, chunk=st.sampled_from([4, 8, 16, 64]), g_mode=st.sampled_from(["mixed", "strong", "mild", "zero"]),
       state_scale=st.sampled_from([0.0, 1.0, 3.0]), seed=st.integers(0, 2 ** 31 - 1))
def test_chunked_matches_recurrent(shp, chunk, g_mode, state_scale, seed):
    b, t, h, dk, dv = shp["b"], shp["t"], shp["h"], shp["dk"], shp["dv"]
    args = make_inputs(seed, b, t, h, dk, dv, g_mode, state_scale)
    o_r, s_r = gdn_recurrent(*args)
    o_c, s_c = gdn_chunked(*args, chunk=chunk)
    chex.assert_shape([o_r, o_c], (b, t, h, dv))
    chex.assert_shape([s_r, s_c], (b, h, dk, dv))
    chex.assert_type([o_r, o_c, s_r, s_c], jnp.float32)
    chex.assert_tree_all_finite((o_r, o_c, s_r, s_c))
    assert_close(o_c, o_r)
    assert_close(s_c, s_r)
    o_np, s_np = np_gdn(*args)
    assert_close(o_r, o_np)
    assert_close(s_r, s_np)


@pytest.mark.parametrize("t,chunk", [(64, 64), (65, 64), (70, 16), (17, 4), (1, 64), (5, 8)])
def test_chunk_boundaries(t, chunk):
    """T a multiple of the chunk, one past, one short, a single token, and T < chunk."""
    args = make_inputs(t * 131 + chunk, 2, t, 2, 8, 12, "mixed")
    o_r, s_r = gdn_recurrent(*args)
    o_c, s_c = gdn_chunked(*args, chunk=chunk)
    assert_close(o_c, o_r)
    assert_close(s_c, s_r)


def test_strong_decay_is_stable():
    """g = -20 everywhere: exp(cumsum g) underflows inside a chunk; nothing may turn into inf/nan."""
    q, k, v, beta, g, s0 = make_inputs(7, 1, 70, 2, 16, 16, "zero", 3.0)
    g = jnp.full_like(g, -20.0)
    o_r, s_r = gdn_recurrent(q, k, v, beta, g, s0)
    o_c, s_c = gdn_chunked(q, k, v, beta, g, s0, chunk=64)
    chex.assert_tree_all_finite((o_c, s_c))
    assert_close(o_c, o_r)
    assert_close(s_c, s_r)
    # the initial state is forgotten after one step: the last state only holds the last token's write
    np.testing.assert_allclose(s_c[:, 0], (k[:, -1, 0, :, None] * (beta[:, -1, 0, None] * v[:, -1, 0])[:, None]),
                               rtol=RTOL, atol=ATOL)


def test_chunked_state_carries_across_calls():
    """Two chunked calls with the state carried == one call (the prefill-in-pieces path)."""
    args = make_inputs(3, 2, 50, 3, 8, 8)
    q, k, v, beta, g, s0 = args
    o_full, s_full = gdn_chunked(*args, chunk=16)
    cut = 23
    o1, s1 = gdn_chunked(q[:, :cut], k[:, :cut], v[:, :cut], beta[:, :cut], g[:, :cut], s0, chunk=16)
    o2, s2 = gdn_chunked(q[:, cut:], k[:, cut:], v[:, cut:], beta[:, cut:], g[:, cut:], s1, chunk=16)
    assert_close(jnp.concatenate([o1, o2], axis=1), o_full)
    assert_close(s2, s_full)


# ---- masking -----------------------------------------------------------------------------------------------------
@settings(SETTINGS, max_examples=6)
@given(shp=shapes, chunk=st.sampled_from([4, 8, 16, 64]), seed=st.integers(0, 2 ** 31 - 1),
       mask_frac=st.sampled_from([0.2, 0.5, 1.0]))
def test_masked_steps_leave_state_unchanged(shp, chunk, seed, mask_frac):
    """Steps with beta = g = 0 and k = v = 0 are no-ops: the result equals running only the unmasked steps."""
    b, t, h, dk, dv = shp["b"], shp["t"], shp["h"], shp["dk"], shp["dv"]
    q, k, v, beta, g, s0 = make_inputs(seed, b, t, h, dk, dv)
    rng = np.random.default_rng(seed + 1)
    keep = rng.uniform(size=t) >= mask_frac
    m = jnp.asarray(keep, jnp.float32)[None, :, None]
    qm, km, vm = q, k * m[..., None], v * m[..., None]
    bm, gm = beta * m, g * m
    for fn in (gdn_recurrent, functools.partial(gdn_chunked, chunk=chunk)):
        o, s = fn(qm, km, vm, bm, gm, s0)
        if keep.any():
            idx = np.flatnonzero(keep)
            o_ref, s_ref = np_gdn(q[:, idx], k[:, idx], v[:, idx], beta[:, idx], g[:, idx], s0)
            assert_close(o[:, idx], o_ref)
            assert_close(s, s_ref)
        else:
            np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))  # exactly untouched


def test_all_masked_is_exact_identity():
    q, k, v, beta, g, s0 = make_inputs(11, 2, 33, 3, 8, 8, state_scale=2.0)
    z = jnp.zeros_like
    for fn in (gdn_recurrent, functools.partial(gdn_chunked, chunk=16)):
        o, s = fn(q, z(k), z(v), z(beta), z(g), s0)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
        # reads of an unchanged state
        assert_close(o, jnp.einsum("bhkv,bthk->bthv", s0, q, precision="highest"))


def test_trailing_padding_keeps_final_state():
    """Right padding masked per step leaves the final state of the valid prefix (per-row lengths)."""
    q, k, v, beta, g, s0 = make_inputs(5, 2, 40, 2, 8, 8)
    n_valid = np.array([40, 17])
    m = jnp.asarray(np.arange(40)[None] < n_valid[:, None], jnp.float32)[..., None]
    o, s = gdn_chunked(q, k * m[..., None], v * m[..., None], beta * m, g * m, s0, chunk=16)
    for r, n in enumerate(n_valid):
        sl = lambda a: a[r:r + 1, :n]
        o_ref, s_ref = np_gdn(sl(q), sl(k), sl(v), sl(beta), sl(g), s0[r:r + 1])
        assert_close(o[r:r + 1, :n], o_ref)
        assert_close(s[r:r + 1], s_ref)


# ---- causal conv -------------------------------------------------------------------------------------------------
def np_conv(x, w, state, n_valid):
    """float64 reference: silu(sum_j w[:, j] * xx[t + j]) and the K-1 rows of xx ending at row n_valid."""
    x, w, state = (np.asarray(a, np.float64) for a in (x, w, state))
    kk = w.shape[1]
    xx = np.concatenate([state, x], axis=1)
    t = x.shape[1]
    acc = sum(xx[:, j:j + t] * w[:, j] for j in range(kk))
    new = np.stack([xx[r, n:n + kk - 1] for r, n in enumerate(n_valid)])
    return acc / (1 + np.exp(-acc)), new


def conv_inputs(seed, b, t, c, kk, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, t, c))
    w = rng.standard_normal((c, kk)) / kk
    s = rng.standard_normal((b, kk - 1, c))
    return tuple(jnp.asarray(a, dtype) for a in (x, w, s))


@settings(SETTINGS, max_examples=10)
@given(b=st.integers(1, 2), t1=st.integers(1, 20), t2=st.integers(1, 20), c=st.integers(1, 24),
       kk=st.integers(2, 5), seed=st.integers(0, 2 ** 31 - 1))
def test_conv_streaming(b, t1, t2, c, kk, seed):
    """conv over [x1; x2] == conv(x1) then conv(x2) with the returned state carried (chunks shorter than K too)."""
    x, w, s0 = conv_inputs(seed, b, t1 + t2, c, kk)
    t = t1 + t2
    y, s = conv(x, w, s0, jnp.full((b,), t, jnp.int32))
    y1, s1 = conv(x[:, :t1], w, s0, jnp.full((b,), t1, jnp.int32))
    y2, s2 = conv(x[:, t1:], w, s1, jnp.full((b,), t2, jnp.int32))
    chex.assert_shape(y, (b, t, c))
    chex.assert_shape([s, s1, s2], (b, kk - 1, c))
    chex.assert_type([y, y1, y2, s, s1, s2], jnp.float32)
    assert_close(jnp.concatenate([y1, y2], axis=1), y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(s))
    y_np, s_np = np_conv(x, w, s0, [t] * b)
    assert_close(y, y_np, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(s), s_np.astype(np.float32))


@settings(SETTINGS, max_examples=10)
@given(b=st.integers(1, 3), t=st.integers(1, 20), c=st.integers(1, 16), kk=st.integers(2, 5),
       data=st.data(), seed=st.integers(0, 2 ** 31 - 1))
def test_conv_state_stops_at_n_valid(b, t, c, kk, data, seed):
    """With n_valid < T the new state is the last K-1 *valid* pre-conv rows (reaching into the old state when
    n_valid < K-1; n_valid = 0 keeps it), and the valid outputs do not depend on the padding."""
    n_valid = data.draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    x, w, s0 = conv_inputs(seed, b, t, c, kk)
    y, s = conv(x, w, s0, jnp.asarray(n_valid, jnp.int32))
    chex.assert_shape(s, (b, kk - 1, c))
    xx = np.concatenate([np.asarray(s0), np.asarray(x)], axis=1)
    for r, n in enumerate(n_valid):
        want = xx[r, n:n + kk - 1]  # rows ending at the n-th valid token
        np.testing.assert_array_equal(np.asarray(s[r]), want)
        if n == 0:
            np.testing.assert_array_equal(np.asarray(s[r]), np.asarray(s0[r]))
        if n > 0:
            # garbage in the padded tail does not reach the valid outputs
            x_junk = x.at[r, n:].set(1e3)
            y_junk, _ = conv(x_junk, w, s0, jnp.asarray(n_valid, jnp.int32))
            np.testing.assert_array_equal(np.asarray(y_junk[r, :n]), np.asarray(y[r, :n]))
    y_np, s_np = np_conv(x, w, s0, n_valid)
    assert_close(y, y_np, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(s), s_np.astype(np.float32))


def test_conv_bf16_dtypes():
    """bf16 activations: output in bf16, accumulation in fp32, the state keeps its own dtype."""
    x, w, s0 = conv_inputs(0, 2, 9, 12, 4, jnp.bfloat16)
    n = jnp.asarray([9, 4], jnp.int32)
    y, s = conv(x, w, s0, n)
    chex.assert_type(y, jnp.bfloat16)
    chex.assert_type(s, jnp.bfloat16)
    y_np, s_np = np_conv(x.astype(jnp.float32), w.astype(jnp.float32), s0.astype(jnp.float32), [9, 4])
    assert_close(y.astype(jnp.float32), y_np, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(s.astype(jnp.float32)), s_np.astype(np.float32))
    _, s32 = conv(x, w, s0.astype(jnp.float32), n)
    chex.assert_type(s32, jnp.float32)


def test_conv_zero_state_is_zero_padding():
    """At sequence start (zero state) the conv sees zeros before the first token."""
    x, w, _ = conv_inputs(1, 1, 6, 5, 4)
    y, _ = conv(x, w, jnp.zeros((1, 3, 5)), jnp.asarray([6], jnp.int32))
    acc0 = np.asarray(x[0, 0], np.float64) * np.asarray(w[:, 3], np.float64)  # only w[:, K-1] sees token 0
    assert_close(y[0, 0], acc0 / (1 + np.exp(-acc0)), rtol=1e-5, atol=1e-6)


@given(c_log=st.integers(0, 6), batch=st.integers(1, 3), scale=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
@example(c_log=6, batch=1, scale=1.0, seed=0)
@example(c_log=6, batch=2, scale=0.9375, seed=242)  # an entry near 1 off by 3.8e-4 next to entries of ~2000
@settings(max_examples=25, deadline=None)
def test_unit_lower_inverse_equals_the_triangular_solve(c_log, batch, scale, seed):
    c = 1 << c_log
    m = np.tril(np.random.default_rng(seed).uniform(-1, 1, (batch, c, c)), -1) * scale
    a = jnp.asarray(np.eye(c) + m, jnp.float32)
    got = gdn.unit_lower_inverse(a)
    want = jax.lax.linalg.triangular_solve(a, jnp.broadcast_to(jnp.eye(c), a.shape), left_side=True, lower=True,
                                           unit_diagonal=True)
    # entries of the inverse reach ~1e4 at c = 64 (uniform(-1, 1) below the diagonal), so float32 rounding is
    # norm-wise: an entry near 1 inherits errors of ~1e-3 from the large ones. Both float32 algorithms are held to
    # 1e-5 of the float64 inverse's largest entry (measured: <= 5e-7 for either).
    ref = np.linalg.inv(np.asarray(a, np.float64))
    bound = 1e-5 * np.abs(ref).max()
    assert np.abs(np.asarray(got, np.float64) - ref).max() <= bound
    assert np.abs(np.asarray(want, np.float64) - ref).max() <= bound
    assert np.all(np.triu(np.asarray(got), 1) == 0) and np.all(np.diagonal(np.asarray(got), axis1=-2, axis2=-1) == 1)
    with pytest.raises(ValueError, match="power of two"):
        gdn.unit_lower_inverse(jnp.eye(3))


@pytest.mark.parametrize("c", [1, 5, 23, 64])
@pytest.mark.parametrize("method", ["inverse", "triangular"])
def test_solve_unit_lower_both_ways_at_any_size(c, method):
    rng = np.random.default_rng(c)
    a = jnp.asarray(np.eye(c) + np.tril(rng.uniform(-0.5, 0.5, (2, c, c)), -1), jnp.float32)
    b = jnp.asarray(rng.normal(size=(2, c, 3)), jnp.float32)
    want = jax.lax.linalg.triangular_solve(a, b, left_side=True, lower=True, unit_diagonal=True)
    np.testing.assert_allclose(np.asarray(gdn.solve_unit_lower(a, b, method)), np.asarray(want), rtol=1e-5, atol=1e-5)
