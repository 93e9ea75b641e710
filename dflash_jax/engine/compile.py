"""Counting XLA compilations, so a recompile after warm-up is caught (and reported) as the bug it is."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import jax
from jax import monitoring

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_count = 0
_seconds = 0.0
_cache_hits = 0


def _listener(event: str, duration: float, **_kw) -> None:
    global _count, _seconds
    if event == _BACKEND_COMPILE:
        with _lock:
            _count += 1
            _seconds += duration


def _event_listener(event: str, **_kw) -> None:
    global _cache_hits
    if event == _CACHE_HIT:
        with _lock:
            _cache_hits += 1


monitoring.register_event_duration_secs_listener(_listener)
monitoring.register_event_listener(_event_listener)


CACHE_MAX_BYTES = 64 << 30  # the persistent cache's default size limit (least recently used entries go first)


def enable_compile_cache(path: str, min_compile_s: float = 1.0, max_bytes: int = CACHE_MAX_BYTES) -> str:
    """Keep compiled executables in JAX's persistent compilation cache under ``path``, so a restart (or a
    benchmark's next fresh engine of the same shapes) loads them instead of compiling again; executables that
    compiled in under ``min_compile_s`` are not stored. Call before the first compilation: JAX fixes its cache
    when it first compiles. Equivalent to ``JAX_COMPILATION_CACHE_DIR=path`` plus
    ``JAX_COMPILATION_CACHE_MAX_SIZE=max_bytes``.

    The size limit is what makes the cache safe to share between processes (several servers, a benchmark and its
    subprocesses): without one (JAX's default, -1) an entry is written in place with no lock, so another process
    can read it half-written and deserialise a truncated executable; with one, every read and write holds the
    directory's file lock (``.lockfile``), and entries beyond ``max_bytes`` are evicted least recently used first.
    The price: each write scans the directory's entries (JAX's eviction pass), ~35 us an entry on a local disk,
    nothing next to a compile while a cache holds hundreds of executables; keep a directory per model set rather
    than one for thousands."""
    if max_bytes <= 0:
        raise ValueError(f"compile cache max_bytes={max_bytes} must be > 0 (0 would turn the cache off)")
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    jax.config.update("jax_compilation_cache_max_size", int(max_bytes))
    return path


def warmup_workers(n_executables: int, backend: str | None = None, cache_on: bool | None = None) -> int:
    """Threads that compile ``n_executables`` at warm-up: one per CPU core, at most one per executable, except on
    the CPU backend with the persistent compilation cache on, where they compile one at a time. XLA:CPU (jaxlib
    0.11.2) has crashed the test suite about once a run while serialising an executable for the cache
    (``put_executable_and_time``): in three of five crashes another warm-up thread was compiling
    (``backend_compile_and_load``); this takes that case away. It has also crashed with no other compile running,
    which this does not prevent (the suite reruns a test whose worker dies)."""
    backend = backend or jax.default_backend()
    cache_on = bool(jax.config.jax_compilation_cache_dir) if cache_on is None else cache_on
    if backend == "cpu" and cache_on:
        return 1
    return max(1, min(n_executables, os.cpu_count() or 1))


def compile_cache_hits() -> int:
    """Executables loaded from the persistent compilation cache in this process so far. ``compile_count`` counts
    them too (JAX times a cache load as a backend compile), so a recompile after warm-up shows either way."""
    return _cache_hits


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
