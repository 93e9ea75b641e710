"""Chunked gated delta rule (prefill): op ``"gdn_chunked"`` in :mod:`pallas_kernels.registry`.

Implementations (signature ``(q, k [B,T,H,dk], v [B,T,H,dv], beta, g [B,T,H], state [B,H,dk,dv] fp32, chunk)
-> (o [B,T,H,dv], state)``, as ``dflash_jax.models.qwen36.gdn_layer`` calls ``gdn.gdn_chunked``):

- ``"reference"``: pure jnp (``dflash_jax.models.gdn.gdn_chunked_reference``), any backend, the default everywhere;
- ``"pallas_triton"``: :func:`kernel.gdn_chunked` (its own chunk length from :func:`kernel.default_config`; the
  ``chunk`` argument is the reference's). Registered **opt-in** (not the GPU default) until it has been measured
  on a GPU: ``DFLASH_KERNELS=gdn_chunked=pallas_triton``. Interpret mode off GPU.
"""

from __future__ import annotations

import jax

from pallas_kernels import registry
from pallas_kernels.gdn.kernel import block_plan, default_config, gdn_chunked
from pallas_kernels.gdn.reference import gdn_chunked_reference


def gdn_chunked_pallas(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array, state: jax.Array,
                       chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The registered Pallas implementation (``chunk`` is ignored: the kernel's own tile is used). Shapes its
    tiles cannot take run the reference, with a warning."""
    del chunk
    backend = registry.current_backend()
    dk, dv = q.shape[-1], v.shape[-1]
    cfg = default_config(dk, dv, backend=backend)
    try:
        block_plan(dk=dk, dv=dv, chunk=cfg["chunk"], block_v=cfg["block_v"], backend=backend)
    except ValueError as e:
        registry.warn_fallback("gdn_chunked", e)
        return gdn_chunked_reference(q, k, v, beta, g, state)
    return gdn_chunked(q, k, v, beta, g, state, **cfg, interpret=backend not in registry.GPU_BACKENDS)


registry.register("gdn_chunked", "reference", gdn_chunked_reference, backends=("any",))
registry.register("gdn_chunked", "pallas_triton", gdn_chunked_pallas, backends=("gpu",), preferred=False)

__all__ = ["block_plan", "default_config", "gdn_chunked", "gdn_chunked_pallas", "gdn_chunked_reference"]
