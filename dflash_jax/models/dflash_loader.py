"""DFlash drafter checkpoints in the Hugging Face layout: ``config.json`` + ``model.safetensors`` (or shards).

Tensor names (an optional ``model.`` prefix is accepted): ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``,
``layers.i.{input_layernorm,post_attention_layernorm}.weight``,
``layers.i.self_attn.{q_proj,k_proj,v_proj,o_proj,q_norm,k_norm}.weight``,
``layers.i.mlp.{gate_proj,up_proj,down_proj}.weight``. A drafter has no embedding or LM head of its own (it uses
the target's); copies named ``embed_tokens.weight`` / ``lm_head.weight`` are skipped. Anything else is an error.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from dflash_jax.config import DrafterConfig
from dflash_jax.models.dflash import Params, param_shapes
from dflash_jax.models.loader import CheckpointError, _get, _set, iter_tensors

SHARED_NAMES = ("embed_tokens.weight", "lm_head.weight")  # the target's; never part of the drafter

_TOP = {"fc.weight": ("fc",), "hidden_norm.weight": ("hidden_norm",), "norm.weight": ("norm",)}
_LAYER = {
    "input_layernorm.weight": ("input_norm",),
    "post_attention_layernorm.weight": ("post_norm",),
    "self_attn.q_proj.weight": ("attn", "q"),
    "self_attn.k_proj.weight": ("attn", "k"),
    "self_attn.v_proj.weight": ("attn", "v"),
    "self_attn.o_proj.weight": ("attn", "o"),
    "self_attn.q_norm.weight": ("attn", "q_norm"),
    "self_attn.k_norm.weight": ("attn", "k_norm"),
    "mlp.gate_proj.weight": ("mlp", "gate"),
    "mlp.up_proj.weight": ("mlp", "up"),
    "mlp.down_proj.weight": ("mlp", "down"),
}


def hf_name_map(cfg: DrafterConfig) -> dict[str, tuple[Any, ...]]:
    """Checkpoint tensor name (``model.`` prefix stripped) -> path into the drafter's parameter pytree."""
    m: dict[str, tuple[Any, ...]] = dict(_TOP)
    for i in range(cfg.num_layers):
        for suffix, path in _LAYER.items():
            m[f"layers.{i}.{suffix}"] = ("layers", i) + path
    return m


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def load_drafter_params(path: str, cfg: DrafterConfig, dtype=jnp.bfloat16,
                        place: Callable[[tuple[Any, ...], np.ndarray], jax.Array] | None = None) -> Params:
    """Stream a drafter checkpoint into a parameter pytree (one tensor on the host at a time).

    ``place(path, host_array)`` puts one tensor on its device(s) (default ``jax.device_put``).
    """
    shapes = param_shapes(cfg, dtype)
    tree: Params = jax.tree_util.tree_map(lambda s: None, shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tree["layers"] = list(tree["layers"])
    names = hf_name_map(cfg)
    place = place or (lambda _p, a: jax.device_put(a))
    seen: set[str] = set()
    for full_name, arr in iter_tensors(path):
        name = _strip(full_name)
        if name in SHARED_NAMES:
            continue
        if name not in names:
            mm = re.match(r"layers\.(\d+)\.", name)
            if mm and int(mm.group(1)) >= cfg.num_layers:
                raise CheckpointError(f"tensor {full_name!r}: layer index beyond the drafter's "
                                      f"num_hidden_layers={cfg.num_layers}")
            raise CheckpointError(f"unexpected tensor {full_name!r} (shape {list(arr.shape)}) in drafter "
                                  f"checkpoint {path!r}")
        if name in seen:
            raise CheckpointError(f"tensor {full_name!r} appears twice in the checkpoint")
        seen.add(name)
        p = names[name]
        want = _get(shapes, p)
        if tuple(arr.shape) != tuple(want.shape):
            raise CheckpointError(f"tensor {full_name!r}: checkpoint shape {list(arr.shape)} != expected "
                                  f"{list(want.shape)} from the drafter's config.json")
        host = np.asarray(arr).astype(want.dtype, copy=False)
        _set(tree, p, place(p, host))
        del arr, host
    missing = sorted(n for n in names if n not in seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"drafter checkpoint {path!r} is missing tensor(s) {missing[:5]}{more}")
    tree["layers"] = tuple(tree["layers"])
    return tree


def load_drafter(path: str | os.PathLike, dtype=jnp.bfloat16,
                 place: Callable[[tuple[Any, ...], np.ndarray], jax.Array] | None = None
                 ) -> tuple[DrafterConfig, Params]:
    """A drafter checkpoint directory -> ``(DrafterConfig, params)``."""
    p = os.fspath(path)
    cfg = DrafterConfig.from_file(p)
    return cfg, load_drafter_params(p, cfg, dtype, place)


def save_drafter(path: str | os.PathLike, cfg: DrafterConfig, params: Params) -> None:
    """Write ``config.json`` + ``model.safetensors`` (HF layout, arrays in their own dtypes) to ``path``."""
    p = os.fspath(path)
    os.makedirs(p, exist_ok=True)
    shapes = param_shapes(cfg, jnp.float32)
    tensors: dict[str, np.ndarray] = {}
    for name, tp in hf_name_map(cfg).items():
        arr = np.asarray(jax.device_get(_get(params, tp)))
        want = _get(shapes, tp).shape
        if tuple(arr.shape) != tuple(want):
            raise CheckpointError(f"parameter {'/'.join(map(str, tp))} ({name!r}) has shape {list(arr.shape)}, "
                                  f"config expects {list(want)}")
        tensors[name] = np.ascontiguousarray(arr)
    dt = str(jnp.dtype(params["fc"].dtype))
    with open(os.path.join(p, "config.json"), "w") as f:
        json.dump({**cfg.to_hf_dict(), "dtype": dt}, f, indent=2)
    save_file(tensors, os.path.join(p, "model.safetensors"), metadata={"format": "pt"})
