"""Packed tree attention over paged KV: op ``"tree_attention"`` in :mod:`pallas_kernels.registry`.

Implementations (signature ``(q [B,N,H,D], k_pages, v_pages, page_table [B,W], start [B], k_tree, v_tree
[B,N,Hkv,D], ancestors [B,N,N], scale)``, as ``dflash_jax.models.qwen36.forward_tree`` calls it; the pages are
arrays or ``QuantizedPages``):

- ``"reference"``: pure jnp (``dflash_jax.models.attention.tree_attention_reference``), any backend;
- ``"pallas_triton"``: :func:`kernel.tree_attention` with the per-backend defaults of
  :func:`kernel.default_config`; runs in interpret mode off GPU (when selected explicitly); fp8 pages on CUDA
  are read as uint16 pairs with f16 dots (:func:`pairs.tree_attention_pairs`, as paged decode reads them); fp8
  pages on ROCm run the reference, with a warning;
- ``"mosaic_gpu"`` (opt-in: ``DFLASH_KERNELS=tree_attention=mosaic_gpu``): :func:`mosaic.tree_attention_mgpu`,
  warpgroup MMA with TMA page copies, for Hopper (sm_90) and bf16 / f16 pages; other GPUs, quantized pages and
  shapes it cannot take run ``pallas_triton``, with a warning; off GPU (when selected explicitly) the Mosaic GPU
  interpreter.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.paged_decode.kernel import MIN_DOT, check_page_dtype, page_arrays
from pallas_kernels.paged_decode.pairs import pack_pairs
from pallas_kernels.tree_attention import pairs
from pallas_kernels.tree_attention.kernel import block_plan, default_config, tree_attention
from pallas_kernels.tree_attention.mosaic import plan as mosaic_plan
from pallas_kernels.tree_attention.mosaic import tree_attention_mgpu
from pallas_kernels.tree_attention.reference import tree_attention_reference


def tree_attention_pallas(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                          start: jax.Array, k_tree: jax.Array, v_tree: jax.Array, ancestors: jax.Array,
                          scale: float) -> jax.Array:
    """The registered Pallas implementation: tuned defaults, prefix split chosen by grid size. Shapes the Triton
    tiles cannot take (e.g. a head_dim that is not a power of two) run the reference, with a warning."""
    backend = registry.current_backend()
    data, k_scale, cd = page_arrays(k_pages)
    try:
        check_page_dtype("tree_attention", k_pages, backend)
    except ValueError as e:
        registry.warn_fallback("tree_attention", e, what="these KV pages")
        return tree_attention_reference(q, k_pages, v_pages, page_table, start, k_tree, v_tree, ancestors, scale)
    cfg = default_config(q.shape[-1], k_pages.shape[1], cd, backend=backend, quantized=k_scale is not None)
    try:
        block_plan(batch=q.shape[0], n_tree=q.shape[1], n_heads=q.shape[2], n_kv_heads=k_pages.shape[2],
                   head_dim=q.shape[-1], page_size=k_pages.shape[1], width=page_table.shape[1], dtype=data.dtype,
                   block_m=cfg["block_m"], pages_per_block=cfg["pages_per_block"], num_partitions=None,
                   num_stages=cfg["num_stages"], target_programs=cfg["target_programs"], compute_dtype=cd)
    except ValueError as e:
        registry.warn_fallback("tree_attention", e)
        return tree_attention_reference(q, k_pages, v_pages, page_table, start, k_tree, v_tree, ancestors, scale)
    if backend == "cuda" and jnp.dtype(data.dtype) == jnp.float8_e4m3fn and q.shape[-1] // 2 >= MIN_DOT:
        return pairs.tree_attention_pairs(
            q, pack_pairs(data), pack_pairs(v_pages.data), page_table, start, k_tree.astype(cd), v_tree.astype(cd),
            ancestors, float(scale), k_scale, v_pages.scale, block_m=cfg["block_m"],
            pages_per_block=cfg["pages_per_block"], num_partitions=None, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"], target_programs=cfg["target_programs"])
    return tree_attention(q, k_pages, v_pages, page_table, start, k_tree, v_tree, ancestors, float(scale),
                          block_m=cfg["block_m"], pages_per_block=cfg["pages_per_block"], num_partitions=None,
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], prefetch=cfg["prefetch"],
                          target_programs=cfg["target_programs"], interpret=backend not in registry.GPU_BACKENDS)


def hopper() -> bool:
    """True on a compute-capability 9.x NVIDIA GPU (warpgroup MMA and TMA)."""
    if registry.current_backend() != "cuda":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def tree_attention_mosaic(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                          start: jax.Array, k_tree: jax.Array, v_tree: jax.Array, ancestors: jax.Array,
                          scale: float) -> jax.Array:
    """The registered Mosaic GPU implementation (partitions chosen by grid size). What it cannot run (not Hopper,
    quantized pages, shapes :func:`mosaic.plan` refuses) goes to :func:`tree_attention_pallas`, with a warning."""
    on_gpu = registry.current_backend() in registry.GPU_BACKENDS
    try:
        if on_gpu and not hopper():
            raise ValueError("not a Hopper GPU")
        if page_arrays(k_pages)[1] is not None:
            raise ValueError("quantized pages")
        mosaic_plan(batch=q.shape[0], n_tree=q.shape[1], n_heads=q.shape[2], n_kv_heads=k_pages.shape[2],
                    head_dim=q.shape[-1], page_size=k_pages.shape[1], width=page_table.shape[1], dtype=k_pages.dtype)
    except ValueError as e:
        warnings.warn(f"tree_attention: the mosaic_gpu kernel cannot take this call ({e}); running pallas_triton",
                      RuntimeWarning, stacklevel=2)
        return tree_attention_pallas(q, k_pages, v_pages, page_table, start, k_tree, v_tree, ancestors, scale)
    return tree_attention_mgpu(q, k_pages, v_pages, page_table, start, k_tree, v_tree, ancestors, float(scale),
                               interpret=not on_gpu)


registry.register("tree_attention", "reference", tree_attention_reference, backends=("any",))
registry.register("tree_attention", "pallas_triton", tree_attention_pallas, backends=("gpu",))
registry.register("tree_attention", "mosaic_gpu", tree_attention_mosaic, backends=("cuda",), preferred=False)

__all__ = ["block_plan", "default_config", "mosaic_plan", "tree_attention", "tree_attention_mgpu",
           "tree_attention_mosaic", "tree_attention_pallas", "tree_attention_reference"]
