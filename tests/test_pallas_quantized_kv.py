"""Quantized KV pages (fp8 e4m3 / int8 + per-token scales) in the Pallas paged-decode and tree-attention kernels
(CPU interpret mode) against the references on the same ``QuantizedPages`` (which dequantize through
``kv_quant.take``); the model's dispatch of quantized pages to the kernels; the ROCm fp8 fallback; static plans."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from hypothesis import example, given, settings

from dflash_jax.kv import quant as kv_quant
from dflash_jax.models import attention
from pallas_kernels import paged_decode as pd
from pallas_kernels import registry
from pallas_kernels import tree_attention as ta
import test_pallas_paged_decode as tpd
import test_pallas_tree_attention as tta

pytestmark = pytest.mark.xdist_group("pallas_quantized_kv")

KV_DTYPES = [jnp.float8_e4m3fn, jnp.int8]


def quantize(q, k, v, dtype, compute_dtype):
    """f32 q and pages -> q in the compute dtype and ``QuantizedPages`` K/V read back in it."""
    return (q.astype(compute_dtype), kv_quant.quantize_pages(k, dtype, compute_dtype),
            kv_quant.quantize_pages(v, dtype, compute_dtype))


def assert_close(out, ref, compute_dtype, tol):
    out, ref = (np.asarray(a.astype(jnp.float32)) for a in (out, ref))
    assert out.shape == ref.shape and np.isfinite(out).all()
    err = np.abs(out - ref).max(initial=0.0)
    bound = tol if compute_dtype == jnp.float32 else tol * max(1.0, np.abs(ref).max(initial=0.0))
    assert err <= bound, err


# ---------------------------------------------------------------------------------------------- paged decode

def check_decode(case, static, kv_dtype, compute_dtype, tol):
    q, k, v, pt, lens = tpd.make_case(dtype=jnp.float32, **case)
    q, kq, vq = quantize(q, k, v, kv_dtype, compute_dtype)
    scale = case["d"] ** -0.5
    out = tpd.run_kernel(q, kq, vq, pt, lens, scale, **static)
    ref = pd.paged_decode_reference(q, kq, vq, pt, lens, scale)
    vis = tpd.has_visible_key(pt, lens, case["page_size"])
    assert (np.asarray(out.astype(jnp.float32))[~vis] == 0).all()  # no visible key: zeros
    assert_close(out[vis], ref[vis], compute_dtype, tol)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@settings(max_examples=4, **tpd.SETTINGS)
@given(tpd.decode_cases())
@example(tpd.EDGE)
def test_decode_kernel_matches_reference_quantized_f32(kv_dtype, c):
    check_decode(c[0], c[1], kv_dtype, jnp.float32, 1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_kernel_matches_reference_quantized_bf16(kv_dtype):
    check_decode(*tpd.EDGE, kv_dtype, jnp.bfloat16, 2e-2)


# ---------------------------------------------------------------------------------------------- tree attention

def check_tree(case, static, kv_dtype, compute_dtype, tol):
    q, k, v, pt, start, kt, vt, anc = tta.make_case(dtype=jnp.float32, **case)
    q, kq, vq = quantize(q, k, v, kv_dtype, compute_dtype)
    args = (q, kq, vq, pt, start, kt.astype(compute_dtype), vt.astype(compute_dtype), anc)
    scale = case["d"] ** -0.5
    assert_close(tta.run_kernel(args, scale, **static), ta.tree_attention_reference(*args, scale), compute_dtype, tol)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@settings(max_examples=4, **tta.SETTINGS)
@given(tta.tree_cases())
@example(tta.EDGE)
@example(tta.ONE_NODE)
def test_tree_kernel_matches_reference_quantized_f32(kv_dtype, c):
    check_tree(c[0], c[1], kv_dtype, jnp.float32, 1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_tree_kernel_matches_reference_quantized_bf16(kv_dtype):
    check_tree(*tta.EDGE, kv_dtype, jnp.bfloat16, 2e-2)


def test_quantized_pages_equal_their_dequantized_plain_pages():
    """The kernel on QuantizedPages equals the same kernel on the pages dequantized up front (f32): the scales are
    applied to the right keys, including through the flash-decoding split and the prefetch double buffer."""
    case, static = tpd.EDGE
    q, k, v, pt, lens = tpd.make_case(dtype=jnp.float32, **case)
    q, kq, vq = quantize(q, k, v, jnp.int8, jnp.float32)
    plain = [kv_quant.take(p, jnp.arange(p.shape[0])) for p in (kq, vq)]
    out = tpd.run_kernel(q, kq, vq, pt, lens, 0.3, **static)
    np.testing.assert_allclose(np.asarray(out), np.asarray(tpd.run_kernel(q, *plain, pt, lens, 0.3, **static)),
                               atol=1e-5)


# ---------------------------------------------------------------------------------------------- model dispatch

def uses_pallas(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_model_dispatches_quantized_pages_to_the_kernels(monkeypatch, kv_dtype):
    """With the Pallas implementations selected, attention.paged_attention (T = 1) and attention.tree_attention
    run the kernels on quantized pages (a pallas_call in the trace) and agree with the references."""
    dcase = dict(seed=6, b=3, hkv=2, g=3, d=16, page_size=8, width=4, lengths=[1, 9, 32], null_tail=True,
                 non_resident=[(2, 1)])
    q, k, v, pt, lens = tpd.make_case(dtype=jnp.float32, **dcase)
    q, kq, vq = quantize(q, k, v, kv_dtype, jnp.float32)
    pos = (lens - 1)[:, None]
    tcase = dict(seed=3, b=2, hkv=2, g=3, d=16, page_size=8, width=3, n=5, starts=[5, 24],
                 parents=[[-1, 0, 0, 1, 2], [-1, 0, 1, -1, 3]], non_resident=[(1, 1)])
    tq, tk, tv, tpt, start, kt, vt, anc = tta.make_case(dtype=jnp.float32, **tcase)
    tq, tkq, tvq = quantize(tq, tk, tv, kv_dtype, jnp.float32)
    targs = (tq, tkq, tvq, tpt, start, kt, vt, anc)
    decode = lambda *a: attention.paged_attention(*a, 0.25)  # noqa: E731
    tree = lambda *a: attention.tree_attention(*a, 0.25)  # noqa: E731

    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    ref_dec = attention.paged_attention_reference(q[:, None], kq, vq, pt, pos, 0.25)
    ref_tree = attention.tree_attention_reference(*targs, 0.25)
    monkeypatch.setenv(registry.ENV_VAR, "tree_attention=pallas_triton,paged_decode=pallas_triton")
    assert uses_pallas(decode, q[:, None], kq, vq, pt, pos) and uses_pallas(tree, *targs)
    np.testing.assert_allclose(np.asarray(decode(q[:, None], kq, vq, pt, pos)), np.asarray(ref_dec), atol=1e-5)
    np.testing.assert_allclose(np.asarray(tree(*targs)), np.asarray(ref_tree), atol=1e-5)


def test_rocm_fp8_pages_fall_back_to_the_reference_with_a_warning(monkeypatch):
    """gfx942's Triton converts only e4m3fnuz fp8: e4m3fn pages on ROCm run the reference, saying why; int8 pages
    (and fp8 pages on CUDA) pass the check."""
    q, k, v, pt, lens = tpd.make_case(0, 2, 1, 2, 16, 8, 2, [3, 16], True, jnp.float32)
    q, kq, vq = quantize(q, k, v, jnp.float8_e4m3fn, jnp.float32)
    monkeypatch.setattr(registry, "current_backend", lambda: "rocm")
    with pytest.warns(RuntimeWarning, match="paged_decode: the Pallas kernel cannot take these KV pages.*e4m3fnuz"):
        out = pd.paged_decode_pallas(q, kq, vq, pt, lens, 0.2)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(pd.paged_decode_reference(q, kq, vq, pt, lens, 0.2)))
    tq, tk, tv, tpt, start, kt, vt, anc = tta.make_case(
        seed=1, b=1, hkv=1, g=2, d=16, page_size=8, width=2, n=3, starts=[9], parents=[[-1, 0, 1]], non_resident=[],
        dtype=jnp.float32)
    tq, tkq, tvq = quantize(tq, tk, tv, jnp.float8_e4m3fn, jnp.float32)
    with pytest.warns(RuntimeWarning, match="tree_attention: the Pallas kernel cannot take these KV pages"):
        ta.tree_attention_pallas(tq, tkq, tvq, tpt, start, kt, vt, anc, 0.2)
    pd.check_page_dtype("paged_decode", kv_quant.quantize_pages(k, jnp.int8), "rocm")
    pd.check_page_dtype("paged_decode", kq, "cuda")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_default_plans_fit_targets_quantized(kv_dtype):
    """The 27B's attention (24 / 4 heads x 256, page 16) on quantized pages with bf16 compute fits Hopper and ROCm
    with the bf16 defaults, and a block moves about half the bytes of bf16 (the rows plus f32 scales)."""
    for backend, budget in (("cuda", 227 * 1024), ("rocm", 64 * 1024)):
        cfg = pd.default_config(256, 16, jnp.bfloat16, backend=backend)
        common = dict(batch=1, n_heads=24, n_kv_heads=4, head_dim=256, page_size=16, width=1024,
                      pages_per_block=cfg["pages_per_block"], num_partitions=None, num_stages=cfg["num_stages"],
                      smem_budget=budget)
        plan = pd.block_plan(dtype=kv_dtype, compute_dtype=jnp.bfloat16, **common)
        base = pd.block_plan(dtype=jnp.bfloat16, **common)
        assert plan["smem_bytes"] <= budget
        assert plan["kv_bytes_per_block"] / base["kv_bytes_per_block"] == pytest.approx((256 + 4) / 512)
        tcfg = ta.default_config(256, 16, jnp.bfloat16, backend=backend)
        tplan = ta.block_plan(batch=16, n_tree=16, n_heads=24, n_kv_heads=4, head_dim=256, page_size=16, width=1024,
                              dtype=kv_dtype, compute_dtype=jnp.bfloat16, block_m=tcfg["block_m"],
                              pages_per_block=tcfg["pages_per_block"], num_partitions=None,
                              num_stages=tcfg["num_stages"], smem_budget=budget)
        assert tplan["smem_bytes"] <= budget


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_model_verify_and_decode_on_quantized_pages_with_kernels_equal_reference(monkeypatch, kv_dtype):
    """The tiny target's forward_tree and one-token forward over quantized KV pages (written by its own prefill):
    the same logits with the Pallas kernels (interpret mode) as with the references."""
    from test_tree_verify import PAGE, WIDTH, _prefill, _tree_input, target

    from dflash_jax.models import qwen36
    from dflash_jax.state import KVPages, RecurrentSlots, StepInput

    t = target("qwen36_tiny_a")
    cfg = t.config
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, cfg.vocab_size, 21).tolist()
    tok = np.zeros((1, 64), np.int32)
    tok[0, :len(prompt) - 1] = prompt[:-1]
    kv = KVPages.zeros(cfg, WIDTH + 1, PAGE, kv_dtype, compute_dtype=jnp.float32)
    kv, rec = _prefill(t.params, cfg, jnp.asarray(tok), jnp.asarray([len(prompt) - 1], jnp.int32), kv,
                       RecurrentSlots.zeros(cfg, 2, jnp.float32))
    assert isinstance(kv.k[0], kv_quant.QuantizedPages)
    toks = rng.integers(0, cfg.vocab_size, 8).tolist()
    toks[0] = prompt[-1]
    tree = _tree_input(toks, [-1, 0, 0, 1, -1, 2, 5, 3], len(prompt) - 1)
    step = StepInput(tokens=jnp.asarray([[prompt[-1]]], jnp.int32),
                     positions=jnp.asarray([[len(prompt) - 1]], jnp.int32), n_valid=jnp.ones((1,), jnp.int32),
                     slots=jnp.ones((1,), jnp.int32), page_table=tree.page_table)

    def run():  # a fresh jit per call: the implementation is chosen at trace time
        def verify(tr, kv, rec):
            return qwen36.lm_logits(t.params, qwen36.forward_tree(t.params, cfg, tr, kv, rec)[0])

        def decode(s, kv, rec):
            return qwen36.lm_logits(t.params, qwen36.forward(t.params, cfg, s, kv, rec)[0])

        return (np.asarray(jax.jit(verify)(tree, kv, rec)), np.asarray(jax.jit(decode)(step, kv, rec)),
                uses_pallas(verify, tree, kv, rec) and uses_pallas(decode, step, kv, rec))

    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    ref_tree, ref_dec, ref_pallas = run()
    monkeypatch.setenv(registry.ENV_VAR, "tree_attention=pallas_triton,paged_decode=pallas_triton")
    out_tree, out_dec, out_pallas = run()
    assert out_pallas and not ref_pallas
    np.testing.assert_allclose(out_tree, ref_tree, atol=1e-4)
    np.testing.assert_allclose(out_dec, ref_dec, atol=1e-4)
