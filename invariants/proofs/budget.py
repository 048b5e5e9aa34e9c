"""Budget proofs: one step never exceeds the token budget or ``max_num_seqs``.

For every state of up to K requests (each running or waiting, any lengths,
computed counts, prefix hits, priorities and orders) and every knob value
(budget, long-prefill threshold, max_num_seqs, max_model_len, chunked prefill
on/off, watermark, admit-after-preempt), and for *every* outcome of every
allocation (memory is an adversary, :class:`~invariants.proofs.stepmodel.OracleMemory`:
any allocation may fail, so preemptions happen in every possible pattern),
the step of :mod:`invariants.proofs.stepmodel` — the spec's loops calling the
spec's own ``chunk_size`` / ``model_len_cap`` / ``long_prefill_cap`` — schedules

* BUDGET.TOKENS_LE_BUDGET: Σ scheduled tokens ≤ max_num_batched_tokens, and each
  scheduled request gets between 1 and its remaining tokens (VLLM-16, VLLM-18,
  MSGL-04, TRT-01, TRT-02);
* SEQ.MAX_NUM_SEQS: at most max_num_seqs requests run after the step, given at
  most that many before (VLLM-16);
* PREEMPT.NOT_SCHEDULED: a request preempted in a step is not in its batch
  (VLLM-01, VLLM-02), for the profile's ``admit_after_preempt = False``.

Assumed (state invariants checked elsewhere): running requests have
``0 ≤ computed < tokens``; waiting requests hold nothing and computed = 0; a
prefix hit leaves at least one token to compute (CACHE.HIT_NOT_WHOLE).
"""
from __future__ import annotations

from typing import Any

import z3

from invariants.proofs import stepmodel as SM
from invariants.proofs.common import (
    AND, COUNT, EQ, LE, LT, NOT, OR, PROVED, SUM, ProofRow, Timer, check_unsat, ite, value,
)
from invariants.proofs.symex import Sym, SymBool, term

PROFILE = "vllm-v1"
BOUNDS = {"ci": 4, "long": 6}


def symbolic_step_input(K: int, policy: str, running: int, block_size: int = 2, max_hits: int = 2, tag: str = ""):
    """A symbolic configuration and pre-step state of K requests, with its preconditions.

    Slots ``0..running-1`` are running, in running-list order; the others wait, in
    FCFS queue order.  This loses nothing: slots are only names, and any state is
    a relabelling of one of these (the properties do not mention slot numbers).
    Under "priority" the queue order and the victim order come from the symbolic
    priorities and arrival numbers instead.
    """
    B, T, S, L, W = (Sym(f"{tag}{x}") for x in ("budget", "threshold", "max_num_seqs", "max_model_len", "watermark"))
    cfg = SM.Cfg(budget=B, threshold=T, max_num_seqs=S, max_model_len=L, block_size=block_size,
                 usable_blocks=Sym(f"{tag}usable"), chunked=SymBool(z3.Bool(f"{tag}chunked")), full_isl=True,
                 watermark_blocks=W, admit_after_preempt=SymBool(z3.Bool(f"{tag}admit_after_preempt")),
                 policy=policy, max_hits=max_hits)
    pre = [LE(1, B), LE(0, T), LE(1, S), LE(1, L), LE(0, W)]
    reqs = []
    for j in range(K):
        run = j < running
        r = SM.Req(st=SM.RUNNING if run else SM.WAITING, preempted=SymBool(z3.Bool(f"{tag}preempted{j}")),
                   tok=Sym(f"{tag}tok{j}"), comp=Sym(f"{tag}comp{j}") if run else 0,
                   held=Sym(f"{tag}held{j}") if run else 0, rkey=j, qkey=j,
                   prio=Sym(f"{tag}prio{j}") if policy == "priority" else 0,
                   aseq=Sym(f"{tag}aseq{j}") if policy == "priority" else j, nhit=Sym(f"{tag}nhit{j}"),
                   hit_refs=[Sym(f"{tag}ref{j}_{k}") for k in range(max_hits)])
        pre += [LE(1, r.tok), LE(0, r.held), LE(0, r.nhit), LE(r.nhit, max_hits),
                LE(r.nhit * block_size, r.tok - 1)]  # CACHE.HIT_NOT_WHOLE
        if run:
            pre += [LE(0, r.comp), LT(r.comp, r.tok)]
        reqs.append(r)
    if policy == "priority":
        pre += [NOT(EQ(reqs[i].aseq, reqs[j].aseq)) for i in range(K) for j in range(i)]
    pre.append(LE(running, S))  # SEQ.MAX_NUM_SEQS before the step
    state = SM.State(reqs, Sym(f"{tag}free"), -1, K)
    pre += [LE(0, state.free)]
    return cfg, state, pre


def budget_properties(cfg, before: SM.State, after: SM.State, d: SM.Decisions) -> list[tuple[str, Any]]:
    K = len(before.reqs)
    each = AND(*[OR(EQ(d.sched[j], 0), AND(LE(1, d.sched[j]), LE(d.start[j] + d.sched[j], before.reqs[j].tok)))
                 for j in range(K)])
    return [
        ("BUDGET.TOKENS_LE_BUDGET: Σ scheduled ≤ max_num_batched_tokens", LE(SUM(d.sched), cfg.budget)),
        ("BUDGET.TOKENS_LE_BUDGET: each scheduled request gets 1..remaining tokens", each),
    ]


def seqs_properties(cfg, before, after, d) -> list[tuple[str, Any]]:
    return [("SEQ.MAX_NUM_SEQS: running ≤ max_num_seqs after the step",
             LE(COUNT(EQ(r.st, SM.RUNNING) for r in after.reqs), cfg.max_num_seqs))]


def preempt_properties(cfg, before, after, d) -> list[tuple[str, Any]]:
    K = len(before.reqs)
    return [("PREEMPT.NOT_SCHEDULED: a request preempted in a step is not in its batch",
             AND(*[IMPLIES_(LE(0, d.victim_seq[j]), EQ(d.sched[j], 0)) for j in range(K)]))]


def IMPLIES_(a, b):
    return OR(NOT(a), b)


def _describe(model, cfg, s: SM.State, d: SM.Decisions) -> str:
    v = lambda x: value(model, x)  # noqa: E731
    knobs = (f"budget={v(cfg.budget)} threshold={v(cfg.threshold)} max_num_seqs={v(cfg.max_num_seqs)} "
             f"max_model_len={v(cfg.max_model_len)} chunked={v(cfg.chunked)} "
             f"admit_after_preempt={v(cfg.admit_after_preempt)} policy={cfg.policy}")
    lines = [knobs]
    for j, r in enumerate(s.reqs):
        st = {SM.RUNNING: "running", SM.WAITING: "waiting"}.get(v(r.st), v(r.st))
        lines.append(f"  r{j}: {st} tokens={v(r.tok)} computed={v(r.comp)} hit_blocks={v(r.nhit)} "
                     f"rkey={v(r.rkey)} qkey={v(r.qkey)} prio={v(r.prio)} -> scheduled {v(d.sched[j])} "
                     f"from {v(d.start[j])}{' (preempted)' if v(d.victim_seq[j]) >= 0 else ''}"
                     f"{' (admitted)' if v(d.admitted[j]) else ''}")
    return "\n".join(lines)


def prove_step_property(name: str, prop: str, props, K: int, policy: str, rules: dict | None = None,
                        fix: dict | None = None, self_preempt: str = "stop", impl: dict | None = None) -> ProofRow:
    """For each number of running requests (0..K): build the symbolic step and check
    ``pre ∧ ¬props`` unsat."""
    status, cex = PROVED, ""
    with Timer() as t:
        for running in range(K + 1):
            cfg, s0, pre = symbolic_step_input(K, policy, running)
            cfg.self_preempt = self_preempt
            for k, v in (fix or {}).items():
                setattr(cfg, k, v)
            s1, d = SM.schedule(s0, cfg, SM.OracleMemory(), rules=rules, impl=impl)
            checks = props(cfg, s0, s1, d)
            status, model = check_unsat(pre + [NOT(AND(*[c for _, c in checks]))])
            if model is not None:
                broken = [label for label, c in checks if value(model, c) is not True]
                cex = "violates " + "; ".join(broken) + "\n" + _describe(model, cfg, s0, d)
            if status != PROVED:
                break
    knobs = ", ".join(f"{k}={v}" for k, v in (fix or {}).items())
    bound = f"K≤{K} requests (running or waiting), all knob values{'; ' + knobs if knobs else ''}, any allocation outcome"
    return ProofRow(name, prop, PROFILE, bound, status, t.seconds, cex, "budget",
                    {"policy": policy, "self_preempt": self_preempt})


def prove_budget(K: int = 4, policy: str = "fcfs", rules: dict | None = None, self_preempt: str = "stop",
                 impl: dict | None = None) -> ProofRow:
    """BUDGET.TOKENS_LE_BUDGET after the step's running phase, preemptions and admissions."""
    tag = policy if policy == "fcfs" else f"{policy}, self-preempt {self_preempt}"
    return prove_step_property(f"budget.tokens.{policy}" + ("" if self_preempt == "stop" else f".{self_preempt}"),
                               f"BUDGET.TOKENS_LE_BUDGET ({tag}): Σ scheduled ≤ budget, each in [1, remaining]",
                               budget_properties, K, policy, rules, self_preempt=self_preempt, impl=impl)


def prove_max_num_seqs(K: int = 4, policy: str = "fcfs", rules: dict | None = None, impl: dict | None = None) -> ProofRow:
    """SEQ.MAX_NUM_SEQS is preserved by the step."""
    return prove_step_property(f"budget.seqs.{policy}", f"SEQ.MAX_NUM_SEQS ({policy}): running ≤ max_num_seqs after the step",
                               seqs_properties, K, policy, rules, impl=impl)


def prove_preempted_not_scheduled(K: int = 4, policy: str = "priority", rules: dict | None = None,
                                  admit_after_preempt=False, impl: dict | None = None) -> ProofRow:
    """PREEMPT.NOT_SCHEDULED: a victim is never in the batch of the step that preempted it,
    even under "priority", where the victim may have been scheduled earlier in the step."""
    return prove_step_property(f"budget.preempted.{policy}", f"PREEMPT.NOT_SCHEDULED ({policy}): a victim is not in its step's batch",
                               preempt_properties, K, policy, rules, fix={"admit_after_preempt": admit_after_preempt},
                               impl=impl)


PROOFS = {
    "budget.tokens.fcfs": lambda K=4, **kw: prove_budget(K, "fcfs", **kw),
    "budget.tokens.priority": lambda K=4, **kw: prove_budget(K, "priority", **kw),
    "budget.tokens.priority.continue": lambda K=4, **kw: prove_budget(K, "priority", self_preempt="continue", **kw),
    "budget.seqs.fcfs": lambda K=4, **kw: prove_max_num_seqs(K, "fcfs", **kw),
    "budget.seqs.priority": lambda K=4, **kw: prove_max_num_seqs(K, "priority", **kw),
    "budget.preempted.priority": lambda K=4, **kw: prove_preempted_not_scheduled(K, "priority", **kw),
}


# --------------------------------------------------------------------------
# liveness: with the rejection rules, an idle engine always admits
# --------------------------------------------------------------------------


def prove_no_idle_stall(K: int = 3, policy: str = "fcfs", rules: dict | None = None, block_size: int = 2,
                        max_hits: int = 2) -> ProofRow:
    """LIVE.NO_IDLE_STALL: if nothing runs and requests wait, the step admits one.

    For every queue of up to K requests that passed the spec's own rejection
    rules at arrival (``prompt_too_long`` and ``never_fits``, lifted from
    ``spec/scheduler.py``) — new ones, and preempted ones that already produced
    outputs (fewer than max_tokens, fewer than max_model_len tokens) — with any
    prefix hits (all evictable: nothing runs, so nothing holds blocks) and any
    knob values, the step admits the queue head.  This is the whole-state
    version of the BMC search: no trace of any length reaches the stall that
    ``bmc.livelock.no_reject`` reaches without the rules (VLLM-05, TGI-01, MSGL-05).
    ``rules`` may replace ``never_fits`` / ``prompt_too_long`` (mutants).
    """
    from invariants.proofs import lifted

    nf = (rules or {}).get("never_fits") or lifted.never_fits(block_size)
    ptl = (rules or {}).get("prompt_too_long") or lifted.prompt_too_long()
    status, cex = PROVED, ""
    with Timer() as t:
        B, T, S, L, W, U = (Sym(x) for x in ("budget", "threshold", "max_num_seqs", "max_model_len", "watermark", "usable"))
        chunked = SymBool(z3.Bool("chunked"))
        cfg = SM.Cfg(budget=B, threshold=T, max_num_seqs=S, max_model_len=L, block_size=block_size, usable_blocks=U,
                     chunked=chunked, full_isl=True, watermark_blocks=W, policy=policy, max_hits=max_hits)
        pre = [LE(1, B), LE(0, T), LE(1, S), LE(2, L), LE(0, W), LE(1, U),
               OR(chunked, LE(L, B))]  # config.validate: chunked prefill off needs budget >= max_model_len
        reqs = []
        for j in range(K):
            prompt, maxt, out = Sym(f"prompt{j}"), Sym(f"max_tokens{j}"), Sym(f"outputs{j}")
            r = SM.Req(st=SM.WAITING, preempted=SymBool(z3.Bool(f"preempted{j}")), tok=prompt + out, rkey=j, qkey=j,
                       prio=Sym(f"prio{j}") if policy == "priority" else 0,
                       aseq=Sym(f"aseq{j}") if policy == "priority" else j, nhit=Sym(f"nhit{j}"),
                       hit_refs=[0] * max_hits, prompt=prompt, max_tokens=maxt)
            pre += [LE(1, prompt), LE(1, maxt), LE(0, out), LT(out, maxt),
                    NOT(ptl(prompt, L)), NOT(nf(prompt, maxt, L, U)),  # admitted at arrival: REJECT.* said no
                    OR(EQ(out, 0), LT(prompt + out, L)),  # STOP.LENGTH would have finished it
                    LE(0, r.nhit), LE(r.nhit, max_hits), LE(r.nhit * block_size, r.tok - 1), LE(r.nhit, U)]
            reqs.append(r)
        if policy == "priority":
            pre += [NOT(EQ(reqs[i].aseq, reqs[j].aseq)) for i in range(K) for j in range(i)]
        s0 = SM.State(reqs, U, -1, K)  # nothing runs: every usable block is in the free queue
        s1, d = SM.schedule(s0, cfg)
        checks = [("LIVE.NO_IDLE_STALL: an idle engine admits its queue head", OR(*d.admitted))]
        status, model = check_unsat(pre + [NOT(AND(*[c for _, c in checks]))])
        if model is not None:
            v = lambda x: value(model, x)  # noqa: E731
            cex = (f"nothing admitted: budget={v(B)} max_model_len={v(L)} usable_blocks={v(U)} chunked={v(chunked)} "
                   f"threshold={v(T)}\n" + "\n".join(
                       f"  r{j}: prompt={v(r.prompt)} max_tokens={v(r.max_tokens)} tokens={v(r.tok)} hit_blocks={v(r.nhit)}"
                       for j, r in enumerate(reqs)))
    return ProofRow(f"live.no_idle_stall.{policy}",
                    f"LIVE.NO_IDLE_STALL ({policy}): with REJECT.* at arrival, an idle engine admits its queue head",
                    PROFILE, f"K≤{K} queued requests (new or preempted), ≤{max_hits} hit blocks each, all knob values",
                    status, t.seconds, cex, "budget")


PROOFS["live.no_idle_stall.fcfs"] = lambda K=3, **kw: prove_no_idle_stall(K, "fcfs", **kw)
