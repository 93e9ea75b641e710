"""Hugging Face checkpoint (config.json + safetensors) -> the target's parameter pytree.

Reads a single ``model.safetensors`` or shards listed by ``model.safetensors.index.json``; maps
``model.language_model.*`` (multimodal Qwen3.5/3.6) or ``model.*`` (text-only) names; skips vision
(``model.visual.*``) and MTP (``mtp.*``) tensors. Tensors stream one at a time: each is read, checked,
cast and placed on the device before the next is read, so the host never holds two copies of the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from dflash_jax.config import FULL, TargetConfig
from dflash_jax.models import quant
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


def weights_sha256(path: str) -> str:
    """SHA-256 over a checkpoint's safetensors files in shard order: which weights a golden or a result belongs to."""
    h = hashlib.sha256()
    for fn in checkpoint_files(path):
        with open(fn, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _raw_entries(fn: str) -> tuple[int, dict[str, Any]]:
    """(data offset, header entries) of a safetensors file."""
    with open(fn, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, host array) for every tensor, one at a time. FP8 tensors (which the ``safetensors`` NumPy reader
    cannot return) are read from the file directly as ``ml_dtypes`` float8 arrays."""
    for fn in checkpoint_files(path):
        base, entries = _raw_entries(fn)
        with safe_open(fn, framework="numpy") as f:
            for name in f.keys():
                e = entries.get(name, {})
                if e.get("dtype") in _RAW_DTYPES:
                    lo, hi = e["data_offsets"]
                    raw = np.fromfile(fn, dtype=np.uint8, count=hi - lo, offset=base + lo)
                    yield name, raw.view(_RAW_DTYPES[e["dtype"]]).reshape(e["shape"])
                else:
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
                  config: str = "config.json", quantization: str | None = None,
                  tensors: Iterable[tuple[str, np.ndarray]] | None = None) -> Params:
    """Stream the tensors of the checkpoint at ``path`` into a pytree shaped like ``shapes``.

    Each tensor name goes through ``strip`` (None: ignore the tensor), then ``skip`` (True: ignore it), then
    ``names`` (-> its path in the pytree); it is checked against ``shapes``, cast to the dtype there and put on
    the device by ``place(path, host_array)`` (default ``jax.device_put``) before the next one is read. A
    depthwise conv weight stored as (C, 1, K) is taken as (C, K). Unknown, duplicated, misshapen and missing
    tensors raise ``CheckpointError`` naming the tensor; ``where`` names the checkpoint and ``config`` the
    config it was checked against in those messages. ``shapes["layers"]`` is a sequence with one entry a layer.

    FP8 checkpoints (``quantization_config.quant_method = "fp8"``, Qwen / DeepSeek layout): a ``float8_e4m3fn``
    ``X.weight`` and its ``X.weight_scale_inv`` (block scales per ``weight_block_size``, or per channel) become
    one ``quant.QuantizedWeight`` (put with ``jax.device_put``); ``*activation_scale`` / ``*input_scale`` tensors
    are ignored. With ``quantization="fp8"`` every other matmul weight (``quant.MATMUL_NAMES``) is quantized
    per output channel on the device right after it is placed. ``tensors`` replaces the safetensors files of
    ``path`` as the source of ``(name, host array)`` pairs (the GGUF loader's dequantized stream).
    """
    fp8_block = quant.read_fp8_block(path) if os.path.isdir(path) else None
    qleaf = quant.leaf_quantizer(quantization)
    pending: dict[str, dict[str, np.ndarray]] = {}  # fp8 weight name -> {"data", "scale"} until both are read
    tree: Params = jax.tree_util.tree_map(lambda s: None, shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tree["layers"] = list(tree["layers"])
    n_layers = len(shapes["layers"])
    place = place or (lambda _p, a: jax.device_put(a))
    seen: set[str] = set()
    for full_name, arr in (iter_tensors(path) if tensors is None else tensors):
        name = strip(full_name)
        if name is None or skip is not None and skip(name):
            continue
        if name.endswith(("activation_scale", ".input_scale")):
            continue
        if name.endswith(".weight_scale_inv") or arr.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
            wname = name.removesuffix("_scale_inv")
            if wname not in names:
                raise CheckpointError(f"unexpected tensor {full_name!r} (shape {list(arr.shape)}) in {where} "
                                      f"{path!r} for this config")
            if arr.dtype == ml_dtypes.float8_e5m2:
                raise CheckpointError(f"tensor {full_name!r}: float8_e5m2 weights are not supported (only e4m3)")
            part = "scale" if name.endswith("_scale_inv") else "data"
            entry = pending.setdefault(wname, {})
            if part in entry or wname in seen:
                raise CheckpointError(f"tensor {full_name!r} appears twice in the checkpoint")
            entry[part] = arr
            if len(entry) < 2:
                continue
            del pending[wname]
            seen.add(wname)
            p = names[wname]
            want = _get(shapes, p)
            if tuple(entry["data"].shape) != tuple(want.shape):
                raise CheckpointError(f"tensor {wname!r}: checkpoint shape {list(entry['data'].shape)} != expected "
                                      f"{list(want.shape)} from {config}")
            try:
                qw = quant.fp8_from_checkpoint(entry["data"], entry["scale"], fp8_block, want.dtype, wname)
            except ValueError as e:
                raise CheckpointError(str(e)) from e
            _set(tree, p, qw)
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
        _set(tree, p, qleaf(p, place(p, host)))
        del arr, host
    for wname, entry in pending.items():
        has, lacks = ("weight_scale_inv", "float8 weight") if "scale" in entry else ("float8 weight", "weight_scale_inv")
        raise CheckpointError(f"tensor {wname!r}: the {where} has its {has} but no {lacks}")
    missing = sorted(n for n in names if n not in seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{where} {path!r} is missing tensor(s) {missing[:5]}{more}")
    tree["layers"] = tuple(tree["layers"])
    return tree


def load_params(path: str, cfg: TargetConfig, dtype=jnp.bfloat16, place: Placer | None = None,
                quantization: str | None = None) -> Params:
    """Stream a checkpoint into a parameter pytree on the device.

    ``place(path, host_array)`` puts one tensor on its device(s) (default: ``jax.device_put``); it is the
    hook for sharded placement. ``quantization="fp8"`` quantizes the matmul weights as they arrive (see
    ``stream_params``); an FP8 checkpoint's weights stay FP8 either way.
    """
    tied = cfg.tie_word_embeddings
    tree = stream_params(path, param_shapes(cfg, dtype), hf_name_map(cfg), _strip, place,
                         skip=lambda name: tied and name == "lm_head.weight", quantization=quantization)
    if tied:
        tree["lm_head"] = tree["embed"]
    return tree


def load_checkpoint(path: str | os.PathLike, from_file: Callable[[str], Any],
                    load: Callable[..., Params], dtype=jnp.bfloat16, place: Placer | None = None,
                    **load_kwargs: Any) -> tuple[Any, Params]:
    """A checkpoint directory -> ``(config, params)``: ``from_file(path)`` reads its config, then
    ``load(path, config, dtype, place, **load_kwargs)`` streams its tensors."""
    p = os.fspath(path)
    cfg = from_file(p)
    return cfg, load(p, cfg, dtype, place, **load_kwargs)


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
