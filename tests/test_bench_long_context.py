"""The long-context benchmarks run end to end on CPU at small scale: PFlash TTFT (random scorer) and needle
retrieval with the shipped tiny set (with and without compression, plus the random-chunk baseline)."""

import json
import os

import pytest

from conftest import FIXTURES
from dflash_jax.bench.__main__ import main
from dflash_jax.bench.pflash import stall_figures
from dflash_jax.serve.__main__ import SHIPPED

pytestmark = pytest.mark.xdist_group("bench_long_context")


def _figures(tmp_path, prefix):
    (res,) = [p for p in tmp_path.iterdir() if p.name.startswith(prefix)]
    return json.loads(res.read_text())


def _random_scorer(tmp_path):
    scorer = tmp_path / "scorer.json"
    scorer.write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "tie_word_embeddings": True, "max_position_embeddings": 4096}))
    return scorer


def test_pflash_ttft_bench_random_scorer(tmp_path):
    scorer = _random_scorer(tmp_path)
    rc = main(["pflash", "--model", os.path.join(FIXTURES, "qwen36_tiny_a"), "--random-scorer", str(scorer),
               "--dtype", "float32", "--context", "512", "--keep-ratio", "0.1", "--head-tokens", "32", "--tail-tokens", "64", "--prefill-chunk", "128",
               "--scorer-chunk", "128", "--page-size", "16", "--repeats", "1", "--out-dir", str(tmp_path)])
    assert rc == 0
    rec = _figures(tmp_path, "pflash_")
    f = rec["figures"]
    assert f["pflash.512.full_ttft_s"] > 0 and f["pflash.512.ttft_s"] > f["pflash.512.scoring_s"] > 0
    assert 0 < f["pflash.512.kept_fraction"] < 1
    assert f["pflash.512.ttft_ratio"] == pytest.approx(f["pflash.512.ttft_s"] / f["pflash.512.full_ttft_s"])
    # the split: scoring + the effective prompt's TTFT, one scorer dispatch per layer plus the embedding, warm runs
    assert f["pflash.512.ttft_s"] == pytest.approx(f["pflash.512.scoring_s"] + f["pflash.512.effective_ttft_s"])
    assert f["pflash.512.effective_tokens"] == pytest.approx(512 * f["pflash.512.kept_fraction"])
    assert f["pflash.512.scorer_dispatches"] == 3
    assert 0 < f["pflash.512.scorer_step_mean_s"] <= f["pflash.512.scorer_step_max_s"]
    assert f["pflash.512.compiles_timed"] == 0
    assert rec["extra"]["scorer_attention"] == "xla" and rec["extra"]["scorer_attention_why"]



def test_pflash_bench_rejects_stall_arguments_it_cannot_use(tmp_path):
    base = ["pflash", "--model", os.path.join(FIXTURES, "qwen36_tiny_a"), "--random-scorer",
            str(_random_scorer(tmp_path)), "--context", "512", "--out-dir", str(tmp_path)]
    for extra, needle in ((["--stall-concurrency", "0"], "--stall-concurrency 0"),
                          (["--stall-concurrency", "1", "--stall-base-steps", "0"], "--stall-base-steps 0"),
                          (["--scorer-dispatch-flops", "-1"], "--scorer-dispatch-flops -1.0"),
                          (["--no-ttft"], "nothing to measure")):
        with pytest.raises(SystemExit, match=needle):
            main(base + extra)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("pflash_")]  # nothing written


def test_stall_figures_from_step_end_times():
    # 4 steps alone of 10 ms, scoring over [0.045, 0.080]: the steps ending at 0.065 (25 ms) and 0.075 overlap it
    ends = [0.0, 0.01, 0.02, 0.03, 0.04, 0.065, 0.075, 0.085, 0.095]
    f = stall_figures(ends, 4, 0.045, 0.080)
    assert f["step_ms"] == pytest.approx(10.0) and f["max_step_ms"] == pytest.approx(25.0)
    assert f["steps"] == 3 and f["stall_steps"] == pytest.approx(1.5)  # (25 - 10) / 10
    assert f["median_step_ms"] == pytest.approx(10.0)
    with pytest.raises(RuntimeError, match="stall-max-tokens"):
        stall_figures(ends, 4, 0.2, 0.3)


def test_pflash_stall_bench_sliced_turns_paced_and_unpaced(tmp_path):
    """Running decode steps are timed while another thread scores a prompt (sliced by heads): taking turns with the
    engine, paced alone and unpaced."""
    scorer = _random_scorer(tmp_path)
    rc = main(["pflash", "--model", os.path.join(FIXTURES, "qwen36_tiny_a"), "--random-scorer", str(scorer),
               "--dtype", "float32", "--context", "512", "--keep-ratio", "0.1", "--head-tokens", "32",
               "--tail-tokens", "64", "--scorer-chunk", "128", "--page-size", "16", "--no-ttft",
               "--scorer-dispatch-flops", str(2 * 512 * 512 * 16), "--stall-concurrency", "1", "2",
               "--stall-compare", "--stall-base-steps", "4", "--stall-prompt-len", "16",
               "--stall-max-tokens", "400", "--out-dir", str(tmp_path)])
    assert rc == 0
    rec = _figures(tmp_path, "pflash_")
    f = rec["figures"]
    assert not any(k.endswith("ttft_s") for k in f)
    for c in (1, 2):
        k = f"pflash.512.stall.c{c}"
        assert f[f"{k}.stall_steps"] == f[f"{k}.turns.stall_steps"]
        for mode in ("turns", "paced", "unpaced"):
            m = f"{k}.{mode}"
            assert f[f"{m}.step_ms"] > 0 and f[f"{m}.max_step_ms"] >= f[f"{m}.median_step_ms"] > 0
            assert f[f"{m}.steps"] >= 1 and f[f"{m}.scoring_s"] > 0 and f[f"{m}.compiles"] == 0
            assert f[f"{m}.gc_passes"] >= 0 and f[f"{m}.gc_max_ms"] >= 0
    assert rec["extra"]["scorer_dispatch_flops"] == 2 * 512 * 512 * 16
    assert f["stall.turns.turns"] > 0  # the scorer took turns with the engine (their order: tests/test_turns.py)

def test_shipped_scorer_keeps_the_needle_at_4k():
    """PFlash with the shipped scorer at a 5 % keep: the needle line of each 4K bench prompt survives compression
    whole (the key's anchor neighbourhood; the kept set stays within the budget)."""
    import numpy as np

    from dflash_jax.bench.acceptance import held_out_files
    from dflash_jax.bench.needle import bench_prompts
    from dflash_jax.models.tokenizer import Tokenizer
    from dflash_jax.prefill.pflash import DenseScorer, PFlashOptions, compress, protected_mask

    target = os.path.join(SHIPPED, "target")
    tok = Tokenizer.from_dir(target)
    scorer = DenseScorer.from_pretrained(os.path.join(SHIPPED, "scorer"), dtype="float32")
    o = PFlashOptions(mode="always", keep_ratio=0.05, min_tokens=1, head_tokens=32, tail_tokens=64)
    for ids, answer, _ in bench_prompts(tok, held_out_files(target), 4096, 3, 0):
        r = compress(np.asarray(ids), scorer, o, must_keep=protected_mask(ids, tok))
        assert r.effective_tokens < 0.05 * len(ids) + 32 + 96  # the budget, one chunk, the forced tail / head
        assert answer in tok.decode(r.effective_ids.tolist())


def test_needle_bench_shipped_set(tmp_path):
    rc = main(["needle", "--model", os.path.join(SHIPPED, "target"), "--scorer", os.path.join(SHIPPED, "scorer"),
               "--context", "1024", "--n", "3", "--keep-ratio", "0.3", "--out-dir", str(tmp_path)])
    assert rc == 0
    rec = _figures(tmp_path, "needle_")
    f = rec["figures"]
    for k in ("needle.1024.accuracy", "needle.1024.pflash.accuracy", "needle.1024.pflash_scores_only.accuracy",
              "needle.1024.random_chunks.accuracy"):
        assert 0 <= f[k] <= 1
    assert f["needle.1024.prompt_tokens"] <= 1024
    prompts = rec["extra"]["prompts"]
    assert len(prompts) == 3 and all(p["answer"] and "pflash_hit" in p for p in prompts)


def test_needle_bench_kvflash_arm(tmp_path):
    """The KVFlash arm answers under a pool of a quarter of the context: pages really leave the pool."""
    rc = main(["needle", "--model", os.path.join(SHIPPED, "target"), "--context", "512", "--n", "2",
               "--kvflash-fraction", "0.25", "--out-dir", str(tmp_path)])
    assert rc == 0
    rec = _figures(tmp_path, "needle_")
    f = rec["figures"]
    assert f["needle.512.kvflash.pool_tokens"] == 128  # 0.25 x 512, whole 16-token pages
    assert f["needle.512.kvflash.pool_tokens"] < f["needle.512.prompt_tokens"]
    assert 0 < f["needle.512.kvflash.pool_fraction"] <= 0.26
    assert f["needle.512.kvflash.pages_out"] > 0
    assert 0 < f["needle.512.kvflash.resident_fraction"] < 0.5
    assert 0 <= f["needle.512.kvflash.same_reply"] <= 1 and 0 <= f["needle.512.kvflash.needle_resident"] <= 1
    prompts = rec["extra"]["prompts"]
    assert len(prompts) == 2 and rec["extra"]["kvflash_fraction"] == 0.25
    for p in prompts:
        assert p["kvflash_pages_out"] > 0
        assert p["kvflash_resident_pages"] <= 128 // 16 < p["kvflash_logical_pages"]
        assert p["kvflash_hit"] == (p["answer"] in (p["kvflash_reply"] or ""))
    assert f["needle.512.kvflash.accuracy"] == sum(p["kvflash_hit"] for p in prompts) / 2


def test_answer_span_is_the_key():
    from dflash_jax.bench.acceptance import held_out_files
    from dflash_jax.bench.needle import answer_span, bench_prompts
    from dflash_jax.models.tokenizer import Tokenizer

    model = os.path.join(SHIPPED, "target")
    tok = Tokenizer.from_dir(model)
    for ids, ans, _ in bench_prompts(tok, held_out_files(model)[:2], 256, 3, 0):
        a, b = answer_span(tok, ids, ans)
        assert ans in tok.decode(ids[a:b])
        assert ans not in tok.decode(ids[a + 1:b]) and ans not in tok.decode(ids[a:b - 1])
        assert tok.decode(ids[a - 4:a]).endswith("is") or " is" in tok.decode(ids[a - 4:b])
