"""KVFlash page scoring on the device (``bounds`` and ``shadow``): a summary of every scored page and the latest
target queries of every slot stay in device tables; a re-ranking moves only the page scores back to the host.

Host-side scoring (``kvflash.bound_scores``, the reference) needed every decode step's queries (``[B, L, H, D]``
float32) and every page's bounds (``[2, L, Hkv, D]``) on the host, and a re-rank of one 27B sequence of 128 pages
was ~0.4 G multiply-adds of NumPy: at C16 most of a decode step's time. Here:

* ``table``: one row per logical page id (``Residency`` gives every logical page an id for its lifetime,
  ``_Page.pid``); ``write`` fills the rows of newly full pages from their physical pages. By ``kind``:

  - ``bounds`` (Quest-style): ``([n_ids, 2, L, Hkv, D],)``, each page's elementwise key min and max (the KV dtype:
    exact in it; float32 for quantized pages, whose keys are dequantized). Scores: ``kvflash.bound_scores``.
  - ``shadow``: ``(data uint8 [n_ids, P, L, Hkv, D / 2], scale float16 [n_ids, P, L, Hkv, D / blk])``, every key
    of the page in packed 4-bit (llama.cpp Q4_0 values per ``blk`` = 32 dimensions, ``shadow_block``): a key
    shadow of the whole history, an eighth of its bf16 K/V bytes (the bounds: a sixteenth). Scores:
    ``kvflash.shadow_scores``, the target's own attention share of each page, computed exactly over the
    shadow keys of the candidates and of the sequence's protected full pages (``context``). On the shipped
    needle set it ranks a needle's pages within the top 7 of ~59 where the bounds' looser estimate reaches 16
    (a resident quota of ~11 pages at a 25 % pool).

* ``queries``: ``[n_slots, Q, L, H, D]`` float32, each slot's latest Q rotated target queries, newest last;
  ``push`` appends a step's ``StepOutput.query`` (the last ``counts[i]`` of its ``T`` positions per row).
* ``score``: for sequences ``(slot, n_query, page ids, context ids)`` the scores of the pages over the slot's
  latest ``n_query`` queries, one call for a batch of sequences (``lax.map`` over rows, so memory is one
  sequence's at a time; ``shadow`` also maps over blocks of ``SHADOW_CHUNK`` pages), ``[S, N]`` float32 back.

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
from dflash_jax.models.quant import F16_MAX, INT4_MAX, INT4_MIN, pack_int4, unpack_int4
from dflash_jax.state import EngineState

KINDS = ("bounds", "shadow")
ROW_BUCKETS = (1, 4, 16, 64)  # sequences scored in one call
MIN_PAGE_BUCKET = 16  # candidate + context pages per sequence: powers of two from this
SHADOW_CHUNK = 16  # pages whose shadow keys are dequantized at once (a divisor of MIN_PAGE_BUCKET; 27B: 67 MB)


def _pow2_at_least(n: int, lo: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


def shadow_block(head_dim: int) -> int:
    """Dimensions per float16 scale of the key shadow: 32 (Q4_0's block) where it divides ``head_dim``, else all."""
    return 32 if head_dim % 32 == 0 else head_dim


def _page_keys(ks: tuple, idx: jax.Array) -> jax.Array:
    """``ks[i] [n_pages, P, Hkv, D]`` (or ``QuantizedPages``), idx ``[n]`` -> ``[n, P, L, Hkv, D]`` float32."""
    return jnp.stack([kv_quant.take(k, idx).astype(jnp.float32) for k in ks], axis=2)


def _key_bounds(ks: tuple, idx: jax.Array) -> jax.Array:
    """Elementwise min and max of each page's keys -> ``[n, 2, L, Hkv, D]`` float32."""
    k = _page_keys(ks, idx)
    return jnp.stack([k.min(axis=1), k.max(axis=1)], axis=1)


def quantize_shadow(k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys ``[..., D]`` -> (packed int4 ``uint8 [..., D / 2]``, float16 scales ``[..., D / blk]``): per block of
    ``shadow_block(D)`` dimensions ``scale = m / -8`` with ``m`` the block's element of largest magnitude, values
    ``clip(round(k / scale), -8, 7)`` (Q4_0's rule, as ``models.quant.quantize_int4``)."""
    *lead, d = k.shape
    blk = shadow_block(d)
    kb = k.astype(jnp.float32).reshape(*lead, d // blk, blk)
    m = jnp.take_along_axis(kb, jnp.argmax(jnp.abs(kb), axis=-1)[..., None], axis=-1)
    scale = jnp.clip(m / -8.0, -F16_MAX, F16_MAX).astype(jnp.float16)
    s = scale.astype(jnp.float32)
    q = jnp.where(s != 0, jnp.clip(jnp.round(kb / jnp.where(s != 0, s, 1.0)), INT4_MIN, INT4_MAX), 0)
    return pack_int4(q.astype(jnp.int8).reshape(*lead, d)), scale[..., 0]


def dequantize_shadow(data: jax.Array, scale: jax.Array) -> jax.Array:
    """``quantize_shadow``'s output -> float32 keys ``[..., D]``."""
    q = unpack_int4(data).astype(jnp.float32)
    *lead, d = q.shape
    nb = scale.shape[-1]
    return (q.reshape(*lead, nb, d // nb) * scale.astype(jnp.float32)[..., None]).reshape(*lead, d)


def _write(kind: str, table: tuple, ks: tuple, phys: jax.Array, ids: jax.Array) -> tuple:
    """Rows ``ids [b]`` of ``table`` <- the summaries of physical pages ``phys [b]`` (``ids < 0``: padding)."""
    idx = jnp.maximum(phys, 0)
    if kind == "bounds":
        rows = (_key_bounds(ks, idx).astype(table[0].dtype),)  # [b, 2, L, Hkv, D]
    else:
        rows = quantize_shadow(_page_keys(ks, idx))  # [b, P, L, Hkv, D / 2], [b, P, L, Hkv, D / blk]
    return tuple(set_rows_where(t, (ids,), r, ids >= 0) for t, r in zip(table, rows))


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


def _log_shares(logit: jax.Array, ok: jax.Array) -> jax.Array:
    """``logit [Q, N, L, Hkv, g]`` (per page) -> log shares over the pages where ``ok [N]``, -inf elsewhere."""
    okb = ok[None, :, None, None, None]
    logit = jnp.where(okb, logit, -jnp.inf)
    m = jnp.max(logit, axis=1, keepdims=True)
    return jnp.where(okb, logit - (m + jnp.log(jnp.sum(jnp.exp(logit - m), axis=1, keepdims=True))), -jnp.inf)


def _scores(kind: str, table: tuple, window: jax.Array, slots: jax.Array, n_query: jax.Array, ids: jax.Array,
            n_pages: jax.Array, n_ctx: jax.Array) -> jax.Array:
    """``[S]`` slots, ``[S]`` valid queries (the newest), ``[S, N]`` page ids of which the first ``n_pages`` are
    candidates and the next ``n_ctx`` context (``shadow``: in the normalisation, not scored; ``bounds`` ignores
    them) -> ``[S, N]`` log attention shares (``kvflash.bound_scores`` / ``shadow_scores``; -inf past
    ``n_pages``)."""
    nq_max, n = window.shape[1], ids.shape[1]

    def one(args):
        slot, nq, pid, npg, nctx = args
        _, layers, h, d = window.shape[1:]
        n_kv = table[0].shape[3]
        q = window[slot].reshape(nq_max, layers, n_kv, h // n_kv, d)  # [Q, L, Hkv, g, D]
        if kind == "bounds":
            bnd = table[0][pid].astype(jnp.float32)  # [N, 2, L, Hkv, D]
            logit = (jnp.einsum("qlkgd,nlkd->qnlkg", jnp.maximum(q, 0), bnd[:, 1])
                     + jnp.einsum("qlkgd,nlkd->qnlkg", jnp.minimum(q, 0), bnd[:, 0])) * d ** -0.5
            in_norm = jnp.arange(n) < npg
        else:
            def chunk(pc):  # [C] page ids -> [Q, C, L, Hkv, g]: log-sum-exp of each page's logits
                k = dequantize_shadow(table[0][pc], table[1][pc])  # [C, P, L, Hkv, D]
                lg = jnp.einsum("qlkgd,cplkd->qcplkg", q, k) * d ** -0.5
                m = jnp.max(lg, axis=2)
                return m + jnp.log(jnp.sum(jnp.exp(lg - m[:, :, None]), axis=2))

            c = min(SHADOW_CHUNK, n)
            per = jax.lax.map(chunk, pid.reshape(n // c, c))  # [N / C, Q, C, L, Hkv, g]
            logit = jnp.moveaxis(per, 0, 1).reshape((nq_max, n) + per.shape[3:])
            in_norm = jnp.arange(n) < npg + nctx
        share = _log_shares(logit, in_norm)
        q_ok = (jnp.arange(nq_max) >= nq_max - nq)[:, None, None, None, None]
        cand = (jnp.arange(n) < npg)[None, :, None, None, None]
        return jnp.where(q_ok & cand, share, -jnp.inf).max(axis=(0, 2, 3, 4))

    return jax.lax.map(one, (slots, n_query, ids, n_pages, n_ctx))


class DeviceScorer:
    """Device tables and jitted operations of ``bounds`` / ``shadow`` scoring for an engine's ``state`` (see the
    module doc)."""

    def __init__(self, state: EngineState, n_ids: int, n_slots: int, n_heads: int, window: int,
                 max_pages: int, kind: str = "bounds") -> None:
        """n_ids: logical page ids (the residency's host pages); n_slots: recurrent slots (incl. the null slot 0);
        n_heads: the target's query heads; window: queries kept per slot; max_pages: most pages one sequence has
        (the page-table width): the largest page bucket covers them and the protected ones."""
        if kind not in KINDS:
            raise ValueError(f"device scoring kind must be one of {KINDS}, got {kind!r}")
        k0 = state.kv.k[0]
        quant = isinstance(k0, QuantizedPages)
        shape = (k0.data if quant else k0).shape  # [n_pages, P, Hkv, D]
        self.kind = kind
        self.n_layers, self.page_size, self.n_kv, self.head_dim = len(state.kv.k), shape[1], shape[2], shape[3]
        if kind == "shadow" and self.head_dim % 2:
            raise ValueError(f"shadow scoring packs two 4-bit keys a byte: head_dim {self.head_dim} must be even")
        self.dtype = self.bounds_dtype(k0.dtype, quant)
        self.n_ids, self.n_slots, self.n_heads, self.window = n_ids, n_slots, n_heads, window
        top = _pow2_at_least(max_pages, MIN_PAGE_BUCKET)
        self.page_buckets = tuple(b for b in (MIN_PAGE_BUCKET * 2 ** i for i in range(32)) if b <= top)
        seqs = max(1, n_slots - 1)  # sequences running at once
        self.row_buckets = tuple(b for b in ROW_BUCKETS if b < seqs) + tuple(
            b for b in ROW_BUCKETS if b >= seqs)[:1]
        dev = next(iter(jax.tree_util.tree_leaves(k0)[0].devices()))
        self.table = tuple(jax.device_put(jnp.zeros(sh, dt), dev) for sh, dt in self.table_shapes(
            kind, n_ids, self.n_layers, self.page_size, self.n_kv, self.head_dim, self.dtype))
        self.queries = jax.device_put(
            jnp.zeros((n_slots, window, self.n_layers, n_heads, self.head_dim), jnp.float32), dev)
        self._write = jax.jit(lambda *a: _write(kind, *a), donate_argnums=(0,))
        self._push = jax.jit(_push, donate_argnums=(0,))
        self._score = jax.jit(lambda *a: _scores(kind, *a))
        self._exec: dict[tuple, object] = {}
        self.lazy_compiles = 0

    @staticmethod
    def bounds_dtype(kv_dtype, quantized: bool) -> jnp.dtype:
        """The dtype of the bounds table: the pages' own (bf16 / f32), float32 over fp8 / int8 pages (their
        dequantized keys)."""
        return jnp.dtype(jnp.float32 if quantized else kv_dtype)

    @staticmethod
    def table_shapes(kind: str, n_ids: int, n_layers: int, page_size: int, n_kv: int, head_dim: int,
                     dtype) -> list[tuple[tuple[int, ...], jnp.dtype]]:
        """(shape, dtype) of each array of the page table of ``kind``."""
        if kind == "bounds":
            return [((n_ids, 2, n_layers, n_kv, head_dim), jnp.dtype(dtype))]
        lead = (n_ids, page_size, n_layers, n_kv)
        return [(lead + (head_dim // 2,), jnp.dtype(jnp.uint8)),
                (lead + (head_dim // shadow_block(head_dim),), jnp.dtype(jnp.float16))]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.table) + self.queries.nbytes

    @classmethod
    def table_bytes(cls, kind: str, n_ids: int, n_slots: int, n_layers: int, page_size: int, n_kv: int,
                    n_heads: int, head_dim: int, window: int, dtype) -> int:
        """Device bytes of the tables (for sizing the resident pool before they exist)."""
        pages = sum(int(np.prod(sh)) * dt.itemsize for sh, dt in cls.table_shapes(
            kind, n_ids, n_layers, page_size, n_kv, head_dim, dtype))
        return pages + n_slots * window * n_layers * n_heads * head_dim * 4

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
        return self._get(("write", b), lambda: self._write.lower(
            tuple(spec(t) for t in self.table), jax.tree_util.tree_map(spec, ks), idx, idx))

    def _push_exec(self, b: int, t: int):
        q = jax.ShapeDtypeStruct((b, t) + self.queries.shape[2:], jnp.float32)
        v = jax.ShapeDtypeStruct((b,), jnp.int32)
        return self._get(("push", b, t), lambda: self._push.lower(self.queries, q, v, v))

    def _score_exec(self, s: int, n: int):
        v = jax.ShapeDtypeStruct((s,), jnp.int32)
        ids = jax.ShapeDtypeStruct((s, n), jnp.int32)
        return self._get(("score", s, n), lambda: self._score.lower(self.table, self.queries, v, v, ids, v, v))

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
        """Table rows ``ids`` <- the summaries of physical pages ``phys`` (asynchronous)."""
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
            self.table = self._write_exec(ks, b)(self.table, ks, p, d)

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

    def score(self, items: Sequence[tuple[int, int, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """``(slot, n_query, page ids [n], context ids [c])`` per sequence -> its page scores ``[n]`` float32
        (blocks). Context pages (a sequence's protected full pages) join ``shadow``'s normalisation; ``bounds``
        does not read them."""
        if self.kind != "shadow":
            items = [(slot, q, pid, ctx[:0]) for slot, q, pid, ctx in items]
        out: list[np.ndarray | None] = [None] * len(items)
        by_n: dict[int, list[int]] = {}
        for i, (_, _, ids, ctx) in enumerate(items):
            by_n.setdefault(_bucket(self.page_buckets, len(ids) + len(ctx)), []).append(i)
        pending = []
        for n, rows in sorted(by_n.items()):
            top = self.row_buckets[-1]
            for j in range(0, len(rows), top):
                part = rows[j: j + top]
                s = _bucket(self.row_buckets, len(part))
                slots, nq, npg, nctx = (np.zeros(s, np.int32) for _ in range(4))
                ids = np.zeros((s, n), np.int32)
                for k, i in enumerate(part):
                    slot, q, pid, ctx = items[i]
                    slots[k], nq[k], npg[k], nctx[k] = slot, min(q, self.window), len(pid), len(ctx)
                    ids[k, : len(pid)] = pid
                    ids[k, len(pid): len(pid) + len(ctx)] = ctx
                pending.append((part, self._score_exec(s, n)(self.table, self.queries, slots, nq, ids, npg, nctx)))
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
