"""Block-pool proofs: every memory action preserves conservation, ref counts and free-xor-held.

Model (modelled by hand from ``spec/kv.py`` — its data structures are Python
objects, not numbers — and tied to it by :func:`cross_check`, which runs the
real ``BlockPool`` / ``KVCacheManager`` methods from random states and
compares the model's prediction field by field after every action).  State,
per block id ``b`` in ``0..N`` (0 is the null block) and request ``r``::

    free[b]     b is in the free queue (free or evictable cached)
    ref[b]      its ref count
    hashed[b]   it carries a block hash;   inmap[b]: the prefix-cache map names it
    mem[r][b]   b is in request r's block table;  running[r];  computed[r]

The free queue's *order* decides which blocks an allocation pops, not whether
the invariant survives, so the proofs quantify over every choice: an
allocation may pop *any* set of free blocks (the spec pops the head ``k``; the
proof covers that and every other order).  The spec's queue is keyed by block
id, so it cannot hold a block twice; a double free shows up here as a block
that is free while held, or a ref count that disagrees with its holders.

Actions, each the transliteration of the spec method named:

    allocate(r, P)  BlockPool.get_new_blocks + table.extend: the popped blocks P leave
                    the queue, lose their hash and map entry (eviction), ref := 1
    touch(r, H)     the prefix-hit part of allocate_slots for a request being admitted:
                    BlockPool.touch(H) (a hit with ref 0 leaves the queue; ref += 1) +
                    table.extend(H)
    free(r)         KVCacheManager.free → BlockPool.free_blocks: ref -= 1; blocks
                    reaching 0 re-enter the queue; shared blocks stay out
    preempt(r)      SpecEngine._preempt: free(r), num_computed_tokens := 0, not running

Each proof asks Z3 for a state with ``Inv(s) ∧ pre(s) ∧ s' = action(s) ∧
¬Inv(s')``; "proved" means there is none: the action preserves the invariant
from *every* state within the bound, not just the ones a test happened to
reach.  Inv is the conjunction of the spec's MEM.CONSERVATION, MEM.REFCOUNT,
MEM.FREE_XOR_HELD (free blocks have ref 0; the null block is never handed
out), CACHE.MAP_CONSISTENT and REQ.IDLE_HOLDS_NOTHING (real-bugs.md: VLLM-08,
SGL-01, SGL-03, MSGL-01, TRT-04, VLLM-19, LMD-02).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Callable

import z3

from invariants.proofs.common import (
    AND, COUNT, EQ, IMPLIES, LT, NOT, OR, PROVED, ProofRow, Timer, check_unsat, ite, value,
)
from invariants.proofs.symex import Sym, SymBool, bitvectors

PROFILE = "vllm-v1"
#: Ref counts are small: signed 8-bit vectors, which Z3 bit-blasts to SAT.
WIDTH = 8


@dataclass
class Pool:
    n: int  # usable blocks, ids 1..n; index 0 is the null block
    free: list
    ref: list
    hashed: list
    inmap: list
    mem: list  # mem[r][b]
    running: list
    computed: list

    @property
    def R(self) -> int:
        return len(self.mem)

    @property
    def ids(self) -> range:
        return range(self.n + 1)

    def copy(self) -> "Pool":
        return replace(self, free=list(self.free), ref=list(self.ref), hashed=list(self.hashed),
                       inmap=list(self.inmap), mem=[list(m) for m in self.mem], running=list(self.running),
                       computed=list(self.computed))


def _b(name: str) -> SymBool:
    return SymBool(z3.Bool(name))


def symbolic_pool(n: int, R: int, tag: str = "") -> Pool:
    """A pool whose every field is a fresh Z3 variable."""
    return Pool(
        n=n,
        free=[_b(f"{tag}free{b}") for b in range(n + 1)],
        ref=[Sym(f"{tag}ref{b}") for b in range(n + 1)],
        hashed=[_b(f"{tag}hashed{b}") for b in range(n + 1)],
        inmap=[_b(f"{tag}inmap{b}") for b in range(n + 1)],
        mem=[[_b(f"{tag}mem{r}_{b}") for b in range(n + 1)] for r in range(R)],
        running=[_b(f"{tag}running{r}") for r in range(R)],
        computed=[Sym(f"{tag}computed{r}") for r in range(R)],
    )


def symbolic_set(name: str, n: int) -> list:
    return [_b(f"{name}{b}") for b in range(n + 1)]


# --------------------------------------------------------------------------
# the invariant
# --------------------------------------------------------------------------


def holders(p: Pool, b: int) -> Any:
    return COUNT(p.mem[r][b] for r in range(p.R))


def held(p: Pool, b: int) -> Any:
    return OR(*[p.mem[r][b] for r in range(p.R)])


def invariant(p: Pool) -> list[tuple[str, Any]]:
    """The conjuncts of Inv, each named after the spec invariant it is part of."""
    usable = range(1, p.n + 1)
    return [
        ("MEM.FREE_XOR_HELD: the null block 0 is never free, held or cached",
         AND(NOT(p.free[0]), NOT(p.hashed[0]), NOT(p.inmap[0]), *[NOT(p.mem[r][0]) for r in range(p.R)])),
        ("MEM.REFCOUNT: each block's ref count equals the number of block tables holding it",
         AND(*[EQ(p.ref[b], holders(p, b)) for b in usable])),
        ("MEM.FREE_XOR_HELD: a block in the free queue has ref count 0",
         AND(*[IMPLIES(p.free[b], EQ(p.ref[b], 0)) for b in usable])),
        ("MEM.FREE_XOR_HELD: no block is both free and held",
         AND(*[NOT(AND(p.free[b], held(p, b))) for b in usable])),
        ("MEM.CONSERVATION: every usable block is free or held (free + held = usable blocks)",
         AND(*[OR(p.free[b], held(p, b)) for b in usable])),
        ("CACHE.MAP_CONSISTENT: the cache map names exactly the blocks that carry a hash",
         AND(*[EQ(p.inmap[b], p.hashed[b]) for b in p.ids])),
        ("REQ.IDLE_HOLDS_NOTHING: a request that is not running holds no blocks",
         AND(*[IMPLIES(NOT(p.running[r]), NOT(p.mem[r][b])) for r in range(p.R) for b in p.ids])),
    ]


def holds(p: Pool) -> Any:
    return AND(*[c for _, c in invariant(p)])


# --------------------------------------------------------------------------
# actions (spec/kv.py, transliterated; cross_check() ties them to the code)
# --------------------------------------------------------------------------


def allocate(p: Pool, r: int, popped: list) -> tuple[Pool, Any]:
    """``get_new_blocks`` (pop from the free queue, evict, ``ref_cnt = 1``) + ``table.extend``."""
    pre = AND(*[IMPLIES(popped[b], p.free[b]) for b in p.ids],  # popped from the free queue
              # a running request grows its table; a waiting one starts from an empty table
              IMPLIES(NOT(p.running[r]), AND(*[NOT(p.mem[r][b]) for b in p.ids])))
    s = p.copy()
    for b in p.ids:
        s.free[b] = AND(p.free[b], NOT(popped[b]))
        s.ref[b] = ite(popped[b], 1, p.ref[b])
        s.hashed[b] = AND(p.hashed[b], NOT(popped[b]))  # _evict: the hash is dropped ...
        s.inmap[b] = AND(p.inmap[b], NOT(popped[b]))  # ... and the map entry with it
        s.mem[r][b] = OR(p.mem[r][b], popped[b])
    s.running[r] = True  # the scheduler marks it running once its allocation succeeds
    return s, pre


def touch(p: Pool, r: int, hits: list) -> tuple[Pool, Any]:
    """``BlockPool.touch(hits)`` + ``table.extend(hits)`` for a request being admitted.

    ``if b.ref_cnt == 0: self.free.remove(b)`` then ``b.ref_cnt += 1``.
    """
    pre = AND(NOT(p.running[r]), *[NOT(p.mem[r][b]) for b in p.ids],
              *[IMPLIES(hits[b], p.inmap[b]) for b in p.ids])  # a hit is a block the cache map names
    s = p.copy()
    for b in p.ids:
        evictable = AND(hits[b], EQ(p.ref[b], 0))
        s.free[b] = AND(p.free[b], NOT(evictable))
        s.ref[b] = ite(hits[b], p.ref[b] + 1, p.ref[b])
        s.mem[r][b] = hits[b]
    s.running[r] = True
    return s, pre


def free(p: Pool, r: int) -> tuple[Pool, Any]:
    """``KVCacheManager.free(r)`` → ``free_blocks(reversed(table))``.

    ``b.ref_cnt -= 1``; blocks reaching 0 re-enter the queue (head or tail:
    ``prepend_n`` / ``append_n``); the table is dropped.
    """
    s = p.copy()
    for b in p.ids:
        s.ref[b] = ite(p.mem[r][b], p.ref[b] - 1, p.ref[b])
        s.free[b] = OR(p.free[b], AND(p.mem[r][b], EQ(s.ref[b], 0)))
        s.mem[r][b] = False
    s.running[r] = False
    return s, True


def preempt(p: Pool, r: int) -> tuple[Pool, Any]:
    """``SpecEngine._preempt``: free the victim's blocks and forget its computed tokens."""
    s, _ = free(p, r)
    s.computed[r] = 0
    return s, p.running[r]


def cache_block(p: Pool, r: int, b: int) -> tuple[Pool, Any]:
    """``BlockPool.cache_full_block``: one of ``r``'s blocks gets a hash and a map entry."""
    s = p.copy()
    s.hashed[b] = True
    s.inmap[b] = True
    return s, p.mem[r][b]


# --------------------------------------------------------------------------
# cross-check: the model computes what spec/kv.py computes
# --------------------------------------------------------------------------


def from_manager(mgr, rids: list[str], running: dict[str, bool], computed: dict[str, int]) -> Pool:
    """The concrete model state of a real ``spec.kv.KVCacheManager``."""
    pool = mgr.pool
    n = len(pool.blocks) - 1
    mapped = {bid for same in pool.cached.values() for bid in same}
    free_ids = set(pool.free.ids())
    tables = [{b.block_id for b in mgr.blocks_of(r)} for r in rids]
    return Pool(
        n=n,
        free=[b in free_ids for b in range(n + 1)],
        ref=[pool.blocks[b].ref_cnt for b in range(n + 1)],
        hashed=[pool.blocks[b].block_hash is not None for b in range(n + 1)],
        inmap=[b in mapped for b in range(n + 1)],
        mem=[[b in t for b in range(n + 1)] for t in tables],
        running=[running[r] for r in rids],
        computed=[computed[r] for r in rids],
    )


def same(a: Pool, b: Pool) -> str | None:
    """None if two concrete pools agree."""
    for name in ("free", "ref", "hashed", "inmap", "mem", "running", "computed"):
        if getattr(a, name) != getattr(b, name):
            return f"{name}: model {getattr(a, name)} vs spec {getattr(b, name)}"
    return None


def cross_check(transitions: int = 300, n: int = 6, R: int = 3, seed: int = 0, model: dict | None = None) -> int:
    """Drive a real ``KVCacheManager`` with random actions; the model must agree after each.

    Returns the number of transitions compared; raises ``AssertionError`` on the
    first disagreement.  ``model`` overrides actions (to show a mutant disagrees).
    """
    from spec.config import SchedulerConfig
    from spec.kv import KVCacheManager

    acts = {"allocate": allocate, "touch": touch, "free": free, "preempt": preempt, "cache_block": cache_block}
    acts.update(model or {})
    rng = random.Random(seed)
    done = 0
    while done < transitions:
        mgr = KVCacheManager(SchedulerConfig(num_blocks=n + 1, block_size=2, enable_prefix_caching=True))
        rids = [f"r{i}" for i in range(R)]
        running = {r: False for r in rids}
        computed = {r: 0 for r in rids}
        counter = 0
        for _ in range(40):
            before = from_manager(mgr, rids, running, computed)
            r = rng.randrange(R)
            rid = rids[r]
            kind = rng.choice(["allocate", "allocate", "touch", "free", "preempt", "cache_block", "cache_block"])
            if kind == "allocate":
                if not running[rid] and mgr.blocks_of(rid):
                    continue
                k = rng.randint(0, mgr.pool.num_free_blocks)
                new = mgr.pool.get_new_blocks(k)
                mgr.req_blocks.setdefault(rid, []).extend(new)
                running[rid] = True
                ids = {b.block_id for b in new}
                expect, _ = acts[kind](before, r, [b in ids for b in range(n + 1)])
            elif kind == "touch":
                if running[rid] or mgr.blocks_of(rid):
                    continue
                cached = [b for same_ in mgr.pool.cached.values() for b in same_.values()]
                hits = rng.sample(cached, rng.randint(0, min(3, len(cached))))
                mgr.pool.touch(hits)
                mgr.req_blocks[rid] = list(hits)
                running[rid] = True
                ids = {b.block_id for b in hits}
                expect, _ = acts[kind](before, r, [b in ids for b in range(n + 1)])
            elif kind in ("free", "preempt"):
                if kind == "preempt" and not running[rid]:
                    continue
                mgr.free(rid)
                running[rid] = False
                if kind == "preempt":
                    computed[rid] = 0
                expect, _ = acts[kind](before, r)
            else:
                table = mgr.blocks_of(rid)
                if not table:
                    continue
                blk = rng.choice(table)
                if blk.block_hash is not None:
                    continue
                counter += 1
                mgr.pool.cache_full_block(blk, counter.to_bytes(8, "big"))
                expect, _ = acts[kind](before, r, blk.block_id)
            if rng.random() < 0.3:
                computed[rid] = rng.randint(1, 9)  # an arbitrary computed count, carried through
                expect.computed[r] = computed[rid]
            after = from_manager(mgr, rids, running, computed)
            diff = same(expect, after)
            if diff:
                raise AssertionError(f"model and spec/kv.py disagree after {kind}({rid}): {diff}")
            done += 1
    return done


# --------------------------------------------------------------------------
# the proofs
# --------------------------------------------------------------------------


def _describe(model, p: Pool, s: Pool | None = None) -> str:
    def show(x: Pool) -> str:
        free_ = [b for b in x.ids if value(model, x.free[b])]
        tables = " ".join(
            f"r{r}{'' if value(model, x.running[r]) else '(idle)'}={[b for b in x.ids if value(model, x.mem[r][b])]}"
            for r in range(x.R))
        refs = {b: value(model, x.ref[b]) for b in x.ids if value(model, x.ref[b])}
        hashed = [b for b in x.ids if value(model, x.hashed[b])]
        return f"free {free_}; tables {tables}; nonzero refs {refs}; hashed {hashed}"

    out = "before: " + show(p)
    if s is not None:
        out += "\nafter:  " + show(s)
    return out


def _prove_action(name: str, prop: str, n: int, R: int, build: Callable[[Pool], tuple[Pool, Any, list]],
                  cross: int) -> ProofRow:
    """``Inv(s) ∧ pre ∧ ¬(Inv(s') ∧ extra)`` must be unsatisfiable."""
    with Timer() as t:
        checked = cross_check(cross, n=min(n, 6), R=min(R, 3)) if cross else 0
        with bitvectors(WIDTH):
            p = symbolic_pool(n, R)
            s, pre, extra = build(p)
            post = invariant(s) + extra
            status, model = check_unsat([holds(p), pre, NOT(AND(*[c for _, c in post]))])
            cex = ""
            if model is not None:
                broken = [label for label, c in post if value(model, c) is not True]
                cex = "violates " + "; ".join(broken) + "\n" + _describe(model, p, s)
    return ProofRow(name, prop, PROFILE, f"N≤{n} blocks, R≤{R} requests", status, t.seconds, cex, "memory",
                    {"cross_checked_transitions": checked})


#: (blocks, requests) per bound.
BOUNDS = {"ci": (16, 4), "long": (64, 8)}


def prove_allocate(n=16, R=4, action=None, cross=200) -> ProofRow:
    """MEM.* are preserved by allocate: blocks popped from the free queue go to one
    block table with ref count 1 (``get_new_blocks`` + ``table.extend``).  Catches
    an allocation that leaves a block in the free list or hands out the null block
    (VLLM-08, MSGL-02, MSGL-03)."""
    action = action or allocate

    def build(p):
        s, pre = action(p, 0, symbolic_set("pop", n))
        return s, pre, []

    return _prove_action("mem.allocate", "MEM.CONSERVATION, MEM.REFCOUNT, MEM.FREE_XOR_HELD preserved by allocate",
                         n, R, build, cross)


def prove_touch(n=16, R=4, action=None, cross=200) -> ProofRow:
    """MEM.* are preserved by touch: a prefix hit takes evictable cached blocks out
    of the free queue and adds a reference to every hit; and ``free.remove`` is
    only ever asked to remove a block that is in the queue (MSGL-01, SGL-09)."""
    action = action or touch

    def build(p):
        hits = symbolic_set("hit", n)
        s, pre = action(p, 0, hits)
        safe = AND(*[IMPLIES(AND(hits[b], EQ(p.ref[b], 0)), p.free[b]) for b in p.ids])
        return s, pre, [("CACHE.TOUCH: a hit with ref count 0 is in the free queue (remove cannot fail)", safe)]

    return _prove_action("mem.touch", "MEM.* preserved by touch (prefix hit); removed blocks were free",
                         n, R, build, cross)


def prove_free(n=16, R=4, action=None, cross=200) -> ProofRow:
    """MEM.* are preserved by free: ref counts drop, blocks reaching 0 re-enter the
    free queue, blocks still shared stay out.  Catches double frees and frees that
    skip the decrement (VLLM-08, TRT-04, SGL-01, SGL-07)."""
    action = action or free

    def build(p):
        s, pre = action(p, 0)
        return s, pre, []

    return _prove_action("mem.free", "MEM.CONSERVATION, MEM.REFCOUNT, MEM.FREE_XOR_HELD preserved by free",
                         n, R, build, cross)


def prove_evict(n=16, R=4, action=None, cross=200) -> ProofRow:
    """Eviction (a cached block popped for re-use) only takes a block nobody holds,
    and drops its hash *and* its cache-map entry, so no later lookup can hit
    recycled memory (MSGL-01, VLLM-19, TRT-06)."""
    action = action or allocate

    def build(p):
        popped = symbolic_set("pop", n)
        s, pre = action(p, 0, popped)
        cached = [AND(popped[b], p.hashed[b]) for b in p.ids]
        unheld = AND(*[IMPLIES(c, EQ(holders(p, b), 0)) for b, c in zip(p.ids, cached)])
        gone = AND(*[IMPLIES(c, AND(NOT(s.inmap[b]), NOT(s.hashed[b]))) for b, c in zip(p.ids, cached)])
        return s, pre, [("CACHE.EVICT_LRU: an evicted block had no holder", unheld),
                        ("CACHE.EVICT_LRU: an evicted block leaves the cache map", gone)]

    return _prove_action("mem.evict", "evicted blocks are unheld and leave the cache map; MEM.* preserved",
                         n, R, build, cross)


def prove_preempt(n=16, R=4, action=None, cross=200) -> ProofRow:
    """MEM.* are preserved by recompute preemption, and the victim ends holding no
    blocks and no computed tokens (VLLM-01, VLLM-02, VLLM-13, LMD-02, TRT-05)."""
    action = action or preempt

    def build(p):
        s, pre = action(p, 0)
        gone = AND(*[NOT(s.mem[0][b]) for b in p.ids], EQ(s.computed[0], 0), NOT(s.running[0]))
        return s, pre, [("REQ.IDLE_HOLDS_NOTHING: a preempted request holds no blocks and no computed tokens", gone)]

    return _prove_action("mem.preempt", "MEM.* preserved by preempt; the victim holds nothing, computed = 0",
                         n, R, build, cross)


PROOFS = {
    "mem.allocate": prove_allocate,
    "mem.touch": prove_touch,
    "mem.free": prove_free,
    "mem.evict": prove_evict,
    "mem.preempt": prove_preempt,
}
