"""KVFlash ``bounds`` scoring on the device: the key bounds of every scored page and the latest target queries of
every slot stay in device tables; a re-ranking moves only the page scores back to the host.

Host-side scoring (``kvflash.bound_scores``, the reference) needed every decode step's queries (``[B, L, H, D]``
float32) and every page's bounds (``[2, L, Hkv, D]``) on the host, and a re-rank of one 27B sequence of 128 pages
was ~0.4 G multiply-adds of NumPy: at C16 most of a decode step's time. Here:

* ``bounds``: ``[n_ids, 2, L, Hkv, D]`` (the KV dtype: the min and max of stored keys are exact in it; float32 for
  quantized pages, whose keys are dequantized), one row per logical page id (``Residency`` gives every logical page
  an id for its lifetime, ``_Page.pid``); ``write`` fills the rows of newly full pages from their physical pages.
* ``queries``: ``[n_slots, Q, L, H, D]`` float32, each slot's latest Q rotated target queries, newest last;
  ``push`` appends a step's ``StepOutput.query`` (the last ``counts[i]`` of its ``T`` positions per row).
* ``score``: for sequences ``(slot, n_query, page ids)`` the Quest-style score of ``bound_scores`` over the
  slot's latest ``n_query`` queries, one call for a batch of sequences (``lax.map`` over rows, so memory is one
  sequence's ``[Q, N, L, H]`` at a time), ``[S, N]`` float32 back.

All three are jitted with donated tables and compiled per bucket (``warmup``): writes per page bucket, pushes per
step shape, scores per (rows, pages) bucket (powers of two). Writes and pushes are asynchronous.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kv import quant as kv_quant
from dflash_jax.kv.kvflash_device import BUCKETS
from dflash_jax.kv.quant import QuantizedPages
from dflash_jax.kv.scatter import set_rows_where
from dflash_jax.state import EngineState

ROW_BUCKETS = (1, 4, 16, 64)  # sequences scored in one call
MIN_PAGE_BUCKET = 16  # candidate pages per sequence: powers of two from this


def _pow2_at_least(n: int, lo: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


def _key_bounds(ks: tuple, idx: jax.Array) -> jax.Array:
    """Elementwise min and max of each page's keys: ``ks[i] [n_pages, P, Hkv, D]`` (or ``QuantizedPages``), idx
    ``[n]`` -> ``[n, 2, len(ks), Hkv, D]`` float32."""
    k = jnp.stack([kv_quant.take(k, idx).astype(jnp.float32) for k in ks], axis=2)  # [n, P, L, Hkv, D]
    return jnp.stack([k.min(axis=1), k.max(axis=1)], axis=1)


def _write(table: jax.Array, ks: tuple, phys: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows ``ids [b]`` of ``table`` <- the key bounds of physical pages ``phys [b]`` (``ids < 0``: padding)."""
    b = _key_bounds(ks, jnp.maximum(phys, 0)).astype(table.dtype)  # [b, 2, L, Hkv, D]
    return set_rows_where(table, (ids,), b, ids >= 0)


def _push(window: jax.Array, query: jax.Array, slots: jax.Array, counts: jax.Array) -> jax.Array:
    """window ``[n_slots, Q, ...]`` (newest last); query ``[b, T, ...]`` whose row i's valid positions are its last
    ``counts[i]`` (<= T); row i's window becomes the last Q of (its window, those positions). ``counts == 0``: not
    written (padding rows)."""
    nq, t = window.shape[1], query.shape[1]
    m = jnp.minimum(counts, t)[:, None]  # [b, 1]
    j = jnp.arange(nq)[None]  # [1, Q]
    # position j of the new window: the old window's entry j + m while that is inside it, else query entry
    # T - Q + j (those are the row's newest m positions, oldest first)
    both = jnp.concatenate([window[slots], query.astype(window.dtype)], axis=1)  # [b, Q + T, ...]
    idx = jnp.where(j + m < nq, j + m, t + j)
    new = jnp.take_along_axis(both, idx.reshape(idx.shape + (1,) * (both.ndim - 2)), axis=1)
    return set_rows_where(window, (slots,), new, counts > 0)


def _scores(table: jax.Array, window: jax.Array, slots: jax.Array, n_query: jax.Array, ids: jax.Array,
            n_pages: jax.Array) -> jax.Array:
    """``[S]`` slots, ``[S]`` valid queries (the newest), ``[S, N]`` page ids of which the first ``n_pages`` are
    candidates -> ``[S, N]`` log attention share bounds (``kvflash.bound_scores``; -inf past ``n_pages``)."""
    nq_max, n = window.shape[1], ids.shape[1]
    n_kv, d = table.shape[3], table.shape[4]

    def one(args):
        slot, nq, pid, npg = args
        q = window[slot]  # [Q, L, H, D]
        layers, h = q.shape[1], q.shape[2]
        g = h // n_kv
        q = q.reshape(nq_max, layers, n_kv, g, d)
        bnd = table[pid].astype(jnp.float32)  # [N, 2, L, Hkv, D]
        ub = (jnp.einsum("qlkgd,nlkd->qnlkg", jnp.maximum(q, 0), bnd[:, 1])
              + jnp.einsum("qlkgd,nlkd->qnlkg", jnp.minimum(q, 0), bnd[:, 0])) * d ** -0.5
        page_ok = (jnp.arange(n) < npg)[None, :, None, None, None]
        ub = jnp.where(page_ok, ub, -jnp.inf)
        m = jnp.max(ub, axis=1, keepdims=True)
        share = ub - (m + jnp.log(jnp.sum(jnp.exp(ub - m), axis=1, keepdims=True)))
        q_ok = (jnp.arange(nq_max) >= nq_max - nq)[:, None, None, None, None]
        share = jnp.where(q_ok & page_ok, share, -jnp.inf)
        return share.max(axis=(0, 2, 3, 4))

    return jax.lax.map(one, (slots, n_query, ids, n_pages))


class DeviceBounds:
    """Device tables and jitted operations of ``bounds`` scoring for an engine's ``state`` (see the module doc)."""

    def __init__(self, state: EngineState, n_ids: int, n_slots: int, n_heads: int, window: int,
                 max_pages: int) -> None:
        """n_ids: logical page ids (the residency's host pages); n_slots: recurrent slots (incl. the null slot 0);
        n_heads: the target's query heads; window: queries kept per slot; max_pages: most pages one sequence has
        (the page-table width): the largest page bucket."""
        k0 = state.kv.k[0]
        quant = isinstance(k0, QuantizedPages)
        shape = (k0.data if quant else k0).shape  # [n_pages, P, Hkv, D]
        self.n_layers, self.n_kv, self.head_dim = len(state.kv.k), shape[2], shape[3]
        self.dtype = jnp.dtype(jnp.float32 if quant else k0.dtype)
        self.n_ids, self.n_slots, self.n_heads, self.window = n_ids, n_slots, n_heads, window
        top = _pow2_at_least(max_pages, MIN_PAGE_BUCKET)
        self.page_buckets = tuple(b for b in (MIN_PAGE_BUCKET * 2 ** i for i in range(32)) if b <= top)
        seqs = max(1, n_slots - 1)  # sequences running at once
        self.row_buckets = tuple(b for b in ROW_BUCKETS if b < seqs) + tuple(
            b for b in ROW_BUCKETS if b >= seqs)[:1]
        dev = next(iter(jax.tree_util.tree_leaves(k0)[0].devices()))
        self.bounds = jax.device_put(jnp.zeros((n_ids, 2, self.n_layers, self.n_kv, self.head_dim), self.dtype), dev)
        self.queries = jax.device_put(
            jnp.zeros((n_slots, window, self.n_layers, n_heads, self.head_dim), jnp.float32), dev)
        self._write = jax.jit(_write, donate_argnums=(0,))
        self._push = jax.jit(_push, donate_argnums=(0,))
        self._score = jax.jit(_scores)
        self._exec: dict[tuple, object] = {}
        self.lazy_compiles = 0

    @property
    def nbytes(self) -> int:
        return self.bounds.nbytes + self.queries.nbytes

    @staticmethod
    def table_bytes(n_ids: int, n_slots: int, n_layers: int, n_kv: int, n_heads: int, head_dim: int, window: int,
                    itemsize: int) -> int:
        """Device bytes of the two tables (for sizing the resident pool before they exist)."""
        return n_ids * 2 * n_layers * n_kv * head_dim * itemsize + n_slots * window * n_layers * n_heads * head_dim * 4

    # ---- compiled executables ------------------------------------------------------------------------------------
    def _get(self, key: tuple, lower):
        fn = self._exec.get(key)
        if fn is None:
            self.lazy_compiles += 1
            fn = self._exec[key] = lower().compile()
        return fn

    def _write_exec(self, ks: tuple, b: int):
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        idx = jax.ShapeDtypeStruct((b,), jnp.int32)
        return self._get(("write", b), lambda: self._write.lower(spec(self.bounds), jax.tree_util.tree_map(spec, ks),
                                                                 idx, idx))

    def _push_exec(self, b: int, t: int):
        q = jax.ShapeDtypeStruct((b, t) + self.queries.shape[2:], jnp.float32)
        v = jax.ShapeDtypeStruct((b,), jnp.int32)
        return self._get(("push", b, t), lambda: self._push.lower(self.queries, q, v, v))

    def _score_exec(self, s: int, n: int):
        v = jax.ShapeDtypeStruct((s,), jnp.int32)
        ids = jax.ShapeDtypeStruct((s, n), jnp.int32)
        return self._get(("score", s, n), lambda: self._score.lower(self.bounds, self.queries, v, v, ids, v))

    def warmup(self, state: EngineState, step_shapes: Sequence[tuple[int, int]]) -> None:
        """Compile every write bucket, a push per step shape ``(rows, query positions)`` and every score bucket."""
        ks = tuple(state.kv.k)
        for b in BUCKETS:
            self._write_exec(ks, b)
        for b, t in step_shapes:
            self._push_exec(b, t)
        for s in self.row_buckets:
            for n in self.page_buckets:
                self._score_exec(s, n)
        self.lazy_compiles = 0

    # ---- operations ----------------------------------------------------------------------------------------------
    def write(self, state: EngineState, phys: Sequence[int], ids: Sequence[int]) -> None:
        """Bounds rows ``ids`` <- the key bounds of physical pages ``phys`` (asynchronous)."""
        ks = tuple(state.kv.k)
        phys, ids = list(phys), list(ids)
        top = BUCKETS[-1]
        for i in range(0, len(phys), top):
            part = phys[i: i + top]
            b = _bucket(BUCKETS, len(part))
            p = np.zeros(b, np.int32)
            p[: len(part)] = part
            d = np.full(b, -1, np.int32)
            d[: len(part)] = ids[i: i + top]
            self.bounds = self._write_exec(ks, b)(self.bounds, ks, p, d)

    def push(self, query: jax.Array, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Append each row's newest ``counts[i]`` positions of ``query [b, T, L, H, D]`` (a step's
        ``StepOutput.query``, still on the device) to slot ``slots[i]``'s window (asynchronous). Rows past
        ``len(slots)`` and rows with a count of 0 are not written."""
        b, t = query.shape[:2]
        sl = np.zeros(b, np.int32)
        sl[: len(slots)] = slots
        ct = np.zeros(b, np.int32)
        ct[: len(counts)] = counts
        self.queries = self._push_exec(b, t)(self.queries, query, sl, ct)

    def score(self, items: Sequence[tuple[int, int, np.ndarray]]) -> list[np.ndarray]:
        """``(slot, n_query, page ids [n])`` per sequence -> its page scores ``[n]`` float32 (blocks)."""
        out: list[np.ndarray | None] = [None] * len(items)
        by_n: dict[int, list[int]] = {}
        for i, (_, _, ids) in enumerate(items):
            by_n.setdefault(_bucket(self.page_buckets, len(ids)), []).append(i)
        pending = []
        for n, rows in sorted(by_n.items()):
            top = self.row_buckets[-1]
            for j in range(0, len(rows), top):
                part = rows[j: j + top]
                s = _bucket(self.row_buckets, len(part))
                slots = np.zeros(s, np.int32)
                nq = np.zeros(s, np.int32)
                npg = np.zeros(s, np.int32)
                ids = np.zeros((s, n), np.int32)
                for k, i in enumerate(part):
                    slot, q, pid = items[i]
                    slots[k], nq[k], npg[k] = slot, min(q, self.window), len(pid)
                    ids[k, : len(pid)] = pid
                pending.append((part, self._score_exec(s, n)(self.bounds, self.queries, slots, nq, ids, npg)))
        for part, sc in pending:
            host = np.asarray(sc)
            for k, i in enumerate(part):
                out[i] = host[k, : len(items[i][2])]
        return out


def _bucket(buckets: Sequence[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
