"""DFlash drafter checkpoints in the Hugging Face layout: ``config.json`` + ``model.safetensors`` (or shards).

Tensor names (an optional ``model.`` prefix is accepted): ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``,
``layers.i.{input_layernorm,post_attention_layernorm}.weight``,
``layers.i.self_attn.{q_proj,k_proj,v_proj,o_proj,q_norm,k_norm}.weight``,
``layers.i.mlp.{gate_proj,up_proj,down_proj}.weight``. A drafter has no embedding or LM head of its own (it uses
the target's); copies named ``embed_tokens.weight`` / ``lm_head.weight`` are skipped. Anything else is an error.
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp

from dflash_jax.config import DrafterConfig
from dflash_jax.models.dflash import Params, param_shapes
from dflash_jax.models.loader import _ATTN as _TARGET_ATTN
from dflash_jax.models.loader import _LAYER as _TARGET_LAYER
from dflash_jax.models.loader import Placer, load_checkpoint, save_checkpoint, stream_params

SHARED_NAMES = ("embed_tokens.weight", "lm_head.weight")  # the target's; never part of the drafter

_TOP = {"fc.weight": ("fc",), "hidden_norm.weight": ("hidden_norm",), "norm.weight": ("norm",)}
_LAYER = _TARGET_LAYER | _TARGET_ATTN  # a drafter layer is named like a target full-attention layer


def hf_name_map(cfg: DrafterConfig) -> dict[str, tuple[Any, ...]]:
    """Checkpoint tensor name (``model.`` prefix stripped) -> path into the drafter's parameter pytree."""
    m: dict[str, tuple[Any, ...]] = dict(_TOP)
    for i in range(cfg.num_layers):
        for suffix, path in _LAYER.items():
            m[f"layers.{i}.{suffix}"] = ("layers", i) + path
    return m


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def load_drafter_params(path: str, cfg: DrafterConfig, dtype=jnp.bfloat16, place: Placer | None = None,
                        quantization: str | None = None) -> Params:
    """Stream a drafter checkpoint into a parameter pytree (one tensor on the host at a time).

    ``place(path, host_array)`` puts one tensor on its device(s) (default ``jax.device_put``);
    ``quantization="fp8"`` quantizes the matmul weights as they arrive (``loader.stream_params``).
    """
    return stream_params(path, param_shapes(cfg, dtype), hf_name_map(cfg), _strip, place,
                         skip=lambda name: name in SHARED_NAMES, where="drafter checkpoint",
                         config="the drafter's config.json", quantization=quantization)


def load_drafter(path: str | os.PathLike, dtype=jnp.bfloat16, place: Placer | None = None,
                 quantization: str | None = None) -> tuple[DrafterConfig, Params]:
    """A drafter checkpoint directory -> ``(DrafterConfig, params)``."""
    return load_checkpoint(path, DrafterConfig.from_file, load_drafter_params, dtype, place,
                           quantization=quantization)


def save_drafter(path: str | os.PathLike, cfg: DrafterConfig, params: Params) -> None:
    """Write ``config.json`` + ``model.safetensors`` (HF layout, arrays in their own dtypes) to ``path``."""
    save_checkpoint(path, hf_name_map(cfg), params, param_shapes(cfg, jnp.float32),
                    lambda: {**cfg.to_hf_dict(), "dtype": str(jnp.dtype(params["fc"].dtype))})
