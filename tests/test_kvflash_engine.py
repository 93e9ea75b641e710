"""The engine with KVFlash bounded residency: greedy output identical to unbounded residency when each step's rows
fit the pool (pages really move out and back in), exact accounting under pressure with keys scoring, telemetry,
deferral instead of failure, and faults (scorer raising, a host copy failing) that end in a fallback or a clear
per-request error while the other requests and the engine keep going and every page is reclaimed.

One bounded engine and one DDTree engine are compiled per module and reconfigured between tests (the residency
policy does not change any compiled shape).
"""

import contextlib
import dataclasses
import functools
import os

import jax
import numpy as np
import pytest

import dflash_jax as dj
from conftest import FIXTURES
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.kv.kvflash import KVFlashOptions, Residency

# Two groups, so the two halves can run on different workers: the tests sharing the module's bounded / unbounded /
# DDTree engines, and the quantized-page tests sharing the bf16 reference (the pinned-pool test shares nothing).
SHARED = pytest.mark.xdist_group("kvflash")
QUANT = pytest.mark.xdist_group("kvflash_quant")

BASE = EngineOptions(max_batch=3, prefill_batch=1, prefill_chunk=16, max_model_len=128, page_size=8)
POOL = 192  # 24 pages of 8 tokens: two requests' histories fit, three do not


@functools.lru_cache(maxsize=None)
def target():
    return dj.load_target(os.path.join(FIXTURES, "qwen36_tiny_a"))


@pytest.fixture(scope="module")
def unbounded():
    eng = Engine(target(), None, BASE)
    eng.warmup()
    return eng


@pytest.fixture(scope="module")
def bounded():
    eng = Engine(target(), None, dataclasses.replace(BASE, kvflash=POOL, kvflash_scoring="keys"))
    eng.warmup()
    rep = eng.kvflash_report()
    assert rep["host_memory_kind"] == "pinned_host"
    # warm-up made every host slab (+ a bucket of page-outs in flight) ready: far below the 8 GiB default cap
    assert rep["prewarm_bytes"] == (rep["host_pages"] + 64) * rep["page_bytes"] and rep["prewarm_s"] > 0
    return eng


def configure(eng: Engine, **kw) -> Residency:
    """A fresh residency policy on an idle engine (same pool, so the same compiled steps)."""
    assert not eng.has_work()
    old = eng.pages
    eng.pages = Residency(old.pool_pages, old.host_pages, old.page_size,
                          KVFlashOptions(pool_tokens=POOL, **kw), floor_pages=old.floor_pages)
    for k in [k for k in eng.counters if k.startswith("kvflash_")]:
        del eng.counters[k]
    return eng.pages


def prompts(*lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 200, n).tolist() for n in lens]


def drive(eng: Engine, ps, sps):
    """Run to completion checking, after every step, the residency invariants and that every dispatched block
    table equals the residency map at dispatch (cross-slot refresh). Returns (outputs in order, tables)."""
    tables = []
    orig = eng._dispatch

    def dispatch(kind, b, rows, inp, samp, *args, **kwargs):
        seen = [r for r in eng.running.values() if r.slot in set(np.asarray(inp.slots).tolist())]
        for r in seen:
            i = list(np.asarray(inp.slots)).index(r.slot)
            np.testing.assert_array_equal(np.asarray(inp.page_table)[i], eng.pages.page_table(r.rid, eng.width))
            tables.append(np.asarray(inp.page_table)[i][: eng.pages.n_logical(r.rid)])
        return orig(kind, b, rows, inp, samp, *args, **kwargs)

    eng._dispatch = dispatch
    try:
        ids = [eng.submit(p, s) for p, s in zip(ps, sps)]
        final = {}
        while eng.has_work():
            for o in eng.step():
                if o.finish_reason is not None:
                    final[o.request_id] = o
            eng.pages.check_invariants()
    finally:
        del eng._dispatch
    return [final[i] for i in ids], tables


def page_bytes(state, dkv, p: int) -> list[np.ndarray]:
    """Every leaf of physical page ``p`` (target and drafter K/V; data and scales when quantized) as bytes."""
    return [np.asarray(a[p]).view(np.uint8) for a in jax.tree_util.tree_leaves((state.kv, dkv))]


@contextlib.contextmanager
def checked_round_trips(eng: Engine):
    """Check that every page-in writes back, bit for bit, the page its slab got at page-out (greedy tokens of the
    tiny model alone would not notice a wrong page). Yields the list of checked page-ins."""
    kvf, slabs, checked = eng.kvf, {}, []
    out, inn = kvf.page_out, kvf.page_in

    def page_out(state, dkv, transfers):
        for t in transfers:
            slabs[t.slab] = page_bytes(state, dkv, t.phys)
        return out(state, dkv, transfers)

    def page_in(state, dkv, transfers):
        state, dkv = inn(state, dkv, transfers)
        for t in transfers:
            for a, b in zip(page_bytes(state, dkv, t.phys), slabs[t.slab], strict=True):
                np.testing.assert_array_equal(a, b)
            checked.append(t)
        return state, dkv

    kvf.page_out, kvf.page_in = page_out, page_in
    try:
        yield checked
    finally:
        del kvf.page_out, kvf.page_in


def assert_reclaimed(eng: Engine):
    res = eng.pages
    res.check_invariants()
    assert not eng.running and not eng.waiting
    assert res.resident_used == 0 and res.host_free == res.host_pages
    assert eng.free_slots == list(range(1, eng.options.max_batch + 1))


@SHARED
def test_bounded_residency_equals_unbounded_when_each_step_fits(bounded, unbounded):
    configure(bounded, scoring="lru", exact_steps=True)
    ps = prompts(100, 100, 60)
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (8, 8, 24)]
    want = unbounded.generate(ps, sps)
    with checked_round_trips(bounded) as checked:
        got, tables = drive(bounded, ps, sps)
    assert checked
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all((t >= 1).all() for t in tables)  # every step attended to its rows' whole history
    rep = bounded.kvflash_report()
    assert rep["pages_in"] > 0 and rep["pages_out"] > 0 and rep["bytes_in"] == rep["pages_in"] * rep["page_bytes"]
    assert rep["table_refreshes"] > 0
    assert sum(o.stats["kv_pages_in"] for o in got) == rep["pages_in"]
    assert sum(o.stats["kv_pages_out"] for o in got) == rep["pages_out"]
    assert_reclaimed(bounded)


@SHARED
def test_keys_scoring_under_pressure_keeps_exact_accounting_and_reports(bounded):
    res = configure(bounded, scoring="keys", rescore_every=4)
    ps = prompts(100, 100, 100, seed=1)
    sps = [SamplingParams(max_tokens=24, ignore_eos=True)] * 3
    got, tables = drive(bounded, ps, sps)
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in got)
    assert any((t < 0).any() for t in tables)  # residency really was bounded: some pages were off-device
    rep = bounded.kvflash_report()
    assert rep["score_decisions"] > 0 and rep["pages_out"] > 0 and rep["pages_in"] > 0
    assert rep["scoring"] == "keys" and res.counters["score_decisions"] == rep["score_decisions"]
    for o in got:
        st = o.stats
        assert st["kvflash"] and st["kv_logical_pages"] == -(-(len(o.prompt_token_ids) + 23) // 8)
        assert 0 < st["kv_resident_pages"] <= res.pool_pages and st["kv_wait_s"] >= 0
    steps = list(bounded.kvflash_steps)
    assert steps and all(0 <= s["occupancy"] <= 1 for s in steps)
    assert max(s["resident_pages"] for s in steps) == res.pool_pages  # the pool was used to the full
    assert_reclaimed(bounded)


@SHARED
def test_a_raising_scorer_falls_back_to_lru_and_is_counted(bounded):
    res = configure(bounded, scoring="keys", rescore_every=1)

    def broken(q, m):
        raise RuntimeError("scorer fault")

    res.scorer = broken
    got, _ = drive(bounded, prompts(100, 100, 100, seed=2), [SamplingParams(max_tokens=16, ignore_eos=True)] * 3)
    assert all(len(o.token_ids) == 16 for o in got)
    rep = bounded.kvflash_report()
    assert rep["score_fallbacks"] > 0 and rep["score_decisions"] == 0 and rep["lru_decisions"] > 0
    assert sum(o.stats["kv_score_fallbacks"] for o in got) == rep["score_fallbacks"]
    assert_reclaimed(bounded)


@SHARED
def test_a_failed_host_copy_fails_only_the_requests_it_touched(bounded, unbounded):
    configure(bounded, scoring="lru")
    kvf = bounded.kvf
    real = kvf.page_out
    hits = []

    def flaky(state, dkv, transfers):
        if transfers and not hits:
            hits.append({t.sid for t in transfers})
            raise OSError("host copy failed")
        return real(state, dkv, transfers)

    kvf.page_out = flaky
    try:
        ps = prompts(100, 100, 100, seed=3)
        got, _ = drive(bounded, ps, [SamplingParams(max_tokens=16, ignore_eos=True)] * 3)
    finally:
        del kvf.page_out
    assert hits, "the workload never paged out"
    failed = [o for o in got if o.finish_reason == "error"]
    assert {o.request_id for o in failed} == hits[0]
    assert all("KVFlash" in o.stats["error"] for o in failed)
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in got if o not in failed)
    assert bounded.counters["kvflash_transfer_failures"] == 1
    assert_reclaimed(bounded)
    # the engine keeps serving
    again, _ = drive(bounded, ps[:1], [SamplingParams(max_tokens=4, ignore_eos=True)])
    assert again[0].finish_reason == "length"
    assert again[0].token_ids == unbounded.generate(ps[:1], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    assert_reclaimed(bounded)


def test_a_pool_full_of_pinned_pages_defers_steps_and_loses_nothing():
    # 3 pages: one 16-token prefill chunk (2-3 pages) pins most of the pool, so a second prefill row must wait
    eng = Engine(target(), None, dataclasses.replace(BASE, prefill_batch=2, kvflash=24, kvflash_scoring="lru"))
    got, _ = drive(eng, prompts(40, 40, 20, seed=4), [SamplingParams(max_tokens=6, ignore_eos=True)] * 3)
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in got)
    rep = eng.kvflash_report()
    assert rep["deferred_steps"] > 0 and sum(o.stats["kv_deferred_steps"] for o in got) == rep["deferred_steps"]
    assert_reclaimed(eng)
    with pytest.raises(ValueError, match="cannot hold one step's writes"):
        Engine(target(), None, dataclasses.replace(BASE, kvflash=16))


@pytest.fixture(scope="module")
def ddtree():
    """One DDTree engine with a bounded pool, built for drafter scoring (its rounds also return the drafter's anchor
    queries), that both DDTree tests reconfigure. DDTree rounds without the queries over a bounded pool run in
    test_bench_concurrency.py's kvflash cases."""
    from test_spec_step import setup

    from dflash_jax.engine.spec_steps import SpecConfig

    t, dcfg, dparams = setup("qwen36_tiny_a")
    opts = dataclasses.replace(BASE, spec=SpecConfig(budget=6), cohort_yield_min=0.0, kvflash=POOL,
                               kvflash_scoring="drafter")
    eng = Engine(t, None, opts, drafter=(dcfg, dparams))
    assert eng.kvf.has_draft  # drafter context pages move with the target's
    assert eng.kvf.draft_summary_layers == dcfg.full_layers == (1,)
    return eng


@SHARED
def test_speculative_rounds_with_bounded_residency_equal_ar_greedy(ddtree, unbounded):
    configure(ddtree, scoring="lru", exact_steps=True)
    ps = prompts(100, 100, 60, seed=5)
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (8, 8, 16)]
    with checked_round_trips(ddtree) as checked:
        got, tables = drive(ddtree, ps, sps)
    assert [o.token_ids for o in got] == [o.token_ids for o in unbounded.generate(ps, sps)]
    assert all(o.stats["spec_mode"] == "ddtree" and o.stats["draft_steps"] >= 1 for o in got)
    assert all((t >= 1).all() for t in tables)
    rep = ddtree.kvflash_report()
    assert rep["pages_in"] > 0 and rep["pages_out"] > 0 and len(checked) == rep["pages_in"]
    assert_reclaimed(ddtree)


def page_bytes_moved(eng: Engine) -> float:
    """Bytes per page moved, from the telemetry (page-ins and page-outs together)."""
    rep = eng.kvflash_report()
    assert rep["pages_in"] > 0 and rep["pages_out"] > 0
    return (rep["bytes_in"] + rep["bytes_out"]) / (rep["pages_in"] + rep["pages_out"])


def quantized_workload():
    return prompts(100, 100, 60, seed=7), [SamplingParams(max_tokens=m, ignore_eos=True) for m in (8, 8, 24)]


@pytest.fixture(scope="module")
def bf16_bytes_per_page():
    eng = Engine(target(), None, dataclasses.replace(BASE, kv_dtype="bf16", kvflash=POOL, kvflash_scoring="lru",
                                                     kvflash_exact_steps=True))
    got, _ = drive(eng, *quantized_workload())
    assert all(o.finish_reason == "length" for o in got)
    return page_bytes_moved(eng)


@QUANT
@pytest.mark.parametrize("kv_dtype,scoring", [("fp8", "lru"), ("int8", "keys")])
def test_quantized_pages_page_bit_exactly_at_about_half_the_bf16_bytes(kv_dtype, scoring, bf16_bytes_per_page):
    opts = dataclasses.replace(BASE, kv_dtype=kv_dtype)
    eng = Engine(target(), None, dataclasses.replace(opts, kvflash=POOL, kvflash_scoring=scoring,
                                                     kvflash_exact_steps=True))
    ps, sps = quantized_workload()
    with checked_round_trips(eng) as checked:  # both leaves of every page come back bit for bit
        got, tables = drive(eng, ps, sps)
    assert len(checked) == eng.kvflash_report()["pages_in"] > 0
    # same greedy tokens as the same quantized engine with every page resident
    assert [o.token_ids for o in got] == [o.token_ids for o in Engine(target(), None, opts).generate(ps, sps)]
    assert all((t >= 1).all() for t in tables)
    rep = eng.kvflash_report()
    assert rep["bytes_in"] == rep["pages_in"] * rep["page_bytes"] and rep["table_refreshes"] > 0
    if scoring == "keys":
        assert rep["score_decisions"] > 0 and rep["summary_failures"] == 0
    # a page moves its fp8 / int8 values and f32 scales: (D + 4) / 2D of a bf16 page's bytes (D = 32 here)
    d = target().config.head_dim
    ratio = page_bytes_moved(eng) / bf16_bytes_per_page
    assert ratio == pytest.approx((d + 4) / (2 * d)) and ratio < 0.6
    assert eng._kv_bytes_per_token(eng.kv_dtype) * BASE.page_size == rep["page_bytes"]
    assert_reclaimed(eng)


@SHARED
def test_drafter_scoring_under_pressure_ranks_by_the_drafters_queries(ddtree):
    """DDTree rounds hand each row's drafter anchor queries to the residency, which ranks pages by them against
    their mean drafter context keys: exact token counts, rankings scored (not only LRU), pages moved both ways,
    every page-in bit-exact; without a drafter the option is refused."""
    eng = ddtree
    eng.kvf.warmup(eng.state, eng.dkv)  # compiles the drafter's summaries only: target keys are not scored here
    assert {src for src, _ in eng.kvf._sum} == {"draft"}
    res = configure(eng, scoring="drafter", rescore_every=2)
    sps = [SamplingParams(max_tokens=24, ignore_eos=True)] * 3
    with checked_round_trips(eng) as checked:
        got, tables = drive(eng, prompts(100, 100, 100, seed=8), sps)
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in got)
    assert all(o.stats["spec_mode"] == "ddtree" and o.stats["draft_steps"] >= 1 for o in got)
    assert any((t < 0).any() for t in tables)  # residency really was bounded
    rep = eng.kvflash_report()
    assert rep["scoring"] == "drafter" and rep["score_decisions"] > 0 and res.counters["score_decisions"] > 0
    assert rep["pages_in"] > 0 and rep["pages_out"] > 0 and len(checked) == rep["pages_in"]
    assert rep["summary_failures"] == 0 and rep["score_fallbacks"] == 0  # query and summaries have one shape
    # rankings before a sequence's first round have no query: LRU, counted
    assert rep["unscored_fallbacks"] > 0 and rep["lru_decisions"] >= rep["unscored_fallbacks"]
    assert sum(o.stats["kv_score_decisions"] for o in got) == rep["score_decisions"]
    assert sum(o.stats["kv_unscored_fallbacks"] for o in got) == rep["unscored_fallbacks"]
    assert_reclaimed(eng)
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(target(), None, dataclasses.replace(BASE, kvflash=POOL, kvflash_scoring="drafter"))


@SHARED
def test_bounds_scoring_ranks_by_the_targets_queries_and_runs_the_prompts_last_token_alone():
    """Bounds scoring: prefill / decode steps return the target's queries, pages are summarised by their key
    bounds and ranked by them (not only LRU), the prompt's last token is a prefill chunk of its own (its rescoring
    sees the prompt's end), exact token counts and accounting under pressure, every page-in bit-exact."""
    eng = Engine(target(), None, dataclasses.replace(BASE, kvflash=POOL, kvflash_scoring="bounds"))
    assert eng.query_tail > 0
    ps = prompts(100, 100, 100, seed=3)
    sps = [SamplingParams(max_tokens=16, ignore_eos=True)] * 3
    with checked_round_trips(eng) as checked:
        got, tables = drive(eng, ps, sps)
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in got)
    assert any((t < 0).any() for t in tables)  # residency really was bounded
    rep = eng.kvflash_report()
    assert rep["scoring"] == "bounds" and rep["score_decisions"] > 0 and rep["summary_failures"] == 0
    assert rep["pages_out"] > 0 and len(checked) == rep["pages_in"] > 0
    assert not eng.kvf._sum and eng.kvb is not None  # the bounds live on the device, not in host summaries
    assert rep["scoring_device_bytes"] == eng.kvb.nbytes > 0
    c = BASE.prefill_chunk
    assert all(o.stats["prefill_chunks"] == -(-(len(p) - 1) // c) + 1 for o, p in zip(got, ps))
    assert_reclaimed(eng)


@SHARED
@pytest.mark.parametrize("scoring", ["bounds", "shadow"])
def test_device_scoring_equals_the_host_reference_through_the_engine(scoring):
    """Every step's queries (copied to the host as they are pushed) kept in host windows, and every ranking's
    device scores checked against the host reference of those windows and the pages' table rows (``bound_scores``
    of the bounds; ``shadow_scores`` of the dequantized shadow keys, context pages included); no compiles after
    warm-up, and greedy tokens equal to a second run (nothing depends on when the host looks)."""
    from dflash_jax.engine.compile import CompileWatch
    from dflash_jax.kv.kvflash import bound_scores, shadow_scores

    eng = Engine(target(), None, dataclasses.replace(BASE, kvflash=POOL, kvflash_scoring=scoring))
    eng.warmup()
    kb, q_tail = eng.kvb, eng.query_tail
    assert kb.kind == scoring
    windows: dict[int, np.ndarray] = {}
    calls, contexts = [], []
    push, score = kb.push, kb.score

    def checked_push(query, slots, counts):
        q = np.asarray(query)
        for i, (s, c) in enumerate(zip(slots, counts)):
            if c:
                old = windows.get(s, np.zeros((0,) + q.shape[2:], np.float32))
                windows[s] = np.concatenate([old, q[i, q.shape[1] - c:]])[-q_tail:]
        return push(query, slots, counts)

    def checked_score(items):
        got = score(items)
        if scoring == "bounds":
            table = np.asarray(kb.table[0])
        else:  # in NumPy: the check itself must not compile anything
            data, scale = (np.asarray(t) for t in kb.table)
            nib = np.stack([data & 15, data >> 4], axis=-1).astype(np.int8)
            q = np.where(nib > 7, nib - 16, nib).reshape(data.shape[:-1] + (-1,)).astype(np.float32)
            table = (q.reshape(scale.shape + (-1,)) * scale.astype(np.float32)[..., None]).reshape(q.shape)
        for (slot, n, ids, ctx), sc in zip(items, got):
            assert n <= len(windows[slot])
            q = windows[slot][-n:]
            want = (bound_scores(q, table[ids]) if scoring == "bounds"
                    else shadow_scores(q, table[np.concatenate([ids, ctx])], len(ids)))
            np.testing.assert_allclose(sc, want, rtol=1e-4, atol=1e-4)
            contexts.append(len(ctx))
        calls.append(len(items))
        return got

    kb.push, kb.score = checked_push, checked_score
    ps = prompts(100, 60, 100, seed=5)
    sps = [SamplingParams(max_tokens=16, ignore_eos=True)] * 3
    with CompileWatch() as w:
        got, _ = drive(eng, ps, sps)
    assert w.count == 0
    assert calls and sum(calls) == eng.kvflash_report()["score_decisions"]
    assert max(contexts) > 0  # protected full pages were passed as context
    kb.push, kb.score = push, score
    again, _ = drive(eng, ps, sps)
    assert [o.token_ids for o in again] == [o.token_ids for o in got]
    assert_reclaimed(eng)


@SHARED
def test_optional_page_ins_per_step_are_capped(bounded):
    """``kvflash_max_page_in`` bounds the page-ins a step adds by rank (a step's own write pages are not limited);
    the requests still complete exactly."""
    assert Engine(target(), None, dataclasses.replace(BASE, kvflash=POOL, kvflash_max_page_in=3)).pages.opts \
        .max_page_in == 3
    res = configure(bounded, scoring="keys", max_page_in=1, rescore_every=1)
    bounded.kvflash_steps.clear()  # the shared engine's earlier tests' steps
    got, _ = drive(bounded, prompts(100, 100, 100, seed=7), [SamplingParams(max_tokens=16, ignore_eos=True)] * 3)
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in got)
    steps = list(bounded.kvflash_steps)
    assert max(s["pages_in"] for s in steps) == 1 and res.counters["optional_page_in"] > 0
    assert_reclaimed(bounded)


def test_a_prompts_last_token_never_takes_a_prefill_row_a_longer_chunk_needs():
    """Under shadow scoring every prompt ends with a one-token chunk. With one 2-row prefill bucket, A's last token
    (while B and C still have chunks to prefill) goes to a decode call instead of a prefill row, so the prefill calls
    are as many as with unbounded residency (a pool that holds everything), and the tokens are the same."""
    opts = dataclasses.replace(BASE, prefill_batch=2, batch_buckets=(3,))
    ps = prompts(20, 40, 40, seed=7)  # chunks of 16 unbounded: 16+4, 16+16+8; shadow: 16+3+1, 16+16+7+1
    sps = [SamplingParams(max_tokens=4, ignore_eos=True)] * 3
    runs = {}
    for name, kw in (("unbounded", {}), ("shadow", dict(kvflash=1024, kvflash_scoring="shadow"))):
        eng = Engine(target(), None, dataclasses.replace(opts, **kw))
        assert eng.prefill_buckets == (2,)
        ids = [eng.submit(p, s) for p, s in zip(ps, sps)]
        final = {}
        while eng.has_work():
            final.update({o.request_id: o for o in eng.step() if o.finish_reason is not None})
        runs[name] = (eng.counters["prefill_steps"], [final[i].token_ids for i in ids])
    assert runs["shadow"][0] == runs["unbounded"][0] == 5
    assert runs["shadow"][1] == runs["unbounded"][1]
