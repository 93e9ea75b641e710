"""Structured output inside speculative rounds (``EngineOptions.structured_spec``): the host walks each constrained
row's automaton along the drafted tree (``Matcher.tree_masks``) and the verify step masks every node's logits with
its own state's allowed tokens. Greedy constrained requests give exactly the AR engine's tokens whether the
proposals follow the constraint (long accepted paths) or break it (rejected at the first refused token), sampled ones
always match their constraint, unconstrained rows of the same rounds are untouched, and the tree masks equal a fresh
automaton walked along each node's path."""

import json
import os
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import dflash_jax as dj
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.engine.spec_steps import SpecConfig
from dflash_jax.engine.structured import Constraint
from dflash_jax.models.dflash_loader import load_drafter
from dflash_jax.models.tokenizer import Tokenizer

pytestmark = pytest.mark.xdist_group("structured_spec")

TARGET = os.path.join(dj.SHIPPED_MODELS, "target")
DRAFTER = os.path.join(dj.SHIPPED_MODELS, "drafter")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"]}
JSON = Constraint("json_schema", json.dumps(SCHEMA))
OPTS = dict(max_batch=4, prefill_batch=2, prefill_chunk=32, max_model_len=256, page_size=16, batch_buckets=(4,))
PROMPTS = ["settings = ", "config = ", "x = "]
PROPOSALS: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> what the oracle proposes after it


@pytest.fixture(scope="module")
def target():
    return dj.load_target(TARGET, dtype="float32")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(TARGET)


@pytest.fixture(scope="module")
def drafter():
    return load_drafter(DRAFTER, dtype="float32")


@pytest.fixture(scope="module")
def ar(target, tok):
    e = Engine(target, tok, EngineOptions(**OPTS))
    e.warmup()
    return e


def _oracle(prompt, toks):
    """The next 15 tokens of the stored text after ``toks`` (zeros past its end)."""
    return (PROPOSALS.get(tuple(prompt), [])[len(toks):] + [0] * 15)[:15]


@pytest.fixture(scope="module")
def oracle_eng(target, tok, drafter):
    e = Engine(target, tok, EngineOptions(**OPTS, spec=SpecConfig(budget=8), cohort_yield_min=0.0,
                                          structured_spec=True, spec_oracle=_oracle), drafter=drafter)
    e.warmup()
    return e


def test_greedy_constrained_rounds_equal_ar_whether_proposals_follow_or_break_the_constraint(ar, oracle_eng):
    p = [ar.tokenizer.encode(s) for s in PROMPTS]
    sps = [SamplingParams(max_tokens=40, constraint=JSON), SamplingParams(max_tokens=40, constraint=JSON),
           SamplingParams(max_tokens=24)]
    want = ar.generate(p, sps)
    free = ar.generate(p[:2], SamplingParams(max_tokens=40))  # what the target says unconstrained
    assert [o.token_ids for o in free] != [o.token_ids for o in want[:2]]
    PROPOSALS.clear()
    PROPOSALS[tuple(p[0])] = want[0].token_ids  # accepted along the constraint
    PROPOSALS[tuple(p[1])] = free[1].token_ids  # breaks it: rejected where it does
    PROPOSALS[tuple(p[2])] = want[2].token_ids
    before = oracle_eng.counters["spec_masked_steps"]
    outs = oracle_eng.generate(p, sps)
    for o, w in zip(outs, want):
        assert o.token_ids == w.token_ids and o.finish_reason == w.finish_reason
        assert o.stats["spec_mode"] == "ddtree" and o.stats["draft_steps"] > 0
    json.loads(outs[0].text)
    assert outs[0].stats["accepted_tokens"] >= len(want[0].token_ids) // 2
    assert oracle_eng.counters["spec_masked_steps"] > before


@pytest.mark.parametrize("c, check", [
    (Constraint("choice", json.dumps(["True", "False", "None"])), lambda t: t in ("True", "False", "None")),
    (Constraint("regex", r"[0-9]{2,3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{2,3}-[a-z]{2}", t)),
    (JSON, lambda t: (lambda o: isinstance(o["ok"], bool) and o["color"] in ("red", "green", "blue"))(json.loads(t))),
    (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict)),
], ids=["choice", "regex", "json_schema", "json_object"])
def test_sampled_constrained_rounds_match_their_constraint(ar, oracle_eng, c, check):
    p = ar.tokenizer.encode(PROMPTS[0])
    PROPOSALS[tuple(p)] = ar.generate([p], SamplingParams(max_tokens=40))[0].token_ids  # unconstrained text
    outs = oracle_eng.generate([p] * 3, [SamplingParams(max_tokens=48, constraint=c, temperature=1.0, seed=s)
                                         for s in range(3)])
    for o in outs:
        assert o.stats["spec_mode"] == "ddtree"
        m = oracle_eng.structured.start(c)
        for t in o.token_ids:  # every token the automaton allows (it raises otherwise): a reply cut by max_tokens
            assert m.mask()[t // 32] >> (t % 32) & 1, (o.text, t)  # is a valid prefix
            m.advance(t)
        if o.finish_reason == "stop":
            assert check(o.text), o.text
    assert any(o.finish_reason == "stop" for o in outs)  # and a complete reply is checked whole


def test_drafted_rounds_with_penalties_equal_ar(target, tok, drafter, ar):
    """The real drafter's trees (no oracle), a constraint together with a repetition penalty, next to a free row."""
    p = [ar.tokenizer.encode(s) for s in PROMPTS]
    sps = [SamplingParams(max_tokens=24, constraint=JSON, repetition_penalty=1.3),
           SamplingParams(max_tokens=16, constraint=Constraint("json_object")), SamplingParams(max_tokens=16)]
    want = ar.generate(p, sps)
    e = Engine(target, tok, EngineOptions(**OPTS, spec=SpecConfig(budget=8), cohort_yield_min=0.0,
                                          structured_spec=True), drafter=drafter)
    e.warmup()
    assert {"draft.b4", "spec_masked.b4"} <= set(e.warmup_report)
    outs = e.generate(p, sps)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert all(o.stats["spec_mode"] == "ddtree" for o in outs)
    assert e.counters["spec_masked_steps"] > 0 and e.counters["lazy_compiles"] == 0
    # without the option a constrained request decodes AR
    e2 = Engine(target, tok, EngineOptions(**OPTS, spec=SpecConfig(budget=8)), drafter=drafter)
    assert e2.generate([p[0]], sps[0])[0].stats["spec_mode"] == "ar"


def test_structured_spec_needs_a_drafter_and_penalty_tables(target, tok):
    with pytest.raises(ValueError, match="structured_spec"):
        Engine(target, tok, EngineOptions(**OPTS, structured_spec=True))


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_tree_masks_equal_a_fresh_automaton_along_every_path(ar, data):
    ar.start_constraint(JSON)
    s = ar.structured
    prefix = ar.tokenizer.encode(data.draw(st.sampled_from(['', '{"ok": ', '{"ok": true, "color": "'])))
    m = s.start(JSON)
    for t in prefix:
        m.advance(t)
    n = data.draw(st.integers(1, 12))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens, paths = [-1], [[]]  # paths[i]: the tokens from the root (exclusive) to node i

    def walk(path):  # a fresh matcher after prefix + path, or None where the automaton refuses or the text ended
        ref = s.start(JSON)
        for t in prefix + path:
            if t in ar.eos_token_ids or t not in ref.guide.get_tokens():
                return None
            ref.advance(t)
        return ref

    for i in range(1, n):  # mostly tokens the parent allows (to go deep), some random ones or an EOS
        ref = walk(paths[parents[i]])
        allowed = sorted(ref.guide.get_tokens()) if ref is not None else []
        kind = data.draw(st.sampled_from(["allowed", "allowed", "allowed", "any", "eos"]))
        if kind == "allowed" and allowed:
            t = int(data.draw(st.sampled_from(allowed)))
        elif kind == "eos":
            t = ar.eos_token_ids[0]
        else:
            t = data.draw(st.integers(0, ar.cfg.vocab_size - 1))
        tokens.append(t)
        paths.append(paths[parents[i]] + [t])
    valid = [True] * n
    masks = m.tree_masks(np.array(tokens), np.array(parents), np.array(valid))
    assert masks.shape == (n, -(-ar.cfg.vocab_size // 32)) and masks.dtype == np.uint32
    for i in range(n):
        ref = walk(paths[i])
        want = ref.mask() if ref is not None else np.full_like(masks[i], 0xFFFFFFFF)
        np.testing.assert_array_equal(masks[i], want, err_msg=f"node {i} path {paths[i]}")
