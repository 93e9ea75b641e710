"""Prompt-prefix caching for a hybrid model: KV pages shared by reference, recurrent state restored from a snapshot.

Attention layers can reuse any cached prefix page by page, but a Gated DeltaNet layer's state after a prefix exists
only where it was saved. So a prefix is cached at prefill-chunk boundaries (``chunk`` tokens, a multiple of the page
size): when a request's prefill reaches a boundary ``L`` (``L`` < its prompt length), the engine copies its
recurrent slot into a snapshot slot and the cache holds the pages of ``[0, L)``. A later request whose prompt starts
with those ``L`` tokens (and is longer) is admitted over the shared pages, its slot restored from the snapshot, and
prefills from ``L`` on: the same chunks at the same positions as without the cache, so the same numbers.

Keys are a hash chain over the chunks (``key(L) = blake2b(key(L - chunk) || tokens[L - chunk: L])``), so finding
the longest cached prefix of a prompt costs one pass over it. When a snapshot slot is needed, or admission needs
pages that only cached prefixes hold, the entry evicted is the one fewest prompts have passed through (a shared head
outlives the deeper boundaries of the prompts that pass it), the least recently used among those. Host-side bookkeeping only;
the copies between slots are the engine's (``Engine._copy_slot``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from dflash_jax.kv.pages import PageAllocator


def chunk_keys(tokens: Sequence[int], chunk: int, limit: int) -> list[tuple[int, bytes]]:
    """``[(L, key(L))]`` for every boundary ``L = chunk, 2 chunk, ... <= limit``."""
    out, h = [], b""
    arr = np.asarray(tokens, np.int64)
    for end in range(chunk, min(limit, len(arr)) + 1, chunk):
        h = hashlib.blake2b(h + arr[end - chunk: end].tobytes(), digest_size=16).digest()
        out.append((end, h))
    return out


@dataclasses.dataclass
class Entry:
    key: bytes
    n_tokens: int
    pages: tuple[int, ...]  # physical pages of [0, n_tokens), held by the cache
    snapshot: int  # recurrent slot holding the state after n_tokens tokens
    uses: int = 1  # prompts that reached this boundary (the one that computed it, and later ones)


class PrefixCache:
    """Cached prompt prefixes over ``alloc``'s pages, one recurrent snapshot slot each (``snapshot_slots``)."""

    def __init__(self, alloc: PageAllocator, chunk: int, snapshot_slots: Sequence[int]) -> None:
        if chunk % alloc.page_size:
            raise ValueError(f"prefix caching needs prefill_chunk ({chunk}) to be a multiple of page_size "
                             f"({alloc.page_size}): a cached prefix is whole pages")
        if not snapshot_slots:
            raise ValueError("prefix caching needs at least one snapshot slot")
        self.alloc, self.chunk = alloc, chunk
        self._free_slots = list(snapshot_slots)
        self._entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()  # least recent first
        self.counters = collections.Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> Entry | None:
        """The longest cached prefix of ``prompt`` that leaves at least one token to prefill (``use`` it when it
        is taken: a request still waiting for pages may look again)."""
        best = None
        for _, key in chunk_keys(prompt, self.chunk, len(prompt) - 1):
            if key in self._entries:
                best = key
        return None if best is None else self._entries[best]

    def use(self, entry: Entry) -> None:
        """A request was admitted over ``entry``: one more use, and the most recent."""
        self._entries.move_to_end(entry.key)
        entry.uses += 1
        self.counters["hits"] += 1

    def wants(self, prompt: Sequence[int], n_tokens: int) -> bytes | None:
        """The key to cache ``prompt[:n_tokens]`` under, or None (not a boundary, the whole prompt, or cached)."""
        if n_tokens % self.chunk or not 0 < n_tokens < len(prompt):
            return None
        key = chunk_keys(prompt, self.chunk, n_tokens)[-1][1]
        if key in self._entries:  # another prompt through the same boundary
            self._entries.move_to_end(key)
            self._entries[key].uses += 1
            return None
        return key

    def insert(self, key: bytes, n_tokens: int, pages: Sequence[int]) -> int | None:
        """Cache a prefix (its pages are in use by the sequence that computed them); returns the snapshot slot to
        copy the sequence's state into, or None when no slot can be had."""
        if not self._free_slots and not self.evict_one():
            return None
        slot = self._free_slots.pop()
        pages = tuple(pages[: n_tokens // self.alloc.page_size])
        self.alloc.hold(pages)
        self._entries[key] = Entry(key, n_tokens, pages, slot)
        self.counters["inserted"] += 1
        return slot

    def evict_one(self, keep: Entry | None = None) -> bool:
        """Drop the entry fewest prompts used, least recently used among those (not ``keep``); False when there is
        none."""
        order = {k: i for i, k in enumerate(self._entries)}  # least recent first
        cands = [k for k, e in self._entries.items() if e is not keep]
        if not cands:
            return False
        key = min(cands, key=lambda k: (self._entries[k].uses, order[k]))
        e = self._entries.pop(key)
        self.alloc.drop(e.pages)
        self._free_slots.append(e.snapshot)
        self.counters["evicted"] += 1
        return True

    def make_room(self, n_tokens: Sequence[int], keep: Entry | None = None) -> bool:
        """Evict entries until ``alloc`` can admit sequences of ``n_tokens`` (the first over ``keep``'s pages: a
        request, or a group admitted together); whether it can."""
        n_prefix = len(keep.pages) if keep is not None else 0
        while not self.alloc.can_admit_all(n_tokens, n_prefix):
            if not self.evict_one(keep):
                return False
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass
