"""Faults inside requests, through the real app and engine thread (in-process, faults injected): an exception
while answering one request fails that request alone with HTTP 500 and OpenAI error JSON, while a concurrent one
succeeds; an engine step that raises fails the requests in flight and the server rebuilds its device state and
keeps serving; no page or slot leaks either way, and /metrics counts the faults."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

import dflash_jax as dj
from conftest import FIXTURES
from dflash_jax.engine.loop import Engine, EngineOptions
from dflash_jax.prefill.pflash import PFlashOptions
from dflash_jax.serve.app import Server, build_app

pytestmark = pytest.mark.xdist_group("serve_faults")


@pytest.fixture(scope="module")
def app():
    t = dj.load_target(os.path.join(FIXTURES, "qwen36_tiny_a"), dtype="float32")
    eng = Engine(t, None, EngineOptions(max_batch=2, prefill_batch=2, prefill_chunk=32, max_model_len=64,
                                        page_size=16))
    eng.warmup()
    srv = Server(eng, "tiny")
    with TestClient(build_app(srv), raise_server_exceptions=False) as client:
        yield srv, client


def _complete(client, n: int):
    return client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": n,
                                                 "ignore_eos": True, "temperature": 0})


def _assert_idle(srv: Server, timeout: float = 20.0) -> None:
    eng, t0 = srv.engine, time.time()
    while time.time() - t0 < timeout:
        if (not eng.running and not eng.waiting and len(eng.free_slots) == eng.options.max_batch
                and all(p.num_free == p.n_pages - 1 for p in eng.pools)):
            return
        time.sleep(0.05)
    pytest.fail(f"not idle: running {list(eng.running)}, waiting {len(eng.waiting)}, "
                f"free slots {len(eng.free_slots)}, free pages {[p.num_free for p in eng.pools]}")


def _both(client, a: int, b: int):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fa, fb = pool.submit(_complete, client, a), pool.submit(_complete, client, b)
        return fa.result(timeout=60), fb.result(timeout=60)


def test_an_exception_answering_one_request_fails_it_alone(app, monkeypatch):
    srv, client = app
    record = Server._record

    def failing_record(self, o, prep):
        if len(o.token_ids) == 7:  # only the request of 7 tokens
            raise RuntimeError("injected fault while answering")
        return record(self, o, prep)

    monkeypatch.setattr(Server, "_record", failing_record)
    bad, good = _both(client, 7, 5)
    assert bad.status_code == 500
    err = bad.json()["error"]
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 5
    _assert_idle(srv)
    monkeypatch.setattr(Server, "_record", record)
    again = _complete(client, 7)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 7


def test_an_engine_step_that_raises_fails_the_requests_in_flight_and_the_server_keeps_serving(app, monkeypatch):
    srv, client = app
    eng = srv.engine
    want = _complete(client, 40).json()["choices"][0]["text"]  # before any fault
    step, raised = Engine.step, []

    def failing_step(self):
        # once, mid-decode of both requests (each admitted and past its first token)
        if not raised and len(self.running) == 2 and all(r.tokens for r in self.running.values()):
            raised.append(True)
            raise RuntimeError("injected device fault")
        return step(self)

    faults0 = srv.runner.faults
    monkeypatch.setattr(Engine, "step", failing_step)
    r1, r2 = _both(client, 40, 40)  # long enough to overlap
    assert r1.status_code == r2.status_code == 500
    assert "injected device fault" in r1.json()["error"]["message"]
    assert srv.runner.faults == faults0 + 1
    _assert_idle(srv)
    after = _complete(client, 40)  # the rebuilt state serves the same greedy text
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == want
    metrics = client.get("/metrics").text
    assert any(line.startswith("dflash_engine_faults_total") and float(line.split()[-1]) >= 1
               for line in metrics.splitlines()), metrics
    assert eng.counters.get("lazy_compiles", 0) == 0


def test_a_short_request_runs_start_to_finish_while_another_prompt_is_being_compressed(app, monkeypatch):
    """PFlash compression runs once per request before admission on its own thread: while the scorer is busy (held
    here until the other request has finished), the event loop still admits requests, a prompt under
    --prefill-min-tokens does not queue behind the scorer, and the engine thread serves it to the end."""
    srv, client = app
    entered, other_done = threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def held_scorer(ids, options):
        entered.set()
        seen["steps_before"] = srv.runner.steps
        seen["released"] = other_done.wait(60)
        seen["steps_after"] = srv.runner.steps
        return np.linspace(1.0, 0.0, len(ids))

    opts = PFlashOptions(mode="always", min_tokens=30, keep_ratio=0.5, head_tokens=0, tail_tokens=0, chunk=4,
                         anchor_ngram=0)
    monkeypatch.setattr(srv, "pflash", (opts, held_scorer))
    compressed_prompt = list(range(5, 45))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = pool.submit(lambda: client.post("/v1/completions", json={
            "model": "tiny", "prompt": compressed_prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0}))
        assert entered.wait(60), "the scorer was never called"
        other = _complete(client, 12)  # through the same app, while the scorer holds
        other_done.set()
        held_r = held.result(timeout=60)
    assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 12
    assert other.json()["choices"][0]["telemetry"]["pflash"] == "short"
    assert seen["released"] and seen["steps_after"] >= seen["steps_before"] + 12  # the engine stepped meanwhile
    assert held_r.status_code == 200, held_r.text
    tel = held_r.json()["choices"][0]["telemetry"]
    assert tel["pflash"] == "compressed" and tel["raw_prompt_tokens"] == 40 == held_r.json()["usage"]["prompt_tokens"]
    assert tel["effective_prompt_tokens"] == 20
    _assert_idle(srv)
