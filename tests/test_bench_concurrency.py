"""The concurrency benchmark runs end to end on CPU (tiny target, random nano drafter) and fails closed."""

import json
import os

import pytest

from conftest import FIXTURES
from dflash_jax.bench.__main__ import main
from dflash_jax.bench.concurrency import prove

pytestmark = pytest.mark.xdist_group("bench_concurrency")

TARGET = os.path.join(FIXTURES, "qwen36_tiny_a")


def _drafter(tmp_path) -> str:
    p = tmp_path / "drafter.json"
    p.write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e7,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16, "block_size": 8,
        "dflash_config": {"mask_token_id": 250, "target_layer_ids": [0, 1, 2]}}))
    return str(p)


def _args(tmp_path, *extra):
    return ["concurrency", "--model", TARGET, "--random-drafter", _drafter(tmp_path), "--dtype", "float32",
            "--concurrency", "1", "2", "--output-len", "8", "--repeats", "2", "--prompt-len-min", "5",
            "--prompt-len-max", "20", "--prefill-chunk", "16", "--page-size", "8", "--budget", "6",
            "--out-dir", str(tmp_path), *extra]


def test_proofs_fail_closed():
    good = {"spec_mode": "yielded", "draft_steps": 1, "accepted_tokens": 0, "mean_accept_len": 1.0}
    assert prove("ddtree", good) is None
    assert "draft_steps" in prove("ddtree", {**good, "draft_steps": 0})
    assert "spec_mode" in prove("ddtree", {**good, "spec_mode": "ar"})
    assert "lack" in prove("ddtree", {k: v for k, v in good.items() if k != "accepted_tokens"})
    assert prove("ar", {"spec_mode": "ar", "draft_steps": 0, "accepted_tokens": 0, "mean_accept_len": None}) is None
    assert prove("ar", good) is not None


def test_concurrency_bench_smoke(tmp_path, capsys):
    rc = main(_args(tmp_path))
    out = capsys.readouterr().out
    assert rc == 0, out
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_") and p.suffix == ".json"]
    rec = json.loads(res.read_text())
    figs, extra = rec["figures"], rec["extra"]
    for c in (1, 2):
        for mode in ("ar", "ddtree"):
            k = f"c{c}.{mode}"
            assert figs[f"{k}.tok_s"] > 0 and figs[f"{k}.req_decode_tok_s"] > 0
            assert 0 < figs[f"{k}.ttft_p50_s"] <= figs[f"{k}.ttft_p99_s"]
            assert figs[f"{k}.tpot_ms"] > 0 and f"{k}.cohort_yield_events" in figs
            assert figs[f"{k}.output_tokens"] == 8 * c
        assert figs[f"c{c}.ddtree.accept_per_step"] >= 1
        assert figs[f"c{c}.ddtree.speedup_vs_ar"] > 0
    assert figs["reproducible"] == 1
    assert extra["accounting"] == "passed"
    assert "PASS" in out and "| c2.ddtree |" in out
    for cs in extra["cases"]:
        for rep in cs["repeats"]:
            assert sum(r["tokens"] for r in rep["requests"]) == rep["figures"]["output_tokens"]
            for r in rep["requests"]:
                assert r["tokens"] == 8
                if cs["case"].endswith("ddtree"):
                    assert r["spec_mode"] in ("ddtree", "yielded") and r["draft_steps"] >= 1
                else:
                    assert r["draft_steps"] == 0


def test_unavailable_feature_fails_closed(tmp_path, capsys):
    rc = main(_args(tmp_path, "--pflash"))
    out = capsys.readouterr().out
    assert rc != 0
    assert "not run: feature not available" in out and "FAIL" in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_")]


def test_missing_proof_fails_the_whole_run(tmp_path, capsys, monkeypatch):
    from dflash_jax.engine import loop

    real = loop.RequestStats.as_dict

    def no_draft_steps(self, n_out):  # an engine that stops reporting its speculative rounds
        d = real(self, n_out)
        if d["spec_mode"] != "ar":
            del d["draft_steps"]
        return d

    monkeypatch.setattr(loop.RequestStats, "as_dict", no_draft_steps)
    args = _args(tmp_path)
    args[args.index("--concurrency") + 1: args.index("--concurrency") + 3] = ["1"]
    args[args.index("--repeats") + 1] = "1"
    rc = main(args)
    out = capsys.readouterr().out
    assert rc != 0 and "FAIL" in out and "PASS" not in out
    assert "c1.ddtree: proof: repeat 0 request 0: stats lack ['draft_steps']" in out
    assert "| c1.ar | 1 | proved 1/1 |" in out and "| c1.ddtree | 1 | off | FAILED" in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_")]


def test_kvflash_case_proves_residency_per_request(tmp_path, capsys):
    # a 48-token pool under 2 requests of 40-60 prompt tokens + 8: residency pressure; fp8 pages (data + scales)
    rc = main(_args(tmp_path, "--kvflash", "48", "--kvflash-compare", "--prompt-len-min", "40", "--kv-dtype", "fp8",
                    "--prompt-len-max", "60", "--kvflash-scoring", "lru", "--concurrency", "2", "--repeats", "1"))
    out = capsys.readouterr().out
    assert rc == 0, out
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_") and p.suffix == ".json"]
    rec = json.loads(res.read_text())
    figs, extra = rec["figures"], rec["extra"]
    assert extra["kvflash"]["pool_tokens"] == 48 and extra["kv_dtype"] == "fp8"
    assert figs["c2.ar.kv_pages_out"] > 0 and figs["c2.ddtree.kv_pages_out"] > 0
    assert figs["c2.ar.kv_page_in_gbs"] > 0 and figs["c2.ar.kv_page_in_ratio"] > 0
    assert figs["c2.ar.kvflash_vs_unbounded"] > 0 and figs["c2.ar_unbounded.tok_s"] > 0
    assert "48-token pool" in out and "| c2.ar_unbounded |" in out
    for cs in extra["cases"]:
        bounded = not cs["case"].endswith("ar_unbounded")
        assert (cs["kvflash"] is not None) == bounded
        for r in cs["repeats"][0]["requests"]:
            assert (r["kv_pages_in"] is not None) == bounded


def test_kvflash_proof_fails_closed():
    from dflash_jax.bench.concurrency import KV_KEYS, prove_kvflash

    st = {"kvflash": True, **{k: 0 for k in KV_KEYS}, "kv_logical_pages": 9}
    assert prove_kvflash(st, pressured=False) is None
    assert "none of its pages moved" in prove_kvflash(st, pressured=True)
    assert prove_kvflash({**st, "kv_pages_out": 2}, pressured=True) is None
    assert "telemetry" in prove_kvflash({**st, "kv_wait_s": None}, pressured=False)
    assert "lack kvflash" in prove_kvflash({}, pressured=False)


def test_modes_flag_runs_only_the_chosen_modes(tmp_path, capsys):
    rc = main(_args(tmp_path, "--modes", "ar", "--concurrency", "1", "--repeats", "1"))
    assert rc == 0, capsys.readouterr().out
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_") and p.suffix == ".json"]
    figs = json.loads(res.read_text())["figures"]
    assert figs["c1.ar.tok_s"] > 0 and not any(k.startswith("c1.ddtree.") and v is not None
                                                 for k, v in figs.items())
