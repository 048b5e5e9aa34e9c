"""Z3 proofs of the invariant catalogue (``batchspec prove``).

Five kinds, each a module of small proof functions returning a :class:`ProofRow`:

* :mod:`~invariants.proofs.memory` — every block-pool action (allocate, touch,
  free, evict, preempt) preserves MEM.CONSERVATION, MEM.REFCOUNT and
  MEM.FREE_XOR_HELD, for every state up to N blocks and R requests;
* :mod:`~invariants.proofs.budget` — one step keeps Σ scheduled ≤ budget, each
  grant in [1, remaining], running ≤ max_num_seqs, victims out of the batch, and
  (LIVE.NO_IDLE_STALL) an idle engine always admits, for every state up to K
  requests, every knob value and every allocation outcome;
* :mod:`~invariants.proofs.translation` — the GPU engine's vectorized formulas
  (``gpu_engine.formulas``, run on Z3 terms) equal the spec's sequential loops;
* :mod:`~invariants.proofs.slo` — exhaustive small-bound runs of the spec for the
  SLO-aware policies (issue 19): EDF admission control meets every admitted deadline when
  the per-step cost is as modelled, and refuses exactly what could not; sprpt's aging bounds
  overtaking; EDF admits in deadline order;
* :mod:`invariants.bmc` — bounded model checking: the shortest trace to a bad
  state, written as a replayable trace file.  Safety rows ("no trace within the
  bound reaches it") are proved when Z3 finds none; reachability rows ("with
  reject_unservable off a request can wait forever", "priority can starve")
  are proved by the witness Z3 finds, which is the trace written.

What is derived from the code and what is modelled by hand is stated in each
module's docstring; in short: the spec's *rules* and the engine's *formulas*
are executed symbolically (:mod:`~invariants.proofs.symex`), the spec's
*loops* and the *block pool* are transliterated by hand and tied to the real
code by concrete cross-checks (:func:`cross_checks`), run before the proofs.

Public API (what the CLI uses)::

    run_proofs(bound="ci", only=None, trace_dir=None, jobs=1, progress=None) -> list[ProofRow]
    all_ok(rows) -> bool
    proof_names(bound="ci") -> list[str]
    cross_checks(bound="ci") -> dict[str, int]
"""
from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable

from invariants.proofs.common import COUNTEREXAMPLE, PROVED, UNKNOWN, ProofRow

__all__ = ["ProofRow", "PROVED", "COUNTEREXAMPLE", "UNKNOWN", "run_proofs", "all_ok",
           "proof_names", "cross_checks", "BOUNDS"]

#: Sizes per bound.  "ci" is what CI runs (the whole table in a few minutes on
#: two cores); "long" is the explicit, slower option (``batchspec prove --bound long``).
BOUNDS = {
    "ci": {"mem": (16, 4), "budget_fcfs": 4, "budget_priority": 3, "live": 3, "tv": 4, "tv_preempt": 3,
           "tv_priority": 3, "tv_admission": (3, 1), "tv_stop": 3, "bmc_steps": 8, "bmc_passing_steps": 6, "cross": 1},
    "long": {"mem": (64, 8), "budget_fcfs": 5, "budget_priority": 4, "live": 5, "tv": 6, "tv_preempt": 5,
             "tv_priority": 4, "tv_admission": (4, 2), "tv_stop": 4, "bmc_steps": 16, "bmc_passing_steps": 10,
             "cross": 5},
}


def _catalogue(bound: str, trace_dir: str | None) -> list[tuple[str, Callable[[], ProofRow]]]:
    """(name, thunk) for every shipped proof at ``bound``, in table order."""
    from invariants.proofs import budget, memory, translation

    b = BOUNDS[bound]
    n, R = b["mem"]
    out: list[tuple[str, Callable[[], ProofRow]]] = []
    for name, fn in memory.PROOFS.items():
        out.append((name, lambda fn=fn: fn(n=n, R=R)))
    kf, kp = b["budget_fcfs"], b["budget_priority"]
    out += [
        ("budget.tokens.fcfs", lambda: budget.prove_budget(kf, "fcfs")),
        ("budget.tokens.priority", lambda: budget.prove_budget(kp, "priority")),
        ("budget.tokens.priority.continue", lambda: budget.prove_budget(kp, "priority", self_preempt="continue")),
        ("budget.seqs.fcfs", lambda: budget.prove_max_num_seqs(kf, "fcfs")),
        ("budget.seqs.priority", lambda: budget.prove_max_num_seqs(kp, "priority")),
        ("budget.preempted.priority", lambda: budget.prove_preempted_not_scheduled(kp, "priority")),
        ("live.no_idle_stall.fcfs", lambda: budget.prove_no_idle_stall(b["live"], "fcfs")),
        ("live.no_idle_stall.priority", lambda: budget.prove_no_idle_stall(b["live"], "priority")),
    ]
    kt = b["tv"]
    out += [
        ("tv.chunking", lambda: translation.prove_chunking(kt)),
        ("tv.allocation", lambda: translation.prove_allocation(kt)),
        ("tv.preemption.fcfs", lambda: translation.prove_preemption(b["tv_preempt"], "fcfs")),
        ("tv.preemption.priority", lambda: translation.prove_preemption(b["tv_priority"], "priority")),
        ("tv.preemption.fcfs.shared", lambda: translation.prove_preemption(b["tv_preempt"], "fcfs", shared=True)),
        ("tv.admission", lambda: translation.prove_admission(b["tv_admission"][0], max_hits=b["tv_admission"][1])),
        ("tv.stop", lambda: translation.prove_stop_codes(b["tv_stop"])),
    ]
    from invariants.proofs import slo  # issue 19: exhaustive runs of the spec, not Z3

    out += [(name, lambda fn=fn: fn(bound)) for name, fn in slo.PROOFS.items()]
    out += [
        ("bmc.livelock.no_reject", lambda: _bmc_livelock(b["bmc_steps"], trace_dir)),
        ("bmc.passing.priority", lambda: _bmc_passing("priority", b["bmc_passing_steps"], trace_dir)),
        ("bmc.passing.fcfs", lambda: _bmc_passing("fcfs", b["bmc_passing_steps"], trace_dir)),
    ]
    return out


def _bmc_livelock(steps: int, trace_dir: str | None) -> ProofRow:
    from invariants import bmc

    out = None if trace_dir is None else f"{trace_dir}/bmc_livelock.jsonl"
    res = bmc.find_livelock(max_steps=steps, out=out, reject_unservable=False)
    return bmc.as_row(res, "why REJECT.NEVER_FITS exists: with reject_unservable off, some trace reaches a request "
                           "that fits the empty pool and waits forever (LIVE.NO_IDLE_STALL broken)", exists=True)


def _bmc_passing(policy: str, steps: int, trace_dir: str | None) -> ProofRow:
    from invariants import bmc

    if policy == "priority":
        out = None if trace_dir is None else f"{trace_dir}/bmc_starvation_priority.jsonl"
        res = bmc.find_passing(max_steps=steps, passes=3, max_requests=4, out=out, policy="priority")
        return bmc.as_row(res, "starvation under priority: some trace has a low-priority request passed over by "
                               "3 later arrivals (SGL-10, LMD-04)", exists=True)
    res = bmc.find_passing(max_steps=steps, passes=1, max_requests=3, policy="fcfs", max_num_seqs=2)
    return bmc.as_row(res, "QUEUE.FCFS_SORTED: under FCFS no later arrival is admitted while an earlier one waits")


def proof_names(bound: str = "ci") -> list[str]:
    return [name for name, _ in _catalogue(bound, None)]


def _selected(names: Iterable[str], only: Iterable[str] | None) -> list[str]:
    names = list(names)
    if not only:
        return names
    only = list(only)
    out = [n for n in names if any(n == o or n.startswith(o.rstrip(".") + ".") or n.startswith(o) for o in only)]
    if not out:
        raise KeyError(f"no proof matches {only} (known: {', '.join(names)})")
    return out


#: name prefixes from the slowest proofs to the fastest (measured at the "ci" bound)
_SLOW_FIRST = ("tv.preemption.priority", "tv.admission", "bmc.passing", "budget.tokens", "tv.preemption", "budget",
               "tv.allocation", "live", "tv", "bmc", "mem")


def _cost_rank(name: str) -> int:
    return next((i for i, p in enumerate(_SLOW_FIRST) if name.startswith(p)), len(_SLOW_FIRST))


def _run_one(args: tuple[str, str, str | None]) -> ProofRow:
    bound, name, trace_dir = args
    thunk = dict(_catalogue(bound, trace_dir))[name]
    t0 = time.perf_counter()
    try:
        return thunk()
    except Exception as e:  # a proof that crashes is a failed row, not a crashed table
        return ProofRow(name, "(error)", "vllm-v1", bound, "error", time.perf_counter() - t0,
                        f"{type(e).__name__}: {e}", "error")


def cross_checks(bound: str = "ci") -> dict[str, int]:
    """Tie the hand-written models to the code on concrete inputs; raises on a disagreement.

    Returns how many concrete transitions / steps / inputs each check compared.
    """
    from invariants.proofs import memory, stepmodel, translation

    scale = BOUNDS[bound]["cross"]
    return {
        "block pool model vs spec/kv.py (transitions)": memory.cross_check(300 * scale),
        "step model vs SpecEngine (steps)": stepmodel.cross_check(15 * scale),
        "Z3 xp stand-in vs gpu_engine.xp numpy/torch (inputs)": translation.cross_check_xp(50 * scale),
        "formulas on Z3 terms vs numpy/torch (inputs)": translation.cross_check_formulas(50 * scale),
    }


def run_proofs(bound: str = "ci", only: Iterable[str] | None = None, trace_dir: str | None = None,
               jobs: int = 1, progress: Callable[[ProofRow], None] | None = None) -> list[ProofRow]:
    """Run the shipped proofs at ``bound`` ("ci" or "long"); one row each, in table order.

    ``only``: names or prefixes (``"mem"``, ``"tv.admission"``).  ``trace_dir``:
    where BMC witnesses are written (``bmc_*.jsonl``; not written when None).
    ``jobs``: worker processes (proofs are independent; Z3 is single-threaded).
    ``progress(row)`` is called as each row completes.
    """
    if bound not in BOUNDS:
        raise KeyError(f"unknown bound {bound!r} (known: {', '.join(BOUNDS)})")
    names = _selected(proof_names(bound), only)
    # slowest first, so that the pool's last proofs are short ones (results keep table order)
    work = sorted(((bound, n, trace_dir) for n in names), key=lambda w: _cost_rank(w[1]))
    rows: dict[str, ProofRow] = {}
    if jobs > 1 and len(work) > 1:
        import multiprocessing

        from concurrent.futures import as_completed

        # spawn, not fork: each worker starts with a clean Z3 context and no torch threads
        # (a script calling this with jobs > 1 needs the usual ``if __name__ == "__main__":``)
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_run_one, w): w[1] for w in work}
            for fut in as_completed(futures):
                row = fut.result()
                rows[futures[fut]] = row
                if progress:
                    progress(row)
    else:
        for w in work:
            row = _run_one(w)
            rows[w[1]] = row
            if progress:
                progress(row)
    return [rows[n] for n in names]


def all_ok(rows: Iterable[ProofRow]) -> bool:
    """Every row gave what the shipped spec and engine should give."""
    return all(r.ok for r in rows)
