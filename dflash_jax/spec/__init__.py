"""Speculative decoding: DDTree draft trees (``ddtree``) and tree verification / acceptance (``verify``)."""

from dflash_jax.spec.ddtree import Tree, build_tree, build_tree_reference, positions
from dflash_jax.spec.verify import accept_greedy, accept_sampled, sample_per_slot

__all__ = ["Tree", "build_tree", "build_tree_reference", "positions", "accept_greedy", "accept_sampled",
           "sample_per_slot"]
