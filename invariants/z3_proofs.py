"""What ``batchspec prove`` and the catalogue import: the Z3 proofs of :mod:`invariants.proofs`.

A thin front: the proofs live in :mod:`invariants.proofs` (memory, budget,
translation validation) and :mod:`invariants.bmc` (bounded model checking);
this module re-exports their public API and says which catalogue invariant
each proof covers (:data:`COVERAGE`, read by ``batchspec invariants``).
Importing it needs ``z3-solver`` (ImportError otherwise).
"""
from __future__ import annotations

from invariants.proofs import (  # noqa: F401 — re-exported
    BOUNDS, COUNTEREXAMPLE, PROVED, UNKNOWN, ProofRow, all_ok, cross_checks, proof_names, run_proofs,
)

_MEM = ["mem.allocate", "mem.touch", "mem.free", "mem.evict", "mem.preempt"]

#: Catalogue invariant id -> the ``batchspec prove`` rows that prove it (or, for a
#: BMC reachability row, show by a witness why the rule behind it is needed).
#: The translation-validation rows (``tv.*``) are not listed: they prove the GPU
#: engine's formulas equal the spec's loops, so the engine inherits every
#: invariant the spec keeps, rather than proving one invariant.
COVERAGE: dict[str, list[str]] = {
    "MEM.CONSERVATION": _MEM,
    "MEM.REFCOUNT": _MEM,
    "MEM.FREE_XOR_HELD": _MEM,
    "CACHE.MAP_CONSISTENT": _MEM,
    "REQ.IDLE_HOLDS_NOTHING": _MEM,
    "BUDGET.TOKENS_LE_BUDGET": ["budget.tokens.fcfs", "budget.tokens.priority", "budget.tokens.priority.continue"],
    "SEQ.MAX_NUM_SEQS": ["budget.seqs.fcfs", "budget.seqs.priority"],
    "PREEMPT.NOT_SCHEDULED": ["budget.preempted.priority"],
    "LIVE.NO_IDLE_STALL": ["live.no_idle_stall.fcfs", "live.no_idle_stall.priority", "bmc.livelock.no_reject"],
    "QUEUE.FCFS_SORTED": ["bmc.passing.fcfs"],
    "QUEUE.ADMISSION_ORDER": ["bmc.passing.fcfs"],
    "SLO.ADMITTED_FEASIBLE": ["slo.edf_ac.deadline", "slo.edf.order"],
    "QUEUE.EDF_ORDER": ["slo.edf.order"],
    "QUEUE.AGING_BOUNDED_OVERTAKING": ["slo.sprpt.overtaking"],
}

__all__ = ["BOUNDS", "COUNTEREXAMPLE", "COVERAGE", "PROVED", "UNKNOWN", "ProofRow", "all_ok", "cross_checks",
           "proof_names", "run_proofs"]
