"""Weight-streaming skinny matmul (decode GEMV/GEMM): op ``"skinny_matmul"`` in :mod:`pallas_kernels.registry`.

``skinny_matmul(x [M, K], w [N, K], scale [N] | None) -> [M, N] float32`` = ``(x @ w^T) * scale`` for the
decode shapes of the model (M <= 64 tokens, a large weight read once per step). ``w`` is bf16 / f32 (no scale)
or ``float8_e4m3fn`` with a per-output-channel f32 ``scale``; the weight tile is converted to x's dtype in
registers and the dot accumulates in float32. The result is always **float32** (the caller casts: the model's
``linear`` / ``qmatmul`` cast to their output dtype, fused by XLA with the split-K sum and the scale).
Implementations:

- ``"reference"``: jnp (XLA's dot, converting an fp8 weight inside it), any backend;
- ``"pallas_triton"``: :func:`skinny_matmul_pallas`, grid ``(M tiles, N / block_n, split_k)``: each program
  reduces ``K / split_k`` of the weight's columns for one ``[bm, block_n]`` output tile in ``block_k`` steps
  and writes its f32 partial sum to ``[split_k, M, N]``; XLA sums the partials and applies the scale once
  (no atomics). Two forms of a program's inner step: ``"dot"`` (``tl.dot`` on an M tile padded to >= 16
  rows) and, for M <= :data:`GEMV_MAX_M`, ``"gemv"`` (no tensor cores: the weight tile converted to f32 in
  registers, multiplied by each row of x and summed along K, so the converted tile never goes through shared
  memory to reach an MMA and no padded rows are computed; the default at those M). Split-K is what fills the
  GPU when N alone gives few programs (N=5120 at block_n=64: 80 programs on 132 SMs). Opt-in
  (``preferred=False``) until measured on the H200: ``DFLASH_KERNELS=skinny_matmul=pallas_triton`` routes ``qwen36.linear`` (bf16 weights) and
  ``quant.qmatmul`` (per-channel fp8) through it (:func:`route`).

Launch configuration (:func:`default_config`, overridable per call): ``block_n`` / ``block_k`` (powers of two
>= 16), ``num_warps``, ``num_stages`` and ``split_k`` (None = :func:`auto_split_k`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import registry

MIN_DOT = 16          # tl.dot needs M, N, K >= 16
MAX_BM = 64           # rows of x per program (decode batches up to 64 take one M tile)
N_SM_TARGET = 132     # H200 SMs
TARGET_PROGRAMS = 2 * N_SM_TARGET
MAX_SPLIT_K = 16
GEMV_MAX_M = 4        # rows of x up to which the "gemv" form is the default (one accumulator per row)
GEMV_LOAD_BYTES = 16  # bytes per thread per weight-row load in the gemv form's default tile (one 128-bit load)
MIN_ROUTE_N = 64      # narrower weights (the GDN b/a gates, N = 48) stay with XLA's dot in the model
WEIGHT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)
FORMS = ("dot", "gemv")


def skinny_matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """x [M, K] @ w [N, K]^T (* scale [N]) -> [M, N] float32 (w converted to x's dtype, f32 accumulation)."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    y = jnp.einsum("mk,nk->mn", x, w.astype(x.dtype), preferred_element_type=acc)
    return y if scale is None else y * scale.astype(acc)


def _kernel(x_ref, w_ref, o_ref, *, m: int, block_k: int, n_k: int, precision):
    # x_ref [bm, K / split_k] activations (rows past M masked: x is not padded); w_ref [block_n, K / split_k]
    # weight (bf16 / fp8); o_ref [bm, block_n] f32: this program's partial sum over its K range
    bm, bn = o_ref.shape
    rows = (pl.program_id(0) * bm + jnp.arange(bm) < m)[:, None]

    def body(i, acc):
        x = plt.load(x_ref.at[:, pl.ds(i * block_k, block_k)], mask=rows, other=0)
        w = w_ref[:, pl.ds(i * block_k, block_k)].astype(x.dtype)
        return acc + plt.dot(x, w, trans_b=True, precision=precision)

    plt.store(o_ref, lax.fori_loop(0, n_k, body, jnp.zeros((bm, bn), jnp.float32)), mask=rows)


def _gemv_kernel(x_ref, w_ref, o_ref, *, m: int, block_k: int, n_k: int):
    # x_ref [bm, K / split_k] activations (rows >= m never read); w_ref [block_n, K / split_k] weight (bf16 / fp8);
    # o_ref [bm, block_n] f32 partial sums (rows >= m never written). One [block_n] f32 accumulator per row of x.
    bn = o_ref.shape[1]

    def body(i, accs):
        w = w_ref[:, pl.ds(i * block_k, block_k)].astype(jnp.float32)  # [block_n, block_k]
        return tuple(acc + jnp.sum(w * x_ref[r, pl.ds(i * block_k, block_k)].astype(jnp.float32)[None, :], axis=1)
                     for r, acc in enumerate(accs))

    accs = lax.fori_loop(0, n_k, body, tuple(jnp.zeros((bn,), jnp.float32) for _ in range(m)))
    for r, acc in enumerate(accs):
        o_ref[r, :] = acc


def padded_m(m: int) -> int:
    """Rows of x's M tile: the next power of two >= max(m, 16), at most 64 (larger M: several 64-row tiles)."""
    return min(MAX_BM, max(MIN_DOT, 1 << max(0, (m - 1).bit_length())))


def _check_form(form: str, m: int) -> None:
    if form not in FORMS:
        raise ValueError(f"skinny_matmul: form {form!r} is not one of {FORMS}")
    if form == "gemv" and not 0 < m <= GEMV_MAX_M:
        raise ValueError(f"skinny_matmul: the gemv form takes 1..{GEMV_MAX_M} rows of x, not {m}; use form='dot'")


def default_form(m: int) -> str:
    """``"gemv"`` up to :data:`GEMV_MAX_M` rows of x, ``"dot"`` above."""
    return "gemv" if m <= GEMV_MAX_M else "dot"


def auto_split_k(n: int, k: int, *, block_n: int, block_k: int, m_tiles: int = 1,
                 target_programs: int = TARGET_PROGRAMS) -> int:
    """The smallest power of two ``s`` with ``m_tiles * (n / block_n) * s >= target_programs`` (2 programs per
    H200 SM) whose K range ``k / s`` is still a multiple of ``block_k``; capped at 16. When no larger split
    divides K, the largest that does (1 at worst). E.g. block_n 64, block_k 256: N=5120 (80 programs) -> 4,
    N=10240 / 12288 -> 2, N=17408 (272 programs) -> 1."""
    programs = m_tiles * (n // block_n)
    s = 1
    while programs * s < target_programs and s < MAX_SPLIT_K and k % (2 * s * block_k) == 0:
        s *= 2
    return s


def _pow2_divisor(n: int, want: int) -> int:
    """The largest power of two <= want dividing n (1 if n is odd)."""
    b = want
    while b > 1 and n % b:
        b //= 2
    return b


def default_config(n: int, k: int, m: int = 1, dtype=jnp.bfloat16, x_dtype=jnp.bfloat16,
                   form: str | None = None) -> dict | None:
    """Launch defaults for an ``[N, K]`` weight of ``dtype`` (bf16 or float8_e4m3fn) at M rows of ``x_dtype`` in
    ``form`` (None: :func:`default_form`):
    form, block_n, block_k, split_k (None: :func:`auto_split_k`), num_warps, num_stages; None if the shape has
    no valid tiling (N or K without a power-of-two divisor >= 16). Starting guesses (``bench linear --sweep``
    records the best per shape and batch). ``"dot"`` (M > :data:`GEMV_MAX_M`): 64 output channels per program,
    256-wide K steps for bf16 and 512-wide for fp8 (the same 32 KiB weight tile), 3 stages, 4 warps; block_k
    halves until the tiles of an M tile of ``padded_m(m)`` rows fit the shared-memory budget. ``"gemv"``: 16
    output channels per program, a K step of one 128-bit load per thread of a warp (256 bf16 / 512 fp8
    weights), 2 stages, 4 warps: the converted f32 tile is 64 values a thread (32 channels would take 128
    registers for it alone)."""
    itemsize = jnp.dtype(dtype).itemsize
    form = form or default_form(m)
    _check_form(form, m)  # a wrong form is the caller's error, not a tiling to search for
    if form == "gemv":
        cfg = dict(form=form, block_n=_pow2_divisor(n, 16), block_k=_pow2_divisor(k, 32 * GEMV_LOAD_BYTES // itemsize),
                   split_k=None, num_warps=4, num_stages=2)
    else:
        cfg = dict(form=form, block_n=_pow2_divisor(n, 64), block_k=_pow2_divisor(k, 512 if itemsize == 1 else 256),
                   split_k=None, num_warps=4, num_stages=3)
    if cfg["block_n"] < MIN_DOT or cfg["block_k"] < MIN_DOT:
        return None
    while True:
        try:
            block_plan(m, n, k, x_dtype=x_dtype, w_dtype=dtype, **{key: cfg[key] for key in
                                                                  ("form", "block_n", "block_k", "split_k",
                                                                   "num_stages")})
            return cfg
        except ValueError:
            if cfg["block_k"] // 2 < MIN_DOT:
                return None
            cfg["block_k"] //= 2


def block_plan(m: int, n: int, k: int, *, x_dtype, w_dtype, block_n: int, block_k: int,
               split_k: int | None, num_stages: int, form: str = "dot", backend: str | None = None) -> dict:
    """Static launch shapes after the Triton tile checks: ``bm`` (M tile), ``m_tiles``, ``split_k`` (auto
    resolved), ``n_k`` (block_k steps per program). Raises ValueError naming the block that does not fit (or a
    ``"gemv"`` form at more than :data:`GEMV_MAX_M` rows)."""
    _check_form(form, m)
    if n % block_n or k % block_k:
        raise ValueError(f"skinny_matmul: N={n} and K={k} must be multiples of block_n={block_n} / "
                         f"block_k={block_k}; pick blocks that divide the weight's shape")
    bm = 1 << max(0, (m - 1).bit_length()) if form == "gemv" else padded_m(m)
    m_tiles = -(-m // bm)
    s = auto_split_k(n, k, block_n=block_n, block_k=block_k, m_tiles=m_tiles) if split_k is None else split_k
    if s < 1 or k % (s * block_k):
        raise ValueError(f"skinny_matmul: split_k={s} must be >= 1 and divide K={k} into multiples of "
                         f"block_k={block_k}")
    xi, wi = jnp.dtype(x_dtype).itemsize, jnp.dtype(w_dtype).itemsize
    if form == "gemv":
        registry.check_block_shapes(
            "skinny_matmul", {"x": (block_k,), "w": (block_n, block_k), "o": (block_n,)},
            smem={"x": num_stages * bm * block_k * xi, "w": num_stages * block_n * block_k * wi}, backend=backend)
    else:
        registry.check_block_shapes(
            "skinny_matmul", {"x": (bm, block_k), "w": (block_n, block_k), "o": (bm, block_n)},
            dots={"xw": (bm, block_n, block_k)},
            # staged loads, plus the weight tile converted to x's dtype when it is narrower (fp8)
            smem={"x": num_stages * bm * block_k * xi, "w": num_stages * block_n * block_k * wi,
                  "w_cvt": block_n * block_k * xi if wi < xi else 0},
            backend=backend)
    return dict(bm=bm, m_tiles=m_tiles, split_k=s, n_k=k // (s * block_k))


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "split_k", "num_warps", "num_stages",
                                             "form", "interpret"))
def skinny_matmul_pallas(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *, block_n: int | None = None,
                         block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, form: str | None = None,
                         interpret: bool | None = None) -> jax.Array:
    """x [M, K] (bf16 / f32), w [N, K] (bf16 / f32, or float8_e4m3fn with scale [N] f32) -> [M, N] float32.

    Blocks left None take :func:`default_config` (``split_k`` None: :func:`auto_split_k`; ``form`` None:
    :func:`default_form`). ``"dot"``: M tiles are a power of two >= 16 rows (one tile up to 64 rows) whose rows
    past M are masked loads and stores (x and the output are not padded); ``"gemv"``: one tile of all M <= 4
    rows, each row its own accumulator. N and K must divide by the blocks (ValueError otherwise)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape != (n, k):
        raise ValueError(f"skinny_matmul: weight shape {w.shape} does not match x {x.shape} ([N, K] with K={k})")
    if jnp.dtype(w.dtype) == jnp.float8_e4m3fn and scale is None:
        raise ValueError("skinny_matmul: a float8_e4m3fn weight needs its per-output-channel scale [N]")
    form = form or default_form(m)
    cfg = default_config(n, k, m, w.dtype, x.dtype, form) or dict(num_warps=4, num_stages=3)
    cfg["form"] = form
    given = dict(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    cfg.update({key: v for key, v in given.items() if v is not None})
    if "block_n" not in cfg or "block_k" not in cfg:
        raise ValueError(f"skinny_matmul: no power-of-two tiling >= {MIN_DOT} for an [{n}, {k}] weight; pass "
                         f"block_n / block_k or use the reference")
    if interpret is None:
        interpret = registry.current_backend() not in registry.GPU_BACKENDS
    plan = block_plan(m, n, k, x_dtype=x.dtype, w_dtype=w.dtype, block_n=cfg["block_n"], block_k=cfg["block_k"],
                      split_k=split_k, num_stages=cfg["num_stages"], form=form)
    bm, s, bn = plan["bm"], plan["split_k"], cfg["block_n"]
    ks = k // s
    if form == "gemv":
        body = functools.partial(_gemv_kernel, m=m, block_k=cfg["block_k"], n_k=plan["n_k"])
    else:
        precision = lax.Precision.HIGHEST if jnp.dtype(x.dtype) == jnp.float32 else None
        body = functools.partial(_kernel, m=m, block_k=cfg["block_k"], n_k=plan["n_k"], precision=precision)
    part = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((s, m, n), jnp.float32),
        grid=(plan["m_tiles"], n // bn, s),
        in_specs=[pl.BlockSpec((bm, ks), lambda i, j, p: (i, p)),
                  pl.BlockSpec((bn, ks), lambda i, j, p: (j, p))],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, p: (p, i, j)),
        compiler_params=plt.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name=f"skinny_matmul_{form}_{jnp.dtype(w.dtype).name}",
    )(x, w)
    y = part[0] if s == 1 else jnp.sum(part, axis=0)
    return y if scale is None else y * scale.astype(jnp.float32)


def supports(m: int, n: int, k: int, x_dtype, w_dtype) -> bool:
    """Whether the model routes this matmul to the kernel: M <= 64 rows, x bf16 / f16 / f32, a bf16 / f16 / f32
    / fp8 weight (fp8 e4m3fn not on ROCm, whose MI300 Triton converts only e4m3fnuz: XLA's dot runs there), and a
    valid default tiling that passes the static check."""
    if not 0 < m <= MAX_BM or jnp.dtype(x_dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return False
    if jnp.dtype(w_dtype) not in tuple(jnp.dtype(d) for d in WEIGHT_DTYPES):
        return False
    if jnp.dtype(w_dtype) == jnp.dtype(jnp.float8_e4m3fn) and registry.current_backend() == "rocm":
        return False
    return default_config(n, k, m, w_dtype, x_dtype) is not None


def _unsharded_trace() -> bool:
    """False under a mesh context with a non-manual axis of size > 1 (a tensor-parallel ``model`` axis left to
    the partitioner, which would gather the sharded weight around the kernel): the caller then keeps XLA's dot.
    A data-parallel ``shard_map`` (manual ``data`` axis, ``model`` of size 1) passes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True
    manual = jax.sharding.AxisType.Manual
    return all(size == 1 or t == manual for size, t in zip(mesh.axis_sizes, mesh.axis_types))


def route(x: jax.Array, w: jax.Array, scale: jax.Array | None = None) -> jax.Array | None:
    """``x [..., K] @ w [N, K]^T (* scale)`` as [..., N] float32 through the registry's ``skinny_matmul`` op when
    it resolves to a kernel (``DFLASH_KERNELS=skinny_matmul=pallas_triton``, or ``=pallas_triton_multi_row`` for
    M >= 2 only; read at trace time), the flattened M is <= 64, N >= 64 and the shape :func:`supports`, outside a tensor-parallel mesh context; None
    otherwise (the caller runs its XLA dot)."""
    impl = registry.resolve("skinny_matmul")
    if impl.name == "reference":
        return None
    n, k = w.shape
    m = math.prod(x.shape[:-1])
    if m < ROUTE_MIN_M.get(impl.name, 1) or n < MIN_ROUTE_N or not supports(m, n, k, x.dtype, w.dtype) \
            or not _unsharded_trace():
        return None
    y = impl.fn(x.reshape(m, k), w, scale)
    return y.reshape(*x.shape[:-1], n)


registry.register("skinny_matmul", "reference", skinny_matmul_reference, backends=("any",))
registry.register("skinny_matmul", "pallas_triton", skinny_matmul_pallas, backends=("gpu",), preferred=False)
# Opt-in: the kernel for matmuls of 2-64 rows only (a speculative round's verify tree and draft block), XLA's dot
# for one-row decode (where XLA's GEMV was as fast or faster); ``ROUTE_MIN_M`` holds the smallest M each routes.
registry.register("skinny_matmul", "pallas_triton_multi_row", skinny_matmul_pallas, backends=("gpu",),
                  preferred=False)
ROUTE_MIN_M = {"pallas_triton_multi_row": 2}

__all__ = ["FORMS", "GEMV_MAX_M", "ROUTE_MIN_M", "auto_split_k", "block_plan", "default_config", "default_form", "padded_m",
           "route", "skinny_matmul_pallas", "skinny_matmul_reference", "supports"]
