"""Bounds scoring on the device (``kv/kvflash_bounds.DeviceBounds``) against the host reference
(``kvflash.bound_scores`` over host-held queries and bounds): the written key bounds, the query windows, the scores
(every bucket, padded pages and queries, several sequences a call), and no compiles after warmup."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax.engine.compile import CompileWatch
from dflash_jax.kv.kvflash import bound_scores
from dflash_jax.kv.kvflash_bounds import DeviceBounds
from test_kvflash_device import random_state

HEADS = 4  # the fixture target's query heads (2 KV heads)


def device_bounds(state, n_ids=12, n_slots=5, window=6, max_pages=40):
    return DeviceBounds(state, n_ids=n_ids, n_slots=n_slots, n_heads=HEADS, window=window, max_pages=max_pages)


def test_written_bounds_are_the_elementwise_min_and_max_of_each_pages_keys():
    state, _ = random_state(n_pages=12)
    kb = device_bounds(state)
    kb.warmup(state, [])
    with CompileWatch() as w:
        kb.write(state, [3, 7], [5, 0])
    assert w.count == 0
    got = np.asarray(kb.bounds)
    ks = [np.asarray(k, np.float32) for k in state.kv.k]  # [n_pages, P, Hkv, D] per layer
    assert got.shape == (12, 2, len(ks)) + ks[0].shape[2:] and got.dtype == np.float32
    for row, p in ((5, 3), (0, 7)):
        for layer, k in enumerate(ks):
            np.testing.assert_array_equal(got[row, 0, layer], k[p].min(0))
            np.testing.assert_array_equal(got[row, 1, layer], k[p].max(0))
    assert not got[[1, 2, 3, 4, 6]].any()  # rows not written stay as they were


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 3]), st.lists(st.integers(0, 3), min_size=3, max_size=3)),
                min_size=1, max_size=6), st.integers(0, 2**16))
def test_query_windows_keep_each_slots_newest_positions(pushes, seed):
    """Pushes of [3, T] query rows (row i to slot i + 1, its last counts[i] positions valid) against a host window
    that concatenates and keeps the newest Q."""
    state, _ = random_state(n_pages=4)
    kb = device_bounds(state, window=4)
    rng = np.random.default_rng(seed)
    shape = kb.queries.shape[2:]
    host = {s: np.zeros((4,) + shape, np.float32) for s in range(kb.n_slots)}
    for t, counts in pushes:
        q = rng.normal(size=(3, t) + shape).astype(np.float32)
        kb.push(jnp.asarray(q), [1, 2, 3], counts)
        for i, c in enumerate(counts):
            c = min(c, t)
            if c:
                host[i + 1] = np.concatenate([host[i + 1], q[i, t - c:]])[-4:]
    got = np.asarray(kb.queries)
    for s in range(kb.n_slots):
        np.testing.assert_array_equal(got[s], host[s])


def test_scores_equal_the_host_reference_for_several_sequences_a_call():
    state, _ = random_state(n_pages=12)
    kb = device_bounds(state, n_ids=48, window=6, max_pages=40)
    rng = np.random.default_rng(0)
    kb.bounds = jnp.asarray(np.sort(rng.normal(size=kb.bounds.shape), axis=1).astype(np.float32))  # min <= max
    kb.queries = jnp.asarray(rng.normal(size=kb.queries.shape).astype(np.float32))
    kb.warmup(state, [])
    table, queries = np.asarray(kb.bounds), np.asarray(kb.queries)
    # (slot, valid queries, page ids): one page, a few, more than one page bucket, every query or one
    items = [(1, 6, np.array([7], np.int32)), (2, 2, rng.permutation(48)[:5].astype(np.int32)),
             (4, 1, rng.permutation(48)[:20].astype(np.int32)), (3, 6, rng.permutation(48)[:33].astype(np.int32)),
             (2, 4, np.arange(9, dtype=np.int32))]
    with CompileWatch() as w:
        got = kb.score(items)
    assert w.count == 0
    for (slot, n, ids), sc in zip(items, got):
        want = bound_scores(queries[slot][-n:], table[ids])
        assert sc.shape == (len(ids),)
        np.testing.assert_allclose(sc, want, rtol=1e-5, atol=1e-5)
    # the same sequences one at a time
    for item, sc in zip(items, got):
        np.testing.assert_allclose(kb.score([item])[0], sc, rtol=1e-6, atol=1e-6)


def test_buckets_cover_the_page_table_width_and_the_running_sequences():
    state, _ = random_state(n_pages=4)
    kb = device_bounds(state, n_slots=17, max_pages=170)
    assert kb.page_buckets == (16, 32, 64, 128, 256) and kb.row_buckets == (1, 4, 16)
    assert device_bounds(state, n_slots=4, max_pages=16).row_buckets == (1, 4)
    assert device_bounds(state, n_slots=100, max_pages=16).row_buckets == (1, 4, 16, 64)
    more = device_bounds(state, n_ids=40, n_slots=100, window=2, max_pages=16)
    more.queries = jnp.ones_like(more.queries)
    more.bounds = jnp.ones_like(more.bounds)
    items = [(s % 99 + 1, 2, np.arange(3, dtype=np.int32)) for s in range(70)]  # more rows than one call takes
    got = more.score(items)
    assert len(got) == 70 and all(g.shape == (3,) and np.isfinite(g).all() for g in got)
    assert DeviceBounds.table_bytes(10, 3, 2, 2, 4, 8, 6, 2) == 10 * 2 * 2 * 2 * 8 * 2 + 3 * 6 * 2 * 4 * 8 * 4
    assert kb.nbytes == kb.bounds.nbytes + kb.queries.nbytes
