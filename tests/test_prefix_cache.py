"""Prompt-prefix caching: the cache's bookkeeping, and an engine with it giving the tokens an engine without it
gives (greedy and sampled, alone and batched, AR and DDTree) while prefilling less, under page pressure too."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import dflash_jax as dj
from conftest import FIXTURES, TINY
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.engine.spec_steps import SpecConfig
from dflash_jax.kv.pages import PageAllocator
from dflash_jax.kv.prefix_cache import PrefixCache, chunk_keys
from dflash_jax.models import dflash

pytestmark = pytest.mark.xdist_group("prefix_cache")

A = TINY[0]
OPTS = dict(max_batch=4, prefill_batch=2, prefill_chunk=16, max_model_len=160, page_size=8)


# ---- the cache alone --------------------------------------------------------------------------------------------
def test_keys_chain_over_chunks():
    a = chunk_keys(list(range(50)), 16, 50)
    assert [n for n, _ in a] == [16, 32, 48]
    b = chunk_keys(list(range(32)) + [7] * 18, 16, 50)
    assert a[:2] == b[:2] and a[2] != b[2]  # same first chunks, same keys; a later difference changes the rest
    assert chunk_keys(list(range(40)), 16, 31) == a[:1]  # only boundaries within the limit


def test_lookup_insert_and_eviction_by_use_then_recency():
    alloc = PageAllocator(1 + 12, 4)
    cache = PrefixCache(alloc, 8, snapshot_slots=[10, 11])
    with pytest.raises(ValueError, match="multiple of page_size"):
        PrefixCache(alloc, 6, [1])
    p = list(range(100, 130))
    alloc.admit(1, 30)
    alloc.grow(1, 24)
    assert cache.wants(p, 12) is None and cache.wants(p, 30) is None  # not a boundary / the whole prompt
    k8, k16 = cache.wants(p, 8), cache.wants(p, 16)
    assert cache.insert(k8, 8, alloc.pages_of(1)) == 11 and cache.insert(k16, 16, alloc.pages_of(1)) == 10
    assert cache.wants(p, 16) is None  # cached already
    assert cache.lookup(p).n_tokens == 16 and cache.lookup(p[:17]).n_tokens == 16
    assert cache.lookup(p[:16]).n_tokens == 8  # a prompt must keep a token to prefill
    cache.use(cache.lookup(p))
    cache.use(cache.lookup(p[:16]))
    assert cache.lookup([1] + p) is None
    alloc.release(1)
    assert alloc.num_held == 4 and alloc.num_free == 12 - 4
    alloc.check_invariants()
    # a third prefix takes the slot of the entry fewest prompts used: the 8-token prefix (2 uses; the 16 one has 3)
    q = list(range(200, 230))
    alloc.admit(2, 30)
    alloc.grow(2, 8)
    assert cache.insert(cache.wants(q, 8), 8, alloc.pages_of(2)) == 11
    assert cache.lookup(p).n_tokens == 16 and cache.lookup(q).n_tokens == 8
    alloc.release(2)
    # room for the whole pool over p's 4 pages: q's prefix has to go, the one to be used stays
    keep = cache.lookup(p)
    assert cache.make_room([12 * 4], keep=keep)
    assert cache.lookup(p) is keep and cache.lookup(q) is None and alloc.num_free == 8
    assert not cache.make_room([13 * 4]) and len(cache) == 0  # more than the pool: everything went, still no room
    cache.clear()
    alloc.check_invariants()
    assert alloc.num_free == 12 and len(cache) == 0


# ---- in the engine ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return dj.load_target(os.path.join(FIXTURES, A), dtype="float32")


@pytest.fixture(scope="module")
def engines(target):
    opts = {**OPTS, "batch_buckets": (1, 4)}  # alone and the four prompts together
    plain = Engine(target, None, EngineOptions(**opts))
    cached = Engine(target, None, EngineOptions(prefix_cache=3, **opts))
    plain.warmup()
    cached.warmup()
    return plain, cached


def _prompts(target, seed=0):
    rng = np.random.default_rng(seed)
    v = target.config.vocab_size
    system = rng.integers(0, v, 40).tolist()  # a shared head: boundaries 16 and 32 lie inside it
    return [system + rng.integers(0, v, n).tolist() for n in (9, 23, 1)] + [system[:35]]


def test_cached_prefixes_give_the_same_tokens_and_prefill_less(engines, target):
    plain, cached = engines
    ps = _prompts(target)
    sps = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=1.0, seed=4),
           SamplingParams(max_tokens=8), SamplingParams(max_tokens=6)]
    want = [plain.generate([p], sp)[0].token_ids for p, sp in zip(ps, sps)]
    first = cached.generate([ps[0]], sps[0])[0]
    assert first.token_ids == want[0] and first.stats["cached_tokens"] == 0
    outs = [cached.generate([p], sp)[0] for p, sp in zip(ps[1:], sps[1:])]
    assert [o.token_ids for o in outs] == want[1:]
    assert [o.stats["cached_tokens"] for o in outs] == [32, 32, 32]
    assert outs[0].stats["prefill_chunks"] < first.stats["prefill_chunks"] + 2  # 63 tokens from 32: 2 chunks
    # together in one batch: the same tokens again
    together = cached.generate(ps, sps)
    assert [o.token_ids for o in together] == want
    assert cached.counters["prefix_cache_hits"] >= 7
    cached.pages.check_invariants()
    assert not cached.running and cached.pages.num_used == cached.pages.num_held  # only the cache holds pages


def test_page_pressure_evicts_cached_prefixes_and_requests_still_run(engines, target):
    plain, _ = engines
    eng = Engine(target, None, EngineOptions(prefix_cache=2, **{**OPTS, "max_batch": 2}, n_pages=1 + 24))
    rng = np.random.default_rng(3)
    v = target.config.vocab_size
    ps = [rng.integers(0, v, 90).tolist() for _ in range(4)]  # 90 + 8 tokens: 13 pages each, the pool holds 24
    sp = SamplingParams(max_tokens=8)
    outs = eng.generate(ps, sp)
    assert [o.token_ids for o in outs] == [plain.generate([p], sp)[0].token_ids for p in ps]
    assert eng.prefix_caches[0].counters["evicted"] >= 1
    eng.pages.check_invariants()
    eng.prefix_caches[0].clear()
    assert eng.pages.num_free == eng.pages.n_pages - 1


def test_ddtree_over_a_cached_prefix_equals_ar(target):
    from test_spec_step import drafter_cfg

    dcfg = drafter_cfg(target.config)
    dparams = dflash.init_params(dcfg, jax.random.key(3), target.params["embed"].dtype)
    one = {**OPTS, "max_batch": 1, "prefill_batch": 1}  # one bucket: the speculative step compiles once
    opts = EngineOptions(prefix_cache=2, spec=SpecConfig(budget=6), cohort_yield_min=0.0, **one)
    eng = Engine(target, None, opts, drafter=(dcfg, dparams))
    ps = _prompts(target, seed=1)
    for p in ps[:3]:
        o = eng.generate([p], SamplingParams(max_tokens=10))[0]
        assert o.token_ids == target.greedy(p, 10) and o.stats["spec_mode"] == "ddtree"
    assert eng.counters["prefix_cache_hits"] == 2


def test_prefix_caching_refuses_what_it_cannot_serve(target):
    with pytest.raises(ValueError, match="multiple of page_size"):
        Engine(target, None, EngineOptions(prefix_cache=1, **{**OPTS, "prefill_chunk": 12}))
    with pytest.raises(ValueError, match="KVFlash"):
        Engine(target, None, EngineOptions(prefix_cache=1, kvflash=64, **OPTS))


def test_a_state_reset_drops_the_cached_prefixes(engines, target):
    """After a faulted step the server rebuilds the device state (``reset_state``): the cache, whose pages and
    snapshots were in it, goes too, and the next requests are served as before."""
    plain, cached = engines
    p = _prompts(target, seed=2)[0]
    sp = SamplingParams(max_tokens=6)
    cached.generate([p], sp)
    assert len(cached.prefix_caches[0]) > 0
    cached.reset_state()
    assert len(cached.prefix_caches[0]) == 0 and cached.pages.num_free == cached.pages.n_pages - 1
    out = cached.generate([p], sp)[0]
    assert out.stats["cached_tokens"] == 0 and out.token_ids == plain.generate([p], sp)[0].token_ids
