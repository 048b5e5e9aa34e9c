"""Corpus traces with a recorded vLLM 0.32 decision log, replayed against the spec in normal CI.

Each ``tests/corpus/NAME.jsonl`` that has ``tests/corpus/vllm/NAME.log.jsonl``
is a finding of the vLLM conformance work (docs/conformance.md): the spec,
fed the tokens vLLM sampled, must make every decision vLLM made.  No vLLM is
needed here; ``tests/test_vllm_conformance.py`` (marker ``vllm``) checks that
the stored logs are still what the live vLLM writes.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fuzz.replay import replay_records
from spec.io import load_log, load_trace

CORPUS = Path(__file__).parent / "corpus"
PAIRS = sorted((t, CORPUS / "vllm" / f"{t.stem}.log.jsonl") for t in CORPUS.glob("*.jsonl")
               if (CORPUS / "vllm" / f"{t.stem}.log.jsonl").exists())


def test_corpus_has_recorded_vllm_logs():
    assert len(PAIRS) >= 3


@pytest.mark.parametrize("trace_path,log_path", PAIRS, ids=[t.stem for t, _ in PAIRS])
def test_spec_makes_vllms_decisions(trace_path, log_path):
    trace, log = load_trace(trace_path), load_log(log_path)
    assert trace.description, "a corpus trace explains itself in its header's description"
    assert log.engine == "vllm-0.32.0" and log.level == "exact"
    result = replay_records(trace, log.records, "exact", engine="vllm")
    assert result.agreed, result.describe()


def test_stall_traces_stall_on_both_sides():
    for name in ("vllm-stall-never-fits", "vllm-self-preempt-livelock"):
        trace = load_trace(CORPUS / f"{name}.jsonl")
        result = replay_records(trace, load_log(CORPUS / "vllm" / f"{name}.log.jsonl").records, "exact", engine="vllm")
        assert result.agreed and result.notes and "max_steps=40" in result.notes[0]
        # The profile's default rejects the request at arrival instead.
        default = dataclasses.replace(trace, config={k: v for k, v in trace.config.items() if k != "reject_unservable"})
        from spec.scheduler import run

        assert run(default)[0].rejected == [("big", "never_fits")]


def test_priority_self_preempt_knob_is_what_separates_vllm_032_from_033():
    trace = load_trace(CORPUS / "vllm-priority-self-preempt.jsonl")
    records = load_log(CORPUS / "vllm" / "vllm-priority-self-preempt.log.jsonl").records
    assert replay_records(trace, records, "exact").agreed
    as_033 = dataclasses.replace(trace, config={**trace.config, "priority_self_preempt": "continue"})
    d = replay_records(as_033, records, "exact", engine="vllm").divergence
    assert d is not None and (d.step, d.field) == (2, "scheduled")
    assert d.spec_value == [["B", 1]] and d.engine_value == []


# -- the findings corpus: one group per bug, its count and smallest example, knob-naming reports ------------------

from fuzz import corpus as C  # noqa: E402
from fuzz.diff import Divergence  # noqa: E402
from spec.formats import StepRecord, Trace, TraceRequest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOY = "examples.toy_engine:ToyEngine"


def lone_cap_result(monkeypatch, prompts=(50,), cap=40):
    """A real divergence: the toy with its lone-cap bug planted, on requests that arrive one after another."""
    import examples.toy_engine as toy
    from fuzz.replay import replay

    monkeypatch.setattr(toy, "BUG", "lone_cap")
    requests = [TraceRequest(id=chr(65 + i), arrival_step=0, prompt_len=n, max_tokens=1) for i, n in enumerate(prompts)]
    trace = Trace(config={"profile": "naive", "long_prefill_token_threshold": cap, "num_blocks": 40}, requests=requests)
    result = replay(trace, TOY, "exact")
    assert not result.agreed
    return result


def test_a_group_keeps_its_smallest_example_and_counts_every_hit(tmp_path, monkeypatch):
    big = lone_cap_result(monkeypatch, prompts=(50, 60, 70))
    small = lone_cap_result(monkeypatch, prompts=(50,))
    sig = ("decision", "scheduled", "ADMIT.NEW")
    assert C.save_finding(tmp_path, big, sig, engine=TOY) is not None
    assert C.save_finding(tmp_path, big, sig, engine=TOY) is None, "not smaller: kept, counted"
    path = C.save_finding(tmp_path, small, sig, engine=TOY)
    assert path is not None and len(load_trace(path).requests) == 1, "a smaller example replaces the kept one"
    assert C.save_finding(tmp_path, big, sig, engine=TOY) is None
    group = C.read_group(tmp_path, C.slug(sig))
    assert group["count"] == 4 and group["example_requests"] == 1 and group["signature"] == list(sig)
    assert [p.name for p in C.corpus_traces(tmp_path)] == ["decision-scheduled-admit-new.jsonl"]
    report = (tmp_path / "decision-scheduled-admit-new.md").read_text()
    assert f"batchspec replay {tmp_path}/decision-scheduled-admit-new.jsonl --engine {TOY} --level exact" in report


def test_the_report_names_the_knob_the_finding_depends_on(tmp_path, monkeypatch):
    result = lone_cap_result(monkeypatch)
    C.save_finding(tmp_path, result, ("decision", "scheduled", "ADMIT.NEW"), engine=TOY)
    report = (tmp_path / "decision-scheduled-admit-new.md").read_text()
    assert "This finding depends on the knob **`long_prefill_token_threshold=40`** (profile `naive` has `0`)" in report
    knobs = report[report.index("## Knobs this trace sets apart"):report.index("## The divergence")]
    lines = [line for line in knobs.splitlines() if line.startswith("- ")]
    assert lines[0].startswith("- `long_prefill_token_threshold=40`") and "goes away without it" in lines[0]
    assert any(line.startswith("- `num_blocks=40`") and "workload size" in line for line in lines)


def test_a_knob_of_the_spec_rule_is_named_first_without_replaying():
    div = Divergence(3, "scheduled", [["A", 4]], [["A", 8]], "A", "BUDGET.LONG_PREFILL", "capped", context=[])
    lines, lead = C.knob_lines({"profile": "vllm-v1", "watermark": 0.1, "long_prefill_token_threshold": 4}, div)
    assert lead.startswith("This finding depends on the knob **`long_prefill_token_threshold=4`**")
    assert "rule `BUDGET.LONG_PREFILL` changes with it" in lead and lines[0].startswith("- `long_prefill_token_threshold=4`")
    plain = Divergence(3, "scheduled", [["A", 4]], [["A", 8]], "A", "RUN.DECODE", "decode", context=[])
    lines, lead = C.knob_lines({"profile": "vllm-v1", "watermark": 0.1}, plain)
    assert lead is None and lines == ["- `watermark=0.1` (profile `vllm-v1`: `0.0`)"]


def test_the_replay_command_names_an_engine_every_batchspec_can_load():
    from fuzz.replay import register_engine
    from examples.toy_engine import ToyEngine

    assert C.replay_engine_arg("gpu") == "gpu" and C.replay_engine_arg(TOY) == TOY
    register_engine("toy-corpus-test", ToyEngine)
    assert C.replay_engine_arg("toy-corpus-test") == TOY
    register_engine("lambda-test", lambda trace: ToyEngine(trace))
    assert C.replay_engine_arg("lambda-test") == "lambda-test", "no importable name: the registered one"


def test_the_group_signature_names_the_cause_first_field():
    from fuzz.replay import ReplayResult

    reasons = [{"rule": "RUN.DECODE", "request": "A", "text": "decode"},
               {"rule": "PREEMPT.VICTIM_NEWEST", "request": "B", "text": "newest running"}]
    spec = [StepRecord(5, scheduled=[("A", 1)], preempted=["B"], reasons=reasons)]
    eng = [StepRecord(5, scheduled=[("B", 1)], preempted=["A"])]
    div = Divergence(5, "scheduled", [["A", 1]], [["B", 1]], "A", "RUN.DECODE", "decode", context=reasons)
    trace = Trace(config={"profile": "vllm-v1"}, requests=[TraceRequest(id="A", prompt_len=4, max_tokens=2)])
    result = ReplayResult(trace, "e", "decisions", eng, spec, div)
    assert C.group_signature(result) == ("decision", "preempted", "PREEMPT.VICTIM_NEWEST")
    memory = ReplayResult(trace, "e", "memory", [StepRecord(5, num_free_blocks=3)], [StepRecord(5, num_free_blocks=4)],
                          Divergence(5, "num_free_blocks", 4, 3))
    # a memory divergence names the memory event behind the spec's value (an allocation here), not a request's role
    assert C.group_signature(memory) == ("decision", "num_free_blocks", "KV.NO_FREE_BLOCKS")
    ids = ReplayResult(trace, "e", "exact", [StepRecord(5, block_ids={"A": [2]})], [StepRecord(5, block_ids={"A": [1]})],
                       Divergence(5, "block_ids", {"A": [1]}, {"A": [2]}, "A", "RUN.PREFILL_CHUNK"))
    assert C.group_signature(ids) == ("decision", "block_ids", "KV.FREE_ORDER"), "the request's role is incidental to a block bug"
    preempting = ReplayResult(trace, "e", "memory", [StepRecord(5, preempted=["B"], num_free_blocks=3, blocks={"A": 1})],
                              [StepRecord(5, preempted=["B"], num_free_blocks=4, blocks={"A": 1})],
                              Divergence(5, "num_free_blocks", 4, 3))
    assert C.group_signature(preempting) == ("decision", "num_free_blocks", "PREEMPT.RECOMPUTE")
    early = ReplayResult(trace, "e", "decisions", [StepRecord(5, finished=[("A", "max_tokens")])], [StepRecord(5)],
                         Divergence(5, "finished", [], [["A", "max_tokens"]], "A"))
    assert C.group_signature(early) == ("decision", "finished", "STOP.LENGTH"), "the engine's stop reason, mapped"


def test_the_report_header_states_the_groups_cause_first_then_the_raw_divergence():
    """Item 7: a report grouped as preempted / PREEMPT.VICTIM_NEWEST leads with that, not with the raw first
    divergence (scheduled / RUN.DECODE), which follows, labelled as the raw one."""
    from fuzz.replay import ReplayResult

    reasons = [{"rule": "RUN.DECODE", "request": "A", "text": "decode"},
               {"rule": "PREEMPT.VICTIM_NEWEST", "request": "B", "text": "newest running"}]
    spec = [StepRecord(5, scheduled=[("A", 1)], preempted=["B"], reasons=reasons)]
    eng = [StepRecord(5, scheduled=[("B", 1)], preempted=["A"])]
    div = Divergence(5, "scheduled", [["A", 1]], [["B", 1]], "A", "RUN.DECODE", "decode", context=reasons)
    trace = Trace(config={"profile": "vllm-v1"}, requests=[TraceRequest(id="A", prompt_len=4, max_tokens=2),
                                                           TraceRequest(id="B", prompt_len=4, max_tokens=2)])
    result = ReplayResult(trace, "e", "decisions", eng, spec, div)
    sig = C.group_signature(result)
    report = C.triage_report(result, sig, C.slug(sig))
    header = report.split("\n")[2:4]
    assert C.slug(sig) == "decision-preempted-preempt-victim-newest"
    assert "field `preempted`" in header[0] and "`PREEMPT.VICTIM_NEWEST`" in header[0] and "RUN.DECODE" not in header[0]
    assert header[1].startswith("First raw divergence") and "field `scheduled`" in header[1] and "`RUN.DECODE`" in header[1]


def test_a_campaign_merges_manifestations_of_one_bug_into_one_group(tmp_path, monkeypatch):
    """Outcomes with different raw signatures whose shrunk divergences share a cause are one finding;
    a later raw signature already grouped is counted there without a shrunk example."""
    from fuzz.campaign import CampaignConfig, CampaignState, Outcome, _merge

    result = lone_cap_result(monkeypatch)
    group = ("decision", "scheduled", "ADMIT.NEW")
    cfg = CampaignConfig(engine=TOY, corpus=str(tmp_path))
    state = CampaignState(0, TOY, "exact")
    outcomes = [Outcome(0, 1, {}, signature=group, raw_signature=("decision", "scheduled", "RUN.PREFILL_CHUNK"), shrunk=result),
                Outcome(1, 2, {}, signature=group, raw_signature=group, shrunk=result),
                Outcome(2, 3, {}, signature=("decision", "scheduled", "RUN.PREFILL_CHUNK"),
                        raw_signature=("decision", "scheduled", "RUN.PREFILL_CHUNK"))]
    _merge(cfg, state, outcomes)
    assert list(state.findings) == ["decision-scheduled-admit-new"]
    entry = state.findings["decision-scheduled-admit-new"]
    assert entry["count"] == 3 and len(entry["raw_signatures"]) == 2
    assert C.read_group(tmp_path, "decision-scheduled-admit-new")["count"] == 3
