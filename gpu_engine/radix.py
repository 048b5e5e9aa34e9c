"""SGLang-style radix cache over the block pool (cache_eviction="leaf-lru", cache_dedup="on-insert").

The cached blocks form a trie of hash-chained blocks kept per block on the host: ``up[b]``
(the block before ``b`` on its path, -1 at the root), ``kids[b]`` (hash -> next block;
``top`` for the root) and ``head[b]`` (``b`` starts a tree node: a run of blocks evicted
together).  A node runs from its head through single non-head children to its end; a
node's recency is ``stamp[head]`` from one counter.  Free blocks are counted as in
:class:`~gpu_engine.block_pool.BlockPool` (the queue holds evictable cached blocks too);
new blocks come from ``clean``, the free blocks without content, oldest first.
"""
from __future__ import annotations

import heapq
from collections import deque

from gpu_engine import xp
from gpu_engine.block_pool import BlockPool
from gpu_engine.xp import Array, Backend


class RadixBlockPool(BlockPool):
    """:class:`BlockPool` whose cached blocks are a radix trie evicted a whole leaf node at a time."""

    release_head_first = True  # SGLang frees a request's slots as a slice of its row, first slot first

    def __init__(self, be: Backend, num_blocks: int, null_block: bool, caching: bool):
        super().__init__(be, num_blocks, null_block, caching)
        self.clean: deque[int] = deque(range(1 if null_block else 0, num_blocks))
        self.up = [-1] * num_blocks
        self.kids: list[dict[int, int] | None] = [None] * num_blocks
        self.top: dict[int, int] = {}
        self.head = [False] * num_blocks
        self.stamp: dict[int, tuple[int, int]] = {}  # node head -> recency
        self.clock = 0
        self.owed = 0  # KV.BATCH_ALLOCATION: blocks promised to the forming prefill batch

    @property
    def num_free(self) -> int:
        return len(self.queue) - self.owed

    # -- trie walking --
    def _tick(self) -> tuple[int, int]:
        self.clock += 1
        return (self.clock, 0)

    def _children(self, b: int) -> dict[int, int]:
        if b < 0:
            return self.top
        k = self.kids[b]
        if k is None:
            k = self.kids[b] = {}
        return k

    def _inner_next(self, b: int) -> int:
        """The block after ``b`` within its node, or -1 when ``b`` ends its node."""
        k = self.kids[b]
        if not k or len(k) != 1:
            return -1
        (c,) = k.values()
        return -1 if self.head[c] else c

    def _node_head(self, b: int) -> int:
        while not self.head[b]:
            b = self.up[b]
        return b

    def _cut_after(self, b: int) -> None:
        """Split ``b``'s node after ``b``: the upper part is re-created, then the lower re-stamped."""
        c = self._inner_next(b)
        self.stamp[self._node_head(b)] = self._tick()
        self.head[c] = True
        self.stamp[c] = self._tick()

    def _walk_node(self, first: int, hashes: list[int], i: int, visit) -> tuple[int, int]:
        """Follow ``first``'s node along ``hashes[i:]``; ``visit(i, block)`` per matched
        position.  Returns (last matched block, next position)."""
        b = first
        while True:
            visit(i, b)
            i += 1
            c = self._inner_next(b)
            if c < 0 or i >= len(hashes) or int(self.block_hash[c]) != hashes[i]:
                return b, i
            b = c

    def lookup(self, hashes: list[int], max_blocks: int) -> list[int]:
        """Longest cached run for the leading ``max_blocks`` hashes; a match ending inside a
        node splits it; the last node matched and its ancestors become the most recent."""
        hashes = hashes[:max_blocks]
        out: list[int] = []
        cur, i = -1, 0
        while i < len(hashes):
            b = self._children(cur).get(hashes[i])
            if b is None:
                break
            cur, i = self._walk_node(b, hashes, i, lambda _, x: out.append(x))
            if self._inner_next(cur) >= 0:
                self._cut_after(cur)
                break
        t, depth = self._tick()[0], 0
        while cur >= 0:
            h = self._node_head(cur)
            self.stamp[h] = (t, -depth)
            cur, depth = self.up[h], depth + 1
        return out

    def insert(self, hashes: list[int], blocks: list[int]) -> tuple[list[tuple[int, int]], int]:
        """Walk ``blocks`` (carrying ``hashes``) into the trie: each node met is stamped, the
        one the path leaves is split, the rest becomes a new node.  Returns the positions the
        trie held in another block, with that block, and where the new node starts."""
        dups: list[tuple[int, int]] = []
        cur, i = -1, 0
        while i < len(hashes):
            b = self._children(cur).get(hashes[i])
            if b is None:
                break
            self.stamp[b] = self._tick()
            cur, i = self._walk_node(b, hashes, i, lambda j, x: dups.append((j, x)) if x != blocks[j] else None)
            if self._inner_next(cur) >= 0:
                self._cut_after(cur)
        if i < len(hashes):
            prev = cur
            for j in range(i, len(hashes)):
                b = blocks[j]
                self.up[b] = prev
                self._children(prev)[hashes[j]] = b
                self.head[b] = j == i
                prev = b
            self.stamp[blocks[i]] = self._tick()
            self.block_hash[self.be.asarray(blocks[i:])] = self.be.asarray(hashes[i:])
            self.entry.update(zip(hashes[i:], blocks[i:]))  # (the base pool's map: one block per hash here)
        return dups, i

    # -- eviction --
    def _node_blocks(self, h: int) -> list[int]:
        out = [h]
        c = self._inner_next(h)
        while c >= 0:
            out.append(c)
            c = self._inner_next(c)
        return out

    def _evictable(self, h: int) -> bool:
        blocks = self._node_blocks(h)
        return not self.kids[blocks[-1]] and all(int(self.ref_cnt[b]) == 0 for b in blocks)

    def make_room(self, n: int) -> None:
        """CACHE.EVICT_LEAF_LRU: evict unlocked leaf nodes, oldest stamp first, until ``n``
        free blocks hold no content; a parent node left childless joins the candidates."""
        if len(self.clean) >= n:
            return
        heap = [(self.stamp[h], h) for h in self.stamp if self._evictable(h)]
        heapq.heapify(heap)
        while heap and len(self.clean) < n:
            _, h = heapq.heappop(heap)
            blocks, parent = self._node_blocks(h), self.up[h]
            del self._children(parent)[int(self.block_hash[h])]
            for b in blocks:
                del self.entry[int(self.block_hash[b])]
            del self.stamp[h]
            for b in blocks:
                self.kids[b] = None
                self.head[b] = False
                self.up[b] = -1
            self.block_hash[self.be.asarray(blocks)] = -1
            self.evicted += blocks
            self.clean.extend(blocks)
            if parent >= 0:
                ph = self._node_head(parent)
                if self._evictable(ph):
                    heapq.heappush(heap, (self.stamp[ph], ph))

    def evict_all(self) -> None:
        self.make_room(self.num_blocks + 1)

    # -- the pool's operations --
    def num_free_uncached(self) -> int:
        return len(self.clean)

    def pop(self, k: int) -> Array:
        """KV.FREE_TO_RELEASE: ``k`` content-free blocks, oldest free first (evicting first)."""
        if k <= 0:
            return self.be.empty_int()
        self.make_room(k)
        out = self.be.asarray([self.clean.popleft() for _ in range(k)])
        self.queue.remove(out)
        self.ref_cnt[out] = 1
        return out

    def free(self, seq: Array, groups: Array | None = None) -> None:
        """As :meth:`BlockPool.free`; the content-free blocks that reach ref 0 also join ``clean``."""
        if len(seq) == 0:
            return
        super().free(seq, groups)  # (leaves ``_last[b]``: the index of b's last entry in seq, unless one group)
        gone = (self.ref_cnt[seq] == 0) & (self.block_hash[seq] < 0)
        if groups is not None:
            gone &= self._last[seq] == self.be.arange(len(seq))
        self.clean.extend(xp.to_list(seq[gone]))
