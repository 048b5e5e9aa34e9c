"""Known vLLM async-scheduling bugs as regression traces (#21 item 3; docs/findings/known-bugs.md).

Each ``tests/corpus/vllm-known/NAME.jsonl`` drives vLLM into the code path of a bug of the catalogue
(docs/reference/real-bugs.md, ASYNC family); ``vllm-known/vllm-<release>/NAME.log.jsonl`` is the log
vLLM 0.32.0 / 0.33.0 wrote on it (scripts/record_known_bugs.py).  None of the bugs reproduces on these
releases (their fixes are in both, or the trigger needs what the adapter does not run); the traces
guard the fixes: in CI, every log is replayed against the spec (agreement, every invariant kept on
the log alone, speculative decoding's drafts included) and
must show the bug's trigger (a trace that no longer reaches the path guards
nothing); under the ``vllm`` marker the installed release runs each trace live and must agree too."""
from __future__ import annotations

from pathlib import Path

import pytest

from fuzz.replay import replay_records
from invariants.log_checker import check_log
from spec.config import resolve
from spec.io import load_log, load_trace

KNOWN = Path(__file__).parent / "corpus" / "vllm-known"
TRACES = sorted(KNOWN.glob("*.jsonl"))
RELEASES = ("0.32.0", "0.33.0")
LOGS = [(t, KNOWN / f"vllm-{r}" / f"{t.stem}.log.jsonl") for t in TRACES for r in RELEASES]


def preempted_in_flight(records) -> int:
    """Preemptions of a request scheduled in the step before: under async scheduling its output is in flight."""
    return sum(1 for prev, rec in zip(records, records[1:]) for r in rec.preempted if r in {q for q, _ in prev.scheduled})


def skipped_with_output_in_flight(records) -> int:
    """Requests scheduled in one step (its output, and under speculative decoding its draft
    placeholders, in flight) and left out of the next one while still unfinished."""
    done: set[str] = set()
    count = 0
    for prev, rec in zip(records, records[1:]):
        done |= {r for r, _ in prev.finished}
        count += sum(1 for r, _ in prev.scheduled if r not in done and r not in {q for q, _ in rec.scheduled}
                     and r not in {q for q, _ in rec.finished})
    return count


def chunks_beside_decodes(records) -> int:
    """Steps that run a prefill chunk of a request not yet sampled beside another request's decode."""
    return sum(1 for rec in records if any(n > 1 for _, n in rec.scheduled) and any(n == 1 for _, n in rec.scheduled))


#: What each trace must make vLLM do for the bug's code path to run (checked on the recorded logs).
TRIGGERS = {
    "async-01-preempt-with-output-in-flight": lambda recs: preempted_in_flight(recs) >= 1,
    "async-01b-preempt-three-decoding": lambda recs: preempted_in_flight(recs) >= 3,
    "async-02-chunked-prefill-beside-decodes": lambda recs: chunks_beside_decodes(recs) >= 5
    and not any(r.preempted for r in recs),
    "async-03-preempt-during-chunked-prefill": lambda recs: preempted_in_flight(recs) >= 1 and chunks_beside_decodes(recs) >= 1,
    "async-04-spec-placeholders-skipped-round": lambda recs: skipped_with_output_in_flight(recs) >= 1
    and any(r.drafts for r in recs),
    "async-05-preemption-cascade": lambda recs: preempted_in_flight(recs) >= 2 and max(len(r.preempted) for r in recs) == 1,
}


def test_every_known_bug_trace_has_a_trigger_and_both_logs():
    assert {t.stem for t in TRACES} == set(TRIGGERS)
    missing = [str(log) for _, log in LOGS if not log.exists()]
    assert not missing, missing


@pytest.mark.parametrize("trace_path,log_path", LOGS, ids=[f"{t.stem}-{l.parent.name}" for t, l in LOGS])
def test_recorded_log_reaches_the_bug_path_agrees_and_keeps_every_invariant(trace_path, log_path):
    trace, log = load_trace(trace_path, steps=True), load_log(log_path)
    assert TRIGGERS[trace_path.stem](log.records), f"{log_path.name} no longer reaches the bug's code path"
    result = replay_records(trace, log.records, "exact", engine=log.engine)
    assert result.agreed, result.describe()
    broken = check_log(log, resolve(trace.config), trace).violations
    assert not broken, [f"{v.invariant} at {v.step}: {v.evidence}" for v in broken[:5]]


@pytest.mark.vllm
@pytest.mark.parametrize("trace_path", TRACES, ids=[t.stem for t in TRACES])
def test_the_installed_vllm_still_agrees_live(trace_path):
    from fuzz.replay import replay
    from fuzz.vllm_adapter import installed_release

    trace = load_trace(trace_path, steps=True)
    result = replay(trace, "vllm-release", "exact", after=None)
    assert result.agreed, result.describe()
    recorded = KNOWN / f"vllm-{installed_release()}" / f"{trace_path.stem}.log.jsonl"
    if recorded.exists():  # the same release decides the same way as when it was recorded
        assert [r.to_json() for r in result.engine_records] == [r.to_json() for r in load_log(recorded).records]
