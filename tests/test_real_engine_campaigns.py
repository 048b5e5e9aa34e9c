"""Campaigns against real engines (#21): an engine's crash, hang and livelock are findings with
what a maintainer needs (traceback, place, first step of the cycle), shrunk like any other, and
every finding carries a triage class (automatic, then set by hand with ``batchspec triage``).

The engines here are the spec with one planted failure each; every campaign is a few seconds."""
from __future__ import annotations

import json
import os

import pytest

from fuzz.campaign import CampaignConfig, Task, run_campaign, run_task
from fuzz.engines import EngineHang, WatchedEngine
from fuzz.replay import register_engine
from fuzz.triage import DELIBERATE, ENGINE_BUG, find_livelock
from spec.formats import StepRecord
from spec.scheduler import SpecEngine


class AssertsOnPreemption(SpecEngine):
    """An engine-core assertion: it refuses to preempt (vLLM's placeholder-underflow asserts look so)."""

    name = "asserts"

    def step(self):
        record = super().step()
        assert not record.preempted, f"preempted {record.preempted} with outputs in flight"
        return record


class LoopsOnPreemption(SpecEngine):
    """A scheduler loop that never ends once it has to preempt."""

    name = "loops"

    def step(self):
        record = super().step()
        while record.preempted:  # the bug: nothing in the loop changes the condition
            pass
        return record


class StallsWhenTwoRun(SpecEngine):
    """Once two requests have been scheduled together it never schedules anything again: a livelock
    (period 1, a stall) whose first step is the step after that batch."""

    name = "stalls"

    def step(self):
        if getattr(self, "stuck", None):
            self.now += 1
            last = self.stuck  # the memory it holds stays as it was: the same state every step
            return StepRecord(self.now, num_free_blocks=last.num_free_blocks, blocks=last.blocks, cache_hits={},
                              num_evicted=0, block_ids=last.block_ids, evicted=[])
        record = super().step()
        self.now = record.step
        if len(record.scheduled) >= 2:
            self.stuck = record
        return record

    def has_unfinished_requests(self) -> bool:
        return bool(getattr(self, "stuck", None)) or super().has_unfinished_requests()


register_engine("t21-asserts", lambda t: AssertsOnPreemption.from_trace(t))
register_engine("t21-loops", lambda t: LoopsOnPreemption.from_trace(t))
register_engine("t21-stalls", lambda t: StallsWhenTwoRun.from_trace(t))


def _campaign(tmp_path, engine: str, **kw):
    cfg = CampaignConfig(**{"seed": 1, "engine": engine, "workers": 1, "corpus": str(tmp_path), "traces": 16,
                            "shrink_tries": 30, "profile": None, "max_findings": 1, "knobs": {"policy": "fcfs"}, **kw})
    return run_campaign(cfg)


def _group(tmp_path, name):
    return json.loads((tmp_path / f"{name}.group.json").read_text())


def test_an_engine_assertion_is_a_finding_with_its_place_traceback_and_class(tmp_path):
    state = _campaign(tmp_path, "t21-asserts", knobs={"policy": "fcfs"}, traces=32)
    [(name, entry)] = state.findings.items()
    kind, field, rule = entry["signature"]
    assert (kind, field) == ("error", "engine raised")
    assert rule.startswith("AssertionError at test_real_engine_campaigns.py:"), rule  # grouped by type and place
    report = (tmp_path / f"{name}.md").read_text()
    assert "### The engine's traceback" in report and "in step" in report and "assert not record.preempted" in report
    assert entry["triage"] == ENGINE_BUG and _group(tmp_path, name)["triage"]["class"] == ENGINE_BUG
    assert entry["requests"] <= 4  # shrunk, to the same crash


def test_a_hang_inside_a_step_is_interrupted_there_and_shrunk(tmp_path):
    state = _campaign(tmp_path, "t21-loops", timeout=4.0, traces=32)
    [(name, entry)] = state.findings.items()
    assert entry["signature"][:2] == ["hang", "step"]
    assert entry["signature"][2] == "stuck in test_real_engine_campaigns.py:step"
    report = (tmp_path / f"{name}.md").read_text()
    assert "while record.preempted" in report and "EngineHang" in report
    assert entry["triage"] == ENGINE_BUG and entry["requests"] is not None


def test_a_livelock_is_a_finding_at_the_first_step_of_its_cycle(tmp_path):
    state = _campaign(tmp_path, "t21-stalls")
    [(name, entry)] = state.findings.items()
    assert entry["signature"][:2] == ["livelock", "livelock"]
    trace_lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
    log = [json.loads(line) for line in (tmp_path / "stalls" / f"{name}.log.jsonl").read_text().splitlines()[1:]]
    two = next(r["step"] for r in log if len(r.get("scheduled", [])) >= 2)
    report = (tmp_path / f"{name}.md").read_text()
    assert f"from step {two + 1} to the step limit" in report, report[:1500]  # the cycle starts right after
    assert entry["triage"] == ENGINE_BUG and len(trace_lines) - 1 <= 3


def test_find_livelock_names_period_and_first_step_and_ignores_progress():
    def rec(step, **kw):
        return StepRecord(step, **kw)

    # progress, then a 2-cycle of preempt/readmit with no token, up to the limit (step 19)
    log = [rec(0, scheduled=[("A", 4)], sampled={"A": 1})] + [
        rec(s, scheduled=[("B", 8)] if s % 2 else [], preempted=[] if s % 2 else ["B"]) for s in range(1, 20)]
    cycle = find_livelock(log, max_steps=20)
    assert cycle is not None and (cycle.start, cycle.period, cycle.end) == (1, 2, 19)
    assert find_livelock(log[:-1], max_steps=20) is None  # it finished before the limit
    busy = [rec(s, scheduled=[("A", 1)], sampled={"A": 5}) for s in range(20)]
    assert find_livelock(busy, max_steps=20) is None  # the same record every step, but tokens are sampled


def test_a_watched_call_that_hangs_raises_inside_it():
    class Slow:
        name = "slow"

        def step(self):
            import time

            time.sleep(30)

    w = WatchedEngine(Slow(), 0.2)
    with pytest.raises(EngineHang):
        w.step()
    assert w.hung == "step" and w.where[2] == "step" and "time.sleep(30)" in w.traceback


def test_a_configuration_the_engine_refuses_is_not_run_not_a_harness_failure():
    from fuzz.replay import EngineConfigError

    def refuses(trace):
        raise EngineConfigError("the engine's validation refuses it")

    register_engine("t21-refuses", refuses)
    out = run_task(Task(0, 5, {}, "t21-refuses", "exact", 0))
    assert out.error is None and out.outside and "refuses" in out.outside


class WrongFlag(SpecEngine):
    """The spec under another value of a knob: a deliberate difference, one knob value away."""

    name = "flagged"

    @classmethod
    def from_trace(cls, trace, **kw):
        import dataclasses

        return super().from_trace(dataclasses.replace(trace, config={**trace.config, "admit_after_preempt": True}), **kw)


register_engine("t21-flagged", lambda t: WrongFlag.from_trace(t))


def test_a_divergence_one_knob_value_explains_is_triaged_deliberate_and_a_person_can_override(tmp_path):
    from batchspec.cli import main

    state = _campaign(tmp_path, "t21-flagged", traces=48, knobs={"policy": "fcfs", "admit_after_preempt": False})
    [(name, entry)] = state.findings.items()
    triage = _group(tmp_path, name)["triage"]
    assert entry["triage"] == DELIBERATE and triage["knob"] == {"admit_after_preempt": True}
    assert triage["status"] == "candidate" and triage["by"] == "auto"  # not documented for this engine
    group = _group(tmp_path, name)
    del group["triage"]
    (tmp_path / f"{name}.group.json").write_text(json.dumps(group))
    assert main(["triage", str(tmp_path), "--auto"]) == 0  # again from the saved trace and log, no engine run
    assert _group(tmp_path, name)["triage"]["knob"] == {"admit_after_preempt": True}
    assert main(["triage", str(tmp_path / f"{name}.jsonl"), "--class", "spec-wrong", "--why", "checked by hand",
                 "--source", "x.py:1"]) == 0
    triage = _group(tmp_path, name)["triage"]
    assert (triage["class"], triage["by"], triage["source"]) == ("spec-wrong", "human", "x.py:1")
    report = (tmp_path / f"{name}.md").read_text()
    assert report.count("## Triage") == 1 and "**spec-wrong** (confirmed, by human): checked by hand" in report
    assert main(["triage", str(tmp_path / f"{name}.jsonl"), "--class", "nonsense"]) == 2


class DiesOnPreemption(SpecEngine):
    """Its process dies when it has to preempt (a segfault in a kernel, an os._exit in a C extension)."""

    name = "dies"

    def step(self):
        record = super().step()
        if record.preempted:
            os._exit(3)
        return record


register_engine("t21-dies", lambda t: DiesOnPreemption.from_trace(t))


def test_a_worker_that_dies_leaves_a_replayable_trace_and_an_engine_bug_class(tmp_path):
    from fuzz.generate import random_trace
    from spec.io import load_trace

    state = _campaign(tmp_path, "t21-dies", traces=32)
    [(name, entry)] = state.findings.items()
    assert entry["signature"] == ["crash", "engine", "-"] and entry["requests"] is None  # not shrunk
    saved = load_trace(tmp_path / f"{name}.jsonl")
    again = random_trace(entry["seed"], **{"max_steps": 3000, **entry["options"]})
    assert [r.to_json() for r in saved.requests] == [r.to_json() for r in again.requests]  # the very trace
    assert _group(tmp_path, name)["triage"]["class"] == ENGINE_BUG
    assert "died" in (tmp_path / f"{name}.md").read_text()


@pytest.mark.parametrize("name,start,period", [("vllm-self-preempt-livelock", 4, 6), ("vllm-stall-never-fits", 4, 1)])
def test_vllms_own_recorded_livelocks_are_found_on_its_log(name, start, period):
    """vLLM 0.32's logs of its two known livelocks (tests/corpus/vllm/): the cycle and its first step."""
    from pathlib import Path

    from spec.config import resolve
    from spec.io import load_log, load_trace

    corpus = Path(__file__).parent / "corpus"
    trace = load_trace(corpus / f"{name}.jsonl")
    cycle = find_livelock(load_log(corpus / "vllm" / f"{name}.log.jsonl").records, resolve(trace.config).max_steps)
    assert cycle is not None and (cycle.start, cycle.period) == (start, period)
