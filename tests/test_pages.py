"""Tests for the host-side paged-KV page allocator (dflash_jax.kv.pages)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from dflash_jax.kv.pages import NULL_PAGE, OutOfPages, PageAllocator, RequestTooLarge


# ---- construction / sizes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_pages,page_size,match", [(1, 4, "n_pages must be >= 2.*got 1"), (0, 4, "got 0"),
                                                      (8, 0, "page_size must be >= 1, got 0")])
def test_bad_construction(n_pages, page_size, match):
    with pytest.raises(ValueError, match=match):
        PageAllocator(n_pages, page_size)


def test_sizes():
    a = PageAllocator(9, 4)
    assert [a.pages_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert a.capacity_tokens == 32
    assert a.num_free == 8 and a.num_used == 0 and a.num_reserved == 0
    with pytest.raises(ValueError, match="-1"):
        a.pages_needed(-1)
    a.check_invariants()


# ---- admit ------------------------------------------------------------------------------------------------------
def test_admit_reserves_without_assigning():
    a = PageAllocator(9, 4)
    a.admit(7, 10)  # 3 pages
    assert 7 in a and 8 not in a
    assert a.pages_of(7) == () and a.num_tokens(7) == 0 and a.reserved_of(7) == 3
    assert a.num_free == 5 and a.num_used == 0 and a.num_reserved == 3
    a.check_invariants()


def test_admit_errors():
    a = PageAllocator(9, 4)
    with pytest.raises(RequestTooLarge, match=r"33 tokens.*at most 32") as ei:
        a.admit(1, 33)
    assert isinstance(ei.value, ValueError)
    assert not a.can_admit(33) and a.can_admit(32)
    a.admit(1, 20)  # 5 pages
    with pytest.raises(ValueError, match="sequence 1 is already admitted"):
        a.admit(1, 4)
    assert not a.can_admit(13) and a.can_admit(12)
    with pytest.raises(OutOfPages, match=r"needs 4 pages but only 3 are free") as ei:
        a.admit(2, 13)
    assert isinstance(ei.value, RuntimeError)
    assert 2 not in a and a.num_free == 3
    a.admit(2, 12)
    assert a.num_free == 0 and a.can_admit(0)
    a.check_invariants()


# ---- grow -------------------------------------------------------------------------------------------------------
def test_grow_uses_reservation_then_free_pool():
    a = PageAllocator(9, 4)
    a.admit(1, 8)  # 2 reserved
    assert a.grow(1, 3) == [1]
    assert a.reserved_of(1) == 1 and a.num_free == 6
    assert a.grow(1, 4) == []  # still fits in page 1
    assert a.grow(1, 13) == [2, 3, 4]  # 1 from reservation, 2 from the free pool
    assert a.reserved_of(1) == 0 and a.num_free == 4 and a.num_used == 4
    assert a.pages_of(1) == (1, 2, 3, 4) and a.num_tokens(1) == 13
    a.check_invariants()


def test_grow_errors_are_atomic():
    a = PageAllocator(5, 2)  # 4 pages
    a.admit(1, 2)
    a.admit(2, 4)  # 3 reserved total, 1 unreserved free
    a.grow(1, 1)
    with pytest.raises(ValueError, match="from 1 to 0 tokens"):
        a.grow(1, 0)
    before = (a.pages_of(1), a.num_tokens(1), a.reserved_of(1), a.num_free)
    with pytest.raises(OutOfPages, match=r"needs 2 new pages \(0 reserved\) but only 1 unreserved"):
        a.grow(1, 6)
    assert (a.pages_of(1), a.num_tokens(1), a.reserved_of(1), a.num_free) == before
    a.check_invariants()
    # the other sequence's reservation is protected even though sequence 1 ran out
    assert a.grow(2, 4) == [2, 3]
    with pytest.raises(KeyError, match="unknown sequence 9"):
        a.grow(9, 1)
    a.check_invariants()


# ---- truncate ---------------------------------------------------------------------------------------------------
def test_truncate_frees_whole_pages_and_keeps_reservation():
    a = PageAllocator(9, 4)
    a.admit(1, 16)
    a.grow(1, 16)
    assert a.truncate(1, 9) == [4]  # 3 pages still needed
    assert a.pages_of(1) == (1, 2, 3) and a.num_tokens(1) == 9
    assert a.reserved_of(1) == 1 and a.num_free == 4 and a.num_used == 3
    assert a.truncate(1, 9) == []
    a.check_invariants()
    assert a.grow(1, 16) == [4]  # regrowth comes out of the restored reservation
    assert a.reserved_of(1) == 0
    assert a.truncate(1, 0, keep_reservation=False) == [1, 2, 3, 4]
    assert a.reserved_of(1) == 0 and a.num_free == 8 and a.pages_of(1) == ()
    with pytest.raises(ValueError, match=r"to 1 tokens: must be in \[0, 0\]"):
        a.truncate(1, 1)
    with pytest.raises(ValueError, match="-1"):
        a.truncate(1, -1)
    a.check_invariants()


# ---- release ----------------------------------------------------------------------------------------------------
def test_release_returns_pages_and_reservation():
    a = PageAllocator(9, 4)
    a.admit(1, 20)
    a.grow(1, 6)
    a.admit(2, 4)
    a.release(1)
    assert 1 not in a and a.num_free == 7 and a.num_used == 0
    with pytest.raises(KeyError, match="unknown sequence 1"):
        a.release(1)
    a.release(2)
    assert a.num_free == 8 and a.num_reserved == 0
    a.check_invariants()


def test_attach_shares_a_prefix_and_returns_its_reservation():
    a = PageAllocator(n_pages=11, page_size=4)
    a.admit(1, 12)
    a.grow(1, 10)  # pages 1-3
    a.admit(2, 16)  # 4 pages reserved
    assert a.num_free == 10 - 3 - 4
    a.attach(2, a.pages_of(1)[:2])  # shares 8 tokens: two pages of its reservation go back
    assert a.pages_of(2) == (1, 2) and a.num_tokens(2) == 8 and a.reserved_of(2) == 2 and a.num_free == 5
    assert a.grow(2, 13) == [4, 5]  # its own pages after the shared ones
    a.check_invariants()
    with pytest.raises(ValueError, match="already holds"):
        a.attach(2, (3,))
    a.release(1)  # the shared pages stay with 2
    assert a.pages_of(2) == (1, 2, 4, 5)
    a.release(2)
    assert a.num_free == 10 and a.num_used == 0
    a.check_invariants()


def test_freed_pages_are_reused_lowest_first():
    a = PageAllocator(9, 1)
    for sid in range(4):
        a.admit(sid, 1)
        a.grow(sid, 1)
    a.release(2)
    a.release(0)
    a.admit(10, 3)
    assert a.grow(10, 3) == [1, 3, 5]


def test_deterministic():
    def run():
        a = PageAllocator(17, 3)
        out = []
        for sid in range(5):
            a.admit(sid, 6)
            out += a.grow(sid, 4)
        a.release(1)
        a.truncate(3, 1)
        for sid in (0, 2, 3):
            out += a.grow(sid, 9)
        return out, [a.pages_of(s) for s in (0, 2, 3, 4)]

    assert run() == run()


# ---- page tables ------------------------------------------------------------------------------------------------
def test_page_table_pads_with_null_page():
    a = PageAllocator(9, 4)
    a.admit(1, 8)
    a.admit(2, 12)
    a.grow(2, 10)
    a.grow(1, 5)
    t = a.page_table(1, 5)
    assert t.dtype == np.int32 and t.shape == (5,)
    assert t.tolist() == [4, 5, 0, 0, 0]
    ts = a.page_tables([2, None, 1], 4)
    assert ts.dtype == np.int32 and ts.shape == (3, 4)
    assert ts.tolist() == [[1, 2, 3, 0], [0, 0, 0, 0], [4, 5, 0, 0]]
    assert a.page_tables([], 4).shape == (0, 4)
    with pytest.raises(ValueError, match="sequence 2 has 3 pages, more than page-table width 2"):
        a.page_table(2, 2)
    with pytest.raises(KeyError, match="unknown sequence 3"):
        a.page_tables([3], 4)


def test_null_page_never_handed_out():
    a = PageAllocator(6, 2)
    a.admit(1, 10)
    pages = a.grow(1, 10)
    assert sorted(pages) == [1, 2, 3, 4, 5] and NULL_PAGE not in pages
    assert a.num_free == 0
    with pytest.raises(OutOfPages):
        a.grow(1, 11)
    a.check_invariants()


def test_check_invariants_detects_corruption():
    a = PageAllocator(9, 4)
    a.admit(1, 8)
    a.grow(1, 8)
    a._seqs[1].pages.append(a._free[0])  # page both owned and free, and wrong page count
    with pytest.raises(AssertionError, match="page 3 of sequence 1 is also free"):
        a.check_invariants()
    b = PageAllocator(9, 4)
    b._free.append(0)
    with pytest.raises(AssertionError, match="NULL page 0"):
        b.check_invariants()
    c = PageAllocator(9, 4)
    c._free.pop()
    with pytest.raises(AssertionError, match=r"pages \[8\] are neither free nor owned"):
        c.check_invariants()


# ---- random operation sequences ---------------------------------------------------------------------------------
class AllocatorMachine(RuleBasedStateMachine):
    """Random admit/grow/truncate/finish/abort sequences against a simple model of the expected state."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.a: PageAllocator | None = None
        self.next_id = 0
        self.model: dict[int, dict] = {}  # seq_id -> {"tokens", "limit"}
        self.holds: list[tuple[int, ...]] = []  # pages held (as the prefix cache holds a cached prefix's)

    @precondition(lambda self: self.a is None)
    @rule(n_pages=st.integers(2, 40), page_size=st.sampled_from([1, 2, 3, 16]))
    def init(self, n_pages, page_size):
        self.a = PageAllocator(n_pages, page_size)

    @precondition(lambda self: self.a is not None)
    @rule(target=seqs, frac=st.floats(0, 1.2))
    def admit(self, frac):
        a = self.a
        n = int(frac * a.capacity_tokens)
        sid, self.next_id = self.next_id, self.next_id + 1
        free_before = a.num_free
        if n > a.capacity_tokens:
            with pytest.raises(RequestTooLarge):
                a.admit(sid, n)
        elif a.pages_needed(n) > free_before:
            assert not a.can_admit(n)
            with pytest.raises(OutOfPages):
                a.admit(sid, n)
        else:
            assert a.can_admit(n)
            a.admit(sid, n)
            assert a.num_free == free_before - a.pages_needed(n)
            self.model[sid] = {"tokens": 0, "limit": n, "guaranteed": True}
        return sid

    @precondition(lambda self: self.a is not None)
    @rule(sid=seqs, extra=st.integers(0, 40), within_reservation=st.booleans())
    def grow(self, sid, extra, within_reservation):
        if sid not in self.model:
            return
        a, m = self.a, self.model[sid]
        target = m["tokens"] + extra
        if within_reservation:
            target = max(min(target, m["limit"]), m["tokens"])
        held = a.pages_needed(m["tokens"])
        need = a.pages_needed(target) - held
        avail = a.reserved_of(sid) + a.num_free
        used_before = a.num_used
        if need > avail:
            # growth within the admitted size never fails unless the reservation was given up
            assert target > m["limit"] or not m["guaranteed"]
            before = (a.pages_of(sid), a.num_free, a.num_reserved)
            with pytest.raises(OutOfPages):
                a.grow(sid, target)
            assert (a.pages_of(sid), a.num_free, a.num_reserved) == before
        else:
            new = a.grow(sid, target)
            assert len(new) == max(0, need) and NULL_PAGE not in new
            assert a.num_used == used_before + len(new)
            m["tokens"] = target
        assert a.num_tokens(sid) == m["tokens"]

    @precondition(lambda self: self.a is not None)
    @rule(sid=seqs, frac=st.floats(0, 1), keep=st.booleans())
    def truncate(self, sid, frac, keep):
        if sid not in self.model:
            return
        m = self.model[sid]
        n = int(frac * m["tokens"])
        reserved_before = self.a.reserved_of(sid)
        freed = self.a.truncate(sid, n, keep_reservation=keep)
        assert len(freed) == self.a.pages_needed(m["tokens"]) - self.a.pages_needed(n)
        # a freed page another holder keeps (a hold, another sequence sharing it) is not re-reserved
        still = {p for s in self.model for p in self.a.pages_of(s)} | {p for h in self.holds for p in h}
        back = sum(p not in still for p in freed)
        assert self.a.reserved_of(sid) == reserved_before + (back if keep else 0)
        m["tokens"] = n
        m["guaranteed"] &= (keep and back == len(freed)) or not freed

    @precondition(lambda self: self.a is not None)
    @rule(sid=consumes(seqs))
    def finish(self, sid):
        if sid in self.model:
            self.a.release(sid)
            del self.model[sid]
        assert sid not in self.a

    @precondition(lambda self: self.a is not None)
    @rule(sid=consumes(seqs))
    def abort(self, sid):
        # an abort may come for a request that was never admitted (or already finished)
        if sid in self.model:
            self.a.release(sid)
            del self.model[sid]
        else:
            with pytest.raises(KeyError):
                self.a.release(sid)

    @precondition(lambda self: self.a is not None)
    @rule(sid=seqs, frac=st.floats(0, 1))
    def hold(self, sid, frac):
        if sid not in self.model:
            return
        full = self.model[sid]["tokens"] // self.a.page_size
        pages = self.a.pages_of(sid)[: int(frac * full)]
        if pages:
            self.a.hold(pages)
            self.holds.append(pages)

    @precondition(lambda self: self.a is not None and self.holds)
    @rule(i=st.integers(0, 1000))
    def drop(self, i):
        pages = self.holds.pop(i % len(self.holds))
        free_before = self.a.num_free
        self.a.drop(pages)
        still = {p for s in self.model for p in self.a.pages_of(s)} | {p for h in self.holds for p in h}
        assert self.a.num_free == free_before + sum(p not in still for p in pages)

    @precondition(lambda self: self.a is not None and self.holds)
    @rule(target=seqs, i=st.integers(0, 1000), extra=st.integers(0, 40))
    def admit_over_prefix(self, i, extra):
        a = self.a
        prefix = self.holds[i % len(self.holds)]
        n = len(prefix) * a.page_size + extra
        sid, self.next_id = self.next_id, self.next_id + 1
        if n > a.capacity_tokens or a.pages_needed(n) - len(prefix) > a.num_free:
            assert not a.can_admit(n, len(prefix))
            return sid
        free_before = a.num_free
        a.admit(sid, n, prefix)
        assert a.pages_of(sid) == prefix and a.num_tokens(sid) == len(prefix) * a.page_size
        assert a.num_free == free_before - (a.pages_needed(n) - len(prefix))
        self.model[sid] = {"tokens": len(prefix) * a.page_size, "limit": n, "guaranteed": True}
        return sid

    @precondition(lambda self: self.a is not None)
    @rule(width=st.integers(0, 40))
    def tables(self, width):
        ids = sorted(self.model)
        if any(len(self.a.pages_of(s)) > width for s in ids):
            return
        t = self.a.page_tables(ids + [None], width)
        assert t.shape == (len(ids) + 1, width) and not t[-1].any()
        for row, s in zip(t, ids):
            k = len(self.a.pages_of(s))
            assert tuple(row[:k]) == self.a.pages_of(s) and not row[k:].any()

    @invariant()
    def consistent(self):
        if self.a is None:
            return
        self.a.check_invariants()
        for sid, m in self.model.items():
            assert self.a.num_tokens(sid) == m["tokens"]
        assert set(self.model) == {s for s in range(self.next_id) if s in self.a}

    def teardown(self):
        if self.a is None:
            return
        for sid in list(self.model):
            self.a.release(sid)
        self.a.check_invariants()
        assert self.a.num_held == len({p for h in self.holds for p in h})
        for pages in self.holds:
            self.a.drop(pages)
        self.a.check_invariants()
        assert self.a.num_free == self.a.n_pages - 1
        assert self.a.num_used == 0 and self.a.num_reserved == 0


AllocatorMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=80, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
