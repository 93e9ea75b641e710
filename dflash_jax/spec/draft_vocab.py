"""A reduced drafting vocabulary: the drafter's LM head over a fixed set of frequent tokens (FR-Spec).

The DFlash drafter shares the target's LM head. At the 27B's 248K vocabulary that head is 2.5 GB of bf16, about
40 % of what one drafting pass reads: at batch 1 (weight-streaming) it costs ~0.5 ms of a ~20 ms speculative
round on an H200. Drafting only over the ``Vh`` most frequent tokens reads ``Vh / V`` of it. The drafter's
distribution is renormalised over the set (the tree's scores are log-softmax over ``Vh``) and tokens outside the
set are never drafted; verification still runs the target's full head, so acceptance stays lossless and only the
number of accepted tokens can change.

A set is given as (``SpecConfig.draft_vocab``):

* an int ``N``: token ids ``0 .. N-1``. Byte-level BPE vocabularies (Qwen's, the shipped tiny tokenizer) number
  their tokens in merge order, which follows the merges' frequency in the tokenizer's training text, so the
  first ids are a frequency-ranked set without a count; special tokens sit at the end and are not included;
* a path: a ``.json`` list of ids (or ``{"token_ids": [...]}``) or a ``.npy`` array, e.g. from counting a corpus
  with ``python -m dflash_jax.spec.draft_vocab --tokenizer DIR --text FILES --size N --out FILE``;
* a sequence of ids.

The engine adds its EOS ids to every set (a reply ends on them) and keeps the ids sorted and unique. This module
is host-side (no JAX: the server parses its flags with it); the drafting head is ``spec_steps.with_draft_vocab``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from typing import Iterable, Sequence

import numpy as np

DraftVocab = int | str | Sequence[int]


def parse_arg(text: str) -> int | str:
    """A ``--draft-vocab`` value: digits are a size N (ids 0..N-1), anything else a file of ids."""
    return int(text) if text.strip().isdigit() else text


QUANTIZATIONS = ("none", "fp8", "fp8_dynamic", "int8", "int4")  # models.quant.QUANTIZATIONS, without importing JAX


def add_quantization_argument(p: argparse.ArgumentParser, flag: str = "--draft-quantization") -> None:
    """The drafter's own weight format (``SpecConfig.draft_quantization``), next to its drafting vocabulary."""
    p.add_argument(flag, default=None, choices=QUANTIZATIONS[1:],
                   help="the drafter's matmul weights and its drafting head (a quantized copy of the LM head rows it "
                        "drafts over) in this format, whatever the target's (SpecConfig.draft_quantization); "
                        "lossless: only what is drafted changes. Default: as --quantization")


def add_argument(p: argparse.ArgumentParser, flag: str = "--draft-vocab") -> None:
    """The benchmarks' drafting-vocabulary flag (``SpecConfig.draft_vocab``)."""
    p.add_argument(flag, type=parse_arg, default=None, metavar="N|FILE",
                   help="draft over token ids 0..N-1 or those in FILE (SpecConfig.draft_vocab); default: all")


def normalise(src: DraftVocab) -> int | str | tuple[int, ...]:
    """``src`` checked without the vocabulary (a preset or a caller may pass any of the forms): a count >= 1, the
    path of an existing file, or a tuple of ids. Raises ValueError / FileNotFoundError saying what is wrong."""
    if isinstance(src, (str, os.PathLike)):
        src = parse_arg(os.fspath(src))
    if isinstance(src, bool) or (isinstance(src, (int, np.integer)) and src < 1):
        raise ValueError(f"draft_vocab must be a token count >= 1, a file of ids or the ids, got {src!r}")
    if isinstance(src, (int, np.integer)):
        return int(src)
    if isinstance(src, str):
        if not os.path.isfile(src):
            raise FileNotFoundError(f"draft_vocab: {src} does not exist (no such file; a .json list of token ids or "
                                    "a .npy array)")
        return src
    return tuple(int(t) for t in src)


def resolve(src: DraftVocab, vocab_size: int, always: Iterable[int] = ()) -> np.ndarray:
    """The drafting token set of ``src`` (see the module doc) plus ``always`` -> sorted unique int32 ``[Vh]``."""
    src = normalise(src)
    if isinstance(src, int):
        if src > vocab_size:
            raise ValueError(f"draft_vocab={src}: a drafting vocabulary of N tokens needs 1 <= N <= {vocab_size}")
        ids = np.arange(src, dtype=np.int64)
    elif isinstance(src, str):
        ids = _read(src)
    else:
        ids = np.asarray(src, dtype=np.int64)
    ids = np.concatenate([ids.reshape(-1), np.asarray(list(always), dtype=np.int64)])
    if ids.size == 0:
        raise ValueError("draft_vocab: the drafting vocabulary is empty")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"draft_vocab: token ids {bad[:5].tolist()} are outside the vocabulary [0, {vocab_size})")
    return np.unique(ids).astype(np.int32)


def _read(path: str) -> np.ndarray:
    if path.endswith(".npy"):
        return np.load(path).astype(np.int64)
    with open(path) as fh:
        obj = json.load(fh)
    if isinstance(obj, dict):
        obj = obj.get("token_ids")
    if not isinstance(obj, list) or not all(isinstance(t, int) for t in obj):
        raise ValueError(f"draft_vocab: {path} must hold a JSON list of token ids or {{\"token_ids\": [...]}}")
    return np.asarray(obj, dtype=np.int64)


def most_frequent(token_lists: Iterable[Sequence[int]], size: int) -> list[int]:
    """The ``size`` most frequent ids over ``token_lists`` (ties: lower id first), most frequent first."""
    counts: collections.Counter = collections.Counter()
    for toks in token_lists:
        counts.update(int(t) for t in toks)
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]


def main(argv: Sequence[str] | None = None) -> int:
    from dflash_jax.models.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(prog="python -m dflash_jax.spec.draft_vocab",
                                 description="Count a corpus's tokens and write the N most frequent as a drafting "
                                             "vocabulary (--draft-vocab FILE).")
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json (the target checkpoint)")
    ap.add_argument("--text", nargs="+", required=True, help="text files to count")
    ap.add_argument("--size", type=int, required=True, help="tokens to keep")
    ap.add_argument("--out", required=True, help="output .json")
    args = ap.parse_args(argv)
    if args.size < 1:
        ap.error(f"--size {args.size}: a drafting vocabulary needs at least one token")
    tok = Tokenizer.from_dir(args.tokenizer)
    if tok is None:
        raise SystemExit(f"{args.tokenizer}: no tokenizer.json")

    def lists():
        for path in args.text:
            with open(path, encoding="utf-8", errors="replace") as fh:
                yield tok.encode(fh.read())

    ids = most_frequent(lists(), args.size)
    if not ids:
        raise SystemExit(f"{' '.join(args.text)}: no tokens counted; nothing to write")
    with open(args.out, "w") as fh:
        json.dump({"token_ids": ids, "size": len(ids), "files": len(args.text)}, fh)
    print(f"wrote {args.out}: {len(ids)} token ids")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
