"""``acc + a @ b`` as one Triton dot that accumulates into ``acc``, for Pallas Triton kernels.

Pallas' ``plt.dot`` always lowers to ``tt.dot(a, b, zeros)``, so a kernel's ``o = alpha * o + dot(p, v)`` becomes a
product into a fresh zero tile and then an add: the fresh tile needs its own registers next to ``o``, and Triton
does not fold the add into the MMA's accumulator (it leaves float adds alone: the fold changes rounding). At the
tree-attention tile (128 rows x 256 channels in f32 over 8 warps: 128 registers a thread each) that second tile is
what spills the output accumulator inside the key loop. :func:`dot_acc` binds a primitive whose Triton lowering is
``tt.dot(a, b, acc)`` (the accumulate is the MMA's own), and whose other lowerings (interpret mode, XLA) are
``acc + dot(a, b)`` in f32: the same sum, with one rounding fewer on the GPU.

The Triton rule is registered in ``jax._src.pallas.triton.lowering.triton_lowering_rules``: a private table of the
pinned JAX (``jax==0.11.2``); ``tests/test_pallas_dot_acc.py`` checks both lowerings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import mlir

dot_acc_p = jex_core.Primitive("pallas_dot_acc")


def dot_acc(a: jax.Array, b: jax.Array, acc: jax.Array, *, trans_b: bool = False, precision=None,
            imprecise_acc: int = 0) -> jax.Array:
    """``acc + a @ b`` (``b.T`` with ``trans_b``): a ``[M, K]``, b ``[K, N]`` (or ``[N, K]``), acc ``[M, N]`` f32.
    ``precision``: as ``plt.dot``'s (``lax.Precision.HIGHEST`` for IEEE f32 operands; None otherwise).
    ``imprecise_acc`` (fp8 operands): how many products along K Hopper's fp8 MMA may sum in its own reduced-precision
    accumulator before Triton adds them into ``acc`` (Triton's ``max_num_imprecise_acc``). At 0, Triton's default,
    it will not use Hopper's fp8 MMA for an f32 result at all and upcasts both operands to f16 for ``mma.sync``."""
    if acc.dtype != jnp.float32:
        raise ValueError(f"dot_acc: the accumulator must be float32, got {acc.dtype}")
    if a.dtype != b.dtype:
        raise ValueError(f"dot_acc: operands of one dtype, got {a.dtype} and {b.dtype}")
    n = b.shape[0] if trans_b else b.shape[1]
    k = b.shape[1] if trans_b else b.shape[0]
    if a.ndim != 2 or a.shape[1] != k or acc.shape != (a.shape[0], n):
        raise ValueError(f"dot_acc: a {a.shape}, b {b.shape} (trans_b={trans_b}) and acc {acc.shape} do not fit")
    return dot_acc_p.bind(a, b, acc, trans_b=bool(trans_b), precision=precision, imprecise_acc=int(imprecise_acc))


def _reference(a, b, acc, *, trans_b: bool, precision, imprecise_acc: int):
    del imprecise_acc
    b = b.T if trans_b else b
    return acc + lax.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


dot_acc_p.def_impl(_reference)
dot_acc_p.def_abstract_eval(lambda a, b, acc, **_: jax.core.ShapedArray(acc.shape, acc.dtype))
mlir.register_lowering(dot_acc_p, mlir.lower_fun(_reference, multiple_results=False))


def _triton_rule(ctx, a, b, acc, *, trans_b: bool, precision, imprecise_acc: int):
    from jax._src.lib.triton import dialect as tt_dialect

    if trans_b:
        b = tt_dialect.trans(b, (1, 0))
    a_dtype = ctx.avals_in[0].dtype
    if a_dtype != jnp.float32:
        input_precision = None
    elif precision in (lax.Precision.HIGHEST, (lax.Precision.HIGHEST, lax.Precision.HIGHEST)):
        input_precision = tt_dialect.InputPrecision.IEEE
    else:
        input_precision = tt_dialect.InputPrecision.TF32
    return tt_dialect.dot(a, b, acc, input_precision=input_precision, max_num_imprecise_acc=imprecise_acc or None)


def _register_triton_rule() -> None:
    from jax._src.pallas.triton import lowering as triton_lowering

    triton_lowering.triton_lowering_rules[dot_acc_p] = _triton_rule


_register_triton_rule()
