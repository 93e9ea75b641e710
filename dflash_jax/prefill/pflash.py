"""Speculative prefill ("PFlash", reference §5): a small scorer model ranks prompt tokens by the attention its last
prompt tokens pay them; only the best 32-token chunks (plus forced head/tail/protected chunks) reach the target.

Pipeline (``compress``):

1. ``scorer(ids, options) -> [T]`` token importance. ``DenseScorer`` runs the prompt through a Qwen3 dense model
   (``models.dense``; the fast pass is ``models.dense_scoring``: one dispatch per layer over the whole prompt, cuDNN
   flash attention on a GPU), takes the queries of the last ``n_query`` prompt tokens at the last ``n_layers``
   layers, and reduces their attention ``[L, H, nq, T]`` by max over (layer, head), mean over queries, then an
   average-pool smoothing of ``pool_kernel`` tokens (``score_tokens`` is the same reduction on a materialised
   tensor).
2. ``select_chunks``: split into ``chunk``-token chunks scored by their mean; always keep the best chunk, the best
   anchor chunk, the head and tail chunks and every chunk holding a ``must_keep`` token (chat structure, tool
   calls/responses, the system turn: see ``protected_mask``), then add the other anchor chunks (``anchor_chunks``:
   the neighbourhoods of earlier occurrences of n-grams of the prompt's last tokens) and chunks by score until
   ``ceil(keep_ratio * T)`` tokens are kept.
3. The kept token ids, in their original order, are the effective prompt the target prefills (contiguously
   re-numbered, as lucebox does; ``kept_indices`` gives the original positions for a SpecPrefill-style variant).

Modes: ``off`` never compresses; ``always`` compresses every prompt of at least ``min_tokens`` tokens; ``auto`` does
the same but skips prompts where the forced chunks alone would keep more than ``auto_max_ratio`` of the prompt (the
scoring pass would not pay for itself). Tool-calling requests are never compressed, in either mode (reference §5: a
dropped chunk of a tool schema or result breaks the call the agent waits for).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models import dense, dense_scoring

MODES = ("off", "auto", "always")


class PFlashError(ValueError):
    """Invalid PFlash options or inputs; the message names the option."""


def _int_opt(name: str, val: Any, lo: int) -> None:
    if isinstance(val, bool) or not isinstance(val, int) or val < lo:
        raise PFlashError(f"pflash option {name!r} must be an int >= {lo}, got {val!r}")


def _ratio_opt(name: str, val: Any) -> None:
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0.0 < val <= 1.0:
        raise PFlashError(f"pflash option {name!r} must be a number in (0, 1], got {val!r}")


@dataclasses.dataclass(frozen=True)
class PFlashOptions:
    """Prompt compression settings (validated on construction).

    mode: "off" | "auto" | "always". keep_ratio: fraction of prompt tokens kept (lucebox server default 0.05;
    guidance 0.02 at 128K, 0.10 at 32K). min_tokens: prompts shorter than this are never compressed. chunk: selection
    granularity in tokens. head_tokens / tail_tokens: the chunks covering the first / last this many tokens are always
    kept (lucebox: 8 and 24 chunks of 32). n_query: tail queries scored. n_layers: the scorer's last layers used
    (None: all). pool_kernel: odd smoothing window (1: none). nope: score with pre-RoPE q/k (lucebox default).
    auto_max_ratio: in auto mode, skip prompts whose forced chunks alone keep more than this fraction.
    anchor_*: anchor neighbourhoods (lucebox): every ``anchor_ngram``-gram of the last ``anchor_window`` tokens that
    also occurs earlier, at most ``anchor_max_hits`` times, marks the chunks within ``anchor_radius`` chunks of each
    earlier occurrence (a question repeats the key it asks about); ``anchor_ngram`` 0 turns them off.
    """

    mode: str = "off"
    keep_ratio: float = 0.05
    min_tokens: int = 32768
    chunk: int = 32
    head_tokens: int = 256
    tail_tokens: int = 768
    n_query: int = 8
    n_layers: int | None = None
    pool_kernel: int = 13
    nope: bool = True
    auto_max_ratio: float = 0.5
    anchor_ngram: int = 4
    anchor_window: int = 96
    anchor_max_hits: int = 8
    anchor_radius: int = 2

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PFlashError(f"pflash option 'mode' must be one of {MODES}, got {self.mode!r}")
        _ratio_opt("keep_ratio", self.keep_ratio)
        _ratio_opt("auto_max_ratio", self.auto_max_ratio)
        _int_opt("min_tokens", self.min_tokens, 0)
        _int_opt("chunk", self.chunk, 1)
        _int_opt("head_tokens", self.head_tokens, 0)
        _int_opt("tail_tokens", self.tail_tokens, 0)
        _int_opt("n_query", self.n_query, 1)
        _int_opt("pool_kernel", self.pool_kernel, 1)
        if self.pool_kernel % 2 == 0:
            raise PFlashError(f"pflash option 'pool_kernel' must be odd (a centred window), got {self.pool_kernel}")
        if self.n_layers is not None:
            _int_opt("n_layers", self.n_layers, 1)
        if not isinstance(self.nope, bool):
            raise PFlashError(f"pflash option 'nope' must be a bool, got {self.nope!r}")
        _int_opt("anchor_ngram", self.anchor_ngram, 0)
        _int_opt("anchor_window", self.anchor_window, 1)
        _int_opt("anchor_max_hits", self.anchor_max_hits, 1)
        _int_opt("anchor_radius", self.anchor_radius, 0)


# ---------------------------------------------------------------------------------------------
# scores
# ---------------------------------------------------------------------------------------------
def _check_kernel(kernel: Any) -> None:
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
        raise PFlashError(f"pflash option 'pool_kernel' must be an odd int >= 1, got {kernel!r}")


def _smooth_valid(x: jax.Array, n: jax.Array, kernel: int) -> jax.Array:
    """``smooth`` of the first ``n`` (traced) entries of x [Tp] float32; entries from ``n`` on are meaningless."""
    if kernel == 1:
        return x
    t, r = x.shape[0], kernel // 2
    c = jnp.concatenate([jnp.zeros((1,), x.dtype), jnp.cumsum(x)])
    i = jnp.arange(t)
    lo, hi = jnp.maximum(i - r, 0), jnp.minimum(i + r + 1, jnp.maximum(n, i + 1))
    return (c[hi] - c[lo]) / (hi - lo).astype(x.dtype)


def smooth(x: Any, kernel: int) -> jax.Array:
    """Centred moving average of a 1-D array over ``kernel`` (odd) entries, averaging only entries inside the array
    (AvgPool1D with same padding and ``count_include_pad=False``)."""
    _check_kernel(kernel)
    x = jnp.asarray(x, jnp.float32)
    if x.shape[0] == 0:
        return x
    return _smooth_valid(x, jnp.int32(x.shape[0]), kernel)


def score_tokens(attn: Any, pool_kernel: int = 13) -> jax.Array:
    """Token importance ``[T]`` from tail attention ``[..., Q, T]`` (e.g. ``[L, H, Q, T]`` from
    ``dense.tail_attention``): max over every leading axis (layers, heads), mean over the Q queries, then
    ``smooth(., pool_kernel)``."""
    a = jnp.asarray(attn, jnp.float32)
    if a.ndim < 2:
        raise PFlashError(f"attention must be [..., Q, T], got shape {a.shape}")
    if a.ndim > 2:
        a = a.reshape((-1,) + a.shape[-2:]).max(axis=0)
    return smooth(a.mean(axis=0), pool_kernel)


def chunk_means(scores: np.ndarray, chunk: int) -> np.ndarray:
    """Mean score of each ``chunk``-token chunk (the last one may be shorter): ``[ceil(T / chunk)]``."""
    t = scores.shape[0]
    n = -(-t // chunk)
    pad = np.zeros(n * chunk, np.float64)
    pad[:t] = scores
    sizes = np.full(n, chunk, np.float64)
    sizes[-1] = t - (n - 1) * chunk
    return pad.reshape(n, chunk).sum(axis=1) / sizes


def _forced_chunks(t: int, chunk: int, head_tokens: int, tail_tokens: int,
                   must_keep: np.ndarray | None) -> np.ndarray:
    """Boolean ``[n_chunks]``: head, tail and must_keep chunks."""
    n = -(-t // chunk)
    keep = np.zeros(n, bool)
    if head_tokens > 0:
        keep[:-(-min(head_tokens, t) // chunk)] = True
    if tail_tokens > 0:
        keep[max(0, t - tail_tokens) // chunk:] = True
    if must_keep is not None:
        keep[np.unique(np.flatnonzero(must_keep) // chunk)] = True
    return keep


def _chunk_sizes(t: int, chunk: int) -> np.ndarray:
    n = -(-t // chunk)
    sizes = np.full(n, chunk, np.int64)
    sizes[-1] = t - (n - 1) * chunk
    return sizes


def _check_must_keep(must_keep: Any, t: int) -> np.ndarray | None:
    if must_keep is None:
        return None
    m = np.asarray(must_keep)
    if m.dtype != np.bool_ or m.shape != (t,):
        raise PFlashError(f"must_keep must be a bool mask of shape ({t},), got {m.dtype} {m.shape}")
    return m


def anchor_chunks(ids: Any, *, chunk: int, ngram: int = 4, window: int = 96, max_hits: int = 8,
                  radius: int = 2) -> np.ndarray:
    """Anchor neighbourhoods (reference §5.3), as chunk indices in priority order (no repeats).

    Every ``ngram``-gram starting in the last ``window`` tokens that also occurs before them, 1 to ``max_hits``
    times, is an anchor (a question repeats the key it asks about; frequent n-grams say nothing). Each earlier
    occurrence lends ``r / hits`` to the chunks it touches and ``r / (hits (d + 1))`` to the chunks ``d`` <=
    ``radius`` chunks away, so a key that several n-grams of the question share outranks a chance match;
    ``r = (i + 1) / m`` for the n-gram's latest start ``i`` among the window's ``m`` n-gram starts: a prompt ends with
    its question, while the window's start often still holds the document, whose nearby repeats (code, lists) are not
    references back (on the tiny needle set they had outranked the key in 3 of 30 prompts at 1K and 4K tokens).
    Chunks with weight, heaviest first; ties: the later chunk first (what follows a key is what a question asks
    for)."""
    _int_opt("chunk", chunk, 1)
    a = np.asarray(ids).reshape(-1)
    t = a.shape[0]
    w0 = max(0, t - window)
    n_early = max(0, w0 - ngram + 1)                              # n-grams wholly before the window
    if ngram < 1 or t < ngram or n_early < 1:
        return np.zeros(0, np.int64)
    grams = np.lib.stride_tricks.sliding_window_view(a, ngram)   # [t - ngram + 1, ngram]
    # a 64-bit hash per n-gram narrows the earlier positions to candidates in O(T), exact rows confirm them
    mult = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5] * (
        -(-ngram // 4)), np.uint64)[:ngram]
    with np.errstate(over="ignore"):
        h = np.bitwise_xor.reduce(grams.astype(np.uint64) * mult, axis=1)
    wg = grams[w0:]
    win, first_rev = np.unique(wg[::-1], axis=0, return_index=True)  # the window's distinct n-grams
    recency = (len(wg) - first_rev) / len(wg)                      # r: (latest start + 1) / starts, in (0, 1]
    cand = np.flatnonzero(np.isin(h[:n_early], h[w0:]))
    gid_c = np.full(cand.shape, -1, np.int64)                    # candidate -> index into win (exact match)
    cand_rows = grams[cand]
    for g, row in enumerate(win):
        gid_c[np.all(cand_rows == row, axis=1)] = g
    cand, gid_c = cand[gid_c >= 0], gid_c[gid_c >= 0]
    hits_of = np.bincount(gid_c, minlength=len(win))
    n_chunks = -(-t // chunk)
    weight = np.zeros(n_chunks, np.float64)
    for p, g in zip(cand.tolist(), gid_c.tolist()):
        if not 1 <= hits_of[g] <= max_hits:
            continue
        w = recency[g] / hits_of[g]
        lo, hi = p // chunk, (p + ngram - 1) // chunk
        weight[lo:hi + 1] += w
        for d in range(1, radius + 1):
            for c in (lo - d, hi + d):
                if 0 <= c < n_chunks:
                    weight[c] += w / (d + 1)
    weight = np.round(weight, 9)  # sums of the same terms in another order tie as they should
    cand = np.flatnonzero(weight > 0)
    return cand[np.lexsort((-cand, -weight[cand]))].astype(np.int64)


def select_chunks(scores: Any, *, chunk: int = 32, keep_ratio: float, head_tokens: int = 0, tail_tokens: int = 0,
                  must_keep: Any = None, anchors: Any = None) -> np.ndarray:
    """Token indices to keep (sorted, original order), chunk by chunk.

    Kept: the chunk with the highest mean score (ties: the earliest), the first of ``anchors`` (chunk indices in
    priority order, ``anchor_chunks``) and the chunk after it, the chunks covering the first ``head_tokens`` and last
    ``tail_tokens`` tokens, every chunk holding a ``must_keep`` token; then the other anchor chunks in their order and
    further chunks by descending mean score while fewer than ``ceil(keep_ratio * T)`` tokens are kept. So when those
    forced chunks fit the budget, ``ceil(keep_ratio * T) <= kept < ceil(keep_ratio * T) + chunk``; otherwise exactly
    the forced chunks are kept. The best anchor's successor is forced with it because what a question asks for
    follows the key it repeats and often crosses the chunk boundary (on the tiny needle set at 1K-2K tokens, where
    the budget holds one anchor chunk, the key's chunk alone held the answer in 18 of 30 prompts, with its successor
    in 27-29).
    """
    s = np.asarray(scores, np.float64)
    if s.ndim != 1 or s.shape[0] == 0:
        raise PFlashError(f"scores must be a non-empty 1-D array, got shape {s.shape}")
    if not np.isfinite(s).all():
        raise PFlashError("scores must be finite")
    _int_opt("chunk", chunk, 1)
    _int_opt("head_tokens", head_tokens, 0)
    _int_opt("tail_tokens", tail_tokens, 0)
    _ratio_opt("keep_ratio", keep_ratio)
    t = s.shape[0]
    mk = _check_must_keep(must_keep, t)
    means = chunk_means(s, chunk)
    sizes = _chunk_sizes(t, chunk)
    order = np.argsort(-means, kind="stable")
    keep = _forced_chunks(t, chunk, head_tokens, tail_tokens, mk)
    keep[order[0]] = True
    anc = np.zeros(0, np.int64) if anchors is None else np.asarray(anchors, np.int64).reshape(-1)
    if anc.size and (anc.min() < 0 or anc.max() >= len(means)):
        raise PFlashError(f"anchors must be chunk indices in [0, {len(means)}), got {anc.min()}..{anc.max()}")
    if anc.size:
        keep[anc[0]:anc[0] + 2] = True
    target = math.ceil(keep_ratio * t)
    kept = int(sizes[keep].sum())
    for c in np.concatenate([anc, order]):
        if kept >= target:
            break
        if not keep[c]:
            keep[c] = True
            kept += int(sizes[c])
    return np.flatnonzero(np.repeat(keep, chunk)[:t])


# ---------------------------------------------------------------------------------------------
# protected spans
# ---------------------------------------------------------------------------------------------
def span_mask(ids: Any, open_id: int | None, close_id: int | None) -> np.ndarray:
    """Marks every token from each ``open_id`` through the next ``close_id`` (inclusive); an unclosed span runs to the
    end of the prompt. All False when either id is None."""
    arr = np.asarray(ids).reshape(-1)
    m = np.zeros(arr.shape, bool)
    if open_id is None or close_id is None:
        return m
    depth_start = None
    for i, tok in enumerate(arr.tolist()):
        if depth_start is None and tok == open_id:
            depth_start = i
        elif depth_start is not None and tok == close_id:
            m[depth_start:i + 1] = True
            depth_start = None
    if depth_start is not None:
        m[depth_start:] = True
    return m


def protected_mask(ids: Any, tokenizer: Any, *, system: bool = True, tools: bool = True) -> np.ndarray:
    """The ``must_keep`` mask for a chat prompt: ``tokenizer.structural_mask(ids)`` (template tokens, role headers)
    plus, with ``tools``, every ``<tool_call>…</tool_call>`` and ``<tool_response>…</tool_response>`` span, and with
    ``system``, every system turn (``<|im_start|>system … <|im_end|>``, which also holds the tool definitions).

    ``tokenizer`` is a ``models.tokenizer.Tokenizer`` (or anything with its ``structural_mask``, ``decode`` and
    special-token id attributes).
    """
    arr = np.asarray(ids, np.int64).reshape(-1)
    m = np.asarray(tokenizer.structural_mask(arr), bool).copy()
    if tools:
        m |= span_mask(arr, tokenizer.tool_call_id, tokenizer.tool_call_end_id)
        m |= span_mask(arr, tokenizer.tool_response_id, tokenizer.tool_response_end_id)
    if system and tokenizer.im_start_id is not None and tokenizer.im_end_id is not None:
        for p in np.flatnonzero(arr == tokenizer.im_start_id):
            head = tokenizer.decode(arr[p + 1:p + 4].tolist(), skip_special_tokens=False)
            if head.startswith("system"):
                ends = np.flatnonzero(arr[p:] == tokenizer.im_end_id)
                m[p:p + ends[0] + 1 if ends.size else arr.shape[0]] = True
    return m


# ---------------------------------------------------------------------------------------------
# scorers
# ---------------------------------------------------------------------------------------------
Scorer = Callable[[np.ndarray, PFlashOptions], Any]
"""``scorer(ids [T] int32, options) -> importance [T]`` (any array-like; higher = keep)."""


@functools.partial(jax.jit, static_argnames=("kernel",))
def _finish(run: jax.Array, n: jax.Array, kernel: int) -> jax.Array:
    """run [nq, Tp] (max over layers and heads) -> smoothed mean over the queries [Tp]; valid for the first n."""
    return _smooth_valid(run.astype(jnp.float32).mean(axis=0), n, kernel)


class DenseScorer:
    """A Qwen3 dense model (``models.dense``) as a PFlash scorer.

    Equals ``score_tokens(dense.tail_attention(...), pool_kernel)``, computed by ``dense_scoring.tail_max_attention``
    (layer-major over the whole prompt, no K/V cache, heads and layers reduced as it goes). ``prefill_chunk``: the
    prompt is padded to a bucketed multiple of it (``dense.capacity_for``), so prompt lengths share compiled shapes,
    and it is the query/key block of the XLA attention. ``attention``: "auto" | "cudnn" | "xla"
    (``dense_scoring.resolve_attention``, resolved on first use; ``attention_impl`` / ``attention_why`` then say
    what runs). The token ids must be in the scorer's vocabulary (a scorer from another tokenizer family needs the
    detokenise/retokenise path of reference §5.2).

    Sharing the device with running decode steps: ``pace`` (default on) waits for each scorer dispatch before the
    next, and ``max_dispatch_flops`` (default ``dense_scoring.DISPATCH_FLOPS``; None = one dispatch per layer) slices
    long prompts' layers by attention heads, so a decode step queued behind scoring waits for at most one bounded
    dispatch (``dense_scoring`` explains both). ``turns``: set to the engine's ``DeviceTurns`` (``Engine.turns``)
    and the scorer's dispatches alternate with the engine's steps while the engine has work.
    """

    def __init__(self, params: dense.Params, cfg: dense.DenseConfig, *, prefill_chunk: int = 512,
                 attention: str = "auto", max_dispatch_flops: float | None = dense_scoring.DISPATCH_FLOPS,
                 pace: bool = True) -> None:
        _int_opt("prefill_chunk", prefill_chunk, 1)
        if attention not in dense_scoring.ATTENTION:
            raise PFlashError(f"scorer attention must be one of {dense_scoring.ATTENTION}, got {attention!r}")
        if max_dispatch_flops is not None and (isinstance(max_dispatch_flops, bool) or not (
                isinstance(max_dispatch_flops, (int, float)) and max_dispatch_flops > 0)):
            raise PFlashError(f"max_dispatch_flops must be a positive number or None, got {max_dispatch_flops!r}")
        self.params, self.cfg, self.prefill_chunk, self.attention = params, cfg, prefill_chunk, attention
        self.max_dispatch_flops, self.pace = max_dispatch_flops, bool(pace)
        self.turns = None  # an engine.turns.DeviceTurns shared with the engine: the scorer then takes turns with it
        self.attention_impl: str | None = None
        self.attention_why = ""

    @classmethod
    def from_pretrained(cls, path: str, dtype=jnp.bfloat16, prefill_chunk: int = 512, attention: str = "auto",
                        max_dispatch_flops: float | None = dense_scoring.DISPATCH_FLOPS,
                        pace: bool = True) -> "DenseScorer":
        cfg, params = dense.load_dense(path, dtype)
        return cls(params, cfg, prefill_chunk=prefill_chunk, attention=attention,
                   max_dispatch_flops=max_dispatch_flops, pace=pace)

    def resolve(self) -> str:
        """The attention implementation this scorer runs (probing cuDNN once for "auto" / "cudnn")."""
        if self.attention_impl is None:
            self.attention_impl, self.attention_why = dense_scoring.resolve_attention(
                self.attention, self.cfg, dense.model_dtype(self.params))
        return self.attention_impl

    def __call__(self, ids: np.ndarray, options: PFlashOptions,
                 step_times: list[float] | None = None) -> np.ndarray:
        """Importance ``[T]`` of the tokens ``ids [T]``. ``step_times``: a list to receive each dispatch's seconds
        (every dispatch is then waited for: profiling only)."""
        run, t = dense_scoring.tail_max_attention(self.params, self.cfg, ids, n_query=options.n_query,
                                                  n_layers=options.n_layers, nope=options.nope,
                                                  attention=self.resolve(), block=self.prefill_chunk,
                                                  max_dispatch_flops=self.max_dispatch_flops, pace=self.pace,
                                                  between=None if self.turns is None else
                                                  self.turns.background_turn, step_times=step_times)
        s = _finish(run, np.int32(t), options.pool_kernel)
        return np.asarray(jax.block_until_ready(s))[:t]


# ---------------------------------------------------------------------------------------------
# compression
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompressionResult:
    """What ``compress`` did. ``effective_ids`` is what the target prefills; ``kept_indices`` their original
    positions; ``ratio = effective_tokens / raw_tokens``; ``scoring_s`` the scorer's wall time (0 if not run).
    ``reason``: "compressed", "off", "short" (< min_tokens), "tools" (a tool-calling request) or "no_gain"
    (auto mode, forced chunks alone exceed auto_max_ratio)."""

    effective_ids: np.ndarray
    kept_indices: np.ndarray
    raw_tokens: int
    effective_tokens: int
    ratio: float
    scoring_s: float
    compressed: bool = False
    reason: str = "off"

    def telemetry(self) -> dict[str, Any]:
        """Fields for a response's telemetry / metrics."""
        return {"raw_prompt_tokens": self.raw_tokens, "effective_prompt_tokens": self.effective_tokens,
                "pflash_ratio": self.ratio, "pflash_scoring_s": self.scoring_s, "pflash": self.reason}


def _untouched(ids: np.ndarray, reason: str) -> CompressionResult:
    t = int(ids.shape[0])
    return CompressionResult(ids, np.arange(t, dtype=np.int64), t, t, 1.0, 0.0, False, reason)


def skip_reason(n_tokens: int, options: PFlashOptions, *, must_keep: Any = None,
                tool_request: bool = False) -> str | None:
    """Why ``compress`` would return a prompt of ``n_tokens`` untouched without running the scorer ("off", "tools",
    "short", "no_gain"), or None when it would score it. Cheap (no scorer): a server decides with it which prompts
    wait for the scorer's thread, so a short request never queues behind another prompt's scoring pass."""
    o = options
    if o.mode == "off":
        return "off"
    if tool_request:
        return "tools"
    if n_tokens < o.min_tokens:
        return "short"
    if o.mode == "auto":
        forced = _forced_chunks(n_tokens, o.chunk, o.head_tokens, o.tail_tokens, _check_must_keep(must_keep, n_tokens))
        if _chunk_sizes(n_tokens, o.chunk)[forced].sum() > o.auto_max_ratio * n_tokens:
            return "no_gain"
    return None


def compress(prompt_ids: Any, scorer: Scorer, options: PFlashOptions, *, must_keep: Any = None,
             tool_request: bool = False) -> CompressionResult:
    """Compress a prompt with ``scorer`` under ``options`` (see the module docstring for the modes).

    ``must_keep`` [T] bool marks tokens that are never dropped (e.g. ``protected_mask``); ``tool_request`` says the
    request carries tools or tool turns: it is never compressed (reason "tools"), in any mode.
    """
    if not isinstance(options, PFlashOptions):
        raise PFlashError(f"options must be PFlashOptions, got {type(options).__name__}")
    ids = np.asarray(prompt_ids)
    if ids.ndim != 1 or ids.shape[0] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise PFlashError(f"prompt_ids must be a non-empty 1-D sequence of token ids, got {ids.dtype} {ids.shape}")
    ids = ids.astype(np.int32)
    t = int(ids.shape[0])
    mk = _check_must_keep(must_keep, t)
    o = options
    skip = skip_reason(t, o, must_keep=mk, tool_request=tool_request)
    if skip is not None:
        return _untouched(ids, skip)
    t0 = time.perf_counter()
    scores = np.asarray(scorer(ids, o), np.float64)
    scoring_s = time.perf_counter() - t0
    if scores.shape != (t,):
        raise PFlashError(f"the scorer returned shape {scores.shape}, expected ({t},)")
    anchors = anchor_chunks(ids, chunk=o.chunk, ngram=o.anchor_ngram, window=o.anchor_window,
                            max_hits=o.anchor_max_hits, radius=o.anchor_radius) if o.anchor_ngram else None
    kept = select_chunks(scores, chunk=o.chunk, keep_ratio=o.keep_ratio, head_tokens=o.head_tokens,
                         tail_tokens=o.tail_tokens, must_keep=mk, anchors=anchors)
    eff = ids[kept]
    return CompressionResult(eff, kept, t, int(eff.shape[0]), eff.shape[0] / t, scoring_s, True, "compressed")
