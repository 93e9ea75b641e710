"""A drafting vocabulary (spec.draft_vocab): the drafter's head over a token set. Trees draft only from the set,
rounds stay lossless, and the whole vocabulary as the set changes nothing."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.engine.spec_steps import (DRAFT_IDS, SpecConfig, SpecInput, draft_head_rows, draft_tree,
                                         with_draft_vocab)
from dflash_jax.models import quant
from dflash_jax.spec import draft_vocab
from test_spec_step import PAGE, ROWS, WIDTH, setup
from dflash_jax.state import DraftKV

TINY_TARGET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dflash_jax", "assets", "tiny",
                           "target")

pytestmark = pytest.mark.xdist_group("spec")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 64), always=st.lists(st.integers(0, 63), max_size=4))
def test_an_int_is_the_first_ids_plus_the_always_ids_sorted_and_unique(n, always):
    ids = draft_vocab.resolve(n, 64, always)
    assert ids.dtype == np.int32
    assert ids.tolist() == sorted(set(range(n)) | set(always))


def test_files_and_sequences(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([9, 3, 3, 7]))
    (tmp_path / "b.json").write_text(json.dumps({"token_ids": [5, 1]}))
    np.save(tmp_path / "c.npy", np.array([4, 2]))
    assert draft_vocab.resolve(str(tmp_path / "a.json"), 16).tolist() == [3, 7, 9]
    assert draft_vocab.resolve(str(tmp_path / "b.json"), 16, (15,)).tolist() == [1, 5, 15]
    assert draft_vocab.resolve(str(tmp_path / "c.npy"), 16).tolist() == [2, 4]
    assert draft_vocab.resolve((8, 0), 16).tolist() == [0, 8]
    assert draft_vocab.resolve("3", 16).tolist() == [0, 1, 2]  # a count given as text (a preset's string)


def test_spec_config_checks_its_set_when_made(tmp_path):
    assert SpecConfig(draft_vocab="64").draft_vocab == 64 and SpecConfig(draft_vocab=[3, 1]).draft_vocab == (3, 1)
    with pytest.raises(ValueError, match="token count >= 1"):
        SpecConfig(draft_vocab=True)
    with pytest.raises(FileNotFoundError, match="no such file"):
        SpecConfig(draft_vocab=str(tmp_path / "missing.json"))


def test_bad_sets_are_named(tmp_path):
    with pytest.raises(ValueError, match="1 <= N <= 16"):
        draft_vocab.resolve(17, 16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        draft_vocab.resolve([3, 16], 16)
    with pytest.raises(ValueError, match="empty"):
        draft_vocab.resolve([], 16)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        draft_vocab.resolve(str(tmp_path / "missing.json"), 16)
    (tmp_path / "bad.json").write_text(json.dumps({"ids": [1]}))
    with pytest.raises(ValueError, match="JSON list"):
        draft_vocab.resolve(str(tmp_path / "bad.json"), 16)


@pytest.mark.parametrize("kind", ["plain", "fp8", "fp8_block", "int8", "int4"])
def test_head_rows_are_the_rows_of_the_head_in_every_weight_format(kind):
    w = jax.random.normal(jax.random.key(0), (96, 64), jnp.float32)
    head = {"plain": lambda: w, "fp8": lambda: quant.quantize_fp8(w), "fp8_block": lambda: quant.quantize_fp8(w, (32, 32)),
            "int8": lambda: quant.quantize_int8(w), "int4": lambda: quant.quantize_int4(w)}[kind]()
    ids = np.array([0, 5, 31, 32, 33, 95], np.int32)
    rows = draft_head_rows(head, ids)
    full = w if kind == "plain" else quant.dequantize(head)
    got = rows if kind == "plain" else quant.dequantize(rows)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(full)[ids])


def test_most_frequent_orders_by_count_then_id_and_the_cli_writes_it(tmp_path):
    assert draft_vocab.most_frequent([[3, 1, 3], [2, 1, 3]], 2) == [3, 1]
    assert draft_vocab.most_frequent([[5, 4]], 5) == [4, 5]
    src = tmp_path / "t.txt"
    src.write_text("def f(x):\n    return x + x\n" * 20)
    out = tmp_path / "v.json"
    assert draft_vocab.main(["--tokenizer", TINY_TARGET, "--text", str(src), "--size", "8",
                             "--out", str(out)]) == 0
    ids = json.loads(out.read_text())["token_ids"]
    assert len(ids) == 8 and len(set(ids)) == 8


def test_the_cli_refuses_an_empty_set(tmp_path):
    src, out = tmp_path / "t.txt", tmp_path / "v.json"
    src.write_text("x = 1\n")
    with pytest.raises(SystemExit):
        draft_vocab.main(["--tokenizer", TINY_TARGET, "--text", str(src), "--size", "0", "--out", str(out)])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit, match="no tokens"):
        draft_vocab.main(["--tokenizer", TINY_TARGET, "--text", str(tmp_path / "empty.txt"), "--size", "4",
                          "--out", str(out)])
    assert not out.exists()


def _trees(ids):
    t, dcfg, dparams = setup("qwen36_tiny_a")
    if ids is not None:
        dparams = with_draft_vocab(dparams, t.params["lm_head"], ids)
    dkv = DraftKV.zeros(dcfg, ROWS * WIDTH + 1, PAGE, jnp.float32)
    rng = np.random.default_rng(0)
    k = jax.random.key(1)
    dkv = DraftKV(tuple(jax.random.normal(k, a.shape, a.dtype) for a in dkv.k),
                  tuple(jax.random.normal(jax.random.fold_in(k, 1), a.shape, a.dtype) for a in dkv.v))
    inp = SpecInput(root=jnp.asarray(rng.integers(0, 50, ROWS), jnp.int32), start=jnp.asarray([5, 9, 12], jnp.int32),
                    slots=jnp.arange(1, ROWS + 1, dtype=jnp.int32), active=jnp.ones(ROWS, bool),
                    page_table=jnp.asarray(np.arange(1, ROWS * WIDTH + 1, dtype=np.int32).reshape(ROWS, WIDTH)))
    tree, _ = draft_tree(t.config, dcfg, SpecConfig(budget=6), t.params, dparams, dkv, inp)
    return jax.device_get(tree), inp


def test_trees_draft_only_from_the_set_and_the_whole_vocabulary_changes_nothing():
    t, _, _ = setup("qwen36_tiny_a")
    v = t.config.vocab_size
    plain, inp = _trees(None)
    whole, _ = _trees(np.arange(v, dtype=np.int32))
    np.testing.assert_array_equal(whole.tokens, plain.tokens)
    np.testing.assert_array_equal(whole.parent, plain.parent)
    ids = np.arange(0, v, 3, dtype=np.int32)  # every third token
    some, _ = _trees(ids)
    drafted = some.tokens[:, 1:][some.valid[:, 1:]]
    assert drafted.size and np.isin(drafted, ids).all()
    np.testing.assert_array_equal(some.tokens[:, 0], np.asarray(inp.root))


def test_engine_rounds_with_a_drafting_vocabulary_equal_ar_greedy():
    t, dcfg, dparams = setup("qwen36_tiny_a")
    v = t.config.vocab_size
    opts = EngineOptions(max_batch=4, prefill_batch=2, prefill_chunk=16, max_model_len=128, page_size=8,
                         spec=SpecConfig(budget=6, draft_vocab=v // 2), cohort_yield_min=0.0)
    eng = Engine(t, None, opts, drafter=(dcfg, dparams))
    assert eng.dparams[DRAFT_IDS].shape[0] >= v // 2
    assert set(eng.eos_token_ids) <= set(np.asarray(eng.dparams[DRAFT_IDS]).tolist())
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, v - 1, n).tolist() for n in (6, 17)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=10))
    assert [o.token_ids for o in outs] == [t.greedy(p, 10) for p in prompts]
    assert all(o.stats["spec_mode"] == "ddtree" and o.stats["draft_steps"] >= 1 for o in outs)


@pytest.mark.parametrize("starts", [(0, 3, 15), (16, 17, 40), (100, 127, 128)])
def test_sliding_layers_drafting_from_their_window_only_equal_the_whole_context(starts):
    """draft_context: a sliding layer gathers only the pages its window reaches (clipped at both ends of the
    table, non-resident pages masked); the drafter's logits equal those over the whole context."""
    from dflash_jax.engine.spec_steps import draft_context, window_pages
    from dflash_jax.models import dflash

    t, dcfg, dparams = setup("qwen36_tiny_a")
    assert window_pages(dcfg.sliding_window, PAGE, WIDTH) == 3 and window_pages(None, PAGE, WIDTH) is None
    assert window_pages(dcfg.sliding_window, PAGE, 3) is None  # a table no longer than the window: all of it
    k = jax.random.key(5)
    dkv = DraftKV.zeros(dcfg, ROWS * WIDTH + 1, PAGE, jnp.float32)
    dkv = DraftKV(tuple(jax.random.normal(jax.random.fold_in(k, i), a.shape, a.dtype) for i, a in enumerate(dkv.k)),
                  tuple(jax.random.normal(jax.random.fold_in(k, 9 + i), a.shape, a.dtype) for i, a in enumerate(dkv.v)))
    table = np.arange(1, ROWS * WIDTH + 1, dtype=np.int32).reshape(ROWS, WIDTH)
    table[1, 1] = table[2, 14] = -1  # non-resident pages inside a window
    table, start = jnp.asarray(table), jnp.asarray(starts, jnp.int32)
    blocks = dflash.make_blocks(dcfg, jnp.asarray([4, 7, 11], jnp.int32))
    out = []
    for windowed in (True, False):
        ck, cv, cp, cm = draft_context(dcfg, dkv, table, start, windowed=windowed)
        assert [a.shape[1] for a in ck] == ([3 * PAGE, WIDTH * PAGE] if windowed else [WIDTH * PAGE] * 2)
        out.append(dflash.draft_forward(dparams, dcfg, t.params["embed"], t.params["lm_head"], blocks, start,
                                        ck, cv, cp, cm))
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(out[1]), rtol=1e-5, atol=1e-5)


def test_the_drafters_own_weight_format_quantizes_its_matmuls_and_a_head_copy_and_stays_lossless():
    """SpecConfig.draft_quantization: the drafter's matmul weights and a drafting head (a quantized copy of the
    target's LM head, or of the drafting vocabulary's rows) in that format, the target's left alone; rounds stay
    equal to AR greedy."""
    from dflash_jax.engine.spec_steps import DRAFT_HEAD, with_draft_quantization

    t, dcfg, dparams = setup("qwen36_tiny_a")
    v = t.config.vocab_size
    assert SpecConfig(draft_quantization="none").draft_quantization is None
    with pytest.raises(ValueError, match="not supported"):
        SpecConfig(draft_quantization="fp4")
    assert draft_vocab.QUANTIZATIONS == quant.QUANTIZATIONS
    q = with_draft_quantization(dparams, t.params["lm_head"], "fp8")
    assert quant.is_quantized(q["fc"]) and quant.is_quantized(q[DRAFT_HEAD]) and DRAFT_IDS not in q
    assert q[DRAFT_HEAD].shape == t.params["lm_head"].shape
    np.testing.assert_allclose(np.asarray(quant.dequantize(q[DRAFT_HEAD])), np.asarray(t.params["lm_head"]),
                               atol=0.07 * float(jnp.abs(t.params["lm_head"]).max()))
    sub = with_draft_quantization(with_draft_vocab(dparams, t.params["lm_head"], np.arange(0, v, 2)),
                                  t.params["lm_head"], "int8")
    assert sub[DRAFT_HEAD].shape == (v // 2, t.params["lm_head"].shape[1]) and sub[DRAFT_HEAD].data.dtype == jnp.int8
    for spec in (SpecConfig(budget=6, draft_quantization="fp8"),
                 SpecConfig(budget=6, draft_quantization="int8", draft_vocab=v // 2)):
        eng = Engine(t, None, EngineOptions(max_batch=4, prefill_batch=2, prefill_chunk=16, max_model_len=128,
                                            page_size=8, spec=spec, cohort_yield_min=0.0), drafter=(dcfg, dparams))
        assert quant.is_quantized(eng.dparams[DRAFT_HEAD]) and not quant.is_quantized(eng.target.params["lm_head"])
        rng = np.random.default_rng(7)
        prompts = [rng.integers(0, v - 1, n).tolist() for n in (6, 17)]
        outs = eng.generate(prompts, SamplingParams(max_tokens=10))
        assert [o.token_ids for o in outs] == [t.greedy(p, 10) for p in prompts]
        assert all(o.stats["spec_mode"] == "ddtree" and o.stats["draft_steps"] >= 1 for o in outs)


def test_the_drafters_format_wins_over_the_targets():
    """quantization="int8" with draft_quantization="fp8": the target's matmuls int8, the drafter's fp8 (not int8
    first, which would leave them int8); the target's head, quantized already, is read as it is (no copy)."""
    from dflash_jax.engine.spec_steps import DRAFT_HEAD

    t, dcfg, dparams = setup("qwen36_tiny_a")
    eng = Engine(t, None, EngineOptions(max_batch=2, prefill_batch=1, prefill_chunk=16, max_model_len=64, page_size=8,
                                        quantization="int8", spec=SpecConfig(budget=4, draft_quantization="fp8"),
                                        fuse_projections=False),
                 drafter=(dcfg, dparams))
    assert eng.target.params["layers"][0]["mlp"]["down"].data.dtype == jnp.int8
    assert eng.dparams["fc"].data.dtype == quant.FP8 and DRAFT_HEAD not in eng.dparams
