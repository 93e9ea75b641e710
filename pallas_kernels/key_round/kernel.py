"""Pallas (Triton lowering) kernel for op ``"key_round"``: channel-by-channel grid rounding with error feedback.

Grid ``(Hkv, cdiv(N, block_n))``: one program per (KV head, block of rows). A program holds its ``[block_n, D]``
tile of ``w`` in registers (f32) as D / block_d column tiles ``[block_n, block_d]`` and runs the D dependent steps
of :func:`pallas_kernels.key_round.reference.key_round_reference` as one ``fori_loop`` per column tile: step ``i``
reads column ``i`` from its tile only (a one-hot select-reduce over block_d columns: Triton has no dynamic
register indexing; one non-zero term, so exact), rounds it, and moves the later columns of its tile and every
later tile by ``err_i * g[h, i, :]`` (row ``i`` of the head's ``g``, read from global memory a step ahead, so its
latency hides behind a step's arithmetic). Each column still receives its updates one at a time in channel order,
as in the reference; the tiles only shorten the reduction (block_d instead of D columns) and skip the finished
tiles' updates.

Step ``i`` only moves columns after ``i`` (the row of ``g`` is masked to them, which is what the reference computes
whatever ``g`` holds on and below its diagonal: a column's later moves never reach its rounded value), so column
``i`` of a finished tile is the value step ``i`` rounded: each tile is stored rounded at once when its loop ends,
and no output accumulator is carried. The arithmetic on ``w`` is the reference's, op for op, so the result equals
it exactly (where both compile the multiply-add the same way: XLA:CPU and interpret mode do not contract it into
an FMA; on a GPU both Triton and XLA's LLVM may).

Rounding is :func:`pallas_kernels.key_round.reference.grid_round_f32`, f32 arithmetic with no cast: Triton has
no round-to-integer op in the Pallas lowering (``lax.round``), and an f32 -> ``float8_e4m3fn`` cast needs sm_89+
(and ROCm's MI300 converts only e4m3fnuz). Integers round half to even through ``floor``; fp8 e4m3fn values scale
``|x|`` by the inverse of its binade's grid step (a power of two built from the float32 exponent bits: exact),
round that half to even, and scale back, which is the cast's round-to-nearest-even, subnormals included (checked
against the cast in the tests).

Rows past N are loaded as zeros and not stored, so there is no pad or slice around the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.key_round.reference import QMAX, grid_round_f32
from pallas_kernels.paged_decode.kernel import _next_pow2
from pallas_kernels.registry import check_block_shapes

# f32 values of w per program at 1 warp per 1024: D=256 gets 8 rows on 2 warps. H100, N=65536, Hkv=4, D=256, fp8:
# 3.99 ms (32-column tiles; 16 rows / 2 warps 4.01, 32 rows / 4 warps 3.79, 8 rows / 1 warp 16.8; 64-column tiles
# 25 ms, one 256-column tile 22 ms).
TILE_ELEMS = 2048
MAX_BLOCK_N = 128
BLOCK_D = 32  # columns of one register tile (64 ran 6x slower on an H100)


def default_config(n: int, d: int) -> dict:
    """``block_n`` (rows a program rounds: ~:data:`TILE_ELEMS` values, no more than N's power of two),
    ``block_d`` (columns of one register tile: min(D, :data:`BLOCK_D`)) and ``num_warps`` (1 warp per 1024 values
    of the tile, 1 to 8)."""
    block_n = max(1, min(TILE_ELEMS // max(d, 1), MAX_BLOCK_N, _next_pow2(max(n, 1))))
    return dict(block_n=block_n, block_d=min(d, BLOCK_D), num_warps=min(8, max(1, block_n * d // 1024)))


def block_plan(*, n: int, hkv: int, d: int, block_n: int, block_d: int) -> dict:
    """Static shapes of a launch, checked with :func:`check_block_shapes` (ValueError for a D, block_n or block_d
    that is not a power of two, or a block_d past D)."""
    check_block_shapes("key_round", {"w": (block_n, d), "w_tile": (block_n, block_d), "g_row": (1, block_d)})
    if block_d > d:
        raise ValueError(f"key_round: block_d={block_d} is wider than D={d}")
    return dict(block_n=block_n, block_d=block_d, grid=(hkv, pl.cdiv(n, block_n)))


def _kernel(w_ref, g_ref, y_ref, *, n: int, dtype, block_d: int):
    # w_ref, y_ref [block_n, D]: this program's rows of one KV head (rows >= n masked); g_ref [D, D] the head's g.
    # The tile is held as D / block_d column tiles [block_n, block_d] (Triton cannot slice registers): step i of
    # column block k reduces only tile k to read column i and moves tiles k.. (tile k past column i).
    block_n, d = w_ref.shape
    n_tiles = d // block_d
    live = (pl.program_id(1) * block_n + lax.broadcasted_iota(jnp.int32, (block_n, block_d), 0)) < n
    cols = lax.broadcasted_iota(jnp.int32, (block_n, block_d), 1)
    g_cols = lax.broadcasted_iota(jnp.int32, (1, block_d), 1)

    def g_rows(r, k: int) -> tuple:
        return tuple(g_ref[pl.ds(r, 1), pl.ds(m * block_d, block_d)] for m in range(k, n_tiles))  # [1, block_d]

    tiles = [plt.load(w_ref.at[:, pl.ds(m * block_d, block_d)], mask=live, other=0.0) for m in range(n_tiles)]
    for k in range(n_tiles):
        base = k * block_d

        def step(i, carry, k=k, base=base):
            ws, gs = carry
            g_next = g_rows(base + jnp.minimum(i + 1, block_d - 1), k)  # next step's row, loaded a step ahead
            wi = jnp.sum(jnp.where(cols == i, ws[0], 0.0), axis=1)  # [block_n]
            err = (grid_round_f32(wi, dtype) - wi)[:, None]
            ws = (ws[0] + err * jnp.where(g_cols > i, gs[0], 0.0),) + tuple(w + err * g for w, g in zip(ws[1:], gs[1:]))
            return ws, g_next

        done, _ = lax.fori_loop(0, block_d, step, (tuple(tiles[k:]), g_rows(base, k)))
        tiles[k:] = done
        plt.store(y_ref.at[:, pl.ds(base, block_d)], grid_round_f32(tiles[k], dtype), mask=live)


@functools.partial(jax.jit, static_argnames=("dtype", "block_n", "block_d", "num_warps", "interpret"))
def key_round_pallas(w: jax.Array, g: jax.Array, dtype, *, block_n: int | None = None, block_d: int | None = None,
                     num_warps: int | None = None, interpret: bool | None = None) -> jax.Array:
    """:func:`pallas_kernels.key_round.reference.key_round_reference`'s contract: ``w [N, Hkv, D]`` float32, ``g
    [Hkv, D, D]`` float32 (only its entries above the diagonal are read), ``dtype`` float8_e4m3fn or int8 ->
    ``y [N, Hkv, D]`` float32 on ``dtype``'s grid. ``block_n`` / ``num_warps``: None takes
    :func:`default_config`'s; ``interpret``: None runs interpret mode off GPU. Raises ValueError (before
    lowering) for shapes the kernel cannot take (D or block_n not a power of two)."""
    from pallas_kernels.registry import GPU_BACKENDS, current_backend

    dtype = jnp.dtype(dtype)
    if dtype not in QMAX:
        raise ValueError(f"key_round: dtype {dtype} is not one of {sorted(str(t) for t in QMAX)}")
    if w.ndim != 3 or g.shape != (w.shape[1], w.shape[2], w.shape[2]):
        raise ValueError(f"key_round: w {w.shape} must be [N, Hkv, D] and g {g.shape} [Hkv, D, D]")
    n, hkv, d = w.shape
    cfg = default_config(n, d)
    block_n = cfg["block_n"] if block_n is None else block_n
    block_d = cfg["block_d"] if block_d is None else block_d
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    plan = block_plan(n=n, hkv=hkv, d=d, block_n=block_n, block_d=block_d)
    if n == 0:
        return jnp.zeros(w.shape, jnp.float32)
    if interpret is None:
        interpret = current_backend() not in GPU_BACKENDS
    return pl.pallas_call(
        functools.partial(_kernel, n=n, dtype=dtype, block_d=block_d),
        grid=plan["grid"],
        in_specs=[pl.BlockSpec((block_n, None, d), lambda h, b: (b, h, 0)),
                  pl.BlockSpec((None, d, d), lambda h, b: (h, 0, 0))],
        out_specs=pl.BlockSpec((block_n, None, d), lambda h, b: (b, h, 0)),
        out_shape=jax.ShapeDtypeStruct(w.shape, jnp.float32),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"key_round_{dtype.name}_d{d}_bn{block_n}_bd{block_d}",
    )(w.astype(jnp.float32), g.astype(jnp.float32))
