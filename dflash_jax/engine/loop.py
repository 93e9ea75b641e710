"""The engine: continuous batching over explicit device state, driven by a plain Python loop.

Each ``Engine.step()``: admit waiting requests (a slot and pages for prompt + max_tokens must be free,
otherwise the request waits; it is never failed for pressure), run one prefill chunk for up to a
bucket of prefilling requests, run one decode step for every decoding request, then apply the decode
contract (EOS, stop ids, stop strings, max_tokens) per emitted token, and free finished requests.
Executables are compiled ahead of time per bucket by ``warmup()``; after that nothing compiles.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import os
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.engine import compile as compile_mod
from dflash_jax.engine.sampling import MAX_BANNED, TOP_LOGPROBS, RowSampling, SamplingArrays
from dflash_jax.engine.hostpack import Packing
from dflash_jax.config import DrafterConfig
from dflash_jax.engine.spec_steps import (SpecConfig, SpecInput, draft_step, masked_verify_step, spec_step,
                                         with_draft_quantization, with_draft_vocab)
from dflash_jax.engine.steps import StepOutput, step
from dflash_jax.engine.structured import Constraint, Matcher, Structured, StructuredError
from dflash_jax.engine.turns import DeviceTurns
from dflash_jax.kv.kvflash import DEVICE_SCORINGS, KVFlashOptions, Plan, Residency, resolve_pool_tokens
from dflash_jax.kv import calibration as kv_calibration
from dflash_jax.kv import quant as kv_quant
from dflash_jax.kv.pages import PageAllocator, RequestTooLarge
from dflash_jax.kv.prefix_cache import PrefixCache
from dflash_jax.models import dflash, quant, qwen36
from dflash_jax.models.tokenizer import Tokenizer
from dflash_jax.state import DraftKV, EngineState, RecurrentSlots, SlotPenalties, StepInput
from dflash_jax.sharding import Layout, to_host
from dflash_jax.spec import ddtree, draft_vocab
from dflash_jax.target import Target, load_target, shard_target

#: Newest positions whose target queries rank pages under KVFlash ``bounds`` / ``shadow`` scoring (a page's worth:
#: a question of a few words plus the chat template's tail).
KVFLASH_QUERY_TAIL = 16
SPEC_KINDS = ("spec", "draft", "spec_masked")  # step kinds whose inputs are a SpecInput
DETOK_SETTLE = 16  # tokens decoded past the settled text before it moves on (Engine._decoded)

FinishReason = str  # "stop" | "length" | "abort" | "error" (the engine failed this request alone; stats["error"])


class RequestError(ValueError):
    """A request this engine cannot serve as given; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. temperature 0 = greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability (after temperature)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False  # per-token logprobs (and the most likely alternatives) wanted
    # penalties over the request's generated tokens (repetition: its prompt's too) and additive logit biases
    # ((token id, bias) pairs); applied on the device (sampling.penalize; in speculative rounds per tree node)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # structured output: the text must match this (engine/structured.py); such requests decode AR too
    constraint: Constraint | None = None
    # prompt log-probabilities: each prompt token's under the model given the tokens before it (the first has none)
    # and, per position, this many most likely tokens (0 to 8); None = off. Needs EngineOptions.prompt_logprobs;
    # such a prompt prefills alone, from its first token (never from a cached prefix)
    prompt_logprobs: int | None = None
    # admission order: a lower value is admitted first (vLLM's convention), arrival order among equals; running
    # requests are never preempted
    priority: int = 0
    # the text: a stop string that ends the request is kept at its end (vLLM's include_stop_str_in_output); special
    # tokens are left out (skip_special_tokens, as vLLM and transformers decode by default)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def penalized(self) -> bool:
        """Whether the request needs its row of the slots' penalty tables (penalties, biases or a constraint)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or self.constraint is not None)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise RequestError(f"repetition_penalty must be in (0, 10] (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not -100.0 <= float(b) <= 100.0 for _, b in self.logit_bias):
            raise RequestError("logit_bias values must be in [-100, 100]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= TOP_LOGPROBS:
            raise RequestError(f"prompt_logprobs must be in [0, {TOP_LOGPROBS}], got {self.prompt_logprobs}")


@dataclasses.dataclass
class RequestStats:
    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prefill_chunks: int = 0
    decode_steps: int = 0
    spec_mode: str = "ar"  # "ddtree" | "ar" | "yielded" (cohort-yield guard switched it to AR)
    spec_steps: int = 0
    draft_nodes: int = 0  # tree nodes verified
    accepted_tokens: int = 0  # draft tokens accepted (bonus tokens not counted)
    emitted_spec: int = 0  # tokens emitted by speculative rounds (accepted + bonus)
    cohort_yield_mean: float | None = None  # tokens per request of the cohort's first round, when it yielded
    rollback_mode: str | None = None  # how rounds committed: "replay" or "fast-rollback" (never claimed otherwise)
    reprobes: int = 0  # times a yielded request went back to DDTree for a probe round
    probe_base: int = 0  # spec_steps when the request (re)entered DDTree: its next round is a probe
    yielded_at: int = 0  # tokens generated when it last yielded
    reprobe_after: int = 0  # AR tokens before the next re-probe (doubles after each failed probe)
    kv: dict | None = None  # KVFlash residency telemetry (None when residency is unbounded)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens that came from the prefix cache (not prefilled)

    def as_dict(self, n_out: int) -> dict:
        ttft = None if self.first_token is None else self.first_token - self.arrival
        dec = (None if self.finished is None or self.first_token is None or n_out < 2
               else (self.finished - self.first_token) / (n_out - 1))
        return {"ttft_s": ttft, "tpot_s": dec, "queue_s": None if self.admitted is None else self.admitted - self.arrival,
                "prefill_chunks": self.prefill_chunks, "decode_steps": self.decode_steps,
                "cached_tokens": self.cached_tokens, "e2e_s": None if self.finished is None else self.finished - self.arrival,
                "spec_mode": self.spec_mode, "draft_steps": self.spec_steps, "draft_nodes": self.draft_nodes,
                "accepted_tokens": self.accepted_tokens,
                "mean_accept_len": self.emitted_spec / self.spec_steps if self.spec_steps else None,
                "cohort_yield_mean": self.cohort_yield_mean,
                "rollback_mode": self.rollback_mode if self.spec_steps else None, "reprobes": self.reprobes,
                **({"kvflash": True, **self.kv} if self.kv is not None else {}),
                **({"error": self.error} if self.error else {})}


@dataclasses.dataclass
class RequestOutput:
    """The result of one request (also the running snapshot while it streams)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: FinishReason | None
    logprobs: list[float]  # per generated token; NaN unless SamplingParams.logprobs
    stats: dict
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    # with SamplingParams.prompt_logprobs: per prompt token its log-probability (None for the first) and the most
    # likely tokens at its position ([] for the first); complete once the prompt is prefilled
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # and each prompt token's rank under the model (1 = the most likely; None for the first)
    prompt_ranks: list[int | None] | None = None


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose outputs the host has not applied yet. ``rows[i]`` is bucket row i (None: padding or
    a row that had stopped); ``start`` / ``step`` [b]: each row's first position and tokens generated before the
    step (host or device arrays), from which a chained step's inputs are computed; ``take`` reorders outputs
    across replicas (data parallelism)."""

    kind: str  # "prefill" | "score" | "decode" | "spec"
    b: int
    rows: list
    out: Any
    start: Any
    step: Any
    t0: float
    take: Callable | None = None


@dataclasses.dataclass
class _Request:
    rid: int
    prompt: list[int]
    sp: SamplingParams
    seed: int
    stats: RequestStats
    slot: int = 0
    replica: int = 0  # data-parallel replica holding its slot and pages
    cursor: int = 0  # prompt tokens already prefilled
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    text: str | None = None  # set when a stop string ended the request: the text before it
    finish: FinishReason | None = None
    emitted: int = 0  # tokens handed to the caller so far
    matcher: Matcher | None = None  # structured output: where the request's text is in its automaton
    prompt_lp: list[float | None] | None = None  # prompt logprobs so far (SamplingParams.prompt_logprobs)
    prompt_top: list[list[tuple[int, float]]] | None = None
    prompt_rank: list[int | None] | None = None
    # a group over one prompt (submit_group): the leader prefills to ``fork_at`` (a page boundary before the prompt's
    # last token), then its ``siblings`` start there from a copy of its recurrent slot over its KV pages (shared);
    # until then a sibling is parked (``leader`` set: admitted with the group, not scheduled)
    fork_at: int = 0
    siblings: list["_Request"] = dataclasses.field(default_factory=list)
    leader: "_Request | None" = None
    kv_wait: float = 0.0  # seconds of KVFlash residency work (planning + transfer dispatch) in its steps
    # incremental detokenization: the text of tokens[:dec_n], settled on a character boundary (Engine._decoded)
    dec_n: int = 0
    dec_text: str = ""
    stop_scan: int = 0  # characters of the text already searched for stop strings

    @property
    def decoding(self) -> bool:
        """Prefilled, with a token to decode from, and not finished."""
        return self.cursor == len(self.prompt) and bool(self.tokens) and self.finish is None

    @property
    def n_cached(self) -> int:
        """Tokens whose K/V and recurrent state are in the cache."""
        return self.cursor + max(0, len(self.tokens) - 1)


def _warn_skinny_matmul_under_tp() -> None:
    """The opt-in Pallas decode matmul takes whole weights: under tensor parallelism (``model`` axis left to the
    partitioner, no mesh in the trace context when data_parallel is 1) the partitioner would gather each sharded
    weight around it."""
    from pallas_kernels import registry

    if registry.resolve("skinny_matmul").name != "reference":
        warnings.warn(f"{registry.ENV_VAR} selects skinny_matmul={registry.resolve('skinny_matmul').name} with "
                      "tensor_parallel > 1: the kernel reads whole weights, so each sharded weight would be gathered "
                      "around it; unset it for tensor-parallel runs", RuntimeWarning, stacklevel=3)


OVERLAP_AUTO_BYTES = 16 * 2**30  # weights a decode step streams (~4 ms on an H200) from which overlap is the default


def overlap_by_default(params) -> bool:
    """``EngineOptions.overlap=None``: whether the engine overlaps its host loop with the device. On a GPU, for a
    target whose weights are at least :data:`OVERLAP_AUTO_BYTES` (the 27B, 51.6 GB in bf16: a decode step long
    enough to hide the host's work behind; the tiny pair's 0.3 ms steps ran slower chained)."""
    from pallas_kernels import registry

    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    return registry.current_backend() in registry.GPU_BACKENDS and nbytes >= OVERLAP_AUTO_BYTES


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How an ``Engine`` is built (fixed for its lifetime: buckets and pool sizes are compiled in).

    max_batch: running sequences (recurrent slots); page_size / max_model_len / n_pages: the paged KV pool;
    prefill_chunk / prefill_batch: tokens per prefill chunk and rows per prefill call; spec: DDTree speculative
    decoding (with ``Engine(..., drafter=...)``); kvflash*: bounded KV residency (see the fields' comments).
    """

    max_batch: int = 8
    page_size: int = 16
    max_model_len: int = 2048
    n_pages: int | None = None  # default: enough for max_batch sequences of max_model_len
    prefill_chunk: int = 64
    prefill_batch: int = 2
    kv_dtype: str | None = None  # default: the params' dtype; "fp8" / "int8": quantized pages (per token-head scales)
    # quantized pages' key calibration (kv/calibration.py): "auto" = the one shipped beside the target's checkpoint
    # (kv_calibration.safetensors) when the pages are quantized; a path; None / "none" = plain rounding
    kv_calibration: str | None = "auto"
    spec: SpecConfig | None = None  # DDTree speculative decoding (needs a drafter)
    cohort_yield_min: float = 6.0  # a cohort whose first round emits fewer tokens per request goes AR (0 = never)
    # adaptive cohort-yield: a yielded request probes DDTree again after this many AR tokens (0 = never); a probe
    # round under cohort_yield_min yields again with the wait doubled
    cohort_reprobe_tokens: int = 0
    # forced acceptance, benchmarks only: (prompt, tokens so far) -> block_size - 1 proposed token ids that every
    # speculative round verifies as a chain instead of the drafter's tree (spec_steps.oracle_step)
    spec_oracle: Callable[[list[int], list[int]], Sequence[int]] | None = None
    # KVFlash bounded residency: None/"off" = every page resident; "auto" = a pool sized from free device memory;
    # an int = a resident pool of that many tokens shared by all running sequences (their histories live on host)
    kvflash: int | str | None = None
    # "bounds" (key min/max per page vs the target's latest queries) | "shadow" (the target's attention share of
    # each page under those queries, over 4-bit copies of all keys on the device) | "keys" (mean keys) | "drafter"
    # (needs the drafter and spec: ranks by its latest round's queries) | "lru" (kv/kvflash.py)
    kvflash_scoring: str = "shadow"
    kvflash_exact_steps: bool = False  # rows of a step get their whole history resident when it fits
    kvflash_max_page_in: int = 64  # optional page-ins (by rank) per step; a step's own write pages are not limited
    kvflash_host_kind: str | None = None  # host memory kind override (default: pinned_host where available)
    # GiB of host slabs the host allocator is made to hold at warm-up (capped at every slab plus one bucket of
    # page-outs): pinned memory is pinned as the allocator grows, so this moves that cost out of the page-outs
    kvflash_host_prewarm_gb: float = 8.0
    tensor_parallel: int = 1  # devices of the mesh's model axis (sharding.py: Megatron layout, one all-reduce a layer)
    data_parallel: int = 1  # replicas over the mesh's data axis; each serves max_batch / data_parallel sequences
    # decode/spec batch sizes compiled per replica (a batch runs in the smallest bucket that holds it); default:
    # the powers of two below max_batch / data_parallel, and it; the largest given must be max_batch / data_parallel
    batch_buckets: tuple[int, ...] | None = None
    quantization: str | None = None  # "fp8" / "int8" / "int4": target + drafter matmul weights (quant.QuantizedWeight)
    # overlap the host loop with the device: a decode / speculative step over the same rows as the step in flight is
    # dispatched before that step's tokens are applied, its roots and positions carried on the device, so the
    # host's work between steps can hide behind the step in flight. Tokens are identical; a request that stops runs
    # one discarded step more. Applies with one replica, without KVFlash and without spec_oracle. None (default):
    # on where a step streams at least OVERLAP_AUTO_BYTES of weights from a GPU (``overlap_by_default``): the 27B
    # ran 1.16x / 1.14x faster with it at C1 / C16 on an H100 and its oracle rounds 291 vs 253 tok/s on the H200,
    # while on the H200 the tiny pair ran slower (a chained step costs two dispatches: its advance and itself)
    overlap: bool | None = None
    # per-slot tables over the vocabulary for repetition / frequency / presence penalties and logit_bias
    # (state.SlotPenalties: 9 bytes a vocabulary entry a slot, e.g. 145 MB for the 27B at 64 sequences); off:
    # requests that ask for them are refused
    sampling_penalties: bool = True
    # prompt-prefix caching (kv/prefix_cache.py): this many recurrent-state snapshots (0 = off), each with the KV
    # pages of a prompt prefix up to a prefill-chunk boundary; a request whose prompt starts with a cached prefix
    # is admitted over its pages and prefills only the rest. Each data-parallel replica keeps its own (a request goes
    # to the replica holding its longest cached prefix); not with KVFlash; prefill_chunk must be a multiple of
    # page_size
    prefix_cache: int = 0
    # one matmul for the input projections that read the same activations (qwen36.fuse_projections), for an unsharded
    # target: the engine fuses a copy (the caller's Target is untouched; Target.fuse_projections() fuses one in place,
    # as the serve and bench entry points do, so the matrices are never held twice); the drafter's context K/V
    # projections likewise (dflash.fuse_context_kv: a joined copy next to its per-layer k / v)
    fuse_projections: bool = True
    # compile a prefill step that also returns prompt log-probabilities (one row per replica, bucket 1), for requests
    # with SamplingParams.prompt_logprobs (the API's echo + logprobs); off: such requests are refused
    prompt_logprobs: bool = False
    # a request's tokens do not depend on what else runs: every step of a kind runs at one shape (decode at max_batch
    # / data_parallel rows, prefill at prefill_batch rows) and a prompt's last token always runs in the decode step,
    # so each row's arithmetic is the same whatever the batch holds (matmuls, attention and sampling are row-wise).
    # Costs padded rows at low concurrency; not with batch_buckets. Speculative requests are covered while they stay
    # speculative (the cohort-yield guard can move a cohort to AR, whose arithmetic differs)
    batch_invariant: bool = False
    # structured output (SamplingParams.constraint) in speculative rounds: a round with constrained rows runs in two
    # steps, draft then verify under every tree node's allowed tokens (the host walks each row's automaton along the
    # tree in between), compiled per decode bucket at warm-up; off: constrained requests decode AR
    structured_spec: bool = False


def _buckets(limit: int, given: Sequence[int] | None = None) -> tuple[int, ...]:
    """Batch buckets up to ``limit``: ``given`` (checked), or the powers of two below it and ``limit``."""
    if given is None:
        return tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < limit) + (limit,)
    out = tuple(sorted({int(b) for b in given}))
    if not out or out[0] < 1 or out[-1] != limit:
        raise ValueError(f"batch_buckets {tuple(given)} must be positive and end at max_batch / data_parallel = "
                         f"{limit} (the largest batch a step can run)")
    return out


def replica_buckets(concurrency: Sequence[int], data_parallel: int = 1) -> tuple[int, ...]:
    """The per-replica batch buckets that ``concurrency`` requests at once run in (``batch_buckets`` for them)."""
    return tuple(sorted({-(-int(c) // data_parallel) for c in concurrency}))


class Engine:
    """Continuous-batching generation over a loaded target.

    ``Engine.from_pretrained(path, dtype=..., max_batch=..., ...)``; ``generate(prompts, sampling)`` for
    a list, ``stream(prompt, sampling)`` for token-by-token output, or ``submit``/``step`` to drive it.
    """

    def __init__(self, target: Target, tokenizer: Tokenizer | None = None, options: EngineOptions = EngineOptions(),
                 eos_token_ids: Sequence[int] | None = None,
                 drafter: tuple[DrafterConfig, dict] | None = None) -> None:
        o = options
        if o.spec is not None and drafter is None:
            raise ValueError("speculative decoding (options.spec) needs a drafter: pass drafter=(DrafterConfig, params)")
        if drafter is not None:
            drafter[0].validate_against(target.config)
        if o.spec is not None and o.spec.fast_rollback and o.max_batch != 1:
            raise ValueError(f"fast rollback keeps every tree node's recurrent state and serves a single sequence: "
                             f"set max_batch=1 (--max-concurrency 1), got {o.max_batch}; or drop fast_rollback")
        if o.cohort_reprobe_tokens < 0:
            raise ValueError(f"cohort_reprobe_tokens must be >= 0, got {o.cohort_reprobe_tokens}")
        if o.max_batch < 1 or o.prefill_batch < 1 or o.prefill_chunk < 1:
            raise ValueError("max_batch, prefill_batch and prefill_chunk must be >= 1")
        if o.max_model_len > target.config.max_position_embeddings:
            raise ValueError(f"max_model_len {o.max_model_len} exceeds the model's max_position_embeddings "
                             f"{target.config.max_position_embeddings}")
        if target.layout is not None and (o.tensor_parallel, o.data_parallel) == (1, 1):  # already laid out
            o = dataclasses.replace(o, tensor_parallel=target.layout.tp, data_parallel=target.layout.dp)
        if o.data_parallel < 1 or o.max_batch % o.data_parallel:
            raise ValueError(f"max_batch {o.max_batch} must be a multiple of data_parallel {o.data_parallel} (each "
                             "replica serves max_batch / data_parallel sequences)")
        if quant.check_quantization(o.quantization) is not None:  # no-op for leaves quantized at load
            if qwen36.fused_unquantized(target.params):
                raise ValueError("quantization applies to the checkpoint's matrices, but this target's projections "
                                 "are already fused in full precision: load it with quantization=... (or quantize "
                                 "before fusing)")
            if target.layout is not None:  # quantized before it is laid out, so scales move with their rows
                raise ValueError("this target is already sharded in full precision: load it with quantization=... "
                                 "and tensor_parallel / data_parallel together, or pass the unsharded target")
            target = dataclasses.replace(target, params=quant.quantize_params(target.params, o.quantization))
            if drafter is not None and (o.spec is None or o.spec.draft_quantization is None):
                drafter = (drafter[0], quant.quantize_params(drafter[1], o.quantization))
        if o.tensor_parallel != 1 or o.data_parallel != 1 or target.layout is not None:
            target = shard_target(target, o.tensor_parallel, o.data_parallel)
        self.layout: Layout | None = target.layout
        if self.layout is not None and self.layout.tp > 1:
            _warn_skinny_matmul_under_tp()
        if drafter is not None and self.layout is not None:  # the drafter is small: replicated on every device
            drafter = (drafter[0], jax.device_put(drafter[1], self.layout.replicated))
        if o.fuse_projections and target.layout is None and not qwen36.is_fused(target.params):
            target = dataclasses.replace(target, params=qwen36.fuse_projections(target.params))
        self.target, self.cfg, self.tokenizer, self.options = target, target.config, tokenizer, o
        self.eos_token_ids = tuple(eos_token_ids if eos_token_ids is not None else
                                   dict.fromkeys(target.eos_token_ids + (tokenizer.eos_token_ids if tokenizer else ())))
        self.dcfg, self.dparams = drafter if drafter is not None else (None, None)
        if o.spec is not None and self.dparams is not None and (o.spec.draft_vocab is not None
                                                                 or o.spec.draft_quantization is not None):
            if o.spec.draft_vocab is not None:
                ids = draft_vocab.resolve(o.spec.draft_vocab, self.cfg.vocab_size, self.eos_token_ids)
                self.dparams = with_draft_vocab(self.dparams, self.target.params["lm_head"], ids)
            if o.spec.draft_quantization is not None:
                self.dparams = with_draft_quantization(self.dparams, self.target.params["lm_head"],
                                                       o.spec.draft_quantization)
            if self.layout is not None:
                self.dparams = jax.device_put(self.dparams, self.layout.replicated)
        if o.fuse_projections and self.dparams is not None:
            self.dparams = dflash.fuse_context_kv(self.dparams)
        self.spec_span = self.dcfg.block_size if o.spec is not None else 0  # positions a round may commit
        self.dtype = jnp.dtype(qwen36.param_dtype(self.target.params))
        self.kv_dtype = kv_dtype = kv_quant.resolve_kv_dtype(o.kv_dtype, self.dtype)
        self.kv_calibration = self._kv_calibration(o.kv_calibration, kv_dtype)  # its path, or None
        if self.kv_calibration is not None:
            calib = kv_calibration.KVCalibration.load(self.kv_calibration)
            self.target = dataclasses.replace(self.target, params=kv_calibration.attach(
                self.target.params, self.cfg, calib, self.layout))
        self.kvflash_pool_tokens = self._kvflash_pool(kv_dtype)
        wanted = overlap_by_default(self.target.params) if o.overlap is None else o.overlap
        self.overlap = wanted and o.data_parallel == 1 and o.spec_oracle is None and self.kvflash_pool_tokens is None
        # positions a step in flight may advance a row beyond what the host has applied (overlap)
        self.ahead = max(self.spec_span, 1) if self.overlap else 0
        self.width = -(-(o.max_model_len + self.spec_span + self.ahead) // o.page_size)  # page-table width
        # data parallelism: dp replicas, each with its own slots and page pool (state [dp, ...], steps vmapped)
        self.dp = dp = o.data_parallel
        per_replica = o.max_batch // dp
        n_pages = (o.n_pages or o.max_batch * self.width + dp) // dp  # pages of one replica
        if self.kvflash_pool_tokens is not None and (dp > 1 or self.layout is not None):
            raise ValueError("KVFlash bounded residency runs on one device: it cannot be combined with "
                             "tensor_parallel > 1 or data_parallel > 1; drop one of them")
        # drafter scoring: every speculative round also returns the drafter's anchor queries (SpecConfig.draft_query)
        self.draft_scoring = self.kvflash_pool_tokens is not None and o.kvflash_scoring == "drafter"
        if self.draft_scoring and (self.dcfg is None or o.spec is None):
            raise ValueError("kvflash_scoring='drafter' ranks pages by the DFlash drafter's queries: it needs a drafter "
                             "and speculative decoding (Engine(..., drafter=...) with options.spec; --ddtree); use "
                             "'keys' or 'lru' without one")
        if self.draft_scoring and not self.dcfg.full_layers:
            raise ValueError("kvflash_scoring='drafter' needs a drafter with a full-attention layer (sliding layers "
                             "never see beyond their window); use 'keys' or 'lru'")
        # bounds / shadow scoring: prefill and decode steps also return the target's queries of each row's newest
        # positions
        self.query_tail = KVFLASH_QUERY_TAIL if (self.kvflash_pool_tokens is not None
                                                 and o.kvflash_scoring in DEVICE_SCORINGS) else 0
        if self.kvflash_pool_tokens is None:
            self.pools: list[PageAllocator | Residency] = [PageAllocator(n_pages, o.page_size) for _ in range(dp)]
        else:
            self.pools = [self._residency(n_pages - 1)]
            n_pages = self.pools[0].n_pages
        self.replica_slots = [list(range(1, per_replica + 1)) for _ in range(dp)]  # free slots of each replica
        self.prefix_caches: list[PrefixCache] = []  # one per replica (its pages, its snapshot slots); [] = off
        if o.prefix_cache:
            if o.prefix_cache < 0:
                raise ValueError(f"prefix_cache must be >= 0 (snapshots kept), got {o.prefix_cache}")
            if self.kvflash_pool_tokens is not None:
                raise ValueError("prefix caching runs with every page resident: it cannot be combined with KVFlash; "
                                 "drop one of them")
            # the slots past the requests' hold the snapshots
            self.prefix_caches = [PrefixCache(pool, o.prefill_chunk,
                                              range(per_replica + 1, per_replica + 1 + o.prefix_cache))
                                  for pool in self.pools]
        self._state_zeros = functools.partial(EngineState.zeros, self.cfg, n_pages=n_pages, page_size=o.page_size,
                                              n_slots=per_replica + 1 + o.prefix_cache, dtype=self.dtype,
                                              kv_dtype=kv_dtype,
                                              penalties=o.sampling_penalties)
        self.state = self.zero_state()
        self.dkv = None
        if self.dcfg is not None:
            self.dkv = self._replicas(functools.partial(DraftKV.zeros, self.dcfg, n_pages, o.page_size, kv_dtype, self.dtype),
                                      lambda lay, shapes: lay.replica_tree(shapes))
        self.kvf = None
        self.kvflash_prewarm: dict[str, float] = {}  # host slabs made ready at warm-up (KVFlashDevice.prewarm)
        self.kvb = None  # bounds / shadow scoring: page tables, query windows on the device (kv/kvflash_scoring.py)
        if self.kvflash_pool_tokens is not None:
            from dflash_jax.kv.kvflash_device import KVFlashDevice

            self.kvf = KVFlashDevice(self.state, self.dkv, self.pools[0].host_pages, host_kind=o.kvflash_host_kind,
                                     draft_summary_layers=self.dcfg.full_layers if self.draft_scoring else (),
                                     target_summaries=o.kvflash_scoring == "keys")
            if self.query_tail:
                from dflash_jax.kv.kvflash_scoring import DeviceScorer

                self.kvb = DeviceScorer(self.state, self.pools[0].host_pages, per_replica + 1,
                                        self.cfg.num_heads, self.query_tail, self.width, kind=o.kvflash_scoring)
        self._plan: Plan | None = None
        self._failed: list[_Request] = []
        self._dispatched_version: dict[int, int] = {}
        # KVFlash telemetry of the last 256 device calls: step, rows, deferred, pages_in/out, bytes_in/out, wait_s,
        # resident_pages, occupancy, sequences_changed (empty when residency is unbounded)
        self.kvflash_steps: collections.deque[dict] = collections.deque(maxlen=256)
        pb = min(o.prefill_batch, per_replica)
        if o.batch_invariant:
            if o.batch_buckets is not None and tuple(o.batch_buckets) != (per_replica,):
                raise ValueError(f"batch_invariant runs one decode bucket ({per_replica}); drop batch_buckets "
                                 f"{tuple(o.batch_buckets)}")
            self.decode_buckets, self.prefill_buckets = (per_replica,), (pb,)
        else:
            self.decode_buckets = _buckets(per_replica, o.batch_buckets)
            self.prefill_buckets = (_buckets(pb) if o.batch_buckets is None
                                    else tuple(b for b in self.decode_buckets if b < pb) + (pb,))
        self.spec_cfg = dataclasses.replace(o.spec, draft_query=True) if self.draft_scoring else o.spec
        if o.structured_spec and (self.dcfg is None or not o.sampling_penalties):
            raise ValueError("structured_spec needs a drafter and sampling_penalties (the allow masks live in the slots' "
                             "penalty tables)")
        self._packings: dict[tuple[str, int], Packing] = {}  # (kind, bucket) -> layout of its host inputs
        self._exec: dict[tuple[str, int], Callable] = {}
        self._inflight: _InFlight | None = None  # overlap: the decode / speculative step not yet applied
        self.structured: Structured | None = None  # structured output's automata (built at the first constraint)
        self._structured_lock = threading.Lock()
        # shared with a background device user (the PFlash scorer) so that they take turns (engine/turns.py)
        self.turns: DeviceTurns | None = None
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: dict[int, _Request] = {}  # admitted, in prefill or decode
        self._ids = itertools.count()
        self.warmup_report: dict[str, float] = {}
        self.counters = collections.Counter()
        # wall seconds by step kind (dispatch to outputs on the host) and of whole ``step()`` calls ("step"):
        # "step" minus the kinds is the host loop's own time
        self.step_seconds: collections.Counter[str] = collections.Counter()

    # ---- KVFlash --------------------------------------------------------------------------------------------
    def _kv_calibration(self, option: str | None, kv_dtype) -> str | None:
        """The key calibration file the pages use (``EngineOptions.kv_calibration``), or None."""
        if option in (None, "none"):
            return None
        if not kv_quant.is_quantized_dtype(kv_dtype):
            if option == "auto":
                return None
            raise ValueError(f"kv_calibration={option!r} rounds keys into quantized pages, but the pages are "
                             f"{jnp.dtype(kv_dtype).name}: pass kv_dtype='fp8' or 'int8' too, or drop it")
        if option == "auto":
            return kv_calibration.find(self.target.path)
        if not os.path.isfile(option):
            raise FileNotFoundError(f"kv_calibration {option!r}: no such file (measure one with python -m "
                                    "dflash_jax.kv.calibrate --model PATH)")
        return option

    def _kv_bytes_per_token(self, kv_dtype) -> int:
        """Device bytes of one token's K and V (target + drafter; quantized pages count their scales too)."""
        per = 2 * len(self.cfg.attn_layers) * self.cfg.num_kv_heads * kv_quant.row_bytes(self.cfg.head_dim, kv_dtype)
        if self.dcfg is not None:
            per += 2 * self.dcfg.num_layers * self.dcfg.num_kv_heads * kv_quant.row_bytes(self.dcfg.head_dim, kv_dtype)
        return per

    def _kvflash_pool(self, kv_dtype) -> int | None:
        o = self.options
        free = None
        if o.kvflash == "auto":
            stats = next(iter(self.target.params["embed"].devices())).memory_stats() or {}
            if "bytes_limit" in stats:  # free memory after the weights, less the recurrent slots still to come
                rec = jax.eval_shape(lambda: EngineState.zeros(self.cfg, n_pages=1, page_size=1,
                                                               n_slots=o.max_batch + 1, dtype=self.dtype).rec)
                rec_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(rec))
                if o.sampling_penalties:
                    rec_bytes += (o.max_batch + 1) * SlotPenalties.bytes_per_slot(self.cfg.vocab_size)
                free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - rec_bytes - self._scoring_bytes(kv_dtype)
        return resolve_pool_tokens(o.kvflash, free_bytes=free, bytes_per_token=self._kv_bytes_per_token(kv_dtype),
                                   page_size=o.page_size)

    def _scoring_bytes(self, kv_dtype) -> int:
        """Device bytes of bounds / shadow scoring's tables (``DeviceScorer``), 0 with another scoring."""
        o = self.options
        if o.kvflash_scoring not in DEVICE_SCORINGS:
            return 0
        from dflash_jax.kv.kvflash_scoring import DeviceScorer

        width = -(-(o.max_model_len + self.spec_span) // o.page_size)  # KVFlash runs without overlap: no ``ahead``
        host_pages = (o.n_pages or o.max_batch * width + 1) - 1
        dtype = DeviceScorer.bounds_dtype(self.dtype, kv_dtype in ("fp8", "int8"))
        c = self.cfg
        return DeviceScorer.table_bytes(o.kvflash_scoring, host_pages, o.max_batch + 1, len(c.attn_layers),
                                        o.page_size, c.num_kv_heads, c.num_heads, c.head_dim, KVFLASH_QUERY_TAIL,
                                        dtype)

    def _device_scores(self, items: list[tuple[int, int, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """``Residency.batch_scorer`` of bounds / shadow scoring: (request id, queries, page ids, context ids) ->
        scores, on the device."""
        return self.kvb.score([(self.running[sid].slot, n, ids, ctx) for sid, n, ids, ctx in items])

    def _residency(self, host_pages: int) -> Residency:
        o = self.options
        ps = o.page_size
        pool = min(self.kvflash_pool_tokens // ps, host_pages)  # more resident pages than history is waste
        self.kvflash_pool_tokens = pool * ps
        step_need = max(-(-(o.prefill_chunk - 1) // ps) + 1, -(-(self.spec_span - 1) // ps) + 1)
        if pool < step_need:
            raise ValueError(f"kvflash pool of {self.kvflash_pool_tokens} tokens ({pool} pages) cannot hold one step's "
                             f"writes ({step_need} pages of {ps} tokens: prefill_chunk {o.prefill_chunk}); "
                             f"use a pool of at least {step_need * ps} tokens or a smaller prefill_chunk")
        floor = -(-(max(self.spec_span, 1) - 1) // ps) + 1  # pages a decode / speculative write can touch
        kopts = KVFlashOptions(pool_tokens=self.kvflash_pool_tokens, scoring=o.kvflash_scoring,
                               exact_steps=o.kvflash_exact_steps, max_page_in=o.kvflash_max_page_in)
        return Residency(pool, host_pages, ps, kopts, floor_pages=min(floor, pool),
                         batch_scorer=self._device_scores if o.kvflash_scoring in DEVICE_SCORINGS else None)

    def _reside(self, rows: list["_Request"], ranges: list[tuple[int, int]]) -> list["_Request"]:
        """Make the pages ``rows`` write resident (and what else the policy wants); returns the rows that run.

        Without KVFlash this just grows each row's pages. With it: summaries for scoring (mean target keys, or mean
        drafter context keys of its full layers for drafter scoring), the residency plan,
        page-outs then page-ins (asynchronous), deferral of rows whose pages do not fit now (they run in a later
        step). Requests whose pages a failed transfer lost fail alone with a clear error.
        """
        if self.kvf is None:
            for r, (_, hi) in zip(rows, ranges):
                self._grow(r, hi)
            return rows
        t0 = time.perf_counter()
        res: Residency = self.pages
        need = res.summaries_needed()
        sec = self.step_seconds  # host time by KVFlash phase: kv_summaries, kv_plan, kv_transfer (of it kv_page_out,
        # kv_page_in: _transfer; kv_query: _apply)
        if need:
            try:
                phys = [p for _, _, p in need]
                keys = [(sid, lp) for sid, lp, _ in need]
                if self.kvb is not None:  # written on the device (asynchronous); the residency records them
                    self.kvb.write(self.state, phys, [res.page_id(sid, lp) for sid, lp in keys])
                    res.set_summaries(keys)
                else:
                    res.set_summaries(keys, self.kvf.draft_summaries(self.dkv, phys) if self.draft_scoring
                                      else self.kvf.summaries(self.state, phys))
            except Exception:  # noqa: BLE001 - without summaries the ranking falls back to LRU (counted)
                self.counters["kvflash_summary_failures"] += 1
        t1 = time.perf_counter()
        before = collections.Counter(res.counters)
        plan = res.prepare([(r.rid, lo, hi) for r, (lo, hi) in zip(rows, ranges)])
        self._plan = plan
        t2 = time.perf_counter()
        lost = self._transfer(plan)
        t3 = time.perf_counter()
        sec["kv_summaries"] += t1 - t0
        sec["kv_plan"] += t2 - t1
        sec["kv_transfer"] += t3 - t2
        dt = t3 - t0
        by_id = dict(self.running)
        for sid in sorted(lost):
            r = by_id.get(sid)
            if r is not None:
                self._fail(r, "KVFlash could not move this request's KV pages between device and host; the "
                              "request was stopped and its pages reclaimed (other requests are unaffected)")
        run = [r for r in rows if r.rid not in plan.deferred and r.rid not in lost]
        for r in rows:
            r.kv_wait += dt
        bpp = self.kvf.slab_bytes
        c = self.counters
        n_in, n_out = len(plan.page_in), len(plan.page_out)
        c["kvflash_pages_in"] += n_in
        c["kvflash_pages_out"] += n_out
        c["kvflash_bytes_in"] += n_in * bpp
        c["kvflash_bytes_out"] += n_out * bpp
        c["kvflash_wait_s"] += dt
        c["kvflash_deferred_steps"] += len(plan.deferred)
        for k in ("score_decisions", "lru_decisions", "score_fallbacks", "unscored_fallbacks", "clean_evictions"):
            c[f"kvflash_{k}"] += res.counters[k] - before[k]
        for r in run:  # block tables are built from the residency map at dispatch: count the ones that changed
            v = res.version(r.rid)
            if self._dispatched_version.get(r.rid) not in (None, v):
                c["kvflash_table_refreshes"] += 1
            self._dispatched_version[r.rid] = v
        self.kvflash_steps.append({"step": plan.step_id, "rows": len(rows), "deferred": len(plan.deferred),
                                   "pages_in": n_in, "pages_out": n_out, "bytes_in": n_in * bpp,
                                   "bytes_out": n_out * bpp, "wait_s": dt, "resident_pages": res.resident_used,
                                   "occupancy": res.resident_used / res.pool_pages,
                                   "sequences_changed": len(plan.changed)})
        return run

    def _grow(self, r: "_Request", n_tokens: int) -> None:
        """Give ``r`` pages for at least ``n_tokens`` tokens (pages already held beyond it stay: a chained step may
        have grown it further ahead)."""
        pool = self.pools[r.replica]
        pool.grow(r.rid, max(n_tokens, pool.num_tokens(r.rid)))

    def _transfer(self, plan: Plan) -> set[int]:
        """Run a plan's copies (page-outs first); returns the sequences whose pages a failed copy lost."""
        lost: set[int] = set()
        t0 = time.perf_counter()
        try:
            self.kvf.page_out(self.state, self.dkv, plan.page_out)
        except Exception:  # noqa: BLE001 - those pages are gone: their requests fail alone
            self.counters["kvflash_transfer_failures"] += 1
            lost |= {t.sid for t in plan.page_out}
        t1 = time.perf_counter()
        ins = [t for t in plan.page_in if t.sid not in lost]
        try:
            self.state, self.dkv = self.kvf.page_in(self.state, self.dkv, ins)
        except Exception:  # noqa: BLE001
            self.counters["kvflash_transfer_failures"] += 1
            lost |= {t.sid for t in ins}
        self.step_seconds["kv_page_out"] += t1 - t0
        self.step_seconds["kv_page_in"] += time.perf_counter() - t1
        return lost

    def _kv_done(self) -> None:
        """The in-flight step's outputs are ready: release its pins."""
        if self._plan is not None:
            self.pages.finish_step(self._plan.step_id)
            self._plan = None

    def _fail(self, r: "_Request", msg: str) -> None:
        r.finish = "error"
        r.stats.error = msg
        self.counters["requests_failed"] += 1
        self._free(r)
        self._failed.append(r)

    def kvflash_report(self) -> dict | None:
        """Engine-level KVFlash state and counters (None when residency is unbounded)."""
        if self.kvf is None:
            return None
        res: Residency = self.pages
        c = self.counters
        return {"pool_tokens": self.kvflash_pool_tokens, "pool_pages": res.pool_pages, "host_pages": res.host_pages,
                "host_memory_kind": self.kvf.host_kind, "host_bytes": self.kvf.host_bytes,
                "page_bytes": self.kvf.slab_bytes, "scoring": res.opts.scoring,
                "prewarm_bytes": self.kvflash_prewarm.get("bytes", 0),
                "prewarm_s": self.kvflash_prewarm.get("seconds", 0.0),
                "scoring_device_bytes": self.kvb.nbytes if self.kvb is not None else 0,
                "resident_pages": res.resident_used, "occupancy": res.resident_used / res.pool_pages,
                **{k: c[f"kvflash_{k}"] for k in (
                    "pages_in", "pages_out", "bytes_in", "bytes_out", "wait_s", "deferred_steps",
                    "score_decisions", "lru_decisions", "score_fallbacks", "unscored_fallbacks", "clean_evictions",
                    "table_refreshes",
                    "transfer_failures", "summary_failures")}}

    def kvflash_residency(self) -> dict[int, dict] | None:
        """Where every running request's KV pages are now (None when residency is unbounded).

        ``{request_id: {"resident": [logical page indices resident in the device pool], "logical_pages": pages of
        its history, "tokens": tokens of its history}}``; the other logical pages live in host slabs. Sample it
        between ``step()`` calls to follow residency over time.
        """
        if self.kvf is None:
            return None
        res: Residency = self.pages
        return {rid: {"resident": res.resident_of(rid), "logical_pages": res.n_logical(rid),
                      "tokens": res.num_tokens(rid)}
                for rid in self.running if rid in res}

    def zero_state(self) -> EngineState:
        """A fresh device state (empty pages and slots), created directly on its shards."""
        return self._replicas(self._state_zeros, lambda lay, shapes: lay.state(shapes))

    def reset_state(self) -> None:
        """Rebuild the device state from zeros (after a faulted step, with no request running): cached prefixes
        go too, since their pages and snapshots were in it."""
        for cache in self.prefix_caches:
            cache.clear()
        self.state = self.zero_state()

    def _replicas(self, zeros: Callable, shardings: Callable):
        """``zeros()`` with a leading ``[dp]`` replica axis when dp > 1, made on the device(s) under the layout's
        ``shardings(layout, shapes)``."""
        dp = self.dp
        fn = zeros if dp == 1 else (lambda: jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (dp,) + a.shape),
                                                                    zeros()))
        if self.layout is None:
            return fn()
        return jax.jit(fn, out_shardings=shardings(self.layout, jax.eval_shape(fn)))()

    @property
    def pages(self) -> "PageAllocator | Residency":
        """Replica 0's page pool (every replica's is the same size; the only one without data parallelism)."""
        return self.pools[0]

    @pages.setter
    def pages(self, pool: "PageAllocator | Residency") -> None:
        if self.dp != 1:
            raise ValueError("with data parallelism each replica has its own pool: set engine.pools[k]")
        self.pools[0] = pool

    @property
    def free_slots(self) -> list[int]:
        """Free recurrent slots of all replicas."""
        return [s for free in self.replica_slots for s in free]

    def compile_step(self, fn: Callable, inputs: int = 2):
        """``fn(params, dparams, state, dkv, *host_inputs) -> (state', dkv', out)`` (``inputs`` host input arguments)
        jitted with state and drafter cache donated; under a layout, with explicit in/out shardings (state keeps its
        sharding; drafter, inputs and outputs are replicated), so its executables take and return the engine's own
        arrays."""
        if self.layout is None:
            return jax.jit(fn, donate_argnums=(2, 3))
        lay, per = self.layout, self.layout.per_replica()
        if self.dp > 1:
            fn = lay.per_replica_step(fn, n_replicated=2, n_per_replica=2 + inputs)
        state_sh = lay.state(self.state)
        ins = (lay.params(self.target.params), lay.replicated, state_sh, per) + (per,) * inputs
        return jax.jit(fn, donate_argnums=(2, 3), in_shardings=ins, out_shardings=(state_sh, per, per))

    def put(self, tree):
        """Host arrays -> device arrays placed as step inputs are (per replica under a layout)."""
        return jax.device_put(tree, self.layout.per_replica() if self.layout is not None else None)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, target_path: str, dtype: str = "float32", warmup: bool = True,
                        drafter_path: str | None = None, **options) -> "Engine":
        """Load a target (and optionally a DFlash drafter) checkpoint; ``options`` are ``EngineOptions`` fields
        (``quantization="fp8"`` quantizes both as they load)."""
        q = options.get("quantization")
        target = load_target(target_path, dtype=dtype, tensor_parallel=options.get("tensor_parallel", 1),
                             data_parallel=options.get("data_parallel", 1), quantization=q)
        drafter = None
        if drafter_path is not None:
            from dflash_jax.models.dflash_loader import load_drafter

            spec = options.get("spec")
            dq = spec.draft_quantization if spec is not None and spec.draft_quantization is not None else q
            drafter = load_drafter(drafter_path, dtype=target.params["embed"].dtype, quantization=dq)
        if options.get("fuse_projections", True):
            target.fuse_projections()
        eng = cls(target, Tokenizer.from_dir(target_path), EngineOptions(**options), drafter=drafter)
        if warmup:
            eng.warmup()
        return eng

    def _shapes(self, kind: str, b: int):
        """One replica's host inputs ``(inp, samp)`` of a ``kind`` step at bucket ``b`` (shapes and dtypes)."""
        t = self.options.prefill_chunk if kind in ("prefill", "score") else 1
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        if kind in SPEC_KINDS:
            inp = SpecInput(root=i32(b), start=i32(b), slots=i32(b), active=jax.ShapeDtypeStruct((b,), jnp.bool_),
                            page_table=i32(b, self.width),
                            proposal=None if self.options.spec_oracle is None else i32(b, self.dcfg.block_size - 1))
        else:
            inp = StepInput(tokens=i32(b, t), positions=i32(b, t), n_valid=i32(b), slots=i32(b),
                            page_table=i32(b, self.width))
        samp = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                      SamplingArrays.from_rows([], b))
        shapes = (inp, samp) + ((i32(b, t),) if kind == "score" else ())  # a scoring step's targets
        if kind == "spec_masked":  # the drafted trees and each node's allowed tokens
            n = self.spec_cfg.budget_for(b) + 1
            tree = ddtree.Tree(tokens=i32(b, n), parent=i32(b, n), depth=i32(b, n),
                               score=jax.ShapeDtypeStruct((b, n), jnp.float32),
                               valid=jax.ShapeDtypeStruct((b, n), jnp.bool_),
                               ancestors=jax.ShapeDtypeStruct((b, n, n), jnp.bool_),
                               max_depth=self.dcfg.block_size - 1)
            shapes += (tree, jax.ShapeDtypeStruct((b, n, -(-self.cfg.vocab_size // 32)), jnp.uint32))
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), shapes)

    def packing(self, kind: str, b: int) -> Packing:
        """The layout of a ``kind`` step's host inputs at bucket ``b`` in its one int32 buffer."""
        key = (kind, b)
        if key not in self._packings:
            self._packings[key] = Packing.of(self._shapes(kind, b))
        return self._packings[key]

    def pack(self, kind: str, b: int, *inputs) -> np.ndarray:
        """A step's host inputs ``(inp, samp[, targets])`` -> the int32 buffer its executable takes (``[size]``, or
        ``[dp, size]``)."""
        return self.packing(kind, b).pack(tuple(inputs))

    @property
    def spec_budgets(self) -> dict[int, int]:
        """DDTree node budget per decode bucket (``SpecConfig.max_verify_tokens`` lowers it at large buckets)."""
        return {} if self.spec_cfg is None else {b: self.spec_cfg.budget_for(b) for b in self.decode_buckets}

    def _lower(self, kind: str, b: int):
        if kind.startswith("advance_"):
            return self._lower_advance(kind.removeprefix("advance_"), b)
        spec_body = {"spec": spec_step, "draft": draft_step, "spec_masked": masked_verify_step}.get(kind)
        body = (functools.partial(spec_body, self.cfg, self.dcfg, self.spec_cfg.for_batch(b)) if spec_body
                else functools.partial(step, self.cfg, self.dcfg, query_tail=self.query_tail))
        packing = self.packing(kind, b)

        def packed(params, dparams, state, dkv, buf):
            return body(params, dparams, state, dkv, *packing.unpack(buf))

        lead = () if self.dp == 1 else (self.dp,)
        buf = jax.ShapeDtypeStruct(lead + (packing.size,), jnp.int32)
        return self.compile_step(packed, inputs=1).lower(self.target.params, self.dparams, self.state, self.dkv, buf)

    def _kinds(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        kinds = (("prefill", self.prefill_buckets), ("decode", self.decode_buckets))
        if self.options.prompt_logprobs:
            kinds += (("score", (1,)),)
        if self.spec_cfg is not None:
            kinds += (("spec", self.decode_buckets),)
            if self.options.structured_spec:
                kinds += (("draft", self.decode_buckets), ("spec_masked", self.decode_buckets))
        if self.overlap:  # the device-side carries of chained steps (tiny)
            kinds += (("advance_decode", self.decode_buckets),)
            if self.spec_cfg is not None:
                kinds += (("advance_spec", self.decode_buckets),)
        return kinds

    def warmup(self, progress: Callable[[str, float], None] | None = None,
               workers: int | None = None) -> dict[str, float]:
        """Compile every bucket ahead of time; returns seconds per bucket.

        Lowering (Python tracing) runs in this thread; XLA compilations run concurrently on
        ``workers`` threads (default ``compile.warmup_workers``: one per CPU core, up to the number of buckets;
        one on the CPU backend with the persistent compilation cache on).
        """
        todo = [(kind, b) for kind, buckets in self._kinds() for b in buckets if (kind, b) not in self._exec]
        if not todo:
            return dict(self.warmup_report)
        t0 = time.perf_counter()
        lowered = {key: self._lower(*key) for key in todo}
        self.warmup_report["lower_s"] = self.warmup_report.get("lower_s", 0.0) + time.perf_counter() - t0

        def build(key):
            t0 = time.perf_counter()
            exe = lowered[key].compile()
            return key, exe, time.perf_counter() - t0

        # the slot writers, compiled by a harmless write of the null slot (padding rows: never read); the slot copy
        # serves cached prefixes and groups (the API's n)
        self._copy_slot(0, 0)
        if self.state.pen is not None:
            v, null = self.cfg.vocab_size, np.zeros(1 if self.dp == 1 else 2, np.int32)
            allow = np.full(-(-v // 32), 0xFFFFFFFF, np.uint32)
            self._set_penalty_row(null, np.zeros(v, np.bool_), np.zeros(v, np.float32), allow)
            self._set_allow(null, allow)
        if self.kvf is not None and "kvflash" not in self.warmup_report:
            t0 = time.perf_counter()
            self.kvf.warmup(self.state, self.dkv)
            self.kvflash_prewarm = self.kvf.prewarm(self.state, self.dkv, self.options.kvflash_host_prewarm_gb * 2**30)
            if self.kvb is not None:  # a query push per step shape that returns queries
                t = min(self.query_tail, self.options.prefill_chunk)
                self.kvb.warmup(self.state, [(b, 1) for b in self.decode_buckets]
                                + [(b, t) for b in self.prefill_buckets])
            self.warmup_report["kvflash"] = time.perf_counter() - t0
        n = workers or compile_mod.warmup_workers(len(todo))
        hits0 = compile_mod.compile_cache_hits()
        with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
            for key, exe, dt in pool.map(build, todo):
                self._exec[key] = exe
                self.warmup_report[f"{key[0]}.b{key[1]}"] = dt
                if progress:
                    progress(f"{key[0]}.b{key[1]}", dt)
        # executables the persistent compilation cache supplied (enable_compile_cache / JAX_COMPILATION_CACHE_DIR)
        self.warmup_report["cache_hits"] = (self.warmup_report.get("cache_hits", 0)
                                            + compile_mod.compile_cache_hits() - hits0)
        return dict(self.warmup_report)

    # ---- submission -------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer.json: pass prompts as token-id lists")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise RequestError("prompt is empty")
        v = self.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= v:
            raise RequestError(f"prompt token ids must be in [0, {v})")
        return ids

    def submit(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams()) -> int:
        """Queue a request; returns its id. Raises RequestError for what can never be served."""
        sampling.validate()
        if sampling.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        ids = self.encode(prompt)
        v = self.cfg.vocab_size
        if any(not isinstance(t, (int, np.integer)) or not 0 <= t < v for t in sampling.stop_token_ids):
            raise RequestError(f"stop_token_ids must be token ids in [0, {v}), got {list(sampling.stop_token_ids)}")
        if sampling.penalized and not self.options.sampling_penalties:
            raise RequestError("this engine was built without sampling penalties (sampling_penalties=False): "
                               "repetition / frequency / presence penalties and logit_bias are not available")
        if any(not isinstance(t, (int, np.integer)) or not 0 <= t < v for t, _ in sampling.logit_bias):
            raise RequestError(f"logit_bias keys must be token ids in [0, {v})")
        if sampling.prompt_logprobs is not None and not self.options.prompt_logprobs:
            raise RequestError("prompt logprobs need an engine built with prompt_logprobs=True "
                               "(serve: --enable-prompt-logprobs)")
        matcher = self.start_constraint(sampling.constraint) if sampling.constraint is not None else None
        if sampling.min_tokens and len(self._banned(sampling)) > MAX_BANNED:
            raise RequestError(f"min_tokens bans the stop and EOS token ids until it is reached, which works for at "
                               f"most {MAX_BANNED} distinct ids; this request has {len(self._banned(sampling))}")
        total = len(ids) + sampling.max_tokens
        if total > self.options.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} exceeds "
                               f"max_model_len {self.options.max_model_len}")
        if self.pages.pages_needed(total) * self.pages.page_size > self.pages.capacity_tokens:
            raise RequestTooLarge(f"request needs {total} tokens of KV but the whole pool holds "
                                  f"{self.pages.capacity_tokens}")
        rid = next(self._ids)
        seed = sampling.seed if sampling.seed is not None else rid
        stats = RequestStats(time.perf_counter())
        # min_tokens bans exist on the AR path only (penalties and biases apply per tree node; constraints too with
        # structured_spec)
        if (self.spec_cfg is not None and not sampling.min_tokens
                and (sampling.constraint is None or self.options.structured_spec)):
            stats.spec_mode = "ddtree"
        r = _Request(rid, ids, sampling, seed, stats, matcher=matcher)
        if sampling.prompt_logprobs is not None:
            r.prompt_lp, r.prompt_top, r.prompt_rank = [None], [[]], [None]
        at = len(self.waiting)  # behind every waiting request of the same or a more urgent priority
        while at > 0 and self.waiting[at - 1].sp.priority > sampling.priority:
            at -= 1
        self.waiting.insert(at, r)
        return rid

    def submit_group(self, prompt: str | Sequence[int], samplings: Sequence[SamplingParams]) -> list[int]:
        """Queue ``len(samplings)`` requests over one prompt (the API's ``n``); returns their ids. The prompt
        prefills once: the first request prefills to the last page boundary before the prompt's last token, the
        others then start there from a copy of its recurrent state over its KV pages (shared, read-only), each
        prefilling the rest (under a page) itself and sampling with its own settings. The group is admitted
        together. Requests that cannot share (one request, a prompt under two pages, KVFlash, prompt logprobs, more
        requests than a replica's slots) are queued as separate submits."""
        rids: list[int] = []
        try:
            for sp in samplings:
                rids.append(self.submit(prompt, sp))
        except Exception:
            for rid in rids:
                self.abort(rid)
            raise
        mine = set(rids)
        reqs = [r for r in self.waiting if r.rid in mine]  # queued one behind another: same priority
        ps, chunk = self.pools[0].page_size, self.options.prefill_chunk
        # batch_invariant: at a chunk boundary, so every member prefills in the chunks it would alone (same arithmetic)
        unit = chunk if self.options.batch_invariant else ps
        fork_at = (len(reqs[0].prompt) - 1) // unit * unit if reqs else 0
        pool = self.pools[0]
        if (len(reqs) < 2 or fork_at < ps or fork_at % ps or self.kvf is not None
                or len(reqs) > self.options.max_batch // self.dp or any(r.prompt_lp is not None for r in reqs)
                or sum(pool.pages_needed(self._need(r)) for r in reqs) > pool.n_pages - 1):  # never fits at once
            return rids
        leader, sibs = reqs[0], reqs[1:]
        leader.fork_at, leader.siblings = fork_at, sibs
        for s in sibs:
            s.leader = leader
        self.counters["groups"] += 1
        return rids

    def start_constraint(self, c: Constraint) -> Matcher:
        """A fresh matcher of ``c`` (its automaton is built on first use and cached: the server builds it off the
        engine thread first). Raises RequestError for a constraint that cannot be built."""
        if self.tokenizer is None:
            raise RequestError("structured output needs the model's tokenizer (tokenizer.json)")
        try:
            with self._structured_lock:
                if self.structured is None:
                    self.structured = Structured(self.tokenizer, self.cfg.vocab_size, self.eos_token_ids)
            return self.structured.start(c)
        except StructuredError as e:
            raise RequestError(str(e)) from None

    def _banned(self, sp: SamplingParams) -> tuple[int, ...]:
        """Token ids that end the request (banned from sampling until min_tokens), without duplicates."""
        return tuple(dict.fromkeys(tuple(int(t) for t in sp.stop_token_ids)
                                   + (() if sp.ignore_eos else self.eos_token_ids)))

    def abort(self, rid: int) -> bool:
        """Cancel a request (waiting or running); frees its pages and slot at once."""
        for r in list(self.waiting):
            if r.rid == rid:
                self.waiting.remove(r)
                self._ungroup(r)
                return True
        r = self.running.get(rid)
        if r is None:
            return False
        r.finish = "abort"
        self._free(r)
        return True

    def _ungroup(self, r: _Request) -> None:
        """``r`` leaves its group before the fork: a sibling is dropped from its leader's list; a leader's parked
        siblings go on alone (they were admitted with full reservations: they prefill the whole prompt)."""
        if r.leader is not None:
            r.leader.siblings.remove(r)
            r.leader = None
        for s in r.siblings:
            s.leader = None
        r.siblings = []

    def has_work(self) -> bool:
        """Requests are waiting or running (``step()`` has something to do)."""
        return bool(self.waiting or self.running)

    # ---- one iteration --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit, prefill one chunk, decode one token; returns the requests that changed."""
        t0 = time.perf_counter()
        if self.turns is not None:
            self.turns.engine_busy(True)
        try:
            return self._step()
        finally:
            self.step_seconds["step"] += time.perf_counter() - t0
            if self.turns is not None:
                self.turns.engine_busy(self.has_work())

    def _step(self) -> list[RequestOutput]:
        self._admit()
        changed: dict[int, _Request] = {}
        pre, last, score = self._prefill_rows()
        if self._inflight is not None:
            nxt = None if (pre or last or score) else self._chain()
            for r in self._apply(self._inflight, chained=nxt is not None):
                changed[r.rid] = r
            self._inflight = nxt
            if nxt is not None:
                return self._outputs(changed)
        first: set[int] = set()  # rows whose prefill ended this step (their first token): they decode next step
        for kind, rows in (("prefill", pre), ("score", score)):
            if rows:
                for r in self._prefill(rows, kind):
                    changed[r.rid] = r
                    first.add(r.rid)
        dec = [r for r in self.running.values() if r.decoding and r.rid not in first]
        last = [r for r in last if r.finish is None and self.running.get(r.rid) is r]  # a failed prefill frees rows
        if self.options.cohort_reprobe_tokens:
            for r in dec:
                st = r.stats
                if st.spec_mode == "yielded" and len(r.tokens) - st.yielded_at >= st.reprobe_after:
                    st.spec_mode, st.probe_base = "ddtree", st.spec_steps
                    st.reprobes += 1
                    self.counters["cohort_reprobe"] += 1
        spec = self._take([r for r in dec if r.stats.spec_mode == "ddtree"], self.decode_buckets[-1])
        ar = self._take([r for r in dec if r.stats.spec_mode != "ddtree"] + last, self.decode_buckets[-1])
        # one kind of step in flight at a time: with both kinds to run, both are applied now
        keep = self.overlap and not (spec and ar)
        for kind, rows in (("spec", spec), ("decode", ar)):
            if rows:
                inf = self._dispatch_spec(rows) if kind == "spec" else self._dispatch_decode(rows)
                if inf is None:
                    continue
                if keep:
                    self._inflight = inf
                else:
                    for r in self._apply(inf, chained=False):
                        changed[r.rid] = r
        return self._outputs(changed)

    def _prefill_rows(self) -> tuple[list[_Request], list[_Request], list[_Request]]:
        """(rows for this step's prefill call, prompts' last tokens for the AR decode call, rows for its scoring
        call).

        Rows with more than one prompt token left come first, a prefill bucket's worth per replica. A prompt's last
        token (T = 1; under bounds / shadow scoring every prompt ends with one, see ``_chunk_end``) rides in the
        prefill call only in a row its bucket pads anyway; otherwise it runs in the decode call, where a row costs
        one token rather than a prefill chunk's worth of positions. Prompts whose logprobs are wanted prefill in the
        scoring call, one per replica, until their last token (whose logits give no prompt logprob)."""
        todo, scoring = [], []
        for r in self.running.values():
            if r.cursor < len(r.prompt) and r.leader is None:
                (scoring if r.prompt_lp is not None and len(r.prompt) - r.cursor > 1 else todo).append(r)
        pre = self._take([r for r in todo if len(r.prompt) - r.cursor > 1], self.prefill_buckets[-1])
        per = collections.Counter(r.replica for r in pre)
        spare = {k: self._bucket(self.prefill_buckets, n) - n for k, n in per.items()}
        last = []
        for r in todo:
            if len(r.prompt) - r.cursor == 1:
                if spare.get(r.replica, 0) > 0 and not self.options.batch_invariant:
                    spare[r.replica] -= 1
                    pre.append(r)
                else:
                    last.append(r)
        return pre, self._take(last, self.decode_buckets[-1]), self._take(scoring, 1)

    def _outputs(self, changed: dict[int, "_Request"]) -> list[RequestOutput]:
        now = time.perf_counter()
        for r in self._failed:
            changed.setdefault(r.rid, r)
        self._failed = []
        for r in changed.values():
            if r.finish is not None:
                r.stats.finished = r.stats.finished or now
        outs = [self._output(r) for r in changed.values()]
        for r in changed.values():
            if r.finish is not None:
                self._free(r)
        return outs

    def _take(self, rows: list[_Request], per_replica: int) -> list[_Request]:
        """The first rows, at most ``per_replica`` of each replica (a bucket's worth each)."""
        n = [0] * self.dp
        out = []
        for r in rows:
            if n[r.replica] < per_replica:
                n[r.replica] += 1
                out.append(r)
        return out

    def _need(self, r: _Request) -> int:
        """KV tokens to reserve at admission."""
        return (len(r.prompt) + r.sp.max_tokens + (self.spec_span if r.stats.spec_mode == "ddtree" else 0)
                + self.ahead)

    def _fits(self, k: int, needs: list[int], n_prefix: int) -> bool:
        """Whether replica ``k`` can admit requests of ``needs`` tokens (the first over ``n_prefix`` cached pages)."""
        pool = self.pools[k]
        if len(needs) == 1:  # (a KVFlash Residency pool: single requests only)
            return pool.can_admit(needs[0], n_prefix) if n_prefix else pool.can_admit(needs[0])
        return pool.can_admit_all(needs, n_prefix)

    def _admit(self) -> None:
        while self.waiting:
            r = self.waiting[0]
            group = [r] + r.siblings  # a group's siblings queue right behind its leader and come in with it
            needs = [self._need(x) for x in group]
            with_slot = [k for k in range(self.dp) if len(self.replica_slots[k]) >= len(group)]
            if not with_slot:
                break
            hits = ([c.lookup(r.prompt) for c in self.prefix_caches] if self.prefix_caches and r.prompt_lp is None
                    else [None] * self.dp)
            n_prefix = [len(h.pages) if h is not None else 0 for h in hits]
            fits = [k for k in with_slot if self._fits(k, needs, n_prefix[k])]
            if not fits and self.prefix_caches:  # cached prefixes give their pages back, on one replica
                for k in sorted(with_slot, key=lambda k: (-n_prefix[k], -len(self.replica_slots[k]), k)):
                    if self.prefix_caches[k].make_room(needs, keep=hits[k]):
                        fits = [k]
                        break
            if not fits:
                self.counters["admission_deferred"] += 1
                break  # FIFO: wait for pages to free up
            # the replica holding the longest cached prefix, then the least loaded
            k = max(fits, key=lambda k: (n_prefix[k], len(self.replica_slots[k]), -k))
            hit = hits[k]
            for s, need in zip(group[1:], needs[1:]):
                self.waiting.remove(s)
                self.pools[k].admit(s.rid, need)
                s.replica, s.slot = k, self.replica_slots[k].pop(0)
                self._started(s)
            need = needs[0]
            self.waiting.popleft()
            if hit is not None:
                self.pools[k].admit(r.rid, need, hit.pages)
            else:
                self.pools[k].admit(r.rid, need)
            r.replica, r.slot = k, self.replica_slots[k].pop(0)
            if hit is not None:  # start from the cached prefix: its pages, and its state copied into the slot
                self.prefix_caches[k].use(hit)
                self._copy_slot(hit.snapshot, r.slot, k)
                r.cursor = r.stats.cached_tokens = hit.n_tokens
                self.counters["prefix_cache_hits"] += 1
                self.counters["prefix_cached_tokens"] += hit.n_tokens
            self._started(r)
            if r.siblings and r.cursor >= r.fork_at:  # the cached prefix reaches the fork point
                self._fork(r)

    def _started(self, r: _Request) -> None:
        if r.sp.penalized:
            self._start_penalties(r)
        r.stats.admitted = time.perf_counter()
        self.running[r.rid] = r

    def _fork(self, leader: _Request) -> None:
        """The leader's prefill reached its fork point: each parked sibling starts there, over the leader's pages
        (shared) with a copy of its recurrent slot (dispatched after the step that wrote it)."""
        pool = self.pools[leader.replica]
        prefix = pool.pages_of(leader.rid)[: leader.fork_at // pool.page_size]
        for s in leader.siblings:
            pool.attach(s.rid, prefix)
            self._copy_slot(leader.slot, s.slot, leader.replica)
            s.cursor = s.stats.cached_tokens = leader.fork_at
            s.leader = None
            self.counters["forked_tokens"] += leader.fork_at
        leader.siblings = []

    def _start_penalties(self, r: _Request) -> None:
        """Write the request's row of the slots' penalty tables: nothing generated yet, its prompt, its biases."""
        v = self.cfg.vocab_size
        prompt = np.zeros(v, np.bool_)
        prompt[r.prompt] = True
        bias = np.zeros(v, np.float32)
        for t, b in r.sp.logit_bias:
            bias[t] += b
        allow = r.matcher.mask() if r.matcher is not None else np.full(-(-v // 32), 0xFFFFFFFF, np.uint32)
        self._set_penalty_row(self._pen_at(r), prompt, bias, allow)

    def _pen_at(self, r: _Request) -> np.ndarray:
        return np.array([r.slot] if self.dp == 1 else [r.replica, r.slot], np.int32)

    def _advance_constraint(self, r: _Request, tok: int) -> None:
        """Move a constrained request's automaton past ``tok`` and write what it allows next."""
        try:
            r.matcher.advance(tok)
            allow = r.matcher.mask()
        except Exception as e:  # noqa: BLE001 - a token the automaton refuses: fail this request alone
            self._fail(r, f"structured output: the automaton refused token {tok}: {e}")
            return
        self._set_allow(self._pen_at(r), allow)

    def _update(self, name: str, part: str, fn: Callable, args: tuple) -> None:
        """Replace ``self.state.<part>`` by ``fn(part, *args)``, compiled once per engine (kept with the step
        executables as ``(name, 1)``), the part donated and kept in its sharding."""
        exe = self._exec.get((name, 1))
        old = getattr(self.state, part)
        if exe is None:
            sh = None if self.layout is None else getattr(self.layout.state(self.state), part)
            specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), args)
            exe = self._exec[(name, 1)] = jax.jit(fn, donate_argnums=(0,), out_shardings=sh).lower(
                old, *specs).compile()
        self.state = dataclasses.replace(self.state, **{part: exe(old, *args)})

    def _set_penalty_row(self, at: np.ndarray, prompt: np.ndarray, bias: np.ndarray, allow: np.ndarray) -> None:
        """``SlotPenalties.set_row`` of row ``at`` (``[slot]`` or ``[replica, slot]``)."""
        self._update("set_row", "pen", lambda pen, at, p, b, a: pen.set_row(tuple(at), p, b, a),
                     (at, prompt, bias, allow))

    def _set_allow(self, at: np.ndarray, allow: np.ndarray) -> None:
        self._update("set_allow", "pen", lambda pen, at, a: pen.set_allow(tuple(at), a), (at, allow))

    def _free(self, r: _Request) -> None:
        self._ungroup(r)
        if r.rid in self.running:
            del self.running[r.rid]
            if self.kvf is not None:
                self._kv_snapshot(r)
                self._dispatched_version.pop(r.rid, None)
            self.pools[r.replica].release(r.rid)
            self.replica_slots[r.replica].append(r.slot)
            self.replica_slots[r.replica].sort()
            r.stats.finished = r.stats.finished or time.perf_counter()

    def _by_replica(self, rows: list[_Request], buckets: tuple[int, ...], make: Callable):
        """Step inputs of ``rows``: ``make(replica, row indices, bucket)`` builds one replica's padded inputs; with
        dp > 1 they are stacked on a leading ``[dp]`` axis. Returns ``(bucket, inputs, take)`` where
        ``take(outputs)`` puts each output row back in the order of ``rows``."""
        groups = [[i for i, r in enumerate(rows) if r.replica == k] for k in range(self.dp)]
        b = self._bucket(buckets, max(len(g) for g in groups))
        parts = [make(k, g, b) for k, g in enumerate(groups)]
        if self.dp == 1:
            return b, parts[0], lambda out: out
        ks = np.zeros(len(rows), np.int32)
        js = np.zeros(len(rows), np.int32)
        for k, g in enumerate(groups):
            ks[g], js[g] = k, np.arange(len(g))
        inputs = jax.tree_util.tree_map(lambda *a: np.stack(a), *parts)
        return b, inputs, lambda out: jax.tree_util.tree_map(lambda a: a[ks, js], out)

    def _bucket(self, buckets: tuple[int, ...], n: int) -> int:
        return next(b for b in buckets if b >= n)

    def _run(self, kind: str, rows: list[_Request], tokens: np.ndarray, n_valid: np.ndarray,
             start: np.ndarray, targets: np.ndarray | None = None) -> "_InFlight":
        """Dispatch a prefill chunk, scoring chunk (``targets`` [rows, T]: each position's next prompt token, -1
        none) or decode step over ``rows`` (not waiting for it)."""
        t = tokens.shape[1]

        def make(k: int, g: list[int], b: int):
            n = len(g)
            tok = np.zeros((b, t), np.int32)
            tok[:n] = tokens[g]
            nv = np.zeros(b, np.int32)
            nv[:n] = n_valid[g]
            pos = np.zeros((b, t), np.int32)
            pos[:n] = start[g][:, None] + np.arange(t, dtype=np.int32)[None]
            slots = np.zeros(b, np.int32)
            slots[:n] = [rows[i].slot for i in g]
            table = self.pools[k].page_tables([rows[i].rid for i in g] + [None] * (b - n), self.width)
            inp = StepInput(tokens=tok, positions=pos, n_valid=nv, slots=slots, page_table=table)
            if targets is None:
                return inp, self._row_sampling([rows[i] for i in g], b)
            tg = np.full((b, t), -1, np.int32)
            tg[:n] = targets[g]
            return inp, self._row_sampling([rows[i] for i in g], b), tg

        buckets = {"prefill": self.prefill_buckets, "score": (1,)}.get(kind, self.decode_buckets)
        b, inputs, take = self._by_replica(rows, buckets, make)
        return self._dispatch(kind, b, rows, *inputs, take=take)

    def _dispatch(self, kind: str, b: int, rows: list["_Request | None"], inp, samp, *extra,
                  take=None) -> "_InFlight":
        """Dispatch a step from its host inputs (one packed transfer); ``extra``: a scoring step's targets, a masked
        verify's trees and masks."""
        start = inp.start if kind in SPEC_KINDS else inp.positions[..., 0]
        return self._dispatch_packed(kind, b, rows, self.pack(kind, b, inp, samp, *extra), start, samp.step, take)

    def _dispatch_packed(self, kind: str, b: int, rows: list["_Request | None"], buf, start, step,
                         take=None) -> "_InFlight":
        """Dispatch a step from its packed input buffer (host, or device for a chained step); ``start`` / ``step``
        [b]: the rows' first positions and tokens generated before it."""
        fn = self._exec.get((kind, b))
        if fn is None:
            self.counters["lazy_compiles"] += 1
            fn = self._exec[(kind, b)] = self._lower(kind, b).compile()
        t0 = time.perf_counter()
        self.state, self.dkv, out = fn(self.target.params, self.dparams, self.state, self.dkv, buf)
        self.counters[f"{kind}_steps"] += 1
        if self.turns is not None:
            self.turns.engine_dispatched()
        return _InFlight(kind, b, list(rows), out, start, step, t0, take)

    def _fetch(self, inf: "_InFlight", done: bool = True):
        """Wait for a dispatched step; its outputs on the host, rows in ``inf.rows`` order. A step's target queries
        (bounds / shadow scoring) stay on the device: they go to ``DeviceScorer.push``. ``done``: the step's KVFlash
        pins are released (not after a draft step: its verify step reads the same pages)."""
        query = getattr(inf.out, "query", None)
        if query is not None:
            out = dataclasses.replace(to_host(dataclasses.replace(inf.out, query=None)), query=query)
        else:
            out = to_host(inf.out)
        self.step_seconds[inf.kind] += time.perf_counter() - inf.t0
        if done:
            self._kv_done()
        return inf.take(out) if inf.take is not None else out

    def _row_sampling(self, rows: list["_Request | None"], b: int) -> SamplingArrays:
        return SamplingArrays.from_rows(
            [RowSampling() if r is None else
             RowSampling(r.sp.temperature, r.sp.top_k, r.sp.top_p, r.seed, len(r.tokens), r.sp.min_tokens,
                         self._banned(r.sp), r.sp.repetition_penalty, r.sp.frequency_penalty, r.sp.presence_penalty,
                         r.sp.penalized, r.sp.min_p, r.sp.logprobs) for r in rows], b)

    @staticmethod
    def _proposal(oracle, r: _Request, depth: int) -> list[int]:
        """``spec_oracle``'s proposal for a row, checked to be ``depth`` (block_size - 1) token ids."""
        ids = [int(t) for t in oracle(r.prompt, r.tokens)]
        if len(ids) != depth:
            raise ValueError(f"spec_oracle returned {len(ids)} token ids after {len(r.tokens)} tokens; it must "
                             f"return block_size - 1 = {depth}")
        return ids

    def _dispatch_spec(self, rows: list[_Request]) -> "_InFlight | None":
        """Dispatch one speculative round for every row (KVFlash may defer some: None when none runs)."""
        rows = self._reside(rows, [(r.n_cached, r.n_cached + self.spec_span) for r in rows])
        if not rows:
            return None
        oracle, depth = self.options.spec_oracle, self.dcfg.block_size - 1

        def make(k: int, g: list[int], b: int):
            rs = [rows[i] for i in g]
            pad = b - len(rs)
            inp = SpecInput(root=np.array([r.tokens[-1] for r in rs] + [0] * pad, np.int32),
                            start=np.array([r.n_cached for r in rs] + [0] * pad, np.int32),
                            slots=np.array([r.slot for r in rs] + [0] * pad, np.int32),
                            active=np.array([True] * len(rs) + [False] * pad),
                            page_table=self.pools[k].page_tables([r.rid for r in rs] + [None] * pad, self.width),
                            proposal=None if oracle is None else np.array(
                                [self._proposal(oracle, r, depth) for r in rs] + [[0] * depth] * pad, np.int32))
            return inp, self._row_sampling(rs, b)

        b, (inp, samp), take = self._by_replica(rows, self.decode_buckets, make)
        if not (self.options.structured_spec and any(r.matcher is not None for r in rows)):
            return self._dispatch("spec", b, rows, inp, samp, take=take)
        tree = self._fetch(self._dispatch("draft", b, rows, inp, samp), done=False)  # per replica: [b, ...] or [dp, b, ...]
        t0 = time.perf_counter()
        allow = self._node_allow(rows, tree, b)
        self.step_seconds["tree_masks"] += time.perf_counter() - t0
        return self._dispatch("spec_masked", b, rows, inp, samp, tree, allow, take=take)

    def _node_allow(self, rows: list[_Request], tree: ddtree.Tree, b: int) -> np.ndarray:
        """Every tree node's allowed next tokens ``[b, N, V/32]`` (``[dp, b, N, V/32]``): a constrained row's from its
        automaton along the tree (``Matcher.tree_masks``), all ones elsewhere. Rows are in ``_by_replica`` order."""
        n = tree.tokens.shape[-1]
        allow = np.full(((self.dp,) if self.dp > 1 else ()) + (b, n, -(-self.cfg.vocab_size // 32)), 0xFFFFFFFF,
                        np.uint32)
        j = collections.Counter()
        for r in rows:
            at = (r.replica, j[r.replica]) if self.dp > 1 else (j[r.replica],)
            j[r.replica] += 1
            if r.matcher is not None:
                allow[at] = r.matcher.tree_masks(tree.tokens[at], tree.parent[at], tree.valid[at])
        return allow

    def _dispatch_decode(self, rows: list[_Request]) -> "_InFlight | None":
        rows = self._reside(rows, [(r.n_cached, r.n_cached + 1) for r in rows])
        if not rows:
            return None
        toks = np.array([[r.tokens[-1] if r.tokens else r.prompt[r.cursor]] for r in rows], np.int32)
        start = np.array([r.n_cached for r in rows], np.int32)
        return self._run("decode", rows, toks, np.ones(len(rows), np.int32), start)

    # ---- overlap: the next step dispatched from the device outputs of the one in flight ----------------
    def _chain(self) -> "_InFlight | None":
        """Dispatch the step after the one in flight over the same bucket rows, its roots / positions / sampling
        counters computed on the device from the in-flight outputs; None when the rows to run changed (a row to
        prefill or to join, a mode switch, a smaller bucket would do): the in-flight step is then applied first."""
        inf = self._inflight
        live = [r if r is not None and r.finish is None and r.rid in self.running else None for r in inf.rows]
        n_live = sum(r is not None for r in live)
        dec = [r for r in self.running.values() if r.decoding]
        want = "spec" if inf.kind == "spec" else "decode"
        if (n_live == 0 or inf.kind == "spec_masked" or len(dec) != n_live or self._bucket(self.decode_buckets, n_live) != inf.b
                # a cohort's probe round is in flight: the cohort-yield guard decides on it before the next round
                or (want == "spec" and self.options.cohort_yield_min > 0
                    and any(r.stats.spec_steps == r.stats.probe_base for r in dec))
                or any((r.stats.spec_mode == "ddtree") != (want == "spec") for r in dec)
                # a constrained request's next mask follows from the token in flight
                or any(r.matcher is not None for r in dec)
                or (self.options.cohort_reprobe_tokens and want == "decode" and any(
                    r.stats.spec_mode == "yielded" and len(r.tokens) + self.ahead - r.stats.yielded_at
                    >= r.stats.reprobe_after for r in dec))):
            return None
        b, span = inf.b, (self.spec_span if want == "spec" else 1)
        for r in live:  # the in-flight step may advance a row by up to `ahead` positions before this one writes
            if r is not None:
                self._grow(r, r.n_cached + self.ahead + span)
        pad = [None] * (b - len(live))
        slots = np.array([0 if r is None else r.slot for r in live] + [0] * len(pad), np.int32)
        table = self.pools[0].page_tables([None if r is None else r.rid for r in live] + pad, self.width)
        samp = self._row_sampling(live + pad, b)  # its `step` is computed on the device
        zeros = np.zeros(b, np.int32)  # root / start, tokens / positions: computed on the device too
        if want == "spec":
            inp = SpecInput(root=zeros, start=zeros, slots=slots,
                            active=np.array([r is not None for r in live + pad]), page_table=table)
            prev = (inf.out.bonus, inf.out.n_accepted)
        else:
            inp = StepInput(tokens=zeros[:, None], positions=zeros[:, None],
                            n_valid=np.array([int(r is not None) for r in live + pad], np.int32), slots=slots,
                            page_table=table)
            prev = (inf.out.tokens,)
        buf, start, step = self._advance(want, b)(*prev, inf.start, inf.step, self.pack(want, b, inp, samp))
        self.counters["chained_steps"] += 1
        return self._dispatch_packed(want, b, live, buf, start, step)

    def _advance(self, kind: str, b: int) -> Callable:
        """The device-side carry from a step's outputs to the next step's inputs (compiled per bucket)."""
        fn = self._exec.get((f"advance_{kind}", b))
        if fn is None:
            fn = self._exec[(f"advance_{kind}", b)] = self._lower_advance(kind, b).compile()
        return fn

    def _lower_advance(self, kind: str, b: int):
        """``(*prev outputs, start, step, buf) -> (buf', start', step')``: the next step's packed inputs, its host
        fields as packed in ``buf`` and its root / tokens, positions and sampling counters from ``prev``."""
        sh = self.layout.per_replica() if self.layout is not None else None
        packing = self.packing(kind, b)
        i32 = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=sh)
        buf = jax.ShapeDtypeStruct((packing.size,), jnp.int32, sharding=sh)

        def carry(inp, samp, start, step):
            return packing.pack_jnp((inp, dataclasses.replace(samp, step=step))), start, step

        if kind == "spec":  # root <- bonus; start, tokens generated += tokens committed (root counted)
            def advance(bonus, n, start, step, buf):
                inp, samp = packing.unpack(buf)
                return carry(dataclasses.replace(inp, root=bonus, start=start + n), samp, start + n, step + n)
            return jax.jit(advance).lower(i32, i32, i32, i32, buf)

        def advance(tok, start, step, buf):  # tokens / positions [b, 1] of the next decode step
            inp, samp = packing.unpack(buf)
            inp = dataclasses.replace(inp, tokens=tok[:, None], positions=(start + 1)[:, None])
            return carry(inp, samp, start + 1, step + 1)
        return jax.jit(advance).lower(i32, i32, i32, buf)

    def _apply(self, inf: "_InFlight", chained: bool) -> list[_Request]:
        """Wait for a dispatched decode / speculative step and apply its tokens to the rows still running.
        ``chained``: the next step over these rows is already in flight, so pages it may write are kept."""
        out = self._fetch(inf)
        rows = [(i, r) for i, r in enumerate(inf.rows)
                if r is not None and r.finish is None and self.running.get(r.rid) is r]
        keep = self.ahead if chained else 0
        if inf.kind == "decode":
            if self.draft_scoring:  # decoding without drafting: no drafter query for these rows (LRU until next round)
                for _, r in rows:
                    self.pages.set_query(r.rid, None)
            if self.query_tail:
                self._push_queries(out.query, [(i, r, 1) for i, r in rows], rescore=False)
            for i, r in rows:
                if r.cursor < len(r.prompt):  # a prompt's last token: its first generated token
                    r.cursor += 1
                    r.stats.prefill_chunks += 1
                    r.stats.first_token = time.perf_counter()
                else:
                    r.stats.decode_steps += 1
                self._accept(r, out, i)
            return [r for _, r in rows]
        if self.draft_scoring and out.draft_query is not None:  # None for oracle rounds (nothing drafted)
            for i, r in rows:
                self.pages.set_query(r.rid, out.draft_query[i])
        cohort, emitted = [], 0
        for i, r in rows:
            n = int(out.n_accepted[i])
            burst = [int(t) for t in out.accepted[i, 1:n]] + [int(out.bonus[i])]
            lps = ([float(x) for x in out.logprobs[i, :n]] if r.sp.logprobs else [float("nan")] * n)
            tops = ([[(int(t), float(lp)) for t, lp in zip(out.top_ids[i, e], out.top_logprobs[i, e])]
                     for e in range(n)] if r.sp.logprobs else [[]] * n)
            st = r.stats
            st.spec_steps += 1
            st.draft_nodes += int(out.tree_nodes[i])
            st.accepted_tokens += n - 1
            st.emitted_spec += len(burst)
            st.rollback_mode = "fast-rollback" if self.options.spec.fast_rollback else "replay"
            for tok, lp, top in zip(burst, lps, tops):  # the decode contract, token by token; nothing past a stop
                self._accept_token(r, tok, lp, top)
                if r.finish is not None:
                    break
            if r.finish is None:
                self.pools[r.replica].truncate(r.rid, r.n_cached + keep)
            if st.spec_steps == st.probe_base + 1:  # first round since (re)entering DDTree
                cohort.append(r)
                emitted += len(burst)
        if cohort and self.options.cohort_yield_min > 0:
            mean = emitted / len(cohort)
            if mean < self.options.cohort_yield_min:
                self.counters["cohort_yield"] += 1
                for r in cohort:
                    st = r.stats
                    st.spec_mode, st.cohort_yield_mean, st.yielded_at = "yielded", mean, len(r.tokens)
                    st.reprobe_after = (self.options.cohort_reprobe_tokens if st.reprobes == 0
                                        else 2 * st.reprobe_after)
        return [r for _, r in rows]

    def _push_queries(self, query: jax.Array, rows: list[tuple[int, "_Request", int]], rescore: bool) -> None:
        """A step's target queries ``[b, T, L, H, D]`` (device) into the query windows of its rows ``(row, request,
        positions written)``; ``rescore``: re-rank those requests at the next step."""
        t0 = time.perf_counter()
        t = query.shape[1]
        slots, counts = [0] * query.shape[0], [0] * query.shape[0]
        for i, r, n in rows:
            slots[i], counts[i] = r.slot, min(t, n)
            self.pages.count_query(r.rid, counts[i], self.query_tail, rescore=rescore)
        self.kvb.push(query, slots, counts)
        self.step_seconds["kv_query"] += time.perf_counter() - t0

    def _cache_prefix(self, r: _Request) -> None:
        """Cache ``r``'s prompt up to its cursor when that is a chunk boundary not cached yet: hold its pages and
        snapshot its slot (the copy runs after the step that wrote them)."""
        cache = self.prefix_caches[r.replica]
        key = cache.wants(r.prompt, r.cursor)
        if key is None:
            return
        snap = cache.insert(key, r.cursor, self.pools[r.replica].pages_of(r.rid))
        if snap is not None:
            self._copy_slot(r.slot, snap, r.replica)

    def _copy_slot(self, src: int, dst: int, replica: int = 0) -> None:
        """Recurrent slot ``dst`` of ``replica`` becomes a copy of its slot ``src`` (conv and SSM state of every GDN
        layer; with data parallelism the state leads with the replica axis)."""
        at = lambda slot: np.array([slot] if self.dp == 1 else [replica, slot], np.int32)  # noqa: E731
        self._update("copy_slot", "rec", lambda rec, s, d: RecurrentSlots(
            tuple(c.at[tuple(d)].set(c[tuple(s)]) for c in rec.conv),
            tuple(x.at[tuple(d)].set(x[tuple(s)]) for x in rec.ssm)), (at(src), at(dst)))

    def _chunk_end(self, r: _Request) -> int:
        """End of ``r``'s next prefill chunk. With bounds / shadow scoring the prompt's last token runs as a chunk of
        its own: the chunk before it returns the queries of the prompt's end (a question) and its rescoring can page in
        what they attend to before the step that samples the first token."""
        end = min(len(r.prompt), r.cursor + self.options.prefill_chunk)
        if r.siblings and r.cursor < r.fork_at:
            end = min(end, r.fork_at)
        if self.query_tail and end == len(r.prompt) and end - r.cursor > 1:
            end -= 1
        return end

    def _prefill(self, rows: list[_Request], kind: str = "prefill") -> list[_Request]:
        """One prefill chunk of every row. When no row has more than one token in its chunk (under bounds / shadow
        scoring, a prompt two tokens from its end: ``_chunk_end`` splits them; prompts' last tokens go to the decode
        call, see ``_prefill_rows``), it runs on the decode executable (T = 1, the same step function) instead of the
        prefill one, whose ``prefill_chunk`` positions would all be computed for one. ``kind`` "score": the chunk also
        returns the log-probabilities of the prompt tokens that follow its positions (prompt logprobs)."""
        c = self.options.prefill_chunk
        rows = self._reside(rows, [(r.cursor, self._chunk_end(r)) for r in rows])
        if not rows:
            return []
        toks = np.zeros((len(rows), c), np.int32)
        nv = np.zeros(len(rows), np.int32)
        start = np.array([r.cursor for r in rows], np.int32)
        for i, r in enumerate(rows):
            part = r.prompt[r.cursor: self._chunk_end(r)]
            toks[i, : len(part)] = part
            nv[i] = len(part)
        if kind == "score":
            targets = np.full((len(rows), c), -1, np.int32)
            for i, r in enumerate(rows):
                nxt = r.prompt[r.cursor + 1: r.cursor + int(nv[i]) + 1]
                targets[i, : len(nxt)] = nxt
            out = self._fetch(self._run("score", rows, toks, nv, start, targets))
        elif int(nv.max()) == 1:
            out = self._fetch(self._run("decode", rows, toks[:, :1], nv, start))
        else:
            out = self._fetch(self._run("prefill", rows, toks, nv, start))
        done = []
        if self.query_tail:
            self._push_queries(out.query, [(i, r, int(nv[i])) for i, r in enumerate(rows)], rescore=True)
        for i, r in enumerate(rows):
            if kind == "score":
                k = r.sp.prompt_logprobs
                for j in range(min(int(nv[i]), len(r.prompt) - 1 - r.cursor)):
                    r.prompt_lp.append(float(out.prompt_logprobs[i, j]))
                    r.prompt_rank.append(int(out.prompt_ranks[i, j]))
                    r.prompt_top.append([(int(t), float(lp)) for t, lp in
                                         zip(out.prompt_top_ids[i, j, :k], out.prompt_top_logprobs[i, j, :k])])
            r.cursor += int(nv[i])
            r.stats.prefill_chunks += 1
            if self.prefix_caches:
                self._cache_prefix(r)
            if r.siblings and r.cursor >= r.fork_at:
                self._fork(r)
            if r.cursor == len(r.prompt):  # the chunk's last logits give the first generated token
                r.stats.first_token = time.perf_counter()
                self._accept(r, out, i)
                done.append(r)
        return done

    # ---- the decode contract ----------------------------------------------------------------------
    def _accept(self, r: _Request, out: StepOutput, row: int) -> None:
        if not r.sp.logprobs:  # the step computed log-probabilities only if some row wanted them
            self._accept_token(r, int(out.tokens[row]), float("nan"), [])
            return
        self._accept_token(r, int(out.tokens[row]), float(out.logprobs[row]),
                           [(int(t), float(lp)) for t, lp in zip(out.top_ids[row], out.top_logprobs[row])])

    def _accept_token(self, r: _Request, tok: int, logprob: float, top: list[tuple[int, float]]) -> None:
        """Apply one generated token: stop ids / EOS end the request without emitting the token."""
        n_before = len(r.tokens)
        if tok in r.sp.stop_token_ids or (not r.sp.ignore_eos and tok in self.eos_token_ids):
            if n_before >= r.sp.min_tokens:
                r.finish = "stop"
                return
        r.tokens.append(tok)
        r.logprobs.append(logprob)
        r.top.append(top)
        if r.matcher is not None:
            self._advance_constraint(r, tok)
            if r.finish is not None:
                return
        if r.sp.stop and self.tokenizer is not None:
            text = self._decoded(r)
            # an occurrence not seen before ends in the new token's text (or in the last character before it, which
            # may have been an incomplete one): search only from there
            start = max(0, r.stop_scan - max(map(len, r.sp.stop)))
            hits = [(i, s) for i, s in ((text.find(s, start), s) for s in r.sp.stop) if i >= 0]
            r.stop_scan = len(text)
            if hits:
                i, hit = min(hits)
                r.text = text[: i + len(hit) if r.sp.include_stop_str_in_output else i]
                r.finish = "stop"
                return
        if len(r.tokens) >= r.sp.max_tokens:
            r.finish = "length"

    def _kv_snapshot(self, r: _Request) -> None:
        """Copy the request's residency telemetry into its stats (kept after its pages are released)."""
        if r.rid not in self.pages:
            return
        st = self.pages.stats_of(r.rid)
        bpp = self.kvf.slab_bytes
        r.stats.kv = {"kv_pages_in": st.get("pages_in", 0), "kv_pages_out": st.get("pages_out", 0),
                      "kv_bytes_in": st.get("pages_in", 0) * bpp, "kv_bytes_out": st.get("pages_out", 0) * bpp,
                      "kv_clean_evictions": st.get("clean_evictions", 0), "kv_wait_s": r.kv_wait,
                      "kv_deferred_steps": st.get("deferred_steps", 0),
                      "kv_score_decisions": st.get("score_decisions", 0),
                      "kv_lru_decisions": st.get("lru_decisions", 0),
                      "kv_score_fallbacks": st.get("score_fallbacks", 0),
                      "kv_unscored_fallbacks": st.get("unscored_fallbacks", 0),
                      "kv_resident_pages": len(self.pages.resident_of(r.rid)),
                      "kv_logical_pages": self.pages.n_logical(r.rid)}

    def _decoded(self, r: _Request) -> str:
        """``tokenizer.decode(r.tokens)`` (with the request's ``skip_special_tokens``), decoding only the tokens past
        the last settled point: a prefix that ends on a character boundary decodes on its own to the same text, so
        the settled text is kept and a step decodes at most ~2 x DETOK_SETTLE tokens, not the whole reply."""
        tail = self.tokenizer.decode(r.tokens[r.dec_n:], skip_special_tokens=r.sp.skip_special_tokens)
        text = r.dec_text + tail
        if len(r.tokens) - r.dec_n >= DETOK_SETTLE and not tail.endswith("\ufffd"):  # not inside a character
            r.dec_n, r.dec_text = len(r.tokens), text
        return text

    def _output(self, r: _Request) -> RequestOutput:
        if self.kvf is not None:
            self._kv_snapshot(r)
        text = None
        if self.tokenizer is not None:
            text = r.text if r.text is not None else self._decoded(r)
        return RequestOutput(r.rid, r.prompt, list(r.tokens), text, r.finish, list(r.logprobs),
                             r.stats.as_dict(len(r.tokens)), list(r.top),
                             None if r.prompt_lp is None else list(r.prompt_lp),
                             None if r.prompt_top is None else list(r.prompt_top),
                             None if r.prompt_rank is None else list(r.prompt_rank))

    # ---- convenience APIs -------------------------------------------------------------------------
    def generate(self, prompts: Iterable[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams()) -> list[RequestOutput]:
        """Run a list of prompts to completion (all batched together); outputs in input order."""
        prompts = list(prompts)
        sps = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(sps) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(sps)} sampling params")
        ids: list[int] = []
        try:
            for p, s in zip(prompts, sps):
                ids.append(self.submit(p, s))
        except Exception:  # one bad prompt: leave none of this call's requests queued behind
            for rid in ids:
                self.abort(rid)
            raise
        final: dict[int, RequestOutput] = {}
        while len(final) < len(ids):
            for o in self.step():
                if o.finish_reason is not None:
                    final[o.request_id] = o
            if not self.has_work() and len(final) < len(ids):
                raise RuntimeError("engine went idle with requests unfinished")
        return [final[i] for i in ids]

    def stream(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams()) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (runs the loop in this thread).

        Other requests advance too (their outputs are not returned here: drive ``step()`` yourself to serve
        several). Closing the iterator early aborts the request and frees its pages and slot.
        """
        rid = self.submit(prompt, sampling)
        done = False
        try:
            while not done:
                for o in self.step():
                    if o.request_id == rid:
                        done = o.finish_reason is not None
                        yield o
                if not self.has_work():
                    return
        finally:
            if not done:
                self.abort(rid)

    def compile_count(self) -> int:
        return compile_mod.compile_count()
