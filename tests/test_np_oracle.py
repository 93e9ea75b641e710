"""Check the float64 NumPy oracle (tests/np_oracle.py) against golden outputs of Hugging Face transformers.

The golden files (``tests/fixtures/<name>_golden.npz``, made by ``experiments/make_hf_fixtures.py``) hold, per
prompt j: ``p{j}.ids``, fp32 ``p{j}.logits`` [T, V], ``p{j}.hidden`` [L+1, T, D] (``output_hidden_states``:
embeddings, decoder-layer outputs, last entry after the final norm) and ``p{j}.greedy`` (16 greedy tokens
from ``generate``). Observed oracle-vs-transformers max abs errors are ~1e-5 (fp32 round-off in transformers).
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import np_oracle  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
MODELS = ["qwen36_tiny_a", "qwen36_tiny_b"]  # a: single model.safetensors, b: sharded with index.json
PROMPTS = [0, 1, 2]
TOL = 5e-4


@functools.lru_cache(maxsize=None)
def _model(name):
    return np_oracle.load_checkpoint(os.path.join(FIXTURES, name))


@functools.lru_cache(maxsize=None)
def _golden(name):
    with np.load(os.path.join(FIXTURES, f"{name}_golden.npz")) as z:
        return {k: z[k] for k in z.files}


@functools.lru_cache(maxsize=None)
def _forward(name, j):
    cfg, w = _model(name)
    return np_oracle.forward(cfg, w, _golden(name)[f"p{j}.ids"])


@pytest.mark.parametrize("name", MODELS)
def test_load_checkpoint(name):
    cfg, w = _model(name)
    assert all(v.dtype == np.float64 for v in w.values())
    assert not any(k.startswith(("model.", "visual")) for k in w), "visual / prefixed names must be stripped"
    assert w["lm_head.weight"].shape == (cfg["vocab_size"], cfg["hidden_size"])
    assert w["embed_tokens.weight"].shape == (cfg["vocab_size"], cfg["hidden_size"])
    assert len(cfg["layer_types"]) == cfg["num_hidden_layers"]
    for i, kind in enumerate(cfg["layer_types"]):
        sub = "self_attn" if kind == "full_attention" else "linear_attn"
        assert any(k.startswith(f"layers.{i}.{sub}.") for k in w), (i, kind)


@pytest.mark.parametrize("j", PROMPTS)
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, j):
    logits, _ = _forward(name, j)
    ref = _golden(name)[f"p{j}.logits"]
    assert logits.dtype == np.float64 and logits.shape == ref.shape
    err = float(np.abs(logits - ref).max())
    assert err < TOL, f"{name} p{j}: max |logits - transformers| = {err:.3e} (tol {TOL:g})"


@pytest.mark.parametrize("j", PROMPTS)
@pytest.mark.parametrize("name", MODELS)
def test_hidden_states_match_transformers(name, j):
    cfg, _ = _model(name)
    _, hidden = _forward(name, j)
    ref = _golden(name)[f"p{j}.hidden"]
    assert hidden.dtype == np.float64
    assert hidden.shape == ref.shape == (cfg["num_hidden_layers"] + 1, len(_golden(name)[f"p{j}.ids"]),
                                         cfg["hidden_size"])
    for layer in range(hidden.shape[0]):
        err = float(np.abs(hidden[layer] - ref[layer]).max())
        tol = TOL * max(1.0, float(np.abs(ref[layer]).max()))
        assert err < tol, f"{name} p{j} hidden[{layer}]: max abs err {err:.3e} (tol {tol:.3e})"


@pytest.mark.parametrize("j", PROMPTS)
@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_transformers(name, j):
    cfg, w = _model(name)
    g = _golden(name)
    ref = [int(t) for t in g[f"p{j}.greedy"]]
    out = np_oracle.greedy(cfg, w, g[f"p{j}.ids"], len(ref))
    assert out == ref, f"{name} p{j}: oracle {out} != transformers {ref}"
