"""The weight-stream ceiling of a decode step (DESIGN.md §8).

A step that reads every weight matrix a real decode step reads (all projections and MLP matrices of
every layer, then the LM head), as batched matvecs, with none of the attention or recurrent-state
math; fused projections (``qwen36.fuse_projections``) as the one matmul the model runs. Its time is the practical floor of an AR decode step at small B; its tok/s the ceiling.

Layers are unrolled in Python over the per-layer param dicts (no ``scan``/``fori_loop``: a dynamic
slice over stacked weights costs 2.6x). Each layer's outputs are folded back into ``x`` so that no
matvec can be dead-code-eliminated.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from dflash_jax.bench import roofline
from dflash_jax.bench.timing import timings
from dflash_jax.config import FULL, TargetConfig
from dflash_jax.models import quant
from dflash_jax.models.qwen36 import acc_dtype, linear, project


def _norm(x: jax.Array) -> jax.Array:
    """Keep the chained activations O(1) over many layers (elementwise, fused, no weight reads)."""
    a = acc_dtype(x.dtype)
    xf = x.astype(a)
    return (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def _mean(y: jax.Array) -> jax.Array:
    return jnp.mean(y.astype(acc_dtype(y.dtype)), axis=-1, keepdims=True).astype(y.dtype)


def _attn(p: dict[str, Any], cfg: TargetConfig, u: jax.Array) -> jax.Array:
    n = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    y = project(p, u, {"q": cfg.q_proj_dim, "k": kv, "v": kv})
    out = y["q"][:, :n] + _mean(y["k"]) + _mean(y["v"])
    if y["q"].shape[-1] > n:  # the output gate half of q_proj
        out = out * jax.nn.sigmoid(y["q"][:, n:2 * n])
    return linear(out, p["o"])


def _gdn(p: dict[str, Any], cfg: TargetConfig, u: jax.Array) -> jax.Array:
    hv = cfg.lin_num_v_heads
    y = project(p, u, {"qkv": cfg.conv_dim, "z": cfg.value_dim, "b": hv, "a": hv})
    qkv = y["qkv"] * p["conv"][:, -1].astype(u.dtype)
    out = qkv[:, 2 * cfg.key_dim:] * jax.nn.silu(y["z"]) + _mean(qkv[:, :2 * cfg.key_dim]) + _mean(y["b"]) \
        + _mean(y["a"])
    return linear(out, p["out"])


def _mlp(p: dict[str, Any], u: jax.Array) -> jax.Array:
    f = p["down"].shape[1]
    y = project(p, u, {"gate": f, "up": f})
    return linear(jax.nn.silu(y["gate"]) * y["up"], p["down"])


def make_weight_stream(cfg: TargetConfig) -> Callable[[dict, jax.Array], jax.Array]:
    """Jitted ``f(params, x [B, D]) -> x [B, D]`` streaming every weight matrix once (see module doc)."""

    def step(params: dict[str, Any], x: jax.Array) -> jax.Array:
        for lt, p in zip(cfg.layer_types, params["layers"]):  # unrolled: one array per layer
            if lt == FULL:
                x = x + _attn(p["attn"], cfg, _norm(x))
            else:
                x = x + _gdn(p["gdn"], cfg, _norm(x))
            x = x + _mlp(p["mlp"], _norm(x))
        logits = linear(_norm(x), params["lm_head"], acc_dtype(x.dtype))
        return x + jnp.max(logits, axis=-1, keepdims=True).astype(x.dtype)

    return jax.jit(step)


def _stream_params(params: dict[str, Any]) -> dict[str, Any]:
    """Only the leaves the stream reads (the embedding stays out of the call)."""
    return {"layers": params["layers"], "lm_head": params["lm_head"]}


def measure_ceiling(cfg: TargetConfig, params: dict[str, Any], batch: int, iters: int = 20,
                    warmup: int = 3, fn: Callable | None = None,
                    hbm_bytes_per_s: float | None = None) -> dict[str, float]:
    """Time the weight stream at batch ``batch``: median over ``iters`` calls after ``warmup``.

    Returns ``ms_per_step``, ``tok_s`` (= batch / step time), ``bytes_per_s`` (= weight_bytes /
    step time, the weight read bandwidth), ``bw_fraction`` (bytes_per_s / hbm_bytes_per_s),
    ``ms_min`` and ``compile_s`` (lower + compile time).
    """
    if iters < 1:
        raise ValueError("iters must be >= 1")
    hbm_bytes_per_s = hbm_bytes_per_s or roofline.device_hbm_bytes_per_s()
    fn = fn or make_weight_stream(cfg)
    p = _stream_params(params)
    dtype = params["lm_head"].dtype
    x = jax.random.normal(jax.random.key(1), (batch, cfg.hidden_size), jnp.float32).astype(dtype)
    t0 = time.perf_counter()
    compiled = fn.lower(p, x).compile()
    compile_s = time.perf_counter() - t0
    times = timings(lambda: compiled(p, x), iters, warmup)
    sec = statistics.median(times)
    wbytes = roofline.weight_bytes(cfg, quant.weight_itemsize(params))
    return {
        "ms_per_step": sec * 1e3,
        "ms_min": min(times) * 1e3,
        "tok_s": batch / sec,
        "bytes_per_s": wbytes / sec,
        "bw_fraction": wbytes / sec / hbm_bytes_per_s,
        "compile_s": compile_s,
    }
