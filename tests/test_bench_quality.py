"""``bench quality``: held-out perplexity, greedy agreement and DDTree tau of quantized weights and pages against the
reference format, on the shipped model set."""

import json
import os

import pytest

import dflash_jax as dj
from dflash_jax.bench.__main__ import main


def test_quality_compares_weight_and_page_formats_with_the_reference(tmp_path):
    rc = main(["quality", "--model", os.path.join(dj.SHIPPED_MODELS, "target"),
               "--drafter", os.path.join(dj.SHIPPED_MODELS, "drafter"), "--dtype", "float32",
               "--quantization", "none", "fp8_dynamic", "--kv-dtypes", "int8", "--draft-quantization", "fp8",
               "--rows", "2", "--row-len", "96",
               "--agree-prefix", "64", "--agree-tokens", "8", "--anchors", "2", "--out-dir", str(tmp_path)])
    assert rc == 0
    [f] = list(tmp_path.iterdir())
    res = json.loads(f.read_text())
    fig = res["figures"]
    assert res["bench"] == "quality" and res["extra"]["reference"] == "f32"
    # the reference reproduces its own greedy tokens when they are teacher-forced through its prefill (fp32)
    assert fig["f32.greedy_agreement"] == 1.0 and fig["f32.ppl_ratio"] == 1.0
    assert fig["f32.greedy_agreement_ci95_lo"] == pytest.approx(16 / (16 + 1.959964 ** 2))  # Wilson at p = 1
    for name in ("f32", "fp8_dynamic", "kv_int8"):
        assert 1 < fig[f"{name}.ppl"] < 1000 and 0 <= fig[f"{name}.greedy_agreement"] <= 1
        assert fig[f"{name}.greedy_agreement_positions"] == 2 * 8  # rows x agree-tokens
        assert fig[f"{name}.greedy_agreement_ci95_lo"] <= fig[f"{name}.greedy_agreement"]
        assert fig[f"{name}.greedy_agreement"] <= fig[f"{name}.greedy_agreement_ci95_hi"]
        assert fig[f"{name}.ppl_ratio"] == pytest.approx(fig[f"{name}.ppl"] / fig["f32.ppl"])
    # int8 pages and W8A8 move the model a little, not a lot
    assert 0.9 < fig["kv_int8.ppl_ratio"] < 1.1 and 0.8 < fig["fp8_dynamic.ppl_ratio"] < 1.25
    # a best-first tree of 22 nodes need not hold the whole top-1 chain (deep chain nodes can rank below other
    # branches), so the tree's tau is not bounded below by the chain's on 4 blocks; both stay in [1, block]
    for name in ("f32", "fp8_dynamic"):
        assert 1 <= fig[f"{name}.chain.tau"] <= 16 and 1 <= fig[f"{name}.ddtree.tau"] <= 16
    assert fig["fp8_dynamic.ddtree.tau_ratio"] == pytest.approx(fig["fp8_dynamic.ddtree.tau"] / fig["f32.ddtree.tau"])
    assert "kv_int8.ddtree.tau" not in fig
    # the drafter alone in fp8 (its head a quantized copy of the f32 target's), against the f32 target's labels
    assert 1 <= fig["draft_fp8.chain.tau"] <= 16 and 1 <= fig["draft_fp8.ddtree.tau"] <= 16
    assert fig["draft_fp8.ddtree.tau_ratio"] == pytest.approx(fig["draft_fp8.ddtree.tau"] / fig["f32.ddtree.tau"])
    assert res["extra"]["draft_quantization"] == ["fp8"]


@pytest.mark.parametrize("p,n,lo,hi", [(0.5, 100, 0.4038, 0.5962), (0.987, 1024, 0.9780, 0.9923), (0.0, 10, 0.0, 0.2775)])
def test_wilson_interval_matches_the_textbook_values(p, n, lo, hi):
    from dflash_jax.bench.quality import wilson_interval

    assert wilson_interval(p, n) == pytest.approx((lo, hi), abs=1e-4)


def test_drafter_formats_without_a_drafter_are_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="give --drafter"):
        main(["quality", "--model", os.path.join(dj.SHIPPED_MODELS, "target"), "--draft-quantization", "fp8",
              "--out-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())
