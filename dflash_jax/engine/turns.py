"""Turns on one device between the engine's steps and one background user (the PFlash scorer).

On a GPU every executable of a device runs in one stream in submission order. A background pass that is paced (each
dispatch waited for before the next) still lands a dispatch in front of most decode steps, and, when the engine's
host work between two steps lets the scorer finish one dispatch and issue the next, two or more. ``DeviceTurns``
makes the order strict while the engine has work: the background user's next dispatch waits until the engine has
dispatched a step since its last one, so every decode step waits for at most one background dispatch. When the
engine is idle the background user never waits; ``timeout_s`` bounds a wait whatever happens on the engine side.

The engine calls ``engine_busy`` (at the start and end of every ``step()``) and ``engine_dispatched`` (after every
device step); the background thread calls ``background_turn`` between its dispatches.
"""

from __future__ import annotations

import threading
import time


class DeviceTurns:
    def __init__(self, timeout_s: float = 0.25) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._dispatches = 0  # engine steps dispatched so far
        self._seen = -1  # engine steps dispatched when the background user last took a turn (none yet)
        self._busy = False
        self.turns = 0  # background turns taken
        self.waits = 0  # ... of which waited for an engine step
        self.timeouts = 0
        self.wait_s = 0.0

    def engine_busy(self, busy: bool) -> None:
        with self._cv:
            if busy != self._busy:
                self._busy = busy
                self._cv.notify_all()

    def engine_dispatched(self) -> None:
        with self._cv:
            self._dispatches += 1
            self._cv.notify_all()

    def background_turn(self) -> None:
        """Block until the engine has dispatched a step since the previous turn, or is idle (or ``timeout_s``)."""
        with self._cv:
            self.turns += 1
            ready = lambda: not self._busy or self._dispatches > self._seen  # noqa: E731
            if not ready():
                self.waits += 1
                t0 = time.perf_counter()
                if not self._cv.wait_for(ready, timeout=self.timeout_s):
                    self.timeouts += 1
                self.wait_s += time.perf_counter() - t0
            self._seen = self._dispatches

    def stats(self) -> dict[str, float]:
        with self._cv:
            return {"turns": self.turns, "waits": self.waits, "timeouts": self.timeouts, "wait_s": self.wait_s}
