"""KVFlash through the server: a real ``python -m dflash_jax.serve --kvflash N`` process on loopback, a resident
pool far smaller than the concurrent histories, spoken to with the official openai client.

Three long streamed requests and one short one run at once in a 24-page pool (their histories need ~57 pages), so
pages are moved to host memory and back while they decode. The short request's history is always within its
max-min fair share of the pool, so it is never paged out and its greedy output must equal the target's own
unbounded greedy continuation. Every request must return exactly the tokens it asked for, report its KVFlash
activity in its telemetry (the streamed ones on their final chunk), and ``/metrics`` must count the same page
traffic the requests report.
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import openai
import pytest

import dflash_jax as dj
from conftest import FIXTURES
from test_serve import _metrics, _spawn

pytestmark = pytest.mark.xdist_group("serve_kvflash")

MODEL_DIR = os.path.join(FIXTURES, "qwen36_tiny_a")  # no tokenizer: prompts and completions are token ids
MODEL = "qwen36_tiny_a"
PAGE, POOL_PAGES = 8, 24
LONG = [(120, 24), (112, 16), (104, 8)]  # (prompt tokens, max_tokens): 18 + 16 + 14 pages of history
PROBE = (8, 8)  # 2 pages: below its fair share of the pool at every step


def _pages(n_tokens: int) -> int:
    return -(-n_tokens // PAGE)


@pytest.fixture(scope="module")
def server():
    proc, base = _spawn(["--model", MODEL_DIR, "--max-concurrency", "4", "--max-model-len", "160",
                         "--page-size", str(PAGE), "--prefill-chunk", "32", "--kvflash", str(POOL_PAGES * PAGE)])
    yield {"base": base, "proc": proc}
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_concurrent_requests_under_kv_pressure_complete_and_report_page_traffic(server):
    rng = np.random.default_rng(0)
    long_prompts = [rng.integers(1, 200, n).tolist() for n, _ in LONG]
    probe_prompt = rng.integers(1, 200, PROBE[0]).tolist()

    async def streamed(c: openai.AsyncOpenAI, prompt: list[int], max_tokens: int):
        text, usage, final = "", None, None
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
                if ch.choices[0].finish_reason is not None:
                    final = ch.choices[0]
            if ch.usage:
                usage = ch.usage
        return text, usage, final

    async def run():
        c = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key="x", max_retries=0, timeout=120)
        probe = c.completions.create(model=MODEL, prompt=probe_prompt, max_tokens=PROBE[1], temperature=0,
                                     extra_body={"ignore_eos": True})
        return await asyncio.wait_for(
            asyncio.gather(probe, *(streamed(c, p, m) for p, (_, m) in zip(long_prompts, LONG))), 120)

    before = _metrics(server)
    probe, *longs = asyncio.run(run())
    after = _metrics(server)

    # every request returns exactly the tokens it asked for
    assert probe.usage.completion_tokens == PROBE[1] and probe.choices[0].finish_reason == "length"
    for (text, usage, final), (n, m) in zip(longs, LONG):
        assert usage.prompt_tokens == n and usage.completion_tokens == m
        assert final.finish_reason == "length" and len(text.split()) == m

    # per-request telemetry (the streamed ones on their final chunk) reports bounded residency and its traffic
    tels = [probe.choices[0].model_extra["telemetry"]] + [f.model_extra["telemetry"] for _, _, f in longs]
    for tel, (n, m) in zip(tels, [PROBE] + LONG):
        assert tel["kvflash"] and tel["effective_prompt_tokens"] == n
        assert tel["kv_logical_pages"] == _pages(n + m)
        assert 0 < tel["kv_resident_pages"] <= POOL_PAGES
        assert tel["kv_bytes_in"] >= 0 and tel["kv_wait_s"] >= 0
    long_tels = tels[1:]
    assert sum(t["kv_pages_out"] for t in long_tels) > 0 and sum(t["kv_pages_in"] for t in long_tels) > 0
    assert any(t["kv_resident_pages"] < t["kv_logical_pages"] for t in long_tels)  # residency really was bounded

    # the short request's whole history stayed resident: its greedy output is the unbounded one
    assert tels[0]["kv_pages_out"] == 0 and tels[0]["kv_resident_pages"] == tels[0]["kv_logical_pages"]
    want = dj.load_target(MODEL_DIR, dtype="float32").greedy(probe_prompt, PROBE[1])
    assert [int(t) for t in probe.choices[0].text.split()] == [int(t) for t in want]

    # /metrics counts exactly the page traffic the requests report; nothing is left running or held
    for key, field in (("dflash_kv_pages_in_total", "kv_pages_in"), ("dflash_kv_pages_out_total", "kv_pages_out")):
        assert after[key] - before[key] == sum(t[field] for t in tels) > 0, (key, before, after)
    assert after["dflash_completion_tokens_total"] - before["dflash_completion_tokens_total"] == \
        PROBE[1] + sum(m for _, m in LONG)
    assert after["dflash_running_requests"] == 0 and after["dflash_queue_depth"] == 0
    ok = 'dflash_requests_total{endpoint="/v1/completions",status="200"}'
    for key in (ok, "dflash_ttft_seconds_count", "dflash_tpot_seconds_count"):
        assert after[key] - before.get(key, 0) == 1 + len(LONG), key


def _ids(r) -> list[int]:
    """Completion token ids (a model without a tokenizer answers with its ids as text)."""
    return [int(t) for t in r.choices[0].text.split()]


def test_stop_token_ids_min_tokens_top_k_and_max_completion_tokens(server):
    c = openai.OpenAI(base_url=server["base"] + "/v1", api_key="x", max_retries=0, timeout=60)
    prompt = [7, 3, 9, 12, 40]
    g = _ids(c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True}))
    assert len(g) == 4
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                             extra_body={"stop_token_ids": [g[0]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 1
    # min_tokens bans the stop ids (and EOS) until it is reached
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                             extra_body={"stop_token_ids": [g[0]], "min_tokens": 3})
    got = _ids(r)
    assert r.usage.completion_tokens == len(got) >= 3 and g[0] not in got[:3]
    # top_k = 1 samples the argmax whatever the temperature and seed
    for seed in (1, 2):
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.5, seed=seed,
                                 extra_body={"top_k": 1, "ignore_eos": True})
        assert _ids(r) == g
    # max_completion_tokens (the newer name) wins over max_tokens
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                             extra_body={"max_completion_tokens": 2, "ignore_eos": True})
    assert r.usage.completion_tokens == 2 and _ids(r) == g[:2]


def test_startup_banner_names_the_model_the_kvflash_pool_and_the_url(server):
    """The start-up output: load line, a compile progress bar, the active features (the pool in tokens and
    pages) and the URL (read once the process has exited)."""
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) in (0, -signal.SIGTERM)
    out = proc.stdout.read()
    assert f"model {MODEL_DIR} (float32) loaded" in out and "compiling" in out
    assert "] 1/" in out and "#" in out  # the progress bar, one line per compiled bucket
    assert f"kvflash={POOL_PAGES * PAGE}-token resident pool ({POOL_PAGES} pages" in out
    assert "spec_mode=ar" in out and "max_concurrency=4" in out
    assert f"serving '{MODEL}' at {server['base']}/v1" in out
