"""Benchmark result files: one JSON per run under ``experiments/results``.

Every file records where the numbers came from (device, commit, library versions, the command line)
next to ``figures``, a flat dict of dotted names (``"b1.ceiling_tok_s"``) to numbers.
"""

from __future__ import annotations

import datetime
import json
import math
import numbers
import os
import platform
import re
import subprocess
from typing import Any

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def device_slug(kind: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``, ``"cpu"`` -> ``"cpu"``."""
    s = re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")
    return s or "unknown"


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "--no-optional-locks", "-C", _REPO, *args], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def git_state() -> tuple[str, bool]:
    """(HEAD commit or ``"unknown"``, whether tracked or untracked files differ from it).

    ``DFLASH_COMMIT`` (and ``DFLASH_DIRTY=1``), when set, override git: a copied working tree may carry a stale
    ``.git``. Outside a git checkout and without them this is ``("unknown", False)``.
    """
    if os.environ.get("DFLASH_COMMIT"):  # a copied tree (e.g. on a benchmark machine): the launcher says what it is
        return os.environ["DFLASH_COMMIT"], os.environ.get("DFLASH_DIRTY", "0") == "1"
    head = _git("rev-parse", "HEAD")
    if head is None:
        return "unknown", False
    status = _git("status", "--porcelain")
    return head.strip(), bool(status and status.strip())


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "numpy", "flax"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def validate_figures(figures: dict[str, Any]) -> dict[str, float | int | None]:
    """Keys must be strings; values finite numbers (bools refused) or None. Raises ValueError."""
    if not isinstance(figures, dict):
        raise ValueError(f"figures must be a dict, got {type(figures).__name__}")
    out: dict[str, float | int | None] = {}
    for k, v in figures.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"figure name {k!r} must be a non-empty string")
        if v is None:
            out[k] = None
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"figure {k!r} = {v!r} is not a number")
        if not math.isfinite(float(v)):
            raise ValueError(f"figure {k!r} = {v!r} is not finite")
        out[k] = int(v) if isinstance(v, numbers.Integral) else float(v)
    return out


def write_result(bench: str, figures: dict[str, float], command: str, extra: dict | None = None,
                 out_dir: str = "experiments/results", out_path: str | None = None) -> str:
    """Write ``<out_dir>/<bench>_<device>_<yyyymmdd-hhmm>.json`` and return its path.

    A file of the same name (same bench, device and minute) is never overwritten: ``-2``, ``-3``...
    is appended instead. ``out_path`` names the file exactly instead (replaced if it exists). The record
    carries ``DFLASH_KERNELS`` as ``kernel_overrides``, ``XLA_FLAGS`` as ``xla_flags`` and
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` as ``memory_fraction`` (None when unset).
    """
    import jax

    figs = validate_figures(figures)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", bench):
        raise ValueError(f"bench name {bench!r} must be a plain file-name fragment")
    kind = jax.devices()[0].device_kind
    dev = device_slug(kind)
    now = datetime.datetime.now(datetime.timezone.utc)
    commit, dirty = git_state()
    rec = {
        "bench": bench,
        "device": dev,
        "device_kind": kind,
        "command": command,
        "commit": commit,
        "dirty": dirty,
        "versions": _versions(),
        "kernel_overrides": os.environ.get("DFLASH_KERNELS") or None,  # not in `command`: set in the environment
        "xla_flags": os.environ.get("XLA_FLAGS") or None,
        "memory_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or None,
        "date": now.isoformat(timespec="seconds"),
        "figures": figs,
        "extra": extra or {},
    }
    if out_path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(rec, f, indent=2, sort_keys=False)
            f.write("\n")
        return out_path
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{bench}_{dev}_{now:%Y%m%d-%H%M}")
    path, n = stem + ".json", 1
    while os.path.exists(path):
        n += 1
        path = f"{stem}-{n}.json"
    with open(path, "x") as f:
        json.dump(rec, f, indent=2, sort_keys=False)
        f.write("\n")
    return path


def script_command(script: str, argv: list[str] | None = None) -> str:
    """The command line of a script run for a result's ``command``: ``python experiments/x.py --a 1``.

    ``script`` is the script's ``__file__`` (shown relative to the repository); ``argv`` its arguments (None:
    ``sys.argv[1:]``, as ``argparse`` reads them)."""
    import shlex
    import sys

    path = os.path.abspath(script)
    rel = os.path.relpath(path, _REPO) if path.startswith(_REPO + os.sep) else path
    return shlex.join(["python", rel, *(sys.argv[1:] if argv is None else list(argv))])


def settings(args: Any) -> dict[str, Any]:
    """A script's parsed arguments for a result's ``extra``, less where its output goes."""
    return {k: v for k, v in vars(args).items() if k not in ("out_dir", "no_write")}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool) or isinstance(v, numbers.Integral):
        return str(v)
    if isinstance(v, numbers.Real):
        a = abs(float(v))
        if a != 0 and (a >= 1e6 or a < 1e-3):
            return f"{float(v):.4g}"
        return f"{float(v):.4f}".rstrip("0").rstrip(".") if a < 10 else f"{float(v):.2f}"
    return str(v)


def print_table(figures: dict[str, Any], file=None) -> None:
    """Print ``name  value`` rows, names left-aligned and values right-aligned."""
    if not figures:
        return
    rows = [(str(k), _fmt(v)) for k, v in figures.items()]
    wk = max(len(k) for k, _ in rows)
    wv = max(len(v) for _, v in rows)
    for k, v in rows:
        print(f"{k:<{wk}}  {v:>{wv}}", file=file)
