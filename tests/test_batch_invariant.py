"""EngineOptions.batch_invariant: a request's tokens and logprobs are bit-identical whatever runs beside it.

bfloat16 on CPU shows the point: with the default buckets the same prompts give different logprobs alone and
batched (different matmul shapes round differently); with one shape per step kind they are equal to the bit.
"""

import os

import numpy as np
import pytest

import dflash_jax as dj
from conftest import FIXTURES, TINY
from dflash_jax.engine.compile import CompileWatch
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams

A = TINY[0]


def test_tokens_and_logprobs_do_not_depend_on_the_batch():
    target = dj.load_target(os.path.join(FIXTURES, A), dtype="bfloat16")
    g = np.load(os.path.join(FIXTURES, f"{A}_golden.npz"))
    ps = [g[f"p{j}.ids"].tolist() for j in range(3)]
    ps += [ps[0][:17], ps[1][:9] + ps[2][:20]]  # lengths that end mid-chunk: last tokens join decode steps
    eng = Engine(target, None, EngineOptions(max_batch=8, prefill_batch=2, prefill_chunk=16, max_model_len=256,
                                             page_size=8, batch_invariant=True))
    assert eng.decode_buckets == (8,) and eng.prefill_buckets == (2,)
    eng.warmup()
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True)
    hot = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95, seed=3, logprobs=True)
    with CompileWatch() as w:
        alone = [eng.generate([p], sp)[0] for p in ps for sp in (greedy, hot)]
        together = eng.generate([p for p in ps for _ in range(2)], [greedy, hot] * len(ps))
        staggered = []  # requests joining while others decode
        for i, p in enumerate(ps):
            eng.submit(p, greedy)
            for _ in range(i + 1):
                staggered += [o for o in eng.step() if o.finish_reason is not None]
        while eng.has_work():
            staggered += [o for o in eng.step() if o.finish_reason is not None]
    assert w.count == 0
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    staggered.sort(key=lambda o: o.request_id)
    for a, b in zip(alone[::2], staggered):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    # a group (the API's n) forks at a chunk boundary: each member prefills in the chunks it would alone
    rids = eng.submit_group(ps[4], [greedy, hot])
    assert eng.waiting[-1].leader is not None
    got = {}
    while eng.has_work():
        got.update({o.request_id: o for o in eng.step() if o.finish_reason is not None})
    for a, rid in zip(alone[8:10], rids):
        assert a.token_ids == got[rid].token_ids and a.logprobs == got[rid].logprobs
    assert got[rids[1]].stats["cached_tokens"] == 16


def test_batch_invariant_takes_no_other_buckets():
    target = dj.load_target(os.path.join(FIXTURES, A))
    with pytest.raises(ValueError, match="batch_invariant"):
        Engine(target, None, EngineOptions(max_batch=4, batch_buckets=(1, 4), batch_invariant=True))
