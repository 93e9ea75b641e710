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

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.engine.sampling import SamplingArrays, penalize, sample
from dflash_jax.models import qwen36
from dflash_jax.state import DraftKV, EngineState, StepInput


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """[B] next token per row and its log-probability (float32); [B, K] the K most likely alternatives.

    query: with ``query_tail`` Q > 0, the rotated queries of each row's last min(Q, T) real positions (oldest
    first; a row with fewer repeats its first one) over the target's attention layers, ``[B, Q, L, H, hd]`` float32
    (KVFlash ``bounds`` scoring); else None.

    prompt_logprobs / prompt_top_ids / prompt_top_logprobs: a scoring step's (``targets`` given) log-probability of
    each position's next prompt token ``[B, T]`` float32 (0 where there is none), and the K most likely tokens
    after each position ``[B, T, K]``; else None."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    query: jax.Array | None = None
    prompt_logprobs: jax.Array | None = None
    prompt_top_ids: jax.Array | None = None
    prompt_top_logprobs: jax.Array | None = None
    prompt_ranks: jax.Array | None = None


def step(cfg: TargetConfig, dcfg: DrafterConfig | None, params, dparams, state: EngineState, dkv: DraftKV | None,
         inp: StepInput, samp: SamplingArrays, targets: jax.Array | None = None, query_tail: int = 0):
    """Run ``inp`` ([B, T] tokens) through the target and sample each row's next token.

    With a drafter (``dcfg`` set), the drafter's context cache is extended with these positions too, so a
    sequence can draft from any point. ``query_tail``: also return the queries of each row's last that many
    positions (``StepOutput.query``). ``targets`` [B, T] int32 (a scoring step: prompt logprobs): each position's
    next prompt token (-1: none); the step also returns their log-probabilities under the model's distribution
    and each position's most likely tokens. Returns ``(state', dkv', StepOutput)``.
    """
    layers = tuple(dcfg.target_layer_ids) if dcfg is not None else ()
    qs: list | None = [] if query_tail else None
    h, kv, rec, feats = qwen36.forward(params, cfg, inp, state.kv, state.rec, layers, qs)
    if dcfg is not None:
        from dflash_jax.engine.spec_steps import features, write_draft_context

        dkv = write_draft_context(dcfg, dparams, dkv, features(feats), inp.positions, inp.valid, inp.page_table)
    last = jnp.clip(inp.n_valid - 1, 0, inp.tokens.shape[1] - 1)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = qwen36.lm_logits(params, h_last)
    pen = state.pen
    if pen is not None:  # a decode step's input is the row's newest generated token once it has generated one
        counted = (inp.n_valid > 0) & (samp.step > 0) if inp.tokens.shape[1] == 1 else jnp.zeros_like(samp.penalized)
        pen, logits = penalize(pen, inp.slots, inp.tokens[:, 0], counted, samp, logits.astype(jnp.float32))
    tok, logp, top_ids, top_lp = sample(logits, samp)
    scored = (None,) * 4 if targets is None else prompt_scores(params, h, targets, top_ids.shape[-1])
    query = None
    if query_tail:
        t = inp.tokens.shape[1]
        query_tail = min(query_tail, t)  # a decode step (T = 1) returns its one position's queries
        at = jnp.clip(inp.n_valid[:, None] - query_tail + jnp.arange(query_tail)[None], 0, t - 1)  # [B, Q]
        query = jnp.stack([jnp.take_along_axis(q, at[:, :, None, None], axis=1) for q in qs], axis=2)
        query = query.astype(jnp.float32)  # [B, Q, L, H, hd]
    return EngineState(kv=kv, rec=rec, pen=pen), dkv, StepOutput(tok, logp, top_ids, top_lp, query, *scored)


def prompt_scores(params, h: jax.Array, targets: jax.Array, k: int):
    """h [B, T, D] final hidden states, targets [B, T] int32 (-1: none) -> (log p(target) [B, T] float32, 0 where
    none; top ids [B, T, k] int32; top log-probabilities [B, T, k]; the target's rank [B, T] int32, 1 + the tokens
    more likely than it, 0 where none), one row at a time (a row's ``[T, V]`` float32 log-probabilities are the
    largest buffer)."""

    def row(args):
        hr, tr = args
        logp = jax.nn.log_softmax(qwen36.lm_logits(params, hr).astype(jnp.float32), axis=-1)  # [T, V]
        lp = jnp.take_along_axis(logp, jnp.clip(tr, 0)[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(logp, k)
        rank = 1 + jnp.sum(logp > lp[:, None], axis=-1, dtype=jnp.int32)
        return jnp.where(tr >= 0, lp, 0.0), top_ids.astype(jnp.int32), top_lp, jnp.where(tr >= 0, rank, 0)

    return jax.lax.map(row, (h, targets))


def step_fn(cfg: TargetConfig, dcfg: DrafterConfig | None = None, query_tail: int = 0):
    """``f(params, dparams, state, dkv, inp, samp)`` jitted with the state (and drafter cache) donated.

    The same function serves prefill buckets (T = chunk) and decode buckets (T = 1).
    """
    return jax.jit(functools.partial(step, cfg, dcfg, query_tail=query_tail), donate_argnums=(2, 3))
