"""The jit step functions: pure ``(params, state, inputs) -> (state', outputs)``, state donated.

``prefill_chunk`` and ``decode`` are the same computation at different shapes: T tokens per row
(a prefill chunk, right padded) or one token per row. Both write K/V into pages and advance the
rows' recurrent slots, then sample the next token from each row's last real position.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig
from dflash_jax.engine.sampling import SamplingArrays, sample
from dflash_jax.models import qwen36
from dflash_jax.state import EngineState, StepInput


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """[B] next token per row and its log-probability (float32); [B, K] the K most likely alternatives."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def step(cfg: TargetConfig, params, state: EngineState, inp: StepInput, samp: SamplingArrays):
    """Run ``inp`` ([B, T] tokens) through the target and sample each row's next token."""
    h, kv, rec, _ = qwen36.forward(params, cfg, inp, state.kv, state.rec)
    last = jnp.clip(inp.n_valid - 1, 0, inp.tokens.shape[1] - 1)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = qwen36.lm_logits(params, h_last)
    tok, logp, top_ids, top_lp = sample(logits, samp)
    return EngineState(kv=kv, rec=rec), StepOutput(tok, logp, top_ids, top_lp)


def step_fn(cfg: TargetConfig):
    """``f(params, state, inp, samp)`` jitted for ``cfg`` with the state donated.

    The same function serves prefill buckets (T = chunk) and decode buckets (T = 1).
    """
    return jax.jit(functools.partial(step, cfg), donate_argnums=(1,))
