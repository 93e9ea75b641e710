"""experiments/calibrate_level_bonus.py: the DDTree level bonus of a drafter picked on training-split text, written
into a copy of the shipped drafter's config.json, which the loaders then carry."""

from __future__ import annotations

import json
import os
import shutil

from conftest import load_experiment

from dflash_jax import SHIPPED_MODELS
from dflash_jax.models.dflash_loader import load_drafter


def test_calibration_picks_the_best_training_tau_and_writes_the_drafters_config(tmp_path):
    mod = load_experiment("calibrate_level_bonus")
    train, _ = load_experiment("corpus").split_stdlib()
    files = mod.training_files(5, 0)
    assert len(files) == 5 and all(os.path.relpath(f, load_experiment("corpus").stdlib_dir()) in train for f in files)
    drafter = tmp_path / "drafter"
    shutil.copytree(os.path.join(SHIPPED_MODELS, "drafter"), drafter)
    out = tmp_path / "results"
    assert mod.main(["--model", os.path.join(SHIPPED_MODELS, "target"), "--drafter", str(drafter), "--chunks", "1",
                     "--files", "4", "--rows", "4", "--anchors", "2", "--grid", "0", "0.3", "2",
                     "--write-config", "--out-dir", str(out)]) == 0
    (res,) = out.glob("calibrate_level_bonus_*.json")
    figs = json.loads(res.read_text())["figures"]
    taus = {v: figs[f"tau.bonus_{v}"] for v in ("0", "0.3", "2")}
    assert figs["blocks"] == 8 and figs["tau.no_bonus"] == taus["0"] and all(t >= 1 for t in taus.values())
    assert figs["tau.best"] == max(taus.values()) and f"{figs['level_bonus.best']:g}" in taus
    dcfg, _ = load_drafter(str(drafter))
    assert dcfg.ddtree_level_bonus == figs["level_bonus.best"]
