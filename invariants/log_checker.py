"""The black-box log checker: every invariant a decision log alone can show.

Works on any engine's log (any language: it is JSON lines), replaying the log's
own events to rebuild who is waiting, running, swapped out and ended, then
checking each step.  With the trace (``--trace``, or the path in the log header)
it also knows arrival steps, prompt lengths, priorities, max_tokens, stop
conditions and the vocabulary, which the order, sampling, stop and liveness
checks need; without it those checks are skipped and the report says so.

Syntax (JSON, types, the schema) is :mod:`spec.io`'s job; this module checks
meaning: a log that contradicts itself or its trace is flagged, and every
violation names the record field that shows it (``Violation.field``), so a
reader knows which number to distrust.

Usage: ``batchspec check-log LOG --profile vllm-v1 [--trace TRACE]``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from spec.config import SchedulerConfig
from spec.formats import ADMIT_STOPS, DecisionLog, StepRecord, Trace, TraceRequest

#: Without a trace the vocabulary is unknown; a sampled token id at or above this bound
#: is flagged anyway.  No tokenizer in use comes near it (the largest have ~2.6e5 ids),
#: while a corrupted or uninitialized value usually lands far above it.
MAX_VOCAB_SIZE = 1 << 24

#: Record fields that name requests, and how: a list of ids, a list of [id, x] pairs,
#: or a mapping keyed by id.
ID_LISTS = ("new", "resumed", "preempted", "aborted", "swapped_out", "swapped_in")
ID_PAIRS = ("scheduled", "finished", "rejected")
ID_MAPS = ("sampled", "blocks", "cache_hits", "block_ids")
#: Fields through which a request may first appear in a log written without its trace.
INTRODUCING = ("new", "rejected", "aborted")


@dataclass(frozen=True)
class Violation:
    invariant: str
    step: int
    request: str | None
    evidence: str
    field: str | None = None  # the record field that shows the contradiction


#: Invariants this checker covers, with what they need beyond the log.
LOG_CHECKS: dict[str, str] = {
    "LOG.STEP_SEQUENCE": "log (exact gaps: trace)",
    "LOG.KNOWN_REQUEST": "log (trace ids: trace)",
    "LOG.NO_DUPLICATE": "log",
    "LOG.LEVEL_FIELDS": "memory / exact level",
    "LOG.REASONS_KNOWN": "log",
    "REQ.AFTER_ARRIVAL": "trace",
    "REQ.NEW_ONCE": "log",
    "BUDGET.TOKENS_LE_BUDGET": "log",
    "SEQ.MAX_NUM_SEQS": "log",
    "REQ.SCHEDULED_IS_RUNNING": "log",
    "REQ.ONE_TERMINAL_EVENT": "log",
    "PREEMPT.NOT_SCHEDULED": "log",
    "MEM.CONSERVATION": "memory level",
    "MEM.FREE_XOR_HELD": "exact level",
    "MEM.BLOCKS_MATCH_COMPUTED": "memory level",
    "MEM.TABLE_APPEND_ONLY": "exact level",
    "LOG.STATE_CONSISTENT": "the optional state fields",
    "REQ.IDLE_HOLDS_NOTHING": "memory level",
    "MEM.SLOTS_COVER_COMPUTED": "memory level",
    "CACHE.HITS_CONSISTENT": "memory level",
    "CACHE.HIT_NOT_WHOLE": "memory level + trace",
    "SWAP.CPU_CONSERVATION": "memory level, preemption_mode=swap",
    "ESTIMATE.RATIO_BOUNDS": "memory level, admission=estimate",
    "SAMPLE.IN_VOCAB": "log (vocab_size: trace)",
    "SAMPLE.AFTER_PREFILL": "trace",
    "STOP.CONSISTENT": "trace",
    "SAMPLE.MIN_TOKENS_MASKED": "trace",
    "REJECT.CONSISTENT": "trace",
    "REQ.COMPUTED_LE_TOKENS": "trace",
    "QUEUE.ADMISSION_ORDER": "trace",
    "PREEMPT.NO_ADMISSION_SAME_STEP": "log",
    "PREEMPT.VICTIM_RULE": "trace for priority",
    "LIVE.NO_IDLE_STALL": "trace",
    "PREEMPT.NEVER_UNDER_FULL_RESERVATION": "log, kv_reservation=full",
    "BATCH.STATIC_NO_JOIN": "log, batching=static",
    "BATCH.PREFILL_ONLY": "log, batching=prefill-first",
    "LIVE.EVERY_REQUEST_ENDS": "log (every trace request: trace)",
}

#: Statements of the checks above that only a log can show (the catalogue lists them).
LOG_STATEMENTS: dict[str, str] = {
    "LOG.STEP_SEQUENCE": (
        "Step numbers follow the driver's contract: they increase by one while any request is waiting, "
        "running or swapped out; an idle engine jumps exactly to the next arrival; no record comes after "
        "the last request ended, and no step reaches max_steps."),
    "LOG.KNOWN_REQUEST": (
        "Every request id in any field is a request of the trace (without the trace: one the log admitted, "
        "rejected or aborted first)."),
    "LOG.NO_DUPLICATE": "No request appears twice in one field of a record, nor as both new and resumed.",
    "LOG.LEVEL_FIELDS": (
        "A memory-level record carries num_free_blocks, blocks, cache_hits and num_evicted (plus "
        "num_free_cpu_blocks under swap, new_token_ratio under estimate); an exact-level one also "
        "block_ids and evicted, with the same keys as blocks, blocks[r] = len(block_ids[r]) and "
        "num_evicted = len(evicted)."),
    "LOG.REASONS_KNOWN": "Every reason names a registered rule id and, if it names a request, one of the trace.",
    "REQ.AFTER_ARRIVAL": (
        "Nothing happens to a request before its arrival step; a rejection is reported at the arrival "
        "step and a client abort at its abort_at step, for a request still live then."),
    "REQ.NEW_ONCE": "A request is 'new' only at its first admission and 'resumed' only after a preemption.",
    "MEM.BLOCKS_MATCH_COMPUTED": (
        "Under kv_reservation=step a running request holds exactly ceil(computed / block_size) blocks "
        "(under full: at least that many, and never more than its reservation)."),
    "MEM.TABLE_APPEND_ONLY": (
        "While a request runs its block table only grows, with blocks that no request running through "
        "the step held before it (its prefix hits at admission excepted; under cache_dedup=on-insert an "
        "entry may be rebound to the cached copy another request holds); such blocks are never evicted."),
    "LOG.STATE_CONSISTENT": (
        "The optional state fields agree with the decisions: computed names the running requests with "
        "the tokens their chunks add up to (and may name those waiting after a preemption, with 0, or "
        "swapped out, with their tokens); VTC counters never decrease; hit_blocks are the first blocks of "
        "the table, one per hit block; a request registers each block once per admission, only blocks "
        "full of computed tokens; ref_counts gives each block its number of running holders; "
        "cached_blocks is sorted, a block in one cache entry at most; admit_stop is one of its words, "
        "and a walk stopped by the budget ends a step whose batch holds max_num_batched_tokens tokens; "
        "waiting names each request the log leaves waiting, once."),
    "CACHE.HITS_CONSISTENT": (
        "cache_hits names exactly the requests admitted from the waiting queue in the step, each hit "
        "a whole number of blocks (0 without prefix caching); blocks are evicted only with prefix caching, "
        "at most as many as the step allocated (under cache_eviction=block-lru)."),
    "SAMPLE.IN_VOCAB": "A sampled token id is inside the vocabulary (the trace's vocab_size).",
    "STOP.CONSISTENT": (
        "A request finishes exactly when the token it sampled meets a stop condition (EOS unless "
        "ignore_eos, a stop token, max_model_len, max_tokens, in that order), with that reason; only a "
        "request that sampled in the step finishes."),
    "REJECT.CONSISTENT": (
        "A request is rejected exactly when the profile's REJECT rules refuse it, with their reason."),
}


@dataclass
class _Req:
    """What the checker knows about one request, rebuilt from the log."""

    request_id: str
    source: TraceRequest | None
    admitted_seq: int = -1  # order of admission into running (for the FCFS victim)
    computed: int = 0
    outputs: int = 0
    state: str = "waiting"  # waiting | running | swapped | ended
    preempted: bool = False  # preempted since its last admission (so it may be resumed)
    hit_unknown: bool = False  # admitted with an unlogged prefix hit: ``computed`` is a lower bound
    hit_blocks: int = 0  # blocks it took from the prefix cache at admission (the only ones it may share)
    registered: set = field(default_factory=set)  # block ordinals it registered in the cache since admission
    placeholders: int = 0  # async scheduling: tokens in flight, inside ``computed`` (ASYNC.PLACEHOLDER)
    preemptions: int = 0  # async scheduling: a token scheduled before a later preemption is stale
    abort_pending: bool = False  # aborted while running, freed after its next sample (ABORT.AFTER_NEXT_SAMPLE)
    peak: int = 0  # speculative decoding: the most tokens computed since admission (rolled-back drafts keep their slots)
    registrable: int | None = None  # speculative decoding: tokens known when it last allocated (SPEC.CACHE_VERIFIED)
    cached_upto: int | None = None  # cache_register=prefill-and-finish: tokens its last prefill cached
    cut_pending: int | None = None  # cache_register=prefill-and-finish: a cut prefill's tokens, cached next step


@dataclass
class LogReport:
    violations: list[Violation] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    steps: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def record_ids(rec: StepRecord, name: str) -> list[str]:
    """The request ids a record's field names (in order, repeats kept)."""
    value = getattr(rec, name)
    if not value:
        return []
    if name in ID_PAIRS:
        return [pair[0] for pair in value]
    return list(value)


class LogChecker:
    """Replays a log's events and checks every step (one instance per log)."""

    def __init__(self, config: SchedulerConfig, trace: Trace | None, level: str):
        self.cfg = config
        self.trace = trace
        self.level = level
        self.reqs: dict[str, _Req] = {}
        self.arrival: dict[str, int] = {}
        self.sources: dict[str, TraceRequest] = {}
        self.report = LogReport()
        self._admissions = 0
        self._ended: set[str] = set()
        self._prev_step: int | None = None
        self._tables: dict[str, list[int]] = {}  # block_ids at the end of the previous record
        self._held: dict[str, int] = {}  # blocks at the end of the previous record
        self._freed_aborts: list[str] = []  # freed after their sample in this step (ABORT.AFTER_NEXT_SAMPLE)
        self._cut: set[str] = set()  # scheduled in the last step without sampling: a cut prefill
        self._ratio = config.new_token_ratio_init  # new_token_ratio at the end of the previous record
        self._vtc: dict[str, float] = {}  # vtc_counters at the end of the previous record that logged them
        self._ordinals_registered: set[int] = set()  # every block ordinal any request registered (cache_dedup)
        self._rules = _rule_ids()
        #: async scheduling: step -> {request: (its preemption count, drafts scheduled)} of the tokens
        #: that step samples, in flight until a record whose ``outputs_step`` names the step
        #: (ASYNC.OUTPUTS_NEXT_STEP)
        self._in_flight: dict[int, dict[str, tuple[int, int]]] = {}
        #: speculative decoding: request -> the stop rules' verdict after this step's verified tokens
        self._verdicts: dict[str, str | None] = {}
        self.vocab = trace.vocab_size if trace is not None else MAX_VOCAB_SIZE
        if trace is not None:
            self.sources = {r.id: r for r in trace.requests}
            order = sorted(range(len(trace.requests)), key=lambda i: trace.requests[i].arrival_step or 0)
            self.arrival = {trace.requests[i].id: pos for pos, i in enumerate(order)}
            self._arrival_steps = sorted({r.arrival_step or 0 for r in trace.requests})
        else:
            self.report.skipped.append("no trace: arrival steps, prompt lengths, stop conditions and liveness "
                                       f"are not checked; token ids are checked against {MAX_VOCAB_SIZE}")
        if level == "decisions":
            self.report.skipped.append("decisions-level log: block accounting is not checked")

    def flag(self, invariant: str, step: int, request: str | None, evidence: str, where: str | None = None) -> None:
        self.report.violations.append(Violation(invariant, step, request, evidence, where))

    def req(self, rid: str) -> _Req:
        if rid not in self.reqs:
            self.reqs[rid] = _Req(rid, self.sources.get(rid))
        return self.reqs[rid]

    def running(self) -> list[_Req]:
        return sorted((r for r in self.reqs.values() if r.state == "running"), key=lambda r: r.admitted_seq)

    def _busy(self) -> bool:
        """Whether any request the checker knows of is waiting, running or swapped out."""
        return any(r.state != "ended" for r in self.reqs.values())

    # -- per step -----------------------------------------------------------

    def check(self, records: list[StepRecord]) -> LogReport:
        for rec in records:
            self.step(rec)
        self.finish(records[-1].step if records else 0)
        self.report.steps = len(records)
        return self.report

    def _arrived_by(self, step: int) -> list[str]:
        if self.trace is None:
            return []
        return [r.id for r in self.trace.requests if (r.arrival_step or 0) <= step]

    def step(self, rec: StepRecord) -> None:
        s = rec.step
        self._check_step_number(rec)
        self._check_ids(rec)
        for rid in self._arrived_by(s):
            self.req(rid)
        self._check_rejections(rec)
        self._check_aborts(rec)
        if not self._busy():
            self._ratio = self.cfg.new_token_ratio_init  # an empty engine resets it (ESTIMATE.RATIO)
        waiting_at_start = [r for r in self.reqs.values() if r.state == "waiting"]
        running_at_start = self.running()
        self._check_preemptions(rec, running_at_start)
        self._check_batching(rec, running_at_start)
        self._check_admissions(rec, waiting_at_start, running_at_start)
        self._check_scheduled(rec)
        if self.cfg.async_scheduling:
            self._apply_async_outputs(rec)
        self._check_finishes(rec)
        for rid, why in rec.finished:
            self._end(rid, s, why, "finished")
        # ABORT.AFTER_NEXT_SAMPLE: freed with this step's result, like a finished request
        self._freed_aborts = [rid for rid in rec.sampled if self.reqs.get(rid) is not None
                              and self.reqs[rid].abort_pending and self.reqs[rid].state == "running"]
        for rid in self._freed_aborts:
            self._end(rid, s, "aborted", "aborted")
        self._cut = {rid for rid, _ in rec.scheduled if rid not in rec.sampled}
        self._check_level_fields(rec)
        self._check_memory(rec)
        throughout = [r.request_id for r in running_at_start if r.request_id not in rec.preempted]
        self._check_tables(rec, throughout)
        self._check_evictions(rec, set(throughout))
        self._check_cache(rec)
        self._check_swap_and_ratio(rec)
        self._check_reasons(rec)
        self._check_state(rec, throughout)
        self._prev_step = s if self._prev_step is None else max(s, self._prev_step)

    # -- the record as a whole ------------------------------------------------

    def _check_step_number(self, rec: StepRecord) -> None:
        """LOG.STEP_SEQUENCE: the driver's step numbering (spec.protocol.drive)."""
        s, prev = rec.step, self._prev_step
        if not isinstance(s, int) or s < 0 or s >= self.cfg.max_steps:
            self.flag("LOG.STEP_SEQUENCE", s, None, f"step {s} outside [0, max_steps={self.cfg.max_steps})", "step")
            return
        if prev is not None and s <= prev:
            self.flag("LOG.STEP_SEQUENCE", s, None, f"step {s} does not increase (previous {prev})", "step")
            return
        busy = self._busy()
        if prev is not None and busy and s != prev + 1:
            self.flag("LOG.STEP_SEQUENCE", s, None, f"step {s} follows {prev} while requests are unfinished", "step")
        elif self.trace is not None and not busy:
            later = [a for a in self._arrival_steps if prev is None or a > prev]
            if not later:
                self.flag("LOG.STEP_SEQUENCE", s, None, "a record after every request ended and none arrives", "step")
            elif s != later[0]:
                self.flag("LOG.STEP_SEQUENCE", s, None, f"idle engine: the next step is the next arrival, {later[0]}", "step")

    def _check_ids(self, rec: StepRecord) -> None:
        """LOG.KNOWN_REQUEST, REQ.AFTER_ARRIVAL and LOG.NO_DUPLICATE over every field that names requests."""
        s = rec.step
        introduced = set(self.reqs) | {rid for name in INTRODUCING for rid in record_ids(rec, name)}
        for name in ID_PAIRS + ID_LISTS + ID_MAPS:
            ids = record_ids(rec, name)
            for rid in ids:
                self._check_known(rid, s, name, introduced)
            if name not in ID_MAPS:
                dup = sorted({rid for rid in ids if ids.count(rid) > 1})
                if dup:
                    self.flag("LOG.NO_DUPLICATE", s, dup[0], f"listed {ids.count(dup[0])} times", name)
        both = set(rec.new) & set(rec.resumed)
        if both:
            self.flag("LOG.NO_DUPLICATE", s, sorted(both)[0], "both new and resumed", "new, resumed")

    def _check_known(self, rid: str, step: int, name: str, introduced: set[str]) -> None:
        if self.trace is None:
            if rid not in introduced:
                self.flag("LOG.KNOWN_REQUEST", step, rid, "never admitted, rejected or aborted before", name)
            return
        src = self.sources.get(rid)
        if src is None:
            self.flag("LOG.KNOWN_REQUEST", step, rid, "not a request of the trace", name)
        elif (src.arrival_step or 0) > step:
            self.flag("REQ.AFTER_ARRIVAL", step, rid, f"before its arrival at step {src.arrival_step}", name)

    def _check_rejections(self, rec: StepRecord) -> None:
        """REJECT.CONSISTENT and REQ.AFTER_ARRIVAL for rejections (reported at the arrival step)."""
        s = rec.step
        for rid, why in rec.rejected:
            r = self.req(rid)
            if why == "slo_infeasible":  # SLO.REFUSE: a waiting request, refused at any step (issue 19)
                if r.state != "waiting" or self.cfg.slo_admission != "refuse":
                    self.flag("REJECT.CONSISTENT", s, rid, f"refused as slo_infeasible while {r.state}", "rejected")
                self._end(rid, s, "rejected", "rejected")
                continue
            if r.state != "waiting" or r.admitted_seq >= 0:
                self.flag("REJECT.CONSISTENT", s, rid, f"rejected while {r.state}, after it was seen", "rejected")
            if r.source is not None:
                if r.source.arrival_step is not None and r.source.arrival_step != s:
                    self.flag("REQ.AFTER_ARRIVAL", s, rid, f"rejected at step {s}, arrived at {r.source.arrival_step}", "rejected")
                want = self._rejection(r.source)
                if want != why:
                    self.flag("REJECT.CONSISTENT", s, rid, f"rejected as {why}; the profile says {want or 'admissible'}", "rejected")
            self._end(rid, s, "rejected", "rejected")
        if self.trace is None:
            return
        rejected = {rid for rid, _ in rec.rejected}
        for src in self.trace.requests:
            if src.arrival_step == s and src.id not in rejected and self._rejection(src):
                self.flag("REJECT.CONSISTENT", s, src.id, f"not rejected ({self._rejection(src)})", "rejected")

    def _rejection(self, src: TraceRequest) -> str | None:
        """The reason the profile's REJECT rules give for ``src`` (None: admissible)."""
        from spec.scheduler import input_limit, never_fits, prompt_too_long  # the rules themselves, not a copy

        if not self.cfg.reject_unservable:
            return None
        if self.cfg.length_limits == "clip":  # REJECT.INPUT_LIMIT replaces the two rules below
            return input_limit(src.prompt_len, self.cfg)
        if prompt_too_long(src.prompt_len, self.cfg):
            return "prompt_too_long"
        if never_fits(src.prompt_len, src.max_tokens, self.cfg):
            return "never_fits"
        return None

    def _check_aborts(self, rec: StepRecord) -> None:
        """REQ.AFTER_ARRIVAL for client aborts: at abort_at, for every request still live then."""
        s = rec.step
        for rid in rec.aborted:
            r = self.req(rid)
            if r.source is not None and r.source.abort_at != s:
                self.flag("REQ.AFTER_ARRIVAL", s, rid, f"aborted at step {s}; the trace aborts it at {r.source.abort_at}", "aborted")
            if r.state == "running" and self.cfg.abort_running == "after-next-sample" and rid not in self._cut:
                r.abort_pending = True  # ABORT.AFTER_NEXT_SAMPLE: it ends after its next sample
                continue  # (a prefill the last step cut is freed at once: ABORT.CUT_PREFILL_AT_ONCE)
            if r.state in ("running", "swapped"):
                r.computed = 0
            self._end(rid, s, "aborted", "aborted")
        if self.trace is None:
            return
        for src in self.trace.requests:
            if src.abort_at == s and src.id not in rec.aborted and self.req(src.id).state != "ended":
                self.flag("REQ.AFTER_ARRIVAL", s, src.id, f"still live at its abort_at step {s} but not aborted", "aborted")

    def _end(self, rid: str, step: int, how: str, where: str) -> None:
        r = self.req(rid)
        if rid in self._ended:
            self.flag("REQ.ONE_TERMINAL_EVENT", step, rid, f"{how} after it had already ended", where)
        self._ended.add(rid)
        r.state = "ended"

    # -- decisions ---------------------------------------------------------------

    def _check_preemptions(self, rec: StepRecord, running: list[_Req]) -> None:
        live = list(running)
        scheduled = {rid for rid, _ in rec.scheduled}
        for rid in rec.swapped_out:
            if rid not in rec.preempted:
                self.flag("REQ.SCHEDULED_IS_RUNNING", rec.step, rid, "swapped out but not preempted", "swapped_out")
        if rec.swapped_out and self.cfg.preemption_mode != "swap":
            self.flag("REQ.SCHEDULED_IS_RUNNING", rec.step, rec.swapped_out[0], "swapped out under recompute", "swapped_out")
        for rid in rec.preempted:
            r = self.req(rid)
            if r not in live:
                self.flag("PREEMPT.VICTIM_RULE", rec.step, rid, f"preempted while {r.state}", "preempted")
                continue
            want = self._victim(live)
            if want is not None and want is not r:
                self.flag("PREEMPT.VICTIM_RULE", rec.step, rid, f"victim should be {want.request_id} ({self.cfg.policy})", "preempted")
            live.remove(r)
            r.preempted = True
            r.placeholders, r.preemptions = 0, r.preemptions + 1  # ASYNC.PREEMPT_ZEROES_PLACEHOLDERS
            if rid in rec.swapped_out:
                r.state = "swapped"  # keeps its computed tokens (in the CPU pool)
            else:
                r.state, r.computed = "waiting", 0
            # under admit_after_preempt the waiting phase may resume a victim of the same step
            if rid in scheduled and not (self.cfg.admit_after_preempt and rid in rec.resumed):
                self.flag("PREEMPT.NOT_SCHEDULED", rec.step, rid, "preempted and scheduled in the same step", "scheduled")

    def _check_batching(self, rec: StepRecord, running: list[_Req]) -> None:
        """The profile's batching and reservation styles, as the log shows them."""
        admitted = rec.new + [rid for rid in rec.resumed if rid not in rec.swapped_in]  # swap-ins are returns
        if self.cfg.kv_reservation == "full" and rec.preempted:
            self.flag("PREEMPT.NEVER_UNDER_FULL_RESERVATION", rec.step, rec.preempted[0], "preempted under full reservation", "preempted")
        if self.cfg.batching == "static" and admitted and running:
            where = "new" if rec.new else "resumed"
            self.flag("BATCH.STATIC_NO_JOIN", rec.step, admitted[0], f"joined while {running[0].request_id} runs", where)
        if self.cfg.batching == "prefill-first" and admitted:
            # Under prefill_chunking=first-continues a prefill cut by the budget continues first in
            # the next prefill batch (RUN.CONTINUE_PREFILL_FIRST), before any admission.
            # (last-continues, SGLang's chunked_req, the same)
            continued = {rid for rid, _ in rec.scheduled[:1]} if self.cfg.prefill_chunking != "any" else set()
            others = [rid for rid, _ in rec.scheduled if rid not in admitted and rid not in continued]
            if others:
                self.flag("BATCH.PREFILL_ONLY", rec.step, others[0], "ran in a step that admitted", "scheduled")

    def _victim(self, live: list[_Req]) -> _Req | None:
        if self.cfg.preemption_victim != "policy":  # slo-slack: token timing the log does not carry
            return None
        if self.cfg.admission == "estimate":  # fewest outputs, then longest prompt, then the latest
            if self.trace is None:
                return None
            return min(reversed(live), key=lambda r: (r.outputs, -(r.source.prompt_len if r.source else 0)))
        if self.cfg.policy != "priority":
            return live[-1]
        if self.trace is None:
            return None
        return max(live, key=lambda r: (r.source.priority if r.source else 0, self._tie_time(r)))

    def _check_admissions(self, rec: StepRecord, waiting: list[_Req], running: list[_Req]) -> None:
        s = rec.step
        joined = set(rec.new) | set(rec.resumed)
        admitted = [rid for rid, _ in rec.scheduled if rid in joined]  # batch order is admission order
        for name in ("new", "resumed"):
            for rid in getattr(rec, name):
                if rid not in admitted:
                    self.flag("REQ.SCHEDULED_IS_RUNNING", s, rid, "admitted but not in the batch", name)
        for rid in rec.swapped_in:
            if rid not in rec.resumed:
                self.flag("REQ.SCHEDULED_IS_RUNNING", s, rid, "swapped in but not resumed", "swapped_in")
        if rec.preempted and admitted and not self.cfg.admit_after_preempt:
            where = "new" if admitted[0] in rec.new else "resumed"
            self.flag("PREEMPT.NO_ADMISSION_SAME_STEP", s, admitted[0], "admitted in a step that preempted", where)
        for rid in admitted:
            self._admit(rec, rid, waiting)
        if self.trace is not None and not running and not admitted:
            if any(w.state == "waiting" for w in waiting):
                self.flag("LIVE.NO_IDLE_STALL", s, waiting[0].request_id, "nothing running, requests waiting, none admitted", "new")
        if self.cfg.max_num_seqs_scope == "step":  # nano-vllm: a cap on one step's batch, not on running requests
            if len(rec.scheduled) > self.cfg.max_num_seqs:
                self.flag("SEQ.MAX_NUM_SEQS", s, None, f"{len(rec.scheduled)} scheduled > {self.cfg.max_num_seqs}", "scheduled")
        elif len(self.running()) > self.cfg.max_num_seqs:
            where = "new" if rec.new else "resumed" if rec.resumed else "scheduled"
            self.flag("SEQ.MAX_NUM_SEQS", s, None, f"{len(self.running())} running > {self.cfg.max_num_seqs}", where)

    def _admit(self, rec: StepRecord, rid: str, waiting: list[_Req]) -> None:
        s, r = rec.step, self.req(rid)
        name = "resumed" if rid in rec.resumed else "new"
        if rid in rec.swapped_in:
            if r.state != "swapped":
                self.flag("REQ.SCHEDULED_IS_RUNNING", s, rid, f"swapped in while {r.state}", "swapped_in")
            self._join(r)
            return
        if r.state != "waiting":
            self.flag("REQ.SCHEDULED_IS_RUNNING", s, rid, f"admitted while {r.state}", name)
        elif name == "new" and (r.admitted_seq >= 0 or r.preempted):
            self.flag("REQ.NEW_ONCE", s, rid, "new, but it was admitted before", "new")
        elif name == "resumed" and not r.preempted:
            self.flag("REQ.NEW_ONCE", s, rid, "resumed, but it was never preempted", "resumed")
        if self.trace is not None and self._ordered():
            ahead = [w.request_id for w in waiting if w.state == "waiting" and self._queue_key(w) < self._queue_key(r)]
            if ahead:
                self.flag("QUEUE.ADMISSION_ORDER", s, rid, f"admitted ahead of {ahead[0]} ({self.cfg.policy})", name)
        self._join(r)
        hit = (rec.cache_hits or {}).get(rid, 0)
        r.computed, r.hit_blocks, r.peak = hit, hit // self.cfg.block_size, hit
        r.hit_unknown = rec.cache_hits is None and self.cfg.enable_prefix_caching  # a decisions-level log
        if r.source is not None and rec.cache_hits is not None and hit >= r.source.prompt_len + r.outputs:
            self.flag("CACHE.HIT_NOT_WHOLE", s, rid, f"hit {hit} of {r.source.prompt_len + r.outputs} tokens", "cache_hits")

    def _join(self, r: _Req) -> None:
        r.state, r.admitted_seq, r.preempted, r.hit_blocks = "running", self._admissions, False, 0
        r.registered = set()
        self._admissions += 1

    def _ordered(self) -> bool:
        """Whether the admission order is a fixed key this checker knows: FCFS or priority without
        aging, recompute preemption to the queue front (not swap, not SGLang's retraction to the tail)."""
        cfg = self.cfg
        return (cfg.policy in ("fcfs", "priority") and not cfg.aging_steps and cfg.admission == "budget"
                and cfg.preemption_mode == "recompute" and cfg.preemption_victim == "policy")  # slo-slack: any victim

    def _queue_key(self, r: _Req) -> tuple:
        """The waiting-queue order: arrival (FCFS; victims return to the front, which under
        FCFS is still arrival order), or (priority, arrival, id as a string)."""
        arrival = self.arrival.get(r.request_id, 0)
        if self.cfg.policy == "priority":
            return (r.source.priority if r.source else 0, self._tie_time(r), r.request_id)
        return (arrival,)

    def _tie_time(self, r: _Req) -> float:
        """Priority ties: the trace's client_arrival_time, else the order of arrival (#15)."""
        arrival = self.arrival.get(r.request_id, 0)
        return r.source.tie_time(arrival) if r.source else float(arrival)

    def _check_scheduled(self, rec: StepRecord) -> None:
        s = rec.step
        total = sum(n for _, n in rec.scheduled)
        if total > self.cfg.max_num_batched_tokens:
            self.flag("BUDGET.TOKENS_LE_BUDGET", s, None, f"{total} tokens > budget {self.cfg.max_num_batched_tokens}", "scheduled")
        batch = dict(rec.scheduled)
        for rid, n in rec.scheduled:
            r = self.req(rid)
            if r.state != "running":
                self.flag("REQ.SCHEDULED_IS_RUNNING", s, rid, f"scheduled while {r.state}", "scheduled")
                continue
            known = r.source.prompt_len + r.outputs if r.source is not None else None
            prefill = rid in rec.new or rid in rec.resumed or (n > 1 if known is None else r.computed < known - 1)
            r.computed += n
            r.peak = max(r.peak, r.computed)
            if self.cfg.cache_register == "prefill-and-finish":
                self._prefill_registration(r, prefill, rid in rec.sampled)
            if n < 1 or r.computed > self.cfg.max_model_len:
                self.flag("REQ.COMPUTED_LE_TOKENS", s, rid, f"computed {r.computed} of max_model_len {self.cfg.max_model_len}", "scheduled")
            drafts = (rec.drafts or {}).get(rid, 0)  # SPEC.DRAFT_SCHEDULE: scheduled past the known tokens
            if self.cfg.async_scheduling:
                self._schedule_async(s, r, drafts)
                continue
            if r.source is None:
                r.outputs += rid in rec.sampled
                continue
            tokens = r.source.prompt_len + r.outputs
            if n < 1 or r.computed - drafts > tokens:
                self.flag("REQ.COMPUTED_LE_TOKENS", s, rid, f"computed {r.computed} > {tokens} tokens"
                          + (f" + {drafts} drafts" if drafts else ""), "scheduled")
            if r.hit_unknown and rid in rec.sampled and r.computed - drafts < tokens:
                r.computed, r.hit_unknown = tokens + drafts, False  # the hit covered the rest: sampling shows it
            if (rid in rec.sampled) != (r.computed - drafts == tokens):
                self.flag("SAMPLE.AFTER_PREFILL", s, rid, f"sampled={rid in rec.sampled} with {r.computed} of {tokens} computed"
                          + (f" + {drafts} drafts" if drafts else ""), "sampled")
            # SPEC.CACHE_VERIFIED: the allocation cached only known tokens; accepted drafts wait for the next one
            r.registrable = tokens if drafts else None
            if drafts and rid in rec.sampled:
                self._verify(r, rec.sampled[rid], drafts, (rec.accepted or {}).get(rid, 0), stale=False)
                continue
            r.outputs += rid in rec.sampled
            if r.outputs > r.source.max_tokens:
                self.flag("REQ.COMPUTED_LE_TOKENS", s, rid, f"{r.outputs} outputs > max_tokens {r.source.max_tokens}", "sampled")
        for rid, token in rec.sampled.items():
            if rid not in batch and not self.cfg.async_scheduling:  # async: checked against the batch in flight
                self.flag("SAMPLE.AFTER_PREFILL", s, rid, "sampled without being scheduled", "sampled")
            if not isinstance(token, int) or not 0 <= token < self.vocab:
                self.flag("SAMPLE.IN_VOCAB", s, rid, f"token {token} outside the vocabulary [0, {self.vocab})", "sampled")

    @staticmethod
    def _prefill_registration(r: _Req, prefill: bool, sampled: bool) -> None:
        """CACHE.REGISTER_PREFILL_AND_FINISH: the blocks a prefill step computed are cached after its
        output (a cut prefill's when the next step begins); a decode step caches nothing until the
        request finishes, so only the tokens of its last prefill must be registered meanwhile."""
        if r.cut_pending is not None:
            r.cached_upto, r.cut_pending = r.cut_pending, None
        elif r.cached_upto is None:
            r.cached_upto = 0
        if prefill and sampled:
            r.cached_upto = r.computed
        elif prefill:
            r.cut_pending = r.computed

    def _schedule_async(self, s: int, r: _Req, drafts: int = 0) -> None:
        """Async scheduling: ``computed`` counts the placeholders (ASYNC.PLACEHOLDERS_COUNT), so a
        request may be computed up to its known tokens plus its placeholders (plus the drafts
        scheduled now); the step samples a token (a new placeholder, in flight until its outputs
        are applied) when it reaches them (ASYNC.PLACEHOLDER), its drafts placeholders too."""
        if r.source is None:
            return
        tokens = r.source.prompt_len + r.outputs + r.placeholders
        if r.computed - drafts > tokens:
            self.flag("REQ.COMPUTED_LE_TOKENS", s, r.request_id, f"computed {r.computed} > {tokens} tokens "
                      f"({r.placeholders} in flight" + (f", {drafts} drafts)" if drafts else ")"), "scheduled")
        if r.computed - drafts >= tokens:
            r.placeholders += 1 + drafts
            self._in_flight.setdefault(s, {})[r.request_id] = (r.preemptions, drafts)

    def _verify(self, r: _Req, first: int, drafts: int, accepted: int, stale: bool) -> int:
        """Speculative decoding: the outputs of a step that verified ``drafts`` drafts.  The rejected
        ones leave ``computed`` (SPEC.ROLLBACK; not for a stale output); then ``1 + accepted`` tokens
        — ``first``, then the trace's next ones — are appended under the stop rules, which may
        stop the request among them (SPEC.STOP_IN_DRAFTS).  Records the stop verdict for
        STOP.CONSISTENT; returns the tokens appended."""
        if not stale and r.computed > 0:
            r.computed -= drafts - accepted
        src, verdict, appended = r.source, None, 0
        for i in range(1 + min(accepted, drafts)):
            token = first if i == 0 else src.output_token(r.outputs, self.vocab, self.trace.eos_token_id)
            r.outputs += 1
            appended += 1
            verdict = self._stop_reason(r, token)
            if verdict is not None:
                break
        self._verdicts[r.request_id] = verdict
        return appended

    def _apply_async_outputs(self, rec: StepRecord) -> None:
        """Async scheduling: a record's ``sampled`` are the tokens of step ``outputs_step`` (the batch
        in flight), applied after this record's batch was scheduled (ASYNC.OUTPUTS_NEXT_STEP).  Exactly
        the requests that step sampled get a token, except those that ended since it was scheduled
        (ASYNC.ABORT_DROPS_OUTPUT); a request preempted since gets its token all the same, stale: it
        changes no placeholder (ASYNC.STALE_OUTPUT)."""
        s, src_step = rec.step, rec.outputs_step
        expected: dict[str, int] = {}
        for step in sorted(k for k in self._in_flight if src_step is not None and k <= src_step):
            batch = self._in_flight.pop(step)
            if step == src_step:
                expected = batch
                continue
            lost = [rid for rid in batch if self.req(rid).state != "ended"]
            if lost:
                self.flag("SAMPLE.AFTER_PREFILL", s, lost[0], f"the token of step {step} was never applied", "outputs_step")
        for rid in expected:
            r = self.req(rid)
            if rid not in rec.sampled and r.state != "ended" and rid not in rec.aborted:
                self.flag("SAMPLE.AFTER_PREFILL", s, rid, f"no token from step {src_step}, whose batch sampled it", "sampled")
        for rid in rec.sampled:
            r = self.req(rid)
            if rid not in expected:
                self.flag("SAMPLE.AFTER_PREFILL", s, rid, f"sampled, but step {src_step} did not sample it", "sampled")
                continue
            if r.state == "ended":
                self.flag("SAMPLE.AFTER_PREFILL", s, rid, "a token applied after the request ended", "sampled")
                continue
            preemptions, drafts = expected[rid]
            fresh = preemptions == r.preemptions
            if drafts and r.source is not None and self.trace is not None:
                accepted = (rec.accepted or {}).get(rid, 0)
                if fresh:
                    r.placeholders -= drafts - accepted
                appended = self._verify(r, rec.sampled[rid], drafts, accepted, stale=not fresh)
                if fresh:
                    r.placeholders -= appended
                continue
            r.outputs += 1
            if fresh:
                r.placeholders -= 1
            if r.source is not None and r.outputs > r.source.max_tokens:
                self.flag("REQ.COMPUTED_LE_TOKENS", s, rid, f"{r.outputs} outputs > max_tokens {r.source.max_tokens}", "sampled")

    def _check_finishes(self, rec: StepRecord) -> None:
        """STOP.CONSISTENT: finishing follows sampling, with the stop rule's reason."""
        s = rec.step
        finished = dict(rec.finished)
        for rid in finished:
            if rid not in rec.sampled:
                self.flag("STOP.CONSISTENT", s, rid, f"finished ({finished[rid]}) in a step it did not sample", "finished")
        for rid, token in rec.sampled.items():
            r = self.reqs.get(rid)
            # async: a stale token may finish a request from the waiting queue (ASYNC.STALE_OUTPUT)
            live = ("running", "waiting") if self.cfg.async_scheduling else ("running",)
            if r is None or r.source is None or r.state not in live:
                continue
            self._check_min_tokens(s, r, token)
            want = self._verdicts.pop(rid) if rid in self._verdicts else self._stop_reason(r, token)
            if want != finished.get(rid):
                got = finished.get(rid, "not finished")
                self.flag("STOP.CONSISTENT", s, rid, f"{got} after sampling {token} (output {r.outputs}); the stop rules say {want or 'go on'}", "finished")

    def _check_min_tokens(self, s: int, r: _Req, token: int) -> None:
        """SAMPLE.MIN_TOKENS_MASKED: the sampler masks EOS (unless ignore_eos) and the stop token
        ids until a request has ``min_tokens`` outputs, so none of them is among its first ones."""
        src = r.source
        if r.outputs > src.min_tokens:  # (``outputs`` counts this token: index outputs - 1)
            return
        if token in src.stop_token_ids or (token == self.trace.eos_token_id and not src.ignore_eos):
            self.flag("SAMPLE.MIN_TOKENS_MASKED", s, r.request_id,
                      f"output {r.outputs - 1} is stop token {token}, inside min_tokens={src.min_tokens}", "sampled")

    def _stop_reason(self, r: _Req, token: int) -> str | None:
        """The stop rules' verdict after ``r`` sampled ``token`` (vLLM's check_stop order)."""
        from spec.scheduler import clipped_max_tokens  # ARRIVE.CLIP_MAX_TOKENS, the rule itself

        src = r.source
        if r.abort_pending:  # ABORT.AFTER_NEXT_SAMPLE: freed as aborted, no stop rule
            return None
        if not src.ignore_eos and token == self.trace.eos_token_id:
            return "eos"
        stops_ignored = src.ignore_eos and self.cfg.ignore_eos_scope == "eos-and-stop-tokens"  # STOP.IGNORE_EOS_SCOPE
        if token in src.stop_token_ids and not stops_ignored:
            return "stop_token"
        if src.prompt_len + r.outputs >= self.cfg.max_model_len:
            return "max_model_len"
        if self.cfg.length_limits == "clip" and r.outputs >= clipped_max_tokens(src.prompt_len, src.max_tokens, self.cfg)[0]:
            return "max_tokens" if r.outputs >= src.max_tokens else "max_model_len"
        if r.outputs >= src.max_tokens:
            return "max_tokens"
        return None

    # -- memory --------------------------------------------------------------

    def _check_level_fields(self, rec: StepRecord) -> None:
        """LOG.LEVEL_FIELDS: the header's level promises fields, and they agree with each other."""
        s = rec.step
        need = []
        if self.level in ("memory", "exact"):
            need += ["num_free_blocks", "blocks", "cache_hits", "num_evicted"]
            if self.cfg.preemption_mode == "swap":
                need.append("num_free_cpu_blocks")
            if self.cfg.admission == "estimate":
                need.append("new_token_ratio")
        if self.level == "exact":
            need += ["block_ids", "evicted"]
        for name in need:
            if getattr(rec, name) is None:
                self.flag("LOG.LEVEL_FIELDS", s, None, f"missing from a {self.level}-level record", name)
        if rec.block_ids is not None and rec.blocks is not None:
            for rid in sorted(set(rec.blocks) | set(rec.block_ids)):
                count, ids = rec.blocks.get(rid), rec.block_ids.get(rid)
                if count is None or ids is None:
                    self.flag("LOG.LEVEL_FIELDS", s, rid, "a key of blocks or block_ids only, not both", "blocks, block_ids")
                elif count != len(ids):  # which of the two is wrong, the other checks tell
                    self.flag("LOG.LEVEL_FIELDS", s, rid, f"blocks says {count}, block_ids lists {len(ids)}", "blocks, block_ids")
        if rec.evicted is not None and rec.num_evicted is not None and rec.num_evicted != len(rec.evicted):
            self.flag("LOG.LEVEL_FIELDS", s, None, f"num_evicted {rec.num_evicted} != len(evicted) {len(rec.evicted)}",
                      "num_evicted, evicted")

    def _check_memory(self, rec: StepRecord) -> None:
        if rec.num_free_blocks is None:
            return
        s, usable = rec.step, self.cfg.usable_blocks
        blocks = rec.blocks or {}
        if not 0 <= rec.num_free_blocks <= usable:
            self.flag("MEM.CONSERVATION", s, None, f"{rec.num_free_blocks} free blocks outside [0, {usable}]", "num_free_blocks")
        for rid in blocks:
            if self.req(rid).state != "running":
                self.flag("REQ.IDLE_HOLDS_NOTHING", s, rid, f"holds {blocks[rid]} blocks while {self.req(rid).state}", "blocks")
        for r in self.running():
            self._check_held(rec, r, blocks.get(r.request_id, 0))
        if rec.block_ids is not None:
            self._check_block_ids(rec)
        elif not self.cfg.enable_prefix_caching and rec.num_free_blocks + sum(blocks.values()) != usable:
            self.flag("MEM.CONSERVATION", s, None, f"{rec.num_free_blocks} free + {sum(blocks.values())} held != {usable}", "num_free_blocks")
        elif rec.num_free_blocks + sum(blocks.values()) < usable or rec.num_free_blocks + self._unshared(blocks) > usable:
            self.flag("MEM.CONSERVATION", s, None, f"{rec.num_free_blocks} free, {sum(blocks.values())} held "
                      f"({self._unshared(blocks)} not from the cache), {usable} usable", "num_free_blocks")

    def _unshared(self, blocks: dict[str, int]) -> int:
        """A lower bound on the distinct blocks held: a block two requests share is a prefix-cache
        hit for all its holders but at most one, so each request's other blocks are its own."""
        if self.cfg.cache_dedup != "on-insert":
            return sum(max(n - self.req(rid).hit_blocks, 0) for rid, n in blocks.items())
        # CACHE.DEDUP_ON_INSERT rebinds a duplicate block to the tree's copy: a block at an ordinal
        # some request registered may be shared as well
        seen = self._ordinals_registered
        return sum(max(n - max(self.req(rid).hit_blocks, sum(1 for o in range(n) if o in seen)), 0)
                   for rid, n in blocks.items())

    def _check_held(self, rec: StepRecord, r: _Req, held: int) -> None:
        """MEM.SLOTS_COVER_COMPUTED and MEM.BLOCKS_MATCH_COMPUTED for one running request."""
        bs, s = self.cfg.block_size, rec.step
        need = _cdiv(r.computed, bs)
        if held < need:
            self.flag("MEM.SLOTS_COVER_COMPUTED", s, r.request_id, f"{r.computed} computed, {held * bs} slots", "blocks")
        elif self.cfg.kv_reservation == "step" and held > _cdiv(max(r.computed, r.peak), bs):  # drafts rolled back keep slots
            self.flag("MEM.BLOCKS_MATCH_COMPUTED", s, r.request_id, f"{held} blocks for {r.computed} computed tokens", "blocks")
        elif self.cfg.kv_reservation == "full" and r.source is not None:
            slots = max(min(r.source.prompt_len + r.source.max_tokens - 1, self.cfg.max_model_len - 1), r.computed)
            if held > _cdiv(slots, bs):
                self.flag("MEM.BLOCKS_MATCH_COMPUTED", s, r.request_id, f"{held} blocks, reservation {slots} slots", "blocks")

    def _check_block_ids(self, rec: StepRecord) -> None:
        s, usable = rec.step, self.cfg.usable_blocks
        first = 1 if self.cfg.null_block else 0
        held = [b for ids in rec.block_ids.values() for b in ids]
        bad = [b for b in held if not first <= b < self.cfg.num_blocks]
        if bad:
            self.flag("MEM.FREE_XOR_HELD", s, None, f"block ids {bad[:4]} are the null block or out of range", "block_ids")
        for rid, ids in rec.block_ids.items():
            if len(set(ids)) != len(ids):
                self.flag("MEM.FREE_XOR_HELD", s, rid, f"block table {ids} holds a block twice", "block_ids")
        if not self.cfg.enable_prefix_caching and len(set(held)) != len(held):
            self.flag("MEM.FREE_XOR_HELD", s, None, "two requests hold one block without prefix caching", "block_ids")
        if rec.num_free_blocks + len(set(held)) != usable:
            self.flag("MEM.CONSERVATION", s, None, f"{rec.num_free_blocks} free + {len(set(held))} held != {usable}", "num_free_blocks")
        bad = [b for b in rec.evicted or [] if not first <= b < self.cfg.num_blocks]
        if bad:
            self.flag("MEM.FREE_XOR_HELD", s, None, f"evicted block ids {bad[:4]} out of range", "evicted")

    def _check_tables(self, rec: StepRecord, throughout: list[str]) -> None:
        """MEM.TABLE_APPEND_ONLY: a block table only grows while its request runs, with blocks
        that were free; blocks of requests that ran through the step are never evicted in it."""
        if rec.block_ids is None:
            return
        s, bs = rec.step, self.cfg.block_size
        live = {b for rid in throughout for b in self._tables.get(rid, [])}
        dedup = self.cfg.cache_dedup == "on-insert"
        for rid, table in rec.block_ids.items():
            if rid in throughout:
                prev = self._tables.get(rid, [])
                if dedup and len(table) >= len(prev):  # CACHE.DEDUP_ON_INSERT rebinds entries to cached copies
                    prev = table[: len(prev)]
                if table[: len(prev)] != prev:
                    self.flag("MEM.TABLE_APPEND_ONLY", s, rid, f"table {table[:6]} does not extend {prev[:6]}", "block_ids")
                    continue
                fresh = table[len(prev):]
            else:  # admitted in this step: its prefix hits may be anybody's blocks
                fresh = table[(rec.cache_hits or {}).get(rid, 0) // bs:]
            taken = sorted(live.intersection(fresh))
            if taken and not dedup:
                self.flag("MEM.TABLE_APPEND_ONLY", s, rid, f"new blocks {taken[:4]} were held by a running request", "block_ids")
        evicted = sorted(live.intersection(rec.evicted or []))
        if evicted:
            self.flag("MEM.TABLE_APPEND_ONLY", s, None, f"evicted blocks {evicted[:4]} held by a running request", "evicted")
        self._tables = {rid: list(t) for rid, t in rec.block_ids.items()}

    def _check_evictions(self, rec: StepRecord, throughout: set[str]) -> None:
        """CACHE.HITS_CONSISTENT: a block is evicted only when it is popped for re-use, so a step
        evicts at most the blocks it newly allocated (known exactly when nobody was preempted)."""
        if rec.blocks is None:
            return
        held, self._held = self._held, dict(rec.blocks)
        if rec.num_evicted is None or rec.preempted or self.cfg.cache_eviction == "leaf-lru":
            return  # (CACHE.EVICT_LEAF_LRU evicts whole leaves, however few blocks were missing)
        pops = 0
        for rid, n in rec.blocks.items():
            pops += n - (held.get(rid, 0) if rid in throughout else self.req(rid).hit_blocks)
        for rid in [rid for rid, _ in rec.finished] + self._freed_aborts:  # freed at the end of the step, after this step's allocations
            if self.cfg.kv_reservation == "full":
                if rid not in throughout:
                    return  # its reservation is not in the log
                continue
            before = held.get(rid, 0) if rid in throughout else self.req(rid).hit_blocks
            r = self.req(rid)
            pops += max(_cdiv(max(r.computed, r.peak), self.cfg.block_size) - before, 0)
        if rec.num_evicted > pops:
            self.flag("CACHE.HITS_CONSISTENT", rec.step, None, f"{rec.num_evicted} evictions, {pops} blocks allocated", "num_evicted")

    def _check_cache(self, rec: StepRecord) -> None:
        """CACHE.HITS_CONSISTENT: who reports a hit, in whole blocks; evictions need a cache."""
        s = rec.step
        if rec.cache_hits is not None:
            from_queue = {rid for rid in rec.new + rec.resumed if rid not in rec.swapped_in}
            for rid in sorted(set(rec.cache_hits) ^ from_queue):
                what = "reports a hit but was not admitted from the queue" if rid in rec.cache_hits else "admitted without a hit entry"
                self.flag("CACHE.HITS_CONSISTENT", s, rid, what, "cache_hits")
            for rid, hit in rec.cache_hits.items():
                if hit % self.cfg.block_size or (hit and not self.cfg.enable_prefix_caching):
                    self.flag("CACHE.HITS_CONSISTENT", s, rid, f"hit of {hit} tokens (block_size {self.cfg.block_size}, "
                              f"prefix caching {'on' if self.cfg.enable_prefix_caching else 'off'})", "cache_hits")
        if rec.num_evicted and not self.cfg.enable_prefix_caching:
            self.flag("CACHE.HITS_CONSISTENT", s, None, f"{rec.num_evicted} evictions without prefix caching", "num_evicted")
        if rec.num_evicted is not None and rec.num_evicted > self.cfg.usable_blocks:
            self.flag("CACHE.HITS_CONSISTENT", s, None, f"{rec.num_evicted} evictions > {self.cfg.usable_blocks} blocks", "num_evicted")

    def _check_swap_and_ratio(self, rec: StepRecord) -> None:
        """SWAP.CPU_CONSERVATION and ESTIMATE.RATIO_BOUNDS, where the log carries them."""
        s, cfg = rec.step, self.cfg
        if rec.num_free_cpu_blocks is not None:
            held = sum(_cdiv(r.computed, cfg.block_size) for r in self.reqs.values() if r.state == "swapped")
            if cfg.preemption_mode != "swap" or rec.num_free_cpu_blocks + held != cfg.num_cpu_blocks:
                self.flag("SWAP.CPU_CONSERVATION", s, None, f"{rec.num_free_cpu_blocks} free + {held} held CPU blocks "
                          f"!= num_cpu_blocks {cfg.num_cpu_blocks}", "num_free_cpu_blocks")
        if rec.new_token_ratio is not None:
            r = rec.new_token_ratio
            idle = self.trace is not None and not self._busy()
            if cfg.admission != "estimate" or not 0.0 <= r <= 1.0 or (idle and r != cfg.new_token_ratio_init):
                self.flag("ESTIMATE.RATIO_BOUNDS", s, None, f"new_token_ratio {r} (init {cfg.new_token_ratio_init}, "
                          f"{'idle' if idle else 'busy'})", "new_token_ratio")
            elif self.trace is not None and not idle and not rec.preempted:
                # without a retraction it stays, or decays by one step to no lower than its floor
                decayed = max(self._ratio - cfg.new_token_ratio_decay, cfg.new_token_ratio_min)
                if min(abs(r - self._ratio), abs(r - decayed)) > 1e-9:
                    self.flag("ESTIMATE.RATIO_BOUNDS", s, None, f"new_token_ratio {r} after {self._ratio} with no "
                              f"retraction (expected it or {decayed})", "new_token_ratio")
            self._ratio = r

    def _check_state(self, rec: StepRecord, throughout: list[str]) -> None:
        """LOG.STATE_CONSISTENT: the optional state fields (spec.formats.STATE_FIELDS) agree with
        what the log's decisions imply."""
        s, cfg, bs = rec.step, self.cfg, self.cfg.block_size
        if rec.computed is not None:
            running = {r.request_id: r for r in self.running()}
            # a request waiting after a preemption (0 computed) or swapped out (its tokens kept) may be named too
            victims = {r.request_id: r for r in self.reqs.values() if r.state == "swapped" or (r.state == "waiting" and r.preempted)}
            for rid in sorted((set(rec.computed) - set(victims)) ^ set(running)):
                self.flag("LOG.STATE_CONSISTENT", s, rid, "computed must name exactly the running requests "
                          "(and those waiting after a preemption)", "computed")
            for rid, n in rec.computed.items():
                r = running.get(rid)
                if r is None:
                    if rid in victims and n != victims[rid].computed:
                        self.flag("LOG.STATE_CONSISTENT", s, rid, f"computed {n} while preempted; the log implies "
                                  f"{victims[rid].computed}", "computed")
                    continue
                if r.hit_unknown:  # the chunks since admission plus an unlogged hit of whole blocks
                    if n < r.computed or (n - r.computed) % bs:
                        self.flag("LOG.STATE_CONSISTENT", s, rid, f"computed {n}: not the log's chunks ({r.computed}) "
                                  f"plus whole blocks of prefix hit", "computed")
                    else:
                        r.computed, r.hit_unknown = n, False  # the state field tells the hit
                elif n != r.computed:
                    self.flag("LOG.STATE_CONSISTENT", s, rid, f"computed {n}; the log's chunks add up to {r.computed}", "computed")
        if rec.vtc_counters is not None:
            for tenant, value in rec.vtc_counters.items():
                if cfg.policy != "vtc" or value < self._vtc.get(tenant, 0.0) - 1e-9 * max(1.0, value):
                    self.flag("LOG.STATE_CONSISTENT", s, None, f"tenant {tenant!r}: counter {value} after "
                              f"{self._vtc.get(tenant, 0.0)} (VTC counters never decrease)", "vtc_counters")
            for tenant in sorted(set(self._vtc) - set(rec.vtc_counters)):
                self.flag("LOG.STATE_CONSISTENT", s, None, f"tenant {tenant!r} left the counters", "vtc_counters")
            for tenant, value in (rec.vtc_lifts or {}).items():  # a lift never lowers; the charges only add
                end = rec.vtc_counters.get(tenant, -1.0)
                if value < self._vtc.get(tenant, 0.0) - 1e-9 * max(1.0, value) or value > end + 1e-9 * max(1.0, end):
                    self.flag("LOG.STATE_CONSISTENT", s, None, f"tenant {tenant!r}: lifted to {value}, between "
                              f"{self._vtc.get(tenant, 0.0)} before and {end} after the step", "vtc_lifts")
            self._vtc = dict(rec.vtc_counters)
        if rec.estimate_rem is not None and (cfg.admission != "estimate" or rec.estimate_rem > cfg.usable_blocks * bs):
            self.flag("LOG.STATE_CONSISTENT", s, None, f"estimate_rem {rec.estimate_rem} above the pool's "
                      f"{cfg.usable_blocks * bs} tokens (or not under admission=estimate)", "estimate_rem")
        parts = rec.estimate_parts
        if parts is not None and rec.estimate_rem is not None and \
                abs(parts["free"] - parts["running"] - parts["chunks"] - rec.estimate_rem) > 1e-6 * max(1.0, abs(rec.estimate_rem)):
            self.flag("LOG.STATE_CONSISTENT", s, None, f"estimate_parts {parts}: free - running - chunks is not "
                      f"estimate_rem {rec.estimate_rem}", "estimate_parts")
        if parts is not None and parts["running"] > parts["outputs"] + 1e-6 * max(1.0, parts["outputs"]):
            self.flag("LOG.STATE_CONSISTENT", s, None, f"estimate_parts {parts}: the running reserve is more than "
                      f"the outputs it scales (a ratio above 1)", "estimate_parts")
        if rec.admit_stop is not None:
            spent = sum(n for _, n in rec.scheduled)
            if rec.admit_stop not in ADMIT_STOPS or (rec.admit_stop == "budget" and spent != cfg.max_num_batched_tokens):
                self.flag("LOG.STATE_CONSISTENT", s, None, f"admit_stop {rec.admit_stop!r} with {spent} tokens scheduled "
                          f"of max_num_batched_tokens {cfg.max_num_batched_tokens} (words: {', '.join(ADMIT_STOPS)})",
                          "admit_stop")
        if rec.waiting is not None:
            self._check_waiting(rec)
        if rec.hit_blocks is not None:
            self._check_hit_blocks(rec)
        if rec.cache_registered is not None:
            self._check_registered(rec, set(throughout))
        if rec.ref_counts is not None and rec.block_ids is not None:
            self._check_ref_counts(rec)
        if rec.cached_blocks is not None:
            entries = list(rec.cached_blocks)
            twice = sorted(b for b, k in Counter(entries).items() if k > 1)
            if twice or entries != sorted(entries):
                self.flag("LOG.STATE_CONSISTENT", s, None, f"cached_blocks: block(s) {twice[:4]} in two cache entries "
                          "(a block holds one hash), or the list is not sorted", "cached_blocks")

    def _check_ref_counts(self, rec: StepRecord) -> None:
        """Each block's reference count is the number of running requests whose table holds it."""
        holders = Counter(str(b) for ids in rec.block_ids.values() for b in ids)
        for key in sorted(set(rec.ref_counts) | set(holders), key=lambda k: (len(k), k)):
            n, m = rec.ref_counts.get(key, 0), holders.get(key, 0)
            if n != m:
                self.flag("LOG.STATE_CONSISTENT", rec.step, None, f"block {key}: {n} references, held by {m} running "
                          "request(s)", "ref_counts")

    def _check_waiting(self, rec: StepRecord) -> None:
        """``waiting`` names exactly the requests the log leaves waiting: arrived (with a trace; without
        one, those the log has named), not running, swapped out or ended, each once and by its id."""
        listed = Counter(rec.waiting)
        known = {rid for rid, r in self.reqs.items() if r.state == "waiting"}
        wrong = {rid for rid in listed if rid is None or listed[rid] > 1 or (rid not in known and (
            self.trace is not None or (rid in self.reqs and self.reqs[rid].state != "waiting")))}
        for rid in sorted(wrong | (known - set(listed)), key=str):
            self.flag("LOG.STATE_CONSISTENT", rec.step, rid, "waiting must name each waiting request once "
                      f"({'not ' if rid in listed else ''}listed; the log leaves it "
                      f"{self.reqs[rid].state if rid in self.reqs else 'unknown'})", "waiting")

    def _check_hit_blocks(self, rec: StepRecord) -> None:
        s, bs = rec.step, self.cfg.block_size
        hits = rec.cache_hits or {}
        want = {rid for rid, h in hits.items() if h}
        for rid in sorted(set(rec.hit_blocks) ^ want) if rec.cache_hits is not None else sorted(rec.hit_blocks):
            self.flag("LOG.STATE_CONSISTENT", s, rid, "hit_blocks must name exactly the requests with a prefix hit", "hit_blocks")
        for rid, ids in rec.hit_blocks.items():
            table = (rec.block_ids or {}).get(rid)
            if len(ids) * bs != hits.get(rid, 0) or (table is not None and table[: len(ids)] != ids):
                self.flag("LOG.STATE_CONSISTENT", s, rid, f"hit blocks {ids[:6]} for a hit of {hits.get(rid, 0)} tokens"
                          + (f", table {table[:6]}" if table is not None else ""), "hit_blocks")

    def _check_registered(self, rec: StepRecord, throughout: set[str]) -> None:
        """A request registers each block once per admission, only blocks full of computed tokens."""
        s, bs = rec.step, self.cfg.block_size
        finished = [rid for rid, _ in rec.finished]
        # CACHE.DEDUP_ON_INSERT: a block whose prefix the tree already holds is freed, not registered; a
        # duplicate sits at an ordinal some request registered (ordinals are positions in the prompt)
        dedup = self.cfg.cache_dedup == "on-insert"
        for rid, ordinals in rec.cache_registered.items():
            if dedup:
                self._ordinals_registered.update(ordinals)
            r = self.reqs.get(rid)
            if not self.cfg.enable_prefix_caching or r is None:
                self.flag("LOG.STATE_CONSISTENT", s, rid, "a registration without prefix caching or request", "cache_registered")
                continue
            if not ordinals:
                self.flag("LOG.STATE_CONSISTENT", s, rid, "a registration entry that names no block", "cache_registered")
            again = sorted(set(ordinals) & r.registered) or sorted({o for o in ordinals if ordinals.count(o) > 1})
            if again:
                self.flag("LOG.STATE_CONSISTENT", s, rid, f"block ordinals {again[:4]} registered twice", "cache_registered")
            r.registered.update(ordinals)
            known = rid not in rec.preempted and not r.hit_unknown and (r.state == "running" or rid in finished)
            if known and ordinals and max(ordinals) >= r.computed // bs:
                self.flag("LOG.STATE_CONSISTENT", s, rid, f"block ordinal {max(ordinals)} registered with only "
                          f"{r.computed} tokens computed", "cache_registered")
        if not self.cfg.enable_prefix_caching:
            return
        seen = self._ordinals_registered if dedup else set()
        for rid in [r.request_id for r in self.running()] + finished:
            r = self.reqs[rid]  # every block full of computed tokens is a hit or was registered
            if r.hit_unknown or rid in rec.preempted:
                continue
            # async: blocks whose last token is in flight are cached when it arrives (ASYNC.CACHE_AFTER_OUTPUT)
            upto = r.computed - r.placeholders if r.registrable is None else min(r.computed, r.registrable)
            if r.cached_upto is not None and rid not in finished:  # a finish caches the rest
                upto = min(upto, r.cached_upto)
            missing = sorted(set(range(r.hit_blocks, upto // bs)) - r.registered - seen)
            if missing:
                self.flag("LOG.STATE_CONSISTENT", s, rid, f"full blocks {missing[:4]} never registered "
                          f"({r.computed} tokens computed)", "cache_registered")

    def _check_reasons(self, rec: StepRecord) -> None:
        """LOG.REASONS_KNOWN: reasons cite registered rules about known requests."""
        for entry in rec.reasons or []:
            rule_id, rid = entry.get("rule"), entry.get("request")
            if rule_id not in self._rules:
                self.flag("LOG.REASONS_KNOWN", rec.step, rid, f"unknown rule id {rule_id!r}", "reasons")
            elif rid is not None and self.trace is not None and rid not in self.sources:  # without it: queued ids
                self.flag("LOG.REASONS_KNOWN", rec.step, rid, f"{rule_id} about an unknown request", "reasons")

    def finish(self, last_step: int) -> None:
        """LIVE.EVERY_REQUEST_ENDS: the driver stops only when nothing is unfinished."""
        ids = [r.id for r in self.trace.requests] if self.trace is not None else list(self.reqs)
        for rid in ids:
            if rid not in self._ended:
                self.flag("LIVE.EVERY_REQUEST_ENDS", last_step, rid, "never finished, aborted or rejected", "finished")


def _rule_ids() -> set[str]:
    from spec.rules import all_rules

    return set(all_rules())


def check_log(log: DecisionLog, config: SchedulerConfig, trace: Trace | None = None) -> LogReport:
    """Check every invariant the log can show; see :data:`LOG_CHECKS`."""
    return LogChecker(config, trace, log.level).check(log.records)
