"""The DDTree pop loop: op ``"ddtree_build"`` in :mod:`pallas_kernels.registry`.

Implementations (signature ``(lp [B, L, K] float32, tok [B, L, K] int32, budget, chain_seed) -> dict`` of the
tree's arrays, as ``dflash_jax.spec.ddtree.build_tree`` calls it):

- ``"reference"``: :func:`dflash_jax.spec.ddtree.build_reference` (the seed, then an XLA while loop per row);
- ``"pallas_triton"`` (the GPU default): :func:`kernel.ddtree_build`, the whole pop loop in one launch; runs in
  interpret mode off GPU (when asked for by name). On an H100 the tiny pair's speculative round went 2.01 -> 1.38 ms
  at C1 and 2.37 -> 1.74 ms at C8 with it, DDTree 1.84x -> 2.42x AR at C1, 1.19x -> 1.46x at C8
  (``concurrency_nvidia-h100-80gb-hbm3_20261206-1749.json`` / ``-1749-2.json``).
  ``DFLASH_KERNELS=ddtree_build=reference`` turns it off.
"""

from __future__ import annotations

from dflash_jax.spec.ddtree import build_reference
from pallas_kernels import registry
from pallas_kernels.ddtree.kernel import block_plan, ddtree_build


def ddtree_build_pallas(lp, tok, budget: int, chain_seed: bool) -> dict:
    """The registered kernel (one warp a row); off GPU in interpret mode."""
    return ddtree_build(lp, tok, budget, chain_seed, interpret=registry.current_backend() not in registry.GPU_BACKENDS)


registry.register("ddtree_build", "reference", build_reference, backends=("any",))
registry.register("ddtree_build", "pallas_triton", ddtree_build_pallas, backends=("gpu",))

__all__ = ["block_plan", "build_reference", "ddtree_build", "ddtree_build_pallas"]
