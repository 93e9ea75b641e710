"""Pallas (Triton lowering) kernel for the gated delta rule over token trees: the ancestor-masked single-chunk form
of ``dflash_jax.models.gdn.gdn_tree_reference`` (tree verification), fp32 state.

Per (sequence, head) of N tree slots with ancestor mask ``A`` (reflexive; ancestors precede descendants):
``gam = A g`` (log-decay along each root->i path), ``Gam_ij = exp(gam_i - gam_j)`` on ancestor pairs (0 elsewhere),
``M = strict_ancestor(beta_i (k_i . k_j) Gam_ij)`` (strictly lower triangular in slot order), ``T = (I + M)^-1``,
``U = T (beta v)``, ``W = T (beta e^gam k)``, ``V' = U - W S0``, ``o = (q e^gam) S0 + ((q k^T) * Gam) V'``.

Grid ``(B, H, dv / block_v)``: every product is linear in v and S0 column by column, so a program owns
``block_v`` value columns; it loads the ``[N, N]`` ancestor mask of its row once, recomputes the state-independent
``gam``, ``Gam``, ``M``, ``T``, ``W`` (small: N <= 64) and writes ``o`` and ``V'`` for its columns; the programs
of value block 0 also write ``gam``, ``Gam`` and the heads-first keys (``TreeGDNCache.gam`` / ``.decay`` /
``.k``). The kernel's tiles have N padded to a power of two >= 16; the arrays are not padded: the slots past N
are masked on load (zeros: beta = g = 0, k = v = 0, a slot that sees only itself) and on store, so there is no
pad, slice or transpose around the kernel.

The inverse ``T`` (``solve``):

- ``"substitution"`` (default): row-by-row forward substitution ``T_i = e_i - sum_{j<i} M_ij T_j``, each row picked by a
  mask (``where(rows == i)``, a reduction), n_valid - 1 sequential steps of ``[N, N]`` elementwise work (padding
  slots' rows are e_i), in fp32. As stable as the reference's triangular solve (equal to fp32 round-off whatever
  the tree). At batch 1 these dependent steps are most of a launch (a 27B verify tree, 23 slots: ~36 us a layer on
  an H100 before the bound, 48 layers a round).
- ``"blocked"``: the same substitution over the two halves of the slots side by side (ceil(n_valid / 2)
  - 1 steps), then ``T21 = -T22 M21 T11`` by two fp32 ``[N, N]`` products; within 1e-5 of the reference on every
  test tree, the adversarial chain below included. Opt-in: as the default for a commit, the 27B's B1 round on an
  H100 went 26.8 -> 37.8 ms (+230 us a layer) with its two products IEEE fp32 dots inside a tf32x3 launch, while
  at IEEE fp32 throughout the kernel sweep timed it faster than substitution (89.5 vs 101.4 us); the mix is the
  likely cost, not isolated. Its products (and doubling's) now follow a tf32x3 launch; untimed so.
- ``"doubling"``: no row steps at all: the inverses of neighbouring diagonal blocks merged pairwise, ceil(log2
  n_valid) levels of two fp32 ``[N, N]`` products each (the chunked path's ``gdn.unit_lower_inverse``); as exact.
  At IEEE fp32 throughout it timed 87.8 us against substitution's 101.4 (H100, a 27B verify tree at B1); at the
  model's tf32x3 launch it is untimed (``bench kernels --ops gdn_tree --batches 1 --trees 23`` sweeps it).
- ``"product"``: the nilpotent product ``(I + M)^-1 = (I - M)(I + M^2)(I + M^4) ... (I + M^(2^(L-1)))``,
  ``L = ceil(log2 N)``, by 2L - 2 matmuls. Exact in exact arithmetic: ``(M^p)_ij`` sums over chains
  ``i > a_1 > ... > j`` of p strict-ancestor steps, so ``M^p = 0`` for p > depth (the longest root->leaf path in
  edges, <= N - 1), and the product expands to ``sum_{p < 2^L} (-M)^p``. But in floating point it cancels: with
  ``|M_ij| <= 1`` (unit keys, beta in (0, 1), ``Gam <= 1``) the entries of ``M^p`` are bounded only by the
  number of such chains, ``C(i-j-1, p-1)`` on a chain of slots (up to ~3e8 at N = 33, ~5e17 at N = 64), while T
  itself stays O(1). Measured against the fp64 inverse (fp32): random unit keys (``|M| ~ 0.05``) 4e-9 at any
  N; correlated keys on a chain (cosine ~0.9, beta 0.5-1, little decay) 7e-6 at N = 16, 7e-3 at N = 33,
  1e4 at N = 64; identical keys with beta -> 1, g = 0: 6e-5, 24, 3e10. Forward substitution: <= 1.2e-7 on all
  of them. In the kernel (interpret mode, against the jnp reference's triangular solve): substitution keeps o
  and V' within 2e-7 relative on every test tree, the identical-key chain included; the product form is 1.6e-5
  off on that chain at N = 16 and 13x the output's scale at N = 33. So ``"product"`` is kept only as an opt-in
  to time against; trees of draft tokens can be long chains of correlated keys.

Precision (``precision``; default by q's dtype, as :mod:`pallas_kernels.gdn.kernel`): ``"fp32"`` every dot at
HIGHEST; ``"bf16"`` dot operands in bf16 with fp32 accumulation (``T`` solved in fp32, rounded as an operand);
``"tf32x3"`` (GPU only) the dots as three TF32 products.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn.kernel import _dot_dtype_and_precision, default_precision, operand_dtype
from pallas_kernels.registry import check_block_shapes, current_backend, first_fitting

SOLVES = ("substitution", "blocked", "doubling", "product")
MAX_SLOTS = 64  # one register tile of [N, N]; verify trees are budget + 1 <= 33 slots


def padded_slots(n: int) -> int:
    """The kernel's slot count for an N-slot tree: the next power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, 1 << max(0, n - 1).bit_length())


def _inverse_substitution(m: jax.Array, n_valid: int) -> jax.Array:
    """``(I + M)^-1`` of a strictly lower triangular ``[N, N]`` fp32 M, row by row (rows picked by masks). Rows at
    and past ``n_valid`` (padding slots) are zero in M, so their rows of the inverse are e_i: not iterated."""
    n = m.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    eye = (rows == lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(jnp.float32)

    def body(i, t):
        sel = rows == i
        m_i = jnp.sum(jnp.where(sel, m, 0.0), axis=0)  # row i of M, [N] over columns j
        mt = jnp.sum(m_i[:, None] * t, axis=0)  # sum_j M_ij T_j (rows j >= i of t are e_j, M_ij = 0 there)
        return jnp.where(sel, t - mt[None, :], t)

    return lax.fori_loop(1, n_valid, body, eye)


def _inverse_blocked(m: jax.Array, n_valid: int, dot) -> jax.Array:
    """``(I + M)^-1`` as two forward substitutions side by side, over slots ``[0, h)`` and ``[h, n_valid)``
    (``h = ceil(n_valid / 2)``: half the sequential steps), then the off-diagonal block ``T21 = -T22 M21 T11``
    by two ``[N, N]`` products. Step i updates rows i and h + i at once: with the cross block of M left out, row
    i of M and of T lives in columns < h and row h + i in columns >= h, so one masked reduction serves both."""
    n = m.shape[0]
    h = (n_valid + 1) // 2  # n_valid <= n, the padded slots
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    eye = (rows == cols).astype(jnp.float32)
    lower = rows >= h
    cross = lower & (cols < h)
    own = (rows < h) == (cols < h)  # the two diagonal blocks
    md = jnp.where(cross, 0.0, m)

    def body(i, t):
        sel = (rows == i) | (rows == h + i)
        m_i = jnp.sum(jnp.where(sel, md, 0.0), axis=0)  # rows i and h + i of M, disjoint columns
        mt = jnp.sum(m_i[:, None] * t, axis=0)
        return jnp.where(sel & own, t - mt[None, :], t)

    t = lax.fori_loop(1, h, body, eye)  # h >= n_valid - h: both halves done
    x = dot(dot(jnp.where(lower, t, 0.0), jnp.where(cross, m, 0.0)), jnp.where(lower, 0.0, t))
    return t - x


def _inverse_doubling(m: jax.Array, n_valid: int, dot) -> jax.Array:
    """``(I + M)^-1`` by doubling diagonal blocks (``dflash_jax.models.gdn.unit_lower_inverse`` in one tile):
    from the 1x1 blocks, each level turns the inverses of two neighbouring s-blocks into that of their 2s-block,
    ``[[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]``, for every pair at once by masks and two ``[N, N]``
    products: ceil(log2 n_valid) levels and no sequential row steps. Only inverses of diagonal blocks enter the
    products (no series in M), so it is exact like the substitution."""
    n = m.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    t = (rows == cols).astype(jnp.float32)
    s = 1
    while s < n_valid:
        pair = (rows // (2 * s)) == (cols // (2 * s))
        r_low, c_low = (rows // s) % 2 == 1, (cols // s) % 2 == 1
        b_inv = jnp.where(pair & r_low & c_low, t, 0.0)
        a_inv = jnp.where(pair & ~r_low & ~c_low, t, 0.0)
        c = jnp.where(pair & r_low & ~c_low, m, 0.0)
        t = t - dot(dot(b_inv, c), a_inv)
        s *= 2
    return t


def _inverse_product(m: jax.Array, dot) -> jax.Array:
    """``(I + M)^-1 = (I - M)(I + M^2)(I + M^4)...`` of a nilpotent ``[N, N]`` M (see the module docstring)."""
    n = m.shape[0]
    eye = (lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1))
    t = eye.astype(jnp.float32) - m
    p = m
    for _ in range(math.ceil(math.log2(n)) - 1):
        p = dot(p, p)
        t = t + dot(t, p)
    return t


def _softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))


def _tree_kernel(*refs, n_valid: int, precision: str, solve: str, pooled: bool, gated: bool, block_v: int):
    # refs: the delta rule's inputs: q_ref, k_ref [N, dk]; v_ref [N, BV]; beta_ref, g_ref [N]
    #   (gated: the post-conv channels cq_ref, ck_ref [N, dk], cv_ref [N, BV] of this head, braw_ref, araw_ref [N],
    #   valid_ref [N] int8, alog_ref, dtb_ref [Hv] whole: q, k, v, beta, g formed here as ``gdn_qkv_gates`` does);
    # anc_ref [N, N] int8; (pooled: slot_ref [B] and s_ref [S, H, dk, dv] whole, row b's S0 at its slot; else s_ref
    # [dk, BV]); o_ref [N, BV]; vp_ref [N, BV]; gam_ref [N]; decay_ref [N, N]; k_out_ref [N, dk] (heads-first k).
    # N = the padded slot count: slots >= n_valid are past the arrays' ends, masked on load (zeros: beta = g = 0,
    # k = v = 0, a padding slot that sees only itself) and on store.
    refs = list(refs)
    n_in = 8 if gated else 5
    inputs, refs = refs[:n_in], refs[n_in:]
    anc_ref = refs.pop(0)
    if pooled:
        slot_ref, s_pool = refs.pop(0), refs.pop(0)
        s_ref = s_pool.at[slot_ref[pl.program_id(0)], pl.program_id(1), :, pl.ds(pl.program_id(2) * block_v, block_v)]
    else:
        s_ref = refs.pop(0)
    o_ref, vp_ref, gam_ref, decay_ref, k_out_ref = refs
    f32 = jnp.float32
    opd, prec = _dot_dtype_and_precision(precision)
    dot = functools.partial(plt.dot, precision=prec)
    n = anc_ref.shape[0]
    slot = lax.broadcasted_iota(jnp.int32, (n,), 0)
    m0 = m1 = m2 = None  # masks of valid slots [N], rows [N, 1], pairs [N, N]
    if n_valid < n:
        m0 = slot < n_valid
        m1 = m0[:, None]
        m2 = m1 & m0[None, :]

    def load(ref, mask):
        return ref[...] if mask is None else plt.load(ref, mask=mask, other=0)

    def store(ref, x, mask):
        if mask is None:
            ref[...] = x.astype(ref.dtype)
        else:
            plt.store(ref, x.astype(ref.dtype), mask=mask)

    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    anc = (load(anc_ref, m2) != 0) | (rows == cols)  # reflexive even if the caller's is not
    # k is loaded after gam / Gam, q and v after the solve (load_k / load_q / load_v), as before the gated form
    # existed: with q and v loaded up front the 27B B1 round on an H100 went 25.7 -> 35.7 ms (their registers held
    # across the solve's loop, most likely)
    if gated:
        cq_ref, ck_ref, cv_ref, braw_ref, araw_ref, valid_ref, alog_ref, dtb_ref = inputs
        h = pl.program_id(1)
        mask = (load(valid_ref, m0) != 0).astype(f32)  # [N]: 0 on invalid and past-the-end slots
        dk = ck_ref.shape[-1]
        beta = mask / (1.0 + jnp.exp(-load(braw_ref, m0).astype(f32)))
        g = (-jnp.exp(alog_ref[h].astype(f32)) * _softplus(load(araw_ref, m0).astype(f32) + dtb_ref[h].astype(f32))
             * mask)

        def load_k():
            k = load(ck_ref, m1).astype(f32)
            return k * (lax.rsqrt(jnp.sum(k * k, axis=1) + 1e-6) * mask)[:, None]

        def load_v():
            return load(cv_ref, m1).astype(f32) * mask[:, None]

        def load_q():
            q = load(cq_ref, m1).astype(f32)
            return q * lax.rsqrt(jnp.sum(q * q, axis=1) + 1e-6)[:, None] * (dk ** -0.5)
    else:
        q_ref, k_ref, v_ref, beta_ref, g_ref = inputs
        beta = load(beta_ref, m0).astype(f32)
        g = load(g_ref, m0).astype(f32)
        load_k = functools.partial(load, k_ref, m1)
        load_v = functools.partial(load, v_ref, m1)
        load_q = functools.partial(load, q_ref, m1)
    gam = jnp.sum(jnp.where(anc, g[None, :], 0.0), axis=1)  # A g: log-decay along each root->i path
    decay = jnp.where(anc, jnp.exp(jnp.where(anc, gam[:, None] - gam[None, :], 0.0)), 0.0)  # masked before exp
    k_in = load_k()
    k = k_in.astype(opd)
    kk = dot(k, k, trans_b=True)
    m = jnp.where(anc & (rows > cols), beta[:, None] * kk * decay, 0.0)  # strictly lower: what the solve reads
    # The solves' products need fp32 accuracy: tf32x3 on tensor cores where the launch is tf32x3 (NVIDIA), else
    # IEEE fp32 (with IEEE products in a tf32x3 launch the blocked solve cost the 27B round +11 ms on an H100, though
    # at IEEE fp32 throughout it timed faster than substitution).
    exact_dot = functools.partial(plt.dot, precision=prec if precision == "tf32x3" else lax.Precision.HIGHEST)
    if solve == "product":
        t = _inverse_product(m, exact_dot)
    elif solve == "blocked":
        t = _inverse_blocked(m, n_valid, exact_dot)
    elif solve == "doubling":
        t = _inverse_doubling(m, n_valid, exact_dot)
    else:
        t = _inverse_substitution(m, n_valid)
    t_op = t.astype(opd)
    kb = (k.astype(f32) * (beta * jnp.exp(gam))[:, None]).astype(opd)
    vb = (load_v().astype(f32) * beta[:, None]).astype(opd)
    s_op = s_ref[...].astype(f32).astype(opd)
    w = dot(t_op, kb)
    vp = dot(t_op, vb) - dot(w.astype(opd), s_op)  # V' [N, BV]
    q = load_q()
    qg = (q.astype(f32) * jnp.exp(gam)[:, None]).astype(opd)
    p = (dot(q.astype(opd), k, trans_b=True) * decay).astype(opd)
    o = dot(qg, s_op) + dot(p, vp.astype(opd))
    store(o_ref, o, m1)
    store(vp_ref, vp, m1)

    @pl.when(pl.program_id(2) == 0)
    def _():
        store(gam_ref, gam, m0)
        store(decay_ref, decay, m2)
        store(k_out_ref, k_in, m1)


def block_plan(*, n: int, dk: int, dv: int, block_v: int, itemsize: int = 4, smem_budget: int | None = None,
               backend: str | None = None) -> dict:
    """Static tiles of a tree launch for an N-slot tree, checked with :func:`check_block_shapes` (raises
    ValueError). Shared memory is estimated as the loads (q, k ``[Np, dk]``, v ``[Np, block_v]``, the state
    slice ``[dk, block_v]`` in the operand dtype, the int8 mask) plus the dots' staged operands (``T``,
    ``W``, ``P`` and ``V'``)."""
    if n > MAX_SLOTS:
        raise ValueError(f"gdn_tree: {n} tree slots > {MAX_SLOTS} (the kernel holds the [N, N] system in one tile)")
    if dv % block_v:
        raise ValueError(f"gdn_tree: dv={dv} is not a multiple of block_v={block_v}")
    np_ = padded_slots(n)
    parts = {"qk": 2 * np_ * dk * itemsize, "v": np_ * block_v * itemsize, "state": dk * block_v * itemsize,
             "mask": np_ * np_, "t_p": 2 * np_ * np_ * itemsize, "w_kb": 2 * np_ * dk * itemsize,
             "vp": np_ * block_v * itemsize}
    total = check_block_shapes(
        "gdn_tree",
        {"q": (np_, dk), "v": (np_, block_v), "state": (dk, block_v), "mask": (np_, np_)},
        dots={"kk": (np_, np_, dk), "tv": (np_, block_v, np_), "tk": (np_, dk, np_), "ws": (np_, block_v, dk),
              "qs": (np_, block_v, dk), "pv": (np_, block_v, np_)},
        smem=parts, smem_budget=smem_budget, backend=backend)
    return dict(n_pad=np_, n_v_blocks=dv // block_v, smem_bytes=total)


def default_config(n: int, dk: int, dv: int, *, dtype=jnp.float32, backend: str | None = None,
                   smem_budget: int | None = None) -> dict:
    """block_v, num_warps, solve: the widest of 64 / 32 / 16 value columns whose tiles fit the shared-memory budget;
    8 warps once the ``[N, dk]`` tiles (q, k, W, beta e^gam k) pass 4K elements, so that they and the state slice
    stay in registers (~130 fp32 registers per thread at N = 32, dk = 128, block_v = 64). Guesses until the
    H200 sweep (``bench kernels --ops gdn_tree``)."""
    b = backend or current_backend()
    isz = jnp.dtype(operand_dtype(default_precision(dtype))).itemsize
    warps = 8 if padded_slots(n) * dk >= 4096 else 4
    cands = [dict(block_v=bv, num_warps=warps, solve="substitution") for bv in (64, 32, 16) if bv <= dv]
    return first_fitting(cands, lambda c: block_plan(n=n, dk=dk, dv=dv, block_v=c["block_v"], itemsize=isz,
                                                     smem_budget=smem_budget, backend=b)) or dict(
        block_v=min(dv, 64), num_warps=warps, solve="substitution")


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "precision", "solve", "interpret"))
def gdn_tree(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array, state: jax.Array,
             ancestors: jax.Array, slots: jax.Array | None = None, *, block_v: int = 64, num_warps: int = 4,
             precision: str | None = None, solve: str = "substitution", interpret: bool = False):
    """Ancestor-masked gated delta rule over B token trees (``dflash_jax.models.gdn.gdn_tree``'s contract).

    q, k [B, N, H, dk]; v [B, N, H, dv]; beta, g [B, N, H]; state [B, H, dk, dv] (fp32); ancestors [B, N, N]
    (bool or int, nonzero = j is i or an ancestor of i); slots [B] (optional): state is then every slot's state
    ``[S, H, dk, dv]`` and row b starts from ``state[slots[b]]``, read where it is (no gather). Returns
    (o [B, N, H, dv] in v's dtype, ``TreeGDNCache(k [B,H,N,dk], vp [B,H,N,dv], gam [B,H,N], decay [B,H,N,N])``
    with vp / gam / decay in
    state's dtype). ``precision`` / ``solve``: see the module docstring.
    """
    b, n, h, dk = q.shape
    dv = v.shape[-1]
    pooled = slots is not None
    if k.shape != q.shape or v.shape[:3] != (b, n, h) or beta.shape != (b, n, h) or g.shape != (b, n, h) \
            or state.shape[1:] != (h, dk, dv) or (not pooled and state.shape[0] != b) \
            or (pooled and slots.shape != (b,)) or ancestors.shape != (b, n, n):
        raise ValueError(f"gdn_tree: q {q.shape}, k {k.shape}, v {v.shape}, beta {beta.shape}, g {g.shape}, "
                         f"state {state.shape}, ancestors {ancestors.shape}"
                         f"{'' if slots is None else f', slots {slots.shape}'} disagree")
    n_pad = padded_slots(n)
    specs = [
        pl.BlockSpec((None, n_pad, None, dk), lambda i, j, c: (i, 0, j, 0)),          # q
        pl.BlockSpec((None, n_pad, None, dk), lambda i, j, c: (i, 0, j, 0)),          # k
        pl.BlockSpec((None, n_pad, None, block_v), lambda i, j, c: (i, 0, j, c)),     # v columns
        pl.BlockSpec((None, n_pad, None), lambda i, j, c: (i, 0, j)),                 # beta
        pl.BlockSpec((None, n_pad, None), lambda i, j, c: (i, 0, j)),                 # g
    ]
    return _launch("gdn_tree", (q, k, v, beta, g), specs, state, ancestors, slots, b=b, n=n, h=h, dk=dk, dv=dv,
                   o_dtype=v.dtype, k_dtype=k.dtype, gated=False, block_v=block_v, num_warps=num_warps,
                   precision=precision, solve=solve, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("n_k_heads", "block_v", "num_warps", "precision", "solve", "interpret"))
def gdn_tree_gated(c: jax.Array, braw: jax.Array, araw: jax.Array, a_log: jax.Array, dt_bias: jax.Array,
                   valid: jax.Array, state: jax.Array, ancestors: jax.Array, slots: jax.Array | None = None, *,
                   n_k_heads: int, block_v: int = 64, num_warps: int = 4, precision: str | None = None,
                   solve: str = "substitution", interpret: bool = False):
    """:func:`gdn_tree` from a GDN layer's post-conv rows: ``dflash_jax.models.qwen36.gdn_tree_gated``'s contract
    (``gdn_qkv_gates`` then the tree delta rule) in one kernel. Each program reads its head's q / k channels (key
    head ``h // (Hv / n_k_heads)``) and its value columns straight from ``c`` and forms the L2-normalised q, k, the
    masked v and ``beta = sigmoid(b)``, ``g = -exp(A_log) softplus(a + dt_bias)`` in registers, so none of them
    is materialised between the conv and the kernel.

    c [B, N, C] (``[q | k | v]`` channels, the checkpoint's layout), braw, araw [B, N, Hv] (fp32), a_log, dt_bias
    [Hv], valid [B, N]; state, ancestors, slots as :func:`gdn_tree`. Returns (o [B, N, Hv, dv], TreeGDNCache) in
    braw's dtype.
    """
    b, n, ch = c.shape
    hv = braw.shape[-1]
    dv = state.shape[-1]
    dk = state.shape[-2]
    hk = n_k_heads
    key_dim = hk * dk
    pooled = slots is not None
    if 2 * key_dim + hv * dv != ch or hv % hk or braw.shape != (b, n, hv) or araw.shape != (b, n, hv) \
            or a_log.shape != (hv,) or dt_bias.shape != (hv,) or valid.shape != (b, n) \
            or state.shape[1] != hv or (not pooled and state.shape[0] != b) \
            or (pooled and slots.shape != (b,)) or ancestors.shape != (b, n, n):
        raise ValueError(f"gdn_tree_gated: c {c.shape}, braw {braw.shape}, araw {araw.shape}, a_log {a_log.shape}, "
                         f"valid {valid.shape}, state {state.shape}, ancestors {ancestors.shape} disagree for "
                         f"{hk} key heads")
    if (2 * key_dim) % block_v:
        raise ValueError(f"gdn_tree_gated: the value channels start at {2 * key_dim}, not a multiple of "
                         f"block_v={block_v}")
    n_pad, r = padded_slots(n), hv // hk
    v0, vb = 2 * key_dim // block_v, dv // block_v  # the value channels' first block, blocks per head
    specs = [
        pl.BlockSpec((None, n_pad, dk), lambda i, j, c: (i, 0, j // r)),                 # q channels
        pl.BlockSpec((None, n_pad, dk), lambda i, j, c: (i, 0, hk + j // r)),            # k channels
        pl.BlockSpec((None, n_pad, block_v), lambda i, j, c: (i, 0, v0 + j * vb + c)),   # v columns
        pl.BlockSpec((None, n_pad, None), lambda i, j, c: (i, 0, j)),                    # raw beta gate
        pl.BlockSpec((None, n_pad, None), lambda i, j, c: (i, 0, j)),                    # raw decay gate
        pl.BlockSpec((None, n_pad), lambda i, j, c: (i, 0)),                             # valid
        pl.no_block_spec, pl.no_block_spec,                                              # A_log, dt_bias
    ]
    return _launch("gdn_tree_gated", (c, c, c, braw, araw, valid.astype(jnp.int8), a_log, dt_bias), specs, state,
                   ancestors, slots, b=b, n=n, h=hv, dk=dk, dv=dv, o_dtype=braw.dtype, k_dtype=braw.dtype,
                   gated=True, block_v=block_v, num_warps=num_warps, precision=precision, solve=solve,
                   interpret=interpret)


def _launch(name: str, inputs: tuple, specs: list, state, ancestors, slots, *, b: int, n: int, h: int, dk: int,
            dv: int, o_dtype, k_dtype, gated: bool, block_v: int, num_warps: int, precision: str | None, solve: str,
            interpret: bool):
    """The tree kernel over grid ``(B, H, dv / block_v)``: ``inputs`` with their block ``specs``, then the ancestor
    mask and the state (its ``[dk, block_v]`` columns, or with ``slots`` the whole pool, each row's S0 read at its
    slot). Returns (o, TreeGDNCache); blocks of the padded slot count, the slots past n masked in the kernel."""
    from dflash_jax.models.gdn import TreeGDNCache

    if solve not in SOLVES:
        raise ValueError(f"{name}: solve={solve!r}; expected one of {SOLVES}")
    precision = precision or default_precision(o_dtype if gated else inputs[0].dtype)
    if precision == "tf32x3" and interpret:
        raise ValueError(f"{name}: precision='tf32x3' needs a GPU (XLA:CPU has no TF32 dot); use 'fp32'")
    plan = block_plan(n=n, dk=dk, dv=dv, block_v=block_v, itemsize=jnp.dtype(operand_dtype(precision)).itemsize)
    np_ = plan["n_pad"]
    pooled = slots is not None
    kernel = functools.partial(_tree_kernel, n_valid=n, precision=precision, solve=solve, pooled=pooled,
                               gated=gated, block_v=block_v)
    state_specs = ([pl.no_block_spec, pl.no_block_spec] if pooled else  # slots; the whole pool
                   [pl.BlockSpec((None, None, dk, block_v), lambda i, j, c: (i, j, 0, c))])  # state columns
    state_args = (slots.astype(jnp.int32), state) if pooled else (state,)
    sdt = state.dtype
    outs = pl.pallas_call(
        kernel,
        grid=(b, h, plan["n_v_blocks"]),
        in_specs=[*specs, pl.BlockSpec((None, np_, np_), lambda i, j, c: (i, 0, 0)), *state_specs],  # + mask
        out_specs=[
            pl.BlockSpec((None, np_, None, block_v), lambda i, j, c: (i, 0, j, c)),     # o
            pl.BlockSpec((None, None, np_, block_v), lambda i, j, c: (i, j, 0, c)),     # V'
            pl.BlockSpec((None, None, np_), lambda i, j, c: (i, j, 0)),                 # gam (value block 0)
            pl.BlockSpec((None, None, np_, np_), lambda i, j, c: (i, j, 0, 0)),         # Gam (value block 0)
            pl.BlockSpec((None, None, np_, dk), lambda i, j, c: (i, j, 0, 0)),          # k heads-first (block 0)
        ],
        out_shape=[jax.ShapeDtypeStruct((b, n, h, dv), o_dtype),
                   jax.ShapeDtypeStruct((b, h, n, dv), sdt),
                   jax.ShapeDtypeStruct((b, h, n), sdt),
                   jax.ShapeDtypeStruct((b, h, n, n), sdt),
                   jax.ShapeDtypeStruct((b, h, n, dk), k_dtype)],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"{name}_n{np_}_dk{dk}_bv{block_v}_{precision}_{solve}",
    )(*inputs, ancestors.astype(jnp.int8), *state_args)
    o, vp, gam, decay, k_hf = outs
    return o, TreeGDNCache(k=k_hf, vp=vp, gam=gam, decay=decay)
