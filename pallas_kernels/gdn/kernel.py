"""Pallas (Triton lowering) kernel for the chunked gated delta rule (prefill), fp32 state.

Same math as ``dflash_jax.models.gdn._chunk`` (WY form), per chunk of C tokens:
``gam = cumsum(g)``, ``Gam_ij = exp(gam_i - gam_j)`` (j <= i), ``M = strict_lower(beta_i (k_i . k_j) Gam_ij)``,
``T = (I + M)^-1``, ``U = T (beta v)``, ``W = T (beta e^gam k)``, ``V' = U - W S``,
``o = (q e^gam) S + ((q k^T) * Gam) V'``, ``S <- e^{gam_C} S + (k e^{gam_C - gam})^T V'``.

Two passes, as production GDN kernels (flash-linear-attention's ``chunk_gated_delta_rule``) split it:

1. :func:`chunk_local` (XLA batched matmuls, parallel over B x chunks x H): everything that does not depend on
   the state: ``gam``, ``T`` (``gdn.unit_lower_inverse``: doubling blocks, batched matmuls), ``W``, ``U`` and
   the intra-chunk ``P = (q k^T) * Gam``. Outputs keep the batched matmuls' natural ``[B, n, H, C, *]`` layout (viewed as
   ``[B, n*H*C, *]``, no transpose), so chunk i of head h is rows ``(i*H + h)*C ...`` of its sequence.
2. :func:`_state_kernel` (Pallas), grid ``(B, H, dv / block_v)``: the value columns of the state are independent
   (every product above is linear in v and S column by column), so a program carries its ``[dk, block_v]`` slice
   of the state in registers through the chunks of its (sequence, head), doing only the state-dependent products
   per chunk (``W S``, ``(q e^gam) S``, ``P V'``, ``(k e^{gam_C-gam})^T V'``), and writes the state once at the end.

Precision (``precision``; default by q's dtype): ``"fp32"`` (fp32 inputs): every dot of both passes at HIGHEST
(IEEE fp32 on a GPU, no tensor cores), so the result equals the reference to fp32 round-off. ``"bf16"`` (16-bit
inputs): dot operands in bf16 with fp32 accumulation, the state and every elementwise step (gates, decays,
``V'``) fp32 and ``T`` solved in fp32, then rounded to bf16 as a matmul operand, as flash-linear-attention
does. ``"tf32x3"`` (GPU only, opt-in for fp32 inputs): the state pass's dots on tensor cores as three TF32
products (about fp32 accuracy); the chunk-local pass stays at HIGHEST.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dflash_jax.models.gdn import unit_lower_inverse
from pallas_kernels.registry import check_block_shapes, current_backend, first_fitting

HI = lax.Precision.HIGHEST
PRECISIONS = ("fp32", "tf32x3", "bf16")


def default_precision(dtype) -> str:
    """``"fp32"`` for fp32 (or wider) inputs, ``"bf16"`` for 16-bit ones."""
    return "fp32" if jnp.dtype(dtype).itemsize >= 4 else "bf16"


def launch_precision(dtype, backend: str) -> str:
    """The registered implementations' precision: ``"tf32x3"`` for fp32 inputs on NVIDIA (about fp32 accuracy on
    tensor cores: 2.4e-7 relative on the H200 at 8K tokens, where HIGHEST, IEEE fp32 in Triton, ran 13x slower),
    else :func:`default_precision`."""
    if backend == "cuda" and default_precision(dtype) == "fp32":
        return "tf32x3"
    return default_precision(dtype)


def _dot_dtype_and_precision(precision: str):
    """(operand dtype, ``lax`` precision) of the state pass's dots."""
    if precision == "bf16":
        return jnp.bfloat16, None  # bf16 x bf16 -> f32 accumulation
    if precision == "tf32x3":
        return jnp.float32, lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    if precision == "fp32":
        return jnp.float32, HI
    raise ValueError(f"gdn_chunked: precision={precision!r}; expected one of {PRECISIONS}")


def operand_dtype(precision: str):
    """The dtype the dots of ``precision`` read their operands in (the chunk-local outputs are stored in it)."""
    return _dot_dtype_and_precision(precision)[0]


# ------------------------------------------------------------------------------------------ pass 1: chunk-local

def chunk_local(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array, *, chunk: int,
                precision: str) -> dict:
    """The state-independent part of every chunk, all chunks at once (inputs padded to n whole chunks).

    q, k [B, n*C, H, dk]; v [B, n*C, H, dv]; beta, g [B, n*C, H]. Returns, with ``r = n*H*C`` rows per sequence
    in chunk-major, head, token order: ``w`` [B, r, dk] and ``u`` [B, r, dv] (dot operand dtype), ``p`` [B, r, C]
    (``(q k^T) * Gam``, operand dtype), ``gam`` [B, r] (fp32, the in-chunk cumulative log-decay).
    """
    b, tp, h, dk = q.shape
    dv = v.shape[-1]
    c, n = chunk, tp // chunk
    f32 = jnp.float32
    opd = operand_dtype(precision)
    prec = None if precision == "bf16" else HI  # tf32x3 too: this pass is parallel, not the bottleneck
    ein = functools.partial(jnp.einsum, precision=prec, preferred_element_type=f32)
    split = lambda a: a.reshape((b, n, c) + a.shape[2:])  # noqa: E731  [B, n, C, H, ...]
    q, k, v = (split(a).astype(opd) for a in (q, k, v))
    beta, g = (jnp.swapaxes(split(a).astype(f32), 2, 3) for a in (beta, g))  # [B, n, H, C]
    gam = jnp.cumsum(g, axis=-1)
    incl = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.where(incl, jnp.exp(jnp.where(incl, gam[..., :, None] - gam[..., None, :], 0.0)), 0.0)
    kk = ein("bnihd,bnjhd->bnhij", k, k)
    a = jnp.eye(c, dtype=f32) + jnp.where(jnp.tril(incl, -1), beta[..., :, None] * kk * decay, 0.0)
    t = unit_lower_inverse(a).astype(opd)  # (I + M)^-1 [B, n, H, C, C] (C is a power of two)
    kb = jnp.swapaxes(beta * jnp.exp(gam), 2, 3)[..., None] * k.astype(f32)  # beta e^gam k [B, n, C, H, dk]
    vb = jnp.swapaxes(beta, 2, 3)[..., None] * v.astype(f32)
    w = ein("bnhij,bnjhd->bnhid", t, kb.astype(opd))
    u = ein("bnhij,bnjhd->bnhid", t, vb.astype(opd))
    p = ein("bnihd,bnjhd->bnhij", q, k) * decay
    rows = n * h * c
    return dict(w=w.astype(opd).reshape(b, rows, dk), u=u.astype(opd).reshape(b, rows, dv),
                p=p.astype(opd).reshape(b, rows, c), gam=gam.reshape(b, rows))


# ------------------------------------------------------------------------------------------ pass 2: the state

def _state_kernel(q_ref, k_ref, w_ref, u_ref, p_ref, gam_ref, s_ref, o_ref, s_out_ref, *, chunk: int,
                  n_chunks: int, n_heads: int, precision: str):
    # q_ref, k_ref [Tp, dk] (token-major); w_ref [n*H*C, dk], u_ref [n*H*C, BV], p_ref [n*H*C, C], gam_ref [n*H*C]
    # (chunk-local pass layout); s_ref [dk, BV]; o_ref [Tp, BV]
    c = chunk
    h = pl.program_id(1)
    opd, prec = _dot_dtype_and_precision(precision)
    dot = functools.partial(plt.dot, precision=prec)
    last = (jnp.arange(c) == c - 1).astype(jnp.float32)

    def body(i, s):
        tok = pl.ds(i * c, c)
        loc = pl.ds((i * n_heads + h) * c, c)
        gam = gam_ref[loc]
        g_end = jnp.sum(gam * last)  # gam[C-1]
        s_op = s.astype(opd)
        vp = u_ref[loc, :].astype(jnp.float32) - dot(w_ref[loc, :].astype(opd), s_op)           # V' [C, BV]
        vp_op = vp.astype(opd)
        qg = (q_ref[tok, :].astype(jnp.float32) * jnp.exp(gam)[:, None]).astype(opd)
        o = dot(qg, s_op) + dot(p_ref[loc, :].astype(opd), vp_op)
        o_ref[tok, :] = o.astype(o_ref.dtype)
        kd = (k_ref[tok, :].astype(jnp.float32) * jnp.exp(g_end - gam)[:, None]).astype(opd)
        return s * jnp.exp(g_end) + dot(kd, vp_op, trans_a=True)

    s = lax.fori_loop(0, n_chunks, body, s_ref[...].astype(jnp.float32))
    s_out_ref[...] = s.astype(s_out_ref.dtype)


def default_config(dk: int, dv: int, *, dtype=jnp.float32, backend: str | None = None) -> dict:
    """chunk (tokens per step), block_v (state columns per program), num_warps, num_stages by backend: the
    largest of chunk 64 / 32 and 2 / 1 pipeline stages whose tiles fit the shared-memory budget."""
    b = backend or current_backend()
    isz = jnp.dtype(operand_dtype(default_precision(dtype))).itemsize
    block_v = min(dv, 32)
    stages = (1,) if b == "rocm" else (2, 1)
    return first_fitting(
        [dict(chunk=chunk, block_v=block_v, num_warps=4, num_stages=st) for chunk in (64, 32) for st in stages],
        lambda c: block_plan(dk=dk, dv=dv, chunk=c["chunk"], block_v=block_v, itemsize=isz,
                             num_stages=c["num_stages"], backend=b))


def block_plan(*, dk: int, dv: int, chunk: int, block_v: int, itemsize: int = 4, num_stages: int = 1,
               smem_budget: int | None = None, backend: str | None = None) -> dict:
    """Static tiles of a state-pass launch, checked with :func:`check_block_shapes` (raises ValueError).

    Shared memory is estimated as the per-chunk loads (q, k, W [C, dk], U [C, block_v], P [C, C] in the dot
    operand dtype of ``itemsize`` bytes), once per pipeline stage."""
    if dv % block_v:
        raise ValueError(f"gdn_chunked: dv={dv} is not a multiple of block_v={block_v}")
    loads = {"qkw": 3 * chunk * dk, "u": chunk * block_v, "p": chunk * chunk}
    total = check_block_shapes(
        "gdn_chunked",
        {"q": (chunk, dk), "u": (chunk, block_v), "state": (dk, block_v), "p": (chunk, chunk)},
        dots={"ws": (chunk, block_v, dk), "qs": (chunk, block_v, dk), "pv": (chunk, block_v, chunk),
              "state": (dk, block_v, chunk)},
        smem={name: n * itemsize * max(1, num_stages) for name, n in loads.items()},
        smem_budget=smem_budget, backend=backend)
    return dict(n_v_blocks=dv // block_v, smem_bytes=total)


@functools.partial(jax.jit, static_argnames=("chunk", "block_v", "num_warps", "num_stages", "precision",
                                             "interpret"))
def gdn_chunked(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array, state: jax.Array, *,
                chunk: int = 64, block_v: int = 32, num_warps: int = 4, num_stages: int = 1,
                precision: str | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Chunked gated delta rule (``dflash_jax.models.gdn.gdn_chunked``'s contract).

    q, k [B, T, H, dk]; v [B, T, H, dv]; beta, g [B, T, H]; state [B, H, dk, dv] (fp32). Returns
    (o [B, T, H, dv] in v's dtype, final state in state's dtype). T is padded to whole chunks with
    beta = g = 0, k = v = 0 tokens, which leave the state unchanged. ``precision``: see the module docstring
    (None: :func:`default_precision` of q's dtype).
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (b, t, h) or beta.shape != (b, t, h) or g.shape != (b, t, h) \
            or state.shape != (b, h, dk, dv):
        raise ValueError(f"gdn_chunked: q {q.shape}, k {k.shape}, v {v.shape}, beta {beta.shape}, g {g.shape}, "
                         f"state {state.shape} disagree")
    precision = precision or default_precision(q.dtype)
    opd = operand_dtype(precision)
    if precision == "tf32x3" and interpret:
        raise ValueError("gdn_chunked: precision='tf32x3' needs a GPU (XLA:CPU has no TF32 dot); use 'fp32'")
    plan = block_plan(dk=dk, dv=dv, chunk=chunk, block_v=block_v, itemsize=jnp.dtype(opd).itemsize,
                      num_stages=num_stages)
    n = -(-t // chunk)
    tp = n * chunk
    if tp != t:
        pad = lambda a: jnp.pad(a, [(0, 0), (0, tp - t)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        q, k, v, beta, g = map(pad, (q, k, v, beta, g))
    loc = chunk_local(q, k, v, beta, g, chunk=chunk, precision=precision)
    rows = n * h * chunk
    kernel = functools.partial(_state_kernel, chunk=chunk, n_chunks=n, n_heads=h, precision=precision)
    o, s = pl.pallas_call(
        kernel,
        grid=(b, h, plan["n_v_blocks"]),
        in_specs=[
            pl.BlockSpec((None, tp, None, dk), lambda i, j, c: (i, 0, j, 0)),          # q
            pl.BlockSpec((None, tp, None, dk), lambda i, j, c: (i, 0, j, 0)),          # k
            pl.BlockSpec((None, rows, dk), lambda i, j, c: (i, 0, 0)),                 # W
            pl.BlockSpec((None, rows, block_v), lambda i, j, c: (i, 0, c)),            # U columns
            pl.BlockSpec((None, rows, chunk), lambda i, j, c: (i, 0, 0)),              # P
            pl.BlockSpec((None, rows), lambda i, j, c: (i, 0)),                        # gam
            pl.BlockSpec((None, None, dk, block_v), lambda i, j, c: (i, j, 0, c)),     # state columns
        ],
        out_specs=[
            pl.BlockSpec((None, tp, None, block_v), lambda i, j, c: (i, 0, j, c)),
            pl.BlockSpec((None, None, dk, block_v), lambda i, j, c: (i, j, 0, c)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, tp, h, dv), v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"gdn_chunked_state_c{chunk}_dk{dk}_bv{block_v}_{precision}",
    )(q, k, loc["w"], loc["u"], loc["p"], loc["gam"], state)
    return o[:, :t], s


# ---------------------------------------------------------------------------------------------- single step

def _step_kernel(q_ref, k_ref, v_ref, beta_ref, g_ref, s_ref, o_ref, s_out_ref):
    # q_ref, k_ref [dk]; v_ref [BV]; beta_ref, g_ref [1]; s_ref [dk, BV]
    q = q_ref[...].astype(jnp.float32)
    k = k_ref[...].astype(jnp.float32)
    v = v_ref[...].astype(jnp.float32)
    beta = beta_ref[0].astype(jnp.float32)
    g = g_ref[0].astype(jnp.float32)
    s = s_ref[...].astype(jnp.float32) * jnp.exp(g)
    read = jnp.sum(s * k[:, None], axis=0)                       # S^T k  [BV]
    s = s + k[:, None] * (beta * (v - read))[None, :]
    o_ref[...] = jnp.sum(s * q[:, None], axis=0).astype(o_ref.dtype)
    s_out_ref[...] = s.astype(s_out_ref.dtype)


def step_block_plan(*, dk: int, dv: int, block_v: int) -> dict:
    """Static tiles of a single-step launch (no dots: elementwise products and reductions only)."""
    if dv % block_v:
        raise ValueError(f"gdn_step: dv={dv} is not a multiple of block_v={block_v}")
    check_block_shapes("gdn_step", {"q": (dk,), "v": (block_v,), "state": (dk, block_v)})
    return dict(n_v_blocks=dv // block_v)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "interpret"))
def gdn_step(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array, state: jax.Array, *,
             block_v: int = 32, num_warps: int = 4, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """One decode token (``dflash_jax.models.gdn.gdn_step``'s contract), the state read and written once.

    q, k [B, H, dk]; v [B, H, dv]; beta, g [B, H]; state [B, H, dk, dv] (fp32). Returns (o [B, H, dv] in v's
    dtype, new state in state's dtype). Grid (B, H, dv / block_v): the state's value columns are independent.
    """
    b, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:2] != (b, h) or beta.shape != (b, h) or g.shape != (b, h) \
            or state.shape != (b, h, dk, dv):
        raise ValueError(f"gdn_step: q {q.shape}, k {k.shape}, v {v.shape}, beta {beta.shape}, g {g.shape}, "
                         f"state {state.shape} disagree")
    plan = step_block_plan(dk=dk, dv=dv, block_v=block_v)
    o, s = pl.pallas_call(
        _step_kernel,
        grid=(b, h, plan["n_v_blocks"]),
        in_specs=[
            pl.BlockSpec((None, None, dk), lambda i, j, c: (i, j, 0)),
            pl.BlockSpec((None, None, dk), lambda i, j, c: (i, j, 0)),
            pl.BlockSpec((None, None, block_v), lambda i, j, c: (i, j, c)),
            pl.BlockSpec((None, None, 1), lambda i, j, c: (i, j, 0)),
            pl.BlockSpec((None, None, 1), lambda i, j, c: (i, j, 0)),
            pl.BlockSpec((None, None, dk, block_v), lambda i, j, c: (i, j, 0, c)),
        ],
        out_specs=[pl.BlockSpec((None, None, block_v), lambda i, j, c: (i, j, c)),
                   pl.BlockSpec((None, None, dk, block_v), lambda i, j, c: (i, j, 0, c))],
        out_shape=[jax.ShapeDtypeStruct((b, h, dv), v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"gdn_step_dk{dk}_bv{block_v}",
    )(q, k, v, beta[..., None], g[..., None], state)  # gates as free [B, H, 1] views: no stacking op
    return o, s
