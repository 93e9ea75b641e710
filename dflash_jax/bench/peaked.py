"""Peaked random weights: a random target as sure of its next token as a trained LM, at an unchanged cost.

Random weights give near-uniform logits (at the 27B shapes the top two of 248K logits are typically ~0.1 apart), so
two numerically different passes over the same tokens, the tree-verify pass and the AR decode step in bf16, often
pick different argmaxes. A forced-acceptance run (``--oracle-tau``) then keeps leaving the recorded greedy
continuation and measures far fewer tokens per round than it asked for.

``peak_params`` rewrites only the *values* of the embedding so that the target becomes a bigram machine: row ``t``
of the embedding is LM-head row ``succ(t)``, rescaled to an RMS of ``gain * sqrt(num_layers)`` per element. The
residual stream then carries that row well above the sum of the layers' outputs (each layer adds ~0.75 RMS per
element to a random-weight stream of these initialisations, so ~0.75 sqrt(L) after L layers), and after the final
norm ``logit[succ(t)] ~ 0.9 sqrt(D)`` while every other logit stays ~N(0, 1): a margin of tens of logits at the 27B
shapes (~8 at hidden size 64) that no bf16 rounding can flip, whatever the context. Every layer still computes on
a normalised input and attends over the whole context; shapes, dtypes, shardings and quantization are unchanged,
so every cost is the same.

Why the embedding and not the LM head: the input token's embedding row (RMS 1/sqrt(D) per element at random
initialisation) is drowned in the residual stream by the layers' outputs, so no LM head (or final norm) alone can
read the input token back; a scaled embedding row can. Leaving the LM head alone also leaves an fp8 LM head as it
is (the embedding is never quantized).

``succ`` is a random permutation within each of ``gcd(V, 8)`` equal vocabulary blocks: with the vocabulary split
over up to 8 devices (tensor parallelism), every block lies on one device, so the rewrite is local to each shard
and gathers nothing; the map is the same for every such layout. A tied LM head (the embedding itself) can only
give ``succ(t) = t``: the target then repeats its input token.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax.models import quant, qwen36
from dflash_jax.target import Target

GAIN = 2.0
SEED = 3
MAX_BLOCKS = 8  # vocabulary blocks the permutation stays within (the largest TP whose shards each hold whole blocks)


def _local_permutation(vocab_size: int, tied: bool, seed: int) -> tuple[int, np.ndarray]:
    """``(n, local [V / n])``: the successor map within each of ``n`` vocabulary blocks of ``m = V / n`` tokens."""
    if tied:
        return 1, np.arange(vocab_size, dtype=np.int32)
    n = math.gcd(vocab_size, MAX_BLOCKS)
    return n, np.random.default_rng(seed).permutation(vocab_size // n).astype(np.int32)


def successor(vocab_size: int, tied: bool = False, seed: int = SEED) -> np.ndarray:
    """``succ [V]`` int32: the greedy next token after ``t`` of a peaked target, ``t // m * m + local[t % m]``."""
    n, local = _local_permutation(vocab_size, tied, seed)
    m = vocab_size // n
    t = np.arange(vocab_size, dtype=np.int32)
    return (t // m * m + local[t % m]).astype(np.int32)


def _row_source(lm) -> jax.Array:
    """LM-head rows up to a positive per-row factor: a per-channel fp8 head's scale multiplies whole rows and the
    rows are renormalised afterwards, so its fp8 data serves as is; block scales vary along a row (dequantized)."""
    if quant.is_quantized(lm):
        return lm.data if lm.block is None else quant.dequantize(lm)
    return lm


def _successor_rows(lm, local: jax.Array, n: int, rms: float, dtype) -> jax.Array:
    """``out[t] = lm[succ(t)] * rms / RMS(lm[succ(t)])`` as ``[V, D]`` in ``dtype``."""
    w = _row_source(lm)
    v, d = w.shape
    rows = w.reshape(n, v // n, d)[:, local].reshape(v, d).astype(jnp.float32)
    inv = lax.rsqrt(jnp.mean(rows * rows, axis=-1, keepdims=True) + jnp.finfo(jnp.float32).tiny)
    return (rows * (rms * inv)).astype(dtype)


def peak_params(params: qwen36.Params, num_layers: int, gain: float = GAIN, seed: int = SEED
                ) -> tuple[qwen36.Params, np.ndarray]:
    """``(params', succ)``: ``params`` with the embedding rewritten (module docstring), each new row placed like the
    old (same sharding, computed shard-locally); ``succ [V]`` the greedy successor map it implements."""
    embed, lm = params["embed"], params["lm_head"]
    tied = lm is embed
    v = embed.shape[0]
    n, local = _local_permutation(v, tied, seed)
    f = functools.partial(_successor_rows, n=n, rms=gain * math.sqrt(num_layers), dtype=embed.dtype)
    new = jax.jit(f, out_shardings=embed.sharding)(lm, jnp.asarray(local))
    out = {**params, "embed": new}
    if tied:
        out["lm_head"] = new
    return out, successor(v, tied, seed)


def peak_target(target: Target, gain: float = GAIN, seed: int = SEED) -> tuple[Target, np.ndarray]:
    """``peak_params`` on a loaded random target -> ``(target', succ)``."""
    params, succ = peak_params(target.params, target.config.num_layers, gain, seed)
    return dataclasses.replace(target, params=params), succ


# ---------------------------------------------------------------------------------------------
# the benchmarks' flag
# ---------------------------------------------------------------------------------------------
def add_peaked_argument(p: argparse.ArgumentParser) -> None:
    """``--peaked-random-weights / --no-peaked-random-weights`` (default: on for random weights with an oracle run)."""
    p.add_argument("--peaked-random-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="give the random target a confident (bigram) output distribution by rewriting only its "
                        "embedding values (dflash_jax/bench/peaked.py; no cost changes), so that the AR greedy "
                        "continuation and the speculative output agree in bf16 and --oracle-tau is met. Default: on "
                        "with --random-weights and --oracle-tau > 0, else off")


def peaked_wanted(args: argparse.Namespace) -> bool:
    """The flag's value, its default resolved; asking for it with a checkpoint target is an error."""
    if args.peaked_random_weights is None:
        return bool(args.random_weights) and args.oracle_tau > 0
    if args.peaked_random_weights and not args.random_weights:
        raise SystemExit("--peaked-random-weights rewrites random weights only: use it with --random-weights")
    return args.peaked_random_weights


def describe(gain: float = GAIN, seed: int = SEED) -> dict:
    """The result JSON's record of peaked weights (``extra.peaked_random_weights_detail``)."""
    return {"gain": gain, "seed": seed,
            "rule": "embedding row t = LM-head row succ(t) rescaled to RMS gain*sqrt(num_layers) per element; succ "
                    "a random permutation within gcd(V, 8) vocabulary blocks (identity when tied); LM head, final "
                    "norm and layers unchanged (dflash_jax/bench/peaked.py)"}
