"""fuzz.strategies: the documented Hypothesis API — parameters, capability envelopes, failing examples as trace files."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis.errors import InvalidArgument

import fuzz.strategies as S
from fuzz import capabilities as caps
from spec.config import resolve
from spec.io import load_trace

REPO = Path(__file__).resolve().parent.parent
TOY = "examples.toy_engine:ToyEngine"
FAST = settings(max_examples=60, deadline=None, derandomize=True, database=None)


def test_traces_is_documented():
    doc = S.traces.__doc__
    for word in ("profile", "knobs", "engine", "capabilities", "max_requests", "Shrinking", "assert_agrees", "InvalidArgument"):
        assert word in doc, word
    assert (REPO / "docs" / "strategies.md").exists()


def test_no_arguments_draws_the_whole_map():
    seen = set()

    @settings(max_examples=150, deadline=None, derandomize=True, database=None)
    @given(S.traces())
    def run(trace):
        cfg = resolve(trace.config)
        seen.add(cfg.policy)
        seen.add(cfg.preemption_mode)
        seen.add(cfg.admission)

    run()
    assert {"fcfs", "priority", "spf", "vtc", "swap", "estimate"} <= seen


def test_knobs_alone_are_fixed_over_the_whole_map():
    seen = set()

    @FAST
    @given(S.traces(knobs={"enable_prefix_caching": False}))
    def run(trace):
        cfg = resolve(trace.config)
        assert not cfg.enable_prefix_caching
        seen.add(cfg.policy)

    run()
    assert len(seen) >= 3, "the rest of the map is still drawn"


def test_an_engines_envelope_bounds_every_draw():
    envelope = caps.for_engine(TOY)
    policies = set()

    @FAST
    @given(S.traces(engine=TOY, max_requests=3))
    def run(trace):
        assert envelope.admits(trace.config), envelope.violations(trace.config)
        assert 1 <= len(trace.requests) <= 3
        policies.add(resolve(trace.config).policy)

    run()
    assert policies == {"fcfs", "priority"}, "the declared values are drawn"


def test_profile_and_knobs_fix_what_they_name():
    @FAST
    @given(S.traces(profile="naive", knobs={"policy": "priority"}, min_requests=2, max_requests=2, max_prompt_len=5))
    def run(trace):
        cfg = resolve(trace.config)
        assert cfg.profile == "naive" and cfg.policy == "priority" and cfg.max_num_seqs == 1
        assert not cfg.enable_prefix_caching and cfg.long_prefill_token_threshold == 0
        assert len(trace.requests) == 2 and all(r.prompt_len <= 5 for r in trace.requests)

    run()


def test_a_capabilities_file_bounds_the_draws(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text('{"format": "batchspec-capabilities", "version": 1, "profile": "tgi", "knobs": {"block_size": [4]}}')

    @FAST
    @given(S.traces(capabilities=str(path)))
    def run(trace):
        cfg = resolve(trace.config)
        assert cfg.batching == "prefill-first" and cfg.kv_reservation == "full" and cfg.block_size == 4

    run()


@pytest.mark.parametrize("kwargs,needle", [
    ({"engine": TOY, "profile": "tgi"}, "outside the engine's capabilities"),
    ({"engine": TOY, "knobs": {"enable_prefix_caching": True}}, "enable_prefix_caching=True"),
    ({"profile": "nope"}, "unknown profile"),
    ({"knobs": {"polcy": "fcfs"}}, "unknown knob"),
    ({"knobs": {"policy": "lifo"}}, "policy"),
    ({"min_requests": 3, "max_requests": 2}, "min_requests"),
    ({"capabilities": {"knobs": {"policy": ["lifo"]}}}, "lifo"),
])
def test_bad_arguments_are_refused_when_the_strategy_is_built(kwargs, needle):
    with pytest.raises(InvalidArgument, match=needle):
        S.traces(**kwargs)


def test_a_failing_example_becomes_a_trace_file_and_a_replay_command_that_reproduces_it(tmp_path, monkeypatch):
    import examples.toy_engine as toy

    monkeypatch.setattr(toy, "BUG", "lone_cap")  # read at every step: the planted bug is on in this process
    failures = tmp_path / "failures"

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(S.traces(engine=TOY, knobs={"long_prefill_token_threshold": 2}, max_requests=3))
    def run(trace):
        S.assert_agrees(trace, TOY, directory=failures)

    with pytest.raises(AssertionError) as info:
        run()
    message = str(info.value)
    written = sorted(failures.glob("*.jsonl"))
    assert len(written) == 1, "only the minimal failing example is written, not every one tried while shrinking"
    command = f"batchspec replay {written[0]} --engine {TOY} --level exact"
    assert command in message
    trace = load_trace(written[0])
    assert trace.config["long_prefill_token_threshold"] == 2
    argv = command.split()[1:]
    env = {**os.environ, "TOY_BUG": "lone_cap"}
    buggy = subprocess.run([sys.executable, "-m", "batchspec.cli", *argv], cwd=REPO, env=env, capture_output=True, text=True)
    assert buggy.returncode == 1, buggy.stdout + buggy.stderr
    env["TOY_BUG"] = ""
    fixed = subprocess.run([sys.executable, "-m", "batchspec.cli", *argv], cwd=REPO, env=env, capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def test_note_trace_writes_only_the_final_example(tmp_path):
    calls = []

    @settings(max_examples=100, deadline=None, derandomize=True, database=None)
    @given(S.traces(max_requests=5))
    def mine(trace):  # a property of one's own: any trace with 3+ requests "fails"
        calls.append(S.note_trace(trace, "gpu", directory=tmp_path / "final"))
        assert len(trace.requests) < 3

    with pytest.raises(AssertionError):
        mine()
    written = [c for c in calls if c is not None]
    assert len(written) == 1 and len(calls) > 1, "one file: the minimal example's, not every one tried"
    assert len(load_trace(written[0]).requests) == 3
    trace = load_trace(REPO / "docs" / "examples" / "hol-blocking.jsonl")
    out = S.note_trace(trace, "gpu", directory=tmp_path)  # outside Hypothesis: written and printed
    assert out is not None and load_trace(out).requests == trace.requests
    assert out == S.write_trace_file(trace, tmp_path), "one example, one file"
    assert S.replay_command(out, "gpu") == f"batchspec replay {out} --engine gpu --level exact"
    from examples.toy_engine import ToyEngine

    assert S.replay_command(out, ToyEngine) == f"batchspec replay {out} --engine {TOY} --level exact"
