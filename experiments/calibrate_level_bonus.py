"""Calibrate a drafter's DDTree level bonus on training text (never the held-out files).

    python experiments/calibrate_level_bonus.py --model dflash_jax/assets/tiny/target \
        --drafter dflash_jax/assets/tiny/drafter [--files 60] [--chunks 3] [--write-config]

A block drafter's marginals at depth d ignore the drafted prefix, yet its hits come in runs, so a path's product of
marginals undervalues deep nodes; ``spec.ddtree``'s level bonus adds c nats per level. This picks c the way
``bench acceptance`` measures trees: teacher-forced blocks (the target's greedy continuation from random anchors
of rows of ``--files`` randomly drawn **training-split** standard-library files, the split rule of the model set's
corpus: ``experiments/corpus.split_stdlib``), the DDTree of ``--budget`` nodes built at each bonus of ``--grid``,
the mean accepted length (bonus token included) per bonus; the best (the smallest on ties) is
``level_bonus.best``. ``--write-config`` stores it as ``dflash_config.ddtree_level_bonus`` in the drafter's
config.json, where the engine, the server and the benchmarks read it as the default. A continued or retrained
drafter needs its own calibration (``train_tiny.py --init-drafter`` does not carry the value over).

Figures: ``tau.bonus_<c>`` per grid value, ``level_bonus.best``, ``tau.best``, ``tau.no_bonus``, ``blocks``;
written as ``calibrate_level_bonus_<device>_<time>.json`` under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import corpus  # noqa: E402
from dflash_jax import load_target  # noqa: E402
from dflash_jax.bench import acceptance, results  # noqa: E402
from dflash_jax.engine.loop import Engine, EngineOptions  # noqa: E402
from dflash_jax.models.dflash_loader import load_drafter  # noqa: E402
from dflash_jax.models.tokenizer import Tokenizer  # noqa: E402

GRID = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6)


def training_files(n: int, seed: int) -> list[str]:
    """``n`` training-split stdlib files (absolute paths), drawn without replacement with ``seed``."""
    train, _ = corpus.split_stdlib()
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(train), size=min(n, len(train)), replace=False)
    return [os.path.join(corpus.stdlib_dir(), train[i]) for i in sorted(pick)]


def blocks(eng: Engine, target, tok, dcfg, dparams, files, rows: int, anchors: int, seed: int):
    """(log-probs [R * A, blk, V], labels [R * A, blk]) of teacher-forced blocks over ``rows`` rows of ``files``;
    ``eng`` (an AR engine of ``target``, max_model_len >= 512 + the block) decodes the labels."""
    rr = acceptance.held_out_rows(tok, files, rows, 512)
    an = acceptance.anchor_positions(rr.shape[1], dcfg.block_size, anchors, seed, len(rr))
    labels = acceptance.greedy_labels(eng, rr, an, dcfg.block_size)
    lp = acceptance.draft_logprobs(target, dcfg, dparams, rr, an)
    return lp.reshape((-1,) + lp.shape[-2:]), labels.reshape(-1, labels.shape[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the target checkpoint (with its tokenizer)")
    ap.add_argument("--drafter", required=True, help="the DFlash drafter checkpoint to calibrate")
    ap.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    ap.add_argument("--files", type=int, default=60, help="training-split stdlib files per chunk")
    ap.add_argument("--chunks", type=int, default=3, help="independent draws of files / rows / anchors")
    ap.add_argument("--rows", type=int, default=64, help="rows of 512 tokens per chunk")
    ap.add_argument("--anchors", type=int, default=6, help="anchor positions per row")
    ap.add_argument("--budget", type=int, default=22)
    ap.add_argument("--grid", type=float, nargs="+", default=list(GRID))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--write-config", action="store_true",
                    help="store the best bonus as dflash_config.ddtree_level_bonus in --drafter's config.json")
    ap.add_argument("--out-dir", default="experiments/results")
    ap.add_argument("--no-write", action="store_true", help="no results JSON")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    tok = Tokenizer.from_dir(args.model)
    target = load_target(args.model, dtype=args.dtype)
    dcfg, dparams = load_drafter(args.drafter, dtype=target.params["embed"].dtype)
    if args.chunks < 1 or args.files < 1 or args.rows < 1 or args.anchors < 1:
        raise SystemExit("--chunks, --files, --rows and --anchors must each be >= 1")
    held_out = set(acceptance.held_out_names(args.model)[1])  # relative to the stdlib root, as training_files
    eng = Engine(target, tok, EngineOptions(max_batch=16, max_model_len=576, prefill_chunk=128))
    lps, labs, used = [], [], []
    for c in range(args.chunks):
        files = training_files(args.files, args.seed + c)
        leak = held_out & {os.path.relpath(f, corpus.stdlib_dir()) for f in files}
        if leak:  # the split rule is the corpus's: never true unless the report and the rule disagree
            raise SystemExit(f"training-split files are held out in the model set's report: {sorted(leak)}")
        lp, lab = blocks(eng, target, tok, dcfg, dparams, files, args.rows, args.anchors, args.seed + c)
        lps.append(lp)
        labs.append(lab)
        used += [os.path.relpath(f, corpus.stdlib_dir()) for f in files]
        print(f"chunk {c}: {len(lab)} blocks ({time.perf_counter() - t0:.0f} s)", flush=True)
    lp, lab = np.concatenate(lps), np.concatenate(labs)
    taus = {v: float(acceptance.tree_tau(lp, lab, args.budget, level_bonus=v).mean()) for v in args.grid}
    best = max(taus, key=lambda v: (round(taus[v], 9), -v))
    figures = {f"tau.bonus_{v:g}": t for v, t in taus.items()}
    figures.update({"level_bonus.best": best, "tau.best": taus[best], "blocks": int(len(lab)),
                    "tau.no_bonus": float(acceptance.tree_tau(lp, lab, args.budget).mean())})
    for v, t in taus.items():
        print(f"  bonus {v:5.2f}: tau {t:.4f}{'  <- best' if v == best else ''}")
    if args.write_config:
        path = os.path.join(args.drafter, "config.json")
        with open(path) as fh:
            raw = json.load(fh)
        raw.setdefault("dflash_config", {})["ddtree_level_bonus"] = best
        with open(path, "w") as fh:
            json.dump(raw, fh, indent=2)
            fh.write("\n")
        print(f"wrote dflash_config.ddtree_level_bonus = {best:g} to {path}")
    if not args.no_write:
        extra = {"model": args.model, "drafter": args.drafter, "dtype": args.dtype, "budget": args.budget,
                 "rows_per_chunk": args.rows, "anchors_per_row": args.anchors, "chunks": args.chunks,
                 "files": sorted(set(used)), "seconds": round(time.perf_counter() - t0, 1)}
        command = "python experiments/calibrate_level_bonus.py " + " ".join(sys.argv[1:] if argv is None else argv)
        print("wrote", results.write_result("calibrate_level_bonus", figures, command, extra, out_dir=args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
