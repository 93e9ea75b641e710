"""Pallas packed tree attention (CPU interpret mode) against the jnp reference; the reference against a NumPy
oracle (non-resident pages, ragged prefixes); the model's dispatch through the kernel registry."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dflash_jax.models import attention, tree_ops
from pallas_kernels import registry
from pallas_kernels.tree_attention import block_plan, default_config, tree_attention, tree_attention_reference
from conftest import FAST_COMPILE

pytestmark = pytest.mark.xdist_group("pallas_tree_attention")


def run_kernel(args, scale, **static):
    static.setdefault("interpret", True)
    return tree_attention.lower(*args, scale, **static).compile(compiler_options=FAST_COMPILE)(*args)


def make_case(seed, b, hkv, g, d, page_size, width, n, starts, parents, non_resident, dtype):
    """Random q / pages / tree K/V. Each row owns `width` distinct real pages; the engine's tables are 0 past
    the prefix's last page; `non_resident` lists (row, logical page) entries set to -1."""
    rng = np.random.default_rng(seed)
    n_pages = 1 + b * width + 2
    q = rng.normal(size=(b, n, g * hkv, d))
    k = rng.normal(size=(n_pages, page_size, hkv, d))
    v = rng.normal(size=(n_pages, page_size, hkv, d))
    kt = rng.normal(size=(b, n, hkv, d))
    vt = rng.normal(size=(b, n, hkv, d))
    pt = rng.permutation(np.arange(1, n_pages))[: b * width].reshape(b, width).astype(np.int32)
    st_ = np.asarray(starts, np.int32)
    used = -(-st_ // page_size)
    pt = np.where(np.arange(width)[None, :] < used[:, None], pt, 0).astype(np.int32)
    for r, p in non_resident:
        pt[r, p] = -1
    anc = tree_ops.tree_ancestors(jnp.asarray(np.asarray(parents, np.int32)))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), jnp.asarray(pt), jnp.asarray(st_), cast(kt), cast(vt), anc)


@st.composite
def trees(draw, n):
    """Parent arrays of n slots: slot 0 is a root, every other slot is padding (-1) or hangs below an earlier
    live slot (ancestors precede descendants, as the DDTree builder emits them)."""
    parents = [-1]
    for i in range(1, n):
        live = [j for j in range(i) if j == 0 or parents[j] >= 0]
        parents.append(-1 if draw(st.integers(0, 5)) == 0 else draw(st.sampled_from(live)))
    return parents


@st.composite
def tree_cases(draw):
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 2))
    g = draw(st.integers(1, 4))
    d = draw(st.sampled_from([16, 32]))
    page_size = draw(st.sampled_from([8, 16]))
    width = draw(st.integers(1, 5))
    n = draw(st.sampled_from([1, 2, 5, 16, 17]))  # one node, small, a full 16-slot budget, one past a tile
    full = width * page_size
    start = st.one_of(st.just(0), st.just(full), st.integers(1, width).map(lambda k: k * page_size),
                      st.integers(0, full))
    starts = draw(st.lists(start, min_size=b, max_size=b))
    parents = [draw(trees(n)) for _ in range(b)]
    non_resident = draw(st.lists(st.tuples(st.integers(0, b - 1), st.integers(0, width - 1)), max_size=3))
    block_m = draw(st.sampled_from([16, 32, 64]))
    ppb = draw(st.sampled_from([p for p in (1, 2, 4) if p * page_size >= 16]))
    parts = draw(st.sampled_from([1, 2, None]))
    prefetch = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return (dict(seed=seed, b=b, hkv=hkv, g=g, d=d, page_size=page_size, width=width, n=n, starts=starts,
                 parents=parents, non_resident=non_resident),
            dict(block_m=block_m, pages_per_block=ppb, num_partitions=parts, prefetch=prefetch))


def check(case, static, dtype, tol):
    args = make_case(dtype=dtype, **case)
    scale = case["d"] ** -0.5
    out = np.asarray(run_kernel(args, scale, **static).astype(jnp.float32))
    ref = np.asarray(tree_attention_reference(*args, scale).astype(jnp.float32))
    assert out.shape == ref.shape == (case["b"], case["n"], case["g"] * case["hkv"], case["d"])
    assert np.isfinite(out).all()
    err = np.abs(out - ref).max()
    assert err <= tol * (1.0 if dtype == jnp.float32 else max(1.0, np.abs(ref).max())), (err, case, static)


SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
# The 27B's GQA group of 6 (24/4 heads), a 17-slot tree (two row tiles of 64 after padding to 102 rows), ragged
# prefixes (empty, one past a page boundary, a full table) and a non-resident page in the middle of a prefix.
EDGE = (dict(seed=1, b=3, hkv=2, g=6, d=32, page_size=8, width=4, n=17, starts=[0, 9, 32],
             parents=[[-1] + list(range(16)), [-1] + [0] * 16, [-1, 0, 1, -1, 2] + [-1] * 12],
             non_resident=[(2, 1)]),
        dict(block_m=64, pages_per_block=2, num_partitions=2, prefetch=True))
ONE_NODE = (dict(seed=2, b=2, hkv=1, g=2, d=16, page_size=16, width=3, n=1, starts=[48, 1], parents=[[-1], [-1]],
                 non_resident=[(0, 0), (0, 2)]),
            dict(block_m=16, pages_per_block=1, num_partitions=None))


@settings(max_examples=8, **SETTINGS)
@given(tree_cases())
@example(EDGE)
@example(ONE_NODE)
def test_kernel_matches_reference_fp32(c):
    check(c[0], c[1], jnp.float32, 1e-5)


@settings(max_examples=4, **SETTINGS)
@given(tree_cases())
@example(EDGE)
def test_kernel_matches_reference_bf16(c):
    check(c[0], c[1], jnp.bfloat16, 2e-2)


# ---------------------------------------------------------------------------------------------- the reference

def oracle(q, k, v, pt, start, kt, vt, anc, scale):
    """Per (row, slot, head): softmax over exactly the visible keys, listed one by one (float64)."""
    q, k, v, kt, vt = (np.asarray(a, np.float64) for a in (q, k, v, kt, vt))
    pt, start, anc = np.asarray(pt), np.asarray(start), np.asarray(anc)
    b, n, h, d = q.shape
    ps, hkv = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    for r in range(b):
        keys = [(k[pt[r, j // ps], j % ps], v[pt[r, j // ps], j % ps]) for j in range(start[r]) if pt[r, j // ps] >= 0]
        for i in range(n):
            kv = keys + [(kt[r, j], vt[r, j]) for j in range(n) if anc[r, i, j]]
            ks = np.stack([a for a, _ in kv])
            vs = np.stack([c for _, c in kv])
            for hh in range(h):
                s = ks[:, hh // (h // hkv)] @ q[r, i, hh] * scale
                p = np.exp(s - s.max())
                out[r, i, hh] = (p / p.sum()) @ vs[:, hh // (h // hkv)]
    return out


def test_reference_masks_non_resident_pages_and_ragged_prefixes():
    case = dict(seed=5, b=3, hkv=2, g=2, d=16, page_size=4, width=5, n=4, starts=[0, 7, 20],
                parents=[[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, -1, 1]], non_resident=[(1, 0), (2, 2), (2, 4)])
    args = make_case(dtype=jnp.float32, **case)
    np.testing.assert_allclose(np.asarray(tree_attention_reference(*args, 0.3)), oracle(*args, 0.3), atol=1e-5)


def test_write_kv_never_writes_a_non_resident_page():
    kp = jnp.zeros((4, 2, 1, 3))
    pt = jnp.asarray([[1, -1, 2]], jnp.int32)
    k = jnp.ones((1, 6, 1, 3))
    kp2, _ = attention.write_kv(kp, kp, k, k, pt, jnp.arange(6, dtype=jnp.int32)[None], jnp.ones((1, 6), bool))
    assert float(kp2[3].sum()) == 0.0  # the last page is what a wrapped -1 would hit
    assert float(kp2[1].sum()) == 6.0 and float(kp2[2].sum()) == 6.0


# ---------------------------------------------------------------------------------------------- dispatch + plans

def test_registry_and_model_dispatch(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    assert registry.get("tree_attention", backend="cpu") is tree_attention_reference
    for b in ("gpu", "cuda", "rocm"):
        assert registry.resolve("tree_attention", backend=b).name == "pallas_triton"
    case = dict(seed=3, b=2, hkv=2, g=3, d=16, page_size=8, width=3, n=5, starts=[5, 24],
                parents=[[-1, 0, 0, 1, 2], [-1, 0, 1, -1, 3]], non_resident=[(1, 1)])
    args = make_case(dtype=jnp.float32, **case)
    ref = np.asarray(attention.tree_attention(*args, 0.25))  # CPU default: the reference itself
    np.testing.assert_array_equal(ref, np.asarray(tree_attention_reference(*args, 0.25)))
    monkeypatch.setenv(registry.ENV_VAR, "tree_attention=pallas_triton")
    np.testing.assert_allclose(np.asarray(attention.tree_attention(*args, 0.25)), ref, atol=1e-5)


def test_rejects_bad_blocks_before_lowering():
    case = dict(seed=0, b=1, hkv=1, g=2, d=16, page_size=8, width=4, n=3, starts=[5], parents=[[-1, 0, 1]],
                non_resident=[])
    args = make_case(dtype=jnp.float32, **case)
    with pytest.raises(ValueError, match=r"block 'q' has shape \(24, 16\)"):
        tree_attention(*args, 0.25, block_m=24, pages_per_block=2, interpret=True)
    with pytest.raises(ValueError, match=r"dot 'qk' has N=8"):
        tree_attention(*args, 0.25, block_m=16, pages_per_block=1, interpret=True)
    with pytest.raises(ValueError, match="exceeds the budget"):
        tree_attention(*args, 0.25, block_m=16, pages_per_block=2, interpret=True, smem_budget=1024)


@pytest.mark.parametrize("n", [16, 23, 33, 64])
def test_default_configs_fit_targets(n):
    """The 27B's attention (24 q / 4 kv heads x 256, page 16, bf16) with trees of 16-64 slots fits Hopper and ROCm."""
    for backend, budget in (("cuda", 227 * 1024), ("rocm", 64 * 1024)):
        cfg = default_config(256, 16, jnp.bfloat16, backend=backend)
        plan = block_plan(batch=16, n_tree=n, n_heads=24, n_kv_heads=4, head_dim=256, page_size=16, width=1024,
                          dtype=jnp.bfloat16, block_m=cfg["block_m"], pages_per_block=cfg["pages_per_block"],
                          num_partitions=None, num_stages=cfg["num_stages"], smem_budget=budget)
        assert plan["smem_bytes"] <= budget and plan["n_row_tiles"] * cfg["block_m"] >= n * 6
        assert plan["n_partitions"] * plan["pages_per_partition"] >= 1024


@pytest.mark.parametrize("n, batch, tiles, parts", [(16, 16, 1, 4), (32, 16, 2, 1), (23, 4, 2, 4), (16, 64, 1, 1)])
def test_prefix_partitions_fill_the_grid_and_multi_tile_trees_take_half(n, batch, tiles, parts):
    """The 27B's heads over a 4K prefix (128 blocks of 32 keys): a one-tile tree's grid aims at 264 programs (2 an
    SM), a tree of two or more row tiles at 132 (its tiles already share every prefix block)."""
    cfg = default_config(256, 16, jnp.bfloat16, backend="cuda")
    plan = block_plan(batch=batch, n_tree=n, n_heads=24, n_kv_heads=4, head_dim=256, page_size=16, width=256,
                      dtype=jnp.bfloat16, block_m=cfg["block_m"], pages_per_block=cfg["pages_per_block"],
                      num_partitions=None, num_stages=cfg["num_stages"], smem_budget=227 * 1024, backend="cuda")
    assert (plan["n_row_tiles"], plan["n_partitions"]) == (tiles, parts)
    assert plan["programs"] <= cfg["target_programs"] // (1 if tiles == 1 else 2) or parts == 1


def test_model_verify_and_decode_with_kernels_equal_reference(monkeypatch):
    """forward_tree and a one-token forward of the tiny target give the same logits with the Pallas kernels
    (interpret mode) as with the references: switching implementation changes no model code."""
    from test_tree_verify import _state_after_prompt, _tree_input, target

    from dflash_jax.models import qwen36
    from dflash_jax.state import StepInput

    t = target("qwen36_tiny_a")
    cfg = t.config
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, 13).tolist()
    kv, rec = _state_after_prompt(t, prompt[:-1])
    toks = rng.integers(0, cfg.vocab_size, 8).tolist()
    toks[0] = prompt[-1]
    tree = _tree_input(toks, [-1, 0, 0, 1, -1, 2, 5, 3], len(prompt) - 1)
    step = StepInput(tokens=jnp.asarray([[prompt[-1]]], jnp.int32), positions=jnp.asarray([[len(prompt) - 1]], jnp.int32),
                     n_valid=jnp.ones((1,), jnp.int32), slots=jnp.ones((1,), jnp.int32), page_table=tree.page_table)

    def run():  # a fresh jit per call: the implementation is chosen at trace time
        verify = jax.jit(lambda tr, kv, rec: qwen36.lm_logits(t.params, qwen36.forward_tree(t.params, cfg, tr, kv, rec)[0]))
        decode = jax.jit(lambda s, kv, rec: qwen36.lm_logits(t.params, qwen36.forward(t.params, cfg, s, kv, rec)[0]))
        return np.asarray(verify(tree, kv, rec)), np.asarray(decode(step, kv, rec))

    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    ref_tree, ref_dec = run()
    monkeypatch.setenv(registry.ENV_VAR, "tree_attention=pallas_triton,paged_decode=pallas_triton")
    out_tree, out_dec = run()
    np.testing.assert_allclose(out_tree, ref_tree, atol=1e-4)
    np.testing.assert_allclose(out_dec, ref_dec, atol=1e-4)


def test_unsupported_shape_falls_back_to_reference_with_a_warning():
    from pallas_kernels.paged_decode import paged_decode_pallas, paged_decode_reference
    from pallas_kernels.tree_attention import tree_attention_pallas

    case = dict(seed=4, b=2, hkv=1, g=2, d=24, page_size=8, width=2, n=3, starts=[3, 16],
                parents=[[-1, 0, 1], [-1, 0, 0]], non_resident=[])
    args = make_case(dtype=jnp.float32, **case)
    with pytest.warns(RuntimeWarning, match="tree_attention: the Pallas kernel cannot take this shape"):
        out = tree_attention_pallas(*args, 0.2)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(tree_attention_reference(*args, 0.2)))
    q, kp, vp, pt, start = args[0][:, 0], args[1], args[2], args[3], args[4] + 1
    with pytest.warns(RuntimeWarning, match="paged_decode: the Pallas kernel cannot take this shape"):
        out = paged_decode_pallas(q, kp, vp, pt, start, 0.2)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_decode_reference(q, kp, vp, pt, start, 0.2)))
