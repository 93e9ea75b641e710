"""Pallas (Triton lowering) kernel: the accepted path of a verified token tree committed into the slots' GDN state,
in place (``dflash_jax.models.gdn.tree_commit_reference``'s contract).

Row b's slot state becomes ``S = e^{gam_i} S0 + sum_j Gam_ij k_j V'_j^T`` for ``i = node[b]`` (the deepest accepted
slot), from the verify cache (``TreeGDNCache``: heads-first keys, pseudo-values, log-decays, ``Gam``) and the S0
the slot still holds. In XLA this is a gather of the slots' states, the rank-N einsum, the scale, a select and a
scatter back (five kernels a layer and the state moved three times: ~15 us a layer of a 27B B1 round on an H100);
here each ``[dk, block_v]`` tile of the state is read once, updated and written back where it is
(``input_output_aliases``).

Grid ``(B, H, dv / block_v)``; a program loads its row's ``[N, dk]`` keys, its ``[N, block_v]`` pseudo-value
columns and row ``i`` of ``Gam`` (zero off ``i``'s ancestors), and adds ``(k * Gam_i)^T V'`` by one dot over the
slots (padded to a power of two >= 16, the padding masked to zero on load). Rows whose slot is 0 (padding) or whose
node is < 0 (nothing accepted) read and write nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn.kernel import _dot_dtype_and_precision
from pallas_kernels.gdn.tree import MAX_SLOTS, padded_slots
from pallas_kernels.registry import check_block_shapes

F32 = jnp.float32


def _commit_kernel(slot_ref, node_ref, k_ref, vp_ref, gam_ref, decay_ref, s_ref, s_out_ref, *, n: int,
                   block_v: int, precision: str):
    # slot_ref, node_ref [B]; this program's blocks: k_ref [Np, dk], vp_ref [Np, BV], gam_ref [Np], decay_ref
    # [Np, Np] (Np >= n slots: those past n are masked on load); s_ref / s_out_ref [S, H, dk, dv] whole, the same
    # buffer (aliased): the old tile is read there, the new one written here.
    i = pl.program_id(0)
    h = pl.program_id(1)
    cols = pl.ds(pl.program_id(2) * block_v, block_v)
    slot = slot_ref[i]
    node = node_ref[i]

    @pl.when((slot > 0) & (node >= 0))
    def _():
        opd, prec = _dot_dtype_and_precision(precision)
        n_pad = k_ref.shape[0]
        valid = lax.broadcasted_iota(jnp.int32, (n_pad,), 0) < n
        k = plt.load(k_ref, mask=valid[:, None], other=0).astype(F32)  # [Np, dk]
        vp = plt.load(vp_ref, mask=valid[:, None], other=0).astype(F32)  # [Np, BV]
        row = plt.load(decay_ref.at[node], mask=valid, other=0).astype(F32)  # Gam_i [Np], zero off i's ancestors
        s = s_ref[slot, h, :, cols].astype(F32)  # [dk, BV]
        kr = (k * row[:, None]).astype(opd)
        upd = plt.dot(kr, vp.astype(opd), trans_a=True, precision=prec)  # [dk, BV]
        s_out_ref[slot, h, :, cols] = (s * jnp.exp(gam_ref[node].astype(F32)) + upd).astype(s_out_ref.dtype)


def block_plan(*, n: int, dk: int, dv: int, block_v: int) -> dict:
    """Static tiles of a commit launch (raises ValueError when they cannot be taken)."""
    if n > MAX_SLOTS:
        raise ValueError(f"gdn_tree_commit: {n} tree slots > {MAX_SLOTS}")
    if dv % block_v:
        raise ValueError(f"gdn_tree_commit: dv={dv} is not a multiple of block_v={block_v}")
    np_ = padded_slots(n)
    check_block_shapes("gdn_tree_commit", {"k": (np_, dk), "vp": (np_, block_v), "state": (dk, block_v)},
                       dots={"update": (dk, block_v, np_)})
    return dict(n_pad=np_, n_v_blocks=dv // block_v)


def default_config(dv: int) -> dict:
    """block_v, num_warps: 64 value columns a program, 8 warps (the 27B at B1: 48 heads x 2 = 96 programs, each
    moving a 32 KiB tile each way). From the H100 sweep ``bench kernels --ops gdn_tree_commit`` (dk = dv = 128,
    ``kernels_nvidia-h100-80gb-hbm3_20261207-0939.json``): B1 x 23 slots 13.8 us, B16 x 32 slots 144 us, against
    15.9 / 172 us for the earlier 32 columns x 4 warps; the best at B1 alone, 64 x 4, was 168 us at B16."""
    return dict(block_v=min(dv, 64), num_warps=8)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "precision", "interpret"))
def gdn_tree_commit(ssm_all: jax.Array, slots: jax.Array, k: jax.Array, vp: jax.Array, gam: jax.Array,
                    decay: jax.Array, node: jax.Array, *, block_v: int = 32, num_warps: int = 4,
                    precision: str = "fp32", interpret: bool = False) -> jax.Array:
    """The commit (module doc). ssm_all [S, H, dk, dv]; slots, node [B] int; k [B, H, N, dk]; vp [B, H, N, dv];
    gam [B, H, N]; decay [B, H, N, N] (``TreeGDNCache``'s fields). ``precision``: the update dot's, ``"fp32"``
    (HIGHEST) or ``"tf32x3"`` (NVIDIA: about fp32 accuracy on tensor cores). Returns ssm_all, updated in place."""
    b, h, n, dk = k.shape
    dv = vp.shape[-1]
    if ssm_all.shape[1:] != (h, dk, dv) or vp.shape != (b, h, n, dv) or gam.shape != (b, h, n) \
            or decay.shape != (b, h, n, n) or slots.shape != (b,) or node.shape != (b,):
        raise ValueError(f"gdn_tree_commit: ssm_all {ssm_all.shape}, slots {slots.shape}, k {k.shape}, vp {vp.shape}, "
                         f"gam {gam.shape}, decay {decay.shape}, node {node.shape} disagree")
    if precision == "tf32x3" and interpret:
        raise ValueError("gdn_tree_commit: precision='tf32x3' needs a GPU (XLA:CPU has no TF32 dot); use 'fp32'")
    plan = block_plan(n=n, dk=dk, dv=dv, block_v=block_v)
    np_ = plan["n_pad"]
    kernel = functools.partial(_commit_kernel, n=n, block_v=block_v, precision=precision)
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel, grid=(b, h, plan["n_v_blocks"]),
        in_specs=[whole, whole,
                  pl.BlockSpec((None, None, np_, dk), lambda i, j, c: (i, j, 0, 0)),         # k
                  pl.BlockSpec((None, None, np_, block_v), lambda i, j, c: (i, j, 0, c)),    # V' columns
                  pl.BlockSpec((None, None, np_), lambda i, j, c: (i, j, 0)),                # gam
                  pl.BlockSpec((None, None, np_, np_), lambda i, j, c: (i, j, 0, 0)),        # Gam
                  whole],
        out_specs=whole, out_shape=jax.ShapeDtypeStruct(ssm_all.shape, ssm_all.dtype),
        input_output_aliases={6: 0}, interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"gdn_tree_commit_n{np_}_dk{dk}_bv{block_v}_{precision}",
    )(slots.astype(jnp.int32), node.astype(jnp.int32), k, vp, gam, decay, ssm_all)
