"""What reports name for bugs of the real-bug catalogue that no mutant stood for before (issue 18 item 3):
an extra preemption victim (VLLM-07), an abort that does not free a running request's blocks (TRT-03,
SGL-07).  Each names the rule whose decision the engine got wrong, not a later symptom."""
from __future__ import annotations

import sys
from pathlib import Path

from fuzz.corpus import _victim_count_rule, group_signature
from fuzz.diff import decision_cause, ref_rule
from fuzz.generate import random_trace
from fuzz.replay import replay
from spec.formats import StepRecord

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mutation_score as ms  # noqa: E402  (its planting mechanism)


def test_an_engine_taking_the_spec_victims_and_more_names_the_victim_count_rule():
    spec = StepRecord(step=3, preempted=["c"], reasons=[{"rule": "PREEMPT.VICTIM_NEWEST", "request": "c"}])
    assert _victim_count_rule("preempted", spec, StepRecord(step=3, preempted=["c", "b"])) == "RUN.PREEMPT_FOR_BLOCKS"
    assert _victim_count_rule("preempted", StepRecord(step=3), StepRecord(step=3, preempted=["b"])) \
        == "RUN.PREEMPT_FOR_BLOCKS"  # (a preemption the spec's step did not need at all)
    retract = StepRecord(step=3, preempted=["c"], reasons=[{"rule": "RETRACT.BATCH_TEST", "request": "c"}])
    assert _victim_count_rule("preempted", retract, StepRecord(step=3, preempted=["c", "b"])) == "RETRACT.BATCH_TEST"
    # fewer victims, or other ones: the spec's own victim has a reason of its own, named elsewhere
    assert _victim_count_rule("preempted", spec, StepRecord(step=3)) is None
    assert _victim_count_rule("preempted", spec, StepRecord(step=3, preempted=["b"])) is None


def test_a_batch_built_after_an_abort_that_freed_less_names_the_abort():
    """The step's aborts are the same on both sides; the engine ends it 2 blocks short, the aborted
    request held 3: the batch that follows was built with less memory because of the abort."""
    previous = StepRecord(step=4, blocks={"x": 3, "y": 2})
    spec = StepRecord(step=5, scheduled=[("y", 1), ("z", 8)], new=["z"], aborted=["x"], num_free_blocks=10)
    engine = StepRecord(step=5, scheduled=[("y", 1), ("z", 4)], new=["z"], aborted=["x"], num_free_blocks=8)
    assert decision_cause("scheduled", spec, engine, "z", previous) == "ABORT.FREE"
    more = StepRecord(step=5, scheduled=[("y", 1), ("z", 4)], new=["z"], aborted=["x"], num_free_blocks=6)
    assert decision_cause("scheduled", spec, more, "z", previous) != "ABORT.FREE"  # (short by more than x held)
    none = StepRecord(step=5, scheduled=[("y", 1), ("z", 8)], new=["z"], num_free_blocks=10)
    assert decision_cause("scheduled", none, StepRecord(step=5, scheduled=[("y", 1), ("z", 4)], new=["z"],
                                                        num_free_blocks=8), "z", previous) != "ABORT.FREE"


def test_a_leaked_reference_is_the_abort_even_when_one_of_its_blocks_was_taken_again():
    """r3 held blocks 1-3 and is aborted; the spec gives block 3 to r9 in the same step, the engine
    (leaking r3's blocks) gives r9 block 4: blocks 1 and 2 keep a reference on the engine's side only."""
    before = StepRecord(step=11, block_ids={"r3": [1, 2, 3]}, ref_counts={"1": 1, "2": 1, "3": 1})
    spec = StepRecord(step=12, aborted=["r3"], block_ids={"r9": [3]}, ref_counts={"3": 1})
    engine = StepRecord(step=12, aborted=["r3"], block_ids={"r9": [4]}, ref_counts={"1": 1, "2": 1, "3": 1, "4": 1})
    assert ref_rule(spec, engine, [before])[:2] == ("ABORT.FREE", "r3")


def test_an_abort_that_leaks_a_running_requests_blocks_is_reported_as_the_abort():
    """With the leak planted, the first aborting trace that diverges names ABORT.FREE (grouped as the
    campaign names it), and agrees unplanted."""
    found = ms.first_divergent("abort_running_leaks_blocks",
                               (random_trace(seed, aborts=True, tight_memory=True) for seed in range(60)))
    assert found is not None
    trace, rule = found[0], group_signature(found[1])[2]
    assert rule == "ABORT.FREE", rule
    assert replay(trace, "gpu", "exact").divergence is None


def test_a_livelocks_shrinking_candidates_run_past_their_last_event_not_to_the_default_limit():
    from fuzz.campaign import LIVELOCK_MARGIN, MAX_STEPS, livelock_limit

    trace = random_trace(4, n_requests=4, aborts=True)
    events = [r.arrival_step for r in trace.requests] + [r.abort_at for r in trace.requests if r.abort_at is not None]
    assert livelock_limit(trace, 10) == max(20, *events) + LIVELOCK_MARGIN < MAX_STEPS
    assert livelock_limit(trace, 5_000) == MAX_STEPS


def test_a_campaign_reports_a_leak_that_livelocks_under_the_abort(tmp_path):
    """The leak ends in a livelock, shrunk with each candidate run to its own short limit
    (:func:`fuzz.campaign.livelock_limit`): one finding, a livelock, naming ABORT.FREE."""
    from fuzz.campaign import CampaignConfig, run_campaign

    mutant = next(m for m in ms.MUTANTS if m.name == "abort_running_leaks_blocks")
    with ms.planted(mutant):
        state = run_campaign(CampaignConfig(seed=0, engine="gpu", level="exact", seconds=60, workers=1,
                                            corpus=str(tmp_path), timeout=30, stop_on_finding=True))
    assert len(state.findings) == 1
    (name, finding), = state.findings.items()
    assert finding["signature"][0] == "livelock" and finding["signature"][2] == "ABORT.FREE", finding["signature"]


def test_a_request_the_step_ended_but_the_engine_still_counts_names_the_rule_that_ended_it():
    """VLLM-12's shape: r0 finished by length in this step; the engine's computed tokens still count a
    running slot (its name released: key None).  The report names STOP.LENGTH; an extra entry that is
    another request (an admission the spec did not make) is not blamed on the finish."""
    from fuzz.diff import _state_divergence

    spec = StepRecord(step=3, scheduled=[("r0", 1), ("r1", 4)], finished=[("r0", "max_tokens")], computed={"r1": 31},
                      reasons=[{"rule": "STOP.LENGTH", "request": "r0"}])
    engine = StepRecord(step=3, scheduled=[("r0", 1), ("r1", 4)], finished=[("r0", "max_tokens")],
                        computed={None: 14, "r1": 31})
    found = _state_divergence(3, spec, engine, "exact", "gpu")
    assert (found.field, found.request, found.rule) == ("computed", "r0", "STOP.LENGTH")
    other = StepRecord(step=3, scheduled=[("r0", 1), ("r1", 4)], finished=[("r0", "max_tokens")],
                       computed={"r2": 5, "r1": 31})
    assert _state_divergence(3, spec, other, "exact", "gpu").rule != "STOP.LENGTH"
