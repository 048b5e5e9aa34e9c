"""Translation validation: the GPU engine's closed forms equal the spec's sequential loops.

``gpu_engine.formulas`` computes a whole batch's decisions at once with prefix
sums and masks; the spec walks requests one at a time.  For every input up to a
size bound, each proof shows the two agree:

* the **engine side** is the engine's own code: the functions of
  ``gpu_engine.formulas`` (and ``Scheduler._victim_order``) are called
  unchanged, on :class:`~invariants.proofs.symex.ZArr` arrays of Z3 terms,
  with :data:`~invariants.proofs.symex.SYM_XP` standing in for
  ``gpu_engine.xp`` (:func:`cross_check_xp` checks the stand-in against the
  real numpy and torch backends, and :func:`cross_check_formulas` runs every
  formula both ways on thousands of concrete inputs).  The few lines of glue
  in ``gpu_engine/scheduler.py`` that call them (the reached prefix ``k``, the
  admission window, the free count an event sees) are transliterated here and
  marked as such;
* the **spec side** is the step model of :mod:`invariants.proofs.stepmodel`:
  the spec's loops calling the spec's own rules (lifted from ``spec/``), tied
  to ``SpecEngine`` by its concrete cross-check.

A proof explores the engine code's own branches (``if cap > 0``, ``int(k)``,
slicing by a symbolic count) with :class:`~invariants.proofs.symex.Explorer`
and asks Z3, per path, for an input where the two sides differ.
"""
from __future__ import annotations

import random
import types
from typing import Any, Callable

import numpy as np
import z3

from invariants.proofs import lifted
from invariants.proofs import stepmodel as SM
from invariants.proofs.common import (
    AND, COUNT, EQ, IMPLIES, LE, LT, NOT, OR, PROVED, COUNTEREXAMPLE, ProofRow, SUM, Timer, ite, value,
)
from invariants.proofs.symex import SYM_XP, Explorer, Sym, SymBool, ZArr, rebind, rebind_module, smin, term, wrap

PROFILE = "vllm-v1"
BOUNDS = {"ci": 4, "long": 6}


def engine_formulas(overrides: dict | None = None) -> dict:
    """``gpu_engine.formulas``' functions, rebound to run on :class:`ZArr` (``overrides``: mutants)."""
    import gpu_engine.formulas as F

    ns = rebind_module(F, {"xp": SYM_XP})
    for name, fn in (overrides or {}).items():
        ns[name] = rebind(fn, namespace=ns)  # a mutant runs on Z3 terms like the original
    return ns


def engine_victim_order():
    """``gpu_engine.scheduler.Scheduler._victim_order``, rebound to run on :class:`ZArr`."""
    from gpu_engine.scheduler import Scheduler

    return rebind(Scheduler._victim_order, {"xp": SYM_XP})


def _stub_scheduler(policy: str, priority: ZArr | None, arrival: ZArr | None):
    """The attributes ``_victim_order`` reads, for the profile's knobs (other knobs at their
    defaults: ``admission="budget"``, so not the SGLang-style ``estimate`` victim order)."""
    from gpu_engine.scheduler import Scheduler

    cfg = lifted.config_stub(policy=policy)
    stub = types.SimpleNamespace(config=cfg, priority=priority, arrival=arrival, client_times=False,
                                 estimate=getattr(cfg, "admission", "budget") == "estimate",
                                 slack_victim=False,  # the policy's victim, not the SLO-slack one
                                 be=types.SimpleNamespace(numpy=True, arange=lambda n, start=0: np.arange(start, start + n)))
    # the engine's own tie key, run on Z3 terms (no client arrival times: ties go by arrival)
    stub._victim_ties = types.MethodType(rebind(Scheduler._victim_ties, {"xp": SYM_XP}), stub)
    return stub


def _per_path(pre: list, paths, prop: Callable[[Any], list[tuple[str, Any]]], describe: Callable) -> tuple[str, str]:
    """Check ``pre ∧ pc ∧ ¬prop`` for every explored path."""
    s = z3.Solver()
    s.add(*[term(c) for c in pre])
    for p in paths:
        checks = prop(p.result)
        s.push()
        s.add(p.condition, z3.Not(z3.And(*[term(c) for _, c in checks])))
        r = s.check()
        if r == z3.sat:
            m = s.model()
            broken = [label for label, c in checks if value(m, c) is not True]
            out = COUNTEREXAMPLE, "differs on: " + "; ".join(broken) + "\n" + describe(m, p.result)
            s.pop()
            return out
        if r != z3.unsat:
            s.pop()
            return "unknown", "solver gave up"
        s.pop()
    return PROVED, ""


def _running_input(K: int, policy: str = "fcfs", block_size: int = 2, shared: bool = False, num_shared: int = 2):
    """K running requests in running-list order, symbolic lengths / computed / blocks.

    ``shared``: besides its own blocks, each request may hold any of ``num_shared``
    prefix-cached blocks that other running requests hold too (symbolic flags).
    """
    B, T, L, free = Sym("budget"), Sym("threshold"), Sym("max_model_len"), Sym("free")
    cfg = SM.Cfg(budget=B, threshold=T, max_num_seqs=K, max_model_len=L, block_size=block_size,
                 usable_blocks=Sym("usable"), policy=policy)
    pre = [LE(1, B), LE(0, T), LE(1, L), LE(0, free)]
    reqs = []
    for j in range(K):
        flags = [SymBool(z3.Bool(f"shares{j}_{u}")) for u in range(num_shared)] if shared else []
        own = Sym(f"own_blocks{j}")
        r = SM.Req(st=SM.RUNNING, tok=Sym(f"tok{j}"), comp=Sym(f"comp{j}"), held=own + COUNT(flags), rkey=j, qkey=j,
                   prio=Sym(f"prio{j}") if policy == "priority" else 0, aseq=Sym(f"aseq{j}") if policy == "priority" else j,
                   shared=flags)
        pre += [LE(0, r.comp), LT(r.comp, r.tok), LE(0, own)]
        if policy == "priority":
            # only the relative order of priorities (ties included) and arrivals matters to
            # either side, and values in [0, K) realise every such order
            pre += [LE(0, r.aseq), LT(r.aseq, K), LE(0, r.prio), LT(r.prio, K)]
        reqs.append(r)
    if policy == "priority":
        pre += [NOT(EQ(reqs[i].aseq, reqs[j].aseq)) for i in range(K) for j in range(i)]
    return cfg, SM.State(reqs, free, -1, K), pre


def _show(m, items) -> str:
    return ", ".join(f"{k}={value(m, v)}" for k, v in items)


# --------------------------------------------------------------------------
# phase 1: budget walk (chunking)
# --------------------------------------------------------------------------


def prove_chunking(K: int = 4, formulas: dict | None = None, rules: dict | None = None) -> ProofRow:
    """``grant_tokens(token_demand(...))`` equals the spec's running-phase token walk.

    Spec: ``_schedule_running`` with every allocation succeeding —
    ``n = model_len_cap(chunk_size(tokens - computed, cap, budget))``, skip if
    ``n <= 0``, ``budget -= n``, stop at ``budget == 0``.  Engine: one
    exclusive prefix sum.  Equal grants for every request, for every length,
    computed count, cap, budget and max_model_len.
    """
    F = engine_formulas(formulas)
    with Timer() as t:
        cfg, s0, pre = _running_input(K)
        s1, d = SM.schedule(s0, cfg, alloc=lambda *a: (True, 0, a[3]), rules=rules)
        cap = ite(LT(1, K), cfg.threshold, 0)  # Scheduler.schedule: T if running + waiting > 1 else 0

        def engine():
            ntok = ZArr(r.tok for r in s0.reqs)
            comp = ZArr(r.comp for r in s0.reqs)
            n, reached = F["grant_tokens"](F["token_demand"](ntok, comp, cap, cfg.max_model_len), cfg.budget)
            return n

        paths = Explorer(pre).run(engine)

        def prop(n):
            return [(f"tokens granted to request {j}", EQ(n[j], d.sched[j])) for j in range(K)]

        def describe(m, n):
            rows = [f"  r{j}: tokens={value(m, r.tok)} computed={value(m, r.comp)} spec={value(m, d.sched[j])} "
                    f"engine={value(m, n[j])}" for j, r in enumerate(s0.reqs)]
            return _show(m, [("budget", cfg.budget), ("cap", cap), ("max_model_len", cfg.max_model_len)]) + "\n" + "\n".join(rows)

        status, cex = _per_path(pre, paths, prop, describe)
    return ProofRow("tv.chunking", "grant_tokens∘token_demand = spec running-phase token walk", PROFILE,
                    f"R≤{K} running requests, all lengths / budgets / caps", status, t.seconds, cex, "translation",
                    {"paths": len(paths)})


# --------------------------------------------------------------------------
# phase 1: allocation order and the first failure
# --------------------------------------------------------------------------


def _engine_segment(F, s0: SM.State, cfg: SM.Cfg, cap):
    """``Scheduler._schedule_running``'s first segment (glue transliterated, formulas real)."""
    ntok = ZArr(r.tok for r in s0.reqs)
    comp = ZArr(r.comp for r in s0.reqs)
    held = ZArr(r.held for r in s0.reqs)
    n, reached = F["grant_tokens"](F["token_demand"](ntok, comp, cap, cfg.max_model_len), cfg.budget)
    k = int(reached.sum())  # reached is a prefix
    need = F["block_demand"](comp[:k], n[:k], held[:k], cfg.block_size, cfg.max_model_len)
    f = F["first_overflow"](need, s0.free)
    return n, k, need, f


def prove_allocation(K: int = 4, formulas: dict | None = None) -> ProofRow:
    """``block_demand`` + ``first_overflow`` equal the spec's sequential ``allocate_slots`` calls.

    Spec: each reached running request calls ``allocate_slots(req, n)`` in
    order, each success shrinking the free count.  Engine: blocks each request
    needs, then the first index whose inclusive prefix sum exceeds the free
    count.  Equal: which request fails first (if any), and how many blocks
    each earlier one takes.
    """
    F = engine_formulas(formulas)
    with Timer() as t:
        cfg, s0, pre = _running_input(K)
        s1, d = SM.schedule(s0, cfg, rules=None)
        cap = ite(LT(1, K), cfg.threshold, 0)
        paths = Explorer(pre).run(lambda: _engine_segment(F, s0, cfg, cap))

        def prop(res):
            n, k, need, f = res
            spec_first = K
            for p in reversed(range(K)):
                spec_first = ite(d.first_fail[p], p, spec_first)
            checks = [("index of the first failed allocation", EQ(ite(LT(f, k), f, K), spec_first))]
            for j in range(k):
                before = LT(j, f)
                checks.append((f"blocks popped for request {j}", IMPLIES(before, EQ(need[j], d.popped[j]))))
                checks.append((f"tokens granted to request {j}", IMPLIES(before, EQ(n[j], d.sched[j]))))
            return checks

        def describe(m, res):
            n, k, need, f = res
            rows = [f"  r{j}: tokens={value(m, r.tok)} computed={value(m, r.comp)} held={value(m, r.held)} "
                    f"spec: popped={value(m, d.popped[j])} first_fail={value(m, d.first_fail[j])}; engine: "
                    f"need={value(m, need[j]) if j < k else '-'}" for j, r in enumerate(s0.reqs)]
            return _show(m, [("budget", cfg.budget), ("free", s0.free), ("engine first_overflow", f)]) + "\n" + "\n".join(rows)

        status, cex = _per_path(pre, paths, prop, describe)
    return ProofRow("tv.allocation", "block_demand + first_overflow = spec sequential allocate_slots (first failure)",
                    PROFILE, f"R≤{K} running requests, any lengths / blocks held / free count", status, t.seconds, cex,
                    "translation", {"paths": len(paths)})


# --------------------------------------------------------------------------
# phase 1: preemption (how many victims, which, and whether the requester itself)
# --------------------------------------------------------------------------


def _freed_in_order(F, s0: SM.State, order: list[int], held_now: list) -> ZArr:
    """``Scheduler._freed_in_order`` (glue transliterated, ``freed_by_position`` real).

    Without shared blocks every victim returns what it holds.  With them, one
    entry per (victim, shared block it holds): ``position`` = the victim's place
    in the order, ``last_position`` = the largest place among that block's
    holders (the engine's ``scatter_max``); the engine's ``freed_by_position``
    counts entries whose victim is the block's last holder.  A victim's own
    blocks have one holder each and always return with it.
    """
    shared = [r.shared for r in s0.reqs]
    if not any(shared):
        return ZArr(held_now[v] for v in order)
    U = len(shared[0])
    last = [0] * U
    for u in range(U):
        last[u] = -1
        for i, v in enumerate(order):
            last[u] = ite(shared[v][u], i, last[u])  # the latest holder in the order
    pos, lastpos = [], []
    for i, v in enumerate(order):
        for u in range(U):
            pos.append(ite(shared[v][u], i, -2))  # no entry for a block it does not hold
            lastpos.append(last[u])
    by_shared = F["freed_by_position"](ZArr(pos), ZArr(lastpos), len(order))
    own = [held_now[v] - COUNT(shared[v]) for v in order]
    return ZArr(own[i] + by_shared[i] for i in range(len(order)))


def prove_preemption(K: int = 4, policy: str = "fcfs", shared: bool = False, formulas: dict | None = None) -> ProofRow:
    """``victims_needed`` (with ``_victim_order``) equals the spec's preemption loop.

    Spec: while ``allocate_slots`` fails, preempt ``fcfs_victim`` /
    ``priority_victim`` (its blocks return to the free queue), stop when the
    requester itself is the victim.  Engine: victims in a fixed order, the first
    prefix whose freed blocks cover the need.  Compared at the step's first
    failed allocation: the number of victims, who they are, in which order,
    and whether the requester preempted itself.

    With ``shared=True`` requests may share prefix-cached blocks: freeing a
    victim returns only the blocks whose ref count reaches 0
    (``BlockPool.free_blocks``), i.e. those no running request still holds; the
    engine counts them with ``freed_by_position`` (the last holder in victim
    order frees a shared block).
    """
    F = engine_formulas(formulas)
    order_fn = engine_victim_order()
    with Timer() as t:
        cfg, s0, pre = _running_input(K, policy, shared=shared)
        s1, d = SM.schedule(s0, cfg)
        cap = ite(LT(1, K), cfg.threshold, 0)

        def engine():
            n, k, need, f = _engine_segment(F, s0, cfg, cap)
            f = int(f)
            if f == k:
                return None
            run = np.arange(K)
            stub = _stub_scheduler(policy, ZArr(r.prio for r in s0.reqs), ZArr(r.aseq for r in s0.reqs))
            order = order_fn(stub, run)
            self_pos = int(np.flatnonzero(order == f)[0])
            # the pool and the block counts as the event sees them: after the segment's allocations
            free_now = s0.free - SUM(need[j] for j in range(f))
            held_now = [s0.reqs[j].held + (need[j] if j < f else 0) for j in range(K)]
            freed = _freed_in_order(F, s0, [int(i) for i in order], held_now)
            count, self_preempted = F["victims_needed"](freed, free_now, need[f], self_pos)
            victims = [int(i) for i in order[: int(count)]]
            return f, count, self_preempted, victims

        paths = Explorer(pre).run(engine)

        def prop(res):
            if res is None:
                return [("(no failure)", True)]
            f, count, self_preempted, victims = res
            checks = [("number of victims", EQ(count, d.victims_at[f])),
                      ("requester preempted itself", EQ(self_preempted, d.self_preempted[f]))]
            for i, v in enumerate(victims):
                checks.append((f"victim #{i} is r{v}", EQ(d.victim_seq[v], i)))
            others = [j for j in range(K) if j not in victims]
            checks.append(("no other request preempted in this event",
                           AND(*[OR(EQ(d.victim_seq[j], -1), LE(count, d.victim_seq[j])) for j in others])))
            return checks

        def describe(m, res):
            f, count, self_p, victims = res
            rows = [f"  r{j}: tokens={value(m, r.tok)} computed={value(m, r.comp)} held={value(m, r.held)}"
                    + (f" shares={[u for u, x in enumerate(r.shared) if value(m, x)]}" if shared else "")
                    + (f" priority={value(m, r.prio)} arrival={value(m, r.aseq)}" if policy == "priority" else "")
                    + f" spec victim #{value(m, d.victim_seq[j])}" for j, r in enumerate(s0.reqs)]
            return (_show(m, [("budget", cfg.budget), ("free", s0.free), ("first failure at", f),
                              ("engine victims", count), ("engine self-preempted", self_p),
                              ("spec victims", d.victims_at[f]), ("spec self-preempted", d.self_preempted[f])])
                    + f"; engine victim order {victims}\n" + "\n".join(rows))

        status, cex = _per_path(pre, paths, prop, describe)
    name = f"tv.preemption.{policy}" + (".shared" if shared else "")
    what = "victims_needed + _victim_order = spec preemption loop"
    bound = f"R≤{K} running requests, any blocks held / free count" + (
        "; any sharing of 2 prefix-cached blocks" if shared else "; no shared blocks (caching off)")
    return ProofRow(name, f"{what} ({policy})", PROFILE, bound, status, t.seconds, cex, "translation",
                    {"paths": len(paths)})


# --------------------------------------------------------------------------
# phase 2: admission
# --------------------------------------------------------------------------


def _waiting_input(K: int, block_size: int, max_hits: int, full: bool):
    B, T, S, L, W, free, nrun = (Sym(x) for x in ("budget", "threshold", "max_num_seqs", "max_model_len", "watermark",
                                                  "free", "num_running"))
    cfg = SM.Cfg(budget=B, threshold=T, max_num_seqs=S, max_model_len=L, block_size=block_size,
                 usable_blocks=Sym("usable"), chunked=SymBool(z3.Bool("chunked")), full_isl=full,
                 watermark_blocks=W, max_hits=max_hits)
    pre = [LE(1, B), LE(0, T), LE(1, S), LE(1, L), LE(0, W), LE(0, free), LE(0, nrun), LE(nrun, S)]
    reqs = []
    for j in range(K):
        r = SM.Req(st=SM.WAITING, tok=Sym(f"tok{j}"), rkey=j, qkey=j, aseq=j, nhit=Sym(f"nhit{j}"),
                   hit_refs=[Sym(f"ref{j}_{k}") for k in range(max_hits)], preempted=SymBool(z3.Bool(f"preempted{j}")))
        pre += [LE(1, r.tok), LE(0, r.nhit), LE(r.nhit, max_hits), LE(r.nhit * block_size, r.tok - 1),
                *[LE(0, x) for x in r.hit_refs]]
        reqs.append(r)
    return cfg, SM.State(reqs, free, -1, K), nrun, pre


def _engine_admission(F, s0: SM.State, cfg: SM.Cfg, nrun, cap):
    """``Scheduler._schedule_waiting`` with known hits (glue transliterated, formula real)."""
    K, bs = len(s0.reqs), cfg.block_size
    budget, free, waiting, running, start = cfg.budget, s0.free, K, nrun, 0
    admitted: list[tuple[int, Any]] = []
    while budget > 0 and waiting > 0 and running < cfg.max_num_seqs:
        width = int(smin(waiting, cfg.max_num_seqs - running, budget))  # one fork per width value
        cand = list(range(start, start + width))
        ntok = ZArr(s0.reqs[j].tok for j in cand)
        nhit = ZArr(s0.reqs[j].nhit for j in cand)
        # evictable hits: hit blocks with ref count 0 (the engine reads pool.ref_cnt)
        evictable = ZArr(SUM(ite(AND(LT(k, s0.reqs[j].nhit), EQ(s0.reqs[j].hit_refs[k], 0)), 1, 0)
                             for k in range(cfg.max_hits)) for j in cand)
        count, n, need = F["admission"](ntok, nhit * bs, nhit, evictable, budget=budget, free=free,
                                        watermark=cfg.watermark_blocks, num_running=running, cap=cap,
                                        chunked=cfg.chunked, full_isl=cfg.full_isl, block_size=bs,
                                        max_model_len=cfg.max_model_len)
        count = int(count)
        if count:
            admitted += [(cand[i], n[i]) for i in range(count)]
            budget = budget - SUM(n[i] for i in range(count))
            free = free - SUM(need[i] for i in range(count))
            running = running + count
            waiting -= count
            start += count
        if count < len(cand) or count == 0:
            break
    return admitted, budget, free


def prove_admission(K: int = 4, formulas: dict | None = None, block_size: int = 2, max_hits: int = 2) -> ProofRow:
    """``admission`` (over the engine's window) equals the spec's admission loop.

    Spec: ``_schedule_waiting`` — head-of-line, stop on budget, max_num_seqs,
    chunked-prefill-off, or the first failed ``allocate_slots`` (full-sequence
    gate, watermark when something runs, prefix hits whose free-queue blocks
    touching consumes).  Engine: the longest all-ok prefix from exclusive
    prefix sums.  Equal: who is admitted, with how many tokens, and the budget
    and free count left, for both values of ``scheduler_reserve_full_isl`` and
    of ``enable_chunked_prefill``.  Hits are given per candidate (the engine's
    lookup window guarantees candidates' hits do not interact).
    """
    F = engine_formulas(formulas)
    status, cex, npaths = PROVED, "", 0
    with Timer() as t:
        for full in (True, False):
            cfg, s0, nrun, pre = _waiting_input(K, block_size, max_hits, full)
            cap = cfg.threshold  # the same cap (long_prefill_cap) reaches both
            s1, d = SM.State(list(s0.copy().reqs), s0.free, -1, K), SM.new_decisions(s0)
            budget_left, _ = SM.schedule_waiting(s1, d, cfg, cfg.budget, nrun, cap, SM.counted_memory, SM._rules(None))
            paths = Explorer(pre).run(lambda: _engine_admission(F, s0, cfg, nrun, cap))
            npaths += len(paths)

            def prop(res):
                admitted, budget, free = res
                ids = [j for j, _ in admitted]
                checks = [(f"r{j} admitted with the same tokens", AND(d.admitted[j], EQ(d.sched[j], nj)))
                          for j, nj in admitted]
                checks.append(("no other request admitted",
                               AND(*[NOT(d.admitted[j]) for j in range(K) if j not in ids])))
                checks.append(("budget left", EQ(budget, budget_left)))
                checks.append(("free blocks left", EQ(free, s1.free)))
                return checks

            def describe(m, res):
                admitted, budget, free = res
                rows = [f"  r{j}: tokens={value(m, r.tok)} hit_blocks={value(m, r.nhit)} "
                        f"hit_refs={[value(m, x) for x in r.hit_refs]} spec: admitted={value(m, d.admitted[j])} "
                        f"n={value(m, d.sched[j])}" for j, r in enumerate(s0.reqs)]
                return (_show(m, [("budget", cfg.budget), ("cap", cap), ("max_num_seqs", cfg.max_num_seqs),
                                  ("running", nrun), ("free", s0.free), ("watermark", cfg.watermark_blocks),
                                  ("chunked", cfg.chunked), ("max_model_len", cfg.max_model_len)])
                        + f", full_isl={full}\n  engine admitted {[(j, value(m, x)) for j, x in admitted]}\n"
                        + "\n".join(rows))

            status, cex = _per_path(pre, paths, prop, describe)
            if status != PROVED:
                break
    return ProofRow("tv.admission", "admission (windowed) = spec admission loop (_schedule_waiting + allocate_slots)",
                    PROFILE, f"R≤{K} queued requests, ≤{max_hits} hit blocks each, all knob values", status, t.seconds,
                    cex, "translation", {"paths": npaths})


# --------------------------------------------------------------------------
# stop rules
# --------------------------------------------------------------------------


def prove_stop_codes(K: int = 3, formulas: dict | None = None) -> ProofRow:
    """``stop_codes`` equals the spec's ``check_stop`` (EOS, stop token, max_model_len,
    max_tokens, in vLLM's order) for every sampled token."""
    import spec.scheduler as S

    F = engine_formulas(formulas)
    ns = rebind_module(S)
    check_stop = ns["check_stop"]
    codes = {None: 0, S.FINISH_EOS: 1, S.FINISH_STOP_TOKEN: 2, S.FINISH_MAX_MODEL_LEN: 3, S.FINISH_MAX_TOKENS: 4}
    EOS = 2
    with Timer() as t:
        token = [Sym(f"token{j}") for j in range(K)]
        eos_ok = [SymBool(z3.Bool(f"eos_ok{j}")) for j in range(K)]
        stop_hit = [SymBool(z3.Bool(f"stop_hit{j}")) for j in range(K)]
        ntok, nout, maxt = ([Sym(f"{x}{j}") for j in range(K)] for x in ("ntok", "nout", "max_tokens"))
        L = Sym("max_model_len")
        pre = [LE(1, L)] + [AND(LE(1, nout[j]), LT(nout[j], ntok[j]), LE(1, maxt[j])) for j in range(K)]

        class _StopIds:
            def __init__(self, hit):
                self.hit = hit

            def __contains__(self, tok):
                return bool(self.hit)

        class _Out:
            def __init__(self, n):
                self.symbolic_len = n

        def both():
            eng = F["stop_codes"](ZArr(token), ZArr(eos_ok), ZArr(stop_hit), ZArr(ntok), ZArr(nout), ZArr(maxt), EOS, L)
            spec = []
            for j in range(K):
                req = types.SimpleNamespace(eos_token_id=EOS if eos_ok[j] else None, stop_token_ids=_StopIds(stop_hit[j]),
                                            num_tokens=ntok[j], output_token_ids=_Out(nout[j]), max_tokens=maxt[j])
                spec.append(codes[check_stop(req, token[j], lifted.config_stub(max_model_len=L))])
            return eng, spec

        paths = Explorer(pre).run(both)

        def prop(res):
            eng, spec = res
            return [(f"stop code of request {j}", EQ(eng[j], spec[j])) for j in range(K)]

        def describe(m, res):
            eng, spec = res
            return "\n".join(f"  r{j}: token={value(m, token[j])} eos_ok={value(m, eos_ok[j])} stop_hit={value(m, stop_hit[j])} "
                             f"tokens={value(m, ntok[j])} outputs={value(m, nout[j])} max_tokens={value(m, maxt[j])} "
                             f"L={value(m, L)}: engine {value(m, eng[j])} spec {value(m, spec[j])}" for j in range(K))

        status, cex = _per_path(pre, paths, prop, describe)
    return ProofRow("tv.stop", "stop_codes = spec check_stop (EOS, stop token, length)", PROFILE,
                    f"R≤{K} sampled tokens, any token / lengths", status, t.seconds, cex, "translation",
                    {"paths": len(paths)})


# --------------------------------------------------------------------------
# ties to the real code
# --------------------------------------------------------------------------


def cross_check_xp(trials: int = 300, seed: int = 0) -> int:
    """:data:`SYM_XP` computes what ``gpu_engine.xp`` computes, on numpy and torch arrays."""
    import torch

    from gpu_engine import xp

    rng = random.Random(seed)
    done = 0
    for _ in range(trials):
        n = rng.randint(0, 6)
        a = [rng.randint(-5, 5) for _ in range(n)]
        b = [rng.randint(-5, 5) for _ in range(n)]
        m = [rng.random() < 0.5 for _ in range(n)]
        za, zb, zm = ZArr(a), ZArr(b), ZArr(m)
        for arr, barr in ((lambda v: np.asarray(v, dtype=np.int64), lambda v: np.asarray(v, dtype=bool)),
                          (lambda v: torch.as_tensor(v, dtype=torch.int64), lambda v: torch.as_tensor(v, dtype=torch.bool))):
            A, Bv, M = arr(a), arr(b), barr(m)
            cases = [
                (xp.minimum(A, Bv), SYM_XP.minimum(za, zb)),
                (xp.maximum(A, Bv), SYM_XP.maximum(za, zb)),
                (xp.where(M, A, Bv), SYM_XP.where(zm, za, zb)),
                (xp.exclusive_cumsum(A), SYM_XP.exclusive_cumsum(za)),
                (A.cumsum(0), za.cumsum(0)),
                (A.clip(min=0), za.clip(min=0)),
                (A.clip(max=1), za.clip(max=1)),
                (-(-A // 2), -(-za // 2)),
            ]
            for real, sym in cases:
                got = [wrap(z3.simplify(x), True) for x in sym.v]
                want = [int(x) for x in (real.tolist() if hasattr(real, "tolist") else real)]
                assert got == want, f"xp stand-in differs: {want} vs {got} on {a} {b} {m}"
            assert xp.first_true(M) == wrap(z3.simplify(term(SYM_XP.first_true(zm))), True)
            done += 1
    return done


def cross_check_formulas(trials: int = 500, seed: int = 0) -> int:
    """Every formula proved above, run on concrete numpy/torch arrays and on constant
    :class:`ZArr` arrays, gives the same numbers: the symbolic reading is the code."""
    import torch

    import gpu_engine.formulas as F

    S = engine_formulas()
    rng = random.Random(seed)

    def ints(x):
        if isinstance(x, ZArr):
            return [wrap(z3.simplify(v), True) for v in x.v]
        if hasattr(x, "tolist"):
            return [int(v) for v in x.tolist()]
        return x if isinstance(x, (list, tuple)) else int(wrap(z3.simplify(term(x)), True)) if not isinstance(x, int) else x

    done = 0
    for _ in range(trials):
        n = rng.randint(1, 5)
        bs = rng.choice([1, 2, 4])
        L = rng.randint(4, 40)
        ntok = [rng.randint(1, L) for _ in range(n)]
        comp = [rng.randint(0, t - 1) for t in ntok]
        held = [rng.randint(0, 6) for _ in range(n)]
        cap = rng.choice([0, 0, 1, 3])
        budget = rng.randint(1, 30)
        free = rng.randint(0, 12)
        nhit = [rng.randint(0, max(0, (t - 1) // bs)) for t in ntok]
        evict = [rng.randint(0, h) for h in nhit]
        for arr in (np.asarray, torch.as_tensor):
            A = lambda v: arr(np.asarray(v, dtype=np.int64))  # noqa: E731
            Z = ZArr
            r_real = F.grant_tokens(F.token_demand(A(ntok), A(comp), cap, L), budget)
            r_sym = S["grant_tokens"](S["token_demand"](Z(ntok), Z(comp), cap, L), budget)
            assert ints(r_real[0]) == ints(r_sym[0]), "grant_tokens"
            nn = r_real[0]
            assert ints(F.block_demand(A(comp), nn, A(held), bs, L)) == ints(S["block_demand"](Z(comp), Z(ints(nn)), Z(held), bs, L))
            need = F.block_demand(A(comp), nn, A(held), bs, L)
            assert F.first_overflow(need, free) == ints(S["first_overflow"](Z(ints(need)), free))
            sp = rng.randrange(n)
            dr = rng.randint(0, 10)
            rv = F.victims_needed(A(held), free, dr, sp)
            sv = S["victims_needed"](Z(held), free, dr, sp)
            assert (int(rv[0]), bool(rv[1])) == (ints(sv[0]), bool(wrap(z3.simplify(term(sv[1])), True))), "victims_needed"
            # freed_by_position: entries (victim position, last holder's position) of held blocks
            ent = [(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(0, 6))]
            pos_, last_ = [max(a, b) if rng.random() < 0.5 else a for a, b in ent], [max(a, b) for a, b in ent]
            real = F.freed_by_position(A(pos_), A(last_), n)
            sym = S["freed_by_position"](Z(pos_), Z(last_), n)
            assert ints(real) == ints(sym), "freed_by_position"
            for full in (True, False):
                for chunked in (True, False):
                    kw = dict(budget=budget, free=free, watermark=rng.choice([0, 1]), num_running=rng.randint(0, 2),
                              cap=cap, chunked=chunked, full_isl=full, block_size=bs, max_model_len=L)
                    hit_t = [h * bs for h in nhit]
                    rr = F.admission(A(ntok), A(hit_t), A(nhit), A(evict), **kw)
                    ss = S["admission"](Z(ntok), Z(hit_t), Z(nhit), Z(evict), **kw)
                    assert int(rr[0]) == ints(ss[0]), "admission count"
                    assert ints(rr[1]) == ints(ss[1]) and ints(rr[2]) == ints(ss[2]), "admission n/need"
            done += 1
    return done


PROOFS = {
    "tv.chunking": lambda K=4, **kw: prove_chunking(K, **kw),
    "tv.allocation": lambda K=4, **kw: prove_allocation(K, **kw),
    "tv.preemption.fcfs": lambda K=4, **kw: prove_preemption(K, "fcfs", **kw),
    "tv.preemption.priority": lambda K=4, **kw: prove_preemption(K, "priority", **kw),
    "tv.preemption.fcfs.shared": lambda K=4, **kw: prove_preemption(K, "fcfs", shared=True, **kw),
    "tv.admission": lambda K=4, **kw: prove_admission(K, **kw),
    "tv.stop": lambda K=3, **kw: prove_stop_codes(K, **kw),
}
