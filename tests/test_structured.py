"""Structured output on the shipped target: every constrained reply matches its constraint, greedy constrained
decoding equals a host loop over the cache-free logits masked by the same automaton, unconstrained neighbours are
untouched, and constraints that cannot be built are refused at submit."""

import json
import os
import re

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.engine.loop import Engine, EngineOptions, RequestError, SamplingParams
from dflash_jax.engine.structured import Constraint, Structured, token_bytes
from dflash_jax.models.tokenizer import Tokenizer
from dflash_jax.serve.__main__ import SHIPPED

pytestmark = pytest.mark.xdist_group("structured")

TARGET = os.path.join(SHIPPED, "target")
PROMPT = "settings = "
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"]}


@pytest.fixture(scope="module")
def eng():
    target = dj.load_target(TARGET, dtype="float32")
    e = Engine(target, Tokenizer.from_dir(TARGET), EngineOptions(max_batch=4, prefill_batch=2, prefill_chunk=32,
                                                                  max_model_len=256, page_size=16))
    e.warmup()
    return e


def _ids(eng, text):
    return eng.tokenizer.encode(text)


def test_token_bytes_spell_every_token_exactly(eng):
    tok = eng.tokenizer
    tb = token_bytes(tok)
    assert len(tb) >= tok.vocab_size - len(tok.special_ids) - 8
    assert not set(tb) & tok.special_ids
    text = "def f(x):\n    return {'a': 1, \"b\": [2.5, None]}  # ünïcode ✓\n"
    ids = tok.encode(text)
    assert b"".join(tb[i] for i in ids).decode("utf-8") == text


@pytest.mark.parametrize("c, check", [
    (Constraint("choice", json.dumps(["True", "False", "None"])), lambda t: t in ("True", "False", "None")),
    (Constraint("regex", r"[0-9]{2,3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{2,3}-[a-z]{2}", t)),
    (Constraint("json_schema", json.dumps(SCHEMA)),
     lambda t: (lambda o: isinstance(o["ok"], bool) and o["color"] in ("red", "green", "blue"))(json.loads(t))),
    (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict)),
], ids=["choice", "regex", "json_schema", "json_object"])
def test_constrained_replies_match_and_stop(eng, c, check):
    for sp in (SamplingParams(max_tokens=48, constraint=c),
               SamplingParams(max_tokens=48, constraint=c, temperature=1.0, seed=3)):
        out = eng.generate([PROMPT], sp)[0]
        assert out.finish_reason == "stop", out.text
        assert check(out.text), out.text
        assert out.stats["spec_mode"] == "ar"


def _host_reference(eng, prompt_ids, c, n) -> list[int]:
    """Greedy over the cache-free logits, masked by a fresh matcher of the same automaton, until EOS."""
    m = eng.structured.start(c)
    ids, out = list(prompt_ids), []
    for _ in range(n):
        logits = np.asarray(eng.target.logits(ids)[-1], np.float64)
        bits = np.unpackbits(m.mask().view(np.uint8), bitorder="little")[: logits.shape[0]].astype(bool)
        t = int(np.argmax(np.where(bits, logits, -np.inf)))
        if t in eng.eos_token_ids:
            break
        out.append(t)
        ids.append(t)
        m.advance(t)
    return out


def test_greedy_constrained_equals_the_host_loop_and_neighbours_are_untouched(eng):
    c = Constraint("json_schema", json.dumps(SCHEMA))
    p = _ids(eng, PROMPT)
    want = _host_reference(eng, p, c, 48)
    plain = eng.generate([p], SamplingParams(max_tokens=12))[0].token_ids
    outs = eng.generate([p, p, _ids(eng, "x = ")], [SamplingParams(max_tokens=12), SamplingParams(max_tokens=48,
                                                    constraint=c), SamplingParams(max_tokens=12)])
    assert outs[1].token_ids == want
    assert outs[0].token_ids == plain and outs[0].token_ids != want[:12]
    # the slot that held the constrained request is free text again
    assert eng.generate([p], SamplingParams(max_tokens=12))[0].token_ids == plain


def test_constraints_that_cannot_be_built_are_refused(eng):
    for c in (Constraint("regex", "(unclosed"), Constraint("json_schema", "{not json"),
              Constraint("choice", json.dumps([]))):
        with pytest.raises(RequestError):
            eng.submit(PROMPT, SamplingParams(max_tokens=4, constraint=c))
    assert not eng.has_work()
    bare = Engine(eng.target, None, eng.options)
    with pytest.raises(RequestError, match="tokenizer"):
        bare.submit([1, 2], SamplingParams(max_tokens=4, constraint=Constraint("json_object")))


def test_automata_are_cached_per_pattern(eng):
    c = Constraint("choice", json.dumps(["a", "b"]))
    eng.start_constraint(c)
    s: Structured = eng.structured
    assert s.index(c) is s.index(Constraint("choice", json.dumps(["a", "b"])))
    assert s.start(c).mask().shape == (-(-eng.cfg.vocab_size // 32),)


def test_the_mask_holds_exactly_the_tokens_the_automaton_allows(eng):
    eng.start_constraint(Constraint("json_object"))
    m = eng.structured.start(Constraint("json_schema", json.dumps(SCHEMA)))
    for tok in _ids(eng, '{"ok": true'):
        bits = np.unpackbits(m.mask().view(np.uint8), bitorder="little")[: eng.cfg.vocab_size]
        allowed = set(m.guide.get_tokens())
        assert set(np.nonzero(bits)[0].tolist()) == allowed | (set(eng.eos_token_ids) if eng.eos_token_ids[0] in allowed
                                                                 else set())
        if tok not in allowed:
            break
        m.advance(tok)
