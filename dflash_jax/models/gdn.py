"""The gated delta rule (Gated DeltaNet recurrence), in recurrent and chunked (WY) forms.

Shapes (value heads already expanded, so q/k carry H = n_v_heads):
  q, k: [B, T, H, dk] float32 (q L2-normalised and scaled by dk^-0.5, k L2-normalised)
  v:    [B, T, H, dv] float32
  beta, g: [B, T, H] float32 (beta in (0,1); g = log decay <= 0)
  state: [B, H, dk, dv] float32 (rows = key dim)
A step with beta = 0, g = 0 and k = v = 0 leaves the state unchanged: that is how padding is masked.

Per token: S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dflash_jax.kv.scatter import set_rows_where

HI = lax.Precision.HIGHEST


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gdn_step(q, k, v, beta, g, state):
    """:func:`gdn_step_reference`'s contract through the kernel registry's ``"gdn_step"`` op."""
    from pallas_kernels import registry

    return registry.get("gdn_step")(q, k, v, beta, g, state)


def gdn_step_reference(q, k, v, beta, g, state):
    """One token for every row/head: q,k [B,H,dk], v [B,H,dv], beta,g [B,H] -> (o [B,H,dv], state)."""
    state = state * jnp.exp(g)[..., None, None]
    read = jnp.einsum("bhkv,bhk->bhv", state, k, precision=HI)
    delta = beta[..., None] * (v - read)
    state = state + k[..., :, None] * delta[..., None, :]
    o = jnp.einsum("bhkv,bhk->bhv", state, q, precision=HI)
    return o, state


def gdn_recurrent(q, k, v, beta, g, state):
    """Token-by-token form (lax.scan over T). Returns (o [B,T,H,dv], final state)."""

    def body(s, xs):
        o, s = gdn_step_reference(*xs, s)
        return s, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, beta, g))
    state, o = lax.scan(body, state, xs)
    return jnp.moveaxis(o, 0, 1), state


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``[..., C, C]`` unit lower-triangular matrices (C a power of two) -> their inverses, by doubling diagonal
    blocks: ``inv([[A, 0], [X, B]]) = [[A^-1, 0], [-B^-1 X A^-1, B^-1]]``, log2(C) levels of batched matmuls.

    Exact like a triangular solve (the same products, regrouped), but all batched matmuls: XLA:CPU's batched
    ``triangular_solve`` took ~7x longer over a 1K-token prefill chunk, and one solve over every chunk of a prompt
    at once (the Pallas kernel's chunk-local pass) is thousands of small systems."""
    c = a.shape[-1]
    if c & (c - 1):
        raise ValueError(f"unit_lower_inverse: size {c} is not a power of two")
    lead = a.shape[:-2]
    t = jnp.ones(lead + (c, 1, 1), a.dtype)  # inverses of the 1x1 diagonal blocks
    s = 1
    while s < c:
        n = c // (2 * s)
        pair = t.reshape(lead + (n, 2, s, s))
        ai, bi = pair[..., 0, :, :], pair[..., 1, :, :]
        x = jnp.diagonal(a.reshape(lead + (n, 2 * s, n, 2 * s)), axis1=-4, axis2=-2)  # [..., 2s, 2s, n]
        x = jnp.moveaxis(x, -1, -3)[..., s:, :s]  # lower-left block of every diagonal 2s block
        low = -jnp.einsum("...ij,...jk,...kl->...il", bi, x, ai, precision=HI)
        t = jnp.concatenate([jnp.concatenate([ai, jnp.zeros_like(ai)], axis=-1),
                             jnp.concatenate([low, bi], axis=-1)], axis=-2)  # [..., n, 2s, 2s]
        s *= 2
    return t.reshape(lead + (c, c))


def _pow2_eye_pad(a: jax.Array) -> jax.Array:
    """Pad ``[..., C, C]`` with identity rows/columns to the next power of two."""
    c = a.shape[-1]
    p = 1 << max(0, (c - 1).bit_length())
    if p == c:
        return a
    pad = [(0, 0)] * (a.ndim - 2) + [(0, p - c), (0, p - c)]
    return jnp.pad(a, pad) + jnp.diag((jnp.arange(p) >= c).astype(a.dtype))


def solve_unit_lower(a: jax.Array, b: jax.Array, method: str | None = None) -> jax.Array:
    """``a^-1 b`` for unit lower-triangular ``a [..., C, C]``, ``b [..., C, N]``.

    ``method``: ``"inverse"`` (:func:`unit_lower_inverse`, then a matmul) or ``"triangular"`` (XLA's
    ``triangular_solve``); None picks by backend: the inverse on CPU, where the batched solve is ~7x slower, the
    solve elsewhere (what the GPU prefill timings were measured with)."""
    method = method or ("inverse" if jax.default_backend() == "cpu" else "triangular")
    if method == "triangular":
        return lax.linalg.triangular_solve(a, b, left_side=True, lower=True, unit_diagonal=True)
    if method != "inverse":
        raise ValueError(f"solve_unit_lower: method must be 'inverse' or 'triangular', got {method!r}")
    c = a.shape[-1]
    t = unit_lower_inverse(_pow2_eye_pad(a))[..., :c, :c]
    return jnp.einsum("...ij,...jn->...in", t, b, precision=HI)


def _chunk(q, k, v, beta, g, s0):
    """One chunk, heads-first: q,k [B,H,C,dk], v [B,H,C,dv], beta,g [B,H,C], s0 [B,H,dk,dv]."""
    c = g.shape[-1]
    gam = jnp.cumsum(g, axis=-1)  # [B,H,C]
    incl = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    diff = gam[..., :, None] - gam[..., None, :]
    decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)  # Gamma_ij, j <= i
    kk = jnp.einsum("bhid,bhjd->bhij", k, k, precision=HI)
    m = jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    a = jnp.eye(c, dtype=m.dtype) + m  # unit lower triangular
    dv = v.shape[-1]
    uw = solve_unit_lower(a, jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(gam))[..., None] * k], axis=-1))
    u, w = uw[..., :dv], uw[..., dv:]
    vp = u - jnp.einsum("bhck,bhkv->bhcv", w, s0, precision=HI)  # pseudo-values [B,H,C,dv]
    qk = jnp.einsum("bhid,bhjd->bhij", q, k, precision=HI) * decay
    o = (jnp.einsum("bhck,bhkv->bhcv", q * jnp.exp(gam)[..., None], s0, precision=HI)
         + jnp.einsum("bhij,bhjv->bhiv", qk, vp, precision=HI))
    g_end = gam[..., -1:]  # [B,H,1]
    s1 = (s0 * jnp.exp(g_end)[..., None]
          + jnp.einsum("bhck,bhcv->bhkv", k * jnp.exp(g_end - gam)[..., None], vp, precision=HI))
    return o, s1


def gdn_chunked(q, k, v, beta, g, state, chunk: int = 64):
    """The chunked form through the kernel registry's ``"gdn_chunked"`` op (:func:`gdn_chunked_reference`'s
    contract; a kernel may pick its own chunk length, the result is the same recurrence)."""
    from pallas_kernels import registry

    return registry.get("gdn_chunked")(q, k, v, beta, g, state, chunk)


def gdn_chunked_reference(q, k, v, beta, g, state, chunk: int = 64):
    """Chunked (WY) form: sequential over chunks, matmuls inside. T need not divide by chunk."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    chunk = min(chunk, t)
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        padt = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        q, k, v, beta, g = map(padt, (q, k, v, beta, g))

    def heads_first(a):  # [B, n*C, H, ...] -> [n, B, H, C, ...]
        a = a.reshape((b, n, chunk) + a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 2, 3)

    xs = tuple(map(heads_first, (q, k, v, beta, g)))

    def body(s, x):
        o, s = _chunk(*x, s)
        return s, o

    state, o = lax.scan(body, state, xs)  # o [n, B, H, C, dv]
    o = jnp.moveaxis(o, 0, 1)  # [B, n, H, C, dv]
    o = jnp.swapaxes(o, 2, 3).reshape(b, n * chunk, h, dv)
    return o[:, :t], state


# ---- tree verification: the ancestor-masked single-chunk form with deferred state (reference §4.5 option 4) -------
import dataclasses as _dataclasses  # noqa: E402


@jax.tree_util.register_dataclass
@_dataclasses.dataclass(frozen=True)
class TreeGDNCache:
    """What `gdn_tree` keeps so that any node's state can be materialised later (`tree_node_state`), heads-first:

    k [B,H,N,dk] (the L2-normalised keys), vp [B,H,N,dv] (pseudo-values V' = U - W S0), gam [B,H,N] (log-decay
    along each root->i path, inclusive), decay [B,H,N,N] (Gam_ij = exp(gam_i - gam_j) for j an ancestor of i or i
    itself, else 0).
    """

    k: jax.Array
    vp: jax.Array
    gam: jax.Array
    decay: jax.Array


def gdn_tree(q, k, v, beta, g, state, ancestors, slots=None):
    """:func:`gdn_tree_reference`'s contract through the kernel registry's ``"gdn_tree"`` op (on a GPU the Pallas
    kernel for launches of one resident wave, e.g. the 27B at B1; see ``pallas_kernels.gdn.gdn_tree_pallas``)."""
    from pallas_kernels import registry

    return registry.get("gdn_tree")(q, k, v, beta, g, state, ancestors, slots)


def gdn_tree_reference(q, k, v, beta, g, state, ancestors, slots=None):
    """Gated delta rule over B token trees of N slots each, in one ancestor-masked chunk.

    q, k [B,N,H,dk], v [B,N,H,dv], beta, g [B,N,H] (as for `gdn_recurrent`), state [B,H,dk,dv] = S0 (the state
    before the root), ancestors [B,N,N] bool: A_ij = j is i or an ancestor of i (reflexive-transitive closure of
    parent). Slots must be in an order where ancestors precede descendants (A lower triangular); a slot whose
    path starts at S0 (a root, or a padding slot that sees only itself) is allowed anywhere. slots [B] (optional):
    state is then every slot's state [S,H,dk,dv] and row b's S0 is state[slots[b]] (the Pallas kernel reads it in
    place).

    Returns (o [B,N,H,dv], TreeGDNCache): o_i is exactly what `gdn_recurrent` gives for slot i when run from S0
    along the root->i path. Exponents are masked before exp (only ancestor pairs, where gam_i - gam_j <= 0 up to
    round-off), so no g <= 0 can overflow; large |gam| only costs ~eps*|gam_i| relative accuracy in Gam (as in
    `_chunk`).
    """
    if slots is not None:
        state = state[slots]
    n = q.shape[1]
    q, k, v = (jnp.moveaxis(a, 2, 1) for a in (q, k, v))  # [B,H,N,d]
    beta, g = (jnp.moveaxis(a, 2, 1) for a in (beta, g))  # [B,H,N]
    f = g.dtype
    eye = jnp.eye(n, dtype=bool)
    anc2 = ancestors.astype(bool) | eye  # [B,N,N] (reflexive even if the caller's is not)
    anc = anc2[:, None]  # [B,1,N,N]
    strict = anc & ~eye
    gam = jnp.einsum("bij,bhj->bhi", anc2.astype(f), g, precision=HI)  # log-decay along each root->i path
    diff = gam[..., :, None] - gam[..., None, :]
    decay = jnp.where(anc, jnp.exp(jnp.where(anc, diff, 0.0)), 0.0)  # Gam_ij [B,H,N,N]
    kk = jnp.einsum("bhid,bhjd->bhij", k, k, precision=HI)
    m = jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    a = jnp.eye(n, dtype=m.dtype) + m  # unit lower triangular in slot order
    dv = v.shape[-1]
    rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(gam))[..., None] * k], axis=-1)
    uw = solve_unit_lower(a, rhs)
    u, w = uw[..., :dv], uw[..., dv:]
    vp = u - jnp.einsum("bhck,bhkv->bhcv", w, state, precision=HI)  # pseudo-values [B,H,N,dv]
    qk = jnp.einsum("bhid,bhjd->bhij", q, k, precision=HI) * decay
    o = (jnp.einsum("bhck,bhkv->bhcv", q * jnp.exp(gam)[..., None], state, precision=HI)
         + jnp.einsum("bhij,bhjv->bhiv", qk, vp, precision=HI))
    return jnp.moveaxis(o, 1, 2), TreeGDNCache(k=k, vp=vp, gam=gam, decay=decay)


def tree_node_states(cache: TreeGDNCache, state0):
    """Every slot's state at once: ``[B, N, H, dk, dv]`` with ``S_i = e^{gam_i} S0 + sum_{j in A(i)} Gam_ij k_j V'_j^T``
    (what the single-sequence fast-rollback commit keeps, then selects from). cache from `gdn_tree`, state0
    [B,H,dk,dv]."""
    s = (jnp.exp(cache.gam)[..., None, None] * state0[:, :, None]
         + jnp.einsum("bhij,bhjk,bhjv->bhikv", cache.decay, cache.k, cache.vp, precision=HI))
    return jnp.moveaxis(s, 2, 1).astype(state0.dtype)


def tree_node_state(cache: TreeGDNCache, state0, node):
    """The state after slot node[b] of row b's tree: S_i = e^{gam_i} S0 + sum_{j in A(i)} Gam_ij k_j V'_j^T.

    cache from `gdn_tree`, state0 [B,H,dk,dv] the S0 given to it, node [B] int (the commit: the deepest accepted
    slot); node < 0 returns state0 unchanged. Returns [B,H,dk,dv].
    """
    n = cache.gam.shape[-1]
    nd = jnp.clip(node, 0, n - 1).astype(jnp.int32)
    row = jnp.take_along_axis(cache.decay, nd[:, None, None, None], axis=2)[:, :, 0]  # [B,H,N]
    gi = jnp.take_along_axis(cache.gam, nd[:, None, None], axis=2)[..., 0]  # [B,H]
    s = (state0 * jnp.exp(gi)[..., None, None]
         + jnp.einsum("bhnk,bhnv->bhkv", cache.k * row[..., None], cache.vp, precision=HI))
    return jnp.where((node >= 0)[:, None, None, None], s.astype(state0.dtype), state0)


def tree_commit(ssm_all, slots, cache: TreeGDNCache, node):
    """:func:`tree_commit_reference`'s contract through the kernel registry's ``"gdn_tree_commit"`` op (on a GPU the
    Pallas kernel ``pallas_kernels.gdn.commit``, the slots' state updated in place)."""
    from pallas_kernels import registry

    return registry.get("gdn_tree_commit")(ssm_all, slots, cache, node)


def tree_commit_reference(ssm_all, slots, cache: TreeGDNCache, node):
    """The accepted path committed into every slot's state: row b's slot ``slots[b]`` becomes
    :func:`tree_node_state` of its tree at ``node[b]``, from the state the slot holds (the S0 its tree was verified
    from).

    ssm_all [S,H,dk,dv] every slot's state; slots [B] (0 = null: not written); cache from `gdn_tree` over the B
    trees; node [B] (< 0: the slot is left as it is). Returns ssm_all with those rows updated.
    """
    s0 = ssm_all[slots]
    s1 = tree_node_state(cache, s0.astype(cache.vp.dtype), node)
    return set_rows_where(ssm_all, (slots,), s1, slots > 0)
