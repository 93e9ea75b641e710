"""Pallas (Triton lowering) kernel for the DDTree pop loop: one program per row runs all ``budget - c`` pops of
:func:`dflash_jax.spec.ddtree.pop_row` (the same body the XLA reference loops over) in one launch.

In XLA the loop is a while loop whose every iteration is a handful of small kernels (max, first-index, one-hot
reads, the ancestor row, the frontier writes): at B1 a 22-pop tree costs ~100 launches of a few microseconds each,
a large part of a small model's speculative round. Here each row's tree, frontier and top-K lists live in one
program's registers for the whole loop.

Tiles are powers of two (Triton): N, F and L * K are padded, the arrays are not: loads past the real sizes are
masked (dead frontier slots, zero tree slots), stores are masked, so there is no pad or slice around the kernel.
``pop_row`` never picks, writes or reads as a parent a slot past the real sizes, so the padded run gives the
reference's values exactly (every dynamic read is a one-hot select-reduce: one non-zero term, exact in any
summation order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.paged_decode.kernel import MIN_DOT, _next_pow2
from pallas_kernels.registry import check_block_shapes


def block_plan(*, n: int, f: int, lk: int) -> dict:
    """Padded tile sizes for N tree slots, F frontier slots and L * K top-K entries (checked: powers of two)."""
    plan = dict(n_pad=max(MIN_DOT, _next_pow2(n)), f_pad=max(MIN_DOT, _next_pow2(f)),
                lk_pad=max(MIN_DOT, _next_pow2(lk)))
    check_block_shapes("ddtree_build", {"tree": (plan["n_pad"],), "ancestors": (plan["n_pad"], plan["n_pad"]),
                                        "frontier": (plan["f_pad"],), "top_k": (plan["lk_pad"],)})
    return plan


def _kernel(lp_ref, tok_ref, tokens_ref, parent_ref, depth_ref, score_ref, valid_ref, anc_ref,
            fs_ref, fp_ref, fd_ref, fr_ref, fa_ref, *out_refs, shape, n: int, f: int, lk: int):
    from dflash_jax.spec.ddtree import pop_row

    def iota(ref, axis=0):
        return lax.broadcasted_iota(jnp.int32, ref.shape, axis)

    def load(ref, size, other):
        return plt.load(ref, mask=iota(ref) < size, other=other)

    m_tree = iota(tokens_ref) < n
    m_anc = (iota(anc_ref, 0) < n) & (iota(anc_ref, 1) < n)
    lp = load(lp_ref, lk, 0.0)
    tok = load(tok_ref, lk, 0)
    tree = (load(tokens_ref, n, 0), load(parent_ref, n, 0), load(depth_ref, n, 1), load(score_ref, n, 0.0),
            load(valid_ref, n, 0), plt.load(anc_ref, mask=m_anc, other=0))
    frontier = (load(fs_ref, f, 0.0), load(fp_ref, f, 0), load(fd_ref, f, 1), load(fr_ref, f, 0),
                load(fa_ref, f, 0))  # slots past F: dead
    tree, _ = lax.fori_loop(0, shape.n_pops, pop_row(shape, lp, tok), (tree, frontier))
    for ref, x in zip(out_refs[:5], tree[:5]):
        plt.store(ref, x.astype(ref.dtype), mask=m_tree)
    plt.store(out_refs[5], tree[5].astype(out_refs[5].dtype), mask=m_anc)


@functools.partial(jax.jit, static_argnames=("budget", "chain_seed", "num_warps", "interpret"))
def ddtree_build(lp: jax.Array, tok: jax.Array, budget: int, chain_seed: bool, *, num_warps: int = 1,
                 interpret: bool = False) -> dict:
    """:func:`dflash_jax.spec.ddtree.build_reference`'s contract: ``lp``/``tok`` [B, L, K] sorted top-K log-probs
    (float32) / ids -> dict of the tree's [B, N] arrays and [B, N, N] ancestors (valid / ancestors int32 flags).
    The seed (:func:`dflash_jax.spec.ddtree.seed`) is XLA; the pop loop is this kernel, grid (B,)."""
    from dflash_jax.spec.ddtree import TREE_FIELDS, seed

    shape, tree, frontier = seed(lp, tok, budget, chain_seed)
    if shape.n_pops <= 0:
        return dict(zip(TREE_FIELDS, tree))
    b, n, f, lk = lp.shape[0], budget + 1, shape.n_frontier, shape.L * shape.K
    plan = block_plan(n=n, f=f, lk=lk)
    npd, fpd, lkp = plan["n_pad"], plan["f_pad"], plan["lk_pad"]
    row = lambda size: pl.BlockSpec((None, size), lambda i: (i, 0))  # noqa: E731
    anc_spec = pl.BlockSpec((None, npd, npd), lambda i: (i, 0, 0))
    outs = pl.pallas_call(
        functools.partial(_kernel, shape=shape, n=n, f=f, lk=lk),
        grid=(b,),
        in_specs=[row(lkp), row(lkp), *[row(npd)] * 5, anc_spec, *[row(fpd)] * 5],
        out_specs=[*[row(npd)] * 5, anc_spec],
        out_shape=[jax.ShapeDtypeStruct((b, n), x.dtype) for x in tree[:5]]
                  + [jax.ShapeDtypeStruct((b, n, n), tree[5].dtype)],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"ddtree_build_n{npd}_f{fpd}_lk{lkp}",
    )(lp.reshape(b, lk), tok.reshape(b, lk), *tree, *frontier)
    return dict(zip(TREE_FIELDS, outs))
