"""bench ar's paired overlap comparison runs end to end on CPU: both modes measured on one engine, no compiles after
warm-up; here on fp8 pages with a key calibration measured on the spot (``--kv-calibration measure``)."""

import json
import os

import pytest

from conftest import FIXTURES
from dflash_jax.bench.__main__ import main


def test_overlap_compare_times_both_loops_on_one_engine(tmp_path):
    assert main(["ar", "--random-weights", os.path.join(FIXTURES, "qwen36_tiny_a", "config.json"), "--dtype",
                 "float32", "--concurrency", "1", "2", "--prompt-len", "16", "--output-len", "10", "--prefill-chunk",
                 "16", "--prefill-batch", "2", "--ceiling-iters", "1", "--overlap-compare",
                 "--kv-dtype", "fp8", "--kv-calibration", "measure", "--out-dir", str(tmp_path)]) == 0
    [f] = list(tmp_path.iterdir())
    res = json.load(open(f))
    figs = res["figures"]
    assert res["extra"]["overlap_compare"] and figs["recompiles_after_warmup"] == 0
    assert figs["kv_calibrated"] == 1 and res["extra"]["kv_calibration"] == "measure"
    for c in (1, 2):
        assert figs[f"c{c}.tok_s"] > 0 and figs[f"c{c}.overlap.tok_s"] > 0
        assert figs[f"c{c}.overlap_speedup"] == pytest.approx(figs[f"c{c}.overlap.tok_s"] / figs[f"c{c}.tok_s"])
        assert figs[f"c{c}.overlap.ceiling_ratio"] > 0 and figs[f"c{c}.ceiling_ratio"] > 0
