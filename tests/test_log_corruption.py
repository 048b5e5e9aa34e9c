"""check-log flags every single-field corruption of a valid decision log, naming the field.

Valid logs come from the spec (bundled and documented traces, and random traces of the
swap and SGLang-estimate profiles) at each comparison level.  Each corruption edits ONE
field of ONE record of the log as written to disk, keeps it schema-valid (syntax is
spec.io's job, so the semantic checker is what is tested here), and must be reported with
that field named.  The uncorrupted logs must pass, so every test can fail both ways.

``systematic_mutations`` walks every field of every record through a few mutation
operators; ``python tests/test_log_corruption.py [CHECKER.py]`` prints the share it flags
(with an older checker file, the figure before issue 14's fixes).
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

from batchspec.cli import example_path
from fuzz.generate import random_trace
from invariants.log_checker import check_log
from spec.config import resolve
from spec.formats import LEVELS, LIMITS, DecisionLog, StepRecord
from spec.io import FormatError, load_log, load_trace, write_trace
from spec.scheduler import run

ROOT = Path(__file__).resolve().parent.parent
GHOST = "ghost"  # a request id no trace here has


def _first_seed(profile: str, want) -> int:
    """The first random trace of ``profile`` whose spec log passes ``want`` (deterministic)."""
    for seed in range(200):
        records = run(random_trace(seed, profile=profile))
        if want(records):
            return seed
    raise AssertionError(f"no trace of {profile} shows the wanted feature in 200 seeds")


def _idle_twice(records) -> bool:
    """Two idle gaps in a row apart by more than one step (see idle_jump_too_far)."""
    steps = [r.step for r in records]
    return any(steps[i] > steps[i - 1] + 1 and steps[i + 1] > steps[i] + 1 for i in range(1, len(steps) - 1))


@lru_cache(maxsize=None)
def source(name: str):
    """(trace, config) of one of the traces the logs replay."""
    if name == "quickstart":  # prefix hits, a preemption, an abort, a rejection, vocab 1000
        trace = load_trace(example_path())
    elif name == "preemption":  # no prefix caching: block tables never share a block
        trace = load_trace(ROOT / "docs" / "examples" / "preemption.jsonl")
    elif name == "swap":  # vllm-v0-swap: a request swapped out and back in
        trace = random_trace(_first_seed("vllm-v0-swap", lambda rs: any(r.swapped_in and len(r.scheduled) > len(r.resumed) for r in rs)), profile="vllm-v0-swap")
    elif name == "idle":  # the engine goes idle twice: the driver skips to the next arrival
        trace = random_trace(_first_seed("vllm-v1", _idle_twice), profile="vllm-v1")
    elif name == "vtc":  # policy=vtc: tenants' counters in the log's state fields
        trace = random_trace(_first_seed("vtc", lambda rs: sum(bool(r.vtc_counters and any(r.vtc_counters.values()))
                                                               for r in rs) > 2), profile="vtc")
    elif name == "sglang":  # admission=estimate: new_token_ratio, retraction
        trace = random_trace(_first_seed("sglang", lambda rs: any(r.preempted for r in rs)), profile="sglang")
    else:
        raise KeyError(name)
    return trace, resolve(trace.config)


@lru_cache(maxsize=None)
def valid_lines(name: str, level: str) -> tuple[str, ...]:
    """The spec's log of trace ``name`` at ``level``, as its record lines (header excluded)."""
    trace, _ = source(name)
    return tuple(json.dumps(r.to_json(level)) for r in run(trace))


def records_of(name: str, level: str) -> list[dict]:
    return [json.loads(line) for line in valid_lines(name, level)]


def check(name: str, level: str, recs: list[dict], tmp_path: Path, with_trace: bool = True):
    """Write ``recs`` as a log, load it through spec.io (schema-valid or FormatError), check it."""
    trace, cfg = source(name)
    path = tmp_path / "log.jsonl"
    header = {"format": "batchspec-log", "version": 1, "engine": "spec", "level": level}
    path.write_text("\n".join(json.dumps(o) for o in [header, *recs]) + "\n")
    log = load_log(path)
    return check_log(log, cfg, trace if with_trace else None)


# -- the corruptions: each edits one field of one record and returns that field's name ---------


def _rec(recs, pred):
    return next(r for r in recs if pred(r))


def _finished_ids(recs, upto):
    return [rid for r in recs[:upto] for rid, _ in r["finished"]]


def unknown_finished(recs, trace):
    recs[-1]["finished"].append([GHOST, "eos"])
    return "finished"


def unknown_aborted(recs, trace):
    recs[0]["aborted"].append(GHOST)
    return "aborted"


def unknown_rejected(recs, trace):
    recs[0]["rejected"].append([GHOST, "prompt_too_long"])
    return "rejected"


def unknown_scheduled(recs, trace):
    recs[1]["scheduled"].append([GHOST, 1])
    return "scheduled"


def unknown_new(recs, trace):
    recs[0]["new"].append(GHOST)
    return "new"


def unknown_resumed(recs, trace):
    recs[1]["resumed"].append(GHOST)
    return "resumed"


def unknown_preempted(recs, trace):
    recs[1]["preempted"].append(GHOST)
    return "preempted"


def unknown_sampled(recs, trace):
    recs[1]["sampled"][GHOST] = 7
    return "sampled"


def unknown_blocks(recs, trace):
    recs[1]["blocks"][GHOST] = 1
    return "blocks"


def unknown_cache_hit(recs, trace):
    recs[0]["cache_hits"][GHOST] = 0
    return "cache_hits"


def unknown_block_table(recs, trace):
    recs[1]["block_ids"][GHOST] = []
    return "block_ids"


def unknown_reason(recs, trace):
    recs[0]["reasons"].append({"rule": "ADMIT.NEW", "request": GHOST, "text": "admitted"})
    return "reasons"


def bogus_rule(recs, trace):
    recs[0]["reasons"][0]["rule"] = "ADMIT.BY_MAGIC"
    return "reasons"


def step_far_ahead(recs, trace):  # the last record: still increasing and within the reader's limit
    recs[-1]["step"] = LIMITS["steps"]
    return "step"


def step_gap_while_busy(recs, trace):
    recs[-1]["step"] += 2
    return "step"


def idle_jump_too_far(recs, trace):  # an idle engine jumps to the next arrival, not past it
    i = next(i for i in range(1, len(recs) - 1) if recs[i]["step"] > recs[i - 1]["step"] + 1
             and recs[i + 1]["step"] > recs[i]["step"] + 1)
    recs[i]["step"] += 1
    return "step"


def token_outside_vocab(recs, trace):
    rec = _rec(recs, lambda r: r["sampled"])
    rec["sampled"][next(iter(rec["sampled"]))] = 10**9
    return "sampled"


def token_at_vocab_size(recs, trace):
    rec = _rec(recs, lambda r: r["sampled"])
    rec["sampled"][next(iter(rec["sampled"]))] = trace.vocab_size
    return "sampled"


def scheduled_after_finish(recs, trace):
    i = next(i for i, r in enumerate(recs) if r["finished"])
    recs[i + 1]["scheduled"].append([recs[i]["finished"][0][0], 1])
    return "scheduled"


def finished_twice(recs, trace):
    i = next(i for i, r in enumerate(recs) if r["finished"])
    recs[-1]["finished"].append([recs[i]["finished"][0][0], "max_tokens"])
    return "finished"


def wrong_finish_reason(recs, trace):
    rec = _rec(recs, lambda r: any(why == "max_tokens" for _, why in r["finished"]))
    k = next(k for k, (_, why) in enumerate(rec["finished"]) if why == "max_tokens")
    rec["finished"][k][1] = "stop_token"
    return "finished"


def finish_dropped(recs, trace):
    rec = _rec(recs, lambda r: r["finished"])
    rec["finished"].pop(0)
    return "finished"


def aborted_after_finish(recs, trace):
    recs[-1]["aborted"].append(_finished_ids(recs, len(recs) - 1)[0])
    return "aborted"


def rejected_after_admission(recs, trace):
    recs[-1]["rejected"].append([recs[-1]["scheduled"][0][0], "never_fits"])
    return "rejected"


def wrong_reject_reason(recs, trace):
    rec = _rec(recs, lambda r: r["rejected"])
    rec["rejected"][0][1] = "never_fits" if rec["rejected"][0][1] == "prompt_too_long" else "prompt_too_long"
    return "rejected"


def abort_dropped(recs, trace):
    rec = _rec(recs, lambda r: r["aborted"])
    rec["aborted"].pop(0)
    return "aborted"


def admitted_before_arrival(recs, trace):
    late = max(trace.requests, key=lambda q: q.arrival_step)
    recs[0]["new"].append(late.id)
    return "new"


def more_tokens_than_budget(recs, trace):
    rec = _rec(recs, lambda r: r["scheduled"])
    rec["scheduled"][0][1] += 10**6
    return "scheduled"


def decode_of_two(recs, trace):  # a decode step claims 2 tokens: more than the sequence has
    rec = _rec(recs, lambda r: any(n == 1 for _, n in r["scheduled"]))
    k = next(k for k, (_, n) in enumerate(rec["scheduled"]) if n == 1)
    rec["scheduled"][k][1] = 2
    return "scheduled"


def scheduled_twice(recs, trace):
    rec = _rec(recs, lambda r: r["scheduled"])
    rec["scheduled"].append(list(rec["scheduled"][0]))
    return "scheduled"


def sampled_mid_prefill(recs, trace):
    rec = _rec(recs, lambda r: any(rid not in r["sampled"] for rid, _ in r["scheduled"]))
    rid = next(rid for rid, _ in rec["scheduled"] if rid not in rec["sampled"])
    rec["sampled"][rid] = 5
    return "sampled"


def sample_dropped(recs, trace):
    rec = _rec(recs, lambda r: r["sampled"] and not r["finished"])
    rec["sampled"].pop(next(iter(rec["sampled"])))
    return "sampled"


def admitted_not_scheduled(recs, trace):
    def waiting(r):
        return [q.id for q in trace.requests if q.arrival_step <= r["step"] and q.id not in dict(r["scheduled"])]

    rec = _rec(recs, lambda r: r["new"] and waiting(r))
    rec["new"].append(waiting(rec)[0])
    return "new"


def new_again(recs, trace):  # a request admitted a second time as "new"
    i = next(i for i, r in enumerate(recs) if r["new"])
    rid = recs[i]["new"][0]
    rec = _rec(recs[i + 1:], lambda r: rid in dict(r["scheduled"]))
    rec["new"].append(rid)
    return "new"


def wrong_victim(recs, trace):
    rec = _rec(recs, lambda r: r["preempted"])
    before = recs[recs.index(rec) - 1]
    rec["preempted"] = [next(rid for rid, _ in before["scheduled"] if rid not in rec["preempted"])]
    return "preempted"


def preempted_idle(recs, trace):
    recs[-1]["preempted"].append(_finished_ids(recs, len(recs) - 1)[0])
    return "preempted"


def free_blocks_plus_one(recs, trace):
    rec = _rec(recs, lambda r: r["blocks"])
    rec["num_free_blocks"] += 1
    return "num_free_blocks"


def free_blocks_minus_one(recs, trace):
    rec = _rec(recs, lambda r: r["num_free_blocks"] > 0)
    rec["num_free_blocks"] -= 1
    return "num_free_blocks"


def free_blocks_over_pool(recs, trace):
    recs[-1]["num_free_blocks"] = resolve(trace.config).num_blocks + 5
    return "num_free_blocks"


def blocks_plus_one(recs, trace):
    rec = _rec(recs, lambda r: r["blocks"])
    rid = next(iter(rec["blocks"]))
    rec["blocks"][rid] += 1
    return "blocks"


def blocks_minus_one(recs, trace):
    rec = _rec(recs, lambda r: any(n > 1 for n in r["blocks"].values()))
    rid = next(rid for rid, n in rec["blocks"].items() if n > 1)
    rec["blocks"][rid] -= 1
    return "blocks"


def blocks_of_finished(recs, trace):
    i = next(i for i, r in enumerate(recs) if r["finished"])
    recs[i]["blocks"][recs[i]["finished"][0][0]] = 1
    return "blocks"


def blocks_dropped(recs, trace):
    rec = _rec(recs, lambda r: r["blocks"])
    rec["blocks"].pop(next(iter(rec["blocks"])))
    return "blocks"


def hit_not_admitted(recs, trace):
    rec = _rec(recs, lambda r: any(rid not in r["cache_hits"] for rid, _ in r["scheduled"]))
    rec["cache_hits"][next(rid for rid, _ in rec["scheduled"] if rid not in rec["cache_hits"])] = 0
    return "cache_hits"


def hit_part_block(recs, trace):
    rec = _rec(recs, lambda r: r["cache_hits"])
    rec["cache_hits"][next(iter(rec["cache_hits"]))] += 1
    return "cache_hits"


def hit_dropped(recs, trace):
    rec = _rec(recs, lambda r: r["cache_hits"])
    rec["cache_hits"].pop(next(iter(rec["cache_hits"])))
    return "cache_hits"


def evicted_without_cache(recs, trace):
    recs[0]["num_evicted"] = 1
    return "num_evicted"


def level_field_missing(recs, trace):
    del recs[1]["num_free_blocks"]
    return "num_free_blocks"


def cpu_blocks_off_by_one(recs, trace):
    rec = _rec(recs, lambda r: r.get("swapped_out"))
    rec["num_free_cpu_blocks"] += 1 if rec["num_free_cpu_blocks"] == 0 else -1
    return "num_free_cpu_blocks"


def swapped_out_not_preempted(recs, trace):
    rec = _rec(recs, lambda r: r["scheduled"] and not r["preempted"])
    rec["swapped_out"] = [rec["scheduled"][0][0]]
    return "swapped_out"


def swapped_in_not_resumed(recs, trace):
    rec = _rec(recs, lambda r: r.get("swapped_in") and len(r["scheduled"]) > len(r["resumed"]))
    rec["swapped_in"].append(next(rid for rid, _ in rec["scheduled"] if rid not in rec["resumed"]))
    return "swapped_in"


def ratio_not_reset_when_idle(recs, trace):
    init = resolve(trace.config).new_token_ratio_init
    recs[-1]["new_token_ratio"] = init / 2
    return "new_token_ratio"


def block_id_duplicated(recs, trace):
    rec = _rec(recs, lambda r: r["block_ids"])
    ids = next(iter(rec["block_ids"].values()))
    ids[-1] = ids[0] if len(ids) > 1 else ids[0]
    if len(ids) == 1:
        ids.append(ids[0])
    return "block_ids"


def block_id_out_of_range(recs, trace):
    rec = _rec(recs, lambda r: r["block_ids"])
    next(iter(rec["block_ids"].values()))[0] = resolve(trace.config).num_blocks
    return "block_ids"


def null_block_held(recs, trace):
    rec = _rec(recs, lambda r: r["block_ids"])
    next(iter(rec["block_ids"].values()))[0] = 0
    return "block_ids"


def block_shared_without_cache(recs, trace):
    rec = _rec(recs, lambda r: len(r["block_ids"]) > 1)
    tables = list(rec["block_ids"].values())
    tables[1][0] = tables[0][0]
    return "block_ids"


def block_table_longer(recs, trace):
    rec = _rec(recs, lambda r: r["block_ids"])
    table = next(iter(rec["block_ids"].values()))
    held = {b for t in rec["block_ids"].values() for b in t}
    table.append(next(b for b in range(1, 10**6) if b not in held))
    return "block_ids"


def evicted_out_of_range(recs, trace):
    rec = _rec(recs, lambda r: r["evicted"])
    rec["evicted"][0] = resolve(trace.config).num_blocks + 3
    return "evicted"


def evicted_extra(recs, trace):
    rec = _rec(recs, lambda r: r["evicted"])
    rec["evicted"].append(rec["evicted"][0])
    return "evicted"


def num_evicted_plus_one(recs, trace):
    rec = _rec(recs, lambda r: r["evicted"])
    rec["num_evicted"] += 1
    return "num_evicted"


def computed_plus_one(recs, trace):
    rec = _rec(recs, lambda r: r["computed"])
    rec["computed"][next(iter(rec["computed"]))] += 1
    return "computed"


def computed_of_finished(recs, trace):
    i = next(i for i, r in enumerate(recs) if r["finished"])
    recs[i]["computed"][recs[i]["finished"][0][0]] = 1
    return "computed"


def vtc_counter_decreases(recs, trace):
    rec = [r for r in recs if r["vtc_counters"] and any(r["vtc_counters"].values())][-1]
    tenant = max(rec["vtc_counters"], key=rec["vtc_counters"].get)
    rec["vtc_counters"][tenant] /= 2
    return "vtc_counters"


def vtc_lift_above_the_counter(recs, trace):
    rec = next(r for r in recs if r.get("vtc_lifts"))
    tenant = next(iter(rec["vtc_lifts"]))
    rec["vtc_lifts"][tenant] = rec["vtc_counters"][tenant] + 100.0
    return "vtc_lifts"


def hit_block_wrong_id(recs, trace):
    rec = _rec(recs, lambda r: r["hit_blocks"])
    ids = next(iter(rec["hit_blocks"].values()))
    ids[0] += 1
    return "hit_blocks"


def registered_twice(recs, trace):
    rec = _rec(recs, lambda r: r["cache_registered"])
    ordinals = next(iter(rec["cache_registered"].values()))
    ordinals.append(ordinals[0])
    return "cache_registered"


def registered_beyond_computed(recs, trace):
    rec = _rec(recs, lambda r: r["cache_registered"])
    next(iter(rec["cache_registered"].values())).append(1000)
    return "cache_registered"


def estimate_rem_above_the_pool(recs, trace):
    rec = _rec(recs, lambda r: r.get("estimate_rem") is not None)
    rec["estimate_rem"] = float(10**9)
    return "estimate_rem"


def estimate_parts_not_adding_up(recs, trace):
    rec = _rec(recs, lambda r: r.get("estimate_parts") is not None)
    rec["estimate_parts"]["running"] += 64
    return "estimate_parts"


@dataclass(frozen=True)
class Corruption:
    edit: object
    trace: str = "quickstart"
    levels: tuple[str, ...] = LEVELS  # where the corrupted field exists


MEMORY, EXACT = ("memory", "exact"), ("exact",)
CORRUPTIONS = [
    Corruption(unknown_finished), Corruption(unknown_aborted), Corruption(unknown_rejected),
    Corruption(unknown_scheduled), Corruption(unknown_new), Corruption(unknown_resumed),
    Corruption(unknown_preempted), Corruption(unknown_sampled), Corruption(unknown_reason), Corruption(bogus_rule),
    Corruption(step_far_ahead), Corruption(step_gap_while_busy), Corruption(idle_jump_too_far, trace="idle"),
    Corruption(token_outside_vocab), Corruption(token_at_vocab_size),
    Corruption(scheduled_after_finish), Corruption(finished_twice), Corruption(wrong_finish_reason),
    Corruption(finish_dropped), Corruption(aborted_after_finish), Corruption(rejected_after_admission),
    Corruption(wrong_reject_reason), Corruption(abort_dropped), Corruption(admitted_before_arrival),
    Corruption(more_tokens_than_budget), Corruption(decode_of_two), Corruption(scheduled_twice),
    Corruption(sampled_mid_prefill), Corruption(sample_dropped), Corruption(admitted_not_scheduled),
    Corruption(new_again), Corruption(wrong_victim), Corruption(wrong_victim, trace="preemption"),
    Corruption(preempted_idle), Corruption(swapped_out_not_preempted, trace="swap"),
    Corruption(swapped_in_not_resumed, trace="swap"),
    # the optional state fields (issue 18)
    Corruption(computed_plus_one), Corruption(computed_of_finished), Corruption(vtc_counter_decreases, trace="vtc"),
    Corruption(vtc_lift_above_the_counter, trace="vtc"),
    Corruption(registered_twice, levels=MEMORY), Corruption(registered_beyond_computed, levels=MEMORY),
    Corruption(estimate_rem_above_the_pool, trace="sglang", levels=MEMORY),
    Corruption(estimate_parts_not_adding_up, trace="sglang", levels=MEMORY), Corruption(hit_block_wrong_id, levels=EXACT),
    # memory level
    Corruption(unknown_blocks, levels=MEMORY), Corruption(unknown_cache_hit, levels=MEMORY),
    Corruption(free_blocks_plus_one, levels=MEMORY), Corruption(free_blocks_minus_one, levels=MEMORY),
    Corruption(free_blocks_over_pool, levels=MEMORY), Corruption(blocks_plus_one, levels=MEMORY),
    Corruption(blocks_minus_one, levels=MEMORY), Corruption(blocks_of_finished, levels=MEMORY),
    Corruption(blocks_dropped, levels=MEMORY), Corruption(hit_not_admitted, levels=MEMORY),
    Corruption(hit_part_block, levels=MEMORY), Corruption(hit_dropped, levels=MEMORY),
    Corruption(evicted_without_cache, trace="preemption", levels=MEMORY),
    Corruption(level_field_missing, levels=MEMORY),
    Corruption(cpu_blocks_off_by_one, trace="swap", levels=MEMORY),
    Corruption(ratio_not_reset_when_idle, trace="sglang", levels=MEMORY),
    Corruption(free_blocks_plus_one, trace="preemption", levels=MEMORY),
    Corruption(blocks_plus_one, trace="preemption", levels=MEMORY),
    # exact level
    Corruption(unknown_block_table, levels=EXACT), Corruption(block_id_duplicated, levels=EXACT),
    Corruption(block_id_out_of_range, levels=EXACT), Corruption(null_block_held, levels=EXACT),
    Corruption(block_shared_without_cache, trace="preemption", levels=EXACT),
    Corruption(block_table_longer, levels=EXACT), Corruption(evicted_out_of_range, levels=EXACT),
    Corruption(evicted_extra, levels=EXACT), Corruption(num_evicted_plus_one, levels=EXACT),
]
CASES = [pytest.param(c, level, id=f"{c.edit.__name__}-{c.trace}-{level}")
         for c in CORRUPTIONS for level in c.levels]
LOGS = [(name, level) for name in ("quickstart", "preemption", "swap", "sglang", "idle", "vtc") for level in LEVELS]


def corrupted(c: Corruption, level: str) -> tuple[list[dict], str]:
    recs = records_of(c.trace, level)
    before = copy.deepcopy(recs)
    where = c.edit(recs, source(c.trace)[0])
    assert recs != before, "the corruption changed nothing"
    return recs, where


def test_enough_kinds_of_corruption_at_every_level():
    assert len({c.edit for c in CORRUPTIONS}) >= 25
    for level in LEVELS:  # each level gets at least 25 kinds (the decisions-level fields, and its own)
        assert len({c.edit for c in CORRUPTIONS if level in c.levels}) >= 25


@pytest.mark.parametrize("name, level", LOGS)
def test_valid_logs_pass(name, level, tmp_path):
    for with_trace in (True, False):
        report = check(name, level, records_of(name, level), tmp_path, with_trace)
        assert report.violations == [], report.violations[:3]


@pytest.mark.parametrize("c, level", CASES)
def test_each_corruption_is_flagged_with_its_field(c, level, tmp_path):
    recs, where = corrupted(c, level)
    report = check(c.trace, level, recs, tmp_path)
    assert report.violations, f"{c.edit.__name__} at {level} went unflagged"
    named = {f for v in report.violations for f in (v.field or "").split(", ")}
    assert where in named, f"{where} not named: {report.violations[:3]}"


def _cli(args, tmp_path):
    return subprocess.run([sys.executable, "-m", "batchspec.cli", "check-log", *args], capture_output=True, text=True,
                          cwd=tmp_path, env={"COLUMNS": "250", "PATH": "/usr/bin:/bin"}, timeout=120)


@pytest.mark.parametrize("c, level", [
    (c, level) for c in CORRUPTIONS for level in c.levels
    if c.edit in (unknown_finished, step_far_ahead, token_outside_vocab, blocks_plus_one, num_evicted_plus_one)
    and c.trace == "quickstart"
])
def test_cli_exits_1_and_names_the_field(c, level, tmp_path):
    trace_path = tmp_path / "trace.jsonl"
    write_trace(source(c.trace)[0], trace_path)
    recs, where = corrupted(c, level)
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    header = {"format": "batchspec-log", "version": 1, "engine": "spec", "level": level, "trace": "trace.jsonl"}
    for path, body in ((good, records_of(c.trace, level)), (bad, recs)):
        path.write_text("\n".join(json.dumps(o) for o in [header, *body]) + "\n")
    ok = _cli([str(good)], tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    no = _cli([str(bad)], tmp_path)
    assert no.returncode == 1, no.stdout + no.stderr
    assert where in no.stdout


def test_a_step_that_goes_back_is_refused_by_the_reader_and_flagged_by_the_checker(tmp_path):
    recs = records_of("quickstart", "exact")
    recs[3]["step"] = 10**12  # later records then go back: spec.io refuses the file (exit 2) ...
    with pytest.raises(FormatError, match="step"):
        check("quickstart", "exact", recs, tmp_path)
    trace, cfg = source("quickstart")  # ... and the checker, given the records directly, flags it
    report = check_log(DecisionLog("x", "exact", [StepRecord.from_json(r) for r in recs]), cfg, trace)
    assert {(v.invariant, v.field) for v in report.violations} >= {("LOG.STEP_SEQUENCE", "step")}


def test_without_the_trace_unknown_ids_and_huge_tokens_are_still_flagged(tmp_path):
    for edit, where in ((unknown_finished, "finished"), (unknown_scheduled, "scheduled"),
                        (token_outside_vocab, "sampled"), (step_far_ahead, "step")):
        recs = records_of("quickstart", "decisions")
        edit(recs, source("quickstart")[0])
        if edit is token_outside_vocab:
            next(r for r in recs if r["sampled"])["sampled"].update({"A": 1 << 40})
        report = check("quickstart", "decisions", recs, tmp_path, with_trace=False)
        assert where in {v.field for v in report.violations}, (edit.__name__, report.violations)


# -- the systematic mutation loop ------------------------------------------------------------------


REASON_SWAP = {"eos": "max_tokens", "max_tokens": "eos", "stop_token": "eos", "max_model_len": "max_tokens",
               "prompt_too_long": "never_fits", "never_fits": "prompt_too_long"}


def _mutations(key: str, value, trace_ids: list[str]):
    """A few mutation operators for one field: (operator name, new value) pairs."""
    if key in ("reasons",):
        yield "bogus rule", [{**value[0], "rule": "NO.SUCH_RULE"}, *value[1:]] if value else []
        yield "unknown request", [{**value[0], "request": GHOST}, *value[1:]] if value else []
        yield "drop", value[1:]
        return
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield "+1", value + 1
        if value > 0:
            yield "-1", value - 1
        yield "huge", 10**12
        return
    if isinstance(value, float):
        yield "halved", value / 2
        yield "one", 1.0
        yield "zero", 0.0
        return
    members = set(value) if isinstance(value, dict) else {v[0] if isinstance(v, list) else v for v in value}
    other = next((rid for rid in trace_ids if rid not in members), GHOST)
    if isinstance(value, dict):
        keys = list(value)
        table = key in ("block_ids", "cache_registered", "hit_blocks")  # request -> a list of ints
        if keys:
            yield "drop key", {k: v for k, v in value.items() if k != keys[0]}
            first = value[keys[0]]
            if table:
                yield "append block", {**value, keys[0]: [*first, max(first, default=0) + 1]}
                if first:
                    yield "change block", {**value, keys[0]: [first[0] + 1, *first[1:]]}
            else:
                yield "value +1", {**value, keys[0]: first + 1}
        filler = [] if table else 1
        yield "unknown key", {**value, GHOST: filler}
        yield "other key", {**value, other: filler}
        return
    if key == "evicted":
        if value:
            yield "drop", value[1:]
            yield "duplicate", [value[0], *value]
            yield "+1", [value[0] + 1, *value[1:]]
        yield "add", [*value, 10**6]
        return
    pairs = key in ("scheduled", "finished", "rejected")
    if value:
        yield "drop", value[1:]
        yield "duplicate", [value[0], *value]
        if pairs:
            rid, x = value[0]
            yield "second changed", [[rid, x + 1 if isinstance(x, int) else REASON_SWAP[x]], *value[1:]]
    second = {"scheduled": 1, "finished": "eos", "rejected": "never_fits"}.get(key)
    for label, rid in (("unknown id", GHOST), ("other id", other)):
        yield label, [*value, [rid, second] if pairs else rid]


#: A long log's records are sampled down to about this many (the SGLang log has 222: every fourth of
#: them, mutated field by field at three levels, took minutes; six exercise the same checks).
RECORDS_PER_LOG = 6


def systematic_mutations(checker=check_log, stride: int = 1):
    """Every field of every ``stride``-th record of every valid log through :func:`_mutations`
    (of a log longer than :data:`RECORDS_PER_LOG` records, about that many, evenly spaced).

    Returns (flagged, total, unflagged counts by "level:field:operator", logs left out).
    Mutations that change nothing, or that spec.io refuses (schema, or a step that does not
    increase: syntax, not this checker's job) are not counted, nor are logs the checker
    already flags uncorrupted (a false positive would count every mutation as caught).
    """
    import jsonschema

    from spec.io import schema

    valid = jsonschema.Draft202012Validator(schema("log-record")).is_valid
    flagged = total = 0
    missed: dict[str, int] = {}
    left_out = []
    for name, level in LOGS:
        trace, cfg = source(name)
        ids = [q.id for q in trace.requests]
        base = records_of(name, level)
        parsed = [StepRecord.from_json(r) for r in base]
        if checker(DecisionLog("spec", level, parsed), cfg, trace).violations:
            left_out.append(f"{name}/{level}")
            continue
        every = max(stride, len(base) // RECORDS_PER_LOG)  # (the checker's cost grows with the log's length)
        for i, rec in enumerate(base):
            if i % every:
                continue
            for key, value in rec.items():
                for op, new in _mutations(key, value, ids):
                    obj = {**rec, key: new}
                    if obj == rec or not valid(obj) or not _steps_increase(base, i, obj["step"]):
                        continue
                    total += 1
                    records = [*parsed[:i], StepRecord.from_json(copy.deepcopy(obj)), *parsed[i + 1:]]
                    if checker(DecisionLog("spec", level, records), cfg, trace).violations:
                        flagged += 1
                    else:
                        label = f"{level}:{key}:{op}"
                        missed[label] = missed.get(label, 0) + 1
    return flagged, total, missed, left_out


def _steps_increase(base: list[dict], i: int, step: int) -> bool:
    return (i == 0 or base[i - 1]["step"] < step) and (i + 1 == len(base) or step < base[i + 1]["step"])


#: Mutations a log checker cannot see: another token value that stops nothing (a real model's
#: tokens are the engine's to choose) and prose or reasons left out (reasons are optional).
UNDETECTABLE = ("sampled:value +1", "reasons:drop")


def test_systematic_mutations_are_almost_all_flagged():
    flagged, total, missed, left_out = systematic_mutations(stride=4)  # every 4th record, ~6 of a long log
    assert left_out == []
    seen = total - sum(n for label, n in missed.items() if label.split(":", 1)[1] in UNDETECTABLE)
    assert total > 1000
    assert flagged >= 0.97 * seen, sorted(missed.items(), key=lambda kv: -kv[1])[:12]


if __name__ == "__main__":  # python tests/test_log_corruption.py [path/to/log_checker.py]
    chk = check_log
    if len(sys.argv) > 1:
        import importlib.util

        spec_ = importlib.util.spec_from_file_location("old_checker", sys.argv[1])
        mod = importlib.util.module_from_spec(spec_)
        sys.modules["old_checker"] = mod
        spec_.loader.exec_module(mod)
        chk = mod.check_log
    f, t, m, out = systematic_mutations(chk)
    blind = sum(n for label, n in m.items() if label.split(":", 1)[1] in UNDETECTABLE)
    print(f"flagged {f} of {t} single-field mutations ({f / t:.1%}); unflagged {t - f}; "
          f"{f / (t - blind):.1%} of the {t - blind} a log can show; logs flagged uncorrupted (left out): {out or 'none'}")
    for label, n in sorted(m.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {label}")
