"""DDTree: the best-first draft tree built from a block drafter's per-position marginals (reference §4.1–4.2).

The drafter runs once per step and yields log-softmax marginals ``lp[d]`` for the block offsets d = 1..L. A node is a
prefix ``(x_1, …, x_d)`` with ``x_e`` among the top-K tokens of ``lp[e]``; its score is ``Σ_e lp[e, x_e]``. The tree
of ``budget`` nodes is the set of the ``budget`` highest-scoring prefixes, enumerated with a heap and lazy expansion:

* start with the single candidate (depth 1, rank 0, parent = root);
* pop the best candidate -> node n; push its **next sibling** (same parent, rank + 1) if rank + 1 < K and its
  **first child** (parent n, depth + 1, rank 0) if depth < L; stop after ``budget`` pops.

Scores only decrease along an extension or down the ranks, so the pops come out in decreasing score order, the popped
set is prefix-closed and a parent is always popped before its children (``parent[i] < i``).

**Level bonus** (``level_bonus`` = c, nats; 0 is the paper's tree): each level adds ``lp[e, x_e] + c``. The
marginals of a block drafter are not conditioned on the drafted prefix, yet its hits come in runs: on the shipped
pair's held-out files (its third drafter run), where the drafted prefix is right the top-1 at depth 9-13 is right
0.57-0.75 of the time against a marginal of ~0.18, so a path's product of marginals undervalues deep nodes. ``c`` is that correction,
calibrated per drafter on training text (``experiments/calibrate_level_bonus.py``; a drafter checkpoint carries its
own as ``dflash_config.ddtree_level_bonus``). A level with ``lp + c > 0`` scores above its parent; the tree is then
the same best-first expansion (still prefix-closed, parents first), no longer always the top-``budget`` prefixes.

For static shapes the heap is a fixed array "frontier" of candidate slots: the candidates pushed by pop t go to two
fixed slots (sibling, child), a pop is an argmax over the live slots, and the loop runs ``pop_row`` once per pop:
a ``lax.fori_loop`` vmapped over the rows (``build_reference``), or on a GPU one Triton kernel per row for the whole
loop (op ``ddtree_build``, ``pallas_kernels.ddtree``). Ties on score go to the earlier-pushed candidate, exactly
like a ``heapq`` keyed by ``(-score, push counter)`` (``build_tree_reference``).

Output layout (``Tree``, all ``[B, N]`` with ``N = budget + 1``): slot 0 is the root (the pending bonus token, filled by
the caller; ``tokens[:, 0] = -1`` here), slots 1.. are the nodes in pop order. When fewer than ``budget`` prefixes exist
the tail is padding: ``valid = False``, token 0 (a safe embedding id), parent 0, depth 1, score -inf, and an ancestor
row that holds only the slot itself, so a padding slot neither sees nor is seen by any valid slot (valid slots never
list it as an ancestor) and the acceptance walk never enters it.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax.spec import topk


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """A batch of draft trees, ``[B, N]`` arrays (``N = budget + 1``, slot 0 = root), nodes in pop order."""

    tokens: jax.Array  # int32; root = -1 (the caller writes the bonus token there); padding = 0
    parent: jax.Array  # int32; root -1; padding 0
    depth: jax.Array  # int32; root 0; padding 1
    score: jax.Array  # float32 cumulative draft log-prob (+ the level bonus per level); root 0; padding -inf
    valid: jax.Array  # bool; root True
    ancestors: jax.Array  # [B, N, N] bool: row i, column j <=> j is an ancestor of i or j == i
    max_depth: int = dataclasses.field(metadata=dict(static=True))  # L: the draft block length the tree came from

    @property
    def n_slots(self) -> int:
        return self.tokens.shape[-1]

    def with_root(self, root_tokens: jax.Array) -> "Tree":
        """The same tree with slot 0 holding ``root_tokens`` [B] (the pending bonus token of each row)."""
        return dataclasses.replace(self, tokens=self.tokens.at[:, 0].set(root_tokens.astype(jnp.int32)))


def positions(tree: Tree, start: jax.Array) -> jax.Array:
    """Position ids of the verify batch: ``start`` [B] (the root's position) + depth -> [B, N] int32."""
    return (jnp.asarray(start, jnp.int32)[:, None] + tree.depth).astype(jnp.int32)


def _resolve_k(top_k: int | None, budget: int, vocab: int) -> int:
    k = min(budget, vocab) if top_k is None else min(int(top_k), vocab)
    if k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    return k


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [M] (one row), idx [] -> x[idx] (a one-hot select-reduce: no gather in the loop; 0 if idx is out of
    range)."""
    hot = lax.broadcasted_iota(jnp.int32, x.shape, 0) == idx
    return jnp.sum(jnp.where(hot, x, jnp.zeros((), x.dtype)))


@dataclasses.dataclass(frozen=True)
class BuildShape:
    """The static shape of a build: ``L`` draft depths, ``K`` candidates per depth, ``budget`` nodes, ``c`` nodes
    of the seeded top-1 chain (0 without ``chain_seed``), ``n_seed`` frontier candidates before the first pop."""

    L: int
    K: int
    budget: int
    c: int
    n_seed: int

    @property
    def n_pops(self) -> int:
        return self.budget - self.c

    @property
    def n_frontier(self) -> int:
        return self.n_seed + 2 * self.n_pops


def seed(lp: jax.Array, tok: jax.Array, budget: int, chain_seed: bool) -> tuple[BuildShape, tuple, tuple]:
    """``lp``/``tok`` [B, L, K] sorted top-K log-probs / ids -> (shape, the tree's [B, N] arrays and [B, N, N]
    ancestors before the first pop, the frontier's five [B, F] arrays). Flags are int32 (1 = set) so that the pop
    loop runs the same in XLA and in a Triton kernel."""
    bsz, L, K = lp.shape
    n = budget + 1
    neg_inf = jnp.float32(-jnp.inf)
    col = lambda v: jnp.broadcast_to(jnp.asarray(v), (bsz,))[:, None]  # noqa: E731

    # Seed: either the single (depth 1, rank 0) candidate, or the top-1 chain as nodes 1..C plus, per chain depth,
    # its rank-1 sibling candidate (lucebox build_ddtree, chain_seed=true).
    c = min(L, budget) if chain_seed else 0
    pad = n - 1 - c
    chain_sc, sib_sc = [], []
    s = jnp.zeros(bsz, jnp.float32)
    for d in range(c):  # static, unrolled: the same float32 additions as the reference
        sib_sc.append(s + lp[:, d, 1] if K > 1 else jnp.full(bsz, neg_inf))
        s = s + lp[:, d, 0]
        chain_sc.append(s)
    cat = lambda *xs: jnp.concatenate([x for x in xs if x.shape[1]], axis=1)  # noqa: E731
    tokens = cat(col(-1).astype(jnp.int32), tok[:, :c, 0], jnp.zeros((bsz, pad), jnp.int32))
    parent = cat(col(-1).astype(jnp.int32), jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (bsz, c)),
                 jnp.zeros((bsz, pad), jnp.int32))
    depth = jnp.broadcast_to(jnp.concatenate([jnp.arange(c + 1), jnp.ones(pad, jnp.int32)]).astype(jnp.int32), (bsz, n))
    score = cat(jnp.zeros((bsz, 1), jnp.float32), jnp.stack(chain_sc, 1) if c else jnp.zeros((bsz, 0)),
                jnp.full((bsz, pad), neg_inf, jnp.float32))
    valid = jnp.broadcast_to(jnp.arange(n) <= c, (bsz, n)).astype(jnp.int32)
    idx = jnp.arange(n)
    anc = jnp.broadcast_to((idx[:, None] == idx[None, :]) | ((idx[None, :] <= idx[:, None]) & (idx[:, None] <= c)),
                           (bsz, n, n)).astype(jnp.int32)

    shape = BuildShape(L=L, K=K, budget=budget, c=c, n_seed=c if chain_seed else 1)
    f_size = shape.n_frontier
    fpad = f_size - shape.n_seed
    if chain_seed:
        f_score = cat(jnp.stack(sib_sc, 1), jnp.full((bsz, fpad), neg_inf))
        f_parent = jnp.arange(f_size, dtype=jnp.int32) * (jnp.arange(f_size) < c)
        f_depth = jnp.where(jnp.arange(f_size) < c, jnp.arange(f_size) + 1, 1).astype(jnp.int32)
        f_rank = jnp.ones(f_size, jnp.int32)
        f_alive = jnp.arange(f_size) < (c if K > 1 else 0)
    else:
        f_score = cat(lp[:, 0, :1], jnp.full((bsz, fpad), neg_inf))
        f_parent = jnp.zeros(f_size, jnp.int32)
        f_depth = jnp.ones(f_size, jnp.int32)
        f_rank = jnp.zeros(f_size, jnp.int32)
        f_alive = jnp.arange(f_size) < 1
    frontier = tuple(jnp.broadcast_to(x, (bsz, f_size)) for x in (f_score, f_parent, f_depth, f_rank,
                                                                   f_alive.astype(jnp.int32)))
    return shape, (tokens, parent, depth, score, valid, anc), frontier


def pop_row(shape: BuildShape, lp_row: jax.Array, tok_row: jax.Array):
    """The body of one row's pop loop, ``(t, (tree, frontier)) -> (tree, frontier)``, over that row's arrays
    (``lp_row`` / ``tok_row`` [L*K]; tree: tokens, parent, depth, score, valid [N], ancestors [N, N]; frontier:
    score, parent, depth, rank, alive [F]). Arrays may be longer than N / F / L*K (a kernel's power-of-two tiles):
    slots past them are never picked, written or read as a parent, provided the extra frontier slots are dead.
    Dynamic reads and writes are one-hot select-reduces / selects: no gathers or scatters."""
    c, n_seed, K, L = shape.c, shape.n_seed, shape.K, shape.L
    neg_inf = jnp.float32(-jnp.inf)

    def pop(t, carry):
        (tokens, parent, depth, score, valid, anc), (f_score, f_parent, f_depth, f_rank, f_alive) = carry
        fidx = lax.broadcasted_iota(jnp.int32, f_alive.shape, 0)
        idx = lax.broadcasted_iota(jnp.int32, tokens.shape, 0)
        rows = lax.broadcasted_iota(jnp.int32, anc.shape, 0)
        live = f_alive != 0
        key = jnp.where(live, f_score, neg_inf)
        best = jnp.max(key)
        # the first live slot holding the best score = the earliest push (none live: past the end, ok = 0)
        pick = jnp.min(jnp.where(live & (key >= best), fidx, f_alive.shape[0]))
        ok = _take(f_alive, pick) != 0
        p, d, r, sc = (_take(x, pick) for x in (f_parent, f_depth, f_rank, f_score))
        f_alive = jnp.where(fidx == pick, 0, f_alive)

        node = c + 1 + t
        hot = idx == node
        put = lambda arr, v: jnp.where(hot, v, arr)  # noqa: E731
        tokens = put(tokens, jnp.where(ok, _take(tok_row, (d - 1) * K + r), 0))
        parent = put(parent, jnp.where(ok, p, 0))
        depth = put(depth, jnp.where(ok, d, 1))
        score = put(score, jnp.where(ok, sc, neg_inf))
        valid = put(valid, ok.astype(jnp.int32))
        anc_p = jnp.max(jnp.where(rows == p, anc, 0), axis=0)  # row p
        new_row = jnp.where(ok, jnp.maximum(anc_p, hot.astype(jnp.int32)), hot.astype(jnp.int32))
        anc = jnp.where(rows == node, new_row[None, :], anc)

        # push the next sibling and the first child into this pop's two frontier slots
        sib, child = n_seed + 2 * t, n_seed + 2 * t + 1
        r1 = jnp.minimum(r + 1, K - 1)
        d1 = jnp.minimum(d, L - 1)
        vals = (
            (_take(score, p) + _take(lp_row, (d - 1) * K + r1), sc + _take(lp_row, d1 * K)),
            (p, jnp.full_like(p, node)),
            (d, d + 1),
            (r + 1, jnp.zeros_like(r)),
            ((ok & (r + 1 < K)).astype(jnp.int32), (ok & (d < L)).astype(jnp.int32)),
        )
        hs, hc = fidx == sib, fidx == child
        frontier = tuple(jnp.where(hs, vs, jnp.where(hc, vc, arr))
                         for arr, (vs, vc) in zip((f_score, f_parent, f_depth, f_rank, f_alive), vals))
        return (tokens, parent, depth, score, valid, anc), frontier

    return pop


def build_reference(lp: jax.Array, tok: jax.Array, budget: int, chain_seed: bool) -> dict:
    """``lp``/``tok`` [B, L, K] sorted top-K log-probs / ids -> the tree's [B, N] arrays (and [B, N, N] ancestors),
    valid / ancestors as int32 flags: :func:`seed`, then :func:`pop_row`'s loop per row (vmapped)."""
    shape, tree, frontier = seed(lp, tok, budget, chain_seed)
    b = lp.shape[0]
    if shape.n_pops > 0:
        def run(lp_row, tok_row, carry):
            return lax.fori_loop(0, shape.n_pops, pop_row(shape, lp_row, tok_row), carry)

        tree, _ = jax.vmap(run)(lp.reshape(b, -1), tok.reshape(b, -1), (tree, frontier))
    return dict(zip(TREE_FIELDS, tree))


TREE_FIELDS = ("tokens", "parent", "depth", "score", "valid", "ancestors")


def _build(lp: jax.Array, tok: jax.Array, budget: int, chain_seed: bool) -> dict:
    """The tree's arrays through the kernel registry's ``"ddtree_build"`` op (:func:`build_reference`'s contract;
    on a GPU one Triton kernel for the whole pop loop, ``pallas_kernels.ddtree``), flags as bool."""
    from pallas_kernels import registry

    out = registry.get("ddtree_build")(lp, tok, budget, chain_seed)
    return {**out, "valid": out["valid"] != 0, "ancestors": out["ancestors"] != 0}


def build_tree(draft_logprobs: jax.Array, budget: int, top_k: int | None = None, chain_seed: bool = False,
               level_bonus: float = 0.0) -> Tree:
    """``draft_logprobs`` [B, L, V] (log-softmax of the drafter at block offsets 1..L) -> ``Tree`` of N = budget + 1.

    ``budget`` (nodes besides the root), ``top_k`` (candidates per depth; default ``min(budget, V)``),
    ``chain_seed`` (insert the full top-1 chain first, then grow best-first) and ``level_bonus`` (nats added per
    level, see the module doc) are static. Jit with
    ``jax.jit(build_tree, static_argnames=("budget", "top_k", "chain_seed", "level_bonus"))``.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    lp = jnp.asarray(draft_logprobs, jnp.float32)
    _, L, V = lp.shape
    k = _resolve_k(top_k, budget, V)
    top_lp, top_tok = topk.top_k(lp, k)  # [B, L, K], sorted descending, ties -> lower id first
    if level_bonus:
        top_lp = top_lp + jnp.float32(level_bonus)
    out = _build(top_lp, top_tok, budget, chain_seed)
    return Tree(**out, max_depth=L)


# ----------------------------------------------------------------------------------------------------------------
# Host-side references (tests and debugging).


def _topk_np(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(logprobs, order, axis=-1), order.astype(np.int32)


def build_tree_reference(logprobs: np.ndarray, budget: int, top_k: int | None = None,
                         chain_seed: bool = False, level_bonus: float = 0.0) -> dict[str, np.ndarray]:
    """The §4.1 heap with ``heapq``, one tree: ``logprobs`` [L, V] -> dict of [N] arrays (and ``ancestors`` [N, N]).

    Same layout and padding as ``build_tree``; scores are float32 sums ``score(parent) + lp`` (the same roundings
    as the jitted builder); heap ties go to the earlier push.
    """
    lp_full = np.asarray(logprobs, np.float32)
    L, V = lp_full.shape
    k = _resolve_k(top_k, budget, V)
    lp, tok = _topk_np(lp_full, k)
    if level_bonus:
        lp = lp + np.float32(level_bonus)
    n = budget + 1
    tokens, parent, depth = [-1], [-1], [0]
    score = [np.float32(0.0)]
    heap: list = []
    counter = itertools.count()

    def push(sc, par, d, r):
        heapq.heappush(heap, (-float(sc), next(counter), np.float32(sc), par, d, r))

    def add(par, d, r, sc):
        tokens.append(int(tok[d - 1, r]))
        parent.append(par)
        depth.append(d)
        score.append(np.float32(sc))
        return len(tokens) - 1

    if chain_seed:
        for d in range(1, min(L, budget) + 1):
            if k > 1:
                push(score[-1] + lp[d - 1, 1], d - 1, d, 1)
            add(d - 1, d, 0, score[-1] + lp[d - 1, 0])
    else:
        push(np.float32(0.0) + lp[0, 0], 0, 1, 0)
    while heap and len(tokens) < n:
        _, _, sc, par, d, r = heapq.heappop(heap)
        node = add(par, d, r, sc)
        if r + 1 < k:
            push(score[par] + lp[d - 1, r + 1], par, d, r + 1)
        if d < L:
            push(sc + lp[d, 0], node, d + 1, 0)

    n_real = len(tokens)
    valid = np.zeros(n, bool)
    valid[:n_real] = True
    pad = n - n_real
    out = dict(
        tokens=np.array(tokens + [0] * pad, np.int32),
        parent=np.array(parent + [0] * pad, np.int32),
        depth=np.array(depth + [1] * pad, np.int32),
        score=np.array(score + [-np.inf] * pad, np.float32),
        valid=valid,
    )
    anc = np.eye(n, dtype=bool)
    for i in range(1, n_real):
        anc[i] |= anc[out["parent"][i]]
    out["ancestors"] = anc
    return out


def tree_paths(tokens: np.ndarray, parent: np.ndarray, valid: np.ndarray) -> list[tuple[int, ...]]:
    """Host-side: the token path (root excluded) of each slot; ``()`` for the root, ``None`` for padding."""
    paths: list = [()]
    for i in range(1, len(tokens)):
        paths.append(paths[int(parent[i])] + (int(tokens[i]),) if valid[i] else None)
    return paths


def brute_force_prefixes(logprobs: np.ndarray, budget: int, top_k: int | None = None
                         ) -> list[tuple[tuple[int, ...], float]]:
    """Every prefix of top-K tokens per depth, scored in float64, best first; the first ``budget`` form the tree.

    Exponential (K + K² + … + K^L prefixes): tests only.
    """
    lp_full = np.asarray(logprobs, np.float64)
    L, V = lp_full.shape
    k = _resolve_k(top_k, budget, V)
    lp, tok = _topk_np(lp_full, k)
    out = []
    for d in range(1, L + 1):
        for ranks in itertools.product(range(k), repeat=d):
            out.append((tuple(int(tok[e, r]) for e, r in enumerate(ranks)),
                        float(sum(lp[e, r] for e, r in enumerate(ranks)))))
    out.sort(key=lambda x: -x[1])
    return out
