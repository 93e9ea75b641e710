"""bench groups runs end to end on CPU: grouped and separate runs give the same tokens, the group prefills less."""

import json
import os

from conftest import FIXTURES
from dflash_jax.bench.__main__ import main


def test_groups_bench_smoke(tmp_path, capsys):
    rc = main(["groups", "--model", os.path.join(FIXTURES, "qwen36_tiny_a"), "--dtype", "float32", "--n", "3",
               "--prompts", "2", "--prompt-len", "60", "--output-len", "4", "--page-size", "8", "--prefill-chunk", "16",
               "--repeats", "1", "--out-dir", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("groups_")]
    figs = json.loads(res.read_text())["figures"]
    assert figs["n3.mismatches"] == 0 and figs["recompiles_after_warmup"] == 0
    # each member forked at 56 prefills 4 tokens: 2 x (60 + 2 x 4) instead of 2 x 3 x 60
    assert figs["n3.prefill_tokens"] == 2 * (60 + 2 * 4) and figs["n3.prefill_tokens_separate"] == 360
    assert figs["n3.speedup"] > 0 and figs["n3.ttft_ratio"] > 0
