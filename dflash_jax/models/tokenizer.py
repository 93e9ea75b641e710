"""Hugging Face ``tokenizers`` wrapper: encode/decode and the checkpoint's special-token ids."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """A ``tokenizer.json`` tokenizer (byte-level BPE for Qwen) with its added special tokens."""

    def __init__(self, tok: _HFTokenizer, eos_token_ids: tuple[int, ...] = ()) -> None:
        self._tok = tok
        self.eos_token_ids = eos_token_ids
        self.special_ids = {t.id for t in tok.get_added_tokens_decoder().values() if t.special} if hasattr(
            tok, "get_added_tokens_decoder") else set()

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer | None":
        """The tokenizer of a checkpoint directory, or None if it ships none."""
        f = os.path.join(path, "tokenizer.json")
        if not os.path.exists(f):
            return None
        tok = _HFTokenizer.from_file(f)
        eos: list[int] = []
        cfg = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg):
            with open(cfg) as fh:
                name = json.load(fh).get("eos_token")
            if isinstance(name, dict):
                name = name.get("content")
            if isinstance(name, str) and tok.token_to_id(name) is not None:
                eos.append(tok.token_to_id(name))
        return cls(tok, tuple(eos))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
