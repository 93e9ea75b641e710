"""Hugging Face checkpoint (config.json + safetensors) -> the target's parameter pytree.

Reads a single ``model.safetensors`` or shards listed by ``model.safetensors.index.json``; maps
``model.language_model.*`` (multimodal Qwen3.5/3.6) or ``model.*`` (text-only) names; skips vision
(``model.visual.*``) and MTP (``mtp.*``) tensors. Tensors stream one at a time: each is read, checked,
cast and placed on the device before the next is read, so the host never holds two copies of the weights.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from dflash_jax.config import FULL, TargetConfig
from dflash_jax.models.qwen36 import Params, param_shapes

SKIP_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
TEXT_PREFIXES = ("model.language_model.", "model.")

_LAYER = {
    "input_layernorm.weight": ("input_norm",),
    "post_attention_layernorm.weight": ("post_norm",),
    "mlp.gate_proj.weight": ("mlp", "gate"),
    "mlp.up_proj.weight": ("mlp", "up"),
    "mlp.down_proj.weight": ("mlp", "down"),
}
_ATTN = {f"self_attn.{n}_proj.weight": ("attn", n) for n in "qkvo"} | {
    "self_attn.q_norm.weight": ("attn", "q_norm"),
    "self_attn.k_norm.weight": ("attn", "k_norm"),
}
_GDN = {
    "linear_attn.in_proj_qkv.weight": ("gdn", "qkv"),
    "linear_attn.in_proj_z.weight": ("gdn", "z"),
    "linear_attn.in_proj_b.weight": ("gdn", "b"),
    "linear_attn.in_proj_a.weight": ("gdn", "a"),
    "linear_attn.conv1d.weight": ("gdn", "conv"),
    "linear_attn.A_log": ("gdn", "A_log"),
    "linear_attn.dt_bias": ("gdn", "dt_bias"),
    "linear_attn.norm.weight": ("gdn", "norm"),
    "linear_attn.out_proj.weight": ("gdn", "out"),
}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor."""


def hf_name_map(cfg: TargetConfig) -> dict[str, tuple[Any, ...]]:
    """Text-model tensor name (prefix stripped) -> path into the parameter pytree."""
    m: dict[str, tuple[Any, ...]] = {"embed_tokens.weight": ("embed",), "norm.weight": ("final_norm",)}
    for i, lt in enumerate(cfg.layer_types):
        table = _LAYER | (_ATTN if lt == FULL else _GDN)
        for suffix, path in table.items():
            m[f"layers.{i}.{suffix}"] = ("layers", i) + path
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head",)
    return m


def _strip(name: str) -> str | None:
    if name.startswith(SKIP_PREFIXES):
        return None
    if name == "lm_head.weight":
        return name
    for pre in TEXT_PREFIXES:
        if name.startswith(pre):
            return name[len(pre):]
    return name


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory, in shard order."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                wm = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index}: not valid JSON ({e})") from e
        wm = wm.get("weight_map") if isinstance(wm, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: missing 'weight_map'")
        files = sorted(set(wm.values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json found")
    out = [os.path.join(path, f) for f in files]
    for f in out:
        if not os.path.exists(f):
            raise CheckpointError(f"{path}: shard {os.path.basename(f)} listed in the index is missing")
    return out


def iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, host array) for every tensor, one at a time."""
    for fn in checkpoint_files(path):
        with safe_open(fn, framework="numpy") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _set(tree: Params, path: tuple[Any, ...], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _get(tree: Params, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


Placer = Callable[[tuple[Any, ...], np.ndarray], jax.Array]


def stream_params(path: str, shapes: Params, names: dict[str, tuple[Any, ...]],
                  strip: Callable[[str], str | None], place: Placer | None = None,
                  skip: Callable[[str], bool] | None = None, where: str = "checkpoint",
                  config: str = "config.json") -> Params:
    """Stream the tensors of the checkpoint at ``path`` into a pytree shaped like ``shapes``.

    Each tensor name goes through ``strip`` (None: ignore the tensor), then ``skip`` (True: ignore it), then
    ``names`` (-> its path in the pytree); it is checked against ``shapes``, cast to the dtype there and put on
    the device by ``place(path, host_array)`` (default ``jax.device_put``) before the next one is read. A
    depthwise conv weight stored as (C, 1, K) is taken as (C, K). Unknown, duplicated, misshapen and missing
    tensors raise ``CheckpointError`` naming the tensor; ``where`` names the checkpoint and ``config`` the
    config it was checked against in those messages. ``shapes["layers"]`` is a sequence with one entry a layer.
    """
    tree: Params = jax.tree_util.tree_map(lambda s: None, shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tree["layers"] = list(tree["layers"])
    n_layers = len(shapes["layers"])
    place = place or (lambda _p, a: jax.device_put(a))
    seen: set[str] = set()
    for full_name, arr in iter_tensors(path):
        name = strip(full_name)
        if name is None or skip is not None and skip(name):
            continue
        if name not in names:
            m = re.match(r"layers\.(\d+)\.", name)
            if m and int(m.group(1)) >= n_layers:
                raise CheckpointError(f"tensor {full_name!r}: layer index beyond num_hidden_layers={n_layers} "
                                      f"of {config}")
            raise CheckpointError(f"unexpected tensor {full_name!r} (shape {list(arr.shape)}) in {where} "
                                  f"{path!r} for this config")
        if name in seen:
            raise CheckpointError(f"tensor {full_name!r} appears twice in the checkpoint")
        seen.add(name)
        p = names[name]
        want = _get(shapes, p)
        if p[-1] == "conv" and arr.ndim == 3 and arr.shape[1] == 1:
            arr = arr[:, 0, :]
        if tuple(arr.shape) != tuple(want.shape):
            raise CheckpointError(f"tensor {full_name!r}: checkpoint shape {list(arr.shape)} != expected "
                                  f"{list(want.shape)} from {config}")
        host = np.asarray(arr).astype(want.dtype, copy=False)
        _set(tree, p, place(p, host))
        del arr, host
    missing = sorted(n for n in names if n not in seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{where} {path!r} is missing tensor(s) {missing[:5]}{more}")
    tree["layers"] = tuple(tree["layers"])
    return tree


def load_params(path: str, cfg: TargetConfig, dtype=jnp.bfloat16, place: Placer | None = None) -> Params:
    """Stream a checkpoint into a parameter pytree on the device.

    ``place(path, host_array)`` puts one tensor on its device(s) (default: ``jax.device_put``); it is the
    hook for sharded placement.
    """
    tied = cfg.tie_word_embeddings
    tree = stream_params(path, param_shapes(cfg, dtype), hf_name_map(cfg), _strip, place,
                         skip=lambda name: tied and name == "lm_head.weight")
    if tied:
        tree["lm_head"] = tree["embed"]
    return tree


def load_checkpoint(path: str | os.PathLike, from_file: Callable[[str], Any],
                    load: Callable[..., Params], dtype=jnp.bfloat16, place: Placer | None = None
                    ) -> tuple[Any, Params]:
    """A checkpoint directory -> ``(config, params)``: ``from_file(path)`` reads its config, then
    ``load(path, config, dtype, place)`` streams its tensors."""
    p = os.fspath(path)
    cfg = from_file(p)
    return cfg, load(p, cfg, dtype, place)


def save_checkpoint(path: str | os.PathLike, names: dict[str, tuple[Any, ...]], params: Params, shapes: Params,
                    hf_config: Callable[[], dict[str, Any]], rename: Callable[[str], str] = lambda name: name
                    ) -> None:
    """Write ``config.json`` (``hf_config()``) + ``model.safetensors`` to ``path``: every tensor of ``names``
    (checkpoint name -> pytree path) taken from ``params``, checked against ``shapes``, stored under
    ``rename(name)`` in its own dtype. A misshapen parameter raises ``CheckpointError`` before anything is
    written."""
    p = os.fspath(path)
    os.makedirs(p, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for name, tp in names.items():
        arr = np.asarray(jax.device_get(_get(params, tp)))
        want = _get(shapes, tp).shape
        if tuple(arr.shape) != tuple(want):
            raise CheckpointError(f"parameter {'/'.join(map(str, tp))} ({name!r}) has shape {list(arr.shape)}, "
                                  f"config expects {list(want)}")
        tensors[rename(name)] = np.ascontiguousarray(arr)
    config = hf_config()
    with open(os.path.join(p, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(p, "model.safetensors"), metadata={"format": "pt"})
