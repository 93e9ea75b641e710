"""W8A16 matmul with per-output-channel scales: op ``"fp8_matmul"`` in :mod:`pallas_kernels.registry`.

``fp8_matmul(x [M, K], data [N, K] float8_e4m3fn, scale [N] f32) -> [M, N] f32`` = ``(x @ data^T) * scale``
with the fp8 weight converted to x's dtype in registers and float32 accumulation. Implementations:

- ``"reference"``: jnp (XLA fuses the convert into its GEMM/GEMV or not: ``bench linear`` tells), any backend;
- ``"pallas_triton"``: :func:`fp8_matmul_pallas`, grid over (M, N) tiles, each program walking K in
  ``block_k`` steps; runs in interpret mode off GPU. **Never compiled on a GPU yet**, so the model only
  uses it when chosen explicitly: ``DFLASH_KERNELS=fp8_matmul=pallas_triton``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import registry

MIN_DOT = 16


def fp8_matmul_reference(x: jax.Array, data: jax.Array, scale: jax.Array) -> jax.Array:
    y = jnp.einsum("mk,nk->mn", x, data.astype(x.dtype), preferred_element_type=jnp.float32)
    return y * scale.astype(jnp.float32)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_k: int, n_k: int):
    # x_ref [bm, K] activations; w_ref [bn, K] fp8; s_ref [bn] f32; o_ref [bm, bn] f32
    bm, bn = o_ref.shape

    def body(i, acc):
        x = x_ref[:, pl.ds(i * block_k, block_k)]
        w = w_ref[:, pl.ds(i * block_k, block_k)].astype(x.dtype)
        return acc + plt.dot(x, w, trans_b=True)

    acc = lax.fori_loop(0, n_k, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc * s_ref[...][None, :]


def block_plan(m: int, n: int, k: int, itemsize: int, *, block_n: int, block_k: int, num_stages: int,
               backend: str | None = None) -> int:
    """Padded M tile (a power of two >= 16) after the static tile checks (ValueError naming the tile)."""
    if n % block_n or k % block_k:
        raise ValueError(f"fp8_matmul: N={n} and K={k} must be multiples of block_n={block_n} / block_k={block_k}")
    bm = max(MIN_DOT, 1 << max(0, (m - 1).bit_length()))
    registry.check_block_shapes(
        "fp8_matmul", {"x": (bm, block_k), "w": (block_n, block_k), "o": (bm, block_n), "scale": (block_n,)},
        dots={"xw": (bm, block_n, block_k)},
        smem={"x": num_stages * bm * block_k * itemsize, "w": num_stages * block_n * block_k * 2},
        backend=backend)
    return bm


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages", "interpret"))
def fp8_matmul_pallas(x: jax.Array, data: jax.Array, scale: jax.Array, *, block_n: int = 64, block_k: int = 256,
                      num_warps: int = 4, num_stages: int = 3, interpret: bool | None = None) -> jax.Array:
    """x [M, K] (bf16/f32), data [N, K] float8_e4m3fn, scale [N] -> [M, N] f32. M is padded to a power of two
    >= 16 (one M tile for decode batches up to 64); N and K must divide by the blocks."""
    m, k = x.shape
    n = data.shape[0]
    if interpret is None:
        interpret = registry.current_backend() not in registry.GPU_BACKENDS
    bm = min(block_plan(m, n, k, jnp.dtype(x.dtype).itemsize, block_n=block_n, block_k=block_k,
                        num_stages=num_stages), 64)
    mp = -(-m // bm) * bm
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, n_k=k // block_k),
        out_shape=jax.ShapeDtypeStruct((mp, n), jnp.float32),
        grid=(mp // bm, n // block_n),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((block_n, k), lambda i, j: (j, 0)),
                  pl.BlockSpec((block_n,), lambda i, j: (j,))],
        out_specs=pl.BlockSpec((bm, block_n), lambda i, j: (i, j)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(xp, data, scale.astype(jnp.float32))
    return out[:m]


def supports(n: int, k: int, block_n: int = 64, block_k: int = 256) -> bool:
    """Whether the Pallas kernel takes an [N, K] weight with the default blocks."""
    return n % block_n == 0 and k % block_k == 0


registry.register("fp8_matmul", "reference", fp8_matmul_reference, backends=("any",))
registry.register("fp8_matmul", "pallas_triton", fp8_matmul_pallas, backends=("gpu",))

__all__ = ["block_plan", "fp8_matmul_pallas", "fp8_matmul_reference", "supports"]
