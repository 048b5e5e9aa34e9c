"""The invariant catalogue as data: id, statement, profiles, bug families, and where it is checked.

Sources, merged here so that ``batchspec invariants`` shows one table:

* the predicates of :mod:`spec.invariants` (checked in the spec after every step,
  and therefore in every Hypothesis stateful run);
* the black-box checks of :mod:`invariants.log_checker` (any engine's log);
* the Z3 proofs of :mod:`invariants.z3_proofs`, when that module is present;
* properties over whole runs that a test checks exhaustively up to a size bound (``EXHAUSTIVE``).

Bug ids refer to docs/reference/real-bugs.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from invariants.log_checker import LOG_CHECKS, LOG_STATEMENTS
from spec.invariants import INVARIANTS, SCHEDULE_CHECKS, STATE_CHECKS


@dataclass(frozen=True)
class Entry:
    id: str
    statement: str
    profiles: str
    bugs: tuple[str, ...]
    checked_by: tuple[str, ...]  # "spec", "hypothesis", "log", "z3"


#: Invariants that only a log (or a whole run) can show, with their statements.
LOG_ONLY = {
    "REQ.SCHEDULED_IS_RUNNING": (
        "Only running requests are scheduled: nothing is scheduled after it finished, "
        "was aborted or preempted, and every admission appears in the batch.",
        ("VLLM-10", "VLLM-11", "SGL-11", "LMD-06"),
    ),
    "REQ.ONE_TERMINAL_EVENT": (
        "Each request ends exactly once: finished, aborted or rejected.",
        ("VLLM-10", "SGL-11", "TGI-04"),
    ),
    "QUEUE.ADMISSION_ORDER": (
        "Admissions follow the queue order: FCFS never admits a later arrival while an earlier one "
        "waits; priority admits the smallest (priority, arrival, id) first.",
        ("VLLM-04", "LMD-01", "VLLM-03"),
    ),
    "PREEMPT.VICTIM_RULE": (
        "The preemption victim follows the profile's rule: the newest running request (FCFS), "
        "the largest (priority, arrival) (priority).",
        ("LMD-01",),
    ),
    "PREEMPT.NO_ADMISSION_SAME_STEP": (
        "No request is admitted in a step that preempted (vllm-v1).",
        ("VLLM-01", "VLLM-02"),
    ),
    "SAMPLE.MIN_TOKENS_MASKED": (
        "Among a request's first min_tokens outputs no token is EOS (unless ignore_eos) or one of its "
        "stop token ids: the sampler masks them until min_tokens outputs exist, so such a request "
        "never stops on a token before then.",
        ("VLLM-24", "VLLM-25", "TRT-09", "TRT-10"),
    ),
    "LIVE.EVERY_REQUEST_ENDS": (
        "Once arrivals stop, every admissible request finishes (liveness, on bounded traces).",
        ("VLLM-05", "VLLM-06", "TGI-01", "LMD-03"),
    ),
}


#: Properties over whole runs, checked exhaustively on every trace up to a size bound by a test:
#: id -> (statement, profiles, bugs).
EXHAUSTIVE = {
    "VTC.SERVICE_GAP_BOUND": (
        "Under VTC, over any interval of steps in which two tenants a, b both stay backlogged (a waiting "
        "request before and after every step's scheduling), |W_a/w_a - W_b/w_b| <= 2U with "
        "U = max(input_price x L, output_price x M) / min weight, L the longest prompt and M the KV capacity "
        "in tokens (the 2x bound of Sheng et al., OSDI'24). Checked on every trace of 2 tenants x 2 requests "
        "(prompt 1|3, max_tokens 1|3, arrival 0|2), weights 1:1 and 1:2, 4 and 8 tokens of KV "
        "(tests/test_spec_map.py).",
        "policy=vtc (vtc)",
        (),
    ),
}


def z3_coverage() -> dict[str, list[str]]:
    """Invariant id -> names of the Z3 proofs that cover it (empty without z3 or the proofs)."""
    try:
        from invariants import z3_proofs  # noqa: PLC0415 — optional: needs z3-solver
    except ImportError:
        return {}
    return getattr(z3_proofs, "COVERAGE", {})


def catalogue() -> list[Entry]:
    z3 = z3_coverage()
    in_spec = set(STATE_CHECKS) | set(SCHEDULE_CHECKS)
    entries = []
    for inv in INVARIANTS.values():
        where = ["spec", "hypothesis"] if inv.id in in_spec else []
        if inv.id in LOG_CHECKS:
            where.append("log")
        if z3.get(inv.id):
            where.append("z3")
        entries.append(Entry(inv.id, inv.statement, inv.profiles, inv.bugs, tuple(where)))
    for inv_id, (statement, bugs) in LOG_ONLY.items():
        where = ["log"] + (["hypothesis"] if inv_id == "REQ.ONE_TERMINAL_EVENT" else []) + (["z3"] if z3.get(inv_id) else [])
        entries.append(Entry(inv_id, statement, "all", bugs, tuple(where)))
    for inv_id, statement in LOG_STATEMENTS.items():  # the log's own consistency (issue 14)
        if inv_id not in LOG_ONLY and inv_id not in INVARIANTS:
            entries.append(Entry(inv_id, statement, "all", (), ("log",)))
    for inv_id, (statement, profiles, bugs) in EXHAUSTIVE.items():
        entries.append(Entry(inv_id, statement, profiles, bugs, ("exhaustive",)))
    return sorted(entries, key=lambda e: e.id)
