"""bench structured runs end to end on CPU on the shipped pair: both engines give the same tokens in float32, every
reply matches the schema, and the speculative engine's rounds are the masked ones."""

import json
import os

import dflash_jax as dj
from dflash_jax.bench.__main__ import main


def test_structured_bench_smoke(tmp_path, capsys):
    rc = main(["structured", "--model", os.path.join(dj.SHIPPED_MODELS, "target"),
               "--drafter", os.path.join(dj.SHIPPED_MODELS, "drafter"), "--dtype", "float32", "--concurrency", "2",
               "--output-len", "72", "--budget", "4", "--repeats", "1", "--out-dir", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("structured_")]
    figs = json.loads(res.read_text())["figures"]
    assert figs["recompiles_after_warmup"] == 0
    for c in (2,):
        assert figs[f"c{c}.mismatches"] == 0 and figs[f"c{c}.matched"] == 1.0
        assert figs[f"c{c}.mean_accept_len"] >= 1.0 and figs[f"c{c}.ar.tok_s"] > 0 and figs[f"c{c}.spec.tok_s"] > 0
        assert figs[f"c{c}.mask_ms_per_round"] > 0 and figs[f"c{c}.draft_ms_per_round"] > 0
