"""``python -m dflash_jax.bench kernels --out FILE.json``: the Pallas kernels against their references on this device.

For every kernel op (``tree_attention``, ``paged_decode``, ``gdn_chunked``, ``gdn_step``, ``gdn_tree``,
``gdn_tree_commit``):

1. **Check** (before any timing): the registered Pallas implementation (compiled for this device; interpret
   mode off GPU) and the XLA reference against an f32 oracle (the reference at HIGHEST matmul precision on
   the same rounded inputs), over shapes that include the 27B head shapes, ragged lengths, page boundaries,
   non-resident pages (table entry -1), one-node and full trees, and one / several KV partitions.
   ``<op>.check.max_rel_err`` (max |out - oracle| / max(1, max |oracle|)) and ``<op>.check.ok`` are figures;
   a mismatch prints ``MISMATCH`` and makes the command exit 1 (after writing the file), and the op is not timed.
2. **Timing** over a grid (batch x prefix [x tree size]; for GDN batch x tokens) at the model's head shapes
   (attention bf16, GDN fp32 as the model feeds it): each implementation runs ``steps`` times inside one
   jitted ``lax.scan`` over page-table sets of disjoint pages (so the KV does not sit in L2), one small input
   perturbed by the loop carry (so nothing is hoisted out of the loop); time per call = median over repeats /
   steps. Figures per case ``<op>.b{B}[.t{N}].p{P}.{kernel_us,reference_us,speedup,bytes_per_s,
   bandwidth_fraction}``, where bytes are the unique bytes a call must move (KV of the prefix, tree K/V, q,
   out; for GDN q, k, v, o, gates and the state in and out) and the fraction is of the device copy bandwidth
   measured in the same run (``device.copy_bytes_per_s``: ``y = x * 2`` over 1 GiB, read + write).
   ``gdn_tree`` (the tree-form delta rule of verification) is timed over batch x tree slots at the GDN head
   shapes (``gdn_tree.b{B}.t{N}.{kernel_us,reference_us,speedup,...}``; bytes: q, k, v, o, gates, the ancestor
   mask, the state in, and the cache's V', gam and Gam out). ``gdn_tree_commit`` (the accepted node's state
   written into each row's slot, in place) likewise (``gdn_tree_commit.b{B}.t{N}.*``; bytes: the rows' states in
   and out, the cache's keys, V' and the node's Gam row); its pool of slot states is carried through the timing
   loop, so neither a copy of it nor a read of all of it is charged to the call.
   Each tree-attention case also times the paged decode kernel over the same prefix pages (one query token a
   sequence): ``tree_attention.b{B}.t{N}.p{P}.{paged_decode_us,vs_paged_decode}`` (the tree kernel's time over
   paged decode's for the same prefix bytes; the issue's bound is 1.5).
3. Summaries for the targets: ``paged_decode.bandwidth_fraction`` (median over prefixes >= 8K),
   ``tree_attention.b{B}.speedup`` (minimum over trees 16-32 and prefixes 2K-16K at that batch),
   ``tree_attention.vs_paged_decode_max`` (maximum over the same region and every batch);
   ``tree_attention.summary_prefix_min`` / ``_max``: the prefixes of that region this run timed (``--quick``: 4K).

4. **Quantized KV pages** (``--kv-dtypes fp8 int8``, default ``fp8``; ``--kv-dtypes`` alone: none) for
   ``paged_decode`` and ``tree_attention``: the registered kernel on ``QuantizedPages`` (the same pages
   quantized, bf16 compute) checked against the reference on the same ``QuantizedPages``
   (``kv_<dt>.<op>.check.rel_err`` / ``.ok``; ``kv_<dt>.<op>.quant_rel_err`` is the reference's error from
   quantizing, against the f32 oracle on the unquantized pages), then timed against the bf16-page kernel at the
   same shape (``KV_GRIDS``): ``<op>.kv_<dt>.b{B}[.t{N}].p{P}.{kernel_us,bf16_kernel_us,speedup,bytes_per_s,
   bandwidth_fraction}`` (speedup = bf16 pages / quantized pages, the issue's figure) plus ``kernel_<cfg>_us`` /
   ``speedup_<cfg>`` for the other launch configs of ``KV_CONFIGS``, to tune the default from, and the minimum over the
   cases ``kv_<dt>.<op>.speedup`` (e.g. ``kv_fp8.tree_attention.speedup``).

5. **Sweep** (``<op>.sweep.<case>.<config>.{kernel_us,bandwidth_fraction,rel_err}``, ``<op>.sweep.<case>.best_us``):
   launch configs of each kernel (block sizes, warps, pipeline stages, hand prefetch, programs per launch) at
   the target cases (``SWEEP``), to tune the per-device ``default_config`` from; the best is printed.
   ``--batches/--trees/--prefixes`` sweep their product instead, each case with the configs ``SWEEP`` lists for
   its tree size.

A kernel that fails to lower or run is recorded (``<op>.ok = 0``, the error text under ``extra.errors``) and
the others continue. Order: all checks, then the grids (tree attention first), the quantized-KV cases, then the
sweeps; no new timing starts after ``--budget-s`` seconds (default 240; what was left out is listed in
``extra.skipped``), so the whole command stays under 5 minutes on a GPU (``--quick``: about a minute).
"""

from __future__ import annotations

import argparse
import functools
import dataclasses
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax.bench import results
from dflash_jax.bench.timing import median_seconds
from dflash_jax.kv import quant as kv_quant

OPS = ("tree_attention", "paged_decode", "gdn_chunked", "gdn_step", "gdn_tree", "gdn_tree_commit")  # timing order: the first target first
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="result JSON path (default: <out-dir>/kernels_<device>_<time>.json)")
    p.add_argument("--quick", action="store_true", help="fewer check cases and a small grid (~1 minute on a GPU)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--batches", type=int, nargs="+", default=None, help="override GRIDS' batches (every op)")
    p.add_argument("--prefixes", type=int, nargs="+", default=None,
                   help="override GRIDS' committed tokens per sequence (GDN: tokens per sequence)")
    p.add_argument("--trees", type=int, nargs="+", default=None, help="override GRIDS' tree slots")
    p.add_argument("--max-tokens", type=int, default=1 << 19,
                   help="skip grid cases with batch x prefix above this (the XLA reference gathers every page)")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--gdn-heads", type=int, default=48, help="GDN value heads (the keys are expanded to them)")
    p.add_argument("--gdn-dim", type=int, default=128, help="GDN key and value head dim")
    p.add_argument("--gdn-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of the GDN chunked / tree q, k, v in the timing grid and sweep (the model feeds fp32; "
                        "bfloat16 times the bf16-operand path; gates and state stay fp32)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--check-dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=240.0, help="start no new timing after this many seconds")
    p.add_argument("--no-sweep", action="store_true", help="skip the kernel-config sweep after the grid")
    p.add_argument("--no-grid", action="store_true",
                   help="skip the timing grids (checks, quantized-KV cases and sweeps still run)")
    p.add_argument("--kv-dtypes", nargs="*", default=["fp8"], choices=("fp8", "int8"),
                   help="quantized KV page formats to check and time against bf16 pages (none: skip)")
    p.add_argument("--copy-bytes", type=int, default=1 << 30, help="array size of the copy-bandwidth measurement")


# ------------------------------------------------------------------------------------------ problems

@dataclasses.dataclass
class Problem:
    """One call's arguments, page-table sets for timing (args[3] is replaced by one per step), the index of a
    small float argument that the timing loop perturbs with its carry, and the bytes a call must move."""

    args: tuple
    tables: jax.Array | None  # [n_sets, B, W] page tables over disjoint pages, or None
    perturb: int
    nbytes: int
    carry: int | None = None  # an argument the op updates in place and returns (carried through the timing loop)


def _pages(key, n_pages, ps, hkv, d, dtype):
    k1, k2 = jax.random.split(key)
    return (jax.random.normal(k1, (n_pages, ps, hkv, d), jnp.float32).astype(dtype),
            jax.random.normal(k2, (n_pages, ps, hkv, d), jnp.float32).astype(dtype))


def _tables(rng, n_sets, b, width, lengths, ps, non_resident=()):
    """[n_sets, B, W] tables over disjoint real pages; 0 past each prefix's last page; (row, page) -> -1."""
    n_pages = 1 + n_sets * b * width
    pt = rng.permutation(np.arange(1, n_pages)).reshape(n_sets, b, width).astype(np.int32)
    used = -(-np.asarray(lengths) // ps)
    pt = np.where(np.arange(width)[None, None, :] < used[None, :, None], pt, 0).astype(np.int32)
    for r, p in non_resident:
        pt[:, r, p] = -1
    return n_pages, jnp.asarray(pt)


def _tree_parents(rng, b, n):
    """Best-first-like trees: every slot hangs below a random earlier slot, biased to the chain."""
    par = np.full((b, n), -1, np.int32)
    for i in range(1, n):
        par[:, i] = np.where(rng.random(b) < 0.6, i - 1, rng.integers(0, i, b))
    return par


def decode_problem(rng, key, b, h, hkv, d, ps, lengths, dtype, n_sets=1, non_resident=()) -> Problem:
    lengths = np.asarray(lengths, np.int32)
    width = max(1, int(-(-lengths.max() // ps)))
    n_pages, pts = _tables(rng, n_sets, b, width, lengths, ps, non_resident)
    kq, kp = jax.random.split(key)
    k, v = _pages(kp, n_pages, ps, hkv, d, dtype)
    q = jax.random.normal(kq, (b, h, d), jnp.float32).astype(dtype)
    isz = jnp.dtype(dtype).itemsize
    nbytes = int(lengths.sum()) * hkv * d * 2 * isz + 2 * b * h * d * isz
    return Problem((q, k, v, pts[0], jnp.asarray(lengths), d ** -0.5), pts, 0, nbytes)


def prefix_decode_problem(prob: Problem) -> Problem:
    """The paged decode call over a tree problem's prefix pages: each sequence's first tree query, the same pages,
    page tables and prefix lengths (the bytes of the prefix K/V, q and out)."""
    q, k, v, pt, starts, *_, scale = prob.args
    q1 = q[:, 0]
    kd = k.data if isinstance(k, kv_quant.QuantizedPages) else k
    hkv, d = kd.shape[2], kd.shape[3]
    isz = jnp.dtype(kd.dtype).itemsize
    nbytes = int(np.asarray(starts).sum()) * hkv * d * 2 * isz + 2 * q1.size * jnp.dtype(q1.dtype).itemsize
    return Problem((q1, k, v, pt, starts, scale), prob.tables, 0, nbytes)


def tree_problem(rng, key, b, n, h, hkv, d, ps, starts, dtype, n_sets=1, non_resident=()) -> Problem:
    from dflash_jax.models import tree_ops

    starts = np.asarray(starts, np.int32)
    width = max(1, int(-(-starts.max() // ps)))
    n_pages, pts = _tables(rng, n_sets, b, width, starts, ps, non_resident)
    kq, kp, kt = jax.random.split(key, 3)
    k, v = _pages(kp, n_pages, ps, hkv, d, dtype)
    q = jax.random.normal(kq, (b, n, h, d), jnp.float32).astype(dtype)
    k1, k2 = jax.random.split(kt)
    k_tree = jax.random.normal(k1, (b, n, hkv, d), jnp.float32).astype(dtype)
    v_tree = jax.random.normal(k2, (b, n, hkv, d), jnp.float32).astype(dtype)
    anc = tree_ops.tree_ancestors(jnp.asarray(_tree_parents(rng, b, n)))
    isz = jnp.dtype(dtype).itemsize
    nbytes = (int(starts.sum()) + b * n) * hkv * d * 2 * isz + 2 * b * n * h * d * isz
    return Problem((q, k, v, pts[0], jnp.asarray(starts), k_tree, v_tree, anc, d ** -0.5), pts, 0, nbytes)


def gdn_problem(key, b, t, h, dk, dv, n_pad=0, dtype=jnp.float32) -> Problem:
    """Model-like inputs: L2-normalised q/k, beta in (0,1), g <= 0; the last n_pad tokens are padding. q, k, v in
    ``dtype``; gates and state fp32."""
    from dflash_jax.models import gdn

    ks = jax.random.split(key, 6)
    m = (jnp.arange(t) < t - n_pad).astype(jnp.float32)[None, :, None]
    q = gdn.l2norm(jax.random.normal(ks[0], (b, t, h, dk))) * dk ** -0.5
    k = gdn.l2norm(jax.random.normal(ks[1], (b, t, h, dk))) * m[..., None]
    v = jax.random.normal(ks[2], (b, t, h, dv)) * m[..., None]
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (b, t, h))) * m
    g = -jax.random.exponential(ks[4], (b, t, h)) * m
    s0 = jax.random.normal(ks[5], (b, h, dk, dv))
    isz = jnp.dtype(dtype).itemsize
    nbytes = isz * b * t * h * (2 * dk + 2 * dv) + 4 * (b * t * h * 2 + 2 * b * h * dk * dv)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return Problem((q, k, v, beta, g, s0), None, 3, nbytes)


def gdn_tree_problem(key, b, n, h, dk, dv, tree="best_first", n_pad=0, dtype=jnp.float32) -> Problem:
    """A verify pass's tree-form delta rule: ``gdn_problem``'s inputs over N slots of B trees (``tree``:
    ``"best_first"`` as :func:`_tree_parents` draws them, ``"chain"`` the deepest tree), the last ``n_pad`` slots
    padding (parent -1, beta = g = 0, k = v = 0). Moves q, k, v, o, gates, the mask, the state in and the cache's
    V', gam and Gam out."""
    from dflash_jax.models import tree_ops

    p = gdn_problem(key, b, n, h, dk, dv, n_pad, dtype)
    q, k, v, beta, g, s0 = p.args
    rng = np.random.default_rng(n * 131 + b)
    par = np.tile(np.arange(n, dtype=np.int32) - 1, (b, 1)) if tree == "chain" else _tree_parents(rng, b, n)
    par = np.where(np.arange(n)[None] < n - n_pad, np.minimum(par, n - n_pad - 1), -1).astype(np.int32)
    anc = tree_ops.tree_ancestors(jnp.asarray(par))
    isz = jnp.dtype(dtype).itemsize
    nbytes = (isz * b * n * h * (2 * dk + 2 * dv) + 4 * (b * n * h * 2 + b * h * dk * dv + b * h * n * dv
                                                         + b * h * n * (n + 1)) + b * n * n)
    return Problem((q, k, v, beta, g, s0, anc), None, 3, nbytes)


def gdn_commit_problem(key, b, n, h, dk, dv, tree="best_first", n_pad=0) -> Problem:
    """A commit after verification: ``gdn_tree_problem``'s trees verified by the reference from a pool of B + 1
    slot states (row b in slot b + 1; slot 0 the null slot), each row committing its deepest slot. Args
    ``(ssm_all, slots, k, vp, gam, decay, node)``; moves the B rows' states in and out and the cache's keys, V'
    and the node's Gam row and gam in."""
    from dflash_jax.models import gdn

    q, k, v, beta, g, s0, anc = gdn_tree_problem(key, b, n, h, dk, dv, tree, n_pad).args
    _, cache = jax.jit(gdn.gdn_tree_reference)(q, k, v, beta, g, s0, anc)
    pool = jnp.concatenate([jnp.zeros((1, h, dk, dv), jnp.float32), s0])
    slots = jnp.arange(1, b + 1, dtype=jnp.int32)
    node = jnp.full((b,), n - n_pad - 1, jnp.int32)
    nbytes = 4 * b * h * (2 * dk * dv + n * (dk + dv) + n + 1)
    return Problem((pool, slots, cache.k, cache.vp, cache.gam, cache.decay, node), None, 4, nbytes, carry=0)


def gdn_step_problem(key, b, h, dk, dv) -> Problem:
    """One decode token: ``gdn_problem`` with T = 1, squeezed; moves the state in and out once."""
    p = gdn_problem(key, b, 1, h, dk, dv)
    q, k, v, beta, g, s0 = p.args
    return Problem((q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g[:, 0], s0), None, 3, p.nbytes)


# ------------------------------------------------------------------------------------------ implementations

def implementations(op: str) -> tuple[Callable, Callable, Callable]:
    """(registered Pallas implementation, reference, ``explicit(*args, **config)``: the kernel entry point with
    the backend's default config updated by ``config``, e.g. ``num_partitions=1`` or ``block_m=32``)."""
    from pallas_kernels.paged_decode.kernel import page_arrays
    from pallas_kernels.registry import GPU_BACKENDS, current_backend

    if op == "paged_decode":
        from pallas_kernels import paged_decode as m

        kernel, pallas_fn, ref_fn = m.paged_decode, m.paged_decode_pallas, m.paged_decode_reference
        defaults = lambda args: dict(m.default_config(args[0].shape[-1], args[1].shape[1],  # noqa: E731
                                                      page_arrays(args[1])[2],
                                                      quantized=page_arrays(args[1])[1] is not None),
                                     num_partitions=None)
    elif op == "tree_attention":
        from pallas_kernels import tree_attention as m

        kernel, pallas_fn, ref_fn = m.tree_attention, m.tree_attention_pallas, m.tree_attention_reference
        defaults = lambda args: dict(m.default_config(args[0].shape[-1], args[1].shape[1],  # noqa: E731
                                                      page_arrays(args[1])[2],
                                                      quantized=page_arrays(args[1])[1] is not None),
                                     num_partitions=None)
    elif op == "gdn_chunked":
        from pallas_kernels import gdn as m

        kernel, pallas_fn, ref_fn = m.gdn_chunked, m.gdn_chunked_pallas, m.gdn_chunked_reference
        defaults = lambda args: m.default_config(args[0].shape[-1], args[2].shape[-1],  # noqa: E731
                                                 dtype=args[0].dtype)
    elif op == "gdn_tree_commit":
        from dflash_jax.models.gdn import TreeGDNCache
        from pallas_kernels import gdn as m

        def as_op(fn):  # the flat problem args -> the op's (ssm_all, slots, cache, node)
            return lambda pool, slots, k, vp, gam, decay, node: fn(pool, slots, TreeGDNCache(k, vp, gam, decay), node)

        kernel, pallas_fn, ref_fn = m.commit.gdn_tree_commit, as_op(m.gdn_tree_commit_pallas), as_op(
            m.gdn_tree_commit_reference)
        defaults = lambda args: dict(m.commit.default_config(args[3].shape[-1]),  # noqa: E731
                                     precision=m.launch_precision(jnp.float32, current_backend()))
    elif op == "gdn_tree":
        from pallas_kernels import gdn as m

        kernel, ref_fn = m.gdn_tree, m.gdn_tree_reference
        pallas_fn = functools.partial(m.gdn_tree_pallas, every_batch=True)  # the kernel, not the batch routing
        defaults = lambda args: m.tree_default_config(args[0].shape[1], args[0].shape[-1],  # noqa: E731
                                                      args[2].shape[-1], dtype=args[0].dtype)
    else:
        from pallas_kernels import gdn as m

        kernel, pallas_fn, ref_fn = m.gdn_step, m.gdn_step_pallas, m.gdn_step_reference
        defaults = lambda args: dict(block_v=m.default_config(args[0].shape[-1], args[2].shape[-1])["block_v"])  # noqa: E731

    pair_kernel = _pair_kernel(op)

    def explicit(*args, **config):
        cfg = defaults(args)
        cfg.update(config)
        if pair_kernel is not None and current_backend() == "cuda" and _fp8_pages(args[1]):
            return pair_kernel(*args, **cfg)  # the kernel the registry runs for fp8 pages on CUDA
        return kernel(*args, interpret=current_backend() not in GPU_BACKENDS, **cfg)

    return pallas_fn, ref_fn, explicit


def _fp8_pages(pages) -> bool:
    from pallas_kernels.paged_decode.kernel import page_arrays

    data, scale, _ = page_arrays(pages)
    return scale is not None and jnp.dtype(data.dtype) == jnp.float8_e4m3fn


def _pair_kernel(op: str) -> Callable | None:
    """For paged decode / tree attention: ``fn(*problem args, **config)`` running the fp8 pair kernel
    (``pallas_kernels.*.pairs``) as the registered implementation calls it, with a launch config (``prefetch``
    dropped: the pair kernels have none); None for the other ops."""
    from pallas_kernels.paged_decode import pairs as pd_pairs

    if op == "paged_decode":
        def run(q, kp, vp, pt, lengths, scale, **cfg):
            return pd_pairs.paged_decode_pairs(
                q, pd_pairs.pack_pairs(kp.data), pd_pairs.pack_pairs(vp.data), pt, lengths, float(scale), kp.scale,
                vp.scale, pages_per_block=cfg["pages_per_block"], num_partitions=cfg.get("num_partitions"),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], interpret=cfg.get("interpret", False))
        return run
    if op == "tree_attention":
        from pallas_kernels.tree_attention import pairs as ta_pairs

        def run(q, kp, vp, pt, start, kt, vt, anc, scale, **cfg):
            cfg.pop("prefetch", None)
            keys = kp.data if cfg.get("fp8_keys") else pd_pairs.pack_pairs(kp.data)  # fp8_keys: e4m3 key rows
            return ta_pairs.tree_attention_pairs(
                q, keys, pd_pairs.pack_pairs(vp.data), pt, start, kt, vt, anc, float(scale), kp.scale, vp.scale,
                **cfg)
        return run
    return None


# ------------------------------------------------------------------------------------------ check

def check_cases(op: str, a: argparse.Namespace) -> list[dict]:
    """Shapes for the on-device check; the model's head shapes first."""
    h, hkv, d, ps = a.heads, a.kv_heads, a.head_dim, a.page_size
    if op == "paged_decode":
        cases = [dict(b=4, h=h, hkv=hkv, d=d, lengths=[1, ps, ps + 1, 64 * ps], non_resident=[(3, 5), (2, 0)]),
                 dict(b=3, h=12, hkv=2, d=64, lengths=[320, 7, 8], non_resident=[(0, 2)]),
                 dict(b=2, h=8, hkv=8, d=128, lengths=[4800, 2333], non_resident=[])]
    elif op == "gdn_chunked":
        gh, gd = a.gdn_heads, a.gdn_dim
        cases = [dict(b=2, t=300, h=gh, dk=gd, dv=gd, n_pad=5), dict(b=1, t=33, h=4, dk=64, dv=32, n_pad=0)]
    elif op == "gdn_step":
        cases = [dict(b=8, h=a.gdn_heads, dk=a.gdn_dim, dv=a.gdn_dim), dict(b=3, h=5, dk=64, dv=32)]
    elif op in ("gdn_tree", "gdn_tree_commit"):  # a verify tree with padding slots, the deepest tree, a small one
        gh, gd = a.gdn_heads, a.gdn_dim
        cases = [dict(b=2, n=23, h=gh, dk=gd, dv=gd, n_pad=3), dict(b=1, n=33, h=gh, dk=gd, dv=gd, tree="chain"),
                 dict(b=3, n=5, h=4, dk=64, dv=32)]
    else:
        cases = [dict(b=3, n=17, h=h, hkv=hkv, d=d, starts=[0, ps + 1, 64 * ps], non_resident=[(2, 3)]),
                 dict(b=2, n=64, h=h, hkv=hkv, d=d, starts=[40 * ps, 5], non_resident=[]),
                 dict(b=2, n=1, h=8, hkv=2, d=128, starts=[100, 8 * ps], non_resident=[(0, 0)]),
                 dict(b=4, n=23, h=12, hkv=2, d=64, starts=[3, 200, 1024, 0], non_resident=[(2, 1)])]
    return cases[:1] if a.quick else cases


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.abs(out - ref).max() / max(1.0, float(np.abs(ref).max())))


def run_checks(op: str, a: argparse.Namespace, figures: dict, errors: dict) -> bool:
    """Kernel (auto and single partition) and XLA reference vs an f32 HIGHEST oracle. True iff all pass."""
    pallas_fn, ref_fn, explicit = implementations(op)
    rng = np.random.default_rng(0)
    worst, ok = 0.0, True
    for ci, case in enumerate(check_cases(op, a)):
        for dt in a.check_dtypes:
            dtype = jnp.dtype(dt)
            key = jax.random.key(100 + ci)
            c = dict(case)
            if op in ("gdn_step", "gdn_tree_commit"):
                if dt != "float32":
                    continue  # the model feeds the delta rule fp32
                prob = (gdn_step_problem if op == "gdn_step" else gdn_commit_problem)(key, **c)
            elif op == "gdn_chunked":  # bfloat16: q, k, v in bf16 (bf16 dot operands), gates and state fp32
                prob = gdn_problem(key, **c, dtype=dtype)
            elif op == "gdn_tree":  # likewise
                prob = gdn_tree_problem(key, **c, dtype=dtype)
            elif op == "paged_decode":
                prob = decode_problem(rng, key, c.pop("b"), c.pop("h"), c.pop("hkv"), c.pop("d"), a.page_size,
                                      c.pop("lengths"), dtype, non_resident=c.pop("non_resident"))
            else:
                prob = tree_problem(rng, key, c.pop("b"), c.pop("n"), c.pop("h"), c.pop("hkv"), c.pop("d"),
                                    a.page_size, c.pop("starts"), dtype, non_resident=c.pop("non_resident"))
            args = prob.args
            f32 = tuple(x.astype(jnp.float32) if isinstance(x, jax.Array) and x.dtype == dtype else x for x in args)
            with jax.default_matmul_precision("highest"):
                oracle = jax.block_until_ready(ref_fn(*f32))
            variants = {"kernel": lambda: pallas_fn(*args), "reference": lambda: ref_fn(*args)}
            if op == "gdn_chunked":
                variants["kernel_c32"] = lambda: explicit(*args, chunk=32)
                if dt == "float32" and jax.default_backend() in ("gpu", "cuda"):
                    variants["kernel_tf32x3"] = lambda: explicit(*args, precision="tf32x3")
            elif op == "gdn_step":
                variants["kernel_bv64"] = lambda: explicit(*args, block_v=min(64, args[2].shape[-1]))
            elif op == "gdn_tree":
                variants["kernel_bv16"] = lambda: explicit(*args, block_v=16)
            elif op == "gdn_tree_commit":
                variants["kernel_bv64"] = lambda: explicit(*args, block_v=min(64, args[3].shape[-1]), num_warps=8)
            else:
                variants["kernel_s1"] = lambda: explicit(*args, num_partitions=1)
            for name, fn in variants.items():
                tag = f"{op}.check.c{ci}.{dt}.{name}"
                err = max(_rel_err(o, r) for o, r in zip(jax.tree.leaves(jax.block_until_ready(fn())),
                                                       jax.tree.leaves(oracle)))
                figures[f"{tag}.rel_err"] = _finite(err)
                good = bool(np.isfinite(err) and err <= TOL[dt])
                if name != "reference":
                    worst = max(worst, err)
                    if not good:
                        ok = False
                        print(f"MISMATCH {tag}: rel err {err:.3g} > {TOL[dt]} for case {case}", flush=True)
                        errors.setdefault(op, []).append(f"mismatch {tag}: rel err {err:.3g} case {case}")
                print(f"check {tag}: rel err {err:.3g}", flush=True)
    figures[f"{op}.check.max_rel_err"] = _finite(worst)
    figures[f"{op}.check.ok"] = int(ok)
    return ok


# ------------------------------------------------------------------------------------------ timing

def measure_copy_bandwidth(nbytes: int, repeats: int = 10) -> tuple[float, float]:
    """(copy bytes/s of ``y = x * 2`` counting read + write, read bytes/s of ``sum(x)``), bf16, median of repeats."""
    n = nbytes // 2
    x = jnp.ones((n // 4096, 4096), jnp.bfloat16)
    copy = jax.jit(lambda x: x * 2)
    read = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    out = []
    for fn, moved in ((copy, 2 * x.nbytes), (read, x.nbytes)):
        jax.block_until_ready(fn(x))
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(x))
            ts.append(time.perf_counter() - t)
        out.append(moved / float(np.median(ts)))
    del x
    return out[0], out[1]


TIMING_UNROLL = 8


def time_call(fn: Callable, prob: Problem, repeats: int) -> float:
    """Median seconds per call: ``steps`` calls in one jitted scan cycling over the page-table sets, with
    ``args[perturb]`` shifted by ``0 * carry`` (not folded for floats) so no call is loop-invariant; an op that
    updates ``args[prob.carry]`` in place gets it carried through the loop (its output, of which only one element
    is summed: no copy or whole read of it is charged to the call). The scan is
    unrolled ``TIMING_UNROLL`` times: a GPU while loop syncs with the host every iteration (~10+ us), which
    would otherwise be charged to every call of a microsecond-scale kernel (on CPU, where the kernels run in
    interpret mode, it is not unrolled: compile time)."""
    unroll = TIMING_UNROLL if jax.default_backend() != "cpu" else 1
    steps = TIMING_UNROLL * int(np.clip(2e9 // max(prob.nbytes, 1) // TIMING_UNROLL, 1, 128 // TIMING_UNROLL))
    carry = prob.carry
    arrays = [i for i, x in enumerate(prob.args)
              if isinstance(x, (jax.Array, kv_quant.QuantizedPages)) and i != carry]
    tables = prob.tables

    @functools.partial(jax.jit, donate_argnums=(0,))
    def loop(carried, dyn, tables):
        def body(state, i):
            acc, carried = state
            a = list(prob.args)
            for j, x in zip(arrays, dyn):
                a[j] = x
            if tables is not None:
                a[3] = tables[i % tables.shape[0]]
            if carry is not None:
                a[carry] = carried
            a[prob.perturb] = a[prob.perturb] + (acc * 0.0).astype(a[prob.perturb].dtype)
            out = fn(*a)
            if carry is not None:
                return (acc + out.reshape(-1)[0].astype(jnp.float32), out), None
            return (acc + sum(jnp.sum(x, dtype=jnp.float32) for x in jax.tree.leaves(out)), carried), None

        (acc, carried), _ = lax.scan(body, (jnp.zeros((), jnp.float32), carried), jnp.arange(steps), unroll=unroll)
        return acc, carried

    dyn = tuple(prob.args[j] for j in arrays)
    held = [jnp.copy(prob.args[carry]) if carry is not None else jnp.zeros(())]

    def call():
        acc, held[0] = loop(held[0], dyn, tables)
        return acc

    return median_seconds(call, repeats) / steps


GRIDS = {  # op -> (batches, prefixes, trees), full and --quick; the targets' region first
    "paged_decode": (([1, 16, 64], [512, 2048, 8192, 32768], [None]), ([1, 64], [2048, 8192], [None])),
    "tree_attention": (([16, 64, 1], [2048, 8192, 16384], [16, 32, 64]), ([16, 64], [4096], [16, 32])),
    "gdn_chunked": (([1, 4, 16], [1024, 4096, 8192], [None]), ([1, 4], [2048], [None])),
    "gdn_step": (([1, 16, 64], [1], [None]), ([16, 64], [1], [None])),  # "prefix" 1 = one token
    "gdn_tree": (([16, 1], [None], [32, 16]), ([16], [None], [32])),  # no prefix: the tree alone
    "gdn_tree_commit": (([1, 16], [None], [23, 32]), ([1], [None], [23])),
}
def _configs(base: dict, *variants: dict) -> list[dict]:
    """``base`` first, then ``base`` updated by each variant (duplicates dropped, order kept)."""
    out: list[dict] = []
    for v in ({}, *variants):
        c = {**base, **v}
        if c not in out:
            out.append(c)
    return out


_DECODE_BASE = dict(pages_per_block=2, num_warps=8, num_stages=2, prefetch=False)
_DECODE_B1 = _configs(_DECODE_BASE, dict(pages_per_block=1), dict(pages_per_block=4, num_stages=1),
                      dict(num_stages=3), dict(prefetch=True), dict(pages_per_block=4, num_stages=1, prefetch=True),
                      dict(num_warps=4), dict(target_programs=132), dict(target_programs=528))
_DECODE_B64 = _configs(_DECODE_BASE, dict(pages_per_block=4), dict(num_stages=3), dict(prefetch=True),
                       dict(pages_per_block=4, num_stages=1, prefetch=True), dict(num_warps=4),
                       dict(num_partitions=2))
_TREE_BASE = dict(block_m=128, pages_per_block=2, num_warps=8, num_stages=2, prefetch=False)
_TREE = _configs(_TREE_BASE, dict(block_m=64), dict(pages_per_block=1), dict(pages_per_block=4, num_stages=1),
                 dict(pages_per_block=4),  # 64-key blocks, pipelined: no spill offline since dot_acc
                 dict(num_stages=3), dict(prefetch=True), dict(num_warps=16), dict(num_warps=4, block_m=64),
                 dict(target_programs=132), dict(target_programs=528), dict(prefetch=True, target_programs=132),
                 dict(block_m=64, num_warps=4, prefetch=True))
# 32 nodes x 6 heads = 192 rows a KV-head group: two 128-row tiles compute 256 rows; three 64-row tiles compute
# none in vain but read each K/V block three times (from L2: the tiles of a group are neighbouring programs)
_TREE_T32 = _configs(dict(_TREE_BASE, prefetch=True), dict(block_m=64, num_warps=4),
                     dict(block_m=64, num_warps=4, prefetch=False), dict(block_m=64, num_warps=4, num_stages=3),
                     dict(block_m=64, num_warps=4, pages_per_block=4, num_stages=1), dict(pages_per_block=4, num_stages=1),
                     dict(pages_per_block=4),
                     dict(num_stages=3), dict(block_m=64, num_warps=8), dict(prefetch=True, target_programs=132),
                     dict(block_m=64, num_warps=4, prefetch=True, target_programs=132))
# a 27B verify tree at batch 1 (23 nodes x 6 heads = 138 rows: two 128-row tiles or three 64-row ones): 8 programs
# before the prefix split, so the split sets the occupancy (29 us a layer at 4K on an H100, ~6x its bytes)
_TREE_B1 = _configs(dict(_TREE_BASE, prefetch=True), dict(target_programs=528), dict(target_programs=1056),
                    dict(block_m=64, num_warps=4), dict(block_m=64, num_warps=4, target_programs=528),
                    dict(prefetch=False), dict(pages_per_block=1), dict(pages_per_block=4, num_stages=1))
_GDN = ([dict(chunk=64, block_v=bv, num_warps=w) for bv, w in ((32, 4), (64, 4), (64, 8), (128, 8))]
        + [dict(chunk=64, block_v=bv, num_warps=w, precision="tf32x3") for bv, w in ((64, 8), (32, 4))]  # tensor cores
        + [dict(chunk=64, block_v=bv, num_warps=w) for bv, w in ((32, 8), (128, 4))]
        + [dict(chunk=32, block_v=bv, num_warps=w) for bv in (32, 64, 128) for w in (4, 8)]
        + [dict(chunk=32, block_v=bv, num_warps=4, num_stages=2) for bv in (32, 64)])  # most likely first: --budget-s
# a commit moves state tiles: the programs a launch (block_v) and their warps
_COMMIT = [dict(block_v=bv, num_warps=w) for bv, w in ((32, 4), (64, 4), (64, 8), (16, 4), (16, 2), (128, 8), (32, 2),
                                                    (128, 4))]
SWEEP = {  # op -> [((B, tree, prefix), kernel configs)]: timed after the grid, to tune default_config from
    "tree_attention": [((16, 16, 4096), _TREE),
                       ((16, 32, 4096), _TREE_T32),
                       ((64, 32, 4096), _configs(_TREE_BASE, dict(block_m=64), dict(prefetch=True),
                                                 dict(block_m=64, num_warps=4, prefetch=True))),
                       ((1, 23, 4096), _TREE_B1)],
    "paged_decode": [((1, None, 8192), _DECODE_B1), ((64, None, 8192), _DECODE_B64)],
    "gdn_chunked": [((1, None, 8192), _GDN), ((16, None, 8192), _GDN)],
    "gdn_step": [((64, None, 1), [dict(block_v=bv, num_warps=w) for bv in (16, 32, 64, 128) for w in (2, 4, 8)])],
    "gdn_tree": [((16, 32, None), [dict(block_v=bv, num_warps=w) for bv, w in ((64, 8), (32, 8), (128, 8), (64, 4),
                                                                                (32, 4), (16, 4), (128, 16))]
                  + [dict(block_v=64, num_warps=8, solve="product")]  # the nilpotent product: unsafe, timed only
                  + [dict(block_v=bv, num_warps=w, precision=pr) for pr in ("tf32x3", "bf16")  # tensor cores
                     for bv, w in ((64, 8), (32, 4))]),
                 # a 27B verify tree at batch 1 (budget 22): the solve's dependent steps are most of the launch; at
                 # the model's launch precision on NVIDIA (fp32 inputs as tf32x3), where the solves rank otherwise
                 # than at --gdn-dtype float32's IEEE dots (H100: blocked 89.5 / substitution 101.4 us there, yet a
                 # 27B round 37.8 vs 26.8 ms with blocked at tf32x3)
                 ((1, 23, None), [dict(block_v=bv, num_warps=w, solve=sv, precision="tf32x3")
                                  for bv, w in ((64, 8), (32, 4)) for sv in ("substitution", "blocked", "doubling")])],
    "gdn_tree_commit": [((1, 23, None), _COMMIT), ((16, 32, None), _COMMIT)],
}
SHORT = {"pages_per_block": "ppb", "num_warps": "w", "num_stages": "st", "prefetch": "pf", "block_m": "bm",
         "target_programs": "tp", "num_partitions": "s", "block_v": "bv", "chunk": "c", "precision": "p",
         "solve": "sv"}


def config_name(cfg: dict) -> str:
    """``{"block_m": 64, "prefetch": True}`` -> ``"bm64.pf1"`` (the sweep's figure names)."""
    return ".".join(f"{SHORT[k]}{int(v) if isinstance(v, bool) else v}" for k, v in cfg.items())


def grid(op: str, a: argparse.Namespace) -> list[tuple]:
    """(batch, tree slots or None, prefix) cases of ``op``, without those above ``--max-tokens``."""
    batches, prefixes, trees = GRIDS[op][1 if a.quick else 0]
    batches = a.batches or batches
    prefixes = [1] if op == "gdn_step" else [None] if op in ("gdn_tree", "gdn_tree_commit") else (a.prefixes or prefixes)
    trees = (a.trees or trees) if op in ("tree_attention", "gdn_tree", "gdn_tree_commit") else [None]
    return [(b, n, p) for b in batches for n in trees for p in prefixes if b * (p or 1) <= a.max_tokens]


def _problem(op, a, b, n, p, dtype, rng):
    key = jax.random.key(b * 7919 + (p or 0) + (n or 0))
    if op == "gdn_chunked":
        return gdn_problem(key, b, p, a.gdn_heads, a.gdn_dim, a.gdn_dim, dtype=jnp.dtype(a.gdn_dtype))
    if op == "gdn_step":
        return gdn_step_problem(key, b, a.gdn_heads, a.gdn_dim, a.gdn_dim)
    if op == "gdn_tree":
        return gdn_tree_problem(key, b, n, a.gdn_heads, a.gdn_dim, a.gdn_dim, dtype=jnp.dtype(a.gdn_dtype))
    if op == "gdn_tree_commit":
        return gdn_commit_problem(key, b, n, a.gdn_heads, a.gdn_dim, a.gdn_dim)
    set_bytes = b * p * a.kv_heads * a.head_dim * 2 * dtype.itemsize
    n_sets = int(np.clip(-(-(256 << 20) // max(set_bytes, 1)), 2, 16))  # >= 256 MiB of distinct pages: not in L2
    if op == "paged_decode":
        return decode_problem(rng, key, b, a.heads, a.kv_heads, a.head_dim, a.page_size, [p] * b, dtype, n_sets)
    return tree_problem(rng, key, b, n, a.heads, a.kv_heads, a.head_dim, a.page_size, [p] * b, dtype, n_sets)


def _tag(op, b, n, p):
    return f"{op}.b{b}" + (f".t{n}" if n else "") + (f".p{p}" if p is not None else "")


def sweep_cases(op: str, a: argparse.Namespace) -> list[tuple]:
    """[((B, tree, prefix), configs)] of ``op``. ``--batches/--prefixes/--trees`` replace the cases by their
    product, each with the configs of the listed case of that tree size (else the first case's)."""
    cases = SWEEP[op]
    if not (a.batches or a.prefixes or a.trees):
        return cases
    out = []
    (b0, n0, p0), _ = cases[0]
    fixed_prefix = op in ("gdn_step", "gdn_tree", "gdn_tree_commit")
    for b in a.batches or [b0]:
        for n in (a.trees or [n0]) if n0 else [None]:
            for p in [p0] if fixed_prefix else (a.prefixes or [p0]):
                configs = next((c for (_, cn, _), c in cases if cn == n), cases[0][1])
                out.append(((b, n, p), configs))
    return out


def run_sweep(op: str, a: argparse.Namespace, copy_bw: float, figures: dict, errors: dict, skipped: list,
              deadline: float) -> None:
    """Time kernel configs at a few cases (``<op>.sweep.<case>.<config>.kernel_us`` / ``.bandwidth_fraction`` /
    ``.rel_err`` against the reference on the same inputs, and ``<op>.sweep.<case>.best_us`` with the best config
    printed): data to pick the per-device defaults from."""
    _, ref_fn, explicit = implementations(op)
    dtype = jnp.dtype(a.dtype)
    tol = TOL["float32" if op == "gdn_tree_commit" else a.gdn_dtype if op in ("gdn_chunked", "gdn_tree") else a.dtype]
    for (b, n, p), configs in sweep_cases(op, a):
        case = _tag(op, b, n, p)[len(op) + 1:]
        if time.perf_counter() > deadline:
            skipped.extend(f"{op}.sweep.{case}.{config_name(c)}" for c in configs)
            continue
        prob = _problem(op, a, b, n, p, dtype, np.random.default_rng(2))
        ref = jax.block_until_ready(ref_fn(*prob.args))
        best = None
        for cfg in configs:
            name = config_name(cfg)
            tag = f"{op}.sweep.{case}.{name}"
            if time.perf_counter() > deadline:
                skipped.append(tag)
                continue
            fn = lambda *args, cfg=cfg: explicit(*args, **cfg)  # noqa: E731
            try:
                out = jax.tree.leaves(fn(*prob.args))
                err = max(_rel_err(o, r) for o, r in zip(out, jax.tree.leaves(ref)))
                figures[f"{tag}.rel_err"] = _finite(err)
                t = time_call(fn, prob, a.repeats)
            except Exception as e:
                errors.setdefault(op, []).append(f"{tag}: {type(e).__name__}: {str(e)[:1000]}")
                print(f"ERROR {tag}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            figures[f"{tag}.kernel_us"] = t * 1e6
            figures[f"{tag}.bandwidth_fraction"] = prob.nbytes / t / copy_bw
            if np.isfinite(err) and err <= tol and (best is None or t < best[0]):
                best = (t, name)
            print(f"sweep {op}.{case} {name}: {t * 1e6:.1f} us, {prob.nbytes / t / copy_bw:.3f} of copy bw",
                  flush=True)
        if best is not None:
            figures[f"{op}.sweep.{case}.best_us"] = best[0] * 1e6
            print(f"sweep {op}.{case} best: {best[1]} ({best[0] * 1e6:.1f} us)", flush=True)
        del prob


def _finite(x: float) -> float | None:
    return x if np.isfinite(x) else None


def run_timing(op: str, a: argparse.Namespace, copy_bw: float, figures: dict, errors: dict, skipped: list,
               deadline: float) -> None:
    pallas_fn, ref_fn, _ = implementations(op)
    dtype = jnp.dtype(a.dtype)
    rng = np.random.default_rng(1)
    ok_kernel = True
    for b, n, p in grid(op, a):
        tag = _tag(op, b, n, p)
        if time.perf_counter() > deadline:
            skipped.append(tag)
            continue
        prob = _problem(op, a, b, n, p, dtype, rng)
        row = {}
        for name, fn in (("kernel", pallas_fn), ("reference", ref_fn)):
            if name == "kernel" and not ok_kernel:
                continue
            try:
                row[name] = time_call(fn, prob, a.repeats)
            except Exception as e:  # record and go on: one failing case must not lose the others
                errors.setdefault(op, []).append(f"{tag} {name}: {type(e).__name__}: {str(e)[:2000]}")
                print(f"ERROR {tag} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                if name == "kernel":
                    ok_kernel = False  # a lowering failure repeats for every case: do not pay for it again
        nbytes = prob.nbytes
        if op == "tree_attention" and "kernel" in row:  # the bound: within 1.5x of paged decode's time
            try:
                row["paged_decode"] = time_call(implementations("paged_decode")[0], prefix_decode_problem(prob),
                                                a.repeats)
            except Exception as e:  # noqa: BLE001 - recorded; the tree figures stand without it
                errors.setdefault(op, []).append(f"{tag} paged_decode: {type(e).__name__}: {str(e)[:2000]}")
        del prob
        if "paged_decode" in row:
            figures[f"{tag}.paged_decode_us"] = row["paged_decode"] * 1e6
            figures[f"{tag}.vs_paged_decode"] = row["kernel"] / row["paged_decode"]
        if "kernel" in row:
            figures[f"{tag}.kernel_us"] = row["kernel"] * 1e6
            bw = nbytes / row["kernel"]
            figures[f"{tag}.bytes_per_s"] = bw
            figures[f"{tag}.bandwidth_fraction"] = bw / copy_bw
        if "reference" in row:
            figures[f"{tag}.reference_us"] = row["reference"] * 1e6
        if "kernel" in row and "reference" in row:
            figures[f"{tag}.speedup"] = row["reference"] / row["kernel"]
        print(f"time {tag}: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in row.items())
              + (f", {figures[f'{tag}.bandwidth_fraction']:.3f} of copy bw" if "kernel" in row else ""), flush=True)


KV_GRIDS = {  # op -> [(B, tree, prefix)] timed with quantized pages, full and --quick; the target first
    "paged_decode": ([(1, None, 16384), (16, None, 16384), (1, None, 4096)], [(1, None, 16384)]),
    "tree_attention": ([(16, 16, 16384), (1, 16, 16384), (16, 16, 4096)], [(16, 16, 16384)]),
}
# quantized-page launch configs timed beside the default (64-key blocks, 8 warps, 2 stages; fp8 pages on CUDA: the
# pair kernel, as the registry runs them): name -> page_size -> kwargs
KV_CONFIGS = {
    "bk32": lambda ps: dict(pages_per_block=max(1, 32 // ps)),
    "bk64_st3": lambda ps: dict(pages_per_block=max(1, 64 // ps), num_stages=3),
    "bk128": lambda ps: dict(pages_per_block=max(1, 128 // ps)),
    "w16": lambda ps: dict(pages_per_block=max(1, 64 // ps), num_warps=16),
}
KV_CHECK_CASES = {  # the 27B's head shapes, ragged lengths, non-resident pages; --quick: the first
    "paged_decode": [dict(b=4, lengths=[1, 17, 1024, 300], non_resident=[(3, 5), (2, 0)]),
                     dict(b=2, lengths=[16, 4500], non_resident=[])],
    "tree_attention": [dict(b=3, n=17, starts=[0, 17, 1024], non_resident=[(2, 3)]),
                       dict(b=2, n=16, starts=[640, 5], non_resident=[])],
}


def kv_grid(op: str, a: argparse.Namespace) -> list[tuple]:
    """(batch, tree, prefix) cases of ``op`` with quantized pages; ``--batches/--prefixes/--trees`` replace them by
    one (their first values)."""
    cases = KV_GRIDS[op][1 if a.quick else 0]
    if not (a.batches or a.prefixes or a.trees):
        return cases
    b, n, p = cases[0]
    return [((a.batches or [b])[0], (a.trees or [n])[0] if n else None, (a.prefixes or [p])[0])]


def quantized_problem(prob: Problem, kv_dtype: str) -> Problem:
    """``prob`` with its K/V pages (args 1, 2) stored as ``QuantizedPages`` (bf16 compute) and the bytes a call
    moves recounted: the stored rows plus one f32 scale per token and KV head."""
    dtype = kv_quant.KV_DTYPES[kv_dtype]
    k, v = prob.args[1], prob.args[2]
    args = (prob.args[0], kv_quant.quantize_pages(k, dtype), kv_quant.quantize_pages(v, dtype), *prob.args[3:])
    kv_old = 2 * k.itemsize * k.shape[-1]  # bytes per (token, KV head) of bf16 K + V
    kv_new = 2 * (jnp.dtype(dtype).itemsize * k.shape[-1] + 4)
    hkv = k.shape[2]
    q = prob.args[0]
    qo_bytes = 2 * q.size * q.dtype.itemsize
    tree_bytes = (prob.args[5].size * 2 * prob.args[5].dtype.itemsize) if len(prob.args) > 6 else 0
    tokens = (prob.nbytes - qo_bytes - tree_bytes) // (kv_old * hkv)  # prefix tokens (Problem's own count)
    return Problem(args, prob.tables, prob.perturb, int(tokens * hkv * kv_new + qo_bytes + tree_bytes))


def run_kv_checks(op: str, kv_dtype: str, a: argparse.Namespace, figures: dict, errors: dict) -> bool:
    """The registered kernel on quantized pages against the reference on the same pages (bf16 tolerance), at the
    model's head shapes. True iff all cases pass."""
    pallas_fn, ref_fn, _ = implementations(op)
    rng = np.random.default_rng(3)
    tag = f"kv_{kv_dtype}.{op}"
    worst, quant_err = 0.0, 0.0
    cases = KV_CHECK_CASES[op][:1] if a.quick else KV_CHECK_CASES[op]
    for ci, c in enumerate(cases):
        key = jax.random.key(200 + ci)
        if op == "paged_decode":
            prob = decode_problem(rng, key, c["b"], a.heads, a.kv_heads, a.head_dim, a.page_size, c["lengths"],
                                  jnp.dtype(jnp.bfloat16), non_resident=c["non_resident"])
        else:
            prob = tree_problem(rng, key, c["b"], c["n"], a.heads, a.kv_heads, a.head_dim, a.page_size, c["starts"],
                                jnp.dtype(jnp.bfloat16), non_resident=c["non_resident"])
        qargs = quantized_problem(prob, kv_dtype).args
        ref = jax.block_until_ready(ref_fn(*qargs))
        worst = max(worst, _rel_err(pallas_fn(*qargs), ref))
        f32 = tuple(x.astype(jnp.float32) if isinstance(x, jax.Array) and x.dtype == jnp.bfloat16 else x
                    for x in prob.args)
        with jax.default_matmul_precision("highest"):
            quant_err = max(quant_err, _rel_err(ref, ref_fn(*f32)))
    ok = bool(np.isfinite(worst) and worst <= TOL["bfloat16"])
    figures[f"{tag}.check.rel_err"] = _finite(worst)
    figures[f"{tag}.check.ok"] = int(ok)
    figures[f"{tag}.quant_rel_err"] = _finite(quant_err)
    print(f"check {tag}: kernel vs reference on the same pages rel err {worst:.3g}; quantization rel err "
          f"{quant_err:.3g}", flush=True)
    if not ok:
        print(f"MISMATCH {tag}: rel err {worst:.3g} > {TOL['bfloat16']}", flush=True)
        errors.setdefault(op, []).append(f"mismatch {tag}: rel err {worst:.3g}")
    return ok


def run_kv_timing(op: str, kv_dtype: str, a: argparse.Namespace, copy_bw: float, figures: dict, errors: dict,
                  skipped: list, deadline: float) -> None:
    """Kernel on quantized pages vs the kernel on the same pages in bf16 (``KV_GRIDS``), bf16 compute; also the
    quantized kernel with other launch configs (``KV_CONFIGS``: 32- and 128-key blocks, 3 stages, 16 warps; fp8 pages
    on CUDA through the pair kernel, as the registry runs them), to tune its default from."""
    pallas_fn, ref_fn, explicit = implementations(op)
    rng = np.random.default_rng(4)
    speedups = []
    for b, n, p in kv_grid(op, a):
        tag = f"{op}.kv_{kv_dtype}." + _tag(op, b, n, p)[len(op) + 1:]
        if time.perf_counter() > deadline:
            skipped.append(tag)
            continue
        base = _problem(op, a, b, n, p, jnp.dtype(jnp.bfloat16), rng)
        prob = quantized_problem(base, kv_dtype)
        row = {}
        variants = [("kernel", pallas_fn, prob), ("bf16_kernel", pallas_fn, base)]
        variants += [(f"kernel_{name}", functools.partial(explicit, **kw(a.page_size)), prob)
                     for name, kw in KV_CONFIGS.items()]
        if not a.quick:
            variants.append(("reference", ref_fn, prob))
        for name, fn, pr in variants:
            try:
                row[name] = time_call(fn, pr, a.repeats)
            except ValueError as e:  # a launch config the static check refuses (e.g. over the shared memory)
                print(f"skip {tag} {name}: {str(e)[:200]}", flush=True)
            except Exception as e:
                errors.setdefault(op, []).append(f"{tag} {name}: {type(e).__name__}: {str(e)[:2000]}")
                print(f"ERROR {tag} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        nbytes = prob.nbytes
        del base, prob, variants
        for name, t in row.items():
            figures[f"{tag}.{name}_us"] = t * 1e6
        if "kernel" in row:
            figures[f"{tag}.bytes_per_s"] = nbytes / row["kernel"]
            figures[f"{tag}.bandwidth_fraction"] = nbytes / row["kernel"] / copy_bw
        if "kernel" in row and "bf16_kernel" in row:
            figures[f"{tag}.speedup"] = row["bf16_kernel"] / row["kernel"]
            speedups.append(figures[f"{tag}.speedup"])
        for name in KV_CONFIGS:
            if f"kernel_{name}" in row and "bf16_kernel" in row:
                figures[f"{tag}.speedup_{name}"] = row["bf16_kernel"] / row[f"kernel_{name}"]
        print(f"time {tag}: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in row.items())
              + (f", {figures[f'{tag}.speedup']:.2f}x vs bf16 pages" if f"{tag}.speedup" in figures else ""),
              flush=True)
    if speedups:
        figures[f"kv_{kv_dtype}.{op}.speedup"] = float(np.min(speedups))


def summarize(figures: dict) -> None:
    """The targets' figures: paged decode's median (and min) bandwidth fraction over prefixes >= 8K; tree
    attention's minimum speedup per batch over trees of 16-32 slots and prefixes of 2K-16K, and the prefixes that
    region held in this run (``tree_attention.summary_prefix_min`` / ``_max``)."""
    fractions, speedups, vs_decode, prefixes = [], {}, [], set()
    for k, v in figures.items():
        parts = k.split(".")
        if parts[0] == "paged_decode" and len(parts) == 4 and parts[1][0] == "b" and parts[3] == "bandwidth_fraction":
            if int(parts[2][1:]) >= 8192:
                fractions.append(v)
        if (parts[0] == "tree_attention" and len(parts) == 5 and parts[1][0] == "b"
                and parts[4] in ("speedup", "vs_paged_decode")):
            b, n, p = int(parts[1][1:]), int(parts[2][1:]), int(parts[3][1:])
            if 16 <= n <= 32 and 2048 <= p <= 16384:
                prefixes.add(p)
                if parts[4] == "speedup":
                    speedups.setdefault(b, []).append(v)
                else:
                    vs_decode.append(v)
    if fractions:
        figures["paged_decode.bandwidth_fraction"] = float(np.median(fractions))
        figures["paged_decode.bandwidth_fraction_min"] = float(np.min(fractions))
    for b, vs in sorted(speedups.items()):
        figures[f"tree_attention.b{b}.speedup"] = float(np.min(vs))
    if prefixes:  # the prefixes those minima cover (--quick: 4K only)
        figures["tree_attention.summary_prefix_min"] = min(prefixes)
        figures["tree_attention.summary_prefix_max"] = max(prefixes)
    if vs_decode:
        figures["tree_attention.vs_paged_decode_max"] = float(np.max(vs_decode))


# ------------------------------------------------------------------------------------------ entry

def run(a: argparse.Namespace, command: str) -> int:
    """Checks of every op first, then the timing grids (ops in ``--ops`` order), then the sweeps. The result file
    is rewritten after every phase, so a crash (e.g. a kernel that faults the device) keeps what came before."""
    t0 = time.perf_counter()
    deadline = t0 + a.budget_s
    dev = jax.devices()[0]
    print(f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
    figures: dict = {}
    errors: dict[str, list[str]] = {}
    skipped: list[str] = []
    out_path = a.out

    def save(final: bool = False) -> None:
        nonlocal out_path
        figures.pop("wall_s", None)  # keep it last in the table
        figures["wall_s"] = time.perf_counter() - t0
        if final:
            results.print_table(figures)
        if a.no_write:
            return
        extra = {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "page_size": a.page_size,
                 "gdn_heads": a.gdn_heads, "gdn_dim": a.gdn_dim, "gdn_dtype": a.gdn_dtype, "dtype": a.dtype,
                 "quick": a.quick, "errors": errors, "skipped": skipped, "tolerances": TOL,
                 "backend": jax.default_backend(), "complete": final}
        out_path = results.write_result("kernels", figures, command, extra, out_dir=a.out_dir, out_path=out_path)
        if final:
            print(f"wrote {out_path}")

    copy_bw, read_bw = measure_copy_bandwidth(a.copy_bytes)
    figures["device.copy_bytes_per_s"] = copy_bw
    figures["device.read_bytes_per_s"] = read_bw
    for op in a.ops:
        try:
            good = run_checks(op, a, figures, errors)
        except Exception as e:  # a lowering failure: record it, go on with the other ops
            good = False
            errors.setdefault(op, []).append(f"check: {type(e).__name__}: {str(e)[:4000]}\n"
                                             f"{traceback.format_exc()[-4000:]}")
            print(f"ERROR {op} check: {type(e).__name__}: {str(e)[:500]}", flush=True)
            figures[f"{op}.check.ok"] = 0
        figures[f"{op}.ok"] = int(good)
        save()
    for op in a.ops:
        if figures[f"{op}.ok"] and not a.no_grid:
            run_timing(op, a, copy_bw, figures, errors, skipped, deadline)
            summarize(figures)
            save()
    kv_ops = [op for op in a.ops if op in KV_GRIDS]
    for kv_dtype in a.kv_dtypes:
        for op in kv_ops:
            try:
                good = run_kv_checks(op, kv_dtype, a, figures, errors)
            except Exception as e:
                good = False
                errors.setdefault(op, []).append(f"kv_{kv_dtype} check: {type(e).__name__}: {str(e)[:4000]}\n"
                                                 f"{traceback.format_exc()[-4000:]}")
                print(f"ERROR kv_{kv_dtype}.{op} check: {type(e).__name__}: {str(e)[:500]}", flush=True)
                figures[f"kv_{kv_dtype}.{op}.check.ok"] = 0
            if good:
                run_kv_timing(op, kv_dtype, a, copy_bw, figures, errors, skipped, deadline)
            save()
    for op in a.ops:
        if figures[f"{op}.ok"] and not a.no_sweep:
            run_sweep(op, a, copy_bw, figures, errors, skipped, deadline)
    summarize(figures)
    save(final=True)
    print("\ntargets: " + ", ".join(
        f"{k} {figures[k]:.3g}" for k in ("tree_attention.b16.speedup", "tree_attention.b64.speedup",
                                          "paged_decode.bandwidth_fraction", "gdn_tree.b16.t32.speedup",
                                          *(f"kv_{dt}.{op}.speedup" for dt in a.kv_dtypes for op in KV_GRIDS))
        if figures.get(k) is not None)
          + "; ok: " + ", ".join(f"{op} {figures[f'{op}.ok']}" for op in a.ops), flush=True)
    failed = [op for op in a.ops if not figures[f"{op}.ok"]] + [
        f"kv_{dt}.{op}" for dt in a.kv_dtypes for op in a.ops if figures.get(f"kv_{dt}.{op}.check.ok") == 0]
    if failed:
        print("FAILED: " + "; ".join(f"{op}: {len(errors.get(op.split('.')[-1], []))} error(s)" for op in failed),
              flush=True)
    return 1 if failed else 0
