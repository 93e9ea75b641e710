"""The concurrency benchmark runs end to end on CPU (tiny target, random nano drafter) and fails closed."""

import json
import os
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FIXTURES, nano_drafter_config
from dflash_jax.bench.__main__ import main
from dflash_jax.bench.concurrency import account, map_preset, prove, prove_pflash, run_batch

pytestmark = pytest.mark.xdist_group("bench_concurrency")

TARGET = os.path.join(FIXTURES, "qwen36_tiny_a")


def _drafter(tmp_path) -> str:
    return nano_drafter_config(tmp_path)


def _scorer(tmp_path) -> str:
    p = tmp_path / "scorer.json"
    p.write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096}))
    return str(p)


# PFlash over 24-60 token prompts: those of >= 32 tokens are compressed to about a quarter (8-token chunks)
PFLASH = ("--pflash", "--pflash-keep-ratio", "0.25", "--pflash-min-tokens", "32", "--pflash-chunk", "8",
          "--pflash-head-tokens", "8",
          "--pflash-tail-tokens", "8", "--prompt-len-min", "24", "--prompt-len-max", "60")


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
                    "--prompt-len-max", "60", "--kvflash-scoring", "lru", "--concurrency", "2", "--repeats", "1",
                    "--kvflash-max-page-in", "8"))
    out = capsys.readouterr().out
    assert rc == 0, out
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_") and p.suffix == ".json"]
    rec = json.loads(res.read_text())
    figs, extra = rec["figures"], rec["extra"]
    assert extra["kvflash"]["pool_tokens"] == 48 and extra["kv_dtype"] == "fp8"
    assert extra["kvflash"]["max_page_in"] == 8
    assert figs["c2.ar.kv_pages_out"] > 0 and figs["c2.ddtree.kv_pages_out"] > 0
    assert figs["c2.ar.kv_page_in_gbs"] > 0 and figs["c2.ar.kv_page_in_ratio"] > 0
    assert figs["c2.ar.kvflash_vs_unbounded"] > 0 and figs["c2.ar_unbounded.tok_s"] > 0
    # KVFlash's share of the host time, by phase (lru scoring: no summaries, no queries)
    assert 0 < figs["c2.ar.kv_plan_ms"] + figs["c2.ar.kv_transfer_ms"] <= figs["c2.ar.host_ms"]
    assert figs["c2.ar.kv_page_out_ms"] + figs["c2.ar.kv_page_in_ms"] <= figs["c2.ar.kv_transfer_ms"]
    assert "c2.ar.kv_query_ms" not in figs and "c2.ar_unbounded.kv_plan_ms" not in figs
    assert "48-token pool" in out and "| c2.ar_unbounded |" in out
    for cs in extra["cases"]:
        bounded = not cs["case"].endswith("ar_unbounded")
        assert (cs["kvflash"] is not None) == bounded
        for r in cs["repeats"][0]["requests"]:
            assert (r["kv_pages_in"] is not None) == bounded


def test_prefix_cache_case_proves_cached_heads_and_compares_with_uncached(tmp_path, capsys):
    rc = main(_args(tmp_path, "--prefix-cache", "2", "--shared-prefix", "40", "--prefix-cache-compare",
                    "--concurrency", "2", "--repeats", "1"))
    out = capsys.readouterr().out
    assert rc == 0, out
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_") and p.suffix == ".json"]
    figs = json.loads(res.read_text())["figures"]
    assert figs["c2.ar.prefix_cached_tokens"] == 32 and figs["c2.ddtree.prefix_cached_tokens"] == 32
    assert "c2.ar_uncached.prefix_cached_tokens" not in figs
    assert figs["c2.ar.prefix_cache_speedup"] > 0 and figs["c2.ar.prefix_cache_ttft_ratio"] > 0
    assert figs["repro.modes_mismatches"] == 0  # the cached and uncached AR cases give the same tokens
    assert "| c2.ar_uncached |" in out
    assert main(_args(tmp_path, "--prefix-cache-compare")) == 2  # needs --prefix-cache


def test_kvflash_drafter_scoring_runs_ddtree_cases_only(tmp_path, capsys):
    kv = ("--kvflash", "48", "--kvflash-scoring", "drafter", "--prompt-len-min", "40", "--prompt-len-max", "60",
          "--concurrency", "2", "--repeats", "1")
    assert main(_args(tmp_path, *kv)) == 2  # the ar cases have no drafter
    assert "--kvflash-scoring drafter" in capsys.readouterr().out
    rc = main(_args(tmp_path, *kv, "--modes", "ddtree", "--cohort-yield-min", "0"))
    out = capsys.readouterr().out
    assert rc == 0, out
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_") and p.suffix == ".json"]
    rec = json.loads(res.read_text())
    assert rec["extra"]["kvflash"]["scoring"] == "drafter" and rec["figures"]["c2.ddtree.kv_pages_out"] > 0
    (case,) = rec["extra"]["cases"]
    assert case["kvflash"]["scoring"] == "drafter" and case["kvflash"]["score_decisions"] > 0


def test_kvflash_proof_fails_closed():
    from dflash_jax.bench.concurrency import KV_KEYS, prove_kvflash

    st = {"kvflash": True, **{k: 0 for k in KV_KEYS}, "kv_logical_pages": 9}
    assert prove_kvflash(st, pressured=False) is None
    assert "none of its pages moved" in prove_kvflash(st, pressured=True)
    assert prove_kvflash({**st, "kv_pages_out": 2}, pressured=True) is None
    assert "telemetry" in prove_kvflash({**st, "kv_wait_s": None}, pressured=False)
    assert "lack kvflash" in prove_kvflash({}, pressured=False)


class _FakeEngine:
    """Engine.submit / step / has_work: a request finishes ``steps`` steps after its submission."""

    def __init__(self, steps: int, n_tokens: int):
        self.steps, self.n_tokens, self.counters = steps, n_tokens, {"cohort_yield": 0}
        self.live: dict[int, tuple[list[int], int]] = {}
        self.next_id, self.max_live = 0, 0

    def submit(self, prompt, sp):
        self.next_id += 1
        self.live[self.next_id] = (list(prompt), self.steps)
        self.max_live = max(self.max_live, len(self.live))
        return self.next_id

    def has_work(self):
        return bool(self.live)

    def step(self):
        outs = []
        for rid, (p, left) in list(self.live.items()):
            fin = left == 1
            outs.append(types.SimpleNamespace(request_id=rid, token_ids=[7] * self.n_tokens, prompt_token_ids=p,
                                              finish_reason="length" if fin else None, stats={}))
            if fin:
                del self.live[rid]
            else:
                self.live[rid] = (p, left - 1)
        return outs


@pytest.mark.parametrize("c", [1, 2, 5])
def test_run_batch_keeps_at_most_c_requests_in_flight(c):
    eng = _FakeEngine(steps=3, n_tokens=4)
    prompts = [[i] * (i + 1) for i in range(5)]
    b = run_batch(eng, prompts, 4, 0, max_in_flight=c)
    assert eng.max_live == c and eng.next_id == 5
    assert [r["index"] for r in b["requests"]] == list(range(5))
    assert [r["prompt_len"] for r in b["requests"]] == [1, 2, 3, 4, 5]
    assert account(b["requests"], 5, 4) == []


def test_requests_flag_serves_the_same_prompts_at_every_concurrency(tmp_path, capsys):
    rc = main(_args(tmp_path, "--modes", "ar", "--requests", "3", "--repeats", "1"))
    out = capsys.readouterr().out
    assert rc == 0, out
    rec = _result(tmp_path)
    figs = rec["figures"]
    assert figs["c1.ar.output_tokens"] == figs["c2.ar.output_tokens"] == 3 * 8
    assert figs["reproducible"] == 1  # request i: the same greedy tokens at C1 and C2
    assert "| c1.ar | 3 |" in out
    assert main(_args(tmp_path, "--requests", "1")) == 2
    assert "fewer than the largest --concurrency" in capsys.readouterr().out


def test_modes_flag_runs_only_the_chosen_modes(tmp_path, capsys):
    rc = main(_args(tmp_path, "--modes", "ar", "--concurrency", "1", "--repeats", "1"))
    assert rc == 0, capsys.readouterr().out
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_") and p.suffix == ".json"]
    figs = json.loads(res.read_text())["figures"]
    assert figs["c1.ar.tok_s"] > 0 and not any(k.startswith("c1.ddtree.") and v is not None
                                                 for k, v in figs.items())


def _result(tmp_path) -> dict:
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_") and p.suffix == ".json"]
    return json.loads(res.read_text())


def test_pflash_case_proves_compression_per_request_and_bills_raw(tmp_path, capsys):
    rc = main(_args(tmp_path, *PFLASH, "--random-scorer", _scorer(tmp_path), "--concurrency", "2", "--repeats", "1"))
    cap = capsys.readouterr()
    assert rc == 0, cap.out
    rec = _result(tmp_path)
    figs, extra = rec["figures"], rec["extra"]
    assert extra["pflash"]["min_tokens"] == 32 and extra["accounting"] == "passed"
    assert "raw" in extra["feature_matrix"][2] and "compressed" in extra["feature_matrix"][2]
    assert "[case 2/2 c2.ddtree]" in cap.err  # the progress line
    lens = extra["prompt_lens"][:2]
    assert len(extra["prompts_hash"]) == 64  # the digest of the prompts: runs compare only where it agrees
    for mode in ("ar", "ddtree"):
        k = f"c2.{mode}"
        assert figs[f"{k}.prompt_tokens_billed"] == sum(lens)
        assert figs[f"{k}.prompt_tokens_effective"] < figs[f"{k}.prompt_tokens_billed"]
        assert figs[f"{k}.pflash_compressed"] == sum(n >= 32 for n in lens) >= 1
    for cs in extra["cases"]:
        for r in cs["repeats"][0]["requests"]:
            assert r["raw_prompt_tokens"] == r["prompt_len"] == r["prompt_tokens_billed"]
            assert r["effective_prompt_tokens"] == r["engine_prompt_tokens"]
            if r["prompt_len"] >= 32:
                assert r["pflash"] == "compressed" and r["effective_prompt_tokens"] < r["prompt_len"]
            else:
                assert r["pflash"] == "short" and r["effective_prompt_tokens"] == r["prompt_len"]
            assert r["tokens"] == 8
    assert figs["reproducible"] == 1


def test_pflash_proof_fails_closed():
    r = {"prompt_len": 40, "engine_prompt_tokens": 12,
         "pflash": {"raw_prompt_tokens": 40, "effective_prompt_tokens": 12, "pflash": "compressed"}}
    assert prove_pflash(r, 32) is None
    assert "no compression record" in prove_pflash({**r, "pflash": None}, 32)
    assert "was not compressed" in prove_pflash(
        {**r, "engine_prompt_tokens": 40, "pflash": {**r["pflash"], "effective_prompt_tokens": 40}}, 32)
    assert "engine prefilled 40" in prove_pflash({**r, "engine_prompt_tokens": 40}, 32)
    assert "below the minimum" in prove_pflash(r, 64)
    short = {"prompt_len": 20, "engine_prompt_tokens": 20,
             "pflash": {"raw_prompt_tokens": 20, "effective_prompt_tokens": 20, "pflash": "short"}}
    assert prove_pflash(short, 32) is None


def test_pflash_missing_proof_fails_the_run(tmp_path, capsys, monkeypatch):
    from dflash_jax.bench import concurrency

    def no_compression(scorer, options):  # a prep that forgets to compress
        return lambda p: (p, {"raw_prompt_tokens": len(p), "effective_prompt_tokens": len(p), "pflash": "off",
                              "pflash_scoring_s": 0.0, "pflash_ratio": 1.0})

    monkeypatch.setattr(concurrency, "pflash_prep", no_compression)
    rc = main(_args(tmp_path, *PFLASH, "--random-scorer", _scorer(tmp_path), "--concurrency", "1", "--repeats", "1",
                    "--modes", "ar", "--prompt-len-min", "40"))
    out = capsys.readouterr().out
    assert rc != 0 and "PASS" not in out
    assert "c1.ar: proof: repeat 0 request 0: PFlash not proved" in out
    assert "no prompt of the batch was compressed" in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_")]


def test_recipe_strix_halo_maps_the_seed_flags():
    from dflash_jax.bench.concurrency import CONFIGS
    from dflash_jax.serve.__main__ import read_preset

    want, notes, bad = map_preset(read_preset(os.path.join(CONFIGS, "strix_halo.yaml")))
    assert bad == []
    assert want == {"budget": 22, "pflash": True, "pflash_mode": "auto", "kvflash": "auto"}
    assert any(n.startswith("target-device: hip:0") for n in notes) and any("persistent" in n for n in notes)
    assert map_preset({"ddtree": False})[0] == {"modes": ["ar"]}
    assert "fast-rollback" in map_preset({"fast_rollback": True})[2][0]
    assert map_preset({"kv_dtype": "fp8"})[0] == {"kv_dtype": "fp8"}
    assert map_preset({"ddtree_chain_seed": True})[0] == {"chain_seed": True}


def test_recipe_fails_closed_before_any_work(tmp_path, capsys):
    # the full recipe without a scorer, and a preset flag this benchmark cannot run: both fail before loading
    rc = main(_args(tmp_path, "--recipe", "full"))
    out = capsys.readouterr().out
    assert rc == 2 and "FAIL: --pflash requested: not run: feature not available (PFlash needs a scorer" in out
    assert "| c1.ddtree | - | off | not run | not run | not run: feature not available | not run |" in out
    preset = tmp_path / "p.yaml"
    preset.write_text("ddtree: true\nfast-rollback: true\n")
    rc = main(_args(tmp_path, "--recipe", str(preset)))
    out = capsys.readouterr().out
    assert rc == 2 and "fast-rollback" in out and "PASS" not in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("concurrency_")]


def test_pflash_that_could_never_compress_fails_before_loading(tmp_path, capsys):
    # the seed's preset sets a 32768-token minimum: with short prompts PFlash would never run
    rc = main(_args(tmp_path, "--recipe", "strix_halo", "--random-scorer", _scorer(tmp_path)))
    out = capsys.readouterr().out
    assert rc == 2 and "every prompt is shorter than --pflash-min-tokens 32768 (--prompt-len-max 20)" in out
    assert "loaded in" not in out and "PASS" not in out


def test_recipe_full_runs_ddtree_pflash_kvflash(tmp_path, capsys):
    rc = main(_args(tmp_path, "--recipe", "full", *PFLASH, "--random-scorer", _scorer(tmp_path), "--kvflash", "48",
                    "--kvflash-scoring", "lru", "--concurrency", "2", "--repeats", "1", "--modes", "ddtree",
                    "--no-progress"))
    cap = capsys.readouterr()
    assert rc == 0, cap.out
    assert "[case" not in cap.err
    extra = _result(tmp_path)["extra"]
    assert extra["recipe"]["name"] == "full" and extra["kvflash"]["pool_tokens"] == 48
    (row,) = [r for r in extra["feature_matrix"] if r.startswith("| c2.ddtree")]
    cells = row.split(" | ")
    assert cells[3].startswith("proved") and "48-token pool" in cells[4] and "raw" in cells[5]


def test_oracle_draft_forces_acceptance_and_stays_lossless(tmp_path, capsys):
    # fixture drafter: block 8 -> 7 proposed positions, budget 6: tau 5 keeps each with q ~ 0.9
    rc = main(_args(tmp_path, "--oracle-tau", "5", "--cohort-yield-min", "0", "--concurrency", "2", "--repeats", "1",
                    "--output-len", "24", "--no-progress"))
    out = capsys.readouterr().out
    assert rc == 0, out
    rec = _result(tmp_path)
    figs, extra = rec["figures"], rec["extra"]
    assert extra["oracle"]["tau"] == 5 and "FORCED ACCEPTANCE" in extra["oracle"]["label"]
    assert "ORACLE DRAFT" in out and any("ORACLE DRAFT" in r for r in extra["feature_matrix"])
    assert figs["c2.ddtree.accept_per_step"] > 3  # the random drafter alone accepts ~nothing
    assert figs["reproducible"] == 1  # ddtree output equals AR greedy: verification is the real one


def test_oracle_needs_the_ar_mode(tmp_path, capsys):
    assert main(_args(tmp_path, "--oracle-tau", "5", "--modes", "ddtree")) == 2
    assert "--oracle-tau needs both modes" in capsys.readouterr().out


def test_text_prompts_are_seeded_windows_of_the_text():
    from dflash_jax.bench.concurrency import prompt_set, text_prompt_set

    text = list(range(1000, 1500))
    a = text_prompt_set(text, 6, 10, 40, seed=3)
    assert a == text_prompt_set(text, 6, 10, 40, seed=3)
    assert [len(p) for p in a] == [len(p) for p in prompt_set(6, 10, 40, 7, seed=3)]  # same length draw
    for p in a:  # contiguous windows of the stream
        assert 10 <= len(p) <= 40 and p == text[p[0] - 1000: p[0] - 1000 + len(p)]
    with pytest.raises(ValueError, match="fewer than"):
        text_prompt_set(text[:30], 2, 10, 40, seed=0)


@given(st.integers(1, 12), st.integers(0, 12), st.integers(0, 2**31 - 1))
@settings(max_examples=25, deadline=None)
def test_prompt_i_does_not_depend_on_how_many_are_drawn(k, extra, seed):
    """A run of --concurrency 1 8 and one of 1 4 8 16 32 give request i the same prompt."""
    from dflash_jax.bench.concurrency import prompt_set, text_prompt_set

    text = list(range(2000))
    assert prompt_set(k + extra, 5, 50, 97, seed)[:k] == prompt_set(k, 5, 50, 97, seed)
    assert text_prompt_set(text, k + extra, 5, 50, seed)[:k] == text_prompt_set(text, k, 5, 50, seed)


def test_held_out_prompts_need_a_model_with_text(tmp_path, capsys):
    rc = main(["concurrency", "--random-weights", os.path.join(TARGET, "config.json"), "--random-drafter",
               _drafter(tmp_path), "--prompts", "held-out", "--out-dir", str(tmp_path)])
    assert rc == 2 and "--prompts held-out needs --model" in capsys.readouterr().out


def test_shipped_pair_on_held_out_text_accepts_more_than_one_token_per_round(tmp_path, capsys):
    from dflash_jax import SHIPPED_MODELS

    # ddtree only: the acceptance is this test's figure (the ar case, a second engine of the shipped target, checks
    # nothing here that the random-weight cases above do not)
    rc = main(["concurrency", "--model", os.path.join(SHIPPED_MODELS, "target"), "--drafter",
               os.path.join(SHIPPED_MODELS, "drafter"), "--dtype", "float32", "--prompts", "held-out",
               "--concurrency", "1", "--repeats", "1", "--output-len", "16", "--prompt-len-min", "48",
               "--prompt-len-max", "96", "--cohort-yield-min", "0", "--modes", "ddtree", "--out-dir", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out
    rec = _result(tmp_path)
    assert "held-out text" in rec["extra"]["prompt_distribution"]
    # real text: the trained drafter's rounds emit more than the bonus token alone (random ids give ~1.0-1.3)
    assert rec["figures"]["c1.ddtree.accept_per_step"] > 1.3, rec["figures"]


def test_batch_invariant_cases_share_one_shape_and_agree_across_concurrencies(tmp_path, capsys):
    rc = main(_args(tmp_path, "--batch-invariant", "--dtype", "bfloat16", "--modes", "ar", "--concurrency", "1", "3",
                    "--repeats", "1", "--require-reproducible"))
    assert rc == 0, capsys.readouterr().out
    res = _result(tmp_path)
    assert res["figures"]["repro.concurrency_mismatches"] == 0
    assert "--batch-invariant" in res["command"]
