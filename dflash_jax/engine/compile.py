"""Counting XLA compilations, so a recompile after warm-up is caught (and reported) as the bug it is."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from jax import monitoring

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_seconds = 0.0


def _listener(event: str, duration: float, **_kw) -> None:
    global _count, _seconds
    if event == _BACKEND_COMPILE:
        with _lock:
            _count += 1
            _seconds += duration


monitoring.register_event_duration_secs_listener(_listener)


def compile_count() -> int:
    """Backend compilations in this process so far."""
    return _count


def compile_seconds() -> float:
    return _seconds


class CompileWatch:
    """``with CompileWatch() as w: ...`` then ``w.count`` is the number of compiles inside."""

    def __init__(self) -> None:
        self.start = self.count = 0

    def __enter__(self) -> "CompileWatch":
        self.start = compile_count()
        return self

    def __exit__(self, *exc) -> None:
        self.count = compile_count() - self.start


@contextlib.contextmanager
def no_compiles(what: str = "this block") -> Iterator[None]:
    """Raise if anything compiles inside the block."""
    w = CompileWatch()
    with w:
        yield
    if w.count:
        raise AssertionError(f"{w.count} XLA compilation(s) during {what}; shapes or static args changed")
