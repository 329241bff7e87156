"""Pool pages (slots of 128 tokens): which are free, which requests hold, which hold a cached prefix.

Without prefix caching a slot is free or held by one request; the lowest free
slot is handed out first.

With prefix caching (``enable_prefix_caching``), every FULL block of a
request's tokens is named by a hash chained to its parent block's,
``sha256(parent hash + the block's 128 token ids)``, so equal hashes mean equal
token sequences from position 0 (no collision between different sequences is
known for sha256). Once a block's K, V and index-K rows are in the cache, its
slot is registered under its hash. A later request whose prompt starts with
the same blocks takes those slots (read-only, reference counted) and prefills
only the rest. A slot nobody holds any more keeps its cached content and
becomes evictable; evictable slots are handed out (their hash forgotten) only
when no never-cached slot is left, least recently released first. A partial
last block is never shared: a request always writes its own.

Framework-neutral: the scheduler calls it; every rank's pool follows the same
slot decisions because every rank runs the block table rank 0 made.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np

from m3_kernels.planner import PAGE_SIZE

__all__ = ["BlockManager", "block_hashes"]


def block_hashes(tokens: np.ndarray, num_blocks: int, parents: Sequence[bytes] = ()) -> list:
    """The chained hashes of the first ``num_blocks`` full blocks of ``tokens`` (int32); ``parents``:
    hashes already known for the first blocks (only the rest are computed)."""
    hashes = list(parents[:num_blocks])
    parent = hashes[-1] if hashes else b""
    for b in range(len(hashes), num_blocks):
        block = np.ascontiguousarray(tokens[b * PAGE_SIZE:(b + 1) * PAGE_SIZE], dtype="<i4")
        parent = hashlib.sha256(parent + block.tobytes()).digest()
        hashes.append(parent)
    return hashes


class BlockManager:
    """The slots of one pool. ``num_slots``: pool pages; ``caching``: keep full blocks for reuse."""

    def __init__(self, num_slots: int, caching: bool):
        self.num_slots, self.caching = num_slots, caching
        self._free = list(range(num_slots))            # never cached (or forgotten), kept sorted
        self._refs = np.zeros(num_slots, np.int64)      # requests holding each slot
        self._cached: dict[bytes, int] = {}             # block hash -> slot
        self._hash_of: dict[int, bytes] = {}            # slot -> its block hash
        self._evictable: collections.OrderedDict = collections.OrderedDict()   # cached, unheld slots, LRU first
        self.hit_tokens = 0       # prompt tokens served from the cache
        self.query_tokens = 0     # prompt tokens of admitted requests

    @property
    def num_available(self) -> int:
        """Slots a request can be given now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def match(self, hashes: Sequence[bytes]) -> list:
        """The slots of the longest cached prefix of these block hashes."""
        slots = []
        for h in hashes:
            slot = self._cached.get(h)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def can_admit(self, hits: Sequence[int], num_new: int) -> bool:
        """True when ``num_new`` more slots can be handed out besides the cached ``hits`` (some of
        which may be evictable now: taking them leaves fewer to hand out)."""
        return num_new <= self.num_available - sum(1 for s in hits if s in self._evictable)

    def admit(self, hits: Sequence[int], num_new: int, prompt_tokens: int) -> np.ndarray:
        """Hold the cached ``hits`` and ``num_new`` fresh slots; -> all of them, in block order."""
        for slot in hits:
            self._evictable.pop(slot, None)
            self._refs[slot] += 1
        fresh = self._free[:num_new]
        del self._free[:len(fresh)]
        while len(fresh) < num_new:   # evict the least recently released cached blocks
            slot, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(slot)]
            fresh.append(slot)
        self._refs[fresh] += 1
        self.hit_tokens += len(hits) * PAGE_SIZE
        self.query_tokens += prompt_tokens
        return np.asarray(list(hits) + fresh, np.int32)

    def register(self, slot: int, block_hash: bytes) -> None:
        """``slot`` now holds the full block named ``block_hash`` (a no-op when that block is cached
        elsewhere already, or caching is off)."""
        if self.caching and block_hash not in self._cached and slot not in self._hash_of:
            self._cached[block_hash] = slot
            self._hash_of[slot] = block_hash

    def release(self, slots: Sequence[int]) -> None:
        """A request lets go of its slots: cached ones become evictable, the others free."""
        freed = []
        for slot in slots:
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                if slot in self._hash_of:
                    self._evictable[slot] = None   # most recently released last
                else:
                    freed.append(slot)
        if freed:
            self._free = sorted(self._free + freed)
