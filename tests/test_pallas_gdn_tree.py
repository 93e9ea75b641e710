"""Pallas tree-form gated delta rule (CPU interpret mode) against the jnp reference ``gdn.gdn_tree_reference``: the
output and every ``TreeGDNCache`` field, the node states materialised from them, over random trees, a chain (the
deepest tree), a star, padding slots, nonzero state, several rows and value blocks; bf16 operands; the product-form
inverse's error on chains (why forward substitution is the default); opt-in registration, fallback, the model's
verify pass with the kernel."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_jax.models import gdn
from pallas_kernels import registry
from pallas_kernels.gdn import gdn_tree, gdn_tree_reference, tree_block_plan, tree_default_config
from pallas_kernels.gdn.tree import padded_slots
from conftest import FAST_COMPILE
from test_tree_gdn import make_inputs, np_ancestors, random_parents

pytestmark = pytest.mark.xdist_group("pallas_gdn_tree")

reference = jax.jit(gdn_tree_reference, compiler_options=FAST_COMPILE)
node_states = jax.jit(gdn.tree_node_states, compiler_options=FAST_COMPILE)


def run_kernel(args, **static):
    static.setdefault("interpret", True)
    return gdn_tree.lower(*args, **static).compile(compiler_options=FAST_COMPILE)(*args)


def chain(b, n):
    return np.tile(np.arange(n) - 1, (b, 1))


def star(b, n):
    par = np.zeros((b, n), np.int64)
    par[:, 0] = -1
    return par


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / max(1.0, np.abs(ref).max()))


def assert_matches(args, anc, out, tol=1e-5):
    """o, V' and the materialised node states to ``tol`` relative; gam and Gam to fp32 round-off of |gam| (the
    kernel sums A g in another order than the reference's matmul: ~eps |gam| absolute in gam, relative in Gam)."""
    o, cache = out
    o_r, c_r = reference(*args, anc)
    ref_shapes = jax.tree.map(lambda x: x.shape, (o_r, c_r))
    assert jax.tree.map(lambda x: x.shape, (o, cache)) == ref_shapes
    assert rel_err(o, o_r) <= tol and rel_err(cache.vp, c_r.vp) <= tol, (rel_err(o, o_r), rel_err(cache.vp, c_r.vp))
    np.testing.assert_array_equal(np.asarray(cache.k), np.asarray(c_r.k))
    gtol = 1e-6 * max(1.0, float(jnp.abs(c_r.gam).max()))
    np.testing.assert_allclose(np.asarray(cache.gam), np.asarray(c_r.gam), atol=gtol, rtol=0)
    np.testing.assert_allclose(np.asarray(cache.decay), np.asarray(c_r.decay), atol=gtol, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.decay) != 0, np.asarray(c_r.decay) != 0)  # the ancestor pattern
    s0 = args[-1]
    assert rel_err(node_states(cache, s0), node_states(c_r, s0)) <= tol


CASES = {  # name -> (parents(b, n) or pad fraction, b, n, h, dk, dv, block_v, g mode, state scale)
    "one_slot": (0.0, 2, 1, 2, 16, 32, 16, "mild", 1.0),
    "random5": (0.2, 2, 5, 3, 32, 64, 16, "mixed", 1.0),
    "random23": (0.2, 3, 23, 2, 16, 32, 32, "strong", 2.0),
    "chain33": (chain, 1, 33, 2, 16, 32, 16, "mild", 1.0),
    "star33": (star, 2, 33, 1, 16, 16, 16, "zero", 1.0),
    "random33_zero_state": (0.1, 1, 33, 2, 32, 32, 16, "mixed", 0.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference_fp32(name):
    tree, b, n, h, dk, dv, block_v, g_mode, s_scale = CASES[name]
    par = tree(b, n) if callable(tree) else random_parents(np.random.default_rng(n), b, n, tree)
    args = make_inputs(n, b, n, h, dk, dv, g_mode, s_scale, jnp.float32)
    anc = jnp.asarray(np_ancestors(par))
    assert_matches(args, anc, run_kernel((*args, anc), block_v=block_v))


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from([3, 12, 17]), pad=st.sampled_from([0.0, 0.3]),
       g_mode=st.sampled_from(["mild", "mixed", "zero"]))
def test_random_trees(seed, n, pad, g_mode):
    par = random_parents(np.random.default_rng(seed), 2, n, pad)
    args = make_inputs(seed, 2, n, 2, 16, 32, g_mode, 1.0, jnp.float32)
    anc = jnp.asarray(np_ancestors(par))
    assert_matches(args, anc, run_kernel((*args, anc), block_v=16))


@pytest.mark.parametrize("solve", ["substitution", "doubling"])
def test_state_read_from_the_slot_pool_in_place(solve):
    """With ``slots``, row b starts from ``pool[slots[b]]`` (the null slot 0 included) read where it is: the same
    output and cache as the state gathered first, kernel and reference alike."""
    b, n, h, dk, dv = 3, 11, 2, 16, 32
    par = random_parents(np.random.default_rng(4), b, n, 0.2)
    q, k, v, beta, g, _ = make_inputs(4, b, n, h, dk, dv, "mixed", 1.0, jnp.float32)
    pool = jnp.asarray(np.random.default_rng(5).standard_normal((6, h, dk, dv)), jnp.float32)
    slots = jnp.asarray([4, 0, 2], jnp.int32)
    anc = jnp.asarray(np_ancestors(par))
    gathered = run_kernel((q, k, v, beta, g, pool[slots], anc), block_v=16, solve=solve)
    pooled = run_kernel((q, k, v, beta, g, pool, anc, slots), block_v=16, solve=solve)
    for a, r in zip(jax.tree.leaves(pooled), jax.tree.leaves(gathered)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    ref = reference(q, k, v, beta, g, pool, anc, slots)
    for a, r in zip(jax.tree.leaves(ref), jax.tree.leaves(reference(q, k, v, beta, g, pool[slots], anc))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    with pytest.raises(ValueError, match="disagree"):
        run_kernel((q, k, v, beta, g, pool, anc, slots[:2]), block_v=16)


@pytest.mark.parametrize("pooled", [False, True])
def test_gated_kernel_forms_q_k_v_and_gates_as_the_model_does(pooled):
    """``gdn_tree_gated``: from post-conv rows (two value heads a key head, bf16 like the conv's output), raw gates
    and the valid mask, the same o and cache as ``gdn_qkv_gates`` then the tree reference."""
    from dflash_jax.models import qwen36
    from pallas_kernels.gdn import gdn_tree_gated

    b, n, hk, hv, dk, dv = 2, 13, 2, 4, 16, 32
    rng = np.random.default_rng(9)
    c = jnp.asarray(rng.standard_normal((b, n, 2 * hk * dk + hv * dv)), jnp.bfloat16)
    braw, araw = (jnp.asarray(rng.standard_normal((b, n, hv)), jnp.float32) for _ in range(2))
    a_log, dt_bias = jnp.asarray(rng.uniform(-1, 1, hv), jnp.float32), jnp.asarray(rng.uniform(-1, 1, hv), jnp.float32)
    valid = jnp.asarray(np.arange(n)[None] < np.array([[n], [n - 3]]))
    anc = jnp.asarray(np_ancestors(random_parents(rng, b, n, 0.0)))
    pool = jnp.asarray(rng.standard_normal((4, hv, dk, dv)), jnp.float32)
    slots = jnp.asarray([3, 1], jnp.int32)
    state, sl = (pool, slots) if pooled else (pool[slots], None)
    args = (c, braw, araw, a_log, dt_bias, valid, state, anc, sl)
    ref = jax.jit(functools.partial(qwen36.gdn_tree_gated_reference, n_k_heads=hk))(*args)
    out = gdn_tree_gated.lower(*args, n_k_heads=hk, block_v=16, interpret=True).compile(
        compiler_options=FAST_COMPILE)(*args)
    for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert a.shape == r.shape and a.dtype == r.dtype
        assert rel_err(a, r) <= 2e-6, rel_err(a, r)


def _kernel_jaxpr(fn, *args):
    """The jaxpr of the first pallas_call that ``fn(*args)`` traces."""
    def find(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                return e.params["jaxpr"]
            for p in e.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None and (hit := find(getattr(inner, "jaxpr", inner))) is not None:
                    return hit
        return None

    return find(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("gated", [False, True])
def test_q_and_v_are_loaded_after_the_solve(gated):
    """The kernel reads q and v only after the substitution loop: loaded before it (and so held across it) they
    cost the 27B's B1 round 25.7 -> 35.7 ms on an H100. The order of the loads in the kernel's jaxpr is what
    Triton receives."""
    from pallas_kernels.gdn import gdn_tree_gated

    sd = jax.ShapeDtypeStruct
    b, n, h, dk, dv, f32 = 1, 23, 2, 16, 32, jnp.float32
    gates = sd((b, n, h), f32)
    if gated:
        fn = functools.partial(gdn_tree_gated, n_k_heads=1, block_v=16, precision="fp32")
        args = (sd((b, n, 2 * dk + h * dv), jnp.bfloat16), gates, gates, sd((h,), f32), sd((h,), f32),
                sd((b, n), jnp.bool_), sd((b, h, dk, dv), f32), sd((b, n, n), jnp.bool_))
        q_in, v_in = 0, 2  # the kernel's refs of the q channels and the v columns
    else:
        fn = functools.partial(gdn_tree, block_v=16, precision="fp32")
        args = (sd((b, n, h, dk), f32), sd((b, n, h, dk), f32), sd((b, n, h, dv), f32), gates, gates,
                sd((b, h, dk, dv), f32), sd((b, n, n), jnp.bool_))
        q_in, v_in = 0, 2
    kj = _kernel_jaxpr(fn, *args)
    names = [e.primitive.name for e in kj.eqns]
    loop = names.index("scan")
    loads = {kj.invars.index(e.invars[0]): i for i, e in enumerate(kj.eqns)
             if "load" in e.primitive.name and e.invars[0] in kj.invars}
    assert loads[q_in] > loop and loads[v_in] > loop, (loop, loads)


def test_padding_slot_sees_only_itself():
    """A padding slot (beta = g = 0, k = v = 0, only itself as ancestor) reads S0 alone, and its presence changes
    no other slot."""
    b, n, h, dk, dv = 1, 9, 2, 16, 16
    par = random_parents(np.random.default_rng(0), b, n, 0.0)
    par[0, [3, 7]] = -1  # slots 3 and 7 become padding; nothing hangs below them
    par[0] = np.where(np.isin(par[0], [3, 7]), 0, par[0])
    q, k, v, beta, g, s0 = make_inputs(5, b, n, h, dk, dv, "mixed", 1.0, jnp.float32)
    pad = np.zeros((b, n, 1), np.float32)
    pad[0, [3, 7]] = 1
    keep = jnp.asarray(1 - pad)
    k, v, beta, g = k * keep[..., None], v * keep[..., None], beta * keep, g * keep
    anc = jnp.asarray(np_ancestors(par))
    o, _ = run_kernel((q, k, v, beta, g, s0, anc), block_v=16)
    np.testing.assert_allclose(np.asarray(o[0, [3, 7]]), np.einsum("nhk,hkv->nhv", q[0, [3, 7]], s0[0]), atol=1e-5)
    live = [i for i in range(n) if i not in (3, 7)]
    sub = lambda a: a[:, live]  # noqa: E731
    o_live, _ = run_kernel((*map(sub, (q, k, v, beta, g)), s0, anc[:, live][:, :, live]), block_v=16)
    np.testing.assert_allclose(np.asarray(o[:, live]), np.asarray(o_live), atol=1e-5)


def adversarial_chain(n, dk=16, dv=16):
    """A valid worst case for the product-form inverse: one chain of identical unit keys, beta -> 1, no decay, so
    every strict-ancestor entry of M is ~1 and (M^p)_ij counts the C(i-j-1, p-1) chains between the slots."""
    q, k, v, beta, g, s0 = make_inputs(7, 1, n, 1, dk, dv, "zero", 1.0, jnp.float32)
    k = jnp.broadcast_to(k[:, :1], k.shape)
    beta = jnp.full_like(beta, 0.999)
    return (q, k, v, beta, g, s0), jnp.asarray(np_ancestors(chain(1, n)))


def test_substitution_exact_on_adversarial_chain_product_form_is_not():
    """Forward substitution matches the reference's triangular solve on the worst chain; the
    nilpotent product form is exact on a star (M^2 = 0) and on random keys, but cancels catastrophically along a
    33-slot chain of identical keys (measured ~24x the output's scale; see ``pallas_kernels.gdn.tree``)."""
    args, anc = adversarial_chain(33)
    assert_matches(args, anc, run_kernel((*args, anc), block_v=16))
    o_r, _ = reference(*args, anc)
    o_p, _ = run_kernel((*args, anc), block_v=16, solve="product")
    assert rel_err(o_p, o_r) > 1e-2
    par = star(1, 33)
    star_anc = jnp.asarray(np_ancestors(par))
    assert_matches(args, star_anc, run_kernel((*args, star_anc), block_v=16, solve="product"))
    rnd = make_inputs(8, 1, 33, 1, 16, 16, "mild", 1.0, jnp.float32)
    assert_matches(rnd, anc, run_kernel((*rnd, anc), block_v=16, solve="product"))


@pytest.mark.parametrize("solve", ["blocked", "doubling"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_other_solves_match_reference(name, solve):
    """Two half-length substitutions side by side plus the off-diagonal block by products, or diagonal blocks
    doubled by products alone: the same inverse."""
    tree, b, n, h, dk, dv, block_v, g_mode, s_scale = CASES[name]
    par = tree(b, n) if callable(tree) else random_parents(np.random.default_rng(n), b, n, tree)
    args = make_inputs(n, b, n, h, dk, dv, g_mode, s_scale, jnp.float32)
    anc = jnp.asarray(np_ancestors(par))
    assert_matches(args, anc, run_kernel((*args, anc), block_v=block_v, solve=solve))


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from([2, 9, 16, 23]), pad=st.sampled_from([0.0, 0.3]))
def test_other_solves_random_trees_and_adversarial_chain(seed, n, pad):
    par = random_parents(np.random.default_rng(seed), 2, n, pad)
    args = make_inputs(seed, 2, n, 2, 16, 32, "mixed", 1.0, jnp.float32)
    anc = jnp.asarray(np_ancestors(par))
    chain_args, chain_anc = adversarial_chain(n)
    for solve in ("blocked", "doubling"):
        assert_matches(args, anc, run_kernel((*args, anc), block_v=16, solve=solve))
        assert_matches(chain_args, chain_anc, run_kernel((*chain_args, chain_anc), block_v=16, solve=solve))


@pytest.mark.parametrize("name", ["random23", "chain33"])
def test_bf16_inputs_within_2e_2(name):
    """bf16 q, k, v (bf16 dot operands, fp32 accumulation, T and state fp32) against the fp32 reference on the
    same rounded values."""
    tree, b, n, h, dk, dv, block_v, g_mode, s_scale = CASES[name]
    par = tree(b, n) if callable(tree) else random_parents(np.random.default_rng(n), b, n, tree)
    args = make_inputs(n, b, n, h, dk, dv, g_mode, s_scale, jnp.float32)
    a16 = tuple(x.astype(jnp.bfloat16) for x in args[:3]) + args[3:]
    anc = jnp.asarray(np_ancestors(par))
    o, cache = run_kernel((*a16, anc), block_v=block_v)
    assert o.dtype == jnp.bfloat16 and cache.vp.dtype == jnp.float32
    o_r, c_r = reference(*(x.astype(jnp.float32) for x in a16), anc)
    assert rel_err(o, o_r) <= 2e-2 and rel_err(cache.vp, c_r.vp) <= 2e-2


def test_block_plan_and_defaults():
    assert [padded_slots(n) for n in (1, 16, 17, 23, 33, 64)] == [16, 16, 32, 32, 64, 64]
    h200 = registry.SMEM_BUDGET_BYTES["sm_90"]
    plan = tree_block_plan(n=23, dk=128, dv=128, block_v=64, smem_budget=h200)
    assert plan["n_pad"] == 32 and plan["n_v_blocks"] == 2
    fits = [("cuda", h200, n, dt) for n in (16, 23, 33) for dt in (jnp.float32, jnp.bfloat16)] + [
        ("rocm", None, 16, jnp.float32), ("rocm", None, 23, jnp.bfloat16)]
    for backend, budget, n, dtype in fits:  # the 27B's GDN heads (dk = dv = 128)
        cfg = tree_default_config(n, 128, 128, dtype=dtype, backend=backend, smem_budget=budget)
        assert cfg["solve"] == "substitution"
        tree_block_plan(n=n, dk=128, dv=128, block_v=cfg["block_v"], itemsize=jnp.dtype(dtype).itemsize,
                        smem_budget=budget, backend=backend)
    with pytest.raises(ValueError, match="exceeds the budget"):  # MI300's 64 KiB: fp32 33-slot trees fall back
        tree_block_plan(n=33, dk=128, dv=128, block_v=16, backend="rocm")
    with pytest.raises(ValueError, match="not a power of two"):
        tree_block_plan(n=16, dk=24, dv=32, block_v=16)
    with pytest.raises(ValueError, match=r"dot 'tv' has N=8"):
        tree_block_plan(n=16, dk=16, dv=8, block_v=8)
    with pytest.raises(ValueError, match="65 tree slots > 64"):
        tree_block_plan(n=65, dk=16, dv=16, block_v=16)
    with pytest.raises(ValueError, match="exceeds the budget"):
        tree_block_plan(n=64, dk=128, dv=128, block_v=128, smem_budget=64 * 1024)
    with pytest.raises(ValueError, match="expected one of"):
        args = make_inputs(0, 1, 4, 1, 16, 16, "mild", 1.0, jnp.float32)
        gdn_tree(*args, jnp.asarray(np_ancestors(chain(1, 4))), block_v=16, solve="lu", interpret=True)


def test_registration_dispatch_and_fallback(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    assert registry.resolve("gdn_tree", backend="cpu").name == "reference"
    for b in ("cuda", "rocm"):  # the GPU defaults (routed by batch), the gated form included
        assert registry.resolve("gdn_tree", backend=b).name == "pallas_triton"
        assert registry.resolve("gdn_tree_gated", backend=b).name == "pallas_triton"
    assert registry.resolve("gdn_tree_gated", backend="cpu").name == "reference"
    par = random_parents(np.random.default_rng(1), 2, 6, 0.2)
    anc = jnp.asarray(np_ancestors(par))
    args = make_inputs(1, 2, 6, 2, 16, 32, "mixed", 1.0, jnp.float32)
    ref = jax.jit(gdn.gdn_tree)(*args, anc)
    monkeypatch.setenv(registry.ENV_VAR, "gdn_tree=pallas_triton")
    assert registry.resolve("gdn_tree", backend="cuda").name == "pallas_triton"
    out = jax.jit(gdn.gdn_tree)(*args, anc)  # a fresh jit: the implementation is chosen at trace time
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    odd = make_inputs(2, 1, 4, 1, 24, 16, "mild", 1.0, jnp.float32)  # dk = 24: no power-of-two tile
    small = jnp.asarray(np_ancestors(chain(1, 4)))
    with pytest.warns(RuntimeWarning, match="gdn_tree: the Pallas kernel cannot take"):
        o, _ = gdn.gdn_tree(*odd, small)
    np.testing.assert_allclose(np.asarray(o), np.asarray(gdn_tree_reference(*odd, small)[0]), atol=1e-6)


def test_routed_kernel_runs_within_one_resident_wave(monkeypatch):
    """The default implementation launches the kernel while B x value heads x value blocks fit one resident wave
    (``TREE_MAX_PROGRAMS``) and runs the reference past it; ``pallas_triton_every_batch`` always launches it."""
    import pallas_kernels.gdn as pg

    calls = []
    monkeypatch.setattr(pg.registry, "current_backend", lambda: "cuda")
    solves = []
    monkeypatch.setattr(pg, "gdn_tree", lambda *a, **kw: calls.append(a[0].shape[0]) or solves.append(kw["solve"])
                        or "kernel")
    monkeypatch.setattr(pg, "gdn_tree_reference", lambda *a: "reference")
    h, dv = 2, 32
    block_v = pg.tree_default_config(8, 16, dv, dtype=jnp.float32, backend="cuda")["block_v"]
    per_row = pg.tree_programs(1, h, dv, block_v)
    fits = pg.TREE_MAX_PROGRAMS // per_row

    def call(b, impl="pallas_triton"):
        x, vv = jnp.zeros((b, 8, h, 16)), jnp.zeros((b, 8, h, dv))
        gates, s0 = jnp.zeros((b, 8, h)), jnp.zeros((b, h, 16, dv))
        fn = registry.implementations("gdn_tree")[impl].fn
        return fn(x, x, vv, gates, gates, s0, jnp.ones((b, 8, 8), bool))

    assert call(1) == call(fits) == "kernel" and calls == [1, fits]
    assert call(fits + 1) == "reference"
    assert call(fits + 1, "pallas_triton_every_batch") == "kernel" and calls[-1] == fits + 1
    default = pg.tree_default_config(8, 16, dv, dtype=jnp.float32, backend="cuda")["solve"]
    assert set(solves) == {default}
    for solve in pg.SOLVES:  # the opt-in solves route like the default, with their own solve
        assert call(1, f"pallas_triton_{solve}") == "kernel" and solves[-1] == solve
        assert call(fits + 1, f"pallas_triton_{solve}") == "reference"
        gated = registry.implementations("gdn_tree_gated")[f"pallas_triton_{solve}"]
        assert not gated.preferred and gated.fn.keywords == {"solve": solve}
    assert pg.tree_programs(1, 48, 128, 64) == 96  # the 27B at B1: one wave of an H100 / H200's 132 SMs


def test_model_verify_with_kernel_equals_reference(monkeypatch):
    """The tiny target's verify pass (GDN dk = dv = 32) and the commit from its scratch (the tree, gated tree and
    commit kernels), vs the references."""
    from test_tree_verify import _state_after_prompt, _tree_input, target

    from dflash_jax.models import qwen36

    t = target("qwen36_tiny_a")
    cfg = t.config
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, cfg.vocab_size, 11).tolist()
    kv, rec = _state_after_prompt(t, prompt[:-1])
    parents = [-1, 0, 1, 1, -1, 2, 5, 3]
    toks = [prompt[-1]] + rng.integers(0, cfg.vocab_size, 7).tolist()
    tree = _tree_input(toks, parents, len(prompt) - 1)
    accepted = jnp.asarray([[0, 1, 2, 5, -1]], jnp.int32)

    def run():  # a fresh jit per call: the implementation is chosen at trace time
        def f(tree, kv, rec):
            h, scratch, _ = qwen36.forward_tree(t.params, cfg, tree, kv, rec)
            _, rec2 = qwen36.commit_tree(cfg, kv, rec, tree, scratch, accepted, jnp.asarray([4], jnp.int32))
            return h, rec2.ssm

        h, ssm = jax.jit(f)(tree, kv, rec)
        return np.asarray(h), [np.asarray(s) for s in ssm]

    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    h_ref, ssm_ref = run()
    monkeypatch.setenv(registry.ENV_VAR, "gdn_tree=pallas_triton,gdn_tree_commit=pallas_triton")
    h, ssm = run()
    np.testing.assert_allclose(h, h_ref, atol=1e-4)
    for a, b in zip(ssm, ssm_ref):
        np.testing.assert_allclose(a, b, atol=1e-4)
    for gated in ("pallas_triton", "pallas_triton_doubling"):  # the default solve, and an opt-in one
        monkeypatch.setenv(registry.ENV_VAR, f"gdn_tree_gated={gated},gdn_tree_commit=pallas_triton")
        h, ssm = run()
        np.testing.assert_allclose(h, h_ref, atol=1e-4)
        for a, b in zip(ssm, ssm_ref):
            np.testing.assert_allclose(a, b, atol=1e-4)
