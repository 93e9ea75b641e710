"""Pure-jnp reference for single-token paged decode attention.

Delegates to the engine's reference ``dflash_jax.models.attention.paged_attention_reference`` with T = 1
and ``q_position = length - 1`` (key j visible iff j < length and its page is resident), so the kernel is
tested against exactly what the model's reference runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_jax.models import attention


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_decode_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                           lengths: jax.Array, scale: float) -> jax.Array:
    """q [B, H, D]; k_pages, v_pages [n_pages, page_size, Hkv, D]; page_table [B, W]; lengths [B]
    (valid KV tokens per sequence, 1 <= length <= W * page_size;
    page-table entries < 0 are non-resident pages, their keys masked). Returns [B, H, D] in q's dtype."""
    pos = (lengths.astype(jnp.int32) - 1)[:, None]
    return attention.paged_attention_reference(q[:, None], k_pages, v_pages, page_table, pos, scale)[:, 0]
