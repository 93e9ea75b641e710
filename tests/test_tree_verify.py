"""Tree verification on the hybrid target: every slot sees exactly its root->slot path, and committing the
accepted path (K/V into pages, GDN state materialised from the verify scratch) continues exactly like AR."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dflash_jax as dj
from conftest import FIXTURES
from dflash_jax.models import qwen36, tree_ops
from dflash_jax.state import KVPages, RecurrentSlots, StepInput, TreeInput

PAGE, WIDTH, N = 8, 24, 8


@functools.lru_cache(maxsize=None)
def target(name):
    return dj.load_target(os.path.join(FIXTURES, name), dtype="float32")


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prefill(params, cfg, tokens, n, kv, rec):
    t = tokens.shape[1]
    inp = StepInput(tokens=tokens, positions=jnp.arange(t, dtype=jnp.int32)[None], n_valid=n,
                    slots=jnp.ones((1,), jnp.int32), page_table=jnp.arange(1, WIDTH + 1, dtype=jnp.int32)[None])
    h, kv, rec, _ = qwen36.forward(params, cfg, inp, kv, rec)
    return kv, rec


@functools.partial(jax.jit, static_argnames=("cfg",))
def _verify(params, cfg, tree, kv, rec):
    h, scratch, _ = qwen36.forward_tree(params, cfg, tree, kv, rec)
    return qwen36.lm_logits(params, h), scratch


@functools.partial(jax.jit, static_argnames=("cfg",))
def _commit(cfg, kv, rec, tree, scratch, accepted, n_acc):
    return qwen36.commit_tree(cfg, kv, rec, tree, scratch, accepted, n_acc)


def _state_after_prompt(t, prompt):
    cfg = t.config
    kv = KVPages.zeros(cfg, WIDTH + 1, PAGE, jnp.float32)
    rec = RecurrentSlots.zeros(cfg, 2, jnp.float32)
    tok = np.zeros((1, 64), np.int32)
    tok[0, :len(prompt)] = prompt
    return _prefill(t.params, cfg, jnp.asarray(tok), jnp.asarray([len(prompt)], jnp.int32), kv, rec)


def _tree_input(tokens, parents, start):
    parents = np.asarray(parents, np.int32)[None]
    depth = np.asarray(tree_ops.tree_depth(jnp.asarray(parents)))
    valid = np.ones_like(parents, bool)
    valid[0, 1:] = parents[0, 1:] >= 0
    return TreeInput(tokens=jnp.asarray(np.asarray(tokens, np.int32)[None]), positions=jnp.asarray(start + depth),
                     parents=jnp.asarray(parents), ancestors=tree_ops.tree_ancestors(jnp.asarray(parents)),
                     valid=jnp.asarray(valid), start=jnp.asarray([start], jnp.int32), slots=jnp.ones((1,), jnp.int32),
                     page_table=jnp.arange(1, WIDTH + 1, dtype=jnp.int32)[None])


def _path(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


@st.composite
def trees(draw):
    """Parent arrays: each slot is padding (-1) or hangs below an earlier non-padding slot."""
    parents = [-1]
    for i in range(1, N):
        live = [j for j in range(i) if j == 0 or parents[j] >= 0]
        parents.append(-1 if draw(st.integers(0, 4)) == 0 else draw(st.sampled_from(live)))
    return parents


@settings(max_examples=8, deadline=None)
@given(parents=trees(), seed=st.integers(0, 10_000))
def test_every_slot_sees_exactly_its_path(parents, seed):
    t = target("qwen36_tiny_a")
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, t.config.vocab_size, 13).tolist()
    toks = rng.integers(0, t.config.vocab_size, N).tolist()
    kv, rec = _state_after_prompt(t, prompt[:-1])
    toks[0] = prompt[-1]  # the root is the last prompt token, not yet in the cache
    logits, _ = _verify(t.params, t.config, _tree_input(toks, parents, len(prompt) - 1), kv, rec)
    for i in range(N):
        if i and parents[i] < 0:
            continue  # padding slot
        ref = np.asarray(t.logits(prompt[:-1] + [toks[j] for j in _path(parents, i)]))[-1]
        np.testing.assert_allclose(np.asarray(logits[0, i]), ref, atol=2e-4)


@pytest.mark.parametrize("name", ["qwen36_tiny_a", "qwen36_tiny_b"])
def test_greedy_tree_decoding_equals_ar_greedy(name):
    """Trees mixing the true continuation with random branches; accept greedily; commit; repeat."""
    t = target(name)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, t.config.vocab_size, 11).tolist()
    want = t.greedy(prompt, 24)
    kv, rec = _state_after_prompt(t, prompt)
    out = [int(np.argmax(np.asarray(t.logits(prompt))[-1]))]  # first token from the prefill
    n_cached = len(prompt)
    accepted_lens = []
    while len(out) < 24:
        truth = want[len(out):]  # the target's own continuation after the pending root
        m = int(min(rng.integers(0, N), len(truth)))  # a spine of m correct tokens ...
        parents, toks = [-1] + list(range(m)), [out[-1]] + truth[:m]
        for i in range(m + 1, N):  # ... then random branches, and the last slot as padding
            parents.append(int(rng.integers(0, i)) if i < N - 1 else -1)
            toks.append(int(rng.integers(0, t.config.vocab_size)))
        tree = _tree_input(toks, parents, n_cached)
        logits, scratch = _verify(t.params, t.config, tree, kv, rec)
        y = np.asarray(jnp.argmax(logits[0], -1))
        path, cur = [0], 0
        while True:  # greedy walk: follow the child whose token is the target's choice
            kids = [j for j in range(N) if parents[j] == cur and toks[j] == y[cur]]
            if not kids:
                break
            cur = kids[0]
            path.append(cur)
        acc = np.full((1, N), -1, np.int32)
        acc[0, :len(path)] = path
        kv, rec = _commit(t.config, kv, rec, tree, scratch, jnp.asarray(acc), jnp.asarray([len(path)], jnp.int32))
        n_cached += len(path)
        out += [toks[j] for j in path[1:]] + [int(y[cur])]
        accepted_lens.append(len(path))
    assert out[:24] == want
    assert max(accepted_lens) > 1  # the spine was accepted at least once: commit of multi-token paths is exercised
