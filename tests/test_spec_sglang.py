"""Hand-worked scenarios for the knobs that make the ``sglang`` profile agree with SGLang 0.5.23
(issue #16 item 2; docs/conformance.md, SGLang section): length_limits=clip (REJECT.INPUT_LIMIT,
ARRIVE.CLIP_MAX_TOKENS), ignore_eos_scope (STOP.IGNORE_EOS_SCOPE), prefill_chunking=last-continues
(RUN.CONTINUE_PREFILL_FIRST, ESTIMATE.CONTINUED_CHUNK), abort_running=after-next-sample
(ABORT.AFTER_NEXT_SAMPLE) and admission_hold=until-departure (ESTIMATE.HOLD_UNTIL_DEPARTURE).
Each is checked against the value the other engines use, with every invariant on.  gpu_engine's
implementation of the same knobs is checked in tests/test_gpu_map_diff.py (the sglang profile and
the mixed-knob draws)."""
from __future__ import annotations

import pytest

from scenario_helpers import R, rules_for, scheduled, steps
from spec.config import ConfigError, resolve
from spec.scheduler import ignore_eos_reserve_admits, insert_eos_state

#: token-granular pool of 1,000 slots (slot 0 is the padding slot), SGLang's page size 1
SG = {"profile": "sglang", "block_size": 1, "num_blocks": 1001, "max_num_batched_tokens": 64, "max_model_len": 32,
      "max_num_seqs": 8}


def _finishes(recs):
    return {rid: (s, why) for s, r in recs.items() for rid, why in r.finished}


def test_input_limit_refuses_six_below_the_context_or_the_pool():
    # max_req_input_len = min(32 - 1, 1000 - 1) - 5 = 26: a 26-token prompt is refused, 25 runs
    recs = steps(SG, R("long", 26, 2), R("ok", 25, 2))
    assert recs[0].rejected == [("long", "prompt_too_long")] and recs[0].new == ["ok"]
    assert "REJECT.INPUT_LIMIT" in rules_for(recs[0], "long")
    # the pool's bound: 40 slots, max_model_len 128 -> 34 tokens refused (never_fits), 33 run
    recs = steps({**SG, "num_blocks": 41, "max_model_len": 128}, R("a", 34, 2), R("b", 33, 2))
    assert recs[0].rejected == [("a", "never_fits")] and recs[0].new == ["b"]
    # vllm-v1's rule admits the 26-token prompt (26 + 1 <= 32)
    assert steps({**SG, "length_limits": "reject"}, R("long", 26, 2))[0].new == ["long"]


def test_an_input_limit_refusal_says_which_limit_refused_it():
    """The reason names the test that refused the prompt: the input limit, or (blocks of more than
    one token) an output room under one token, where the prompt is below the input limit."""
    def text(config, prompt):
        [r] = [r for r in steps(config, R("x", prompt, 2))[0].reasons if r["rule"] == "REJECT.INPUT_LIMIT"]
        return r["text"]

    assert text(SG, 26) == "prompt 26 >= min(max_model_len, pool) - 6 = 26"
    # 11 blocks of 8 (88 slots, 82 context): 73 < 82 - 6, but 88 - 80 - 8 - 1 = -1 output tokens fit
    paged = {**SG, "block_size": 8, "num_blocks": 12, "max_model_len": 82}
    assert text(paged, 73) == "prompt 73 leaves room for -1 output tokens in 8-token blocks (at least 1 needed)"


def test_clip_cuts_max_tokens_two_short_of_the_limit_and_admits_what_vllm_rejects():
    # 32 - 20 - 2 = 10 outputs at most: r finishes after 10 tokens (reason max_model_len), s asked 10
    recs = steps(SG, R("r", 20, 20), R("s", 20, 10))
    assert "ARRIVE.CLIP_MAX_TOKENS" in rules_for(recs[0], "r") and "ARRIVE.CLIP_MAX_TOKENS" not in rules_for(recs[0], "s")
    assert _finishes(recs) == {"r": (9, "max_model_len"), "s": (9, "max_tokens")}
    assert sum("r" in rec.sampled for rec in recs.values()) == 10
    # under "reject" r runs to max_model_len: 32 - 20 = 12 outputs
    recs = steps({**SG, "length_limits": "reject"}, R("r", 20, 20))
    assert _finishes(recs) == {"r": (11, "max_model_len")}
    # a request whose peak exceeds the pool: rejected under "reject", admitted and cut under "clip"
    small = {**SG, "num_blocks": 31, "max_model_len": 64}  # 30 slots: 10 + 30 - 1 > 30
    assert steps({**small, "length_limits": "reject"}, R("big", 10, 30))[0].rejected == [("big", "never_fits")]
    recs = steps(small, R("big", 10, 30))  # min(64 - 10 - 2, 30 - 10 - 1 - 1) = 18 outputs
    assert _finishes(recs) == {"big": (17, "max_model_len")}


def test_clip_needs_the_input_limit():
    with pytest.raises(ConfigError, match="length_limits"):
        resolve({"profile": "sglang", "reject_unservable": False})


def test_ignore_eos_ignores_stop_tokens_too():
    outputs = (100, 777, 101, 102, 103, 104)
    req = R("x", 6, 6, ignore_eos=True, stop_token_ids=(777,), output_tokens=outputs)
    assert _finishes(steps(SG, req)) == {"x": (5, "max_tokens")}
    assert _finishes(steps({**SG, "ignore_eos_scope": "eos"}, req)) == {"x": (1, "stop_token")}
    # without ignore_eos the stop token stops it under both values
    plain = R("y", 6, 6, stop_token_ids=(777,), output_tokens=outputs)
    assert _finishes(steps(SG, plain)) == {"y": (1, "stop_token")}


def test_last_continues_the_cut_prefill_first_and_shares_the_budget():
    """Budget 8: A (10 tokens) is cut after 8; next step it continues first with its last 2 and B
    is admitted with the 6 left (cut too), then B continues; only then does anybody decode."""
    cfg = {**SG, "max_num_batched_tokens": 8, "num_blocks": 64, "max_model_len": 128}
    recs = steps(cfg, R("A", 10, 4), R("B", 12, 3))
    got = scheduled(recs)
    assert got[0] == [("A", 8)]
    assert got[1] == [("A", 2), ("B", 6)] and recs[1].new == ["B"] and "A" in recs[1].sampled
    assert "RUN.CONTINUE_PREFILL_FIRST" in rules_for(recs[1], "A")
    assert got[2] == [("B", 6)] and got[3] == [("A", 1), ("B", 1)]
    # "any": the cut prefill waits in the running list while B's prefill batch takes the whole budget
    got = scheduled(steps({**cfg, "prefill_chunking": "any"}, R("A", 10, 4), R("B", 12, 3)))
    assert got[1] == [("B", 8)]


def test_continued_chunk_is_charged_to_the_estimate_not_its_running_share():
    """rem at step 1 = 55 free before the chunk - (2 + 1 + 4) for A's last chunk and its output
    (ESTIMATE.CONTINUED_CHUNK), not 0.7 x A's 4 remaining outputs."""
    cfg = {**SG, "max_num_batched_tokens": 8, "num_blocks": 64, "max_model_len": 128}
    recs = steps(cfg, R("A", 10, 4), R("B", 12, 3))
    assert recs[1].estimate_rem == 48


def test_abort_of_a_running_request_takes_effect_after_its_next_sample():
    cfg = {**SG, "max_model_len": 128}
    recs = steps(cfg, R("r0", 8, 20, abort_at=3), R("r1", 8, 20))
    assert recs[3].aborted == ["r0"] and ("r0", 1) in recs[3].scheduled and "r0" in recs[3].sampled
    assert "ABORT.AFTER_NEXT_SAMPLE" in rules_for(recs[3], "r0")
    assert "r0" not in recs[3].blocks and "r0" not in {rid for rid, _ in recs[3].finished}
    assert all("r0" not in dict(r.scheduled) for s, r in recs.items() if s > 3)
    at_once = steps({**cfg, "abort_running": "at-once"}, R("r0", 8, 20, abort_at=3), R("r1", 8, 20))
    assert at_once[3].aborted == ["r0"] and at_once[3].scheduled == [("r1", 1)]


def test_admission_hold_waits_for_a_departure_not_for_the_ratio():
    """30 slots, the ratio at its floor after two decode steps.  B is refused at step 0 (nothing
    ran before: no hold) and again at step 1 while A runs: from then on B is not even tested until
    A finishes, although the decayed ratio would admit it at step 3 (admission_hold=off)."""
    cfg = {**SG, "num_blocks": 31, "max_model_len": 64, "new_token_ratio_decay_steps": 2}
    recs = steps(cfg, R("A", 2, 20), R("B", 2, 20))
    assert "ESTIMATE.ADMIT" in rules_for(recs[0], "B") and "ESTIMATE.ADMIT" in rules_for(recs[1], "B")
    assert "ESTIMATE.HOLD_UNTIL_DEPARTURE" in rules_for(recs[3], "B")
    assert "ESTIMATE.ADMIT" not in rules_for(recs[3], "B")
    a_done = _finishes(recs)["A"][0]
    assert a_done == 19 and next(s for s, r in recs.items() if r.new == ["B"]) == a_done + 1
    off = steps({**cfg, "admission_hold": "off"}, R("A", 2, 20), R("B", 2, 20))
    assert off[3].new == ["B"]


def test_admission_hold_is_an_estimate_rule():
    with pytest.raises(ConfigError, match="admission_hold"):
        resolve({"profile": "vllm-v1", "admission_hold": "until-departure"})


#: 100 usable slots, no radix cache: SGLang tests an ignore_eos request by add_one_req_ignore_eos
NO_CACHE = {**SG, "num_blocks": 101, "max_model_len": 128, "enable_prefix_caching": False}


def test_ignore_eos_reserve_refuses_what_the_estimate_admits():
    """A (10 tokens, 40 outputs) runs from step 0 and holds 10 slots: 90 free at step 1, A has
    sampled once.  B (35 tokens, 26 outputs, ignore_eos) arrives at step 1.  ESTIMATE.ADMIT:
    35 + 26 + 1 = 62 < 90 - 0.7 x 39 = 62.7, admitted.  ESTIMATE.IGNORE_EOS_RESERVE: its paged
    36 fit, then the simulation sorted by tokens left, [B (26, 35), A (0.7 x 40 - 1 = 27, 11)]:
    with both growing, 90 - 36 - 26 x 2 = 2 <= the reserve of 1 x 2: refused (and held)."""
    reqs = (R("A", 10, 40, output_tokens=(100,) * 40), R("B", 35, 26, at=1, ignore_eos=True))
    recs = steps(NO_CACHE, *reqs)
    assert recs[0].new == ["A"] and recs[1].new == []
    assert "ESTIMATE.IGNORE_EOS_RESERVE" in rules_for(recs[1], "B") and "ESTIMATE.ADMIT" not in rules_for(recs[1], "B")
    assert "ESTIMATE.HOLD_UNTIL_DEPARTURE" in rules_for(recs[2], "B")
    assert steps({**NO_CACHE, "ignore_eos_admission": "estimate"}, *reqs)[1].new == ["B"]
    # with the radix cache on SGLang never takes this path: ESTIMATE.ADMIT admits B
    assert steps({**NO_CACHE, "enable_prefix_caching": True}, *reqs)[1].new == ["B"]
    # one output fewer leaves 4 > 2 at the first point and 54 + 35 - 27 = 62 > 1 at the second: admitted
    fewer = (reqs[0], R("B", 35, 25, at=1, ignore_eos=True))
    assert steps(NO_CACHE, *fewer)[1].new == ["B"]


def test_ignore_eos_reserve_is_not_applied_to_a_request_that_would_run_alone():
    """The recorded finding (tests/corpus/sglang/findings/ignore-eos-no-cache-stall.jsonl): 83
    slots, r0 (52 tokens, max_tokens clipped to 83 - 52 - 2 = 29) alone.  SGLang's rule refuses
    it in every step (83 - 53 - 29 x 1 = 1 <= 1) and it never runs; the spec admits it."""
    paged, free = 53, 83
    assert not ignore_eos_reserve_admits(paged, free, float(free), [(29.0, 52)], alone=False)
    assert ignore_eos_reserve_admits(paged, free, float(free), [(29.0, 52)], alone=True)
    cfg = {**SG, "enable_prefix_caching": False, "max_model_len": 128, "num_blocks": 84}
    recs = steps(cfg, R("r0", 52, 32, ignore_eos=True))
    assert recs[0].new == ["r0"] and _finishes(recs)["r0"] == (28, "max_model_len")


def test_ignore_eos_reserve_inserts_later_candidates_as_sglang_does():
    """Later candidates of a round go before the first entry with at least as many tokens left,
    or, when every entry has fewer, before the last one (SGLang's loop index stops there)."""
    states = [(1.0, 5), (3.0, 5)]
    insert_eos_state(states, (2.0, 7))
    assert states == [(1.0, 5), (2.0, 7), (3.0, 5)]
    insert_eos_state(states, (9.0, 8))
    assert states == [(1.0, 5), (2.0, 7), (9.0, 8), (3.0, 5)]
    empty: list = []
    insert_eos_state(empty, (4.0, 1))
    insert_eos_state(empty, None)  # nothing left to produce: not simulated
    assert empty == [(4.0, 1)]


def test_ignore_eos_admission_is_an_estimate_rule():
    with pytest.raises(ConfigError, match="ignore_eos_admission"):
        resolve({"profile": "vllm-v1", "ignore_eos_admission": "reserve"})


def test_no_chunking_cap_exclusive_needs_budget_left_behind_the_first():
    """Chunked prefill off, budget 64: A (12) is admitted, B (52 = the 52 tokens left) is not:
    SGLang refuses input_tokens >= rem_input_tokens behind the batch's first request; it runs in
    the next step (the SGLang campaign's spec-wrong finding, tests/corpus/sglang/agree/)."""
    cfg = {**SG, "enable_chunked_prefill": False, "enable_prefix_caching": False,
           "max_model_len": 59, "max_num_batched_tokens": 64, "max_num_seqs": 2, "num_blocks": 70}
    reqs = (R("A", 12, 1), R("B", 52, 1))
    recs = steps(cfg, *reqs)
    assert scheduled(recs)[0] == [("A", 12)] and scheduled(recs)[1] == [("B", 52)]
    assert "ADMIT.NO_CHUNKING_EXCLUSIVE" in rules_for(recs[0], "B")
    assert scheduled(steps({**cfg, "no_chunking_cap": "inclusive"}, *reqs))[0] == [("A", 12), ("B", 52)]
    # one token fewer leaves one token of budget: both in step 0
    assert scheduled(steps(cfg, R("A", 12, 1), R("B", 51, 1)))[0] == [("A", 12), ("B", 51)]


def test_no_chunking_cap_exclusive_is_tested_after_the_estimate():
    """A request that both the input cap and the estimate refuse is refused by the estimate (SGLang
    tests memory first): with a batch running, that holds admission (ESTIMATE.HOLD_UNTIL_DEPARTURE).
    100 slots; A (4 tokens, 50 outputs) runs from step 0.  At step 1 C (10) is admitted (rem 96 -
    0.7 x 49 = 61.7 - 13 = 48.7 left, 54 tokens of budget); D (55 tokens) needs 58 > 48.7 and
    55 >= 54."""
    cfg = {**SG, "enable_chunked_prefill": False, "enable_prefix_caching": False,
           "max_model_len": 64, "max_num_batched_tokens": 64, "num_blocks": 101}
    reqs = (R("A", 4, 50, output_tokens=(100,) * 50), R("C", 10, 2, at=1), R("D", 55, 2, at=1))
    recs = steps(cfg, *reqs)
    assert recs[1].new == ["C"]
    assert "ESTIMATE.ADMIT" in rules_for(recs[1], "D") and "ADMIT.NO_CHUNKING_EXCLUSIVE" not in rules_for(recs[1], "D")
    assert "ESTIMATE.HOLD_UNTIL_DEPARTURE" in rules_for(recs[2], "D")
    # vLLM's order (the cap first): the cap refuses D, which holds nothing
    recs = steps({**cfg, "no_chunking_cap": "inclusive"}, *reqs)
    assert "ADMIT.NO_CHUNKING" in rules_for(recs[1], "D") and "ESTIMATE.ADMIT" not in rules_for(recs[1], "D")
    assert "ESTIMATE.HOLD_UNTIL_DEPARTURE" not in rules_for(recs[2], "D")


# -- the radix cache (#8 CACHE.EVICT_LEAF_LRU, #13 CACHE.DEDUP_ON_INSERT) ------------------------

#: the scenarios' pool with SGLang's radix cache on (scenario_helpers turns caching off by default)
SGC = {**SG, "enable_prefix_caching": True}


def _prompt(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def test_dedup_frees_the_second_copy_of_a_prefix_computed_in_the_same_step():
    """r0 and r1 compute the same 16-token prefix in step 0 (neither can hit the other's blocks);
    when r1's blocks enter the cache its 16 duplicates are freed and its table points at r0's."""
    p = _prompt(100, 16)
    reqs = (R("r0", p + [500, 501, 502, 503], 3), R("r1", p + [600, 601, 602, 603], 3))
    cfg = {**SGC, "num_blocks": 101}  # 100 usable slots
    rec = steps(cfg, *reqs)[0]
    assert rec.num_free_blocks == 100 - 40 + 16
    assert rec.block_ids["r1"][:16] == rec.block_ids["r0"][:16]
    assert set(rec.block_ids["r1"][16:]).isdisjoint(rec.block_ids["r0"])
    # cache_dedup=off (with vLLM's block-level eviction): both copies stay
    rec = steps({**cfg, "cache_eviction": "block-lru", "cache_dedup": "off"}, *reqs)[0]
    assert rec.num_free_blocks == 100 - 40
    assert set(rec.block_ids["r1"]).isdisjoint(rec.block_ids["r0"])


def test_leaf_lru_evicts_a_whole_leaf_and_the_outputs_before_the_prompt():
    """A (10-token prompt, 6 outputs) finishes at step 5 and caches its 15 computed tokens as two
    nodes, the prompt more recent than the outputs.  B needs 8 slots with 5 free of content:
    the whole 5-token output leaf goes (not the 3 slots missing), A's prompt stays for C's hit."""
    pa = _prompt(100, 10)
    cfg = {**SGC, "num_blocks": 21, "max_model_len": 64}  # 20 usable slots
    reqs = (R("A", pa, 6), R("B", _prompt(300, 8), 1, at=6), R("C", pa + [999], 1, at=7))
    recs = steps(cfg, *reqs)
    assert recs[5].finished == [("A", "max_tokens")] and recs[5].num_free_blocks == 20
    outputs = recs[4].block_ids["A"][10:]  # A's table before its last decode: 10 prompt + 4 output slots
    assert recs[6].new == ["B"] and recs[6].num_evicted == 5
    assert recs[6].evicted[:4] == outputs  # A's output leaf, root side first
    assert recs[7].cache_hits == {"C": 10}
    # vLLM's block-level LRU evicts just the 3 blocks B lacks
    block = steps({**cfg, "cache_eviction": "block-lru", "cache_dedup": "off"}, *reqs)
    assert block[6].num_evicted == 3


def test_a_prefill_batch_takes_its_blocks_after_every_lookup():
    """X, Y and W cache a 10-token prompt each at step 0 (X least recently used).  At step 1 C (20
    tokens) and D (X's prompt + 5) are admitted together; they need 25 slots, 15 are free of
    content.  D's lookup came first (KV.BATCH_ALLOCATION), so X is D's hit, locked, and the
    eviction takes Y, the next least recently used leaf."""
    px, py, pw = _prompt(100, 10), _prompt(200, 10), _prompt(300, 10)
    cfg = {**SGC, "num_blocks": 46, "max_model_len": 64}  # 45 usable slots
    recs = steps(cfg, R("X", px, 1), R("Y", py, 1), R("W", pw, 1),
                 R("C", _prompt(400, 20), 1, at=1), R("D", px + _prompt(500, 5), 1, at=1))
    # a fresh pool hands out slots 1, 2, ... in order (KV.FREE_TO_RELEASE): X 1-10, Y 11-20, W 21-30
    assert recs[1].new == ["C", "D"] and recs[1].cache_hits == {"C": 0, "D": 10}
    assert recs[1].hit_blocks == {"D": list(range(1, 11))}
    assert recs[1].num_evicted == 10 and recs[1].evicted == list(range(11, 21))


def test_retraction_evicts_the_victims_cached_prompt_at_once():
    """The leaf-eviction corpus trace, worked by hand: at step 20 three 1-slot decodes find 1 slot
    free; C (fewest outputs, then the latest) is retracted, and SGLang's release_req evicts for
    the 2 remaining requests' next retract_decode_steps = 20 decodes at once: C's cached 4-token
    prompt leaf goes although C's freed decode slots cover the step (CACHE.EVICT_ON_RETRACT)."""
    cfg = {"profile": "sglang", "num_blocks": 61, "max_model_len": 128, "new_token_ratio_decay_steps": 1,
           "block_size": 1, "max_num_batched_tokens": 16384, "max_num_seqs": 1024, "enable_prefix_caching": True}
    recs = steps(cfg, R("A", 4, 40), R("B", 4, 40, at=3), R("C", 4, 30, at=4))
    assert recs[20].preempted == ["C"]
    assert recs[20].num_evicted == 4 and recs[20].evicted == recs[19].block_ids["C"][:4]


def test_register_prefill_and_finish_keeps_decoded_tokens_private_until_the_finish():
    """A's prompt enters the cache after its prefill, its decoded tokens only when it finishes: B
    (A's prompt, A's first two outputs and one more token) hits the 8 prompt tokens while A still
    decodes; under cache_register=computed it hits the outputs too (10)."""
    pa, outs = _prompt(100, 8), (700, 701, 702, 703, 704, 705)
    cfg = {**SGC, "num_blocks": 201, "max_model_len": 64}
    reqs = (R("A", pa, 6, output_tokens=outs), R("B", pa + [700, 701, 999], 1, at=4))
    assert steps(cfg, *reqs)[4].cache_hits == {"B": 8}
    assert steps({**cfg, "cache_register": "computed"}, *reqs)[4].cache_hits == {"B": 10}


def test_leaf_lru_needs_one_copy_per_block_and_computed_blocks():
    with pytest.raises(ConfigError, match="cache_dedup"):
        resolve({"profile": "sglang", "cache_dedup": "off"})
    with pytest.raises(ConfigError, match="cache_register"):
        resolve({"profile": "sglang", "cache_register": "allocation"})
    with pytest.raises(ConfigError, match="free_block_order"):
        resolve({"profile": "sglang", "free_block_order": "tail"})
    with pytest.raises(ConfigError, match="cache_duplicates"):
        resolve({"profile": "vllm-v1", "cache_dedup": "on-insert", "cache_duplicates": "latest"})


def test_abort_of_a_cut_prefill_frees_it_at_once():
    """Budget 8: A (20 tokens) is cut after 8 at step 0 and aborted at step 1, before its next
    chunk: SGLang frees its in-flight chunked request at the top of the step
    (ABORT.CUT_PREFILL_AT_ONCE), so step 1 schedules nothing of A and B (arriving at 1) is admitted
    with the whole budget.  A request that has sampled still runs once more (ABORT.AFTER_NEXT_SAMPLE)."""
    cfg = {**SG, "max_num_batched_tokens": 8, "num_blocks": 64, "max_model_len": 128}
    recs = steps(cfg, R("A", 20, 4, abort_at=1), R("B", 6, 2, at=1))
    assert recs[0].scheduled == [("A", 8)] and recs[1].aborted == ["A"]
    assert "ABORT.CUT_PREFILL_AT_ONCE" in rules_for(recs[1], "A")
    # once it has sampled (step 2 on, 16-token budget) it runs once more after the abort
    later = steps({**cfg, "max_num_batched_tokens": 32}, R("A", 20, 4, abort_at=2))
    assert ("A", 1) in later[2].scheduled and "ABORT.AFTER_NEXT_SAMPLE" in rules_for(later[2], "A")
    assert recs[1].scheduled == [("B", 6)] and "A" not in recs[1].blocks
    assert all("A" not in dict(r.scheduled) for s, r in recs.items() if s >= 1)


def test_a_retraction_leaves_the_batch_in_retraction_order():
    """77 slots, the ratio decaying in one step.  A (10 tokens) and B (4) run from step 0, C (2)
    from step 2; at step 22 a decode lacks memory and C (fewest outputs) is retracted.  SGLang's
    retract_decode keeps the survivors sorted by (outputs, -prompt), descending: A and B have as
    many outputs and B the shorter prompt, so the batch is B, A from then on (RETRACT.BATCH_ORDER)."""
    cfg = {**SG, "num_blocks": 78, "max_model_len": 128, "new_token_ratio_decay_steps": 1,
           "retract_decode_steps": 1}
    reqs = (R("A", 10, 30, output_tokens=(100,) * 30), R("B", 4, 30, output_tokens=(100,) * 30),
            R("C", 2, 30, at=2, output_tokens=(100,) * 30))
    recs = steps(cfg, *reqs)
    assert scheduled(recs)[21] == [("A", 1), ("B", 1), ("C", 1)]
    assert recs[22].preempted == ["C"] and scheduled(recs)[22] == [("B", 1), ("A", 1)]
    assert scheduled(recs)[23][:2] == [("B", 1), ("A", 1)]


def test_a_retraction_comes_before_any_allocation_of_the_step():
    """The same run at the exact level: at step 22 the three decodes need 3 slots and 2 are free
    (76, 77).  SGLang tests the whole batch first (check_decode_mem), retracts C, then allocates
    for the survivors in retraction order (RETRACT.BATCH_TEST): B gets 76, A 77.  A walk that
    allocated request by request would have given A slot 76 before C's turn failed."""
    from spec.rules import HITS

    cfg = {**SG, "num_blocks": 78, "max_model_len": 128, "new_token_ratio_decay_steps": 1,
           "retract_decode_steps": 1}
    reqs = (R("A", 10, 30, output_tokens=(100,) * 30), R("B", 4, 30, output_tokens=(100,) * 30),
            R("C", 2, 30, at=2, output_tokens=(100,) * 30))
    HITS.clear()
    recs = steps(cfg, *reqs)
    assert recs[21].num_free_blocks == 2 and recs[22].preempted == ["C"]
    assert recs[22].block_ids["B"][-1] == 76 and recs[22].block_ids["A"][-1] == 77
    assert any("need 3 blocks, 2 free" in x["text"] for x in recs[22].reasons if x.get("request") == "C")
    assert HITS["RETRACT.BATCH_TEST"] == 1


def test_an_aborted_running_request_is_inserted_like_a_finished_one():
    """A is aborted at step 3, decodes once more and is freed (ABORT.AFTER_NEXT_SAMPLE); SGLang
    treats it as finished (FINISH_ABORT) and inserts its computed tokens, outputs included, into
    the radix tree: B (A's prompt, A's first two outputs and one more token) hits 10 tokens at
    step 5, not only the 8 of A's prompt inserted after its prefill."""
    pa, outs = _prompt(100, 8), (700, 701, 702, 703, 704, 705)
    cfg = {**SGC, "num_blocks": 201, "max_model_len": 64}
    recs = steps(cfg, R("A", pa, 6, output_tokens=outs, abort_at=3), R("B", pa + [700, 701, 999], 1, at=5))
    assert recs[3].aborted == ["A"]
    assert recs[5].cache_hits == {"B": 10}


#: a token-granular pool of 40 slots without the prefix cache: A takes 22 of them and finishes, then B's 30
#: need every fresh slot left and 12 of A's released ones
RELEASE = {"block_size": 1, "num_blocks": 41, "max_num_batched_tokens": 64, "max_model_len": 64, "max_num_seqs": 8,
           "enable_prefix_caching": False}


@pytest.mark.parametrize("profile, order", [("sglang", "head first"), ("vllm-v1", "tail first")])
def test_a_finished_request_returns_its_blocks_in_its_engines_release_order(profile, order):
    """KV.FREE_IN_ORDER (SGLang frees a request's row as one slice, first slot first) against vLLM's
    KV.FREE_REVERSED: the blocks B re-uses of the finished A's come in A's table order, or reversed."""
    from spec.rules import HITS

    HITS.clear()
    recs = steps({**RELEASE, "profile": profile}, R("A", 20, 2), R("B", 30, 3, at=4))
    a_table = next(r.block_ids["A"] for s, r in sorted(recs.items(), reverse=True) if "A" in (r.block_ids or {}))
    b_table = next(r.block_ids["B"] for s, r in sorted(recs.items()) if "B" in (r.block_ids or {}))
    reused = [b for b in b_table if b in a_table]
    assert len(reused) >= 10  # (B needs more than the fresh slots left)
    assert reused == (a_table if order == "head first" else a_table[::-1])[:len(reused)]
    assert ("KV.FREE_IN_ORDER" if order == "head first" else "KV.FREE_REVERSED") in HITS


def test_gpu_engine_releases_a_table_in_the_profiles_order_too():
    """gpu_engine's radix pool frees head first, its vLLM pool tail first: the spec's block ids exactly."""
    from fuzz.replay import replay
    from scenario_helpers import trace as make_trace

    for profile in ("sglang", "vllm-v1"):
        result = replay(make_trace({**RELEASE, "profile": profile}, R("A", 20, 2), R("B", 30, 3, at=4)), "gpu", "exact",
                        after=None)
        assert result.agreed, result.divergence.describe()
        assert any("B" in (r.block_ids or {}) for r in result.engine_records)


def test_a_release_in_another_order_is_blamed_on_the_profiles_release_rule():
    """An engine log whose B re-uses A's released blocks in another order than the spec's: the report
    names the release rule of the trace's profile (KV.FREE_IN_ORDER under sglang, KV.FREE_REVERSED under vLLM)."""
    import copy

    from fuzz.replay import replay_records
    from scenario_helpers import trace as make_trace
    from spec.scheduler import run

    for profile, rule in (("sglang", "KV.FREE_IN_ORDER"), ("vllm-v1", "KV.FREE_REVERSED")):
        t = make_trace({**RELEASE, "profile": profile}, R("A", 20, 2), R("B", 30, 3, at=4))
        records = copy.deepcopy(run(t))
        a_table = next(r.block_ids["A"] for r in reversed(records) if "A" in (r.block_ids or {}))
        for r in records:  # B's re-used blocks in the other order: the engine released A the other way round
            if "B" in (r.block_ids or {}):
                table = r.block_ids["B"]
                at = [i for i, b in enumerate(table) if b in a_table]
                for i, b in zip(at, [table[i] for i in at][::-1]):
                    table[i] = b
        result = replay_records(t, records, "exact", engine="log")
        assert not result.agreed and result.divergence.field == "block_ids"
        assert result.divergence.rule == rule, result.divergence.describe()
