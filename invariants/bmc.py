"""Bounded model checking: Z3 searches for the shortest trace that reaches a bad state.

The transition system is the spec's step (:mod:`invariants.proofs.stepmodel`:
the spec's loops calling the spec's own rules, cross-checked against
``SpecEngine``) unrolled ``k`` times for a small configuration.  The requests'
prompt lengths, output lengths, arrival steps and priorities are free
variables: Z3 chooses the workload.  For ``k = 1, 2, …`` it asks whether a bad
state is reachable within ``k`` steps; the first ``k`` that answers yes gives a
shortest witness, which is written as a batchspec trace file.  Replaying that
file with ``batchspec run`` (or :func:`spec.scheduler.run`) shows the problem.

Searches (each returns a :class:`BmcResult`):

* :func:`find_livelock` — "a request waits forever" (LIVE.NO_IDLE_STALL;
  real bugs VLLM-05, TGI-01, MSGL-05): nothing is running, a request waits,
  and the step admits nobody, with every prompt fitting the empty pool, when
  ``reject_unservable`` is off.  The spec's REJECT.NEVER_FITS rule exists
  because of this trace: with it on, the request is rejected at arrival.
* :func:`find_starvation` — under the "priority" policy a low-priority request
  is passed over by a stream of later, more important arrivals (SGL-10,
  LMD-04): it is still waiting after ``passes`` later requests were admitted
  ahead of it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import z3

from invariants.proofs import stepmodel as SM
from invariants.proofs.common import (
    AND, COUNT, COUNTEREXAMPLE, EQ, LE, LT, NOT, OR, PROVED, ProofRow, ite, term, value,
)
from invariants.proofs.symex import Sym

PROFILE = "vllm-v1"


@dataclass
class BmcResult:
    name: str
    found: bool
    steps: int | None  # length of the shortest witness (steps executed), None if none within the bound
    bound: int
    seconds: float
    trace: Any = None  # spec.formats.Trace
    path: str | None = None
    description: str = ""
    details: dict = field(default_factory=dict)


def _config(**over) -> dict:
    base = {"profile": "vllm-v1", "num_blocks": 5, "block_size": 2, "max_num_batched_tokens": 8, "max_num_seqs": 4,
            "max_model_len": 32, "enable_prefix_caching": False, "reject_unservable": True, "max_steps": 50}
    base.update(over)
    return base


def _search(config: dict, K: int, max_steps: int, bad_at, extra_pre=None, max_prompt: int = 12, max_tokens: int = 6,
            max_arrival: int = 6, priorities: list | None = None, rules: dict | None = None, impl: dict | None = None):
    """Unroll the step; return (k, model, symbols) for the smallest k with ``bad_at(...)`` satisfiable."""
    from spec.config import resolve

    c = resolve(config)
    cfg = SM.Cfg.from_config(c)
    prompts = [Sym(f"prompt{j}") for j in range(K)]
    maxtok = [Sym(f"max_tokens{j}") for j in range(K)]
    arrivals = [Sym(f"arrival{j}") for j in range(K)]
    prios = priorities if priorities is not None else [0] * K
    s = SM.initial(cfg, prompts, maxtok, arrivals, prios)
    solver = z3.Solver()
    for j in range(K):
        solver.add(term(AND(LE(1, prompts[j]), LE(prompts[j], max_prompt), LE(1, maxtok[j]), LE(maxtok[j], max_tokens),
                            LE(0, arrivals[j]), LE(arrivals[j], max_arrival))))
    for c_ in (extra_pre(cfg, s, prompts, maxtok, arrivals) if extra_pre else []):
        solver.add(term(c_))
    history = []
    for k in range(max_steps):
        s_before = s
        s, info = SM.step(s, cfg, k, rules=rules, impl=impl)
        history.append((s_before, s, info))
        bad = bad_at(k, history, cfg)
        solver.push()
        solver.add(term(bad))
        r = solver.check()
        if r == z3.sat:
            m = solver.model()
            solver.pop()
            return k + 1, m, (prompts, maxtok, arrivals, prios), history
        solver.pop()
    return None, None, (prompts, maxtok, arrivals, prios), history


def _story(trace, steps: int) -> str:
    """What the spec does in the witness's first steps, in one line per step."""
    from dataclasses import replace as dc_replace

    from spec.protocol import StepLimitError
    from spec.scheduler import run

    try:
        recs = run(dc_replace(trace, config={**trace.config, "max_steps": steps + 1}))
    except StepLimitError as e:
        recs = e.records
    parts = []
    for r in recs[: steps + 1]:
        bits = [" ".join(f"{rid}:{n}" for rid, n in r.scheduled) or "nothing scheduled"]
        bits += [f"admits {' '.join(r.new + r.resumed)}"] if (r.new or r.resumed) else []
        bits += [f"preempts {' '.join(r.preempted)}"] if r.preempted else []
        bits += [f"finishes {' '.join(x for x, _ in r.finished)}"] if r.finished else []
        bits += [f"rejects {' '.join(x for x, _ in r.rejected)}"] if r.rejected else []
        parts.append(f"step {r.step}: " + ", ".join(bits) + f" ({r.num_free_blocks} blocks free)")
    return "; ".join(parts)


def _trace(config: dict, m, syms, name: str, description: str):
    from spec.formats import Trace, TraceRequest

    prompts, maxtok, arrivals, prios = syms
    reqs = [TraceRequest(id=f"r{j}", prompt_len=value(m, prompts[j]), max_tokens=value(m, maxtok[j]),
                         arrival_step=value(m, arrivals[j]), priority=value(m, prios[j]), ignore_eos=True)
            for j in range(len(prompts))]
    # trace files list requests in arrival order; ties keep slot order, as the model's add order does
    reqs.sort(key=lambda r: r.arrival_step)
    return Trace(config=dict(config), requests=reqs, name=name, description=description)


def _describe(trace, steps: int, what: str):
    trace.description = f"{what} What happens: {_story(trace, steps)}."
    return trace


def _shortest(config: dict, max_requests: int, max_steps: int, bad_at, extra_pre=None, priorities=None, **kw):
    """The fewest steps, then the fewest requests, that reach a bad state (``kw``: mutants for every step)."""
    best = None
    for K in range(1, max_requests + 1):
        prios = priorities(K) if priorities else None
        k, m, syms, _ = _search(config, K, max_steps if best is None else best[0] - 1 if best[0] > 1 else 0,
                                bad_at, extra_pre, priorities=prios, **kw)
        if k is not None and (best is None or k < best[0]):
            best = (k, m, syms)
    return best


def find_livelock(max_steps: int = 12, max_requests: int = 2, out: str | Path | None = None,
                  rules: dict | None = None, impl: dict | None = None, **config) -> BmcResult:
    """Shortest trace to a permanent idle stall (LIVE.NO_IDLE_STALL).

    Bad state at step ``k``: every request has arrived, nothing is running, a
    request is waiting, and the step admits nobody.  The pool is then entirely
    free and nothing else can change, so the waiting request waits forever
    (the spec raises LIVE.NO_IDLE_STALL, or StepLimitError without checks).
    Every prompt must fit the empty pool, so the stall is not the trivial
    "prompt larger than the cache" case: the request has to grow into it.
    With ``reject_unservable`` on (the profile's value) no such trace exists
    within the bound; pass ``reject_unservable=False`` to find one.
    """
    cfgd = _config(**config)
    t0 = time.perf_counter()

    def fits(cfg, s, prompts, maxtok, arrivals):
        return [LE(prompts[j], cfg.usable_blocks * cfg.block_size) for j in range(len(prompts))]

    def bad_at(k, history, cfg):
        before, after, info = history[-1]
        d = info["decisions"]
        arrived = AND(*[LE(r.arrival, k) for r in after.reqs])
        return AND(arrived, info["starved"], NOT(OR(*d.admitted)))

    best = _shortest(cfgd, max_requests, max_steps, bad_at, fits, rules=rules, impl=impl)
    res = BmcResult("bmc.livelock" + ("" if cfgd["reject_unservable"] else ".no_reject"), best is not None,
                    best and best[0], max_steps, 0.0, details={"config": cfgd, "max_requests": max_requests})
    if best is not None:
        k, m, syms = best
        desc = (f"Found by Z3 bounded model checking (invariants.bmc.find_livelock): the shortest trace, {k} steps, "
                "after which a request that fits the empty pool waits forever with reject_unservable off "
                "(LIVE.NO_IDLE_STALL). With reject_unservable on, REJECT.NEVER_FITS rejects it at arrival.")
        res.trace = _describe(_trace(cfgd, m, syms, "bmc-livelock", desc), k, desc)
        res.description = res.trace.description
        res.path = _write(res.trace, out)
    res.seconds = time.perf_counter() - t0
    return res


def find_passing(max_steps: int = 10, passes: int = 3, max_requests: int = 4, out: str | Path | None = None,
                 rules: dict | None = None, impl: dict | None = None, **config) -> BmcResult:
    """Shortest trace where request r0 waits while ``passes`` later arrivals are admitted ahead of it.

    Under "priority" (r0 has priority 1, the others 0) this is starvation by
    design of the policy (SGL-10, LMD-04), and Z3 finds the shortest stream of
    arrivals that does it.  Under "fcfs" no such trace exists within the bound:
    FCFS never passes an earlier arrival (QUEUE.FCFS_SORTED).
    """
    cfgd = _config(**{"max_num_seqs": 1, "reject_unservable": True, "policy": "priority", **config})
    t0 = time.perf_counter()

    def bad_at(k, history, cfg):
        passed = 0
        for before, after, info in history:
            d = info["decisions"]
            # r0 waited through this step: queued after the arrivals, not admitted
            waited = AND(EQ(after.reqs[0].st, SM.WAITING), NOT(d.admitted[0]))
            for j in range(1, len(after.reqs)):
                later = LT(after.reqs[0].aseq, after.reqs[j].aseq)
                passed = passed + ite(AND(d.admitted[j], waited, later), 1, 0)
        return LE(passes, passed)

    best = _shortest(cfgd, max_requests, max_steps, bad_at,
                     priorities=lambda K: [1] + [0] * (K - 1) if cfgd["policy"] == "priority" else None,
                     rules=rules, impl=impl)
    res = BmcResult(f"bmc.passing.{cfgd['policy']}", best is not None, best and best[0], max_steps, 0.0,
                    details={"config": cfgd, "max_requests": max_requests})
    if best is not None:
        k, m, syms = best
        desc = (f"Found by Z3 bounded model checking (invariants.bmc.find_passing): the shortest trace, {k} steps, "
                f"in which request r0 waits while {passes} later requests are admitted ahead of it "
                f"({cfgd['policy']} policy, max_num_seqs={cfgd['max_num_seqs']})"
                + (": starvation under priority (SGL-10, LMD-04)." if cfgd["policy"] == "priority"
                   else ": FCFS admission passed an earlier arrival (QUEUE.FCFS_SORTED)."))
        res.trace = _describe(_trace(cfgd, m, syms, f"bmc-passing-{cfgd['policy']}", desc), k, desc)
        res.description = res.trace.description
        res.path = _write(res.trace, out)
    res.seconds = time.perf_counter() - t0
    return res


def find_starvation(max_steps: int = 10, passes: int = 3, max_requests: int = 4, out: str | Path | None = None,
                    **config) -> BmcResult:
    """:func:`find_passing` under the "priority" policy."""
    return find_passing(max_steps, passes, max_requests, out, policy="priority", **config)


def _write(trace, out) -> str | None:
    if out is None:
        return None
    from spec.io import write_trace

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_trace(trace, out)
    return str(out)


# --------------------------------------------------------------------------
# replay: the spec shows the problem
# --------------------------------------------------------------------------


def replay_livelock(trace) -> dict:
    """Replay a livelock witness through the real spec three ways.

    Returns what happened: ``checked`` (invariants on: the violated invariant id),
    ``unchecked`` (invariants off: "StepLimitError" if it never terminates) and
    ``rejecting`` (reject_unservable on: the requests rejected at arrival)."""
    from dataclasses import replace as dc_replace

    from spec.invariants import InvariantViolation
    from spec.protocol import StepLimitError
    from spec.scheduler import run

    out: dict = {}
    try:
        run(trace, check_invariants=True)
        out["checked"] = None
    except InvariantViolation as e:
        out["checked"] = e.invariant_id
    try:
        run(trace)
        out["unchecked"] = None
    except StepLimitError:
        out["unchecked"] = "StepLimitError"
    fixed = dc_replace(trace, config={**trace.config, "reject_unservable": True})
    recs = run(fixed, check_invariants=True)
    out["rejecting"] = [(rid, why) for r in recs for rid, why in r.rejected]
    return out


def replay_starvation(trace, request: str = "r0") -> dict:
    """Replay a starvation witness; count how many later arrivals were admitted
    while ``request`` waited, and when it was finally admitted."""
    from spec.scheduler import run

    recs = run(trace, check_invariants=True)
    arrival = {r.id: r.arrival_step for r in trace.requests}
    order = {r.id: i for i, r in enumerate(sorted(trace.requests, key=lambda r: r.arrival_step))}
    admitted_at = None
    passed = []
    for rec in recs:
        if request in rec.new:
            admitted_at = rec.step
            break
        if rec.step >= arrival[request]:
            passed += [rid for rid in rec.new if order[rid] > order[request]]
    return {"passed_over_by": passed, "admitted_at": admitted_at, "arrival": arrival[request]}


def as_row(res: BmcResult, prop: str, exists: bool = False) -> ProofRow:
    """The table row of a search.

    ``exists=False`` (a safety claim, "no trace within the bound reaches the bad
    state"): proved when Z3 finds none, a counterexample (the trace) when it does.
    ``exists=True`` (a reachability claim, "some trace within the bound reaches
    it", e.g. why a rule exists): proved by the witness Z3 finds, which is then
    the row's evidence and is written as a trace file; a counterexample (no such
    trace within the bound) otherwise.
    """
    text = ""
    if res.found:
        reqs = ", ".join(f"{r.id}(prompt {r.prompt_len}, max_tokens {r.max_tokens}, arrives {r.arrival_step}"
                         + (f", priority {r.priority}" if r.priority else "") + ")" for r in res.trace.requests)
        text = f"shortest witness: {res.steps} steps; {reqs}" + (f"; written to {res.path}" if res.path else "")
        status = PROVED if exists else COUNTEREXAMPLE
    else:
        status = COUNTEREXAMPLE if exists else PROVED
        if exists:
            text = f"no trace of at most {res.bound} steps reaches it"
    cfg = res.details.get("config", {})
    bound = (f"≤{res.bound} steps, {cfg.get('num_blocks', 1) - 1} usable blocks, block size {cfg.get('block_size')}, "
             f"{res.details.get('max_requests', '?')} requests, max_num_seqs {cfg.get('max_num_seqs')}")
    return ProofRow(res.name, prop, PROFILE, bound, status, res.seconds, text, "bmc",
                    {"steps": res.steps, "path": res.path, "exists": exists})
