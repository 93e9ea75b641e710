"""``pallas_kernels.tree_attention.pairs`` (fp8 pages read as uint16 pairs, what the registered tree attention runs
for fp8 pages on CUDA): interpret mode against the reference on the same ``QuantizedPages`` over drawn trees, ragged
prefixes, non-resident pages and prefix partitions, and with value scales far apart from page to page; the
routing; the CUDA lowering."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from hypothesis import example, given, settings

from dflash_jax.kv import quant as kv_quant
from pallas_kernels import registry
from pallas_kernels import tree_attention as ta
from pallas_kernels.paged_decode.pairs import pack_pairs
from pallas_kernels.tree_attention import fp8 as fp8_products
from pallas_kernels.tree_attention import pairs
import test_pallas_tree_attention as tta
from conftest import FAST_COMPILE
from test_pallas_lowering import CFG, attention_args, lower

pytestmark = [pytest.mark.xdist_group("pallas_quantized_kv"),
              pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")]

# A full 16-slot budget (one chain, one flat fan-out) over two KV heads with the 27B's group of 6: 96 rows in one
# 128-row tile, the prefix in three partitions, one row's prefix empty.
FULL = (dict(seed=7, b=2, hkv=2, g=6, d=32, page_size=16, width=6, n=16, starts=[90, 0],
             parents=[[-1] + list(range(15)), [-1] + [0] * 15], non_resident=[(0, 2)]),
        dict(block_m=128, pages_per_block=1, num_partitions=3))


def fp8_case(case, v_page_factor=None, v_tree_factor=1.0):
    """tta.make_case's arrays with q and the tree K/V in bf16 and the pages as fp8 ``QuantizedPages``;
    ``v_page_factor(p)``: what V of page p is multiplied by (p an array of page ids), ``v_tree_factor`` the tree's V."""
    q, k, v, pt, start, kt, vt, anc = tta.make_case(dtype=jnp.float32, **case)
    if v_page_factor is not None:
        v = v * v_page_factor(jnp.arange(v.shape[0]))[:, None, None, None]
    kq, vq = (kv_quant.quantize_pages(x, jnp.float8_e4m3fn, jnp.bfloat16) for x in (k, v))
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    return bf(q), kq, vq, pt, start, bf(kt), bf(vt * v_tree_factor), anc


def run_pairs(args, scale, **static):
    q, kq, vq, pt, start, kt, vt, anc = args
    static = {k: v for k, v in static.items() if k != "prefetch"}
    keys = kq.data if static.get("fp8_keys") else pack_pairs(kq.data)
    head = (q, keys, pack_pairs(vq.data), pt, start, kt, vt, anc)
    return pairs.tree_attention_pairs.lower(*head, scale, kq.scale, vq.scale, interpret=True, **static).compile(
        compiler_options=FAST_COMPILE)(*head, kq.scale, vq.scale)  # the compiled call takes no static scale


def check(args, scale, static, relative=False):
    """The pair kernel against the reference, within 2% of the reference's largest magnitude (at least 1 unless
    ``relative``)."""
    out = np.asarray(run_pairs(args, scale, **static).astype(jnp.float32))
    ref = np.asarray(ta.tree_attention_reference(*args, scale).astype(jnp.float32))
    assert out.shape == ref.shape and np.isfinite(out).all()
    err = np.abs(out - ref).max()
    top = np.abs(ref).max()
    assert err <= 2e-2 * (top if relative else max(1.0, top)), (err, top)


@settings(max_examples=3, **tta.SETTINGS)
@given(tta.tree_cases())
@example(tta.EDGE)
@example(tta.ONE_NODE)
@example(FULL)
def test_pair_kernel_matches_reference_on_fp8_pages(c):
    case, static = c
    check(fp8_case(case), case["d"] ** -0.5, static)


@pytest.mark.parametrize("v_page_factor, v_tree_factor", [(lambda p: 1e3 ** (p % 5 - 2.0), 1.0),
                                                            (lambda p: jnp.full(p.shape, 1e-6), 1e-6)],
                         ids=["far_apart", "tiny"])
def test_pair_kernel_keeps_value_scales_in_f16_range(v_page_factor, v_tree_factor):
    """V pages 10^-6 .. 10^6 apart (the output rescaled between blocks of different largest value scale; two pages
    a block), and V of 1e-6 everywhere (value scales ~1e-8, below f16's range unless taken relative to the
    block's largest)."""
    case, static = tta.EDGE
    args = fp8_case(case, v_page_factor, v_tree_factor)
    check(args, case["d"] ** -0.5, {**static, "pages_per_block": 2, "num_partitions": 1}, relative=True)


@settings(max_examples=2, **tta.SETTINGS)
@given(tta.tree_cases())
@example(tta.EDGE)
@example(FULL)
def test_fp8_keys_match_reference_on_fp8_pages(c):
    """The opt-in fp8-key form: keys as e4m3 rows into e4m3 products with q's two e4m3 parts."""
    case, static = c
    check(fp8_case(case), case["d"] ** -0.5, {**static, "fp8_keys": True})


def test_split_e4m3_keeps_about_bf16_precision():
    """q . k from q's two e4m3 parts is within bf16's rounding of q . k for e4m3 keys, over rows of very different
    magnitude, a zero row and tiny entries."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 256)).astype(np.float32) * np.array([1e-4, 1e-2, 1, 30, 1e3, 0])[:, None]
    q[2, :8] = 1e-6
    k = jnp.asarray(rng.standard_normal((32, 256)), jnp.float32).astype(jnp.float8_e4m3fn)
    sq = fp8_products.row_scale(jnp.asarray(q))
    hi, lo = fp8_products.split_e4m3(jnp.asarray(q), sq[:, None])
    assert hi.dtype == lo.dtype == jnp.float8_e4m3fn and sq.shape == (6,)
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    got = (f(hi) @ f(k).T + f(lo) @ f(k).T) / f(sq)[:, None]
    exact = f(q) @ f(k).T
    bf16 = f(jnp.asarray(q).astype(jnp.bfloat16)) @ f(k).T
    scale = np.abs(f(q)) @ np.abs(f(k)).T + 1e-30
    assert np.all(np.abs(got - exact) <= 2 * np.abs(bf16 - exact).max(axis=1, keepdims=True) + 1e-6 * scale)
    assert np.all(got[5] == 0)


def test_halves_and_interleave_are_inverse():
    x = jnp.arange(2 * 3 * 8).reshape(2, 3, 8)
    h = pairs.halves(x)
    assert h.shape == (2, 3, 2, 4)
    np.testing.assert_array_equal(np.asarray(h[..., 0, :]), np.asarray(x[..., 0::2]))
    np.testing.assert_array_equal(np.asarray(h[..., 1, :]), np.asarray(x[..., 1::2]))
    np.testing.assert_array_equal(np.asarray(pairs.interleave(h)), np.asarray(x))


def test_registered_kernel_reads_fp8_pages_as_pairs_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(pairs, "tree_attention_pairs", lambda *a, **k: calls.append((a, k)) or "pairs")
    monkeypatch.setattr(ta, "tree_attention", lambda *a, **k: "tiles")
    n, d = 3, 32
    q = jnp.zeros((1, n, 4, d), jnp.bfloat16)
    plain = jnp.zeros((2, 8, 1, d), jnp.float32)
    tree = (jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), jnp.zeros((1, n, 1, d), jnp.float32),
            jnp.zeros((1, n, 1, d), jnp.float32), jnp.ones((1, n, n), bool))
    fp8 = kv_quant.quantize_pages(plain, jnp.float8_e4m3fn, jnp.bfloat16)
    int8 = kv_quant.quantize_pages(plain, jnp.int8, jnp.bfloat16)
    monkeypatch.setattr(registry, "current_backend", lambda: "cuda")
    assert ta.tree_attention_pallas(q, fp8, fp8, *tree, 0.25) == "pairs"
    (args, kw), = calls
    assert args[1].dtype == jnp.uint16 and args[1].shape == (2, 8, 1, d // 2)  # the same bytes as channel pairs
    assert args[5].dtype == jnp.bfloat16  # the tree K/V in the pages' compute dtype
    cfg = ta.default_config(d, 8, jnp.bfloat16, backend="cuda", quantized=True)
    assert (kw["block_m"], kw["pages_per_block"]) == (cfg["block_m"], cfg["pages_per_block"])
    assert ta.tree_attention_pallas(q, int8, int8, *tree, 0.25) == "tiles"  # int8 pages keep the 8-bit tiles
    narrow = kv_quant.quantize_pages(plain[..., :16], jnp.float8_e4m3fn, jnp.bfloat16)  # D / 2 < 16: no pair dots
    assert ta.tree_attention_pallas(q[..., :16], narrow, narrow, *tree[:2], tree[2][..., :16], tree[3][..., :16],
                                    tree[4], 0.25) == "tiles"
    monkeypatch.setattr(registry, "current_backend", lambda: "rocm")
    assert ta.tree_attention_pallas(q, int8, int8, *tree, 0.25) == "tiles"
    monkeypatch.setattr(registry, "current_backend", lambda: "cpu")  # off CUDA: the tile kernel (interpret mode)
    assert ta.tree_attention_pallas(q, fp8, fp8, *tree, 0.25) == "tiles"
    assert len(calls) == 1


@pytest.mark.parametrize("b,n", [(16, 16), (1, 23)])
def test_pair_kernel_lowers_for_cuda_with_the_pair_conversion_in_inline_ptx(b, n):
    """The 27B's heads with the registered defaults: B16 x a 16-node tree (one row tile), and B1 x 23 nodes (two
    row tiles) with the prefix split."""
    q, kp, _, pt, start, kt, anc = attention_args(b, n, jnp.bfloat16)
    pair_pages = jax.ShapeDtypeStruct((*kp.shape[:3], kp.shape[3] // 2), jnp.uint16)
    scales = jax.ShapeDtypeStruct(kp.shape[:3], jnp.float32)
    cfg = ta.default_config(CFG.head_dim, kp.shape[1], jnp.bfloat16, backend="cuda", quantized=True)
    fn = lambda *a: pairs.tree_attention_pairs(  # noqa: E731
        *a[:8], CFG.head_dim ** -0.5, *a[8:], block_m=cfg["block_m"], pages_per_block=cfg["pages_per_block"],
        num_partitions=None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    text = lower("cuda", fn, q, pair_pages, pair_pages, pt, start, kt, kt, anc, scales, scales)
    assert "__gpu$xla.gpu.triton" in text and "tree_attention_fp8_pairs" in text and "cvt.rn.f16x2.e4m3x2" in text


def test_fp8_keys_lower_to_hopper_fp8_products():
    """With fp8 keys the score products are e4m3 x e4m3 dots that may sum 128 products in the MMA's own
    accumulator (without that Triton will not use Hopper's fp8 MMA for an f32 result)."""
    import re

    from conftest import load_experiment

    mod = load_experiment("triton_offline")
    fn, args = mod.case("tree_attention_pairs", "fp8", b=2, n=16, prefix=1024, overrides={"fp8_keys": True})
    ttir, _ = mod.lower_for_h100(fn, *args)
    fp8_dots = [ln for ln in ttir.splitlines() if re.search(r"tt\.dot .*f8E4M3FN>? \*", ln)]
    assert len(fp8_dots) == 2 and all("maxNumImpreciseAcc = 128" in ln for ln in fp8_dots), fp8_dots


def run_fp8_products(args, scale, **static):
    q, kq, vq, pt, start, kt, vt, anc = args
    static = {k: v for k, v in static.items() if k != "prefetch"}
    head = (q, kq.data, vq.data, pt, start, kt, vt, anc)
    return fp8_products.tree_attention_fp8.lower(*head, scale, kq.scale, vq.scale, interpret=True, **static).compile(
        compiler_options=FAST_COMPILE)(*head, kq.scale, vq.scale)


@settings(max_examples=2, **tta.SETTINGS)
@given(tta.tree_cases())
@example(tta.EDGE)
@example(tta.ONE_NODE)
@example(FULL)
def test_fp8_products_kernel_matches_reference_on_fp8_pages(c):
    """``tree_attention/fp8.py`` (opt-in): e4m3 products on both sides, q and the probabilities split in two parts."""
    case, static = c
    args = fp8_case(case)
    scale = case["d"] ** -0.5
    out = np.asarray(run_fp8_products(args, scale, **static).astype(jnp.float32))
    ref = np.asarray(ta.tree_attention_reference(*args, scale).astype(jnp.float32))
    assert out.shape == ref.shape and np.isfinite(out).all()
    assert np.abs(out - ref).max() <= 2e-2 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("v_page_factor, v_tree_factor", [(lambda p: 1e3 ** (p % 5 - 2.0), 1.0),
                                                            (lambda p: jnp.full(p.shape, 1e-6), 1e-6)],
                         ids=["far_apart", "tiny"])
def test_fp8_products_keep_value_scales_in_range(v_page_factor, v_tree_factor):
    case, static = tta.EDGE
    args = fp8_case(case, v_page_factor, v_tree_factor)
    scale = case["d"] ** -0.5
    out = np.asarray(run_fp8_products(args, scale, **{**static, "pages_per_block": 2, "num_partitions": 1}))
    ref = np.asarray(ta.tree_attention_reference(*args, scale).astype(jnp.float32))
    assert np.abs(out.astype(np.float32) - ref).max() <= 2e-2 * np.abs(ref).max()


def test_fp8_products_lower_to_hopper_fp8_mma():
    import re

    from conftest import load_experiment

    mod = load_experiment("triton_offline")
    fn, args = mod.case("tree_attention_fp8", "fp8", b=2, n=16, prefix=1024, overrides={})
    ttir, _ = mod.lower_for_h100(fn, *args)
    fp8_dots = [ln for ln in ttir.splitlines() if re.search(r"tt\.dot .*f8E4M3FN>? \*", ln)]
    assert len(fp8_dots) == 4 and all("maxNumImpreciseAcc = 128" in ln for ln in fp8_dots), fp8_dots
