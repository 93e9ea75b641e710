"""OpenAI-compatible request bodies (pydantic) and the error type every handler raises."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_jax.engine.structured import Constraint

MAX_STOP = 16
MAX_PROMPTS = 256  # prompts in one /v1/completions request (a batch)


class APIError(Exception):
    """An error answered as OpenAI error JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)  # vLLM's: lower is admitted first
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    # vLLM's output options: the stop string that ended the text kept at its end; special tokens in the text;
    # only the prompt's last k tokens (-1: max_model_len) kept
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # vLLM's prompt_logprobs: each prompt token's log-probability, rank and the k most likely tokens at its position
    # (choice.prompt_logprobs); needs a server started with --enable-prompt-logprobs
    prompt_logprobs: int | None = Field(default=None, ge=0, le=8)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's), not by their text
    user: str | None = None
    # OpenAI's penalties and logit_bias ({"token id": bias}), vLLM's repetition_penalty; requests with any of them
    # decode without speculation
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    # structured output: OpenAI's response_format (text / json_object / json_schema) or vLLM's guided_json /
    # guided_regex / guided_choice; at most one
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; 400 for keys that are not token ids or values out of range."""
        out = []
        for k, v in (self.logit_bias or {}).items():
            try:
                t = int(k)
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
            if not -100.0 <= v <= 100.0:
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {v} for {k}", param="logit_bias")
            out.append((t, float(v)))
        return tuple(out)

    def constraint(self) -> Constraint | None:
        """The structured-output constraint the request asks for (None: free text); 400 for a malformed one."""
        found: list[tuple[str, Constraint]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("response_format", Constraint("json_object")))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(400, 'response_format json_schema needs {"json_schema": {"name": ..., "schema": '
                                        '{...}}}', param="response_format")
                found.append(("response_format", Constraint("json_schema", json.dumps(schema))))
            elif kind != "text":
                raise APIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                               param="response_format")
        if self.guided_json is not None:
            schema = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            found.append(("guided_json", Constraint("json_schema", schema)))
        if self.guided_regex is not None:
            found.append(("guided_regex", Constraint("regex", self.guided_regex)))
        if self.guided_choice is not None:
            if not self.guided_choice or not all(self.guided_choice):
                raise APIError(400, "guided_choice needs a non-empty list of non-empty strings", param="guided_choice")
            found.append(("guided_choice", Constraint("choice", json.dumps(self.guided_choice))))
        if len(found) > 1:
            raise APIError(400, f"at most one of response_format, guided_json, guided_regex and guided_choice, got "
                                f"{[n for n, _ in found]}", param=found[1][0])
        return found[0][1] if found else None

    def stop_list(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise APIError(400, f"at most {MAX_STOP} stop sequences are allowed, got {len(stop)}", param="stop")
        if any(not s for s in stop):
            raise APIError(400, "stop sequences must be non-empty strings", param="stop")
        return tuple(stop)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: score the prompt only (with echo)
    logprobs: int | None = Field(default=None, ge=0, le=8)
    echo: bool = False  # the prompt comes back in front of the completion (and, with logprobs, its logprobs)
    suffix: str | None = None


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` (text) or chat ``messages`` (rendered by the chat template, the
    assistant turn opened) -> token ids."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=8)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's template switches: without the generation prompt the model writes its own turn header; with
    # continue_final_message (and add_generation_prompt false) it continues the last message, e.g. a partial reply
    add_generation_prompt: bool = True
    continue_final_message: bool = False
