"""Blocked paged attention (prefill chunks) against the one-shot reference."""

import numpy as np
import jax
import jax.numpy as jnp
from hypothesis import assume, given, settings, strategies as st

from dflash_jax.models import attention


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(2, 9), ps=st.sampled_from([2, 4]), w=st.integers(1, 9),
       block_pages=st.integers(1, 4), hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16), holes=st.booleans())
def test_blocked_paged_attention_equals_reference(b, t, ps, w, block_pages, hkv, g, seed, holes):
    assume(w * ps >= t)
    rng = np.random.default_rng(seed)
    d, n_pages = 8, 1 + b * w
    kp = jnp.asarray(rng.standard_normal((n_pages, ps, hkv, d)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((n_pages, ps, hkv, d)), jnp.float32)
    table = (1 + np.arange(b * w).reshape(b, w)).astype(np.int32)
    # each row's queries are the last t positions of a prefix that ends somewhere in its table
    end = rng.integers(t, w * ps + 1, b)
    pos = (end[:, None] - t + np.arange(t)[None]).astype(np.int32)
    if holes:  # non-resident pages, never one holding a query (its own K/V is written before attention)
        off = rng.random((b, w)) < 0.3
        off[np.arange(b)[:, None], pos // ps] = False
        table = np.where(off, -1, table)
    q = jnp.asarray(rng.standard_normal((b, t, hkv * g, d)), jnp.float32)
    ref = attention.paged_attention_reference(q, kp, vp, jnp.asarray(table), jnp.asarray(pos), 0.3)
    got = jax.jit(attention.paged_attention_blocked, static_argnames=("scale", "block_pages"))(
        q, kp, vp, jnp.asarray(table), jnp.asarray(pos), scale=0.3, block_pages=block_pages)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_blocked_paged_attention_visits_only_the_prefix_blocks():
    """Keys past the furthest query position are never read: NaN there does not reach the output."""
    b, t, ps, w, hkv, d = 1, 4, 4, 16, 1, 8
    rng = np.random.default_rng(0)
    kp = rng.standard_normal((1 + w, ps, hkv, d)).astype(np.float32)
    vp = rng.standard_normal((1 + w, ps, hkv, d)).astype(np.float32)
    kp[5:], vp[5:] = np.nan, np.nan  # pages 5.. hold logical positions >= 16
    table = jnp.asarray((1 + np.arange(w))[None], jnp.int32)
    pos = jnp.asarray(np.arange(8, 8 + t)[None], jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
    got = attention.paged_attention_blocked(q, jnp.asarray(kp), jnp.asarray(vp), table, pos, 0.5, block_pages=2)
    assert np.isfinite(np.asarray(got)).all()
    ref = attention.paged_attention_reference(q, jnp.asarray(np.nan_to_num(kp)), jnp.asarray(np.nan_to_num(vp)),
                                              table, pos, 0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)
