"""DDTree builder: structural invariants, equality with the heapq reference and the brute-force best prefixes,
chain seeding, padding, positions. CPU, continuous random logits (no score ties)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_jax.spec import ddtree
from dflash_jax.spec.ddtree import brute_force_prefixes, build_tree_reference, tree_paths

_build = jax.jit(ddtree.build_tree, static_argnames=("budget", "top_k", "chain_seed", "level_bonus"))


def build(lp, budget, top_k=None, chain_seed=False, level_bonus=0.0):
    """Always pass every static argument, so equal configs share one jit cache entry."""
    return _build(lp, budget=budget, top_k=top_k, chain_seed=chain_seed, level_bonus=level_bonus)
B = 3


def draft_logprobs(seed: int, bsz: int, L: int, V: int, scale: float = 2.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(bsz, L, V)) * scale
    x = x - x.max(-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


def row(tree, b) -> dict:
    return {k: np.asarray(getattr(tree, k)[b]) for k in ("tokens", "parent", "depth", "score", "valid", "ancestors")}


def check_invariants(t: dict, lp: np.ndarray, budget: int, k: int, bonus: float = 0.0):
    L, V = lp.shape
    n = budget + 1
    tokens, parent, depth, score, valid, anc = (
        t[x] for x in ("tokens", "parent", "depth", "score", "valid", "ancestors"))
    assert tokens.shape == parent.shape == depth.shape == score.shape == valid.shape == (n,)
    assert anc.shape == (n, n)
    assert valid[0] and tokens[0] == -1 and parent[0] == -1 and depth[0] == 0 and score[0] == 0
    n_valid = int(valid.sum())
    assert n_valid - 1 <= budget
    assert valid[:n_valid].all() and not valid[n_valid:].any(), "padding only at the tail"
    topk_ids = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    for i in range(1, n_valid):
        p = parent[i]
        assert 0 <= p < i and valid[p], "parents precede children"
        assert depth[i] == depth[p] + 1 and 1 <= depth[i] <= L
        assert tokens[i] in topk_ids[depth[i] - 1]
        np.testing.assert_allclose(score[i], score[p] + lp[depth[i] - 1, tokens[i]] + bonus, rtol=1e-5, atol=1e-5)
    for i in range(n_valid, n):  # padding
        assert tokens[i] == 0 and parent[i] == 0 and depth[i] == 1 and score[i] == -np.inf
    # ancestors = reflexive-transitive closure of parent (valid rows); padding rows see only themselves
    want = np.eye(n, dtype=bool)
    for i in range(1, n_valid):
        j = i
        while j >= 0:
            want[i, j] = True
            j = parent[j] if j > 0 else -1
    np.testing.assert_array_equal(anc, want)
    assert not anc[:n_valid, n_valid:].any(), "padding is invisible to valid slots"
    # siblings carry distinct tokens
    for p in range(n_valid):
        kids = [tokens[i] for i in range(1, n_valid) if parent[i] == p]
        assert len(kids) == len(set(kids))


def boundary_tie(ranked, budget, eps=1e-4) -> bool:
    return len(ranked) > budget and budget > 0 and ranked[budget - 1][1] - ranked[budget][1] < eps


# A fixed menu of static configs (L, V, budget, top_k, chain_seed): each compiles once, hypothesis varies the logits.
CONFIGS = st.sampled_from([
    (1, 5, 3, None, False),  # single depth: siblings only
    (2, 2, 9, None, False),  # 6 prefixes < budget: padding
    (2, 2, 9, None, True),
    (3, 5, 6, None, False),
    (3, 5, 6, None, True),
    (3, 8, 10, 3, False),
    (4, 3, 16, 2, True),
    (4, 8, 1, None, False),  # budget 1
    (4, 5, 3, 1, True),  # top_k 1 and chain longer than the budget
    (4, 5, 10, 2, False),
])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=CONFIGS, seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.5, 2.0, 6.0]))
def test_build_tree_properties(cfg, seed, scale):
    L, V, budget, top_k, chain = cfg
    lp = draft_logprobs(seed, B, L, V, scale)
    tree = build(lp, budget=budget, top_k=top_k, chain_seed=chain)
    assert tree.max_depth == L
    k = min(budget, V) if top_k is None else min(top_k, V)
    for b in range(B):
        t = row(tree, b)
        check_invariants(t, lp[b], budget, k)

        # jitted == heapq reference (same pop order: no ties with continuous logits)
        ref = build_tree_reference(lp[b], budget, top_k, chain_seed=chain)
        for key in ("tokens", "parent", "depth", "valid", "ancestors"):
            np.testing.assert_array_equal(t[key], ref[key], err_msg=key)
        np.testing.assert_allclose(t["score"], ref["score"], rtol=1e-6)

        # brute force: the pure heap returns the `budget` best prefixes; chain seeding returns the top-1 chain
        # plus the best (budget - C) of the remaining prefixes
        paths = [p for p in tree_paths(t["tokens"], t["parent"], t["valid"])[1:] if p is not None]
        scores = {p: s for p, s in zip(tree_paths(t["tokens"], t["parent"], t["valid"])[1:], t["score"][1:])
                  if p is not None}
        ranked = brute_force_prefixes(lp[b], budget, top_k)
        greedy = tuple(int(x) for x in np.argmax(lp[b], -1))
        if chain:
            c = min(L, budget)
            chain_paths = [greedy[:d] for d in range(1, c + 1)]
            assert paths[:c] == chain_paths, "chain first, in depth order"
            rest = [r for r in ranked if r[0] not in set(chain_paths)]
            if boundary_tie(rest, budget - c):
                continue
            want = chain_paths + [r[0] for r in rest[:budget - c]]
        else:
            if boundary_tie(ranked, budget):
                continue
            want = [r[0] for r in ranked[:budget]]
            assert np.all(np.diff(t["score"][t["valid"]][1:]) <= 1e-6), "best-first pop order"
        assert sorted(paths) == sorted(want)
        assert len(paths) == min(budget, len(ranked))
        for p, s in ranked:
            if p in scores:
                np.testing.assert_allclose(scores[p], s, rtol=1e-5, atol=1e-5)


# The tests below reuse the property test's static configs (and B), so they hit the jit cache.


def test_pop_order_matches_brute_force_ranking():
    lp = draft_logprobs(7, B, 3, 8)
    tree = build(lp, budget=10, top_k=3)
    for b in range(B):
        t = row(tree, b)
        paths = tree_paths(t["tokens"], t["parent"], t["valid"])[1:]
        ranked = brute_force_prefixes(lp[b], 10, 3)
        assert paths == [r[0] for r in ranked[:10]]


def test_padding_when_budget_exceeds_prefixes():
    # L=2, V=2: only 2 + 4 = 6 prefixes; budget 9 leaves 3 padding slots
    lp = draft_logprobs(3, B, 2, 2)
    for chain in (False, True):
        tree = build(lp, budget=9, chain_seed=chain)
        for b in range(B):
            t = row(tree, b)
            check_invariants(t, lp[b], 9, 2)
            assert t["valid"].sum() == 7
            assert sorted(p for p in tree_paths(t["tokens"], t["parent"], t["valid"]) if p) == sorted(
                r[0] for r in brute_force_prefixes(lp[b], 9))


def test_chain_seed_contains_greedy_chain_even_when_unlikely():
    # near-flat marginals make the pure heap spend the budget on depth-1 siblings; the seeded tree keeps the chain
    L, V = 3, 5
    lp = draft_logprobs(11, B, L, V, scale=0.05)
    tree = build(lp, budget=6, chain_seed=True)
    plain = build(lp, budget=6)
    for b in range(B):
        t = row(tree, b)
        greedy = tuple(int(x) for x in np.argmax(lp[b], -1))
        paths = tree_paths(t["tokens"], t["parent"], t["valid"])
        assert paths[1:L + 1] == [greedy[:d] for d in range(1, L + 1)]
        assert int(np.asarray(plain.depth[b]).max()) < L  # the unseeded tree does not reach full depth here
    short = row(build(lp, budget=3, top_k=1, chain_seed=True), 0)  # L=4 > budget: the chain is cut at the budget
    assert list(short["parent"]) == [-1, 0, 1, 2]


def test_top_k_one_is_the_chain():
    lp = draft_logprobs(5, B, 4, 5)
    tree = build(lp, budget=3, top_k=1, chain_seed=True)
    t = row(tree, 1)
    assert list(t["parent"]) == [-1, 0, 1, 2]
    assert list(t["tokens"][1:]) == list(np.argmax(lp[1], -1)[:3])


def test_positions_and_root():
    lp = draft_logprobs(2, B, 3, 5)
    tree = build(lp, budget=6)
    start = jnp.array([10, 37, 0], jnp.int32)
    pos = np.asarray(ddtree.positions(tree, start))
    np.testing.assert_array_equal(pos, np.asarray(start)[:, None] + np.asarray(tree.depth))
    assert (pos[:, 0] == np.asarray(start)).all()
    rooted = tree.with_root(jnp.array([4, 9, 1]))
    np.testing.assert_array_equal(np.asarray(rooted.tokens[:, 0]), [4, 9, 1])
    np.testing.assert_array_equal(np.asarray(rooted.tokens[:, 1:]), np.asarray(tree.tokens[:, 1:]))


def test_tree_is_a_pytree_through_jit():
    lp = draft_logprobs(4, B, 3, 5)
    tree = build(lp, budget=6)
    leaves, _ = jax.tree_util.tree_flatten(tree)
    assert len(leaves) == 6
    same = jax.jit(lambda t: t)(tree)
    assert same.max_depth == 3
    np.testing.assert_array_equal(np.asarray(same.ancestors), np.asarray(tree.ancestors))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.sampled_from([(3, 5, 6, None, False), (4, 5, 10, 2, False), (3, 5, 6, None, True)]),
       bonus=st.sampled_from([0.3, 1.5]), seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.5, 2.0, 6.0]))
def test_level_bonus_tree_is_valid_and_equals_the_reference(cfg, bonus, seed, scale):
    """A level bonus adds c per level to every score (a child may then outscore its parent): the tree keeps every
    structural invariant and the jitted builder pops exactly what the heapq reference pops."""
    L, V, budget, top_k, chain = cfg
    lp = draft_logprobs(seed, B, L, V, scale)
    tree = build(lp, budget=budget, top_k=top_k, chain_seed=chain, level_bonus=bonus)
    k = min(budget, V) if top_k is None else min(top_k, V)
    for b in range(B):
        t = row(tree, b)
        check_invariants(t, lp[b], budget, k, bonus)
        ref = build_tree_reference(lp[b], budget, top_k, chain_seed=chain, level_bonus=bonus)
        for key in ("tokens", "parent", "depth", "valid", "ancestors"):
            np.testing.assert_array_equal(t[key], ref[key], err_msg=key)
        np.testing.assert_allclose(t["score"], ref["score"], rtol=1e-6)


def test_level_bonus_deepens_the_tree_towards_the_chain():
    """The bonus trades width for depth: on this draft the total depth grows with it, and past every log-prob gap the
    first L pops are the drafter's top-1 chain (each child then outscores every remaining sibling)."""
    L, V, budget = 4, 8, 10
    lp = draft_logprobs(3, B, L, V, 2.0)
    depths = [np.asarray(build(lp, budget=budget, level_bonus=c).depth).sum(1) for c in (0.0, 0.5, 2.0, 100.0)]
    assert all(np.all(a <= b) for a, b in zip(depths, depths[1:]))
    t = build(lp, budget=budget, level_bonus=100.0)
    greedy = np.argmax(lp, -1)
    np.testing.assert_array_equal(np.asarray(t.tokens)[:, 1:L + 1], greedy)
    np.testing.assert_array_equal(np.asarray(t.depth)[:, 1:L + 1], np.broadcast_to(np.arange(1, L + 1), (B, L)))


def test_bad_args():
    with pytest.raises(ValueError):
        ddtree.build_tree(jnp.zeros((1, 2, 3)), budget=0)
    with pytest.raises(ValueError):
        ddtree.build_tree(jnp.zeros((1, 2, 3)), budget=2, top_k=0)
