"""Paged KV memory: the block pool, prefix caching, allocation and freeing.

State
    ``blocks``      every block: id, ref count, and the hash of its contents if cached
    ``free``        the free queue: truly free blocks *and* evictable cached blocks
                    (ref count 0, hash kept), in the order they will be re-used
    ``cached``      hash -> blocks with that content (insertion ordered, no de-dup)
    ``req_blocks``  request -> its block table

Actions (each preserves the invariants in :mod:`spec.invariants`)
    ``get_computed_blocks``  prefix-cache lookup for a request being admitted
    ``allocate_slots``       find blocks for this step's tokens, or fail with no effect
    ``free``                 return a finished or preempted request's blocks
    ``touch``                take cached blocks out of the free queue for a hit

Everything follows vLLM V1 (``block_pool.py``, ``kv_cache_manager.py``; see
docs/reference/vllm-v1.md §2), with block ids equal to vLLM's.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from spec.config import SchedulerConfig
from spec.radix import RadixTree
from spec.rules import declare, fired, rule


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@rule("CACHE.BLOCK_HASH", knobs=("enable_prefix_caching", "block_size"))
def hash_block(parent: bytes | None, tokens: Iterable[int]) -> bytes:
    """A full block's hash chains its parent's hash with its own token ids.

    ``hash_i = sha256(hash_{i-1} || tokens of block i)``, so two blocks are equal
    only if their whole prefixes are equal.  Only *full* blocks have a hash; the
    partially filled last block of a sequence never does (vLLM hashes with
    sha256 too; the hash values themselves are never compared across engines).
    """
    h = hashlib.sha256(parent or b"batchspec-none-hash")
    h.update(array("q", tokens).tobytes())
    return h.digest()


@rule("CACHE.SALT", knobs=("enable_prefix_caching",))
def salted_first_hash(first_hash: bytes, cache_salt: str) -> bytes:
    """A request's ``cache_salt`` is mixed into the hash of its first block only.

    vLLM adds ``("cache_salt", salt)`` to the extra keys of the block starting at
    token 0 (an empty salt adds nothing); every later hash chains on that one, so
    two requests share prefix blocks only if their salts are equal (or both unset).
    """
    return hashlib.sha256(b"batchspec-cache-salt\0" + cache_salt.encode() + b"\0" + first_hash).digest()


@rule("CACHE.SKIP_READ", knobs=("enable_prefix_caching",), applies=bool)
def skips_prefix_cache(req) -> bool:
    """A request marked ``skip_prefix_cache`` never reads the prefix cache: it hits
    nothing at admission or on resumption and computes its whole sequence.

    vLLM sets ``skip_reading_prefix_cache`` for requests with ``prompt_logprobs`` (a hit
    would skip the positions whose logprobs were asked for).  Only reading is skipped:
    its full blocks are still hashed and registered, so later requests hit them.
    """
    return bool(getattr(req, "skip_prefix_cache", False))


class SequenceLike(Protocol):
    request_id: str
    num_computed_tokens: int
    block_hashes: list[bytes]

    @property
    def num_tokens(self) -> int: ...


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    #: the block id as the step record's ``ref_counts`` keys it (a JSON object key), made once, not every step
    log_key: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.log_key = str(self.block_id)


class FreeBlockQueue:
    """The free queue: O(1) pop from the head, append, prepend and remove from the middle."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self._q: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._q

    def ids(self) -> list[int]:
        return list(self._q)

    def popleft_n(self, n: int) -> list[KVBlock]:
        return [self._q.popitem(last=False)[1] for _ in range(n)]

    def append_n(self, blocks: list[KVBlock]) -> None:
        for b in blocks:
            self._q[b.block_id] = b

    def prepend_n(self, blocks: list[KVBlock]) -> None:
        """Insert ``blocks`` at the head, keeping their order (the first becomes the head)."""
        for b in reversed(blocks):
            self._q[b.block_id] = b
            self._q.move_to_end(b.block_id, last=False)

    def remove(self, block: KVBlock) -> None:
        del self._q[block.block_id]


class BlockPool:
    """All KV blocks, the free queue and the prefix-cache map."""

    def __init__(self, cfg: SchedulerConfig):
        self.caching = cfg.enable_prefix_caching
        if cfg.free_block_order == "tail":  # nano-vllm's free order (KV.FREE_TO_TAIL)
            self.free_blocks = self.free_blocks_to_tail
        if cfg.cache_duplicates == "latest":  # nano-vllm's cache map (CACHE.LATEST_WINS)
            self.cache_full_block = self.cache_latest
        self.blocks = [KVBlock(i) for i in range(cfg.num_blocks)]
        first = 1 if cfg.null_block else 0
        self.null_block = self.blocks[0] if cfg.null_block else None
        self.free = FreeBlockQueue(self.blocks[first:])
        self.cached: dict[bytes, dict[int, KVBlock]] = {}
        self.evicted: list[int] = []  # block ids evicted since the last ``take_evicted``

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The earliest-cached block still holding this content (vLLM: first in the map)."""
        same = self.cached.get(block_hash)
        return next(iter(same.values())) if same else None

    @rule("KV.POP_HEAD", knobs=("cache_eviction",))
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """New blocks are popped from the head of the free queue, in order.

        A popped block that still holds cached content is evicted right then
        (lazy eviction): its hash leaves the cache map.  Because freed cached
        blocks go to the tail and unhashed ones to the head, this re-uses
        never-cached memory first and evicts cached blocks in LRU order.
        """
        assert n <= len(self.free), "callers check capacity first"
        out = self.free.popleft_n(n)
        for b in out:
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
        return out

    @rule("CACHE.EVICT_LRU", knobs=("enable_prefix_caching", "cache_eviction"))
    def _evict(self, b: KVBlock) -> None:
        """A cached block is evicted only when popped for re-use, never earlier.

        Until then it stays hit-able in the free queue (vLLM's lazy LRU eviction).
        """
        self._uncache(b)

    def _uncache(self, b: KVBlock) -> None:
        """Drop ``b``'s entry from the cache map and log it as evicted."""
        same = self.cached[b.block_hash]
        del same[b.block_id]
        if not same:
            del self.cached[b.block_hash]
        b.block_hash = None
        self.evicted.append(b.block_id)

    @rule("CACHE.TOUCH", knobs=("enable_prefix_caching",))
    def touch(self, blocks: list[KVBlock]) -> None:
        """A prefix hit takes each hit block out of the free queue and adds a reference.

        A block that was evictable (ref count 0) stops being evictable; when it
        is freed again it goes to the tail: the LRU "most recently used" move.
        """
        for b in blocks:
            if b.ref_cnt == 0:
                self.free.remove(b)
            b.ref_cnt += 1

    @staticmethod
    def _unref(ordered: list[KVBlock]) -> list[KVBlock]:
        """Drop one reference from each block; the blocks left with none, in the given order."""
        zero = []
        for b in ordered:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                zero.append(b)
        return zero

    @rule("KV.FREE_REVERSED", knobs=("cache_eviction",))
    def release_order(self, table: list[KVBlock]) -> list[KVBlock]:
        """A finished, aborted or preempted request returns its blocks tail first.

        Freeing in reverse puts the deepest prefix block ahead of the leading ones,
        so the leading blocks (shared most often) stay cached longest.
        """
        return table[::-1]

    @rule("KV.FREE_ORDER", knobs=("enable_prefix_caching", "free_block_order", "cache_eviction"))
    def free_blocks(self, ordered: list[KVBlock]) -> None:
        """Freed blocks whose ref count reaches 0 re-enter the free queue.

        Blocks without a hash (all of them when caching is off) go to the *head*,
        keeping the given order, so the next allocation re-uses them first (LIFO
        for locality).  Cached blocks go to the *tail*, so they are evicted last
        and in the order they were freed (LRU).  Shared blocks that still have
        holders stay out of the queue.
        """
        zero = self._unref(ordered)
        self.free.prepend_n([b for b in zero if b.block_hash is None])
        self.free.append_n([b for b in zero if b.block_hash is not None])

    @rule("KV.FREE_TO_TAIL", knobs=("free_block_order",))
    def free_blocks_to_tail(self, ordered: list[KVBlock]) -> None:
        """Under free_block_order="tail", every freed block whose ref count reaches 0
        goes to the *tail* of the free queue, in the given order, cached or not.

        Blocks are then re-used first in, first out: a block freed long ago is popped
        before one freed just now (nano-vllm's deque of free block ids).  A cached block
        keeps its hash until it is popped, as under KV.FREE_ORDER.
        """
        zero = self._unref(ordered)
        self.free.append_n(zero)

    @rule("CACHE.REGISTER_AT_ALLOCATION", knobs=("enable_prefix_caching", "cache_register"))
    def cache_full_block(self, b: KVBlock, block_hash: bytes) -> None:
        """A full block is registered in the prefix cache as soon as it is allocated.

        This happens before the forward pass computes it (vLLM does the same), so
        two identical prompts admitted in the same step share blocks.  Several
        blocks may hold the same content; a lookup returns the earliest.
        """
        b.block_hash = block_hash
        self.cached.setdefault(block_hash, {})[b.block_id] = b

    @rule("CACHE.LATEST_WINS", knobs=("cache_duplicates",))
    def cache_latest(self, b: KVBlock, block_hash: bytes) -> None:
        """Under cache_duplicates="latest", a block registered with a hash that another
        block already carries replaces it in the cache map: the earlier block loses its
        hash (it is no longer hit-able, and popping it later evicts nothing).

        nano-vllm keeps one block id per hash and overwrites it; two requests that compute
        the same prefix in one step leave the map pointing at the second one's block.
        """
        for old in list(self.cached.get(block_hash, {}).values()):
            old.block_hash = None
        self.cached[block_hash] = {b.block_id: b}
        b.block_hash = block_hash

    def take_evicted(self) -> list[int]:
        out, self.evicted = self.evicted, []
        return out


class OwedBlock(KVBlock):
    """A block table entry whose block is taken when the prefill batch is complete (KV.BATCH_ALLOCATION)."""


class RadixPool(BlockPool):
    """The block pool under cache_eviction="leaf-lru": cached blocks live in a radix tree
    (:class:`spec.radix.RadixTree`) whose unlocked leaves are evicted whole.

    ``free`` still holds every free block, evictable cached ones included, so
    ``num_free_blocks`` counts free + evictable as under block-lru; new blocks come from
    ``clean``, the free blocks without cached content, in the order they became free
    (KV.FREE_TO_RELEASE).
    """

    def __init__(self, cfg: SchedulerConfig):
        super().__init__(cfg)
        self.tree = RadixTree()
        self.clean = FreeBlockQueue(self.blocks[1 if cfg.null_block else 0:])
        #: KV.BATCH_ALLOCATION: while a prefill batch forms, new blocks are IOUs taken afterwards
        self.deferring = False
        self.owed: list[OwedBlock] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) - len(self.owed)

    def lookup(self, hashes: list[bytes]) -> list[KVBlock]:
        """CACHE.EVICT_LEAF_LRU's tree lookup: a match that ends inside a node splits it, and
        the matched path becomes the most recently used."""
        return self.tree.match(hashes)

    @rule("KV.FREE_TO_RELEASE", knobs=("cache_eviction",))
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Under cache_eviction="leaf-lru", new blocks are the free blocks without cached content,
        oldest first: never-used blocks in id order, then blocks in the order they were freed or
        evicted (whole leaves are evicted first when too few are free, CACHE.EVICT_LEAF_LRU).

        SGLang's token allocator hands out its free list from the front and appends freed slots
        to a release list it only merges back when the free list runs short.
        """
        if self.deferring:
            owed = [OwedBlock(-1) for _ in range(n)]
            self.owed += owed
            return owed
        self.make_room(n)
        out = self.clean.popleft_n(n)
        for b in out:
            self.free.remove(b)
            b.ref_cnt = 1
        return out

    @rule("CACHE.EVICT_LEAF_LRU", knobs=("cache_eviction",))
    def make_room(self, n: int) -> None:
        """Under cache_eviction="leaf-lru", when fewer than ``n`` free blocks hold no cached
        content, whole unlocked leaves of the radix tree are evicted, least recently used
        first, until ``n`` do; a parent left without children becomes a leaf and is eligible
        in its turn.  An evicted leaf frees all its blocks, however few were missing: 41
        tokens short, a 49-token leaf goes.

        SGLang's RadixCache (``evict_to_free_tokens`` -> ``evict_for_alloc``) evicts a node's
        tokens together because a node is its unit of bookkeeping: its KV indices are one
        tensor and its recency one timestamp; the surplus stays free for later allocations.
        """
        if len(self.clean) < n:
            self.tree.evict_until(lambda: len(self.clean) >= n, self._evict_leaf_block)

    def _evict_leaf_block(self, b: KVBlock) -> None:
        """Drop ``b``'s cached content (out of the cache map, logged as evicted); it is clean now."""
        self._uncache(b)
        self.clean.append_n([b])

    def evict_all(self) -> None:
        """Evict every unlocked leaf, and the parents they uncover."""
        self.tree.evict_until(lambda: False, self._evict_leaf_block)

    @rule("KV.FREE_IN_ORDER", knobs=("cache_eviction",))
    def release_order(self, table: list[KVBlock]) -> list[KVBlock]:
        """Under cache_eviction="leaf-lru", a finished, aborted or retracted request returns
        its blocks head first, in the order of its block table.

        SGLang frees a request's KV slots as one slice of its ``req_to_token`` row (first
        slot first), and its token allocator appends freed slots to its free list in the
        order given: the next allocation gets the request's leading slots first.
        """
        return list(table)

    def free_blocks(self, ordered: list[KVBlock]) -> None:
        """Blocks reaching ref count 0 join ``free``; those without cached content join
        ``clean`` too, at its tail (KV.FREE_TO_RELEASE)."""
        zero = self._unref(ordered)
        self.free.append_n(zero)
        self.clean.append_n([b for b in zero if b.block_hash is None])


@dataclass(frozen=True)
class AllocFailure:
    """Why ``allocate_slots`` found no room: the rule and the numbers."""

    rule: str
    text: str


ADMIT_FULL_SEQUENCE = declare(
    "ADMIT.FULL_SEQUENCE",
    """A waiting request is admitted only if the free queue holds blocks for its
    whole current sequence (prompt plus any outputs so far), not just for this
    step's chunk (vLLM's ``scheduler_reserve_full_isl``).  This keeps a chunked
    prefill from being admitted only to be preempted before it finishes.
    Future decode tokens are not reserved.""",
    __name__,
    knobs=("scheduler_reserve_full_isl",),
)
ADMIT_WATERMARK = declare(
    "ADMIT.WATERMARK",
    """When other requests are running, admitting a waiting or preempted request
    must leave ``int(watermark * num_blocks)`` blocks free, headroom for the
    running requests' growth.  A request admitted into an empty engine ignores it.""",
    __name__,
    knobs=("watermark",),
)
ALLOC_NO_BLOCKS = declare(
    "KV.NO_FREE_BLOCKS",
    """An allocation needs ``ceil(slots / block_size)`` blocks minus those the request
    already holds or hits; if the free queue (evictable cached blocks included) has
    fewer, it fails and changes nothing.""",
    __name__,
    knobs=("num_blocks", "block_size"),
)


def _not_yet(req: SequenceLike, num_tokens: int) -> None:
    """cache_register="computed": nothing enters the cache at allocation (rule CACHE.REGISTER_WHEN_COMPUTED)."""


class KVCacheManager:
    """Per-request block tables over a :class:`BlockPool` (vLLM's KVCacheManager)."""

    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.pool = RadixPool(cfg) if cfg.cache_eviction == "leaf-lru" else BlockPool(cfg)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        #: request -> ordinals of the blocks it registered since ``take_registered`` (None: not logged)
        self.registered: dict[str, list[int]] | None = None
        if cfg.cache_register != "allocation":  # the scheduler registers blocks after the step instead
            self.register_allocated = _not_yet
        if cfg.cache_eviction == "leaf-lru":
            self.cache_blocks, self.get_computed_blocks = self.insert_into_tree, self.get_tree_hits
        elif cfg.cache_dedup == "on-insert":
            self.cache_blocks = self.cache_blocks_dedup

    def blocks_of(self, request_id: str) -> list[KVBlock]:
        return self.req_blocks.get(request_id, [])

    @rule("CACHE.HIT", knobs=("enable_prefix_caching",), applies=lambda hit: hit[1] > 0)
    def get_computed_blocks(self, req: SequenceLike) -> tuple[list[KVBlock], int]:
        """A request being admitted reuses the longest run of cached full blocks
        that match its leading blocks, capped so that at least one token is computed.

        The hit covers at most ``num_tokens - 1`` tokens, in whole blocks: the last
        token must run through the model to produce logits.  A 32-token prompt with
        block size 16 hits at most 16 tokens; a 33-token prompt can hit 32.  A
        resumed request looks up prompt *and* outputs, so it re-hits its own blocks
        if they were not evicted.
        """
        if not self.pool.caching or skips_prefix_cache(req):
            return [], 0
        hits: list[KVBlock] = []
        for h in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            b = self.pool.cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def get_tree_hits(self, req: SequenceLike) -> tuple[list[KVBlock], int]:
        """CACHE.HIT under cache_eviction="leaf-lru": the same leading blocks, looked up in the
        radix tree (which splits the node the match ends in and stamps the matched path)."""
        if not self.pool.caching or skips_prefix_cache(req):
            return [], 0
        hits = self.pool.lookup(req.block_hashes[: (req.num_tokens - 1) // self.block_size])
        if hits:
            fired("CACHE.HIT")
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        req: SequenceLike,
        num_new_tokens: int,
        hit_blocks: list[KVBlock] = (),  # type: ignore[assignment]
        num_hit_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        watermark_blocks: int = 0,
        reserve_tokens: int = 0,
    ) -> list[KVBlock] | AllocFailure:
        """Give ``req`` blocks for ``num_new_tokens`` more tokens, or fail with no effect.

        Hit blocks that are evictable (ref count 0) sit in the free queue, so
        taking them consumes free blocks too (``evictable_hits`` below).
        ``reserve_tokens`` allocates at least that many slots now (reservation
        to completion, rule ADMIT.RESERVE_FULL).
        """
        bs, max_len = self.block_size, self.cfg.max_model_len
        held = len(self.blocks_of(req.request_id)) + len(hit_blocks)
        evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0) if hit_blocks else 0
        free = self.pool.num_free_blocks
        if full_sequence_must_fit:
            need_full = max(cdiv(min(req.num_tokens, max_len), bs) - held, 0) + evictable_hits
            if need_full + watermark_blocks > free:
                return self._failure(ADMIT_FULL_SEQUENCE, need_full, watermark_blocks, free, "its whole sequence")
        total, slots = self._slots(req, num_new_tokens, num_hit_tokens, reserve_tokens)
        need = max(cdiv(slots, bs) - held, 0) + evictable_hits
        if need + watermark_blocks > free:
            return self._failure(ALLOC_NO_BLOCKS, need, watermark_blocks, free, f"{slots} slots")
        table = self.req_blocks.setdefault(req.request_id, [])
        if hit_blocks:
            self.pool.touch(list(hit_blocks))
            table.extend(hit_blocks)
            self.num_cached_block[req.request_id] = len(hit_blocks)
        new = self.pool.get_new_blocks(need - evictable_hits) if need > evictable_hits else []
        table.extend(new)
        self.register_allocated(req, min(total + num_new_tokens, req.num_tokens))
        return new

    def _slots(self, req: SequenceLike, num_new_tokens: int, num_hit_tokens: int = 0,
               reserve_tokens: int = 0) -> tuple[int, int]:
        """(tokens the request's KV covers before, slots it needs after) an allocation of
        ``num_new_tokens``: never past max_model_len, at least ``reserve_tokens``."""
        max_len = self.cfg.max_model_len
        total = min(req.num_computed_tokens + num_hit_tokens, max_len)
        return total, max(min(total + num_new_tokens, max_len), reserve_tokens)

    def blocks_needed(self, req: SequenceLike, num_new_tokens: int) -> int:
        """The new blocks :meth:`allocate_slots` would take for ``num_new_tokens`` more tokens
        of a request that holds its blocks already (no hits, no reservation)."""
        slots = self._slots(req, num_new_tokens)[1]
        return max(cdiv(slots, self.block_size) - len(self.blocks_of(req.request_id)), 0)

    def register_allocated(self, req: SequenceLike, num_tokens: int) -> None:
        """CACHE.REGISTER_AT_ALLOCATION: the blocks an allocation filled enter the cache at once."""
        self.cache_blocks(req, num_tokens)

    @staticmethod
    def _failure(rule_id: str, need: int, watermark: int, free: int, what: str) -> AllocFailure:
        rule_id = ADMIT_WATERMARK if need <= free < need + watermark else rule_id
        extra = f" + {watermark} watermark" if watermark else ""
        return AllocFailure(rule_id, f"needs {need}{extra} blocks for {what}, {free} free")

    def cache_blocks(self, req: SequenceLike, num_tokens: int) -> None:
        """Register the request's newly full blocks covering its first ``num_tokens`` tokens."""
        if not self.pool.caching:
            return
        start = self.num_cached_block.get(req.request_id, 0)
        table = self.req_blocks[req.request_id]
        # a prompt past max_model_len has full blocks of tokens that no block holds
        end = min(num_tokens // self.block_size, len(req.block_hashes), len(table))
        if end <= start:
            return  # no block became full (most decode steps)
        for i in range(start, end):
            self.pool.cache_full_block(table[i], req.block_hashes[i])
        self.num_cached_block[req.request_id] = max(start, end)
        if self.registered is not None:  # the decision log's optional cache_registered field
            self.registered.setdefault(req.request_id, []).extend(range(start, end))

    def _note_registered(self, req: SequenceLike, start: int, end: int) -> None:
        self.num_cached_block[req.request_id] = max(self.num_cached_block.get(req.request_id, 0), end)
        if self.registered is not None and end > start:  # the decision log's optional cache_registered field
            self.registered.setdefault(req.request_id, []).extend(range(start, end))

    @rule("CACHE.DEDUP_ON_INSERT", knobs=("cache_dedup",))
    def rebind_duplicate(self, table: list[KVBlock], i: int, cached: KVBlock) -> None:
        """Under cache_dedup="on-insert", a block whose content is already cached in another
        block is not cached twice: when the request's blocks enter the cache, entry ``i`` of its
        table is pointed at the cached block (a reference more) and its own copy is freed at
        once (it holds nothing another request could hit).

        Two requests that computed the same prefix in one step (neither could hit the other's
        blocks before they were computed) hold one copy once both are inserted: SGLang's
        ``checkpoint_into_tree`` frees the slots of the second insert that duplicate tree
        nodes and rebinds the request's ``req_to_token`` row to the tree's slots.
        """
        own = table[i]
        self.pool.touch([cached])
        table[i] = cached
        self.pool.free_blocks([own])

    def cache_blocks_dedup(self, req: SequenceLike, num_tokens: int) -> None:
        """:meth:`cache_blocks` under CACHE.DEDUP_ON_INSERT: each newly full block whose content the
        cache map holds in another block is rebound to that one (the earliest), else registered."""
        if not self.pool.caching:
            return
        start = self.num_cached_block.get(req.request_id, 0)
        table = self.req_blocks[req.request_id]
        end = min(num_tokens // self.block_size, len(req.block_hashes), len(table))
        new = []
        for i in range(start, end):
            cached = self.pool.cached_block(req.block_hashes[i])
            if cached is not None and cached is not table[i]:
                self.rebind_duplicate(table, i, cached)
            else:
                self.pool.cache_full_block(table[i], req.block_hashes[i])
                new.append(i)
        self.num_cached_block[req.request_id] = max(start, end)
        if self.registered is not None and new:
            self.registered.setdefault(req.request_id, []).extend(new)

    def insert_into_tree(self, req: SequenceLike, num_tokens: int) -> None:
        """CACHE.EVICT_LEAF_LRU's insert: the request's full computed blocks are walked into the
        radix tree from the root (stamping and splitting nodes, a new leaf for the rest); a
        position the tree already holds in another block is a duplicate, rebound and freed under
        CACHE.DEDUP_ON_INSERT, else the request keeps its own uncached copy.  When the insert
        reaches past the prompt, the prompt is inserted again, which splits the path at the
        prompt's end and makes the prompt more recent than the outputs (SGLang's
        checkpoint_into_tree: "so eviction can drop the output KV without the prompt")."""
        if not self.pool.caching:
            return
        table = self.req_blocks[req.request_id]
        end = min(num_tokens // self.block_size, len(req.block_hashes), len(table))
        if end <= 0:
            return
        dups, first_new = self.pool.tree.insert(req.block_hashes[:end], table[:end])
        if self.cfg.cache_dedup == "on-insert":
            for i, cached in dups:
                self.rebind_duplicate(table, i, cached)
        for i in range(first_new, end):
            self.pool.cache_full_block(table[i], req.block_hashes[i])
        prompt = len(req.prompt_token_ids) // self.block_size
        if 0 < prompt < end:  # split at the prompt's end: its outputs can go without the prompt
            self.pool.tree.insert(req.block_hashes[:prompt], table[:prompt])
        self._note_registered(req, first_new, end)

    @rule("KV.BATCH_ALLOCATION", knobs=("cache_eviction", "batching"))
    def take_deferred(self) -> None:
        """Under cache_eviction="leaf-lru" with prefill-first batching, the new blocks of a
        prefill batch (its continued chunk and its admissions) are taken only once the batch is
        formed, in batch order, each table entry as it was promised: leaves are evicted for
        them (CACHE.EVICT_LEAF_LRU) after every candidate of the round was looked up, so a
        candidate's lookup (which makes its prefix the most recently used) happens before any
        eviction of the step.  Admission counted the blocks as taken meanwhile.

        SGLang's PrefillAdder only matches and locks; ``prepare_for_extend`` allocates the whole
        batch's ``extend`` tokens at once (``alloc_for_extend``), evicting then.
        """
        pool = self.pool
        owed, pool.owed, pool.deferring = pool.owed, [], False
        if not owed:
            return
        order = {id(b): i for i, b in enumerate(owed)}
        spots = sorted((order[id(b)], j, rid) for rid, table in self.req_blocks.items()
                       for j, b in enumerate(table) if isinstance(b, OwedBlock))
        for _, j, rid in spots:
            self.req_blocks[rid][j] = pool.get_new_blocks(1)[0]

    def take_registered(self) -> dict[str, list[int]]:
        """The registrations since the last call (for the step record), and start afresh."""
        out, self.registered = self.registered or {}, {}
        return out

    @rule("CACHE.REGISTER_WHEN_COMPUTED", knobs=("cache_register",))
    def register_computed(self, req: SequenceLike) -> None:
        """Under cache_register="computed", a request's blocks enter the prefix cache only
        after the step that computed them: every block full of computed tokens, for each
        request of the batch in batch order, before finished requests free their blocks.

        A block allocated but not yet computed cannot be hit, so two requests with the same
        prefix admitted in one step each compute their own copy (nano-vllm hashes blocks in
        postprocess, after the forward pass).
        """
        self.cache_blocks(req, req.num_computed_tokens)

    def free(self, request_id: str) -> None:
        """A finished, aborted or preempted request returns its blocks, in the order its
        pool's engine releases a block table (:meth:`BlockPool.release_order`)."""
        table = self.req_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.pool.free_blocks(self.pool.release_order(table))
