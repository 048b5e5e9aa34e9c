"""Mechanisms no default campaign combined (issue 18): each pair is a steering target, and each target
makes a bug planted where the two meet visible, under the rule at fault.

Coverage of gpu_engine over a 3,000-trace default campaign found branches that ran 0 times: the swap-in
order under the priority policy, a swap-in's VTC charge, SLO admission control under prefill-first
batching, and a request that its in-flight token stops after a preemption leaving its VTC tenant's
queue.  A radix tree evicting whole leaves (SGLang's) was drawn with one-token pages only, where an
insert that forgets to refresh the nodes it walks shows in ~1 trace in 150."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fuzz.campaign import COMBINATIONS, _all_targets, rule_target
from fuzz.corpus import group_signature
from fuzz.generate import random_trace
from fuzz.replay import replay

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mutation_score as ms  # noqa: E402  (its planting mechanism: one line of one method changed)


#: mechanism pair (fuzz.campaign.COMBINATIONS) -> the planted bug where its two mechanisms meet, and whether the first divergent
#: trace, unshrunk, already names the rule at fault (the VTC one first shows as a crash in the admission
#: the stale waiting count leads to)
CASES = [
    ("swap-in x priority", "swap_order_ignores_priority", True),
    ("swap-in x VTC charge", "vtc_swap_in_uncharged", True),
    ("SLO admission x prefill-first", "slo_admission_continuous_only", True),
    ("VTC x async scheduling", "vtc_stale_finish_keeps_waiting", False),
    ("radix tree x paged blocks", "radix_insert_no_stamp", True),
]


@pytest.mark.parametrize("key,name,named", CASES, ids=[name for _, name, _ in CASES])
def test_the_steering_target_makes_the_bug_where_its_mechanisms_meet_visible(key, name, named):
    """Among the target's first traces one diverges with the bug planted, and the same trace agrees
    without the bug (the divergence is the bug's, not the target's); where ``named``, its report (grouped
    as the campaign names it) names a rule at fault."""
    target = COMBINATIONS[key]
    assert target in _all_targets(None), f"{key}: not in the rotation every campaign goes round"
    found = ms.first_divergent(name, (random_trace(seed, **target) for seed in range(200)))
    assert found is not None, f"{name}: no divergence in 200 traces of {key}'s target"
    trace, rule = found[0], group_signature(found[1])[2]
    if named:
        assert rule in ms.AT_FAULT[name], f"{name}: the report names {rule}, not one of {ms.AT_FAULT[name]}"
    assert replay(trace, "gpu", "exact").divergence is None


def test_the_radix_pair_draws_pages_longer_than_one_token_beside_the_rules_own_target():
    """SGLang's profile fixes one-token pages; the pair leaves the page size to the generator, so a
    request that fills no new page at its finish (its finish inserts no node) is drawn.  The rule's own
    target (SGLang's knobs) stays in the rotation: a pair stands in for no rule."""
    target = COMBINATIONS["radix tree x paged blocks"]
    assert "block_size" not in target and target["cache_eviction"] == "leaf-lru"
    sizes = {random_trace(seed, **target).config["block_size"] for seed in range(40)}
    assert any(size > 1 for size in sizes), sizes
    own = rule_target("CACHE.EVICT_LEAF_LRU")
    assert own["block_size"] == 1 and own in _all_targets(None)


def test_a_fixed_profile_keeps_its_knobs_in_the_pairs():
    """Under ``--profile tgi`` a pair's knobs that the profile fixes are dropped, as a family's are."""
    from fuzz.generate import profile_knobs

    fixed = profile_knobs("tgi")
    for target in _all_targets("tgi"):
        assert not set(target) & set(fixed), target


def test_block_ids_after_another_eviction_name_the_leaf_eviction_under_a_radix_tree():
    """Under leaf-LRU a pop hands out content-free blocks: when the step's evictions differ, the other
    blocks a request got are the eviction's symptom.  Under block-LRU the pop itself evicts, and the
    free queue's order stays the rule named (None here)."""
    from fuzz.diff import leaf_eviction_blame
    from spec.formats import StepRecord

    spec = StepRecord(24, block_ids={"r7": [2, 6, 5]}, evicted=[5, 1, 3, 4])
    eng = StepRecord(24, block_ids={"r7": [2, 6, 3]}, evicted=[3, 4, 5, 1])
    radix = {"profile": "sglang", "block_size": 4}
    assert leaf_eviction_blame("block_ids", spec, eng, radix) == "CACHE.EVICT_LEAF_LRU"
    assert leaf_eviction_blame("block_ids", spec, eng, {"profile": "vllm-v1"}) is None
    same = StepRecord(24, block_ids={"r7": [2, 6, 3]}, evicted=[5, 1, 3, 4])
    assert leaf_eviction_blame("block_ids", spec, same, radix) is None  # (the evictions agree: the pop's order)
    assert leaf_eviction_blame("blocks", spec, eng, radix) is None


def test_an_admission_the_spec_deferral_reordered_names_slo_deferral():
    """SLO admission control under prefill-first batching (slo_admission_continuous_only): the engine
    never deferred r6, so it took r6 where the spec took r5 — r6 deferred in an earlier step — or
    blocked on r6 in the step the spec deferred it and admitted r5 behind it."""
    from fuzz.diff import QUEUE_ORDER, decision_cause
    from spec.formats import StepRecord

    def defer(rid: str) -> dict:
        return {"rule": "SLO.DEFER", "request": rid, "text": "deadline out of reach"}

    earlier = [StepRecord(3, reasons=[defer("r6")])]
    spec = StepRecord(5, scheduled=[("r5", 2)], new=["r5"], reasons=[{"rule": "ADMIT.NEW", "request": "r5"}])
    eng = StepRecord(5, scheduled=[("r6", 2)], new=["r6"])
    assert decision_cause("new", spec, eng, "r6", earlier[-1], earlier) == "SLO.DEFER"
    assert decision_cause("new", spec, eng, "r6") == QUEUE_ORDER  # (no deferral on record: the queue's order)
    admitted = [StepRecord(3, reasons=[defer("r6")]), StepRecord(4, scheduled=[("r6", 2)], new=["r6"])]
    assert decision_cause("new", spec, eng, "r6", admitted[-1], admitted) == QUEUE_ORDER  # (r6 ran since)
    now = StepRecord(5, scheduled=[("r5", 2)], new=["r5"], reasons=[defer("r6"), {"rule": "ADMIT.NEW", "request": "r5"}])
    assert decision_cause("new", now, StepRecord(5, scheduled=[("r1", 1)]), "r5") == "SLO.DEFER"


def test_a_campaign_moves_a_prompt_to_an_arrival_limit_in_a_quarter_of_its_traces():
    """fuzz.generate.EDGE_SHARE of a campaign's traces take ``edges`` (chosen by a hash of the seed and
    trace number, so any worker count draws the same traces); plain random_trace never does."""
    from fuzz.campaign import CampaignConfig, campaign_envelope, trace_options

    cfg = CampaignConfig(seed=3)
    env = campaign_envelope(cfg)
    drawn = [trace_options(cfg, k, [], env, []).get("edges", False) for k in range(400)]
    assert 60 <= sum(drawn) <= 140, sum(drawn)
    assert drawn == [trace_options(cfg, k, [], env, []).get("edges", False) for k in range(400)]
