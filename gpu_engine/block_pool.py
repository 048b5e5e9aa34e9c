"""Paged KV memory bookkeeping in tensors: free-block queue, ref counts, block hashes.

Block ids and queue order follow vLLM V1 (block 0 is the null block; the free
queue starts as ``1..N-1``; freed unhashed blocks go to the head, freed cached
blocks to the tail; a prefix hit removes an evictable block from wherever it
is; popping a cached block evicts it).  The prefix-cache map itself
(hash -> blocks) is a host dict, as the issue allows: lookups walk a request's
hash chain, which is inherently sequential.  It is flat: ``entry[h]`` is the
earliest-registered block carrying ``h``, the later ones (duplicates: the same
content computed twice before either was cached, rare) wait in ``duplicates[h]``;
so registering and evicting a block is one store or delete on the common path,
done by the dict itself for a whole batch (no per-hash set of blocks to build
and tear down: that was 12-18% of a capacity sweep).
"""
from __future__ import annotations

import hashlib
from collections import deque

from gpu_engine import xp
from gpu_engine.formulas import free_order
from gpu_engine.xp import Array, Backend

_MASK63 = (1 << 63) - 1
NONE_HASH = int.from_bytes(hashlib.sha256(b"batchspec-gpu-engine-none-hash").digest()[:8], "little") & _MASK63


def hash_block(parent: int | None, tokens) -> int:
    """``h_i = H(h_{i-1}, tokens_i)``, a non-negative int64 (tensor-friendly), over the
    block's token ids (a list or tuple of ints).

    ``H`` is CPython's tuple hash, 64-bit and deterministic for ints (only str and
    bytes hashes are salted per process), ~20x cheaper than sha256 (vLLM V1's
    default block hash was the builtin ``hash`` too).  A chain over full blocks:
    equal hashes mean equal prefixes, up to a ~2⁻⁶³ accidental collision chance
    per pair; the inputs are traces, not an adversary.
    """
    return hash((NONE_HASH if parent is None else parent, *tokens)) & _MASK63


class FreeQueue:
    """vLLM's doubly linked free list as an array deque with tombstones.

    ``buf[head:tail]`` holds the queue; an entry is a block id, or -1 where a
    block was removed from the middle (a prefix hit: ``remove``).  ``pos[b]`` is
    block ``b``'s index in ``buf`` (-1 when not queued).  ``popleft``, ``prepend``
    and ``append`` are slices; removal writes tombstones, which ``popleft``
    skips with one prefix count.  ``buf`` is 3N+2 long and is re-centred
    (compacted) when an end is reached, so every operation is a bounded number
    of array ops.
    """

    def __init__(self, be: Backend, num_blocks: int, first: int):
        self.be, self.n = be, num_blocks
        self.buf_t = be.tensor((3 * num_blocks + 2,), -1)
        self.pos_t = be.tensor((num_blocks,), -1)
        self.buf, self.pos = be.view(self.buf_t), be.view(self.pos_t)
        self.head = num_blocks
        self.tail = self.head
        self.num_tombstones = 0
        self.append(be.arange(num_blocks - first, first))

    def __len__(self) -> int:
        return self.tail - self.head - self.num_tombstones

    def ids(self) -> list[int]:
        live = self.buf[self.head:self.tail]
        return xp.to_list(live[live >= 0])

    def popleft(self, k: int) -> Array:
        """The first ``k`` blocks, removed from the queue (caller checks ``k <= len``)."""
        if k <= 0:
            return self.be.empty_int()
        if self.num_tombstones == 0:
            out = xp.copy(self.buf[self.head:self.head + k])
            self.head += k
        else:
            window = self.buf[self.head:min(self.tail, self.head + k + self.num_tombstones)]
            live = window >= 0
            end = int(xp.searchsorted(live.cumsum(0), self.be.asarray([k]))[0]) + 1  # k-th live entry
            out = window[:end][live[:end]]
            self.num_tombstones -= end - k
            self.head += end
        self.pos[out] = -1
        return out

    def prepend(self, blocks: Array) -> None:
        """Insert at the head keeping order: ``blocks[0]`` becomes the head."""
        m = len(blocks)
        if m == 0:
            return
        if self.head < m:
            self._compact()
        self.buf[self.head - m:self.head] = blocks
        self.pos[blocks] = self.be.arange(m, self.head - m)
        self.head -= m

    def append(self, blocks: Array) -> None:
        m = len(blocks)
        if m == 0:
            return
        if self.tail + m > len(self.buf):
            self._compact()
        self.buf[self.tail:self.tail + m] = blocks
        self.pos[blocks] = self.be.arange(m, self.tail)
        self.tail += m

    def remove(self, blocks: Array) -> None:
        """Take queued blocks out from wherever they are (O(1) each, like the linked list)."""
        if len(blocks) == 0:
            return
        self.buf[self.pos[blocks]] = -1
        self.pos[blocks] = -1
        self.num_tombstones += len(blocks)
        if self.num_tombstones > self.n:
            self._compact()

    def _compact(self) -> None:
        live = self.buf[self.head:self.tail]
        live = xp.copy(live[live >= 0])
        m = len(live)
        self.buf[:] = -1
        self.head = (len(self.buf) - m) // 2
        self.tail = self.head + m
        self.buf[self.head:self.tail] = live
        self.pos[live] = self.be.arange(m, self.head)
        self.num_tombstones = 0


class BlockPool:
    """Ref counts, block hashes, the free queue and the prefix-cache map."""

    release_head_first = False  # a request's table is freed tail first (the scheduler reads this)

    def __init__(self, be: Backend, num_blocks: int, null_block: bool, caching: bool,
                 free_to_tail: bool = False, latest_wins: bool = False):
        self.be, self.caching = be, caching
        #: free_block_order="tail": every freed block re-enters at the tail (FIFO re-use, nano-vllm)
        self.free_to_tail = free_to_tail
        #: cache_duplicates="latest": a hash maps to the block registered last (nano-vllm's dict)
        self.latest_wins = latest_wins
        self.num_blocks = num_blocks
        self.ref_cnt_t = be.tensor((num_blocks,), 0)
        self.block_hash_t = be.tensor((num_blocks,), -1)  # -1: not a cached block
        self.ref_cnt, self.block_hash = be.view(self.ref_cnt_t), be.view(self.block_hash_t)
        self._last_t = be.tensor((num_blocks,), -1)  # scratch for ``free``
        self._last = be.view(self._last_t)
        self.queue = FreeQueue(be, num_blocks, 1 if null_block else 0)
        self.entry: dict[int, int] = {}  # hash -> the earliest-registered block carrying it
        self.duplicates: dict[int, dict[int, None]] = {}  # hash -> its later blocks, in registration order
        self.evicted: list[int] = []  # this step's evictions, in pop order

    def cached_blocks(self) -> list[int]:
        """Every block in the prefix-cache map (entries, then duplicates)."""
        out = list(self.entry.values())
        for more in self.duplicates.values():
            out += more
        return out

    @property
    def num_free(self) -> int:
        return len(self.queue)

    def num_free_uncached(self) -> int:
        """Free blocks without a hash.  They always precede the cached ones in the
        queue (unhashed blocks only ever enter at the head, cached ones at the tail).
        Not so when freed blocks all go to the tail, or when a replaced duplicate loses
        its hash inside the queue: then 0, the safe bound (any pop may evict)."""
        if self.free_to_tail or self.latest_wins:
            return 0
        queued_cached = (self.block_hash >= 0) & (self.queue.pos >= 0)
        return self.num_free - xp.total(queued_cached)

    # -- prefix cache (host map) --
    def lookup(self, hashes: list[int], max_blocks: int) -> list[int]:
        """Longest run of cached blocks for the leading hashes (earliest-cached block per hash)."""
        out = []
        entry = self.entry
        for h in hashes[:max_blocks]:
            b = entry.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def register(self, blocks: Array | list[int], hashes: list[int]) -> None:
        """Cache full blocks (no de-duplication: a hash may map to several; under
        ``latest_wins`` the new block replaces them instead)."""
        ids = blocks if isinstance(blocks, list) else xp.to_list(blocks)
        if self.latest_wins:
            self._register_latest(ids, hashes)
            return
        self.block_hash[self.be.asarray(blocks) if isinstance(blocks, list) else blocks] = self.be.asarray(hashes)
        firsts = list(map(self.entry.setdefault, hashes, ids))  # (in order, in C) each hash's earliest block
        if firsts != ids:  # (rare) duplicates: after the blocks already carrying their hash
            for b, h, first in zip(ids, hashes, firsts):
                if first != b:
                    self.duplicates.setdefault(h, {})[b] = None

    def _register_latest(self, blocks: list[int], hashes: list[int]) -> None:
        """CACHE.LATEST_WINS: in order, each block takes its hash over from the blocks that
        carried it, which lose theirs (no longer hit-able; popping one evicts nothing)."""
        entry = self.entry  # (one block per hash here: never a duplicate)
        for b, h in zip(blocks, hashes):
            old = entry.get(h)
            if old is not None:
                self.block_hash[old] = -1
            entry[h] = b
            self.block_hash[b] = h

    def uncache(self, blocks: list[int], hashes: list[int]) -> None:
        """Take cached blocks (``hashes[i]`` the hash of ``blocks[i]``) out of the map; a
        hash's next duplicate, if any, becomes its entry."""
        entry = self.entry
        if not self.duplicates:  # every hash has one block, the evicted one
            deque(map(entry.__delitem__, hashes), maxlen=0)  # (del entry[h] for each, in C)
            return
        for b, h in zip(blocks, hashes):
            more = self.duplicates.get(h)
            if entry[h] == b:
                if more:
                    entry[h] = next(iter(more))
                    del more[entry[h]]
                else:
                    del entry[h]
            else:
                del more[b]
            if more is not None and not more:
                del self.duplicates[h]

    # -- queue operations --
    def pop(self, k: int) -> Array:
        """``get_new_blocks``: pop ``k`` from the head; cached ones are evicted on the way."""
        out = self.queue.popleft(k)
        if len(out) == 0:
            return out
        self.ref_cnt[out] = 1
        if self.caching:
            hashes = self.block_hash[out]
            if xp.largest(hashes) >= 0:  # (hash -1: not cached)
                cached_mask = hashes >= 0
                ev = out[cached_mask]
                evicted = xp.to_list(ev)
                self.uncache(evicted, xp.to_list(hashes[cached_mask]))
                self.evicted += evicted
                self.block_hash[ev] = -1
        return out

    def touch(self, blocks: Array) -> None:
        """Prefix hit: evictable blocks leave the queue; every hit block gains a reference."""
        if len(blocks) == 0:
            return
        self.queue.remove(blocks[self.ref_cnt[blocks] == 0])
        xp.add_at(self.ref_cnt, blocks, 1)

    def free(self, seq: Array, groups: Array | None = None) -> None:
        """Free a batch of block tables: ``seq`` is the requests' blocks in freeing order
        (each request tail first), ``groups`` the request index of each entry (None: one
        request's table, in which each block appears once).
        Blocks reaching ref 0 re-enter the queue by :func:`free_order`."""
        if len(seq) == 0:
            return
        if groups is None:  # one request's table: each block appears once, so every entry is its last
            self.ref_cnt[seq] -= 1
            last, groups = seq >= 0, seq * 0
        else:
            xp.add_at(self.ref_cnt, seq, -1)
            idx = self.be.arange(len(seq))
            self._last[seq] = -1
            xp.scatter_max(self._last, seq, idx)
            last = self._last[seq] == idx
        zero = self.ref_cnt[seq] == 0
        hashed = self.block_hash[seq] >= 0  # never set when caching is off
        if self.free_to_tail:  # KV.FREE_TO_TAIL: each block at its last occurrence, in order
            self.queue.append(seq[xp.nonzero(last & zero)])
            return
        head, tail = free_order(groups, last, zero, hashed)
        self.queue.prepend(seq[head])
        self.queue.append(seq[tail])
