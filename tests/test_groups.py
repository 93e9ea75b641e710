"""Engine.submit_group (the API's ``n``): one prompt prefills once, its siblings start from a copy of the leader's
state over its KV pages; every member's tokens equal the same request run alone."""

import functools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dflash_jax as dj
from conftest import FIXTURES, TINY
from dflash_jax.engine.compile import CompileWatch
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams

A = TINY[0]
OPTS = EngineOptions(max_batch=4, prefill_batch=2, prefill_chunk=16, max_model_len=256, page_size=8, prefix_cache=2)


@functools.lru_cache(maxsize=None)
def target():
    return dj.load_target(os.path.join(FIXTURES, A))


@pytest.fixture(scope="module")
def eng():
    e = Engine(target(), None, OPTS)
    e.warmup()
    return e


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, target().config.vocab_size, n).tolist()


SPS = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=1.0, seed=11),
       SamplingParams(max_tokens=7, temperature=0.8, top_k=5, seed=12), SamplingParams(max_tokens=10, temperature=1.0)]


def run(eng, rids) -> dict:
    final = {}
    while eng.has_work():
        for o in eng.step():
            if o.finish_reason is not None:
                final[o.request_id] = o
    return [final[r] for r in rids]


def idle(eng):
    assert not eng.has_work() and sorted(eng.free_slots) == [1, 2, 3, 4]
    eng.pages.check_invariants()
    assert eng.pages.num_free + eng.pages.num_held == eng.pages.n_pages - 1


def test_a_group_prefills_once_and_each_member_equals_its_request_alone(eng):
    p = prompt(45)  # fork at 40: the siblings prefill 5 tokens each
    sps = [SPS[0], SPS[1], SPS[2], SamplingParams(max_tokens=10, temperature=1.0, seed=13)]
    alone = [eng.generate([p], sp)[0].token_ids for sp in sps]
    before = dict(eng.counters)
    with CompileWatch() as w:
        outs = run(eng, eng.submit_group(p, sps))
    assert w.count == 0
    assert [o.token_ids for o in outs] == alone
    assert outs[0].token_ids == target().greedy(p, 10)
    assert eng.counters["forked_tokens"] - before.get("forked_tokens", 0) == 3 * 40
    assert eng.counters["prefill_steps"] - before.get("prefill_steps", 0) < 3 * 4  # the prompt prefilled once
    # the leader starts from the prefix cache (the runs alone cached two chunks), the others from the fork
    assert [o.stats["cached_tokens"] for o in outs] == [32, 40, 40, 40]
    idle(eng)


def test_aborting_a_group_member_before_the_fork(eng):
    p = prompt(60, seed=1)  # not cached yet: the leader prefills four chunks before the fork at 56
    rids = eng.submit_group(p, SPS[:3])
    eng.step()  # admitted; the leader prefills its first chunk, the siblings wait
    assert eng.running[rids[1]].leader is not None
    eng.abort(rids[2])
    outs = run(eng, rids[:2])
    assert outs[1].stats["cached_tokens"] == 56
    idle(eng)
    # the leader aborted: its siblings prefill the prompt themselves
    q = prompt(60, seed=7)
    rids = eng.submit_group(q, SPS[:3])
    eng.step()
    eng.abort(rids[0])
    again = run(eng, rids[1:])
    assert all(o.stats["cached_tokens"] == 0 for o in again)
    idle(eng)
    assert [o.token_ids for o in outs] == [eng.generate([p], sp)[0].token_ids for sp in SPS[:2]]
    assert [o.token_ids for o in again] == [eng.generate([q], sp)[0].token_ids for sp in SPS[1:3]]


def test_groups_that_cannot_share_run_as_separate_requests(eng):
    groups = eng.counters["groups"]
    short = prompt(6, seed=2)  # under two pages: nothing to share
    outs = run(eng, eng.submit_group(short, SPS[:2]))
    assert [o.token_ids for o in outs] == [eng.generate([short], sp)[0].token_ids for sp in SPS[:2]]
    big = [SamplingParams(max_tokens=3, temperature=1.0, seed=i) for i in range(6)]  # more than the slots
    p = prompt(30, seed=3)
    outs = run(eng, eng.submit_group(p, big))
    assert [o.token_ids for o in outs] == [eng.generate([p], sp)[0].token_ids for sp in big]
    assert eng.counters["groups"] == groups
    idle(eng)


def test_a_group_larger_than_the_pool_runs_as_separate_requests():
    """Admitted together a group would need more pages than the pool has: it is never formed (its members queue as
    separate requests and all finish)."""
    small = Engine(target(), None, EngineOptions(max_batch=4, prefill_batch=2, prefill_chunk=16, max_model_len=256,
                                                 page_size=8, n_pages=1 + 40))
    p = prompt(100, seed=9)
    sps = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(3)]  # 3 x 18 > 40
    outs = run(small, small.submit_group(p, sps))
    assert small.counters["groups"] == 0 and all(len(o.token_ids) == 40 for o in outs)
    assert small.pages.num_free == 40
    ok = small.submit_group(p, sps[:2])  # 2 x 18 pages fit
    assert small.counters["groups"] == 1 and [len(o.token_ids) for o in run(small, ok)] == [40, 40]


def test_a_group_behind_a_cached_prefix(eng):
    head = prompt(48, seed=4)
    p = head + prompt(9, seed=5)  # fork at 56; the cache holds 48 (three chunks)
    eng.generate([head + prompt(20, seed=6)], SamplingParams(max_tokens=2))
    alone = [eng.generate([p], sp)[0].token_ids for sp in SPS[:2]]
    outs = run(eng, eng.submit_group(p, SPS[:2]))
    assert [o.token_ids for o in outs] == alone
    assert outs[0].stats["cached_tokens"] == 48 and outs[1].stats["cached_tokens"] == 56
    idle(eng)


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 3), st.integers(5, 40), st.integers(-1, 1), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 20))), min_size=4, max_size=14))
def test_random_schedules_of_groups_priorities_and_aborts(eng, ops):
    """Any interleaving of group / single submits (with priorities), steps and aborts: every request that was not
    aborted ends with the tokens it gets alone, and every page and slot comes back."""
    subs: list[tuple[int, list[int], SamplingParams]] = []
    aborted: set[int] = set()
    done: dict[int, object] = {}
    seed = 0

    def step():
        for o in eng.step():
            if o.finish_reason is not None:
                done[o.request_id] = o

    for op in ops:
        if op[0] == "submit":
            _, n, length, prio, kind = op
            seed += 1
            p = prompt(length, seed=100 + seed)
            sps = [SamplingParams(max_tokens=4 + i, temperature=0.0 if (kind + i) % 2 == 0 else 1.0,
                                  seed=1000 + seed * 10 + i, priority=prio) for i in range(n)]
            for rid, sp in zip(eng.submit_group(p, sps) if n > 1 else [eng.submit(p, sps[0])], sps):
                subs.append((rid, p, sp))
        elif op[0] == "step":
            for _ in range(op[1]):
                if eng.has_work():
                    step()
        elif subs:
            rid = subs[op[1] % len(subs)][0]
            if rid not in done and eng.abort(rid):
                aborted.add(rid)
    while eng.has_work():
        step()
    idle(eng)
    for rid, p, sp in subs:
        if rid not in aborted:
            assert done[rid].token_ids == eng.generate([p], sp)[0].token_ids
