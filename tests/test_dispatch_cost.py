"""experiments/dispatch_cost.py runs end to end on CPU and writes every figure."""

from __future__ import annotations

import json

import pytest

from conftest import load_experiment


def _module():
    return load_experiment("dispatch_cost")


def test_dispatch_cost_times_host_and_device_buffers(tmp_path):
    assert _module().main(["--dtype", "float32", "--concurrency", "2", "--prompt-len", "32", "--iters", "5",
                           "--leaves", "4", "64", "--out-dir", str(tmp_path)]) == 0
    (res,) = tmp_path.glob("dispatch_cost_*.json")
    rec = json.loads(res.read_text())
    figs = rec["figures"]
    for name in ("host_buffer", "device_buffer"):
        assert 0 < figs[f"c2.decode.{name}.dispatch_ms"] <= figs[f"c2.decode.{name}.wall_ms"]
    assert figs["c2.decode.sync_ms"] > 0 and figs["leaves4.call_ms"] > 0 and figs["leaves64.call_ms"] > 0
    assert figs["param_leaves"] > 10 and rec["extra"]["buffer_words"] > 0


def test_dispatch_cost_rejects_empty_loops(capsys):
    with pytest.raises(SystemExit):
        _module().main(["--iters", "0"])
    assert "--iters" in capsys.readouterr().err
