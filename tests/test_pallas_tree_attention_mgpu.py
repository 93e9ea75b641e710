"""The Mosaic GPU tree-attention kernel: its launch plan's refusals here, and its interpreter cases
(``mgpu_interpreter_cases.py``) in a child pytest process.

Why a child: JAX's Mosaic GPU interpreter runs each warpgroup of a CTA as an XLA:CPU executable on its own thread,
and a warpgroup waiting on a barrier does so inside a host callback that holds a thread of XLA:CPU's pool. XLA
sizes that pool from the CPU count (or ``NPROC``, read once when the CPU client starts): with 2 CPUs, two waiting
warpgroups (three compute / memory warpgroups and the launching callback per CTA) starve the others and the kernel
never finishes. The child gets a pool of ``INTERPRETER_THREADS``; the suite's own processes keep one thread per
core."""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from pallas_kernels.tree_attention import mosaic_plan

CASES = os.path.join(os.path.dirname(__file__), "mgpu_interpreter_cases.py")
INTERPRETER_THREADS = 8


def test_interpreter_cases_in_a_process_with_enough_xla_threads():
    env = dict(os.environ, NPROC=str(max(INTERPRETER_THREADS, os.cpu_count() or 1)))
    proc = subprocess.run([sys.executable, "-m", "pytest", CASES, "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "--timeout", "600"], env=env, capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.dirname(CASES)))
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail


def test_plan_refuses_what_the_kernel_cannot_take():
    ok = dict(batch=16, n_tree=23, n_heads=24, n_kv_heads=4, head_dim=256, page_size=16, width=256,
              dtype=jnp.bfloat16)
    p = mosaic_plan(**ok)
    assert p["rows"] == 138 and p["rows_padded"] == 256 and p["n_tiles"] == 2
    assert p["smem_bytes"] <= 227 * 1024 and p["n_partitions"] >= 1
    for bad, msg in [(dict(dtype=jnp.float8_e4m3fn), "bf16 / f16"), (dict(head_dim=96), "multiple of 64"),
                     (dict(page_size=12), "page_size"), (dict(n_tree=65), "tree nodes"),
                     (dict(n_heads=10), "multiple of n_kv_heads"), (dict(stages=4), "shared memory")]:
        with pytest.raises(ValueError, match=msg):
            mosaic_plan(**{**ok, **bad})


@pytest.mark.parametrize("pingpong", [True, False])
def test_lowers_to_mosaic_gpu_for_the_27b(pingpong):
    """Mosaic GPU lowering runs on any host: the 27B's heads with a 32-node tree (192 rows: the second tile's second
    warpgroup is padding) must lower, both schedules (a layout or lowering rule the kernel misses fails here, not
    on the GPU)."""
    import jax

    from pallas_kernels.tree_attention import tree_attention_mgpu

    b, n, h, hkv, d, page, width = 2, 32, 24, 4, 256, 16, 64
    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((b, n, h, d), bf), jax.ShapeDtypeStruct((128, page, hkv, d), bf),
            jax.ShapeDtypeStruct((128, page, hkv, d), bf), jax.ShapeDtypeStruct((b, width), jnp.int32),
            jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b, n, hkv, d), bf),
            jax.ShapeDtypeStruct((b, n, hkv, d), bf), jax.ShapeDtypeStruct((b, n, n), jnp.bool_))
    fn = jax.jit(lambda *a: tree_attention_mgpu(*a, d ** -0.5, pingpong=pingpong))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
