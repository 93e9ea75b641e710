"""Tree helpers for speculative tree verification on the hybrid target (reference §4.5 options 4 and 5).

A batch holds B token trees of N slots each. ``parents [B,N]`` int: parent slot of each slot, -1 for the root
(slot 0) and for padding slots; a parent always precedes its child (parents[b,i] < i). A padding slot is thus a
lone root: it sees only itself (and S0 / the conv state), and no valid slot sees it.

* `tree_ancestors(parents)` -> ancestors [B,N,N] bool (A_ij = j is i or an ancestor of i), the mask that
  `gdn.gdn_tree` and tree attention take.
* `tree_conv(x_tree, w, conv_state, parents)`: the depthwise causal conv + SiLU of `qwen36.causal_conv`, where each
  slot's window follows its ancestor chain (slot, parent, parent², ...) and reaches into the conv state when the chain
  is shorter than K-1.
* `tree_conv_state(x_tree, conv_state, parents, node)`: the new conv state after committing the root->node path.
* The GDN state commit is `gdn.tree_node_state`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def tree_ancestors(parents: jax.Array) -> jax.Array:
    """[B,N] parent slots (-1 = none) -> [B,N,N] bool, the reflexive-transitive closure of parent."""
    n = parents.shape[-1]
    eye = jnp.eye(n, dtype=bool)
    reach = eye | (parents[..., :, None] == jnp.arange(n))  # i itself or its parent
    # repeated squaring: after s steps reach covers paths of length < 2^s
    for _ in range(max(1, (n - 1).bit_length())):
        r = reach.astype(jnp.float32)
        reach = jnp.einsum("bij,bjk->bik", r, r, precision=lax.Precision.HIGHEST) > 0
    return reach


def tree_depth(parents: jax.Array) -> jax.Array:
    """[B,N] depth of every slot (root and padding slots: 0)."""
    return jnp.sum(tree_ancestors(parents), axis=-1).astype(jnp.int32) - 1


def _ext_parents(parents: jax.Array, km1: int) -> jax.Array:
    """Predecessor table over the extended rows [conv_state (K-1) ; tree (N)], shape [B, K-1+N].

    Tree slot i (row K-1+i) -> its parent's row, or the last conv-state row K-2 for a root/padding slot;
    conv-state row r -> r-1 (clamped at 0: never reached within K-1 steps)."""
    b = parents.shape[0]
    state_prev = jnp.broadcast_to(jnp.maximum(jnp.arange(km1) - 1, 0), (b, km1))
    tree_prev = jnp.where(parents >= 0, parents + km1, km1 - 1)
    return jnp.concatenate([state_prev, tree_prev], axis=1).astype(jnp.int32)


def tree_conv_taps(parents: jax.Array, kernel: int) -> jax.Array:
    """[B,N,K] rows of [conv_state (K-1) ; x_tree (N)] that each slot's conv window reads, oldest first:
    taps[..., K-1] is the slot itself, taps[..., K-2] its parent (or the last conv-state row), and so on."""
    km1 = kernel - 1
    n = parents.shape[-1]
    prev = _ext_parents(parents, km1)
    cur = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) + km1, parents.shape)
    taps = [cur]
    for _ in range(km1):
        cur = jnp.take_along_axis(prev, cur, axis=1)
        taps.append(cur)
    return jnp.stack(taps[::-1], axis=-1)


def _acc_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _ext_rows(x_tree: jax.Array, conv_state: jax.Array, slots: jax.Array | None, idx: jax.Array) -> jax.Array:
    """Rows ``idx [B, M]`` of each row's ``[conv_state (K-1) ; x_tree (N)]``, ``[B, M, C]`` in x_tree's dtype, read
    from the two arrays where they are (no concatenation: one fusion with its consumer). conv_state [B, K-1, C], or
    with ``slots [B]`` every slot's ``[S, K-1, C]`` (row b's at ``slots[b]``)."""
    km1, n = conv_state.shape[1], x_tree.shape[1]
    lead = slots[:, None] if slots is not None else jnp.arange(x_tree.shape[0])[:, None]
    st = conv_state[lead, jnp.clip(idx, 0, km1 - 1)].astype(x_tree.dtype)
    tr = jnp.take_along_axis(x_tree, jnp.clip(idx - km1, 0, n - 1)[..., None], axis=1)
    return jnp.where((idx < km1)[..., None], st, tr)


def tree_conv(x_tree: jax.Array, w: jax.Array, conv_state: jax.Array, parents: jax.Array,
              slots: jax.Array | None = None) -> jax.Array:
    """Tree-aware depthwise causal conv + SiLU.

    x_tree [B,N,C] pre-conv rows of the tree slots; w [C,K] (w[:, K-1] multiplies the slot's own row, w[:, 0] the
    row K-1 steps up its chain); conv_state [B,K-1,C] the last K-1 committed pre-conv rows (or, with slots [B],
    every slot's [S,K-1,C], row b's at slots[b]); parents [B,N].
    Returns silu(conv) [B,N,C] in x_tree's dtype (accumulated in float32, or float64 for float64 inputs): for every
    slot, what `qwen36.causal_conv` gives at the last token of its root->slot path started from conv_state.
    """
    kk = w.shape[1]
    taps = tree_conv_taps(parents, kk)  # [B,N,K]
    a = _acc_dtype(x_tree.dtype)
    acc = sum(_ext_rows(x_tree, conv_state, slots, taps[..., j]).astype(a) * w[:, j].astype(a) for j in range(kk))
    return jax.nn.silu(acc).astype(x_tree.dtype)


def tree_conv_state(x_tree: jax.Array, conv_state: jax.Array, parents: jax.Array, node: jax.Array,
                    slots: jax.Array | None = None) -> jax.Array:
    """New conv state after committing row b's root->node[b] path: its last K-1 pre-conv rows, oldest first
    (taking rows of the old conv_state when the path is shorter than K-1). node < 0 keeps conv_state.

    x_tree [B,N,C], conv_state [B,K-1,C] (or with slots [B] every slot's [S,K-1,C]), parents [B,N], node [B] int
    -> [B,K-1,C] in conv_state's dtype.
    """
    km1 = conv_state.shape[1]
    if km1 == 0:
        return conv_state if slots is None else conv_state[slots]
    prev = _ext_parents(parents, km1)
    n = x_tree.shape[1]
    cur = jnp.where(node >= 0, jnp.minimum(node, n - 1) + km1, km1 - 1).astype(jnp.int32)[:, None]  # [B,1]
    rows = [cur]
    for _ in range(km1 - 1):
        cur = jnp.take_along_axis(prev, cur, axis=1)
        rows.append(cur)
    idx = jnp.concatenate(rows[::-1], axis=1)  # [B,K-1]
    return _ext_rows(x_tree, conv_state, slots, idx).astype(conv_state.dtype)
