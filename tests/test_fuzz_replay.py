"""Differential replay: the spec against itself agrees; planted engine bugs are found."""
from __future__ import annotations

import pytest

from fuzz.diff import ERROR, NON_TERMINATION
from fuzz.generate import random_trace
from fuzz.replay import (
    ENGINES,
    EngineUnavailable,
    FedSpec,
    make_engine,
    register_engine,
    replay,
    replay_command,
    replay_records,
)
from spec.formats import StepRecord, Trace, TraceRequest
from spec.io import write_trace
from spec.scheduler import SpecEngine


def test_spec_against_spec_agrees_on_many_seeds():
    for seed in range(100):
        result = replay(random_trace(seed), "spec", "exact")
        assert result.agreed, result.summary()
        assert result.engine_records and len(result.engine_records) == len(result.spec_records)


def test_registry_has_builtin_engines_and_extends():
    assert {"spec", "vllm"} <= set(ENGINES)
    with pytest.raises(EngineUnavailable):
        make_engine("no-such-engine", random_trace(0))
    register_engine("spec-copy", lambda trace: SpecEngine.from_trace(trace), "test")
    try:
        assert replay(random_trace(1), "spec-copy").agreed
    finally:
        del ENGINES["spec-copy"]


class Eos(SpecEngine):
    """An engine whose model samples EOS for request r0's second token."""

    def feed(self, sampled):  # the harness never feeds the engine under test
        raise AssertionError

    def _synthetic_token(self, request_id):
        req = self.requests[request_id]
        if request_id == "r0" and len(req.output_token_ids) == 1:
            return self.eos_token_id
        return super()._synthetic_token(request_id)


def _two_request_trace(**cfg) -> Trace:
    return Trace(
        config={"profile": "vllm-v1", "num_blocks": 64, "block_size": 4, **cfg},
        requests=[TraceRequest(id="r0", arrival_step=0, prompt_len=5, max_tokens=6),
                  TraceRequest(id="r1", arrival_step=40, prompt_len=3, max_tokens=2)],
    )


def test_spec_adopts_the_engines_tokens():
    """The engine stops r0 early on an EOS the trace does not prescribe: fed that
    token, the spec stops it too, so they agree."""
    trace = _two_request_trace()
    result = replay(trace, Eos.from_trace(trace))
    assert result.agreed, result.summary()
    finished = [f for r in result.spec_records for f in r.finished]
    assert ("r0", "eos") in finished


def test_fed_spec_recovers_step_numbers_across_idle_gaps():
    trace = _two_request_trace()
    result = replay(trace, "spec")
    steps = [r.step for r in result.spec_records]
    assert 40 in steps and steps == sorted(steps) and len(set(steps)) == len(steps)
    fed = FedSpec(SpecEngine.from_trace(trace), result.engine_records)
    assert fed.tokens[result.engine_records[0].step] == result.engine_records[0].sampled


class NewestFirstVictim(SpecEngine):
    """A planted scheduler bug: under FCFS, preempt the *oldest* running request."""

    def _schedule_running(self, out, scheduled, budget, cap):
        import spec.scheduler as s

        saved = s.fcfs_victim
        s.fcfs_victim = lambda running: running[0]
        try:
            return super()._schedule_running(out, scheduled, budget, cap)
        finally:
            s.fcfs_victim = saved


def test_planted_victim_bug_is_reported_with_the_spec_rule():
    found = None
    for seed in range(300):
        trace = random_trace(seed, policy="fcfs", tight_memory=True)
        result = replay(trace, NewestFirstVictim.from_trace(trace))
        if not result.agreed:
            found = result
            break
    assert found is not None, "the planted bug went unnoticed on 300 traces"
    d = found.divergence
    assert d.kind == "decision" and d.rule is not None
    assert "spec" in d.describe() and f"step {d.step}" in d.describe()


class NeverDone(SpecEngine):
    """An engine that never finishes (always reports work left)."""

    def has_unfinished_requests(self):
        return True


class Crashes(SpecEngine):
    def step(self):
        if self._steps_taken >= 2:
            raise RuntimeError("boom")
        self._steps_taken += 1
        return super().step()


def test_non_termination_is_a_divergence():
    trace = _two_request_trace(max_steps=80)
    result = replay(trace, NeverDone.from_trace(trace))
    assert not result.agreed and result.divergence.kind == NON_TERMINATION
    assert result.divergence.step == 80 and "max_steps=80" in result.divergence.describe()


def test_engine_crash_is_a_divergence():
    trace = _two_request_trace()
    engine = Crashes.from_trace(trace)
    engine._steps_taken = 0
    result = replay(trace, engine)
    assert not result.agreed and result.divergence.kind == ERROR
    assert "boom" in result.divergence.describe()


def test_both_sides_stalling_the_same_way_agree_with_a_note():
    """A request that can never fit, with rejection switched off, stalls both sides."""
    trace = Trace(config={"profile": "vllm-v1", "num_blocks": 3, "block_size": 4, "reject_unservable": False, "max_steps": 30},
                  requests=[TraceRequest(id="big", arrival_step=0, prompt_len=6, max_tokens=10)])
    result = replay(trace, "spec")
    assert result.agreed and result.notes and "max_steps=30" in result.notes[0]


def test_replay_records_against_a_recorded_log():
    trace = random_trace(4)
    recorded = replay(trace, "spec").engine_records
    assert replay_records(trace, recorded).agreed
    tampered = [StepRecord(**{**r.__dict__}) for r in recorded]
    tampered[0].scheduled = tampered[0].scheduled[1:] + [("intruder", 1)]
    assert not replay_records(trace, tampered).agreed


def test_replay_command_exit_codes(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(random_trace(2), path)
    assert replay_command(str(path), "spec", "exact") == 0
    assert "agree" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "batchspec-trace", "version": 1}\n')
    assert replay_command(str(bad), "spec") == 2
    assert replay_command(str(path), "no-such-engine") == 2
    register_engine("planted", lambda trace: NeverDone.from_trace(trace))
    try:
        write_trace(_two_request_trace(max_steps=60), path)
        assert replay_command(str(path), "planted") == 1
    finally:
        del ENGINES["planted"]


def test_replay_command_against_a_recorded_log(tmp_path):
    from spec.formats import DecisionLog
    from spec.io import write_log

    trace_path, log_path = tmp_path / "t.jsonl", tmp_path / "t.log.jsonl"
    trace = random_trace(9)
    write_trace(trace, trace_path)
    records = replay(trace, "spec").engine_records
    write_log(DecisionLog("elsewhere", "exact", records), log_path)
    assert replay_command(str(trace_path), engine_log=str(log_path)) == 0
    records[1].scheduled = records[1].scheduled[::-1] + [("intruder", 2)]
    write_log(DecisionLog("elsewhere", "exact", records), log_path)
    assert replay_command(str(trace_path), engine_log=str(log_path)) == 1


class DivergesThenExplodes(SpecEngine):
    """Schedules request r0's prefill one token short at its first step, and raises if it is
    ever stepped three steps past that: a lock-step replay must have stopped by then."""

    def step(self):
        self.n = getattr(self, "n", 0) + 1
        if self.n > 4:
            raise AssertionError("stepped past the divergence: the replay did not stop")
        record = super().step()
        if self.n == 1:
            record.scheduled = [(rid, n - 1 if rid == "r0" else n) for rid, n in record.scheduled]
        return record


def test_replay_runs_in_lock_step_and_stops_at_the_first_divergence():
    trace = _two_request_trace()
    result = replay(trace, DivergesThenExplodes.from_trace(trace))
    assert result.divergence.kind == "decision" and result.divergence.step == 0
    assert [r.step for r in result.engine_records] == [0] and [r.step for r in result.spec_records] == [0]
    context = replay(trace, DivergesThenExplodes.from_trace(trace), after=2)  # steps kept for a report's window
    assert context.divergence.step == 0 and [r.step for r in context.engine_records] == [0, 1, 2]


def test_a_crash_inside_a_step_is_a_finding_with_file_and_line():
    trace = _two_request_trace()
    engine = Crashes.from_trace(trace)
    engine._steps_taken = 0
    result = replay(trace, engine)
    assert result.divergence.kind == ERROR and result.divergence.step == 2
    assert "RuntimeError: boom at " in result.divergence.engine_value and __file__ in result.divergence.engine_value


def test_an_engine_whose_constructor_raises_is_not_a_finding():
    from fuzz.replay import EngineBuildError

    def broken(trace):
        raise KeyError("no such setting")

    register_engine("broken-ctor", broken)
    try:
        with pytest.raises(EngineBuildError, match="could not be constructed: KeyError"):
            replay(random_trace(0), "broken-ctor")
    finally:
        del ENGINES["broken-ctor"]


def test_a_factory_that_returns_no_engine_or_a_module_that_raises_on_import_is_not_a_finding(tmp_path, monkeypatch):
    from fuzz.replay import EngineBuildError

    register_engine("not-an-engine", lambda trace: "a string")
    try:
        with pytest.raises(EngineBuildError, match="not an engine .*step"):
            replay(random_trace(0), "not-an-engine")
    finally:
        del ENGINES["not-an-engine"]
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EngineUnavailable, match="broken at import"):
        make_engine("raises_on_import:factory", random_trace(0))
