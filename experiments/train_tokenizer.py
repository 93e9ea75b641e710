"""Train the toy byte-level BPE tokenizer (reference §6.2/§6.4) on the corpus train split.

Qwen3.5-style pipeline: NFC normaliser; pre-tokenizer = Qwen's split regex (letter(+mark) runs with one leading
non-letter, **single digits**, punctuation runs with trailing newlines, newline runs, whitespace) followed by
byte-level mapping; byte-level decoder; no unknown token (all 256 bytes are in the alphabet). Added tokens, at
ids 0..9 in this order: ``<|endoftext|> <|im_start|> <|im_end|> <think> </think> <tool_call> </tool_call>
<tool_response> </tool_response> <|mask|>`` (as in Qwen, the think/tool tokens are added but not "special", so
``decode(skip_special_tokens=True)`` keeps them).

Writes ``tokenizer.json``, ``tokenizer_config.json`` (``eos_token`` ``<|im_end|>``, ``pad_token`` ``<|endoftext|>``,
``mask_token`` ``<|mask|>``) and ``generation_config.json`` (eos ids of ``<|im_end|>`` and ``<|endoftext|>``).

    python experiments/train_tokenizer.py --out /tmp/tok                    # corpus built in memory
    python experiments/train_tokenizer.py --out /tmp/tok --corpus /tmp/corpus  # from corpus.py's train.txt
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                  "</tool_call>", "<tool_response>", "</tool_response>", "<|mask|>")
#: Added tokens that are not flagged special (kept by ``decode(skip_special_tokens=True)``), as in Qwen's vocab.
NON_SPECIAL = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"})
#: Qwen3.5's pre-tokenizer regex (tokenization_qwen3_5.py): letters with combining marks, single digits.
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def _pieces(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """Training texts with the special-token strings cut out (no merges may span them), capped at ``max_bytes``."""
    total = 0
    for t in texts:
        for p in _SPECIAL_RE.split(t):
            if p:
                total += len(p.encode("utf-8"))
                yield p
        if max_bytes is not None and total >= max_bytes:
            return


def train_bpe(texts: Iterable[str], out_dir: str, *, vocab_size: int = 8192, min_frequency: int = 2,
              max_bytes: int | None = None) -> Tokenizer:
    """Train on ``texts`` (at most ``max_bytes`` UTF-8 bytes of them) and write the tokenizer files to ``out_dir``."""
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_pieces(texts, max_bytes), trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    # Flip the think/tool tokens to non-special (Qwen convention) in the serialised added_tokens, then reload.
    spec = json.loads(tok.to_str())
    for t in spec.get("added_tokens", []):
        if t["content"] in NON_SPECIAL:
            t["special"] = False
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(spec, fh, ensure_ascii=False)
    tok = Tokenizer.from_file(path)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "mask_token": "<|mask|>",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": {str(i): {"content": t, "special": t not in NON_SPECIAL, "normalized": False,
                                          "lstrip": False, "rstrip": False, "single_word": False}
                                 for t, i in ids.items()},
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]},
                  fh, indent=1)
    return tok


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--corpus", default=None, help="a corpus.py output dir (train.txt); default: build in memory")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--max-mb", type=float, default=16.0, help="cap on the training text (MB) to keep it fast")
    ap.add_argument("--n-chat", type=int, default=2000, help="chat samples when building in memory")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from experiments import corpus

    t0 = time.time()
    max_bytes = int(args.max_mb * 1e6)
    if args.corpus:
        texts: Iterable[str] = corpus.read_train_docs(os.path.join(args.corpus, "train.txt"))
    else:
        # chat samples first (small), then stdlib files up to the cap
        import itertools
        import random
        files = corpus.load_stdlib("train")
        rng = random.Random(args.seed)
        fns = corpus.collect_functions(files[:: max(1, len(files) // 300)])
        chats = (corpus.chat_example(rng, fns)[0] for _ in range(args.n_chat))
        texts = itertools.chain(chats, (corpus.stdlib_document(r, t) for r, t in files))
    t1 = time.time()
    tok = train_bpe(texts, args.out, vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                    max_bytes=max_bytes)
    t2 = time.time()
    sample = corpus.load_stdlib("eval")[:50]
    n_chars = sum(len(t) for _, t in sample)
    n_tok = sum(len(tok.encode(t).ids) for _, t in sample)
    stats = {"vocab_size": tok.get_vocab_size(), "train_seconds": round(t2 - t1, 1),
             "total_seconds": round(time.time() - t0, 1), "max_bytes": max_bytes,
             "eval_chars_per_token": round(n_chars / max(1, n_tok), 3),
             "special_ids": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}}
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    main()
