"""The black-box log checker passes honest logs and flags each hand-made corruption."""
import copy
import subprocess
import sys

import pytest
from hypothesis import given, settings

from batchspec.cli import example_path
from fuzz.generate import random_trace
from fuzz.strategies import traces
from invariants.log_checker import check_log
from spec.config import resolve
from spec.formats import DecisionLog
from spec.io import load_trace, write_log
from spec.scheduler import run

TRACE = load_trace(example_path())
CFG = resolve(TRACE.config)
RECORDS = run(TRACE)


def by_step(records):
    return {r.step: r for r in records}


def flagged(records, cfg=CFG, trace=TRACE, level="exact"):
    report = check_log(DecisionLog("test", level, records), cfg, trace)
    return {v.invariant for v in report.violations}


def test_the_example_log_is_clean():
    assert flagged(RECORDS) == set()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(traces())
def test_spec_logs_are_clean_for_random_traces(trace):
    report = check_log(DecisionLog("spec", "exact", run(trace)), resolve(trace.config), trace)
    assert report.violations == []


def corrupt(edit):
    records = copy.deepcopy(RECORDS)
    edit(by_step(records))
    return records


def _budget(s):
    s[0].scheduled[0] = ("A", 17)


def _free_count(s):
    s[4].num_free_blocks += 1


def _duplicate_block(s):
    s[4].block_ids["A"].append(s[4].block_ids["A"][0])


def _preempted_keeps_blocks(s):
    s[3].blocks["C"] = 3
    s[3].block_ids["C"] = [9, 10, 11]


def _scheduled_after_finish(s):
    s[6].scheduled.append(("A", 1))


def _lost_request(s):
    s[17].finished = []


def _wrong_victim(s):
    s[3].preempted = ["A"]


def _fcfs_passed(s):
    s[6].resumed = []


def _sample_mid_prefill(s):
    s[0].sampled["B"] = 5


def _admit_after_preempt(s):
    s[3].new = ["D"]
    s[3].scheduled.append(("D", 5))


@pytest.mark.parametrize(
    "edit, invariant",
    [
        (_budget, "BUDGET.TOKENS_LE_BUDGET"),
        (_free_count, "MEM.CONSERVATION"),
        (_duplicate_block, "MEM.FREE_XOR_HELD"),
        (_preempted_keeps_blocks, "REQ.IDLE_HOLDS_NOTHING"),
        (_scheduled_after_finish, "REQ.SCHEDULED_IS_RUNNING"),
        (_lost_request, "LIVE.EVERY_REQUEST_ENDS"),
        (_wrong_victim, "PREEMPT.VICTIM_RULE"),
        (_fcfs_passed, "QUEUE.ADMISSION_ORDER"),
        (_sample_mid_prefill, "SAMPLE.AFTER_PREFILL"),
        (_admit_after_preempt, "PREEMPT.NO_ADMISSION_SAME_STEP"),
    ],
)
def test_each_corruption_is_flagged(edit, invariant):
    assert invariant in flagged(corrupt(edit))


def test_seq_cap_is_checked_against_the_claimed_configuration():
    # The engine ran 4 requests at once (step 8) but claims max_num_seqs=3.
    assert "SEQ.MAX_NUM_SEQS" in flagged(RECORDS, cfg=resolve({**TRACE.config, "max_num_seqs": 3}))


def test_truncated_log_fails_liveness():
    assert "LIVE.EVERY_REQUEST_ENDS" in flagged(RECORDS[:10])


def test_without_a_trace_the_log_only_checks_are_still_run():
    assert check_log(DecisionLog("test", "exact", RECORDS), CFG, None).violations == []
    report = check_log(DecisionLog("test", "exact", corrupt(_budget)), CFG, None)
    # 17 tokens for A: over the budget, more than A's blocks hold, more than the state's computed
    assert {v.invariant for v in report.violations} == {"BUDGET.TOKENS_LE_BUDGET", "MEM.SLOTS_COVER_COMPUTED",
                                                         "LOG.STATE_CONSISTENT"}
    assert report.skipped


def test_cli_check_log(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    write_log(DecisionLog("spec", "exact", RECORDS, trace=TRACE.source), good)
    write_log(DecisionLog("spec", "exact", corrupt(_wrong_victim), trace=TRACE.source), bad)
    cmd = [sys.executable, "-m", "batchspec.cli", "check-log"]
    ok = subprocess.run(cmd + [str(good), "--profile", "vllm-v1"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    no = subprocess.run(cmd + [str(bad), "--profile", "vllm-v1"], capture_output=True, text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert no.returncode == 1
    assert "PREEMPT.VICTIM_RULE" in no.stdout and "3" in no.stdout


def test_catalogue_covers_every_check_and_cli_lists_it():
    from invariants.catalogue import catalogue
    from invariants.log_checker import LOG_CHECKS

    ids = {e.id for e in catalogue()}
    assert set(LOG_CHECKS) <= ids
    assert all(e.checked_by and e.statement for e in catalogue())
    proc = subprocess.run([sys.executable, "-m", "batchspec.cli", "invariants"], capture_output=True, text=True,
                          env={"COLUMNS": "250", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0
    assert all(i in proc.stdout for i in ids)


def test_a_victim_resumed_in_its_own_step_is_legal_only_under_admit_after_preempt():
    """ADMIT.AFTER_PREEMPT: the waiting phase of a step that preempted may resume that step's victim;
    without the knob (vLLM V1) the same log breaks PREEMPT.NOT_SCHEDULED."""
    found = None
    for seed in range(200):
        trace = random_trace(seed, admit_after_preempt=True, tight_memory=True)
        records = run(trace)
        if any(set(r.preempted) & set(r.resumed) for r in records):
            found = trace, records
            break
    assert found is not None, "no random trace resumes a victim in its own step"
    trace, records = found
    cfg = resolve(trace.config)
    assert flagged(records, cfg, trace) == set()
    strict = resolve({**trace.config, "admit_after_preempt": False})
    assert "PREEMPT.NOT_SCHEDULED" in flagged(records, strict, trace)
