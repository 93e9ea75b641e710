"""Tree verification: which draft slots the target accepts, and the per-slot target draws (reference §4.3).

The target runs once over the whole tree (slot i attends to its ancestors only) and gives, per slot i, the target's
distribution of the token that follows the path root -> i. One token ``y_i`` is then taken per slot:

* greedy: ``y_i = argmax``;
* sampling: ``y_i ~ p_target(· | path to i)`` with the row's temperature / top-k / top-p, drawn independently per slot
  (``sample_per_slot``).

Acceptance is the same walk in both cases: ``cur = root; while some child c of cur has token y_cur: cur = c``. The
visited slots (root included) are accepted and ``bonus = y_cur`` is the target's token after the deepest accepted node.

Why the sampled walk is lossless (DDTree's "target-only" verification): the walk emits ``y_root`` as its first token
(either as the accepted child with that token or as the bonus), and ``y_root`` is an exact draw from the target given
the committed context. If it continues into child c, the next emitted token is ``y_c``, an exact draw given
context + token(c), and ``y_c`` is independent of ``y_root`` (fresh key per slot), so conditioning on the walk having
reached c — an event decided by ``y_root`` and earlier draws only — leaves its distribution untouched. By induction
every emitted token is drawn from the target conditioned on everything emitted before it, i.e. the emitted sequence
is distributed exactly like autoregressive sampling; the draft only decides how many of those tokens one verify pass
gets to keep. (Equivalent per-node rule, SGLang's ``tree_speculative_sampling_target_only``: accept child x with
probability p(x), residual-renormalised after each rejection, else draw the bonus from the residual.)

Implementation: the walk is loop-free. Node i is *locally* accepted when it is valid and ``token_i == y_parent(i)``;
it is on the walk's path iff all its ancestors are locally accepted (siblings carry distinct tokens, so at most one
node per depth qualifies). The deepest such node is where the walk stops; its ancestor row lists the accepted slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.engine.sampling import filtered
from dflash_jax.spec.ddtree import Tree


def _walk(tree: Tree, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    y = jnp.asarray(y, jnp.int32)
    bsz, n = y.shape
    rows = jnp.arange(bsz)[:, None]
    par = jnp.maximum(tree.parent, 0)
    local = tree.valid & (tree.tokens == y[rows, par])
    local = local.at[:, 0].set(True)  # the root is always accepted
    on_path = jnp.all(~tree.ancestors | local[:, None, :], axis=-1)  # [B, N]: every ancestor-or-self accepted
    last = jnp.argmax(jnp.where(on_path, tree.depth, -1), axis=-1)  # [B] deepest accepted slot
    n_acc = tree.depth[rows[:, 0], last] + 1
    path = tree.ancestors[rows[:, 0], last]  # [B, N] accepted slots
    d_max = tree.max_depth
    at_depth = path[:, None, :] & (tree.depth[:, None, :] == jnp.arange(d_max + 1)[None, :, None])  # [B, L+1, N]
    slots = jnp.where(jnp.any(at_depth, axis=-1), jnp.argmax(at_depth, axis=-1), -1).astype(jnp.int32)
    bonus = y[rows[:, 0], last]
    return slots, n_acc.astype(jnp.int32), bonus


def accept_greedy(tree: Tree, target_argmax: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy acceptance. ``target_argmax`` [B, N]: the target's argmax at each slot.

    Returns ``accepted_slots`` [B, L + 1] int32 (slot ids in depth order, root first, padded with -1),
    ``n_accepted`` [B] int32 (root counted: the number of tokens this step commits) and ``bonus`` [B] int32
    (``target_argmax`` at the deepest accepted slot: the next root).
    """
    return _walk(tree, target_argmax)


def accept_sampled(tree: Tree, target_samples: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Lossless sampled acceptance: the same walk over ``target_samples`` [B, N], one independent draw from the
    target's (temperature / top-k / top-p adjusted) distribution per slot (``sample_per_slot``). The emitted
    tokens are the accepted nodes' tokens followed by ``bonus``; see the module docstring for why their
    distribution equals autoregressive sampling. Same outputs as ``accept_greedy``.
    """
    return _walk(tree, target_samples)


def sample_per_slot(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                    seed: jax.Array, step: jax.Array, min_p: jax.Array | None = None) -> jax.Array:
    """One target draw per slot: ``logits`` [B, N, V] -> tokens [B, N] int32.

    Per-row ``temperature`` (0 = greedy: argmax), ``top_k`` (0 = off), ``top_p`` (1 = off), ``seed`` (uint32),
    ``step`` (int32, tokens generated so far) and ``min_p`` (0 = off; None: off for every row), all [B]: the
    distribution of ``engine.sampling.filtered``. Slot j of row b
    draws with ``fold_in(fold_in(key(seed_b), step_b), j)``: independent across slots (what makes the
    sampled walk lossless) and independent of the rest of the batch.
    """
    logits = jnp.asarray(logits, jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    min_p = jnp.zeros_like(top_p) if min_p is None else jnp.asarray(min_p, jnp.float32)
    seed = jnp.asarray(seed, jnp.uint32)
    step = jnp.asarray(step, jnp.int32)
    n = logits.shape[1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn(logits):
        masked = filtered(logits, temperature, top_k, top_p, min_p)

        def row(seed, step, m):
            base = jax.random.fold_in(jax.random.key(seed), step)
            keys = jax.vmap(lambda j: jax.random.fold_in(base, j))(jnp.arange(n))
            return jax.vmap(jax.random.categorical)(keys, m)

        return jax.vmap(row)(seed, step, masked).astype(jnp.int32)

    tok = jax.lax.cond(jnp.any(temperature > 0), drawn, lambda l: greedy, logits)
    return jnp.where((temperature > 0)[:, None], tok, greedy)
