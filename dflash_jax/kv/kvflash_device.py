"""The device side of KVFlash: host slabs and whole-page copies between the resident pool and host memory.

A *page* moves as one packed slab: for one physical page index, the K and V of every full-attention layer of the
target (``KVPages``) and, with a drafter, of every drafter layer (``DraftKV``, which shares the page tables),
flattened and concatenated: ``[slab_elems]`` in the KV dtype. Quantized pages (``kv.quant.QuantizedPages``) move
both leaves, the fp8 / int8 ``data`` and the float32 ``scale``, bit-cast to bytes: ``[slab_elems]`` uint8, about
half the bytes of a bf16 page (D + 4 bytes per token and KV head instead of 2 D). Whenever the leaves do not share
one dtype the slab is bytes.

* Host memory: ``pinned_host`` where the device offers it (H200, and CPU jaxlib), else ``unpinned_host``, else
  NumPy slabs (one ``[host_pages, slab_elems]`` array allocated once). ``host_kind`` says which is in use. With a
  JAX memory kind each of the ``host_pages`` slab slots holds one host array of the fixed slab shape (JAX arrays
  are immutable, so a page-out writes a fresh array into the slot; the fixed size keeps the XLA host allocator
  from fragmenting).
* Page-out: one jitted gather of up to a bucket of physical pages whose outputs are placed in host memory
  (``out_shardings`` with the host memory kind): XLA issues the device->host copies; the call returns at once.
* Page-in: one jitted call that moves a bucket of host slabs to the device (``device_put`` inside the jit) and
  scatters them into the donated pools (a batched ``device_put`` before a jitted scatter measured 0.72-0.77 of a
  plain host-to-device copy on the H200, this 0.84-0.87: ``experiments/page_in_sweep.py``). Page-outs are
  dispatched before page-ins and before the step (they read pages the others reuse); all
  are asynchronous and ordered by buffer dependencies, so the host waits only when the step's outputs are read.
* Summaries: per page, the mean key of each layer and KV head over the page's tokens, float32, over dequantized keys
  (``kv_quant.take``) when the pages are quantized: of the target's attention layers ``[L*Hkv*D]`` (keys scoring,
  ``summaries``) or of the drafter's full-attention layers' context keys ``[n_full*Hkv_d*hd]`` (drafter scoring,
  ``draft_summaries``; k-normed and RoPE'd as the drafter attends to them; sliding layers never see beyond their
  window, so they do not rank history). Bounds and shadow scoring keep their page tables on the device (``kvflash_scoring``).

Bucket sizes are fixed (``BUCKETS``); ``warmup`` compiles every bucket ahead of time.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kv import quant as kv_quant
from dflash_jax.kv.kvflash import Transfer
from dflash_jax.kv.scatter import set_rows_where
from dflash_jax.state import DraftKV, EngineState, KVPages

BUCKETS = (1, 4, 16, 64)


def host_memory_kind(device: jax.Device) -> str:
    """The host memory kind to back pages with on ``device``: pinned_host > unpinned_host > numpy."""
    kinds = {m.kind for m in device.addressable_memories()}
    for k in ("pinned_host", "unpinned_host"):
        if k in kinds:
            return k
    return "numpy"


def _tensors(kv: KVPages, dkv: DraftKV | None) -> tuple:
    """The page arrays that move, target then drafter: plain arrays or ``QuantizedPages`` (pytrees)."""
    return tuple(kv.k) + tuple(kv.v) + ((tuple(dkv.k) + tuple(dkv.v)) if dkv is not None else ())


def _slab_dtype(leaves: Sequence[jax.Array]) -> jnp.dtype:
    """The leaves' dtype when they share one, else bytes (uint8; each leaf is bit-cast)."""
    dts = {jnp.dtype(t.dtype) for t in leaves}
    return dts.pop() if len(dts) == 1 else jnp.dtype(jnp.uint8)


def _row_elems(t, dtype) -> int:
    """Slab elements of one page of leaf ``t`` ``[n_pages, ...]`` packed as ``dtype``."""
    return math.prod(t.shape[1:]) * jnp.dtype(t.dtype).itemsize // jnp.dtype(dtype).itemsize


def _gather(tensors: tuple, idx: jax.Array) -> jax.Array:
    """[n] physical pages -> [n, slab_elems] packed (in the slab dtype)."""
    leaves = jax.tree_util.tree_leaves(tensors)
    dt = _slab_dtype(leaves)
    rows = []
    for t in leaves:
        g = t[idx]
        if g.dtype != dt:
            g = jax.lax.bitcast_convert_type(g, dt)  # [n, ...] -> [n, ..., itemsize] bytes
        rows.append(g.reshape(idx.shape[0], -1))
    return jnp.concatenate(rows, axis=1)


def _scatter(tensors: tuple, packed: jax.Array, idx: jax.Array) -> tuple:
    """Write ``packed [n, slab_elems]`` (from ``_gather``) into physical pages ``idx [n]`` (0: a padding row, not
    written); bit-exact."""
    leaves, tree = jax.tree_util.tree_flatten(tensors)
    dt = _slab_dtype(leaves)
    out, off = [], 0
    for t in leaves:
        n = _row_elems(t, dt)
        part = packed[:, off: off + n]
        if t.dtype != dt:
            size = jnp.dtype(t.dtype).itemsize
            part = jax.lax.bitcast_convert_type(
                part.reshape((idx.shape[0],) + t.shape[1:] + ((size,) if size > 1 else ())), t.dtype)
        out.append(set_rows_where(t, (idx,), part.reshape((idx.shape[0],) + t.shape[1:]), idx > 0))
        off += n
    return jax.tree_util.tree_unflatten(tree, out)


def _mean_keys(ks: tuple, idx: jax.Array) -> jax.Array:
    """Mean key over each page's tokens: ``ks[i] [n_pages, P, Hkv, D]`` (or ``QuantizedPages``), idx ``[n]`` ->
    ``[n, len(ks)*Hkv*D]`` float32, layers concatenated in order."""
    return jnp.concatenate([jnp.mean(kv_quant.take(k, idx).astype(jnp.float32), axis=1).reshape(idx.shape[0], -1)
                            for k in ks], axis=1)


def _split(tensors: tuple, n_k: int, has_draft: bool, n_dk: int):
    k, v = tensors[:n_k], tensors[n_k: 2 * n_k]
    kv = KVPages(k=k, v=v)
    if not has_draft:
        return kv, None
    rest = tensors[2 * n_k:]
    return kv, DraftKV(k=rest[:n_dk], v=rest[n_dk:])


class KVFlashDevice:
    """Host slabs + jitted page-out / page-in / key summaries for a resident pool of ``n_pages`` pages."""

    def __init__(self, state: EngineState, dkv: DraftKV | None, host_pages: int, device: jax.Device | None = None,
                 host_kind: str | None = None, draft_summary_layers: Sequence[int] = (),
                 target_summaries: bool = True) -> None:
        """draft_summary_layers: the drafter layers whose context keys ``draft_summaries`` averages (its
        full-attention layers, for drafter scoring; empty: no drafter summaries are compiled);
        target_summaries: whether ``warmup`` compiles the target-key summaries (``keys`` scoring uses them; with
        ``bounds``, ``drafter`` or ``lru`` scoring they would only cost start-up time)."""
        leaves = jax.tree_util.tree_leaves(_tensors(state.kv, dkv))
        self.device = device or next(iter(leaves[0].devices()))
        self.host_kind = host_kind or host_memory_kind(self.device)
        self.dtype = _slab_dtype(leaves)  # of the slabs: the KV dtype, or uint8 for quantized / mixed pages
        self.n_k, self.has_draft = len(state.kv.k), dkv is not None
        self.n_dk = len(dkv.k) if dkv is not None else 0
        self.slab_elems = sum(_row_elems(t, self.dtype) for t in leaves)
        self.slab_bytes = self.slab_elems * self.dtype.itemsize  # every byte of a page: data and scales
        self.host_pages = host_pages
        if self.host_kind == "numpy":
            self.slabs: list | np.ndarray = np.zeros((host_pages, self.slab_elems), self.dtype)
            self._host = None
        else:
            self.slabs = [None] * host_pages
            self._host = jax.sharding.SingleDeviceSharding(self.device, memory_kind=self.host_kind)
        self._dev = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
        self._zero_slab = None
        self._out: dict[int, object] = {}
        self._in: dict[int, object] = {}
        self._sum: dict[tuple[str, int], object] = {}  # ("target" | "draft", bucket) -> jitted mean keys
        self.draft_summary_layers = tuple(draft_summary_layers)
        self.target_summaries = target_summaries
        if self.draft_summary_layers and dkv is None:
            raise ValueError("drafter summaries need the drafter's context pages (DraftKV)")
        self.lazy_compiles = 0

    @property
    def host_bytes(self) -> int:
        return self.host_pages * self.slab_bytes

    # ---- jitted functions (one per bucket) -------------------------------------------------------------------------
    def _out_fn(self, b: int):
        if b not in self._out:
            if self._host is None:
                fn = jax.jit(_gather)
            else:
                def f(tensors, idx):
                    g = _gather(tensors, idx)
                    return tuple(g[i] for i in range(b))
                fn = jax.jit(f, out_shardings=tuple([self._host] * b))
            self._out[b] = fn
        return self._out[b]

    def _in_fn(self, b: int):
        if b not in self._in:
            if self._host is None:
                fn = jax.jit(_scatter, donate_argnums=(0,))
            else:
                dev = self._dev

                def f(tensors, slabs, idx):
                    packed = jnp.stack([jax.device_put(s, dev) for s in slabs])
                    return _scatter(tensors, packed, idx)
                fn = jax.jit(f, donate_argnums=(0,))
            self._in[b] = fn
        return self._in[b]

    def _sum_fn(self, b: int, source: str = "target"):
        if (source, b) not in self._sum:
            self._sum[(source, b)] = jax.jit(_mean_keys)
        return self._sum[(source, b)]

    def _draft_keys(self, dkv: DraftKV) -> tuple:
        return tuple(dkv.k[i] for i in self.draft_summary_layers)

    def warmup(self, state: EngineState, dkv: DraftKV | None) -> None:
        """Compile every bucket of page-out, page-in and summaries ahead of time (nothing is moved)."""
        tensors = _tensors(state.kv, dkv)
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        ts = jax.tree_util.tree_map(spec, tensors)
        for b in BUCKETS:
            idx = jax.ShapeDtypeStruct((b,), jnp.int32)
            self._out[b] = self._out_fn(b).lower(ts, idx).compile()
            if self._host is None:
                packed = jax.ShapeDtypeStruct((b, self.slab_elems), self.dtype)
                self._in[b] = self._in_fn(b).lower(ts, packed, idx).compile()
            else:
                slab = jax.ShapeDtypeStruct((self.slab_elems,), self.dtype, sharding=self._host)
                self._in[b] = self._in_fn(b).lower(ts, tuple([slab] * b), idx).compile()
            if self.target_summaries:
                self._sum[("target", b)] = self._sum_fn(b).lower(jax.tree_util.tree_map(spec, tuple(state.kv.k)),
                                                                 idx).compile()
            if self.draft_summary_layers:
                self._sum[("draft", b)] = self._sum_fn(b, "draft").lower(
                    jax.tree_util.tree_map(spec, self._draft_keys(dkv)), idx).compile()

    # ---- operations ----------------------------------------------------------------------------------------------
    @staticmethod
    def _chunks(items: Sequence, top: int = BUCKETS[-1]):
        for i in range(0, len(items), top):
            part = items[i: i + top]
            yield part, next(b for b in BUCKETS if b >= len(part))

    def page_out(self, state: EngineState, dkv: DraftKV | None, transfers: Sequence[Transfer]) -> None:
        """Copy the physical pages of ``transfers`` into their host slabs (asynchronous)."""
        tensors = _tensors(state.kv, dkv)
        for part, b in self._chunks(list(transfers)):
            idx = np.zeros(b, np.int32)
            idx[: len(part)] = [t.phys for t in part]
            out = self._out_fn(b)(tensors, idx)
            if self._host is None:
                got = np.asarray(out)
                for i, t in enumerate(part):
                    self.slabs[t.slab] = got[i]
            else:
                for i, t in enumerate(part):
                    self.slabs[t.slab] = out[i]

    def page_in(self, state: EngineState, dkv: DraftKV | None,
                transfers: Sequence[Transfer]) -> tuple[EngineState, DraftKV | None]:
        """Copy host slabs into the physical pages of ``transfers``; returns the new (donated) state."""
        tensors = _tensors(state.kv, dkv)
        for part, b in self._chunks(list(transfers)):
            idx = np.zeros(b, np.int32)  # padding rows write the null page
            idx[: len(part)] = [t.phys for t in part]
            if self._host is None:
                packed = np.zeros((b, self.slab_elems), self.dtype)
                packed[: len(part)] = self.slabs[[t.slab for t in part]]
                tensors = self._in_fn(b)(tensors, packed, idx)
            else:
                slabs = [self.slabs[t.slab] for t in part]
                if any(s is None for s in slabs):
                    raise RuntimeError("KVFlash page-in of a host slab that was never written")
                slabs += [self._zero()] * (b - len(part))
                tensors = self._in_fn(b)(tensors, tuple(slabs), idx)
        kv, d = _split(tensors, self.n_k, self.has_draft, self.n_dk)
        return EngineState(kv=kv, rec=state.rec, pen=state.pen), d

    def summaries(self, state: EngineState, phys: Sequence[int]) -> np.ndarray:
        """[n, L*Hkv*D] float32 mean target keys of the given physical pages (blocks until ready)."""
        return self._summaries("target", tuple(state.kv.k), phys)

    def draft_summaries(self, dkv: DraftKV, phys: Sequence[int]) -> np.ndarray:
        """[n, n_full*Hkv_d*hd] float32 mean drafter context keys of the given physical pages over the
        ``draft_summary_layers`` (blocks until ready)."""
        if not self.draft_summary_layers:
            raise ValueError("no drafter summary layers were given (draft_summary_layers)")
        return self._summaries("draft", self._draft_keys(dkv), phys)

    def _summaries(self, source: str, ks: tuple, phys: Sequence[int]) -> np.ndarray:
        outs = []
        for part, b in self._chunks(list(phys)):
            idx = np.zeros(b, np.int32)
            idx[: len(part)] = part
            outs.append(np.asarray(self._sum_fn(b, source)(ks, idx))[: len(part)])
        return np.concatenate(outs) if outs else np.zeros((0, 0), np.float32)

    def prewarm(self, state: EngineState, dkv: DraftKV | None, max_bytes: float) -> dict[str, float]:
        """Have the host allocator hold room for every slab plus one top bucket of page-outs in flight, up to
        ``max_bytes``, before serving: page-outs of the null page into that many temporary host buffers, waited for
        and dropped. Pinned host memory comes from a growing pool whose every new region is pinned on first use,
        which would otherwise happen on the serving path, inside page-outs, as the host copies of histories
        accumulate. Returns ``{"slabs", "bytes", "seconds"}``; nothing is done without a JAX host memory kind."""
        if self._host is None or max_bytes <= 0:
            return {"slabs": 0, "bytes": 0, "seconds": 0.0}
        n = self.host_pages + BUCKETS[-1]
        if max_bytes < n * self.slab_bytes:
            n = int(max_bytes // self.slab_bytes)
        t0 = time.perf_counter()
        tensors, held, left = _tensors(state.kv, dkv), [], n
        while left:  # whole buckets only (no padding rows), so exactly n buffers
            b = max(x for x in BUCKETS if x <= left)
            held.append(self._out_fn(b)(tensors, np.zeros(b, np.int32)))
            left -= b
        jax.block_until_ready(held)
        del held
        return {"slabs": n, "bytes": n * self.slab_bytes, "seconds": time.perf_counter() - t0}

    def _zero(self):
        if self._zero_slab is None:
            self._zero_slab = jax.device_put(np.zeros(self.slab_elems, self.dtype), self._host)
        return self._zero_slab

    def bandwidth(self, state: EngineState, dkv: DraftKV | None, n: int = 64, iters: int = 15) -> dict[str, float]:
        """Page-in GB/s through ``page_in`` vs a plain pinned host->device ``device_put`` of the same bytes.

        Moves pages 1..n of the pool out to slabs 0..n-1 and back in (contents unchanged; the slabs' previous
        contents are restored); returns ``({"page_in_gbs", "page_out_gbs", "host_to_device_gbs", "ratio"}, state,
        dkv)`` (the state is donated through the page-ins). Page-out, page-in and the plain copy take turns, each
        timed alone, and each rate is the median of ``iters`` (a shared host's bandwidth drifts: timing all
        page-ins and then all copies measured 0.65-0.87 on the H200 where the sweep read 0.84-0.87). Blocks; for
        benchmarks, on an idle engine.
        """
        n = min(n, BUCKETS[-1], state.kv.n_pages - 1, self.host_pages)
        ts = [Transfer(-1, i, 1 + i, i) for i in range(n)]
        saved = list(self.slabs[:n]) if self._host is not None else self.slabs[:n].copy()
        host = (jax.device_put(np.zeros((n, self.slab_elems), self.dtype), self._host) if self._host is not None
                else np.zeros((n, self.slab_elems), self.dtype))
        times: dict[str, list[float]] = {"out": [], "in": [], "raw": []}
        for i in range(iters + 1):  # the first round warms every path up and is not counted
            t0 = time.perf_counter()
            self.page_out(state, dkv, ts)
            jax.block_until_ready(self.slabs[:n] if self._host is not None else 0)
            t1 = time.perf_counter()
            state, dkv = self.page_in(state, dkv, ts)
            jax.block_until_ready(state.kv.k)
            t2 = time.perf_counter()
            jax.block_until_ready(jax.device_put(host, self._dev))
            t3 = time.perf_counter()
            if i:
                times["out"].append(t1 - t0)
                times["in"].append(t2 - t1)
                times["raw"].append(t3 - t2)
        self.slabs[:n] = saved
        gb = n * self.slab_bytes / 1e9
        med = {k: float(np.median(v)) for k, v in times.items()}
        res = {"page_in_gbs": gb / med["in"], "page_out_gbs": gb / med["out"], "host_to_device_gbs": gb / med["raw"]}
        res["ratio"] = res["page_in_gbs"] / res["host_to_device_gbs"]
        return res, state, dkv
