"""A toy serving engine that runs one request at a time — and how to test it with batchspec.

It is deliberately simple (about 150 lines of scheduling), written from scratch
against the engine protocol of ``spec/protocol.py`` without importing any of the
spec's scheduling logic, so that the differential tests below mean something.  It
claims to reproduce the ``naive`` profile: FCFS (or priority) order, one request
running at a time, chunked prefill under the token budget, paged KV blocks popped
from the head of a free queue and returned tail first, no prefix cache.

Run it through batchspec's own command line (docs/engine-guide.md walks through each)::

    python examples/toy_engine.py fuzz --engine toy --profile naive --traces 64 --level exact
    python examples/toy_engine.py replay docs/examples/hol-blocking.jsonl --engine toy
    python examples/toy_engine.py log docs/examples/hol-blocking.jsonl toy.log.jsonl
    batchspec check-log toy.log.jsonl --trace docs/examples/hol-blocking.jsonl

It **declares what it implements** (``ToyEngine.capabilities``): the ``naive``
profile, FCFS or priority order, chunked prefill on or off, any long-prefill cap,
full-sequence reservation on or off — and nothing else (no prefix cache, no
batching, no preemption).  ``batchspec fuzz --engine toy`` then draws only inside
that envelope, and covers it.

Planted bugs (``TOY_BUG=...``), for the guide's "does the fuzzer find it?" exercise:

* ``priority`` — under ``policy="priority"`` the queue is served in arrival order,
  ignoring priorities;
* ``lone_cap`` — the long-prefill cap is applied to a request that is alone (the
  bug family of ``BUDGET.LONG_PREFILL``); it shows at admission and in later chunks,
  yet a campaign reports it as one finding.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python examples/toy_engine.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spec.config import resolve  # the trace header's knobs, validated (configuration, not logic)
from spec.formats import StepRecord, Trace, TraceRequest

#: Planted bug, for the guide's "does the fuzzer find it?" exercise: "", "priority" or "lone_cap".
BUG = os.environ.get("TOY_BUG", "")

#: What the toy implements (fuzz/capabilities.py): the naive profile — one request at a time,
#: no prefix cache — with these knobs free to vary.  Every other semantic knob keeps naive's
#: value; sizes (blocks, budget, max_model_len) are drawn freely.
CAPABILITIES = {
    "profile": "naive",
    "knobs": {
        "policy": ["fcfs", "priority"],
        "enable_chunked_prefill": [True, False],
        "long_prefill_token_threshold": "any",
        "scheduler_reserve_full_isl": [True, False],
    },
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ToyRequest:
    def __init__(self, tr: TraceRequest, seq: int, eos: int | None):
        self.tr = tr
        self.id = tr.id
        self.seq = seq  # arrival order
        self.eos = None if tr.ignore_eos else eos
        self.outputs: list[int] = []
        self.computed = 0
        self.blocks: list[int] = []

    @property
    def num_tokens(self) -> int:
        return self.tr.prompt_len + len(self.outputs)

    def key(self, policy: str) -> tuple:
        if policy == "priority" and BUG != "priority":
            return (self.tr.priority, self.seq)
        return (self.seq,)


class ToyEngine:
    """One request at a time.  Implements ``spec.protocol.Engine``."""

    name = "toy"
    capabilities = CAPABILITIES  # read by batchspec fuzz / conform / fuzz.strategies
    samples_script = True  # it samples TraceRequest.output_token: a replay compares token values too

    def __init__(self, trace: Trace):
        cfg = resolve(trace.config)
        if cfg.max_num_seqs != 1 or cfg.enable_prefix_caching or cfg.policy not in ("fcfs", "priority") \
                or cfg.batching != "continuous" or cfg.kv_reservation != "step" \
                or getattr(cfg, "aging_steps", 0) or getattr(cfg, "admission", "budget") != "budget":
            raise ValueError(f"the toy engine runs one request at a time, without a prefix cache "
                             f"(profile naive); this trace asks for {cfg.overrides()}")
        self.cfg = cfg
        self.vocab = trace.vocab_size
        self.eos = trace.eos_token_id
        first = 1 if cfg.null_block else 0
        self.free: list[int] = list(range(first, cfg.num_blocks))  # the free queue: pop from the head
        self.usable = len(self.free)
        self.waiting: list[ToyRequest] = []
        self.running: ToyRequest | None = None
        self.seen = 0
        self.done: set[str] = set()
        self.pending_aborted: list[str] = []
        self.pending_rejected: list[tuple[str, str]] = []

    # -- the protocol ------------------------------------------------------

    def add_request(self, tr: TraceRequest) -> None:
        cfg = self.cfg
        self.seen += 1
        peak = min(tr.prompt_len + tr.max_tokens - 1, cfg.max_model_len - 1)
        if cfg.reject_unservable and tr.prompt_len + 1 > cfg.max_model_len:
            self.pending_rejected.append((tr.id, "prompt_too_long"))
        elif cfg.reject_unservable and cdiv(peak, cfg.block_size) > self.usable:
            self.pending_rejected.append((tr.id, "never_fits"))
        else:
            self.waiting.append(ToyRequest(tr, self.seen, self.eos))

    def abort_request(self, request_id: str) -> None:
        if self.running is not None and self.running.id == request_id:
            self._free(self.running)
            self.running = None
        elif any(r.id == request_id for r in self.waiting):
            self.waiting = [r for r in self.waiting if r.id != request_id]
        else:
            return  # finished, rejected or unknown: ignored
        self.pending_aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.running is not None or bool(self.waiting)

    def step(self) -> StepRecord:
        cfg = self.cfg
        rec = StepRecord(step=-1, aborted=self.pending_aborted, rejected=self.pending_rejected)
        self.pending_aborted, self.pending_rejected = [], []
        budget = cfg.max_num_batched_tokens
        eligible = (self.running is not None) + len(self.waiting)
        cap = cfg.long_prefill_token_threshold if eligible > 1 or BUG == "lone_cap" else 0
        batch: list[tuple[ToyRequest, int]] = []
        admitted: ToyRequest | None = None
        # 1. the running request continues (prefill chunk or decode)
        r = self.running
        if r is not None:
            n = min(self._chunk(r.num_tokens - r.computed, cap, budget), cfg.max_model_len - r.computed - 1)
            if n > 0 and self._grow(r, n):
                batch.append((r, n))
                budget -= n
        # 2. admission: only into an empty engine, head of the queue first
        elif self.waiting and budget > 0:
            head = min(self.waiting, key=lambda q: q.key(cfg.policy))
            whole = cap if 0 < cap < head.num_tokens else head.num_tokens
            n = self._chunk(head.num_tokens, cap, budget)
            fits_budget = cfg.enable_chunked_prefill or whole <= budget
            fits_memory = not cfg.scheduler_reserve_full_isl or \
                cdiv(min(head.num_tokens, cfg.max_model_len), cfg.block_size) <= len(self.free)
            if fits_budget and fits_memory and self._grow(head, n):
                self.waiting.remove(head)
                self.running = admitted = head
                batch.append((head, n))
        # 3. the model runs: every request whose prompt is now computed samples a token
        for req, n in batch:
            req.computed += n
            rec.scheduled.append((req.id, n))
            if req.computed < req.num_tokens:
                continue
            token = req.tr.output_token(len(req.outputs), self.vocab)
            req.outputs.append(token)
            rec.sampled[req.id] = token
            why = self._stop(req, token)
            if why:
                rec.finished.append((req.id, why))
                self._free(req)
                self.running = None
        # 4. the record, at the exact level
        if admitted is not None:
            rec.new.append(admitted.id)
        rec.cache_hits = {admitted.id: 0} if admitted is not None else {}
        held = [self.running] if self.running is not None and self.running.blocks else []
        rec.num_free_blocks = len(self.free)
        rec.blocks = {q.id: len(q.blocks) for q in held}
        rec.block_ids = {q.id: list(q.blocks) for q in held}
        rec.num_evicted, rec.evicted = 0, []
        return rec

    # -- helpers -----------------------------------------------------------

    @staticmethod
    def _chunk(remaining: int, cap: int, budget: int) -> int:
        return min(cap if 0 < cap < remaining else remaining, budget)

    def _grow(self, req: ToyRequest, n: int) -> bool:
        """Give ``req`` the blocks for ``n`` more tokens (all or nothing)."""
        slots = min(req.computed + n, self.cfg.max_model_len)
        need = max(cdiv(slots, self.cfg.block_size) - len(req.blocks), 0)
        if need > len(self.free):
            return False  # cannot happen one at a time: a request that never fits was rejected
        req.blocks += self.free[:need]
        del self.free[:need]
        return True

    def _free(self, req: ToyRequest) -> None:
        self.free[:0] = reversed(req.blocks)  # tail first, to the head of the free queue
        req.blocks = []

    def _stop(self, req: ToyRequest, token: int) -> str | None:
        if req.eos is not None and token == req.eos:
            return "eos"
        if token in req.tr.stop_token_ids:
            return "stop_token"
        if req.num_tokens >= self.cfg.max_model_len:
            return "max_model_len"
        if len(req.outputs) >= req.tr.max_tokens:
            return "max_tokens"
        return None


# --------------------------------------------------------------------------
# Command line: register the engine, then run batchspec's own commands.
# --------------------------------------------------------------------------


def register() -> None:
    """Make ``--engine toy`` available to ``batchspec replay`` / ``fuzz`` / ``conform`` in this process."""
    from fuzz.replay import register_engine

    register_engine("toy", ToyEngine, "examples/toy_engine.py: one request at a time (profile naive)")


def write_log(trace_path: str, log_path: str) -> int:
    """Run a trace through the toy engine alone and write its decision log (what an engine in CI would do)."""
    from spec.formats import DecisionLog
    from spec.io import load_trace, write_log as write
    from spec.protocol import drive

    trace = load_trace(trace_path)
    engine = ToyEngine(trace)
    records = drive(engine, trace, resolve(trace.config).max_steps)
    write(DecisionLog("toy", "exact", records, trace=trace_path, config=trace.config), log_path)
    print(f"wrote {log_path}: {len(records)} steps of the toy engine's decision log")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["log"]:
        if len(argv) != 3:
            print("usage: python examples/toy_engine.py log TRACE LOG", file=sys.stderr)
            return 2
        return write_log(argv[1], argv[2])
    register()
    from batchspec.cli import main as batchspec_main

    return batchspec_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
