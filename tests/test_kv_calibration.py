"""Key calibration for quantized pages (``kv.calibration``): the rounding with error feedback against a NumPy
channel loop, the centring and rotation leave the model's logits unchanged, a measurement agrees with hooks on the
model's own attention calls, and an engine with fp8 pages rounds with it on every path (prefill, decode, commit)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import dflash_jax as dj
from conftest import FIXTURES, load_experiment
from dflash_jax.config import TargetConfig
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.engine.spec_steps import SpecConfig
from dflash_jax.kv import calibration as kvc
from dflash_jax.kv import calibrate as kv_calibrate
from dflash_jax.kv import quant as kvq
from dflash_jax.models import attention, dflash
from dflash_jax.sharding import MODEL, ShardPlan, param_spec

F8, I8 = jnp.float8_e4m3fn, jnp.int8


def _moments(rng, h: int, d: int) -> np.ndarray:
    a = rng.normal(size=(h, d, d)) * np.linspace(0.05, 1, d) ** 3  # anisotropic: a few directions dominate
    return np.einsum("hij,hkj->hik", a, a) + 0.01 * np.eye(d)


def _np_feedback_round(x: np.ndarray, dtype, g: np.ndarray) -> np.ndarray:
    """A NumPy oracle: each row scaled as pages scale it, then rounded channel by channel, feeding each error on."""
    qmax = kvq.QMAX[jnp.dtype(dtype)]
    amax = np.abs(x).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    w = (x / scale).astype(np.float32)
    y = np.zeros_like(w)
    for i in range(x.shape[-1]):
        wi = np.clip(w[..., i], -qmax, qmax)
        yi = np.round(wi) if dtype == I8 else np.asarray(jnp.asarray(wi).astype(dtype).astype(jnp.float32))
        y[..., i] = yi
        w = w + (yi - w[..., i])[..., None] * g[None, :, i, :]
    return y * scale


@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from([F8, I8]), rows=st.integers(1, 9), h=st.sampled_from([1, 2]),
       d=st.sampled_from([8, 32]), seed=st.integers(0, 2**16))
def test_feedback_rounding_equals_a_numpy_channel_loop(kind, rows, h, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, h, d)).astype(np.float32) * rng.uniform(0.01, 10)
    g = kvq.feedback_matrix(kvc.error_factors(_moments(rng, h, d)))
    data, scale = kvq.quantize_rows_feedback(jnp.asarray(x), kind, jnp.asarray(g))
    got = np.asarray(kvq.dequantize(data, scale, jnp.float32))
    np.testing.assert_allclose(got, _np_feedback_round(x, kind, g), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(kvq.quantize_rows(jnp.asarray(x), kind)[1]))


def test_feedback_rounding_without_feedback_is_plain_rounding():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 7, 3, 16)), jnp.float32)
    for kind in (F8, I8):
        got = kvq.quantize_rows_feedback(x, kind, jnp.zeros((3, 16, 16)))
        want = kvq.quantize_rows(x, kind)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_feedback_rounding_lowers_the_error_the_queries_see():
    """``e^T M e`` under the feedback of M falls below half of plain rounding's (both formats)."""
    rng = np.random.default_rng(2)
    m = _moments(rng, 2, 64)
    g = jnp.asarray(kvq.feedback_matrix(kvc.error_factors(m, damp=0.0)))
    x = jnp.asarray(rng.normal(size=(300, 2, 64)), jnp.float32)
    err = lambda y: np.einsum("nhi,hij,nhj->", y - np.asarray(x), m, y - np.asarray(x))  # noqa: E731
    for kind in (F8, I8):
        plain = np.asarray(kvq.dequantize(*kvq.quantize_rows(x, kind), jnp.float32))
        fed = np.asarray(kvq.dequantize(*kvq.quantize_rows_feedback(x, kind, g), jnp.float32))
        assert err(fed) < 0.5 * err(plain), jnp.dtype(kind).name


def test_hadamard_is_orthonormal_and_symmetric():
    for n in (1, 2, 64, 256):
        h = kvc.hadamard(n)
        np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-6)
        np.testing.assert_array_equal(h, h.T)
    with pytest.raises(ValueError, match="power-of-two"):
        kvc.hadamard(48)


@functools.lru_cache(maxsize=None)
def _target() -> dj.Target:
    return dj.load_target(os.path.join(FIXTURES, "qwen36_tiny_a"), dtype="float32")


def _rows(n: int, t: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, _target().config.vocab_size, (n, t)).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _calibration() -> kvc.KVCalibration:
    t = _target()
    return kvc.measure(t.params, t.config, _rows(3, 48))


def test_centred_rotated_queries_and_keys_leave_the_logits_unchanged():
    """Rotating queries and keys alike keeps every score; centring the keys moves all scores of a query by the same
    ``q . mu``: with plain pages the model's logits do not change (a large random mean, so a wrong sign shows)."""
    t = _target()
    cfg = t.config
    rng = np.random.default_rng(1)
    n, hkv, d = len(cfg.attn_layers), cfg.num_kv_heads, cfg.head_dim
    calib = kvc.KVCalibration((3 * rng.normal(size=(n, hkv, d))).astype(np.float32), np.zeros((n, hkv, d, d),
                                                                                               np.float32))
    moved = dataclasses.replace(t, params=kvc.attach(t.params, cfg, calib))
    assert kvc.is_attached(moved.params) and not kvc.is_attached(t.params)
    ids = _rows(1, 30)[0].tolist()
    np.testing.assert_allclose(np.asarray(moved.logits(ids)), np.asarray(t.logits(ids)), atol=2e-4, rtol=1e-4)


def test_measurement_agrees_with_hooks_on_the_models_attention_calls():
    """``measure``'s key means and feedback equal those accumulated by ``experiments/kv_quant_parts.py``'s hooks on
    ``attention.write_kv`` / ``attention.paged_attention`` over the same forward passes."""
    kqp = load_experiment("kv_quant_parts")
    t = _target()
    cfg = t.config
    rows = _rows(2, 32, seed=4)
    got: list = []

    def run():
        got.append(kvc.measure(t.params, cfg, rows))

    with jax.disable_jit():  # the hooks see every call
        mu = kqp.key_means(len(cfg.attn_layers), run)
        moments = kqp.query_moments(len(cfg.attn_layers), cfg.num_kv_heads, run)
    np.testing.assert_allclose(got[0].key_mean, mu, rtol=1e-4, atol=1e-5)
    h = kvc.hadamard(cfg.head_dim).astype(np.float64)
    want = kvq.feedback_matrix(kvc.error_factors(h @ moments.astype(np.float64) @ h.T))
    np.testing.assert_allclose(got[1].key_feedback, want, rtol=2e-3, atol=2e-4)
    assert got[1].meta["tokens"] == str(rows.size)


def test_save_load_find_and_a_clear_error_for_another_model(tmp_path):
    calib = _calibration()
    assert kvc.find(str(tmp_path)) is None
    path = calib.save(str(tmp_path / kvc.FILE_NAME))
    assert kvc.find(str(tmp_path)) == path
    back = kvc.KVCalibration.load(path)
    np.testing.assert_array_equal(back.key_mean, calib.key_mean)
    np.testing.assert_array_equal(back.key_feedback, calib.key_feedback)
    assert back.meta["rows"] == "3"
    other = dataclasses.replace(_target().config, head_dim=2 * _target().config.head_dim)
    with pytest.raises(ValueError, match="does not fit this model"):
        back.check(other)


def test_shipped_target_ships_a_calibration_that_fits_it():
    path = kvc.find(os.path.join(dj.SHIPPED_MODELS, "target"))
    assert path is not None
    kvc.KVCalibration.load(path).check(TargetConfig.from_file(os.path.join(dj.SHIPPED_MODELS, "target")))


def test_write_kv_rounds_keys_with_the_feedback_and_values_plainly():
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.normal(size=(1, 5, 2, 16)), jnp.float32) for _ in range(2))
    g = jnp.asarray(kvq.feedback_matrix(kvc.error_factors(_moments(rng, 2, 16))))
    pages = kvq.zeros((3, 8, 2, 16), F8, jnp.float32)
    table, pos = jnp.asarray([[1, 2]]), jnp.arange(5)[None]
    kp, vp = attention.write_kv(pages, pages, k, v, table, pos, jnp.ones((1, 5), bool), g)
    want_k, want_v = kvq.quantize_rows_feedback(k[0], F8, g), kvq.quantize_rows(v[0], F8)
    np.testing.assert_array_equal(np.asarray(kp.data[1, :5], np.float32), np.asarray(want_k[0], np.float32))
    np.testing.assert_array_equal(np.asarray(vp.data[1, :5], np.float32), np.asarray(want_v[0], np.float32))
    assert not np.array_equal(np.asarray(kp.data[1, :5], np.float32),
                              np.asarray(kvq.quantize_rows(k[0], F8)[0], np.float32))


@functools.lru_cache(maxsize=None)
def _calibration_file(tmp: str) -> str:
    return _calibration().save(os.path.join(tmp, kvc.FILE_NAME))


IDS = [int(i) for i in np.random.default_rng(7).integers(0, 250, 23)]


def test_engine_with_fp8_pages_and_a_calibration_decodes_like_the_model(tmp_path_factory):
    path = _calibration_file(str(tmp_path_factory.mktemp("calib")))
    eng = Engine(_target(), None, EngineOptions(max_batch=1, max_model_len=64, prefill_chunk=16, kv_dtype="fp8",
                                                kv_calibration=path))
    assert eng.kv_calibration == path and kvc.is_attached(eng.target.params)
    assert not kvc.is_attached(_target().params)  # the engine's copy only
    out = eng.generate([IDS], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == _target().greedy(IDS, 8)


def test_speculative_rounds_commit_keys_as_decode_writes_them(tmp_path_factory):
    """With fp8 pages and a calibration, DDTree rounds (keys rounded as the commit writes them) give AR's greedy."""
    from test_spec_step import drafter_cfg

    path = _calibration_file(str(tmp_path_factory.mktemp("calib")))
    t = _target()
    dcfg = drafter_cfg(t.config)
    dparams = dflash.init_params(dcfg, jax.random.key(3), jnp.float32)
    opts = EngineOptions(max_batch=2, prefill_chunk=16, max_model_len=96, page_size=8, kv_dtype="fp8",
                         kv_calibration=path, spec=SpecConfig(budget=6), cohort_yield_min=0.0)
    spec = Engine(t, None, opts, drafter=(dcfg, dparams))
    ar = Engine(t, None, dataclasses.replace(opts, spec=None))
    prompts = [IDS, IDS[5:17]]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    got, want = spec.generate(prompts, sp), ar.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.stats["spec_mode"] == "ddtree" for o in got)


def test_engine_options_name_what_is_wrong(tmp_path):
    t = _target()
    with pytest.raises(ValueError, match="quantized pages"):
        Engine(t, None, EngineOptions(max_batch=1, max_model_len=32, kv_calibration=str(tmp_path / "x")))
    with pytest.raises(FileNotFoundError, match="dflash_jax.kv.calibrate"):
        Engine(t, None, EngineOptions(max_batch=1, max_model_len=32, kv_dtype="fp8",
                                      kv_calibration=str(tmp_path / "missing.safetensors")))
    eng = Engine(t, None, EngineOptions(max_batch=1, max_model_len=32, kv_dtype="fp8"))  # auto: none beside it
    assert eng.kv_calibration is None and not kvc.is_attached(eng.target.params)


def test_calibrate_command_writes_one_that_loads(tmp_path):
    model = os.path.join(dj.SHIPPED_MODELS, "target")
    src = tmp_path / "text.py"
    src.write_text("def f(x):\n    return [x * i for i in range(10)]\n" * 40)
    out = tmp_path / "calib.safetensors"
    assert kv_calibrate.main(["--model", model, "--files", str(src), "--rows", "2", "--row-len", "64",
                              "--out", str(out)]) == 0
    calib = kvc.KVCalibration.load(str(out))
    calib.check(TargetConfig.from_file(model))
    assert calib.meta["rows"] == "2" and calib.meta["row_len"] == "64"


def test_calibration_shards_by_kv_head_with_the_attention():
    cfg = _target().config
    path = ("layers", cfg.attn_layers[0], "attn", kvc.PARAMS_KEY, "key_feedback")
    plan = ShardPlan.for_config(cfg, 2)
    assert plan.attn and param_spec(path, plan) == P(MODEL)
    assert param_spec(path, ShardPlan.for_config(cfg, 1)) == P()


def test_calibrate_command_asks_for_text_for_a_model_of_your_own(capsys):
    with pytest.raises(SystemExit):
        kv_calibrate.main(["--model", os.path.join(FIXTURES, "qwen36_tiny_a")])
    assert "--files" in capsys.readouterr().err
