"""Speculative decoding (issue #15 item 2, rules SPEC.*), hand-worked from vLLM 0.32's code.

Every expected value was derived by hand from vLLM's scheduler before running
(``Scheduler.schedule``: a running request is scheduled ``num_tokens_with_spec +
placeholders - num_computed_tokens`` tokens and its ``spec_token_ids`` truncated to the
part past its known tokens; the waiting loop pads a one-token admission to ``1 + K``;
``update_from_output``: ``num_computed_tokens -= num_rejected`` before the tokens are
appended one by one under ``check_stop``; ``kv_cache_manager.allocate_slots``: slots for
every scheduled token, cached only up to ``request.num_tokens``).  The spec runs in the
normal suite; the same scenarios on vLLM's real scheduler are marked ``vllm``
(run with vLLM's own venv: ``python -m pytest -m vllm``).

Shared shape (tests/scenario_helpers.BASE): block size 4, 16 usable blocks, a 32-token
budget, max_model_len 64, no prefix caching unless said.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scenario_helpers import R, rules_for, steps, trace
from spec import specdec
from spec.config import ConfigError, resolve, step_plan
from spec.formats import StepRecord, TraceRequest
from spec.io import FormatError, load_trace

EXAMPLES = Path(__file__).parent.parent / "examples"


def _view(records: dict[int, StepRecord]) -> dict[int, tuple]:
    """Per step: the batch, the drafts scheduled, the drafts accepted, the finishes."""
    return {s: (r.scheduled, r.drafts, r.accepted, r.finished) for s, r in records.items()}


# -- scenarios (expected values worked by hand) ---------------------------------------

#: A: 6-token prompt, max_tokens 6, K=3, each verification accepts 1 draft.
#: step 0: prefill 6, samples its 1st token; the drafter proposes 3 (SPEC.PROPOSE).
#: step 1: 1 + 3 = 4 tokens (computed 6 -> 10, 3 blocks for 10 slots); 1 accepted: +2 tokens
#:         (3 outputs), 2 rejected: computed 10 - 2 = 8 = num_tokens - 1 (SPEC.ROLLBACK).
#: step 2: 4 tokens again (8 -> 12, still 3 blocks); +2 tokens (5 outputs), computed 10.
#: step 3: one output short of max_tokens, still 1 + 3 tokens (10 -> 14: a 4th block, for
#:         drafts that can never be used); the first of the 2 tokens reaches max_tokens and
#:         the accepted draft after it is dropped (SPEC.STOP_IN_DRAFTS).
ROLLBACK = ({"num_speculative_tokens": 3}, R("A", 6, 6, spec_accept=(1,)))
ROLLBACK_VIEW = {
    0: ([("A", 6)], {}, {}, []),
    1: ([("A", 4)], {"A": 3}, {"A": 1}, []),
    2: ([("A", 4)], {"A": 3}, {"A": 1}, []),
    3: ([("A", 4)], {"A": 3}, {"A": 1}, [("A", "max_tokens")]),
}
ROLLBACK_BLOCKS = {0: {"A": 2}, 1: {"A": 3}, 2: {"A": 3}, 3: {}}
ROLLBACK_COMPUTED = {0: {"A": 6}, 1: {"A": 8}, 2: {"A": 10}, 3: {}}

#: Budget 6, K=3: step 0 prefills A (4) and B (2). Step 1: A takes 1 + 3 = 4, B gets the 2
#: tokens left: 1 + 1 draft (its proposals truncated, SPEC.DRAFT_SCHEDULE); every draft
#: accepted (no script, and synchronous: the record's own outputs): A +4 tokens, B +2.
#: Step 2 is the same, and A's 4 tokens make its 9 outputs: it finishes (B has 5 of 9).
TRUNCATED = ({"num_speculative_tokens": 3, "max_num_batched_tokens": 6, "max_num_seqs": 4},
             R("A", 4, 9), R("B", 2, 9))
TRUNCATED_STEP1 = ([("A", 4), ("B", 2)], {"A": 3, "B": 1}, {"A": 3, "B": 1}, [])

#: Prefix caching on, K=3.  W (9 tokens, group g of 8) finishes at step 0 and leaves its two
#: group blocks cached.  X (9 tokens, same group) arrives at step 1 and hits 8 tokens: one
#: token left, so it is padded to 1 + 3 with dummy drafts (SPEC.PAD_ADMISSION: it had a hit),
#: 12 slots = 2 hit blocks + 1 new; the dummies are rejected: computed 8 + 4 - 3 = 9.
PADDED = ({"num_speculative_tokens": 3, "enable_prefix_caching": True},
          R("W", 9, 1, prefix_group="g", prefix_len=8),
          R("X", 9, 3, at=1, prefix_group="g", prefix_len=8))
PADDED_STEP1 = ([("X", 4)], {"X": 3}, {"X": 0}, [])

#: Async scheduling, K=2, A: 6-token prompt, max_tokens 5, every draft accepted.
#: step 0: prefill 6 (1 placeholder, 2 draft placeholders: SPEC.ASYNC_DRAFT_PLACEHOLDERS).
#: step 1: 6 + 2 + 1 - 6 = 3 tokens, 2 of them drafts; then step 0's 1 token arrives.
#: step 2: 7 + 2 + 3 - 9 = 3 tokens (2 drafts); then step 1's 3 tokens (4 outputs).
#: step 3: A is skipped (ASYNC.LAST_TOKEN_IN_FLIGHT: 12 + 2 - 3 >= 6 + 5); step 2's tokens
#:         arrive: the first reaches max_tokens, the 2 accepted drafts after it are dropped.
ASYNC = ({"num_speculative_tokens": 2, "async_scheduling": True}, R("A", 6, 5))
ASYNC_VIEW = {
    0: ([("A", 6)], {}, {}, []),
    1: ([("A", 3)], {"A": 2}, {}, []),
    2: ([("A", 3)], {"A": 2}, {"A": 2}, []),
    3: ([], {}, {"A": 2}, [("A", "max_tokens")]),
}


def test_drafts_are_scheduled_rejected_ones_rolled_back_and_their_blocks_kept():
    records = steps(*ROLLBACK)
    assert _view(records) == ROLLBACK_VIEW
    assert {s: r.blocks for s, r in records.items()} == ROLLBACK_BLOCKS
    assert {s: r.computed for s, r in records.items()} == ROLLBACK_COMPUTED
    assert "SPEC.DRAFT_SCHEDULE" in rules_for(records[1], "A")


def test_budget_truncates_a_requests_drafts():
    records = steps(*TRUNCATED)
    assert _view(records)[1] == TRUNCATED_STEP1
    assert _view(records)[2] == (*TRUNCATED_STEP1[:3], [("A", "max_tokens")])


def test_one_token_admission_is_padded_with_dummy_drafts():
    records = steps(*PADDED)
    assert records[1].new == ["X"] and records[1].cache_hits == {"X": 8}
    assert _view(records)[1] == PADDED_STEP1
    assert records[1].blocks == {"X": 3} and records[1].computed == {"X": 9}
    assert "SPEC.PAD_ADMISSION" in rules_for(records[1], "X")


def test_async_schedules_draft_placeholders_before_the_output_arrives():
    assert _view(steps(*ASYNC)) == ASYNC_VIEW


def test_draft_fields_are_logged_at_every_level_and_compared_by_the_differ():
    from fuzz.diff import first_divergence
    from spec.protocol import drive
    from spec.scheduler import SpecEngine

    t = trace(*ROLLBACK)
    for level in ("decisions", "memory", "exact"):
        recs = drive(SpecEngine.from_trace(t, record_level=level), t, 100)
        assert all("drafts" in r.to_json(level) and "accepted" in r.to_json(level) for r in recs)
    spec = drive(SpecEngine.from_trace(t), t, 100)
    other = drive(SpecEngine.from_trace(t), t, 100)
    other[2].accepted = {"A": 2}
    d = first_divergence(spec, other, "exact")
    assert (d.step, d.field, d.request, d.rule) == (2, "accepted", "A", "SPEC.ACCEPT")


def test_without_drafts_nothing_changes():
    """K=0: no SPEC rule in the plan, no draft fields in the records."""
    assert step_plan(resolve({"profile": "vllm-v1"})).speculative == ()
    records = steps({}, R("A", 6, 3))
    assert all(r.drafts is None and r.accepted is None for r in records.values())


def test_preemption_discards_proposed_drafts():
    """4 usable blocks, K=2: A and B (4-token prompts) decode 1 + 2 tokens a step until B
    cannot get a block and the newest, B, is preempted: it has proposals from its last
    output, and loses them (SPEC.PREEMPT_DISCARDS), so its resumption schedules none."""
    from spec.protocol import drive
    from spec.scheduler import SpecEngine

    t = trace({"num_speculative_tokens": 2, "num_blocks": 5}, R("A", 4, 8), R("B", 4, 8))
    eng = SpecEngine.from_trace(t, check_invariants=True)
    seen = []

    def on_step(record):
        for rid in record.preempted:
            seen.append((rid, eng.requests[rid].spec_drafts))

    records = drive(eng, t, 100, on_step=on_step)
    assert seen and all(drafts == 0 for _, drafts in seen), seen
    for r in records:
        for rid in r.resumed:
            assert "SPEC.DRAFT_SCHEDULE" not in rules_for(r, rid)


# -- acceptance script (SPEC.ACCEPT) ------------------------------------------------------


def test_spec_accept_cycles_and_is_capped_by_the_drafts_scheduled():
    tr = TraceRequest("a", 4, 4, spec_accept=(3, 0, 1))
    assert [specdec.accepted_drafts(tr, j, 2) for j in range(5)] == [2, 0, 1, 2, 0]


def test_spec_accept_rate_is_a_seeded_prefix_of_successes():
    tr = TraceRequest("a", 4, 4, spec_accept_rate=0.5)
    draws = [specdec.accept_rate_draw("a", 7, i) for i in range(4)]
    expected = next((i for i, u in enumerate(draws) if u >= 0.5), 4)
    assert specdec.accepted_drafts(tr, 7, 4) == expected
    assert specdec.accepted_drafts(TraceRequest("a", 4, 4, spec_accept_rate=0.0), 0, 4) == 0
    assert specdec.accepted_drafts(TraceRequest("a", 4, 4, spec_accept_rate=1.0), 0, 4) == 4
    assert specdec.accepted_drafts(TraceRequest("a", 4, 4), 0, 3) == 3  # no script: every draft


# -- formats and configuration -----------------------------------------------------------


def test_acceptance_fields_round_trip_through_json():
    for tr in (TraceRequest("a", 4, 4, spec_accept=(0, 2)), TraceRequest("b", 4, 4, spec_accept_rate=0.25)):
        assert TraceRequest.from_json(json.loads(json.dumps(tr.to_json()))) == tr


def _write(tmp_path, request: dict, config: dict | None = None) -> str:
    path = tmp_path / "t.jsonl"
    header = {"format": "batchspec-trace", "version": 1, "config": {"profile": "vllm-v1", **(config or {})}}
    path.write_text(json.dumps(header) + "\n" + json.dumps({"id": "a", "arrival_step": 0, "prompt_len": 4, "max_tokens": 4, **request}) + "\n")
    return str(path)


@pytest.mark.parametrize("request_fields, field", [
    ({"spec_accept": [1], "spec_accept_rate": 0.5}, "spec_accept_rate"),
    ({"spec_accept_rate": 1.5}, "spec_accept_rate"),
    ({"spec_accept": [-1]}, "spec_accept"),
    ({"spec_accept": []}, "spec_accept"),
])
def test_bad_acceptance_fields_are_refused_by_name(tmp_path, request_fields, field):
    with pytest.raises(FormatError) as e:
        load_trace(_write(tmp_path, request_fields))
    assert f"t.jsonl:2: {field}" in str(e.value)


def test_good_acceptance_fields_load(tmp_path):
    tr = load_trace(_write(tmp_path, {"spec_accept": [0, 3]}, {"num_speculative_tokens": 3})).requests[0]
    assert tr.spec_accept == (0, 3) and tr.spec_accept_rate is None


@pytest.mark.parametrize("knobs, field", [
    ({"num_speculative_tokens": 3, "long_prefill_token_threshold": 2}, "long_prefill_token_threshold"),
    ({"num_speculative_tokens": 3, "max_num_batched_tokens": 3, "max_num_seqs": 3}, "max_num_batched_tokens"),
    ({"num_speculative_tokens": 2, "batching": "prefill-first"}, "batching"),
    ({"num_speculative_tokens": 2, "policy": "vtc"}, "policy"),
    ({"num_speculative_tokens": 65}, "num_speculative_tokens"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
])
def test_configurations_speculative_decoding_is_not_specified_for_are_refused(knobs, field):
    with pytest.raises(ConfigError) as e:
        resolve({"profile": "vllm-v1", **knobs})
    assert e.value.field == field


def test_plans_name_the_proposal_rule_of_each_mode():
    sync = step_plan(resolve({"profile": "vllm-v1", "num_speculative_tokens": 2}))
    asyn = step_plan(resolve({"profile": "vllm-v1", "num_speculative_tokens": 2, "async_scheduling": True}))
    assert "SPEC.PROPOSE" in sync.speculative and "SPEC.ASYNC_DRAFT_PLACEHOLDERS" not in sync.speculative
    assert "SPEC.ASYNC_DRAFT_PLACEHOLDERS" in asyn.speculative and "SPEC.PROPOSE" not in asyn.speculative


def test_generator_draws_acceptance_only_with_speculative_decoding():
    from fuzz.generate import random_trace

    plain, spec = random_trace(5), random_trace(5, num_speculative_tokens=3)
    assert not any(r.spec_accept or r.spec_accept_rate is not None for r in plain.requests)
    assert any(r.spec_accept or r.spec_accept_rate is not None for r in spec.requests)
    cfg = resolve(spec.config)  # the generator keeps vLLM's constraints: the spec accepts it
    assert cfg.num_speculative_tokens == 3 and cfg.max_num_batched_tokens >= 4


# -- the same scenarios on vLLM's real scheduler ----------------------------------------


def _vllm_records(config, *requests):
    from fuzz.replay import EngineUnavailable, replay
    from fuzz.vllm_adapter import RELEASES, installed_release

    try:  # the installed release's profile (vllm-v1 for 0.32, vllm-v1-0.33 for 0.33)
        result = replay(trace({**config, "profile": RELEASES[installed_release()]}, *requests), "vllm", "exact")
    except EngineUnavailable as e:
        pytest.fail(f"the `vllm` suite was selected but vLLM cannot be used: {e}", pytrace=False)
    assert result.agreed, result.describe()
    return {r.step: r for r in result.engine_records}


@pytest.mark.vllm
@pytest.mark.parametrize("scenario, step, expected", [
    (ROLLBACK, 1, ROLLBACK_VIEW[1]), (ROLLBACK, 3, ROLLBACK_VIEW[3]), (TRUNCATED, 1, TRUNCATED_STEP1),
    (PADDED, 1, PADDED_STEP1), (ASYNC, 2, ASYNC_VIEW[2]), (ASYNC, 3, ASYNC_VIEW[3]),
])
def test_vllm_does_what_each_scenario_says(scenario, step, expected):
    assert _view(_vllm_records(*scenario))[step] == expected


@pytest.mark.vllm
@pytest.mark.parametrize("capabilities", ["vllm-v1-specdec", "vllm-v1-async-specdec"])
def test_vllm_random_speculative_traces_agree(capabilities):
    """At least 2,000 fuzzed traces with speculative decoding (and with async scheduling too)
    agree at the exact level (BATCHSPEC_VLLM_TRACES raises the count)."""
    import os

    from fuzz.capabilities import load
    from fuzz.conform import run_conformance

    from fuzz.vllm_adapter import installed_release

    n = max(2000, int(os.environ.get("BATCHSPEC_VLLM_TRACES", "2000")))
    if installed_release() == "0.33.0":  # its envelope pins the release knob priority_self_preempt=continue
        capabilities = capabilities.replace("vllm-v1-", "vllm-v1-0.33-")
    envelope = load(EXAMPLES / f"{capabilities}.capabilities.json")
    report = run_conformance(n, seed=0, level="exact", engine="vllm", progress=False, capabilities=envelope)
    assert report.n_traces >= 2000
    assert report.all_agreed, "\n\n".join(f"seed {o.seed}: {o.explanation}" for o in report.divergent[:5])


def test_gpu_engine_with_its_model_refuses_speculative_decoding_by_name():
    """gpu_engine drafts in scheduler-only mode (tests/test_gpu_specdec_diff.py); with its model it
    has no drafter, so it refuses the knob by name instead of running something else."""
    pytest.importorskip("torch", reason="gpu_engine needs torch")
    from gpu_engine.engine import GpuEngine, check_supported

    config = resolve({"profile": "vllm-v1", "num_speculative_tokens": 2})
    check_supported(config)  # implemented without a model
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        GpuEngine(config, model="tiny")


@pytest.mark.vllm
def test_vllm_asserts_on_a_padded_admission_cut_by_the_long_prefill_cap(monkeypatch):
    """The configuration the spec refuses (0 < long_prefill_token_threshold < 1 + K): W leaves
    its 8-token group prefix cached; X and Y then hit 8 of their 9 tokens, X's one token is
    padded to 1 + 3, and with two requests eligible the cap of 2 cuts it: vLLM fails its own
    ``assert num_new_tokens == 1 + self.num_spec_tokens``."""
    import dataclasses

    import fuzz.vllm_adapter as adapter
    from spec.config import PROFILES
    from spec.protocol import drive

    cfg = dataclasses.replace(PROFILES[adapter.RELEASES[adapter.installed_release()]].config, num_blocks=32, block_size=4, max_num_batched_tokens=32,
                              max_num_seqs=8, max_model_len=64, num_speculative_tokens=3,
                              long_prefill_token_threshold=2, enable_prefix_caching=True)
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        resolve({"profile": "vllm-v1", **{k: getattr(cfg, k) for k in ("num_speculative_tokens",
                                                                         "long_prefill_token_threshold")}})
    t = trace({}, R("W", 9, 1, prefix_group="g", prefix_len=8), R("X", 9, 3, at=3, prefix_group="g", prefix_len=8),
              R("Y", 9, 3, at=3, prefix_group="g", prefix_len=8))
    monkeypatch.setattr(adapter, "resolve", lambda raw: cfg)  # past the spec's refusal
    with pytest.raises(AssertionError):
        drive(adapter.VllmEngine(t), t, 50)


# -- the log checker counts drafts (invariants/log_checker.py) ---------------------------


def _check(t, records):
    from invariants.log_checker import check_log
    from spec.formats import DecisionLog

    return check_log(DecisionLog("spec", "exact", records), resolve(t.config), t).violations


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_log_checker_keeps_every_invariant_on_speculative_logs(async_scheduling):
    """Drafts scheduled past the known tokens, rolled back, kept slots, accepted tokens (stops
    among them) and blocks cached only once verified: none of it is a violation."""
    from fuzz.generate import random_trace
    from spec.protocol import drive
    from spec.scheduler import SpecEngine

    for seed in range(40):
        t = random_trace(seed, num_speculative_tokens=1 + seed % 4, async_scheduling=async_scheduling)
        broken = _check(t, drive(SpecEngine.from_trace(t), t, 100_000))
        assert not broken, (seed, [f"{v.invariant} at {v.step}: {v.evidence}" for v in broken[:3]])


def test_the_log_checker_flags_a_wrong_accepted_count():
    """One accepted draft more than the log's tokens show: the computed tokens the checker
    derives no longer match the log's own ``computed`` (and the stop rules' verdict moves)."""
    from spec.protocol import drive
    from spec.scheduler import SpecEngine

    t = trace(*ROLLBACK)
    records = drive(SpecEngine.from_trace(t), t, 100)
    assert not _check(t, records)
    records[1].accepted = {"A": 2}
    assert _check(t, records)


def test_conform_rotates_a_knob_the_generator_never_draws():
    """examples/vllm-v1-specdec.capabilities.json lists num_speculative_tokens 1-4 (not the
    profile's 0): seed i's trace gets value i mod 4, and the rest of its draws are random_trace(i)'s."""
    from fuzz.capabilities import load
    from fuzz.conform import trace_for
    from fuzz.generate import random_trace

    envelope = load(EXAMPLES / "vllm-v1-specdec.capabilities.json")
    for seed in range(8):
        t = trace_for(seed, envelope)
        assert resolve(t.config).num_speculative_tokens == [1, 2, 3, 4][seed % 4]
        plain = random_trace(seed)
        assert [(r.id, r.prompt_len, r.max_tokens) for r in t.requests] == \
               [(r.id, r.prompt_len, r.max_tokens) for r in plain.requests]


def test_recorded_vllm_speculative_logs_keep_every_invariant():
    """tests/corpus/vllm/vllm-specdec-*.log.jsonl (vLLM 0.32.0, scripts: the scenarios above and
    four fuzzed traces with padded admissions, preemption and stops among accepted drafts) hold
    no violation of the log checker; tests/test_fuzz_corpus.py replays them against the spec."""
    from invariants.log_checker import check_log
    from spec.io import load_log

    corpus = Path(__file__).parent / "corpus"
    traces = sorted(corpus.glob("vllm-specdec-*.jsonl"))
    assert len(traces) >= 7
    for path in traces:
        t, log = load_trace(path), load_log(corpus / "vllm" / f"{path.stem}.log.jsonl")
        assert log.engine == "vllm-0.32.0" and any(r.drafts for r in log.records)
        broken = check_log(log, resolve(t.config), t).violations
        assert not broken, (path.stem, [f"{v.invariant} at {v.step}: {v.evidence}" for v in broken[:3]])


# -- when accepted drafts' blocks are cached: 0.32 vs 0.33 (SPEC.CACHE_AT_OUTPUT) ---------------

#: Prefix caching, K=3, A: prompt 10..15, outputs 20, 21, 22, 23 scripted, max_tokens 4, every
#: draft accepted.  Step 0 prefills A (its first block cached at allocation).  Step 1 schedules
#: 1 + 3 (computed 6 -> 10) when A knows 7 tokens: the allocation caches nothing new; the 4
#: verified tokens stop at max_tokens after the third (10 tokens known).  vLLM 0.32 never
#: allocates for A again, so A's second block (14, 15, 20, 21) is never cached; 0.33 caches up
#: to num_tokens - 1 = 9 when the output is applied: the second block too.  B (10 tokens
#: starting with those 8) arrives at step 3 and hits 4 tokens under 0.32, 8 under 0.33.
CACHED = ({"num_speculative_tokens": 3, "enable_prefix_caching": True},
          R("A", [10, 11, 12, 13, 14, 15], 4, output_tokens=(20, 21, 22, 23)),
          R("B", [10, 11, 12, 13, 14, 15, 20, 21, 22, 30], 2, at=3))
CACHED_HIT = {"vllm-v1": 4, "vllm-v1-0.33": 8}


@pytest.mark.parametrize("profile", sorted(CACHED_HIT))
def test_accepted_drafts_blocks_are_cached_when_the_release_caches_them(profile):
    cfg, *requests = CACHED
    records = steps({**cfg, "profile": profile, "spec_cache_at_output": profile == "vllm-v1-0.33"}, *requests)
    assert records[1].finished == [("A", "max_tokens")]
    assert records[1].cache_registered == ({"A": [1]} if profile == "vllm-v1-0.33" else {})
    assert {rid: n for r in records.values() for rid, n in r.cache_hits.items()}["B"] == CACHED_HIT[profile]


@pytest.mark.vllm
def test_vllm_caches_accepted_drafts_blocks_as_its_release_does():
    from fuzz.vllm_adapter import RELEASES, installed_release

    records = _vllm_records(*CACHED)
    hits = {rid: n for r in records.values() for rid, n in (r.cache_hits or {}).items()}
    assert hits["B"] == CACHED_HIT[RELEASES[installed_release()]]
