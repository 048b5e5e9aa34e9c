"""Exhaustive small-bound checks of what the SLO-aware policies promise (issue 19).

Unlike the Z3 rows, these run the spec itself (:class:`spec.scheduler.SpecEngine`) on
*every* trace of a small family and check a property of each whole run; a row is
``proved`` for that family when no trace breaks it, and names the first trace that does
otherwise.  The families are stated in each row's ``bound``.

* ``slo.edf_ac.deadline`` — SLO admission control is sound and exact when the per-step cost
  is as modelled (a request, once admitted, gets the whole token budget every step: it runs
  alone).  A request R with a TTFT target waits behind a blocker X (no target, max_num_seqs
  = 1), then runs alone.  Under ``edf-ac`` R is either refused, or it meets its deadline
  (**sound**: SLO.ADMITTED_FEASIBLE implies the deadline is met); and R is refused exactly
  when the same trace under ``edf`` (no admission control) misses R's deadline (**exact**:
  nothing that could have made it is refused).
* ``slo.sprpt.overtaking`` — under ``sprpt`` with aging, QUEUE.AGING_BOUNDED_OVERTAKING
  holds at every step of every trace of the family (a long request's wait stays bounded),
  checked by the spec's own per-step invariant checks.
* ``slo.edf.order`` — under ``edf`` (with and without deferral), QUEUE.EDF_ORDER and
  SLO.ADMITTED_FEASIBLE hold at every step of every trace of the family.
"""
from __future__ import annotations

import itertools
import time

from invariants.proofs.common import COUNTEREXAMPLE, PROVED, ProofRow
from spec.formats import Trace, TraceRequest
from spec.invariants import InvariantViolation
from spec.scheduler import run

#: Family sizes per bound: (max prompt, max budget, max ttft, blockers) for the deadline row;
#: (predicted lengths, arrival steps, requests) for the trace families.
SIZES = {
    "ci": {"deadline": (9, 4, 6), "family": (3, 3, 3)},
    "long": {"deadline": (16, 6, 10), "family": (4, 4, 3)},
}

_BASE = {"block_size": 4, "num_blocks": 65, "max_model_len": 128, "enable_prefix_caching": False}


def _trace(config: dict, *requests: TraceRequest) -> Trace:
    return Trace(config={**_BASE, **config}, requests=list(requests), vocab_size=1000, eos_token_id=2)


def _first_token_step(records, rid: str) -> int:
    """The step that sampled ``rid``'s first token (a huge number when it never did)."""
    return next((r.step for r in records if rid in r.sampled), 10**9)


def check_deadline(max_prompt: int, max_budget: int, max_ttft: int) -> tuple[int, str]:
    """Run the ``slo.edf_ac.deadline`` family; return (traces checked, first counterexample or "")."""
    blockers = (None, (2, 2), (3, 1), (1, 3))  # X: (prompt, max_tokens); it holds the one seat meanwhile
    n = 0
    for budget, p, ttft, blocker in itertools.product(range(1, max_budget + 1), range(1, max_prompt + 1),
                                                      range(1, max_ttft + 1), blockers):
        reqs = ([TraceRequest(id="X", prompt_len=blocker[0], max_tokens=blocker[1], arrival_step=0)] if blocker else []) \
            + [TraceRequest(id="R", prompt_len=p, max_tokens=2, arrival_step=0, ttft_slo=ttft)]
        cfg = {"max_num_batched_tokens": budget, "max_num_seqs": 1}
        where = f"budget {budget}, R prompt {p} ttft {ttft}, blocker {blocker}"
        n += 1
        try:
            ac = run(_trace({"profile": "edf-ac", **cfg}, *reqs), check_invariants=True)
            plain = run(_trace({"profile": "edf", **cfg}, *reqs), check_invariants=True)
        except InvariantViolation as e:
            return n, f"{where}: {e}"
        deadline = ttft - 1  # arrival 0
        refused = any(rid == "R" for rec in ac for rid, _ in rec.rejected)
        met_plain = _first_token_step(plain, "R") <= deadline
        if not refused and _first_token_step(ac, "R") > deadline:
            return n, f"{where}: admitted by edf-ac, first token at step {_first_token_step(ac, 'R')} > deadline {deadline}"
        if refused == met_plain:
            return n, (f"{where}: edf-ac {'refused' if refused else 'admitted'} R, but alone under edf it "
                       f"{'meets' if met_plain else 'misses'} the deadline {deadline}")
    return n, ""


def _family(preds: int, arrivals: int, count: int):
    """Every trace of ``count`` one-token-prompt requests with predicted lengths 0..preds-1
    (max_tokens = predicted + 1) and arrival steps 0..arrivals-1 (in arrival order)."""
    for arr in itertools.combinations_with_replacement(range(arrivals), count):
        for pred in itertools.product(range(preds), repeat=count):
            yield [TraceRequest(id=f"r{i}", prompt_len=1 + (i % 2), max_tokens=pred[i] + 1, arrival_step=arr[i],
                                predicted_output_len=pred[i], ttft_slo=pred[i] + 1 + arr[i] % 2, tpot_slo=1 + i % 2)
                   for i in range(count)]


def check_family(configs: list[dict], preds: int, arrivals: int, count: int) -> tuple[int, str]:
    """Run every trace of the family under each config with the spec's per-step invariants on."""
    n = 0
    for cfg in configs:
        for reqs in _family(preds, arrivals, count):
            n += 1
            try:
                run(_trace(cfg, *reqs), check_invariants=True)
            except InvariantViolation as e:
                shown = ", ".join(f"{r.id}@{r.arrival_step} pred {r.predicted_output_len}" for r in reqs)
                return n, f"{cfg}: [{shown}]: {e}"
    return n, ""


def _row(name: str, prop: str, profile: str, bound: str, t0: float, n: int, cex: str) -> ProofRow:
    return ProofRow(name, prop, profile, f"{bound} ({n} traces)", COUNTEREXAMPLE if cex else PROVED,
                    time.perf_counter() - t0, cex, "exhaustive")


def prove_deadline(bound: str = "ci") -> ProofRow:
    t0 = time.perf_counter()
    p, b, t = SIZES[bound]["deadline"]
    n, cex = check_deadline(p, b, t)
    return _row("slo.edf_ac.deadline", "SLO.ADMITTED_FEASIBLE: admitted => TTFT deadline met when served alone; "
                "refused <=> edf alone misses", "edf-ac",
                f"prompt <= {p}, budget <= {b}, ttft <= {t}, 4 blockers", t0, n, cex)


def prove_sprpt_overtaking(bound: str = "ci") -> ProofRow:
    t0 = time.perf_counter()
    preds, arrivals, count = SIZES[bound]["family"]
    configs = [{"profile": "sprpt", "aging_steps": a, "max_num_seqs": 1, "max_num_batched_tokens": 4} for a in (1, 2)]
    n, cex = check_family(configs, preds, arrivals, count)
    return _row("slo.sprpt.overtaking", "QUEUE.AGING_BOUNDED_OVERTAKING under sprpt", "sprpt",
                f"{count} requests, predicted < {preds}, arrivals < {arrivals}, aging 1|2", t0, n, cex)


def prove_edf_order(bound: str = "ci") -> ProofRow:
    t0 = time.perf_counter()
    preds, arrivals, count = SIZES[bound]["family"]
    configs = [{"profile": "edf", "max_num_seqs": s, "max_num_batched_tokens": 2, "num_blocks": 5} for s in (1, 2)] + \
              [{"profile": "edf-ac", "max_num_seqs": 1, "max_num_batched_tokens": 2},
               {"profile": "edf", "slo_admission": "defer", "max_num_seqs": 1, "max_num_batched_tokens": 2}]
    n, cex = check_family(configs, preds, arrivals, count)
    return _row("slo.edf.order", "QUEUE.EDF_ORDER and SLO.ADMITTED_FEASIBLE at every step", "edf, edf-ac",
                f"{count} requests, predicted < {preds}, arrivals < {arrivals}, 4 configs", t0, n, cex)


PROOFS = {"slo.edf_ac.deadline": prove_deadline, "slo.sprpt.overtaking": prove_sprpt_overtaking,
          "slo.edf.order": prove_edf_order}
