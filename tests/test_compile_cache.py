"""The persistent compilation cache: a second process with the same engine shapes loads every bucket's executable
instead of compiling it, and its greedy output is unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash_jax.engine.compile import enable_compile_cache

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SCRIPT = r"""
import json, sys
from dflash_jax.engine.compile import compile_count, enable_compile_cache
enable_compile_cache(sys.argv[1], min_compile_s=0.0)
import dflash_jax as dj
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
t = dj.load_target(sys.argv[2], dtype="float32")
eng = Engine(t, None, EngineOptions(max_batch=2, prefill_batch=1, prefill_chunk=32, max_model_len=64, page_size=16))
c0 = compile_count()
rep = eng.warmup()
compiled = compile_count() - c0
out = eng.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=6, ignore_eos=True))
print(json.dumps({"hits": rep["cache_hits"], "compiled": compiled,
                  "buckets": len(eng.prefill_buckets) + len(eng.decode_buckets),
                  "tokens": [o.token_ids for o in out]}))
"""


def _run(cache: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, cache, os.path.join(HERE, "fixtures", "qwen36_tiny_a")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_loads_every_bucket_from_the_cache(tmp_path):
    cache = str(tmp_path / "cache")
    first, second = _run(cache), _run(cache)
    assert first["hits"] == 0 and first["compiled"] >= first["buckets"], first
    assert second["hits"] == second["buckets"], second
    assert second["compiled"] == first["compiled"]  # a load still counts as a compile event (shape changes show)
    assert second["tokens"] == first["tokens"]
    # reads and writes held the directory's file lock (a size limit is set), so processes sharing it never read a
    # half-written entry
    assert ".lockfile" in os.listdir(cache) and any(f.endswith("-cache") for f in os.listdir(cache))


def test_a_cache_without_room_is_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        enable_compile_cache("/tmp/unused-cache", max_bytes=0)


def test_cpu_warmup_compiles_one_at_a_time_with_the_cache_on():
    """XLA:CPU can abort while it serialises an executable for the cache and another thread compiles, so a CPU
    engine with the cache on compiles its buckets on one thread; otherwise one per core, at most one per bucket."""
    from dflash_jax.engine.compile import warmup_workers

    cores = os.cpu_count() or 1
    assert warmup_workers(12, "cpu", cache_on=True) == 1
    assert warmup_workers(12, "gpu", cache_on=True) == min(12, cores)
    assert warmup_workers(12, "cpu", cache_on=False) == min(12, cores)
    assert warmup_workers(1, "cpu", cache_on=False) == 1 and warmup_workers(0, "gpu", cache_on=False) == 1
    assert warmup_workers(12) == 1  # this suite runs on CPU with one cache for the run (tests/conftest.py)
