"""The FastAPI application: OpenAI-compatible completions and chat completions over one engine.

Every response carries ``usage`` (raw prompt tokens are billed) and a ``telemetry`` object per choice:
``effective_prompt_tokens``, ``spec_mode``, ``draft_steps``, ``accepted_tokens``, ``kv_pages_in``,
``kv_pages_out``, ``ttft_s``, ``tpot_s``, ``queue_s``, ``prefill_chunks``, ``decode_steps``.

``tool_choice`` "required" or a named function is enforced by a forced assistant prefix (``chat.tool_call_prefix``,
no grammar): the prompt ends with the start of a call, the reply is parsed as prefix + generated text. The prefix
tokens are prompt tokens (``usage.prompt_tokens`` and ``effective_prompt_tokens`` include them); ``completion_tokens``
counts only the generated tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dflash_jax.engine.loop import Engine, RequestError, RequestOutput, SamplingParams
from dflash_jax.engine.turns import DeviceTurns
from dflash_jax.kv.pages import RequestTooLarge
from dflash_jax.serve.metrics import Metrics
from dflash_jax.serve.protocol import (MAX_PROMPTS, APIError, ChatRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest)
from dflash_jax.serve.runner import EngineRunner

log = logging.getLogger("dflash_jax.serve")


class ToolSelection(NamedTuple):
    """What a chat request's ``tool_choice`` asks for."""

    tools: list[dict[str, Any]] | None  # the tools the chat template lists (None: no tools)
    forced: str  # the assistant prefix that enforces a call ("" when none is enforced)

    @property
    def names(self) -> frozenset[str] | None:
        """The functions an enforced call may name (None when no call is enforced: any parsed call counts)."""
        from dflash_jax.models.chat import tool_names

        return tool_names(self.tools) if self.forced else None


def _telemetry(o: RequestOutput, prep: dict[str, Any]) -> dict[str, Any]:
    """Per-request telemetry: prompt preparation (raw vs effective tokens, PFlash) and the engine's stats
    (spec_mode, draft_steps, accepted_tokens, timings, ...)."""
    return {**prep, "effective_prompt_tokens": len(o.prompt_token_ids), "kv_pages_in": 0, "kv_pages_out": 0,
            **o.stats}


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events. A plain streaming response, so a SIGTERM drains open streams instead of cutting them."""

    async def body():
        async for e in events:
            yield f"data: {e}\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _scored_only(o: RequestOutput) -> RequestOutput:
    """A completion with ``max_tokens`` 0 (echo: the prompt scored): the one token generated is left out."""
    return dataclasses.replace(o, token_ids=[], text="", logprobs=[], top_logprobs=[],
                               finish_reason=None if o.finish_reason is None else "length")


def _holdback(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could start a stop string (not streamed yet)."""
    keep = 1 if text.endswith("\ufffd") else 0  # an incomplete UTF-8 sequence
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return keep


class Server:
    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None,
                 default_thinking: bool = True, pflash: tuple[Any, Any] | None = None) -> None:
        """``pflash``: ``(PFlashOptions, scorer)`` to compress prompts once before admission."""
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.pflash = pflash
        if pflash is not None and getattr(pflash[1], "pace", False):
            # the scorer's dispatches alternate with the engine's steps (a decode step waits for one at most)
            engine.turns = pflash[1].turns = DeviceTurns()
        self._prep_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-pflash")
        self.default_thinking = default_thinking
        self.runner = EngineRunner(engine)
        self.metrics = Metrics()
        self.created = int(time.time())

    # ---- request -> engine -----------------------------------------------------------------------
    def _sampling(self, req, stops: tuple[str, ...]) -> SamplingParams:
        """The engine's SamplingParams of a request; a completion's ``max_tokens`` 0 (echo only) generates one token,
        which the response leaves out."""
        max_tokens = req.max_completion_tokens or (req.max_tokens if req.max_tokens is not None else 16)
        completion = isinstance(req, CompletionRequest)
        wants_logprobs = req.logprobs is not None if completion else bool(req.logprobs)
        if max_tokens == 0 and not (completion and req.echo):
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt scored, nothing "
                                "generated)", param="max_tokens")
        prompt_logprobs = req.logprobs if completion and req.echo and req.logprobs is not None else None
        if req.prompt_logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, req.prompt_logprobs)
        return SamplingParams(max_tokens=max(max_tokens, 1), prompt_logprobs=prompt_logprobs,
                              temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p,
                              min_p=req.min_p, priority=req.priority, seed=req.seed, stop=stops,
                              stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                              min_tokens=req.min_tokens, logprobs=wants_logprobs,
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias_pairs(),
                              constraint=req.constraint(),
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              skip_special_tokens=req.skip_special_tokens)

    async def _build_constraint(self, sp: SamplingParams) -> None:
        """Build a constrained request's automaton off the engine thread (it is cached: submit finds it)."""
        if sp.constraint is not None:
            try:
                await asyncio.to_thread(self.engine.start_constraint, sp.constraint)
            except RequestError as e:
                raise APIError(400, str(e), param="response_format") from e

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           type_="not_found_error", param="model", code="model_not_found")

    async def _prepare(self, prompt: list[int], tools: bool, scored: bool = False) -> tuple[list[int], dict[str, Any]]:
        """Prompt compression, once per request before admission, off the event loop and the engine thread.
        Returns the effective prompt and its telemetry; billing stays on the raw prompt. Only prompts the scorer
        must read wait for its thread (one at a time); the others are answered here at once. A prompt whose
        logprobs are wanted (``scored``) is never compressed: they are of the prompt as sent."""
        if self.pflash is None or scored:
            return prompt, {"raw_prompt_tokens": len(prompt), "pflash": "off"}
        from dflash_jax.prefill.pflash import compress, protected_mask, skip_reason

        opts, scorer = self.pflash
        tok = self.engine.tokenizer
        must_keep = protected_mask(prompt, tok) if tok is not None else None
        run = functools.partial(compress, prompt, scorer, opts, must_keep=must_keep, tool_request=tools)
        if skip_reason(len(prompt), opts, must_keep=must_keep, tool_request=tools) is not None:
            res = run()  # returned untouched: the scorer does not run
        else:
            res = await asyncio.get_running_loop().run_in_executor(self._prep_pool, run)
        self.metrics.effective_prompt_tokens.inc(res.effective_tokens)
        return [int(t) for t in res.effective_ids], res.telemetry()

    async def _start(self, prompt: list[int], sp: SamplingParams, n: int):
        """Submit the ``n`` choices of one prompt as a group (the prompt prefills once); choice i's seed is
        ``seed + i``."""
        sps = [sp if n == 1 or sp.seed is None else dataclasses.replace(sp, seed=sp.seed + i) for i in range(n)]
        try:
            return await self.runner.submit_group(prompt, sps)
        except RequestTooLarge as e:
            raise APIError(413, str(e), param="max_tokens") from e
        except RequestError as e:
            raise APIError(400, str(e)) from e

    async def _final(self, request: Request, rid: int, q: asyncio.Queue) -> RequestOutput:
        while True:
            try:
                item = await asyncio.wait_for(q.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.runner.abort(rid)
                    raise asyncio.CancelledError
                continue
            if isinstance(item, BaseException):
                raise APIError(500, str(item), type_="server_error")
            if item.finish_reason is not None:
                return item

    def _record(self, o: RequestOutput, prep: dict[str, Any]) -> None:
        """Metrics of a finished request; its telemetry is logged (one line per request)."""
        log.info("request %d finished (%s, %d tokens): %s", o.request_id, o.finish_reason, len(o.token_ids),
                 json.dumps(_telemetry(o, prep), default=str))
        self.metrics.completion_tokens.inc(len(o.token_ids))
        if o.stats.get("ttft_s") is not None:
            self.metrics.ttft.observe(o.stats["ttft_s"])
        if o.stats.get("tpot_s") is not None:
            self.metrics.tpot.observe(o.stats["tpot_s"])
        if o.stats.get("mean_accept_len") is not None:
            self.metrics.accept_len.observe(o.stats["mean_accept_len"])
        self.metrics.draft_steps.inc(o.stats.get("draft_steps", 0))
        self.metrics.accepted_tokens.inc(o.stats.get("accepted_tokens", 0))
        self.metrics.kv_pages_in.inc(o.stats.get("kv_pages_in", 0))
        self.metrics.kv_pages_out.inc(o.stats.get("kv_pages_out", 0))

    def _usage(self, prompt_lens: list[int], outs: list[RequestOutput]) -> dict[str, Any]:
        """OpenAI's usage over ``outs`` (choices in order, ``len(outs) // len(prompt_lens)`` per prompt);
        ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache supplied (each prompt's first
        choice: the others share its prompt)."""
        c = sum(len(o.token_ids) for o in outs)
        n = max(1, len(outs) // max(1, len(prompt_lens)))
        cached = sum((o.stats or {}).get("cached_tokens", 0) for o in outs[::n])
        p = sum(prompt_lens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- /v1/completions -------------------------------------------------------------------------
    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        """The request's prompts (one, or a batch: a list of strings or of token-id lists) as ``(ids, text as
        sent or None)``."""
        p = req.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (list, str)) else [p]
        if len(batch) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}", param="prompt")
        out = []
        for one in batch:
            if isinstance(one, str):
                if self.engine.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
                ids = self.engine.tokenizer.encode(one)
            else:
                ids = [int(t) for t in one]
            if not ids:
                raise APIError(400, "prompt is empty", param="prompt")
            kept = self._truncate(req, ids)
            out.append((kept, one if isinstance(one, str) and len(kept) == len(ids) else None))
        return out

    def _check_prompt_logprobs(self, req, sp: SamplingParams) -> None:
        if sp.prompt_logprobs is not None and not self.engine.options.prompt_logprobs:
            param, what = (("prompt_logprobs", "prompt_logprobs") if req.prompt_logprobs is not None
                           else ("echo", "echo with logprobs"))
            raise APIError(400, f"{what} needs the prompt scored: start the server with --enable-prompt-logprobs",
                           param=param)

    def _prompt_logprobs(self, req, o: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs`` of a choice: per prompt token (None for the first) a dict keyed by token id of
        the prompt token and the ``req.prompt_logprobs`` most likely ones, each with its logprob, rank and text."""
        k = req.prompt_logprobs
        if k is None or o.prompt_logprobs is None:
            return None
        name = self._namer(req)
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for j in range(1, len(o.prompt_logprobs)):
            t = o.prompt_token_ids[j]
            d = {str(t): {"logprob": o.prompt_logprobs[j], "rank": o.prompt_ranks[j], "decoded_token": name(t)}}
            for rank, (a, lp) in enumerate(o.prompt_top_logprobs[j][:k], 1):
                d.setdefault(str(a), {"logprob": lp, "rank": rank, "decoded_token": name(a)})
            out.append(d)
        return out

    def _truncate(self, req, ids: list[int]) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (-1: ``max_model_len``)."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        if k == 0:
            raise APIError(400, "truncate_prompt_tokens must be >= 1 (or -1: max_model_len)",
                           param="truncate_prompt_tokens")
        k = self.engine.options.max_model_len if k == -1 else k
        return ids[-k:]

    async def completions(self, request: Request, req: CompletionRequest):
        self._check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        stops = req.stop_list()
        sp = self._sampling(req, stops)
        self._check_prompt_logprobs(req, sp)
        await self._build_constraint(sp)
        prompts = self._completion_prompts(req)
        subs, preps = [], []
        try:  # choice index = prompt index * n + j (OpenAI's order)
            for ids, _ in prompts:
                effective, prep = await self._prepare(ids, tools=False, scored=sp.prompt_logprobs is not None)
                subs += await self._start(effective, sp, req.n)
                preps += [prep] * req.n
        except BaseException:
            for rid, _ in subs:
                self.runner.abort(rid)
            raise
        lens = [len(ids) for ids, _ in prompts]
        self.metrics.prompt_tokens.inc(sum(lens))
        cid = f"cmpl-{uuid.uuid4().hex}"
        echo = [self._echo_text(ids, text) for ids, text in prompts for _ in range(req.n)] if req.echo else None
        if req.stream:
            return _sse(self._stream(request, cid, "text_completion", lens, subs, stops, req, preps, chat=False,
                                     echo=echo))
        outs = await self._gather(request, subs, preps, scored_only=req.max_tokens == 0)
        choices = []
        for i, o in enumerate(outs):
            lp = None
            if req.logprobs is not None:
                lp = (self._echo_logprobs(o, req.logprobs, self._namer(req)) if echo is not None
                      else self._completion_logprobs(o, req.logprobs, self._namer(req)))
            text = self._text(o) if echo is None else echo[i] + self._text(o)
            choices.append({"index": i, "text": text, "finish_reason": o.finish_reason,
                            "telemetry": _telemetry(o, preps[i]), "logprobs": lp,
                            "prompt_logprobs": self._prompt_logprobs(req, o)})
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage(lens, outs)}

    # ---- /tokenize, /detokenize -------------------------------------------------------------------
    def _tokenizer(self):
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (tokenizer.json): token ids only")
        return self.engine.tokenizer

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        tok = self._tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None:
            ids = tok.encode(req.prompt)
        else:
            thinking = bool((req.chat_template_kwargs or {}).get("enable_thinking", self.default_thinking))
            try:
                ids = tok.apply_chat_template(req.messages, enable_thinking=thinking,
                                              add_generation_prompt=req.add_generation_prompt,
                                              continue_final_message=req.continue_final_message)
            except (ValueError, TypeError, KeyError) as e:
                raise APIError(400, f"messages: {e}", param="messages") from e
        return {"count": len(ids), "max_model_len": self.engine.options.max_model_len, "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        tok = self._tokenizer()
        v = self.engine.cfg.vocab_size
        if any(not 0 <= t < v for t in req.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {v})", param="tokens")
        return {"prompt": tok.decode(list(req.tokens), skip_special_tokens=False)}

    # ---- /v1/chat/completions --------------------------------------------------------------------
    async def chat(self, request: Request, req: ChatRequest):
        self._check_model(req.model)
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer/chat template; use /v1/completions with token ids")
        kwargs = req.chat_template_kwargs or {}
        stops = req.stop_list()
        sp = self._sampling(req, stops)
        self._check_prompt_logprobs(req, sp)
        if sp.constraint is not None and req.tools:
            raise APIError(400, "structured output (response_format / guided_*) cannot be combined with tools",
                           param="response_format")
        # a constrained reply is the answer itself: no reasoning block before it (the thinking-off template)
        thinking = bool(kwargs.get("enable_thinking", self.default_thinking)) and sp.constraint is None
        await self._build_constraint(sp)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        sel = self._tool_selection(req, thinking)
        try:
            prompt = tok.apply_chat_template(messages, enable_thinking=thinking, tools=sel.tools,
                                             assistant_prefix=sel.forced,
                                             add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        prompt = self._truncate(req, prompt)
        # the reply opens with a reasoning block only after the thinking generation prompt; a continued message or
        # a turn the model opens itself is parsed as content
        thinking = thinking and req.add_generation_prompt
        verbatim = req.continue_final_message and not sel.tools  # a continuation: the generated text as it is
        # a tool-calling request (tools offered, or tool turns in the history) is never compressed (issue: "requests
        # with tools are never prompt-compressed"), whatever --prefill-compression says
        tool_request = bool(req.tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        effective, prep = await self._prepare(prompt, tools=tool_request, scored=sp.prompt_logprobs is not None)
        subs = await self._start(effective, sp, req.n)
        self.metrics.prompt_tokens.inc(len(prompt))
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return _sse(self._stream(request, cid, "chat.completion.chunk", [len(prompt)], subs, stops, req,
                                     [prep] * req.n, chat=True, thinking=thinking, sel=sel, verbatim=verbatim))
        outs = await self._gather(request, subs, [prep] * req.n)
        choices = []
        for i, o in enumerate(outs):
            msg = self._assistant_message(sel.forced + self._text(o), thinking, sel, verbatim)
            finish = "tool_calls" if msg.get("tool_calls") else o.finish_reason
            c = {"index": i, "message": msg, "finish_reason": finish, "telemetry": _telemetry(o, prep),
                 "prompt_logprobs": self._prompt_logprobs(req, o),
                 "logprobs": self._chat_logprobs(o, req.top_logprobs or 0, self._namer(req)) if req.logprobs
                 else None}
            choices.append(c)
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage([len(prompt)], outs)}

    @staticmethod
    def _tool_selection(req: ChatRequest, thinking: bool) -> ToolSelection:
        """The tools the chat template lists and the forced prefix, by ``tool_choice``: "auto" (default) all tools,
        nothing forced; "none" no tools; "required" all tools and the start of a call (``<tool_call>\\n<function``:
        the model names the function); a named function only that tool and the start of a call to it, name included
        (``chat.tool_call_prefix``)."""
        from dflash_jax.models.chat import tool_call_prefix

        choice = req.tool_choice
        if choice is None or choice == "auto":
            return ToolSelection(req.tools, "")
        if choice == "none":
            return ToolSelection(None, "")
        if choice == "required":
            if not req.tools:
                raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
            return ToolSelection(req.tools, tool_call_prefix(enable_thinking=thinking))
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                    '"function": {"name": ...}}', param="tool_choice")
            named = [t for t in req.tools or () if isinstance(t, dict)
                     and isinstance(t.get("function"), dict) and t["function"].get("name") == name]
            if not named:
                raise APIError(400, f"tool_choice names function {name!r}, which is not among the tools",
                               param="tool_choice")
            try:
                return ToolSelection(named, tool_call_prefix(name, enable_thinking=thinking))
            except ValueError as e:
                raise APIError(400, f"tool_choice: {e}", param="tool_choice") from e
        raise APIError(400, f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                       param="tool_choice")

    def _assistant_message(self, text: str, thinking: bool, sel: ToolSelection,
                           verbatim: bool = False) -> dict[str, Any]:
        """The final assistant message of ``text`` (the forced prefix, if any, then the generated text). Tool calls
        are parsed only for a request with tools (typed by their schemas), otherwise the model's call text stays
        content; under an enforced ``tool_choice`` only calls to the offered functions count. A reply that does not
        parse into a call keeps its text (prefix included) as content, as unparseable call text always does.
        ``verbatim`` (a continued message): the text is the content as generated, whitespace included."""
        from dflash_jax.models.chat import parse_assistant

        if verbatim:
            return {"role": "assistant", "content": text}

        reasoning, content, calls = parse_assistant(text, thinking=thinking, tools=sel.tools,
                                                    parse_tools=bool(sel.tools), names=sel.names)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        return msg

    # ---- shared pieces ---------------------------------------------------------------------------
    async def _gather(self, request: Request, subs, preps: list[dict[str, Any]],
                      scored_only: bool = False) -> list[RequestOutput]:
        """Every request's final output (recorded in the metrics); ``scored_only``: completions with ``max_tokens`` 0,
        whose one generated token is left out of the reply and the counts."""
        try:
            outs = await asyncio.gather(*(self._final(request, rid, q) for rid, q in subs))
        except BaseException:
            for rid, _ in subs:
                self.runner.abort(rid)
            raise
        if scored_only:
            outs = [_scored_only(o) for o in outs]
        for o, prep in zip(outs, preps):
            self._record(o, prep)
        return list(outs)

    def _text(self, o: RequestOutput) -> str:
        if o.text is not None:
            return o.text
        return " ".join(map(str, o.token_ids))  # no tokenizer: ids as text

    def _tok_str(self, t: int) -> str:
        tok = self.engine.tokenizer
        return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)

    def _namer(self, req) -> Callable[[int], str]:
        """How a request's logprobs name tokens: their text, or ``token_id:N`` (vLLM's return_tokens_as_token_ids)."""
        return (lambda t: f"token_id:{t}") if req.return_tokens_as_token_ids else self._tok_str

    def _completion_logprobs(self, o: RequestOutput, k: int, name: Callable[[int], str],
                             start: int = 0, first: int = 0) -> dict[str, Any]:
        """OpenAI's completion logprobs of the generated tokens from index ``first`` on (a stream's new tokens),
        named by ``name`` (``_namer``); ``text_offset`` counted from ``start``, token ``first``'s offset."""
        toks = [name(t) for t in o.token_ids[first:]]
        offsets = list(itertools.accumulate(map(len, toks[:-1]), initial=start)) if toks else []
        return {"tokens": toks, "token_logprobs": o.logprobs[first:], "text_offset": offsets,
                "top_logprobs": [self._top_dict(alts[:k], name) for alts in o.top_logprobs[first:]] if k else None}

    def _top_dict(self, alts: list[tuple[int, float]], name: Callable[[int], str]) -> dict[str, float]:
        """Alternatives keyed by token name, most likely first; ids that decode alike (partial UTF-8) keep the
        likeliest's logprob."""
        out: dict[str, float] = {}
        for t, lp in alts:
            out.setdefault(name(t), lp)
        return out

    def _echo_text(self, ids: list[int], text: str | None) -> str:
        """A prompt as echoed: the text as sent, or its token ids decoded."""
        if text is not None:
            return text
        tok = self.engine.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok is not None else " ".join(map(str, ids)) + " "

    def _echo_logprobs(self, o: RequestOutput, k: int, name: Callable[[int], str]) -> dict[str, Any]:
        """Echo with logprobs: the prompt's tokens first (the first with no logprob), then the completion's."""
        toks = [name(t) for t in o.prompt_token_ids]
        offsets, pos = [], 0
        for s in toks:
            offsets.append(pos)
            pos += len(s)
        gen = self._completion_logprobs(o, k, name, pos)
        top = None
        if k:
            top = [None] + [self._top_dict(alts[:k], name) for alts in o.prompt_top_logprobs[1:]]
            top += gen["top_logprobs"]
        return {"tokens": toks + gen["tokens"], "token_logprobs": list(o.prompt_logprobs) + gen["token_logprobs"],
                "text_offset": offsets + gen["text_offset"], "top_logprobs": top}

    def _chat_logprobs(self, o: RequestOutput, k: int, name: Callable[[int], str], start: int = 0) -> dict[str, Any]:
        content = []
        for t, lp, alts in zip(o.token_ids[start:], o.logprobs[start:], o.top_logprobs[start:]):
            s = name(t)
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": name(a), "logprob": alp, "bytes": list(name(a).encode())}
                                             for a, alp in alts[:k]]})
        return {"content": content}

    async def _stream(self, request: Request, cid: str, obj: str, prompt_lens: list[int], subs, stops, req,
                      preps: list[dict[str, Any]], *,
                      chat: bool, thinking: bool = False,
                      sel: ToolSelection = ToolSelection(None, ""),
                      echo: list[str] | None = None, verbatim: bool = False) -> AsyncIterator[str]:
        """SSE chunks. Chat deltas are cut from ``partial_assistant`` of the text so far (after the forced prefix of
        an enforced ``tool_choice``) and, at the end, from the final message, so the joined deltas equal the
        non-streamed message exactly. ``echo``: per choice, the prompt text its first chunk starts with (and, with
        logprobs, the prompt's logprobs). ``prompt_lens`` / ``preps``: per prompt / per choice."""
        from dflash_jax.models.chat import partial_assistant

        created = int(time.time())
        sent_text = [0] * len(subs)
        sent_tok = [0] * len(subs)
        lp_end = [0] * len(subs)  # completion logprobs: the text offset after the last token sent
        echoed = [echo is None] * len(subs)  # the echoed prompt went out (in a choice's first chunk)
        finals: dict[int, RequestOutput] = {}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(i: int, delta: Any, finish: str | None, o: RequestOutput | None = None, logprobs=None) -> str:
            choice: dict[str, Any] = {"index": i, "finish_reason": finish, "logprobs": logprobs}
            if chat:
                choice["delta"] = delta
            else:
                choice["text"] = delta
            if finish is not None and o is not None:
                choice["telemetry"] = _telemetry(o, preps[i])
                if req.prompt_logprobs is not None:  # complete since the first token: sent with the last chunk
                    choice["prompt_logprobs"] = self._prompt_logprobs(req, o)
            body = {"id": cid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return json.dumps(body)

        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, q: asyncio.Queue):
            while True:
                item = await q.get()
                await merged.put((i, item))
                if isinstance(item, BaseException) or item.finish_reason is not None:
                    return

        tasks = [asyncio.create_task(pump(i, q)) for i, (_, q) in enumerate(subs)]
        try:
            if chat:
                for i in range(len(subs)):
                    yield chunk(i, {"role": "assistant", "content": ""}, None)
            sent_r = [0] * len(subs)  # reasoning characters streamed per choice (chat with thinking)
            while len(finals) < len(subs):
                i, item = await merged.get()
                if isinstance(item, BaseException):
                    yield json.dumps(APIError(500, str(item), type_="server_error").body())
                    return
                o = _scored_only(item) if not chat and req.max_tokens == 0 else item
                text = self._text(o)
                done = o.finish_reason is not None
                upto = len(text) if done else len(text) - _holdback(text, stops)
                visible = text[:max(upto, 0)]
                lp = None
                if chat and req.logprobs and len(o.token_ids) > sent_tok[i]:
                    lp = self._chat_logprobs(o, req.top_logprobs or 0, self._namer(req), sent_tok[i])
                elif not chat and req.logprobs is not None and (len(o.token_ids) > sent_tok[i] or not echoed[i]):
                    if echo is not None and not echoed[i]:  # the prompt's entries go out with the first chunk
                        lp = self._echo_logprobs(o, req.logprobs, self._namer(req))
                    else:  # only the new tokens, their offsets continuing from the last chunk's
                        lp = self._completion_logprobs(o, req.logprobs, self._namer(req), lp_end[i], sent_tok[i])
                    if lp["tokens"]:
                        lp_end[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                sent_tok[i] = len(o.token_ids)
                if not chat:
                    piece = visible[sent_text[i]:]
                    sent_text[i] = max(sent_text[i], len(visible))
                    if not echoed[i]:
                        piece, echoed[i] = echo[i] + piece, True
                    if piece or done or lp:
                        yield chunk(i, piece, o.finish_reason if done else None, o if done else None, lp)
                else:
                    calls = []
                    if verbatim:
                        reasoning, content = "", text if done else visible
                    elif done:
                        msg = self._assistant_message(sel.forced + text, thinking, sel)
                        reasoning, content = msg.get("reasoning_content") or "", msg["content"]
                        calls = msg.get("tool_calls") or []
                    else:
                        reasoning, content = partial_assistant(sel.forced + visible, thinking=thinking,
                                                               parse_tools=bool(sel.tools))
                    deltas = []
                    if reasoning[sent_r[i]:]:
                        deltas.append({"reasoning_content": reasoning[sent_r[i]:]})
                        sent_r[i] = len(reasoning)
                    if content[sent_text[i]:]:
                        deltas.append({"content": content[sent_text[i]:]})
                        sent_text[i] = len(content)
                    if calls:
                        deltas.append({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
                    if lp is not None and not deltas:
                        deltas.append({})
                    for d in deltas:
                        yield chunk(i, d, None, logprobs=lp)
                        lp = None
                    if done:
                        yield chunk(i, {}, "tool_calls" if calls else o.finish_reason, o)
                if done:
                    finals[i] = o
                    self._record(o, preps[i])
            if include_usage:
                yield json.dumps({"id": cid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                                  "usage": self._usage(prompt_lens, [finals[i] for i in sorted(finals)])})
            yield "[DONE]"
        finally:  # client gone or finished: cancel whatever still runs, at once
            for t in tasks:
                t.cancel()
            for i, (rid, _) in enumerate(subs):
                if i not in finals:
                    self.runner.abort(rid)

    def refresh_gauges(self) -> None:
        eng, m = self.engine, self.metrics
        m.queue_depth.set(len(eng.waiting))
        m.running.set(len(eng.running))
        m.free_pages.set(sum(p.num_free for p in eng.pools))
        m.total_pages.set(sum(p.n_pages - 1 for p in eng.pools))
        m.free_slots.set(len(eng.free_slots))
        m.sync(m.engine_faults, self.runner.faults)
        m.sync(m.cohort_yield, eng.counters["cohort_yield"])
        m.sync(m.cohort_reprobes, eng.counters["cohort_reprobe"])
        m.sync(m.prefix_hits, eng.counters["prefix_cache_hits"])
        m.sync(m.prefix_tokens, eng.counters["prefix_cached_tokens"])
        if eng.prefix_caches:
            m.prefix_entries.set(sum(len(c) for c in eng.prefix_caches))
            m.prefix_pages.set(sum(p.num_held for p in eng.pools))
        if eng.turns is not None:
            st = eng.turns.stats()
            m.sync(m.scorer_turn_waits, st["waits"])
            m.sync(m.scorer_turn_wait_seconds, st["wait_s"])


def build_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        server.runner.start()
        try:
            yield
        finally:
            server.runner.stop()

    app = FastAPI(title="dflash-jax", version="0.1.0", lifespan=lifespan)
    app.state.server = server

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if server.api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {server.api_key}":
                return JSONResponse(APIError(401, "missing or invalid API key", type_="authentication_error",
                                             code="invalid_api_key").body(), status_code=401)
        return await call_next(request)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        server.metrics.requests.labels(request.url.path, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = "invalid JSON body" if first.get("type") == "json_invalid" else f"{loc}: {first.get('msg')}"
        server.metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(APIError(400, msg, param=loc).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("request failed")
        server.metrics.requests.labels(request.url.path, "500").inc()
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", type_="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_name, "steps": server.runner.steps}

    @app.get("/metrics")
    async def metrics():
        server.refresh_gauges()
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "dflash-jax", "max_model_len": server.engine.options.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        out = await server.completions(request, body)
        server.metrics.requests.labels("/v1/completions", "200").inc()
        return out

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest):
        out = await server.chat(request, body)
        server.metrics.requests.labels("/v1/chat/completions", "200").inc()
        return out

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        out = server.tokenize(body)
        server.metrics.requests.labels("/tokenize", "200").inc()
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        out = server.detokenize(body)
        server.metrics.requests.labels("/detokenize", "200").inc()
        return out

    return app
