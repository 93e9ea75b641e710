"""The speculative benchmark runs end to end on CPU (small shapes) and its oracle loop checks losslessness."""

import json
import os

import pytest

from conftest import FIXTURES, nano_drafter_config
from dflash_jax.bench.__main__ import main
from dflash_jax.bench.spec import chain_keep_prob

pytestmark = pytest.mark.xdist_group("bench_spec")


def test_chain_keep_prob_hits_the_expected_tokens_per_round():
    for tau, depth in [(6.5, 15), (3.0, 6), (1.0, 4), (16.0, 15)]:
        q = chain_keep_prob(tau, depth)
        assert abs(1 + sum(q ** k for k in range(1, depth + 1)) - tau) < 1e-6
    with pytest.raises(ValueError, match="tau"):
        chain_keep_prob(20.0, 15)


def test_spec_bench_smoke(tmp_path):
    drafter = nano_drafter_config(tmp_path)
    rc = main(["spec", "--model", os.path.join(FIXTURES, "qwen36_tiny_a"), "--random-drafter", str(drafter),
               "--dtype", "float32", "--batch", "1", "2", "--budget", "6", "--max-verify-tokens", "8", "--context", "40", "--prefill-chunk", "32",
               "--iters", "2", "--oracle-tau", "3", "--oracle-tokens", "24", "--out-dir", str(tmp_path)])
    assert rc == 0
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("spec_")]
    figs = json.loads(res.read_text())["figures"]
    assert figs["b1.step_overhead"] > 0 and figs["b2.spec_step_ms"] > 0 and figs["b2.spec_round_sync_ms"] > 0
    assert (figs["b1.budget"], figs["b2.budget"]) == (6, 3)  # 8 verified tokens at most over the 2-row bucket
    assert figs["oracle_tau3.b1.tau_measured"] >= 1 and figs["oracle_tau3.b1.tok_s"] > 0
    assert figs["oracle_tau3.b1.resyncs"] == 0  # float32: the recorded continuation always predicts the output
    # the overlapped loop computes proposals on the device from the previous round's outputs: if it read the
    # continuation at the wrong position, rounds would accept ~1 token instead of the synchronous loop's tau
    assert figs["oracle_tau3.b1.sync.resyncs"] == 0 and figs["oracle_tau3.b1.sync.tok_s"] > 0
    # (the overlapped loop also counts the round in flight when the run ends: one round more over a few)
    assert abs(figs["oracle_tau3.b1.tau_measured"] - figs["oracle_tau3.b1.sync.tau_measured"]) < 1.0
    assert figs["oracle_tau3.b1.tau_measured"] > 2
