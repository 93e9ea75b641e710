"""Pieces shared by the Qwen3-style decoder stacks (the dense scorer and the DFlash drafter): the parameter
shapes of one decoder layer and the random initialisation of a shape pytree."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

F32 = jnp.float32


def qwen3_layer_shapes(cfg: Any, dtype, vec) -> tuple[dict[str, Any], ...]:
    """The ``cfg.num_layers`` decoder layers of a Qwen3 stack as ``jax.ShapeDtypeStruct`` leaves, each
    ``input_norm``, ``post_norm``, ``attn {q, k, v, o, q_norm, k_norm}``, ``mlp {gate, up, down}`` (matrices
    ``[out, in]`` in ``dtype``, norm weights in ``vec``). ``cfg`` has ``hidden_size``, ``intermediate_size``,
    ``num_heads``, ``num_kv_heads``, ``head_dim`` and ``num_layers`` (a ``DenseConfig`` or ``DrafterConfig``)."""
    S = jax.ShapeDtypeStruct
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_heads, cfg.num_kv_heads
    return tuple(
        {
            "input_norm": S((d,), vec), "post_norm": S((d,), vec),
            "attn": {"q": S((nh * hd, d), dtype), "k": S((nkv * hd, d), dtype),
                     "v": S((nkv * hd, d), dtype), "o": S((d, nh * hd), dtype),
                     "q_norm": S((hd,), vec), "k_norm": S((hd,), vec)},
            "mlp": {"gate": S((f, d), dtype), "up": S((f, d), dtype), "down": S((d, f), dtype)},
        }
        for _ in range(cfg.num_layers))


def random_params(shapes: Any, key: jax.Array, norm_noise: float = 0.0) -> Any:
    """Random weights for a shape pytree: matrices ``normal * fan_in**-0.5``, vectors (norm weights) 1
    (+ ``norm_noise * normal``)."""
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for s, k in zip(leaves, keys):
        if len(s.shape) == 1:
            out.append((1.0 + norm_noise * jax.random.normal(k, s.shape, F32)).astype(s.dtype))
        else:
            out.append((jax.random.normal(k, s.shape, F32) * s.shape[-1] ** -0.5).astype(s.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
