"""The radix tree over cached KV blocks (cache_eviction="leaf-lru", SGLang's RadixCache).

Under ``cache_eviction="leaf-lru"`` the prefix cache is a radix tree, as in SGLang: each
node holds a run of cached blocks (tokens at ``block_size`` 1), its children are keyed by
the hash of their first block, and a whole node is the unit of eviction.  Where a node's
boundaries fall depends on history, not only on the cached content: a lookup or an
insert that stops inside a node splits it there, and an insert that goes past the
tree's end adds one new leaf for the rest.

Each node carries a recency stamp from one counter (SGLang's ``last_access_time``, from
``get_and_increase_time_counter``): a lookup stamps the node where the match ends and
each ancestor (ancestors a hair older, ``(t, -depth)``); an insert stamps every node it
walks, in walking order; a split stamps the new upper fragment at its creation and then
the lower one; a new leaf is stamped at creation.  Only the order of stamps matters.

Which blocks a request holds stays with :class:`spec.kv.BlockPool` (ref counts): a node
is locked while any request holds one of its blocks (SGLang locks the path from a
request's last node to the root; the spec's block tables hold exactly that path).
"""
from __future__ import annotations

import heapq
from typing import Callable


class RadixNode:
    """A run of cached blocks: ``blocks`` (hash-chained), ``children`` by first-block hash."""

    __slots__ = ("blocks", "parent", "children", "stamp")

    def __init__(self, blocks: list, parent: "RadixNode | None", stamp: tuple[int, int]):
        self.blocks = blocks
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.stamp = stamp

    def __lt__(self, other: "RadixNode") -> bool:  # heap ties never happen: stamps are unique
        return self.stamp < other.stamp


def _common(blocks: list, hashes: list[bytes], start: int) -> int:
    """How many of ``blocks`` carry ``hashes[start:]`` in order."""
    k, n = 0, min(len(blocks), len(hashes) - start)
    while k < n and blocks[k].block_hash == hashes[start + k]:
        k += 1
    return k


class RadixTree:
    """Nodes of cached blocks, their recency stamps, lookup, insert and leaf eviction."""

    def __init__(self) -> None:
        self.clock = 0
        self.root = RadixNode([], None, (0, 0))

    def _tick(self) -> tuple[int, int]:
        self.clock += 1
        return (self.clock, 0)

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node`` after its first ``k`` blocks; return the new upper fragment (SGLang's
        _split_node: the fragment is created, and stamped, before the lower part is re-stamped)."""
        upper = RadixNode(node.blocks[:k], node.parent, self._tick())
        node.blocks = node.blocks[k:]
        node.stamp = self._tick()
        upper.parent.children[upper.blocks[0].block_hash] = upper
        upper.children[node.blocks[0].block_hash] = node
        node.parent = upper
        return upper

    def match(self, hashes: list[bytes]) -> list:
        """The longest run of cached blocks carrying ``hashes``' leading entries; a match that
        ends inside a node splits it there; the last matched node and its ancestors are stamped."""
        node, i, out = self.root, 0, []
        while i < len(hashes):
            child = node.children.get(hashes[i])
            if child is None:
                break
            k = _common(child.blocks, hashes, i)
            partial = k < len(child.blocks)
            if partial:
                child = self._split(child, k)
            out.extend(child.blocks)
            i += k
            node = child
            if partial:
                break
        t, depth = self._tick()[0], 0
        while node is not self.root:
            node.stamp = (t, -depth)
            node, depth = node.parent, depth + 1
        return out

    def insert(self, hashes: list[bytes], blocks: list) -> tuple[list[tuple[int, object]], int]:
        """Insert a request's blocks (``blocks[i]`` carries ``hashes[i]``, not yet cached when
        new).  Walked nodes are stamped in order and split where the request diverges; the
        rest becomes one new leaf.  Returns ``(i, tree block)`` for each position the tree
        already held in a different block than the request's (a duplicate), and where the
        new leaf starts (``len(hashes)`` when nothing was new)."""
        node, i, dups = self.root, 0, []
        while i < len(hashes):
            child = node.children.get(hashes[i])
            if child is None:
                break
            child.stamp = self._tick()
            k = _common(child.blocks, hashes, i)
            if k < len(child.blocks):
                child = self._split(child, k)
            dups.extend((i + j, b) for j, b in enumerate(child.blocks) if b is not blocks[i + j])
            i += k
            node = child
        if i < len(hashes):
            leaf = RadixNode(list(blocks[i:]), node, self._tick())
            node.children[hashes[i]] = leaf
        return dups, i

    def evictable_leaves(self) -> list[RadixNode]:
        """Leaves no request holds a block of (SGLang's evictable_device_leaves)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif all(b.ref_cnt == 0 for b in node.blocks):
                out.append(node)
        return out

    def evict_until(self, done: Callable[[], bool], evict_block: Callable[[object], None]) -> None:
        """Evict whole unlocked leaves, least recently stamped first, until ``done()``; a parent
        left childless and unlocked becomes a candidate with its own stamp."""
        heap = self.evictable_leaves()
        heapq.heapify(heap)
        while heap and not done():
            node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.blocks[0].block_hash]
            for b in node.blocks:
                evict_block(b)
            if parent is not self.root and not parent.children and all(b.ref_cnt == 0 for b in parent.blocks):
                heapq.heappush(heap, parent)
