"""Measure a target's KV calibration (``kv.calibration``) and write it beside the checkpoint.

    python -m dflash_jax.kv.calibrate --model PATH [--files F ...] [--rows 16] [--row-len 512] [--out FILE]

Rows of ``--row-len`` tokens are cut from ``--files`` (default: the standard-library training split of a shipped
model set, the text the tiny set was trained on) and run through the target once each; ``--out`` defaults to
``<model>/kv_calibration.safetensors``, where engines built with quantized pages find it (``kv_calibration="auto"``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
from typing import Sequence

from dflash_jax.kv.calibration import DAMP, FILE_NAME, measure


def training_files(model_dir: str, limit: int = 200) -> list[str]:
    """This interpreter's standard-library ``.py`` files on the training side of a shipped model set's split (not
    held out in its ``train_report.json``, nor in the held-out hash class): the text the tiny set was trained on."""
    from dflash_jax.bench.acceptance import held_out_names

    _, held = held_out_names(model_dir)
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py"))
    held = set(held)
    keep = [f for f in files if os.path.relpath(f, root) not in held
            and int(hashlib.sha1(os.path.relpath(f, root).encode()).hexdigest(), 16) % 20 != 0]
    return keep[:limit]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Measure a target's KV calibration (keys rounded where the queries do "
                                            "not look, for --kv-dtype fp8 / int8) and write it beside the model.")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--files", nargs="*", default=None,
                   help="text files to calibrate on (default: the standard-library training split of a shipped "
                        "model set's train_report.json)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--row-len", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--damp", type=float, default=DAMP)
    p.add_argument("--out", default=None, help=f"default: <model>/{FILE_NAME}")
    a = p.parse_args(argv)

    from dflash_jax.bench.acceptance import held_out_rows
    from dflash_jax.models.tokenizer import Tokenizer
    from dflash_jax.target import load_target

    tok = Tokenizer.from_dir(a.model)
    if not a.files and not os.path.exists(os.path.join(os.path.dirname(os.path.abspath(a.model)),
                                                       "train_report.json")):
        p.error(f"{a.model} is not a shipped model set (no train_report.json beside it): name the text to "
                "calibrate on with --files")
    files = a.files if a.files else training_files(a.model)
    rows = held_out_rows(tok, files, a.rows, a.row_len)
    target = load_target(a.model, dtype=a.dtype)
    calib = measure(target.params, target.config, rows, a.damp)
    out = calib.save(a.out or os.path.join(a.model, FILE_NAME))
    print(json.dumps({"wrote": out, **calib.meta}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
