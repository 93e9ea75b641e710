"""Peaked random weights (``bench/peaked.py``): the random target becomes a confident bigram machine at unchanged
shapes, dtypes, quantization and sharding, and the bf16 oracle run then meets its requested tau without resyncs."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, nano_drafter_config, xla_flags
from dflash_jax.bench.__main__ import main
from dflash_jax.bench.peaked import peak_target, successor
from dflash_jax.bench.spec import accepted_lengths, chain_keep_prob
from dflash_jax.config import TargetConfig
from dflash_jax.models import quant, qwen36
from dflash_jax.target import Target

# No xdist group: the tests share no module fixtures, so the two workers may split them.

TINY_CONFIG = os.path.join(FIXTURES, "qwen36_tiny_a", "config.json")
IDS = np.random.default_rng(0).integers(0, 256, 96)


def _target(dtype, quantization=None, tied=False) -> Target:
    cfg = TargetConfig.from_file(TINY_CONFIG)
    if tied:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    return Target(cfg, qwen36.init_params(cfg, jax.random.key(0), dtype, quantization=quantization))


def _margins(target: Target) -> tuple[np.ndarray, np.ndarray]:
    """(argmax [T], top-1 minus top-2 logit [T]) of the full pass over IDS."""
    lg = np.asarray(target.logits(IDS))
    top = np.sort(lg, axis=-1)
    return lg.argmax(-1), top[:, -1] - top[:, -2]


@pytest.mark.parametrize("dtype,quantization,tied", [(jnp.bfloat16, None, False), (jnp.float32, None, False),
                                                     (jnp.bfloat16, "fp8", False), (jnp.bfloat16, "int4", False),
                                                     (jnp.bfloat16, None, True)])
def test_peaked_target_greedy_is_its_successor_map_by_a_wide_margin(dtype, quantization, tied):
    plain = _target(dtype, quantization, tied)
    _, plain_gap = _margins(plain)
    assert np.median(plain_gap) < 0.5  # random weights: near-ties are common

    peaked, succ = peak_target(plain)
    top, gap = _margins(peaked)
    np.testing.assert_array_equal(top, succ[IDS])
    assert gap.min() > 2.0, gap.min()
    if tied:
        np.testing.assert_array_equal(succ, np.arange(256))
        assert peaked.params["lm_head"] is peaked.params["embed"]
    else:
        np.testing.assert_array_equal(succ, successor(256))
        assert sorted(succ.tolist()) == list(range(256)) and (succ != np.arange(256)).mean() > 0.9
    # only the embedding's values change: every other leaf is the same object, the embedding keeps shape and dtype
    changed = {"embed", "lm_head"} if tied else {"embed"}
    for k, v in plain.params.items():
        if k not in changed:
            assert peaked.params[k] is v
    assert peaked.params["embed"].shape == plain.params["embed"].shape
    assert peaked.params["embed"].dtype == plain.params["embed"].dtype
    if quantization:
        assert quant.is_quantized(peaked.params["lm_head"])


def test_accepted_lengths_follow_the_chain_distribution_closely():
    for tau, depth in [(6.5, 15), (3.0, 7), (1.5, 4)]:
        q = chain_keep_prob(tau, depth)
        want = np.array([q ** k * (1 - q) for k in range(depth)] + [q ** depth])
        gen = accepted_lengths(tau, depth, seed=5)
        ks = np.array([next(gen) for _ in range(2000)])
        assert ks.min() >= 0 and ks.max() <= depth
        np.testing.assert_allclose(np.bincount(ks, minlength=depth + 1) / len(ks), want, atol=3e-3)
        for n, tol in ((20, 0.14), (40, 0.07), (400, 0.01)):  # random draws: ~0.75 tau / sqrt(n) at tau 6.5
            assert abs(1 + ks[:n].mean() - tau) < tol * tau, (tau, n, ks[:n].mean())


def _drafter(tmp_path) -> str:
    return nano_drafter_config(tmp_path, block_size=16)


# bf16 only (a float32 run compiles the same programs again, ~1.5 min of CI): bf16 rounding is what made the plain
# random target resync. What a float32 run would add is covered by its parts: the float32 peaked target's greedy is
# its successor map by a wide margin (above), and the float32 oracle loop has no resyncs (test_bench_spec.py).
def test_oracle_run_on_peaked_random_weights_meets_the_requested_tau(tmp_path):
    rc = main(["spec", "--random-weights", TINY_CONFIG, "--random-drafter", _drafter(tmp_path), "--dtype", "bfloat16",
               "--batch", "1", "--budget", "22", "--context", "40", "--prefill-chunk", "32", "--iters", "1",
               "--oracle-tau", "6.5", "--oracle-tokens", "96", "--out-dir", str(tmp_path)])
    assert rc == 0
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("spec_")]
    out = json.loads(res.read_text())
    figs = out["figures"]
    assert out["extra"]["peaked_random_weights"] is True and out["extra"]["weights"] == "peaked random"
    assert figs["oracle_tau6.5.b1.resyncs"] == 0
    assert figs["oracle_tau6.5.b1.tau_measured"] >= 0.8 * 6.5, figs["oracle_tau6.5.b1.tau_measured"]
    assert figs["oracle_tau6.5.b1.tok_s_at_tau"] == pytest.approx(6.5e3 / figs["oracle_tau6.5.b1.round_ms"])


def test_concurrency_oracle_on_peaked_random_weights_is_lossless_in_bf16(tmp_path):
    rc = main(["concurrency", "--random-weights", TINY_CONFIG, "--random-drafter", _drafter(tmp_path), "--dtype",
               "bfloat16", "--concurrency", "2", "--output-len", "24", "--repeats", "1", "--prompt-len-min", "5",
               "--prompt-len-max", "20", "--prefill-chunk", "16", "--page-size", "8", "--oracle-tau", "6.5",
               "--cohort-yield-min", "0", "--no-progress", "--out-dir", str(tmp_path)])
    assert rc == 0
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_") and p.suffix == ".json"]
    out = json.loads(res.read_text())
    assert out["extra"]["peaked_random_weights"] is True
    assert out["figures"]["reproducible"] == 1  # bf16 ddtree output equals the ar greedy it was given
    assert out["figures"]["c2.ddtree.accept_per_step"] > 4


def test_peaked_flag_is_refused_for_a_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="--random-weights"):
        main(["spec", "--model", os.path.join(FIXTURES, "qwen36_tiny_a"), "--random-drafter", _drafter(tmp_path),
              "--peaked-random-weights", "--no-write"])


def test_peaked_embedding_is_rewritten_shard_locally_under_tensor_parallelism():
    """Under TP=2 (vocabulary split) the rewrite matches the unsharded one, keeps the embedding's sharding and its
    compiled program moves no data between devices (2 CPU devices, in a subprocess: JAX must start with them)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(2),
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, TINY_CONFIG], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TP OK" in proc.stdout, proc.stdout


def _tp_check(config: str) -> None:
    from dflash_jax.bench import peaked
    from dflash_jax.sharding import Layout

    cfg = TargetConfig.from_file(config)
    lay = Layout.build(cfg, 2, 1)
    assert lay.plan.vocab
    params = qwen36.init_params(cfg, jax.random.key(0), jnp.bfloat16, place=lay.reshard(cfg))
    ref = qwen36.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    new, _ = peaked.peak_params(params, cfg.num_layers)
    want, _ = peaked.peak_params(ref, cfg.num_layers)
    assert new["embed"].sharding == params["embed"].sharding
    np.testing.assert_array_equal(np.asarray(new["embed"], np.float32), np.asarray(want["embed"], np.float32))
    n, local = peaked._local_permutation(cfg.vocab_size, False, peaked.SEED)
    f = functools.partial(peaked._successor_rows, n=n, rms=1.0, dtype=jnp.bfloat16)
    hlo = jax.jit(f, out_shardings=params["embed"].sharding).lower(params["lm_head"], jnp.asarray(local)).compile()
    text = hlo.as_text()
    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
        assert op not in text, op
    print("TP OK")


if __name__ == "__main__":
    _tp_check(sys.argv[1])
