"""The engine's text: incremental detokenization equals decoding every token at each step (multi-byte characters
split across tokens included), stop strings end the text with or without the stop string kept
(include_stop_str_in_output), and skip_special_tokens decides whether special tokens are in it."""

import os
import types

import pytest
from hypothesis import given, settings, strategies as st

import dflash_jax as dj
from dflash_jax.engine.loop import DETOK_SETTLE, Engine, EngineOptions, SamplingParams, _Request
from dflash_jax.models.tokenizer import Tokenizer

pytestmark = pytest.mark.xdist_group("detokenize")

TARGET = os.path.join(dj.SHIPPED_MODELS, "target")
TEXT = ("def größe(x):  # naïve ✓ — 数据 🙂\n    return {'ä': x, \"ß\": [1.5, None]}\r\n\tprint('ok')\n" * 4)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(TARGET)


@pytest.fixture(scope="module")
def eng(tok):
    e = Engine(dj.load_target(TARGET, dtype="float32"), tok,
               EngineOptions(max_batch=2, prefill_batch=2, prefill_chunk=32, max_model_len=192, page_size=16))
    e.warmup()
    return e


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_incremental_text_equals_decoding_every_token(tok, data):
    ids = tok.encode(TEXT)
    # a stretch of real text, or ids in any order (byte tokens that never form a character included)
    if data.draw(st.booleans()):
        a = data.draw(st.integers(0, len(ids) - 1))
        seq = ids[a:a + data.draw(st.integers(1, 3 * DETOK_SETTLE + 5))]
    else:
        seq = data.draw(st.lists(st.sampled_from(sorted(set(ids)) + list(range(256))), min_size=1, max_size=60))
    skip = data.draw(st.booleans())
    r = _Request(0, [1], SamplingParams(skip_special_tokens=skip), 0, None)
    host = types.SimpleNamespace(tokenizer=tok)
    for t in seq:
        r.tokens.append(t)
        if data.draw(st.integers(0, 3)):  # not every step asks for the text
            assert Engine._decoded(host, r) == tok.decode(r.tokens, skip_special_tokens=skip)
    assert Engine._decoded(host, r) == tok.decode(r.tokens, skip_special_tokens=skip)


def test_stop_strings_with_and_without_the_stop_string_kept(eng, tok):
    p = tok.encode("def parse_args(argv):\n")
    free = eng.generate([p], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]
    assert stop and free.find(stop) < len(free) - 3
    cut, kept = eng.generate([p, p], [SamplingParams(max_tokens=40, stop=(stop, "\x00never"), ignore_eos=True),
                                      SamplingParams(max_tokens=40, stop=(stop,), ignore_eos=True,
                                                     include_stop_str_in_output=True)])
    i = free.find(stop)
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert cut.text == free[:i] and kept.text == free[:i + len(stop)]


def test_special_tokens_are_in_the_text_only_when_asked(eng, tok):
    eos = eng.eos_token_ids[0]
    sp = dict(max_tokens=3, ignore_eos=True, logit_bias=((eos, 100.0),))
    skip, keep = eng.generate([[5, 6, 7]] * 2, [SamplingParams(**sp), SamplingParams(**sp, skip_special_tokens=False)])
    assert skip.token_ids == keep.token_ids == [eos] * 3
    assert skip.text == "" and keep.text == tok.decode([eos] * 3, skip_special_tokens=False) != ""
