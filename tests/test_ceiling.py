"""Weight-stream ceiling on CPU with a tiny config: it runs, is unrolled, and touches every matrix."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.bench import ceiling, results
from dflash_jax.bench.__main__ import main
from dflash_jax.config import FULL, LINEAR, TargetConfig
from dflash_jax.models import qwen36

TINY = TargetConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=4,
    layer_types=(LINEAR, LINEAR, LINEAR, FULL), num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=4,
    rope_theta=1e4, attn_output_gate=True, lin_num_k_heads=2, lin_num_v_heads=4, lin_k_dim=16,
    lin_v_dim=16, conv_kernel=4)

TINY_HF = {
    "model_type": "qwen3_5",
    "text_config": {
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    },
}


def _has_while(text: str) -> bool:
    """A while loop in StableHLO (``stablehlo.while``) or HLO (``= ... while(``) text."""
    return re.search(r"stablehlo\.while|\swhile\(", text) is not None


@pytest.fixture(scope="module")
def params():
    return qwen36.init_params(TINY, jax.random.key(0), jnp.float32)


def test_runs_and_finite(params):
    f = ceiling.make_weight_stream(TINY)
    x = jnp.ones((2, 64), jnp.float32)
    y = f(params, x)
    assert y.shape == (2, 64) and y.dtype == jnp.float32
    assert np.isfinite(np.asarray(y)).all()


def test_no_while_loop_and_every_matrix_used(params):
    f = ceiling.make_weight_stream(TINY)
    x = jnp.ones((1, 64), jnp.bfloat16)
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.ndim == 2 else a, params)
    assert not _has_while(f.lower(p, x).as_text())
    assert not _has_while(f.lower(p, x).compile().as_text())
    # the detector does see a scan
    scanned = jax.jit(lambda w, v: jax.lax.scan(lambda c, wi: (c @ wi, None), v, w)[0])
    assert _has_while(scanned.lower(jnp.ones((3, 64, 64)), jnp.ones((1, 64))).as_text())
    # every matrix of every layer, and the LM head, changes the output
    base = np.asarray(f(params, jnp.ones((1, 64), jnp.float32)))
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        if leaf.ndim != 2 or name == "['embed']":
            continue
        bumped = jax.tree_util.tree_map_with_path(
            lambda q, a: a * 1.5 + 0.1 if jax.tree_util.keystr(q) == name else a, params)
        out = np.asarray(f(bumped, jnp.ones((1, 64), jnp.float32)))
        assert not np.allclose(out, base), f"{name} does not reach the output"


def test_measure_ceiling(params):
    m = ceiling.measure_ceiling(TINY, params, batch=2, iters=3, warmup=1)
    assert set(m) >= {"ms_per_step", "tok_s", "bytes_per_s"}
    assert m["ms_per_step"] > 0
    assert m["tok_s"] == pytest.approx(2 / (m["ms_per_step"] / 1e3))
    assert all(math.isfinite(v) for v in m.values())


def test_write_result_validation(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_graph_min_graph_size=1")
    with pytest.raises(ValueError):
        results.write_result("x", {"a": float("nan")}, "cmd", out_dir=str(tmp_path))
    with pytest.raises(ValueError):
        results.write_result("x", {"a": "1"}, "cmd", out_dir=str(tmp_path))
    with pytest.raises(ValueError):
        results.write_result("x", {1: 1.0}, "cmd", out_dir=str(tmp_path))
    p1 = results.write_result("x", {"a.b": 1.5, "c": None, "n": 3}, "cmd", extra={"k": 1}, out_dir=str(tmp_path))
    p2 = results.write_result("x", {"a.b": 1.5}, "cmd", out_dir=str(tmp_path))
    assert p1 != p2
    rec = json.load(open(p1))
    assert rec["bench"] == "x" and rec["device"] == "cpu" and rec["figures"] == {"a.b": 1.5, "c": None, "n": 3}
    assert set(rec) >= {"device_kind", "command", "commit", "dirty", "versions", "date", "extra"}
    assert isinstance(rec["dirty"], bool)
    assert rec["xla_flags"] == "--xla_gpu_graph_min_graph_size=1"
    assert set(rec["versions"]) == {"python", "jax", "jaxlib", "numpy", "flax"}


def test_script_command_names_the_script_from_the_repository(monkeypatch):
    import argparse
    import os

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(results.__file__))), "..",
                          "experiments", "x.py")
    assert results.script_command(script, ["--a", "1 2"]) == "python experiments/x.py --a '1 2'"
    monkeypatch.setattr("sys.argv", ["x.py", "--b"])
    assert results.script_command(script) == "python experiments/x.py --b"
    assert results.settings(argparse.Namespace(a=1, out_dir="o", no_write=False)) == {"a": 1}


def test_cli_end_to_end(tmp_path, capsys):
    cfg_path = tmp_path / "tiny.json"
    cfg_path.write_text(json.dumps(TINY_HF))
    out = tmp_path / "out"
    rc = main(["ceiling", "--random-weights", str(cfg_path), "--batch", "1", "2", "--iters", "2",
               "--warmup", "1", "--out-dir", str(out)])
    assert rc == 0
    files = list(out.glob("ceiling_cpu_*.json"))
    assert len(files) == 1
    figs = json.load(open(files[0]))["figures"]
    for b in (1, 2):
        assert figs[f"b{b}.ceiling_tok_s"] > 0
        assert figs[f"b{b}.ceiling_bw_fraction"] == pytest.approx(figs[f"b{b}.ceiling_bytes_per_s"] / 4.8e12)
    assert "b2.ceiling_tok_s" in capsys.readouterr().out
