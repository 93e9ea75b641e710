"""A step's host inputs moved to the device in one transfer.

Every engine step takes a handful of small per-row arrays from the host (tokens, positions, slots, the page table,
the sampling settings). Passed as separate numpy arguments, each is its own host-to-device copy; on an H200 that
costs ~75 us apiece, ~0.9 ms a step for twelve of them, more than a small model's whole decode step. ``Packing``
lays such a pytree out as one flat int32 buffer on the host (``pack``) and takes it apart inside the compiled step
at static offsets (``unpack``): one copy per step. The layout is fixed by the leaves' shapes and dtypes, so each
batch bucket has its own ``Packing`` and executable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# 32-bit dtypes travel as their bits; bool as 0 / 1
_WORD = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32))
_BOOL = np.dtype(np.bool_)


@dataclasses.dataclass(frozen=True)
class Packing:
    """The layout of a pytree of small int32 / uint32 / float32 / bool arrays in one ``[size]`` int32 buffer:
    leaf ``i`` (shape ``shapes[i]``, dtype ``dtypes[i]``) at words ``offsets[i]`` onwards, row-major."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]

    @classmethod
    def of(cls, tree: Any) -> "Packing":
        """The layout of ``tree`` (arrays or ``jax.ShapeDtypeStruct`` leaves; ``None`` fields stay ``None``)."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        dtypes = tuple(np.dtype(x.dtype) for x in leaves)
        for x, dt in zip(leaves, dtypes):
            if dt not in _WORD and dt != _BOOL:
                raise TypeError(f"Packing takes int32 / uint32 / float32 / bool leaves; got {dt} of shape "
                                f"{tuple(x.shape)}: convert it on the host first")
        return cls(treedef, tuple(tuple(x.shape) for x in leaves), dtypes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @property
    def size(self) -> int:
        """Words (int32) in the buffer."""
        return sum(self.sizes)

    def pack(self, tree: Any) -> np.ndarray:
        """Host pytree (numpy leaves, this layout) -> ``[size]`` int32; leaves with leading axes beyond the layout's
        shapes (e.g. ``[dp, ...]`` replicas) give ``[..., size]``."""
        leaves = self._leaves(tree)
        lead = np.shape(leaves[0])[:np.ndim(leaves[0]) - len(self.shapes[0])] if leaves else ()
        parts = []
        for x, shape, dt in zip(leaves, self.shapes, self.dtypes):
            x = np.asarray(x)
            if x.shape != lead + shape:
                raise ValueError(f"leaf of shape {x.shape} where the packing expects {lead + shape}")
            x = x.astype(np.int32) if dt == _BOOL else np.ascontiguousarray(x, dt).view(np.int32)
            parts.append(x.reshape(lead + (-1,)))
        return np.concatenate(parts, axis=-1) if parts else np.zeros(lead + (0,), np.int32)

    def pack_jnp(self, tree: Any) -> jax.Array:
        """``pack`` for device arrays (inside a jitted function): ``[size]`` int32."""
        parts = []
        for x, shape, dt in zip(self._leaves(tree), self.shapes, self.dtypes):
            x = jnp.asarray(x)
            if x.shape != shape:
                raise ValueError(f"leaf of shape {x.shape} where the packing expects {shape}")
            x = x.astype(jnp.int32) if dt == _BOOL else jax.lax.bitcast_convert_type(x.astype(dt), jnp.int32)
            parts.append(x.reshape(-1))
        return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.int32)

    def unpack(self, buf: jax.Array) -> Any:
        """``[size]`` int32 (traced) -> the pytree, each leaf a static slice of ``buf`` in its shape and dtype."""
        if buf.shape != (self.size,):
            raise ValueError(f"buffer of shape {buf.shape} where the packing expects ({self.size},)")
        leaves, o = [], 0
        for shape, dt, n in zip(self.shapes, self.dtypes, self.sizes):
            w = buf[o:o + n].reshape(shape)
            leaves.append(w != 0 if dt == _BOOL else w if dt == np.int32 else jax.lax.bitcast_convert_type(w, dt))
            o += n
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def _leaves(self, tree: Any) -> list:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"pytree {treedef} does not match the packing's {self.treedef}")
        return leaves
