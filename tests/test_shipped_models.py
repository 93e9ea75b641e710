"""The shipped tiny model set (``dflash_jax/assets/tiny``) loads through the normal loaders, is wired as trained, and
its drafter really drafts: a small held-out acceptance evaluation (a regression guard, not the target)."""

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from conftest import FIXTURES
from dflash_jax.bench import acceptance
from dflash_jax.config import DrafterConfig
from dflash_jax.engine.spec_steps import features
from dflash_jax.models import dense, dflash, loader
from dflash_jax.models.dflash_loader import load_drafter
from dflash_jax.models.tokenizer import Tokenizer
from dflash_jax.serve.__main__ import SHIPPED

pytestmark = pytest.mark.xdist_group("shipped")

TARGET, DRAFTER, SCORER = (os.path.join(SHIPPED, n) for n in ("target", "drafter", "scorer"))


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_the_set_is_complete_and_small():
    for d, files in ((TARGET, ("config.json", "tokenizer.json", "generation_config.json")),
                     (DRAFTER, ("config.json", "model.safetensors")),
                     (SCORER, ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"))):
        for f in files:
            assert os.path.exists(os.path.join(d, f)), f"{d}/{f} missing"
    # the target's weights: one file, or shards listed by an index (each file small enough to ship)
    assert loader.checkpoint_files(TARGET)
    assert _size(SHIPPED) <= 24_000_000
    with open(os.path.join(SHIPPED, "train_report.json")) as fh:
        rep = json.load(fh)
    assert rep["data"]["held_out"]["stdlib_files"] and rep["environment"]["backend"] == "gpu"


@pytest.fixture(scope="module")
def models():
    target = dj.load_target(TARGET)
    dcfg, dparams = load_drafter(DRAFTER, dtype=jnp.float32)
    return target, dcfg, dparams


def test_loaders_and_drafter_wiring(models):
    target, dcfg, dparams = models
    tcfg = target.config
    assert tcfg.layer_types.count("full_attention") == 2 and tcfg.num_layers == 8
    dcfg.validate_against(tcfg)
    assert dcfg.vocab_size == tcfg.vocab_size and dcfg.hidden_size == tcfg.hidden_size
    assert DrafterConfig.from_file(DRAFTER) == dcfg
    chex.assert_shape(dparams["fc"], (tcfg.hidden_size, len(dcfg.target_layer_ids) * tcfg.hidden_size))
    tok = Tokenizer.from_dir(TARGET)
    ids = tok.encode("import os\n\ndef main():\n    print(os.getcwd())\n")
    t = len(ids)
    feats = target.hidden_states(ids, dcfg.target_layer_ids)
    chex.assert_shape(feats, (len(dcfg.target_layer_ids), t, tcfg.hidden_size))
    anchors = jnp.asarray([[1, t // 2]])
    logits = dflash.train_forward(dparams, dcfg, target.params["embed"], target.params["lm_head"],
                                  features(feats[:, None]), jnp.asarray(ids)[None], anchors)
    chex.assert_shape(logits, (1, 2, dcfg.block_size, tcfg.vocab_size))
    chex.assert_tree_all_finite(logits)
    scfg = dense.DenseConfig.from_file(SCORER)
    assert scfg.vocab_size == tcfg.vocab_size


def test_held_out_text_ships_with_the_set(monkeypatch, tmp_path):
    """The held-out files come from the set's own archive, not this interpreter's stdlib (another patch release's
    files would shift every prompt window), in the report's order, whatever the stdlib holds."""
    import sysconfig

    _, names = acceptance.held_out_names(TARGET)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})  # an empty stdlib
    files = acceptance.held_out_files(TARGET)
    assert len(files) == len(names) == 28
    assert [f.endswith(os.sep + n.replace("/", os.sep)) for f, n in zip(files, names)] == [True] * len(names)
    assert all(os.path.getsize(f) > 0 for f in files) and acceptance.held_out_files(TARGET) == files


def test_held_out_archive_is_rebuilt_byte_for_byte(tmp_path):
    """``write_held_out_archive`` (what the training script's export calls) reproduces the shipped archive from
    its own files: the archive is what the committed command builds, and rebuilding it is deterministic."""
    _, names = acceptance.held_out_names(TARGET)
    first = acceptance.held_out_files(TARGET)[0]  # <unpacked root>/<names[0]>
    root = first[: len(first) - len(names[0])]
    rebuilt = acceptance.write_held_out_archive(str(tmp_path), names, root)
    shipped = os.path.join(os.path.dirname(TARGET), acceptance.HELD_OUT_ARCHIVE)
    with open(rebuilt, "rb") as a, open(shipped, "rb") as b:
        assert a.read() == b.read()
    with pytest.raises(FileNotFoundError, match="missing"):
        acceptance.write_held_out_archive(str(tmp_path), names + ["no/such_file.py"], root)


def test_target_is_trained(models):
    """Held-out next-token loss on a stdlib file far below the uniform log(V)."""
    target, _, _ = models
    tok = Tokenizer.from_dir(TARGET)
    (path,) = acceptance.held_out_files(TARGET)[:1]
    with open(path) as fh:
        ids = tok.encode(fh.read())[:512]
    logp = jax.nn.log_softmax(target.logits(ids), axis=-1)
    nll = -float(jnp.mean(logp[jnp.arange(len(ids) - 1), jnp.asarray(ids[1:])]))
    assert nll < 0.5 * np.log(target.config.vocab_size)


def test_held_out_acceptance_regression_guard(models):
    target, dcfg, dparams = models
    tok = Tokenizer.from_dir(TARGET)
    rows = acceptance.held_out_rows(tok, acceptance.held_out_files(TARGET), 4, 256)
    anchors = acceptance.anchor_positions(rows.shape[1], dcfg.block_size, 16, 0, len(rows))
    from dflash_jax.engine.loop import Engine, EngineOptions

    eng = Engine(target, tok, EngineOptions(max_batch=8, max_model_len=320, prefill_chunk=128))
    labels = acceptance.greedy_labels(eng, rows, anchors, dcfg.block_size)
    lp = acceptance.draft_logprobs(target, dcfg, dparams, rows, anchors)
    chain = acceptance.chain_tau(lp, labels)
    tree = acceptance.tree_tau(lp, labels, 22)  # best-first, the engine's default
    seeded = acceptance.tree_tau(lp, labels, 22, chain_seed=True)
    assert (seeded >= chain).all()  # the chain-seeded tree holds the top-1 chain
    assert tree.mean() > 1.5, f"DDTree tau {tree.mean():.2f} on held-out stdlib text"


def test_shipped_target_matches_transformers():
    """The shipped target against transformers 5.17's ``Qwen3_5ForCausalLM`` loaded from the same safetensors
    (``tests/fixtures/shipped_target_golden``, made by ``experiments/make_hf_fixtures.py --shipped``): logits at
    sampled positions of held-out needle prompts of 95, 700 and 2600 tokens (the last past the 2048 positions its
    YaRN scaling stretches) within fp32 tolerance, and the same 16 greedy tokens."""
    stem = os.path.join(FIXTURES, "shipped_target_golden")
    with open(stem + ".json") as fh:
        meta = json.load(fh)
    assert loader.weights_sha256(TARGET) == meta["weights_sha256"], (
        "the shipped target changed since its golden was made; regenerate it with: " + meta["command"])
    g = dict(np.load(stem + ".npz"))
    t = dj.load_target(TARGET, dtype="float32")
    assert t.config.rope_scaling is not None and max(meta["prompt_lengths"]) > \
        t.config.rope_scaling.original_max_position_embeddings
    for j in range(len(meta["prompt_lengths"])):
        ids = g[f"p{j}.ids"]
        logits = np.asarray(t.logits(ids))[g[f"p{j}.positions"]]
        assert np.abs(logits - g[f"p{j}.logits"]).max() <= 2e-4, j
        assert t.greedy([int(i) for i in ids], 16) == g[f"p{j}.greedy"].tolist(), j
