"""experiments/topk_sweep.py runs end to end on CPU, checks both top-ks and both sampling filters agree and writes
every figure."""

from __future__ import annotations

import json

from conftest import load_experiment


def test_topk_sweep_times_both_forms(tmp_path):
    mod = load_experiment("topk_sweep")
    assert mod.main(["--vocab", "20000", "--positions", "3", "--batch", "1", "2", "--k", "9", "--chunks", "32", "128",
                     "--sampler-rows", "3", "--iters", "2", "--out-dir", str(tmp_path)]) == 0
    (res,) = tmp_path.glob("topk_*.json")
    figs = json.loads(res.read_text())["figures"]
    for b in (1, 2):
        assert figs[f"topk.b{b}.lax_us"] > 0 and figs[f"topk.b{b}.chunk32.us"] > 0
        assert figs[f"topk.b{b}.speedup"] == figs[f"topk.b{b}.lax_us"] / figs[f"topk.b{b}.chunk128.us"]
    assert figs["sampler.r3.sort_us"] > 0 and figs["sampler.r3.kept_us"] > 0 and figs["sampler.r3.speedup"] > 0
