"""The continuously batched AR engine: greedy parity, batch independence while requests join and leave,
no recompiles, page/slot accounting, admission under pressure, the decode contract, sampling, streaming.

Engines are built (and their buckets compiled) once per module and reused: requests come and go.
"""

import collections
import dataclasses
import functools
import math
import os

import jax
import numpy as np
import pytest

import dflash_jax as dj
from conftest import FIXTURES, TINY
from dflash_jax.engine.compile import CompileWatch
from dflash_jax.engine.loop import Engine, EngineOptions, RequestError, SamplingParams
from dflash_jax.engine.sampling import MAX_BANNED
from dflash_jax.kv.pages import RequestTooLarge

pytestmark = pytest.mark.xdist_group("engine")  # share the compiled engines on one worker

A, B = TINY
OPTS = EngineOptions(max_batch=4, prefill_batch=2, prefill_chunk=32, max_model_len=256, page_size=8)
# fewer buckets (tiny_b compiles slowly): one prefill row; decode alone (1) and the three prompts together (4)
OPTS_B = dataclasses.replace(OPTS, prefill_batch=1, batch_buckets=(1, 4))
# A pool of 28 pages (224 tokens) holds about two of the pressure test's requests at once.
OPTS_SMALL = dataclasses.replace(OPTS, n_pages=1 + 28)
GREEDY = SamplingParams(max_tokens=16)

WARMUP_COMPILES: dict[str, int] = {}


@functools.lru_cache(maxsize=None)
def target(name):
    return dj.load_target(os.path.join(FIXTURES, name))


@functools.lru_cache(maxsize=None)
def golden(name):
    return dict(np.load(os.path.join(FIXTURES, f"{name}_golden.npz")))


def prompts(name) -> list[list[int]]:
    g = golden(name)
    return [g[f"p{j}.ids"].tolist() for j in range(3)]


def greedy_golden(name, j) -> list[int]:
    return golden(name)[f"p{j}.greedy"].tolist()


@functools.lru_cache(maxsize=None)
def _reference(name, prompt: tuple, n: int) -> tuple:
    return tuple(target(name).greedy(prompt, n))


def reference(name, prompt, n) -> list[int]:
    """The cache-free greedy reference (re-runs the full pass per token)."""
    return list(_reference(name, tuple(prompt), n))


def build(name, options, fixture) -> Engine:
    eng = Engine(target(name), None, options)
    with CompileWatch() as w:
        eng.warmup()
    WARMUP_COMPILES[fixture] = w.count
    return eng


@pytest.fixture(scope="module")
def eng():
    return build(A, OPTS, "eng")


@pytest.fixture(scope="module")
def eng_b():
    return build(B, OPTS_B, "eng_b")


@pytest.fixture(scope="module")
def small(eng):
    """An engine whose page pool is ``OPTS_SMALL.n_pages``: admission, rejection and page accounting read only the
    pool (``Engine.pages``), so ``eng``'s compiled buckets (a larger KV array; pages past the pool stay unused) run
    it instead of compiling an engine of its own."""
    built = Engine(target(A), None, OPTS_SMALL)  # not warmed up: the pool that n_pages gives
    assert built.pages.n_pages == OPTS_SMALL.n_pages
    other = sibling(eng)
    other.pages = built.pages
    return other


def sibling(eng: Engine, **kwargs) -> Engine:
    """An engine like ``eng`` (same target and options, so the same bucket shapes) but built with other
    constructor arguments. It reuses ``eng``'s compiled buckets instead of compiling them again."""
    other = Engine(eng.target, eng.tokenizer, eng.options, **kwargs)
    other._exec.update(eng._exec)
    with CompileWatch() as w:
        other.warmup()
    assert w.count == 0
    return other


def assert_idle(eng: Engine) -> None:
    """Nothing queued or running, every slot free, every page back in the pool."""
    assert not eng.has_work() and not eng.waiting and not eng.running
    assert eng.free_slots == list(range(1, eng.options.max_batch + 1))
    assert eng.pages.num_free == eng.pages.n_pages - 1
    assert eng.pages.num_reserved == 0 and eng.pages.num_used == 0
    eng.pages.check_invariants()


@pytest.fixture(autouse=True)
def _engines_end_idle(request):
    """Every test leaves the shared engines it used idle, so the next test starts clean."""
    yield
    for name in ("eng", "eng_b", "small"):
        if name in request.fixturenames:
            assert_idle(request.getfixturevalue(name))


def alone(eng: Engine, prompt, sp: SamplingParams = GREEDY):
    assert not eng.has_work()
    [out] = eng.generate([prompt], sp)
    return out


class Driver:
    """Drives ``submit``/``step`` by hand and records what came out, per request label."""

    def __init__(self, eng: Engine) -> None:
        self.eng = eng
        self.rid: dict[str, int] = {}
        self.label: dict[int, str] = {}
        self.snaps: dict[str, list] = {}
        self.final: dict[str, object] = {}
        self.order: list[str] = []  # labels in the order they finished
        self.max_running = 0

    def submit(self, label, prompt, sp) -> None:
        rid = self.eng.submit(prompt, sp)
        self.rid[label], self.label[rid] = rid, label

    def step(self) -> None:
        for o in self.eng.step():
            lab = self.label[o.request_id]
            assert lab not in self.final, f"{lab} changed after it finished"
            self.snaps.setdefault(lab, []).append(o)
            if o.finish_reason is not None:
                self.final[lab] = o
                self.order.append(lab)
        self.max_running = max(self.max_running, len(self.eng.running))

    def tokens(self, label) -> list[int]:
        snaps = self.snaps.get(label, [])
        return snaps[-1].token_ids if snaps else []

    def run(self, until=lambda: False, max_steps=200) -> None:
        for _ in range(max_steps):
            if until() or not self.eng.has_work():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")


# ---- 1. greedy parity with transformers ---------------------------------------------------------
@pytest.mark.parametrize("name, fixture", [(A, "eng"), (B, "eng_b")])
def test_greedy_equals_transformers_alone_and_together(name, fixture, request):
    e = request.getfixturevalue(fixture)
    ps = prompts(name)
    steps_alone = e.counters["decode_steps"]
    for j, p in enumerate(ps):
        out = alone(e, p)
        assert out.token_ids == greedy_golden(name, j), f"prompt {j} run alone"
        assert out.finish_reason == "length" and out.prompt_token_ids == p and out.text is None
    steps_alone = e.counters["decode_steps"] - steps_alone

    steps_together = e.counters["decode_steps"]
    outs = e.generate(ps, GREEDY)
    steps_together = e.counters["decode_steps"] - steps_together
    assert [o.token_ids for o in outs] == [greedy_golden(name, j) for j in range(3)]
    assert [o.prompt_token_ids for o in outs] == ps  # outputs in input order
    assert steps_together < steps_alone  # the decodes really were batched



def test_a_one_token_last_chunk_runs_on_the_decode_executable(eng):
    """A prompt one token longer than a prefill chunk: its second chunk is that token alone, run on the T=1 decode
    executable (no prefill-width step for one token), and the output is the reference's; no compile."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 200, OPTS.prefill_chunk + 1)]
    c0 = collections.Counter(eng.counters)
    with CompileWatch() as w:
        out = alone(eng, prompt, SamplingParams(max_tokens=6))
    assert out.token_ids == reference(A, prompt, 6)
    d = collections.Counter(eng.counters)
    d.subtract(c0)
    assert d["prefill_steps"] == 1 and d["decode_steps"] == 6  # the last prompt token + 5 generated tokens
    assert out.stats["prefill_chunks"] == 2 and w.count == 0


def test_a_prompts_last_token_joins_the_running_decode_step(eng):
    """While A decodes, B's one-token last chunk rides in A's decode call (no prefill call of its own); both
    outputs are the reference's; no compile."""
    rng = np.random.default_rng(6)
    pa = [int(t) for t in rng.integers(1, 200, 10)]
    pb = [int(t) for t in rng.integers(1, 200, OPTS.prefill_chunk + 1)]
    d = Driver(eng)
    d.submit("A", pa, SamplingParams(max_tokens=8))
    d.step()
    assert len(d.tokens("A")) == 1  # A decodes from the next step
    c0 = collections.Counter(eng.counters)
    with CompileWatch() as w:
        d.submit("B", pb, SamplingParams(max_tokens=4))
        d.step()  # B's first chunk (prefill call) + A's decode
        d.step()  # B's last token and A's next token in one decode call
        c = collections.Counter(eng.counters)
        c.subtract(c0)
        assert c["prefill_steps"] == 1 and c["decode_steps"] == 2 and len(d.tokens("B")) == 1
        d.run()
    assert w.count == 0
    assert d.final["A"].token_ids == reference(A, pa, 8) and d.final["B"].token_ids == reference(A, pb, 4)
    assert d.final["B"].stats["prefill_chunks"] == 2 and d.final["B"].stats["decode_steps"] == 3

# ---- 2. batch independence while requests join and leave ----------------------------------------
def test_requests_joining_and_leaving_do_not_affect_each_other(eng):
    ps = prompts(A)
    reqs = {  # label: (prompt, max_tokens)
        "A": (ps[1], 3),  # 64 tokens = two prefill chunks; leaves early
        "B": (ps[2][:50], 12),  # joins while A decodes, two chunks
        "C": (ps[0], 10),  # joins with B; prefilled in the same chunk batch
        "D": (ps[2][-41:], 6),  # joins after A has left, leaves before B and C
    }
    sp = {k: SamplingParams(max_tokens=n) for k, (_, n) in reqs.items()}
    d = Driver(eng)
    d.submit("A", reqs["A"][0], sp["A"])
    d.step()
    d.step()
    assert len(d.tokens("A")) == 1  # prefill done, A is decoding
    d.submit("B", reqs["B"][0], sp["B"])
    d.submit("C", reqs["C"][0], sp["C"])
    d.run(until=lambda: "A" in d.final)
    assert "B" not in d.final and "C" not in d.final  # A left early; the others go on
    assert len(d.tokens("C")) >= 1
    d.submit("D", reqs["D"][0], sp["D"])
    d.run()
    assert d.order[0] == "A" and d.order.index("D") < d.order.index("B")
    assert d.max_running == 3

    for k, (p, n) in reqs.items():
        out = d.final[k]
        assert out.finish_reason == "length" and len(out.token_ids) == n, k
        for s in d.snaps[k]:  # every snapshot a prefix of the final output
            assert out.token_ids[:len(s.token_ids)] == s.token_ids
        assert out.token_ids == alone(eng, p, sp[k]).token_ids, f"{k}: batched != alone"
        assert out.token_ids == reference(A, p, n), f"{k}: != cache-free Target.greedy"


# ---- 3. no recompiles after warm-up -------------------------------------------------------------
def test_no_recompiles_after_warmup(eng):
    assert WARMUP_COMPILES["eng"] >= len(eng.prefill_buckets) + len(eng.decode_buckets)  # the watch sees compiles
    ps = prompts(A)
    mixed = [
        (ps[2], SamplingParams(max_tokens=5)),
        (ps[1], SamplingParams(max_tokens=7, temperature=0.8, top_k=20, seed=1)),
        (ps[0], SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9)),
        (ps[0][:3], SamplingParams(max_tokens=9, min_tokens=4, stop_token_ids=(5, 6))),
        (ps[2][:33], SamplingParams(max_tokens=2, ignore_eos=True)),  # 5 > max_batch: one waits
        (ps[1][:20], SamplingParams(max_tokens=4, frequency_penalty=1.0, logit_bias=((3, 2.0),))),
    ]
    with CompileWatch() as w:
        eng.generate([p for p, _ in mixed], [s for _, s in mixed])
        rid = eng.submit(ps[2], SamplingParams(max_tokens=20))
        eng.step()
        eng.abort(rid)
        snaps = list(eng.stream(ps[1][:10], SamplingParams(max_tokens=4)))
        eng.generate([ps[0]], SamplingParams(max_tokens=1))
    assert snaps[-1].finish_reason == "length"
    assert w.count == 0, f"{w.count} XLA compilation(s) after warm-up"
    assert eng.counters["lazy_compiles"] == 0


# ---- 4. page and slot accounting, abort ---------------------------------------------------------
def test_pages_and_slots_are_returned_and_abort_frees_at_once(eng):
    ps = prompts(A)
    sp = SamplingParams(max_tokens=10)
    d = Driver(eng)
    d.submit("keep1", ps[0], sp)
    d.submit("victim", ps[1], sp)
    d.submit("keep2", ps[2][:40], sp)
    d.submit("prefilling", ps[2], sp)  # 100 tokens: four prefill chunks
    d.submit("queued", ps[0][:5], sp)  # max_batch is 4: this one waits for a slot
    d.run(until=lambda: len(d.tokens("victim")) >= 2)

    # abort mid-decode: pages (owned and still reserved) and slot come back at once
    vid = d.rid["victim"]
    assert vid in eng.running and "victim" not in d.final
    held = len(eng.pages.pages_of(vid)) + eng.pages.reserved_of(vid)
    free_pages, free_slots = eng.pages.num_free, len(eng.free_slots)
    assert eng.abort(vid)
    assert vid not in eng.running and vid not in eng.pages
    assert eng.pages.num_free == free_pages + held
    assert len(eng.free_slots) == free_slots + 1
    eng.pages.check_invariants()
    assert not eng.abort(vid)  # already gone

    # abort mid-prefill and one still queued
    pid = d.rid["prefilling"]
    assert pid in eng.running and eng.pages.num_tokens(pid) < len(ps[2])
    assert eng.abort(pid) and pid not in eng.pages
    assert eng.abort(d.rid["queued"]) and not eng.waiting
    eng.pages.check_invariants()

    # a newcomer reuses a freed slot (and pages) and starts from a clean recurrent state
    d.submit("newcomer", ps[2][:45], sp)
    d.run()
    assert set(d.final) == {"keep1", "keep2", "newcomer"}  # aborted requests produce nothing more
    assert_idle(eng)
    for k, p in (("keep1", ps[0]), ("keep2", ps[2][:40]), ("newcomer", ps[2][:45])):
        assert d.final[k].token_ids == alone(eng, p, sp).token_ids == reference(A, p, 10), k
    assert eng.abort(12345) is False


# ---- 5. admission under pressure, request validation -------------------------------------------
def test_admission_waits_for_pages_under_pressure(small):
    ps = prompts(A)
    reqs = [ps[2], ps[1], ps[2][:80], ps[0], ps[1][:48], ps[2][10:100]]  # 14, 9, 11, 2, 7, 13 pages
    sp = SamplingParams(max_tokens=8)
    need = sorted(small.pages.pages_needed(len(p) + 8) for p in reqs)
    assert need[-1] + need[-2] <= small.pages.n_pages - 1 < sum(need)  # the pool can't hold them all
    assert sum(need[:4]) > small.pages.n_pages - 1  # nor any four of them: max_batch is never what binds
    deferred = small.counters["admission_deferred"]
    d = Driver(small)
    for i, p in enumerate(reqs):
        d.submit(i, p, sp)
    d.run()
    assert small.counters["admission_deferred"] > deferred
    assert 2 <= d.max_running < small.options.max_batch  # pages, not slots, limited concurrency
    for i, p in enumerate(reqs):
        out = d.final[i]
        assert out.finish_reason == "length" and out.token_ids == reference(A, p, 8), i
    assert_idle(small)


def test_requests_that_can_never_be_served_are_rejected_at_submit(small):
    ps = prompts(A)
    v = small.cfg.vocab_size
    # larger than the whole pool (28 pages x 8 = 224 tokens) but within max_model_len (256)
    with pytest.raises(RequestTooLarge, match="whole pool"):
        small.submit(ps[2], SamplingParams(max_tokens=130))
    with pytest.raises(RequestError, match="max_model_len 256"):
        small.submit(ps[2], SamplingParams(max_tokens=157))

    bad_prompts = [
        ("empty", []),
        (r"\[0, %d\)" % v, [1, v]),
        (r"\[0, %d\)" % v, [-1, 3]),
        ("tokenizer", "a text prompt"),
    ]
    for msg, p in bad_prompts:
        with pytest.raises(RequestError, match=msg):
            small.submit(p)

    bad_params = [
        ("temperature", dict(temperature=-0.5)),
        ("temperature", dict(temperature=math.nan)),
        ("temperature", dict(temperature=1000.0)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-1)),
        ("min_p", dict(min_p=-0.1)),
        ("min_p", dict(min_p=1.5)),
        ("min_tokens", dict(min_tokens=17)),
        ("min_tokens", dict(min_tokens=-1)),
        ("max_tokens", dict(max_tokens=0)),
        ("max_tokens", dict(max_tokens=2.5)),
        ("stop strings need a tokenizer", dict(stop=("\n",))),
        ("stop_token_ids", dict(stop_token_ids=(v,))),
        ("stop_token_ids", dict(stop_token_ids=(2**40,))),  # used to blow up inside step(), wedging the engine
        (f"at most {MAX_BANNED}", dict(min_tokens=2, stop_token_ids=tuple(range(MAX_BANNED + 1)))),
    ]
    for msg, kw in bad_params:
        with pytest.raises(RequestError, match=msg):
            small.submit(ps[0], SamplingParams(**kw))
    # min_tokens is fine with many stop ids once duplicates (here the EOS id) are counted once
    eos = small.eos_token_ids[0]
    small.abort(small.submit(ps[0], SamplingParams(min_tokens=1, stop_token_ids=(eos,) * 3 + tuple(range(7)))))

    with pytest.raises(RequestError, match="2 prompts but 1 sampling"):
        small.generate([ps[0], ps[1]], [GREEDY])
    with pytest.raises(RequestError, match="empty"):  # a bad prompt in a list leaves nothing queued behind
        small.generate([ps[0], ps[1], []])
    assert not small.has_work()


# ---- 6. the decode contract ---------------------------------------------------------------------
def test_max_tokens_and_stop_token_ids(eng):
    p, gr = prompts(A)[0], greedy_golden(A, 0)
    assert gr[2] not in gr[:2] and gr[0] not in gr[1:4]
    for n in (1, 5):
        out = alone(eng, p, SamplingParams(max_tokens=n))
        assert out.finish_reason == "length" and out.token_ids == gr[:n] and len(out.logprobs) == n

    out = alone(eng, p, SamplingParams(stop_token_ids=(gr[2],)))
    assert out.finish_reason == "stop" and out.token_ids == gr[:2]  # the stop token is not emitted
    assert len(out.logprobs) == 2
    out = alone(eng, p, SamplingParams(stop_token_ids=(200, gr[0])))  # stops at the very first token
    assert out.finish_reason == "stop" and out.token_ids == []


def test_eos_and_ignore_eos(eng):
    p, gr = prompts(A)[0], greedy_golden(A, 0)
    e = sibling(eng, eos_token_ids=[gr[2]])
    assert e.eos_token_ids == (gr[2],)
    out = alone(e, p)
    assert out.finish_reason == "stop" and out.token_ids == gr[:2]
    out = alone(e, p, SamplingParams(max_tokens=16, ignore_eos=True))
    assert out.finish_reason == "length" and out.token_ids == gr  # runs through the EOS token
    out = alone(e, p, SamplingParams(max_tokens=16, stop_token_ids=(gr[4],), ignore_eos=True))
    assert out.finish_reason == "stop" and out.token_ids == gr[:4]  # ignore_eos leaves stop ids alone
    assert_idle(e)


def _runner_up_without(name, ids, banned) -> int:
    logits = np.asarray(target(name).logits(ids)[-1]).copy()
    logits[list(banned)] = -np.inf
    return int(np.argmax(logits))


@pytest.mark.parametrize("via", ["stop_token_ids", "eos"])
def test_min_tokens_bans_stopping_until_reached(eng, via):
    p, gr = prompts(A)[0], greedy_golden(A, 0)
    tok, m = gr[2], 5
    e = sibling(eng, eos_token_ids=[tok]) if via == "eos" else eng
    stop = (tok,) if via == "stop_token_ids" else ()
    short = alone(e, p, SamplingParams(max_tokens=16, stop_token_ids=stop))
    out = alone(e, p, SamplingParams(max_tokens=16, stop_token_ids=stop, min_tokens=m))
    assert short.token_ids == gr[:2] and short.finish_reason == "stop"
    assert len(out.token_ids) > len(short.token_ids) and len(out.token_ids) >= m
    assert tok not in out.token_ids[:m]
    assert tok not in out.token_ids  # a stop/EOS token is never emitted: banned before m, a stop after
    assert out.token_ids[:2] == gr[:2]
    # where the banned token would have come, the engine takes the runner-up
    assert out.token_ids[2] == _runner_up_without(A, p + gr[:2], [tok])
    if out.finish_reason == "length":
        assert len(out.token_ids) == 16
    else:
        assert out.finish_reason == "stop"
    if via == "eos":
        assert_idle(e)


def test_min_tokens_bans_a_stop_id_listed_after_duplicates(eng):
    """The banned list holds MAX_BANNED ids; repeated stop/EOS ids must not push a real one out of it."""
    p, gr = prompts(A)[0], greedy_golden(A, 0)
    eos = eng.eos_token_ids[0]
    sp = SamplingParams(max_tokens=8, min_tokens=5, stop_token_ids=(eos,) * MAX_BANNED + (gr[2],))
    out = alone(eng, p, sp)
    assert gr[2] not in out.token_ids and len(out.token_ids) >= 5
    assert out.token_ids[:2] == gr[:2]


# ---- 7. sampling --------------------------------------------------------------------------------
def test_sampling_seeds_top_k_and_logprobs(eng):
    ps = prompts(A)
    p, gr = ps[0], greedy_golden(A, 0)
    hot = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, logprobs=True)
    first = alone(eng, p, hot)
    assert alone(eng, p, hot).token_ids == first.token_ids  # same seed, same tokens
    assert first.token_ids != gr[:12]  # really sampled at temperature 1
    other = alone(eng, p, dataclasses.replace(hot, seed=4321))
    assert other.token_ids != first.token_ids

    # the same seeded request inside a batch of greedy and differently sampled neighbours
    outs = eng.generate([ps[1], p, ps[2][:30], p], [
        GREEDY, hot, SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=7, logprobs=True),
        SamplingParams(max_tokens=12, temperature=1.0, seed=4321, logprobs=True)])
    assert outs[1].token_ids == first.token_ids
    assert outs[3].token_ids == other.token_ids
    assert outs[0].token_ids == greedy_golden(A, 1)  # greedy rows unaffected by sampled ones

    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5), dict(min_p=1.0)):
        out = alone(eng, p, SamplingParams(max_tokens=16, temperature=1.0, seed=99, **kw))
        assert out.token_ids == gr, kw

    greedy = alone(eng, p, dataclasses.replace(GREEDY, logprobs=True))
    for o in (first, other, greedy, *outs[1:]):
        assert len(o.logprobs) == len(o.top_logprobs) == len(o.token_ids)
        assert all(math.isfinite(x) and x <= 0.0 for x in o.logprobs), o.logprobs
    # a request that did not ask gets none, even in a step whose other rows computed theirs
    assert all(math.isnan(x) for x in outs[0].logprobs) and outs[0].top_logprobs == [[]] * len(outs[0].token_ids)
    # a greedy step's log-probability is that of the token under the model's full distribution
    ref = np.asarray(jax.nn.log_softmax(target(A).logits(p)[-1]))
    assert greedy.logprobs[0] == pytest.approx(float(ref[gr[0]]), abs=1e-4)
    assert greedy.logprobs[0] == pytest.approx(float(ref.max()), abs=1e-4)


def _penalized_reference(name, prompt, n, repetition=1.0, frequency=0.0, presence=0.0, bias=()) -> list[int]:
    """Greedy decoding with the penalties applied on the host to the cache-free reference's logits."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = np.asarray(target(name).logits(ids)[-1], np.float64).copy()
        counts = collections.Counter(out)
        for t in set(out) | set(prompt):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t, c in counts.items():
            logits[t] -= frequency * c + presence
        for t, b in bias:
            logits[t] += b
        out.append(int(np.argmax(logits)))
        ids.append(out[-1])
    return out


# (the random fixture model repeats no token in 12 greedy steps: negative penalties make it repeat, positive ones
# then act on the repeats)
PENALTIES = [dict(frequency=-2.0), dict(presence=-2.0), dict(presence=-2.0, frequency=1.0),
             dict(repetition=0.5, frequency=1.5), dict(repetition=0.6, presence=1.0), dict(bias=((7, 6.0), (11, -100.0)))]


@pytest.mark.parametrize("kw", PENALTIES, ids=lambda kw: "-".join(kw))
def test_penalties_and_logit_bias_follow_the_host_reference(eng, kw):
    p, gr = prompts(A)[0], greedy_golden(A, 0)
    sp = SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=kw.get("repetition", 1.0),
                        frequency_penalty=kw.get("frequency", 0.0), presence_penalty=kw.get("presence", 0.0),
                        logit_bias=kw.get("bias", ()))
    want = _penalized_reference(A, p, 12, **kw)
    assert want != reference(A, p, 12)  # the penalty changes this greedy continuation
    assert alone(eng, p, sp).token_ids == want
    # beside unpenalized requests, which it leaves alone; then a plain request in the same slot is plain again
    outs = eng.generate([prompts(A)[1], p, prompts(A)[2]], [GREEDY, sp, GREEDY])
    assert outs[1].token_ids == want
    assert outs[0].token_ids == greedy_golden(A, 1) and outs[2].token_ids == greedy_golden(A, 2)
    assert alone(eng, p).token_ids == gr


def test_a_large_logit_bias_forces_a_token_and_bad_values_are_refused(eng):
    p = prompts(A)[0]
    out = alone(eng, p, SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((5, 100.0),)))
    assert out.token_ids == [5] * 6
    v = eng.cfg.vocab_size
    for sp, msg in [(SamplingParams(logit_bias=((v, 1.0),)), "logit_bias keys"),
                    (SamplingParams(logit_bias=((1, 101.0),)), "logit_bias values"),
                    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
                    (SamplingParams(frequency_penalty=2.5), "frequency_penalty"),
                    (SamplingParams(presence_penalty=-3.0), "presence_penalty")]:
        with pytest.raises(RequestError, match=msg):
            eng.submit(p, sp)
    off = Engine(eng.target, None, dataclasses.replace(eng.options, sampling_penalties=False))
    assert off.state.pen is None
    with pytest.raises(RequestError, match="without sampling penalties"):
        off.submit(p, SamplingParams(presence_penalty=1.0))


# ---- 8. streaming -------------------------------------------------------------------------------
def test_stream_yields_growing_snapshots(eng):
    p, gr = prompts(A)[0], greedy_golden(A, 0)
    snaps = list(eng.stream(p, SamplingParams(max_tokens=6)))
    assert [len(s.token_ids) for s in snaps] == [1, 2, 3, 4, 5, 6]
    assert all(s.finish_reason is None for s in snaps[:-1]) and snaps[-1].finish_reason == "length"
    for a, b in zip(snaps, snaps[1:]):
        assert b.token_ids[:len(a.token_ids)] == a.token_ids
        assert b.request_id == a.request_id
    assert snaps[-1].token_ids == alone(eng, p, SamplingParams(max_tokens=6)).token_ids == gr[:6]

    snaps = list(eng.stream(p, SamplingParams(stop_token_ids=(gr[2],))))
    assert snaps[-1].finish_reason == "stop" and snaps[-1].token_ids == gr[:2]
    assert all(s.finish_reason is None for s in snaps[:-1])

    hot = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    assert list(eng.stream(p, hot))[-1].token_ids == alone(eng, p, hot).token_ids


def test_closing_a_stream_early_aborts_its_request(eng):
    it = eng.stream(prompts(A)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    first = next(it)
    assert len(first.token_ids) == 1 and eng.running
    it.close()
    assert not eng.running and not eng.waiting  # the autouse check also verifies pages and slots came back


def test_batch_buckets_are_checked_and_default_to_powers_of_two():
    from dflash_jax.engine.loop import _buckets

    assert _buckets(12) == (1, 2, 4, 8, 12)
    assert _buckets(16, (16, 1, 1)) == (1, 16)
    for bad in ((1, 8), (), (0, 16)):
        with pytest.raises(ValueError, match="must be positive and end at"):
            _buckets(16, bad)


def test_priority_orders_admission(eng):
    ps = prompts(A)
    fill = [eng.submit(ps[0], SamplingParams(max_tokens=4)) for _ in range(3)]
    late = eng.submit(ps[1], SamplingParams(max_tokens=4, priority=5))
    urgent = eng.submit(ps[2], SamplingParams(max_tokens=4, priority=-1))
    also = eng.submit(ps[1][:9], SamplingParams(max_tokens=4, priority=-1))
    assert [r.rid for r in eng.waiting] == [urgent, also, *fill, late]  # arrival order among equals
    eng.step()  # four slots: the two urgent requests and two of the rest come in
    assert set(eng.running) == {urgent, also, *fill[:2]}
    outs, seen_late_before_fill = {}, False
    while eng.has_work():
        for o in eng.step():
            outs[o.request_id] = o
        seen_late_before_fill |= late in eng.running and fill[2] not in eng.running and fill[2] not in outs
    assert not seen_late_before_fill
    assert outs[urgent].token_ids == greedy_golden(A, 2)[:4] and outs[late].token_ids == greedy_golden(A, 1)[:4]
    assert_idle(eng)
