"""DeviceTurns: a background device user (the PFlash scorer) alternates with the engine's steps while the engine has
work, never waits while it is idle, and a wait is bounded by its timeout; the engine reports its steps to it."""

import os
import threading
import time

import pytest

from conftest import FIXTURES
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.engine.turns import DeviceTurns
from dflash_jax.target import load_target


def test_an_idle_engine_never_makes_the_background_wait():
    t = DeviceTurns(timeout_s=5.0)
    t0 = time.perf_counter()
    for _ in range(100):
        t.background_turn()
    assert time.perf_counter() - t0 < 1.0
    assert t.stats()["turns"] == 100 and t.stats()["waits"] == 0


def test_a_busy_engine_gets_a_step_between_two_background_dispatches():
    """While the engine is busy, every background turn after the first comes after an engine dispatch that the
    previous turn had not seen: the engine-dispatch count at successive turns strictly increases."""
    t = DeviceTurns(timeout_s=5.0)
    seen: list[int] = []
    t.engine_busy(True)

    def background():
        for _ in range(20):
            t.background_turn()
            seen.append(t._seen)  # the engine dispatches counted at this turn (set under the lock by the turn)
            time.sleep(0.0005)  # the dispatch itself

    th = threading.Thread(target=background)
    th.start()
    steps = 0
    while th.is_alive() and steps < 5000:  # the engine keeps stepping until the background is done
        time.sleep(0.002)  # host work and the step on the device
        t.engine_dispatched()
        steps += 1
    th.join(5.0)
    t.engine_busy(False)
    assert not th.is_alive() and len(seen) == 20
    assert all(b > a for a, b in zip(seen, seen[1:])), seen
    assert t.stats()["waits"] >= 1 and t.stats()["timeouts"] == 0  # how many waited depends on thread timing


def test_the_engine_going_idle_releases_a_waiting_background():
    t = DeviceTurns(timeout_s=10.0)
    t.engine_busy(True)
    t.background_turn()  # no step dispatched since the start: takes the turn the engine owes it
    done = threading.Event()
    th = threading.Thread(target=lambda: (t.background_turn(), done.set()))
    th.start()
    assert not done.wait(0.1)  # busy, and no step since the last turn: waits
    t.engine_busy(False)
    assert done.wait(5.0)
    th.join()


def test_a_wait_ends_at_the_timeout():
    t = DeviceTurns(timeout_s=0.05)
    t.engine_busy(True)
    t.background_turn()
    t0 = time.perf_counter()
    t.background_turn()
    assert 0.04 < time.perf_counter() - t0 < 2.0 and t.stats()["timeouts"] == 1
    with pytest.raises(ValueError, match="timeout_s"):
        DeviceTurns(timeout_s=0)


def test_the_engine_reports_every_dispatched_step_and_goes_idle():
    eng = Engine(load_target(os.path.join(FIXTURES, "qwen36_tiny_a"), dtype="float32"), None,
                 EngineOptions(max_batch=2, page_size=16, max_model_len=128, prefill_chunk=16))
    eng.turns = t = DeviceTurns()
    busy = []
    real = t.engine_busy
    t.engine_busy = lambda b: (busy.append(b), real(b))[1]
    eng.generate([[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    steps = sum(v for k, v in eng.counters.items() if k.endswith("_steps"))
    assert steps > 0 and t._dispatches == steps
    assert busy[0] is True and busy[-1] is False and not t._busy


def test_a_server_with_a_paced_scorer_shares_its_turns_with_the_engine():
    import jax
    import jax.numpy as jnp

    from dflash_jax.models import dense
    from dflash_jax.prefill.pflash import DenseScorer, PFlashOptions
    from dflash_jax.serve.app import Server

    tgt = load_target(os.path.join(FIXTURES, "qwen36_tiny_a"), dtype="float32")
    cfg = dense.DenseConfig(vocab_size=tgt.config.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=1e4)
    opts = EngineOptions(max_batch=1, page_size=16, max_model_len=64, prefill_chunk=16)
    scorer = DenseScorer(dense.init_params(cfg, jax.random.key(0), jnp.float32), cfg)
    srv = Server(Engine(tgt, None, opts), "tiny", pflash=(PFlashOptions(mode="always"), scorer))
    assert isinstance(srv.engine.turns, DeviceTurns) and scorer.turns is srv.engine.turns
    srv.engine.turns.engine_busy(True)
    srv.engine.turns.background_turn()
    srv.engine.turns.timeout_s = 0.01
    srv.engine.turns.background_turn()  # waits (busy, no step since the last turn) until the timeout
    srv.refresh_gauges()
    from prometheus_client import generate_latest

    text = generate_latest(srv.metrics.registry).decode()
    assert "dflash_pflash_scorer_turn_waits_total 1.0" in text and "dflash_pflash_scorer_turn_wait_seconds_total" in text
    unpaced = DenseScorer(scorer.params, cfg, pace=False)
    srv = Server(Engine(tgt, None, opts), "tiny", pflash=(PFlashOptions(mode="always"), unpaced))
    assert srv.engine.turns is None and unpaced.turns is None
    assert Server(Engine(tgt, None, opts), "tiny").engine.turns is None
