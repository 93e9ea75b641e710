"""Overlap: a decode / speculative step chained on the device from the step in flight gives the same tokens as
the synchronous loop (greedy, seeded sampling, stops, joins, aborts), returns every page and slot, and compiles
nothing after warm-up."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from conftest import FIXTURES
from dflash_jax.config import DrafterConfig
from dflash_jax.engine.compile import CompileWatch
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.engine.spec_steps import SpecConfig
from dflash_jax.models import dflash

pytestmark = pytest.mark.xdist_group("overlap")

OPTS = EngineOptions(max_batch=4, prefill_batch=2, prefill_chunk=16, max_model_len=128, page_size=8,
                     cohort_yield_min=0.0)


@functools.lru_cache(maxsize=None)
def target():
    return dj.load_target(os.path.join(FIXTURES, "qwen36_tiny_a"), dtype="float32")


@functools.lru_cache(maxsize=None)
def engine(spec: bool, overlap: bool) -> Engine:
    t = target()
    drafter = None
    if spec:
        dcfg = DrafterConfig.from_hf_dict({
            "model_type": "qwen3", "hidden_size": t.config.hidden_size, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rms_norm_eps": 1e-6, "rope_theta": 1e7, "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 16, "block_size": 8, "num_target_layers": t.config.num_layers,
            "vocab_size": t.config.vocab_size,
            "dflash_config": {"mask_token_id": t.config.vocab_size - 1, "target_layer_ids": [0, 1, 2]}})
        drafter = (dcfg, dflash.init_params(dcfg, jax.random.key(3), jnp.float32))
    opts = dataclasses.replace(OPTS, overlap=overlap, spec=SpecConfig(budget=6) if spec else None)
    eng = Engine(t, None, opts, drafter=drafter)
    eng.warmup()
    return eng


def serve(eng: Engine) -> dict[str, list[int]]:
    """Six requests through a 4-row engine (two join mid-run), one stopped by a stop id, one sampled, one aborted."""
    rng = np.random.default_rng(7)
    vocab = target().config.vocab_size
    prompts = [rng.integers(0, vocab - 1, n).tolist() for n in (5, 19, 12, 9, 26, 14)]
    stop = target().greedy(prompts[2], 12)[4]
    sps = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=7),
           SamplingParams(max_tokens=12, stop_token_ids=(stop,)),
           SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=11),
           SamplingParams(max_tokens=40), SamplingParams(max_tokens=9)]
    ids = {f"r{i}": eng.submit(p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))}
    got: dict[str, list[int]] = {}
    by_id = {v: k for k, v in ids.items()}
    n = 0
    while eng.has_work():
        for o in eng.step():
            if o.finish_reason is not None:
                got[by_id[o.request_id]] = o.token_ids
        n += 1
        if n == 6:
            assert eng.abort(ids["r4"])  # mid-run, likely inside a chained step
            got["r4"] = []
    assert eng.pages.num_free == eng.pages.n_pages - 1 and eng.pages.num_reserved == 0
    assert sorted(eng.free_slots) == list(range(1, OPTS.max_batch + 1))
    eng.pages.check_invariants()
    return got


@pytest.mark.parametrize("spec", [False, True], ids=["ar", "ddtree"])
def test_overlapped_tokens_equal_the_synchronous_loop(spec):
    sync, over = engine(spec, False), engine(spec, True)
    c0 = sync.counters["chained_steps"], over.counters["chained_steps"]
    want, got = serve(sync), serve(over)
    assert got == want
    t = target()
    rng = np.random.default_rng(7)
    p0 = rng.integers(0, t.config.vocab_size - 1, 5).tolist()
    assert got["r0"] == t.greedy(p0, 12)
    assert sync.counters["chained_steps"] == c0[0]
    assert over.counters["chained_steps"] > c0[1]
    with CompileWatch() as w:
        assert serve(over) == want
    assert w.count == 0, "chained steps compiled after warm-up"


def test_overlap_is_off_where_the_host_must_see_every_step():
    eng = Engine(target(), None, dataclasses.replace(OPTS, kvflash=128, prefill_chunk=16))
    assert not eng.overlap and eng.ahead == 0
    assert engine(False, True).overlap and engine(False, True).ahead == 1


def test_overlap_defaults_on_only_for_large_targets_on_a_gpu(monkeypatch):
    from dflash_jax.engine import loop
    from pallas_kernels import registry

    big = {"w": jax.ShapeDtypeStruct((loop.OVERLAP_AUTO_BYTES // 2,), jnp.bfloat16)}
    small = {"w": jax.ShapeDtypeStruct((1024,), jnp.bfloat16)}
    monkeypatch.setattr(registry, "current_backend", lambda: "cuda")
    assert loop.overlap_by_default(big) and not loop.overlap_by_default(small)
    monkeypatch.setattr(registry, "current_backend", lambda: "cpu")
    assert not loop.overlap_by_default(big)
