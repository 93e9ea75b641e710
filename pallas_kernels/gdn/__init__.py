"""Gated delta rule kernels: ops ``"gdn_chunked"`` (prefill) and ``"gdn_step"`` (one decode token) in
:mod:`pallas_kernels.registry`.

Implementations (signature ``(q, k [B,T,H,dk], v [B,T,H,dv], beta, g [B,T,H], state [B,H,dk,dv] fp32, chunk)
-> (o [B,T,H,dv], state)``, as ``dflash_jax.models.qwen36.gdn_layer`` calls ``gdn.gdn_chunked``):

- ``"reference"``: pure jnp (``dflash_jax.models.gdn.gdn_chunked_reference``), any backend, the default everywhere;
- ``"pallas_triton"``: :func:`kernel.gdn_chunked`, a parallel chunk-local pass (XLA) then a sequential state
  pass (Pallas), dots at :func:`kernel.launch_precision` (the inputs' precision; fp32 inputs on NVIDIA as tf32x3,
  about fp32 accuracy on tensor cores, where Triton's IEEE fp32 dots ran 13x slower); its own chunk length from
  :func:`kernel.default_config` (the ``chunk`` argument is the reference's). Registered **opt-in** (not the GPU
  default) until it has been measured on a GPU: ``DFLASH_KERNELS=gdn_chunked=pallas_triton``. Interpret mode off GPU.

``"gdn_step"`` (signature ``(q, k [B,H,dk], v [B,H,dv], beta, g [B,H], state [B,H,dk,dv]) -> (o, state)``, as
``qwen36.gdn_layer`` calls ``gdn.gdn_step`` for decode): ``"reference"`` = ``gdn.gdn_step_reference``;
``"pallas_triton"`` = :func:`kernel.gdn_step` (the state read and written once), opt-in likewise.

``"gdn_tree"`` (signature ``(q, k [B,N,H,dk], v [B,N,H,dv], beta, g [B,N,H], state [B,H,dk,dv], ancestors [B,N,N],
slots=None) -> (o [B,N,H,dv], TreeGDNCache)``; with ``slots [B]`` state is the pool ``[S,H,dk,dv]``, read in place),
as ``qwen36.gdn_tree_gated_reference`` calls ``gdn.gdn_tree`` for verification):
``"reference"`` = ``gdn.gdn_tree_reference``; ``"pallas_triton"`` = :func:`tree.gdn_tree` (one program per
(sequence, head, value block), the ancestor-masked system solved in registers), **the GPU default, routed**: a
launch of more than ``TREE_MAX_PROGRAMS`` programs (one resident wave) runs the reference (see
:func:`gdn_tree_pallas`); ``"pallas_triton_every_batch"`` (opt-in) runs the kernel at every batch;
``"pallas_triton_<solve>"`` (opt-in, one per :data:`tree.SOLVES`) routes as the default with that solve;
``DFLASH_KERNELS=gdn_tree=reference`` turns it off. Trees over 64 slots or tiles that do not fit run the
reference, with a warning.

``"gdn_tree_gated"`` (signature ``(c [B,N,C], braw, araw [B,N,Hv], a_log, dt_bias [Hv], valid [B,N], state, ancestors,
slots=None, *, n_k_heads, groups) -> (o, TreeGDNCache)``, as ``qwen36.forward_tree`` calls ``qwen36.gdn_tree_gated``:
a GDN layer's tree delta rule from its post-conv rows): ``"reference"`` = ``qwen36.gdn_tree_gated_reference``
(``gdn_qkv_gates`` then the ``"gdn_tree"`` op, so on a GPU the tree kernel above); ``"pallas_triton"`` =
:func:`tree.gdn_tree_gated`, the tree kernel forming the L2-normalised q / k, the masked v and the gates from the
post-conv rows in registers (no q / k / v / gate arrays between the conv and the kernel), routed as
``gdn_tree`` (``"pallas_triton_<solve>"`` opt-in likewise), **the GPU default** (the 27B's B1 round 25.13 vs 25.74 ms through the unfused path, one H100, one
run: ``experiments/results/spec_nvidia-h100-80gb-hbm3_20261207-0638.json`` / ``-0637``).

``"gdn_tree_commit"`` (signature ``(ssm_all [S,Hv,dk,dv], slots [B], cache: TreeGDNCache, node [B]) -> ssm_all``, as
``qwen36.commit_tree`` calls ``gdn.tree_commit``: the accepted path's state written into each row's slot):
``"reference"`` = ``gdn.tree_commit_reference`` (gather, ``tree_node_state``, scatter); ``"pallas_triton"`` =
:func:`commit.gdn_tree_commit` (each state tile read, updated and written once, in place), **the GPU default**;
``DFLASH_KERNELS=gdn_tree_commit=reference`` turns it off.

``"gdn_decode"`` (signature ``(parts (the in-projection outputs, together [B, C+Hv*dv+2*Hv] = [x | z | b | a]), conv_w [C,K], a_log, dt_bias [Hv], norm_w
[dv], conv_all [S,K-1,C], ssm_all [S,Hv,dk,dv], slots, fresh, valid [B], *, n_k_heads, groups, eps) -> (y [B,Hv,dv],
conv_all, ssm_all)``, as ``qwen36.gdn_decode_layer`` calls ``qwen36.gdn_decode``: a GDN layer's whole decode token between its
projections, the slots' state updated in place): ``"reference"`` = ``qwen36.gdn_decode_reference``;
``"pallas_triton"`` = :func:`decode.gdn_decode` (one kernel a layer; two, a q / k kernel then a program per value
head, when a batch gives at most ``decode.SPLIT_MAX_PROGRAMS`` (row, key head) programs), **the GPU default**
(H200, 27B shapes, bf16: AR decode 1.05x at C1 and 1.34x at C16 over the reference path in one run,
``ar_nvidia-h200_20261203-2225*.json``); ``"pallas_triton_one_kernel"`` (opt-in) never splits;
``DFLASH_KERNELS=gdn_decode=reference`` turns it off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.gdn import commit as _commit
from pallas_kernels.gdn import decode as _decode
from pallas_kernels.gdn.kernel import (block_plan, chunk_local, default_config, default_precision, gdn_chunked,
                                      gdn_step, launch_precision, operand_dtype, step_block_plan)
from pallas_kernels.gdn.reference import (gdn_chunked_reference, gdn_decode_reference, gdn_step_reference,
                                          gdn_tree_commit_reference, gdn_tree_reference)
from pallas_kernels.gdn.tree import block_plan as tree_block_plan
from pallas_kernels.gdn.tree import default_config as tree_default_config
from pallas_kernels.gdn.tree import SOLVES, gdn_tree, gdn_tree_gated
from pallas_kernels.paged_decode.kernel import N_SM_TARGET


def tree_programs(batch: int, heads: int, dv: int, block_v: int) -> int:
    """Programs of a tree-kernel launch: one per (sequence, value head, value block)."""
    return batch * heads * -(-dv // block_v)


def gdn_chunked_pallas(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array, state: jax.Array,
                       chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The registered Pallas implementation (``chunk`` is ignored: the kernel's own tile is used). Shapes its
    tiles cannot take run the reference, with a warning."""
    del chunk
    backend = registry.current_backend()
    dk, dv = q.shape[-1], v.shape[-1]
    cfg = default_config(dk, dv, dtype=q.dtype, backend=backend)
    try:
        block_plan(dk=dk, dv=dv, chunk=cfg["chunk"], block_v=cfg["block_v"],
                   itemsize=jnp.dtype(operand_dtype(default_precision(q.dtype))).itemsize,
                   num_stages=cfg["num_stages"], backend=backend)
    except ValueError as e:
        registry.warn_fallback("gdn_chunked", e)
        return gdn_chunked_reference(q, k, v, beta, g, state)
    return gdn_chunked(q, k, v, beta, g, state, **cfg, precision=launch_precision(q.dtype, backend),
                       interpret=backend not in registry.GPU_BACKENDS)


def gdn_step_pallas(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array,
                    state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The registered single-step kernel; shapes its tiles cannot take run the reference, with a warning."""
    backend = registry.current_backend()
    dk, dv = q.shape[-1], v.shape[-1]
    block_v = default_config(dk, dv, backend=backend)["block_v"]
    try:
        step_block_plan(dk=dk, dv=dv, block_v=block_v)
    except ValueError as e:
        registry.warn_fallback("gdn_step", e)
        return gdn_step_reference(q, k, v, beta, g, state)
    return gdn_step(q, k, v, beta, g, state, block_v=block_v, interpret=backend not in registry.GPU_BACKENDS)


TREE_MAX_PROGRAMS = 2 * N_SM_TARGET  # one resident wave: the routed tree kernel's limit


def gdn_tree_pallas(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array, state: jax.Array,
                    ancestors: jax.Array, slots: jax.Array | None = None, *, every_batch: bool = False,
                    solve: str | None = None):
    """The registered tree kernel with :func:`tree.default_config` (``solve`` replaces its solve: the opt-in
    ``pallas_triton_<solve>`` implementations, for timing them against each other in a whole step); shapes its
    tiles cannot take (over 64 slots, head dims that are not powers of two >= 16, over the shared-memory budget)
    run the reference, with a warning.

    Unless ``every_batch``, a launch of more than :data:`TREE_MAX_PROGRAMS` programs (B x value heads x value
    blocks) runs the reference, by design: each program solves its tree serially (N - 1 substitution steps), so
    the kernel wins while one wave holds them all (the 27B at B1, 96 programs: the speculative round 28.6 ->
    27.5 ms and the oracle 242 -> 256 tok/s on an H100, ``spec_nvidia-h100-80gb-hbm3_20261206-1443/1444.json``)
    and loses past it (B16 x 32 nodes, 1536 programs: 0.22x the reference on the H200), where the reference's
    batched matmuls fill the GPU and its ~30 launches a layer no longer dominate."""
    reference = functools.partial(gdn_tree_reference, q, k, v, beta, g, state, ancestors, slots)
    cfg = _tree_launch("gdn_tree", q.shape[0], q.shape[1], v.shape[2], q.shape[-1], v.shape[-1], q.dtype,
                       every_batch=every_batch, solve=solve)
    if cfg is None:
        return reference()
    return gdn_tree(q, k, v, beta, g, state, ancestors, slots, **cfg)


def gdn_tree_gated_pallas(c, braw, araw, a_log, dt_bias, valid, state, ancestors, slots=None, *, n_k_heads: int,
                          groups: int = 1, solve: str | None = None):
    """The registered gated tree kernel (:func:`tree.gdn_tree_gated`), routed as :func:`gdn_tree_pallas` (past one
    resident wave the unfused path runs; ``solve`` as there); channel layouts other than the checkpoint's
    (``groups > 1``) and tiles that cannot be taken run the unfused path, with a warning."""
    args = (c, braw, araw, a_log, dt_bias, valid, state, ancestors, slots)
    dk, dv = state.shape[-2], state.shape[-1]

    def layout(cfg):
        if groups != 1:
            raise ValueError(f"gdn_tree_gated: the kernel reads the checkpoint's [q | k | v] channels; groups={groups}")
        if (2 * n_k_heads * dk) % cfg["block_v"]:
            raise ValueError(f"gdn_tree_gated: value channels at {2 * n_k_heads * dk}, block_v {cfg['block_v']}")

    cfg = _tree_launch("gdn_tree_gated", braw.shape[0], braw.shape[1], braw.shape[2], dk, dv, braw.dtype,
                       solve=solve, check=layout)
    if cfg is None:
        return _gated_reference(*args, n_k_heads=n_k_heads, groups=groups)
    return gdn_tree_gated(*args, n_k_heads=n_k_heads, **cfg)


def _tree_launch(op: str, b: int, n: int, h: int, dk: int, dv: int, dtype, *, every_batch: bool = False,
                 solve: str | None = None, check=None) -> dict | None:
    """The launch arguments of a routed tree kernel (:func:`tree.default_config`, ``solve`` replacing its solve,
    the launch precision, interpret mode off GPU), or None where the reference runs: past one resident wave
    unless ``every_batch`` (silently, by design), or a shape the tiles cannot take or ``check(cfg)`` refuses
    (with a warning)."""
    backend = registry.current_backend()
    cfg = tree_default_config(n, dk, dv, dtype=dtype, backend=backend)
    if solve is not None:
        cfg = {**cfg, "solve": solve}
    if not every_batch and tree_programs(b, h, dv, cfg["block_v"]) > TREE_MAX_PROGRAMS:
        return None
    try:
        if check is not None:
            check(cfg)
        tree_block_plan(n=n, dk=dk, dv=dv, block_v=cfg["block_v"],
                        itemsize=jnp.dtype(operand_dtype(default_precision(dtype))).itemsize, backend=backend)
    except ValueError as e:
        registry.warn_fallback(op, e)
        return None
    return dict(cfg, precision=launch_precision(dtype, backend), interpret=backend not in registry.GPU_BACKENDS)


def _gated_reference(*args, **kw):
    from dflash_jax.models.qwen36 import gdn_tree_gated_reference

    return gdn_tree_gated_reference(*args, **kw)


def gdn_tree_commit_pallas(ssm_all: jax.Array, slots: jax.Array, cache, node: jax.Array) -> jax.Array:
    """The registered commit kernel (:func:`commit.gdn_tree_commit`, :func:`commit.default_config`, the update dot at
    :func:`launch_precision`); trees its tiles cannot take run the reference, with a warning."""
    backend = registry.current_backend()
    n, dk, dv = cache.k.shape[2], cache.k.shape[3], cache.vp.shape[3]
    cfg = _commit.default_config(dv)
    try:
        _commit.block_plan(n=n, dk=dk, dv=dv, block_v=cfg["block_v"])
    except ValueError as e:
        registry.warn_fallback("gdn_tree_commit", e)
        return gdn_tree_commit_reference(ssm_all, slots, cache, node)
    return _commit.gdn_tree_commit(ssm_all, slots, cache.k, cache.vp, cache.gam, cache.decay, node, **cfg,
                                   precision=launch_precision(cache.vp.dtype, backend),
                                   interpret=backend not in registry.GPU_BACKENDS)


def gdn_decode_pallas(parts, conv_w, a_log, dt_bias, norm_w, conv_all, ssm_all, slots, fresh, valid, *,
                      n_k_heads: int, groups: int = 1, eps: float, split: bool | None = None):
    """The registered fused decode kernel (``split``: :func:`decode.gdn_decode`'s; None = by the batch); channel
    layouts other than the checkpoint's (``groups > 1``, tensor parallel) and head dims its tiles cannot take run
    the reference, with a warning."""
    backend = registry.current_backend()
    hv, dv = a_log.shape[0], norm_w.shape[0]
    dk = (conv_w.shape[0] - hv * dv) // (2 * n_k_heads)
    args = (parts, conv_w, a_log, dt_bias, norm_w, conv_all, ssm_all, slots, fresh, valid)
    try:
        if groups != 1:
            raise ValueError(f"gdn_decode: the kernel reads the checkpoint's [q | k | v] channels; groups={groups}")
        _decode.block_plan(dk=dk, dv=dv)
    except ValueError as e:
        registry.warn_fallback("gdn_decode", e)
        return gdn_decode_reference(*args, n_k_heads=n_k_heads, groups=groups, eps=eps)
    return _decode.gdn_decode(*args, n_k_heads=n_k_heads, eps=eps, split=split,
                              interpret=backend not in registry.GPU_BACKENDS)


registry.register("gdn_chunked", "reference", gdn_chunked_reference, backends=("any",))
registry.register("gdn_chunked", "pallas_triton", gdn_chunked_pallas, backends=("gpu",), preferred=False)
registry.register("gdn_step", "reference", gdn_step_reference, backends=("any",))
registry.register("gdn_step", "pallas_triton", gdn_step_pallas, backends=("gpu",), preferred=False)
registry.register("gdn_tree", "reference", gdn_tree_reference, backends=("any",))
registry.register("gdn_decode", "reference", gdn_decode_reference, backends=("any",))
registry.register("gdn_tree_commit", "reference", gdn_tree_commit_reference, backends=("any",))
registry.register("gdn_tree_gated", "reference", lambda *a, **kw: _gated_reference(*a, **kw), backends=("any",))
registry.register("gdn_tree_gated", "pallas_triton", gdn_tree_gated_pallas, backends=("gpu",))  # the GPU default
registry.register("gdn_tree_commit", "pallas_triton", gdn_tree_commit_pallas, backends=("gpu",))  # the GPU default
registry.register("gdn_decode", "pallas_triton", gdn_decode_pallas, backends=("gpu",))  # the GPU default
registry.register("gdn_decode", "pallas_triton_one_kernel", functools.partial(gdn_decode_pallas, split=False),
                  backends=("gpu",), preferred=False)
registry.register("gdn_tree", "pallas_triton", gdn_tree_pallas, backends=("gpu",))  # the GPU default, routed
registry.register("gdn_tree", "pallas_triton_every_batch", functools.partial(gdn_tree_pallas, every_batch=True),
                  backends=("gpu",), preferred=False)
for _solve in SOLVES:
    registry.register("gdn_tree", f"pallas_triton_{_solve}", functools.partial(gdn_tree_pallas, solve=_solve),
                      backends=("gpu",), preferred=False)
    registry.register("gdn_tree_gated", f"pallas_triton_{_solve}",
                      functools.partial(gdn_tree_gated_pallas, solve=_solve), backends=("gpu",), preferred=False)

__all__ = ["block_plan", "chunk_local", "default_config", "default_precision", "gdn_chunked", "gdn_chunked_pallas",
           "gdn_chunked_reference", "gdn_decode_pallas", "gdn_decode_reference", "gdn_step", "gdn_step_pallas",
           "gdn_step_reference", "gdn_tree", "gdn_tree_commit_pallas", "gdn_tree_commit_reference", "gdn_tree_gated",
           "gdn_tree_gated_pallas", "gdn_tree_pallas", "gdn_tree_reference", "launch_precision", "operand_dtype",
           "step_block_plan", "tree_block_plan", "tree_default_config", "tree_programs", "TREE_MAX_PROGRAMS"]
