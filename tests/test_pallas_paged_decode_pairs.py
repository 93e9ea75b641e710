"""``pallas_kernels.paged_decode.pairs`` (fp8 pages read as uint16 pairs, what the registered paged decode runs for
fp8 pages on CUDA): interpret mode against the reference on the same ``QuantizedPages`` for both dot variants,
ragged lengths, non-resident pages and flash-decoding partitions; the pair view of the bytes; the routing; the
CUDA lowering."""

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


def test_registered_kernel_reads_fp8_pages_as_pairs_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(pairs, "paged_decode_pairs", lambda *a, **k: calls.append((a, k)) or "pairs")
    q = jnp.zeros((1, 4, 32), jnp.bfloat16)
    plain = jnp.zeros((2, 8, 1, 32), jnp.float32)
    fp8 = kv_quant.quantize_pages(plain, jnp.float8_e4m3fn, jnp.bfloat16)
    pt, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    monkeypatch.setattr(registry, "current_backend", lambda: "cuda")
    assert pd.paged_decode_pallas(q, fp8, fp8, pt, lens, 0.25) == "pairs"
    (args, kw), = calls
    assert args[1].dtype == jnp.uint16 and args[1].shape == (2, 8, 1, 16)  # the same bytes as channel pairs
    assert kw["pages_per_block"] == pd.default_config(32, 8, jnp.bfloat16, quantized=True)["pages_per_block"]
    int8 = kv_quant.quantize_pages(plain, jnp.int8, jnp.bfloat16)
    monkeypatch.setattr(pd, "paged_decode", lambda *a, **k: "tiles")  # int8 pages keep the 8-bit tile kernel
    assert pd.paged_decode_pallas(q, int8, int8, pt, lens, 0.25) == "tiles"
    monkeypatch.setattr(registry, "current_backend", lambda: "cpu")  # off CUDA: the tile kernel (interpret mode)
    assert pd.paged_decode_pallas(q, fp8, fp8, pt, lens, 0.25) == "tiles"
    assert len(calls) == 1


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
