"""Structured output: a request's text held to a regular expression (JSON schema, any JSON object, a regex, one
of a list of choices), token by token.

The constraint is a finite automaton over the tokenizer's vocabulary (``outlines_core``: an ``Index`` built once
per regex and vocabulary, a ``Guide`` walking it per request). Before each of a constrained request's steps the
engine writes the tokens its automaton allows as a bitmask into the request's row of ``SlotPenalties.allow``
(``[V / 32]`` uint32 words); ``sampling.penalize`` sends every other token's logit to -inf, and the sampled token
advances the automaton. Where the automaton may end, the end-of-sequence tokens are allowed; where it must end,
only they are. In a speculative round (``EngineOptions.structured_spec``) the host walks the automaton along the
drafted tree between the draft and the verify step (``Matcher.tree_masks``): every node gets the mask of the state
its path leads to, so the target accepts only tokens the automaton allows; otherwise constrained requests decode
AR.

Token texts come from the tokenizer's byte-level alphabet (Qwen's byte-level BPE): each token's exact bytes, so a
multi-byte character split across tokens is matched byte by byte. Special tokens are never allowed as text.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import re
import threading
from typing import Any

import numpy as np

MAX_REGEX_CHARS = 200_000
INDEX_CACHE = 32  # compiled automata kept per engine (least recently used dropped)


class StructuredError(ValueError):
    """A constraint this engine cannot build (bad schema or regex, no tokenizer, outlines_core missing)."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a request's output must match: ``kind`` "json_schema" (``spec`` the schema as JSON text),
    "json_object" (any JSON object), "regex" (``spec`` the pattern) or "choice" (``spec`` a JSON list of
    strings)."""

    kind: str
    spec: str = ""

    def regex(self) -> str:
        from outlines_core import json_schema

        if self.kind == "json_object":
            return json_schema.build_regex_from_schema(json.dumps({"type": "object"}))
        if self.kind == "json_schema":
            try:
                return json_schema.build_regex_from_schema(self.spec)
            except Exception as e:  # noqa: BLE001 - outlines raises its own types for unsupported schemas
                raise StructuredError(f"cannot constrain output to this JSON schema: {e}") from None
        if self.kind == "regex":
            return self.spec
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise StructuredError("guided_choice needs a non-empty list of non-empty strings")
            return "(" + "|".join(re.escape(c) for c in choices) + ")"
        raise StructuredError(f"unknown constraint kind {self.kind!r}")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer) -> dict[int, bytes]:
    """Token id -> the bytes it stands for, for every non-special token of a byte-level BPE ``Tokenizer``."""
    hf = tokenizer._tok
    dec = getattr(hf, "decoder", None)
    if type(dec).__name__ != "ByteLevel":
        raise StructuredError("structured output needs a byte-level BPE tokenizer (as Qwen's); this tokenizer's "
                              f"decoder is {type(dec).__name__}")
    table = _byte_decoder()
    out: dict[int, bytes] = {}
    for tok, i in hf.get_vocab(with_added_tokens=False).items():
        if i in tokenizer.special_ids:
            continue
        try:
            out[i] = bytes(table[c] for c in tok)
        except KeyError:  # not in the byte alphabet: a token the byte-level decoder would not produce
            continue
    return out


class Structured:
    """An engine's compiled automata (per regex) over one tokenizer and vocabulary size ``n_vocab`` (the model's:
    ids past the tokenizer's are never allowed). Thread-safe: the server builds automata off the engine thread."""

    def __init__(self, tokenizer, n_vocab: int, eos_token_ids: tuple[int, ...]) -> None:
        if importlib.util.find_spec("outlines_core") is None:
            raise StructuredError("structured output needs the outlines-core package: pip install outlines-core "
                                  "(or the serve extra)")
        if not eos_token_ids:
            raise StructuredError("structured output needs an end-of-sequence token id to end the text")
        self.tokenizer, self.n_vocab, self.eos = tokenizer, n_vocab, tuple(eos_token_ids)
        self.words = -(-n_vocab // 32)
        self._vocab = None
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _vocabulary(self):
        from outlines_core import Vocabulary

        if self._vocab is None:
            by_bytes: dict[bytes, list[int]] = collections.defaultdict(list)
            for i, b in token_bytes(self.tokenizer).items():
                if i < self.n_vocab and b:
                    by_bytes[b].append(i)
            self._vocab = Vocabulary(self.eos[0], dict(by_bytes))
        return self._vocab

    def index(self, c: Constraint):
        """The compiled automaton of ``c`` (built on first use, then cached)."""
        from outlines_core import Index

        pattern = c.regex()
        if len(pattern) > MAX_REGEX_CHARS:
            raise StructuredError(f"the constraint's regular expression has {len(pattern)} characters (at most "
                                  f"{MAX_REGEX_CHARS}): simplify the schema")
        with self._lock:
            hit = self._cache.get(pattern)
            if hit is not None:
                self._cache.move_to_end(pattern)
                return hit
        try:
            idx = Index(pattern, self._vocabulary())
        except Exception as e:  # noqa: BLE001 - outlines raises its own types for bad / unsupported patterns
            raise StructuredError(f"cannot build the output automaton: {e}") from None
        with self._lock:
            self._cache[pattern] = idx
            while len(self._cache) > INDEX_CACHE:
                self._cache.popitem(last=False)
        return idx

    def start(self, c: Constraint) -> "Matcher":
        from outlines_core import Guide

        index = self.index(c)
        return Matcher(Guide(index), index, self)

    def words_of(self, allowed) -> np.ndarray:
        """Allowed token ids -> the ``[words]`` uint32 bitmask (bit i % 32 of word i // 32)."""
        words = np.zeros(self.words, np.uint32)
        ids = np.asarray(allowed, np.int64)
        ids = ids[ids < self.n_vocab]
        np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
        return words

    def with_eos(self, words: np.ndarray) -> np.ndarray:
        """Every EOS id allowed where the first one is (the automaton may end there)."""
        e = self.eos[0]
        if (words[e // 32] >> np.uint32(e % 32)) & 1:
            for t in self.eos:
                words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
        return words


TREE_MASK_CACHE = 256  # a matcher's automaton states whose masks it keeps for tree walks


class Matcher:
    """One request's position in its automaton."""

    def __init__(self, guide, index, owner: Structured) -> None:
        self.guide, self.index, self.owner = guide, index, owner
        self._state_masks: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def mask(self) -> np.ndarray:
        """``[words]`` uint32 bitmask of the tokens allowed next (bit i % 32 of word i // 32); every EOS id where the
        automaton may end."""
        o = self.owner
        words = np.zeros(o.words, np.uint32)
        try:  # the automaton writes its bitmask itself (a large vocabulary: no id list)
            self.guide.write_mask_into(words.ctypes.data, words.size, 4)
        except Exception:  # noqa: BLE001 - a mask size it does not take: from the allowed ids
            words = o.words_of(self.guide.get_tokens())
        return o.with_eos(words)

    def _state_mask(self, state: int) -> np.ndarray:
        hit = self._state_masks.get(state)
        if hit is None:
            allowed = self.index.get_allowed_tokens(state) or []
            hit = self._state_masks[state] = self.owner.with_eos(self.owner.words_of(allowed))
            while len(self._state_masks) > TREE_MASK_CACHE:
                self._state_masks.popitem(last=False)
        else:
            self._state_masks.move_to_end(state)
        return hit

    def tree_masks(self, tokens: np.ndarray, parents: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """The allowed next tokens at every node of a drafted tree: ``tokens, parents, valid [N]`` (node 0 the root,
        this matcher's current position; parents before children) -> ``[N, words]`` uint32. A node whose token
        the automaton refuses at its parent (or an EOS, which ends the text) can never be accepted: its mask and its
        subtree's are all ones, so no row of the verify pass is empty."""
        n = len(tokens)
        out = np.full((n, self.owner.words), 0xFFFFFFFF, np.uint32)
        states: list[int | None] = [None] * n
        states[0] = self.guide.get_state()
        out[0] = self.mask()
        eos = self.owner.eos
        for i in range(1, n):
            p = int(parents[i])
            if not valid[i] or p < 0 or states[p] is None or int(tokens[i]) in eos:
                continue
            nxt = self.index.get_next_state(states[p], int(tokens[i]))
            if nxt is not None:
                states[i] = nxt
                out[i] = self._state_mask(nxt)
        return out

    def advance(self, token: int) -> None:
        if token in self.owner.eos:
            return
        self.guide.advance(int(token))
