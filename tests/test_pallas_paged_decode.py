"""Pallas paged decode kernel (CPU interpret mode) against the jnp reference; kernel registry; static checks."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import FAST_COMPILE
from dflash_jax.models import attention
from pallas_kernels import registry
from pallas_kernels.paged_decode import (auto_partitions, block_plan, default_config, paged_decode,
                                         paged_decode_reference)

pytestmark = pytest.mark.xdist_group("pallas_paged_decode")


def run_kernel(q, k, v, pt, lens, scale, **static):
    static.setdefault("interpret", True)
    args = (q, k, v, pt, lens, scale)
    return paged_decode.lower(*args, **static).compile(compiler_options=FAST_COMPILE)(q, k, v, pt, lens)


def make_case(seed, b, hkv, g, d, page_size, width, lengths, null_tail, dtype, non_resident=()):
    """Random q/pages; each row owns `width` distinct real pages (page 0 = null page, also random);
    `non_resident` lists (row, logical page) table entries set to -1."""
    rng = np.random.default_rng(seed)
    n_pages = 1 + b * width + 3
    q = rng.normal(size=(b, g * hkv, d)).astype(np.float32)
    k = rng.normal(size=(n_pages, page_size, hkv, d)).astype(np.float32)
    v = rng.normal(size=(n_pages, page_size, hkv, d)).astype(np.float32)
    pt = rng.permutation(np.arange(1, n_pages))[: b * width].reshape(b, width).astype(np.int32)
    lens = np.asarray(lengths, np.int32)
    if null_tail:  # the engine's tables: 0 past each sequence's last page
        used = -(-lens // page_size)
        pt = np.where(np.arange(width)[None, :] < used[:, None], pt, 0).astype(np.int32)
    for r, p in non_resident:
        pt[r, p] = -1
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(pt), jnp.asarray(lens)


@st.composite
def decode_cases(draw):
    b = draw(st.integers(1, 4))
    hkv = draw(st.integers(1, 2))
    g = draw(st.integers(1, 6))
    d = draw(st.sampled_from([16, 32, 64]))
    page_size = draw(st.sampled_from([8, 16]))
    width = draw(st.integers(1, 6))
    full = width * page_size
    length = st.one_of(
        st.just(1), st.just(full),                                              # shortest / full table
        st.integers(1, width).map(lambda n: n * page_size),                    # exactly at a page boundary
        st.integers(1, width).map(lambda n: min(full, n * page_size + 1)),     # one past a boundary
        st.integers(1, full))
    lengths = draw(st.lists(length, min_size=b, max_size=b))
    ppb = draw(st.sampled_from([p for p in (1, 2, 4) if p * page_size >= 16]))
    parts = draw(st.sampled_from([1, 2, 3, None]))
    prefetch = draw(st.booleans())
    null_tail = draw(st.booleans())
    non_resident = draw(st.lists(st.tuples(st.integers(0, b - 1), st.integers(0, width - 1)), max_size=3))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(seed=seed, b=b, hkv=hkv, g=g, d=d, page_size=page_size, width=width, lengths=lengths,
                null_tail=null_tail, non_resident=non_resident), dict(pages_per_block=ppb, num_partitions=parts,
                                                                                   prefetch=prefetch)


def has_visible_key(pt, lens, page_size):
    """[B] bool: some key j < length sits on a resident page (rows without one are zeros in the kernel)."""
    pt, lens = np.asarray(pt), np.asarray(lens)
    used = -(-lens // page_size)
    return np.asarray([(pt[r, :used[r]] >= 0).any() for r in range(len(lens))])


def check(case, static, dtype, tol):
    q, k, v, pt, lens = make_case(dtype=dtype, **case)
    scale = case["d"] ** -0.5
    out = np.asarray(run_kernel(q, k, v, pt, lens, scale, **static).astype(jnp.float32))
    ref = np.asarray(paged_decode_reference(q, k, v, pt, lens, scale).astype(jnp.float32))
    assert out.shape == ref.shape == (case["b"], case["g"] * case["hkv"], case["d"])
    assert np.isfinite(out).all()
    vis = has_visible_key(pt, lens, case["page_size"])
    assert (out[~vis] == 0).all()  # no visible key: zeros (the reference averages masked keys there)
    out, ref = out[vis], ref[vis]
    err = np.abs(out - ref).max(initial=0.0)
    if dtype == jnp.float32:
        assert err <= tol, (err, case, static)
    else:
        assert err <= tol * max(1.0, np.abs(ref).max()), (err, case, static)


SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
# A GQA group of 6 (the 27B's 24/4), a length at a page boundary, one past it, 1, and a full table.
# A non-resident page inside the last row's context, and the first row's only page non-resident.
EDGE = (dict(seed=1, b=4, hkv=2, g=6, d=64, page_size=16, width=4, lengths=[16, 17, 1, 64], null_tail=True,
             non_resident=[(3, 1), (0, 0)]),
        dict(pages_per_block=2, num_partitions=2, prefetch=True))


@settings(max_examples=8, **SETTINGS)
@given(decode_cases())
@example(EDGE)
def test_kernel_matches_reference_fp32(c):
    check(c[0], c[1], jnp.float32, 1e-5)


@settings(max_examples=5, **SETTINGS)
@given(decode_cases())
@example(EDGE)
def test_kernel_matches_reference_bf16(c):
    check(c[0], c[1], jnp.bfloat16, 2e-2)


def test_partitions_agree_and_zero_length_rows_are_zero():
    case = dict(seed=7, b=2, hkv=1, g=2, d=16, page_size=8, width=6, lengths=[48, 0], null_tail=True)
    q, k, v, pt, lens = make_case(dtype=jnp.float32, **case)
    outs = [np.asarray(run_kernel(q, k, v, pt, lens, 0.25, pages_per_block=2, num_partitions=s)) for s in (1, 3)]
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-6)
    assert (outs[0][1] == 0).all() and (outs[1][1] == 0).all()  # length 0: documented zeros, not NaN
    ref = np.asarray(paged_decode_reference(q[:1], k, v, pt[:1], lens[:1], 0.25))
    np.testing.assert_allclose(outs[0][:1], ref, atol=1e-5)


def test_reference_masks_non_resident_pages():
    """The reference against a NumPy oracle that lists the visible keys one by one."""
    case = dict(seed=4, b=3, hkv=2, g=2, d=16, page_size=4, width=5, lengths=[7, 20, 3], null_tail=True,
                non_resident=[(0, 0), (1, 2), (1, 4)])
    q, k, v, pt, lens = make_case(dtype=jnp.float32, **case)
    out = np.asarray(paged_decode_reference(q, k, v, pt, lens, 0.3))
    qn, kn, vn, ptn = (np.asarray(a, np.float64) for a in (q, k, v, pt))
    for r, n in enumerate(np.asarray(lens)):
        keep = [j for j in range(n) if ptn[r, j // 4] >= 0]
        for h in range(4):
            ks = np.stack([kn[int(ptn[r, j // 4]), j % 4, h // 2] for j in keep])
            vs = np.stack([vn[int(ptn[r, j // 4]), j % 4, h // 2] for j in keep])
            s = ks @ qn[r, h] * 0.3
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[r, h], (p / p.sum()) @ vs, atol=1e-5)


def test_model_decode_dispatch(monkeypatch):
    """attention.paged_attention with T = 1 runs the registry's paged_decode (length = position + 1); with the
    reference selected (CPU) it runs the blocked jnp path, equal to the reference up to rounding."""
    case = dict(seed=6, b=3, hkv=2, g=3, d=16, page_size=8, width=4, lengths=[1, 9, 32], null_tail=True,
                non_resident=[(2, 1)])
    q, k, v, pt, lens = make_case(dtype=jnp.float32, **case)
    pos = (lens - 1)[:, None]
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    ref = np.asarray(attention.paged_attention(q[:, None], k, v, pt, pos, 0.25))
    np.testing.assert_allclose(ref, np.asarray(attention.paged_attention_reference(q[:, None], k, v, pt, pos, 0.25)),
                               rtol=1e-6, atol=1e-6)
    monkeypatch.setenv(registry.ENV_VAR, "paged_decode=pallas_triton")
    np.testing.assert_allclose(np.asarray(attention.paged_attention(q[:, None], k, v, pt, pos, 0.25)), ref, atol=1e-5)


# ---------------------------------------------------------------------------------------------- registry

def test_registry_default_selection(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    impls = registry.implementations("paged_decode")
    assert set(impls) >= {"reference", "pallas_triton"}
    assert registry.resolve("paged_decode").name == ("reference" if jax.default_backend() == "cpu" else "pallas_triton")
    assert registry.get("paged_decode", backend="cpu") is paged_decode_reference
    for b in ("gpu", "cuda", "rocm"):
        assert registry.resolve("paged_decode", backend=b).name == "pallas_triton"
    assert registry.resolve("paged_decode", backend="tpu").name == "reference"
    assert "paged_decode" in registry.ops()


def test_registry_env_override_and_explicit(monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, " other_op=x , paged_decode=pallas_triton ")
    assert registry.resolve("paged_decode", backend="cpu").name == "pallas_triton"
    assert registry.resolve("paged_decode", "reference", backend="gpu").name == "reference"  # argument wins
    # The env-selected Pallas implementation runs off GPU in interpret mode and agrees with the reference.
    case = dict(seed=3, b=2, hkv=2, g=2, d=16, page_size=16, width=3, lengths=[5, 48], null_tail=True)
    q, k, v, pt, lens = make_case(dtype=jnp.float32, **case)
    out = registry.get("paged_decode")(q, k, v, pt, lens, 0.25)
    np.testing.assert_allclose(out, paged_decode_reference(q, k, v, pt, lens, 0.25), atol=1e-5)

    monkeypatch.setenv(registry.ENV_VAR, "paged_decode=nope")
    with pytest.raises(KeyError, match="nope"):
        registry.get("paged_decode")
    monkeypatch.setenv(registry.ENV_VAR, "paged_decode")
    with pytest.raises(ValueError, match="malformed"):
        registry.get("paged_decode")
    monkeypatch.delenv(registry.ENV_VAR)
    with pytest.raises(KeyError, match="no kernel op"):
        registry.get("no_such_op")


def test_registry_register_custom(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    registry.register("_test_op", "reference", lambda x: x + 1, backends=("any",))

    @registry.register("_test_op", "pallas_triton", backends=("rocm",))
    def fast(x):
        return x + 2

    assert registry.get("_test_op", backend="cpu")(0) == 1
    assert registry.get("_test_op", backend="rocm")(0) == 2
    assert registry.get("_test_op", backend="cuda")(0) == 1  # registered for ROCm only
    with pytest.raises(ValueError, match="unknown backend"):
        registry.register("_test_op", "x", fast, backends=("metal",))


# ---------------------------------------------------------------------------------------------- static checks

def test_check_block_shapes_errors():
    with pytest.raises(ValueError, match=r"block 'k' has shape \(24, 64\).*extent 24 on axis 0"):
        registry.check_block_shapes("kern", {"q": (16, 64), "k": (24, 64)})
    with pytest.raises(ValueError, match=r"dot 'qk' has M=8"):
        registry.check_block_shapes("kern", {"q": (8, 64)}, dots={"qk": (8, 32, 64)})
    with pytest.raises(ValueError, match=r"exceeds the budget of 65536 B.*largest tile is block 'v'"):
        registry.check_block_shapes("kern", {}, smem={"q": 1024, "v": 80 * 1024}, backend="rocm")
    total = registry.check_block_shapes("kern", {"q": (16, 64)}, dots={"qk": (16, 16, 64)}, smem={"q": 2048},
                                        smem_budget=4096)
    assert total == 2048
    assert registry.smem_budget_bytes("rocm") == 64 * 1024
    assert registry.smem_budget_bytes("cpu") == 227 * 1024  # off GPU: the H200 target


def test_paged_decode_rejects_bad_blocks_before_lowering():
    q, k, v, pt, lens = make_case(0, 1, 1, 2, 16, 8, 4, [5], True, jnp.float32)
    with pytest.raises(ValueError, match=r"block 'k' has shape \(24, 16\)"):
        paged_decode(q, k, v, pt, lens, 0.25, pages_per_block=3, interpret=True)
    with pytest.raises(ValueError, match=r"dot 'qk' has N=8"):  # 1 page of 8 tokens: too small a dot
        paged_decode(q, k, v, pt, lens, 0.25, pages_per_block=1, interpret=True)
    q48, k48, v48, pt48, lens48 = make_case(0, 1, 1, 2, 48, 16, 2, [5], True, jnp.float32)
    with pytest.raises(ValueError, match=r"block 'q' has shape \(16, 48\)"):
        paged_decode(q48, k48, v48, pt48, lens48, 0.25, pages_per_block=1, interpret=True)
    with pytest.raises(ValueError, match="exceeds the budget"):
        paged_decode(q, k, v, pt, lens, 0.25, pages_per_block=2, interpret=True, smem_budget=1024)


def test_default_configs_fit_targets():
    """The 27B's attention (H=24, Hkv=4, D=256, page 16, bf16) fits Hopper and ROCm with the defaults."""
    for backend, budget in (("cuda", 227 * 1024), ("rocm", 64 * 1024)):
        cfg = default_config(256, 16, jnp.bfloat16, backend=backend)
        plan = block_plan(batch=8, n_heads=24, n_kv_heads=4, head_dim=256, page_size=16, width=260,
                          dtype=jnp.bfloat16, pages_per_block=cfg["pages_per_block"], num_partitions=None,
                          num_stages=cfg["num_stages"], smem_budget=budget)
        assert plan["gp"] == 16 and plan["smem_bytes"] <= budget
        assert plan["n_partitions"] * plan["pages_per_partition"] >= 260


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 128), st.integers(1, 8), st.integers(1, 4096), st.sampled_from([132, 264, 528]))
def test_auto_partitions_fill_but_never_exceed_the_resident_grid(b, hkv, n_blocks, target):
    s = auto_partitions(b, hkv, n_blocks, target_programs=target)
    assert 1 <= s <= n_blocks
    assert b * hkv * s <= max(target, b * hkv)  # never a second, mostly empty wave
    assert s == n_blocks or b * hkv * (s + 1) > target  # and no room for another partition per (sequence, head)
