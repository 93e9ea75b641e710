"""KVFlash's host-side residency state machine (no JAX): exact accounting, no lost or stale page, pinned pages never
evicted, deferral instead of failure, fair quotas, scorer faults falling back to LRU.

A simulator plays the device pool and the host slabs: every logical page carries a version that each write bumps;
transfers copy versions. After every step the page's authoritative copy (resident: the device page; host-only:
the slab) must hold the latest version, and a clean resident page's slab must equal it.
"""

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_jax.kv.kvflash import (NOT_RESIDENT, KVFlashOptions, Residency, bound_scores, dot_scores,
                                     neighbour_scores, resolve_pool_tokens)


class Sim:
    """A residency plus a fake device pool and host slabs holding (sid, logical, version) per page."""

    def __init__(self, pool_pages=8, host_pages=64, page_size=4, **kw) -> None:
        opts = KVFlashOptions(pool_tokens=pool_pages * page_size, **kw)
        self.res = Residency(pool_pages, host_pages, page_size, opts)
        self.dev: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}
        self.version: dict[tuple[int, int], int] = collections.Counter()
        self.reserve: dict[int, int] = {}

    def admit(self, sid: int, tokens: int) -> bool:
        if not self.res.can_admit(tokens):
            return False
        self.res.admit(sid, tokens)
        self.reserve[sid] = tokens
        return True

    def step(self, rows, finish=True):
        """prepare -> transfers (page-outs first) -> the step writes its pinned pages -> finish_step."""
        res = self.res
        before = {sid: res.page_table(sid, 64).copy() for sid in res._seqs}
        plan = res.prepare(rows)
        for t in plan.page_out:
            assert self.dev[t.phys][:2] == (t.sid, t.logical), "page-out reads another sequence's page"
            self.host[t.slab] = self.dev[t.phys]
        for t in plan.page_in:
            assert self.host[t.slab][:2] == (t.sid, t.logical), "page-in of another sequence's slab"
            self.dev[t.phys] = self.host[t.slab]
        for sid in plan.deferred:  # a deferred row changes nothing of its own pages' count
            assert res.n_logical(sid) == int((before[sid] != 0).sum())
        for sid, lo, hi in rows:
            if sid in plan.deferred:
                continue
            for lp in range(lo // res.page_size, res.pages_needed(hi)):
                phys = res.page_table(sid, 64)[lp]
                assert phys >= 1, "a written page is not resident"
                self.version[(sid, lp)] += 1
                self.dev[phys] = (sid, lp, self.version[(sid, lp)])
        self.check()
        if finish:
            res.finish_step(plan.step_id)
        return plan

    def check(self):
        res = self.res
        res.check_invariants()
        for sid, s in res._seqs.items():
            for lp, p in enumerate(s.pages):
                want = (sid, lp, self.version[(sid, lp)])
                if s.phys[lp] != NOT_RESIDENT:
                    if self.version[(sid, lp)]:
                        assert self.dev[int(s.phys[lp])] == want, f"resident page {lp} of {sid} is stale"
                    if p.slab >= 0:
                        assert self.host[p.slab] == want, f"clean page {lp} of {sid} differs from its slab"
                else:
                    assert self.host[p.slab] == want, f"host page {lp} of {sid} is stale or lost"

    def release(self, sid):
        self.res.release(sid)
        for lp in [k for k in self.version if k[0] == sid]:
            del self.version[lp]
        del self.reserve[sid]


def resident(res, sid):
    return len(res.resident_of(sid))


# ---- properties over random admit / grow / evict / finish sequences -----------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["admit", "step", "spec", "release", "summaries"]),
                         st.integers(0, 10 ** 6)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, pool=st.integers(4, 12), scoring=st.sampled_from(["keys", "lru"]), exact=st.booleans(),
       faulty=st.booleans())
def test_random_workloads_keep_exact_accounting(ops, pool, scoring, exact, faulty):
    sim = Sim(pool_pages=pool, host_pages=60, page_size=4, scoring=scoring, exact_steps=exact, window_pages=2,
              rescore_every=1)
    res = sim.res
    calls = [0]

    def scorer(q, m):
        calls[0] += 1
        if faulty and calls[0] % 2:
            raise RuntimeError("scorer fault")
        return m @ q

    res.scorer = scorer
    next_sid = 0
    for op, x in ops:
        rng = np.random.default_rng(x)
        live = sorted(res._seqs)
        if op == "admit":
            if sim.admit(next_sid, int(rng.integers(1, 40))):
                next_sid += 1
        elif op == "summaries":
            need = res.summaries_needed()
            res.set_summaries([(a, b) for a, b, _ in need], rng.normal(size=(len(need), 3)))
        elif op == "release" and live:
            sim.release(int(rng.choice(live)))
        elif op in ("step", "spec") and live:
            rows = []
            for sid in live[: int(rng.integers(1, len(live) + 1))]:
                n = res.num_tokens(sid)
                room = sim.reserve[sid] - n
                if room <= 0:
                    continue
                rows.append((sid, n, n + int(rng.integers(1, min(room, 9) + 1))))
            if not rows:
                continue
            plan = sim.step(rows, finish=False)
            pinned_now = len(res._pinned)
            res.finish_step(plan.step_id)
            oldest = rows[0][0]
            assert oldest not in plan.deferred, "the oldest row of a step fits the pool and is never deferred"
            if op == "spec":  # a speculative round commits fewer tokens than it wrote: roll back
                for sid, lo, hi in rows:
                    if sid not in plan.deferred:
                        keep = int(rng.integers(lo, hi + 1))
                        res.truncate(sid, keep)
                        for lp in range(res.pages_needed(keep), res.pages_needed(hi)):
                            sim.version.pop((sid, lp), None)
                sim.check()
            # fairness: every sequence holds at least its max-min fair share of what pins leave free (with
            # exact_steps, the step's rows may take their whole history and page the other sequences out)
            n = len(res._seqs)
            in_step = {sid for sid, _, _ in rows}
            for sid in res._seqs:
                if exact and sid not in in_step:
                    continue
                share = min(res.n_logical(sid), (res.pool_pages - pinned_now) // n)
                assert resident(res, sid) >= share, f"sequence {sid} starved: {resident(res, sid)} < {share}"
        res.check_invariants()
    for sid in list(res._seqs):
        sim.release(sid)
    res.check_invariants()
    assert res.num_free == res.pool_pages and res.host_free == res.host_pages  # everything reclaimed


# ---- targeted cases -------------------------------------------------------------------------------------------
def test_whole_history_stays_resident_while_it_fits():
    sim = Sim(pool_pages=8, page_size=4)
    assert sim.admit(0, 30) and sim.admit(1, 30)
    for _ in range(3):
        sim.step([(0, sim.res.num_tokens(0), sim.res.num_tokens(0) + 4), (1, sim.res.num_tokens(1),
                                                                            sim.res.num_tokens(1) + 4)])
    assert resident(sim.res, 0) == 3 and resident(sim.res, 1) == 3
    assert sim.res.counters["page_out"] == 0 and sim.res.counters["page_in"] == 0


def test_pinned_pages_are_never_evicted_and_a_full_pinned_pool_defers():
    sim = Sim(pool_pages=4, page_size=4)
    assert sim.admit(0, 40) and sim.admit(1, 40)
    plan = sim.step([(0, 0, 16)], finish=False)  # 4 pages written and still in flight: the whole pool is pinned
    pinned = sim.res.page_table(0, 64)[:4].tolist()
    plan2 = sim.res.prepare([(1, 0, 4)])  # another step wants a page: nothing evictable -> deferred, not failed
    assert plan2.deferred == [1] and not plan2.page_out and not plan2.page_in
    assert sim.res.page_table(0, 64)[:4].tolist() == pinned
    assert sim.res.stats_of(1)["deferred_steps"] == 1
    sim.res.finish_step(plan2.step_id)
    sim.res.finish_step(plan.step_id)  # outputs ready: the pins go, and the deferred row runs
    plan3 = sim.step([(1, 0, 4)])
    assert not plan3.deferred and len(plan3.page_out) == 1  # sequence 0 gave a dirty page to host
    sim.check()


def test_eviction_goes_to_the_sequence_furthest_over_its_share():
    sim = Sim(pool_pages=8, page_size=4, window_pages=1, sink_pages=0)
    assert sim.admit(0, 64) and sim.admit(1, 64)
    sim.step([(0, 0, 32)])  # sequence 0 alone fills the pool
    assert resident(sim.res, 0) == 8
    sim.step([(1, 0, 4)])
    # water-filling: 1 needs one page, 0 keeps the other seven; the victim was 0's lowest-ranked page
    assert resident(sim.res, 0) == 7 and resident(sim.res, 1) == 1
    sim.step([(1, 4, 12)])  # 1 wants 3 pages: max-min fair shares are 5 and 3
    assert resident(sim.res, 0) == 5 and resident(sim.res, 1) == 3
    sim.step([(1, 12, 32)])  # both want 8, but 1 pins the 5 pages it writes: 3 and 5
    assert resident(sim.res, 0) == 3 and resident(sim.res, 1) == 5
    sim.step([(1, 32, 33)])  # one pinned page: the pool is split evenly
    assert resident(sim.res, 0) == 4 and resident(sim.res, 1) == 4


def test_sinks_and_recent_window_stay_and_lru_evicts_the_oldest_use():
    sim = Sim(pool_pages=6, page_size=4, scoring="lru", sink_pages=1, window_pages=2)
    assert sim.admit(0, 100) and sim.admit(1, 100)
    for i in range(10):
        n = sim.res.num_tokens(0)
        sim.step([(0, n, n + 4)])
    sim.step([(1, 0, 12)])
    res = sim.res
    kept = res.resident_of(0)
    assert 0 in kept and 9 in kept and 8 in kept  # sink and the recent window
    assert kept == [0, 8, 9]  # the rest by recency: pages 1..7 were used least recently


def _grow_summarised(sim, vec: dict, pages: int = 8):
    """Sequence 0 grows by ``pages`` full pages, each resident full page summarised by ``vec[logical]`` before
    every step (what the engine does); returns the summarising function."""
    res = sim.res

    def summaries():
        need = res.summaries_needed()
        res.set_summaries([(a, b) for a, b, _ in need], [vec[b] for _, b, _ in need])

    for _ in range(pages):
        n = res.num_tokens(0)
        summaries()
        sim.step([(0, n, n + 4)])
    summaries()
    return summaries


def test_keys_scoring_keeps_the_best_matching_page_and_a_raising_scorer_falls_back_to_lru():
    sim = Sim(pool_pages=5, page_size=4, scoring="keys", sink_pages=1, window_pages=1, rescore_every=1)
    res = sim.res
    assert sim.admit(0, 100) and sim.admit(1, 100)
    vec = {lp: np.eye(4)[1] * 0.1 for lp in range(8)}
    vec[3] = np.eye(4)[0] * 5  # the latest full page (7) matches page 3 best
    vec[7] = np.eye(4)[0]

    _grow_summarised(sim, vec)
    sim.step([(1, 0, 8)])  # sequence 1 needs pages: 0 drops to its quota, keeping its best-scored page
    kept = res.resident_of(0)
    assert 3 in kept and 0 in kept and 7 in kept
    assert res.counters["score_decisions"] >= 1

    def broken(q, m):
        raise RuntimeError("scorer fault")

    res.scorer = broken
    res._seqs[0].ranks = None
    sim.step([(1, 8, 12)])
    assert res.counters["score_fallbacks"] == 1 and res.stats_of(0)["score_fallbacks"] == 1
    sim.check()


def test_clean_pages_are_evicted_without_moving_bytes():
    sim = Sim(pool_pages=4, page_size=4, window_pages=1, sink_pages=0)
    assert sim.admit(0, 64) and sim.admit(1, 64)
    sim.step([(0, 0, 16)])
    sim.step([(1, 0, 16)])  # 0 pages out; its pages are host-only now
    sim.step([(0, 16, 17)])  # 0 comes back to its share of 2 (one page-in: a clean copy), 1 goes out
    assert sim.res.counters["page_in"] == 1
    plan = sim.step([(1, 16, 28)])  # 1 pins 3 pages: 0's clean page leaves again without a copy
    assert sim.res.counters["clean_evictions"] == 1
    assert plan.page_out and all(t.sid == 1 for t in plan.page_out)  # only 1's dirty pages moved
    sim.check()


def test_admission_keeps_a_floor_per_running_sequence_and_host_capacity():
    res = Residency(4, 10, 4, KVFlashOptions(pool_tokens=16), floor_pages=2)
    assert res.can_admit(40)
    res.admit(0, 20)
    res.admit(1, 20)
    assert not res.can_admit(4)  # a third sequence would leave less than 2 pages each
    res2 = Residency(16, 10, 4, KVFlashOptions(pool_tokens=64))
    res2.admit(0, 36)
    assert not res2.can_admit(8) and res2.can_admit(4)  # host capacity: 9 + 2 > 10 pages


def test_pool_size_flag():
    assert resolve_pool_tokens("off", free_bytes=None, bytes_per_token=4, page_size=16) is None
    assert resolve_pool_tokens(8192, free_bytes=None, bytes_per_token=4, page_size=16) == 8192
    assert resolve_pool_tokens("auto", free_bytes=10_000, bytes_per_token=4, page_size=16) == 2000 // 16 * 16
    with pytest.raises(ValueError, match="free memory"):
        resolve_pool_tokens("auto", free_bytes=None, bytes_per_token=4, page_size=16)
    with pytest.raises(ValueError, match="off, auto or a token count"):
        resolve_pool_tokens("lots", free_bytes=None, bytes_per_token=4, page_size=16)


def test_drafter_scoring_ranks_by_query_dot_summary_and_falls_back_to_lru_without_a_query():
    sim = Sim(pool_pages=5, page_size=4, scoring="drafter", sink_pages=1, window_pages=1, rescore_every=1,
              hysteresis=0.0)
    res = sim.res
    assert sim.admit(0, 100) and sim.admit(1, 100)
    vec = {lp: np.eye(8)[lp] for lp in range(8)}  # page lp's mean drafter keys point along axis lp

    summaries = _grow_summarised(sim, vec)
    assert all(res._seqs[0].pages[lp].summary is not None for lp in range(8))
    sim.step([(1, 0, 8)])  # no drafter query yet: sequence 0 keeps its sink, window and most recent page (LRU)
    assert res.resident_of(0) == [0, 6, 7]
    assert res.counters["unscored_fallbacks"] >= 1 and res.stats_of(0)["unscored_fallbacks"] >= 1
    assert res.counters["score_decisions"] == 0 and res.stats_of(0)["lru_decisions"] >= 1

    res.set_query(0, 3 * vec[2] + 2 * vec[4] - vec[6])  # the drafter attends to page 2, then 4; away from 6
    summaries()
    plan = sim.step([(1, 8, 12)])
    assert res._seqs[0].ranks[:2] == [2, 4] and res._seqs[0].ranks[-1] == 6  # query . summary order
    assert res.resident_of(0) == [0, 2, 7]  # its best-scored page came back (paged in from its host slab)
    assert any(t.sid == 0 and t.logical == 2 for t in plan.page_in)
    assert res.counters["score_decisions"] >= 1 and res.stats_of(0)["score_decisions"] >= 1

    fallbacks = res.stats_of(0)["unscored_fallbacks"]
    res.set_query(0, None)  # it decodes without drafting now: LRU again, counted
    res.set_query(99, vec[0])  # an unknown sequence is ignored
    sim.step([(1, 12, 13)])
    assert res.stats_of(0)["unscored_fallbacks"] == fallbacks + 1
    sim.check()


def _bounds(keys: np.ndarray) -> np.ndarray:
    """keys [P, L, Hkv, D] of one page -> its bounds [2, L, Hkv, D] (a row of a ``DeviceScorer`` bounds table)."""
    return np.stack([keys.min(0), keys.max(0)])


def test_bound_scores_find_the_page_with_one_aligned_key_that_mean_keys_miss():
    rng = np.random.default_rng(0)
    d, p = 8, 16
    q = np.zeros((1, 1, 2, d), np.float32)  # one position, one layer, two query heads on one KV head
    q[0, 0, 0, 0] = 4.0  # head 0 looks for keys along axis 0; head 1 is diffuse
    q[0, 0, 1] = rng.normal(size=d) * 0.1
    noise = lambda: rng.normal(size=(p, 1, 1, d)).astype(np.float32) * 0.05 * (np.arange(d) > 0)
    needle = noise()
    needle[5, 0, 0, 0] = 3.0  # one token of 16 carries the matching key: its page mean along axis 0 is 3 / 16
    plain = [noise() + 0.5 * np.eye(d, dtype=np.float32)[0] for _ in range(3)]  # mean 0.5 along 0, no key above it
    pages = [plain[0], needle, plain[1], plain[2]]
    assert bound_scores(q, np.stack([_bounds(k) for k in pages])).argmax() == 1
    # the mean-key dot product ranks the needle page last: the one line is averaged away
    means = np.stack([k.mean(0).ravel() for k in pages])
    assert dot_scores(q[0, :, :1].ravel(), means).argmin() == 1
    # the bounds really bound every key's logit from above, head by head
    b = np.stack([_bounds(k) for k in pages])
    for i, k in enumerate(pages):
        for h in range(2):
            ub = np.maximum(q[0, 0, h] * b[i, 0, 0, 0], q[0, 0, h] * b[i, 1, 0, 0]).sum()
            assert (k[:, 0, 0] @ q[0, 0, h] <= ub + 1e-6).all()


@pytest.mark.parametrize("nq,layers,heads,kv_heads,d,n", [(1, 1, 2, 1, 4, 3), (3, 2, 4, 2, 8, 7), (16, 3, 6, 2, 16, 40)])
def test_bound_scores_equal_the_definition(nq, layers, heads, kv_heads, d, n):
    """Per (position, layer, query head): ub = sum_d max(q kmin, q kmax) / sqrt(D) over the KV head it reads, log
    shares over pages, best share per page."""
    rng = np.random.default_rng(n)
    q = rng.normal(size=(nq, layers, heads, d)).astype(np.float32)
    k = rng.normal(size=(n, 2, layers, kv_heads, d)).astype(np.float32)
    b = np.stack([k.min(axis=1), k.max(axis=1)], axis=1)
    kv = np.repeat(b, heads // kv_heads, axis=3)
    ub = np.maximum(q[:, None] * kv[None, :, 0], q[:, None] * kv[None, :, 1]).sum(-1) / np.sqrt(d)  # [Q, n, L, H]
    share = ub - np.log(np.exp(ub).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(bound_scores(q, b), share.max(axis=(0, 2, 3)), rtol=1e-5, atol=1e-5)


def test_bound_scores_let_one_sharp_head_outrank_many_diffuse_ones():
    d, n = 4, 6
    q = np.ones((1, 2, 4, d), np.float32)  # 2 layers x 4 heads, 2 KV heads
    b = np.zeros((n, 2, 2, 2, d), np.float32)
    b[:, :, :, :, :] = np.linspace(1.0, 1.5, n)[:, None, None, None, None]  # large, flat logits: page 5 a bit more
    b[2, :, 1, 1, 0] = 30.0  # layer 1, KV head 1 (heads 2, 3) have one key of page 2 far above the rest
    sc = bound_scores(q, b)
    assert sc.shape == (n,) and sc.argmax() == 2
    assert list(np.argsort(-sc))[1] == 5  # then the diffuse heads' order


def _axis_pages_sim(pool_pages: int, d: int = 8):
    """Two sequences under bounds scoring; sequence 0 grows 8 pages, page lp holding one key along axis lp among
    zeros (bounds [2, L=1, Hkv=1, D]). Returns (sim, residency, summaries())."""
    sim = Sim(pool_pages=pool_pages, page_size=4, scoring="bounds", sink_pages=1, window_pages=1, rescore_every=1000,
              hysteresis=0.0)
    assert sim.admit(0, 100) and sim.admit(1, 100)
    vec = {}
    for lp in range(8):
        k = np.zeros((4, 1, 1, d), np.float32)
        k[1, 0, 0, lp] = 1.0
        vec[lp] = _bounds(k)
    return sim, sim.res, _grow_summarised(sim, vec)


def test_bounds_scoring_ranks_by_pushed_queries_and_a_prefill_query_forces_a_rescore():
    d = 8
    sim, res, summaries = _axis_pages_sim(5, d)
    sim.step([(1, 0, 8)])  # no query yet: LRU, counted
    assert res.resident_of(0) == [0, 6, 7] and res.stats_of(0)["unscored_fallbacks"] >= 1
    q = np.zeros((2, 1, 2, d), np.float32)  # two positions, two query heads on the one KV head
    q[1, 0, 1, 3] = 5.0  # the newest position's second head attends to page 3's key
    res.push_query(0, q[:1], keep=4)
    res.push_query(0, q[1:], keep=4, rescore=True)  # a prefill chunk's queries: re-rank now, not in 1000 steps
    assert res._seqs[0].query.shape == (2, 1, 2, d)
    summaries()
    plan = sim.step([(1, 8, 12)])
    assert res._seqs[0].ranks[0] == 3 and res.resident_of(0) == [0, 3, 7]
    assert any(t.sid == 0 and t.logical == 3 for t in plan.page_in)  # paged back in from its host slab
    res.push_query(0, np.zeros((3, 1, 2, d), np.float32), keep=4)
    assert res._seqs[0].query.shape == (4, 1, 2, d)  # the window keeps the newest 4
    res.push_query(99, q, keep=4)  # an unknown sequence is ignored
    sim.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), unique=True, max_size=25), st.integers(0, 2**16))
def test_neighbour_scores_equal_their_definition(pages, seed):
    sc = np.random.default_rng(seed).normal(size=len(pages))
    at = {lp: i for i, lp in enumerate(pages)}
    want = [max([sc[i]] + [sc[at[nb]] + np.log(0.5) for nb in (lp - 1, lp + 1) if nb in at])
            for i, lp in enumerate(pages)]
    np.testing.assert_allclose(neighbour_scores(sc, pages, 0.5), want, rtol=0, atol=1e-12)


def test_bounds_scoring_keeps_the_neighbour_of_a_strong_page_over_a_weak_match():
    """A line straddling a page boundary: the page after (or before) the one its query hits is kept with it."""
    assert list(neighbour_scores(np.array([-1.0, -9.0, -3.0, -9.0]), [2, 3, 5, 6], 0.5)) == pytest.approx(
        [-1.0, -1.0 + np.log(0.5), -3.0, -3.0 + np.log(0.5)])  # 3 is 2's neighbour; 5 is nobody's (4 is absent)
    d = 8
    sim, res, summaries = _axis_pages_sim(6, d)
    q = np.zeros((1, 1, 1, d), np.float32)
    q[0, 0, 0, 3] = 5.0  # the question hits page 3 hard ...
    q[0, 0, 0, 6] = 1.0  # ... and page 6 a little: on their own scores page 6 would be kept next, not 2 or 4
    res.push_query(0, q, keep=4, rescore=True)
    summaries()
    sim.step([(1, 0, 8)])
    kept = set(res.resident_of(0))
    assert res._seqs[0].ranks[0] == 3 and len(kept) == 4
    assert {0, 3, 7} <= kept and kept & {2, 4} and 6 not in kept
    sim.check()


def test_residency_replay_times_the_host_work_and_writes_its_figures(tmp_path):
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from experiments import residency_replay

    base = ["--concurrency", "4", "--prompt-len", "100", "200", "--output-len", "8", "--pool", "256",
            "--prefill-chunk", "64", "--out-dir", str(tmp_path)]
    for extra in ([], ["--scoring", "host", "--shapes", "2", "4", "2", "8"]):
        f = residency_replay.main(base + extra)
        assert f["decode_ms_per_step"] > 0 and f["pages_out"] > 0 and f["score_decisions"] > 0
        assert f["logical_pages"] > f["pool_pages"] == 16
    recs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("residency_replay_*.json"))]
    assert len(recs) == 2 and all(r["command"].startswith("python experiments/residency_replay.py") for r in recs)
    assert {r["extra"]["settings"]["scoring"] for r in recs} == {"device", "host"}
    with pytest.raises(SystemExit, match="too small"):
        residency_replay.main(base[:-2] + ["--no-write", "--prefill-chunk", "1024", "--prompt-len", "300", "400"])
