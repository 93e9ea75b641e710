"""The server as a real process on loopback, spoken to with the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURES
from dflash_jax.models.chat import tool_call_prefix

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # experiments/

pytestmark = pytest.mark.xdist_group("serve")  # one server process, tests in order (SIGTERM last)

KEY = "test-key"
MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_dir(tmp) -> str:
    """tiny_b plus a small byte-level BPE tokenizer with the ChatML specials (vocab fits the model's 512)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = os.path.join(tmp, MODEL)
    shutil.copytree(os.path.join(FIXTURES, "qwen36_tiny_b"), d)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                "</tool_call>", "<tool_response>", "</tool_response>", "<|mask|>"]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["def add(a, b):\n    return a + b\n", "Hello world, the quick brown fox.", "user assistant system"] * 50
    tok.train_from_iterator(text, trainer)
    assert tok.get_vocab_size() <= 512
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>"}, f)
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    model = _model_dir(str(tmp_path_factory.mktemp("serve")))
    cmd = [sys.executable, "-m", "dflash_jax.serve", "--model", model, "--port", str(port), "--max-concurrency", "4",
           "--max-model-len", "256", "--page-size", "8", "--prefill-chunk", "32", "--api-key", KEY,
           "--enable-prompt-logprobs"]
    log = open(os.path.join(str(tmp_path_factory.getbasetemp()), "serve.log"), "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"server exited early:\n{log.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("server did not come up")
    yield {"base": base, "proc": proc, "log": log}
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server["base"] + "/metrics").text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(dflash_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def _idle(server, timeout=20.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        m = _metrics(server)
        if (m["dflash_running_requests"] == 0 and m["dflash_queue_depth"] == 0
                and m["dflash_kv_free_pages"] == m["dflash_kv_total_pages"] and m["dflash_free_slots"] == 4):
            return m
        time.sleep(0.2)
    pytest.fail(f"server not idle: {m}")


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(server["base"] + "/health").json()["status"] == "ok"


def test_completion_non_streaming_with_usage_logprobs_and_telemetry(server, client):
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0, logprobs=3)
    c = r.choices[0]
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 6 and r.usage.total_tokens == 10
    assert c.finish_reason == "length"
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    # keyed by token text: distinct ids that decode alike (partial UTF-8) share a key
    assert all(1 <= len(d) <= 3 for d in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    tel = c.model_extra["telemetry"]
    assert tel["effective_prompt_tokens"] == 4 and tel["spec_mode"] == "ar"
    for k in ("draft_steps", "accepted_tokens", "kv_pages_in", "kv_pages_out"):
        assert tel[k] == 0
    with open(server["log"].name) as f:  # the telemetry is logged too, one line per request
        logged = [json.loads(line.split(": ", 2)[2]) for line in f if "finished (length, 6 tokens)" in line]
    assert any(t["effective_prompt_tokens"] == 4 and t["spec_mode"] == "ar" for t in logged)


def test_streaming_equals_non_streaming_and_usage_is_exact(client):
    full = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 10
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_echo_returns_the_prompt_and_its_logprobs(server, client):
    import jax

    import dflash_jax as dj

    ids = [5, 6, 7, 8, 40, 41, 42, 9, 10, 11] * 4  # two prefill chunks of 32
    ref = np.asarray(jax.nn.log_softmax(dj.load_target(os.path.join(FIXTURES, "qwen36_tiny_b")).logits(ids), -1))
    # scoring only (max_tokens 0, as evaluation harnesses ask): the prompt, its logprobs, nothing generated
    before = _metrics(server)["dflash_completion_tokens_total"]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    assert _metrics(server)["dflash_completion_tokens_total"] == before  # nothing generated is counted
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], ref[np.arange(len(ids) - 1), ids[1:]], atol=1e-3)
    assert all(max(d.values()) == pytest.approx(float(ref[j - 1].max()), abs=1e-3)
               for j, d in enumerate(lp.top_logprobs) if j)
    assert c.text == "".join(lp.tokens) and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    # echo + generation: the prompt's entries, then exactly what the same request without echo returns
    kw = dict(model=MODEL, prompt="def add(a, b):", max_tokens=5, temperature=0, logprobs=1)
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(echo=True, **kw).choices[0]
    assert echoed.text == "def add(a, b):" + plain.text
    n = len(echoed.logprobs.tokens) - 5
    assert echoed.logprobs.tokens[n:] == plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert echoed.logprobs.text_offset == sorted(echoed.logprobs.text_offset)
    # streamed: the prompt comes first, and the chunks join to the same text and logprobs
    chunks = [ch.choices[0] for ch in client.completions.create(echo=True, stream=True, **kw) if ch.choices]
    assert chunks[0].text.startswith("def add(a, b):")
    assert "".join(ch.text for ch in chunks) == echoed.text
    assert sum((ch.logprobs.tokens for ch in chunks if ch.logprobs), []) == echoed.logprobs.tokens
    assert sum((ch.logprobs.text_offset for ch in chunks if ch.logprobs), []) == echoed.logprobs.text_offset
    # each chunk carries only its new tokens, offsets continuing where the last chunk's ended
    for streamed, whole in ((chunks, echoed), ([ch.choices[0] for ch in client.completions.create(stream=True, **kw)
                                                if ch.choices], plain)):
        lps = [ch.logprobs for ch in streamed if ch.logprobs]
        assert sum((lp.tokens for lp in lps), []) == whole.logprobs.tokens
        assert sum((lp.text_offset for lp in lps), []) == whole.logprobs.text_offset
        got = sum((lp.token_logprobs for lp in lps), [])
        assert [x is None for x in got] == [x is None for x in whole.logprobs.token_logprobs]
        assert [x for x in got if x is not None] == pytest.approx(
            [x for x in whole.logprobs.token_logprobs if x is not None], abs=1e-5)
        assert sum((lp.top_logprobs for lp in lps), []) == whole.logprobs.top_logprobs
    # echo without logprobs needs no scoring
    assert client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2, echo=True).choices[0].text.startswith(
        "".join(lp.tokens[:2]))


def test_a_batch_of_prompts_gives_choices_in_prompt_order(client):
    prompts = ["def add(a, b):", "Hello world", "the quick brown"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2, echo=True)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [p + a.choices[0].text for p, a in zip(prompts, alone) for _ in range(2)]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    ids = client.completions.create(model=MODEL, prompt=[[5, 6], [7, 8, 9]], max_tokens=3, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    streamed: dict[int, str] = {}
    for ch in client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {i: a.choices[0].text for i, a in enumerate(alone)}


def test_stop_strings_and_stop_token_ids(client):
    base = client.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if stop.strip():
        r = client.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=12, temperature=0, stop=[stop])
        assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
        assert text.startswith(r.choices[0].text)
        s = list(client.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=12, temperature=0, stop=[stop],
                                           stream=True))
        assert "".join(ch.choices[0].text for ch in s if ch.choices) == r.choices[0].text
    r = client.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [511]})  # an id the model may emit: never past it
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_completion_with_reasoning_split(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                       temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 5
    s = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=8, temperature=0, stream=True,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    content = "".join((ch.choices[0].delta.content or "") for ch in s if ch.choices)
    assert content == (r.choices[0].message.content or "")
    # thinking on: everything before </think> is reasoning_content, never content
    t = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert t.choices[0].message.model_extra.get("reasoning_content") is not None
    assert len(t.choices[0].logprobs.content) == 6
    assert all(len(x.top_logprobs) == 2 for x in t.choices[0].logprobs.content)


def test_chat_continues_the_final_message_and_opens_no_turn_without_the_generation_prompt(server, client):
    """vLLM's continue_final_message / add_generation_prompt: the reply continues a partial assistant message (the
    prompt /tokenize renders with the same flags, answered greedily as a plain completion would) and is content."""
    h = {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "user", "content": "Write a function."}, {"role": "assistant", "content": "def add(a, b):"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(server["base"] + "/tokenize", json={"messages": msgs, **flags}, headers=h).json()["tokens"]
    closed = httpx.post(server["base"] + "/tokenize", json={"messages": msgs, "add_generation_prompt": False},
                        headers=h).json()["tokens"]
    assert closed[:len(ids)] == ids and len(closed) > len(ids)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={**flags, "ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids)
    want = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert r.choices[0].message.content == want
    assert r.choices[0].message.model_extra.get("reasoning_content") is None
    streamed = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                              extra_body={**flags, "ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == want
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                       extra_body={"continue_final_message": True})


def test_vllm_prompt_logprobs_on_completions_and_chat(client):
    import jax

    import dflash_jax as dj

    ids = [5, 6, 7, 8, 40, 41, 42, 9, 10, 11]
    ref = np.asarray(jax.nn.log_softmax(dj.load_target(os.path.join(FIXTURES, "qwen36_tiny_b")).logits(ids), -1))
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for j in range(1, len(ids)):
        mine = pl[j][str(ids[j])]
        assert mine["logprob"] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-3)
        assert mine["rank"] == 1 + int(np.sum(ref[j - 1] > ref[j - 1, ids[j]] + 1e-4))
        top = sorted((d for t, d in pl[j].items() if d["rank"] <= 2), key=lambda d: d["rank"])
        assert [d["logprob"] for d in top] == pytest.approx(np.sort(ref[j - 1])[::-1][:2].tolist(), abs=1e-3)
        assert all(isinstance(d["decoded_token"], str) for d in pl[j].values())
    assert r.choices[0].text == client.completions.create(model=MODEL, prompt=ids, max_tokens=2,
                                                          temperature=0).choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    cpl = chat.choices[0].model_extra["prompt_logprobs"]
    assert len(cpl) == chat.usage.prompt_tokens and all(len(d) == 1 for d in cpl[1:])
    streamed = [ch.choices[0] for ch in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0, stream=True, extra_body={"prompt_logprobs": 2})
        if ch.choices]
    assert streamed[-1].model_extra["prompt_logprobs"] == pl


def test_logprobs_name_tokens_by_id_when_asked(server, client):
    kw = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=2)
    plain = client.completions.create(**kw).choices[0]
    ids = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert all(t.startswith("token_id:") for t in ids.logprobs.tokens)
    toks = [int(t.removeprefix("token_id:")) for t in ids.logprobs.tokens]
    back = httpx.post(server["base"] + "/detokenize", json={"tokens": toks},
                      headers={"Authorization": f"Bearer {KEY}"}).json()["prompt"]
    assert back == plain.text == ids.text
    assert ids.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs)
    assert all(k.startswith("token_id:") for d in ids.logprobs.top_logprobs for k in d)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    assert all(c.token.startswith("token_id:") and all(a.token.startswith("token_id:") for a in c.top_logprobs)
               for c in chat.choices[0].logprobs.content)


def test_vllm_output_options_truncate_the_prompt_and_keep_the_stop_string(client):
    kw = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    ids = list(range(3, 40))
    tail = client.completions.create(prompt=ids[-8:], **kw)
    cut = client.completions.create(prompt=ids, **{**kw, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 8}})
    assert cut.usage.prompt_tokens == 8 and cut.choices[0].text == tail.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there " * 8}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    text = tail.choices[0].text
    stop = text[4:6]
    assert stop and text.find(stop) == 4
    for keep in (False, True):
        r = client.completions.create(prompt=ids[-8:], stop=[stop], **{**kw, "extra_body": {
            "ignore_eos": True, "include_stop_str_in_output": keep}})
        assert r.choices[0].text == text[:6 if keep else 4] and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(prompt=ids, **{**kw, "extra_body": {"truncate_prompt_tokens": 0}})


def _stream_matches(client, **kw):
    """The same greedy chat request streamed and not: the joined content / reasoning_content deltas equal the
    message exactly (whitespace included) and the streamed tool calls are the message's. Returns the non-streamed
    response."""
    r = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    msg = r.choices[0].message
    assert "".join(d.content or "" for d in deltas) == (msg.content or "")
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        ((msg.model_extra or {}).get("reasoning_content") or "")
    assert [(tc.function.name, tc.function.arguments) for d in deltas for tc in (d.tool_calls or [])] == \
        [(tc.function.name, tc.function.arguments) for tc in (msg.tool_calls or [])]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    return r


@pytest.mark.parametrize("thinking", [False, True])
def test_streamed_chat_equals_non_streamed_exactly(client, thinking):
    for n in (3, 7, 12):  # cut at different points: trailing whitespace, partial markers
        _stream_matches(client, model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=n,
                        temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": thinking},
                                                   "ignore_eos": True})


def test_sampling_is_reproducible_with_a_seed(client):
    a = client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=8, temperature=1.0, seed=123)
    b = client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=8, temperature=1.0, seed=123)
    assert a.choices[0].text == b.choices[0].text
    n = client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=8, temperature=1.0, seed=5, n=3)
    assert len(n.choices) == 3 and n.usage.completion_tokens == 24
    # min_p = 1 keeps only the most likely token: temperature-1 sampling becomes greedy
    kw = dict(model=MODEL, prompt=[3, 4], max_tokens=8)
    greedy = client.completions.create(temperature=0, extra_body={"ignore_eos": True}, **kw).choices[0].text
    kept = client.completions.create(temperature=1.0, seed=9, extra_body={"ignore_eos": True, "min_p": 1.0}, **kw)
    assert kept.choices[0].text == greedy


def test_logit_bias_and_penalties_reach_the_sampler(client):
    forced = client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=5, temperature=0, logprobs=0,
                                       logit_bias={"40": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].logprobs.tokens == [forced.choices[0].logprobs.tokens[0]] * 5
    again = client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=5, temperature=0, logprobs=0,
                                      logit_bias={"41": 100}, extra_body={"ignore_eos": True})
    assert again.choices[0].logprobs.tokens[0] != forced.choices[0].logprobs.tokens[0]
    kw = dict(model=MODEL, prompt=[3, 4, 5], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    # negative penalties make the random fixture model repeat what it said
    repeat = client.completions.create(frequency_penalty=-2.0, presence_penalty=-2.0, **kw).choices[0].text
    assert repeat != plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        frequency_penalty=-2.0, presence_penalty=-2.0, stream=True, **kw))
    assert streamed == repeat


def test_structured_output_through_the_api(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
              "required": ["ok", "size"]}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a size."}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert isinstance(obj["ok"], bool) and obj["size"] in ("S", "M", "L") and r.choices[0].finish_reason == "stop"
    assert r.choices[0].telemetry["spec_mode"] == "ar"
    c = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=8, temperature=0.8, seed=2,
                                  extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert c.choices[0].text in ("yes", "no", "maybe")
    rx = client.completions.create(model=MODEL, prompt="id:", max_tokens=8, temperature=0,
                                   extra_body={"guided_regex": "[a-c]{3}[0-9]"})
    assert re.fullmatch("[a-c]{3}[0-9]", rx.choices[0].text)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a size."}], max_tokens=40, temperature=0,
        stream=True, response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content


def test_tokenize_and_detokenize(server, client):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server["base"] + "/tokenize", json={"model": MODEL, "prompt": "def add(a, b):"}, headers=h).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 256
    back = httpx.post(server["base"] + "/detokenize", json={"tokens": r["tokens"]}, headers=h).json()
    assert back["prompt"] == "def add(a, b):"
    msgs = [{"role": "user", "content": "Hello world"}]
    chat = httpx.post(server["base"] + "/tokenize", json={"messages": msgs}, headers=h).json()
    done = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert chat["count"] == done.usage.prompt_tokens  # the prompt the chat endpoint bills
    for body, path in (({"tokens": [99999]}, "/detokenize"), ({"prompt": "a", "messages": msgs}, "/tokenize"),
                       ({}, "/tokenize"), ({"prompt": "a", "model": "nope"}, "/tokenize")):
        e = httpx.post(server["base"] + path, json=body, headers=h)
        assert e.status_code in (400, 404) and e.json()["error"]["message"], (body, e.text)


BAD = [
    ("post", "/v1/completions", b"{not json", 400, "JSON"),
    ("json", "/v1/completions", {"model": "nope", "prompt": [1], "max_tokens": 2}, 404, "does not exist"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "temperature": 7}, 400, "temperature"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "top_p": 0}, 400, "top_p"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "n": 0}, 400, "n"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "min_p": 1.5}, 400, "min_p"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 5000}, 400, "max_model_len"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1] * 300, "max_tokens": 2}, 400, "max_model_len"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 2}, 400, "empty"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [99999], "max_tokens": 2}, 400, "token ids"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "stop": ["a"] * 17}, 400, "stop"),
    ("json", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "suffix": "x"}, 400, "suffix"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ("json", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": 0}, 400, "max_tokens"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "presence_penalty": 3}, 400, "presence_penalty"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("json", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "response_format": {"type": "xml"}}, 400, "response_format"),
    ("json", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "response_format": {"type": "json_schema"}}, 400, "json_schema"),
    ("json", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400,
     "at most one"),
    ("json", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "response_format": {"type": "json_object"},
                                      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     400, "tools"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "guided_regex": "(unclosed"}, 400, "automaton"),
    ("json", "/v1/completions", {"model": MODEL, "prompt": [1], "guided_choice": []}, 400, "guided_choice"),
    ("json", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("json", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("json", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "tool_choice": "banana"}, 400, "tool_choice"),
    ("json", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "tool_choice": "required"}, 400, "needs tools"),
    ("json", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
     "not among the tools"),
]


@pytest.mark.parametrize("kind,path,body,status,needle", BAD)
def test_bad_input_gets_openai_error_json(server, kind, path, body, status, needle):
    h = {"Authorization": f"Bearer {KEY}"}
    if kind == "post":
        r = httpx.post(server["base"] + path, content=body, headers={**h, "content-type": "application/json"})
    else:
        r = httpx.post(server["base"] + path, json=body, headers=h)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower() and err["type"]


_FIELDS = {"model": st.sampled_from([MODEL, "other", "", None]),
           "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 600), max_size=20), st.none(),
                               st.lists(st.lists(st.integers(0, 500), max_size=5), max_size=2)),
           "max_tokens": st.one_of(st.integers(-3, 8), st.just(5000), st.none(), st.text(max_size=3)),
           "temperature": st.one_of(st.floats(-1, 5), st.none()),
           "top_p": st.one_of(st.floats(-1, 2), st.none()), "top_k": st.integers(-3, 50),
           "min_p": st.floats(-0.5, 1.5), "echo": st.booleans(), "priority": st.integers(-3, 3),
           "n": st.integers(-1, 4), "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=20)),
           "seed": st.one_of(st.integers(-2, 2**40), st.none()), "logprobs": st.one_of(st.integers(-1, 12), st.none()),
           "min_tokens": st.integers(-1, 8), "stop_token_ids": st.lists(st.integers(-5, 2**33), max_size=10),
           "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
           "repetition_penalty": st.floats(-1, 12),
           "logit_bias": st.dictionaries(st.one_of(st.integers(-2, 600).map(str), st.text(max_size=3)),
                                         st.floats(-150, 150), max_size=4),
           "guided_choice": st.lists(st.text(max_size=3), max_size=3),
           "guided_regex": st.sampled_from(["[ab]{2}", "(", "x*", ""]),
           "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                                               {"type": "json_schema", "json_schema": {"schema": {"enum": ["a"]}}},
                                               {"type": 3}]),
           "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x", "tool"]),
                                                       "content": st.one_of(st.text(max_size=20), st.none())}),
                                max_size=3)}


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.dictionaries(st.sampled_from(sorted(_FIELDS)), st.none(), max_size=8).flatmap(
           lambda d: st.fixed_dictionaries({k: _FIELDS[k] for k in d})))
def test_fuzzed_request_bodies_never_crash_the_server_or_leak(server, path, body):
    r = httpx.post(server["base"] + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code in (200, 400, 404, 413), r.text
    if r.status_code != 200:
        assert r.json()["error"]["message"]
    _idle(server)


def test_api_key_is_required(server):
    r = httpx.post(server["base"] + "/v1/completions", json={"model": MODEL, "prompt": [1]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_client_disconnect_frees_pages_and_slot(server):
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server["base"] + "/v1/completions", headers=h, timeout=30,
                      json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200, "stream": True,
                            "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    _idle(server)


def test_bounded_load_every_stream_completes_and_nothing_leaks(server):
    async def one(c, i):
        t0 = time.perf_counter()
        first, n_tok, usage = None, 0, None
        stream = await c.completions.create(model=MODEL, prompt=list(range(1, 2 + i % 20)), max_tokens=4 + i % 13,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            logprobs=0, extra_body={"ignore_eos": True})
        async for ch in stream:
            if ch.choices and ch.choices[0].logprobs:
                first = first or time.perf_counter() - t0
                n_tok += len(ch.choices[0].logprobs.tokens)
            if ch.usage:
                usage = ch.usage
        return first, n_tok, usage, 4 + i % 13

    async def run():
        c = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=240)
        return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(64))), 240)

    before = _metrics(server)["dflash_completion_tokens_total"]
    res = asyncio.run(run())
    assert len(res) == 64
    for first, n_tok, usage, want in res:
        assert usage is not None and usage.completion_tokens == want == n_tok
    total = sum(u.completion_tokens for _, _, u, _ in res)
    m = _idle(server)
    assert m["dflash_completion_tokens_total"] - before == total
    ttfts = sorted(r[0] for r in res if r[0] is not None)
    print(f"p99 TTFT over 64 streams: {ttfts[int(0.99 * (len(ttfts) - 1))]:.3f}s")


def test_sigterm_drains_running_requests_then_exits(server):
    h = {"Authorization": f"Bearer {KEY}"}
    got = []
    with httpx.stream("POST", server["base"] + "/v1/completions", headers=h, timeout=60,
                      json={"model": MODEL, "prompt": [1, 2], "max_tokens": 40, "stream": True,
                            "ignore_eos": True}) as r:
        server["proc"].send_signal(signal.SIGTERM)
        for line in r.iter_lines():
            if line.startswith("data:"):
                got.append(line)
    assert got[-1] == "data: [DONE]"
    # uvicorn re-raises the signal after its graceful shutdown, so -SIGTERM is a clean exit too
    assert server["proc"].wait(60) in (0, -signal.SIGTERM)


def _spawn(args: list[str]) -> tuple[subprocess.Popen, str]:
    """Start a server process with ``args`` on a free port; wait for /health. Returns (process, base URL)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_jax.serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            pytest.fail(proc.stdout.read())
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail("server did not come up")


ADD_TOOL = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]


def _check_tools(client, model: str) -> None:
    """Tools through the server (the Qwen tool preamble is ~250 tokens with the shipped tokenizer, ~950 with the
    test one: too long for the module server). Tools reach the chat template (the prompt grows by the tool
    preamble; tool_choice "none" drops them) and the streamed answer of a tool request equals the non-streamed one
    (tool-call parsing itself: tests/test_chat.py)."""
    tools = ADD_TOOL
    kw = dict(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    plain = client.chat.completions.create(**kw)
    r = client.chat.completions.create(**kw, tools=tools)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert client.chat.completions.create(**kw, tools=tools, tool_choice="none").usage.prompt_tokens == \
        plain.usage.prompt_tokens
    other = {"type": "function", "function": {"name": "mul", "description": "Multiply.", "parameters": {
        "type": "object", "properties": {"x": {"type": "number"}}}}}
    named = client.chat.completions.create(**kw, tools=[other, *tools],
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    # only the named function is offered, and the prompt ends with the forced start of a call to it
    forced = tool_call_prefix("add", enable_thinking=False)
    assert named.usage.prompt_tokens == len(_shipped_tok().apply_chat_template(
        kw["messages"], enable_thinking=False, tools=tools, assistant_prefix=forced))
    _stream_matches(client, **kw, tools=tools)


@pytest.fixture(scope="module")
def shipped():
    """``python -m dflash_jax.serve --ddtree``: no model given, so the shipped tiny target with its own drafter."""
    proc, base = _spawn(["--ddtree", "--max-concurrency", "2", "--max-model-len", "512"])
    yield openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0), base
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def test_the_shipped_model_set_is_served_by_default(shipped):
    """With no --model the shipped set is served: chat works with the real client, the model id is the shipped
    target's, greedy text (speculative, with the shipped drafter) equals the target's own greedy continuation, and
    chat with tools works (``_check_tools``)."""
    import dflash_jax as dj
    from dflash_jax.models.tokenizer import Tokenizer
    from dflash_jax.serve.__main__ import SHIPPED

    c, _ = shipped
    (m,) = c.models.list().data
    assert m.id == "target"
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    r = c.chat.completions.create(model=m.id, messages=msgs, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].message.content is not None
    prompt = "def add(a, b):\n"
    r = c.completions.create(model=m.id, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].model_extra["telemetry"]["draft_steps"] >= 1
    path = os.path.join(SHIPPED, "target")
    tok = Tokenizer.from_dir(path)
    want = dj.load_target(path).greedy(tok.encode(prompt), 8)
    assert r.choices[0].text == tok.decode(want)
    _check_tools(c, m.id)


def test_shipped_model_stream_equals_non_stream_with_trailing_whitespace(shipped):
    """The shipped target answers "hi" (thinking off, 17 tokens) with text ending in "It has ": the streamed
    content must equal the message exactly, trailing space handled the same way in both."""
    c, _ = shipped
    kw = dict(model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=17, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
    raw = c.completions.create(model="target", prompt=_chat_prompt("hi", thinking=False), max_tokens=17,
                               temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    assert raw != raw.rstrip()  # the case this test is about is still produced by the shipped model
    assert _stream_matches(c, **kw).choices[0].message.content == raw.strip()
    kw["extra_body"] = {"ignore_eos": True}  # thinking on (the server default): reasoning_content too
    assert _stream_matches(c, **kw).choices[0].message.model_extra.get("reasoning_content") is not None


def _shipped_tok():
    from dflash_jax.models.tokenizer import Tokenizer
    from dflash_jax.serve.__main__ import SHIPPED

    return Tokenizer.from_dir(os.path.join(SHIPPED, "target"))


def _chat_prompt(content: str, *, thinking: bool) -> list[int]:
    return _shipped_tok().apply_chat_template([{"role": "user", "content": content}], enable_thinking=thinking)


def test_enforced_tool_choice_forces_the_call(shipped):
    """tool_choice "required" and a named function are enforced by a forced start of the call: the reply (streamed
    or not) is the greedy continuation of the prompt plus that prefix (checked against /v1/completions on the same
    token ids), parsed as if the model had written the prefix; the prefix is billed as prompt tokens. The shipped
    target, trained on calls to ``read_source`` for questions about a function, calls it when it may choose
    ("required"; to "hello" it starts the call but does not close it within 64 tokens). A reply that does not
    parse into a call (the shipped target, forced into ``add``, writes code instead of its parameters; or a call cut
    short by length) keeps its raw text, prefix included, as content, with the engine's finish reason."""
    from dflash_jax.models.chat import parse_assistant
    from experiments.corpus import READ_FILE_TOOL

    c, _ = shipped
    tok = _shipped_tok()
    msgs = [{"role": "user", "content": "What does `json.dumps` do?"}]
    tools = [READ_FILE_TOOL, *ADD_TOOL]
    named = {"type": "function", "function": {"name": "add"}}
    parsed = 0
    for choice, fn, offered, max_tokens in ((named, "add", ADD_TOOL, 64), ("required", None, tools, 64),
                                            (named, "add", ADD_TOOL, 3)):
        r = _stream_matches(c, model="target", messages=msgs, tools=tools, tool_choice=choice, max_tokens=max_tokens,
                            temperature=0)  # thinking on (the server default): closed empty by the prefix
        prefix = tool_call_prefix(fn, enable_thinking=True)
        ids = tok.apply_chat_template(msgs, tools=offered, assistant_prefix=prefix)
        raw = c.completions.create(model="target", prompt=ids, max_tokens=max_tokens, temperature=0)
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == raw.usage.completion_tokens <= max_tokens
        reasoning, content, calls = parse_assistant(prefix + raw.choices[0].text, thinking=True, tools=offered)
        msg = r.choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == (reasoning, content) and reasoning == ""
        if max_tokens == 3:
            assert r.choices[0].finish_reason == "length" and not msg.tool_calls
            assert content.startswith("<tool_call>\n<function=add>\n")
            continue
        if not calls:
            assert r.choices[0].finish_reason == raw.choices[0].finish_reason and not msg.tool_calls
            assert content.startswith("<tool_call>\n<function" + (f"={fn}>\n" if fn else ""))
            continue
        parsed += 1
        assert r.choices[0].finish_reason == "tool_calls" and content == ""
        assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == [
            (t["function"]["name"], t["function"]["arguments"]) for t in calls]
        assert msg.tool_calls[0].function.name == (fn or "read_source")
    assert parsed >= 1  # "required": the shipped target completes the call it starts


def test_speculative_metrics_move_after_requests(shipped):
    """/metrics of a --ddtree server: the acceptance-length histogram, draft rounds, accepted tokens and the
    cohort-yield events (the shipped drafter emits fewer than the default 6 tokens per request in a first round, so
    each cohort yields to AR) all move with requests."""
    c, base = shipped
    m0 = _metrics({"base": base})
    for p in ("def add(a, b):\n", "import os\n", "class A:\n"):
        c.completions.create(model="target", prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    m1 = _metrics({"base": base})
    assert m1["dflash_acceptance_length_count"] - m0["dflash_acceptance_length_count"] == 3
    assert m1["dflash_acceptance_length_sum"] - m0["dflash_acceptance_length_sum"] >= 3  # >= 1 token per round
    assert m1["dflash_spec_draft_steps_total"] - m0["dflash_spec_draft_steps_total"] >= 3
    assert m1["dflash_spec_accepted_tokens_total"] >= m0["dflash_spec_accepted_tokens_total"]
    assert m1["dflash_cohort_yield_events_total"] - m0["dflash_cohort_yield_events_total"] >= 1
    assert m1["dflash_cohort_reprobes_total"] == 0  # --cohort-reprobe-tokens 0: a yielded request stays AR
    assert m1["dflash_completion_tokens_total"] - m0["dflash_completion_tokens_total"] == 18


def test_ddtree_flags_start_a_speculative_server(tmp_path):
    """--ddtree --drafter (with --fast-rollback: one sequence) serves losslessly (same greedy text as the AR
    server) and reports the mode and how rounds committed; with --structured-spec a guided request stays
    speculative and matches its constraint."""
    import jax
    import jax.numpy as jnp

    import dflash_jax as dj
    from dflash_jax.config import DrafterConfig
    from dflash_jax.models import dflash
    from dflash_jax.models.dflash_loader import save_drafter
    from dflash_jax.models.tokenizer import Tokenizer

    model = _model_dir(str(tmp_path))
    tcfg = dj.TargetConfig.from_file(model)
    dcfg = DrafterConfig.from_hf_dict({
        "model_type": "qwen3", "hidden_size": tcfg.hidden_size, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rope_theta": 1e7, "block_size": 4,
        "dflash_config": {"mask_token_id": 9, "target_layer_ids": [1, 5]}})
    save_drafter(str(tmp_path / "drafter"), dcfg, dflash.init_params(dcfg, jax.random.key(0), jnp.float32))
    proc, base = _spawn(["--model", model, "--max-concurrency", "1", "--max-model-len", "128", "--page-size", "8",
                         "--prefill-chunk", "32", "--ddtree", "--drafter", str(tmp_path / "drafter"),
                         "--ddtree-budget", "4", "--ddtree-max-verify-tokens", "4", "--cohort-yield-min", "0",
                         "--fast-rollback", "--structured-spec"])
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True})
        tel = r.choices[0].model_extra["telemetry"]
        assert tel["spec_mode"] == "ddtree" and tel["draft_steps"] >= 1 and r.usage.completion_tokens == 6
        assert tel["rollback_mode"] == "fast-rollback"
        want = dj.load_target(model).greedy([5, 6, 7, 8], 6)
        assert r.choices[0].text == Tokenizer.from_dir(model).decode(want)
        rx = c.completions.create(model=MODEL, prompt="id:", max_tokens=8, temperature=0,
                                  extra_body={"guided_regex": "[a-c]{3}[0-9]"})
        assert re.fullmatch("[a-c]{3}[0-9]", rx.choices[0].text)
        assert rx.choices[0].model_extra["telemetry"]["spec_mode"] == "ddtree"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_prefix_cache_flag_reuses_prompt_prefixes(tmp_path):
    """--prefix-cache: a prompt sharing a cached prefix reports it in usage and answers the target's greedy text."""
    import dflash_jax as dj
    from dflash_jax.models.tokenizer import Tokenizer

    model = _model_dir(str(tmp_path))
    proc, base = _spawn(["--model", model, "--max-concurrency", "2", "--max-model-len", "128", "--page-size", "8",
                         "--prefill-chunk", "16", "--prefix-cache", "2"])
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        head = list(range(20, 60))
        kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        first = c.completions.create(prompt=head + [3, 4], **kw)
        again = c.completions.create(prompt=head + [7, 8, 9], **kw)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == 32
        want = dj.load_target(model).greedy(head + [7, 8, 9], 6)
        assert again.choices[0].text == Tokenizer.from_dir(model).decode(want)
        m = httpx.get(base + "/metrics").text
        assert "dflash_prefix_cache_hits_total 1.0" in m and "dflash_prefix_cache_tokens_total 32.0" in m
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_prefill_compression_bills_raw_and_prefills_effective(tmp_path):
    """--prefill-compression always: a long prompt is compressed once before admission; usage stays raw."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.models import dense

    model = _model_dir(str(tmp_path))
    scfg = dense.DenseConfig.from_hf_dict({
        "model_type": "qwen3", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": True, "max_position_embeddings": 4096})
    dense.save_dense(str(tmp_path / "scorer"), scfg, dense.init_params(scfg, jax.random.key(0), jnp.float32))
    proc, base = _spawn(["--model", model, "--max-concurrency", "1", "--max-model-len", "1536", "--page-size", "16",
                         "--prefill-chunk", "128", "--prefill-compression", "always",
                         "--prefill-drafter", str(tmp_path / "scorer"), "--prefill-min-tokens", "1024",
                         "--prefill-keep-ratio", "0.05"])
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        raw = 3000  # over max_model_len: only its compressed form fits (head 256 + tail 768 + ~5 % kept)
        long_prompt = [int(i) for i in np.random.default_rng(0).integers(20, 500, raw)]
        r = c.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4, temperature=0)
        tel = r.choices[0].model_extra["telemetry"]
        assert r.usage.prompt_tokens == raw and tel["raw_prompt_tokens"] == raw
        assert tel["pflash"] == "compressed" and tel["effective_prompt_tokens"] <= 256 + 768 + 0.05 * raw + 2 * 32
        assert tel["effective_prompt_tokens"] == round(tel["pflash_ratio"] * raw) and tel["pflash_scoring_s"] > 0
        short = c.completions.create(model=MODEL, prompt=long_prompt[:20], max_tokens=2, temperature=0)
        st = short.choices[0].model_extra["telemetry"]
        assert st["pflash"] == "short" and st["effective_prompt_tokens"] == 20 == short.usage.prompt_tokens
        # tool-calling requests are never compressed, even with "always": tools offered, or tool turns in the history
        filler = "the quick brown fox " * 60
        tool_turns = [{"role": "user", "content": filler * 5},
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "1"}]
        for kw in (dict(messages=[{"role": "user", "content": filler}], tools=ADD_TOOL), dict(messages=tool_turns)):
            r = c.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, **kw)
            tel = r.choices[0].model_extra["telemetry"]
            assert r.usage.prompt_tokens >= 1024  # over --prefill-min-tokens: compressed if it were not for tools
            assert tel["pflash"] == "tools" and tel["effective_prompt_tokens"] == r.usage.prompt_tokens
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
