"""Exact top-k over a vocabulary-sized last axis without sorting it.

XLA's GPU top-k kernel handles k <= 16; above that ``jax.lax.top_k`` becomes a full sort of the axis. A DDTree of
budget 22 needs the top 22 of every drafted position: at the 27B's 248K vocabulary that sort is ~27 kernels and
~0.8 ms of a batch-1 round on an H200, about 4 % of it, and it grows with the batch.

``top_k`` here gives exactly what ``jax.lax.top_k`` gives (the same values and ids, ties to the lower id) from two
small selections: the axis in chunks of ``chunk`` elements, the max of each chunk, the k chunks with the largest
maxima, then the top k of those chunks' elements. It is exact because each of the true top k lies in one of those
chunks: order elements by (value descending, id ascending) and a chunk by its first element in that order; if an
element of the top k sat in a chunk outside the first k, each of the k chunks before it would hold an element
ahead of it, k in all, and it would not be in the top k. Chunks are contiguous id ranges, so comparing two
chunks' first elements compares their maxima, then their indices, which is the order ``jax.lax.top_k`` uses on
the maxima.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 128
MIN_CHUNKS_PER_K = 4  # below k * this many chunks the two-stage form saves nothing over one selection


def top_k(x: jax.Array, k: int, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """``x`` [..., N] -> (values [..., k], ids [..., k] int32), equal to ``jax.lax.top_k(x, k)`` (x without NaN).

    Two-stage (see the module docstring) when N holds at least ``MIN_CHUNKS_PER_K * k`` chunks of ``chunk``;
    otherwise ``jax.lax.top_k`` itself.
    """
    n = x.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"top_k needs 1 <= k <= {n} (the last axis), got k={k}")
    if chunk < 1 or n < MIN_CHUNKS_PER_K * k * chunk:
        vals, ids = jax.lax.top_k(x, k)
        return vals, ids.astype(jnp.int32)
    lead = x.shape[:-1]
    g = -(-n // chunk)
    pad = g * chunk - n
    if pad:  # padding sorts after every real element: -inf, and ids above N (ties go to the lower id)
        fill = jnp.full(lead + (pad,), -jnp.inf, x.dtype)
        x = jnp.concatenate([x, fill], axis=-1)
    blocks = x.reshape(lead + (g, chunk))
    _, best = jax.lax.top_k(jnp.max(blocks, axis=-1), k)  # [..., k] chunk indices
    best = jnp.sort(best, axis=-1)  # ascending, so candidate positions follow ids and ties still go to the lower id
    cand = jnp.take_along_axis(blocks, best[..., None], axis=-2).reshape(lead + (k * chunk,))
    cand_ids = (best[..., None] * chunk + jnp.arange(chunk, dtype=best.dtype)).reshape(lead + (k * chunk,))
    vals, pos = jax.lax.top_k(cand, k)
    return vals, jnp.take_along_axis(cand_ids, pos, axis=-1).astype(jnp.int32)
