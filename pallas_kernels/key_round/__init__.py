"""Rounding keys onto a quantized page's grid with error feedback: op ``"key_round"`` in
:mod:`pallas_kernels.registry`.

``key_round(w [N, Hkv, D] float32, g [Hkv, D, D] float32, dtype) -> y [N, Hkv, D] float32``: each row of ``w``
(already divided by the scale its page row will store) is rounded onto ``dtype``'s grid (fp8 e4m3 or int8,
clipped to the format's range) one channel at a time, and each channel's rounding error is fed into the channels
after it through ``g`` (``dflash_jax.kv.quant.feedback_matrix``: GPTQ's update for one vector), so that the error
lands where the queries reading that KV head look least. ``g`` is zero on and below its diagonal.

Implementations:

- ``"reference"``: :func:`reference.key_round_reference`, a ``fori_loop`` over the D channels (any backend);
- ``"pallas_triton"`` (the GPU default: the reference is D dependent XLA steps): :func:`kernel.key_round_pallas`,
  grid ``(Hkv, N / block_n)``: a program holds ``block_n`` rows of one head in registers as ``[block_n, 32]``
  column tiles and runs the D steps in one loop per tile (column ``i`` by a one-hot reduce over its tile, rounded
  in f32 arithmetic with no cast, the later columns moved by row ``i`` of ``g``, read a step ahead); equal to the
  reference in interpret mode and on an H100 (fp8 and int8, D=64 and 256, against the reference run by XLA:CPU).
  H100, Hkv=4, D=256, fp8, default launch (``experiments/key_round_gpu.py``, one call): N = 1 / 16 rows (a decode
  step's writes of one layer) 57 / 69 us against the reference's 5.97 / 5.60 ms (the best decode launch of its
  sweep: 59 / 61 us, so the default stays); in an earlier call N = 4096 / 65536 took 0.41 / 3.99 ms against 3.62 /
  56.5 ms. At 16 attention layers a decode step spends ~1 ms in it: a program's 256 dependent channel steps,
  ~0.22 us each.
  Off GPU (when asked for by name) it runs in interpret mode; a D that is not a power of two runs the reference,
  with a warning.
"""

from __future__ import annotations

import jax

from pallas_kernels import registry
from pallas_kernels.key_round.kernel import block_plan, default_config, key_round_pallas
from pallas_kernels.key_round.reference import QMAX, grid_round, grid_round_f32, key_round_reference


def key_round_triton(w: jax.Array, g: jax.Array, dtype) -> jax.Array:
    """The registered kernel with :func:`kernel.default_config`'s launch; off GPU in interpret mode."""
    n, hkv, d = w.shape
    try:
        cfg = default_config(n, d)
        block_plan(n=n, hkv=hkv, d=d, block_n=cfg["block_n"], block_d=cfg["block_d"])
    except ValueError as e:
        registry.warn_fallback("key_round", e)
        return key_round_reference(w, g, dtype)
    return key_round_pallas(w, g, dtype, interpret=registry.current_backend() not in registry.GPU_BACKENDS)


registry.register("key_round", "reference", key_round_reference, backends=("any",))
registry.register("key_round", "pallas_triton", key_round_triton, backends=("gpu",))

__all__ = ["QMAX", "block_plan", "default_config", "grid_round", "grid_round_f32", "key_round_pallas",
           "key_round_reference", "key_round_triton"]
