"""Hugging Face ``tokenizers`` wrapper: encode/decode, the checkpoint's special-token ids and the chat template."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

from dflash_jax.models import chat as _chat

# Candidate strings of the DFlash mask token (the drafter's ``mask_token_id``); the toy tokenizer uses ``<|mask|>``.
_MASK_CANDIDATES = ("<|mask|>", "<|MASK|>", "<mask>", "[MASK]")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as fh:
            obj = json.load(fh)
    except (OSError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _token_name(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    """A ``tokenizer.json`` tokenizer (byte-level BPE for Qwen) with its added special tokens.

    Special-token ids (None when the vocabulary lacks the token): ``im_start_id``, ``im_end_id``, ``endoftext_id``,
    ``think_start_id``, ``think_end_id``, ``tool_call_id``, ``tool_call_end_id``, ``tool_response_id``,
    ``tool_response_end_id``, ``mask_token_id``.
    """

    def __init__(self, tok: _HFTokenizer, eos_token_ids: tuple[int, ...] = (), mask_token: str | None = None) -> None:
        self._tok = tok
        self.eos_token_ids = tuple(eos_token_ids)
        self.special_ids: set[int] = {i for i, t in tok.get_added_tokens_decoder().items() if t.special} if hasattr(
            tok, "get_added_tokens_decoder") else set()
        tid = tok.token_to_id
        self.im_start_id: int | None = tid(_chat.IM_START)
        self.im_end_id: int | None = tid(_chat.IM_END)
        self.endoftext_id: int | None = tid(_chat.ENDOFTEXT)
        self.think_start_id: int | None = tid(_chat.THINK_START)
        self.think_end_id: int | None = tid(_chat.THINK_END)
        self.tool_call_id: int | None = tid(_chat.TOOL_CALL_START)
        self.tool_call_end_id: int | None = tid(_chat.TOOL_CALL_END)
        self.tool_response_id: int | None = tid(_chat.TOOL_RESPONSE_START)
        self.tool_response_end_id: int | None = tid(_chat.TOOL_RESPONSE_END)
        self.mask_token_id: int | None = None
        for cand in ((mask_token,) if mask_token else ()) + _MASK_CANDIDATES:
            if tid(cand) is not None:
                self.mask_token_id = tid(cand)
                break
        # Ids the chat template writes, plus every special added token (vision placeholders, mask, ...).
        self.structural_ids: frozenset[int] = frozenset(
            {i for i in (tid(t) for t in _chat.STRUCTURAL_TOKENS) if i is not None} | self.special_ids)
        self._newline_ids: dict[int, bool] = {}

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer | None":
        """The tokenizer of a checkpoint directory, or None if it ships none.

        EOS ids: ``eos_token`` of ``tokenizer_config.json`` first, then the ``eos_token_id`` (int or list) of
        ``generation_config.json``, de-duplicated in that order.
        """
        f = os.path.join(path, "tokenizer.json")
        if not os.path.exists(f):
            return None
        tok = _HFTokenizer.from_file(f)
        eos: list[int] = []
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        name = _token_name(cfg.get("eos_token"))
        if name is not None and tok.token_to_id(name) is not None:
            eos.append(tok.token_to_id(name))
        gen = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
        for i in (gen if isinstance(gen, list) else [gen]):
            if isinstance(i, int) and not isinstance(i, bool) and i >= 0 and i not in eos:
                eos.append(i)
        return cls(tok, tuple(eos), mask_token=_token_name(cfg.get("mask_token")))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; added (special) tokens written in it are recognised as single ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------------------------------------------------
    # chat
    # ----------------------------------------------------------------------------------------------------------------

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **kw: Any) -> str:
        """``chat.render_chat`` (Qwen3.6 ChatML template) as text."""
        return _chat.render_chat(messages, **kw)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **kw: Any) -> list[int]:
        """Render ``messages`` with the Qwen3.6 chat template and encode it (template tokens become single ids).

        Keyword arguments are those of ``chat.render_chat``: ``add_generation_prompt=True``, ``enable_thinking=True``,
        ``tools=None``, ``preserve_thinking=False``, ``assistant_prefix=""``, ``continue_final_message=False``.
        """
        missing = [t for t in (_chat.IM_START, _chat.IM_END) if self._tok.token_to_id(t) is None]
        if missing:
            raise ValueError(f"this tokenizer has no chat tokens {missing}: it cannot apply the ChatML template")
        return self.encode(_chat.render_chat(messages, **kw))

    def _has_newline(self, i: int) -> bool:
        v = self._newline_ids.get(i)
        if v is None:
            v = "\n" in self._tok.decode([i], skip_special_tokens=False)
            self._newline_ids[i] = v
        return v

    def structural_mask(self, ids: Sequence[int] | np.ndarray, *, role_headers: bool = True) -> np.ndarray:
        """Boolean mask over ``ids`` marking chat-template structure, which prompt compression must never drop.

        Marks every chat-template token (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ``<think>``,
        ``</think>``, ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``) and every other
        special added token; with ``role_headers`` also the role header after each ``<|im_start|>`` (the tokens up to
        and including the first one holding a newline, at most 8) and the ``\\n`` token right after ``<|im_end|>``.
        """
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not self.structural_ids:
            return np.zeros(arr.shape, dtype=bool)
        mask = np.isin(arr, np.fromiter(self.structural_ids, dtype=np.int64))
        if role_headers and self.im_start_id is not None:
            n = arr.shape[0]
            for p in np.flatnonzero(arr == self.im_start_id):
                for q in range(p + 1, min(p + 9, n)):
                    if mask[q] and arr[q] in self.structural_ids:
                        break  # another template token: the header ended (or was empty)
                    mask[q] = True
                    if self._has_newline(int(arr[q])):
                        break
        if role_headers and self.im_end_id is not None:
            nl = self._tok.token_to_id("\u010a")  # byte-level "\n" right after <|im_end|>
            if nl is not None and self._tok.decode([nl]) == "\n":
                after = np.flatnonzero(arr[:-1] == self.im_end_id) + 1
                mask[after[arr[after] == nl]] = True
        return mask
