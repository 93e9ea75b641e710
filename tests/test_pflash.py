"""PFlash compression: chunk selection properties, options, score reductions, a needle, an end-to-end run."""

from __future__ import annotations

import collections
import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax.engine.compile import CompileWatch
from dflash_jax.models import dense, dense_scoring
from dflash_jax.prefill import pflash
from dflash_jax.prefill.pflash import PFlashError, PFlashOptions

SCFG = dense.DenseConfig(vocab_size=211, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, rope_theta=1e4)


@pytest.fixture(scope="module")
def scorer():
    return pflash.DenseScorer(dense.init_params(SCFG, jax.random.key(0), jnp.float32, norm_noise=0.1), SCFG,
                              prefill_chunk=256)


# ---- chunk selection properties ------------------------------------------------------------------------------------
@st.composite
def selections(draw):
    t = draw(st.integers(1, 700))
    chunk = draw(st.sampled_from([1, 3, 8, 32]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scores = rng.random(t) if draw(st.booleans()) else rng.integers(0, 3, t).astype(float)  # with ties
    density = draw(st.sampled_from([0.0, 0.002, 0.05]))
    must = rng.random(t) < density if draw(st.booleans()) else None
    n_chunks = -(-t // chunk)
    anchors = rng.permutation(n_chunks)[:draw(st.integers(0, min(n_chunks, 12)))] if draw(st.booleans()) else None
    return dict(scores=scores, chunk=chunk, keep_ratio=draw(st.floats(0.01, 1.0)),
                head_tokens=draw(st.integers(0, 100)), tail_tokens=draw(st.integers(0, 100)), must_keep=must,
                anchors=anchors)


@settings(max_examples=150, deadline=None)
@given(selections())
def test_select_chunks_properties(kw):
    s, c = kw["scores"], kw["chunk"]
    t = len(s)
    kept = pflash.select_chunks(**kw)
    assert kept.dtype.kind == "i" and np.all(np.diff(kept) > 0) and kept.min() >= 0 and kept.max() < t
    ks = set(kept.tolist())
    # whole chunks only
    chunks = set((kept // c).tolist())
    assert ks == {i for ch in chunks for i in range(ch * c, min(t, ch * c + c))}
    # head, tail, the best chunk (earliest on ties) and every must_keep token
    assert set(range(min(kw["head_tokens"], t))) <= ks
    assert set(range(max(0, t - kw["tail_tokens"]), t)) <= ks
    means = pflash.chunk_means(s, c)
    best = int(np.flatnonzero(means == means.max())[0])
    assert best in chunks
    if kw["must_keep"] is not None:
        assert set(np.flatnonzero(kw["must_keep"]).tolist()) <= ks
    # the first anchor and the chunk after it always; the others in their order, before any chunk chosen by score
    anc = [] if kw["anchors"] is None else kw["anchors"].tolist()
    assert not anc or {anc[0], min(anc[0] + 1, len(pflash.chunk_means(s, c)) - 1)} <= chunks
    # the keep ratio, within one chunk, whenever the forced chunks fit in it
    forced = pflash._forced_chunks(t, c, kw["head_tokens"], kw["tail_tokens"], kw["must_keep"])
    forced[best] = True
    if anc:
        forced[anc[0]:anc[0] + 2] = True
    missed = [a for a in anc if a not in chunks]
    if missed:
        later = anc[anc.index(missed[0]):]
        assert all(forced[a] for a in later if a in chunks)  # past a skipped anchor only forced chunks
        assert all(forced[ch] or ch in anc for ch in chunks)  # and nothing by score
    forced_tokens = int(pflash._chunk_sizes(t, c)[forced].sum())
    target = math.ceil(kw["keep_ratio"] * t)
    if forced_tokens <= target:
        assert target <= len(kept) < target + c
    else:
        assert len(kept) == forced_tokens
    # every kept chunk chosen by score scores at least as high as every dropped chunk
    extra = [ch for ch in chunks if not forced[ch] and ch not in anc]
    dropped = sorted(set(range(len(means))) - chunks)
    if extra and dropped:
        assert min(means[extra]) >= max(means[dropped])


def test_anchor_chunks_find_the_key_a_question_repeats():
    """A key planted once early and repeated in the last tokens anchors its chunk, then its neighbours out to the
    radius (the later side first); an n-gram seen more than max_hits times before, or only inside the window,
    anchors nothing; a key several question n-grams share outranks a single chance match, and a match later in the
    window outranks an earlier one."""
    rng = np.random.default_rng(3)
    ids = rng.integers(100, 4000, 1000).astype(np.int32)
    key = [7, 8, 9, 10]
    ids[330:334] = key                       # chunk 10 (320..351)
    for p in range(0, 640, 64):              # a frequent 4-gram: 10 earlier occurrences
        ids[p + 40:p + 44] = [1, 2, 3, 4]
    ids[-30:-26] = key                       # the question repeats the key
    ids[-20:-16] = [1, 2, 3, 4]
    got = pflash.anchor_chunks(ids, chunk=32, ngram=4, window=96, max_hits=8, radius=2)
    assert got.tolist() == [10, 11, 9, 12, 8]
    assert pflash.anchor_chunks(ids, chunk=32, radius=0).tolist() == [10]
    assert pflash.anchor_chunks(ids, chunk=32, max_hits=10, radius=0).tolist() == [10] + [
        (p + 40) // 32 for p in range(576, -1, -64)]  # allowed now: r/10 each, later chunks first
    ids3 = ids.copy()
    ids3[600:604] = [21, 22, 23, 24]           # chunk 18: one chance match ...
    ids3[-50:-46] = [21, 22, 23, 24]
    ids3[200:207] = [31, 32, 33, 34, 35, 36, 37]  # ... and a key the question repeats whole (four 4-grams): chunk 6
    ids3[-12:-5] = [31, 32, 33, 34, 35, 36, 37]
    # four n-grams at the window's end (r ~0.93 each), then one at r = 67/93, then one at r = 47/93: the later an
    # n-gram stands in the window, the more it counts
    assert pflash.anchor_chunks(ids3, chunk=32, radius=0).tolist()[:3] == [6, 10, 18]
    assert pflash.anchor_chunks(ids[:90], chunk=32).size == 0  # everything inside the window
    ids2 = ids.copy()
    ids2[330:334] = [11, 12, 13, 14]
    assert 10 not in pflash.anchor_chunks(ids2, chunk=32).tolist()


def _anchor_reference(ids, chunk, ngram, window, max_hits, radius):
    """anchor_chunks by its definition, with dicts."""
    t = len(ids)
    w0 = max(0, t - window)
    grams = [tuple(ids[i:i + ngram]) for i in range(t - ngram + 1)]
    early = grams[:max(0, w0 - ngram + 1)]
    hits = {g: early.count(g) for g in set(grams[w0:])}
    starts = grams[w0:]
    recency = {g: (max(i for i, x in enumerate(starts) if x == g) + 1) / len(starts) for g in hits}
    weight = collections.defaultdict(float)
    for p, g in enumerate(early):
        if 1 <= hits.get(g, 0) <= max_hits:
            w = recency[g] / hits[g]
            lo, hi = p // chunk, (p + ngram - 1) // chunk
            for c in range(lo, hi + 1):
                weight[c] += w
            for d in range(1, radius + 1):
                for c in (lo - d, hi + d):
                    if 0 <= c < -(-t // chunk):
                        weight[c] += w / (d + 1)
    return {c: round(w, 9) for c, w in weight.items()}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(2, 6), st.integers(1, 5), st.sampled_from([4, 8, 32]),
       st.integers(1, 4), st.integers(1, 120), st.integers(1, 9), st.integers(0, 2))
def test_anchor_chunks_match_their_definition(t, vocab, seed, chunk, ngram, window, max_hits, radius):
    ids = np.random.default_rng(seed).integers(0, vocab, t).astype(np.int32)  # small vocabularies: many repeats
    got = pflash.anchor_chunks(ids, chunk=chunk, ngram=ngram, window=window, max_hits=max_hits, radius=radius)
    weight = _anchor_reference(ids.tolist(), chunk, ngram, window, max_hits, radius)
    assert sorted(got.tolist()) == sorted(weight)
    keys = [(-weight[c], -c) for c in got.tolist()]  # heaviest first, the later chunk first on ties
    assert keys == sorted(keys)


def test_compress_keeps_the_anchored_needle_over_the_scores():
    """A needle the scores miss (a scorer that favours the start) survives through its anchor at a 5 % keep."""
    rng = np.random.default_rng(5)
    ids = rng.integers(100, 4000, 4096).astype(np.int32)
    ids[2500:2504] = [7, 8, 9, 10]
    ids[-40:-36] = [7, 8, 9, 10]
    early = lambda x, _o: np.linspace(1.0, 0.0, len(x))  # noqa: E731
    o = PFlashOptions(mode="always", min_tokens=1, keep_ratio=0.05, head_tokens=32, tail_tokens=64)
    assert set(range(2500, 2504)) <= set(pflash.compress(ids, early, o).kept_indices.tolist())
    off = dataclasses.replace(o, anchor_ngram=0)
    assert not set(range(2500, 2504)) & set(pflash.compress(ids, early, off).kept_indices.tolist())


def test_what_follows_the_key_is_kept_when_the_budget_holds_one_anchor_chunk():
    """At 1K tokens a 5 % keep is under the forced head and tail, so only forced chunks are kept: the key ends its
    chunk and the value the question asks for lies in the next one, which is kept with it."""
    rng = np.random.default_rng(8)
    ids = rng.integers(100, 4000, 1024).astype(np.int32)
    ids[412:416] = [7, 8, 9, 10]              # the key ends chunk 12 (384..415); its value is 416..423, in chunk 13
    ids[-40:-36] = [7, 8, 9, 10]
    early = lambda x, _o: np.linspace(1.0, 0.0, len(x))  # noqa: E731
    o = PFlashOptions(mode="always", min_tokens=1, keep_ratio=0.05, head_tokens=32, tail_tokens=64)
    kept = pflash.compress(ids, early, o).kept_indices
    assert set(range(412, 424)) <= set(kept.tolist())
    assert len(kept) == 32 + 64 + 2 * 32  # head, tail, the anchor chunk and its successor: nothing by score


def test_select_chunks_errors():
    with pytest.raises(PFlashError, match="keep_ratio"):
        pflash.select_chunks(np.ones(10), keep_ratio=0.0)
    with pytest.raises(PFlashError, match="must_keep"):
        pflash.select_chunks(np.ones(10), keep_ratio=0.5, must_keep=np.ones(9, bool))
    with pytest.raises(PFlashError, match="finite"):
        pflash.select_chunks(np.array([1.0, np.nan]), keep_ratio=0.5)


# ---- options and modes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, name", [
    ({"mode": "sometimes"}, "mode"), ({"keep_ratio": 0.0}, "keep_ratio"), ({"keep_ratio": 1.5}, "keep_ratio"),
    ({"min_tokens": -1}, "min_tokens"), ({"chunk": 0}, "chunk"), ({"head_tokens": -1}, "head_tokens"),
    ({"tail_tokens": 1.5}, "tail_tokens"), ({"n_query": 0}, "n_query"), ({"pool_kernel": 4}, "pool_kernel"),
    ({"n_layers": 0}, "n_layers"), ({"nope": 1}, "nope"), ({"auto_max_ratio": 2}, "auto_max_ratio"),
    ({"anchor_ngram": -1}, "anchor_ngram"), ({"anchor_window": 0}, "anchor_window"),
    ({"anchor_max_hits": 0}, "anchor_max_hits"), ({"anchor_radius": 1.0}, "anchor_radius"),
])
def test_options_validation_names_the_option(kw, name):
    with pytest.raises(PFlashError, match=f"'{name}'"):
        PFlashOptions(**kw)


def _never(ids, options):
    raise AssertionError("the scorer must not run")


def _ramp(ids, options):
    return np.arange(len(ids), dtype=np.float64)[::-1].copy()  # earlier tokens score higher


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3000), st.sampled_from(["off", "auto", "always"]), st.integers(0, 4000))
def test_off_and_short_prompts_untouched(t, mode, min_tokens):
    ids = np.arange(t) % 50
    o = PFlashOptions(mode=mode, min_tokens=min_tokens, keep_ratio=0.1, head_tokens=0, tail_tokens=0)
    if mode == "off" or t < min_tokens:
        r = pflash.compress(ids, _never, o)
        assert not r.compressed and r.reason == ("off" if mode == "off" else "short") == pflash.skip_reason(t, o)
        assert r.effective_tokens == r.raw_tokens == t and r.ratio == 1.0 and r.scoring_s == 0.0
        np.testing.assert_array_equal(r.effective_ids, ids)
        np.testing.assert_array_equal(r.kept_indices, np.arange(t))
    else:
        r = pflash.compress(ids, _ramp, o)
        assert pflash.skip_reason(t, o) is None
        # at least the best chunk, the best anchor chunk and its successor (this periodic prompt repeats every 4-gram)
        assert r.compressed and r.effective_tokens <= max(math.ceil(0.1 * t) + 31, 96)
        np.testing.assert_array_equal(r.effective_ids, ids[r.kept_indices])  # order preserved
        assert np.all(np.diff(r.kept_indices) > 0)


def test_tool_requests_are_never_compressed_and_auto_skips_no_gain_prompts():
    ids = np.arange(4096) % 100
    auto = PFlashOptions(mode="auto", min_tokens=1024, keep_ratio=0.05)
    always = PFlashOptions(mode="always", min_tokens=1024, keep_ratio=0.05)
    for o in (auto, always):  # the scorer is not even run
        r = pflash.compress(ids, _never, o, tool_request=True)
        assert r.reason == "tools" and not r.compressed and r.effective_tokens == 4096
        np.testing.assert_array_equal(r.effective_ids, ids)
    mk = np.zeros(4096, bool)
    mk[::20] = True  # protected tokens everywhere: nothing to gain
    assert pflash.compress(ids, _never, auto, must_keep=mk).reason == "no_gain"
    assert pflash.skip_reason(4096, auto, must_keep=mk) == "no_gain" and pflash.skip_reason(4096, auto) is None
    assert pflash.skip_reason(4096, always, tool_request=True) == "tools"
    r = pflash.compress(ids, _ramp, always, must_keep=mk)
    assert r.compressed and r.effective_tokens == 4096  # every chunk holds a protected token
    r = pflash.compress(ids, _ramp, auto)
    assert r.compressed and r.reason == "compressed" and r.ratio < 0.3


def test_must_keep_tokens_survive_compression():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 100, 5000)
    mk = np.zeros(5000, bool)
    mk[[7, 1234, 2500, 2501, 4001]] = True
    o = PFlashOptions(mode="always", min_tokens=0, keep_ratio=0.02, head_tokens=32, tail_tokens=32)
    r = pflash.compress(ids, lambda i, _: rng.random(len(i)), o, must_keep=mk)
    assert set(np.flatnonzero(mk)) <= set(r.kept_indices.tolist())
    with pytest.raises(PFlashError, match="must_keep"):
        pflash.compress(ids, _ramp, o, must_keep=mk[:10])
    with pytest.raises(PFlashError, match="scorer returned"):
        pflash.compress(ids, lambda i, _: np.ones(3), o)


# ---- scoring reductions --------------------------------------------------------------------------------------------
def test_smooth_and_score_tokens():
    x = np.random.default_rng(2).random(50)
    np.testing.assert_allclose(pflash.smooth(x, 1), x, rtol=1e-6)
    np.testing.assert_allclose(pflash.smooth(np.full(20, 3.0), 13), 3.0, rtol=1e-6)  # no padding damping at edges
    np.testing.assert_allclose(pflash.smooth(x, 5)[10], x[8:13].mean(), rtol=1e-6)
    # the padded form used on device: entries past the valid length never enter the averages
    pad = np.concatenate([x, np.full(7, 1e6, np.float32)])
    for k in (1, 5, 13):
        ref = [x[max(0, i - k // 2):i + k // 2 + 1].mean() for i in range(len(x))]
        np.testing.assert_allclose(pflash.smooth(x, k), ref, rtol=1e-5)
        np.testing.assert_allclose(pflash._smooth_valid(jnp.asarray(pad), jnp.int32(len(x)), k)[:len(x)], ref,
                                   rtol=1e-5)
    att = np.random.default_rng(3).random((3, 4, 8, 50))
    np.testing.assert_allclose(pflash.score_tokens(att, 5), pflash.smooth(att.max(axis=(0, 1)).mean(0), 5),
                               rtol=1e-6)
    with pytest.raises(PFlashError, match="pool_kernel"):
        pflash.smooth(x, 4)


def test_needle_chunk_is_kept():
    """Attention where one head of one layer spikes on a needle that straddles two chunks, deep in a 32K prompt:
    with the default options (5% keep, 256 head / 768 tail tokens) both of its chunks survive."""
    rng = np.random.default_rng(4)
    t = 32768
    att = rng.random((2, 4, 8, t)).astype(np.float32) * 1e-4
    att[1, 2, :, 9000:9010] = 0.05  # chunks 281 and 282
    o = PFlashOptions(mode="auto")
    scores = pflash.score_tokens(att, o.pool_kernel)
    kept = pflash.select_chunks(scores, chunk=o.chunk, keep_ratio=o.keep_ratio, head_tokens=o.head_tokens,
                                tail_tokens=o.tail_tokens)
    assert set(range(9000, 9010)) <= set(kept.tolist())
    assert len(kept) < 0.05 * t + 32


@pytest.mark.parametrize("t,n_layers", [(300, 2), (300, 1), (256, None), (5, 1)])
def test_dense_scorer_matches_score_tokens_of_tail_attention(scorer, t, n_layers):
    """The layer-major scoring pass equals the reference (chunked prefill into a cache, then the tail attention of
    the last layers, reduced by score_tokens): prompts shorter than, equal to and not a multiple of the bucket,
    and shorter than n_query."""
    ids = np.random.default_rng(5).integers(0, SCFG.vocab_size, t)
    for nope in (False, True):
        o = PFlashOptions(n_query=8, pool_kernel=13, nope=nope, n_layers=n_layers)
        att = dense.tail_attention(scorer.params, SCFG, ids, n_query=8, n_layers=n_layers, chunk=64, nope=nope)
        got = scorer(ids, o)
        assert got.shape == (t,)
        np.testing.assert_allclose(got, pflash.score_tokens(att, 13), rtol=1e-5, atol=1e-8)


def test_dense_scorer_long_prompt_compiles_few_executables():
    """Scoring a long prompt is a handful of executables (embedding, scored middle layer, scored last layer,
    final reduction), not one per chunk or per prompt length: another length in the same bucket compiles nothing.
    One dispatch per layer plus the embedding."""
    cfg = dense.DenseConfig(vocab_size=101, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2,
                            num_kv_heads=1, head_dim=8, rope_theta=1e4)  # shapes of this test only: a cold cache
    sc = pflash.DenseScorer(dense.init_params(cfg, jax.random.key(3), jnp.float32), cfg, prefill_chunk=128)
    rng = np.random.default_rng(7)
    o = PFlashOptions()
    with CompileWatch() as first:
        a = sc(rng.integers(0, cfg.vocab_size, 4000), o)
    assert 1 <= first.count <= 4 and a.shape == (4000,) and np.isfinite(a).all()
    steps: list[float] = []
    with CompileWatch() as second:
        b = sc(rng.integers(0, cfg.vocab_size, 3900), o, step_times=steps)  # same 4096-row bucket
    assert second.count == 0 and b.shape == (3900,)
    assert len(steps) == cfg.num_layers + 1 and min(steps) > 0
    assert sc.attention_impl == "xla"


def test_dense_scorer_attention_option():
    with pytest.raises(PFlashError, match="attention"):
        pflash.DenseScorer({}, SCFG, attention="flash")
    sc = pflash.DenseScorer({"embed": jnp.zeros((SCFG.vocab_size, 32), jnp.bfloat16)}, SCFG, attention="auto")
    assert sc.resolve() == "xla" and "cpu" in sc.attention_why  # no cuDNN off GPU
    with pytest.raises(ValueError, match="cudnn"):
        dense_scoring.resolve_attention("cudnn", SCFG, jnp.bfloat16)
    for bad in (0, -1.0, "1e12", True):
        with pytest.raises(PFlashError, match="max_dispatch_flops"):
            pflash.DenseScorer({}, SCFG, max_dispatch_flops=bad)
    assert pflash.DenseScorer({}, SCFG, max_dispatch_flops=None, pace=False).pace is False


def test_compress_end_to_end_2k(scorer):
    rng = np.random.default_rng(6)
    ids = rng.integers(0, SCFG.vocab_size, 2048).astype(np.int32)
    mk = np.zeros(2048, bool)
    mk[[100, 1500]] = True
    o = PFlashOptions(mode="always", min_tokens=1024, keep_ratio=0.1, head_tokens=32, tail_tokens=64)
    r = pflash.compress(ids, scorer, o, must_keep=mk)
    assert r.compressed and r.raw_tokens == 2048
    assert r.effective_ids.shape == r.kept_indices.shape == (r.effective_tokens,)
    assert r.effective_ids.dtype == np.int32
    assert 205 <= r.effective_tokens < 205 + 32 and r.ratio == pytest.approx(r.effective_tokens / 2048)
    np.testing.assert_array_equal(r.effective_ids, ids[r.kept_indices])
    assert {100, 1500} | set(range(32)) | set(range(1984, 2048)) <= set(r.kept_indices.tolist())
    assert r.scoring_s > 0.0
    tel = r.telemetry()
    assert tel["raw_prompt_tokens"] == 2048 and tel["effective_prompt_tokens"] == r.effective_tokens


# ---- protected spans -----------------------------------------------------------------------------------------------
def test_span_and_protected_masks():
    ids = np.array([1, 50, 5, 6, 51, 7, 50, 8])
    np.testing.assert_array_equal(pflash.span_mask(ids, 50, 51), [0, 1, 1, 1, 1, 0, 1, 1])
    assert not pflash.span_mask(ids, None, 51).any()
    # <|im_start|>=90 system=91 \n=92 ... <|im_end|>=93; <tool_call>=60 </tool_call>=61; user=94
    tok = types.SimpleNamespace(
        im_start_id=90, im_end_id=93, tool_call_id=60, tool_call_end_id=61, tool_response_id=None,
        tool_response_end_id=None, structural_mask=lambda a: np.isin(a, [90, 93]),
        decode=lambda xs, skip_special_tokens=False: "".join({91: "system", 92: "\n", 94: "user"}.get(x, "x")
                                                             for x in xs))
    ids = np.array([90, 91, 92, 5, 5, 93, 90, 94, 92, 5, 60, 5, 61, 5, 93])
    m = pflash.protected_mask(ids, tok)
    np.testing.assert_array_equal(m, [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 1])
    m = pflash.protected_mask(ids, tok, system=False, tools=False)
    np.testing.assert_array_equal(m, np.isin(ids, [90, 93]))
