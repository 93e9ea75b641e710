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
import time
from typing import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.engine import compile as compile_mod
from dflash_jax.engine.sampling import MAX_BANNED, RowSampling, SamplingArrays
from dflash_jax.config import DrafterConfig
from dflash_jax.engine.spec_steps import SpecConfig, SpecInput, spec_step
from dflash_jax.engine.steps import StepOutput, step_fn
from dflash_jax.kv import quant as kv_quant
from dflash_jax.kv.pages import PageAllocator, RequestTooLarge
from dflash_jax.models import quant
from dflash_jax.models.tokenizer import Tokenizer
from dflash_jax.state import DraftKV, EngineState, StepInput
from dflash_jax.target import Target, load_target

FinishReason = str  # "stop" | "length" | "abort"


class RequestError(ValueError):
    """A request this engine cannot serve as given; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. temperature 0 = greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False  # per-token logprobs wanted: such requests decode AR (speculative rounds return tokens)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")


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

    def as_dict(self, n_out: int) -> dict:
        ttft = None if self.first_token is None else self.first_token - self.arrival
        dec = (None if self.finished is None or self.first_token is None or n_out < 2
               else (self.finished - self.first_token) / (n_out - 1))
        return {"ttft_s": ttft, "tpot_s": dec, "queue_s": None if self.admitted is None else self.admitted - self.arrival,
                "prefill_chunks": self.prefill_chunks, "decode_steps": self.decode_steps,
                "e2e_s": None if self.finished is None else self.finished - self.arrival,
                "spec_mode": self.spec_mode, "draft_steps": self.spec_steps, "draft_nodes": self.draft_nodes,
                "accepted_tokens": self.accepted_tokens,
                "mean_accept_len": self.emitted_spec / self.spec_steps if self.spec_steps else None,
                "cohort_yield_mean": self.cohort_yield_mean}


@dataclasses.dataclass
class RequestOutput:
    """The result of one request (also the running snapshot while it streams)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: FinishReason | None
    logprobs: list[float]
    stats: dict
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Request:
    rid: int
    prompt: list[int]
    sp: SamplingParams
    seed: int
    stats: RequestStats
    slot: int = 0
    cursor: int = 0  # prompt tokens already prefilled
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    text: str | None = None  # set when a stop string ended the request: the text before it
    finish: FinishReason | None = None
    emitted: int = 0  # tokens handed to the caller so far

    @property
    def n_cached(self) -> int:
        """Tokens whose K/V and recurrent state are in the cache."""
        return self.cursor + max(0, len(self.tokens) - 1)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 8
    page_size: int = 16
    max_model_len: int = 2048
    n_pages: int | None = None  # default: enough for max_batch sequences of max_model_len
    prefill_chunk: int = 64
    prefill_batch: int = 2
    kv_dtype: str | None = None  # default: the params' dtype; "fp8" / "int8": quantized pages (per token-head scales)
    spec: SpecConfig | None = None  # DDTree speculative decoding (needs a drafter)
    cohort_yield_min: float = 6.0  # a cohort whose first round emits fewer tokens per request goes AR (0 = never)
    quantization: str | None = None  # "fp8": matmul weights of target and drafter in fp8 (quant.QuantizedWeight)


def _buckets(limit: int) -> tuple[int, ...]:
    out = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < limit]
    return tuple(out) + (limit,)


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
        if o.max_batch < 1 or o.prefill_batch < 1 or o.prefill_chunk < 1:
            raise ValueError("max_batch, prefill_batch and prefill_chunk must be >= 1")
        if o.max_model_len > target.config.max_position_embeddings:
            raise ValueError(f"max_model_len {o.max_model_len} exceeds the model's max_position_embeddings "
                             f"{target.config.max_position_embeddings}")
        if quant.check_quantization(o.quantization) is not None:  # no-op for leaves quantized at load
            target = dataclasses.replace(target, params=quant.quantize_params(target.params, o.quantization))
            if drafter is not None:
                drafter = (drafter[0], quant.quantize_params(drafter[1], o.quantization))
        self.target, self.cfg, self.tokenizer, self.options = target, target.config, tokenizer, o
        self.eos_token_ids = tuple(eos_token_ids if eos_token_ids is not None else
                                   dict.fromkeys(target.eos_token_ids + (tokenizer.eos_token_ids if tokenizer else ())))
        self.dcfg, self.dparams = drafter if drafter is not None else (None, None)
        self.spec_span = self.dcfg.block_size if o.spec is not None else 0  # positions a round may commit
        self.width = -(-(o.max_model_len + self.spec_span) // o.page_size)  # page-table width
        n_pages = o.n_pages or o.max_batch * self.width + 1
        self.pages = PageAllocator(n_pages, o.page_size)
        self.dtype = jnp.dtype(self.target.params["layers"][0]["mlp"]["gate"].dtype)
        self.kv_dtype = kv_quant.resolve_kv_dtype(o.kv_dtype, self.dtype)
        self.state = self.zero_state()
        self.dkv = (DraftKV.zeros(self.dcfg, n_pages, o.page_size, self.kv_dtype, self.dtype)
                    if self.dcfg is not None else None)
        self.free_slots = list(range(1, o.max_batch + 1))
        self.decode_buckets = _buckets(o.max_batch)
        self.prefill_buckets = _buckets(min(o.prefill_batch, o.max_batch))
        self._jit = step_fn(self.cfg, self.dcfg)
        self._spec_jit = (jax.jit(functools.partial(spec_step, self.cfg, self.dcfg, o.spec), donate_argnums=(2, 3))
                          if o.spec is not None else None)
        self._exec: dict[tuple[str, int], Callable] = {}
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: dict[int, _Request] = {}  # admitted, in prefill or decode
        self._ids = itertools.count()
        self.warmup_report: dict[str, float] = {}
        self.counters = collections.Counter()

    # ---- construction ---------------------------------------------------------------------------
    def zero_state(self) -> EngineState:
        """Empty device state of this engine's shapes (K/V pages in ``kv_dtype``, quantized for fp8 / int8)."""
        o = self.options
        return EngineState.zeros(self.cfg, n_pages=self.pages.n_pages, page_size=o.page_size,
                                 n_slots=o.max_batch + 1, dtype=self.dtype, kv_dtype=self.kv_dtype)

    @classmethod
    def from_pretrained(cls, target_path: str, dtype: str = "float32", warmup: bool = True,
                        drafter_path: str | None = None, **options) -> "Engine":
        """Load a target (and optionally a DFlash drafter) checkpoint; ``options`` are ``EngineOptions`` fields
        (``quantization="fp8"`` quantizes both as they load)."""
        q = options.get("quantization")
        target = load_target(target_path, dtype=dtype, quantization=q)
        drafter = None
        if drafter_path is not None:
            from dflash_jax.models.dflash_loader import load_drafter

            drafter = load_drafter(drafter_path, dtype=target.params["embed"].dtype, quantization=q)
        eng = cls(target, Tokenizer.from_dir(target_path), EngineOptions(**options), drafter=drafter)
        if warmup:
            eng.warmup()
        return eng

    def _shapes(self, kind: str, b: int):
        t = self.options.prefill_chunk if kind == "prefill" else 1
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        if kind == "spec":
            inp = SpecInput(root=i32(b), start=i32(b), slots=i32(b), active=jax.ShapeDtypeStruct((b,), jnp.bool_),
                            page_table=i32(b, self.width))
        else:
            inp = StepInput(tokens=i32(b, t), positions=i32(b, t), n_valid=i32(b), slots=i32(b),
                            page_table=i32(b, self.width))
        samp = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                      SamplingArrays.from_rows([], b))
        return inp, samp

    def _lower(self, kind: str, b: int):
        fn = self._spec_jit if kind == "spec" else self._jit
        return fn.lower(self.target.params, self.dparams, self.state, self.dkv, *self._shapes(kind, b))

    def _kinds(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        kinds = (("prefill", self.prefill_buckets), ("decode", self.decode_buckets))
        return kinds + ((("spec", self.decode_buckets),) if self._spec_jit is not None else ())

    def warmup(self, progress: Callable[[str, float], None] | None = None,
               workers: int | None = None) -> dict[str, float]:
        """Compile every bucket ahead of time; returns seconds per bucket.

        Lowering (Python tracing) runs in this thread; XLA compilations run concurrently on
        ``workers`` threads (default: one per CPU core, up to the number of buckets).
        """
        todo = [(kind, b) for kind, buckets in self._kinds() for b in buckets if (kind, b) not in self._exec]
        if not todo:
            return dict(self.warmup_report)
        lowered = {key: self._lower(*key) for key in todo}

        def build(key):
            t0 = time.perf_counter()
            exe = lowered[key].compile()
            return key, exe, time.perf_counter() - t0

        n = workers or min(len(todo), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
            for key, exe, dt in pool.map(build, todo):
                self._exec[key] = exe
                self.warmup_report[f"{key[0]}.b{key[1]}"] = dt
                if progress:
                    progress(f"{key[0]}.b{key[1]}", dt)
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
        if sampling.min_tokens and len(self._banned(sampling)) > MAX_BANNED:
            raise RequestError(f"min_tokens bans the stop and EOS token ids until it is reached, which works for at "
                               f"most {MAX_BANNED} distinct ids; this request has {len(self._banned(sampling))}")
        total = len(ids) + sampling.max_tokens
        if total > self.options.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} exceeds "
                               f"max_model_len {self.options.max_model_len}")
        if self.pages.pages_needed(total) > self.pages.n_pages - 1:
            raise RequestTooLarge(f"request needs {total} tokens of KV but the whole pool holds "
                                  f"{(self.pages.n_pages - 1) * self.pages.page_size}")
        rid = next(self._ids)
        seed = sampling.seed if sampling.seed is not None else rid
        stats = RequestStats(time.perf_counter())
        # min_tokens bans and per-token logprobs exist on the AR path only
        if self._spec_jit is not None and not sampling.min_tokens and not sampling.logprobs:
            stats.spec_mode = "ddtree"
        self.waiting.append(_Request(rid, ids, sampling, seed, stats))
        return rid

    def _banned(self, sp: SamplingParams) -> tuple[int, ...]:
        """Token ids that end the request (banned from sampling until min_tokens), without duplicates."""
        return tuple(dict.fromkeys(tuple(int(t) for t in sp.stop_token_ids)
                                   + (() if sp.ignore_eos else self.eos_token_ids)))

    def abort(self, rid: int) -> bool:
        """Cancel a request (waiting or running); frees its pages and slot at once."""
        for r in list(self.waiting):
            if r.rid == rid:
                self.waiting.remove(r)
                return True
        r = self.running.get(rid)
        if r is None:
            return False
        r.finish = "abort"
        self._free(r)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one iteration --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit, prefill one chunk, decode one token; returns the requests that changed."""
        self._admit()
        changed: dict[int, _Request] = {}
        pre = [r for r in self.running.values() if r.cursor < len(r.prompt)][: self.prefill_buckets[-1]]
        if pre:
            for r in self._prefill(pre):
                changed[r.rid] = r
        dec = [r for r in self.running.values() if r.cursor == len(r.prompt) and r.tokens and r.finish is None
               and r.rid not in changed]
        spec = [r for r in dec if r.stats.spec_mode == "ddtree"][: self.decode_buckets[-1]]
        ar = [r for r in dec if r.stats.spec_mode != "ddtree"][: self.decode_buckets[-1]]
        if spec:
            for r in self._spec(spec):
                changed[r.rid] = r
        if ar:
            for r in self._decode(ar):
                changed[r.rid] = r
        now = time.perf_counter()
        for r in changed.values():
            if r.finish is not None:
                r.stats.finished = now
        outs = [self._output(r) for r in changed.values()]
        for r in changed.values():
            if r.finish is not None:
                self._free(r)
        return outs

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            r = self.waiting[0]
            need = len(r.prompt) + r.sp.max_tokens + (self.spec_span if r.stats.spec_mode == "ddtree" else 0)
            if not self.pages.can_admit(need):
                self.counters["admission_deferred"] += 1
                break  # FIFO: wait for pages to free up
            self.waiting.popleft()
            self.pages.admit(r.rid, need)
            r.slot = self.free_slots.pop(0)
            r.stats.admitted = time.perf_counter()
            self.running[r.rid] = r

    def _free(self, r: _Request) -> None:
        if r.rid in self.running:
            del self.running[r.rid]
            self.pages.release(r.rid)
            self.free_slots.append(r.slot)
            self.free_slots.sort()
            r.stats.finished = r.stats.finished or time.perf_counter()

    def _bucket(self, buckets: tuple[int, ...], n: int) -> int:
        return next(b for b in buckets if b >= n)

    def _run(self, kind: str, rows: list[_Request], tokens: np.ndarray, n_valid: np.ndarray,
             start: np.ndarray) -> StepOutput:
        b = self._bucket(self.prefill_buckets if kind == "prefill" else self.decode_buckets, len(rows))
        t = tokens.shape[1]
        tok = np.zeros((b, t), np.int32)
        tok[: len(rows)] = tokens
        nv = np.zeros(b, np.int32)
        nv[: len(rows)] = n_valid
        pos = np.zeros((b, t), np.int32)
        pos[: len(rows)] = start[:, None] + np.arange(t, dtype=np.int32)[None]
        slots = np.zeros(b, np.int32)
        slots[: len(rows)] = [r.slot for r in rows]
        table = self.pages.page_tables([r.rid for r in rows] + [None] * (b - len(rows)), self.width)
        samp = self._row_sampling(rows, b)
        inp = StepInput(tokens=tok, positions=pos, n_valid=nv, slots=slots, page_table=table)
        return self._call(kind, b, inp, samp)

    def _call(self, kind: str, b: int, inp, samp):
        fn = self._exec.get((kind, b))
        if fn is None:
            self.counters["lazy_compiles"] += 1
            fn = self._exec[(kind, b)] = self._lower(kind, b).compile()
        self.state, self.dkv, out = fn(self.target.params, self.dparams, self.state, self.dkv, inp, samp)
        self.counters[f"{kind}_steps"] += 1
        return jax.device_get(out)

    def _row_sampling(self, rows: list[_Request], b: int) -> SamplingArrays:
        return SamplingArrays.from_rows(
            [RowSampling(r.sp.temperature, r.sp.top_k, r.sp.top_p, r.seed, len(r.tokens), r.sp.min_tokens,
                         self._banned(r.sp)) for r in rows], b)

    def _spec(self, rows: list[_Request]) -> list[_Request]:
        """One speculative round for every row; apply each row's burst in order; cohort-yield after round one."""
        b = self._bucket(self.decode_buckets, len(rows))
        for r in rows:
            self.pages.grow(r.rid, r.n_cached + self.spec_span)
        pad = b - len(rows)
        inp = SpecInput(root=np.array([r.tokens[-1] for r in rows] + [0] * pad, np.int32),
                        start=np.array([r.n_cached for r in rows] + [0] * pad, np.int32),
                        slots=np.array([r.slot for r in rows] + [0] * pad, np.int32),
                        active=np.array([True] * len(rows) + [False] * pad),
                        page_table=self.pages.page_tables([r.rid for r in rows] + [None] * pad, self.width))
        out = self._call("spec", b, inp, self._row_sampling(rows, b))
        cohort = []
        for i, r in enumerate(rows):
            n = int(out.n_accepted[i])
            burst = [int(t) for t in out.accepted[i, 1:n]] + [int(out.bonus[i])]
            st = r.stats
            st.spec_steps += 1
            st.draft_nodes += int(out.tree_nodes[i])
            st.accepted_tokens += n - 1
            st.emitted_spec += len(burst)
            for tok in burst:  # the decode contract, token by token; nothing past a stop is emitted
                self._accept_token(r, tok, float("nan"), [])
                if r.finish is not None:
                    break
            if r.finish is None:
                self.pages.truncate(r.rid, r.n_cached)
            if st.spec_steps == 1:
                cohort.append(r)
        if cohort and self.options.cohort_yield_min > 0:
            mean = sum(r.stats.emitted_spec for r in cohort) / len(cohort)
            if mean < self.options.cohort_yield_min:
                self.counters["cohort_yield"] += 1
                for r in cohort:
                    r.stats.spec_mode = "yielded"
                    r.stats.cohort_yield_mean = mean
        return rows

    def _prefill(self, rows: list[_Request]) -> list[_Request]:
        c = self.options.prefill_chunk
        toks = np.zeros((len(rows), c), np.int32)
        nv = np.zeros(len(rows), np.int32)
        start = np.array([r.cursor for r in rows], np.int32)
        for i, r in enumerate(rows):
            part = r.prompt[r.cursor: r.cursor + c]
            toks[i, : len(part)] = part
            nv[i] = len(part)
            self.pages.grow(r.rid, r.cursor + len(part))
        out = self._run("prefill", rows, toks, nv, start)
        done = []
        for i, r in enumerate(rows):
            r.cursor += int(nv[i])
            r.stats.prefill_chunks += 1
            if r.cursor == len(r.prompt):  # the chunk's last logits give the first generated token
                r.stats.first_token = time.perf_counter()
                self._accept(r, out, i)
                done.append(r)
        return done

    def _decode(self, rows: list[_Request]) -> list[_Request]:
        toks = np.array([[r.tokens[-1]] for r in rows], np.int32)
        start = np.array([r.n_cached for r in rows], np.int32)
        for r in rows:
            self.pages.grow(r.rid, r.n_cached + 1)
        out = self._run("decode", rows, toks, np.ones(len(rows), np.int32), start)
        for i, r in enumerate(rows):
            r.stats.decode_steps += 1
            self._accept(r, out, i)
        return rows

    # ---- the decode contract ----------------------------------------------------------------------
    def _accept(self, r: _Request, out: StepOutput, row: int) -> None:
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
        if r.sp.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(r.tokens)
            hits = [i for i in (text.find(s) for s in r.sp.stop) if i >= 0]
            if hits:
                r.text = text[: min(hits)]
                r.finish = "stop"
                return
        if len(r.tokens) >= r.sp.max_tokens:
            r.finish = "length"

    def _output(self, r: _Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = r.text if r.text is not None else self.tokenizer.decode(r.tokens)
        return RequestOutput(r.rid, r.prompt, list(r.tokens), text, r.finish, list(r.logprobs),
                             r.stats.as_dict(len(r.tokens)), list(r.top))

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
