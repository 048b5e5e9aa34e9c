"""Issue 19: service-level targets and output budgets — trace fields, the SLO-aware policies
(edf, sprpt, slo-slack victims, SLO admission control), hand-worked scenarios.

Every expected value below is worked out by hand in the comment above it, from the rules'
statements (spec/slo.py), not read off a run."""
from __future__ import annotations

import importlib.util
import json

import pytest

from scenario_helpers import R, rules_for, scheduled, steps
from spec import slo
from spec.config import PROFILES, ConfigError, resolve
from spec.io import FormatError, load_trace


def _admissions(records) -> list[str]:
    return [rid for s in sorted(records) for rid in records[s].new]


# -- trace fields ---------------------------------------------------------------------------


def _write(tmp_path, header_extra: dict, *lines: dict, name="t.jsonl"):
    header = {"format": "batchspec-trace", "version": 1, "config": {"profile": "edf"}, **header_extra}
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(x) for x in (header, *lines)) + "\n")
    return path


def test_slo_class_fills_targets_a_request_leaves_out(tmp_path):
    path = _write(tmp_path, {"slo_classes": {"chat": {"ttft": 4, "tpot": 2}}},
                  {"id": "a", "arrival_step": 0, "prompt_len": 3, "max_tokens": 2, "slo_class": "chat"},
                  {"id": "b", "arrival_step": 0, "prompt_len": 3, "max_tokens": 2, "slo_class": "chat", "ttft_slo": 9,
                   "predicted_output_len": 1})
    a, b = load_trace(path).requests
    assert (a.ttft_slo, a.tpot_slo, a.predicted_output_len) == (4, 2, None)
    assert (b.ttft_slo, b.tpot_slo, b.predicted_output_len) == (9, 2, 1)  # its own ttft wins


def test_old_traces_load_unchanged(tmp_path):
    path = _write(tmp_path, {}, {"id": "a", "arrival_step": 0, "prompt_len": 3, "max_tokens": 2})
    trace = load_trace(path)
    assert trace.slo_classes is None and trace.requests[0].ttft_slo is None
    assert "ttft_slo" not in trace.requests[0].to_json() and "slo_classes" not in trace.header_json()


@pytest.mark.parametrize("line, field, words", [
    ({"slo_class": "gold"}, "slo_class", "unknown class 'gold'"),
    ({"ttft_slo": 2.5}, "ttft_slo", "not a whole number of steps"),
    ({"ttft_slo": 2.0}, "ttft_slo", "not a whole number of steps"),  # a float is no integer, even when whole
    ({"tpot_slo": 0}, "tpot_slo", ""),
    ({"ttft_slo": 10**8}, "ttft_slo", "exceeds the limit steps="),
    ({"predicted_output_len": -1}, "predicted_output_len", ""),
    ({"predicted_output_len": True}, "predicted_output_len", ""),
])
def test_bad_slo_fields_name_line_and_field(tmp_path, line, field, words):
    path = _write(tmp_path, {"slo_classes": {"chat": {"ttft": 4}}},
                  {"id": "a", "arrival_step": 0, "prompt_len": 3, "max_tokens": 2, **line})
    with pytest.raises(FormatError) as e:
        load_trace(path)
    assert f":2: {field}" in str(e.value) and words in str(e.value)


def test_a_timed_trace_counts_seconds(tmp_path):
    path = _write(tmp_path, {"config": {"profile": "edf", "slo_step_s": 0.1}},
                  {"id": "a", "arrival_time": 0.0, "prompt_len": 3, "max_tokens": 2, "ttft_slo": 0.25, "tpot_slo": 0.05})
    req = load_trace(path).requests[0]
    assert req.ttft_slo == 0.25
    # 0.25 s / 0.1 s = 2.5 -> 2 steps (rounded down); 0.05 s is half a step -> at least 1
    assert slo.target_steps(req.ttft_slo, True, 0.1) == 2 and slo.target_steps(req.tpot_slo, True, 0.1) == 1


def test_knob_conflicts_are_refused():
    with pytest.raises(ConfigError, match="slo_admission: needs policy=edf"):
        resolve({"profile": "vllm-v1", "slo_admission": "refuse"})
    with pytest.raises(ConfigError, match="aging_steps"):
        resolve({"profile": "edf", "aging_steps": 2})
    assert resolve({"profile": "sprpt"}).aging_steps == 4


def test_vllm_v1_plan_is_unchanged_and_new_profiles_name_their_phases():
    assert PROFILES["vllm-v1"].plan.phases == ("schedule_running", "hold_after_preempt", "schedule_waiting")
    assert PROFILES["vllm-v1"].plan.victim == "PREEMPT.VICTIM_NEWEST"
    assert PROFILES["edf"].plan.phases[0] == "serve_at_risk"
    assert "slo_admission" in PROFILES["edf-ac"].plan.phases
    assert PROFILES["edf"].plan.victim == "PREEMPT.VICTIM_SLO_SLACK"
    for name in ("edf", "edf-ac", "sprpt"):
        assert PROFILES[name].sources


# -- EDF admission ----------------------------------------------------------------------------


def test_edf_admits_the_earliest_deadline_first():
    # One request runs at a time.  a's deadline is 0+20-1 = 19, b's 0+5-1 = 4, c has none.
    # EDF: b (4), a (19), c (never).  Each has a 4-token prompt (one step) and 2 outputs (a
    # decode step after): b admitted at 0, finishes at 1; a at 2; c at 4.
    records = steps({"profile": "edf", "max_num_seqs": 1},
                    R("a", 4, 2, ttft_slo=20), R("b", 4, 2, ttft_slo=5), R("c", 4, 2))
    assert [(s, r.new) for s, r in records.items() if r.new] == [(0, ["b"]), (2, ["a"]), (4, ["c"])]
    # FCFS on the same trace: arrival order.
    assert _admissions(steps({"profile": "vllm-v1", "max_num_seqs": 1},
                             R("a", 4, 2, ttft_slo=20), R("b", 4, 2, ttft_slo=5), R("c", 4, 2))) == ["a", "b", "c"]


def test_edf_serves_at_risk_decodes_before_the_rest_of_the_running_list():
    # Budget 3.  b (12-token prompt, deadline 9) is admitted first and prefills 3 tokens a step
    # (steps 0-3); a (1 token, no TTFT target, tpot 1) joins at step 4, when b decodes.  From
    # step 5 a's next token is due every step (last token at s-1, tpot 1): it goes first.
    records = steps({"profile": "edf", "max_num_batched_tokens": 3}, R("b", 12, 4, ttft_slo=10), R("a", 1, 4, tpot_slo=1))
    assert scheduled(records)[4] == [("b", 1), ("a", 1)]
    assert scheduled(records)[5] == [("a", 1), ("b", 1)]
    assert "EDF.AT_RISK_FIRST" in rules_for(records[5], "a")
    # vllm-v1 keeps the running-list order.
    fcfs = steps({"profile": "vllm-v1", "max_num_batched_tokens": 3}, R("b", 12, 4, ttft_slo=10), R("a", 1, 4, tpot_slo=1))
    assert scheduled(fcfs)[5] == [("b", 1), ("a", 1)]


# -- SLO admission control -------------------------------------------------------------------


def test_refuse_rejects_a_request_that_cannot_make_its_deadline():
    # Budget 8.  x: 40 tokens need ceil(40/8) = 5 steps, first token at step 4 at the earliest;
    # its deadline 0+3-1 = 2: infeasible at step 0, refused.  y: 8 tokens, deadline 0: one step,
    # feasible, admitted at step 0.
    records = steps({"profile": "edf-ac", "max_num_batched_tokens": 8, "max_model_len": 64, "num_blocks": 33},
                    R("x", 40, 2, ttft_slo=3), R("y", 8, 2, ttft_slo=1))
    assert records[0].rejected == [("x", slo.SLO_INFEASIBLE)]
    assert records[0].new == ["y"]
    assert "SLO.REFUSE" in rules_for(records[0], "x")


def test_refuse_checks_every_step_and_lets_feasible_requests_through():
    # Budget 4, one running at a time.  a (4 tokens, ttft 1 -> deadline 0) goes first and runs
    # steps 0-1.  b (4 tokens, ttft 2 -> deadline 1): at step 0 feasible (0 + 1 - 1 <= 1) but not
    # admitted (max_num_seqs);
    # at step 1 still feasible (1 <= 1); at step 2 infeasible (2 > 1): refused at step 2.
    records = steps({"profile": "edf-ac", "max_num_batched_tokens": 4, "max_num_seqs": 1},
                    R("a", 4, 2, ttft_slo=1), R("b", 4, 2, ttft_slo=2))
    assert [(s, r.rejected) for s, r in records.items() if r.rejected] == [(2, [("b", slo.SLO_INFEASIBLE)])]


def test_defer_keeps_the_request_behind_feasible_ones():
    # As above, with a third request c (4 tokens, ttft 10 -> deadline 9) arriving at step 0.
    # EDF order at step 0: b (1), c (9), a (never) -- so b runs first (steps 0-1).  Put a
    # 1-step prompt d with deadline 2 (arrives 0): order b(1) d(2) c(9).
    # Step 0: b admitted (runs 0-1).  Step 2: d is infeasible (2 + 1 - 1 = 2 <= 2: feasible!),
    # admitted at 2 (runs 2-3).  Step 4: c feasible (4 <= 9), admitted.  Now make d's
    # deadline 1 instead (ttft 2): at step 2 it is infeasible and deferred behind c.
    records = steps({"profile": "edf", "slo_admission": "defer", "max_num_batched_tokens": 4, "max_num_seqs": 1},
                    R("b", 4, 2, ttft_slo=2), R("d", 4, 2, ttft_slo=2), R("c", 4, 2, ttft_slo=10))
    assert _admissions(records) == ["b", "c", "d"]  # d deferred at step 2, served after c
    assert not any(r.rejected for r in records.values())
    defer_steps = [s for s, r in records.items() if "SLO.DEFER" in rules_for(r, "d")]
    assert defer_steps == [2]


def test_feasibility_rule_by_hand():
    # now + ceil(tokens / budget) - 1 <= deadline
    assert slo.feasible(0, 8, 8, 0) and not slo.feasible(0, 9, 8, 0) and slo.feasible(0, 9, 8, 1)
    assert slo.feasible(5, 1, 8, None)


# -- SLO-slack preemption ------------------------------------------------------------------


def test_slo_slack_victim_is_the_missed_then_the_most_slack():
    class Q:  # just the fields the rule reads
        def __init__(self, rid, seq, first, last, tpot, deadline, missed=False):
            self.request_id, self.arrival_seq = rid, seq
            self.first_token_step, self.last_token_step, self.tpot_steps = first, last, tpot
            self.ttft_deadline, self.slo_missed = deadline, missed

    tight = Q("tight", 0, 3, 9, 1, 5)  # next token due at 10
    loose = Q("loose", 1, 3, 9, 5, 5)  # due at 14
    fresh = Q("fresh", 2, None, None, None, 12)  # first token due by step 12
    none = Q("none", 3, None, None, None, None)  # no target: infinite slack
    assert slo.slo_slack_victim([tight, loose, fresh], 10).request_id == "loose"
    assert slo.slo_slack_victim([tight, loose, fresh, none], 10).request_id == "none"
    lost = Q("lost", 0, 3, 9, 1, 5, missed=True)
    assert slo.slo_slack_victim([lost, loose, none], 10).request_id == "lost"  # a miss goes first
    overdue = Q("overdue", 0, 3, 7, 1, 5)  # due at 8 < now 10: missed already
    assert slo.slo_slack_victim([overdue, loose], 10).request_id == "overdue"


def test_slo_slack_preempts_the_loose_request_not_the_newest():
    # 4 usable blocks of 4 tokens.  a (tpot 1) and b (no targets) each hold 2 blocks (prompt 8,
    # full); the first decode of a needs a 3rd block: no block free, someone is preempted.
    # vllm-v1: the newest (b).  slo-slack: b again (infinite slack) -- so make a the newest:
    # b is admitted first; a's decode lacks a block: vllm-v1 preempts a itself (the newest),
    # slo-slack preempts b (no target: the most slack).
    cfg = {"num_blocks": 5, "max_num_batched_tokens": 16, "max_model_len": 32}
    trace = (R("b", 8, 4), R("a", 8, 4, tpot_slo=1))
    newest = steps({"profile": "vllm-v1", **cfg}, *trace)
    slack = steps({"profile": "vllm-v1", "preemption_victim": "slo-slack", **cfg}, *trace)
    assert newest[1].preempted == ["a"]
    assert slack[1].preempted == ["b"]
    assert "PREEMPT.VICTIM_SLO_SLACK" in rules_for(slack[1], "b")


# -- SPRPT ------------------------------------------------------------------------------------


def test_sprpt_admits_the_shortest_predicted_output_first():
    # One at a time, aging off.  Predicted remaining: a 9 (predicted 9), b 2 (predicted 2),
    # c 5 (no prediction: max_tokens 5).  Order b, c, a; the real lengths (max_tokens) do not matter.
    records = steps({"profile": "sprpt", "aging_steps": 0, "max_num_seqs": 1},
                    R("a", 2, 10, predicted_output_len=9), R("b", 2, 10, predicted_output_len=2), R("c", 2, 5))
    assert _admissions(records) == ["b", "c", "a"]


def test_sprpt_aging_bounds_how_long_a_long_request_waits():
    # One at a time; long L (predicted 6) arrives at step 0; a short request (predicted 1,
    # 1 token prompt, 1 output: it finishes in the step it is admitted) arrives every step.
    # With aging_steps = 1, at step s L's key is 6 - s and a new short one's is 1, so L is
    # admitted at the first step with 6 - s <= 1 where it also wins the tie on arrival: s = 5.
    shorts = [R(f"s{i}", 1, 1, at=i, predicted_output_len=1) for i in range(10)]
    records = steps({"profile": "sprpt", "aging_steps": 1, "max_num_seqs": 1},
                    R("L", 1, 6, predicted_output_len=6), *shorts)
    admitted_at = {rid: s for s, r in records.items() for rid in r.new}
    assert admitted_at["L"] == 5
    no_aging = steps({"profile": "sprpt", "aging_steps": 0, "max_num_seqs": 1},
                     R("L", 1, 6, predicted_output_len=6), *shorts)
    assert {rid: s for s, r in no_aging.items() for rid in r.new}["L"] == 10  # after every short one


# -- proofs and their mutants (batchspec prove rows slo.*) --------------------------------------

needs_z3 = pytest.mark.skipif(importlib.util.find_spec("z3") is None,
                              reason="the proof rows' ProofRow lives with the Z3 proofs (z3-solver not installed)")


@needs_z3
def test_the_shipped_slo_rows_are_proved():
    from invariants.proofs import slo as proofs

    for prove in proofs.PROOFS.values():
        row = prove("ci")
        assert row.result == "proved", (row.name, row.counterexample)


def _late_feasible(now, tokens, budget, deadline):  # planted bug: one step too optimistic
    return deadline is None or now + -(-tokens // budget) - 2 <= deadline


def _strict_feasible(now, tokens, budget, deadline):  # planted bug: one step too cautious
    return deadline is None or now + -(-tokens // budget) <= deadline


@needs_z3
@pytest.mark.parametrize("mutant, words", [(_late_feasible, "SLO.ADMITTED_FEASIBLE"), (_strict_feasible, "refused R")])
def test_deadline_row_catches_a_wrong_feasibility_test(monkeypatch, mutant, words):
    import spec.scheduler
    from invariants.proofs import slo as proofs

    monkeypatch.setattr(spec.scheduler, "feasible", mutant)  # the phase's rule, not the invariant's
    row = proofs.prove_deadline("ci")
    assert row.result == "counterexample" and words in row.counterexample


@needs_z3
def test_overtaking_row_catches_aging_that_does_not_age(monkeypatch):
    import spec.queues
    from invariants.proofs import slo as proofs

    monkeypatch.setattr(spec.queues.AgingQueue, "key", lambda self, req, now: (self.base_key(req), req.arrival_seq,
                                                                              req.request_id))
    row = proofs.prove_sprpt_overtaking("ci")
    assert row.result == "counterexample" and "QUEUE.AGING_BOUNDED_OVERTAKING" in row.counterexample


@needs_z3
def test_order_row_catches_a_queue_that_ignores_deadlines(monkeypatch):
    import spec.queues
    from invariants.proofs import slo as proofs

    monkeypatch.setattr(spec.queues, "edf_key", lambda req: (req.deferred, 0, req.arrival_seq, req.request_id))
    row = proofs.prove_edf_order("ci")
    assert row.result == "counterexample" and "QUEUE.EDF_ORDER" in row.counterexample


# -- the fuzzer draws the new fields and profiles --------------------------------------------


@pytest.mark.parametrize("profile, knobs", [("edf", {}), ("edf-ac", {}), ("sprpt", {}),
                                            ("vllm-v1", {"preemption_victim": "slo-slack", "slo": True}),
                                            ("edf", {"slo_admission": "defer"})])
def test_generated_traces_of_the_slo_profiles_keep_every_invariant(profile, knobs, tmp_path):
    from fuzz.generate import random_trace
    from invariants.log_checker import check_log
    from spec.formats import DecisionLog
    from spec.io import write_trace
    from spec.scheduler import run

    drawn = 0
    for seed in range(60):
        trace = random_trace(seed, profile=profile, **knobs)
        drawn += sum(r.ttft_slo is not None or r.predicted_output_len is not None for r in trace.requests)
        path = tmp_path / f"{seed}.jsonl"
        write_trace(trace, path)
        trace = load_trace(path)  # the drawn fields are valid trace fields (steps: integers)
        records = run(trace, check_invariants=True)
        report = check_log(DecisionLog("spec", "exact", records), resolve(trace.config), trace)
        assert report.ok, (seed, report.violations[:2])
    assert drawn > 100


def test_slo_fields_leave_other_traces_unchanged():
    from fuzz.generate import random_trace

    assert all(r.ttft_slo is None and r.predicted_output_len is None for r in random_trace(3).requests)
    with_slo = random_trace(3, slo=True)
    assert [(r.id, r.prompt_len, r.max_tokens) for r in with_slo.requests] == \
        [(r.id, r.prompt_len, r.max_tokens) for r in random_trace(3).requests]
    assert any(r.ttft_slo is not None for r in with_slo.requests)
