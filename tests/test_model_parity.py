"""The target against transformers' golden fixtures and our own float64 NumPy re-derivation."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
import np_oracle
from conftest import FIXTURES, TINY, YARN
from dflash_jax.engine.compile import CompileWatch
from dflash_jax.models import qwen36
from dflash_jax.state import KVPages, RecurrentSlots, StepInput


@functools.lru_cache(maxsize=None)
def target(name, dtype="float32"):
    return dj.load_target(os.path.join(FIXTURES, name), dtype=dtype)


@functools.lru_cache(maxsize=None)
def golden(name):
    return dict(np.load(os.path.join(FIXTURES, f"{name}_golden.npz")))


@pytest.mark.parametrize("name", TINY + (YARN,))
@pytest.mark.parametrize("j", [0, 1, 2])
def test_logits_match_transformers(name, j):
    g = golden(name)
    logits = np.asarray(target(name).logits(g[f"p{j}.ids"]))
    err = np.abs(logits - g[f"p{j}.logits"]).max()
    assert logits.shape == g[f"p{j}.logits"].shape
    assert err <= 5e-4, f"max abs error {err:.3g} vs transformers"


@pytest.mark.parametrize("name", TINY + (YARN,))
def test_hidden_states_match_transformers(name):
    g = golden(name)
    t = target(name)
    layers = tuple(range(t.config.num_layers - 1))  # the last HF entry is after the final norm
    hs = np.asarray(t.hidden_states(g["p1.ids"], layers))
    ref = g["p1.hidden"][1:t.config.num_layers]
    err = np.abs(hs - ref).max() / max(1.0, np.abs(ref).max())
    assert err <= 5e-4, err


@pytest.mark.parametrize("name", TINY + (YARN,))
def test_float64_matches_numpy_rederivation(name):
    """Exact maths: in float64 the JAX model equals an independent float64 NumPy forward."""
    g = golden(name)
    cfg, w = np_oracle.load_checkpoint(os.path.join(FIXTURES, name))
    ref, _ = np_oracle.forward(cfg, w, g["p2.ids"])
    with jax.enable_x64(True):
        t = dj.load_target(os.path.join(FIXTURES, name), dtype="float64")
        logits = np.asarray(t.logits(g["p2.ids"]))
    assert logits.dtype == np.float64
    assert np.abs(logits - ref).max() <= 1e-5


@pytest.mark.parametrize("name", TINY + (YARN,))
def test_greedy_matches_transformers_generate(name):
    g = golden(name)
    assert target(name).greedy(g["p0.ids"], 16) == g["p0.greedy"].tolist()
    if name == YARN:  # past the 32 positions YaRN stretches: the decode path rotates as transformers does
        assert target(name).greedy(g["p2.ids"], 16) == g["p2.greedy"].tolist()


# ---- chunked prefill + recurrent decode against one full pass -----------------------------------
PAGE = 8


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("kv", "rec"))
def _step(params, cfg, inp, kv, rec):
    h, kv, rec, _ = qwen36.forward(params, cfg, inp, kv, rec)
    return qwen36.lm_logits(params, h), kv, rec


def _inp(tokens, start, n_valid, width):
    t = tokens.shape[1]
    return StepInput(tokens=jnp.asarray(tokens, jnp.int32),
                     positions=(start + jnp.arange(t, dtype=jnp.int32))[None],
                     n_valid=jnp.asarray([n_valid], jnp.int32), slots=jnp.asarray([1], jnp.int32),
                     page_table=jnp.arange(1, width + 1, dtype=jnp.int32)[None])


def run_chunked_then_decode(t, ids, chunk, n_decode):
    """Prefill ids in chunks of ``chunk`` (last one right padded), then decode greedily."""
    cfg = t.config
    width = 32
    kv = KVPages.zeros(cfg, width + 1, PAGE, jnp.float32)
    rec = RecurrentSlots.zeros(cfg, 2, jnp.float32)
    rows = []
    for s in range(0, len(ids), chunk):
        part = ids[s:s + chunk]
        tok = np.zeros((1, chunk), np.int32)
        tok[0, :len(part)] = part
        logits, kv, rec = _step(t.params, cfg, _inp(tok, s, len(part), width), kv, rec)
        rows.append(np.asarray(logits[0, :len(part)]))
    pos, nxt = len(ids), int(np.argmax(rows[-1][-1]))
    out, dec_logits = [], []
    with CompileWatch() as w:
        for i in range(n_decode):
            out.append(nxt)
            logits, kv, rec = _step(t.params, cfg, _inp(np.array([[nxt]]), pos, 1, width), kv, rec)
            dec_logits.append(np.asarray(logits[0, 0]))
            pos, nxt = pos + 1, int(np.argmax(logits[0, 0]))
    return np.concatenate(rows), out, np.stack(dec_logits), w


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_prefill_then_decode_equals_full_pass(chunk):
    name = "qwen36_tiny_a"
    t, g = target(name), golden(name)
    ids = g["p1.ids"][:50]
    prefill, out, dec, _ = run_chunked_then_decode(t, ids, chunk, 8)
    full = np.asarray(t.logits(np.concatenate([ids, out])))
    np.testing.assert_allclose(prefill, full[:len(ids)], atol=1e-4)
    np.testing.assert_allclose(dec, full[len(ids):], atol=1e-4)


def test_decode_continuation_matches_transformers_and_never_recompiles():
    name = "qwen36_tiny_b"
    t, g = target(name), golden(name)
    ids = g["p2.ids"]
    _, out, _, _ = run_chunked_then_decode(t, ids, 64, 2)  # warm-up: compiles prefill and decode
    _, out, _, watch = run_chunked_then_decode(t, ids, 64, 50)
    assert out[:16] == g["p2.greedy"].tolist()
    assert watch.count == 0, f"{watch.count} compilations while decoding 50 tokens after warm-up"


def test_bad_token_ids_are_rejected():
    t = target("qwen36_tiny_a")
    with pytest.raises(ValueError, match="token ids must be in"):
        t.logits([0, t.config.vocab_size])
    with pytest.raises(ValueError, match="empty"):
        t.logits([])


def _yarn_copy(tmp_path, name: str, **rope) -> str:
    """A copy of fixture ``name`` whose config.json asks for YaRN (``rope`` over its rope_parameters)."""
    import json
    import shutil

    d = str(tmp_path / f"{name}_yarn")
    shutil.copytree(os.path.join(FIXTURES, name), d)
    with open(os.path.join(d, "config.json")) as f:
        raw = json.load(f)
    tc = raw.get("text_config", raw)
    tc["rope_parameters"].update(rope_type="yarn", **rope)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(raw, f)
    return d


@pytest.mark.parametrize("rope", [dict(factor=4.0, original_max_position_embeddings=32),
                                  dict(factor=8.0, original_max_position_embeddings=16, beta_fast=8.0,
                                       attention_factor=1.3)],
                         ids=["defaults", "explicit"])
def test_float64_yarn_matches_numpy_rederivation(tmp_path, rope):
    """YaRN: in float64 the JAX model equals the NumPy forward with its own YaRN frequencies, on a prompt past
    the original context; the scaling changes the logits (it is not ignored)."""
    name = TINY[0]
    g = golden(name)
    ids = g["p2.ids"]
    d = _yarn_copy(tmp_path, name, **rope)
    cfg, w = np_oracle.load_checkpoint(d)
    ref, _ = np_oracle.forward(cfg, w, ids)
    with jax.enable_x64(True):
        t = dj.load_target(d, dtype="float64")
        assert t.config.rope_scaling is not None
        logits = np.asarray(t.logits(ids))
        plain = np.asarray(dj.load_target(os.path.join(FIXTURES, name), dtype="float64").logits(ids))
    assert len(ids) > rope["original_max_position_embeddings"]
    assert np.abs(logits - ref).max() <= 1e-5
    assert np.abs(logits - plain).max() > 1e-3
