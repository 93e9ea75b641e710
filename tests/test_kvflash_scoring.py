"""Page scoring on the device (``kv/kvflash_scoring.DeviceScorer``) against the host references
(``kvflash.bound_scores`` over host-held queries and bounds, ``kvflash.shadow_scores`` over the dequantized key
shadow): the written tables, the query windows, the scores (every bucket, padded pages and queries, context pages,
several sequences a call), and no compiles after warmup."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax.engine.compile import CompileWatch
from dflash_jax.kv.kvflash import bound_scores, shadow_scores
from dflash_jax.kv.kvflash_scoring import DeviceScorer, dequantize_shadow, quantize_shadow, shadow_block
from test_kvflash_device import random_state

HEADS = 4  # the fixture target's query heads (2 KV heads)


def device_bounds(state, n_ids=12, n_slots=5, window=6, max_pages=40, kind="bounds"):
    return DeviceScorer(state, n_ids=n_ids, n_slots=n_slots, n_heads=HEADS, window=window, max_pages=max_pages,
                        kind=kind)


def test_written_bounds_are_the_elementwise_min_and_max_of_each_pages_keys():
    state, _ = random_state(n_pages=12)
    kb = device_bounds(state)
    kb.warmup(state, [])
    with CompileWatch() as w:
        kb.write(state, [3, 7], [5, 0])
    assert w.count == 0
    got = np.asarray(kb.table[0])
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
    kb.table = (jnp.asarray(np.sort(rng.normal(size=kb.table[0].shape), axis=1).astype(np.float32)),)  # min <= max
    kb.queries = jnp.asarray(rng.normal(size=kb.queries.shape).astype(np.float32))
    kb.warmup(state, [])
    table, queries = np.asarray(kb.table[0]), np.asarray(kb.queries)
    # (slot, valid queries, page ids, context ids): one page, a few, more than one page bucket, every query or
    # one; bounds scores ignore the context
    none = np.zeros(0, np.int32)
    items = [(1, 6, np.array([7], np.int32), none), (2, 2, rng.permutation(48)[:5].astype(np.int32), none),
             (4, 1, rng.permutation(48)[:20].astype(np.int32), np.array([40, 41], np.int32)),
             (3, 6, rng.permutation(48)[:33].astype(np.int32), none), (2, 4, np.arange(9, dtype=np.int32), none)]
    with CompileWatch() as w:
        got = kb.score(items)
    assert w.count == 0
    for (slot, n, ids, _), sc in zip(items, got):
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
    more.table = (jnp.ones_like(more.table[0]),)
    items = [(s % 99 + 1, 2, np.arange(3, dtype=np.int32), np.zeros(0, np.int32)) for s in range(70)]  # > one call
    got = more.score(items)
    assert len(got) == 70 and all(g.shape == (3,) and np.isfinite(g).all() for g in got)
    f16, u8 = 2, 1
    assert DeviceScorer.table_bytes("bounds", 10, 3, 2, 4, 2, 4, 8, 6, jnp.bfloat16) == (
        10 * 2 * 2 * 2 * 8 * 2 + 3 * 6 * 2 * 4 * 8 * 4)
    assert DeviceScorer.table_bytes("shadow", 10, 3, 2, 4, 2, 4, 64, 6, jnp.bfloat16) == (
        10 * 4 * 2 * 2 * (32 * u8 + 2 * f16) + 3 * 6 * 2 * 4 * 64 * 4)
    assert kb.nbytes == kb.table[0].nbytes + kb.queries.nbytes
    sh = device_bounds(state, kind="shadow")
    assert sh.nbytes == sum(t.nbytes for t in sh.table) + sh.queries.nbytes
    assert [t.dtype for t in sh.table] == [jnp.uint8, jnp.float16]


def q4_reference(k: np.ndarray) -> np.ndarray:
    """Q4_0's values of keys ``[..., D]`` in NumPy, dequantized: per block the element of largest magnitude m,
    scale = float16(m / -8), q = clip(round(k / scale), -8, 7)."""
    d = k.shape[-1]
    blk = shadow_block(d)
    kb = k.astype(np.float32).reshape(k.shape[:-1] + (d // blk, blk))
    m = np.take_along_axis(kb, np.abs(kb).argmax(-1)[..., None], -1)
    s = (m / -8.0).astype(np.float16).astype(np.float32)
    q = np.where(s != 0, np.clip(np.round(kb / np.where(s != 0, s, 1)), -8, 7), 0)
    return (q * s).reshape(k.shape)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([8, 64, 96]), st.floats(1e-3, 1e3), st.integers(0, 2**16))
def test_shadow_quantization_is_q4_0_and_within_a_step_of_the_keys(d, mag, seed):
    k = (np.random.default_rng(seed).normal(size=(3, 5, d)) * mag).astype(np.float32)
    data, scale = quantize_shadow(jnp.asarray(k))
    assert data.shape == (3, 5, d // 2) and data.dtype == jnp.uint8
    assert scale.shape == (3, 5, d // shadow_block(d)) and scale.dtype == jnp.float16
    back = np.asarray(dequantize_shadow(data, scale))
    np.testing.assert_allclose(back, q4_reference(k), rtol=1e-6, atol=0)
    step = np.abs(k.reshape(3, 5, -1, shadow_block(d))).max(-1, keepdims=True) / 8  # one step of each block
    assert (np.abs(back - k).reshape(step.shape[:-1] + (-1,)) <= step * (1 + 1e-2)).all()


def test_shadow_rows_hold_every_key_of_the_page():
    state, _ = random_state(n_pages=12)
    kb = device_bounds(state, kind="shadow")
    kb.warmup(state, [])
    with CompileWatch() as w:
        kb.write(state, [3, 7], [5, 0])
    assert w.count == 0
    back = np.asarray(dequantize_shadow(*kb.table))  # [n_ids, P, L, Hkv, D]
    ks = np.stack([np.asarray(k, np.float32) for k in state.kv.k], axis=2)  # [n_pages, P, L, Hkv, D]
    for row, p in ((5, 3), (0, 7)):
        np.testing.assert_allclose(back[row], q4_reference(ks[p]), rtol=1e-6, atol=0)
    assert not back[[1, 2, 3, 4, 6]].any()


def test_shadow_scores_equal_the_host_reference_with_context_pages():
    state, _ = random_state(n_pages=12)
    kb = device_bounds(state, n_ids=48, window=6, max_pages=40, kind="shadow")
    rng = np.random.default_rng(1)
    keys = rng.normal(size=(48,) + kb.table[0].shape[1:-1] + (kb.head_dim,)).astype(np.float32) * 2
    kb.table = tuple(quantize_shadow(jnp.asarray(keys)))
    kb.queries = jnp.asarray(rng.normal(size=kb.queries.shape).astype(np.float32))
    kb.warmup(state, [])
    shadow, queries = np.asarray(dequantize_shadow(*kb.table)), np.asarray(kb.queries)
    perm = lambda n: rng.permutation(48)[:n].astype(np.int32)
    items = [(1, 6, np.array([7], np.int32), np.zeros(0, np.int32)), (2, 2, perm(5), np.array([44, 45], np.int32)),
             (4, 1, perm(14), perm(3)), (3, 6, perm(30), perm(4)), (2, 4, np.arange(9, dtype=np.int32), perm(1))]
    with CompileWatch() as w:
        got = kb.score(items)
    assert w.count == 0
    for (slot, n, ids, ctx), sc in zip(items, got):
        want = shadow_scores(queries[slot][-n:], shadow[np.concatenate([ids, ctx])], len(ids))
        assert sc.shape == (len(ids),)
        np.testing.assert_allclose(sc, want, rtol=1e-4, atol=1e-4)
    # context only lowers candidates' shares (it joins the normalisation): never above the scores without it
    alone = kb.score([(3, 6, items[3][2], np.zeros(0, np.int32))])[0]
    assert (got[3] <= alone + 1e-5).all() and (got[3] < alone - 1e-6).any()


def test_shadow_scores_rank_the_page_that_holds_the_attended_key_first():
    """A query equal to one stored key (scaled up) gives that key's page the largest share."""
    state, _ = random_state(n_pages=4)
    kb = device_bounds(state, n_ids=20, window=2, max_pages=20, kind="shadow")
    rng = np.random.default_rng(2)
    keys = rng.normal(size=(20,) + kb.table[0].shape[1:-1] + (kb.head_dim,)).astype(np.float32)
    kb.table = tuple(quantize_shadow(jnp.asarray(keys)))
    q = np.zeros(kb.queries.shape, np.float32)
    g = HEADS // kb.n_kv
    q[1, -1] = 8 * np.repeat(keys[13, 2], g, axis=1)  # every head of slot 1 looks for token 2 of page 13
    kb.queries = jnp.asarray(q)
    sc = kb.score([(1, 1, np.arange(20, dtype=np.int32), np.zeros(0, np.int32))])[0]
    assert int(np.argmax(sc)) == 13


def test_scoring_cost_bench_times_both_kinds_and_writes_its_figures(tmp_path):
    import json

    from experiments import scoring_cost

    f = scoring_cost.main(["--shapes", "2", "4", "2", "64", "--rows", "1", "4", "--pages", "16", "32", "--iters", "2",
                           "--out-dir", str(tmp_path)])
    for kind in ("shadow", "bounds"):
        assert all(f[f"{kind}.s{s}.n{n}.ms"] > 0 for s in (1, 4) for n in (16, 32))
    # per page: shadow = P x L x Hkv x (D / 2 + 2 D / 32) bytes, bounds = 2 x L x Hkv x D bf16
    assert f["shadow.table_bytes_per_page"] == 16 * 2 * 2 * (32 + 4) and f["bounds.table_bytes_per_page"] == 1024
    assert f["shadow_vs_bounds.s4.n32"] == f["shadow.s4.n32.ms"] / f["bounds.s4.n32.ms"]
    (rec,) = [json.loads(p.read_text()) for p in tmp_path.glob("scoring_cost_*.json")]
    assert rec["bench"] == "scoring_cost" and rec["command"].startswith("python experiments/scoring_cost.py")
