"""Interaction coverage: pairs of mechanisms that meet in one step or in one request's life.

Rule-id coverage (:data:`spec.rules.HITS`) says that each rule fired *somewhere*; the
bugs that survive it need two mechanisms at once — a preemption of a request whose
blocks another request shares, a priority preemption in a step whose token budget is
spent, an abort of a request that is preempted or swapped out (issue 18 item 2).  This
module reads the spec's own fired-rule record — each step record's ``reasons`` (rule id
and request) — plus a few facts the same records show without a reason (a prefix hit
in ``cache_hits``, an eviction in ``num_evicted``, a block held by two requests in
``block_ids``, a request waiting after a preemption), and derives two things:

* **automatic pairs**: every two rule ids fired in one step (``step:A+B``) or on one
  request across its life (``life:A+B``), counted as seen, without a denominator
  (most of the ``n^2`` pairs cannot meet);
* **interactions** (:data:`INTERACTIONS`): a curated list of mechanism pairs that
  matter, each with the generator options that make it likely (steering) and the knob
  values it needs (its reachability under an engine's envelope).  A campaign reports
  ``interactions hit / interactions reachable`` next to rule coverage and steers a
  share of its traces towards the interactions it has met least.

Facts that are not rule ids are named ``STATE.*`` (they are states of a request or a
step, not decisions): ``STATE.SHARED_BLOCKS`` (the request entered the step holding a
block another request holds), ``STATE.PREEMPTED`` (it waits after a preemption by
recompute), ``STATE.SWAPPED`` (its KV is swapped out), ``STATE.RETRACTED`` (it waits
after an estimate-admission retraction), ``STATE.BUDGET_SPENT`` (the step scheduled its
whole token budget).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from itertools import chain, combinations
from operator import itemgetter
from typing import Any, Callable, Iterable

from spec.formats import StepRecord, Trace

#: Rule-id families that preempt a request (the victim is the reason's request).
PREEMPTING = ("PREEMPT.", "RETRACT.", "SWAP.OUT", "SWAP.FALLBACK_RECOMPUTE")


@dataclass
class StepFacts:
    """What fired at one step: ``rules`` per request (``None``: the step as a whole);
    ``fired``: all of them, kept as they are added (the union of ``by_request``'s sets)."""

    step: int
    by_request: dict[str | None, set[str]] = field(default_factory=dict)
    fired: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.by_request and not self.fired:  # built from ``by_request`` alone
            self.fired = set().union(*self.by_request.values())

    def add(self, rule: str, request: str | None = None) -> None:
        self.by_request.setdefault(request, set()).add(rule)
        self.fired.add(rule)

    def rules(self) -> set[str]:
        return set(self.fired)

    def of(self, request: str | None) -> set[str]:
        return self.by_request.get(request, set())


def _shared(block_ids: dict[str, list[int]] | None) -> set[str]:
    """Requests that hold a block another request holds too (a shared prefix block)."""
    if not block_ids:
        return set()
    flat = list(chain.from_iterable(block_ids.values()))
    if len(set(flat)) == len(flat):  # most steps: no block held twice (one C-level pass)
        return set()
    seen: set[int] = set()
    twice: set[int] = set()  # blocks an earlier request holds too
    for blocks in block_ids.values():
        twice.update(seen.intersection(blocks))
        seen.update(blocks)
    if not twice:  # a block held twice by one request only
        return set()
    return {rid for rid, blocks in block_ids.items() if not twice.isdisjoint(blocks)}


def step_facts(records: Iterable[StepRecord], budget: int | None = None) -> list[StepFacts]:
    """The facts of each spec step record, in order (see the module docstring).

    ``budget``: the trace's ``max_num_batched_tokens`` (``STATE.BUDGET_SPENT``); states that
    last across steps (preempted, swapped, retracted, shared blocks) are carried from the
    records before."""
    out: list[StepFacts] = []
    shared: set[str] = set()
    waiting: dict[str, str] = {}  # request -> STATE.PREEMPTED / STATE.SWAPPED / STATE.RETRACTED
    for rec in records:
        # (StepFacts.add inlined: this loop runs for every step of every campaign trace)
        by: dict[str | None, set[str]] = {rid: {"STATE.SHARED_BLOCKS"} for rid in shared}
        for rid, state in waiting.items():
            by.setdefault(rid, set()).add(state)
        for r in rec.reasons or ():
            by.setdefault(r.get("request"), set()).add(str(r.get("rule")))
        for rid, hit in (rec.cache_hits or {}).items():
            if hit > 0:
                by.setdefault(rid, set()).add("CACHE.HIT")
        if rec.num_evicted:
            by.setdefault(None, set()).add("CACHE.EVICT_LRU")
        if budget and sum(map(itemgetter(1), rec.scheduled)) >= budget:
            by.setdefault(None, set()).add("STATE.BUDGET_SPENT")
        f = StepFacts(rec.step, by, set().union(*by.values()))
        for rid in rec.resumed:
            waiting.pop(rid, None)
        for rid in list(rec.aborted) + [r for r, _ in rec.finished]:
            waiting.pop(rid, None)
        for rid in rec.preempted:
            mine = f.of(rid)
            waiting[rid] = ("STATE.SWAPPED" if rid in rec.swapped_out else
                            "STATE.RETRACTED" if any(x.startswith("RETRACT.") for x in mine) else "STATE.PREEMPTED")
        if rec.block_ids is not None:
            shared = _shared(rec.block_ids)
        out.append(f)
    return out


def automatic_pairs(facts: list[StepFacts]) -> set[str]:
    """Every two rule ids (``STATE.*`` facts left out) fired in one step, ``step:A+B``, or on one
    request across the trace, ``life:A+B`` (names in sorted order)."""
    out: set[str] = set()
    life: dict[str, set[str]] = {}  # request -> every fact it had (STATE.* left out at the end)
    seen: set[frozenset[str]] = set()  # a step's facts seen before add no pair (most decode steps)
    step_sets: set[frozenset[str]] = set()
    for f in facts:
        fired = frozenset(f.fired)
        if fired not in seen:
            seen.add(fired)
            rules = frozenset(_rules_only(fired))
            if rules not in step_sets:
                step_sets.add(rules)
                out.update(f"step:{a}+{b}" for a, b in combinations(sorted(rules), 2))
        for rid, mine in f.by_request.items():
            if rid is not None:
                had = life.get(rid)
                if had is None:
                    life[rid] = set(mine)
                else:
                    had |= mine
    for mine in life.values():
        out.update(f"life:{a}+{b}" for a, b in combinations(sorted(_rules_only(mine)), 2))
    return out


def _rules_only(facts: Iterable[str]) -> list[str]:
    """The rule ids among ``facts`` (``STATE.*`` facts left out)."""
    return [r for r in facts if not r.startswith("STATE.")]


def _starts(rules: set[str], prefixes: tuple[str, ...]) -> bool:
    return any(r.startswith(prefixes) for r in rules)


@dataclass(frozen=True)
class Interaction:
    """Two mechanisms meeting, a predicate over one trace's facts, and how to provoke it."""

    name: str
    statement: str  # what meets, and which bugs live there
    met: Callable[[list[StepFacts]], bool]
    steer: dict[str, Any]  # generator options (switches and knobs) that make it likely
    needs: dict[str, Any] = field(default_factory=dict)  # knob -> values (or a test) it needs to be reachable
    shape: Callable[[Trace, random.Random], Trace] | None = None  # reworks a drawn trace towards it (shape_trace)


def _needs(first: tuple[str, ...], second: tuple[str, ...]):
    """Mark a predicate with the two families it needs: it can only be met by a trace in which
    a rule of each fired somewhere (:func:`interactions_met` skips it otherwise — most traces)."""
    def wrap(met: Callable[[list[StepFacts]], bool]) -> Callable[[list[StepFacts]], bool]:
        met.families = (first, second)  # type: ignore[attr-defined]
        return met
    return wrap


def _same_request(first: tuple[str, ...], second: tuple[str, ...]) -> Callable[[list[StepFacts]], bool]:
    """Some request has a rule of ``first`` and one of ``second`` in one step."""
    @_needs(first, second)
    def met(facts: list[StepFacts]) -> bool:
        return any(_starts(mine, first) and _starts(mine, second)
                   for f in facts if _starts(f.fired, first) and _starts(f.fired, second)  # (else no request can)
                   for rid, mine in f.by_request.items() if rid is not None)
    return met


def _same_step(first: tuple[str, ...], second: tuple[str, ...]) -> Callable[[list[StepFacts]], bool]:
    """One step has a rule of ``first`` (anyone's) and one of ``second`` (anyone's)."""
    @_needs(first, second)
    def met(facts: list[StepFacts]) -> bool:
        return any(_starts(f.fired, first) and _starts(f.fired, second) for f in facts)
    return met


def _one_life(first: tuple[str, ...], second: tuple[str, ...]) -> Callable[[list[StepFacts]], bool]:
    """Some request has a rule of ``first`` and, at the same or a later step, one of ``second``."""
    @_needs(first, second)
    def met(facts: list[StepFacts]) -> bool:
        seen: set[str] = set()
        for f in facts:
            if not _starts(f.fired, first) and not (seen and _starts(f.fired, second)):
                continue  # (no request of this step can be marked or match)
            for rid, mine in f.by_request.items():
                if rid is None:
                    continue
                if _starts(mine, first):
                    seen.add(rid)
                if rid in seen and _starts(mine, second):
                    return True
        return False
    return met


# -- shaping: a drawn trace reworked towards an interaction (random_trace(..., interaction=NAME)) -------


def spec_run(trace: Trace, decisions_only: bool = False) -> list[StepRecord]:
    """The records of the spec's own run of ``trace`` ([] when it does not finish within its step
    limit), for shaping a drawn trace.  ``decisions_only``: records at the decisions level, without
    state fields (cheaper): the batches, rules and waiting states, no memory fields."""
    from spec.config import resolve
    from spec.protocol import StepLimitError, drive
    from spec.scheduler import SpecEngine

    light = {"record_level": "decisions", "record_state": False} if decisions_only else {}
    engine = SpecEngine.from_trace(trace, check_invariants=False, **light)
    try:
        return drive(engine, trace, resolve(trace.config).max_steps)
    except StepLimitError:
        return []


def _spec_facts(trace: Trace, decisions_only: bool = False) -> list[StepFacts]:
    """The facts of the spec's own run of ``trace`` (:func:`spec_run`; [] when it does not finish).
    ``decisions_only``: the facts that need memory fields (prefix hits, evictions, shared blocks) are
    then missing, the rules and the waiting states (preempted, swapped, retracted) are all there."""
    from spec.config import resolve

    records = spec_run(trace, decisions_only)
    return step_facts(records, resolve(trace.config).max_num_batched_tokens) if records else []


def _abort_while(states: tuple[str, ...]) -> Callable[[Trace, random.Random], Trace]:
    """Aborts timed into a state: the spec runs the drawn trace, and one request found in one of
    ``states`` at the start of some step (waiting after a preemption, swapped out) gets that step
    as its ``abort_at`` — the run before that step is unchanged, so the abort meets the state.
    Only a request with no earlier abort is picked (an earlier abort would change the history)."""
    def shape(trace: Trace, rng: random.Random) -> Trace:
        facts = _spec_facts(trace, decisions_only=True)  # (the waiting states are decisions)
        by_id = {r.id: r for r in trace.requests}
        found = [(f.step, rid) for f in facts for rid, mine in sorted(f.by_request.items(), key=lambda kv: str(kv[0]))
                 if rid in by_id and mine.intersection(states)
                 and (by_id[rid].abort_at is None or by_id[rid].abort_at > f.step)]
        if not found:
            return trace
        step, rid = rng.choice(found)
        return replace(trace, requests=[replace(r, abort_at=step) if r.id == rid else r for r in trace.requests])
    return shape


def _victims_resumed(facts: list[StepFacts]) -> bool:
    """Two or more requests preempted in one step, two of them resumed later (in one step or
    two): the order the victims wait in (re-inserted at the queue's front one by one) decides
    which resumes first."""
    groups: list[tuple[set[str], set[str]]] = []  # (victims of one step, those of them resumed since)
    for f in facts:
        resumed = {rid for rid, mine in f.by_request.items() if rid is not None and "ADMIT.RESUMED" in mine}
        for victims, back in groups:
            back.update(victims & resumed)
            if len(back) >= 2:
                return True
        victims = {rid for rid, mine in f.by_request.items() if rid is not None and _starts(mine, PREEMPTING)}
        if len(victims) >= 2:
            groups.append((victims, set()))
    return False


_victims_resumed.families = (PREEMPTING, ("ADMIT.RESUMED",))  # type: ignore[attr-defined]  (interactions_met)


def _one_long_many_short(trace: Trace, rng: random.Random) -> Trace:
    """The first request gets a prompt that nearly fills the usable blocks and a few outputs; the
    others, arriving with it, short prompts of at most a block.  Under a long-prefill cap the short
    ones are admitted beside the long prefill's first chunk; once the pool runs dry, one chunk of
    the long prefill needs more blocks than one short request frees, so one allocation preempts
    several newest requests at once, and they resume after the long one finishes."""
    from spec.config import resolve

    config = resolve(trace.config)
    bs, usable = config.block_size, config.num_blocks - (1 if config.null_block else 0)
    order = sorted(trace.requests, key=lambda r: (r.arrival_step or 0, r.id))
    if usable < 4 or not order or any(r.prompt is not None for r in order):
        return trace
    first = order[0].id
    outputs = rng.randint(1, bs)
    longest = min(config.max_model_len - 1 - outputs, (usable - 1) * bs - outputs)
    out = []
    for r in trace.requests:
        if r.id == first:
            r = replace(r, prompt_len=max(1, rng.randint(max(1, longest - bs), max(1, longest))), max_tokens=outputs,
                        prefix_group=None, prefix_len=0, arrival_step=0, abort_at=None, ignore_eos=True)
        else:
            r = replace(r, prompt_len=rng.randint(1, bs), prefix_group=None, prefix_len=0, arrival_step=0,
                        max_tokens=max(1, min(r.max_tokens, 2 * bs)), abort_at=None)
        out.append(r)
    out.sort(key=lambda r: r.id != first)
    return replace(trace, requests=out)


def _later_more_important(trace: Trace, rng: random.Random) -> Trace:
    """Priorities that fall with arrival (a later request more important, 0 the most): the running
    list then holds older, less important requests ahead of newer ones, so a priority victim is
    often one scheduled earlier in the same step, whose tokens go back to the budget."""
    order = sorted(trace.requests, key=lambda r: (r.arrival_step or 0, r.id))
    n = len(order)
    rank = {r.id: max(0, min(3, 3 - (4 * i) // max(n, 1) + rng.choice((-1, 0, 0, 1)))) for i, r in enumerate(order)}
    return replace(trace, requests=[replace(r, priority=rank[r.id]) for r in trace.requests])


def _common_prefix(trace: Trace, rng: random.Random) -> Trace:
    """One shared prompt prefix of one to three blocks and a bit for most requests (those without
    explicit prompt tokens): whichever request is preempted, the requests running beside it then
    likely hold the same cached prefix blocks."""
    from spec.config import resolve

    config = resolve(trace.config)
    bs = config.block_size
    plen = bs * rng.randint(1, 3) + rng.randint(0, bs - 1)
    out = []
    for r in trace.requests:
        if r.prompt is None and rng.random() < 0.8:
            longer = min(plen + rng.randint(0, 2 * bs), config.max_model_len - 1)
            r = replace(r, prefix_group="shared", prefix_len=min(plen, max(r.prompt_len, longer)),
                        prompt_len=max(r.prompt_len, longer))
        out.append(r)
    return replace(trace, requests=out)


def shape_trace(trace: Trace, name: str, seed: int) -> Trace:
    """``trace`` reworked towards interaction ``name`` by its ``shape`` (unchanged without one);
    deterministic in ``seed``."""
    interaction = BY_NAME.get(name)
    if interaction is None:
        raise ValueError(f"unknown interaction {name!r} (known: {', '.join(BY_NAME)})")
    if interaction.shape is None:
        return trace
    return interaction.shape(trace, random.Random(f"interaction:{name}:{seed}"))


_CACHING = {"enable_prefix_caching": True, "prefix_groups": True, "clones": True}
#: Memory pressure: a tight pool, no headroom kept, chunks admitted without their whole sequence,
#: several requests at once, allocation step by step — preemptions in most traces.
_PRESSURE = {"tight_memory": True, "batching": "continuous", "kv_reservation": "step", "watermark": 0.0,
             "scheduler_reserve_full_isl": False, "max_num_seqs": 16, "n_requests": 10}

#: The curated interactions (docs/mutation-score.md names them and the planted bug of each).
INTERACTIONS: tuple[Interaction, ...] = (
    Interaction("preempt x shared-prefix",
                "a request is preempted (or retracted, swapped out) while it holds a prefix block another request "
                "holds too: freeing it must only drop a reference",
                _same_request(PREEMPTING, ("STATE.SHARED_BLOCKS",)),
                {**_CACHING, **_PRESSURE, "preemption_mode": "recompute", "block_size": 4, "max_num_batched_tokens": 32},
                {"enable_prefix_caching": (True,)}, _common_prefix),
    Interaction("priority-preempt x spent-budget",
                "a priority preemption in a step whose token budget is spent: a victim scheduled earlier in the "
                "step gives its tokens back to the requests after it",
                _same_step(("PREEMPT.VICTIM_LOWEST_PRIORITY",), ("STATE.BUDGET_SPENT", "BUDGET.EXHAUSTED")),
                {**_PRESSURE, "policy": "priority", "max_num_batched_tokens": 16, "admission": "budget",
                 "preemption_mode": "recompute", "n_requests": 12, "admit_after_preempt": True,
                 "enable_chunked_prefill": True, "long_prefill_token_threshold": 0},
                {"policy": ("priority",)}, _later_more_important),
    Interaction("abort x preempted",
                "a request aborted while it waits after a preemption: it holds no blocks, and must leave the queue",
                _same_request(("ABORT.",), ("STATE.PREEMPTED", "STATE.RETRACTED")),
                {**_PRESSURE, "preemption_mode": "recompute"},
                shape=_abort_while(("STATE.PREEMPTED", "STATE.RETRACTED"))),
    Interaction("abort x swapped",
                "a request aborted while its KV is swapped out: its CPU blocks must return to the CPU pool",
                _same_request(("ABORT.",), ("STATE.SWAPPED",)),
                {**_PRESSURE, "preemption_mode": "swap", "async_scheduling": False, "num_cpu_blocks": 256},
                {"preemption_mode": ("swap",)}, _abort_while(("STATE.SWAPPED",))),
    Interaction("preempt x swapped",
                "a preemption (or swap-out) in a step while another request waits swapped out: that step swaps "
                "nobody back in, even where the victims' blocks would fit it (vLLM V0 swaps in only after a step "
                "that preempted nothing)",
                _same_step(PREEMPTING, ("STATE.SWAPPED",)),
                {**_PRESSURE, "preemption_mode": "swap", "async_scheduling": False, "admission": "budget"},
                {"preemption_mode": ("swap",)}),
    Interaction("chunked-prefill x prefix-hit",
                "a request admitted with a prefix hit whose prefill is then cut into chunks: the chunks start "
                "after the hit",
                _one_life(("CACHE.HIT",), ("RUN.PREFILL_CHUNK",)),
                {**_CACHING, "enable_chunked_prefill": True, "max_num_batched_tokens": 8},
                {"enable_prefix_caching": (True,), "enable_chunked_prefill": (True,)}),
    Interaction("retraction x eviction",
                "cached blocks are evicted while a retracted request waits: its prefix stays cached until popped",
                _same_step(("STATE.RETRACTED",), ("CACHE.EVICT_LRU",)),
                {**_CACHING, **_PRESSURE, "admission": "estimate", "async_scheduling": False, "block_size": 4,
                 "preemption_mode": "recompute",
                 "max_num_batched_tokens": 32, "enable_chunked_prefill": True},
                {"admission": ("estimate",), "enable_prefix_caching": (True,)}),
    Interaction("several victims x resume",
                "two or more requests preempted in one step and resumed later: the victims return to the "
                "queue's front one by one, so the last one preempted resumes first",
                _victims_resumed,
                {**_PRESSURE, "policy": "fcfs", "preemption_mode": "recompute", "admission": "budget",
                 "enable_chunked_prefill": True, "max_num_batched_tokens": 32, "block_size": 4,
                 "enable_prefix_caching": False, "long_prefill_token_threshold": 16, "async_scheduling": False},
                {"policy": ("fcfs",), "preemption_mode": ("recompute",)}, _one_long_many_short),
    Interaction("resume x prefix-hit",
                "a preempted request resumes with a prefix hit on blocks it (or another) left cached",
                _same_request(("ADMIT.RESUMED",), ("CACHE.HIT",)),
                {**_CACHING, "tight_memory": True},
                {"enable_prefix_caching": (True,)}),
    Interaction("prefix-hit x eviction",
                "one step both hits cached blocks and evicts cached blocks: a hit block must not be the one popped",
                _same_step(("CACHE.HIT",), ("CACHE.EVICT_LRU",)),
                {**_CACHING, "tight_memory": True},
                {"enable_prefix_caching": (True,)}),
    Interaction("preempt x eviction",
                "cached blocks are evicted while a preempted request waits for its own blocks",
                _same_step(("STATE.PREEMPTED",), ("CACHE.EVICT_LRU",)),
                {**_CACHING, "tight_memory": True},
                {"enable_prefix_caching": (True,)}),
    Interaction("stale output x preempted",
                "under async scheduling a request preempted with its token still in flight: the token arrives, and "
                "when it stops the request, the request finishes from the waiting queue (it leaves the queue)",
                _same_request(("ASYNC.STALE_OUTPUT",), ("STOP.",)),
                {**_PRESSURE, "async_scheduling": True, "preemption_mode": "recompute", "admission": "budget",
                 "eos": True},
                {"async_scheduling": (True,), "preemption_mode": ("recompute",)}),  # (async scheduling never swaps)
    Interaction("ignore_eos-reserve x running batch",
                "SGLang's reserve admission of an ignore_eos request while others run: the simulation of every "
                "request's remaining outputs (an ignore_eos one's unscaled, the rest's by the ratio) decides",
                _same_step(("ESTIMATE.IGNORE_EOS_RESERVE",), ("RUN.DECODE",)),
                {**_PRESSURE, "admission": "estimate", "ignore_eos_admission": "reserve", "enable_prefix_caching": False,
                 "ignore_eos": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 32,
                 "async_scheduling": False},
                {"admission": ("estimate",), "ignore_eos_admission": ("reserve",), "enable_prefix_caching": (False,)}),
)

BY_NAME = {i.name: i for i in INTERACTIONS}


def interactions_met(facts: list[StepFacts]) -> list[str]:
    """The names of the curated interactions the trace's facts show, in :data:`INTERACTIONS` order."""
    fired = set().union(*(f.fired for f in facts))
    return [i.name for i in INTERACTIONS if _may_meet(i, fired) and i.met(facts)]


def _may_meet(interaction: Interaction, fired: set[str]) -> bool:
    """Whether each family the interaction's predicate needs fired somewhere in the trace
    (True for a predicate that does not say: it is always asked)."""
    return all(_starts(fired, family) for family in getattr(interaction.met, "families", ()))


def trace_pairs(records: Iterable[StepRecord], budget: int | None = None) -> tuple[list[str], list[str]]:
    """``(automatic pairs, interactions met)`` of one run's spec records."""
    facts = step_facts(records, budget)
    return sorted(automatic_pairs(facts)), interactions_met(facts)


def reachable_interactions(envelope, profile: str | None = None, fixed: dict[str, Any] | None = None) -> list[str]:
    """The interactions a campaign against ``envelope`` can meet: each of its knob needs can take
    a value it meets them with (:func:`fuzz.capabilities.knob_can`)."""
    from fuzz.capabilities import knob_can

    return [i.name for i in INTERACTIONS
            if all(knob_can(envelope, knob, test, profile, fixed) for knob, test in i.needs.items())]
