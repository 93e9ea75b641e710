"""Wall-clock timing of device work, shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax


def timings(call: Callable[[], Any], iters: int, warmup: int = 1) -> list[float]:
    """Wall times (s) of ``iters`` runs of ``call()``, each blocked until its outputs are ready, after ``warmup``
    untimed ones."""
    for _ in range(max(warmup, 0)):
        jax.block_until_ready(call())
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        out.append(time.perf_counter() - t0)
    return out


def median_seconds(call: Callable[[], Any], iters: int, warmup: int = 1) -> float:
    """Median of :func:`timings`."""
    return statistics.median(timings(call, iters, warmup))
