"""experiments/profile_steps.py runs end to end on CPU (step times; the CPU trace has no device events)."""

from __future__ import annotations

import json

from conftest import load_experiment


def _module():
    return load_experiment("profile_steps")


def test_op_families_sum_the_unrolled_layers():
    ops = [("gemm_fusion_dot_962", 2.0, 64), ("gemm_fusion_dot_12", 1.0, 64), ("nvjet_sm90_tst_176x128_h_TNN", 2.5, 3),
           ("wrapped_slice.3", 0.5, 1), ("fusion", 0.25, 2)]
    assert _module().families(ops, 3) == [("gemm_fusion_dot", 3.0, 128), ("nvjet_sm90_tst_176x128_h_TNN", 2.5, 3),
                                          ("wrapped_slice", 0.5, 1)]


def test_profile_steps_writes_step_times_for_both_modes(tmp_path):
    mod = _module()
    assert mod.main(["--dtype", "float32", "--concurrency", "1", "--prompt-len-min", "16", "--prompt-len-max", "24",
                     "--output-len", "4", "--prefill-chunk", "32", "--out-dir", str(tmp_path)]) == 0
    (res,) = tmp_path.glob("profile_steps_*.json")
    figs = json.loads(res.read_text())["figures"]
    # the trace starts after prefill by default: only the decode steps / rounds are in it
    assert "ar.prefill_steps" not in figs and figs["ar.decode_steps"] == 3 and figs["ar.decode_step_ms"] > 0
    assert figs["ddtree.spec_steps"] >= 1 and figs["ddtree.spec_step_ms"] > 0
    assert figs["ar.device_ms_per_step"] >= 0 and "ddtree.device_ms_per_step" in figs


def test_profile_steps_takes_held_out_text(tmp_path):
    assert _module().main(["--dtype", "float32", "--concurrency", "2", "--prompts", "held-out", "--prompt-len-min", "16",
                           "--prompt-len-max", "24", "--output-len", "3", "--prefill-chunk", "32", "--modes", "ar",
                           "--no-decode-only", "--out-dir", str(tmp_path)]) == 0
    (res,) = tmp_path.glob("profile_steps_*.json")
    rec = json.loads(res.read_text())
    assert rec["extra"]["prompts"] == "held-out" and all(16 <= n <= 24 for n in rec["extra"]["prompt_lens"])
    assert rec["figures"]["ar.decode_steps"] == 2 and rec["figures"]["ar.prefill_steps"] == 1
    assert "ar.device_ms_per_step" not in rec["figures"]
