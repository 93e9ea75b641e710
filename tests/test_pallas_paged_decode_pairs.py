"""``pallas_kernels.paged_decode.pairs`` (fp8 pages read as uint16 pairs, implementation ``pallas_triton_pairs``):
interpret mode against the reference on the same ``QuantizedPages`` for both dot variants, ragged lengths,
non-resident pages and flash-decoding partitions; the pair view of the bytes; the registered implementation's
routing; the CUDA lowering carries the inline PTX of both halves."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from hypothesis import example, given, settings

from dflash_jax.kv import quant as kv_quant
from pallas_kernels import paged_decode as pd
from pallas_kernels import registry
from pallas_kernels.paged_decode import pairs
import test_pallas_paged_decode as tpd
from test_pallas_lowering import lower

pytestmark = [pytest.mark.xdist_group("pallas_quantized_kv"),
              pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")]


def run_pairs(case, static, dots):
    q, k, v, pt, lens = tpd.make_case(dtype=jnp.float32, **case)
    q = q.astype(jnp.bfloat16)
    kq, vq = (kv_quant.quantize_pages(x, jnp.float8_e4m3fn, jnp.bfloat16) for x in (k, v))
    scale = case["d"] ** -0.5
    out = pairs.paged_decode_pairs(q, pairs.pack_pairs(kq.data), pairs.pack_pairs(vq.data), pt, lens, scale,
                                   kq.scale, vq.scale, dots=dots, interpret=True,
                                   pages_per_block=static["pages_per_block"],
                                   num_partitions=static["num_partitions"])
    ref = pd.paged_decode_reference(q, kq, vq, pt, lens, scale)
    return out, ref, tpd.has_visible_key(pt, lens, case["page_size"])


@pytest.mark.parametrize("dots", pairs.DOTS)
@settings(max_examples=3, **tpd.SETTINGS)
@given(tpd.decode_cases())
@example(tpd.EDGE)
def test_pair_kernel_matches_reference_on_fp8_pages(dots, c):
    case, static = c
    if case["d"] % 2:
        return
    out, ref, vis = run_pairs(case, static, dots)
    out, ref = (np.asarray(a.astype(jnp.float32)) for a in (out, ref))
    assert out.shape == ref.shape and np.isfinite(out).all()
    assert (out[~vis] == 0).all()  # no visible key: zeros
    assert np.abs(out[vis] - ref[vis]).max(initial=0.0) <= 2e-2 * max(1.0, np.abs(ref).max(initial=0.0))


def test_pairs_hold_channel_2j_in_the_low_byte_and_convert_exactly():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8)) * 50, jnp.float32).astype(jnp.float8_e4m3fn)
    u = pairs.pack_pairs(x)
    assert u.shape == (3, 4) and u.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(u) & 0xFF, np.asarray(x).view(np.uint8)[:, 0::2])
    even, odd = pairs.pair_halves(u, "float16", interpret=True)
    np.testing.assert_array_equal(np.asarray(even), np.asarray(x[:, 0::2].astype(jnp.float16)))
    np.testing.assert_array_equal(np.asarray(odd), np.asarray(x[:, 1::2].astype(jnp.float16)))
    even_b, _ = pairs.pair_halves(u, "bfloat16", interpret=True)  # bf16 halves: the values times 2^-120
    np.testing.assert_array_equal(np.asarray(even_b.astype(jnp.float32)) * 2.0 ** 120,
                                  np.asarray(x[:, 0::2].astype(jnp.float32)))


def test_registered_implementation_is_opt_in_and_routes_other_pages_to_the_library_kernel(monkeypatch):
    assert registry.resolve("paged_decode", backend="cuda").name == "pallas_triton"  # not preferred: opt-in
    calls = []
    monkeypatch.setattr(pd, "paged_decode_pallas", lambda *a: calls.append(a) or "library")
    q = jnp.zeros((1, 4, 16), jnp.bfloat16)
    pages = jnp.zeros((2, 8, 1, 16), jnp.bfloat16)
    pt, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    assert pairs.paged_decode_pairs_pallas(q, pages, pages, pt, lens, 0.25) == "library"  # bf16 pages
    fp8 = kv_quant.quantize_pages(pages.astype(jnp.float32), jnp.float8_e4m3fn, jnp.bfloat16)
    assert pairs.paged_decode_pairs_pallas(q, fp8, fp8, pt, lens, 0.25) == "library"  # fp8 pages off CUDA
    assert len(calls) == 2


def test_pair_kernel_lowers_for_cuda_with_both_halves_in_inline_ptx():
    sd = jax.ShapeDtypeStruct
    b, h, hkv, d, n_pages, width = 2, 24, 4, 256, 64, 16
    pairs_sd = sd((n_pages, 16, hkv, d // 2), jnp.uint16)
    scales = sd((n_pages, 16, hkv), jnp.float32)
    for dots in pairs.DOTS:
        fn = lambda q, kp, vp, pt, ln, ks, vs, dots=dots: pairs.paged_decode_pairs(  # noqa: E731
            q, kp, vp, pt, ln, d ** -0.5, ks, vs, dots=dots)
        text = lower("cuda", fn, sd((b, h, d), jnp.bfloat16), pairs_sd, pairs_sd, sd((b, width), jnp.int32),
                     sd((b,), jnp.int32), scales, scales)
        assert "__gpu$xla.gpu.triton" in text
