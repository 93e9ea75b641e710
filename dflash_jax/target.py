"""The notebook-level handle on a target model: ``dflash_jax.load_target(path).logits(ids)``."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import TargetConfig, read_generation_eos
from dflash_jax.models import loader, quant, qwen36
from dflash_jax.sharding import Layout, ShardingError
from dflash_jax.state import KVPages, RecurrentSlots, StepInput

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}
_PAGE = 16
_BUCKET = 64


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported; use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("dtype float64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', True))")
    return dtype


@functools.partial(jax.jit, static_argnames=("cfg", "return_layers"))
def _full_pass(params, cfg, tokens, n_valid, return_layers):
    """One sequence, no prior state: tokens [1, T] -> (logits [T, V], feats [L, T, D] | None)."""
    t = tokens.shape[1]
    dtype = qwen36.param_dtype(params)
    n_pages = t // _PAGE + 1
    kv = KVPages.zeros(cfg, n_pages, _PAGE, dtype)
    rec = RecurrentSlots.zeros(cfg, 2, dtype)
    inp = StepInput(tokens=tokens, positions=jnp.arange(t, dtype=jnp.int32)[None],
                    n_valid=n_valid, slots=jnp.ones((1,), jnp.int32),
                    page_table=jnp.arange(1, n_pages, dtype=jnp.int32)[None])
    h, _, _, feats = qwen36.forward(params, cfg, inp, kv, rec, return_layers)
    return qwen36.lm_logits(params, h[0]), None if feats is None else feats[:, 0]


@dataclasses.dataclass
class Target:
    """A loaded target: ``config``, ``params`` (pytree on the device), ``eos_token_ids``.

    With a ``layout`` (tensor / data parallel), ``params`` are sharded over its mesh and ``config`` is the
    model config of its plan (KV heads as stored, GDN qkv channels grouped; ``sharding.ShardPlan.model_config``).
    """

    config: TargetConfig
    params: qwen36.Params
    eos_token_ids: tuple[int, ...] = ()
    path: str | None = None
    layout: Layout | None = None

    def _run(self, token_ids: Sequence[int], return_layers: tuple[int, ...]):
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if ids.size == 0:
            raise ValueError("token_ids is empty")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}); got range "
                             f"[{ids.min()}, {ids.max()}]")
        t = ids.size
        padded = -(-t // _BUCKET) * _BUCKET  # few shapes -> few compiles
        tok = np.zeros((1, padded), np.int32)
        tok[0, :t] = ids
        logits, feats = _full_pass(self.params, self.config, jnp.asarray(tok), jnp.asarray([t], jnp.int32),
                                   return_layers)
        return logits[:t], None if feats is None else feats[:, :t]

    def fuse_projections(self) -> "Target":
        """Fuse this target's input projections in place (``qwen36.fuse_projections``; each part's buffer is freed
        as its fused matrix is made) and return it; a target laid out over a mesh is left as is. What an ``Engine``
        would otherwise do on a copy."""
        if self.layout is None and not qwen36.is_fused(self.params):
            self.params = qwen36.fuse_projections(self.params, consume=True)
        return self

    def logits(self, token_ids: Sequence[int]) -> jax.Array:
        """Full-sequence logits ``[T, V]`` (float32) of one sequence starting at position 0."""
        return self._run(token_ids, ())[0]

    def hidden_states(self, token_ids: Sequence[int], layers: Sequence[int]) -> jax.Array:
        """Outputs of the given decoder layers (before the final norm): ``[len(layers), T, D]``."""
        layers = tuple(int(i) for i in layers)
        for i in layers:
            if not 0 <= i < self.config.num_layers:
                raise ValueError(f"layer {i} out of range [0, {self.config.num_layers})")
        return self._run(token_ids, layers)[1]

    def greedy(self, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation by re-running the full pass (a slow reference, no cache)."""
        ids = list(int(i) for i in token_ids)
        out = []
        for _ in range(max_new_tokens):
            nxt = int(jnp.argmax(self.logits(ids)[-1]))
            ids.append(nxt)
            out.append(nxt)
        return out


def load_target(path: str | os.PathLike, dtype="float32", tensor_parallel: int = 1, data_parallel: int = 1,
                devices: list | None = None, quantization: str | None = None) -> Target:
    """Load a Qwen3.5/3.6 hybrid checkpoint: a Hugging Face directory (bf16/fp32, or FP8 with
    ``weight_scale_inv`` block scales) or a llama.cpp ``.gguf`` file (``qwen35``; dequantized at load).

    ``dtype`` is the activation dtype; ``quantization="fp8"`` stores every large matmul weight as fp8 with
    per-output-channel scales (``"fp8_dynamic"``: the same, each matmul quantizing its input per token too),
    ``"int8"`` as Q8_0 blocks, ``"int4"`` as packed Q4_0 blocks (``models/quant.py``;
    quantized on the device as it loads). With ``tensor_parallel`` or
    ``data_parallel`` > 1, each tensor is re-laid out and written straight to its shards of a ``data`` x
    ``model`` mesh over ``devices`` (default ``jax.devices()``) while streaming; quantized weights are loaded
    quantized on the default device first, then re-laid out and resharded leaf by leaf (scales with their rows).
    """
    path = os.fspath(path)
    quantization = quant.check_quantization(quantization)
    sharded = tensor_parallel != 1 or data_parallel != 1
    if path.endswith(".gguf") and os.path.isfile(path):
        from dflash_jax.models import gguf_loader

        cfg, params, eos = gguf_loader.load_gguf(path, resolve_dtype(dtype), quantization=quantization)
        target = Target(config=cfg, params=params, eos_token_ids=eos, path=path)
        return shard_target(target, tensor_parallel, data_parallel, devices) if sharded else target
    cfg = TargetConfig.from_file(path)
    eos = tuple(dict.fromkeys(read_generation_eos(path) + cfg.eos_token_ids))
    if not sharded or quantization is not None:
        params = loader.load_params(path, cfg, resolve_dtype(dtype), quantization=quantization)
        target = Target(config=cfg, params=params, eos_token_ids=eos, path=path)
        return shard_target(target, tensor_parallel, data_parallel, devices) if sharded else target
    lay = Layout.build(cfg, tensor_parallel, data_parallel, devices)
    params = loader.load_params(path, cfg, resolve_dtype(dtype), place=lay.place(cfg))
    return Target(config=lay.plan.model_config(cfg), params=params, eos_token_ids=eos, path=path, layout=lay)


def shard_target(target: Target, tensor_parallel: int = 1, data_parallel: int = 1,
                 devices: list | None = None) -> Target:
    """``target`` laid out over a ``data`` x ``model`` mesh (re-laid-out and resharded leaf by leaf); a target
    already laid out that way is returned as is."""
    if target.layout is not None:
        have = (target.layout.tp, target.layout.dp)
        if have != (tensor_parallel, data_parallel):
            raise ShardingError(f"the target is laid out for tensor_parallel={have[0]}, data_parallel={have[1]} "
                                f"but {tensor_parallel}, {data_parallel} were asked for; load it again unsharded")
        return target
    if qwen36.is_fused(target.params):
        raise ShardingError("the target's projections are fused (an Engine built on it with fuse_projections); "
                            "tensor / data parallelism lays out the checkpoint's matrices: load it again")
    lay = Layout.build(target.config, tensor_parallel, data_parallel, devices)
    return dataclasses.replace(target, config=lay.plan.model_config(target.config),
                               params=lay.shard_params(target.params, target.config), layout=lay)
