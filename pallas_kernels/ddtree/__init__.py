"""The DDTree pop loop: op ``"ddtree_build"`` in :mod:`pallas_kernels.registry`.

Implementations (signature ``(lp [B, L, K] float32, tok [B, L, K] int32, budget, chain_seed) -> dict`` of the
tree's arrays, as ``dflash_jax.spec.ddtree.build_tree`` calls it):

- ``"reference"``: :func:`dflash_jax.spec.ddtree.build_reference` (the seed, then an XLA while loop per row);
- ``"pallas_triton"`` (opt-in, ``DFLASH_KERNELS=ddtree_build=pallas_triton``, until it is timed on a GPU):
  :func:`kernel.ddtree_build`, the whole pop loop in one launch; runs in interpret mode off GPU.
"""

from __future__ import annotations

from dflash_jax.spec.ddtree import build_reference
from pallas_kernels import registry
from pallas_kernels.ddtree.kernel import block_plan, ddtree_build


def ddtree_build_pallas(lp, tok, budget: int, chain_seed: bool) -> dict:
    """The registered kernel (one warp a row); off GPU in interpret mode."""
    return ddtree_build(lp, tok, budget, chain_seed, interpret=registry.current_backend() not in registry.GPU_BACKENDS)


registry.register("ddtree_build", "reference", build_reference, backends=("any",))
registry.register("ddtree_build", "pallas_triton", ddtree_build_pallas, backends=("gpu",), preferred=False)

__all__ = ["block_plan", "build_reference", "ddtree_build", "ddtree_build_pallas"]
