"""The log checker honours each profile's knobs on logs recorded from real engines (or
written by the spec under that profile): no false violations, and real findings still
flagged.  Item 1: ``nano-vllm`` (max_num_seqs_scope=step, prefill_chunking=first-continues);
item 2: ``vllm-v1-async`` (async_scheduling: a record's outputs are those of outputs_step)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from invariants.log_checker import check_log
from spec.config import resolve
from spec.formats import DecisionLog, StepRecord, Trace, TraceRequest

NANO = Path(__file__).parent / "corpus" / "nano-vllm"


def _nano_entries(name: str) -> list[tuple[Trace, DecisionLog]]:
    out = []
    for line in (NANO / name).read_text().splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        header, *requests = obj["trace"]
        trace = Trace(config=header["config"], vocab_size=header["vocab_size"], eos_token_id=header["eos_token_id"],
                      name=header.get("name"), requests=[TraceRequest.from_json(r) for r in requests])
        log_header, *records = obj["log"]
        out.append((trace, DecisionLog(log_header["engine"], log_header["level"],
                                       [StepRecord.from_json(r) for r in records])))
    return out


def _violations(trace: Trace, log: DecisionLog, profile: str | None = None):
    raw = dict(trace.config)
    if profile is not None:
        raw["profile"] = profile
    return check_log(log, resolve(raw), trace).violations


def test_nano_vllm_corpus_logs_keep_every_invariant_of_the_nano_vllm_profile():
    entries = _nano_entries("corpus.jsonl")
    assert len(entries) >= 300
    bad = [f"{t.name}: {v}" for t, log in entries for v in _violations(t, log, "nano-vllm")]
    assert not bad, f"{len(bad)} false violations; first: {bad[0]}"


def test_nano_vllm_never_fits_logs_are_flagged_only_for_the_request_that_crashes_it():
    """nano-vllm raises in schedule() on a request that can never fit, so its log stops there:
    the only violations are that request not rejected and the requests the crash left unended."""
    entries = _nano_entries("never-fits.jsonl")
    assert entries
    for trace, log in entries:
        found = {(v.invariant, v.request) for v in _violations(trace, log, "nano-vllm")}
        assert {inv for inv, _ in found} <= {"REJECT.CONSISTENT", "LIVE.EVERY_REQUEST_ENDS"}, (trace.name, found)
        assert all(rid == "huge" for inv, rid in found if inv == "REJECT.CONSISTENT"), (trace.name, found)


@pytest.mark.parametrize("name, invariant", [
    ("decode-ignores-budget", "BUDGET.TOKENS_LE_BUDGET"),
    ("never-fits-growth", "REJECT.CONSISTENT"),
    ("never-fits-prompt", "LIVE.EVERY_REQUEST_ENDS"),
    ("past-max-model-len", "STOP.CONSISTENT"),
])
def test_check_log_flags_the_known_nano_vllm_findings(name, invariant):
    log = NANO / "findings" / f"{name}.log.jsonl"
    proc = subprocess.run([sys.executable, "-m", "batchspec.cli", "check-log", str(log), "--profile", "nano-vllm",
                           "--trace", str(NANO / "findings" / f"{name}.jsonl")], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert invariant in proc.stdout
    assert "SEQ.MAX_NUM_SEQS" not in proc.stdout and "BATCH.PREFILL_ONLY" not in proc.stdout


def test_nano_vllm_step_cap_is_still_checked():
    """The same logs, checked against a max_num_seqs one below the fullest step's batch, are flagged."""
    trace, log = max(_nano_entries("corpus.jsonl"), key=lambda e: max(len(r.scheduled) for r in e[1].records))
    widest = max(len(r.scheduled) for r in log.records)
    raw = dict(trace.config, profile="nano-vllm", max_num_seqs=widest - 1)
    assert "SEQ.MAX_NUM_SEQS" in {v.invariant for v in check_log(log, resolve(raw), trace).violations}


ASYNC_TRACES = sorted((Path(__file__).parent / "corpus").glob("vllm-async-*.jsonl"))


def _async_spec_logs(n: int):
    from fuzz.generate import random_trace
    from spec.scheduler import run

    for seed in range(n):
        trace = random_trace(seed, async_scheduling=True)
        assert resolve(trace.config).async_scheduling
        yield seed, trace, run(trace)


def test_spec_logs_of_random_async_traces_keep_every_invariant():
    bad = []
    for seed, trace, records in _async_spec_logs(200):
        bad += [f"seed {seed}: {v}" for v in check_log(DecisionLog("spec", "exact", records), resolve(trace.config), trace).violations]
    assert not bad, f"{len(bad)} false violations; first: {bad[0]}"


@pytest.mark.parametrize("trace_path", ASYNC_TRACES, ids=lambda p: p.stem)
def test_vllm_async_logs_pass_check_log(trace_path):
    log = trace_path.parent / "vllm" / f"{trace_path.stem}.log.jsonl"
    proc = subprocess.run([sys.executable, "-m", "batchspec.cli", "check-log", str(log), "--trace", str(trace_path),
                           "--profile", "vllm-v1-async"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_corrupted_async_log_is_still_flagged():
    """Dropping a token, or moving it to the record that scheduled it (a synchronous reading), is flagged."""
    import copy

    seed, trace, records = next((s, t, r) for s, t, r in _async_spec_logs(50) if sum(len(x.sampled) for x in r) > 3)
    cfg = resolve(trace.config)
    k = next(i for i, rec in enumerate(records) if rec.sampled and not rec.finished and i > 0)
    dropped = copy.deepcopy(records)
    rid = next(iter(dropped[k].sampled))
    del dropped[k].sampled[rid]
    assert "SAMPLE.AFTER_PREFILL" in {v.invariant for v in check_log(DecisionLog("x", "exact", dropped), cfg, trace).violations}
    early = copy.deepcopy(records)
    early[k - 1].sampled[rid] = early[k].sampled.pop(rid)
    assert "SAMPLE.AFTER_PREFILL" in {v.invariant for v in check_log(DecisionLog("x", "exact", early), cfg, trace).violations}


@pytest.mark.parametrize("profile", sorted(__import__("spec.config", fromlist=["PROFILES"]).PROFILES))
def test_spec_logs_of_every_profile_keep_every_invariant(profile):
    """The black-box checker holds each profile's own rules (SGLang's deferred abort of a running
    request and its cut prefill freed at once, prefill-first batches, VTC, ...): the spec's logs of
    random traces with aborts, request features and edge values are clean."""
    from fuzz.generate import random_trace
    from spec.scheduler import run

    for seed in range(40):
        trace = random_trace(seed, profile=profile, aborts=True, request_features=True, edges=True,
                             tight_memory=seed % 2 == 0)
        report = check_log(DecisionLog("spec", "exact", run(trace)), resolve(trace.config), trace)
        assert report.violations == [], (seed, report.violations[:3])
