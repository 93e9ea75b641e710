"""How much of each accelerator's memory JAX's allocator may take.

JAX preallocates 75 % of a GPU's memory by default; the 27B in bf16 (51.6 GB of weights) with 16 sequences of 4K
tokens (4.4 GB of KV pages, 2.6 GB of recurrent slots) does not fit 75 % of an 80 GB H100. Serving engines take
most of the device (vLLM's ``--gpu-memory-utilization`` defaults to 0.9), and so do ``python -m dflash_jax.serve``
and the benchmarks, through ``XLA_PYTHON_CLIENT_MEM_FRACTION``, which JAX reads when it first touches a device.
"""

from __future__ import annotations

import os
import warnings

DEFAULT_FRACTION = 0.9
ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def set_memory_fraction(fraction: float | None = None) -> str:
    """Let JAX's allocator take ``fraction`` of each accelerator's memory. ``None``: the environment's
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` if set, else :data:`DEFAULT_FRACTION`; an explicit fraction replaces the
    environment's. Call before JAX first touches a device (a warning says when it is too late). Returns the value in
    force."""
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"memory fraction {fraction}: must be in (0, 1]")
    if fraction is None and ENV in os.environ:
        return os.environ[ENV]
    value = f"{DEFAULT_FRACTION if fraction is None else fraction:g}"
    if os.environ.get(ENV) != value and _backends_initialized():
        warnings.warn(f"{ENV}={value} is set after JAX initialised its devices: it applies to the next process only",
                      stacklevel=2)
    os.environ[ENV] = value
    return value


def _backends_initialized() -> bool:
    """Whether JAX has already set up an accelerator (its allocator then has its size; a CPU has no preallocation)."""
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a JAX without the module: assume not yet
        return False
    if not xla_bridge.backends_are_initialized():
        return False
    return any(name != "cpu" for name in xla_bridge.backends())
