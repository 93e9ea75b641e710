"""The pure-``jnp`` reference of op ``"key_round"``: channel-by-channel rounding with error feedback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dflash_jax.kv.quant import QMAX
FP8_MIN_EXP = -6  # e4m3fn: 2^-6 is the smallest normal; below it the step stays 2^-9 (subnormals)
FP8_MANT_BITS = 3


def grid_round(x: jax.Array, dtype) -> jax.Array:
    """``x`` (float32, in units of a row's scale) clipped to the format's range and rounded onto ``dtype``'s grid,
    as float32 (integers round half to even; fp8 as its cast rounds)."""
    qmax = QMAX[jnp.dtype(dtype)]
    y = jnp.clip(x, -qmax, qmax)
    return jnp.round(y) if jnp.issubdtype(dtype, jnp.integer) else y.astype(dtype).astype(jnp.float32)


def round_half_even(a: jax.Array) -> jax.Array:
    """``a >= 0`` (float32, < 2^23) rounded to an integer, ties to even, in f32 arithmetic (every op exact)."""
    f = jnp.floor(a)
    frac = a - f
    odd = f - 2.0 * jnp.floor(0.5 * f) != 0.0
    return jnp.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)


def grid_round_f32(x: jax.Array, dtype) -> jax.Array:
    """:func:`pallas_kernels.key_round.reference.grid_round` without a cast or ``lax.round`` (both missing from
    some Triton targets): ``x`` clipped to ``dtype``'s range and rounded to its grid, ties to even, as float32.

    fp8 e4m3fn: ``|x|``'s binade ``[2^e, 2^(e+1))`` has grid step ``2^(e - 3)``, and below ``2^-6`` the step stays
    ``2^-9`` (subnormals); ``e`` is read from the float32's exponent bits (clamped at -6) and the step and its
    inverse are built as float32 bits, so the scaling is exact and costs a few integer ops, not a search."""
    qmax = QMAX[jnp.dtype(dtype)]
    x = jnp.clip(x, -qmax, qmax)
    a = jnp.abs(x)
    if jnp.issubdtype(dtype, jnp.integer):
        r = round_half_even(a)
    else:
        e = jnp.maximum(lax.shift_right_logical(lax.bitcast_convert_type(a, jnp.int32), 23) - 127, FP8_MIN_EXP)
        step = lax.bitcast_convert_type(lax.shift_left(e + (127 - FP8_MANT_BITS), 23), jnp.float32)
        inv = lax.bitcast_convert_type(lax.shift_left((127 + FP8_MANT_BITS) - e, 23), jnp.float32)
        r = round_half_even(a * inv) * step
    return jnp.where(jnp.signbit(x), -r, r)


def key_round_reference(w: jax.Array, g: jax.Array, dtype) -> jax.Array:
    """``w [N, Hkv, D]`` float32 (each row already divided by its scale) rounded onto ``dtype``'s grid one channel at
    a time, in order: channel ``i`` rounds to ``y_i`` and every later channel ``j`` of its row moves by
    ``(y_i - w_i) g[h, i, j]`` before it is rounded (``g [Hkv, D, D]``, zero on and below the diagonal). Returns
    ``y [N, Hkv, D]`` float32 on the grid. D dependent steps: the reference for CPUs and tests. It rounds with
    :func:`grid_round_f32` (arithmetic equal to the cast), as the kernel does: XLA:GPU drops a ``f32 -> fp8 -> f32``
    convert pair as excess precision (on an H100, session 35, the loop rounding by the cast returned every value
    unrounded), so :func:`grid_round` is only the definition the tests compare with."""
    d = w.shape[-1]
    g = g.astype(jnp.float32)

    def step(i, carry):
        w, y = carry
        wi = jax.lax.dynamic_index_in_dim(w, i, axis=-1, keepdims=False)  # [N, Hkv]
        yi = grid_round_f32(wi, dtype)
        w = w + (yi - wi)[..., None] * jax.lax.dynamic_index_in_dim(g, i, axis=1, keepdims=False)[None]
        return w, jax.lax.dynamic_update_index_in_dim(y, yi, i, axis=-1)

    _, y = jax.lax.fori_loop(0, d, step, (w.astype(jnp.float32), jnp.zeros(w.shape, jnp.float32)))
    return y
