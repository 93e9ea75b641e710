"""KVFlash: bounded concurrent KV residency over a shared resident page pool, with host backing.

Every admitted sequence keeps its full logical history of KV pages; only some of them are *resident* in the
device pool of ``pool_pages`` physical pages (page 0 stays the null page). The others live in host slabs.
Attention reads only a sequence's resident pages (a page-table entry < 0 is masked), so attention over a
partially resident history is a bounded, query-aware approximation of full attention, and exact whenever the
whole history is resident.

Host side (``Residency``: pure Python + NumPy, no JAX) decides, between steps:

* what a step needs: the pages its rows write must be resident and are *pinned* until the step's outputs are
  ready (``prepare`` ... ``finish_step``); rows whose write pages cannot be made resident are deferred, never
  failed;
* how the pool is shared (fairness): max-min fair quotas by water-filling over all running sequences, each
  sequence's floor being its pinned pages; eviction victims come from the sequence furthest above its quota
  (largest excess first), so no sequence is starved and every sequence with demand gets at least its share;
* what stays resident inside a sequence's quota: pinned pages, then the recent window (newest first) and the
  sink pages, then the rest ranked by score (``scoring="bounds"``, ``"keys"`` or ``"drafter"``) or recency
  (``"lru"``). A ranking without a query or without every page's summary, and a scorer fault, fall back to LRU for
  that decision
  and are counted;
* the transfers: page-out (resident dirty page -> a host slab) and page-in (host slab -> a free physical page).

Page states (every logical page is in exactly one; nothing is ever both dirty and duplicated, nothing is lost):

* resident dirty:  ``phys >= 1``, no host copy (newer than any copy it had);
* resident clean:  ``phys >= 1`` and a host slab with identical contents (evicting it moves no bytes);
* host:            ``phys == -1``, a host slab holds it.

The device side (``KVFlashDevice``) owns the host slabs and the jitted whole-page gather/scatter between the
engine's donated ``KVPages`` (+ the drafter's ``DraftKV``, which shares the page tables) and host memory.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Callable, Sequence

import numpy as np

from dflash_jax.kv.pages import OutOfPages, RequestTooLarge

NOT_RESIDENT = -1  # page-table entry of a logical page that is not resident (attention masks its keys)
SCORINGS = ("keys", "bounds", "shadow", "drafter", "lru")
DEVICE_SCORINGS = ("bounds", "shadow")  # scored on the device from device-held tables (``kvflash_scoring``)
# bounds / shadow scoring: a page scores at least this share of an adjacent page's attention share, so a line of
# text that straddles a page boundary (a needle's value split over two pages) is kept whole
NEIGHBOUR_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class KVFlashOptions:
    """Settings of bounded residency.

    pool_tokens: size of the resident pool in tokens (``"auto"`` is resolved by the engine from free device
    memory before this is built). scoring: ``"keys"`` ranks non-protected pages by the dot product of the
    sequence's latest full page's mean keys (a stand-in for its latest queries) with each page's mean keys, over
    the target's attention layers; ``"drafter"`` by the DFlash drafter's attention logits of its latest round's
    anchor queries (``set_query``) over each page's mean drafter context keys, over the drafter's full-attention
    layers (a sequence without a query yet ranks by LRU, counted); ``"bounds"`` (Quest-style) keeps per page the
    elementwise min and max of its keys per attention layer and KV head and scores it with the target's own
    rotated queries of the sequence's latest positions (``push_query``; ``count_query`` when the engine keeps them
    on the device), see ``bound_scores``; ``"shadow"`` scores each page by the target's exact attention share under
    those queries, over a 4-bit copy of every key held on the device (``shadow_scores``,
    ``kv/kvflash_scoring.py``; needs a ``batch_scorer``); under both a page scores at least ``NEIGHBOUR_SHARE`` of
    an adjacent page's attention share (``neighbour_scores``); ``"lru"`` ranks by last use. sink_pages /
    window_pages: always-kept head and recent pages (within quota). rescore_every: engine steps between re-rankings
    of a sequence (stable ranks between avoid churn; so does ``hysteresis``, a bonus of that many score standard
    deviations for pages already resident). max_page_in: optional page-ins per step (mandatory ones are not limited).
    exact_steps: give the rows of a step their whole history when all of it fits (exact attention for them,
    paging other sequences out); otherwise quotas apply.
    """

    pool_tokens: int
    scoring: str = "bounds"
    sink_pages: int = 1
    window_pages: int = 4
    rescore_every: int = 16
    max_page_in: int = 64
    exact_steps: bool = False
    hysteresis: float = 0.25  # resident pages' scores get this many standard deviations of bonus (less churn)

    def validate(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"kvflash scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.pool_tokens < 1 or self.sink_pages < 0 or self.window_pages < 1 or self.max_page_in < 0:
            raise ValueError("kvflash needs pool_tokens >= 1, sink_pages >= 0, window_pages >= 1, max_page_in >= 0")


@dataclasses.dataclass
class _Page:
    slab: int = -1
    dirty: bool = True
    last_use: int = 0
    summary: np.ndarray | None = None  # mean keys [F] (keys / drafter) or key bounds [2, L, Hkv, D] of a full page
    scored: bool = False  # has a summary: in ``summary``, or (with a batch scorer) in the scorer's row ``pid``
    pid: int = -1  # the page's id for its lifetime (a row of a device-held summary table)


@dataclasses.dataclass
class _Seq:
    """One sequence's history: ``pages[lp]`` its logical pages, ``phys[lp]`` where each is in the device pool."""

    order: int  # admission order (fair tie-breaks)
    pages: list[_Page]
    n_tokens: int
    reserved: int  # host-capacity pages promised, not yet materialised
    ranks: list[int] | None = None  # cached logical order best-first (non-protected pages), from the last rescoring
    rank_of: dict[int, int] = dataclasses.field(default_factory=dict)  # logical page -> its index in ``ranks``
    head_key: tuple | None = None  # (logical pages, protected pages) that ``ranks`` was ordered for
    ranked_at: int = -(10 ** 9)
    # int32 physical page of each logical page (NOT_RESIDENT: on host; the block table as it is), capacity doubling
    phys: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    query: np.ndarray | None = None  # drafter: [F] latest anchor queries; bounds: [Q, L, H, D] latest target queries
    n_query: int = 0  # bounds with a batch scorer: how many of the slot's device-held query window are this one's
    version: int = 0  # bumped on every residency change (block-table refresh)
    stats: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def resident(self) -> list[int]:
        """Logical pages now in the device pool, ascending."""
        return np.flatnonzero(self.phys[: len(self.pages)] != NOT_RESIDENT).tolist()

    def is_resident(self, lp: int) -> bool:
        return bool(self.phys[lp] != NOT_RESIDENT)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One page copy: ``out`` = device page ``phys`` -> host ``slab``; ``in`` = host ``slab`` -> device ``phys``."""

    sid: int
    logical: int
    phys: int
    slab: int


@dataclasses.dataclass
class Plan:
    """What one ``prepare`` decided: transfers to run before the step (all page-outs first), rows deferred."""

    step_id: int
    page_out: list[Transfer]
    page_in: list[Transfer]
    deferred: list[int]
    changed: set[int]  # sequences whose page table changed


class Residency:
    """The residency state machine of KVFlash (pure host-side bookkeeping).

    ``pool_pages`` physical pages (numbered 1..pool_pages; 0 = null) are shared by all sequences; ``host_pages``
    host slabs back the logical histories (admission reserves host capacity for a request's whole length, so a
    page-out never lacks a slab). ``floor_pages``: pages per running sequence that admission keeps available
    (a decode step's writes), so admitting never starves the running set of the pages its next step needs.

    Scoring: ``scorer(query, summaries [n, ...]) -> [n]`` ranks one sequence from host-held queries and summaries
    (``push_query`` / ``set_summaries`` with arrays; the default is ``bound_scores`` or ``dot_scores``). With a
    ``batch_scorer`` (``bounds`` / ``shadow`` scoring on the device, ``kvflash_scoring.DeviceScorer``) the queries
    and summaries live elsewhere: ``count_query`` / ``set_summaries(keys)`` only record that they exist, and every
    ranking of a step is one call ``batch_scorer([(sid, n_query, page ids [n], context ids [c])]) -> [[n] scores]``
    (ids: ``page_id``; context: the sequence's protected pages that have summaries, which ``shadow`` normalises
    over).
    """

    def __init__(self, pool_pages: int, host_pages: int, page_size: int, opts: KVFlashOptions,
                 floor_pages: int = 1, scorer: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                 batch_scorer: Callable[[list[tuple[int, int, np.ndarray, np.ndarray]]], Sequence[np.ndarray]]
                 | None = None) -> None:
        opts.validate()
        if pool_pages < 1 or host_pages < 1 or page_size < 1:
            raise ValueError("kvflash needs pool_pages, host_pages, page_size >= 1")
        if opts.scoring == "shadow" and batch_scorer is None:
            raise ValueError("shadow scoring reads the key shadow on the device: it needs a batch_scorer "
                             "(kvflash_scoring.DeviceScorer, as the engine builds it)")
        self.pool_pages, self.host_pages, self.page_size, self.opts = pool_pages, host_pages, page_size, opts
        self.floor_pages = floor_pages
        self.scorer = scorer or (bound_scores if opts.scoring == "bounds" else dot_scores)
        self.batch_scorer = batch_scorer
        self._free_pids = list(range(host_pages - 1, -1, -1))  # every logical page holds one (<= host_pages of them)
        self._free_phys = list(range(1, pool_pages + 1))
        self._free_slabs = list(range(host_pages))
        self._seqs: dict[int, _Seq] = {}
        self._order = 0
        self._reserved_total = 0
        self._pins: dict[int, set[tuple[int, int]]] = {}  # step id -> (sid, logical) pinned by that step
        self._pinned: collections.Counter = collections.Counter()  # (sid, logical) -> pins held
        self._step = 0
        self.counters: collections.Counter = collections.Counter()

    # ---- sizes (PageAllocator-compatible where the engine needs it) -------------------------------------------
    @property
    def n_pages(self) -> int:
        """Physical pages of the device pool including the null page (the device KV arrays' page count)."""
        return self.pool_pages + 1

    def pages_needed(self, n_tokens: int) -> int:
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        return -(-n_tokens // self.page_size)

    @property
    def capacity_tokens(self) -> int:
        """Tokens of history the host backing can hold in all."""
        return self.host_pages * self.page_size

    @property
    def host_free(self) -> int:
        """Host-capacity pages neither materialised nor reserved (what admission can still promise)."""
        used = sum(len(s.pages) for s in self._seqs.values())
        return self.host_pages - used - self._reserved_total

    @property
    def resident_used(self) -> int:
        return self.pool_pages - len(self._free_phys)

    @property
    def num_free(self) -> int:
        """Free physical pages of the resident pool."""
        return len(self._free_phys)

    # ---- admission / lifetime ---------------------------------------------------------------------------------
    def can_admit(self, n_tokens: int) -> bool:
        """Host capacity for the whole request, and the pool keeps ``floor_pages`` per running sequence."""
        return (self.pages_needed(n_tokens) <= self.host_free
                and (len(self._seqs) + 1) * self.floor_pages <= self.pool_pages)

    def admit(self, sid: int, reserve_tokens: int) -> None:
        if sid in self._seqs:
            raise ValueError(f"sequence {sid} is already admitted")
        if reserve_tokens > self.capacity_tokens:
            raise RequestTooLarge(f"request needs {reserve_tokens} tokens but the KVFlash host backing holds at most "
                                  f"{self.capacity_tokens}")
        need = self.pages_needed(reserve_tokens)
        if not self.can_admit(reserve_tokens):
            raise OutOfPages(f"admitting sequence {sid}: {need} host pages needed, {self.host_free} free, "
                             f"{len(self._seqs)} sequences running in a pool of {self.pool_pages}")
        self._seqs[sid] = _Seq(order=self._order, pages=[], n_tokens=0, reserved=need)
        self._order += 1
        self._reserved_total += need

    def release(self, sid: int) -> None:
        """Finish or abort: every page of ``sid`` (resident and host) and its reservation go back."""
        s = self._get(sid)
        for lp in range(len(s.pages)):
            self._drop(sid, s, lp)
        self._reserved_total -= s.reserved
        del self._seqs[sid]
        for pins in self._pins.values():
            pins.difference_update({k for k in pins if k[0] == sid})
        for k in [k for k in self._pinned if k[0] == sid]:
            del self._pinned[k]

    def truncate(self, sid: int, n_tokens: int) -> None:
        """Shrink to ``n_tokens`` (speculative rollback); dropped pages return to the reservation."""
        s = self._get(sid)
        if not 0 <= n_tokens <= s.n_tokens:
            raise ValueError(f"truncate of sequence {sid} to {n_tokens}: must be in [0, {s.n_tokens}]")
        keep = self.pages_needed(n_tokens)
        for lp in range(keep, len(s.pages)):
            self._drop(sid, s, lp)
            self._pinned.pop((sid, lp), None)
        dropped = len(s.pages) - keep
        del s.pages[keep:]
        s.n_tokens = n_tokens
        s.reserved += dropped
        self._reserved_total += dropped
        if dropped:
            s.version += 1
            s.ranks = None

    def __contains__(self, sid: object) -> bool:
        return sid in self._seqs

    def num_tokens(self, sid: int) -> int:
        return self._get(sid).n_tokens

    def stats_of(self, sid: int) -> dict:
        return dict(self._get(sid).stats)

    def version(self, sid: int) -> int:
        return self._get(sid).version

    def resident_of(self, sid: int) -> list[int]:
        """Logical indices of the resident pages of ``sid``."""
        return self._get(sid).resident()

    def n_logical(self, sid: int) -> int:
        return len(self._get(sid).pages)

    # ---- block tables -------------------------------------------------------------------------------------------
    def page_table(self, sid: int, width: int) -> np.ndarray:
        """int32 [width]: physical page per logical page, NOT_RESIDENT (-1) where on host, 0 past the end."""
        s = self._get(sid)
        n = len(s.pages)
        if n > width:
            raise ValueError(f"sequence {sid} has {n} pages, more than page-table width {width}")
        out = np.zeros((width,), np.int32)
        out[:n] = s.phys[:n]
        return out

    def page_tables(self, sids: Sequence[int | None], width: int) -> np.ndarray:
        out = np.zeros((len(sids), width), np.int32)
        for i, sid in enumerate(sids):
            if sid is not None:
                out[i] = self.page_table(sid, width)
        return out

    # ---- scoring inputs ---------------------------------------------------------------------------------------
    def summaries_needed(self) -> list[tuple[int, int, int]]:
        """(sid, logical, phys) of resident full pages without a summary (every scoring but lru)."""
        if self.opts.scoring == "lru":
            return []
        out = []
        for sid, s in self._seqs.items():
            full = s.n_tokens // self.page_size
            out += [(sid, lp, int(s.phys[lp])) for lp in s.resident() if lp < full and not s.pages[lp].scored]
        return out

    def page_id(self, sid: int, lp: int) -> int:
        """The id of logical page ``lp`` of ``sid`` (its row in a device-held summary table), fixed for its life."""
        return self._get(sid).pages[lp].pid

    def set_summaries(self, keys: Sequence[tuple[int, int]], summaries: np.ndarray | None = None) -> None:
        """Summaries of pages ``(sid, logical)``: host arrays, or None when the batch scorer holds them (under
        ``page_id``). Unknown / released sequences are ignored."""
        if summaries is None and self.batch_scorer is None:
            raise ValueError("summaries held outside the residency need a batch_scorer to score with")
        for i, (sid, lp) in enumerate(keys):
            s = self._seqs.get(sid)
            if s is not None and lp < len(s.pages):
                p = s.pages[lp]
                p.summary = None if summaries is None else np.asarray(summaries[i], np.float32)
                p.scored = True

    def set_query(self, sid: int, query: np.ndarray | None) -> None:
        """The drafter's queries of ``sid``'s latest round ``[F]`` (drafter scoring), or None when it has none (it
        decodes without drafting): its next rankings use it. Unknown / released sequences are ignored."""
        s = self._seqs.get(sid)
        if s is not None:
            s.query = None if query is None else np.asarray(query, np.float32)

    def push_query(self, sid: int, queries: np.ndarray, keep: int, rescore: bool = False) -> None:
        """Append the target's queries of ``sid``'s newest positions ``[n, L, H, D]`` (bounds scoring) to its query
        window, which keeps the latest ``keep``. ``rescore``: re-rank at the next step whatever ``rescore_every``
        says (a prefill chunk's queries: the prompt's end, e.g. its question, must be able to page its pages in
        before the step that answers). Unknown / released sequences are ignored."""
        s = self._seqs.get(sid)
        if s is None or len(queries) == 0:
            return
        q = np.asarray(queries, np.float32)
        s.query = (q if s.query is None else np.concatenate([s.query, q]))[-keep:]
        if rescore:
            s.ranks = None

    def count_query(self, sid: int, n: int, keep: int, rescore: bool = False) -> None:
        """``push_query`` for queries the batch scorer holds: ``n`` newer positions of ``sid`` were appended to its
        window of ``keep``. Unknown / released sequences are ignored."""
        s = self._seqs.get(sid)
        if s is None or n <= 0:
            return
        s.n_query = min(keep, s.n_query + n)
        if rescore:
            s.ranks = None

    # ---- the step protocol ------------------------------------------------------------------------------------
    def prepare(self, rows: Sequence[tuple[int, int, int]]) -> Plan:
        """Make a step's write pages resident and pinned; rebalance the pool; return the transfers to run.

        rows: (sid, write_from, write_to) tokens each row writes, in priority order. A row whose write pages
        cannot all be made resident (the pool is full of pinned pages) is deferred: nothing of it changes.
        Transfers must run before the step, all page-outs first (they read physical pages that page-ins and new
        pages may reuse). Call ``finish_step(plan.step_id)`` once the step's outputs are ready.
        """
        self._step += 1
        sid_step = self._step
        pins: set[tuple[int, int]] = set()
        self._pins[sid_step] = pins
        plan = Plan(sid_step, [], [], [], set())
        for sid, lo, hi in rows:
            s = self._get(sid)
            if not 0 <= lo <= min(s.n_tokens, hi):
                raise ValueError(f"sequence {sid} holds {s.n_tokens} tokens: a step cannot write [{lo}, {hi})")
            first, last = lo // self.page_size, self.pages_needed(hi)
            need = [lp for lp in range(first, last) if (sid, lp) not in self._pinned]
            if len(need) + sum(1 for k in self._pinned) > self.pool_pages or not self._can_grow(s, hi):
                plan.deferred.append(sid)
                s.stats["deferred_steps"] += 1
                self.counters["deferred_steps"] += 1
                continue
            self._grow(sid, s, hi)
            for lp in range(first, last):
                if (sid, lp) not in pins:
                    pins.add((sid, lp))
                    self._pinned[(sid, lp)] += 1
        self._rebalance(plan, {sid for sid, _, _ in rows if sid not in plan.deferred})
        # the pinned pages are about to be written: they are dirty now (a stale host copy is dropped)
        for sid, lp in pins:
            s = self._seqs[sid]
            p = s.pages[lp]
            assert s.is_resident(lp), f"pinned page {lp} of sequence {sid} is not resident"
            if p.slab >= 0:
                self._free_slabs.append(p.slab)
                p.slab = -1
            p.dirty = True
            p.summary, p.scored = None, False
            p.last_use = sid_step
        self.counters["page_out"] += len(plan.page_out)
        self.counters["page_in"] += len(plan.page_in)
        return plan

    def finish_step(self, step_id: int) -> None:
        """The step's outputs are ready: its pins are released."""
        for k in self._pins.pop(step_id, set()):
            if self._pinned.get(k, 0) > 1:
                self._pinned[k] -= 1
            else:
                self._pinned.pop(k, None)

    # ---- internals ------------------------------------------------------------------------------------------------
    def _get(self, sid: int) -> _Seq:
        try:
            return self._seqs[sid]
        except KeyError:
            raise KeyError(f"unknown sequence {sid} (not admitted or already released)") from None

    def _drop(self, sid: int, s: _Seq, lp: int) -> None:
        p = s.pages[lp]
        if s.is_resident(lp):
            heapq.heappush(self._free_phys, int(s.phys[lp]))
            s.phys[lp] = NOT_RESIDENT
        if p.slab >= 0:
            self._free_slabs.append(p.slab)
            p.slab = -1
        if p.pid >= 0:
            self._free_pids.append(p.pid)
            p.pid = -1

    def _can_grow(self, s: _Seq, hi: int) -> bool:
        extra = self.pages_needed(hi) - len(s.pages)
        return extra <= s.reserved + self.host_free

    def _grow(self, sid: int, s: _Seq, hi: int) -> None:
        """New logical pages (not yet placed: placed by _rebalance as pinned mandatory pages)."""
        extra = self.pages_needed(hi) - len(s.pages)
        if len(s.pages) + extra > len(s.phys):
            s.phys = np.concatenate([s.phys, np.full(max(len(s.phys), extra, 16), NOT_RESIDENT, np.int32)])
        for _ in range(max(0, extra)):
            s.pages.append(_Page(last_use=self._step, pid=self._free_pids.pop()))
            if s.reserved > 0:
                s.reserved -= 1
                self._reserved_total -= 1
        s.n_tokens = max(s.n_tokens, hi)

    def _quotas(self, in_step: set[int]) -> tuple[dict[int, int], set[int]]:
        """Max-min fair shares of the pool (water-filling); floor = pinned pages; demand = logical pages.

        Returns the quotas and the sequences granted their whole history this step (``exact_steps``)."""
        floor = collections.Counter(sid for sid, _ in self._pinned)
        exact: set[int] = set()
        if self.opts.exact_steps:
            whole = sum(len(self._seqs[s].pages) for s in in_step)
            other_floor = sum(v for s, v in floor.items() if s not in in_step)
            if whole + other_floor <= self.pool_pages:
                exact = set(in_step)
                for s in in_step:
                    floor[s] = len(self._seqs[s].pages)
        demand = {sid: len(s.pages) for sid, s in self._seqs.items()}
        lo_q = {sid: min(floor[sid], demand[sid]) for sid in demand}
        at = lambda level: {sid: min(demand[sid], max(lo_q[sid], level)) for sid in demand}
        lo, hi = 0, max(demand.values(), default=0)
        while lo < hi:  # the highest water level whose allocation fits the pool
            mid = (lo + hi + 1) // 2
            if sum(at(mid).values()) <= self.pool_pages:
                lo = mid
            else:
                hi = mid - 1
        quota = at(lo)
        left = self.pool_pages - sum(quota.values())
        nxt = at(lo + 1)
        for sid in sorted(demand, key=lambda x: self._seqs[x].order):  # the remainder, one page each, oldest first
            if left <= 0:
                break
            if nxt[sid] > quota[sid]:
                quota[sid] += 1
                left -= 1
        return quota, exact

    def _rank_all(self) -> dict[int, list[int]]:
        """Every sequence's protected pages best-first: pinned, window (newest first), sinks; its other pages are in
        ``s.ranks`` (score or LRU order). Stale orders are recomputed, every one to score in one batch. A sequence's
        order is ``head + s.ranks``; ``s.rank_of`` indexes ``s.ranks``."""
        pinned_of: dict[int, list[int]] = collections.defaultdict(list)
        for sid, lp in self._pinned:
            pinned_of[sid].append(lp)
        heads: dict[int, list[int]] = {}
        stale: list[tuple[int, _Seq, list[int]]] = []
        for sid, s in self._seqs.items():
            n = len(s.pages)
            pinned = sorted(pinned_of.get(sid, ()), reverse=True)
            window = list(range(n - 1, max(-1, n - 1 - self.opts.window_pages), -1))
            sinks = list(range(min(self.opts.sink_pages, n)))
            head = list(dict.fromkeys(pinned + window + sinks))
            heads[sid] = head
            key = (n, frozenset(head))
            if s.ranks is None or self._step - s.ranked_at >= self.opts.rescore_every or key != s.head_key:
                s.head_key = key
                hs = set(head)
                stale.append((sid, s, [lp for lp in range(n) if lp not in hs]))
        to_score = []
        for sid, s, rest in stale:
            s.ranked_at = self._step
            lru = sorted(rest, key=lambda lp: (-s.pages[lp].last_use, -lp))
            self._set_ranks(s, lru)
            if self.opts.scoring == "lru" or not rest:
                self._count(s, "lru_decisions")
            elif not self._has_query(s) or not all(s.pages[lp].scored for lp in rest):
                # nothing to score with yet (no query / a page without a summary): LRU for this ranking, counted
                self._count(s, "unscored_fallbacks", "lru_decisions")
            else:
                to_score.append((sid, s, rest))
        for (sid, s, rest), sc in zip(to_score, self._scores(to_score, heads)):
            if sc is None:  # a scorer fault falls back to LRU (already in place), counted
                self._count(s, "score_fallbacks", "lru_decisions")
                continue
            self._count(s, "score_decisions")
            if self.opts.scoring in DEVICE_SCORINGS and NEIGHBOUR_SHARE > 0 and len(sc) > 1:
                sc = neighbour_scores(sc, rest, NEIGHBOUR_SHARE)
            if self.opts.hysteresis and len(sc) > 1:
                sc = sc + self.opts.hysteresis * float(np.std(sc)) * np.array(
                    s.phys[rest] != NOT_RESIDENT)
            self._set_ranks(s, [rest[i] for i in np.argsort(-sc, kind="stable")])
        return heads

    @staticmethod
    def _set_ranks(s: _Seq, ranks: list[int]) -> None:
        s.ranks = ranks
        s.rank_of = {lp: i for i, lp in enumerate(ranks)}

    def _count(self, s: _Seq, *names: str) -> None:
        for k in names:
            self.counters[k] += 1
            s.stats[k] += 1

    def _has_query(self, s: _Seq) -> bool:
        if self.batch_scorer is not None:
            return s.n_query > 0
        return self._query(s) is not None

    def _query(self, s: _Seq) -> np.ndarray | None:
        """The host-held query of ``s``: its pushed / set query (bounds, drafter), or for keys scoring the mean keys
        of its latest summarised full page."""
        if self.opts.scoring in ("drafter",) + DEVICE_SCORINGS:
            return s.query
        full = s.n_tokens // self.page_size
        return next((s.pages[lp].summary for lp in range(min(full, len(s.pages)) - 1, -1, -1)
                     if s.pages[lp].summary is not None), None)

    def _scores(self, items: list[tuple[int, _Seq, list[int]]],
                heads: dict[int, list[int]]) -> list[np.ndarray | None]:
        """Scores of each item's ``rest`` pages (float64 ``[n]``), None where the scorer failed (raised, or gave a
        wrong shape or non-finite scores). ``heads``: each sequence's protected pages (the batch scorer's context)."""
        if not items:
            return []
        if self.batch_scorer is not None:
            pids = lambda s, lps: np.array([s.pages[lp].pid for lp in lps], np.int32)
            try:
                raw = list(self.batch_scorer([
                    (sid, s.n_query, pids(s, rest), pids(s, [lp for lp in heads[sid] if s.pages[lp].scored]))
                    for sid, s, rest in items]))
                if len(raw) != len(items):
                    raise ValueError(f"batch scorer returned {len(raw)} results for {len(items)} sequences")
            except Exception:  # noqa: BLE001 - a scorer fault falls back to LRU and is counted
                return [None] * len(items)
        else:
            raw = []
            for _, s, rest in items:
                try:
                    raw.append(self.scorer(self._query(s), np.stack([s.pages[lp].summary for lp in rest])))
                except Exception:  # noqa: BLE001 - as above, for this sequence only
                    raw.append(None)
        out: list[np.ndarray | None] = []
        for (_, _, rest), sc in zip(items, raw):
            sc = None if sc is None else np.asarray(sc, np.float64)
            ok = sc is not None and sc.shape == (len(rest),) and bool(np.all(np.isfinite(sc)))
            out.append(sc if ok else None)
        return out

    def _rebalance(self, plan: Plan, in_step: set[int]) -> None:
        quota, exact = self._quotas(in_step)
        heads = self._rank_all()
        desired = {}
        for sid, s in self._seqs.items():
            head = heads[sid]
            desired[sid] = head[: quota[sid]] + s.ranks[: max(0, quota[sid] - len(head))]
        resident = {sid: s.resident() for sid, s in self._seqs.items()}
        res_count = {sid: len(v) for sid, v in resident.items()}
        # victims: resident pages outside their sequence's desired set, from the largest excess first
        excess: dict[int, list[int]] = {}
        for sid, s in self._seqs.items():
            want = set(desired[sid])
            extra = [lp for lp in resident[sid] if lp not in want]
            if extra:
                head = {lp: i for i, lp in enumerate(heads[sid])}
                extra.sort(key=lambda lp: head[lp] if lp in head else len(head) + s.rank_of[lp])  # worst last
                excess[sid] = extra
        # the sequence furthest over its quota first (then the oldest): a heap of (-(resident - quota), order),
        # a fresh entry pushed whenever a count changes (entries whose key is no longer current are skipped)
        over = [(quota[sid] - res_count[sid], self._seqs[sid].order, sid) for sid in excess]
        heapq.heapify(over)

        def victim() -> tuple[int, int] | None:
            while over:
                key, order, sid = heapq.heappop(over)
                if excess[sid] and key == quota[sid] - res_count[sid]:
                    res_count[sid] -= 1
                    lp = excess[sid].pop()
                    if excess[sid]:
                        heapq.heappush(over, (quota[sid] - res_count[sid], order, sid))
                    return sid, lp
            return None

        def place(sid: int, lp: int) -> bool:
            s = self._seqs[sid]
            p = s.pages[lp]
            if not self._free_phys:
                v = victim()
                if v is None:
                    return False
                self._evict(plan, *v)
            s.phys[lp] = heapq.heappop(self._free_phys)
            res_count[sid] += 1
            if excess.get(sid):
                heapq.heappush(over, (quota[sid] - res_count[sid], s.order, sid))
            p.last_use = self._step
            s.version += 1
            plan.changed.add(sid)
            if p.slab >= 0:
                plan.page_in.append(Transfer(sid, lp, int(s.phys[lp]), p.slab))
                p.dirty = False
                s.stats["pages_in"] += 1
            return True

        # mandatory first (pinned pages; the whole history of rows granted an exact step), then optional
        # page-ins round-robin by rank, bounded by max_page_in
        for sid in sorted(in_step, key=lambda x: self._seqs[x].order):
            for lp in desired[sid]:
                mandatory = sid in exact or (sid, lp) in self._pinned
                if mandatory and not self._seqs[sid].is_resident(lp):
                    ok = place(sid, lp)
                    assert ok, "mandatory pages exceed the pool (prepare and _quotas check this)"
        budget = self.opts.max_page_in
        queues = [[lp for lp in desired[sid] if not self._seqs[sid].is_resident(lp)]
                  for sid in sorted(self._seqs, key=lambda x: self._seqs[x].order)]
        sids = sorted(self._seqs, key=lambda x: self._seqs[x].order)
        while budget > 0 and any(queues):
            for sid, q in zip(sids, queues):
                if q and budget > 0:
                    lp = q.pop(0)
                    if not place(sid, lp):
                        q.clear()
                        continue
                    budget -= 1
                    if self._seqs[sid].pages[lp].slab >= 0:
                        self.counters["optional_page_in"] += 1

    def _evict(self, plan: Plan, sid: int, lp: int) -> None:
        s = self._seqs[sid]
        p = s.pages[lp]
        assert (sid, lp) not in self._pinned, "a pinned page is never evicted"
        if p.dirty:
            if p.slab < 0:
                p.slab = self._free_slabs.pop()
            plan.page_out.append(Transfer(sid, lp, int(s.phys[lp]), p.slab))
            s.stats["pages_out"] += 1
            p.dirty = False
        else:
            s.stats["clean_evictions"] += 1
            self.counters["clean_evictions"] += 1
        heapq.heappush(self._free_phys, int(s.phys[lp]))
        s.phys[lp] = NOT_RESIDENT
        s.version += 1
        plan.changed.add(sid)

    # ---- checks -------------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the residency bookkeeping is inconsistent."""
        phys_owner: dict[int, tuple[int, int]] = {}
        slab_owner: dict[int, tuple[int, int]] = {}
        pids: set[int] = set()
        for sid, s in self._seqs.items():
            assert len(s.pages) == self.pages_needed(s.n_tokens), (
                f"sequence {sid}: {s.n_tokens} tokens in {len(s.pages)} logical pages")
            assert s.reserved >= 0
            assert (s.phys[len(s.pages):] == NOT_RESIDENT).all(), f"sequence {sid}: a page past its end is placed"
            for lp, p in enumerate(s.pages):
                phys = int(s.phys[lp])
                res, host = phys != NOT_RESIDENT, p.slab >= 0
                assert res or host, f"logical page {lp} of sequence {sid} is lost (neither resident nor on host)"
                assert 0 <= p.pid < self.host_pages and p.pid not in pids, f"page {lp} of {sid}: bad id {p.pid}"
                pids.add(p.pid)
                assert not (p.dirty and host), f"page {lp} of {sid} is dirty and also has a host copy"
                assert res or not p.dirty, f"page {lp} of {sid} is on host only but marked dirty"
                if res:
                    assert 1 <= phys <= self.pool_pages, f"bad physical page {phys}"
                    assert phys not in phys_owner, f"physical page {phys} owned twice"
                    phys_owner[phys] = (sid, lp)
                if host:
                    assert 0 <= p.slab < self.host_pages, f"bad slab {p.slab}"
                    assert p.slab not in slab_owner, f"slab {p.slab} owned twice"
                    slab_owner[p.slab] = (sid, lp)
        assert len(set(self._free_phys)) == len(self._free_phys), "free physical list has duplicates"
        assert not set(self._free_phys) & phys_owner.keys(), "a free physical page is also owned"
        assert len(self._free_phys) + len(phys_owner) == self.pool_pages, "physical pages leaked"
        assert not set(self._free_slabs) & slab_owner.keys(), "a free slab is also owned"
        assert len(set(self._free_slabs)) + len(slab_owner) == self.host_pages, "host slabs leaked"
        assert not set(self._free_pids) & pids and len(set(self._free_pids)) + len(pids) == self.host_pages, (
            "page ids leaked")
        assert self._reserved_total == sum(s.reserved for s in self._seqs.values())
        assert self.host_free >= 0, "host capacity over-committed"
        for (sid, lp), n in self._pinned.items():
            assert n > 0 and sid in self._seqs and self._seqs[sid].is_resident(lp), (
                f"pinned page {lp} of {sid} is not resident")


def dot_scores(query: np.ndarray, summaries: np.ndarray) -> np.ndarray:
    """Score of each page: its mean keys dotted with the query summary (both [F], flattened layers x heads x D)."""
    return summaries @ query


def bound_scores(query: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Quest-style page scores from key bounds: ``query [Q, L, H, D]`` (rotated target queries of the latest Q
    positions, L attention layers, H query heads), ``bounds [n, 2, L, Hkv, D]`` (per page the elementwise min and
    max of its keys) -> ``[n]``.

    For query head h (reading KV head h // (H / Hkv)), ``ub = sum_d max(q_d kmin_d, q_d kmax_d)`` bounds the logit
    ``q . k`` of every key of the page from above, however few of its tokens carry it (a mean over the page would
    dilute a one-line needle). Each (position, layer, head) turns its bounds into log shares of attention over the
    candidate pages (``ub / sqrt(D)`` less their log-sum-exp), which puts heads of different logit scales on one
    footing; a page scores its best share over all of them: one sharp head (a retrieval head) that would attend to
    it is reason enough to keep it, where a sum would let many diffuse heads outvote that one.
    """
    q = np.asarray(query, np.float32)
    b = np.asarray(bounds, np.float32)
    nq, n_layers, h, d = q.shape
    hkv = b.shape[3]
    g = h // hkv  # query head h reads KV head h // g
    # max(q kmin, q kmax) = max(q, 0) kmax + min(q, 0) kmin: two batched matmuls over (layer, KV head), no
    # [Q, n, L, H, D] temporaries. qb [L*Hkv, Q*g, D] @ [L*Hkv, D, n] -> [L*Hkv, Q*g, n]
    qb = q.reshape(nq, n_layers, hkv, g, d).transpose(1, 2, 0, 3, 4).reshape(n_layers * hkv, nq * g, d)
    kmin, kmax = (b[:, i].reshape(len(b), n_layers * hkv, d).transpose(1, 2, 0) for i in (0, 1))
    ub = np.matmul(np.maximum(qb, 0), kmax) + np.matmul(np.minimum(qb, 0), kmin)
    ub = ub.reshape(n_layers, hkv, nq, g, len(b)).transpose(2, 4, 0, 1, 3).reshape(nq, len(b), n_layers, h)
    ub = ub * d ** -0.5  # [Q, n, L, H]
    m = ub.max(axis=1, keepdims=True)
    share = ub - (m + np.log(np.exp(ub - m).sum(axis=1, keepdims=True)))
    return share.max(axis=(0, 2, 3))


def shadow_scores(query: np.ndarray, keys: np.ndarray, n_candidates: int) -> np.ndarray:
    """Exact attention-share page scores: ``query [Q, L, H, D]`` (rotated target queries of the latest Q positions),
    ``keys [n, P, L, Hkv, D]`` (every key of n full pages: the first ``n_candidates`` are scored, the rest are
    context, e.g. the protected recent pages) -> ``[n_candidates]``.

    For query head h (reading KV head h // (H / Hkv)) the share of page p is its part of the softmax over the keys of
    all n pages, ``log sum_{t in p} exp(q . k_t / sqrt(D)) - log sum_{all t} exp(q . k_t / sqrt(D))``; a page
    scores its best share over (position, layer, head), as ``bound_scores`` does with its upper bounds. The
    context pages make a head that attends to the recent text give the older pages small shares (with the
    candidates alone every head's shares sum to one over them, however little it reads them).
    """
    q = np.asarray(query, np.float64)
    k = np.asarray(keys, np.float64)
    nq, n_layers, h, d = q.shape
    hkv = k.shape[3]
    qg = q.reshape(nq, n_layers, hkv, h // hkv, d)
    lg = np.einsum("qlkgd,nplkd->qnplkg", qg, k) * d ** -0.5  # [Q, n, P, L, Hkv, g]
    m = lg.max(axis=2, keepdims=True)
    page = (m + np.log(np.exp(lg - m).sum(axis=2, keepdims=True)))[:, :, 0]  # [Q, n, L, Hkv, g]
    mm = page.max(axis=1, keepdims=True)
    share = page - (mm + np.log(np.exp(page - mm).sum(axis=1, keepdims=True)))
    return share[:, :n_candidates].max(axis=(0, 2, 3, 4))


def neighbour_scores(scores: np.ndarray, pages: Sequence[int], share: float) -> np.ndarray:
    """Log-share page scores ``[n]`` of logical ``pages`` -> each the max of its own and ``log(share)`` plus the
    score of a logically adjacent page among ``pages`` (``share`` of its neighbour's attention share)."""
    sc = np.asarray(scores, np.float64)
    lp = np.asarray(pages, np.int64)
    if len(lp) == 0:
        return sc.copy()
    by_page = np.full(int(lp.max()) + 3, -np.inf)  # index lp + 1: room for lp - 1 and lp + 1
    by_page[lp + 1] = sc
    nb = np.maximum(by_page[lp], by_page[lp + 2])
    return np.maximum(sc, nb + np.log(share))


def resolve_pool_tokens(spec: str | int | None, *, free_bytes: int | None, bytes_per_token: int, page_size: int,
                        fraction: float = 0.8) -> int | None:
    """``--kvflash off|auto|N`` -> pool tokens (None = off). ``auto``: ``fraction`` of the free device bytes."""
    if spec is None or spec in ("off", "None", 0, "0"):
        return None
    if spec == "auto":
        if not free_bytes:
            raise ValueError("--kvflash auto needs the device's free memory, which this backend does not report; "
                             "pass a token count (--kvflash N)")
        return max(page_size, int(free_bytes * fraction) // bytes_per_token // page_size * page_size)
    try:
        n = int(spec)
    except (TypeError, ValueError):
        raise ValueError(f"--kvflash must be off, auto or a token count, got {spec!r}") from None
    if n < page_size:
        raise ValueError(f"--kvflash {n}: the resident pool must hold at least one page ({page_size} tokens)")
    return n
