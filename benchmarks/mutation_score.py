"""Mutation score: plant realistic scheduler bugs in gpu_engine, one at a time, and fuzz.

Each mutant is a test-time patch (attributes replaced on gpu_engine's classes and
modules for the duration of one campaign, then restored) — never a switch in the
engine.  The bugs come from the families of docs/reference/real-bugs.md.  For
each mutant a campaign of ``--seconds`` (one worker, the spec vs ``gpu`` at the
exact level) reports whether it was caught, the **time to first finding**
(detection and shrinking), the **findings per bug** (finding groups the one planted
bug produced: the goal is 1), the raw signatures its divergences showed before
shrinking (what the findings would be if each manifestation counted), and the size
of the shrunk trace.  ``--stop-on-finding`` ends each campaign at its first finding
(the time-to-catch table of earlier versions).

    python benchmarks/mutation_score.py [--seconds 60] [--only NAME[,NAME]] [--out table.md]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_engine.block_pool as BP  # noqa: E402
import gpu_engine.formulas as F  # noqa: E402
from fuzz.campaign import CampaignConfig, run_campaign  # noqa: E402
from gpu_engine import xp  # noqa: E402
from gpu_engine.block_pool import BlockPool  # noqa: E402
from gpu_engine.scheduler import PREEMPTED, Scheduler  # noqa: E402


@dataclasses.dataclass
class Mutant:
    name: str
    family: str  # real-bugs.md ids
    bug: str
    patches: callable  # () -> list of (object, attribute, replacement)


def _block_off_by_one():
    def block_demand(num_computed, n, held, block_size, max_model_len):
        slots = (num_computed + n).clip(max=max_model_len)
        need = (F.cdiv(slots - 1, block_size) - held).clip(min=0)  # BUG: one block short at a boundary
        return xp.where(n > 0, need, 0)
    return [(F, "block_demand", block_demand)]


def _no_reset_on_preempt():
    admit = Scheduler._admit

    def _preempt(self, victims):
        self._free_tables(victims)
        self.status[victims] = PREEMPTED  # BUG: num_computed_tokens kept ...
        for s in xp.to_list(victims):
            self._enqueue(s, front=True)

    def _admit(self, batch, adm, ntok, n, need, hits, nhit, evictable):
        resumed = adm[self.status[adm] == PREEMPTED]
        kept = self.num_computed_tokens[resumed] * 1
        admit(self, batch, adm, ntok, n, need, hits, nhit, evictable)
        self.num_computed_tokens[resumed] = xp.maximum(kept, self.num_computed_tokens[resumed])  # ... and used on resume
    return [(Scheduler, "_preempt", _preempt), (Scheduler, "_admit", _admit)]


def _wrong_victim():
    orig = Scheduler._victim_order

    def _victim_order(self, run):
        if self.config.policy == "priority":
            return orig(self, run)
        return self.be.arange(len(run))  # BUG: oldest running request first
    return [(Scheduler, "_victim_order", _victim_order)]


def _double_free():
    orig = BlockPool.free

    def free(self, seq, groups):
        if len(seq) > 1:  # BUG: the first block appears twice in the release list
            seq, groups = self.be.cat([seq[:1], seq]), self.be.cat([groups[:1], groups])
        return orig(self, seq, groups)
    return [(BlockPool, "free", free)]


def _hash_before_computed():
    orig = Scheduler._cache_blocks

    def _cache_blocks(self, slots, upto_tokens):
        return orig(self, slots, upto_tokens + self.bs)  # BUG: registers the next, uncomputed block too
    return [(Scheduler, "_cache_blocks", _cache_blocks)]


def _admission_not_rolled_back():
    orig = Scheduler._admit

    def _admit(self, batch, adm, ntok, n, need, hits, nhit, evictable):
        extra = hits[int(nhit.sum()):]
        if len(extra):  # BUG: hits of candidates that were not admitted stay referenced
            self.pool.touch(extra)
        return orig(self, batch, adm, ntok, n, need, hits, nhit, evictable)
    return [(Scheduler, "_admit", _admit)]


def _budget_charged_differently():
    def grant_tokens(demand, budget):
        c = demand.clip(min=0)
        left = (budget - xp.exclusive_cumsum(c + 1)).clip(min=0)  # BUG: charges one token more than runs
        return xp.minimum(c, left), left > 0
    return [(F, "grant_tokens", grant_tokens)]


def _reinsertion_reversed():
    def _preempt(self, victims):
        self._free_tables(victims)
        self.status[victims] = PREEMPTED
        self.num_computed_tokens[victims] = 0
        for s in reversed(xp.to_list(victims)):  # BUG: several victims return in reverse order
            self._enqueue(s, front=True)
    return [(Scheduler, "_preempt", _preempt)]


def _whole_prompt_hit():
    orig = BlockPool.lookup

    def lookup(self, hashes, max_blocks):
        return orig(self, hashes, max_blocks + 1)  # BUG: the hit may cover the whole sequence
    return [(BlockPool, "lookup", lookup)]


def _unhashed_to_tail():
    orig = BP.free_order

    def free_order(groups, last, zero, hashed):
        head, tail = orig(groups, last, zero, hashed)
        both = xp.nonzero(last & zero)
        return both[:0], both  # BUG: every freed block goes to the tail (no LIFO reuse)
    return [(BP, "free_order", free_order)]


def _free_not_reversed():
    def _free_tables(self, slots):
        held = self.num_blocks[slots]
        rows, cols = self._table_entries(slots, held, held * 0)  # BUG: head block first
        groups = xp.repeat(self.be.arange(len(slots)), held)
        self.pool.free(self.block_table[rows, cols], groups)
        self.num_blocks[slots] = 0
        self.num_cached_blocks[slots] = 0
    return [(Scheduler, "_free_tables", _free_tables)]


def _watermark_ignored():
    orig = F.admission

    def admission(*args, **kw):
        kw["watermark"] = 0  # BUG: no headroom kept for running requests
        return orig(*args, **kw)
    return [(F, "admission", admission)]


def _lone_request_capped():
    run, wait = Scheduler._schedule_running, Scheduler._schedule_waiting

    def fix(cap, self):
        return cap or self.config.long_prefill_token_threshold  # BUG: caps a request that is alone

    return [(Scheduler, "_schedule_running", lambda self, b, budget, cap: run(self, b, budget, fix(cap, self))),
            (Scheduler, "_schedule_waiting", lambda self, b, budget, cap: wait(self, b, budget, fix(cap, self)))]


def _length_before_eos():
    orig = F.stop_codes

    def stop_codes(token, eos_ok, stop_hit, num_tokens, num_output, max_tokens, eos_token_id, max_model_len):
        code = orig(token, eos_ok, stop_hit, num_tokens, num_output, max_tokens, eos_token_id, max_model_len)
        return xp.where((num_output >= max_tokens) & (code > 0), F.STOP_MAX_TOKENS, code)  # BUG: length wins
    return [(F, "stop_codes", stop_codes)]


def _admit_after_preempt():
    orig = Scheduler.schedule

    def schedule(self):
        if not self.config.admit_after_preempt:  # BUG: admissions in a step that preempted
            self.config = dataclasses.replace(self.config, admit_after_preempt=True)
        return orig(self)
    return [(Scheduler, "schedule", schedule)]


def _max_num_seqs_off_by_one():
    orig = Scheduler._schedule_waiting

    def _schedule_waiting(self, batch, budget, cap):
        real = self.config
        self.config = dataclasses.replace(real, max_num_seqs=real.max_num_seqs + 1)  # BUG: <= instead of <
        try:
            return orig(self, batch, budget, cap)
        finally:
            self.config = real
    return [(Scheduler, "_schedule_waiting", _schedule_waiting)]


def _touch_keeps_free():
    def touch(self, blocks):
        if len(blocks):
            xp.add_at(self.ref_cnt, blocks, 1)  # BUG: an evictable hit block stays in the free queue
    return [(BlockPool, "touch", touch)]


def _evict_keeps_hash():
    def pop(self, k):
        out = self.queue.popleft(k)
        if len(out):
            self.ref_cnt[out] = 1  # BUG: a re-used cached block keeps its hash-map entry
        return out
    return [(BlockPool, "pop", pop)]


MUTANTS = [
    Mutant("block_off_by_one", "VLLM-17, ATOM#250", "a growing request gets one block too few at a block boundary", _block_off_by_one),
    Mutant("no_reset_on_preempt", "LMD-02, VLLM-13", "a preempted request keeps its computed-token count", _no_reset_on_preempt),
    Mutant("wrong_victim", "LMD-01", "FCFS preempts the oldest running request instead of the newest", _wrong_victim),
    Mutant("double_free", "VLLM-08", "a block appears twice in a release list", _double_free),
    Mutant("hash_before_computed", "TGI-02, TRT-07", "the next, not yet computed block is registered in the prefix cache", _hash_before_computed),
    Mutant("admission_not_rolled_back", "SGL-09, TGI-02", "hit blocks of a candidate that was not admitted stay referenced", _admission_not_rolled_back),
    Mutant("budget_charged_differently", "TRT-01, TRT-02", "the budget walk charges one token more than is scheduled", _budget_charged_differently),
    Mutant("reinsertion_reversed", "VLLM-04", "several victims of one step return to the queue in reverse order", _reinsertion_reversed),
    Mutant("whole_prompt_hit", "VLLM-18", "a prefix hit may cover the whole sequence", _whole_prompt_hit),
    Mutant("unhashed_to_tail", "VLLM free-queue order", "freed uncached blocks go to the tail, not the head", _unhashed_to_tail),
    Mutant("free_not_reversed", "VLLM free-queue order", "a request's blocks are freed head first", _free_not_reversed),
    Mutant("watermark_ignored", "VLLM-05", "admission ignores the watermark", _watermark_ignored),
    Mutant("lone_request_capped", "VLLM long-prefill", "the long-prefill cap applies to a request that is alone", _lone_request_capped),
    Mutant("length_before_eos", "VLLM-11, TGI-04", "max_tokens wins over EOS / stop tokens in the stop check", _length_before_eos),
    Mutant("admit_after_preempt", "VLLM-01, VLLM-02", "waiting requests are admitted in a step that preempted", _admit_after_preempt),
    Mutant("max_num_seqs_off_by_one", "VLLM-16", "admission allows max_num_seqs + 1 running requests", _max_num_seqs_off_by_one),
    Mutant("touch_keeps_free", "MSGL-01", "a hit block stays in the free queue and can be re-allocated while in use", _touch_keeps_free),
    Mutant("evict_keeps_hash", "VLLM-19, VLLM-21", "a re-used cached block keeps its prefix-cache entry", _evict_keeps_hash),
]


@contextlib.contextmanager
def planted(mutant: Mutant):
    patches = mutant.patches()
    saved = [(obj, name, obj.__dict__[name] if name in obj.__dict__ else getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def score(mutant: Mutant, seconds: float, seed: int, stop_on_finding: bool = False) -> dict:
    with planted(mutant), tempfile.TemporaryDirectory() as corpus:
        t0 = time.perf_counter()
        state = run_campaign(CampaignConfig(seed=seed, engine="gpu", level="exact", seconds=seconds, workers=1,
                                            corpus=corpus, timeout=30, shrink_tries=300, stop_on_finding=stop_on_finding))
        elapsed = time.perf_counter() - t0
    raw = {r for f in state.findings.values() for r in f.get("raw_signatures", [])}
    out = {"caught": bool(state.findings), "seconds": elapsed, "traces": state.traces, "findings": len(state.findings),
           "raw": len(raw), "first": (state.first_finding or {}).get("seconds"),
           "divergent": sum(f["count"] for f in state.findings.values())}
    if state.findings:
        name, f = min(state.findings.items(), key=lambda kv: kv[1]["first_trace"])
        out.update(signature=", ".join(sorted(state.findings)), requests=f.get("requests"),
                   original=f.get("original_requests"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="campaign budget per mutant")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="run these mutants (comma-separated names)")
    ap.add_argument("--stop-on-finding", action="store_true", help="end each campaign at its first finding")
    ap.add_argument("--out", help="also write the table (Markdown) to this file")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    rows, results = [], []
    header = ("| mutant | bug family | caught | time to first finding | findings per bug | raw signatures | "
              "divergent traces | traces run | shrunk trace | finding(s) |\n|---|---|---|---:|---:|---:|---:|---:|---|---|")
    print(header)
    for m in MUTANTS:
        if only and m.name not in only:
            continue
        r = score(m, args.seconds, args.seed, args.stop_on_finding)
        results.append(r)
        size = f"{r['requests']} requests (from {r['original']})" if r.get("requests") else "-"
        first = f"{r['first']:.1f} s" if r.get("first") is not None else "-"
        row = (f"| `{m.name}` ({m.bug}) | {m.family} | {'yes' if r['caught'] else '**no**'} | {first} | "
               f"{r['findings']} | {r['raw']} | {r['divergent']} | {r['traces']} | {size} | {r.get('signature', '-')} |")
        rows.append(row)
        print(row, flush=True)
    caught = [r for r in results if r["caught"]]
    firsts = sorted(r["first"] for r in caught if r.get("first") is not None)
    per_bug = sorted(r["findings"] for r in caught)
    summary = (f"\n{len(caught)}/{len(rows)} mutants caught within {args.seconds:g} s each (one worker, seed {args.seed}"
               + (", stopping at the first finding" if args.stop_on_finding else "") + ")."
               + (f" Findings per caught bug: mean {sum(per_bug) / len(per_bug):.2f}, max {per_bug[-1]}, "
                  f"{sum(1 for n in per_bug if n == 1)}/{len(per_bug)} exactly one (raw signatures: mean "
                  f"{sum(r['raw'] for r in caught) / len(caught):.2f}, max {max(r['raw'] for r in caught)})."
                  + (f" Time to first finding: median {firsts[len(firsts) // 2]:.1f} s, max {firsts[-1]:.1f} s."
                     if firsts else "") if caught else ""))
    print(summary)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n" + "\n".join(rows) + "\n" + summary + "\n")


if __name__ == "__main__":
    main()
