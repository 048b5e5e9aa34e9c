"""The automatic triage of a finding (fuzz.triage.classify) on planted gpu_engine bugs: a knob value
that merely switches off the mechanism whose state differed is no explanation, and a log the replay
cut a few steps past the divergence is no evidence that requests never finish."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from fuzz.generate import random_trace
from fuzz.replay import register_engine
from fuzz.triage import DELIBERATE, ENGINE_BUG, classify, explaining_knobs
from spec.scheduler import SpecEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mutation_score as ms  # noqa: E402  (its planting mechanism)


def test_a_vtc_bug_is_not_explained_by_switching_vtc_off():
    """A VTC counter bug diverges on vtc_counters; under policy=fcfs the spec logs no counters, so the
    comparison is skipped, not passed: policy=fcfs must not be offered as the engine's knob value."""
    found = ms.first_divergent("vtc_weight_multiplies", (random_trace(seed, profile="vtc") for seed in range(60)))
    assert found is not None
    trace, result = found
    assert result.divergence.field.startswith("vtc_")
    knobs = explaining_knobs(trace, result.engine_records, result.level, result.divergence.step)
    assert ("policy", "fcfs") not in knobs
    triage = classify(result, "gpu")
    assert triage["class"] != DELIBERATE or triage["knob"] != {"policy": "fcfs"}, triage


def test_unfinished_requests_of_a_cut_replay_are_no_evidence():
    """The replay stops a few steps past the first divergence: the engine's log then leaves requests
    unfinished, which is no engine bug (LIVE.EVERY_REQUEST_ENDS is left out of the triage's evidence)."""
    found = ms.first_divergent("wrong_victim", (random_trace(seed, n_requests=10) for seed in range(60)))
    assert found is not None
    triage = classify(found[1], "gpu")
    assert "LIVE.EVERY_REQUEST_ENDS" not in triage["invariants"], triage
    assert triage["class"] != ENGINE_BUG or triage["invariants"], triage


def test_replay_prints_request_ids_in_brackets_and_no_cut_liveness(tmp_path, capsys):
    """`batchspec replay` on a planted bug: request ids in brackets survive the console (not taken as
    markup), and the replay's cut log is not reported as leaving requests unfinished."""
    from batchspec.cli import main
    from spec.io import write_trace

    trace, _ = ms.first_divergent("wrong_victim", (random_trace(seed, n_requests=10) for seed in range(60)))
    write_trace(trace, tmp_path / "t.jsonl")
    with ms.planted(next(m for m in ms.MUTANTS if m.name == "wrong_victim")):
        assert main(["replay", str(tmp_path / "t.jsonl"), "--engine", "gpu"]) == 1
    out = capsys.readouterr().out
    assert "PREEMPT.VICTIM_NEWEST [r" in out
    assert "LIVE.EVERY_REQUEST_ENDS" not in out


def test_a_boundary_bug_that_mimics_a_knob_value_on_one_trace_is_not_called_deliberate():
    """Refusing an exact fit without chunked prefill (a planted off-by-one) reproduces, on its trace,
    SGLang's no_chunking_cap=exclusive; but on other traces drawn with the same knobs the engine
    decides as the trace's own inclusive cap, which an engine that has the exclusive one never
    does: the triage does not offer it as a deliberate difference (fuzz.triage.contradicted)."""
    from fuzz.triage import contradicted

    mutant = next(m for m in ms.MUTANTS if m.name == "admission_exact_fit_refused")
    options = {"enable_chunked_prefill": False, "budget_edge": True}
    trace, result = ms.first_divergent(mutant.name, (random_trace(seed, **options) for seed in range(200)))
    knobs = explaining_knobs(trace, result.engine_records, result.level, result.divergence.step)
    assert ("no_chunking_cap", "exclusive") in knobs  # (it does reproduce this trace)
    with ms.planted(mutant):
        refuted = contradicted(trace, "gpu", result.level, knobs)
        triage = classify(result, "gpu")
    assert ("no_chunking_cap", "exclusive") in refuted
    assert triage["class"] != DELIBERATE and "no_chunking_cap=exclusive reproduces this trace but not the engine" \
        in triage["why"], triage
    register_engine("exclusive-cap", lambda t: SpecEngine.from_trace(
        dataclasses.replace(t, config={**t.config, "no_chunking_cap": "exclusive"})))  # (an engine that has it)
    assert ("no_chunking_cap", "exclusive") not in contradicted(trace, "exclusive-cap", result.level, knobs)
