"""Host-side allocator for the paged KV cache.

Physical pages are numbered ``0 .. n_pages-1``. Page 0 is the NULL page: it is never handed out and page tables
are padded with it, so a padded slot always points at valid (ignored) memory.

Each sequence (keyed by an int ``seq_id``) owns an ordered list of physical pages (logical page ``i`` -> physical
page ``pages[i]``), a token count, and a *reservation*: pages promised at admission but not yet materialised.
Reserved pages stay on the free list but are not counted in ``num_free``, so once a sequence is admitted its
reservation can always be materialised by ``grow`` regardless of what other sequences do.

Pages can be shared (a cached prompt prefix, ``kv/prefix_cache.py``): every page counts its holders, the sequences
whose lists contain it plus ``hold`` references; it returns to the free list when the last one lets go. A sequence
admitted over shared ``prefix`` pages starts with them (read-only: it only ever writes past them).

Allocation is deterministic: the free list is a min-heap, so the lowest free page is always handed out first.
Pure Python + numpy; no JAX.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

import numpy as np

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """Not enough free pages for an admission or a growth step; nothing was changed."""


class RequestTooLarge(ValueError):
    """A request needs more tokens than the whole pool can ever hold."""


@dataclasses.dataclass
class _Seq:
    pages: list[int]  # logical -> physical
    n_tokens: int
    reserved: int  # pages promised but not yet assigned


class PageAllocator:
    """Allocates physical KV pages of ``page_size`` tokens out of a pool of ``n_pages`` (page 0 reserved)."""

    def __init__(self, n_pages: int, page_size: int) -> None:
        if n_pages < 2:
            raise ValueError(f"n_pages must be >= 2 (page 0 is the reserved NULL page), got {n_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.n_pages = n_pages
        self.page_size = page_size
        self._free: list[int] = list(range(1, n_pages))  # sorted, hence already a valid min-heap
        self._seqs: dict[int, _Seq] = {}
        self._reserved_total = 0
        self._refs: dict[int, int] = {}  # page -> holders (sequences + holds), for pages not on the free list
        self._held: dict[int, int] = {}  # page -> ``hold`` references

    # ---- sizes -------------------------------------------------------------------------------------------------
    def pages_needed(self, n_tokens: int) -> int:
        """Pages needed to hold ``n_tokens`` tokens (ceil division)."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        return -(-n_tokens // self.page_size)

    @property
    def num_free(self) -> int:
        """Pages neither owned by a sequence nor reserved for one."""
        return len(self._free) - self._reserved_total

    @property
    def num_used(self) -> int:
        """Physical pages currently owned by sequences."""
        return self.n_pages - 1 - len(self._free)

    @property
    def num_reserved(self) -> int:
        """Pages promised to sequences but not yet assigned."""
        return self._reserved_total

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold (page 0 excluded)."""
        return (self.n_pages - 1) * self.page_size

    # ---- admission ---------------------------------------------------------------------------------------------
    def can_admit(self, n_tokens: int, n_prefix_pages: int = 0) -> bool:
        """Whether ``admit(_, n_tokens)`` (over ``n_prefix_pages`` shared pages) would succeed right now."""
        return (n_tokens <= self.capacity_tokens
                and self.pages_needed(n_tokens) - n_prefix_pages <= self.num_free)

    def can_admit_all(self, n_tokens: Sequence[int], n_prefix_pages: int = 0) -> bool:
        """Whether sequences of ``n_tokens`` tokens (the first over ``n_prefix_pages`` shared pages) could all be
        admitted right now."""
        return (max(n_tokens, default=0) <= self.capacity_tokens
                and sum(self.pages_needed(n) for n in n_tokens) - n_prefix_pages <= self.num_free)

    def admit(self, seq_id: int, reserve_tokens: int, prefix: Sequence[int] = ()) -> None:
        """Register ``seq_id`` and reserve enough pages for ``reserve_tokens`` tokens; with ``prefix`` (full pages
        in use elsewhere: a cached prompt prefix) it starts holding those, ``len(prefix) * page_size`` tokens."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already admitted")
        if reserve_tokens > self.capacity_tokens:
            raise RequestTooLarge(
                f"request needs {reserve_tokens} tokens but the whole KV pool holds at most {self.capacity_tokens} "
                f"tokens ({self.n_pages - 1} pages x {self.page_size})"
            )
        if any(self._refs.get(p, 0) < 1 for p in prefix):
            raise ValueError(f"prefix pages {list(prefix)} must be in use (held by the prefix cache)")
        need = max(0, self.pages_needed(reserve_tokens) - len(prefix))
        if need > self.num_free:
            raise OutOfPages(f"admitting sequence {seq_id} needs {need} pages but only {self.num_free} are free")
        for p in prefix:
            self._refs[p] += 1
        self._seqs[seq_id] = _Seq(pages=list(prefix), n_tokens=len(prefix) * self.page_size, reserved=need)
        self._reserved_total += need

    def attach(self, seq_id: int, prefix: Sequence[int]) -> None:
        """Give ``seq_id``, which holds no pages yet, the full pages ``prefix`` (in use by another sequence: shared,
        read-only) as its first ``len(prefix) * page_size`` tokens; as many pages of its reservation go back to
        the pool (they are not needed any more). A forked request's start (``Engine.submit_group``)."""
        s = self._get(seq_id)
        if s.pages or s.n_tokens:
            raise ValueError(f"attach to sequence {seq_id}, which already holds {s.n_tokens} tokens")
        if any(self._refs.get(p, 0) < 1 for p in prefix):
            raise ValueError(f"prefix pages {list(prefix)} must be in use")
        for p in prefix:
            self._refs[p] += 1
        s.pages, s.n_tokens = list(prefix), len(prefix) * self.page_size
        back = min(s.reserved, len(prefix))
        s.reserved -= back
        self._reserved_total -= back

    # ---- shared pages --------------------------------------------------------------------------------------------
    def hold(self, pages: Sequence[int]) -> None:
        """Take a reference on pages in use (they stay allocated until ``drop``, whoever else lets go)."""
        if any(self._refs.get(p, 0) < 1 for p in pages):
            raise ValueError(f"hold of pages not in use: {[p for p in pages if self._refs.get(p, 0) < 1]}")
        for p in pages:
            self._refs[p] += 1
            self._held[p] = self._held.get(p, 0) + 1

    def drop(self, pages: Sequence[int]) -> None:
        """Let go of ``hold`` references; pages with no holder left return to the free list."""
        for p in pages:
            if self._held.get(p, 0) < 1:
                raise ValueError(f"drop of page {p}, which is not held")
            self._held[p] -= 1
            if not self._held[p]:
                del self._held[p]
            self._unref(p)

    @property
    def num_held(self) -> int:
        """Pages held (by the prefix cache) that no sequence holds too: what dropping every hold would free."""
        in_seqs = {p for s in self._seqs.values() for p in s.pages}
        return sum(1 for p in self._held if p not in in_seqs)

    def _take(self) -> int:
        p = heapq.heappop(self._free)
        self._refs[p] = 1
        return p

    def _unref(self, p: int) -> None:
        self._refs[p] -= 1
        if not self._refs[p]:
            del self._refs[p]
            heapq.heappush(self._free, p)

    # ---- growth / rollback -------------------------------------------------------------------------------------
    def grow(self, seq_id: int, new_total_tokens: int) -> list[int]:
        """Make ``seq_id`` hold ``new_total_tokens`` tokens; returns the newly assigned physical pages.

        New pages come out of the sequence's reservation first, then out of the unreserved free pool. Atomic: on
        ``OutOfPages`` nothing changes.
        """
        s = self._get(seq_id)
        if new_total_tokens < s.n_tokens:
            raise ValueError(
                f"grow cannot shrink sequence {seq_id} from {s.n_tokens} to {new_total_tokens} tokens; use truncate"
            )
        need = max(0, self.pages_needed(new_total_tokens) - len(s.pages))
        from_reservation = min(need, s.reserved)
        if need - from_reservation > self.num_free:
            raise OutOfPages(
                f"growing sequence {seq_id} to {new_total_tokens} tokens needs {need} new pages "
                f"({from_reservation} reserved) but only {self.num_free} unreserved pages are free"
            )
        new = [self._take() for _ in range(need)]
        s.reserved -= from_reservation
        self._reserved_total -= from_reservation
        s.pages.extend(new)
        s.n_tokens = new_total_tokens
        return new

    def truncate(self, seq_id: int, n_tokens: int, keep_reservation: bool = True) -> list[int]:
        """Shrink ``seq_id`` to ``n_tokens`` tokens (e.g. speculative rollback); returns the pages it freed.

        Whole pages no longer needed go back to the free list. With ``keep_reservation`` (the default) they are
        re-added to the sequence's reservation, so a later ``grow`` back to the admitted size cannot fail (pages
        that another holder keeps, shared ones, are not: they never left the pool's use).
        """
        s = self._get(seq_id)
        if not 0 <= n_tokens <= s.n_tokens:
            raise ValueError(f"truncate of sequence {seq_id} to {n_tokens} tokens: must be in [0, {s.n_tokens}]")
        keep = self.pages_needed(n_tokens)
        freed = s.pages[keep:]
        del s.pages[keep:]
        s.n_tokens = n_tokens
        back = 0  # pages that went back to the free list (a page someone else holds stays with them)
        for p in freed:
            self._unref(p)
            back += p not in self._refs
        if keep_reservation:
            s.reserved += back
            self._reserved_total += back
        return freed

    def release(self, seq_id: int) -> None:
        """Finish or abort ``seq_id``: return its pages and its unused reservation to the pool."""
        s = self._get(seq_id)
        for p in s.pages:
            self._unref(p)
        self._reserved_total -= s.reserved
        del self._seqs[seq_id]

    # ---- queries -----------------------------------------------------------------------------------------------
    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).n_tokens

    def pages_of(self, seq_id: int) -> tuple[int, ...]:
        """Physical pages of ``seq_id`` in logical order."""
        return tuple(self._get(seq_id).pages)

    def reserved_of(self, seq_id: int) -> int:
        """Pages still reserved (not yet assigned) for ``seq_id``."""
        return self._get(seq_id).reserved

    def page_table(self, seq_id: int, width: int) -> np.ndarray:
        """int32 ``[width]``: the physical pages of ``seq_id`` followed by NULL_PAGE (0) padding."""
        pages = self._get(seq_id).pages
        if len(pages) > width:
            raise ValueError(f"sequence {seq_id} has {len(pages)} pages, more than page-table width {width}")
        out = np.zeros((width,), np.int32)
        out[: len(pages)] = pages
        return out

    def page_tables(self, seq_ids: Sequence[int | None], width: int) -> np.ndarray:
        """int32 ``[len(seq_ids), width]``; a ``None`` entry (empty batch slot) gives an all-zero row."""
        out = np.zeros((len(seq_ids), width), np.int32)
        for i, sid in enumerate(seq_ids):
            if sid is not None:
                out[i] = self.page_table(sid, width)
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        owner: dict[int, str] = {}
        for p in self._free:
            assert p not in owner, f"page {p} is on the free list twice"
            owner[p] = "free"
        holders: dict[int, int] = dict(self._held)
        for sid, s in self._seqs.items():
            assert len(set(s.pages)) == len(s.pages), f"sequence {sid} lists a page twice"
            for p in s.pages:
                assert owner.get(p) != "free", f"page {p} of sequence {sid} is also free"
                owner[p] = f"owned by sequence {sid}"
                holders[p] = holders.get(p, 0) + 1
            assert len(s.pages) == self.pages_needed(s.n_tokens), (
                f"sequence {sid} holds {s.n_tokens} tokens in {len(s.pages)} pages, "
                f"expected {self.pages_needed(s.n_tokens)}"
            )
            assert s.reserved >= 0, f"sequence {sid} has negative reservation {s.reserved}"
        for p in self._held:
            assert owner.get(p) != "free", f"held page {p} is also free"
            owner.setdefault(p, "held")
        assert holders == self._refs, f"page reference counts {self._refs} != holders {holders}"
        assert NULL_PAGE not in owner, f"NULL page 0 is {owner.get(NULL_PAGE)}"
        missing = set(range(1, self.n_pages)) - owner.keys()
        assert not missing, f"pages {sorted(missing)} are neither free nor owned"
        extra = owner.keys() - set(range(self.n_pages))
        assert not extra, f"unknown pages {sorted(extra)}"
        total = sum(s.reserved for s in self._seqs.values())
        assert total == self._reserved_total, f"reservation total {self._reserved_total} != sum {total}"
        assert total <= len(self._free), f"{total} pages reserved but only {len(self._free)} on the free list"

    def _get(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id} (not admitted or already released)") from None
