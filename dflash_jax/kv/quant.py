"""Quantized KV pages: ``QuantizedPages`` (fp8 e4m3 or int8 values with one float32 scale per token and KV head).

A page array ``[n_pages, page_size, Hkv, D]`` becomes ``data`` of that shape in the storage dtype plus
``scale [n_pages, page_size, Hkv]``: each (token, head) row of D values is scaled so its largest magnitude maps to
the format's largest value (448 for e4m3, 127 for int8) when it is written, so rows written at different times
into one page never share (and never need to re-scale) a scale. Reads dequantize to ``compute_dtype``.
The scales cost 4 bytes per D values (1.6 % at D = 256): KV bytes per token go from 2 D to about D + 4 per head.

``set_rows`` / ``take`` are the only two operations the paged-attention code needs; both accept plain arrays too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kv.scatter import set_rows_where

F32 = jnp.float32
# --kv-dtype names -> storage dtype (None: the model dtype)
KV_DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn,
             "float8_e4m3fn": jnp.float8_e4m3fn, "int8": jnp.int8, "float32": jnp.float32, "f32": jnp.float32,
             "float16": jnp.float16}
QMAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.int8): 127.0}  # largest value of each page format


@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """``data [n_pages, page_size, Hkv, D]`` (fp8 / int8), ``scale [n_pages, page_size, Hkv]`` float32;
    value = data * scale, read back in ``compute_dtype``. ``dtype`` is the storage dtype."""

    data: jax.Array
    scale: jax.Array
    compute_dtype: Any = jnp.bfloat16

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scale.nbytes)


jax.tree_util.register_dataclass(QuantizedPages, data_fields=["data", "scale"], meta_fields=["compute_dtype"])


def resolve_kv_dtype(name: str | None, model_dtype) -> jnp.dtype:
    """A ``--kv-dtype`` name (``bf16 | fp8 | int8``, or a dtype name; None = the model dtype) -> its dtype."""
    if name is None:
        return jnp.dtype(model_dtype)
    if str(name) not in KV_DTYPES:
        try:
            return jnp.dtype(name)
        except TypeError:
            raise ValueError(f"kv dtype {name!r} not supported; use one of bf16, fp8, int8 (or a float dtype)") from None
    return jnp.dtype(KV_DTYPES[str(name)])


def is_quantized_dtype(dtype) -> bool:
    return jnp.dtype(dtype) in QMAX


def row_bytes(head_dim: int, dtype) -> int:
    """Bytes one (token, KV head) row of ``head_dim`` values costs in pages of ``dtype`` (values + its scale)."""
    return head_dim * jnp.dtype(dtype).itemsize + (jnp.dtype(F32).itemsize if is_quantized_dtype(dtype) else 0)


def zeros(shape: tuple[int, ...], dtype, compute_dtype=jnp.bfloat16) -> jax.Array | QuantizedPages:
    """Empty pages ``shape = [n_pages, page_size, Hkv, D]``: a plain array, or ``QuantizedPages`` for fp8/int8."""
    if not is_quantized_dtype(dtype):
        return jnp.zeros(shape, dtype)
    return QuantizedPages(jnp.zeros(shape, dtype), jnp.zeros(shape[:-1], F32), jnp.dtype(compute_dtype))


def _scaled_rows(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``x [..., D]`` -> (``x / scale`` float32, ``scale [...]``): each row's largest magnitude maps to the format's."""
    xf = x.astype(F32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / QMAX[jnp.dtype(dtype)], 1.0)
    return xf / scale[..., None], scale


def quantize_rows(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``x [..., D]`` -> (values ``[..., D]`` in ``dtype``, scales ``[...]`` float32), one scale per row."""
    qmax = QMAX[jnp.dtype(dtype)]
    w, scale = _scaled_rows(x, dtype)
    y = jnp.clip(w, -qmax, qmax)
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.round(y)
    return y.astype(dtype), scale


def feedback_matrix(u: np.ndarray) -> np.ndarray:
    """The error-feedback matrix ``G [..., D, D]`` of :func:`quantize_rows_feedback`, from ``u [..., D, D]`` the upper
    Cholesky factor of ``M^-1`` (``U^T U = M^-1``) for an error measure ``e^T M e``: ``G[i, j] = U[i, j] / U[i, i]``
    for ``j > i``, zero elsewhere. Channel ``i``'s rounding error ``delta_i`` then moves the channels after it by
    ``-delta_i G[i]``, the change that minimises ``e^T M e`` given it (GPTQ's update, applied to one vector)."""
    u = np.asarray(u, np.float64)
    g = np.triu(u / np.diagonal(u, axis1=-2, axis2=-1)[..., :, None], k=1)
    return g.astype(np.float32)


def quantize_rows_feedback(x: jax.Array, dtype, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., Hkv, D]`` -> (values, scales) as :func:`quantize_rows` stores them (the same per-row scale), but
    rounded one channel at a time with each channel's rounding error fed into the channels after it through
    ``g [Hkv, D, D]`` (:func:`feedback_matrix`), so the error lands where the quadratic ``g`` came from weighs it
    least. The rounding runs as the registry's ``"key_round"`` op."""
    from pallas_kernels import registry

    w, scale = _scaled_rows(x, dtype)
    hkv, d = x.shape[-2:]
    y = registry.get("key_round")(w.reshape(-1, hkv, d), g, jnp.dtype(dtype))
    return y.reshape(x.shape).astype(dtype), scale


def quantize_pages(pages: jax.Array, dtype, compute_dtype=None) -> QuantizedPages:
    """Whole pages ``[n_pages, page_size, Hkv, D]`` -> ``QuantizedPages`` in ``dtype`` (fp8 / int8), read back in
    ``compute_dtype`` (None: the pages' dtype); the same rounding as rows written by :func:`set_rows`."""
    q, s = quantize_rows(pages, dtype)
    return QuantizedPages(q, s, jnp.dtype(compute_dtype or pages.dtype))


def set_rows(pages: jax.Array | QuantizedPages, page: jax.Array, off: jax.Array, x: jax.Array,
             keep: jax.Array, feedback: jax.Array | None = None) -> jax.Array | QuantizedPages:
    """``pages.at[page, off].set(x)`` for ``x [B, T, Hkv, D]`` at page / offset ``[B, T]``, only where ``keep [B, T]``
    (quantizing if needed; see ``kv.scatter``). ``feedback [Hkv, D, D]``: quantized rows round with it
    (:func:`quantize_rows_feedback`); plain pages ignore it."""
    if not isinstance(pages, QuantizedPages):
        return set_rows_where(pages, (page, off), x, keep)
    if feedback is None:
        q, s = quantize_rows(x, pages.data.dtype)
    else:
        q, s = quantize_rows_feedback(x, pages.data.dtype, feedback)
    return QuantizedPages(set_rows_where(pages.data, (page, off), q, keep),
                          set_rows_where(pages.scale, (page, off), s, keep), pages.compute_dtype)


def dequantize(data: jax.Array, scale: jax.Array, compute_dtype) -> jax.Array:
    """Stored rows ``data [..., D]`` and their scales ``[...]`` -> values in ``compute_dtype`` (what a read gives)."""
    return (data.astype(F32) * scale[..., None]).astype(compute_dtype)


def take(pages: jax.Array | QuantizedPages, idx: jax.Array) -> jax.Array:
    """``pages[idx]`` (dequantized to the compute dtype for ``QuantizedPages``)."""
    if not isinstance(pages, QuantizedPages):
        return pages[idx]
    return dequantize(pages.data[idx], pages.scale[idx], pages.compute_dtype)
