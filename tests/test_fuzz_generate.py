"""The seeded trace generator: deterministic, valid, and covering every feature area."""
from __future__ import annotations

import collections
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fuzz.generate import FEATURES, random_trace, trace_features
from spec.config import resolve
from spec.io import load_trace, write_trace
from spec.scheduler import run

#: Digest of the traces seeds 0..99 make (see the last test).
GOLDEN = "45fbcc58f6faafc4"


def _lines(trace) -> list[str]:
    return [json.dumps(trace.header_json(), sort_keys=True)] + [json.dumps(r.to_json(), sort_keys=True) for r in trace.requests]


def test_same_seed_same_trace():
    for seed in (0, 1, 17, 123456789):
        assert _lines(random_trace(seed)) == _lines(random_trace(seed))


def test_different_seeds_differ():
    assert len({tuple(_lines(random_trace(s))) for s in range(50)}) == 50


def test_no_global_random_state():
    import random

    a = _lines(random_trace(5))
    random.seed(999)
    random.random()
    assert _lines(random_trace(5)) == a


def test_seeds_make_the_traces_the_conformance_results_were_measured_on():
    """docs/conformance.md reports results by seed: changing what a seed makes must be
    deliberate (update GOLDEN and re-run the conformance table)."""
    digest = hashlib.sha256()
    for seed in range(100):
        digest.update(json.dumps(_lines(random_trace(seed))).encode())
    assert digest.hexdigest()[:16] == GOLDEN, "random_trace changed: re-run `batchspec conform` and update docs/conformance.md"


@pytest.mark.parametrize("seed", range(0, 400, 7))
def test_traces_are_valid_files(seed, tmp_path):
    trace = random_trace(seed)
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    loaded = load_trace(path)  # schema + cross-field checks
    assert [r.to_json() for r in loaded.requests] == [r.to_json() for r in trace.requests]
    assert 2 <= len(trace.requests) <= (32 if "stress" in trace_features(trace) else 12)
    assert all(1 <= r.prompt_len <= 100 for r in trace.requests)
    plain = random_trace(seed, stress=False)
    assert 2 <= len(plain.requests) <= 12 and all(r.prompt_len <= 84 for r in plain.requests)


def test_format_rules_hold_over_many_seeds():
    for seed in range(500):
        trace = random_trace(seed)
        ids = [r.id for r in trace.requests]
        assert len(set(ids)) == len(ids)
        steps = [r.arrival_step for r in trace.requests]
        assert all(isinstance(s, int) for s in steps) and steps == sorted(steps)
        assert all(r.abort_at is None or r.abort_at >= r.arrival_step for r in trace.requests)


def test_configs_are_ones_vllm_accepts():
    """vLLM 0.32's SchedulerConfig.verify_max_model_len constraints."""
    for seed in range(500):
        cfg = resolve(random_trace(seed).config)
        assert cfg.max_num_batched_tokens >= cfg.max_num_seqs
        assert cfg.long_prefill_token_threshold <= cfg.max_model_len
        if not cfg.enable_chunked_prefill:
            assert cfg.max_num_batched_tokens >= cfg.max_model_len
        assert cfg.usable_blocks >= 1 and cfg.block_size in (1, 2, 3, 4, 5, 8, 16)


def test_fixed_knobs_keep_vllms_constraints():
    for seed in range(60):
        cfg = resolve(random_trace(seed, enable_chunked_prefill=False, max_num_seqs=8).config)
        assert not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens >= cfg.max_model_len
        assert cfg.max_num_seqs == 8 <= cfg.max_num_batched_tokens
    for seed in range(60):
        cfg = resolve(random_trace(seed, max_num_seqs=64).config)
        assert cfg.max_num_seqs == 64 <= cfg.max_num_batched_tokens


def test_every_feature_area_is_exercised():
    seen: collections.Counter = collections.Counter()
    for seed in range(300):
        trace = random_trace(seed)
        seen.update(trace_features(trace, run(trace)))
    missing = [f for f in FEATURES if seen[f] == 0]
    assert not missing, f"no trace in 300 exercises {missing}"
    assert seen["preemption"] >= 45, "tight memory should force preemption in a good fraction of traces"
    assert seen["chunked_prefill"] >= 150


def test_options_fix_knobs_and_switches():
    t = random_trace(3, policy="priority", enable_prefix_caching=True, n_requests=7, aborts=False)
    assert t.config["policy"] == "priority" and t.config["enable_prefix_caching"] is True
    assert len(t.requests) == 7
    assert all(r.abort_at is None for r in t.requests)
    assert any(r.abort_at is not None for s in range(20) for r in random_trace(s, aborts=True).requests)
    with pytest.raises(TypeError):
        random_trace(1, no_such_option=True)


def test_forced_rejections_produce_rejected_requests():
    rejected = 0
    for seed in range(40):
        trace = random_trace(seed, rejections=True)
        rejected += sum(len(r.rejected) for r in run(trace))
    assert rejected >= 10


def test_stress_traces_reach_the_extreme_corners():
    corners = collections.Counter()
    for seed in range(80):
        t = random_trace(seed, stress=True)
        cfg = resolve(t.config)
        assert "stress" in trace_features(t)
        corners.update({"vocab": t.vocab_size < 100, "block": cfg.block_size in (1, 2, 3, 5),
                        "many": len(t.requests) > 12, "short": cfg.max_model_len <= 12})
    assert all(corners[c] > 0 for c in ("vocab", "block", "many", "short")), corners


def test_static_tags_follow_the_config():
    t = random_trace(11, policy="fcfs", enable_chunked_prefill=False, max_num_batched_tokens=4096, watermark=0.1,
                     scheduler_reserve_full_isl=False, long_prefill_token_threshold=8, enable_prefix_caching=True,
                     stress=False)
    tags = trace_features(t)
    assert {"fcfs", "no_chunking", "watermark", "reserve_first_chunk", "long_prefill_cap", "prefix_caching"} <= tags
    assert "priority" not in tags and "chunked_prefill" not in tags


def test_edge_traces_put_a_prompt_at_an_arrival_limit_and_show_its_off_by_one():
    """``edges=True`` moves one prompt to where an arrival rule flips: with the context's limit
    off by one planted (a prompt of exactly max_model_len accepted), 60 plain traces show nothing
    and the same seeds with edges show it several times.  Plain traces are untouched (GOLDEN above)."""
    from fuzz.replay import replay

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import mutation_score as ms  # (its planting mechanism: one line of one method changed)

    mutant = next(m for m in ms.MUTANTS if m.name == "prompt_too_long_off_by_one")
    at_limit = sum(any(r.prompt_len in (t.config["max_model_len"] - 1, t.config["max_model_len"]) for r in t.requests)
                   for t in (random_trace(seed, edges=True) for seed in range(60)))
    assert at_limit >= 10, at_limit
    with ms.planted(mutant):
        plain = sum(replay(random_trace(seed), "gpu", "exact").divergence is not None for seed in range(60))
        edged = sum(replay(random_trace(seed, edges=True), "gpu", "exact").divergence is not None for seed in range(60))
    assert plain == 0 and edged >= 5, (plain, edged)


def _exact_fits(trace) -> int:
    """Admissions in the spec's run of ``trace`` that end exactly on their step's token budget."""
    from spec.protocol import drive
    from spec.scheduler import SpecEngine

    config = resolve(trace.config)
    records = drive(SpecEngine.from_trace(trace, check_invariants=False), trace, config.max_steps)
    fits = 0
    for rec in records:
        spent = 0
        for rid, n in rec.scheduled:
            spent += n
            fits += rid in rec.new and spent == config.max_num_batched_tokens
    return fits


def test_budget_edge_grows_one_prompt_to_fill_a_steps_budget_and_shows_the_exact_fit_off_by_one():
    """``budget_edge=True`` grows one admitted request's prompt (or the admission's before it) by
    its step's spare budget: only that prompt changes, it only grows, and the spec's runs of the
    shaped traces end admissions exactly on the budget more often.  With the unchunked
    admission's ``c <= left`` planted as ``c < left`` (an exact fit refused), 60 plain traces
    show nothing and the same seeds shaped show it."""
    from fuzz.replay import replay

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import mutation_score as ms
    import gpu_engine.formulas as F

    pairs = [(random_trace(seed, enable_chunked_prefill=False), random_trace(seed, enable_chunked_prefill=False,
                                                                              budget_edge=True)) for seed in range(60)]
    for plain, shaped in pairs:
        moved = [(a, b) for a, b in zip(plain.requests, shaped.requests) if a != b]
        assert len(moved) <= 1 and plain.config == shaped.config
        for a, b in moved:
            assert b.prompt_len > a.prompt_len and replace(b, prompt_len=a.prompt_len) == a
    assert sum(a != b for a, b in pairs) >= 15
    assert sum(map(_exact_fits, (b for _, b in pairs))) >= sum(map(_exact_fits, (a for a, _ in pairs))) + 4
    assert random_trace(7, budget_edge=True) == random_trace(7, budget_edge=True)

    patches = (ms.source_patch(F, "admission", "ok = ok & (c <= left)", "ok = ok & (c < left)")
               + ms.source_patch(F, "admission_walk", "(chunked or c <= left)", "(chunked or c < left)"))
    saved = [(o, n, o.__dict__[n]) for o, n, _ in patches]
    try:
        for o, n, v in patches:
            setattr(o, n, v)
        plain = sum(replay(a, "gpu", "exact").divergence is not None for a, _ in pairs)
        shaped = sum(replay(b, "gpu", "exact").divergence is not None for _, b in pairs)
    finally:
        for o, n, v in saved:
            setattr(o, n, v)
    assert plain == 0 and shaped >= 3, (plain, shaped)


def test_a_next_turn_continues_a_finished_conversation_and_reaches_its_output_blocks():
    """``turns``: a request arriving after another finished gets that request's prompt, the response
    it sampled and new tokens as its prompt, with its salt; in some traces its prefix hit then goes
    past the earlier prompt, into blocks filled by generated tokens (fuzz.generate.next_turn)."""
    from fuzz.pairs import spec_run

    turned = deep = 0
    for seed in range(100):
        trace = random_trace(seed, turns=True, enable_prefix_caching=True)
        base = random_trace(seed, enable_prefix_caching=True)
        changed = [r for r, b in zip(trace.requests, base.requests) if r != b]
        assert len(changed) <= 1
        if not changed:
            continue
        turned += 1
        [y] = changed
        finished = {rid: rec.step for rec in spec_run(base) for rid, _ in rec.finished}
        earlier = [x for x in base.requests if x.id != y.id and x.id in finished and finished[x.id] < y.arrival_step
                   and list(y.prompt[:x.prompt_len]) == x.prompt_token_ids(base.vocab_size)
                   and y.cache_salt == x.cache_salt and y.prompt_len > x.prompt_len]
        assert earlier, (seed, y)
        hit = max((rec.cache_hits or {}).get(y.id, 0) for rec in spec_run(trace))
        deep += hit > max(x.prompt_len for x in earlier)
    assert turned >= 40 and deep >= 3, (turned, deep)
    assert random_trace(5) == random_trace(5, turns=False)  # (plain traces never take a turn)


def test_a_campaign_draws_next_turns_in_a_share_of_its_traces():
    """fuzz.generate.TURNS_SHARE of a campaign's traces take ``turns`` (a hash of seed and trace number)."""
    from fuzz.campaign import CampaignConfig, campaign_envelope, trace_options
    from fuzz.generate import TURNS_SHARE

    cfg = CampaignConfig(seed=4)
    env = campaign_envelope(cfg)
    options = [trace_options(cfg, k, [], env, []) for k in range(400)]
    drawn = sum(bool(o.get("turns")) for o in options)
    assert abs(drawn - TURNS_SHARE * 400) <= 45, drawn
    assert options == [trace_options(cfg, k, [], env, []) for k in range(400)]
