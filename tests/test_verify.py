"""Tree acceptance: greedy walk vs a Python reference, whole-path acceptance, padding never accepted, per-slot
sampling, and losslessness of the sampled (target-only) walk by chi-square tests against a fixed target."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from dflash_jax.spec import ddtree
from dflash_jax.spec.verify import accept_greedy, accept_sampled, sample_per_slot

_build = jax.jit(ddtree.build_tree, static_argnames=("budget", "top_k", "chain_seed"))
greedy_walk = jax.jit(accept_greedy)
sampled_walk = jax.jit(accept_sampled)
sample = jax.jit(sample_per_slot)
B = 4


def build(lp, budget, top_k=None, chain_seed=False):
    return _build(lp, budget=budget, top_k=top_k, chain_seed=chain_seed)


def draft_logprobs(rng, bsz, L, V, scale=2.0):
    x = rng.normal(size=(bsz, L, V)) * scale
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


def reference_walk(tokens, parent, valid, y):
    """§4.3: cur = root; while some valid child of cur has token y[cur]: cur = that child."""
    acc, cur = [0], 0
    while True:
        kids = [i for i in range(1, len(tokens)) if valid[i] and parent[i] == cur and tokens[i] == y[cur]]
        assert len(kids) <= 1
        if not kids:
            return acc, int(y[cur])
        cur = kids[0]
        acc.append(cur)


def check_against_reference(tree, y, slots, n_acc, bonus):
    L = tree.max_depth
    assert slots.shape == (y.shape[0], L + 1)
    for b in range(y.shape[0]):
        tok, par, val = (np.asarray(getattr(tree, k)[b]) for k in ("tokens", "parent", "valid"))
        acc, bon = reference_walk(tok, par, val, y[b])
        assert list(slots[b, :len(acc)]) == acc
        assert (slots[b, len(acc):] == -1).all()
        assert n_acc[b] == len(acc) and bonus[b] == bon
        assert val[slots[b, :n_acc[b]]].all(), "padding is never accepted"


# (L, V, budget, top_k, chain_seed): padded (2, 2, 9) included
CONFIGS = st.sampled_from([(3, 5, 6, None, False), (2, 2, 9, None, True), (4, 3, 10, 2, True), (4, 6, 8, 3, False)])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=CONFIGS, seed=st.integers(0, 2**31 - 1), p_follow=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_accept_greedy_matches_reference_walk(cfg, seed, p_follow):
    L, V, budget, top_k, chain = cfg
    rng = np.random.default_rng(seed)
    tree = build(draft_logprobs(rng, B, L, V), budget, top_k, chain)
    tok, par, val = (np.asarray(getattr(tree, k)) for k in ("tokens", "parent", "valid"))
    # target tokens: with prob p_follow copy the token of a random valid child (so walks go deep), else random
    y = rng.integers(0, V, size=tok.shape).astype(np.int32)
    for b in range(B):
        for i in range(budget + 1):
            kids = [j for j in range(1, budget + 1) if val[b, j] and par[b, j] == i]
            if kids and rng.random() < p_follow:
                y[b, i] = tok[b, rng.choice(kids)]
    out = [np.asarray(x) for x in greedy_walk(tree, jnp.asarray(y))]
    check_against_reference(tree, y, *out)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=CONFIGS, seed=st.integers(0, 2**31 - 1))
def test_path_in_tree_is_fully_accepted(cfg, seed):
    L, V, budget, top_k, chain = cfg
    rng = np.random.default_rng(seed)
    tree = build(draft_logprobs(rng, B, L, V), budget, top_k, chain)
    tok, par, val = (np.asarray(getattr(tree, k)) for k in ("tokens", "parent", "valid"))
    y = rng.integers(0, V, size=tok.shape).astype(np.int32)
    want_path, want_bonus = [], []
    for b in range(B):
        v = int(rng.choice(np.flatnonzero(val[b])))  # any valid slot, root included
        path = [v]
        while path[-1] != 0:
            path.append(int(par[b, path[-1]]))
        path = path[::-1]
        for a, c in zip(path[:-1], path[1:]):
            y[b, a] = tok[b, c]  # the target agrees with the drafted path
        kids = {int(tok[b, j]) for j in range(1, budget + 1) if val[b, j] and par[b, j] == v}
        free = [x for x in range(V) if x not in kids]
        if free:
            y[b, v] = rng.choice(free)  # ... and then disagrees with every child of v
        want_path.append(path)
        want_bonus.append(int(y[b, v]) if free else None)
    slots, n_acc, bonus = (np.asarray(x) for x in greedy_walk(tree, jnp.asarray(y)))
    for b in range(B):
        path = want_path[b]
        assert list(slots[b, :len(path)]) == path
        if want_bonus[b] is not None:
            assert n_acc[b] == len(path) and bonus[b] == want_bonus[b]
            assert (slots[b, len(path):] == -1).all()


def test_padding_token_never_accepted():
    # 6 real nodes + 3 padding slots (token 0, parent root); the target says 0 everywhere
    rng = np.random.default_rng(0)
    tree = build(draft_logprobs(rng, B, 2, 2), 9, None, True)
    assert not np.asarray(tree.valid).all()
    y = np.zeros((B, 10), np.int32)
    slots, n_acc, bonus = (np.asarray(x) for x in greedy_walk(tree, jnp.asarray(y)))
    check_against_reference(tree, y, slots, n_acc, bonus)
    val = np.asarray(tree.valid)
    for b in range(B):
        assert val[b, slots[b, :n_acc[b]]].all()
        assert n_acc[b] == 3  # root -> the depth-1 node with token 0 -> the depth-2 node with token 0
    # the sampled walk is the same walk
    for a, c in zip((slots, n_acc, bonus), accept_sampled(tree, jnp.asarray(y))):
        np.testing.assert_array_equal(a, np.asarray(c))


# ---------------------------------------------------------------------------------------------------------------
# per-slot sampling


# every sample call in this file uses one shape [NB, 7, 5] (one compile)
NB, NS, NV = 20000, 7, 5


def const_logits(p):
    return jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (NB, NS, NV))


def test_sample_per_slot_greedy_rows_and_determinism():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(NB, NS, NV)), jnp.float32)
    temp = jnp.asarray(rng.choice([0.0, 1.0, 0.8], NB), jnp.float32).at[:3].set(jnp.array([0.0, 1.0, 0.8]))
    top_k = jnp.zeros(NB, jnp.int32).at[2].set(1)
    top_p = jnp.ones(NB)
    seed = jnp.asarray(rng.integers(0, 2**32, NB), jnp.uint32)
    step = jnp.asarray(rng.integers(0, 100, NB), jnp.int32)
    a = np.asarray(sample(logits, temp, top_k, top_p, seed, step))
    b = np.asarray(sample(logits, temp, top_k, top_p, seed, step))
    np.testing.assert_array_equal(a, b)
    argmax = np.asarray(jnp.argmax(logits, -1))
    np.testing.assert_array_equal(a[0], argmax[0])  # temperature 0 -> argmax
    np.testing.assert_array_equal(a[2], argmax[2])  # top_k 1 -> argmax
    np.testing.assert_array_equal(a[np.asarray(temp) == 0], argmax[np.asarray(temp) == 0])
    # all-greedy batches take the argmax path too
    g = np.asarray(sample(logits, jnp.zeros(NB), top_k, top_p, seed, step))
    np.testing.assert_array_equal(g, argmax)
    # a row's draws depend only on its own seed and step, not on its place in the batch
    perm = rng.permutation(NB)
    other = np.asarray(sample(logits[perm], temp[perm], top_k[perm], top_p[perm], seed[perm], step[perm]))
    np.testing.assert_array_equal(other, a[perm])
    # a different step gives different draws
    c = np.asarray(sample(logits, temp, top_k, top_p, seed, step + 1))
    assert (c[np.asarray(temp) > 0] != a[np.asarray(temp) > 0]).mean() > 0.2


def test_sample_per_slot_slots_independent_and_distributed():
    # every slot sees the same logits: slots must still draw independently, each from softmax(logits)
    p = np.array([0.1, 0.2, 0.3, 0.15, 0.25])
    tok = np.asarray(sample(const_logits(p), jnp.ones(NB), jnp.zeros(NB, jnp.int32), jnp.ones(NB),
                            jnp.arange(NB, dtype=jnp.uint32), jnp.full(NB, 3, jnp.int32)))
    counts = np.bincount(tok.ravel(), minlength=NV)
    assert stats.chisquare(counts, p * tok.size).pvalue > 1e-3
    # independence of two slots of a row: joint of (slot 0, slot 3) is the product
    joint = np.bincount(tok[:, 0] * NV + tok[:, 3], minlength=NV * NV)
    assert stats.chisquare(joint, np.outer(p, p).ravel() * NB).pvalue > 1e-3


def test_sample_per_slot_top_k_top_p():
    p = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
    seeds = jnp.arange(NB, dtype=jnp.uint32)
    step = jnp.zeros(NB, jnp.int32)
    tk = np.asarray(sample(const_logits(p), jnp.ones(NB), jnp.full(NB, 2, jnp.int32), jnp.ones(NB), seeds, step))
    assert set(np.unique(tk)) == {1, 3}
    tp = np.asarray(sample(const_logits(p), jnp.ones(NB), jnp.zeros(NB, jnp.int32), jnp.full(NB, 0.75), seeds, step))
    assert set(np.unique(tp)) == {1, 3, 4}  # 0.4 + 0.3 < 0.75 -> the third-ranked token is kept too
    # top-p over what top-k left, renormalised (vLLM's and transformers' order): 0.4 / 0.7 >= 0.55 -> one token
    kp = np.asarray(sample(const_logits(p), jnp.ones(NB), jnp.full(NB, 2, jnp.int32), jnp.full(NB, 0.55), seeds, step))
    assert set(np.unique(kp)) == {1}
    # min-p: p >= 0.35 x 0.4 = 0.14 keeps ranks 0-2; top-p 0.85 over (0.4, 0.3, 0.15) / 0.85 keeps all three
    mp = np.asarray(sample(const_logits(p), jnp.ones(NB), jnp.zeros(NB, jnp.int32), jnp.full(NB, 0.85), seeds, step,
                           jnp.full(NB, 0.35)))
    assert set(np.unique(mp)) == {1, 3, 4}
    # min-p after temperature: at T=0.5 the ratios square (0.3/0.4)^2 = 0.5625 -> 0.6 keeps only the top token
    mt = np.asarray(sample(const_logits(p), jnp.full(NB, 0.5), jnp.zeros(NB, jnp.int32), jnp.ones(NB), seeds, step,
                           jnp.full(NB, 0.6)))
    assert set(np.unique(mt)) == {1}


# ---------------------------------------------------------------------------------------------------------------
# losslessness of the sampled walk


def transform(p, temperature, top_k, top_p, min_p=0.0):
    """The distribution sample_per_slot draws from, given target probabilities p [..., V] (numpy): temperature,
    then min-p and top-k, then top-p over what is left."""
    lg = np.log(p) / temperature
    q = np.exp(lg - lg.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    order = np.argsort(-q, -1, kind="stable")
    srt = np.take_along_axis(q, order, -1)
    rank = np.arange(p.shape[-1])
    keep = srt >= min_p * srt[..., :1]
    if top_k > 0:
        keep &= rank < top_k
    left = np.where(keep, srt, 0)
    left = left / left.sum(-1, keepdims=True)
    before = np.cumsum(left, -1) - left
    keep &= (before < top_p) | (rank == 0)
    srt = np.where(keep, srt, 0)
    out = np.zeros_like(q)
    np.put_along_axis(out, order, srt, -1)
    return out / out.sum(-1, keepdims=True)


def emitted_first_two(T, tree, root, temperature, top_k, top_p, min_p, seeds):
    """Run up to two verify rounds of the sampled walk against a fixed target and return the first two tokens.

    The target is a position-dependent Markov chain: p(x_{k+1} | x_<=k) = T[k, x_k], independent of the draft. Slot i
    of a round whose root sits at position k0 holds the token at position k0 + depth(i), so its target distribution
    is T[k0 + depth(i), token(i)].
    """
    nb, n = tree.tokens.shape
    tok = np.asarray(tree.tokens).copy()
    depth = np.asarray(tree.depth)
    args = (jnp.full(nb, temperature, jnp.float32), jnp.full(nb, top_k, jnp.int32), jnp.full(nb, top_p, jnp.float32),
            jnp.asarray(seeds, jnp.uint32))
    mp = jnp.full(nb, min_p, jnp.float32)
    rows = np.arange(nb)

    def one_round(k0, root_tok, step):
        tok[:, 0] = root_tok
        logits = jnp.log(jnp.asarray(T[k0[:, None] + depth, tok], jnp.float32))  # [nb, N, V]
        y = sample(logits, *args, jnp.asarray(step, jnp.int32), mp)
        slots, n_acc, bonus = (np.asarray(x) for x in sampled_walk(tree, y))
        # emitted tokens: the accepted nodes after the root, then the bonus
        emitted = np.full((nb, slots.shape[1]), -1)
        for d in range(1, slots.shape[1]):
            emitted[:, d - 1] = np.where(d < n_acc, tok[rows, np.maximum(slots[:, d], 0)], -1)
        emitted[rows, n_acc - 1] = bonus
        return emitted, n_acc

    e1, n1 = one_round(np.zeros(nb, int), np.full(nb, root), np.zeros(nb))
    first = e1[:, 0]
    e2, _ = one_round(n1.astype(int), e1[rows, n1 - 1], n1)  # next round: root = bonus at position n1
    second = np.where(n1 >= 2, e1[:, 1], e2[:, 0])
    return first, second, n1


def chi2_pvalue(counts, probs):
    exp = probs * counts.sum()
    keep = exp >= 5  # pool sparse cells
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(exp[keep], exp[~keep].sum())
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0  # draws where the target has no mass
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 3, 0.95, 0.0),
                                                           (1.3, 0, 0.9, 0.15)])
def test_sampled_walk_is_lossless(temperature, top_k, top_p, min_p):
    V, L, budget, nb, root = 5, 3, 6, 20000, 2
    rng = np.random.default_rng(1234)
    T = rng.dirichlet(np.full(V, 1.5), size=(2 * (L + 1), V))  # [positions, prev token, next token]
    # the draft: a noisy guess of the target's unconditional marginals per depth, varying per row, so trees
    # differ and the walk accepts often (about half of the rows accept at least one node)
    guess = np.log(T.mean(1))[1:L + 1]
    draft = guess[None] + 0.7 * rng.normal(size=(nb, L, V))
    tree = build(jnp.asarray(jax.nn.log_softmax(jnp.asarray(draft, jnp.float32), -1)), budget, None, False)
    first, second, n1 = emitted_first_two(T, tree, root, temperature, top_k, top_p, min_p, rng.integers(0, 2**32, nb))
    assert 0.3 < (n1 > 1).mean() and (n1 > 2).mean() > 0.05, "the test must exercise acceptance"

    p1 = transform(T[0, root], temperature, top_k, top_p, min_p)  # [V]
    p12 = p1[:, None] * transform(T[1], temperature, top_k, top_p, min_p)  # [V, V]
    c1 = np.bincount(first, minlength=V)
    c12 = np.bincount(first * V + second, minlength=V * V)
    assert chi2_pvalue(c1, p1) > 1e-3
    assert chi2_pvalue(c12, p12.ravel()) > 1e-3

    # power: the same counts reject a target that is off by 2 percentage points
    biased = p1.copy()
    hi, lo = np.argmax(np.where(p1 > 0, p1, -1)), np.argmin(np.where(p1 > 0, p1, 2))
    biased[hi] -= 0.02
    biased[lo] += 0.02
    assert chi2_pvalue(c1, biased) < 1e-4
    biased12 = p12.ravel().copy()
    hi, lo = np.argmax(biased12), np.argmin(np.where(biased12 > 0.01, biased12, 2))
    biased12[hi] -= 0.02
    biased12[lo] += 0.02
    assert chi2_pvalue(c12, biased12) < 1e-4
