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
value head's ``[dk, dv]`` state tile is read, updated and written once. The split form (``split``, the default up
to ``SPLIT_MAX_PROGRAMS`` programs) runs the key heads' q / k first (grid ``(B, n_k_heads)``, their conv rows
written), then a program per value head (grid ``(B, Hv)``): r times the programs, each one state tile. Rows whose slot is 0 (padding) read and
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
        row = _Row(parts, locs, w_ref, cs_ref, cs_out_ref, fresh_ref, valid_ref, i=i, slot=slot, kk=kk)
        states = [s_ref[slot, h] for h in heads]  # every tile's load first: r independent reads in flight
        q, k = row.qk(j, hk=hk, dk=dk)
        for h, st in zip(heads, states):
            row.value_head(h, q, k, st, alog_ref, dtb_ref, nw_ref, s_out_ref, y_ref, hk=hk, dk=dk, dv=dv, eps=eps)


def _qk_kernel(*refs, n_parts, locs, hk, dk, kk):
    """Split form, first kernel, grid ``(B, Hk)``: a key head's q / k (conv, SiLU, L2 norm) into ``qk_ref``
    ``[B, Hk, 2, dk]`` f32 and their new conv rows written in place."""
    parts = refs[:n_parts]
    w_ref, slot_ref, fresh_ref, valid_ref, cs_ref, qk_ref, cs_out_ref = refs[n_parts:]
    i = pl.program_id(0)
    j = pl.program_id(1)
    slot = slot_ref[i]

    @pl.when(slot == 0)
    def _():
        qk_ref[i, j] = jnp.zeros((2, dk), F32)

    @pl.when(slot > 0)
    def _():
        row = _Row(parts, locs, w_ref, cs_ref, cs_out_ref, fresh_ref, valid_ref, i=i, slot=slot, kk=kk)
        q, k = row.qk(j, hk=hk, dk=dk)
        qk_ref[i, j, 0] = q
        qk_ref[i, j, 1] = k


def _value_kernel(*refs, n_parts, locs, hk, dk, dv, r, kk, eps):
    """Split form, second kernel, grid ``(B, Hv)``: one value head's conv, gates, delta-rule step and gated norm
    from its key head's q / k (``qk_ref``); its v conv rows and state tile written in place."""
    parts = refs[:n_parts]
    (w_ref, alog_ref, dtb_ref, nw_ref, slot_ref, fresh_ref, valid_ref, qk_ref, cs_ref, s_ref, y_ref, cs_out_ref,
     s_out_ref) = refs[n_parts:]
    i = pl.program_id(0)
    h = pl.program_id(1)
    slot = slot_ref[i]

    @pl.when(slot == 0)
    def _():
        y_ref[i, h] = jnp.zeros((dv,), y_ref.dtype)

    @pl.when(slot > 0)
    def _():
        st = s_ref[slot, h]
        row = _Row(parts, locs, w_ref, cs_ref, cs_out_ref, fresh_ref, valid_ref, i=i, slot=slot, kk=kk)
        j = h // r
        row.value_head(h, qk_ref[i, j, 0], qk_ref[i, j, 1], st, alog_ref, dtb_ref, nw_ref, s_out_ref, y_ref,
                       hk=hk, dk=dk, dv=dv, eps=eps)


class _Row:
    """Row ``i`` (slot ``slot`` > 0) of a kernel: its in-projection segments, conv rows and flags."""

    def __init__(self, parts, locs, w_ref, cs_ref, cs_out_ref, fresh_ref, valid_ref, *, i, slot, kk):
        self.parts, self.locs, self.w_ref, self.cs_ref, self.cs_out_ref = parts, locs, w_ref, cs_ref, cs_out_ref
        self.i, self.slot, self.kk = i, slot, kk
        self.fresh = fresh_ref[i] != 0
        self.m = (valid_ref[i] != 0).astype(F32)

    def seg(self, name, idx):
        """Element(s) ``idx`` (an int or a ``pl.ds``, relative to the segment) of this row's segment ``name``."""
        part, base = self.locs[name]
        if isinstance(idx, pl.Slice):
            return self.parts[part][self.i, pl.ds(base + idx.start, idx.size)]
        return self.parts[part][self.i, base + idx]

    def conv(self, off, n):
        """Conv + SiLU of channels [off, off + n) (rounded to x's dtype, as the reference); their new rows are
        written in place."""
        kk, slot = self.kk, self.slot
        ch = pl.ds(off, n)
        x = self.seg("x", ch)
        rows = [jnp.where(self.fresh, jnp.zeros_like(x), self.cs_ref[slot, t, ch]) for t in range(kk - 1)]
        acc = x.astype(F32) * self.w_ref[ch, kk - 1].astype(F32)
        for t in range(kk - 1):
            acc = acc + rows[t].astype(F32) * self.w_ref[ch, t].astype(F32)
        c = _silu(acc).astype(x.dtype).astype(F32)
        for t in range(kk - 1):
            self.cs_out_ref[slot, t, ch] = jnp.where(self.m > 0, (rows + [x])[t + 1], rows[t])
        return c

    def qk(self, j, *, hk, dk):
        """Key head ``j``'s L2-normalised q (scaled by dk^-1/2) and k (zero on an invalid row)."""
        q = self.conv(j * dk, dk)
        k = self.conv(hk * dk + j * dk, dk)
        q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * (dk ** -0.5)
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6) * self.m
        return q, k

    def value_head(self, h, q, k, s, alog_ref, dtb_ref, nw_ref, s_out_ref, y_ref, *, hk, dk, dv, eps):
        """Value head ``h``: v conv, gates, the delta-rule step on state ``s`` [dk, dv], gated norm; the state
        and the output written."""
        m = self.m
        v = self.conv(2 * hk * dk + h * dv, dv) * m
        braw = self.seg("b", h).astype(F32)
        araw = self.seg("a", h).astype(F32)
        beta = m / (1.0 + jnp.exp(-braw))
        g = -jnp.exp(alog_ref[h].astype(F32)) * _softplus(araw + dtb_ref[h].astype(F32)) * m
        s = jnp.where(self.fresh, jnp.zeros_like(s), s.astype(F32)) * jnp.exp(g)
        read = jnp.sum(s * k[:, None], axis=0)                      # S^T k [dv]
        s = s + k[:, None] * (beta * (v - read))[None, :]
        o = jnp.sum(s * q[:, None], axis=0)                         # S^T q [dv]
        s_out_ref[self.slot, h] = s.astype(s_out_ref.dtype)
        z = self.seg("z", pl.ds(h * dv, dv)).astype(F32)
        ms = jnp.sum(o * o) / dv
        y_ref[self.i, h] = (o * jax.lax.rsqrt(ms + eps) * nw_ref[...].astype(F32) * _silu(z)).astype(y_ref.dtype)


def block_plan(*, dk: int, dv: int) -> None:
    """Static check of the tiles one program loads (the state tile ``[dk, dv]`` in registers)."""
    check_block_shapes("gdn_decode", {"q": (dk,), "v": (dv,), "state": (dk, dv)})


def default_num_warps(r: int) -> int:
    """Warps a program: its ``r`` state tiles of ``[dk, dv]`` fp32 are held at once (16 warps: 96 registers a thread
    for three 128 x 128 tiles)."""
    return 16 if r > 1 else 8


SPLIT_MAX_PROGRAMS = 256  # up to this many (row, key head) programs: the split form (measured up to B16 x 16)


def use_split(b: int, n_k_heads: int) -> bool:
    """Whether ``gdn_decode`` runs as two kernels by default. One program per (row, key head) walks its key head's
    value-head state tiles in turn (three 64 KiB tiles at the 27B); a program per value head runs them at once. On
    an H100 at the 27B's shapes (``gdn_decode_sweep``, device loops) the split form took 16.0 / 12.3 / 14.4 / 47.4 us
    at B 1 / 2 / 4 / 16, 1.21x / 1.81x / 2.04x / 1.52x the one-kernel form; larger batches are unmeasured and keep
    one kernel."""
    return b * n_k_heads <= SPLIT_MAX_PROGRAMS


@functools.partial(jax.jit, static_argnames=("n_k_heads", "eps", "num_warps", "split", "interpret"))
def gdn_decode(parts, conv_w, a_log, dt_bias, norm_w, conv_all, ssm_all, slots, fresh, valid, *, n_k_heads: int,
               eps: float, num_warps: int | None = None, split: bool | None = None, interpret: bool = False):
    """The fused decode step (module doc). parts: a tuple of [B, *] arrays, the in-projections' outputs, that
    concatenated along the last axis are the row ``[x | z | b | a]`` (C + Hv*dv + 2*Hv; each segment inside one part:
    one part for the fused ``"qkv+z+b+a"``, four for separate matrices); conv_w [C, K]; a_log, dt_bias [Hv]; norm_w
    [dv]; conv_all [S, K-1, C]; ssm_all [S, Hv, dk, dv]; slots [B] int32; fresh, valid [B]. Returns (y [B, Hv, dv]
    in the parts' dtype, conv_all, ssm_all), the state updated in place.

    ``split`` (default :func:`use_split`): two kernels instead of one: grid ``(B, Hk)`` for the key heads' q / k
    (their conv rows written), then grid ``(B, Hv)``, one program per value head's state tile (its v conv rows and
    state written). One kernel cannot give a key head's value heads programs of their own: the program that
    rewrites the key head's q / k conv rows would race the others reading them. ``num_warps`` applies to the
    fused kernel and the value-head kernel."""
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
    name = f"gdn_decode_hk{hk}_dk{dk}_dv{dv}"
    flags = (slots.astype(jnp.int32), fresh.astype(jnp.int32), valid.astype(jnp.int32))
    y_shape = jax.ShapeDtypeStruct((b, hv, dv), parts[0].dtype)
    conv_shape = jax.ShapeDtypeStruct(conv_all.shape, conv_all.dtype)
    ssm_shape = jax.ShapeDtypeStruct(ssm_all.shape, ssm_all.dtype)
    if not (use_split(b, hk) if split is None else split):
        kernel = functools.partial(_kernel, n_parts=len(parts), locs=locs, hk=hk, dk=dk, dv=dv, hv=hv, r=r, kk=kk,
                                   eps=eps)
        n_in = len(parts) + 9
        return tuple(pl.pallas_call(
            kernel, grid=(b, hk), out_shape=[y_shape, conv_shape, ssm_shape],
            input_output_aliases={n_in - 2: 1, n_in - 1: 2}, interpret=interpret,
            compiler_params=plt.CompilerParams(num_warps=num_warps or default_num_warps(r), num_stages=1), name=name,
        )(*parts, conv_w, a_log, dt_bias, norm_w, *flags, conv_all, ssm_all))
    n_in = len(parts) + 5
    qk, conv_all = pl.pallas_call(
        functools.partial(_qk_kernel, n_parts=len(parts), locs=locs, hk=hk, dk=dk, kk=kk),
        grid=(b, hk), out_shape=[jax.ShapeDtypeStruct((b, hk, 2, dk), F32), conv_shape],
        input_output_aliases={n_in - 1: 1}, interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1), name=name + "_qk",
    )(*parts, conv_w, *flags, conv_all)
    n_in = len(parts) + 10
    return tuple(pl.pallas_call(
        functools.partial(_value_kernel, n_parts=len(parts), locs=locs, hk=hk, dk=dk, dv=dv, r=r, kk=kk, eps=eps),
        grid=(b, hv), out_shape=[y_shape, conv_shape, ssm_shape],
        input_output_aliases={n_in - 2: 1, n_in - 1: 2}, interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps or default_num_warps(1), num_stages=1),
        name=name + "_v",
    )(*parts, conv_w, a_log, dt_bias, norm_w, *flags, qk, conv_all, ssm_all))
