"""Pure-jnp reference for packed tree attention: the model's own ``tree_attention_reference``
(``dflash_jax.models.attention``), so the kernel is tested against exactly what the model's reference runs."""

from __future__ import annotations

from dflash_jax.models.attention import tree_attention_reference

__all__ = ["tree_attention_reference"]
