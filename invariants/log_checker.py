"""The black-box log checker: every invariant a decision log alone can show.

Works on any engine's log (any language: it is JSON lines), replaying the log's
own events to rebuild who is waiting, running and finished, then checking each
step.  With the trace (``--trace``, or the path in the log header) it also
knows arrival order, prompt lengths, priorities and max_tokens, which the
order, sampling and liveness checks need; without it those checks are skipped
and the report says so.

Usage: ``batchspec check-log LOG --profile vllm-v1 [--trace TRACE]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from spec.config import SchedulerConfig
from spec.formats import DecisionLog, StepRecord, Trace, TraceRequest


@dataclass(frozen=True)
class Violation:
    invariant: str
    step: int
    request: str | None
    evidence: str


#: Invariants this checker covers, with what they need beyond the log.
LOG_CHECKS: dict[str, str] = {
    "BUDGET.TOKENS_LE_BUDGET": "log",
    "SEQ.MAX_NUM_SEQS": "log",
    "REQ.SCHEDULED_IS_RUNNING": "log",
    "REQ.ONE_TERMINAL_EVENT": "log",
    "PREEMPT.NOT_SCHEDULED": "log",
    "MEM.CONSERVATION": "memory level",
    "MEM.FREE_XOR_HELD": "exact level",
    "REQ.IDLE_HOLDS_NOTHING": "memory level",
    "MEM.SLOTS_COVER_COMPUTED": "memory level + trace",
    "CACHE.HIT_NOT_WHOLE": "memory level + trace",
    "SAMPLE.AFTER_PREFILL": "trace",
    "REQ.COMPUTED_LE_TOKENS": "trace",
    "QUEUE.ADMISSION_ORDER": "trace",
    "PREEMPT.NO_ADMISSION_SAME_STEP": "log",
    "PREEMPT.VICTIM_RULE": "trace for priority",
    "LIVE.NO_IDLE_STALL": "trace",
    "PREEMPT.NEVER_UNDER_FULL_RESERVATION": "log, kv_reservation=full",
    "BATCH.STATIC_NO_JOIN": "log, batching=static",
    "BATCH.PREFILL_ONLY": "log, batching=prefill-first",
    "LIVE.EVERY_REQUEST_ENDS": "trace",
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


@dataclass
class LogReport:
    violations: list[Violation] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    steps: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations


class LogChecker:
    """Replays a log's events and checks every step (one instance per log)."""

    def __init__(self, config: SchedulerConfig, trace: Trace | None, level: str):
        self.cfg = config
        self.trace = trace
        self.level = level
        self.reqs: dict[str, _Req] = {}
        self.arrival: dict[str, int] = {}
        self.report = LogReport()
        self._admissions = 0
        self._ended: set[str] = set()
        if trace is not None:
            order = sorted(range(len(trace.requests)), key=lambda i: trace.requests[i].arrival_step or 0)
            self.arrival = {trace.requests[i].id: pos for pos, i in enumerate(order)}
        else:
            self.report.skipped.append("no trace: arrival order, prompt lengths and liveness are not checked")
        if level == "decisions":
            self.report.skipped.append("decisions-level log: block accounting is not checked")

    def flag(self, invariant: str, step: int, request: str | None, evidence: str) -> None:
        self.report.violations.append(Violation(invariant, step, request, evidence))

    def req(self, rid: str) -> _Req:
        if rid not in self.reqs:
            src = None
            if self.trace is not None:
                src = next((r for r in self.trace.requests if r.id == rid), None)
            self.reqs[rid] = _Req(rid, src)
        return self.reqs[rid]

    def running(self) -> list[_Req]:
        return sorted((r for r in self.reqs.values() if r.state == "running"), key=lambda r: r.admitted_seq)

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
        for rid in self._arrived_by(s):
            self.req(rid)
        for rid, _ in rec.rejected:
            self._end(rid, s, "rejected")
        for rid in rec.aborted:
            self._end(rid, s, "aborted")
        waiting_at_start = [r for r in self.reqs.values() if r.state == "waiting"]
        running_at_start = self.running()
        self._check_preemptions(rec, running_at_start)
        self._check_batching(rec, running_at_start)
        self._check_admissions(rec, waiting_at_start, running_at_start)
        self._check_scheduled(rec)
        for rid, why in rec.finished:
            self._end(rid, s, why)
        self._check_memory(rec)

    def _end(self, rid: str, step: int, how: str) -> None:
        r = self.req(rid)
        if rid in self._ended:
            self.flag("REQ.ONE_TERMINAL_EVENT", step, rid, f"{how} after it had already ended")
        self._ended.add(rid)
        r.state = "ended"

    def _check_preemptions(self, rec: StepRecord, running: list[_Req]) -> None:
        live = list(running)
        scheduled = {rid for rid, _ in rec.scheduled}
        for rid in rec.preempted:
            r = self.req(rid)
            if r not in live:
                self.flag("PREEMPT.VICTIM_RULE", rec.step, rid, "preempted while not running")
                continue
            want = self._victim(live)
            if want is not None and want is not r:
                self.flag("PREEMPT.VICTIM_RULE", rec.step, rid, f"victim should be {want.request_id} ({self.cfg.policy})")
            live.remove(r)
            if rid in rec.swapped_out:
                r.state = "swapped"  # keeps its computed tokens (in the CPU pool)
            else:
                r.state, r.computed = "waiting", 0
            if rid in scheduled:
                self.flag("PREEMPT.NOT_SCHEDULED", rec.step, rid, "preempted and scheduled in the same step")

    def _check_batching(self, rec: StepRecord, running: list[_Req]) -> None:
        """The profile's batching and reservation styles, as the log shows them."""
        admitted = rec.new + [rid for rid in rec.resumed if rid not in rec.swapped_in]  # swap-ins are returns
        if self.cfg.kv_reservation == "full" and rec.preempted:
            self.flag("PREEMPT.NEVER_UNDER_FULL_RESERVATION", rec.step, rec.preempted[0], "preempted under full reservation")
        if self.cfg.batching == "static" and admitted and running:
            self.flag("BATCH.STATIC_NO_JOIN", rec.step, admitted[0], f"joined while {running[0].request_id} runs")
        if self.cfg.batching == "prefill-first" and admitted:
            others = [rid for rid, _ in rec.scheduled if rid not in admitted]
            if others:
                self.flag("BATCH.PREFILL_ONLY", rec.step, others[0], "ran in a step that admitted")

    def _victim(self, live: list[_Req]) -> _Req | None:
        if self.cfg.admission == "estimate":  # fewest outputs, then longest prompt, then the latest
            if self.trace is None:
                return None
            return min(reversed(live), key=lambda r: (r.outputs, -(r.source.prompt_len if r.source else 0)))
        if self.cfg.policy != "priority":
            return live[-1]
        if self.trace is None:
            return None
        return max(live, key=lambda r: (r.source.priority if r.source else 0, self.arrival.get(r.request_id, 0)))

    def _check_admissions(self, rec: StepRecord, waiting: list[_Req], running: list[_Req]) -> None:
        s = rec.step
        joined = set(rec.new) | set(rec.resumed)
        admitted = [rid for rid, _ in rec.scheduled if rid in joined]  # batch order is admission order
        for rid in joined.difference(admitted):
            self.flag("REQ.SCHEDULED_IS_RUNNING", s, rid, "admitted but not in the batch")
        if rec.preempted and admitted and not self.cfg.admit_after_preempt:
            self.flag("PREEMPT.NO_ADMISSION_SAME_STEP", s, admitted[0], "admitted in a step that preempted")
        for rid in admitted:
            r = self.req(rid)
            if rid in rec.swapped_in:
                if r.state != "swapped":
                    self.flag("REQ.SCHEDULED_IS_RUNNING", s, rid, f"swapped in while {r.state}")
                r.state, r.admitted_seq = "running", self._admissions
                self._admissions += 1
                continue
            if r.state != "waiting":
                self.flag("REQ.SCHEDULED_IS_RUNNING", s, rid, f"admitted while {r.state}")
            if self.trace is not None and self._ordered():
                ahead = [w.request_id for w in waiting if w.state == "waiting" and self._queue_key(w) < self._queue_key(r)]
                if ahead:
                    self.flag("QUEUE.ADMISSION_ORDER", s, rid, f"admitted ahead of {ahead[0]} ({self.cfg.policy})")
            r.state, r.admitted_seq = "running", self._admissions
            self._admissions += 1
            hit = (rec.cache_hits or {}).get(rid, 0)
            r.computed = hit
            if r.source is not None and rec.cache_hits is not None and hit >= r.source.prompt_len + r.outputs:
                self.flag("CACHE.HIT_NOT_WHOLE", s, rid, f"hit {hit} of {r.source.prompt_len + r.outputs} tokens")
        if self.trace is not None and not running and not admitted:
            if any(w.state == "waiting" for w in waiting):
                self.flag("LIVE.NO_IDLE_STALL", s, waiting[0].request_id, "nothing running, requests waiting, none admitted")
        if len(self.running()) > self.cfg.max_num_seqs:
            self.flag("SEQ.MAX_NUM_SEQS", s, None, f"{len(self.running())} running > {self.cfg.max_num_seqs}")

    def _ordered(self) -> bool:
        """Whether the admission order is a fixed key this checker knows: FCFS or priority without
        aging, recompute preemption to the queue front (not swap, not SGLang's retraction to the tail)."""
        cfg = self.cfg
        return (cfg.policy in ("fcfs", "priority") and not cfg.aging_steps and cfg.admission == "budget"
                and cfg.preemption_mode == "recompute")

    def _queue_key(self, r: _Req) -> tuple:
        """The waiting-queue order: arrival (FCFS; victims return to the front, which under
        FCFS is still arrival order), or (priority, arrival, id as a string)."""
        arrival = self.arrival.get(r.request_id, 0)
        if self.cfg.policy == "priority":
            return (r.source.priority if r.source else 0, arrival, r.request_id)
        return (arrival,)

    def _check_scheduled(self, rec: StepRecord) -> None:
        s = rec.step
        total = sum(n for _, n in rec.scheduled)
        if total > self.cfg.max_num_batched_tokens:
            self.flag("BUDGET.TOKENS_LE_BUDGET", s, None, f"{total} tokens > budget {self.cfg.max_num_batched_tokens}")
        for rid, n in rec.scheduled:
            r = self.req(rid)
            if r.state != "running":
                self.flag("REQ.SCHEDULED_IS_RUNNING", s, rid, f"scheduled while {r.state}")
                continue
            r.computed += n
            if r.source is None:
                r.outputs += rid in rec.sampled
                continue
            tokens = r.source.prompt_len + r.outputs
            if n < 1 or r.computed > tokens:
                self.flag("REQ.COMPUTED_LE_TOKENS", s, rid, f"computed {r.computed} > {tokens} tokens")
            if (rid in rec.sampled) != (r.computed == tokens):
                self.flag("SAMPLE.AFTER_PREFILL", s, rid, f"sampled={rid in rec.sampled} with {r.computed} of {tokens} computed")
            r.outputs += rid in rec.sampled
            if r.outputs > r.source.max_tokens:
                self.flag("REQ.COMPUTED_LE_TOKENS", s, rid, f"{r.outputs} outputs > max_tokens {r.source.max_tokens}")
        for rid in rec.sampled:
            if rid not in dict(rec.scheduled):
                self.flag("SAMPLE.AFTER_PREFILL", s, rid, "sampled without being scheduled")

    def _check_memory(self, rec: StepRecord) -> None:
        if rec.num_free_blocks is None:
            return
        s, usable = rec.step, self.cfg.usable_blocks
        blocks = rec.blocks or {}
        for rid in blocks:
            if self.req(rid).state != "running":
                self.flag("REQ.IDLE_HOLDS_NOTHING", s, rid, f"holds {blocks[rid]} blocks while {self.req(rid).state}")
        for r in self.running():
            have = blocks.get(r.request_id, 0) * self.cfg.block_size
            if r.source is not None and have < r.computed:
                self.flag("MEM.SLOTS_COVER_COMPUTED", s, r.request_id, f"{r.computed} computed, {have} slots")
        if rec.block_ids is not None:
            held = [b for ids in rec.block_ids.values() for b in ids]
            bad = [b for b in held if b >= self.cfg.num_blocks or (self.cfg.null_block and b == 0)]
            if bad:
                self.flag("MEM.FREE_XOR_HELD", s, None, f"block ids {bad[:4]} are the null block or out of range")
            for rid, ids in rec.block_ids.items():
                if len(set(ids)) != len(ids):
                    self.flag("MEM.FREE_XOR_HELD", s, rid, f"block table {ids} holds a block twice")
            if rec.num_free_blocks + len(set(held)) != usable:
                self.flag("MEM.CONSERVATION", s, None, f"{rec.num_free_blocks} free + {len(set(held))} held != {usable}")
        elif not self.cfg.enable_prefix_caching and rec.num_free_blocks + sum(blocks.values()) != usable:
            self.flag("MEM.CONSERVATION", s, None, f"{rec.num_free_blocks} free + {sum(blocks.values())} held != {usable}")
        elif rec.num_free_blocks > usable or rec.num_free_blocks + sum(blocks.values()) < usable:
            self.flag("MEM.CONSERVATION", s, None, f"{rec.num_free_blocks} free, {sum(blocks.values())} held, {usable} usable")

    def finish(self, last_step: int) -> None:
        if self.trace is None:
            return
        for r in self.trace.requests:
            if r.id not in self._ended:
                self.flag("LIVE.EVERY_REQUEST_ENDS", last_step, r.id, "never finished, aborted or rejected")


def check_log(log: DecisionLog, config: SchedulerConfig, trace: Trace | None = None) -> LogReport:
    """Check every invariant the log can show; see :data:`LOG_CHECKS`."""
    return LogChecker(config, trace, log.level).check(log.records)
