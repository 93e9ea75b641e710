"""``python -m dflash_jax.bench kernels`` on CPU (interpret mode, tiny shapes): the JSON convention, the on-device
check before timing, a failing kernel recorded while the others go on, and the targets' summary figures."""

from __future__ import annotations

import argparse
import json

import pytest

from dflash_jax.bench import __main__ as bench_main
from dflash_jax.bench import kernels

pytestmark = pytest.mark.xdist_group("pallas_bench")

TINY = ["--quick", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--gdn-heads", "2", "--gdn-dim", "16",
        "--check-dtypes", "float32",
        "--copy-bytes", "1000000", "--repeats", "1", "--no-sweep", "--kv-dtypes"]  # (no quantized-KV cases)


def test_check_then_time_writes_result(tmp_path):
    out = tmp_path / "k.json"
    rc = bench_main.main(["kernels", "--out", str(out), "--ops", "tree_attention", "--batches", "2",
                          "--prefixes", "48", "--trees", "16", *TINY])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["bench"] == "kernels" and rec["command"].startswith("python -m dflash_jax.bench kernels")
    assert {"device", "commit", "versions", "figures"} <= set(rec)
    f = rec["figures"]
    assert f["tree_attention.ok"] == 1 and f["tree_attention.check.ok"] == 1
    assert f["tree_attention.check.max_rel_err"] <= kernels.TOL["float32"]
    assert f["device.copy_bytes_per_s"] > 0
    for k in ("kernel_us", "reference_us", "speedup", "bytes_per_s", "bandwidth_fraction", "paged_decode_us"):
        assert f[f"tree_attention.b2.t16.p48.{k}"] > 0
    assert f["tree_attention.b2.t16.p48.vs_paged_decode"] == pytest.approx(
        f["tree_attention.b2.t16.p48.kernel_us"] / f["tree_attention.b2.t16.p48.paged_decode_us"])
    assert rec["extra"]["errors"] == {} and rec["extra"]["skipped"] == [] and rec["extra"]["complete"]


def test_failing_kernel_is_recorded_and_others_continue(tmp_path, monkeypatch):
    real = kernels.implementations

    def broken(op):
        pallas_fn, ref_fn, explicit = real(op)
        if op == "paged_decode":
            def pallas_fn(*args):
                raise RuntimeError("Triton lowering failed: test")
        return pallas_fn, ref_fn, explicit

    monkeypatch.setattr(kernels, "implementations", broken)
    out = tmp_path / "k.json"
    rc = bench_main.main(["kernels", "--out", str(out), "--budget-s", "0", "--ops", "paged_decode", "tree_attention",
                          *TINY])
    assert rc == 1  # loud
    rec = json.loads(out.read_text())
    f = rec["figures"]
    assert f["paged_decode.ok"] == 0 and f["paged_decode.check.ok"] == 0
    assert "Triton lowering failed: test" in rec["extra"]["errors"]["paged_decode"][0]
    assert f["tree_attention.ok"] == 1  # checked after the failure
    assert rec["extra"]["skipped"]  # past the time budget: timings skipped, and said so


def test_summary_figures():
    f = {"paged_decode.b1.p2048.bandwidth_fraction": 0.1, "paged_decode.b1.p8192.bandwidth_fraction": 0.7,
         "paged_decode.b8.p32768.bandwidth_fraction": 0.9, "paged_decode.b64.p8192.bandwidth_fraction": 0.8,
         "tree_attention.b16.t16.p2048.speedup": 3.0, "tree_attention.b16.t32.p16384.speedup": 2.5,
         "tree_attention.b16.t64.p2048.speedup": 1.0, "tree_attention.b16.t16.p512.speedup": 0.5,
         "tree_attention.b16.t16.p2048.vs_paged_decode": 1.2, "tree_attention.b64.t32.p16384.vs_paged_decode": 1.4,
         "tree_attention.b16.t64.p2048.vs_paged_decode": 9.0, "tree_attention.sweep.bm64.ppb2.w8.kernel_us": 1.0}
    kernels.summarize(f)
    assert f["paged_decode.bandwidth_fraction"] == pytest.approx(0.8)
    assert f["paged_decode.bandwidth_fraction_min"] == pytest.approx(0.7)
    assert f["tree_attention.b16.speedup"] == pytest.approx(2.5)
    assert f["tree_attention.vs_paged_decode_max"] == pytest.approx(1.4)  # trees of 16-32 slots only
    # the prefixes the tree-attention minima cover (512 and 64-slot trees are outside the region)
    assert (f["tree_attention.summary_prefix_min"], f["tree_attention.summary_prefix_max"]) == (2048, 16384)


def test_sweep_names_configs_and_reports_the_best(tmp_path, monkeypatch):
    monkeypatch.setitem(kernels.SWEEP, "paged_decode", [((2, None, 48), [
        dict(pages_per_block=1, num_warps=4), dict(pages_per_block=2, num_stages=3, prefetch=True)])])
    out = tmp_path / "k.json"
    tiny = [x for x in TINY if x != "--no-sweep"]
    rc = bench_main.main(["kernels", "--out", str(out), "--ops", "paged_decode", "--batches", "2", "--prefixes", "48",
                          "--page-size", "16", *tiny])
    assert rc == 0
    f = json.loads(out.read_text())["figures"]
    for name in ("ppb1.w4", "ppb2.st3.pf1"):
        assert f[f"paged_decode.sweep.b2.p48.{name}.kernel_us"] > 0
        assert f[f"paged_decode.sweep.b2.p48.{name}.rel_err"] <= kernels.TOL["bfloat16"]
    assert f["paged_decode.sweep.b2.p48.best_us"] == min(
        f[f"paged_decode.sweep.b2.p48.{n}.kernel_us"] for n in ("ppb1.w4", "ppb2.st3.pf1"))
    assert "paged_decode.bandwidth_fraction" not in f  # sweep figures are not grid cases


def test_sweep_overrides_give_every_case_the_configs_of_its_tree_size():
    def ns(**kw):
        return argparse.Namespace(**{"batches": None, "prefixes": None, "trees": None, **kw})

    assert kernels.sweep_cases("tree_attention", ns()) == kernels.SWEEP["tree_attention"]
    cases = kernels.sweep_cases("tree_attention", ns(batches=[16], trees=[32, 16], prefixes=[2048, 8192]))
    assert [c for c, _ in cases] == [(16, 32, 2048), (16, 32, 8192), (16, 16, 2048), (16, 16, 8192)]
    assert cases[0][1] is kernels._TREE_T32 and cases[2][1] is kernels._TREE
    assert kernels.sweep_cases("tree_attention", ns(trees=[48]))[0] == ((16, 48, 4096), kernels._TREE)
    b1 = kernels.sweep_cases("tree_attention", ns(batches=[1], trees=[23], prefixes=[4096]))
    assert b1 == [((1, 23, 4096), kernels._TREE_B1)]
    assert [c for c, _ in kernels.sweep_cases("gdn_tree", ns(batches=[1], trees=[23]))] == [(1, 23, None)]
    gdn = kernels.sweep_cases("gdn_tree", ns(batches=[4], prefixes=[999]))  # the tree GDN has no prefix
    assert [c for c, _ in gdn] == [(4, 32, None)]
    assert [c for c, _ in kernels.sweep_cases("paged_decode", ns(prefixes=[2048]))] == [(1, None, 2048)]


def test_configs_and_names():
    cs = kernels._configs(dict(block_m=64, prefetch=False), dict(block_m=64), dict(prefetch=True))
    assert cs == [dict(block_m=64, prefetch=False), dict(block_m=64, prefetch=True)]
    assert kernels.config_name(cs[1]) == "bm64.pf1"
    for op, cases in kernels.SWEEP.items():
        for _, configs in cases:
            assert all(set(c) <= set(kernels.SHORT) for c in configs), op


def test_quantized_kv_cases(tmp_path):
    """--kv-dtypes: the kernels on quantized pages are checked against the reference on the same pages, then timed
    against bf16 pages at the same shape; the issue's speedup figures exist."""
    out = tmp_path / "k.json"
    rc = bench_main.main(["kernels", "--out", str(out), "--ops", "tree_attention", "paged_decode", "--batches", "2",
                          "--prefixes", "48", "--trees", "16", "--no-grid", *TINY, "fp8"])
    assert rc == 0
    f = json.loads(out.read_text())["figures"]
    for dt in ("fp8",):  # int8 takes the same path (tests/test_pallas_quantized_kv.py covers both)
        for op, case in (("tree_attention", "b2.t16.p48"), ("paged_decode", "b2.p48")):
            assert f[f"kv_{dt}.{op}.check.ok"] == 1
            assert f[f"kv_{dt}.{op}.check.rel_err"] <= kernels.TOL["bfloat16"]
            assert 0 < f[f"kv_{dt}.{op}.quant_rel_err"] < 0.1
            for k in ("kernel_us", "bf16_kernel_us", "speedup", "bytes_per_s", "bandwidth_fraction",
                      *(f"kernel_{c}_us" for c in kernels.KV_CONFIGS), *(f"speedup_{c}" for c in kernels.KV_CONFIGS)):
                assert f[f"{op}.kv_{dt}.{case}.{k}"] > 0
            assert f[f"kv_{dt}.{op}.speedup"] == f[f"{op}.kv_{dt}.{case}.speedup"]
            assert f"{op}.{case}.kernel_us" not in f  # --no-grid: the bf16 grid was not timed


def test_quantized_problem_counts_stored_bytes():
    import jax
    import jax.numpy as jnp
    import numpy as np

    prob = kernels.tree_problem(np.random.default_rng(0), jax.random.key(0), 2, 4, 8, 2, 64, 16, [32, 48],
                                jnp.dtype(jnp.bfloat16))
    q = kernels.quantized_problem(prob, "fp8")
    qo, tree = 2 * 2 * 4 * 8 * 64 * 2, 2 * 4 * 2 * 64 * 2 * 2
    assert prob.nbytes == 80 * 2 * 64 * 2 * 2 + qo + tree
    assert q.nbytes == 80 * 2 * (64 + 4) * 2 + qo + tree
    assert q.args[1].dtype == jnp.float8_e4m3fn and q.args[1].compute_dtype == jnp.bfloat16


def test_gdn_chunked_checks_bf16_inputs(tmp_path):
    """GDN chunked is checked with bf16 q, k, v too (bf16 dot operands, fp32 state) against the fp32 oracle."""
    out = tmp_path / "k.json"
    tiny = [x for x in TINY if x != "float32"]
    at = tiny.index("--check-dtypes") + 1
    rc = bench_main.main(["kernels", "--out", str(out), "--ops", "gdn_chunked", "--no-grid", "--gdn-dtype",
                          "bfloat16", *tiny[:at], "bfloat16", *tiny[at:]])
    assert rc == 0
    rec = json.loads(out.read_text())
    f = rec["figures"]
    assert f["gdn_chunked.check.ok"] == 1 and rec["extra"]["gdn_dtype"] == "bfloat16"
    for name in ("kernel", "kernel_c32"):
        assert 0 < f[f"gdn_chunked.check.c0.bfloat16.{name}.rel_err"] <= kernels.TOL["bfloat16"]
    assert rec["extra"]["errors"] == {}


def test_gdn_problem_dtype_and_bytes():
    import jax
    import jax.numpy as jnp

    p32 = kernels.gdn_problem(jax.random.key(0), 2, 8, 3, 16, 32)
    p16 = kernels.gdn_problem(jax.random.key(0), 2, 8, 3, 16, 32, dtype=jnp.bfloat16)
    assert [x.dtype for x in p16.args] == [jnp.bfloat16] * 3 + [jnp.float32] * 3
    assert p32.nbytes - p16.nbytes == 2 * 2 * 8 * 3 * (2 * 16 + 2 * 32)  # q, k, v, o at half the bytes


def test_gdn_tree_checks_and_times(tmp_path):
    """gdn_tree: checked against the fp32 oracle (bf16 q, k, v take the same path: --check-dtypes bfloat16 on the
    GPU; the kernel's bf16 numerics are tests/test_pallas_gdn_tree.py's), then timed over batch x tree slots with
    the figure names the targets read (``gdn_tree.b{B}.t{N}.speedup``, no prefix)."""
    out = tmp_path / "k.json"
    rc = bench_main.main(["kernels", "--out", str(out), "--ops", "gdn_tree", "--batches", "2", "--trees", "16",
                          *TINY])
    assert rc == 0
    rec = json.loads(out.read_text())
    f = rec["figures"]
    assert f["gdn_tree.ok"] == 1 and f["gdn_tree.check.ok"] == 1
    for name in ("kernel", "kernel_bv16"):
        assert 0 <= f[f"gdn_tree.check.c0.float32.{name}.rel_err"] <= 1e-5
    for k in ("kernel_us", "reference_us", "speedup", "bytes_per_s", "bandwidth_fraction"):
        assert f[f"gdn_tree.b2.t16.{k}"] > 0
    assert rec["extra"]["errors"] == {}


def test_gdn_tree_commit_checks_times_and_sweeps(tmp_path):
    """gdn_tree_commit: checked against the fp32 oracle, timed with its pool carried through the loop, swept."""
    out = tmp_path / "k.json"
    args = [a for a in TINY if a != "--no-sweep"]
    rc = bench_main.main(["kernels", "--out", str(out), "--ops", "gdn_tree_commit", "--batches", "2", "--trees", "7",
                          *args])
    assert rc == 0
    rec = json.loads(out.read_text())
    f = rec["figures"]
    assert f["gdn_tree_commit.ok"] == 1 and f["gdn_tree_commit.check.ok"] == 1
    for name in ("kernel", "kernel_bv64", "reference"):
        assert 0 <= f[f"gdn_tree_commit.check.c0.float32.{name}.rel_err"] <= 1e-5
    for k in ("kernel_us", "reference_us", "speedup", "bytes_per_s", "bandwidth_fraction"):
        assert f[f"gdn_tree_commit.b2.t7.{k}"] > 0
    assert f["gdn_tree_commit.sweep.b2.t7.best_us"] > 0 and f["gdn_tree_commit.sweep.b2.t7.bv16.w4.kernel_us"] > 0
    errors = rec["extra"]["errors"].get("gdn_tree_commit", [])  # only the sweep's tiles wider than the tiny dv = 16
    assert set(rec["extra"]["errors"]) <= {"gdn_tree_commit"} and all("not a multiple" in e for e in errors)


def test_gdn_tree_problem():
    import jax
    import numpy as np

    p = kernels.gdn_tree_problem(jax.random.key(0), 2, 6, 3, 16, 32, tree="chain", n_pad=2)
    q, k, v, beta, g, s0, anc = p.args
    a = np.asarray(anc)
    assert a.shape == (2, 6, 6) and (a[:, :4, :4] == np.tril(np.ones((4, 4), bool))).all()  # the chain
    assert (a[:, 4:] == np.eye(6, dtype=bool)[4:]).all()  # padding slots see only themselves
    assert float(np.abs(np.asarray(beta[:, 4:])).max()) == 0.0 and float(np.abs(np.asarray(k[:, 4:])).max()) == 0.0


@pytest.mark.parametrize("op", ["paged_decode", "tree_attention"])
def test_fp8_launch_configs_time_the_pair_kernel(op):
    """The quantized-KV configs on fp8 pages run the pair kernel the registry runs on CUDA (here in interpret
    mode), with a config's block size and no ``prefetch`` argument, and it equals the reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_decode.kernel import default_config

    rng = np.random.default_rng(0)
    if op == "paged_decode":
        prob = kernels.decode_problem(rng, jax.random.key(0), 2, 4, 1, 64, 16, [40, 7], jnp.bfloat16)
    else:
        prob = kernels.tree_problem(rng, jax.random.key(0), 2, 5, 4, 1, 64, 16, [40, 7], jnp.bfloat16)
    prob = kernels.quantized_problem(prob, "fp8")
    _, ref_fn, _ = kernels.implementations(op)
    cfg = dict(default_config(64, 16, jnp.bfloat16, quantized=True), num_partitions=None,
               **kernels.KV_CONFIGS["bk32"](16), interpret=True)
    if op == "tree_attention":
        cfg["block_m"] = 32
    out = kernels._pair_kernel(op)(*prob.args, **cfg)
    ref = ref_fn(*prob.args)
    assert kernels._rel_err(out, ref) <= kernels.TOL["bfloat16"]
    assert kernels._pair_kernel("gdn_tree") is None
