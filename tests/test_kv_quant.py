"""Quantized KV pages (fp8 / int8 with a scale per token and KV head): round-trip bounds, the page operations the
attention code uses, and the engine decoding with them."""

from __future__ import annotations

import functools
import os

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dflash_jax as dj
from conftest import FIXTURES
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.kv import quant as kvq
from dflash_jax.models import attention

pytestmark = pytest.mark.xdist_group("kv_quant")


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["fp8", "int8"]), rows=st.integers(1, 12), d=st.sampled_from([4, 32, 64]),
       seed=st.integers(0, 999), log_range=st.floats(0, 4))
def test_rows_round_trip_within_the_formats_bound(kind, rows, d, seed, log_range):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, 2, d)) * 10.0 ** rng.uniform(-log_range, 0, (rows, 2, d))).astype(np.float32)
    dtype = kvq.resolve_kv_dtype(kind, jnp.float32)
    # padded with all-zero rows to 12, so every example of a (kind, d) reuses one compiled shape; rows are
    # quantized independently, and a zero row must come back as zeros
    padded = np.zeros((12, 2, d), np.float32)
    padded[:rows] = x
    q, s = kvq.quantize_rows(jnp.asarray(padded), dtype)
    chex.assert_shape(s, (12, 2))
    back = np.asarray(q.astype(jnp.float32) * s[..., None])
    assert not back[rows:].any()
    back, s = back[:rows], np.asarray(s)[:rows, :, None]
    if kind == "int8":  # uniform grid of step `scale`: half a step
        bound = 0.5 * s * (1 + 1e-5)
    else:  # e4m3: 2^-4 relative for normals, 2^-10 of the scale for subnormals
        bound = np.maximum(np.abs(x) * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-5)
    assert np.all(np.abs(back - x) <= bound + 1e-30)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_write_then_gather_equals_the_dequantized_plain_pages(kind):
    rng = np.random.default_rng(0)
    shape = (6, 4, 2, 8)  # [n_pages, page_size, Hkv, D]
    qp = kvq.zeros(shape, kvq.resolve_kv_dtype(kind, jnp.float32), jnp.float32)
    plain = kvq.zeros(shape, jnp.float32)
    assert isinstance(qp, kvq.QuantizedPages) and qp.shape == shape and not isinstance(plain, kvq.QuantizedPages)
    k = jnp.asarray(rng.standard_normal((2, 5, 2, 8)), jnp.float32)
    table = jnp.asarray([[1, 2, 0], [3, 4, 5]], jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 3, 4], [2, 3, 4, 5, 6]], jnp.int32)
    valid = jnp.asarray([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
    qk, _ = attention.write_kv(qp, qp, k, k, table, pos, valid)
    pk, _ = attention.write_kv(plain, plain, k, k, table, pos, valid)
    gq = attention.gather_pages(qk, table)
    gp = attention.gather_pages(pk, table)
    chex.assert_equal_shape([gq, gp])
    assert gq.dtype == jnp.float32
    q, s = kvq.quantize_rows(gp, qp.dtype)
    np.testing.assert_allclose(np.asarray(gq), np.asarray(q.astype(jnp.float32) * s[..., None]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gq), np.asarray(gp), rtol=0.07, atol=0.07)


def test_unknown_kv_dtype_is_rejected():
    with pytest.raises(ValueError, match="int3"):
        kvq.resolve_kv_dtype("int3", jnp.bfloat16)


@functools.lru_cache(maxsize=None)
def _target() -> dj.Target:
    return dj.load_target(os.path.join(FIXTURES, "qwen36_tiny_a"), dtype="float32")


IDS = [int(i) for i in np.random.default_rng(0).integers(0, 256, 40)]


@functools.lru_cache(maxsize=None)
def _decode(kv: str | None):
    eng = Engine(_target(), None, EngineOptions(max_batch=1, max_model_len=64, prefill_chunk=16, kv_dtype=kv))
    assert isinstance(eng.state.kv.k[0], kvq.QuantizedPages) == (kv not in (None, "bf16"))
    return eng.generate([IDS], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True))[0]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_engine_with_quantized_kv_decodes_like_full_precision(kind):
    got, full = _decode(kind), _decode(None)
    assert got.token_ids == full.token_ids == _target().greedy(IDS, 6)
    np.testing.assert_allclose(got.logprobs, full.logprobs, atol=0.05)
