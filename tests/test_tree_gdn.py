"""Tree verification kernels: the ancestor-masked chunk form of the gated delta rule (`gdn.gdn_tree`, with the
deferred per-node state `gdn.tree_node_state`) and the tree-aware causal conv (`tree_ops.tree_conv`,
`tree_ops.tree_conv_state`) equal the sequential kernels run along every root->node path."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FAST_COMPILE
from dflash_jax.models import gdn, tree_ops
from dflash_jax.models.qwen36 import causal_conv

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)

# compile-bound on CPU: skip the expensive LLVM passes (the HLO numerics are unchanged)
gdn_tree = jax.jit(gdn.gdn_tree, compiler_options=FAST_COMPILE)
node_state = jax.jit(gdn.tree_node_state, compiler_options=FAST_COMPILE)
gdn_recurrent = jax.jit(gdn.gdn_recurrent, compiler_options=FAST_COMPILE)
gdn_chunked = jax.jit(gdn.gdn_chunked, static_argnames="chunk", compiler_options=FAST_COMPILE)
ancestors_of = jax.jit(tree_ops.tree_ancestors, compiler_options=FAST_COMPILE)
tree_conv = jax.jit(tree_ops.tree_conv, compiler_options=FAST_COMPILE)
tree_conv_state = jax.jit(tree_ops.tree_conv_state, compiler_options=FAST_COMPILE)
conv = jax.jit(causal_conv, compiler_options=FAST_COMPILE)


# ---- trees and inputs ----------------------------------------------------------------------------------------------
def random_parents(rng, b, n, pad_frac=0.2):
    """[B,N] parent arrays: slot 0 the root, a random subset of the other slots padding (parent -1, seen by no
    valid slot), valid slots hang off an earlier valid slot (half the time the previous one: deep chains)."""
    par = np.full((b, n), -1, np.int64)
    for r in range(b):
        valid = [0]
        for i in range(1, n):
            if rng.uniform() < pad_frac:
                continue
            par[r, i] = valid[-1] if rng.uniform() < 0.5 else valid[rng.integers(len(valid))]
            valid.append(i)
    return par


def np_ancestors(par):
    b, n = par.shape
    a = np.zeros((b, n, n), bool)
    for r in range(b):
        for i in range(n):
            j = i
            while j >= 0:
                a[r, i, j] = True
                j = par[r, j]
    return a


def paths(par):
    """paths[r][i] = the slots of row r's root->i path, in order."""
    return [[list(np.flatnonzero(row)) for row in a] for a in np_ancestors(par)]


def make_inputs(seed, b, n, h, dk, dv, g_mode, state_scale, dtype):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, n, h, dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dk ** -0.5
    k = rng.standard_normal((b, n, h, dk))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, n, h, dv))
    beta = rng.uniform(1e-3, 1 - 1e-3, (b, n, h))
    if g_mode == "mild":
        g = -rng.uniform(0.0, 0.5, (b, n, h))
    elif g_mode == "strong":
        g = -rng.uniform(0.0, 20.0, (b, n, h))
    elif g_mode == "zero":
        g = np.zeros((b, n, h))
    else:  # mostly mild, some exact zeros, some strongly negative
        r = rng.uniform(size=(b, n, h))
        g = np.where(r < 0.15, -rng.uniform(5.0, 20.0, (b, n, h)),
                     np.where(r < 0.3, 0.0, -rng.uniform(0.0, 0.5, (b, n, h))))
    s0 = state_scale * rng.standard_normal((b, h, dk, dv))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v, beta, g, s0))


def path_reference(par, q, k, v, beta, g, s0):
    """gdn_recurrent along every root->i path at once: row (r, i) of a [B*N, N] batch holds the path left-padded
    with null steps (k = v = beta = g = 0 leave the state exactly unchanged). -> (o [B,N,H,dv], S [B,N,H,dk,dv])."""
    b, n = par.shape
    idx = np.zeros((b * n, n), np.int64)
    live = np.zeros((b * n, n), bool)
    rows = np.repeat(np.arange(b), n)
    for r, ps in enumerate(paths(par)):
        for i, p in enumerate(ps):
            idx[r * n + i, n - len(p):] = p
            live[r * n + i, n - len(p):] = True
    m = live[..., None]
    take = lambda a: np.asarray(a)[rows[:, None], idx]  # gathers in NumPy: eager jnp ops would each compile
    o, s = gdn_recurrent(take(q), take(k) * m[..., None], take(v) * m[..., None], take(beta) * m, take(g) * m,
                         np.asarray(s0)[rows])
    o, s = np.asarray(o), np.asarray(s)
    return o[:, -1].reshape((b, n) + o.shape[2:]), s.reshape((b, n) + s.shape[1:])


def all_node_states(cache, s0, n):
    b = s0.shape[0]
    return np.stack([np.asarray(node_state(cache, s0, np.full((b,), i, np.int32))) for i in range(n)], axis=1)


def assert_close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


# ---- gdn_tree == per-path recurrence ---------------------------------------------------------------------------
def check_tree(seed, b, n, h, dk, dv, g_mode, state_scale, pad_frac, dtype, tol):
    rng = np.random.default_rng(seed)
    par = random_parents(rng, b, n, pad_frac)
    args = make_inputs(seed + 1, b, n, h, dk, dv, g_mode, state_scale, dtype)
    anc = ancestors_of(jnp.asarray(par, jnp.int32))
    np.testing.assert_array_equal(np.asarray(anc), np_ancestors(par))
    o, cache = gdn_tree(*args, anc)
    chex.assert_shape(o, (b, n, h, dv))
    chex.assert_type(o, dtype)
    chex.assert_tree_all_finite((o, cache))
    o_ref, s_ref = path_reference(par, *args)
    assert_close(o, o_ref, tol)
    s_all = all_node_states(cache, args[-1], n)
    chex.assert_type(s_all, dtype)
    assert_close(s_all, s_ref, tol)
    # node < 0 (nothing accepted) keeps S0 exactly
    np.testing.assert_array_equal(np.asarray(node_state(cache, args[-1], jnp.full((b,), -1, jnp.int32))),
                                  np.asarray(args[-1]))
    # a different node per row in one call
    pick = rng.integers(0, n, b)
    s_pick = node_state(cache, args[-1], jnp.asarray(pick, jnp.int32))
    assert_close(s_pick, s_ref[np.arange(b), pick], tol)


tree_shapes = st.fixed_dictionaries({
    "b": st.integers(1, 3), "n": st.integers(1, 24), "h": st.integers(1, 3),
    "dk": st.integers(2, 12), "dv": st.integers(2, 12),
})


@settings(SETTINGS, max_examples=10)
@given(shp=tree_shapes, g_mode=st.sampled_from(["mixed", "strong", "mild", "zero"]),
       state_scale=st.sampled_from([0.0, 1.0, 3.0]), pad_frac=st.sampled_from([0.0, 0.2, 0.5]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_tree_matches_path_recurrence_fp32(shp, g_mode, state_scale, pad_frac, seed):
    check_tree(seed, shp["b"], shp["n"], shp["h"], shp["dk"], shp["dv"], g_mode, state_scale, pad_frac,
               jnp.float32, 1e-4)


@settings(SETTINGS, max_examples=5)
@given(shp=tree_shapes, g_mode=st.sampled_from(["mixed", "strong", "mild"]), pad_frac=st.sampled_from([0.0, 0.3]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_tree_matches_path_recurrence_fp64(shp, g_mode, pad_frac, seed):
    with jax.enable_x64(True):
        check_tree(seed, shp["b"], shp["n"], shp["h"], shp["dk"], shp["dv"], g_mode, 1.0, pad_frac,
                   jnp.float64, 1e-10)


def test_chain_tree_is_the_sequence():
    """parent[i] = i-1: gdn_tree == gdn_chunked == gdn_recurrent, and the state after slot i is the state after
    i+1 tokens of the sequence."""
    b, n, h, dk, dv = 2, 19, 3, 8, 6
    args = make_inputs(3, b, n, h, dk, dv, "mixed", 1.0, jnp.float32)
    par = np.broadcast_to(np.arange(n) - 1, (b, n))
    o, cache = gdn_tree(*args, ancestors_of(jnp.asarray(par, jnp.int32)))
    o_r, s_r = gdn_recurrent(*args)
    o_c, s_c = gdn_chunked(*args, chunk=8)
    assert_close(o, o_r, 1e-4)
    assert_close(o, o_c, 1e-4)
    assert_close(node_state(cache, args[-1], jnp.full((b,), n - 1, jnp.int32)), s_r, 1e-4)
    assert_close(node_state(cache, args[-1], jnp.full((b,), n - 1, jnp.int32)), s_c, 1e-4)
    # the state after slot i is the state after the first i+1 tokens
    _, s_prefix = path_reference(par, *args)
    assert_close(all_node_states(cache, args[-1], n), s_prefix, 1e-4)


def test_every_node_state_at_once_equals_one_at_a_time():
    """The fast-rollback form (all slots' states, then select) equals the per-node materialisation."""
    b, n, h, dk, dv = 2, 11, 3, 8, 6
    rng = np.random.default_rng(4)
    par = random_parents(rng, b, n, 0.2)
    args = make_inputs(5, b, n, h, dk, dv, "mixed", 1.0, jnp.float32)
    _, cache = gdn_tree(*args, ancestors_of(jnp.asarray(par, jnp.int32)))
    every = jax.jit(gdn.tree_node_states, compiler_options=FAST_COMPILE)(cache, args[-1])
    assert every.shape == (b, n, h, dk, dv)
    assert_close(every, all_node_states(cache, args[-1], n), 1e-5)


def test_padding_slots_do_not_touch_valid_slots():
    """Appending padding slots (lone roots with garbage inputs) leaves the valid slots' outputs and states alone."""
    b, n, npad, h, dk, dv = 2, 9, 7, 2, 8, 8
    rng = np.random.default_rng(0)
    par = random_parents(rng, b, n, 0.0)
    q, k, v, beta, g, s0 = make_inputs(1, b, n + npad, h, dk, dv, "mixed", 1.0, jnp.float32)
    v = v.at[:, n:].mul(1e3)
    g = g.at[:, n:].set(-50.0)
    par_pad = np.concatenate([par, np.full((b, npad), -1)], axis=1)
    o_pad, c_pad = gdn_tree(q, k, v, beta, g, s0, ancestors_of(jnp.asarray(par_pad, jnp.int32)))
    sl = lambda a: a[:, :n]
    o, c = gdn_tree(sl(q), sl(k), sl(v), sl(beta), sl(g), s0, ancestors_of(jnp.asarray(par, jnp.int32)))
    assert_close(o_pad[:, :n], o, 1e-6)
    assert_close(all_node_states(c_pad, s0, n), all_node_states(c, s0, n), 1e-6)


def test_strong_decay_is_finite():
    """g = -60 on every slot of a deep tree: e^gam underflows, nothing may become inf/nan."""
    b, n, h, dk, dv = 1, 24, 2, 8, 8
    q, k, v, beta, g, s0 = make_inputs(5, b, n, h, dk, dv, "zero", 3.0, jnp.float32)
    g = jnp.full_like(g, -60.0)
    par = random_parents(np.random.default_rng(5), b, n, 0.0)
    o, cache = gdn_tree(q, k, v, beta, g, s0, ancestors_of(jnp.asarray(par, jnp.int32)))
    s_all = all_node_states(cache, s0, n)
    chex.assert_tree_all_finite((o, s_all))
    o_ref, s_ref = path_reference(par, q, k, v, beta, g, s0)
    assert_close(o, o_ref, 1e-4)
    assert_close(s_all, s_ref, 1e-4)


# ---- tree conv == causal_conv along every path ------------------------------------------------------------------
def conv_path_reference(par, x, w, s0):
    """causal_conv along every root->i path: row (r, i) of a [B*N, N] batch holds the path right-padded, n_valid
    = path length. -> (output at each slot [B,N,C], new state after each slot [B,N,K-1,C])."""
    b, n = par.shape
    idx = np.zeros((b * n, n), np.int64)
    lens = np.zeros(b * n, np.int32)
    rows = np.repeat(np.arange(b), n)
    for r, ps in enumerate(paths(par)):
        for i, p in enumerate(ps):
            idx[r * n + i, :len(p)] = p
            lens[r * n + i] = len(p)
    y, s = conv(np.asarray(x)[rows[:, None], idx], w, np.asarray(s0)[rows], lens)
    y, s = np.asarray(y), np.asarray(s)
    y_last = y[np.arange(b * n), lens - 1]
    return y_last.reshape(b, n, -1), s.reshape((b, n) + s.shape[1:])


@settings(SETTINGS, max_examples=10)
@given(b=st.integers(1, 3), n=st.integers(1, 24), c=st.integers(1, 12), kk=st.integers(2, 5),
       pad_frac=st.sampled_from([0.0, 0.3]), seed=st.integers(0, 2 ** 31 - 1))
def test_tree_conv_matches_path_conv(b, n, c, kk, pad_frac, seed):
    rng = np.random.default_rng(seed)
    par = random_parents(rng, b, n, pad_frac)
    x = jnp.asarray(rng.standard_normal((b, n, c)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((c, kk)) / kk, jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, kk - 1, c)), jnp.float32)
    parj = jnp.asarray(par, jnp.int32)
    y = tree_conv(x, w, s0, parj)
    chex.assert_shape(y, (b, n, c))
    chex.assert_type(y, jnp.float32)
    y_ref, s_ref = conv_path_reference(par, x, w, s0)
    assert_close(y, y_ref, 1e-6)
    for i in range(n):
        s_new = tree_conv_state(x, s0, parj, jnp.full((b,), i, jnp.int32))
        chex.assert_shape(s_new, (b, kk - 1, c))
        np.testing.assert_array_equal(np.asarray(s_new), np.asarray(s_ref[:, i]))  # pure gathers: exact
    np.testing.assert_array_equal(np.asarray(tree_conv_state(x, s0, parj, jnp.full((b,), -1, jnp.int32))),
                                  np.asarray(s0))
    pick = rng.integers(0, n, b)
    np.testing.assert_array_equal(np.asarray(tree_conv_state(x, s0, parj, jnp.asarray(pick, jnp.int32))),
                                  np.asarray(s_ref[np.arange(b), pick]))
    # the same from every slot's conv state, each row's read at its slot (the pool the model passes)
    slots = jnp.asarray(rng.permutation(b + 2)[:b], jnp.int32)
    pool = jnp.asarray(rng.standard_normal((b + 2, kk - 1, c)), jnp.float32).at[slots].set(s0)
    np.testing.assert_array_equal(np.asarray(tree_conv(x, w, pool, parj, slots)), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(tree_conv_state(x, pool, parj, jnp.asarray(pick, jnp.int32), slots)),
                                  np.asarray(s_ref[np.arange(b), pick]))


def test_tree_conv_padding_and_siblings():
    """Padding rows do not reach valid slots; siblings see the same ancestors but not each other."""
    b, n, npad, c, kk = 1, 6, 3, 5, 4
    rng = np.random.default_rng(2)
    par = np.array([[-1, 0, 0, 1, 2, 3]])
    x = jnp.asarray(rng.standard_normal((b, n + npad, c)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((c, kk)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, kk - 1, c)), jnp.float32)
    par_pad = jnp.asarray(np.concatenate([par, np.full((b, npad), -1)], axis=1), jnp.int32)
    y = tree_conv(x[:, :n], w, s0, jnp.asarray(par, jnp.int32))
    y_pad = tree_conv(x.at[:, n:].set(1e3), w, s0, par_pad)
    np.testing.assert_array_equal(np.asarray(y_pad[:, :n]), np.asarray(y))
    # slot 5's window: (s0[-1], 0, 1, 3, 5) -> last K=4 rows are (0, 1, 3, 5)
    xs = np.asarray(x[0], np.float64)
    acc = sum(np.asarray(w[:, j], np.float64) * xs[r] for j, r in enumerate([0, 1, 3, 5]))
    assert_close(y[0, 5], acc / (1 + np.exp(-acc)), 1e-5)
    # slot 4 (parent 2, sibling of 1): window (s0[-2], s0[-1], 0, 2, 4) -> (s0[-1], 0, 2, 4)
    acc = (np.asarray(w[:, 0], np.float64) * np.asarray(s0[0, -1], np.float64)
           + sum(np.asarray(w[:, j + 1], np.float64) * xs[r] for j, r in enumerate([0, 2, 4])))
    assert_close(y[0, 4], acc / (1 + np.exp(-acc)), 1e-5)
    s_new = tree_conv_state(x[:, :n], s0, jnp.asarray(par, jnp.int32), jnp.asarray([4], jnp.int32))
    np.testing.assert_array_equal(np.asarray(s_new[0]), np.stack([x[0, 0], x[0, 2], x[0, 4]]))


def test_tree_conv_bf16_dtypes():
    """bf16 activations: bf16 output, the state keeps its own dtype (as causal_conv)."""
    rng = np.random.default_rng(4)
    par = random_parents(rng, 2, 7, 0.2)
    parj = jnp.asarray(par, jnp.int32)
    x = jnp.asarray(rng.standard_normal((2, 7, 6)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((6, 4)) / 4, jnp.bfloat16)
    s0 = jnp.asarray(rng.standard_normal((2, 3, 6)), jnp.float32)
    y = tree_conv(x, w, s0, parj)
    chex.assert_type(y, jnp.bfloat16)
    y_ref, s_ref = conv_path_reference(par, x, w, s0)
    assert_close(y.astype(jnp.float32), y_ref.astype(jnp.float32), 1e-2)
    s_new = tree_conv_state(x, s0, parj, jnp.full((2,), 6, jnp.int32))
    chex.assert_type(s_new, jnp.float32)
    np.testing.assert_array_equal(np.asarray(s_new), np.asarray(s_ref[:, 6]))
