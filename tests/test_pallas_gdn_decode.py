"""The fused GDN decode kernel (``gdn_decode``, CPU interpret mode) against ``qwen36.gdn_decode_reference``: outputs
and in-place state over random slots, padding rows (slot 0: no state read or written, zeros out), fresh rows (zero
state read) and invalid rows (state kept); the tiny target's batched decode step with the kernel equals the
reference."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax.models import qwen36
from pallas_kernels import registry
from pallas_kernels.gdn import decode
from conftest import FAST_COMPILE

pytestmark = pytest.mark.xdist_group("pallas_gdn")


def make_case(seed: int, b: int, hk: int, r: int, dk: int, dv: int, n_slots: int, dtype, kk: int = 4):
    """Model-like inputs; rows get distinct slots in [1, n_slots) or 0 (padding), random fresh / valid flags."""
    rng = np.random.default_rng(seed)
    hv = hk * r
    c = 2 * hk * dk + hv * dv
    f = lambda *s, dt=dtype: jnp.asarray(rng.normal(size=s), dt)  # noqa: E731
    live = rng.permutation(np.arange(1, n_slots))[:b]
    slots = np.where(rng.random(b) < 0.25, 0, live).astype(np.int32)
    proj = f(b, c + hv * dv + 2 * hv)
    cuts = np.cumsum([c, hv * dv, hv])  # fused (one part), or the four separate matrices' outputs
    parts = (proj,) if rng.random() < 0.5 else tuple(np.split(proj, cuts, axis=1))
    return dict(parts=tuple(jnp.asarray(x) for x in parts), conv_w=f(c, kk) * 0.5,
                a_log=jnp.log(jnp.asarray(rng.uniform(1, 16, hv), jnp.float32)),
                dt_bias=f(hv, dt=jnp.float32) * 0.1, norm_w=f(dv, dt=jnp.float32),
                conv_all=f(n_slots, kk - 1, c), ssm_all=f(n_slots, hv, dk, dv, dt=jnp.float32) * 0.3,
                slots=jnp.asarray(slots), fresh=jnp.asarray(rng.random(b) < 0.3),
                valid=jnp.asarray(rng.random(b) < 0.8)), hk


def run_kernel(case: dict, hk: int, **static):
    args = tuple(case.values())  # parts: a tuple argument
    fn = jax.jit(lambda *a: decode.gdn_decode(*a, n_k_heads=hk, eps=1e-6, interpret=True, **static))
    return fn.lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


@pytest.mark.parametrize("split", [False, True], ids=["one_kernel", "split"])
@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 4), hk=st.integers(1, 2), r=st.sampled_from([1, 3]),
       dk=st.sampled_from([16, 32]), dv=st.sampled_from([16, 32]), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_kernel_matches_reference(split, seed, b, hk, r, dk, dv, dtype):
    dtype = jnp.dtype(dtype)
    case, hk = make_case(seed, b, hk, r, dk, dv, n_slots=b + 3, dtype=dtype)
    want = qwen36.gdn_decode_reference(*case.values(), n_k_heads=hk, eps=1e-6)
    got = run_kernel(case, hk, num_warps=4 if seed % 2 else None, split=split)
    rtol = 1e-5 if dtype == jnp.float32 else 2e-2
    live = np.asarray(case["slots"]) > 0
    for name, w, g in zip(("y", "conv_all", "ssm_all"), want, got):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        w, g = np.asarray(w, np.float32), np.asarray(g, np.float32)
        if name == "y":  # padding rows (slot 0) read no state and output zeros
            assert not g[~live].any()
            w, g = w[live], g[live]
        np.testing.assert_allclose(g, w, atol=rtol * max(1.0, float(np.abs(w).max(initial=0.0))), err_msg=name)
    untouched = np.setdiff1d(np.arange(b + 3), np.asarray(case["slots"]))  # incl. the null slot 0
    for name, before, after in (("conv", case["conv_all"], got[1]), ("ssm", case["ssm_all"], got[2])):
        np.testing.assert_array_equal(np.asarray(after)[untouched], np.asarray(before)[untouched], err_msg=name)


def test_split_form_is_the_default_only_for_few_programs():
    assert decode.use_split(1, 16) and decode.use_split(16, 16)  # the 27B at B1-16: measured faster split
    assert not decode.use_split(17, 16) and not decode.use_split(64, 16)
    case, hk = make_case(2, 2, 2, 3, 16, 16, 5, jnp.float32)
    kernels = lambda **kw: [e.params["name"] for e in jax.make_jaxpr(  # noqa: E731
        lambda *a: decode.gdn_decode(*a, n_k_heads=hk, eps=1e-6, interpret=True, **kw))(*case.values()).eqns[0]
        .params["jaxpr"].eqns if e.primitive.name == "pallas_call"]
    assert kernels() == ["gdn_decode_hk2_dk16_dv16_qk", "gdn_decode_hk2_dk16_dv16_v"]
    assert kernels(split=False) == ["gdn_decode_hk2_dk16_dv16"]


def test_rejects_mismatched_shapes_and_split_segments():
    case, hk = make_case(0, 2, 2, 3, 16, 16, 5, jnp.float32)
    with pytest.raises(ValueError, match="disagree"):
        decode.gdn_decode(*case.values(), n_k_heads=3, eps=1e-6, interpret=True)
    row = jnp.concatenate(case["parts"], axis=1)
    with pytest.raises(ValueError, match="straddles"):  # a cut inside x
        decode.gdn_decode((row[:, :10], row[:, 10:]), *list(case.values())[1:], n_k_heads=hk, eps=1e-6,
                          interpret=True)
    assert qwen36.segment_locations((64, 96, 12), {"x": 64, "z": 96, "b": 6, "a": 6}) == {
        "x": (0, 0), "z": (1, 0), "b": (2, 0), "a": (2, 6)}


def test_gpu_default_and_fallback_for_grouped_channels(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    assert registry.resolve("gdn_decode", backend="cuda").name == "pallas_triton"  # measured faster on the H200
    assert registry.resolve("gdn_decode", backend="cpu").name == "reference"
    case, hk = make_case(1, 2, 2, 1, 16, 16, 5, jnp.float32)
    impl = registry.implementations("gdn_decode")["pallas_triton"].fn
    with pytest.warns(RuntimeWarning, match="groups=2"):
        got = impl(*case.values(), n_k_heads=hk, groups=2, eps=1e-6)
    want = qwen36.gdn_decode_reference(*case.values(), n_k_heads=hk, groups=2, eps=1e-6)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_model_batched_decode_with_kernel_equals_reference(monkeypatch):
    """Two sequences of different lengths in one decode step (and a padding row): hidden states and every GDN
    layer's slot state agree with the reference path."""
    from test_tree_verify import PAGE, WIDTH, target

    from dflash_jax.state import KVPages, RecurrentSlots, StepInput

    t = target("qwen36_tiny_a")
    cfg = t.config
    rng = np.random.default_rng(3)
    kv = KVPages.zeros(cfg, 2 * WIDTH + 1, PAGE, jnp.float32)
    rec = RecurrentSlots.zeros(cfg, 4, jnp.float32)
    pt = np.zeros((3, WIDTH), np.int32)
    pt[0], pt[1] = np.arange(1, WIDTH + 1), np.arange(WIDTH + 1, 2 * WIDTH + 1)
    fwd = jax.jit(lambda i, kv, r: qwen36.forward(t.params, cfg, i, kv, r))
    lens = (11, 6)
    tok = np.zeros((3, 16), np.int32)
    for row, n in enumerate(lens):
        tok[row, :n] = rng.integers(0, cfg.vocab_size, n)
    prefill = StepInput(tokens=jnp.asarray(tok), positions=jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (3, 16)),
                        n_valid=jnp.asarray([*lens, 0], jnp.int32), slots=jnp.asarray([1, 3, 0], jnp.int32),
                        page_table=jnp.asarray(pt))
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    _, kv, rec, _ = fwd(prefill, kv, rec)
    step = StepInput(tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 1)), jnp.int32),
                     positions=jnp.asarray([[lens[0]], [lens[1]], [0]], jnp.int32),
                     n_valid=jnp.asarray([1, 1, 0], jnp.int32), slots=jnp.asarray([1, 3, 0], jnp.int32),
                     page_table=jnp.asarray(pt))

    def run():  # a fresh jit per call: the implementation is chosen at trace time
        h, _, rec2, _ = jax.jit(lambda s, kv, r: qwen36.forward(t.params, cfg, s, kv, r))(step, kv, rec)
        return np.asarray(h[:2]), [np.asarray(x) for x in rec2.ssm + rec2.conv]

    h_ref, st_ref = run()
    monkeypatch.setenv(registry.ENV_VAR, "gdn_decode=pallas_triton")
    h, st_got = run()
    np.testing.assert_allclose(h, h_ref, atol=1e-4)
    for a, b in zip(st_got, st_ref):
        np.testing.assert_allclose(a, b, atol=1e-4)
