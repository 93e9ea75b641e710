"""Single-token paged decode attention: op ``"paged_decode"`` in :mod:`pallas_kernels.registry`.

Implementations (same signature ``(q [B,H,D], k_pages, v_pages, page_table [B,W], lengths [B], scale)``; the
pages are arrays or ``QuantizedPages``):

- ``"reference"``: pure jnp (the engine's ``paged_attention`` with T = 1), any backend;
- ``"pallas_triton"``: :func:`kernel.paged_decode` with the per-backend defaults of
  :func:`kernel.default_config`; runs in interpret mode off GPU (when selected explicitly); fp8 pages on CUDA
  are read as uint16 pairs with f16 dots (:func:`pairs.paged_decode_pairs`: 1.1-1.4x the 8-bit tile kernel on an
  H100); fp8 pages on ROCm run the reference, with a warning (:func:`kernel.check_page_dtype`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.paged_decode import pairs
from pallas_kernels.paged_decode.kernel import (MIN_DOT, auto_partitions, block_plan, check_page_dtype,
                                                default_config, merge_partitions, page_arrays, paged_decode)
from pallas_kernels.paged_decode.reference import paged_decode_reference


def paged_decode_pallas(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                        lengths: jax.Array, scale: float) -> jax.Array:
    """The registered Pallas implementation: tuned defaults, flash-decoding split chosen by batch. Shapes the
    Triton tiles cannot take (e.g. a head_dim that is not a power of two) run the reference, with a warning."""
    backend = registry.current_backend()
    data, k_scale, cd = page_arrays(k_pages)
    try:
        check_page_dtype("paged_decode", k_pages, backend)
    except ValueError as e:
        registry.warn_fallback("paged_decode", e, what="these KV pages")
        return paged_decode_reference(q, k_pages, v_pages, page_table, lengths, scale)
    cfg = default_config(q.shape[-1], k_pages.shape[1], cd, backend=backend, quantized=k_scale is not None)
    try:
        block_plan(batch=q.shape[0], n_heads=q.shape[1], n_kv_heads=k_pages.shape[2], head_dim=q.shape[-1],
                   page_size=k_pages.shape[1], width=page_table.shape[1], dtype=data.dtype,
                   pages_per_block=cfg["pages_per_block"], num_partitions=None, num_stages=cfg["num_stages"],
                   target_programs=cfg["target_programs"], compute_dtype=cd)
    except ValueError as e:
        registry.warn_fallback("paged_decode", e)
        return paged_decode_reference(q, k_pages, v_pages, page_table, lengths, scale)
    if backend == "cuda" and jnp.dtype(data.dtype) == jnp.float8_e4m3fn and q.shape[-1] // 2 >= MIN_DOT:
        return pairs.paged_decode_pairs(q, pairs.pack_pairs(data), pairs.pack_pairs(v_pages.data), page_table,
                                        lengths, float(scale), k_scale, v_pages.scale,
                                        pages_per_block=cfg["pages_per_block"], num_warps=cfg["num_warps"],
                                        num_stages=cfg["num_stages"])
    return paged_decode(q, k_pages, v_pages, page_table, lengths, float(scale),
                        pages_per_block=cfg["pages_per_block"], num_partitions=None,
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], prefetch=cfg["prefetch"],
                        target_programs=cfg["target_programs"], interpret=backend not in registry.GPU_BACKENDS)


registry.register("paged_decode", "reference", paged_decode_reference, backends=("any",))
registry.register("paged_decode", "pallas_triton", paged_decode_pallas, backends=("gpu",))

__all__ = ["auto_partitions", "block_plan", "check_page_dtype", "default_config", "merge_partitions", "paged_decode",
           "paged_decode_pallas",
           "paged_decode_reference"]
