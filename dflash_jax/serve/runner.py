"""One thread owns the engine; HTTP handlers talk to it through queues and never block it.

``EngineRunner.submit`` hands a request to the engine thread and returns an asyncio queue on which
that request's ``RequestOutput`` snapshots arrive (the last one has a ``finish_reason``). ``abort``
cancels a request (a client that went away). If a step raises, the requests in flight fail with
the error, the device state is rebuilt and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any

from dflash_jax.engine.loop import Engine, RequestOutput, SamplingParams

log = logging.getLogger("dflash_jax.serve")


class EngineFault(RuntimeError):
    """The engine failed while running this request."""


class EngineRunner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._subs: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self.steps = 0
        self.faults = 0
        self.last_step_s = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    # ---- called from the event loop --------------------------------------------------------------
    async def submit(self, prompt: list[int], sampling: SamplingParams) -> tuple[int, asyncio.Queue]:
        """Queue a request on the engine thread; raises what ``Engine.submit`` raises."""
        return (await self.submit_group(prompt, [sampling]))[0]

    async def submit_group(self, prompt: list[int], samplings: list[SamplingParams]) -> list[tuple[int, asyncio.Queue]]:
        """Queue requests over one prompt (``Engine.submit_group``: the prompt prefills once); raises what it
        raises (then none is queued)."""
        loop = asyncio.get_running_loop()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        qs: list[asyncio.Queue] = [asyncio.Queue() for _ in samplings]
        self._inbox.put(("submit", (prompt, list(samplings), loop, qs, fut)))
        rids = await asyncio.wrap_future(fut)
        return list(zip(rids, qs))

    def abort(self, rid: int) -> None:
        self._inbox.put(("abort", rid))

    # ---- the engine thread -----------------------------------------------------------------------
    def _handle(self, op: str, arg: Any) -> None:
        if op == "submit":
            prompt, samplings, loop, qs, fut = arg
            try:
                rids = self.engine.submit_group(prompt, samplings)  # one sampling: a plain submit
            except Exception as e:  # RequestError / RequestTooLarge go back to the handler
                fut.set_exception(e)
                return
            for rid, q in zip(rids, qs):
                self._subs[rid] = (loop, q)
            fut.set_result(rids)
        elif op == "abort":
            self.engine.abort(arg)
            self._subs.pop(arg, None)

    def _publish(self, rid: int, item: RequestOutput | BaseException) -> None:
        sub = self._subs.get(rid)
        if sub is None:
            return
        loop, q = sub
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown)
            self._subs.pop(rid, None)

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                block = not eng.has_work()
                op, arg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
                self._handle(op, arg)
                continue  # drain the inbox before stepping
            except queue.Empty:
                pass
            if not eng.has_work():
                continue
            t0 = time.perf_counter()
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - a fault fails the requests in flight, not the server
                self._fault(e)
                continue
            self.steps += 1
            self.last_step_s = time.perf_counter() - t0
            for o in outs:
                # a request the engine failed alone (e.g. its KV pages were lost in a transfer) -> HTTP 500
                self._publish(o.request_id, EngineFault(o.stats.get("error", "engine fault")) if o.finish_reason
                              == "error" else o)
                if o.finish_reason is not None:
                    self._subs.pop(o.request_id, None)

    def _fault(self, err: Exception) -> None:
        self.faults += 1
        log.exception("engine step failed; failing the requests in flight and rebuilding device state")
        eng = self.engine
        for rid in list(eng.running):
            eng.abort(rid)
            self._publish(rid, EngineFault(f"engine fault: {type(err).__name__}: {err}"))
            self._subs.pop(rid, None)
        eng.reset_state()
