"""experiments/gdn_decode_sweep.py runs end to end on CPU (the kernel in interpret mode, tiny target shapes) and
writes every figure."""

from __future__ import annotations

import json
import os

import pytest

from conftest import FIXTURES, load_experiment


def test_sweep_writes_every_figure(tmp_path):
    cfg = os.path.join(FIXTURES, "qwen36_tiny_a", "config.json")
    assert load_experiment("gdn_decode_sweep").main(["--config", cfg, "--dtype", "float32", "--batch", "1", "3",
                                                     "--warps", "4", "8", "--iters", "2",
                                                     "--out-dir", str(tmp_path)]) == 0
    (res,) = tmp_path.glob("gdn_decode_sweep_*.json")
    rec = json.loads(res.read_text())
    figs = rec["figures"]
    for b in (1, 3):
        t = f"gdn_decode.b{b}"
        assert figs[f"{t}.reference_us"] > 0 and figs[f"{t}.w4_us"] > 0 and figs[f"{t}.w8_us"] > 0
        times = [figs[f"{t}.{s}w{w}_us"] for s in ("", "split.") for w in (4, 8)]
        assert figs[f"{t}.best_us"] == min(times) and figs[f"{t}.split_speedup"] > 0
        assert figs[f"{t}.best_warps"] in (4, 8) and figs[f"{t}.best_split"] in (0, 1)
        assert figs[f"{t}.speedup"] > 0 and figs[f"{t}.state_gbps"] > 0
    assert rec["extra"]["interpret"] is True


def test_sweep_rejects_empty_loops(capsys):
    with pytest.raises(SystemExit):
        load_experiment("gdn_decode_sweep").main(["--iters", "0"])
    assert "--iters" in capsys.readouterr().err
