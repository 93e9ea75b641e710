"""Packed tree attention over paged KV: op ``"tree_attention"`` in :mod:`pallas_kernels.registry`.

Implementations (signature ``(q [B,N,H,D], k_pages, v_pages, page_table [B,W], start [B], k_tree, v_tree
[B,N,Hkv,D], ancestors [B,N,N], scale)``, as ``dflash_jax.models.qwen36.forward_tree`` calls it; the pages are
arrays or ``QuantizedPages``):

- ``"reference"``: pure jnp (``dflash_jax.models.attention.tree_attention_reference``), any backend;
- ``"pallas_triton"``: :func:`kernel.tree_attention` with the per-backend defaults of
  :func:`kernel.default_config`; runs in interpret mode off GPU (when selected explicitly); fp8 pages on ROCm
  run the reference, with a warning.
"""

from __future__ import annotations

import jax

from pallas_kernels import registry
from pallas_kernels.paged_decode.kernel import check_page_dtype, page_arrays
from pallas_kernels.tree_attention.kernel import block_plan, default_config, tree_attention
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
    return tree_attention(q, k_pages, v_pages, page_table, start, k_tree, v_tree, ancestors, float(scale),
                          block_m=cfg["block_m"], pages_per_block=cfg["pages_per_block"], num_partitions=None,
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], prefetch=cfg["prefetch"],
                          target_programs=cfg["target_programs"], interpret=backend not in registry.GPU_BACKENDS)


registry.register("tree_attention", "reference", tree_attention_reference, backends=("any",))
registry.register("tree_attention", "pallas_triton", tree_attention_pallas, backends=("gpu",))

__all__ = ["block_plan", "default_config", "tree_attention", "tree_attention_pallas", "tree_attention_reference"]
