"""Invariant predicates over the spec's state, checked after every step when enabled.

Each invariant has a stable id, a statement, and the real-bug families it
catches (ids from docs/reference/real-bugs.md).  ``check_state`` runs the
state invariants after a whole step; ``check_schedule`` runs the ones about a
step's decisions right after ``schedule()``.  A violation raises
:class:`InvariantViolation` naming the invariant and the evidence.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from spec.scheduler import SchedulerOutput, SpecEngine


class InvariantViolation(AssertionError):
    def __init__(self, invariant_id: str, evidence: str):
        super().__init__(f"{invariant_id}: {evidence}")
        self.invariant_id = invariant_id
        self.evidence = evidence


@dataclass(frozen=True)
class Invariant:
    id: str
    statement: str
    bugs: tuple[str, ...]  # real-bugs.md entries this catches
    profiles: str = "all"
    check: Callable | None = None


INVARIANTS: dict[str, Invariant] = {}


def invariant(inv_id: str, bugs: tuple[str, ...] = (), profiles: str = "all"):
    """Register a predicate: a generator yielding one evidence string per violation."""

    def wrap(fn):
        INVARIANTS[inv_id] = Invariant(inv_id, " ".join((fn.__doc__ or "").split()), bugs, profiles, fn)
        return fn

    return wrap


# -- memory ---------------------------------------------------------------


@invariant("MEM.CONSERVATION", bugs=("VLLM-08", "SGL-01", "SGL-03", "LMD-05", "TRT-04"))
def _conservation(eng: "SpecEngine") -> Iterator[str]:
    """Every usable block is either in the free queue or held by a request: free + held = total."""
    pool = eng.kv.pool
    held = {b.block_id for t in eng.kv.req_blocks.values() for b in t}
    free = set(pool.free.ids())
    if len(free) + len(held) != eng.config.usable_blocks:
        yield f"{len(free)} free + {len(held)} held != {eng.config.usable_blocks} usable"


@invariant("MEM.FREE_XOR_HELD", bugs=("VLLM-08", "MSGL-01", "TRT-04"))
def _free_xor_held(eng: "SpecEngine") -> Iterator[str]:
    """No block is both free and held; free blocks have ref count 0; the null block is never handed out."""
    pool = eng.kv.pool
    free = pool.free.ids()
    if len(set(free)) != len(free):
        yield "duplicate block in the free queue"
    held = {b.block_id for t in eng.kv.req_blocks.values() for b in t}
    both = held & set(free)
    if both:
        yield f"blocks {sorted(both)[:5]} are free and held"
    for bid in free:
        if pool.blocks[bid].ref_cnt != 0:
            yield f"free block {bid} has ref count {pool.blocks[bid].ref_cnt}"
    if pool.null_block is not None and (0 in held or 0 in free):
        yield "the null block 0 was allocated or freed"


@invariant("MEM.REFCOUNT", bugs=("MSGL-01", "SGL-09", "VLLM-09"))
def _refcount(eng: "SpecEngine") -> Iterator[str]:
    """Each block's ref count equals the number of block tables that hold it."""
    holders = Counter(b.block_id for t in eng.kv.req_blocks.values() for b in t)
    for b in eng.kv.pool.blocks:
        if b is eng.kv.pool.null_block:
            continue
        if b.ref_cnt != holders.get(b.block_id, 0):
            yield f"block {b.block_id}: ref count {b.ref_cnt}, held by {holders.get(b.block_id, 0)}"


@invariant("CACHE.MAP_CONSISTENT", bugs=("VLLM-19", "TGI-02", "TRT-07"))
def _cache_map(eng: "SpecEngine") -> Iterator[str]:
    """The prefix-cache map names exactly the blocks that carry a hash, under that hash."""
    pool = eng.kv.pool
    mapped = set()
    for h, blocks in pool.cached.items():
        for bid, b in blocks.items():
            mapped.add(bid)
            if b.block_hash != h:
                yield f"block {bid} is cached under a hash it does not carry"
    carrying = {b.block_id for b in pool.blocks if b.block_hash is not None}
    if carrying != mapped:
        yield f"blocks with a hash {sorted(carrying ^ mapped)[:5]} are missing from (or stale in) the map"


@invariant("MEM.SLOTS_COVER_COMPUTED", bugs=("VLLM-17", "TRT-08", "MSGL-05"))
def _slots(eng: "SpecEngine") -> Iterator[str]:
    """A running request holds enough blocks for every token it has computed."""
    bs = eng.config.block_size
    for r in eng.running:
        have = len(eng.kv.blocks_of(r.request_id)) * bs
        if have < r.num_computed_tokens:
            yield f"{r.request_id}: {r.num_computed_tokens} computed but only {have} slots"


# -- request lifecycle ------------------------------------------------------


@invariant("REQ.ONE_PLACE", bugs=("VLLM-10", "SGL-11", "LMD-06"))
def _one_place(eng: "SpecEngine") -> Iterator[str]:
    """No request is lost: each is in exactly one of waiting / running / swapped / finished / aborted /
    rejected, matching its status."""
    from spec.scheduler import Status

    in_running = Counter(r.request_id for r in eng.running)
    in_waiting = Counter(r.request_id for r in eng.waiting)
    in_swapped = Counter(r.request_id for r in eng.swapped)
    for rid, req in eng.requests.items():
        places = (in_running[rid], in_waiting[rid], in_swapped[rid])
        want = {Status.RUNNING: (1, 0, 0), Status.WAITING: (0, 1, 0), Status.PREEMPTED: (0, 1, 0),
                Status.SWAPPED: (0, 0, 1)}.get(req.status, (0, 0, 0))
        if places != want:
            yield f"{rid} ({req.status.value}) is in running x{places[0]}, waiting x{places[1]}, swapped x{places[2]}"
    for rid in eng.rejected:
        if rid in eng.requests:
            yield f"{rid} rejected and also admitted"


@invariant("REQ.IDLE_HOLDS_NOTHING", bugs=("VLLM-01", "VLLM-02", "VLLM-13", "LMD-02", "TRT-05"))
def _idle_holds_nothing(eng: "SpecEngine") -> Iterator[str]:
    """A waiting, preempted, swapped, finished or aborted request holds no GPU blocks; a waiting or
    recompute-preempted one has no computed tokens (a swapped one keeps them, in the CPU pool)."""
    from spec.scheduler import Status

    for rid, req in eng.requests.items():
        if req.status == Status.RUNNING:
            continue
        if eng.kv.blocks_of(rid):
            yield f"{rid} ({req.status.value}) holds {len(eng.kv.blocks_of(rid))} blocks"
        if req.status in (Status.WAITING, Status.PREEMPTED) and req.num_computed_tokens:
            yield f"{rid} ({req.status.value}) keeps {req.num_computed_tokens} computed tokens"


@invariant("REQ.COMPUTED_LE_TOKENS", bugs=("VLLM-17", "VLLM-18", "VLLM-11"))
def _computed(eng: "SpecEngine") -> Iterator[str]:
    """computed <= tokens for every request (output placeholders included under async
    scheduling); outputs never exceed max_tokens.  A request that stopped in the middle of its
    accepted drafts keeps their positions computed, at most K of them (SPEC.STOP_IN_DRAFTS)."""
    for rid, req in eng.requests.items():
        slack = getattr(eng, "num_spec", 0) if req.finish_reason is not None else 0
        if req.num_computed_tokens > req.num_tokens_with_placeholders + slack:
            yield f"{rid}: computed {req.num_computed_tokens} > tokens {req.num_tokens_with_placeholders}"
        if len(req.output_token_ids) > req.max_tokens:
            yield f"{rid}: {len(req.output_token_ids)} outputs > max_tokens {req.max_tokens}"


@invariant("QUEUE.FCFS_SORTED", bugs=("VLLM-04", "LMD-01", "VLLM-03"),
           profiles="policy=fcfs, preemption_mode=recompute, admission=budget")
def _fcfs_sorted(eng: "SpecEngine") -> Iterator[str]:
    """Under FCFS the running list and the waiting queue are each sorted by arrival,
    and every running request arrived before every waiting one: victims go back to
    the front, so an earlier arrival is never passed.  (Not under swap, where a
    recompute fall-back victim may rejoin behind a swapped-in request, nor under
    admission=estimate, where a retracted request goes to the tail, as in SGLang, nor under
    preemption_victim=slo-slack, where the victim need not be the newest.)"""
    cfg = eng.config
    if cfg.policy != "fcfs" or cfg.preemption_mode != "recompute" or cfg.admission != "budget" \
            or cfg.preemption_victim != "policy":
        return
    seqs = [r.arrival_seq for r in eng.running] + [r.arrival_seq for r in eng.waiting]
    if seqs != sorted(seqs):
        yield f"running + waiting not in arrival order: {[r.request_id for r in eng.running]} + {[r.request_id for r in eng.waiting]}"


@invariant("SEQ.MAX_NUM_SEQS", bugs=("VLLM-16",))
def _max_seqs(eng: "SpecEngine") -> Iterator[str]:
    """At most max_num_seqs requests run at once (under max_num_seqs_scope=step: are scheduled in one step)."""
    if eng.config.max_num_seqs_scope == "step":
        last = eng.previous
        if last is not None and len(last.scheduled) > eng.config.max_num_seqs:
            yield f"{len(last.scheduled)} scheduled in one step > max_num_seqs {eng.config.max_num_seqs}"
    elif len(eng.running) > eng.config.max_num_seqs:
        yield f"{len(eng.running)} running > max_num_seqs {eng.config.max_num_seqs}"


@invariant("SWAP.CPU_CONSERVATION", profiles="preemption_mode=swap (vllm-v0-swap)")
def _cpu_conservation(eng: "SpecEngine") -> Iterator[str]:
    """The CPU swap pool is conserved: free CPU blocks + the CPU blocks of every swapped request =
    num_cpu_blocks; exactly the swapped requests hold CPU blocks, ceil(computed / block_size) each,
    and the swapped queue is in swap-in order."""
    cfg = eng.config
    held = sum(eng.cpu_blocks.values())
    if eng.cpu_free < 0 or eng.cpu_free + held != cfg.num_cpu_blocks:
        yield f"{eng.cpu_free} free + {held} held CPU blocks != {cfg.num_cpu_blocks}"
    if set(eng.cpu_blocks) != {r.request_id for r in eng.swapped}:
        yield f"CPU holders {sorted(eng.cpu_blocks)} != swapped {[r.request_id for r in eng.swapped]}"
    for r in eng.swapped:
        want = -(-r.num_computed_tokens // cfg.block_size)
        if eng.cpu_blocks.get(r.request_id) != want:
            yield f"{r.request_id}: {eng.cpu_blocks.get(r.request_id)} CPU blocks for {r.num_computed_tokens} computed tokens"
    if eng.swapped != sorted(eng.swapped, key=eng._swap_key):
        yield f"swapped queue out of order: {[r.request_id for r in eng.swapped]}"


@invariant("ESTIMATE.RATIO_BOUNDS", profiles="admission=estimate (sglang)")
def _ratio_bounds(eng: "SpecEngine") -> Iterator[str]:
    """Under admission=estimate, new_token_ratio stays within [0, 1] (decay stops at init x min_factor;
    a retraction may set it lower, and the next decay step lifts it back to that floor), and equals
    init whenever nothing is running or waiting."""
    cfg = eng.config
    if cfg.admission != "estimate":
        return
    r = eng.new_token_ratio
    if not 0.0 <= r <= 1.0:
        yield f"new_token_ratio {r} outside [0, 1]"
    if not eng.has_unfinished_requests() and r != cfg.new_token_ratio_init:
        yield f"idle engine with new_token_ratio {r} != init {cfg.new_token_ratio_init}"


STATE_CHECKS = (
    "MEM.CONSERVATION",
    "MEM.FREE_XOR_HELD",
    "MEM.REFCOUNT",
    "CACHE.MAP_CONSISTENT",
    "MEM.SLOTS_COVER_COMPUTED",
    "REQ.ONE_PLACE",
    "REQ.IDLE_HOLDS_NOTHING",
    "REQ.COMPUTED_LE_TOKENS",
    "QUEUE.FCFS_SORTED",
    "SEQ.MAX_NUM_SEQS",
    "SWAP.CPU_CONSERVATION",
    "ESTIMATE.RATIO_BOUNDS",
)


def check_state(eng: "SpecEngine") -> None:
    """Run every state invariant; raise on the first violation."""
    for inv_id in STATE_CHECKS:
        for evidence in INVARIANTS[inv_id].check(eng):
            raise InvariantViolation(inv_id, evidence)


# -- per-step decisions -----------------------------------------------------


@invariant("BUDGET.TOKENS_LE_BUDGET", bugs=("VLLM-16", "MSGL-04", "TRT-01", "TRT-02"))
def _budget(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """The tokens scheduled in a step sum to at most max_num_batched_tokens, and each scheduled request gets 1..remaining tokens."""
    total = sum(s.num_tokens for s in out.scheduled)
    if total > eng.config.max_num_batched_tokens:
        yield f"{total} tokens scheduled > budget {eng.config.max_num_batched_tokens}"
    for s in out.scheduled:
        req = eng.requests[s.request_id]
        if s.num_tokens < 1 or s.start + s.num_tokens - s.drafts > req.num_tokens_with_placeholders:  # drafts: SPEC.*
            yield f"{s.request_id}: scheduled {s.num_tokens} tokens from {s.start} of {req.num_tokens_with_placeholders}"


@invariant("SAMPLE.AFTER_PREFILL", bugs=("VLLM-17", "VLLM-18"))
def _sample_after_prefill(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """A request samples only in a step that completes its prefill (computed reaches its token count)."""
    for s in out.scheduled:
        req = eng.requests[s.request_id]
        if s.samples != (s.start + s.num_tokens - s.drafts == req.num_tokens_with_placeholders):
            yield f"{s.request_id}: samples={s.samples} at {s.start}+{s.num_tokens} of {req.num_tokens_with_placeholders}"


@invariant("CACHE.HIT_NOT_WHOLE", bugs=("VLLM-18",))
def _hit_not_whole(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """A prefix-cache hit never covers a request's whole sequence: at least one token is computed."""
    for rid, hit in out.cache_hits.items():
        if hit >= eng.requests[rid].num_tokens:
            yield f"{rid}: hit {hit} of {eng.requests[rid].num_tokens} tokens"


@invariant("LIVE.NO_IDLE_STALL", bugs=("VLLM-05", "VLLM-06", "TGI-01", "LMD-03"))
def _no_idle_stall(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """If nothing is running and a request waits, the step admits one: the pool is
    then entirely free, and the rejection rules guarantee every queued request fits it.
    (A step whose SLO admission control refused every waiting request, SLO.REFUSE, leaves
    nobody waiting: no stall.)"""
    if starved and len(eng.waiting) and not (out.new or out.resumed):
        head = next(iter(eng.waiting)).request_id if len(eng.waiting) else "?"
        yield f"nothing running, {len(eng.waiting)} waiting, head {head} not admitted"


@invariant("PREEMPT.NOT_SCHEDULED", bugs=("VLLM-01", "VLLM-02"))
def _preempted_not_scheduled(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """A request preempted in a step is not in that step's batch and is not admitted back in it."""
    batch = {s.request_id for s in out.scheduled}
    for rid in out.preempted:
        if rid in batch:
            yield f"{rid} preempted and scheduled in the same step"


@invariant("PREEMPT.NEVER_UNDER_FULL_RESERVATION", bugs=("TRT-03",), profiles="kv_reservation=full (static, orca, tgi)")
def _no_preempt_full(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """With KV reserved to completion at admission, no request is ever preempted."""
    if eng.config.kv_reservation == "full" and out.preempted:
        yield f"preempted {out.preempted} although every request reserved its whole sequence"


def _admitted(out: "SchedulerOutput") -> list[str]:
    """Requests admitted from the waiting queue in this step (swap-ins are returns, not admissions)."""
    if not out.swapped_in:
        return out.new + out.resumed
    return out.new + [r for r in out.resumed if r not in out.swapped_in]


@invariant("BATCH.STATIC_NO_JOIN", profiles="batching=static (static)")
def _static_no_join(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """Under static batching, requests are admitted only in a step that began with nothing running."""
    if eng.config.batching == "static" and _admitted(out) and not starved:
        yield f"{_admitted(out)} joined a running static batch"


@invariant("BATCH.PREFILL_ONLY", profiles="batching=prefill-first (vllm-v0, tgi, sglang, vtc)")
def _prefill_only(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """Under prefill-first batching, a step that admits from the waiting queue runs only the admitted requests
    (and, under prefill_chunking=first-continues or last-continues, the cut prefill it continued first)."""
    admitted = _admitted(out)
    if eng.config.batching == "prefill-first" and admitted:
        continued = {s.request_id for s in out.scheduled[:1] if eng.config.prefill_chunking != "any"}
        others = [s.request_id for s in out.scheduled if s.request_id not in admitted and s.request_id not in continued]
        if others:
            yield f"{others} ran in a prefill batch"


@invariant("SWAP.BEFORE_WAITING", profiles="preemption_mode=swap (vllm-v0-swap)")
def _swap_before_waiting(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """Under swap, no waiting request is admitted while a request is swapped out, nothing is swapped
    in during a step that preempted, and swapped requests come back in swap-in order."""
    if eng.config.preemption_mode != "swap":
        return
    admitted = _admitted(out)
    if admitted and eng.swapped:
        yield f"{admitted} admitted while {[r.request_id for r in eng.swapped]} are swapped out"
    if out.swapped_in and out.preempted:
        yield f"{out.swapped_in} swapped in in a step that preempted {out.preempted}"
    if out.swapped_in and eng.swapped and eng._swap_key(eng.swapped[0]) < eng._swap_key(eng.requests[out.swapped_in[-1]]):
        yield f"{out.swapped_in[-1]} swapped in ahead of {eng.swapped[0].request_id}"


@invariant("RETRACT.VICTIM_FEWEST_OUTPUTS", profiles="admission=estimate (sglang)")
def _retract_victim(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """Under admission=estimate every retracted request had, among the requests running when it was
    retracted, the fewest output tokens, and the longest prompt among those with as few."""
    if eng.config.admission != "estimate" or not out.preempted:
        return
    joined = set(out.new) | set(out.resumed)
    live = [r for r in eng.running if r.request_id not in joined] + [eng.requests[r] for r in out.preempted]
    for rid in out.preempted:  # outputs do not change during schedule(); victims leave in order
        victim = eng.requests[rid]
        best = min((len(r.output_token_ids), -len(r.prompt_token_ids)) for r in live)
        if (len(victim.output_token_ids), -len(victim.prompt_token_ids)) != best:
            yield f"{rid} retracted with {len(victim.output_token_ids)} outputs; another had key {best}"
        live.remove(victim)


@invariant("QUEUE.AGING_BOUNDED_OVERTAKING", profiles="aging_steps > 0 (priority-aging, spf-aging, sprpt)")
def _aging_bounded_overtaking(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """Under aging (aging_steps = A > 0) a request x is admitted ahead of a waiting request r that
    arrived before it only if x arrived fewer than (key_r - key_x) x A steps after r (key = priority,
    prompt length under spf, predicted remaining output under sprpt).  So r can be overtaken only by requests arriving within
    (key_r - key_min) x A steps after it: once r is that old, everything admitted before it arrived
    before it, and r waits at most (key_r - key_min) x A steps plus the time to serve the requests
    that arrived before it or in that window (no starvation)."""
    cfg = eng.config
    if not cfg.aging_steps or not (out.new or out.resumed):
        return
    key = eng.waiting.base_key
    for rid in _admitted(out):
        x = eng.requests[rid]
        for r in eng.waiting:
            if r.arrival_seq < x.arrival_seq and x.arrival_step - r.arrival_step >= (key(r) - key(x)) * cfg.aging_steps:
                yield (f"{rid} (key {key(x)}, arrived step {x.arrival_step}) admitted ahead of {r.request_id} "
                       f"(key {key(r)}, arrived step {r.arrival_step}) with aging_steps {cfg.aging_steps}")


@invariant("QUEUE.EDF_ORDER", profiles="policy=edf (edf, edf-ac)")
def _edf_order(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """Under EDF the requests admitted in a step come before every request left waiting in
    the order (deferred, next-token due step, arrival, id) (rule QUEUE.EDF): admission never
    passes over a request that is due earlier, unless SLO admission control deferred it."""
    if eng.config.policy != "edf" or not (out.new or out.resumed):
        return
    from spec.slo import edf_key

    waiting = [edf_key(r) for r in eng.waiting]
    if not waiting:
        return
    first = min(waiting)
    for rid in _admitted(out):
        key = edf_key(eng.requests[rid])
        if key > first:
            yield f"{rid} (deadline {key[1]}) admitted while {first[3]} (deadline {first[1]}) waits"


@invariant("SLO.ADMITTED_FEASIBLE", profiles="slo_admission=refuse|defer (edf-ac)")
def _admitted_feasible(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> Iterator[str]:
    """Under SLO admission control every request admitted in a step whose first token is not
    out could still sample it by its TTFT deadline with the whole token budget from that step
    on (rule SLO.FEASIBLE), unless it was deferred (then it is served best effort).  With the
    modelled per-step cost -- the whole budget every step once admitted -- such a request
    meets its TTFT target (proved exhaustively at small bounds: batchspec prove,
    slo.edf_ac.deadline)."""
    cfg = eng.config
    if cfg.slo_admission == "off" or not (out.new or out.resumed):
        return
    from spec.slo import feasible

    for rid in _admitted(out):
        req = eng.requests[rid]
        if req.deferred or req.first_token_step is not None:
            continue
        tokens = req.num_tokens  # everything it must compute (hits are not counted)
        if not feasible(eng.clock, tokens, cfg.max_num_batched_tokens, req.ttft_deadline):
            yield f"{rid} admitted at step {eng.clock}: {tokens} tokens cannot be prefilled by step {req.ttft_deadline}"


SCHEDULE_CHECKS = (
    "QUEUE.EDF_ORDER",
    "SLO.ADMITTED_FEASIBLE",
    "PREEMPT.NEVER_UNDER_FULL_RESERVATION",
    "BATCH.STATIC_NO_JOIN",
    "BATCH.PREFILL_ONLY",
    "SWAP.BEFORE_WAITING",
    "RETRACT.VICTIM_FEWEST_OUTPUTS",
    "QUEUE.AGING_BOUNDED_OVERTAKING",
    "BUDGET.TOKENS_LE_BUDGET",
    "SAMPLE.AFTER_PREFILL",
    "CACHE.HIT_NOT_WHOLE",
    "LIVE.NO_IDLE_STALL",
    "PREEMPT.NOT_SCHEDULED",
)


def check_schedule(eng: "SpecEngine", out: "SchedulerOutput", starved: bool) -> None:
    """Run every per-step invariant on ``schedule()``'s output; raise on the first violation."""
    for inv_id in SCHEDULE_CHECKS:
        for evidence in INVARIANTS[inv_id].check(eng, out, starved):
            raise InvariantViolation(inv_id, evidence)
