"""``batchspec triage-engines``: two engines, one trace set, the traces they decide differently.

The oracle for "which traces differ" is independent of the command: the spec's own decision logs
under priority_self_preempt=stop and =continue, produced by :func:`spec.protocol.drive` and
compared record by record."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from fuzz.generate import random_trace
from fuzz.triage import triage_command, triage_trace, parse_profile
from spec.config import resolve
from spec.protocol import drive
from spec.scheduler import SpecEngine

ROOT = Path(__file__).resolve().parents[1]
CONTINUE = "profile=vllm-v1,priority_self_preempt=continue"
B = "examples.triage_engines:gpu_continue"


def _spec_log(trace, value):
    t = dataclasses.replace(trace, config={**trace.config, "priority_self_preempt": value})
    recs = drive(SpecEngine.from_trace(t), t, resolve(t.config).max_steps)
    return [(r.step, r.scheduled, r.preempted, sorted(r.sampled), r.finished, r.new) for r in recs]


def _traces(n=40):
    return [(f"random-{s}", random_trace(s, policy="priority", tight_memory=True)) for s in range(n)]


def test_finds_exactly_the_traces_the_knob_changes_and_names_its_rule(monkeypatch):
    monkeypatch.chdir(ROOT)
    traces = _traces()
    expected = {name for name, t in traces if _spec_log(t, "stop") != _spec_log(t, "continue")}
    assert expected, "the seeds should include traces where a running request preempts itself"
    diffs = [d for name, t in traces if (d := triage_trace(t, name, "gpu", B, [parse_profile(CONTINUE)]))]
    assert {d.name for d in diffs} == expected
    for d in diffs:
        own, cont = d.verdicts
        assert (own.agrees_with, cont.agrees_with) == ("a", "b"), d.name
        assert d.separating == "RUN.PREEMPT_FOR_BLOCKS", d.name


def test_identical_engines_exit_0(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert triage_command(["tests/corpus"], "gpu", "spec", ["vllm-v1"]) == 0
    assert "0 of" in capsys.readouterr().out


def test_cli_exit_codes_and_recorded_logs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "batchspec.cli", "triage-engines", *a], cwd=ROOT,
                                    capture_output=True, text=True, env=env, timeout=300)
    one = "tests/corpus/vllm-priority-self-preempt.jsonl"
    out = run(one, "--engine-a", "gpu", "--engine-b", B, "--profile", CONTINUE)
    assert out.returncode == 1, out.stderr
    assert "first difference at step" in out.stdout and "separating rule: RUN.PREEMPT_FOR_BLOCKS" in out.stdout
    out = run(one, "--engine-a", "gpu", "--engine-b", B, "--profile", CONTINUE, "--json")
    report = __import__("json").loads(out.stdout)
    (diff,) = report["differ"]
    assert diff["step"] == 2 and diff["a"] == [] and diff["b"] == [["B", 1]]
    assert diff["separating_rule"] == "RUN.PREEMPT_FOR_BLOCKS"
    assert [v["agrees_with"] for v in diff["verdicts"]] == ["a", "b"]
    # engine A as a directory of recorded logs: the corpus keeps vLLM 0.32's log of this trace
    out = run(one, "--engine-a", "tests/corpus/vllm", "--engine-b", "gpu")
    assert out.returncode == 0, out.stdout + out.stderr
    bad = run(one, "--engine-a", "gpu", "--engine-b", "gpu", "--profile", "no-such-profile")
    assert bad.returncode == 2 and "no-such-profile" in bad.stderr
    missing = run(one, "--engine-a", str(tmp_path), "--engine-b", "gpu")
    assert missing.returncode == 2 and "no decision log" in missing.stderr


def test_a_crash_is_a_difference_at_its_step(monkeypatch):
    monkeypatch.chdir(ROOT)
    from spec.io import load_trace

    trace = load_trace(ROOT / "tests/corpus/vllm-priority-self-preempt.jsonl", steps=True)
    d = triage_trace(trace, "t", "gpu", "examples.triage_engines:gpu_crashes_at_step_3", [])
    assert d is not None and d.divergence.kind == "error" and d.divergence.step == 3
    assert d.divergence.spec_value == "ran" and "planted crash" in d.divergence.engine_value
    assert d.verdicts[0].agrees_with == "a"
