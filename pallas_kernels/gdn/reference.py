"""Pure-jnp reference for the chunked gated delta rule: the model's own ``gdn_chunked_reference``
(``dflash_jax.models.gdn``), so the kernel is tested against exactly what the model's reference runs."""

from __future__ import annotations

from dflash_jax.models.gdn import gdn_chunked_reference

__all__ = ["gdn_chunked_reference"]
