"""experiments/kv_quant_parts.py: its rounding of keys / values is the quantized pages' own, its variants write what
they name, its query moments sum each KV head's query heads, and a smoke run of two variants measures agreement (the
query-weighted rounding itself is the pages' own, tested in test_kv_calibration.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from conftest import load_experiment
from dflash_jax.kv import quant as kv_quant

kqp = load_experiment("kv_quant_parts")


def test_round_trip_is_what_quantized_pages_read_back():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 2, 64)), jnp.float32)
    for dt in (jnp.float8_e4m3fn, jnp.int8):
        pages = kv_quant.quantize_pages(x, dt)
        want = np.asarray(kv_quant.take(pages, jnp.arange(3)))
        np.testing.assert_array_equal(np.asarray(kqp.round_trip(x, dt)), want)


def test_variants_write_what_they_name():
    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.normal(size=(1, 20, 2, 64)), jnp.float32) for _ in range(2))
    pos = jnp.arange(20)[None]
    seen = {}

    def capture(kp, vp, kk, vv, *rest):
        seen["k"], seen["v"] = np.asarray(kk), np.asarray(vv)
        return kp, vp

    mu = rng.normal(size=(3, 2, 64)).astype(np.float32)
    eye = kqp.error_factors(np.broadcast_to(np.eye(64), (3, 2, 64, 64)).copy())  # = plain rounding
    for name, variant in kqp.VARIANTS.items():
        kd, vd, sink, rot, centre, weighted, _ = variant
        kqp.rounding_write_kv(variant, capture, mu, (eye, eye))(None, None, k, v, None, pos, None)
        want_k = np.asarray(k) - mu[0] if centre else np.asarray(k)  # the first call is the first layer's
        assert np.array_equal(seen["k"], want_k) == (kd is None), name
        assert np.array_equal(seen["v"], np.asarray(v)) == (vd is None), name
        if sink:
            assert np.array_equal(seen["k"][:, :sink], want_k[:, :sink]), name
        if kd is not None:  # rounded keys stay within the format's error of the originals
            assert np.max(np.abs(seen["k"] - want_k)) <= 0.07 * np.max(np.abs(want_k)), name


def test_query_moments_sum_each_kv_heads_query_heads(monkeypatch):
    monkeypatch.setattr(kqp.attention, "write_kv", lambda kp, vp, *rest: (kp, vp))
    monkeypatch.setattr(kqp.attention, "paged_attention", lambda q, *rest: q)
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)  # [B, T, H=4, D]; 2 KV heads of 2 query heads
    valid = jnp.asarray([[True, True, False], [True, False, False]])

    def run():
        for _ in range(2):  # two layers
            kqp.attention.write_kv(None, None, None, None, None, None, valid)
            kqp.attention.paged_attention(q, None, None, None, None, 1.0)

    got = kqp.query_moments(2, 2, run)
    qq = np.asarray(q)[np.asarray(valid)].reshape(-1, 2, 2, 8)
    want = np.einsum("njgd,njge->jde", qq, qq) / len(qq)
    np.testing.assert_allclose(got, np.stack([want, want]), rtol=1e-5)


def test_key_means_average_each_layers_valid_keys(monkeypatch):
    monkeypatch.setattr(kqp.attention, "write_kv", lambda kp, vp, *rest: (kp, vp))
    k = jnp.asarray(np.arange(2 * 3 * 1 * 2, dtype=np.float32).reshape(2, 3, 1, 2))
    valid = jnp.asarray([[True, True, False], [True, False, False]])

    def run():
        for _ in range(2):  # two layers
            kqp.attention.write_kv(None, None, k, k, None, None, valid)

    mu = kqp.key_means(2, run)
    want = np.asarray(k)[np.asarray(valid)].mean(0)
    np.testing.assert_allclose(mu, np.stack([want, want]), rtol=1e-6)


def test_smoke_run_measures_agreement(capsys):
    assert kqp.main(["--rows", "2", "--row-len", "96", "--agree-prefix", "64", "--agree-tokens", "8",
                     "--variants", "none", "kv_fp8.rot", "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "none" in out and "kv_fp8.rot" in out and "greedy agreement" in out
