"""Row writes into donated state (KV pages, recurrent slots) as collision-free scatters.

Rows that must not be written (padding, non-resident pages) used to be sent to the null page / null slot. On a
GPU, XLA lowers a scatter whose indices may repeat to atomic stores, and colliding 16-bit stores become
compare-and-swap loops that serialise: a bf16 prefill chunk of 4 x 1024 tokens, mostly padding, spent ~25 ms in
one K write. Here every dropped row gets its own out-of-range index instead, the scatter drops it, and the
remaining indices are unique, so XLA emits plain stores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def set_rows_where(x: jax.Array, idx: tuple[jax.Array, ...], values: jax.Array, keep: jax.Array) -> jax.Array:
    """``x.at[idx].set(values)`` for the rows where ``keep``; the others leave ``x`` untouched.

    idx: index arrays into ``x``'s leading dims, all of ``keep``'s shape; values: ``keep.shape + x.shape[len(idx):]``.
    The kept rows must address distinct elements (true of pages and slots: one sequence owns each).
    """
    first = idx[0]
    dropped = x.shape[0] + jnp.arange(first.size, dtype=first.dtype).reshape(first.shape)
    idx = (jnp.where(keep, first, dropped),) + tuple(idx[1:])
    return x.at[idx].set(values.astype(x.dtype), mode="drop", unique_indices=True)
