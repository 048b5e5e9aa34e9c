"""One ``vllm-v1`` step of the spec as a branch-free function over ints or Z3 terms.

What is derived and what is modelled:

* **derived** — every decision rule is the spec's own code, lifted by symbolic
  execution (:mod:`invariants.proofs.lifted`): ``chunk_size``,
  ``model_len_cap``, ``long_prefill_cap``, ``length_capped``, ``never_fits``,
  ``prompt_too_long`` and the whole block arithmetic of
  ``KVCacheManager.allocate_slots`` (full-sequence gate, watermark, prefix
  hits, evictable hits).  With concrete inputs those functions run as they are.
* **modelled by hand** — the loop skeleton of ``SpecEngine.schedule``
  (``_schedule_running`` with its preemption loop, ``_schedule_waiting``),
  ``update_from_output`` and the driver's arrivals, transliterated statement by
  statement with ``If`` instead of ``if`` so that Z3 sees every path at once.
  Memory is counted, not named: a preempted or finished request returns all
  its blocks, except prefix-cached blocks it shares with requests that keep
  running (:attr:`Req.shared`, used by the translation-validation proofs).
* **tied to the code** — :func:`cross_check` replays random traces through the
  real ``SpecEngine`` and through :func:`step` with concrete ints, and compares
  every step's scheduled tokens, admissions, preemptions, finishes, free-block
  count and per-request block counts.

State per request slot ``j`` (see :class:`Req`); the running list is ordered by
``rkey`` (admission order), the FCFS queue by ``qkey`` (arrivals get their
arrival sequence number, preemption victims go to the front with decreasing
negative keys: vLLM's ``appendleft``), the priority queue by
``(priority, arrival sequence)``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import z3

from invariants.proofs import lifted
from invariants.proofs.common import (
    AND, COUNT, EQ, LE, LT, MAX, MIN, NOT, OR, SUM, ite, one_hot_select,
)
from invariants.proofs.symex import Sym, SymBool, wrap

ABSENT, WAITING, RUNNING, FINISHED, REJECTED = 0, 1, 2, 3, 4


@dataclass
class Cfg:
    """The knobs the step reads (ints / bools, or Z3 terms where marked)."""

    budget: Any  # max_num_batched_tokens (symbolic ok)
    threshold: Any  # long_prefill_token_threshold (symbolic ok)
    max_num_seqs: Any  # (symbolic ok)
    max_model_len: Any  # (symbolic ok)
    block_size: int
    usable_blocks: Any  # (symbolic ok)
    chunked: Any = True  # enable_chunked_prefill (symbolic ok)
    full_isl: bool = True  # scheduler_reserve_full_isl
    watermark_blocks: Any = 0  # (symbolic ok)
    admit_after_preempt: Any = False  # (symbolic ok)
    policy: str = "fcfs"
    self_preempt: str = "stop"  # priority_self_preempt
    reject_unservable: bool = True
    max_hits: int = 0  # prefix-hit blocks an admission may bring (0: caching off)

    @classmethod
    def from_config(cls, c) -> "Cfg":
        return cls(budget=c.max_num_batched_tokens, threshold=c.long_prefill_token_threshold,
                   max_num_seqs=c.max_num_seqs, max_model_len=c.max_model_len, block_size=c.block_size,
                   usable_blocks=c.usable_blocks, chunked=c.enable_chunked_prefill,
                   full_isl=c.scheduler_reserve_full_isl, watermark_blocks=c.watermark_blocks,
                   admit_after_preempt=c.admit_after_preempt, policy=c.policy,
                   self_preempt=c.priority_self_preempt, reject_unservable=c.reject_unservable)


@dataclass
class Req:
    """One request slot."""

    st: Any = ABSENT
    preempted: Any = False  # status PREEMPTED (waiting again after a preemption)
    tok: Any = 0  # num_tokens: prompt + outputs
    out: Any = 0  # number of outputs
    comp: Any = 0  # num_computed_tokens
    held: Any = 0  # blocks in its block table
    rkey: Any = 0  # running-list order
    qkey: Any = 0  # FCFS queue order
    prio: Any = 0
    aseq: Any = 0  # arrival sequence (add_request order)
    prompt: Any = 0
    max_tokens: Any = 1
    arrival: Any = 0  # arrival step
    nhit: Any = 0  # prefix-hit blocks if admitted now (inputs; 0 with caching off)
    hit_refs: list = field(default_factory=list)  # ref counts of those hit blocks
    #: prefix-cached blocks it shares with other requests (one flag per shared block,
    #: counted in ``held``): freeing it returns such a block only if no running
    #: request still holds it (``BlockPool.free_blocks``: ref count reaches 0)
    shared: list = field(default_factory=list)


@dataclass
class State:
    reqs: list
    free: Any
    head_key: Any = -1
    next_rkey: Any = 0

    def copy(self) -> "State":
        return State([replace(r, hit_refs=list(r.hit_refs), shared=list(r.shared)) for r in self.reqs], self.free,
                     self.head_key, self.next_rkey)


@dataclass
class Decisions:
    """What one step decided, per request slot (all values ints or terms)."""

    sched: list  # tokens scheduled (0: not scheduled)
    start: list  # computed tokens before the step
    order: list  # batch position key (phase 1 by running position, then admissions)
    admitted: list  # admitted this step
    resumed: list  # admitted and it had been preempted
    victim_seq: list  # -1, or its index in this step's preemption order
    finished: list  # 0, or 1 + stop code (1: max_model_len, 2: max_tokens)
    popped: list  # blocks popped for it this step
    first_fail: list  # phase 1: its first allocation attempt failed
    victims_at: list  # phase 1: victims preempted while serving it
    self_preempted: list  # phase 1: it preempted itself
    reached: list  # phase 1: the loop reached it
    any_preempted: Any = False
    nrun_after: Any = 0


Allocator = Callable[..., tuple]  # (cfg, req, n, free, nrun, admission) -> (ok, popped, free_after)


def counted_memory(cfg: Cfg, r: Req, n, free, watermark, admission: bool) -> tuple:
    """``allocate_slots`` (lifted from the spec) on block counts."""
    if admission:
        return lifted.allocate(cfg.block_size, cfg.max_hits, cfg.full_isl, comp=0, tok=r.tok, n=n, held=0,
                               free=free, L=cfg.max_model_len, wm=watermark, nhit=r.nhit,
                               hit_tokens=r.nhit * cfg.block_size, refs=r.hit_refs)
    return lifted.allocate(cfg.block_size, 0, False, comp=r.comp, tok=r.tok, n=n, held=r.held, free=free,
                           L=cfg.max_model_len)


class OracleMemory:
    """Memory as an adversary: every allocation may succeed or fail (a fresh boolean).

    Proofs over this allocator hold for *any* memory state and any KV policy.
    """

    def __init__(self, prefix: str = "alloc"):
        self.prefix, self.calls = prefix, 0

    def __call__(self, cfg, r, n, free, watermark, admission):
        ok = SymBool(z3.Bool(f"{self.prefix}{self.calls}"))
        self.calls += 1
        return ok, 0, free


def _key_lt(cfg: Cfg, a: Req, b: Req, queue: bool) -> Any:
    """``a`` comes before ``b``: in the waiting queue (``queue``) or by the priority victim key."""
    if cfg.policy == "priority":
        return OR(LT(a.prio, b.prio), AND(EQ(a.prio, b.prio), LT(a.aseq, b.aseq)))
    return LT(a.qkey, b.qkey) if queue else LT(a.rkey, b.rkey)


def _first(flags: list, before: Callable[[int, int], Any]) -> list:
    """One-hot: the flagged slot that comes first (``before(i, j)``: i precedes j)."""
    return [AND(flags[j], *[NOT(AND(flags[i], before(i, j))) for i in range(len(flags)) if i != j])
            for j in range(len(flags))]


def _rules(rules: dict | None) -> dict:
    R = dict(chunk_size=lifted.chunk_size(), model_len_cap=lifted.model_len_cap(),
             long_prefill_cap=lifted.long_prefill_cap())
    R.update(rules or {})
    return R


def new_decisions(s: State) -> Decisions:
    K = len(s.reqs)
    return Decisions(sched=[0] * K, start=[r.comp for r in s.reqs], order=[0] * K, admitted=[False] * K,
                     resumed=[False] * K, victim_seq=[-1] * K, finished=[0] * K, popped=[0] * K,
                     first_fail=[False] * K, victims_at=[0] * K, self_preempted=[False] * K, reached=[False] * K)


def schedule(s: State, cfg: Cfg, alloc: Allocator = counted_memory, rules: dict | None = None,
             impl: dict | None = None) -> tuple[State, Decisions]:
    """``SpecEngine.schedule``: phase 1 (running, in order) then phase 2 (admissions).

    Test-only mutants: ``rules`` replaces lifted rules (keys ``chunk_size``,
    ``model_len_cap``, ``long_prefill_cap``); ``impl`` replaces a phase
    (``schedule_running``, ``schedule_waiting``).
    """
    impl = impl or {}
    schedule_running_ = impl.get("schedule_running", schedule_running)
    schedule_waiting_ = impl.get("schedule_waiting", schedule_waiting)
    R = _rules(rules)
    s = s.copy()
    d = new_decisions(s)
    running = [EQ(r.st, RUNNING) for r in s.reqs]
    waiting = [EQ(r.st, WAITING) for r in s.reqs]
    cap = R["long_prefill_cap"](cfg.threshold, COUNT(running) + COUNT(waiting))
    budget, alive = schedule_running_(s, d, cfg, cfg.budget, cap, alloc, R)
    admit_phase = OR(NOT(d.any_preempted), cfg.admit_after_preempt)
    budget, nrun = schedule_waiting_(s, d, cfg, budget, COUNT(alive), cap, alloc, R, enabled=admit_phase)
    d.nrun_after = nrun
    # end of schedule(): computed tokens advance
    for j, r in enumerate(s.reqs):
        r.comp = r.comp + d.sched[j]
    return s, d


def schedule_running(s: State, d: Decisions, cfg: Cfg, budget, cap, alloc: Allocator, R: dict):
    """Phase 1, ``SpecEngine._schedule_running`` (mutates ``s`` and ``d``); returns
    ``(budget left, alive flags)``."""
    K = len(s.reqs)
    q = s.reqs
    running = [EQ(r.st, RUNNING) for r in q]
    rank = [COUNT(AND(running[i], LT(q[i].rkey, q[j].rkey)) for i in range(K)) for j in range(K)]
    alive = list(running)
    stopped = False
    npreempted = 0
    for p in range(K):
        at = [AND(running[j], EQ(rank[j], p)) for j in range(K)]
        cur = lambda field_: one_hot_select(at, [getattr(r, field_) for r in q])  # noqa: E731
        here = OR(*[AND(at[j], alive[j]) for j in range(K)])
        reach = AND(here, NOT(stopped), LT(0, budget))
        tok, comp = cur("tok"), cur("comp")
        n = R["model_len_cap"](R["chunk_size"](tok - comp, cap, budget), comp, cfg.max_model_len)
        go = AND(reach, LT(0, n))
        cur_req = Req(tok=tok, comp=comp, held=cur("held"))
        ok, pops, _ = alloc(cfg, cur_req, n, s.free, 0, False)
        done = AND(go, ok)
        got_pops = ite(done, pops, 0)
        self_p = False
        for j in range(K):
            d.reached[j] = OR(d.reached[j], AND(at[j], reach))
            d.first_fail[j] = OR(d.first_fail[j], AND(at[j], go, NOT(ok)))
        for _v in range(K):  # each failed attempt preempts one victim: at most K
            need = AND(go, NOT(done), NOT(self_p))
            if cfg.policy == "priority":
                # priority_victim: max (priority, arrival) among the running list
                vic = _first(alive, lambda i, j: _key_lt(cfg, q[j], q[i], queue=True))
            else:
                # fcfs_victim: running[-1], the latest admitted
                vic = _first(alive, lambda i, j: LT(q[j].rkey, q[i].rkey))
            hit_self = OR(*[AND(vic[j], at[j]) for j in range(K)])
            for j, r in enumerate(q):
                v = AND(need, vic[j])
                still_held = COUNT(AND(sh, OR(*[AND(alive[i], q[i].shared[u]) for i in range(K) if i != j]))
                                   for u, sh in enumerate(r.shared))
                rel = r.held - still_held  # blocks whose ref count reaches 0
                s.free = ite(v, s.free + rel, s.free)
                budget = ite(v, budget + d.sched[j], budget)  # un-scheduled: its tokens come back
                d.sched[j] = ite(v, 0, d.sched[j])
                d.victim_seq[j] = ite(v, npreempted, d.victim_seq[j])
                alive[j] = AND(alive[j], NOT(v))
                r.st = ite(v, WAITING, r.st)
                r.preempted = OR(r.preempted, v)
                r.comp = ite(v, 0, r.comp)
                r.held = ite(v, 0, r.held)
                r.shared = [AND(sh, NOT(v)) for sh in r.shared]
                r.qkey = ite(v, s.head_key, r.qkey)
            for j in range(K):
                d.victims_at[j] = ite(AND(at[j], need), d.victims_at[j] + 1, d.victims_at[j])
            s.head_key = ite(need, s.head_key - 1, s.head_key)
            npreempted = ite(need, npreempted + 1, npreempted)
            self_p = OR(self_p, AND(need, hit_self))
            ok2, pops2, _ = alloc(cfg, cur_req, n, s.free, 0, False)
            retry_ok = AND(need, NOT(hit_self), ok2)
            got_pops = ite(retry_ok, pops2, got_pops)
            done = OR(done, retry_ok)
        for j, r in enumerate(q):
            mine = AND(at[j], done)
            d.sched[j] = ite(mine, n, d.sched[j])
            d.order[j] = ite(mine, p, d.order[j])
            d.popped[j] = ite(mine, got_pops, d.popped[j])
            d.self_preempted[j] = OR(d.self_preempted[j], AND(at[j], self_p))
            r.held = ite(mine, r.held + got_pops, r.held)
        s.free = ite(done, s.free - got_pops, s.free)
        budget = ite(done, budget - n, budget)
        if not (cfg.policy == "priority" and cfg.self_preempt == "continue"):
            stopped = OR(stopped, self_p)
    d.any_preempted = LT(0, npreempted)
    return budget, alive


def schedule_waiting(s: State, d: Decisions, cfg: Cfg, budget, nrun, cap, alloc: Allocator, R: dict,
                     enabled=True):
    """Phase 2, ``SpecEngine._schedule_waiting`` (mutates ``s`` and ``d``); returns
    ``(budget left, running count)``.  ``nrun``: requests running when it starts."""
    K = len(s.reqs)
    q = s.reqs
    considered = [False] * K
    stop = NOT(enabled)
    for a in range(K):
        queued = [AND(EQ(r.st, WAITING), NOT(considered[j])) for j, r in enumerate(q)]
        head = _first(queued, lambda i, j: _key_lt(cfg, q[i], q[j], queue=True))
        exists = OR(*queued)
        h = lambda field_: one_hot_select(head, [getattr(r, field_) for r in q])  # noqa: E731
        c1 = AND(exists, NOT(stop))
        tok, nhit = h("tok"), h("nhit")
        hit = nhit * cfg.block_size
        remaining = tok - hit
        capped = ite(AND(LT(0, cap), LT(cap, remaining)), cap, remaining)  # inline in _schedule_waiting
        refuse = OR(LE(budget, 0), LE(cfg.max_num_seqs, nrun), AND(NOT(cfg.chunked), LT(budget, capped)))
        n = R["chunk_size"](remaining, cap, budget)
        wm = ite(LT(0, nrun), cfg.watermark_blocks, 0)
        cand = Req(tok=tok, nhit=nhit, hit_refs=[one_hot_select(head, [r.hit_refs[k] if k < len(r.hit_refs) else 1
                                                                         for r in q], 1)
                                                 for k in range(cfg.max_hits)])
        ok, pops, free_after = alloc(cfg, cand, n, s.free, wm, True)
        admit = AND(c1, NOT(refuse), ok)
        stop = OR(stop, AND(c1, NOT(admit)))
        for j, r in enumerate(q):
            mine = AND(head[j], admit)
            considered[j] = OR(considered[j], mine)
            d.admitted[j] = OR(d.admitted[j], mine)
            d.resumed[j] = OR(d.resumed[j], AND(mine, r.preempted))
            d.sched[j] = ite(mine, n, d.sched[j])
            d.start[j] = ite(mine, hit, d.start[j])
            d.order[j] = ite(mine, K + a, d.order[j])
            d.popped[j] = ite(mine, pops, d.popped[j])
            r.st = ite(mine, RUNNING, r.st)
            r.rkey = ite(mine, s.next_rkey, r.rkey)
            r.comp = ite(mine, hit, r.comp)
            r.held = ite(mine, r.nhit + pops, r.held)
        s.free = ite(admit, free_after, s.free)
        s.next_rkey = ite(admit, s.next_rkey + 1, s.next_rkey)
        budget = ite(admit, budget - n, budget)
        nrun = ite(admit, nrun + 1, nrun)
    return budget, nrun


def update(s: State, d: Decisions, cfg: Cfg, rules: dict | None = None) -> tuple[State, list]:
    """``update_from_output`` for tokens that never hit EOS or a stop token: a request
    whose prefill is complete samples one token; ``length_capped`` may finish it,
    and a finished request frees its blocks.  Returns the new state and per slot
    ``samples`` flags."""
    capped = (rules or {}).get("length_capped") or lifted.length_capped()
    s = s.copy()
    samples = []
    for j, r in enumerate(s.reqs):
        smp = AND(LT(0, d.sched[j]), LE(r.tok, r.comp))
        samples.append(smp)
        r.tok = ite(smp, r.tok + 1, r.tok)
        r.out = ite(smp, r.out + 1, r.out)
        code = capped(r.tok, r.out, r.max_tokens, cfg.max_model_len)
        fin = AND(smp, NOT(EQ(code, 0)))
        d.finished[j] = ite(fin, code, 0)
        s.free = ite(fin, s.free + r.held, s.free)  # (multi-step models share no blocks)
        r.held = ite(fin, 0, r.held)
        r.st = ite(fin, FINISHED, r.st)
    return s, samples


def arrive(s: State, cfg: Cfg, step, rules: dict | None = None) -> tuple[State, list]:
    """The driver adds the requests due at ``step`` (``add_request``): rejected when
    ``reject_unservable`` and unservable, else queued.  Returns per slot the rejected flag.
    ``rules`` may replace ``never_fits`` / ``prompt_too_long`` (test-only mutants)."""
    rules = rules or {}
    nf = rules.get("never_fits") or lifted.never_fits(cfg.block_size)
    ptl = rules.get("prompt_too_long") or lifted.prompt_too_long()
    s = s.copy()
    rejected = []
    for r in s.reqs:
        due = AND(EQ(r.st, ABSENT), EQ(r.arrival, step))
        bad = False
        if cfg.reject_unservable:
            bad = OR(ptl(r.prompt, cfg.max_model_len), nf(r.prompt, r.max_tokens, cfg.max_model_len, cfg.usable_blocks))
        rej = AND(due, bad)
        rejected.append(rej)
        r.st = ite(rej, REJECTED, ite(due, WAITING, r.st))
        r.tok = ite(due, r.prompt, r.tok)
        r.qkey = ite(due, r.aseq, r.qkey)
    return s, rejected


def initial(cfg: Cfg, prompts, max_tokens, arrivals, priorities=None) -> State:
    """Requests not yet arrived; ``aseq`` from (arrival step, trace order) like the driver's sort."""
    K = len(prompts)
    priorities = priorities or [0] * K
    reqs = []
    for j in range(K):
        aseq = COUNT(OR(LT(arrivals[i], arrivals[j]), AND(EQ(arrivals[i], arrivals[j]), i < j)) for i in range(K))
        reqs.append(Req(prompt=prompts[j], max_tokens=max_tokens[j], arrival=arrivals[j], prio=priorities[j], aseq=aseq))
    return State(reqs, cfg.usable_blocks)


def step(s: State, cfg: Cfg, k, alloc: Allocator = counted_memory, rules: dict | None = None,
         impl: dict | None = None) -> tuple[State, dict]:
    """One driver step ``k``: arrivals, ``schedule``, ``update``."""
    s, rejected = arrive(s, cfg, k, rules)
    starved = AND(NOT(OR(*[EQ(r.st, RUNNING) for r in s.reqs])), OR(*[EQ(r.st, WAITING) for r in s.reqs]))
    s, d = schedule(s, cfg, alloc, rules, impl)
    s, samples = update(s, d, cfg)
    return s, {"decisions": d, "rejected": rejected, "samples": samples, "starved": starved}


# --------------------------------------------------------------------------
# cross-check against the real SpecEngine
# --------------------------------------------------------------------------


def record_of(s: State, info: dict, ids: list[str]) -> dict:
    """The concrete step record (decisions + memory levels) the model predicts."""
    d: Decisions = info["decisions"]
    K = len(ids)
    batch = sorted((d.order[j], j) for j in range(K) if d.sched[j])
    victims = sorted((d.victim_seq[j], j) for j in range(K) if d.victim_seq[j] >= 0)
    reasons = {1: "max_model_len", 2: "max_tokens"}
    running = sorted((r.rkey, j) for j, r in enumerate(s.reqs) if r.st == RUNNING)
    return {
        "scheduled": [[ids[j], d.sched[j]] for _, j in batch],
        "new": [ids[j] for _, j in sorted((d.order[j], j) for j in range(K) if d.admitted[j] and not d.resumed[j])],
        "resumed": [ids[j] for _, j in sorted((d.order[j], j) for j in range(K) if d.resumed[j])],
        "preempted": [ids[j] for _, j in victims],
        "finished": [[ids[j], reasons[d.finished[j]]] for _, j in batch if d.finished[j]],
        "rejected": [[ids[j], "?"] for j in range(K) if info["rejected"][j]],
        "num_free_blocks": s.free,
        "blocks": {ids[j]: s.reqs[j].held for _, j in running if s.reqs[j].held},
    }


def simulate(trace, max_steps: int = 200) -> list[dict]:
    """Run a trace through the model with concrete values (caching off, no aborts)."""
    from spec.config import resolve

    c = resolve(trace.config)
    cfg = Cfg.from_config(c)
    reqs = trace.requests
    ids = [r.id for r in reqs]
    s = initial(cfg, [r.prompt_len for r in reqs], [r.max_tokens for r in reqs], [r.arrival_step for r in reqs],
                [r.priority for r in reqs])
    out = []
    for k in range(max_steps):
        if all(r.st in (FINISHED, REJECTED) for r in s.reqs):
            break
        s, info = step(s, cfg, k)
        rec = record_of(s, info, ids)
        rec["step"] = k
        idle = not (rec["scheduled"] or rec["finished"] or rec["rejected"] or rec["preempted"])
        if not idle or any(r.st in (WAITING, RUNNING) for r in s.reqs):
            out.append(rec)
    return out


def spec_records(trace, max_steps: int = 200) -> list[dict]:
    from spec.protocol import drive
    from spec.scheduler import SpecEngine

    eng = SpecEngine.from_trace(trace)
    recs = drive(eng, trace, max_steps)
    keys = ("step", "scheduled", "new", "resumed", "preempted", "finished", "rejected", "num_free_blocks", "blocks")
    out = []
    for r in recs:
        j = r.to_json("memory")
        j["rejected"] = [[rid, "?"] for rid, _ in j["rejected"]]
        out.append({k: j[k] for k in keys})
    return out


def random_trace(rng: random.Random, policy: str | None = None):
    from spec.formats import Trace, TraceRequest

    policy = policy or rng.choice(["fcfs", "priority"])
    bs = rng.choice([1, 2, 4])
    cfg = {"profile": "vllm-v1", "num_blocks": rng.randint(2, 10), "block_size": bs,
           "max_num_batched_tokens": rng.choice([2, 3, 4, 6, 8, 16]), "max_num_seqs": rng.choice([1, 2, 3, 8]),
           "max_model_len": rng.choice([6, 10, 16, 64]), "long_prefill_token_threshold": rng.choice([0, 0, 1, 2, 3]),
           "enable_prefix_caching": False, "policy": policy, "max_steps": 400,
           "watermark": rng.choice([0.0, 0.0, 0.2]), "admit_after_preempt": rng.random() < 0.3,
           "reject_unservable": rng.random() < 0.8,
           "priority_self_preempt": rng.choice(["stop", "continue"])}
    if rng.random() < 0.2:
        cfg["enable_chunked_prefill"] = False
        cfg["max_num_batched_tokens"] = max(cfg["max_num_batched_tokens"], cfg["max_model_len"])
    n = rng.randint(1, 5)
    reqs = [TraceRequest(id=f"r{i}", prompt_len=rng.randint(1, 12), max_tokens=rng.randint(1, 8),
                         arrival_step=rng.randint(0, 4), priority=rng.randint(0, 2), ignore_eos=True)
            for i in range(n)]
    return Trace(config=cfg, requests=reqs)


def cross_check(traces: int = 200, seed: int = 0, max_steps: int = 80) -> int:
    """Random traces through the real spec and through :func:`step`; every record must agree.

    Traces where the spec does not terminate within ``max_steps`` are compared
    on the steps both produced.  Returns the number of steps compared.
    """
    from spec.protocol import StepLimitError

    rng = random.Random(seed)
    compared = 0
    for _ in range(traces):
        tr = random_trace(rng)
        try:
            want = spec_records(tr, max_steps)
        except StepLimitError as e:
            want = None
            limit_records = e.records
        got = simulate(tr, max_steps)
        if want is None:
            from spec.formats import StepRecord  # noqa: F401
            want = []
            for r in limit_records:
                j = r.to_json("memory")
                j["rejected"] = [[rid, "?"] for rid, _ in j["rejected"]]
                want.append({k: j[k] for k in ("step", "scheduled", "new", "resumed", "preempted", "finished",
                                               "rejected", "num_free_blocks", "blocks")})
            got = [g for g in got if g["step"] < max_steps][: len(want)]
        for w, g in zip(want, got):
            if w != g:
                raise AssertionError(f"step model and spec disagree on {tr.config} "
                                     f"{[r.to_json() for r in tr.requests]}:\n spec  {w}\n model {g}")
            compared += 1
        if len(want) != len(got):
            raise AssertionError(f"step counts differ ({len(want)} vs {len(got)}) on {tr.config} "
                                 f"{[r.to_json() for r in tr.requests]}")
    return compared
