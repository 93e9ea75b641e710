"""Qwen3.5/3.6 ChatML chat template in pure Python (no jinja), and the matching assistant-output parser.

``render_chat`` reproduces the official Qwen3.6 ``chat_template.jinja`` (the Qwen3.5 template plus the
``preserve_thinking`` kwarg) for OpenAI-style messages:

* a turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` (contents are ``strip()``-ed, as jinja's ``|trim``);
* ``tools`` put a ``# Tools`` preamble with one ``json.dumps`` line per tool inside ``<tools>…</tools>`` (plus the
  XML call-format instructions) at the top of the system turn, followed by the system message if there is one;
* assistant turns after the last real user query carry ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``;
  earlier ones drop their reasoning (unless ``preserve_thinking=True``); ``tool_calls`` render as
  ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``;
* consecutive ``tool`` messages are grouped into one ``user`` turn of ``<tool_response>\\n…\\n</tool_response>``
  blocks;
* the generation prompt is ``<|im_start|>assistant\\n<think>\\n`` (thinking on) or
  ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`` (thinking off).

``parse_assistant`` splits generated text back into ``(reasoning_content, content, tool_calls)``, accepting both the
XML-ish ``<function=…>`` tool-call body and the older JSON ``{"name": …, "arguments": …}`` body.

``tool_call_prefix`` is the forced start of an assistant reply that makes a tool call (``tool_choice`` "required" or a
named function, enforced without a grammar): ``render_chat(..., assistant_prefix=...)`` ends the prompt with it, and
the parser reads it back in front of the generated text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
MASK = "<|mask|>"

#: The tokens the chat template itself writes (each is one added token in Qwen's and our toy tokenizers).
STRUCTURAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END,
    TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END,
)

ROLES = ("system", "user", "assistant", "tool")

TOOLS_PREAMBLE = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge and do "
    "not tell the user about function calls\n</IMPORTANT>"
)

_MISSING = object()


# ---------------------------------------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------------------------------------

def _content_text(content: Any, where: str) -> str:
    """Message content as text: a string, or a list of ``{"type": "text", "text": ...}`` parts (concatenated)."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str) and part.get("type", "text") == "text":
                out.append(part["text"])
            else:
                raise ValueError(f"{where}: content part {j} is not a text part (only text content is supported)")
        return "".join(out)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _tojson(x: Any) -> str:
    """transformers' jinja ``tojson`` (``json.dumps(x, ensure_ascii=False)``)."""
    return json.dumps(x, ensure_ascii=False)


def _jinja_string(v: Any) -> str:
    """jinja's ``|string`` on a scalar is Python's ``str``."""
    return str(v)


def _validate_tools(tools: Any) -> list[Any]:
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of tool schemas, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{i}]: a tool must be a dict, got {type(tool).__name__}")
        if "function" in tool:
            if tool.get("type", "function") != "function":
                raise ValueError(f"tools[{i}]: unsupported tool type {tool.get('type')!r} (only 'function')")
            fn = tool["function"]
            if not isinstance(fn, Mapping):
                raise ValueError(f"tools[{i}]: 'function' must be a dict")
        elif "name" in tool:
            fn = tool  # a bare function schema
        else:
            raise ValueError(f"tools[{i}]: a tool needs a 'function' schema (or at least a 'name')")
        name = fn.get("name")
        if not isinstance(name, str) or not name or any(c in name for c in "<>\n"):
            raise ValueError(f"tools[{i}]: function name must be a non-empty string without '<', '>' or newlines")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ValueError(f"tools[{i}]: 'parameters' of {name!r} must be a JSON-schema object (dict)")
        if isinstance(params, Mapping) and "properties" in params and not isinstance(params["properties"], Mapping):
            raise ValueError(f"tools[{i}]: 'parameters.properties' of {name!r} must be a dict")
        try:
            _tojson(tool)
        except (TypeError, ValueError) as e:
            raise ValueError(f"tools[{i}]: not JSON-serialisable: {e}") from None
    return list(tools)


def _normalise_tool_call(tc: Any, where: str) -> tuple[str, dict[str, Any]]:
    """``(name, arguments dict)`` of an OpenAI ``tool_calls`` entry (``arguments`` may be a JSON string)."""
    if not isinstance(tc, Mapping):
        raise ValueError(f"{where}: a tool call must be a dict")
    fn = tc.get("function", tc)
    if not isinstance(fn, Mapping):
        raise ValueError(f"{where}: 'function' must be a dict")
    name = fn.get("name")
    if not isinstance(name, str) or not name or any(c in name for c in "<>\n"):
        raise ValueError(f"{where}: function name must be a non-empty string without '<', '>' or newlines")
    args = fn.get("arguments", {})
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: arguments of {name!r} is not valid JSON: {e}") from None
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}: arguments of {name!r} must be a JSON object, got {type(args).__name__}")
    for k in args:
        if not isinstance(k, str) or not k or any(c in k for c in "<>\n"):
            raise ValueError(f"{where}: bad parameter name {k!r} in call to {name!r}")
    return name, dict(args)


def _check_messages(messages: Any) -> list[Mapping[str, Any]]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("no messages provided")
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where}: must be a dict, got {type(m).__name__}")
        role = m.get("role", _MISSING)
        if role is _MISSING:
            raise ValueError(f"{where}: missing 'role'")
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if role == "system" and i != 0:
            raise ValueError(f"{where}: a system message must be the first message")
        if role == "tool" and i == 0:
            raise ValueError(f"{where}: a tool message cannot open the conversation")
        content = m.get("content", None)
        if role == "assistant":
            tcs = m.get("tool_calls")
            if content is None and not tcs and m.get("reasoning_content") is None:
                raise ValueError(f"{where}: assistant message needs 'content' (or 'tool_calls')")
            if content is not None:
                _content_text(content, where)
            rc = m.get("reasoning_content")
            if rc is not None and not isinstance(rc, str):
                raise ValueError(f"{where}: 'reasoning_content' must be a string")
            if tcs is not None:
                if isinstance(tcs, (str, bytes, Mapping)) or not isinstance(tcs, Sequence):
                    raise ValueError(f"{where}: 'tool_calls' must be a list")
                for j, tc in enumerate(tcs):
                    _normalise_tool_call(tc, f"{where}: tool_calls[{j}]")
        else:
            if content is None:
                raise ValueError(f"{where}: {role} message is missing 'content'")
            _content_text(content, where)
    return list(messages)


# ---------------------------------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------------------------------

def _render_tool_call(name: str, args: Mapping[str, Any]) -> str:
    out = [f"<function={name}>\n"]
    for k, v in args.items():
        val = _tojson(v) if isinstance(v, (Mapping, list, tuple)) else _jinja_string(v)
        out.append(f"<parameter={k}>\n{val}\n</parameter>\n")
    out.append("</function>\n</tool_call>")
    return "".join(out)


def render_chat(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                enable_thinking: bool = True, tools: Sequence[Mapping[str, Any]] | None = None,
                preserve_thinking: bool = False, assistant_prefix: str = "",
                continue_final_message: bool = False) -> str:
    """Render OpenAI-style ``messages`` with Qwen3.6's chat template (see the module docstring).

    ``assistant_prefix`` is written after the generation prompt: the start of the assistant's reply that the model
    continues (e.g. ``tool_call_prefix``); it needs ``add_generation_prompt``. ``continue_final_message``: the last
    message is left open (no ``<|im_end|>`` after it), so the model continues it, e.g. a partial assistant reply
    (transformers' and vLLM's option of that name); it excludes ``add_generation_prompt``.
    Raises ``ValueError`` naming the offending message (or tool) index for malformed input.
    """
    if assistant_prefix and not add_generation_prompt:
        raise ValueError("assistant_prefix needs add_generation_prompt=True (it continues the generation prompt)")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message continues the last message; it cannot be combined with "
                         "add_generation_prompt=True (set add_generation_prompt to false)")
    msgs = _check_messages(messages)
    tool_list = _validate_tools(tools)
    out: list[str] = []

    has_system = msgs[0]["role"] == "system"
    system_text = _content_text(msgs[0]["content"], "message 0").strip() if has_system else ""
    if tool_list:
        out.append(IM_START + "system\n" + TOOLS_PREAMBLE)
        for t in tool_list:
            out.append("\n" + _tojson(t))
        out.append("\n</tools>" + TOOLS_INSTRUCTIONS)
        if system_text:
            out.append("\n\n" + system_text)
        out.append(IM_END + "\n")
    elif has_system:
        out.append(f"{IM_START}system\n{system_text}{IM_END}\n")

    # The last "real" user query (a user turn that is not just tool responses): reasoning is kept after it.
    last_query = -1
    for i in range(len(msgs) - 1, -1, -1):
        m = msgs[i]
        if m["role"] == "user":
            c = _content_text(m["content"], f"message {i}").strip()
            if not (c.startswith(TOOL_RESPONSE_START) and c.endswith(TOOL_RESPONSE_END)):
                last_query = i
                break
    if last_query < 0:
        raise ValueError("no user query found in messages")

    n = len(msgs)
    for i, m in enumerate(msgs):
        role = m["role"]
        where = f"message {i}"
        raw = m.get("content")
        content = _content_text(raw, where).strip() if raw is not None else ""
        if role == "system":
            continue
        if role == "user":
            out.append(f"{IM_START}user\n{content}{IM_END}\n")
        elif role == "assistant":
            rc = m.get("reasoning_content")
            if isinstance(rc, str):
                reasoning = rc
            else:
                reasoning = ""
                if THINK_END in content:
                    reasoning = content.split(THINK_END)[0].rstrip("\n").split(THINK_START)[-1].lstrip("\n")
                    content = content.split(THINK_END)[-1].lstrip("\n")
            reasoning = reasoning.strip()
            if preserve_thinking or i > last_query:
                out.append(f"{IM_START}assistant\n{THINK_START}\n{reasoning}\n{THINK_END}\n\n{content}")
            else:
                out.append(f"{IM_START}assistant\n{content}")
            for j, tc in enumerate(m.get("tool_calls") or ()):
                name, args = _normalise_tool_call(tc, f"{where}: tool_calls[{j}]")
                if j == 0:
                    out.append(("\n\n" if content.strip() else "") + TOOL_CALL_START + "\n")
                else:
                    out.append("\n" + TOOL_CALL_START + "\n")
                out.append(_render_tool_call(name, args))
            out.append(IM_END + "\n")
        else:  # tool
            if msgs[i - 1]["role"] != "tool":
                out.append(IM_START + "user")
            out.append(f"\n{TOOL_RESPONSE_START}\n{content}\n{TOOL_RESPONSE_END}")
            if i == n - 1 or msgs[i + 1]["role"] != "tool":
                out.append(IM_END + "\n")

    if continue_final_message:
        text = "".join(out)
        tail = IM_END + "\n"
        if not text.endswith(tail):
            raise ValueError("continue_final_message: the last message does not end a turn that can be continued")
        return text[:-len(tail)]
    if add_generation_prompt:
        out.append(IM_START + "assistant\n")
        out.append(f"{THINK_START}\n" if enable_thinking else f"{THINK_START}\n\n{THINK_END}\n\n")
        out.append(assistant_prefix)
    return "".join(out)


def generation_prompt(enable_thinking: bool = True) -> str:
    """The text ``render_chat`` appends for ``add_generation_prompt=True``."""
    return IM_START + "assistant\n" + (f"{THINK_START}\n" if enable_thinking else f"{THINK_START}\n\n{THINK_END}\n\n")


def tool_call_prefix(name: str | None = None, *, enable_thinking: bool = True) -> str:
    """The forced start of an assistant reply that calls a tool, written after the generation prompt.

    ``<tool_call>\\n<function=NAME>\\n`` for a named function (the name is fixed, the model writes the parameters),
    ``<tool_call>\\n<function`` with ``name=None`` (the model writes ``=NAME>`` and picks the function). It is the
    template's own (XML) call format, the one its tool instructions ask for and history calls are rendered in. Both
    end where Qwen's pre-tokenizer splits the template's call text anyway (``<function`` | ``=read`` | ``_source`` |
    ``>\\n`` | ``<parameter``), so the prompt's tokens are those the model would have written itself; ending at
    ``<function=`` would leave a lone ``=`` token that a complete call never contains. With thinking on the prefix
    first closes the open ``<think>`` block empty, so the prompt then ends exactly as the template's thinking-off
    generation prompt does before a call (``<think>\\n\\n</think>\\n\\n<tool_call>…``): the model does not reason
    before an enforced call, and the reply's reasoning is "".
    """
    if name is not None and (not name or any(c in name for c in "<>\n")):
        raise ValueError(f"function name must be a non-empty string without '<', '>' or newlines, got {name!r}")
    close = f"\n{THINK_END}\n\n" if enable_thinking else ""
    return close + TOOL_CALL_START + "\n<function" + ("" if name is None else f"={name}>\n")


# ---------------------------------------------------------------------------------------------------------------------
# parsing generated assistant text
# ---------------------------------------------------------------------------------------------------------------------

_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _param_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``{function name: {parameter: JSON-schema type}}`` from tool schemas."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or ():
        if not isinstance(t, Mapping):
            continue
        fn = t.get("function", t)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), Mapping) else None
        out[fn["name"]] = {k: (v.get("type") if isinstance(v, Mapping) else None)
                           for k, v in (props or {}).items()}
    return out


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> frozenset[str]:
    """The function names of tool schemas (``{"type": "function", "function": {...}}`` or bare function schemas)."""
    return frozenset(_param_types(tools))


def _convert_value(raw: str, typ: Any) -> Any:
    """A ``<parameter>`` value string as a JSON value: by the schema type when known, else JSON if it parses.

    The template writes dicts/lists as JSON and scalars with Python's ``str`` (so ``True``/``None``), which is undone
    here; without a schema a value that parses as JSON (``3``, ``[1]``, ``"x"``) is taken as that JSON value.
    """
    if isinstance(typ, list):  # e.g. ["string", "null"]
        typ = next((t for t in typ if t != "null"), None)
    if typ == "string":
        return raw
    s = raw.strip()
    if s in ("True", "False", "true", "false") and typ in (None, "boolean"):
        return s.lower() == "true"
    if s in ("None", "null"):
        return None
    try:
        v = json.loads(s)
    except (json.JSONDecodeError, ValueError):
        if typ in ("integer", "number"):
            try:
                f = float(s)
                return int(f) if typ == "integer" and f.is_integer() else f
            except ValueError:
                pass
        return raw
    if typ == "integer" and isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _parse_tool_call_body(body: str, types: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """An OpenAI ``tool_calls`` entry from the text inside ``<tool_call>…</tool_call>``, or None if unparseable."""
    b = body.strip()
    if b.startswith("<function="):
        m = _FUNCTION_RE.match(b)
        if not m:
            return None
        name = m.group(1).strip()
        ptypes = types.get(name, {})
        args: dict[str, Any] = {}
        for pm in _PARAM_RE.finditer(m.group(2)):
            val = pm.group(2)
            val = val[1:] if val.startswith("\n") else val
            val = val[:-1] if val.endswith("\n") else val
            pname = pm.group(1).strip()
            args[pname] = _convert_value(val, ptypes.get(pname))
    elif b.startswith("{"):
        try:
            obj = json.loads(b)
        except json.JSONDecodeError:
            try:  # raw newlines inside JSON strings
                obj = json.loads(b.replace("\n", "\\n"))
            except json.JSONDecodeError:
                return None
        if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
            return None
        name = obj["name"]
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            return None
    else:
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_assistant(text: str, *, thinking: bool, tools: Sequence[Mapping[str, Any]] | None = None,
                    parse_tools: bool = True, names: Collection[str] | None = None
                    ) -> tuple[str | None, str, list[dict[str, Any]]]:
    """Split generated assistant text into ``(reasoning_content, content, tool_calls)``.

    ``text`` is what the model produced after the generation prompt (which, with thinking on, already ended in
    ``<think>\\n``); a leading ``<think>`` is accepted too, and anything from ``<|im_end|>`` on is dropped.
    With ``thinking`` and no ``</think>`` (generation cut short) everything is reasoning. With thinking off,
    reasoning is None unless the text nonetheless opens with a complete ``<think>…</think>`` block.
    ``tool_calls`` are OpenAI dicts (``id``, ``type: "function"``, ``function: {name, arguments (JSON string)}``);
    parameter values of the XML form are typed by the ``tools`` schemas when given, else read as JSON when they
    parse as JSON (strings otherwise). Unparseable ``<tool_call>`` blocks are left in ``content``, and so, when
    ``names`` is given, are calls to a function not among them; with ``parse_tools=False`` (a request without tools)
    no tool call is parsed and all of it is content. For a forced reply (``tool_call_prefix``) ``text`` is the forced
    prefix followed by the generated text, read as if the model had written both.
    Reasoning and content are trimmed of surrounding whitespace, as the chat template trims them when the turn is
    sent back; ``partial_assistant`` gives the parts of an unfinished generation that a stream may send already.
    """
    text = _cut_at_end(text)
    reasoning: str | None = None
    rest = text
    if thinking:
        if THINK_END in text:
            r, rest = text.split(THINK_END, 1)
            reasoning = _drop_think_start(r).strip()
        else:
            return _drop_think_start(text).strip(), "", []
    elif text.lstrip().startswith(THINK_START) and THINK_END in text:
        r, rest = text.split(THINK_END, 1)
        reasoning = _drop_think_start(r).strip()

    if not parse_tools:
        return reasoning, rest.strip(), []
    types = _param_types(tools)
    calls: list[dict[str, Any]] = []
    pieces: list[str] = []
    pos = 0
    for m in _TOOL_CALL_RE.finditer(rest):
        tc = _parse_tool_call_body(m.group(1), types)
        if tc is None or names is not None and tc["function"]["name"] not in names:
            continue
        calls.append(tc)
        pieces.append(rest[pos:m.start()])
        pos = m.end()
    pieces.append(rest[pos:])
    content = "".join(pieces).strip() if calls else rest.strip()
    return reasoning, content, calls


_MARKERS = (THINK_START, THINK_END, TOOL_CALL_START, IM_END, ENDOFTEXT)


def _cut_at_end(text: str) -> str:
    for stop in (IM_END, ENDOFTEXT):
        k = text.find(stop)
        if k >= 0:
            text = text[:k]
    return text


def _drop_think_start(r: str) -> str:
    r = r.lstrip()
    return r[len(THINK_START):] if r.startswith(THINK_START) else r


def partial_assistant(text: str, *, thinking: bool, parse_tools: bool = True) -> tuple[str, str]:
    """``(reasoning, content)`` of an unfinished generation that are prefixes of what ``parse_assistant`` returns
    for the finished text, whatever follows (None reasoning counts as ""): what a stream may send so far.

    Held back: a tail that may still become a marker (``</thi``), everything from the first ``<tool_call>`` on
    (calls are sent parsed when the generation ends), trailing whitespace (trimmed if nothing follows it), and,
    with thinking off, a text that opens with ``<think>`` until its ``</think>`` shows whether it is a block.
    """
    text = _cut_at_end(text)
    for m in _MARKERS:  # a tail that is a proper prefix of a marker
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                text = text[:-k]
                break
    if thinking or THINK_END in text and text.lstrip().startswith(THINK_START):
        if THINK_END not in text:
            r = text.lstrip()
            return ("" if THINK_START.startswith(r) else _drop_think_start(r).strip()), ""
        r, rest = text.split(THINK_END, 1)
        reasoning = _drop_think_start(r).strip()
    else:
        s = text.lstrip()
        if THINK_START.startswith(s) or s.startswith(THINK_START):  # may still open a <think> block
            return "", ""
        reasoning, rest = "", text
    if parse_tools and TOOL_CALL_START in rest:
        rest = rest[:rest.index(TOOL_CALL_START)]
    return reasoning, rest.strip()
