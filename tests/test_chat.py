"""Qwen3.6 ChatML renderer (golden strings written from the official chat_template.jinja) and the output parser."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax.models.chat import (TOOLS_INSTRUCTIONS, TOOLS_PREAMBLE, parse_assistant, partial_assistant,
                                    render_chat, tool_call_prefix, tool_names)

USER = [{"role": "user", "content": "Hello!"}]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                      "units": {"type": "string"}, "zip": {"type": "string"}},
                       "required": ["city"]},
    },
}


def test_plain_user_thinking_on():
    assert render_chat(USER) == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_plain_user_thinking_off():
    assert render_chat(USER, enable_thinking=False) == (
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_no_generation_prompt_and_trim():
    msgs = [{"role": "user", "content": "  padded \n"}]
    assert render_chat(msgs, add_generation_prompt=False) == "<|im_start|>user\npadded<|im_end|>\n"
    # list-of-parts content
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(parts, add_generation_prompt=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_system_multi_turn_drops_historical_reasoning():
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Add again."},
    ]
    want = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\n2+2?<|im_end|>\n"
            "<|im_start|>assistant\n4<|im_end|>\n"
            "<|im_start|>user\n3+3?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6<|im_end|>\n")
    assert render_chat(msgs, add_generation_prompt=False) == want
    # inline <think> in content (no reasoning_content field) is split the same way
    msgs2 = [dict(m) for m in msgs]
    msgs2[2] = {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"}
    msgs2[4] = {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"}
    assert render_chat(msgs2, add_generation_prompt=False) == want
    # next turn: everything before the new query loses its reasoning
    more = msgs + [{"role": "user", "content": "ok"}]
    out = render_chat(more, enable_thinking=False)
    assert "Add again." not in out and "Add them." not in out
    assert out.endswith("<|im_start|>assistant\n6<|im_end|>\n<|im_start|>user\nok<|im_end|>\n"
                        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # preserve_thinking keeps it (and writes an empty block where there was none)
    kept = render_chat(more, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>" in kept


def test_empty_reasoning_after_last_query_gives_empty_think_block():
    msgs = USER + [{"role": "assistant", "content": "Hi."}]
    assert render_chat(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHi.<|im_end|>\n")


def test_continue_final_message_leaves_the_last_turn_open():
    msgs = USER + [{"role": "assistant", "content": "The answer is"}]
    assert render_chat(msgs, add_generation_prompt=False, continue_final_message=True) == (
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is")
    hist = [{"role": "system", "content": "S"}, *USER, {"role": "assistant", "content": "4", "reasoning_content": "r"},
            {"role": "user", "content": "more"}]
    closed = render_chat(hist + [{"role": "assistant", "content": "Sure"}], add_generation_prompt=False)
    opened = render_chat(hist + [{"role": "assistant", "content": "Sure"}], add_generation_prompt=False,
                         continue_final_message=True)
    assert closed == opened + "<|im_end|>\n"  # the same rendering, only the last turn's end left out
    assert render_chat(hist, add_generation_prompt=False, continue_final_message=True).endswith("user\nmore")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        render_chat(msgs, continue_final_message=True)


def test_tools_preamble():
    want_tools = "\n" + json.dumps(WEATHER, ensure_ascii=False)
    want = ("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
            + want_tools + "\n</tools>" + TOOLS_INSTRUCTIONS + "\n\nBe nice.<|im_end|>\n"
            "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n")
    out = render_chat([{"role": "system", "content": "Be nice."}] + USER, tools=[WEATHER])
    assert out == want
    assert TOOLS_PREAMBLE == "# Tools\n\nYou have access to the following functions:\n\n<tools>"
    assert TOOLS_INSTRUCTIONS.startswith("\n\nIf you choose to call a function ONLY reply in the following format")
    assert TOOLS_INSTRUCTIONS.endswith("do not tell the user about function calls\n</IMPORTANT>")
    # without a system message: preamble only
    out2 = render_chat(USER, tools=[WEATHER])
    assert out2.startswith("<|im_start|>system\n# Tools\n") and "</IMPORTANT><|im_end|>\n<|im_start|>user" in out2


def _calls_turn():
    return [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Two cities, two calls.",
         "tool_calls": [
             {"id": "a", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}},
             {"id": "b", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Rome", "opts": {"x": [1, 2]}}}},
         ]},
    ]


def test_assistant_tool_calls_rendering():
    out = render_chat(_calls_turn(), add_generation_prompt=False)
    assert out == ("<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\nLet me check."
                   "\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
                   "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                   '<parameter=opts>\n{"x": [1, 2]}\n</parameter>\n</function>\n</tool_call><|im_end|>\n')
    # no content: the call follows the think block directly
    msgs = [USER[0], {"role": "assistant", "content": None,
                      "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    assert render_chat(msgs, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
        "<|im_end|>\n")


def test_tool_results_grouped_into_one_user_turn():
    msgs = _calls_turn() + [
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rainy"},
        {"role": "assistant", "content": "Paris sunny, Rome rainy.", "reasoning_content": "Summarise."},
        {"role": "user", "content": "thanks"},
        {"role": "tool", "content": "late"},
    ]
    out = render_chat(msgs, enable_thinking=False)
    assert ("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
            "<tool_response>\nrainy\n</tool_response><|im_end|>\n") in out
    # "thanks" is the last query, so both earlier assistant turns lose their reasoning
    assert "Summarise." not in out and "Two cities" not in out
    assert out.endswith("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>user\n<tool_response>\nlate\n"
                        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # tool responses do not count as a query: within one multi-step tool exchange all reasoning is kept
    out2 = render_chat(msgs[:5], add_generation_prompt=False)
    assert "<think>\nTwo cities, two calls.\n</think>" in out2 and "<think>\nSummarise.\n</think>" in out2


def test_parse_round_trip_reasoning_and_tool_calls():
    msgs = _calls_turn()
    text = render_chat(msgs, add_generation_prompt=False)
    gen = text.split("<|im_start|>assistant\n<think>\n", 1)[1]  # what the model writes after the prompt
    reasoning, content, calls = parse_assistant(gen, thinking=True, tools=[WEATHER])
    assert reasoning == "Two cities, two calls."
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome", "opts": {"x": [1, 2]}}
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
    assert calls[0]["id"] != calls[1]["id"]
    # re-render the parsed message: identical text
    again = [msgs[0], {"role": "assistant", "content": content, "reasoning_content": reasoning,
                       "tool_calls": calls}]
    assert render_chat(again, add_generation_prompt=False) == text


def test_parse_schema_types_and_json_body():
    # schema says string: a numeric-looking zip code stays a string; without schema it would be an int
    gen = ("Hmm.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
           "<parameter=zip>\n10001\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    _, content, calls = parse_assistant(gen, thinking=True, tools=[WEATHER])
    assert content == ""
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "New York", "zip": "10001", "days": 2}
    _, _, calls = parse_assistant(gen, thinking=True)
    assert json.loads(calls[0]["function"]["arguments"])["zip"] == 10001
    # multi-line values keep inner newlines
    gen = "<tool_call>\n<function=w>\n<parameter=code>\nline1\nline2\n</parameter>\n</function>\n</tool_call>"
    _, _, calls = parse_assistant(gen, thinking=False)
    assert json.loads(calls[0]["function"]["arguments"]) == {"code": "line1\nline2"}
    # JSON body (Qwen2.5/Qwen3 hermes style)
    gen = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
    r, content, calls = parse_assistant(gen, thinking=False)
    assert r is None and content == "Sure."
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_parse_thinking_edge_cases():
    assert parse_assistant("Still thinking about", thinking=True) == ("Still thinking about", "", [])
    assert parse_assistant("<think>\nx\n</think>\n\ny<|im_end|>junk", thinking=True) == ("x", "y", [])
    assert parse_assistant("plain answer\n", thinking=False) == (None, "plain answer", [])
    # an unparseable tool call stays in content
    r, c, calls = parse_assistant("a </think> <tool_call>not a call</tool_call>", thinking=True)
    assert r == "a" and c == "<tool_call>not a call</tool_call>" and calls == []


_PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<function=f>", "<parameter=x>\n1\n",
           "</parameter>", "</function>", '{"name": "g", "arguments": {}}', "<", "</", "<thi", "\n", "\n\n", " ",
           "  ", "a", "b c", "[1, ", "}", "é",
           "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
           '<tool_call>\n{"name": "g", "arguments": {"y": 2}}\n</tool_call>', "<think>\nr\n</think>\n\n"]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES), max_size=14), thinking=st.booleans(), tools=st.booleans(),
       forced=st.sampled_from([None, "", "f", "g"]), data=st.data())
def test_streamed_parts_are_prefixes_of_the_parsed_message(pieces, thinking, tools, forced, data):
    """What a stream sends for any prefix of a generation (split anywhere, even inside a marker) is a prefix of the
    final message's reasoning and content, and the finished text gives exactly the final parts, so the joined
    deltas equal the non-streamed message. Also for a forced tool-call reply (``forced``: None none, "" any function,
    else that one; only calls to "f" count), where the stream reads the forced prefix before the text so far."""
    prefix = "" if forced is None else tool_call_prefix(forced or None, enable_thinking=thinking)
    tools = tools or forced is not None
    names = None if forced is None else {"f"}
    gen = "".join(pieces)
    reasoning, content, _ = parse_assistant(prefix + gen, thinking=thinking, parse_tools=tools, names=names)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(gen)), max_size=6))) + [len(gen)]
    for k in cuts:
        r, c = partial_assistant(prefix + gen[:k], thinking=thinking, parse_tools=tools)
        assert (reasoning or "").startswith(r) and content.startswith(c), (gen[:k], r, c)


def test_partial_holds_back_markers_whitespace_and_tool_calls():
    assert partial_assistant("x\n</thi", thinking=True) == ("x", "")
    assert partial_assistant("x\n</think>\n\n[1, ", thinking=True) == ("x", "[1,")
    assert parse_assistant("x\n</think>\n\n[1, ", thinking=True) == ("x", "[1,", [])
    assert partial_assistant("Sure.\n<tool_call>\n<function=f>", thinking=False) == ("", "Sure.")
    assert partial_assistant("Sure.\n<tool_call>\n<function=f>", thinking=False, parse_tools=False) == (
        "", "Sure.\n<tool_call>\n<function=f>")
    assert partial_assistant("<think>a", thinking=False) == ("", "")  # a block or plain text: not known yet
    # a request without tools gets the call text as content, never a silently dropped call
    gen = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    assert parse_assistant(gen, thinking=False, parse_tools=False) == (None, gen, [])


def test_tool_call_prefix_closes_thinking_and_opens_a_call():
    assert tool_call_prefix("get_weather", enable_thinking=False) == "<tool_call>\n<function=get_weather>\n"
    assert tool_call_prefix(enable_thinking=False) == "<tool_call>\n<function"
    assert tool_call_prefix("f") == "\n</think>\n\n<tool_call>\n<function=f>\n"
    # the prompt ends as the template's thinking-off generation prompt does, whatever the thinking setting
    for name in ("get_weather", None):
        on = render_chat(USER, tools=[WEATHER], assistant_prefix=tool_call_prefix(name, enable_thinking=True))
        off = render_chat(USER, tools=[WEATHER], enable_thinking=False,
                          assistant_prefix=tool_call_prefix(name, enable_thinking=False))
        assert on == off == render_chat(USER, tools=[WEATHER], enable_thinking=False) + tool_call_prefix(
            name, enable_thinking=False)
    with pytest.raises(ValueError, match="function name"):
        tool_call_prefix("a>b")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        render_chat(USER, add_generation_prompt=False, assistant_prefix="<tool_call>")
    assert tool_names([WEATHER, {"name": "bare"}]) == {"get_weather", "bare"}


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("name", ["get_weather", None])
def test_forced_reply_parses_as_if_the_model_wrote_the_prefix(thinking, name):
    """A forced reply is read as prefix + generated text: a complete call parses to exactly the call the template
    renders (reasoning "" with thinking on, as a closed empty block); a call cut short, or to a function not offered
    under the enforced choice, is not a call and its text (prefix included) is the content."""
    call = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]
    full = render_chat(USER + [{"role": "assistant", "content": None, "tool_calls": call}],
                       add_generation_prompt=False, tools=[WEATHER])
    prefix = tool_call_prefix(name, enable_thinking=thinking)
    prompt = render_chat(USER, tools=[WEATHER], enable_thinking=thinking, assistant_prefix=prefix)
    gen = full[len(prompt):]  # what the model writes after the forced prefix
    assert full.startswith(prompt) and gen.endswith("</tool_call><|im_end|>\n")
    reasoning, content, calls = parse_assistant(prefix + gen, thinking=thinking, tools=[WEATHER],
                                                names={"get_weather"})
    assert (reasoning, content) == (("" if thinking else None), "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})]
    cut = gen[:gen.index("</function>")]  # e.g. finish_reason "length"
    assert parse_assistant(prefix + cut, thinking=thinking, tools=[WEATHER]) == (
        "" if thinking else None, (prefix + cut).split("</think>")[-1].strip(), [])
    other = (prefix + gen).replace("get_weather", "get_time")
    _, content, calls = parse_assistant(other, thinking=thinking, tools=[WEATHER], names={"get_weather"})
    assert calls == [] and content.startswith("<tool_call>\n<function=get_time>")
    assert parse_assistant(other, thinking=thinking, tools=[WEATHER])[2]  # any name counts without ``names``


@pytest.fixture(scope="module")
def shipped_tok():
    import os

    import dflash_jax
    from dflash_jax.models.tokenizer import Tokenizer

    return Tokenizer.from_dir(os.path.join(dflash_jax.SHIPPED_MODELS, "target"))


@settings(max_examples=60, deadline=None)
@given(name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,14}", fullmatch=True),
       arg=st.text("abc xyz_.019", max_size=12), thinking=st.booleans(), named=st.booleans())
def test_forced_prompt_tokens_are_a_prefix_of_the_complete_calls_tokens(shipped_tok, name, arg, thinking, named):
    """With the shipped tokenizer the forced prompt encodes to a token prefix of the same conversation with the whole
    call written out (the template's rendering): the model continues from the tokens it would have produced itself,
    with no token split across the prefix's end."""
    tool = {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}
    call = [{"type": "function", "function": {"name": name, "arguments": {"q": arg}}}]
    full = render_chat(USER + [{"role": "assistant", "content": None, "tool_calls": call}],
                       add_generation_prompt=False, tools=[tool])
    prompt = render_chat(USER, tools=[tool], enable_thinking=thinking,
                         assistant_prefix=tool_call_prefix(name if named else None, enable_thinking=thinking))
    assert full.startswith(prompt)
    p, f = shipped_tok.encode(prompt), shipped_tok.encode(full)
    assert f[:len(p)] == p


@pytest.mark.parametrize("messages, tools, match", [
    ([], None, "no messages"),
    ([{"role": "robot", "content": "x"}], None, r"message 0: unknown role 'robot'"),
    ([{"content": "x"}], None, "message 0: missing 'role'"),
    ([{"role": "user", "content": "a"}, {"role": "user"}], None, "message 1: user message is missing 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], None, "message 1: a system message"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], None, "message 0: content part 0"),
    ([{"role": "user", "content": 5}], None, "message 0: content must be"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}], None, "message 1: assistant message needs"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}],
     None, r"message 1: tool_calls\[0\]: function name"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "",
                                         "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     None, r"message 1: tool_calls\[0\]: arguments of 'f' is not valid JSON"),
    ([{"role": "tool", "content": "r"}, {"role": "user", "content": "a"}], None, "message 0: a tool message"),
    ([{"role": "system", "content": "s"}], None, "no user query"),
    (USER, [{"type": "function"}], r"tools\[0\]: a tool needs a 'function'"),
    (USER, [WEATHER, {"type": "function", "function": {"name": ""}}], r"tools\[1\]: function name"),
    (USER, [{"type": "function", "function": {"name": "f", "parameters": []}}], r"tools\[0\]: 'parameters'"),
    (USER, {"name": "f"}, "tools must be a list"),
    ("hello", None, "messages must be a list"),
])
def test_malformed_messages(messages, tools, match):
    with pytest.raises(ValueError, match=match):
        render_chat(messages, tools=tools)
