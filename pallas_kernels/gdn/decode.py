"""Pallas (Triton lowering) kernel: one decode token of a Gated DeltaNet layer between its projections, fused.

``dflash_jax.models.qwen36.gdn_decode_reference``'s contract: from the in-projection row ``[x | z | b | a]`` (read in
place from the projections' outputs, one part when fused ``"qkv+z+b+a"``: no slice or concatenation of them is
materialised), the
depthwise causal conv + SiLU (the slot's last K-1 rows), L2-normalised q / k, ``beta = sigmoid(b)``,
``g = -exp(A_log) softplus(a + dt_bias)``, the delta-rule step on the slot's fp32 state, the gated RMSNorm of the
output, and the slot's new conv rows and state written back in place (``input_output_aliases``). In XLA this is
~15 kernels a layer (gathers, conv, norms, gates, the step, scatters), each a launch of a few microseconds on a
decode step that is otherwise weight streaming; here it is one.

Grid ``(B, n_k_heads)``: a program owns one row's key head ``j``: its q / k conv channels and the ``r = Hv / Hk``
value heads that read them (their v channels, states and outputs), so every byte of state it writes is its own
(value heads sharing a key head in one program: no other program reads the q / k conv rows it rewrites). Each
value head's ``[dk, dv]`` state tile is read, updated and written once. Rows whose slot is 0 (padding) read and
write no state (a decode bucket's padding would otherwise read the null slot's state once a row) and output zeros.
The checkpoint's channel layout ``[q | k | v]`` only (``groups == 1``); other layouts run the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dflash_jax.models.qwen36 import segment_locations
from pallas_kernels.registry import check_block_shapes

F32 = jnp.float32


def _silu(x):
    return x / (1.0 + jnp.exp(-x))


def _softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))


def _kernel(*refs, n_parts, locs, hk, dk, dv, hv, r, kk, eps):
    # refs: the in-projection parts (together the row [x | z | b | a]; ``locs[seg] = (part, offset)`` where each
    # segment starts), then conv_w, a_log, dt_bias, norm_w, slots, fresh, valid, conv_all, ssm_all, and the outputs
    # y, conv_all, ssm_all. cs_out_ref / s_out_ref alias cs_ref / s_ref (the same buffers): the old state is read
    # there, the new one written here.
    parts = refs[:n_parts]
    (w_ref, alog_ref, dtb_ref, nw_ref, slot_ref, fresh_ref, valid_ref, cs_ref, s_ref, y_ref, cs_out_ref,
     s_out_ref) = refs[n_parts:]

    i = pl.program_id(0)
    j = pl.program_id(1)
    slot = slot_ref[i]
    heads = [j * r + e for e in range(r)]  # the value heads of key head j

    @pl.when(slot == 0)
    def _():  # a padding row: no state read or written, zeros out
        for h in heads:
            y_ref[i, h] = jnp.zeros((dv,), y_ref.dtype)

    @pl.when(slot > 0)
    def _():
        _row(parts, locs, w_ref, alog_ref, dtb_ref, nw_ref, fresh_ref, valid_ref, cs_ref, s_ref, y_ref, cs_out_ref,
             s_out_ref, i=i, j=j, slot=slot, heads=heads, hk=hk, dk=dk, dv=dv, kk=kk, eps=eps)


def _row(parts, locs, w_ref, alog_ref, dtb_ref, nw_ref, fresh_ref, valid_ref, cs_ref, s_ref, y_ref, cs_out_ref,
         s_out_ref, *, i, j, slot, heads, hk, dk, dv, kk, eps):
    """Row ``i`` (slot ``slot`` > 0), key head ``j`` and its value heads ``heads``: the step, state written back."""

    def seg(name, idx):
        """Element(s) ``idx`` (an int or a ``pl.ds``, relative to the segment) of this row's segment ``name``."""
        part, base = locs[name]
        if isinstance(idx, pl.Slice):
            return parts[part][i, pl.ds(base + idx.start, idx.size)]
        return parts[part][i, base + idx]

    fresh = fresh_ref[i] != 0
    m = (valid_ref[i] != 0).astype(F32)
    key_dim = hk * dk
    # every state tile's load first: r independent 64 KiB reads in flight, not one after another
    states = [s_ref[slot, h] for h in heads]

    def conv(off, n):
        """Conv + SiLU of channels [off, off + n) (rounded to x's dtype, as the reference), and their new rows."""
        ch = pl.ds(off, n)
        x = seg("x", ch)
        rows = [jnp.where(fresh, jnp.zeros_like(x), cs_ref[slot, t, ch]) for t in range(kk - 1)]
        acc = x.astype(F32) * w_ref[ch, kk - 1].astype(F32)
        for t in range(kk - 1):
            acc = acc + rows[t].astype(F32) * w_ref[ch, t].astype(F32)
        c = _silu(acc).astype(x.dtype).astype(F32)
        new = [jnp.where(m > 0, (rows + [x])[t + 1], rows[t]) for t in range(kk - 1)]
        return c, new

    def store_rows(off, n, new):
        for t in range(kk - 1):
            cs_out_ref[slot, t, pl.ds(off, n)] = new[t]

    q, q_rows = conv(j * dk, dk)
    k, k_rows = conv(key_dim + j * dk, dk)
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * (dk ** -0.5)
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6) * m
    store_rows(j * dk, dk, q_rows)
    store_rows(key_dim + j * dk, dk, k_rows)
    nw = nw_ref[...].astype(F32)
    for h, s in zip(heads, states):
        v_off = 2 * key_dim + h * dv
        v, v_rows = conv(v_off, dv)
        v = v * m
        store_rows(v_off, dv, v_rows)
        braw = seg("b", h).astype(F32)
        araw = seg("a", h).astype(F32)
        beta = m / (1.0 + jnp.exp(-braw))
        g = -jnp.exp(alog_ref[h].astype(F32)) * _softplus(araw + dtb_ref[h].astype(F32)) * m
        s = jnp.where(fresh, jnp.zeros_like(s), s.astype(F32)) * jnp.exp(g)
        read = jnp.sum(s * k[:, None], axis=0)                      # S^T k [dv]
        s = s + k[:, None] * (beta * (v - read))[None, :]
        o = jnp.sum(s * q[:, None], axis=0)                         # S^T q [dv]
        s_out_ref[slot, h] = s.astype(s_out_ref.dtype)

        z = seg("z", pl.ds(h * dv, dv)).astype(F32)
        ms = jnp.sum(o * o) / dv
        y_ref[i, h] = (o * jax.lax.rsqrt(ms + eps) * nw * _silu(z)).astype(y_ref.dtype)


def block_plan(*, dk: int, dv: int) -> None:
    """Static check of the tiles one program loads (the state tile ``[dk, dv]`` in registers)."""
    check_block_shapes("gdn_decode", {"q": (dk,), "v": (dv,), "state": (dk, dv)})


def default_num_warps(r: int) -> int:
    """Warps a program: its ``r`` state tiles of ``[dk, dv]`` fp32 are held at once (16 warps: 96 registers a thread
    for three 128 x 128 tiles)."""
    return 16 if r > 1 else 8


@functools.partial(jax.jit, static_argnames=("n_k_heads", "eps", "num_warps", "interpret"))
def gdn_decode(parts, conv_w, a_log, dt_bias, norm_w, conv_all, ssm_all, slots, fresh, valid, *, n_k_heads: int,
               eps: float, num_warps: int | None = None, interpret: bool = False):
    """The fused decode step (module doc). parts: a tuple of [B, *] arrays, the in-projections' outputs, that
    concatenated along the last axis are the row ``[x | z | b | a]`` (C + Hv*dv + 2*Hv; each segment inside one part:
    one part for the fused ``"qkv+z+b+a"``, four for separate matrices); conv_w [C, K]; a_log, dt_bias [Hv]; norm_w
    [dv]; conv_all [S, K-1, C]; ssm_all [S, Hv, dk, dv]; slots [B] int32; fresh, valid [B]. Returns (y [B, Hv, dv]
    in the parts' dtype, conv_all, ssm_all), the state updated in place."""
    parts = tuple(parts)
    b = parts[0].shape[0]
    hv, dv = a_log.shape[0], norm_w.shape[0]
    hk = n_k_heads
    ch, kk = conv_w.shape
    key_dim = (ch - hv * dv) // 2
    dk = key_dim // hk if hk else 0
    if 2 * key_dim + hv * dv != ch or hk * dk != key_dim or hv % hk or ssm_all.shape[1:] != (hv, dk, dv) \
            or conv_all.shape[1:] != (kk - 1, ch) or any(x.shape[0] != b or x.ndim != 2 for x in parts):
        raise ValueError(f"gdn_decode: parts {[x.shape for x in parts]}, conv_w {conv_w.shape}, a_log {a_log.shape}, "
                         f"norm_w {norm_w.shape}, conv_all {conv_all.shape}, ssm_all {ssm_all.shape} disagree for "
                         f"{hk} key heads")
    locs = segment_locations(tuple(x.shape[1] for x in parts), {"x": ch, "z": hv * dv, "b": hv, "a": hv})
    block_plan(dk=dk, dv=dv)
    r = hv // hk
    kernel = functools.partial(_kernel, n_parts=len(parts), locs=locs, hk=hk, dk=dk, dv=dv, hv=hv, r=r, kk=kk,
                               eps=eps)
    n_in = len(parts) + 9
    y, conv_all, ssm_all = pl.pallas_call(
        kernel,
        grid=(b, hk),
        out_shape=[jax.ShapeDtypeStruct((b, hv, dv), parts[0].dtype),
                   jax.ShapeDtypeStruct(conv_all.shape, conv_all.dtype),
                   jax.ShapeDtypeStruct(ssm_all.shape, ssm_all.dtype)],
        input_output_aliases={n_in - 2: 1, n_in - 1: 2},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps or default_num_warps(r), num_stages=1),
        name=f"gdn_decode_hk{hk}_dk{dk}_dv{dv}",
    )(*parts, conv_w, a_log, dt_bias, norm_w, slots.astype(jnp.int32), fresh.astype(jnp.int32),
      valid.astype(jnp.int32), conv_all, ssm_all)
    return y, conv_all, ssm_all
