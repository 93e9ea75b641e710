"""experiments/train_tiny.py end to end at smoke size: corpus -> tokenizer -> target -> drafter -> scorer -> HF export,
then the exported set is loaded back the way the engine and the server load it and generates from a text prompt."""

import json
import math
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import train_tiny  # noqa: E402

from dflash_jax import load_target  # noqa: E402
from dflash_jax.config import build_target_layer_ids  # noqa: E402
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams  # noqa: E402
from dflash_jax.models import dense  # noqa: E402
from dflash_jax.models.dflash_loader import load_drafter  # noqa: E402
from dflash_jax.models.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.xdist_group("train_tiny")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_tiny")
    out, work = root / "tiny", root / "work"
    report = train_tiny.main(["--smoke", "--out", str(out), "--work-dir", str(work)])
    return out, work, report


def test_smoke_run_trains_and_exports(smoke_run):
    out, work, report = smoke_run
    for sub, files in {"target": ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json"),
                       "drafter": ("config.json", "model.safetensors"),
                       "scorer": ("config.json", "model.safetensors", "tokenizer.json")}.items():
        for f in files:
            assert (out / sub / f).is_file(), f"{sub}/{f} missing"
    with open(out / "train_report.json") as fh:
        on_disk = json.load(fh)
    assert on_disk["target"]["held_out"] == report["target"]["held_out"]
    assert on_disk["command"].startswith("python experiments/train_tiny.py --smoke")
    assert on_disk["data"]["held_out"]["stdlib_files"], "held-out file list recorded"

    for phase in ("target", "drafter", "scorer"):
        tl = report[phase]["train_loss"]
        assert tl["last"] < tl["first"], f"{phase} loss did not go down: {tl}"
        assert report[phase]["timing"]["steps_run"] == report[phase]["hparams"]["steps"]
    ppl = report["target"]["held_out"]["ppl"]
    assert math.isfinite(ppl) and ppl < report["data"]["vocab_size"], ppl  # better than uniform
    assert math.isfinite(report["scorer"]["held_out"]["ppl"])
    tau = report["drafter"]["held_out"]["tau"]
    assert 1.0 <= tau <= 16.0 and report["drafter"]["held_out_at_init"]["tau"] >= 1.0
    # the exported target reloads with the serving loader to the trained model (float32 export in --smoke)
    check = report["export"]["check"]
    assert check["target_max_abs_logit_diff"] < 1e-3 and check["target_greedy_agree"] == 1.0
    assert check["drafter_max_abs_param_diff"] == 0.0
    # orbax checkpoints of every phase
    for phase in ("target", "drafter", "scorer"):
        steps = report[phase]["hparams"]["steps"]
        assert (work / "ckpt" / phase / str(steps)).is_dir()
    # the long phase ran on rows each holding a whole retrieval document; held-out needle accuracy before/after it
    long = report["target"]["long"]
    assert long["timing"]["steps_run"] == long["hparams"]["steps"]
    assert (work / "ckpt" / "target_long" / str(long["hparams"]["steps"])).is_dir()
    packing = report["data"]["packing"]
    assert packing["train"]["whole_docs"] > 0 and packing["train_long"]["whole_docs"] > 0
    assert report["data"]["train_long_seqs"] == packing["train_long"]["rows_with_whole_docs"]
    # the long phase extends the context with YaRN (the preset's rope_scaling): the exported target carries it
    y = load_target(out / "target", dtype="float32").config.rope_scaling
    assert (y.factor, y.original_max_position_embeddings) == (2.0, 256)
    assert report["target"]["config"]["rope_parameters"]["rope_type"] == "yarn"
    for when in ("after_target", "extended_untrained", "after_target_long"):
        r = report["target"]["retrieval"][when]
        assert set(r) == {"needle_acc_160", "needle_tok_160", "induction_acc"}
        assert all(0.0 <= v <= 1.0 for v in r.values())
    assert report["data"]["corpus_stats"]["train_drill"] == 6  # recall drills packed with the retrieval documents
    assert all(os.path.getsize(os.path.join(d, f)) <= train_tiny.MAX_FILE_BYTES
               for d, _, fs in os.walk(out) for f in fs)


def test_exported_set_loads_and_generates(smoke_run):
    out, _, report = smoke_run
    target = load_target(out / "target", dtype="float32")
    tok = Tokenizer.from_dir(str(out / "target"))
    assert tok is not None and tok.vocab_size == target.config.vocab_size
    assert tok.im_end_id in target.eos_token_ids
    cfg = target.config
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)

    prompt = "def add(a, b):\n    return"
    ids = tok.encode(prompt)
    logits = np.asarray(target.logits(ids))
    assert logits.shape == (len(ids), cfg.vocab_size) and np.isfinite(logits).all()

    dcfg, dparams = load_drafter(out / "drafter", dtype=jnp.float32)
    dcfg.validate_against(cfg)
    assert dcfg.mask_token_id == tok.mask_token_id == tok.token_to_id("<|mask|>")
    assert dcfg.target_layer_ids == build_target_layer_ids(cfg.num_layers, dcfg.num_layers)
    assert dcfg.block_size == 16

    scfg, sparams = dense.load_dense(str(out / "scorer"), jnp.float32)
    assert scfg.vocab_size == cfg.vocab_size
    h = np.asarray(dense.hidden_states(sparams, scfg, jnp.asarray(ids, jnp.int32)[None]))
    assert np.isfinite(h).all()

    eng = Engine(target, tok, EngineOptions(max_batch=1, max_model_len=128, prefill_chunk=16))
    [res] = eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    assert res.finish_reason == "length" and len(res.token_ids) == 4
    assert isinstance(res.text, str) and res.prompt_token_ids == ids
    assert res.token_ids == target.greedy(ids, 4)  # the engine's greedy decode equals the reference


def _work_with_data(src, dst):
    """A fresh work dir holding the smoke run's cached data (no corpus / tokenizer rebuild)."""
    dst.mkdir()
    for d in src.iterdir():
        if d.name.startswith("data-"):
            shutil.copytree(d, dst / d.name)
    return dst


def test_init_drafter_continues_from_the_exported_drafter(smoke_run, tmp_path):
    out, work, report = smoke_run
    new = tmp_path / "cont"
    # a calibrated DDTree level bonus in the checkpoint is an inference setting: accepted, not carried over
    init = tmp_path / "calibrated"
    shutil.copytree(out / "drafter", init)
    raw = json.loads((init / "config.json").read_text())
    raw["dflash_config"]["ddtree_level_bonus"] = 0.25
    (init / "config.json").write_text(json.dumps(raw))
    rep = train_tiny.main(["--smoke", "--out", str(new), "--work-dir", str(_work_with_data(work, tmp_path / "w")),
                           "--init-target", str(out / "target"), "--init-drafter", str(init),
                           "--no-scorer", "--set", "train.drafter.steps=0"])
    assert rep["settings"]["init_drafter"] == os.path.abspath(init)
    assert rep["drafter"]["loaded_from"] == str(init)
    assert rep["seeds"]["batch_order"]["drafter"] == train_tiny.CONTINUE_SEED_OFFSET + 1
    # the phase starts from the loaded parameters: its tau at init is the exported drafter's final tau, and with
    # zero steps the export is the input (float32 export in --smoke: bit for bit)
    assert rep["drafter"]["held_out_at_init"] == report["drafter"]["held_out"]
    assert rep["drafter"]["timing"]["steps_run"] == 0
    cfg_a, pa = load_drafter(out / "drafter", dtype=jnp.float32)
    cfg_b, pb = load_drafter(new / "drafter", dtype=jnp.float32)
    assert cfg_a == cfg_b
    la, lb = jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pb)
    assert len(la) == len(lb) and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(la, lb))


def test_init_drafter_refuses_a_mismatched_config_and_needs_init_target(smoke_run, tmp_path, capsys):
    out, work, _ = smoke_run
    with pytest.raises(SystemExit, match="not this preset's drafter config"):
        train_tiny.main(["--smoke", "--out", str(tmp_path / "o"), "--work-dir",
                         str(_work_with_data(work, tmp_path / "w")), "--init-target", str(out / "target"),
                         "--init-drafter", str(out / "drafter"), "--no-scorer", "--set", "drafter.num_layers=3"])
    assert not (tmp_path / "o").exists(), "nothing exported"
    with pytest.raises(SystemExit):
        train_tiny.main(["--smoke", "--out", str(tmp_path / "o"), "--init-drafter", str(out / "drafter")])
    assert "--init-drafter needs --init-target" in capsys.readouterr().err


def test_extend_target_runs_the_long_phase_on_a_loaded_target(smoke_run, tmp_path):
    """``--init-target DIR --extend-target``: a target exported before its context extension (plain rotary) gets
    the long phase with YaRN, and the export carries the scaling; the drafter then trains on the extended one."""
    out, work, _ = smoke_run
    base = tmp_path / "base"
    shutil.copytree(out / "target", base)
    raw = json.loads((base / "config.json").read_text())
    rp = raw["text_config"]["rope_parameters"]
    raw["text_config"]["rope_parameters"] = {k: rp[k] for k in ("rope_type", "rope_theta", "partial_rotary_factor")}
    raw["text_config"]["rope_parameters"]["rope_type"] = "default"
    (base / "config.json").write_text(json.dumps(raw))
    assert load_target(base, dtype="float32").config.rope_scaling is None
    new = tmp_path / "ext"
    rep = train_tiny.main(["--smoke", "--out", str(new), "--work-dir", str(_work_with_data(work, tmp_path / "w")),
                           "--init-target", str(base), "--extend-target", "--no-scorer",
                           "--set", "train.drafter.steps=1"])
    assert rep["settings"]["extend_target"] is True
    long = rep["target"]["long"]
    assert long["timing"]["steps_run"] == long["hparams"]["steps"] > 0
    assert set(rep["target"]["retrieval"]) == {"loaded", "extended_untrained", "after_target_long"}
    assert load_target(new / "target", dtype="float32").config.rope_scaling.factor == 2.0
    # the parameters moved (the phase trained), the export check passed at the extended config
    assert rep["export"]["check"]["target_greedy_agree"] == 1.0
    with pytest.raises(SystemExit):
        train_tiny.main(["--smoke", "--out", str(tmp_path / "o"), "--extend-target"])
