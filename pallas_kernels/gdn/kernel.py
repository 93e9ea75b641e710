"""Pallas (Triton lowering) kernel for the chunked gated delta rule (prefill), fp32 state.

Same math as ``dflash_jax.models.gdn._chunk`` (WY form), per chunk of C tokens:
``gam = cumsum(g)``, ``Gam_ij = exp(gam_i - gam_j)`` (j <= i), ``M = strict_lower(beta_i (k_i . k_j) Gam_ij)``,
``T = (I + M)^-1``, ``U = T (beta v)``, ``W = T (beta e^gam k)``, ``V' = U - W S``,
``o = (q e^gam) S + ((q k^T) * Gam) V'``, ``S <- e^{gam_C} S + (k e^{gam_C - gam})^T V'``.

The value columns of the state are independent (every product above is linear in v and S column by
column), so the grid is ``(B, H, dv / block_v)``: a program carries its ``[dk, block_v]`` slice of the
state in registers through all chunks of its (sequence, head) and writes it once at the end. The
unit-lower-triangular inverse is a product of log2(C) factors, ``(I + M)^-1 = prod_i (I + (-M)^(2^i))``
(exact: M is nilpotent, M^C = 0), so every step is a ``dot`` (no row-by-row substitution, which
Triton cannot index). All dots are f32 (IEEE precision on GPU), like the reference's HIGHEST.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.registry import check_block_shapes, current_backend

HI = lax.Precision.HIGHEST


def _kernel(q_ref, k_ref, v_ref, beta_ref, g_ref, s_ref, o_ref, s_out_ref, *, chunk: int, n_chunks: int):
    # q_ref, k_ref [Tp, dk]; v_ref [Tp, BV]; beta_ref, g_ref [Tp]; s_ref [dk, BV]; o_ref [Tp, BV]
    c = chunk
    rows = jnp.arange(c)[:, None]
    cols = jnp.arange(c)[None, :]
    incl = rows >= cols
    strict = rows > cols
    eye = (rows == cols).astype(jnp.float32)
    dot = functools.partial(plt.dot, precision=HI)

    def body(i, s):
        sl = pl.ds(i * c, c)
        q = q_ref[sl, :].astype(jnp.float32)
        k = k_ref[sl, :].astype(jnp.float32)
        v = v_ref[sl, :].astype(jnp.float32)
        beta = beta_ref[sl].astype(jnp.float32)
        g = g_ref[sl].astype(jnp.float32)
        gam = jnp.cumsum(g)
        g_end = jnp.sum(g)  # gam[C-1]
        decay = jnp.where(incl, jnp.exp(jnp.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
        m = jnp.where(strict, beta[:, None] * dot(k, k, trans_b=True) * decay, 0.0)
        n = -m
        t = eye + n
        p = n
        for _ in range(max(0, (c - 1).bit_length() - 1)):  # T = (I + N)(I + N^2)(I + N^4)...
            p = dot(p, p)
            t = t + dot(t, p)
        u = dot(t, beta[:, None] * v)                                   # [C, BV]
        w = dot(t, (beta * jnp.exp(gam))[:, None] * k)                  # [C, dk]
        vp = u - dot(w, s)                                              # [C, BV]
        qk = dot(q, k, trans_b=True) * decay
        o = dot(q * jnp.exp(gam)[:, None], s) + dot(qk, vp)
        o_ref[sl, :] = o.astype(o_ref.dtype)
        return s * jnp.exp(g_end) + dot(k * jnp.exp(g_end - gam)[:, None], vp, trans_a=True)

    s = lax.fori_loop(0, n_chunks, body, s_ref[...].astype(jnp.float32))
    s_out_ref[...] = s.astype(s_out_ref.dtype)


def default_config(dk: int, dv: int, *, backend: str | None = None) -> dict:
    """chunk (tokens per step), block_v (state columns per program), num_warps, num_stages by backend."""
    b = backend or current_backend()
    return dict(chunk=32, block_v=min(dv, 32), num_warps=4, num_stages=1 if b == "rocm" else 2)


def block_plan(*, dk: int, dv: int, chunk: int, block_v: int, smem_budget: int | None = None,
               backend: str | None = None) -> dict:
    """Static tiles of a launch, checked with :func:`check_block_shapes` (raises ValueError)."""
    if dv % block_v:
        raise ValueError(f"gdn_chunked: dv={dv} is not a multiple of block_v={block_v}")
    f = 4
    smem = {"qk": 2 * chunk * dk * f, "v": chunk * block_v * f, "cc": 2 * chunk * chunk * f}
    total = check_block_shapes(
        "gdn_chunked",
        {"q": (chunk, dk), "v": (chunk, block_v), "state": (dk, block_v), "cc": (chunk, chunk)},
        dots={"kk": (chunk, chunk, dk), "tt": (chunk, chunk, chunk), "u": (chunk, block_v, chunk),
              "w": (chunk, dk, chunk), "ws": (chunk, block_v, dk), "state": (dk, block_v, chunk)},
        smem=smem, smem_budget=smem_budget, backend=backend)
    return dict(n_v_blocks=dv // block_v, smem_bytes=total)


@functools.partial(jax.jit, static_argnames=("chunk", "block_v", "num_warps", "num_stages", "interpret"))
def gdn_chunked(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array, state: jax.Array, *,
                chunk: int = 32, block_v: int = 32, num_warps: int = 4, num_stages: int = 2,
                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Chunked gated delta rule (``dflash_jax.models.gdn.gdn_chunked``'s contract).

    q, k [B, T, H, dk]; v [B, T, H, dv]; beta, g [B, T, H]; state [B, H, dk, dv] (fp32). Returns
    (o [B, T, H, dv] in v's dtype, final state in state's dtype). T is padded to whole chunks with
    beta = g = 0, k = v = 0 tokens, which leave the state unchanged.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (b, t, h) or beta.shape != (b, t, h) or g.shape != (b, t, h) \
            or state.shape != (b, h, dk, dv):
        raise ValueError(f"gdn_chunked: q {q.shape}, k {k.shape}, v {v.shape}, beta {beta.shape}, g {g.shape}, "
                         f"state {state.shape} disagree")
    plan = block_plan(dk=dk, dv=dv, chunk=chunk, block_v=block_v)
    n = -(-t // chunk)
    tp = n * chunk
    if tp != t:
        pad = lambda a: jnp.pad(a, [(0, 0), (0, tp - t)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        q, k, v, beta, g = map(pad, (q, k, v, beta, g))
    kernel = functools.partial(_kernel, chunk=chunk, n_chunks=n)
    o, s = pl.pallas_call(
        kernel,
        grid=(b, h, plan["n_v_blocks"]),
        in_specs=[
            pl.BlockSpec((None, tp, None, dk), lambda i, j, c: (i, 0, j, 0)),          # q
            pl.BlockSpec((None, tp, None, dk), lambda i, j, c: (i, 0, j, 0)),          # k
            pl.BlockSpec((None, tp, None, block_v), lambda i, j, c: (i, 0, j, c)),     # v columns
            pl.BlockSpec((None, tp, None), lambda i, j, c: (i, 0, j)),                 # beta
            pl.BlockSpec((None, tp, None), lambda i, j, c: (i, 0, j)),                 # g
            pl.BlockSpec((None, None, dk, block_v), lambda i, j, c: (i, j, 0, c)),     # state columns
        ],
        out_specs=[
            pl.BlockSpec((None, tp, None, block_v), lambda i, j, c: (i, 0, j, c)),
            pl.BlockSpec((None, None, dk, block_v), lambda i, j, c: (i, j, 0, c)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, tp, h, dv), v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"gdn_chunked_c{chunk}_dk{dk}_bv{block_v}",
    )(q, k, v, beta, g, state)
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
