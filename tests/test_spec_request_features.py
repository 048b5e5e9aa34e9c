"""Request features vLLM's scheduler sees (issue #15 item 3): ``skip_prefix_cache``,
``cache_salt``, ``min_tokens``, ``client_arrival_time``, and the knobs
``max_num_active_seqs`` and ``long_prefill_token_threshold_adaptive``, hand-worked from vLLM 0.32's code.

Every expected value below was derived by hand from vLLM's source before running
(``kv_cache_manager.get_computed_blocks``: no lookup when ``skip_reading_prefix_cache``;
``kv_cache_utils.generate_block_hash_extra_keys``: ``("cache_salt", salt)`` only in the
block starting at token 0; ``sched/utils.check_stop``: EOS and stop tokens are checked
before ``min_tokens``, which vLLM enforces in the sampler's logits processor instead).
The spec runs in the normal suite; the same scenarios on vLLM's real scheduler are
marked ``vllm`` (``BATCHSPEC_VLLM_VENV`` python, ``-m vllm``).

Shared shape: block size 4, a 32-block pool, 10-token prompts whose first 8 tokens
are the prefix group ``g`` (two full blocks), ``max_tokens`` 2.  A request admitted
while both group blocks are cached hits ``(10 - 1) // 4 = 2`` blocks = 8 tokens.
"""
from __future__ import annotations

import json
import os

import pytest

from spec.formats import Trace, TraceRequest, synthetic_token
from spec.io import FormatError, load_trace
from spec.scheduler import run

CONFIG = {"profile": "vllm-v1", "num_blocks": 32, "block_size": 4}
GROUP = {"prompt_len": 10, "max_tokens": 2, "prefix_group": "g", "prefix_len": 8}


def _trace(*requests, **config):
    return Trace(config={**CONFIG, **config}, requests=[TraceRequest(**r) for r in requests])


def _hits(records):
    """Prefix hits at admission, request -> tokens, over the whole run."""
    return {rid: n for r in records for rid, n in r.cache_hits.items()}


# -- scenarios (expected values worked by hand from vLLM's code) ---------------

SKIP = ({"id": "a", "arrival_step": 0, "skip_prefix_cache": True, **GROUP},
        {"id": "b", "arrival_step": 3, "skip_prefix_cache": True, **GROUP},
        {"id": "c", "arrival_step": 6, **GROUP})
#: a: empty cache. b: a's group blocks are cached but b never reads them (CACHE.SKIP_READ).
#: c: reads normally and hits the blocks the skipping requests registered: 8 tokens.
SKIP_HITS = {"a": 0, "b": 0, "c": 8}

SALT = ({"id": "a", "arrival_step": 0, "cache_salt": "x", **GROUP},
        {"id": "b", "arrival_step": 3, "cache_salt": "y", **GROUP},
        {"id": "c", "arrival_step": 6, "cache_salt": "x", **GROUP},
        {"id": "d", "arrival_step": 9, **GROUP})
#: Same tokens, but the salt changes block 0's hash and so the whole chain (CACHE.SALT):
#: only c (same salt as a) hits; b (other salt) and d (no salt) hit nothing.
SALT_HITS = {"a": 0, "b": 0, "c": 8, "d": 0}

MIN = ({"id": "a", "arrival_step": 0, "prompt_len": 6, "max_tokens": 5, "min_tokens": 2,
        "output_tokens": [2, 2, 2, 7], "stop_token_ids": [7]},
       {"id": "b", "arrival_step": 0, "prompt_len": 6, "max_tokens": 5, "min_tokens": 2,
        "output_tokens": [2, 7, 9]})


def _min_expected():
    """EOS is 2.  a: outputs 0 and 1 are scripted EOS, masked by the sampler, so the model
    samples the synthetic token there; output 2 is EOS again, now allowed: a finishes by
    EOS at step 2 with 3 outputs.  b: output 0 (EOS) masked; output 1 is 7, not one of
    b's stop tokens; b runs to max_tokens (5 outputs, steps 0..4)."""
    syn = lambda rid, i: synthetic_token(rid, i, 32000)  # noqa: E731 - the trace format's rule
    tokens = {"a": [syn("a", 0), syn("a", 1), 2], "b": [syn("b", 0), 7, 9, syn("b", 3), syn("b", 4)]}
    finished = {"a": (2, "eos"), "b": (4, "max_tokens")}
    return tokens, finished


TIE = ({"id": "x", "arrival_step": 0, "prompt_len": 4, "max_tokens": 3},
       {"id": "a", "arrival_step": 1, "prompt_len": 4, "max_tokens": 1, "priority": 1, "client_arrival_time": 5.0},
       {"id": "b", "arrival_step": 1, "prompt_len": 4, "max_tokens": 1, "priority": 1, "client_arrival_time": 2.0},
       {"id": "c", "arrival_step": 1, "prompt_len": 4, "max_tokens": 1, "priority": 1})
TIE_CONFIG = {"policy": "priority", "max_num_seqs": 1}
#: One running slot.  x runs steps 0-2 (3 outputs).  a, b, c tie on priority 1; vLLM's heap
#: orders them by arrival_time: b 2.0, c 3.0 (no client time: its arrival index 3), a 5.0.
#: Each finishes in the step it is admitted (one output), so: b at 3, c at 4, a at 5.
TIE_ADMITTED = {"x": 0, "b": 3, "c": 4, "a": 5}


ACTIVE = tuple({"id": str(i), "arrival_step": 0, "prompt_len": 4, "max_tokens": 2} for i in range(4))
ACTIVE_CONFIG = {"max_num_seqs": 4, "max_num_active_seqs": 2}
#: max_num_seqs 4 would run all four at once; max_num_active_seqs 2 admits two: 0 and 1
#: prefill at step 0 and finish at step 1 (two outputs), then 2 and 3 at steps 2-3.
ACTIVE_ADMITTED = {"0": 0, "1": 0, "2": 2, "3": 2}

ADAPTIVE = tuple({"id": str(i), "arrival_step": 0, "prompt_len": 30, "max_tokens": 2} for i in range(3))
ADAPTIVE_CONFIG = {"max_num_batched_tokens": 32, "max_num_seqs": 16, "long_prefill_token_threshold": 4,
                   "long_prefill_token_threshold_adaptive": True}
#: Three requests eligible: the cap 4 is floored at 32 // 3 = 10, so each prefills 10 tokens
#: a step for three steps (30 of the 32-token budget), then decodes once at step 3.
ADAPTIVE_SCHEDULED = [[(str(i), 10) for i in range(3)]] * 3 + [[(str(i), 1) for i in range(3)]]
#: Without the floor the cap is 4: 4 tokens each a step.
FIXED_CAP_FIRST_STEP = [(str(i), 4) for i in range(3)]


def _admitted(records):
    return {rid: r.step for r in records for rid in r.new}


def _sampled(records):
    out: dict[str, list[int]] = {}
    for r in records:
        for rid, t in r.sampled.items():
            out.setdefault(rid, []).append(t)
    return out


def _finished(records):
    return {rid: (r.step, why) for r in records for rid, why in r.finished}


def test_skip_prefix_cache_reads_nothing_but_still_registers():
    assert _hits(run(_trace(*SKIP))) == SKIP_HITS


def test_cache_salt_separates_prefixes():
    assert _hits(run(_trace(*SALT))) == SALT_HITS


def test_cache_salt_unset_and_equal_salts_still_share():
    """Without salts the same three requests hit as usual (the salt is what separated them)."""
    plain = [{k: v for k, v in r.items() if k != "cache_salt"} for r in SALT]
    assert _hits(run(_trace(*plain))) == {"a": 0, "b": 8, "c": 8, "d": 8}


def test_min_tokens_masks_stop_tokens_until_reached():
    tokens, finished = _min_expected()
    records = run(_trace(*MIN))
    assert _sampled(records) == tokens
    assert _finished(records) == finished


def test_min_tokens_masked_replacement_avoids_stop_tokens():
    """A stop token that is also the synthetic replacement is skipped too (never a stop token)."""
    syn0 = synthetic_token("c", 0, 32000)
    tr = TraceRequest(id="c", prompt_len=4, max_tokens=3, min_tokens=1, output_tokens=(2,), stop_token_ids=(syn0,))
    token = tr.output_token(0, 32000, 2)
    assert token not in (2, syn0)
    with pytest.raises(ValueError, match="eos_token_id"):
        tr.output_token(0, 32000)  # an engine that forgets the EOS id fails loudly


def test_client_arrival_time_breaks_priority_ties():
    assert _admitted(run(_trace(*TIE, **TIE_CONFIG))) == TIE_ADMITTED


def test_without_client_arrival_time_ties_follow_arrival_order():
    plain = [{k: v for k, v in r.items() if k != "client_arrival_time"} for r in TIE]
    assert _admitted(run(_trace(*plain, **TIE_CONFIG))) == {"x": 0, "a": 3, "b": 4, "c": 5}


def test_max_num_active_seqs_limits_admission():
    assert _admitted(run(_trace(*ACTIVE, **ACTIVE_CONFIG))) == ACTIVE_ADMITTED
    assert _admitted(run(_trace(*ACTIVE, max_num_seqs=4))) == {str(i): 0 for i in range(4)}


def test_max_num_active_seqs_above_max_num_seqs_is_refused():
    from spec.config import ConfigError, resolve

    with pytest.raises(ConfigError, match="max_num_active_seqs"):
        resolve({**CONFIG, "max_num_seqs": 2, "max_num_active_seqs": 3})


def test_adaptive_long_prefill_threshold_floors_the_cap_at_a_fair_share():
    assert [r.scheduled for r in run(_trace(*ADAPTIVE, **ADAPTIVE_CONFIG))] == ADAPTIVE_SCHEDULED
    fixed = {**ADAPTIVE_CONFIG, "long_prefill_token_threshold_adaptive": False}
    assert run(_trace(*ADAPTIVE, **fixed))[0].scheduled == FIXED_CAP_FIRST_STEP


def test_features_round_trip_through_json():
    for r in SKIP + SALT + MIN + TIE:
        tr = TraceRequest(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()})
        assert TraceRequest.from_json(tr.to_json()) == tr


@pytest.mark.parametrize("field,value,problem", [
    ("min_tokens", 9, "more than max_tokens"),
    ("min_tokens", -1, ""),
    ("cache_salt", "", ""),
    ("cache_salt", 3, ""),
    ("skip_prefix_cache", "yes", ""),
    ("client_arrival_time", -1.0, ""),
    ("client_arrival_time", 2e9, "exceeds the limit"),
])
def test_bad_feature_values_are_refused(tmp_path, field, value, problem):
    path = tmp_path / "t.jsonl"
    header = {"format": "batchspec-trace", "version": 1, "config": CONFIG}
    req = {"id": "a", "arrival_step": 0, "prompt_len": 4, "max_tokens": 3, field: value}
    path.write_text(json.dumps(header) + "\n" + json.dumps(req) + "\n")
    with pytest.raises(FormatError) as e:
        load_trace(path)
    assert e.value.line == 2 and field in str(e.value) and problem in str(e.value)


# -- the same scenarios on vLLM 0.32's real scheduler --------------------------

def _vllm(*requests, **config):
    from fuzz.replay import EngineUnavailable
    from fuzz.vllm_adapter import VllmEngine
    from spec.protocol import drive

    trace = _trace(*requests, **config)
    try:
        engine = VllmEngine(trace)
    except EngineUnavailable as e:
        pytest.fail(f"the `vllm` suite was selected but vLLM cannot be used: {e}", pytrace=False)
    return drive(engine, trace, 1000)


@pytest.mark.vllm
def test_vllm_skip_prefix_cache():
    assert _hits(_vllm(*SKIP)) == SKIP_HITS


@pytest.mark.vllm
def test_vllm_cache_salt():
    assert _hits(_vllm(*SALT)) == SALT_HITS


@pytest.mark.vllm
def test_vllm_min_tokens():
    tokens, finished = _min_expected()
    records = _vllm(*MIN)
    assert _sampled(records) == tokens
    assert _finished(records) == finished


@pytest.mark.vllm
def test_vllm_client_arrival_time():
    assert _admitted(_vllm(*TIE, **TIE_CONFIG)) == TIE_ADMITTED


@pytest.mark.vllm
def test_vllm_max_num_active_seqs():
    assert _admitted(_vllm(*ACTIVE, **ACTIVE_CONFIG)) == ACTIVE_ADMITTED


@pytest.mark.vllm
def test_vllm_adaptive_long_prefill_threshold():
    assert [r.scheduled for r in _vllm(*ADAPTIVE, **ADAPTIVE_CONFIG)] == ADAPTIVE_SCHEDULED


SCENARIOS = {"skip": (SKIP, {}), "salt": (SALT, {}), "min": (MIN, {}), "tie": (TIE, TIE_CONFIG),
             "active": (ACTIVE, ACTIVE_CONFIG), "adaptive": (ADAPTIVE, ADAPTIVE_CONFIG)}


@pytest.mark.vllm
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_vllm_equals_spec_exactly(scenario):
    from fuzz.diff import first_divergence

    requests, config = SCENARIOS[scenario]
    spec, vllm = run(_trace(*requests, **config)), _vllm(*requests, **config)
    assert first_divergence(spec, vllm, level="exact") is None


# -- the fuzzer's knob ---------------------------------------------------------

def test_generator_draws_features_without_changing_other_draws():
    """``request_features=True`` adds the fields from its own random stream: the rest of
    each trace is the one ``random_trace(seed)`` makes, and the features appear."""
    from dataclasses import replace

    from fuzz.generate import REQUEST_FEATURES, random_trace, trace_features

    seen = set()
    for seed in range(60):
        plain, drawn = random_trace(seed), random_trace(seed, request_features=True)
        new_knobs = {"max_num_active_seqs", "long_prefill_token_threshold_adaptive"}
        assert {k: v for k, v in drawn.config.items() if k not in new_knobs} == plain.config
        assert [replace(r, skip_prefix_cache=False, cache_salt=None, min_tokens=0, client_arrival_time=None)
                for r in drawn.requests] == plain.requests
        assert all(0 <= r.min_tokens <= r.max_tokens for r in drawn.requests)
        assert random_trace(seed, request_features=True).requests == drawn.requests  # deterministic
        seen |= trace_features(drawn) & set(REQUEST_FEATURES)
        assert not trace_features(plain) & set(REQUEST_FEATURES)
    assert seen == set(REQUEST_FEATURES)


def test_generated_feature_traces_run_on_the_spec_with_invariants():
    from fuzz.generate import random_trace

    from invariants.log_checker import check_log
    from spec.config import resolve
    from spec.formats import DecisionLog

    for seed in range(40):
        trace = random_trace(seed, request_features=True)
        log = DecisionLog("spec", "exact", run(trace, check_invariants=True))
        report = check_log(log, resolve(trace.config), trace)
        assert report.ok, (seed, report.violations[:3])


# -- gpu_engine: implements them independently ------------------------------------

#: Random traces with the request features drawn, gpu_engine vs the spec at the exact level
#: (issue 15: 500 per new combination; BATCHSPEC_GPU_FEATURE_TRACES to change).
N_GPU_TRACES = int(os.environ.get("BATCHSPEC_GPU_FEATURE_TRACES", "500"))


@pytest.mark.parametrize("options", [{}, {"policy": "priority"}, {"profile": "vllm-v1-async"}],
                         ids=["drawn", "priority", "vllm-v1-async"])
def test_gpu_engine_agrees_with_the_spec_on_feature_traces(options):
    """Every request feature and both new knobs (drawn only without a profile, which fixes
    every knob) on gpu_engine's own implementation."""
    from fuzz.generate import random_trace, trace_features
    from fuzz.replay import replay

    seen, diverged = set(), []
    for seed in range(N_GPU_TRACES):
        trace = random_trace(seed, request_features=True, **options)
        result = replay(trace, "gpu", "exact")
        seen |= trace_features(trace, result.spec_records)
        if not result.agreed:
            diverged.append((seed, result.divergence.describe()))
    assert not diverged, f"{len(diverged)} divergences, first: {diverged[0]}"
    wanted = {"skip_prefix_cache", "cache_salt", "min_tokens", "prefix_hits"}
    if "profile" not in options:
        wanted |= {"max_num_active_seqs", "adaptive_long_prefill", "client_arrival_time", "preemption"}
    assert wanted <= seen


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_gpu_engine_hand_worked_scenarios(scenario):
    from fuzz.diff import first_divergence
    from fuzz.replay import replay

    requests, config = SCENARIOS[scenario]
    trace = _trace(*requests, **config)
    records = replay(trace, "gpu", "exact").engine_records
    assert first_divergence(run(trace), records, level="exact") is None
    expected = {"skip": (_hits, SKIP_HITS), "salt": (_hits, SALT_HITS), "tie": (_admitted, TIE_ADMITTED),
                "active": (_admitted, ACTIVE_ADMITTED),
                "adaptive": (lambda rs: [r.scheduled for r in rs], ADAPTIVE_SCHEDULED),
                "min": (lambda rs: (_sampled(rs), _finished(rs)), _min_expected())}[scenario]
    assert expected[0](records) == expected[1]


def test_conform_draws_the_features_on_request():
    """`batchspec conform --request-features`: the traces carry them, the areas show them,
    and the reproduction command names the flag."""
    from fuzz.conform import run_conformance

    report = run_conformance(30, engine="gpu", progress=False, workers=1, features=True)
    assert report.all_agreed and report.command().endswith("--request-features")
    areas = report.areas()
    assert all(areas[name].traces > 0 for name in ("skip_prefix_cache", "cache_salt", "min_tokens"))
    plain = run_conformance(30, engine="gpu", progress=False, workers=1)
    assert "skip_prefix_cache" not in plain.areas() and "--request-features" not in plain.command()
