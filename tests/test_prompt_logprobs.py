"""Prompt log-probabilities (SamplingParams.prompt_logprobs): every prompt token's log-probability and each
position's most likely tokens, from the engine's scoring prefill, against the cache-free full pass."""

import functools
import os

import jax
import numpy as np
import pytest

import dflash_jax as dj
from conftest import FIXTURES, TINY
from dflash_jax.engine.compile import CompileWatch
from dflash_jax.engine.loop import Engine, EngineOptions, RequestError, SamplingParams

A = TINY[0]
# chunks of 16 tokens: the fixture prompts span several, so positions across chunk boundaries are scored
OPTS = EngineOptions(max_batch=4, prefill_batch=2, prefill_chunk=16, max_model_len=256, page_size=8,
                     prompt_logprobs=True, prefix_cache=2)


@functools.lru_cache(maxsize=None)
def target():
    return dj.load_target(os.path.join(FIXTURES, A))


def prompts() -> list[list[int]]:
    g = np.load(os.path.join(FIXTURES, f"{A}_golden.npz"))
    return [g[f"p{j}.ids"].tolist() for j in range(3)]


@pytest.fixture(scope="module")
def eng():
    e = Engine(target(), None, OPTS)
    e.warmup()
    return e


def reference(prompt: list[int]) -> np.ndarray:
    """log-softmax of the full pass's logits [T, V]: row j is the distribution of token j + 1."""
    return np.asarray(jax.nn.log_softmax(target().logits(prompt), axis=-1))


def check(out, prompt: list[int], k: int) -> None:
    ref = reference(prompt)
    assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] == []
    want = ref[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(out.prompt_logprobs[1:], want, atol=2e-4, rtol=0)
    assert out.prompt_ranks[0] is None and len(out.prompt_ranks) == len(prompt)
    for j in range(1, len(prompt)):  # 1 + the tokens more likely (ties within the tolerance either way)
        assert 1 + np.sum(ref[j - 1] > want[j - 1] + 2e-4) <= out.prompt_ranks[j] <= 1 + np.sum(ref[j - 1] > want[j - 1] - 2e-4)
    for j in range(1, len(prompt)):
        top = out.prompt_top_logprobs[j]
        assert len(top) == k
        if k:
            ids, lps = zip(*top)
            np.testing.assert_allclose(lps, np.sort(ref[j - 1])[::-1][:k], atol=2e-4, rtol=0)
            assert ref[j - 1][list(ids)].tolist() == pytest.approx(list(lps), abs=2e-4)


def test_prompt_logprobs_match_the_full_pass_beside_other_requests(eng):
    ps = prompts()
    long = (ps[0] + ps[1])[:70]  # five chunks, the last one partial
    sps = [SamplingParams(max_tokens=6, prompt_logprobs=3), SamplingParams(max_tokens=6),
           SamplingParams(max_tokens=6, prompt_logprobs=0), SamplingParams(max_tokens=6)]
    with CompileWatch() as w:
        outs = eng.generate([long, ps[1], ps[2], ps[0]], sps)
    assert w.count == 0, "the scoring step was compiled at warm-up"
    check(outs[0], long, 3)
    check(outs[2], ps[2], 0)
    assert outs[1].prompt_logprobs is None and outs[3].prompt_logprobs is None
    # generation is unchanged by scoring: each request's greedy tokens equal the same request alone
    for p, o in zip([long, ps[1], ps[2], ps[0]], outs):
        assert o.token_ids == target().greedy(p, 6)
    assert eng.counters["score_steps"] >= 5 + 2


def test_a_scored_prompt_never_starts_from_a_cached_prefix(eng):
    p = (prompts()[0] * 3)[:60]
    first = eng.generate([p], SamplingParams(max_tokens=2))[0]
    again = eng.generate([p], SamplingParams(max_tokens=2))[0]
    assert again.stats["cached_tokens"] > 0, "the plain request reuses the cached prefix"
    scored = eng.generate([p], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert scored.stats["cached_tokens"] == 0
    check(scored, p, 1)
    assert scored.token_ids == first.token_ids == again.token_ids


def test_single_token_prompt_and_refusals(eng):
    out = eng.generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    assert out.prompt_logprobs == [None] and out.prompt_top_logprobs == [[]]
    with pytest.raises(RequestError, match="prompt_logprobs"):
        eng.submit([1, 2], SamplingParams(prompt_logprobs=9))
    plain = Engine(target(), None, EngineOptions(max_batch=2, prefill_chunk=16, max_model_len=64, page_size=8))
    with pytest.raises(RequestError, match="prompt_logprobs=True"):
        plain.submit([1, 2], SamplingParams(prompt_logprobs=1))
