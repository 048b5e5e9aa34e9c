"""Block-pool proofs: every memory action preserves conservation, ref counts and free-xor-held.

Model (modelled by hand from ``spec/kv.py``; tied to it by :func:`cross_check`,
which runs the real ``BlockPool`` / ``KVCacheManager`` methods on random
concrete states and compares every field after every action)::

    blocks     1..N usable (0 is the null block, never handed out)
    ref[b]     ref count;  hashed[b]: the block carries a hash;  inmap[b]: the
               prefix-cache map names it
    q[0..qlen) the free queue, head first (free and evictable cached blocks)
    tbl[r][0..cnt[r])  request r's block table;  running[r];  computed[r]

Actions, each the transliteration of the spec method named:

    allocate(r, k)  BlockPool.get_new_blocks(k) + table.extend  (pop k from the head,
                    evict their hashes, ref := 1)
    touch(r, hits)  the prefix-hit part of allocate_slots: BlockPool.touch(hits) +
                    table.extend(hits) for a request being admitted
    free(r)         KVCacheManager.free: BlockPool.free_blocks(reversed(table)):
                    decrement; blocks reaching 0 go to the head (no hash) or tail (hash)
    evict           the eviction inside get_new_blocks (a popped cached block leaves the map)
    preempt(r)      SpecEngine._preempt: free(r), num_computed_tokens := 0, not running

Each proof asserts ``Inv(s) ∧ pre(s) ∧ s' = action(s) ∧ ¬Inv(s')`` and asks Z3
for a model: none (unsat) means the action preserves the invariant for *every*
state of up to N blocks and R requests, not just the reachable ones we happened
to test.  Inv is the conjunction of the spec's MEM.CONSERVATION, MEM.REFCOUNT,
MEM.FREE_XOR_HELD (no duplicates in the free queue, free blocks have ref 0, the
null block never handed out), CACHE.MAP_CONSISTENT and
REQ.IDLE_HOLDS_NOTHING (real bugs: VLLM-08, SGL-01, MSGL-01, TRT-04, VLLM-19, LMD-02).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Callable

import z3

from invariants.proofs.common import (
    AND, COUNT, EQ, IMPLIES, LE, LT, NE, NOT, OR, COUNTEREXAMPLE, PROVED, ProofRow, Timer,
    check_unsat, ite, one_hot_select, select, value,
)
from invariants.proofs.symex import Sym, SymBool, wrap

PROFILE = "vllm-v1"


@dataclass
class Pool:
    n: int  # usable blocks, ids 1..n
    ref: list  # per block id 0..n (index 0: the null block, unused)
    hashed: list
    inmap: list
    q: list  # free queue, capacity n
    qlen: Any
    tbl: list  # per request, capacity n
    cnt: list
    running: list
    computed: list

    @property
    def R(self) -> int:
        return len(self.tbl)

    def copy(self) -> "Pool":
        return replace(self, ref=list(self.ref), hashed=list(self.hashed), inmap=list(self.inmap), q=list(self.q),
                       tbl=[list(t) for t in self.tbl], cnt=list(self.cnt), running=list(self.running),
                       computed=list(self.computed))


def symbolic_pool(n: int, R: int, tag: str = "") -> Pool:
    I = lambda name: Sym(f"{tag}{name}")  # noqa: E731
    B = lambda name: SymBool(z3.Bool(f"{tag}{name}"))  # noqa: E731
    return Pool(
        n=n,
        ref=[0] + [I(f"ref{b}") for b in range(1, n + 1)],
        hashed=[False] + [B(f"hashed{b}") for b in range(1, n + 1)],
        inmap=[False] + [B(f"inmap{b}") for b in range(1, n + 1)],
        q=[I(f"q{i}") for i in range(n)],
        qlen=I("qlen"),
        tbl=[[I(f"t{r}_{i}") for i in range(n)] for r in range(R)],
        cnt=[I(f"cnt{r}") for r in range(R)],
        running=[B(f"running{r}") for r in range(R)],
        computed=[I(f"computed{r}") for r in range(R)],
    )


# --------------------------------------------------------------------------
# the invariant
# --------------------------------------------------------------------------


def holders(p: Pool, b) -> Any:
    return COUNT(AND(LT(i, p.cnt[r]), EQ(p.tbl[r][i], b)) for r in range(p.R) for i in range(p.n))


def in_queue(p: Pool, b) -> Any:
    return OR(*[AND(LT(i, p.qlen), EQ(p.q[i], b)) for i in range(p.n)])


def invariant(p: Pool) -> list[tuple[str, Any]]:
    """The conjuncts of Inv, each named after the spec invariant it is part of."""
    n, ids = p.n, range(1, p.n + 1)
    usable = lambda x: AND(LE(1, x), LE(x, n))  # noqa: E731
    held = {b: holders(p, b) for b in ids}
    inq = {b: in_queue(p, b) for b in ids}
    return [
        ("MEM.FREE_XOR_HELD: the free queue holds usable block ids only (never the null block)",
         AND(LE(0, p.qlen), LE(p.qlen, n), *[IMPLIES(LT(i, p.qlen), usable(p.q[i])) for i in range(n)])),
        ("MEM.FREE_XOR_HELD: no block appears twice in the free queue",
         AND(*[IMPLIES(LT(j, p.qlen), NE(p.q[i], p.q[j])) for j in range(n) for i in range(j)])),
        ("MEM.FREE_XOR_HELD: block tables hold usable block ids only (never the null block)",
         AND(*[AND(LE(0, p.cnt[r]), LE(p.cnt[r], n), *[IMPLIES(LT(i, p.cnt[r]), usable(p.tbl[r][i])) for i in range(n)])
               for r in range(p.R)])),
        ("MEM.REFCOUNT: no block appears twice in one block table",
         AND(*[IMPLIES(LT(j, p.cnt[r]), NE(p.tbl[r][i], p.tbl[r][j])) for r in range(p.R) for j in range(n) for i in range(j)])),
        ("MEM.REFCOUNT: each block's ref count equals the number of block tables holding it",
         AND(*[EQ(p.ref[b], held[b]) for b in ids])),
        ("MEM.FREE_XOR_HELD: a block in the free queue has ref count 0",
         AND(*[IMPLIES(inq[b], EQ(p.ref[b], 0)) for b in ids])),
        ("MEM.FREE_XOR_HELD: no block is both free and held",
         AND(*[NOT(AND(inq[b], LT(0, held[b]))) for b in ids])),
        ("MEM.CONSERVATION: free + held = usable blocks",
         EQ(p.qlen + COUNT(LT(0, held[b]) for b in ids), n)),
        ("CACHE.MAP_CONSISTENT: the cache map names exactly the blocks that carry a hash",
         AND(*[EQ(p.inmap[b], p.hashed[b]) for b in ids])),
        ("REQ.IDLE_HOLDS_NOTHING: a request that is not running holds no blocks",
         AND(*[IMPLIES(NOT(p.running[r]), EQ(p.cnt[r], 0)) for r in range(p.R)])),
    ]


def holds(p: Pool) -> Any:
    return AND(*[c for _, c in invariant(p)])


# --------------------------------------------------------------------------
# actions (spec/kv.py, transliterated; cross_check() ties them to the code)
# --------------------------------------------------------------------------


def pop(p: Pool, k) -> tuple[Pool, list]:
    """``BlockPool.get_new_blocks(k)``: pop ``k`` from the head; evict their hashes; ref := 1.

    Returns the new pool and, per head position ``i``, ``(popped?, block id)``.
    """
    s = p.copy()
    popped = [(LT(i, k), p.q[i]) for i in range(p.n)]
    for b in range(1, p.n + 1):
        was_popped = OR(*[AND(a, EQ(x, b)) for a, x in popped])
        s.ref[b] = ite(was_popped, 1, p.ref[b])
        s.hashed[b] = AND(p.hashed[b], NOT(was_popped))  # evicted: the hash is dropped ...
        s.inmap[b] = AND(p.inmap[b], NOT(was_popped))  # ... and the map entry with it
    s.q = [select(p.q, i + k) for i in range(p.n)]
    s.qlen = p.qlen - k
    return s, popped


def allocate(p: Pool, r: int, k) -> tuple[Pool, Any]:
    """``get_new_blocks(k)`` then ``table.extend(new)`` for request ``r``; it runs afterwards."""
    pre = AND(LE(0, k), LE(k, p.qlen), LE(p.cnt[r] + k, p.n), OR(p.running[r], EQ(p.cnt[r], 0)))
    s, _ = pop(p, k)
    c = p.cnt[r]
    s.tbl[r] = [ite(LT(j, c), p.tbl[r][j], ite(LT(j, c + k), select(p.q, j - c), p.tbl[r][j])) for j in range(p.n)]
    s.cnt[r] = c + k
    s.running[r] = True
    return s, pre


def touch(p: Pool, r: int, hits: list, m) -> tuple[Pool, Any]:
    """``BlockPool.touch(hits)`` + ``table.extend(hits)``: the prefix hit of a request being admitted.

    Each hit block with ref count 0 (evictable, in the free queue) is removed
    from the queue wherever it is; every hit gains a reference.
    """
    n = p.n
    pre = AND(NOT(p.running[r]), EQ(p.cnt[r], 0), LE(0, m), LE(m, len(hits)),
              *[IMPLIES(LT(i, m), AND(LE(1, h), LE(h, n), select(p.hashed, h, False))) for i, h in enumerate(hits)],
              *[IMPLIES(LT(j, m), NE(hits[i], hits[j])) for j in range(len(hits)) for i in range(j)])
    s = p.copy()
    for i, h in enumerate(hits):
        active = LT(i, m)
        evictable = AND(active, EQ(select(s.ref, h), 0))
        pos = one_hot_select([AND(LT(j, s.qlen), EQ(s.q[j], h)) for j in range(n)], list(range(n)), n)
        s.q = [ite(evictable, ite(LT(j, pos), s.q[j], select(s.q, j + 1)), s.q[j]) for j in range(n)]
        s.qlen = ite(evictable, s.qlen - 1, s.qlen)
        s.ref = [s.ref[0]] + [ite(AND(active, EQ(h, b)), s.ref[b] + 1, s.ref[b]) for b in range(1, n + 1)]
    s.tbl[r] = [ite(LT(j, m), hits[j], p.tbl[r][j]) if j < len(hits) else p.tbl[r][j] for j in range(n)]
    s.cnt[r] = m
    s.running[r] = True
    return s, pre


def free(p: Pool, r: int) -> tuple[Pool, Any]:
    """``KVCacheManager.free(r)``: ``free_blocks(reversed(table))``.

    Each block's ref count drops by one; those reaching 0 re-enter the queue:
    without a hash at the head (``prepend_n``, keeping the reversed order),
    with a hash at the tail (``append_n``).  Shared blocks stay out.
    """
    n, c = p.n, p.cnt[r]
    s = p.copy()
    order = [(LT(k, c), select(p.tbl[r], c - 1 - k)) for k in range(n)]
    zero = []
    for active, b in order:
        s.ref = [s.ref[0]] + [ite(AND(active, EQ(b, x)), s.ref[x] - 1, s.ref[x]) for x in range(1, n + 1)]
        zero.append(AND(active, EQ(select(s.ref, b), 0)))
    hashed = [select(p.hashed, b, False) for _, b in order]
    to_head = [AND(z, NOT(h)) for z, h in zip(zero, hashed)]
    to_tail = [AND(z, h) for z, h in zip(zero, hashed)]
    pos_head = [COUNT(to_head[:k]) for k in range(n)]
    pos_tail = [COUNT(to_tail[:k]) for k in range(n)]
    nh, nt = COUNT(to_head), COUNT(to_tail)
    ids = [b for _, b in order]
    q = []
    for j in range(n):
        head = one_hot_select([AND(f, EQ(pk, j)) for f, pk in zip(to_head, pos_head)], ids)
        tail = one_hot_select([AND(f, EQ(pk, j - nh - p.qlen)) for f, pk in zip(to_tail, pos_tail)], ids)
        q.append(ite(LT(j, nh), head, ite(LT(j, nh + p.qlen), select(p.q, j - nh), tail)))
    s.q, s.qlen = q, p.qlen + nh + nt
    s.cnt[r] = 0
    s.running[r] = False
    return s, True


def preempt(p: Pool, r: int) -> tuple[Pool, Any]:
    """``SpecEngine._preempt``: free the victim's blocks and forget its computed tokens."""
    s, _ = free(p, r)
    s.computed[r] = 0
    return s, p.running[r]


def cache_block(p: Pool, r: int, i) -> tuple[Pool, Any]:
    """``BlockPool.cache_full_block``: request ``r``'s ``i``-th block gets a hash and a map entry."""
    s = p.copy()
    b = select(p.tbl[r], i)
    for x in range(1, p.n + 1):
        s.hashed[x] = OR(p.hashed[x], EQ(b, x))
        s.inmap[x] = OR(p.inmap[x], EQ(b, x))
    return s, AND(LE(0, i), LT(i, p.cnt[r]))


# --------------------------------------------------------------------------
# cross-check: the model computes what spec/kv.py computes
# --------------------------------------------------------------------------


def from_manager(mgr, rids: list[str], running: dict[str, bool], computed: dict[str, int]) -> Pool:
    """The concrete model state of a real ``spec.kv.KVCacheManager``."""
    pool = mgr.pool
    n = len(pool.blocks) - 1
    mapped = {bid for same in pool.cached.values() for bid in same}
    q = pool.free.ids()
    tables = [[b.block_id for b in mgr.blocks_of(r)] for r in rids]
    return Pool(
        n=n,
        ref=[0] + [pool.blocks[b].ref_cnt for b in range(1, n + 1)],
        hashed=[False] + [pool.blocks[b].block_hash is not None for b in range(1, n + 1)],
        inmap=[False] + [b in mapped for b in range(1, n + 1)],
        q=q + [0] * (n - len(q)),
        qlen=len(q),
        tbl=[t + [0] * (n - len(t)) for t in tables],
        cnt=[len(t) for t in tables],
        running=[running[r] for r in rids],
        computed=[computed[r] for r in rids],
    )


def same(a: Pool, b: Pool) -> str | None:
    """None if two concrete pools agree (queue and tables compared up to their lengths)."""
    for name in ("ref", "hashed", "inmap", "cnt", "running", "computed"):
        if list(getattr(a, name)) != list(getattr(b, name)):
            return f"{name}: model {getattr(a, name)} vs spec {getattr(b, name)}"
    if a.qlen != b.qlen or a.q[: a.qlen] != b.q[: b.qlen]:
        return f"free queue: model {a.q[:a.qlen]} vs spec {b.q[:b.qlen]}"
    for r in range(a.R):
        if a.tbl[r][: a.cnt[r]] != b.tbl[r][: b.cnt[r]]:
            return f"table {r}: model {a.tbl[r][:a.cnt[r]]} vs spec {b.tbl[r][:b.cnt[r]]}"
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
            kind = rng.choice(["allocate", "allocate", "touch", "free", "preempt", "cache_block"])
            if kind == "allocate":
                if not (running[rid] or not mgr.blocks_of(rid)):
                    continue
                k = rng.randint(0, min(mgr.pool.num_free_blocks, n - len(mgr.blocks_of(rid))))
                mgr.req_blocks.setdefault(rid, []).extend(mgr.pool.get_new_blocks(k))
                running[rid] = True
                expect, _ = acts[kind](before, r, k)
            elif kind == "touch":
                if running[rid] or mgr.blocks_of(rid):
                    continue
                cached = [b for same_ in mgr.pool.cached.values() for b in same_.values()]
                hits = rng.sample(cached, rng.randint(0, min(3, len(cached))))
                mgr.pool.touch(hits)
                mgr.req_blocks[rid] = list(hits)
                running[rid] = True
                ids = [b.block_id for b in hits]
                expect, _ = acts[kind](before, r, ids + [0] * (3 - len(ids)), len(ids))
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
                i = rng.randrange(len(table))
                if table[i].block_hash is not None:
                    continue
                counter += 1
                mgr.pool.cache_full_block(table[i], counter.to_bytes(8, "big"))
                expect, _ = acts[kind](before, r, i)
            if rng.random() < 0.3:
                computed[rid] = rng.randint(0, 9)  # an arbitrary computed count, carried through
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
        qlen = value(model, x.qlen)
        q = [value(model, x.q[i]) for i in range(max(0, min(qlen, x.n)))]
        refs = {b: value(model, x.ref[b]) for b in range(1, x.n + 1)}
        tables = []
        for r in range(x.R):
            c = value(model, x.cnt[r])
            t = [value(model, x.tbl[r][i]) for i in range(max(0, min(c, x.n)))]
            tables.append(f"r{r}{'' if value(model, x.running[r]) else '(idle)'}={t}")
        hashed = [b for b in range(1, x.n + 1) if value(model, x.hashed[b])]
        return f"free queue {q} (len {qlen}); tables {' '.join(tables)}; refs {refs}; hashed {hashed}"

    out = "before: " + show(p)
    if s is not None:
        out += "\nafter:  " + show(s)
    return out


def _prove_action(name: str, prop: str, n: int, R: int, build: Callable[[Pool], tuple[Pool, Any, list]],
                  cross: int) -> ProofRow:
    with Timer() as t:
        checked = cross_check(cross, n=min(n, 6), R=min(R, 3)) if cross else 0
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


MEMORY_BOUNDS = {"ci": (8, 3), "long": (12, 4)}


def prove_allocate(n=8, R=3, action=None, cross=200) -> ProofRow:
    """MEM.* are preserved by allocate: popping k blocks from the free queue's head
    into a block table (``get_new_blocks``).  Catches allocations that leave a
    block in the free list or hand out the null block (VLLM-08, MSGL-02)."""
    action = action or allocate
    k = Sym("k")

    def build(p):
        s, pre = action(p, 0, k)
        return s, pre, []

    return _prove_action("mem.allocate", "MEM.CONSERVATION ∧ MEM.REFCOUNT ∧ MEM.FREE_XOR_HELD preserved by allocate (pop k from the head)",
                         n, R, build, cross)


def prove_touch(n=8, R=3, action=None, cross=200, max_hits=3) -> ProofRow:
    """MEM.* are preserved by touch: a prefix hit takes evictable cached blocks out
    of the free queue and adds a reference to each hit (MSGL-01, SGL-09)."""
    action = action or touch
    hits = [Sym(f"hit{i}") for i in range(max_hits)]
    m = Sym("m")

    def build(p):
        s, pre = action(p, 0, hits, m)
        return s, pre, []

    return _prove_action("mem.touch", "MEM.CONSERVATION ∧ MEM.REFCOUNT ∧ MEM.FREE_XOR_HELD preserved by touch (prefix hit)",
                         n, R, build, cross)


def prove_free(n=8, R=3, action=None, cross=200) -> ProofRow:
    """MEM.* are preserved by free: ref counts drop, blocks reaching 0 re-enter the
    queue (head if unhashed, tail if cached), shared blocks stay out.  Catches
    double frees and frees that skip the decrement (VLLM-08, TRT-04, SGL-01)."""
    action = action or free

    def build(p):
        s, pre = action(p, 0)
        return s, pre, []

    return _prove_action("mem.free", "MEM.CONSERVATION ∧ MEM.REFCOUNT ∧ MEM.FREE_XOR_HELD preserved by free (finish / abort)",
                         n, R, build, cross)


def prove_evict(n=8, R=3, action=None, cross=200) -> ProofRow:
    """Eviction (a cached block popped for re-use) only ever takes a block nobody
    holds, and drops its hash *and* its cache-map entry, so no later lookup can
    hit recycled memory (MSGL-01, VLLM-19, TRT-06)."""
    action = action or allocate
    k = Sym("k")

    def build(p):
        s, pre = action(p, 0, k)
        head = [(LT(i, k), p.q[i]) for i in range(n)]
        unheld = AND(*[IMPLIES(a, EQ(holders(p, b), 0)) for a, b in head])
        gone = AND(*[IMPLIES(a, NOT(select(s.inmap, b, False))) for a, b in head])
        return s, pre, [("CACHE.EVICT_LRU: an evicted block had no holder", unheld),
                        ("CACHE.EVICT_LRU: an evicted block leaves the cache map", gone)]

    return _prove_action("mem.evict", "evicted blocks are unheld and leave the cache map; MEM.* preserved by evict-on-pop",
                         n, R, build, cross)


def prove_preempt(n=8, R=3, action=None, cross=200) -> ProofRow:
    """MEM.* are preserved by recompute preemption, and the victim ends holding no
    blocks with no computed tokens (VLLM-01, VLLM-02, VLLM-13, LMD-02, TRT-05)."""
    action = action or preempt

    def build(p):
        s, pre = action(p, 0)
        after = AND(EQ(s.cnt[0], 0), EQ(s.computed[0], 0), NOT(s.running[0]))
        return s, pre, [("REQ.IDLE_HOLDS_NOTHING: a preempted request holds no blocks and no computed tokens", after)]

    return _prove_action("mem.preempt", "MEM.* preserved by preempt; the victim holds nothing, computed = 0",
                         n, R, build, cross)


PROOFS = {
    "mem.allocate": prove_allocate,
    "mem.touch": prove_touch,
    "mem.free": prove_free,
    "mem.evict": prove_evict,
    "mem.preempt": prove_preempt,
}
