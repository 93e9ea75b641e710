"""Pure-jnp references for the gated delta rule kernels: the model's own ``gdn_chunked_reference`` and
``gdn_step_reference`` (``dflash_jax.models.gdn``), so the kernels are tested against exactly what the model's
references run (``gdn_tree_reference``: the ancestor-masked tree form; ``gdn_tree_commit_reference``: the accepted
path written into the slots' state; ``gdn_decode_reference``: a GDN layer's decode token between its projections,
conv and gates and state writes included)."""

from __future__ import annotations

from dflash_jax.models.gdn import (gdn_chunked_reference, gdn_step_reference, gdn_tree_reference,
                                   tree_commit_reference as gdn_tree_commit_reference)
from dflash_jax.models.qwen36 import gdn_decode_reference

__all__ = ["gdn_chunked_reference", "gdn_decode_reference", "gdn_step_reference", "gdn_tree_commit_reference",
           "gdn_tree_reference"]
