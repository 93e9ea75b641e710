"""The two-stage top-k equals ``jax.lax.top_k`` exactly: values, ids and the order of ties (lower id first)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dflash_jax.spec import ddtree, topk


@functools.partial(jax.jit, static_argnames=("k", "chunk"))
def _two_stage(x, k, chunk):
    return topk.top_k(x, k, chunk)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 9), chunk=st.sampled_from([1, 2, 3, 4, 8]),
       extra=st.integers(0, 40), levels=st.sampled_from([2, 3, 5, 1000]), rows=st.integers(1, 3))
@example(seed=0, k=4, chunk=4, extra=0, levels=2, rows=2)  # heavy ties: ids must still come lowest first
def test_equals_lax_top_k(seed, k, chunk, extra, levels, rows):
    n = topk.MIN_CHUNKS_PER_K * k * chunk + extra  # always the two-stage path (a partial last chunk when extra)
    rng = np.random.default_rng(seed)
    x = rng.integers(0, levels, size=(rows, 2, n)).astype(np.float32)  # few levels: many ties
    x[rng.random(x.shape) < 0.05] = -np.inf
    want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
    got_v, got_i = _two_stage(jnp.asarray(x), k, chunk)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))


def test_a_tie_across_chunks_goes_to_the_lower_id():
    x = np.full((1, 16), -1.0, np.float32)
    x[0, :4] = [1.0, 0.0, 9.0, 1.0]  # chunk 1 ranks first (max 9), but the tied 1.0 at id 0 precedes id 3
    v, i = _two_stage(jnp.asarray(x), 2, 2)
    assert np.asarray(i).tolist() == [[2, 0]] and np.asarray(v).tolist() == [[9.0, 1.0]]


def test_all_top_values_in_one_chunk_and_padding():
    n, k, chunk = 4 * 3 * 8 + 5, 3, 8
    x = np.zeros((1, n), np.float32)
    x[0, 17:20] = [5.0, 7.0, 6.0]  # one chunk holds all three
    x[0, -1] = 9.0  # in the padded last chunk
    v, i = _two_stage(jnp.asarray(x), k, chunk)
    assert np.asarray(i).tolist() == [[n - 1, 18, 19]] and np.asarray(v).tolist() == [[9.0, 7.0, 6.0]]


def test_small_axes_use_one_selection_and_bad_k_is_refused():
    x = jnp.arange(10.0)[None]
    v, i = topk.top_k(x, 3, chunk=8)  # 10 < 4 * 3 * 8: plain top_k
    assert np.asarray(i).tolist() == [[9, 8, 7]] and i.dtype == jnp.int32
    with pytest.raises(ValueError, match="k=11"):
        topk.top_k(x, 11)
    with pytest.raises(ValueError, match="k=0"):
        topk.top_k(x, 0)


def test_the_two_stage_path_has_no_full_axis_sort():
    x = jax.ShapeDtypeStruct((1, 15, 248320), jnp.float32)
    hlo = jax.jit(lambda a: topk.top_k(a, 22)).lower(x).as_text()
    assert "248320" in hlo
    for line in hlo.splitlines():  # any sort / top_k left works on chunk maxima or candidates, not the vocabulary
        if "sort" in line or "top_k" in line:
            assert "248320" not in line, line


def test_build_tree_on_a_large_vocabulary_equals_the_reference():
    budget, L = 22, 3
    v = topk.MIN_CHUNKS_PER_K * budget * topk.CHUNK + 7  # the two-stage path, with a partial chunk
    rng = np.random.default_rng(1)
    lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(2, L, v)) * 3, jnp.float32), axis=-1)
    tree = jax.jit(ddtree.build_tree, static_argnames=("budget", "top_k", "chain_seed"))(lp, budget=budget)
    for b in range(2):
        ref = ddtree.build_tree_reference(np.asarray(lp[b]), budget)
        np.testing.assert_array_equal(np.asarray(tree.tokens[b]), ref["tokens"])
        np.testing.assert_array_equal(np.asarray(tree.parent[b]), ref["parent"])
