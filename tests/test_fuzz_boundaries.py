"""Budget comparisons at their exact fit (issue 18): a share of a campaign's traces grow one prompt to
fill a step's token budget exactly (``fuzz.generate.budget_edge``), and a report whose request the spec
admitted with exactly the budget left names the gate that compares the two (``fuzz.diff.budget_fit_blame``).

An operator sweep of gpu_engine's formulas, pools and engine found the exact-fit comparisons
(``c <= left`` and its kin) among those that took hundreds of traces to show."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fuzz.corpus import group_signature
from fuzz.diff import budget_fit_blame
from fuzz.generate import BUDGET_EDGE_SHARE, random_trace
from fuzz.replay import replay
from spec.formats import StepRecord

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mutation_score as ms  # noqa: E402  (its planting mechanism)

UNCHUNKED = {"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 64}


def _records(budget_left_for_b: int) -> tuple[StepRecord, StepRecord]:
    """Spec: ``a`` decodes (1 token), ``b`` is admitted with ``budget_left_for_b`` tokens; engine: ``a`` only."""
    spec = StepRecord(step=4, scheduled=[("a", 1), ("b", budget_left_for_b)], new=["b"])
    engine = StepRecord(step=4, scheduled=[("a", 1)])
    return spec, engine


@pytest.mark.parametrize("config,rule", [
    (UNCHUNKED, "ADMIT.NO_CHUNKING"),
    ({"max_num_batched_tokens": 64, "max_model_len": 64}, "BUDGET.TOKENS"),
    ({"max_num_batched_tokens": 64, "max_model_len": 64, "prefill_chunking": "first-continues",
      "batching": "prefill-first"}, "ADMIT.CHUNK_ONLY_FIRST"),
])
def test_an_admission_that_ends_on_the_budget_names_the_gate_that_compares_them(config, rule):
    """``b``'s 63 tokens after ``a``'s 1 end exactly on the budget of 64: the engine leaving it out
    names the configured gate (first-continues: ``b`` is behind the batch's first entry); 62 tokens (budget to spare), a specific cause already named, or the engine giving ``b`` the same
    tokens name nothing."""
    spec, engine = _records(63)
    for generic in ("ADMIT.NEW", "BUDGET.TOKENS", None):
        assert budget_fit_blame(generic, "scheduled", spec, engine, "b", config) == rule
    assert budget_fit_blame("CACHE.HIT", "scheduled", spec, engine, "b", config) is None
    spare, engine_spare = _records(62)
    assert budget_fit_blame("ADMIT.NEW", "scheduled", spare, engine_spare, "b", config) is None
    same = StepRecord(step=4, scheduled=[("a", 1), ("b", 63)], new=["b"])
    assert budget_fit_blame("ADMIT.NEW", "scheduled", spec, same, "b", config) is None


def test_the_batchs_first_entry_is_held_to_the_budget_alone_under_first_continues():
    """First-continues lets the batch's first prefill be cut: when it is the one that ends on the
    budget, the token budget decided it, not the chunk-only-first gate."""
    config = {"max_num_batched_tokens": 64, "max_model_len": 64, "prefill_chunking": "first-continues",
              "batching": "prefill-first"}
    spec = StepRecord(step=2, scheduled=[("a", 64)], new=["a"])
    engine = StepRecord(step=2, scheduled=[("a", 60)], new=["a"])
    assert budget_fit_blame("ADMIT.NEW", "scheduled", spec, engine, "a", config) == "BUDGET.TOKENS"
    behind = StepRecord(step=2, scheduled=[("a", 40), ("b", 24)], new=["a", "b"])
    assert budget_fit_blame("ADMIT.NEW", "new", behind, StepRecord(step=2, scheduled=[("a", 40)], new=["a"]), "b",
                            config) == "ADMIT.CHUNK_ONLY_FIRST"


def test_a_campaign_grows_a_prompt_to_a_budget_edge_in_a_share_of_its_plain_traces():
    """fuzz.generate.BUDGET_EDGE_SHARE of the traces not shaped towards an interaction take
    ``budget_edge`` (a hash of seed and trace number: any worker count draws the same); shaped ones never."""
    from fuzz.campaign import CampaignConfig, campaign_envelope, trace_options

    cfg = CampaignConfig(seed=3)
    env = campaign_envelope(cfg)
    options = [trace_options(cfg, k, [], env, []) for k in range(400)]
    plain = [o for o in options if "interaction" not in o]
    drawn = sum(bool(o.get("budget_edge")) for o in plain)
    assert abs(drawn - BUDGET_EDGE_SHARE * len(plain)) <= 0.1 * len(plain) + 5, (drawn, len(plain))
    assert not any(o.get("budget_edge") for o in options if "interaction" in o)
    assert options == [trace_options(cfg, k, [], env, []) for k in range(400)]


@pytest.mark.parametrize("name,options", [
    ("admission_exact_fit_refused", {"enable_chunked_prefill": False}),
    ("chunk_only_first_inclusive", {"prefill_chunking": "first-continues", "batching": "prefill-first",
                                        "enable_chunked_prefill": True, "long_prefill_token_threshold": 0}),
])
def test_budget_edge_traces_show_an_exact_fit_refused_under_the_gates_name(name, options):
    """With the exact fit refused planted, a budget-edge trace diverges within 80 seeds, the same trace
    agrees unplanted, and its report names the gate at fault (mutation_score.AT_FAULT).  (No per-request
    cap here: a capped request's uncapped tokens, which first-continues compares, are not in the log.)"""
    found = ms.first_divergent(name, (random_trace(seed, budget_edge=True, **options) for seed in range(80)))
    assert found is not None, f"{name}: no divergence in 80 budget-edge traces"
    trace, grouped, replayed = found[0], group_signature(found[1])[2], found[1].divergence.rule
    assert grouped in ms.AT_FAULT[name] and replayed in ms.AT_FAULT[name], (grouped, replayed)
    assert replay(trace, "gpu", "exact").divergence is None


def test_pad_edge_moves_the_context_to_where_a_padded_admission_flips():
    """``pad_edge`` sets max_model_len to ``prompt_len + K + 1`` of a request admitted with one token
    left (its padded decode then just fits: hit + 1 + K + 1 <= max_model_len) or one less (refused):
    in the spec's run of the moved trace, that request is admitted with one token of its own, padded
    exactly when the context allows it.  Only the context and at most the two requests shaped into a
    candidate (a prefix hit of all but the last token) change."""
    from fuzz.pairs import spec_run

    padded_at_edge = refused_past_it = 0
    for seed in range(120):
        base = random_trace(seed, num_speculative_tokens=2)
        edged = random_trace(seed, num_speculative_tokens=2, pad_edge=True)
        mml = edged.config["max_model_len"]
        if mml == base.config["max_model_len"]:
            continue
        assert {**edged.config, "max_model_len": 0} == {**base.config, "max_model_len": 0}  # (the context moved)
        assert sum(a != b for a, b in zip(edged.requests, base.requests)) <= 2  # (at most a candidate was shaped)
        by_id = {r.id: r for r in edged.requests}
        ones = [(by_id[rid].prompt_len + 2 + 1 - mml, rec.drafts.get(rid, 0)) for rec in spec_run(edged)
                for rid, n in rec.scheduled if rid in rec.new and n - rec.drafts.get(rid, 0) == 1]
        at_edge = [(below, drafts) for below, drafts in ones if below in (0, 1)]
        assert at_edge, (seed, mml)
        assert all(drafts == 0 for below, drafts in at_edge if below == 1)  # one token past: never padded
        padded_at_edge += any(below == 0 and drafts for below, drafts in at_edge)
        refused_past_it += any(below == 1 for below, _ in at_edge)
    assert padded_at_edge >= 5 and refused_past_it >= 5, (padded_at_edge, refused_past_it)  # both sides of the edge


def test_pad_edge_traces_show_a_padding_past_the_context_under_its_rule():
    """With the padding's context test one token too loose planted, a pad-edge trace diverges within
    150 seeds, agrees unplanted, and names SPEC.PAD_ADMISSION (a hunt's bug, missed on 3 seeds before)."""
    traces = (random_trace(seed, num_speculative_tokens=k, pad_edge=True) for seed in range(150) for k in (2, 3))
    found = ms.first_divergent("pad_context_off_by_one", traces)
    assert found is not None, "no divergence in 300 pad-edge traces"
    trace, grouped, replayed = found[0], group_signature(found[1])[2], found[1].divergence.rule
    assert grouped == replayed == "SPEC.PAD_ADMISSION", (grouped, replayed)
    assert replay(trace, "gpu", "exact").divergence is None


def test_a_head_refused_for_a_padding_past_the_context_names_the_padding():
    """The spec admits B (a hit of 12 of its 13 tokens) with one token, unpadded: 12 + 1 + K + 1 > 17.
    An engine that stops its walk at the blocks gate there asked for the padded decode: the report
    names SPEC.PAD_ADMISSION, not the block gate — and the block gate where the context allowed padding."""
    from fuzz.diff import configured_rule

    config = {"profile": "vllm-v1", "block_size": 4, "max_model_len": 17, "max_num_batched_tokens": 5,
              "num_speculative_tokens": 4, "num_blocks": 5}
    spec = StepRecord(step=4, scheduled=[("B", 1)], new=["B"], cache_hits={"B": 12}, drafts={}, admit_stop="empty")
    engine = StepRecord(step=4, admit_stop="blocks", drafts={})
    assert configured_rule("ADMIT.NEW", "scheduled", spec, engine, "B", config) == "SPEC.PAD_ADMISSION"
    roomy = {**config, "max_model_len": 18}  # (the padding fitted the context: not the padding's test)
    assert configured_rule("ADMIT.NEW", "scheduled", spec, engine, "B", roomy) != "SPEC.PAD_ADMISSION"
