"""Scenario tests: small traces whose decisions were worked out by hand from
docs/reference/vllm-v1.md, step by step.  Block size 4 throughout;
``num_blocks`` counts the null block 0, so N blocks give N-1 usable ones.
The derivation of each expectation is in the test's comments.
"""
import pytest

from scenario_helpers import R, rules_for, scheduled, steps, trace
from spec.invariants import InvariantViolation
from spec.protocol import StepLimitError
from spec.scheduler import run


# -- chunked prefill and budgets --------------------------------------------


def test_chunked_prefill_spans_steps_and_samples_only_at_the_end():
    # budget 8: 20-token prompt runs 8 + 8 + 4, samples after the last chunk, then decodes.
    recs = steps({"max_num_batched_tokens": 8}, R("A", 20, 2))
    assert scheduled(recs) == {0: [("A", 8)], 1: [("A", 8)], 2: [("A", 4)], 3: [("A", 1)]}
    assert [list(recs[s].sampled) for s in range(4)] == [[], [], ["A"], ["A"]]
    # one block per 4 slots: 8, 16, 20, then 21 slots for the decode
    assert [recs[s].block_ids.get("A") for s in range(3)] == [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5]]
    assert recs[3].finished == [("A", "max_tokens")]
    assert recs[3].num_free_blocks == 16


def test_free_blocks_go_to_the_head_in_reverse_when_caching_is_off():
    # A held [1..6]; freeing tail-first and prepending makes 6 the next block handed out.
    recs = steps({"max_num_batched_tokens": 8}, R("A", 20, 2), R("B", 3, 1, at=4))
    assert recs[4].block_ids == {} and recs[4].new == ["B"]
    recs = steps({"max_num_batched_tokens": 8}, R("A", 20, 2), R("B", 3, 2, at=4))
    assert recs[4].block_ids == {"B": [6]}


def test_running_first_then_admission_with_the_leftover_budget():
    # budget 8: A takes 6, B is admitted with the 2 left (chunked), then finishes its prefill.
    recs = steps({"max_num_batched_tokens": 8}, R("A", 6, 3), R("B", 6, 3))
    assert scheduled(recs) == {
        0: [("A", 6), ("B", 2)],
        1: [("A", 1), ("B", 4)],
        2: [("A", 1), ("B", 1)],
        3: [("B", 1)],
    }
    assert recs[0].new == ["A", "B"] and list(recs[0].sampled) == ["A"]
    assert recs[1].block_ids == {"A": [1, 2], "B": [3, 4]}
    assert recs[2].finished == [("A", "max_tokens")] and recs[2].block_ids == {"B": [3, 4]}


def test_budget_exhaustion_keeps_the_waiting_head_out():
    # budget 2, three 1-token prompts: C waits until A finishes (after 2 tokens).
    recs = steps({"max_num_batched_tokens": 2}, R("A", 1, 2), R("B", 1, 3), R("C", 1, 1))
    assert scheduled(recs) == {0: [("A", 1), ("B", 1)], 1: [("A", 1), ("B", 1)], 2: [("B", 1), ("C", 1)]}
    assert "BUDGET.EXHAUSTED" in rules_for(recs[0], "C")
    assert recs[2].finished == [("B", "max_tokens"), ("C", "max_tokens")]


def test_long_prefill_threshold_caps_each_request_when_several_are_eligible():
    # T=4 with two eligible requests: 4 + 4, 4 + 4, 2 + 2.
    recs = steps({"long_prefill_token_threshold": 4, "max_num_batched_tokens": 16}, R("A", 10, 1), R("B", 10, 1))
    assert scheduled(recs) == {0: [("A", 4), ("B", 4)], 1: [("A", 4), ("B", 4)], 2: [("A", 2), ("B", 2)]}


def test_long_prefill_threshold_never_caps_a_lone_request():
    recs = steps({"long_prefill_token_threshold": 4, "max_num_batched_tokens": 16}, R("A", 10, 1))
    assert scheduled(recs) == {0: [("A", 10)]}


def test_chunked_prefill_off_blocks_the_head_until_the_whole_prompt_fits():
    # budget 16 = max_model_len: after A's 10 tokens, B's 10 do not fit the 6 left.
    cfg = {"enable_chunked_prefill": False, "max_num_batched_tokens": 16, "max_model_len": 16}
    recs = steps(cfg, R("A", 10, 3), R("B", 10, 2))
    assert scheduled(recs) == {0: [("A", 10)], 1: [("A", 1), ("B", 10)], 2: [("A", 1), ("B", 1)]}
    assert "ADMIT.NO_CHUNKING" in rules_for(recs[0], "B")
    assert recs[1].block_ids == {"A": [1, 2, 3], "B": [4, 5, 6]}


def test_max_num_seqs_caps_admissions():
    recs = steps({"max_num_seqs": 2}, R("A", 2, 2), R("B", 2, 2), R("C", 2, 2))
    assert recs[0].new == ["A", "B"] and "ADMIT.MAX_NUM_SEQS" in rules_for(recs[0], "C")
    assert recs[1].finished == [("A", "max_tokens"), ("B", "max_tokens")]
    assert recs[2].new == ["C"] and recs[3].finished == [("C", "max_tokens")]


# -- preemption ------------------------------------------------------------


def _fcfs_pressure():
    # 4 usable blocks; A and B grow one block each at 5 tokens; at 9 tokens A needs a
    # third block with none free, so B (running[-1]) is preempted.  C arrives then.
    return steps({"num_blocks": 5}, R("A", 4, 8), R("B", 4, 10), R("C", 1, 1, at=5))


def test_fcfs_victim_is_the_newest_running_request():
    recs = _fcfs_pressure()
    assert recs[1].block_ids == {"A": [1, 3], "B": [2, 4]} and recs[1].num_free_blocks == 0
    assert recs[5].preempted == ["B"] and recs[5].scheduled == [("A", 1)]
    # B's blocks [2, 4] went back reversed to the head; A took 4.
    assert recs[5].block_ids == {"A": [1, 3, 4]} and recs[5].num_free_blocks == 1
    assert "PREEMPT.VICTIM_NEWEST" in rules_for(recs[5], "B")


def test_no_admission_in_a_step_that_preempted():
    recs = _fcfs_pressure()
    # C (1 block) would fit the free block at step 5, but nothing is admitted after a preemption,
    # and afterwards the victim B heads the queue and blocks C until A finishes.
    assert recs[5].new == [] and recs[6].new == [] and recs[7].new == []
    assert "ADMIT.FULL_SEQUENCE" in rules_for(recs[6], "B")
    assert recs[7].finished == [("A", "max_tokens")]


def test_preempted_request_resumes_first_and_recomputes_prompt_and_outputs():
    recs = _fcfs_pressure()
    # B kept its 5 outputs: 9 tokens recomputed into A's freed blocks [4, 3, 1]; C gets 2.
    assert recs[8].resumed == ["B"] and recs[8].new == ["C"]
    assert recs[8].scheduled == [("B", 9), ("C", 1)]
    assert recs[8].block_ids == {"B": [4, 3, 1]}  # C finished (max_tokens 1) and freed [2]
    assert recs[12].finished == [("B", "max_tokens")] and recs[12].scheduled == [("B", 1)]


def test_several_victims_return_to_the_queue_front_in_running_order():
    # 8 usable blocks, T=8.  A (32 tokens) prefills 8 per step; at step 3 it needs 2 blocks
    # with none free: C then B are preempted (tail first) and go back ahead of D.
    cfg = {"num_blocks": 9, "long_prefill_token_threshold": 8, "max_num_batched_tokens": 16}
    recs = steps(cfg, R("A", 32, 1), R("B", 2, 10), R("C", 2, 10), R("D", 2, 1, at=3))
    assert scheduled(recs)[0] == [("A", 8), ("B", 2), ("C", 2)]
    assert recs[2].num_free_blocks == 0
    assert recs[3].preempted == ["C", "B"] and recs[3].scheduled == [("A", 8)]
    assert recs[3].finished == [("A", "max_tokens")]
    # queue front is now B, C (running order), then D
    assert recs[4].resumed == ["B", "C"] and recs[4].new == ["D"]
    assert recs[4].scheduled == [("B", 5), ("C", 5), ("D", 2)]
    # A's 8 blocks were freed tail first and prepended: [4, 3, 8, 7, 6, 5, 2, 1]
    assert recs[4].block_ids["B"] == [4, 3] and recs[4].block_ids["C"] == [8, 7]


def _priority_unschedule():
    # B (priority 5) runs first, then A (priority 0).  At step 6 A needs a block: the victim
    # is B, already scheduled in this step, so its token goes back to the budget.
    return steps({"num_blocks": 5, "policy": "priority"}, R("B", 2, 10, priority=5), R("A", 4, 7, at=1))


def test_priority_victim_is_the_least_important_even_if_already_scheduled():
    recs = _priority_unschedule()
    assert recs[5].scheduled == [("B", 1), ("A", 1)]
    assert recs[6].preempted == ["B"] and recs[6].scheduled == [("A", 1)]
    assert "PREEMPT.VICTIM_LOWEST_PRIORITY" in rules_for(recs[6], "B")
    assert recs[6].block_ids == {"A": [2, 3, 4]}


def test_priority_victim_resumes_after_the_important_request_finishes():
    recs = _priority_unschedule()
    assert recs[7].finished == [("A", "max_tokens")] and recs[7].resumed == []
    assert recs[8].resumed == ["B"] and recs[8].scheduled == [("B", 8)]


@pytest.mark.parametrize("mode, expected", [("stop", []), ("continue", [("X", 1), ("Y", 1)])])
def test_priority_self_preemption_stop_is_vllm_032_continue_is_033(mode, expected):
    # B (priority 5) runs first; X and Y fill the last blocks.  At step 2 B needs a block and
    # is its own victim: 0.32 ends the running phase, 0.33 goes on with X and Y.
    cfg = {"num_blocks": 4, "policy": "priority", "priority_self_preempt": mode}
    recs = steps(cfg, R("B", 3, 10, priority=5), R("X", 3, 3, at=1), R("Y", 3, 3, at=1))
    assert recs[1].scheduled == [("B", 1), ("X", 3), ("Y", 3)] and recs[1].num_free_blocks == 0
    assert recs[2].preempted == ["B"]
    assert recs[2].scheduled == expected


def test_priority_queue_orders_by_priority_then_arrival():
    recs = steps({"policy": "priority", "max_num_seqs": 1}, R("A", 2, 1, priority=1), R("B", 2, 1), R("C", 2, 1))
    assert [recs[s].new for s in range(3)] == [["B"], ["C"], ["A"]]


def test_fcfs_head_of_line_blocking_is_never_skipped():
    # 8 usable blocks.  A holds 6 at step 1; B (4 blocks) does not fit, so C (1 block) waits too.
    recs = steps({"num_blocks": 9}, R("A", 20, 3), R("B", 16, 1, at=1), R("C", 4, 1, at=1))
    assert recs[1].new == [] and recs[2].new == []
    assert "WAIT.QUEUED" not in rules_for(recs[1], "C")  # reasons only name the head by default
    assert "ADMIT.FULL_SEQUENCE" in rules_for(recs[1], "B")
    assert recs[3].new == ["B", "C"]


# -- prefix caching ----------------------------------------------------------

SHARED = list(range(10, 18))  # two full blocks of 4


def _prefix_run():
    return steps(
        {"enable_prefix_caching": True},
        R("A", SHARED, 1),
        R("B", SHARED, 2, at=2),
        R("C", SHARED + [99], 2, at=3),
    )


def test_prefix_hit_is_capped_at_num_tokens_minus_one():
    recs = _prefix_run()
    # B's 8-token prompt is two cached blocks, but at most 7 tokens may hit: one block.
    assert recs[2].cache_hits == {"B": 4} and recs[2].scheduled == [("B", 4)]
    # the hit block 1 is re-used; the second block is new (3, the free-queue head)
    assert recs[2].block_ids == {"B": [1, 3]}


def test_prefix_hit_returns_the_earliest_cached_duplicate():
    recs = _prefix_run()
    # C = the same 8 tokens + 1: both blocks hit.  Block 2 (A's, cached first) and block 3
    # (B's duplicate) both hold the second block; the earlier one is returned.  B's decode
    # took block 4 first (running before waiting), so C's one new block is 5.
    assert recs[3].cache_hits == {"C": 8} and recs[3].scheduled == [("B", 1), ("C", 1)]
    assert recs[3].block_ids == {"C": [1, 2, 5]} and recs[3].finished[0] == ("B", "max_tokens")


def test_cached_blocks_go_to_the_tail_and_evict_in_lru_order():
    # A and B share 3 full blocks and finish in one step, A first.  Freed tail-first:
    # unhashed partial blocks to the head (B's 5 ahead of A's 4), cached ones to the tail.
    shared = list(range(100, 112))
    cfg = {"enable_prefix_caching": True, "num_blocks": 11, "max_num_batched_tokens": 64}
    recs = steps(cfg, R("A", shared + [7, 8], 1), R("B", shared + [5, 6], 1), R("C", 39, 2, at=1))
    assert recs[0].cache_hits == {"A": 0, "B": 12}
    assert recs[0].block_ids == {} and recs[0].num_free_blocks == 10
    # C takes all ten blocks in free-queue order: [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert recs[1].block_ids == {"C": [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]}
    assert recs[1].evicted == [3, 2, 1] and recs[1].num_evicted == 3


def test_identical_prompts_admitted_in_one_step_share_blocks():
    # Blocks are registered at allocation, so B hits A's blocks in the same step.
    prompt = list(range(200, 210))
    recs = steps({"enable_prefix_caching": True}, R("A", prompt, 2), R("B", prompt, 2))
    assert recs[0].scheduled == [("A", 10), ("B", 2)]
    assert recs[0].cache_hits == {"A": 0, "B": 8}
    assert recs[0].block_ids == {"A": [1, 2, 3], "B": [1, 2, 4]}


def test_preempted_request_re_hits_its_own_surviving_blocks():
    # As the FCFS pressure scenario, caching on.  B's second block is evicted when A takes it
    # at step 5; its first block (2) survives in the free queue and is hit on resume.
    recs = steps({"num_blocks": 5, "enable_prefix_caching": True}, R("A", 4, 8), R("B", 4, 10))
    assert recs[5].preempted == ["B"] and recs[5].evicted == [4]
    assert recs[6].resumed == [] and recs[7].finished == [("A", "max_tokens")]
    assert recs[8].resumed == ["B"] and recs[8].cache_hits == {"B": 4}
    assert recs[8].scheduled == [("B", 5)]
    # free queue after A: [4 (unhashed partial), 2, 3, 1]; 2 is touched, 4 and 3 are popped
    assert recs[8].block_ids == {"B": [2, 4, 3]} and recs[8].evicted == [3]


# -- watermark, aborts, rejections, stops ------------------------------------------------


def test_watermark_applies_only_beside_running_requests():
    # int(0.2 * 11) = 2 blocks of headroom.  A is admitted alone (no watermark); B fits with the
    # watermark (4 + 2 <= 6); C's single block would fit but would eat into the watermark.
    cfg = {"num_blocks": 11, "watermark": 0.2, "max_num_batched_tokens": 64}
    recs = steps(cfg, R("A", 16, 1), R("B", 16, 1), R("C", 4, 1))
    assert recs[0].new == ["A", "B"]
    assert "ADMIT.WATERMARK" in rules_for(recs[0], "C")
    assert recs[1].new == ["C"]


def test_watermark_never_blocks_an_empty_engine():
    recs = steps({"num_blocks": 11, "watermark": 0.2, "max_num_batched_tokens": 64}, R("D", 40, 1))
    assert recs[0].new == ["D"] and len(recs[0].scheduled) == 1


def test_abort_of_a_waiting_request():
    recs = steps({"max_num_seqs": 1}, R("A", 4, 5), R("B", 4, 2, abort_at=2), R("C", 4, 1, abort_at=9))
    assert recs[2].aborted == ["B"]
    assert all(rid != "B" for r in recs.values() for rid, _ in r.scheduled)
    # C finished at step 5; its later abort is ignored and reported nowhere
    assert recs[5].finished == [("C", "max_tokens")]
    assert not any("C" in r.aborted for r in recs.values())


def test_abort_of_a_running_request_frees_its_blocks_before_the_step():
    recs = steps({"max_num_seqs": 1}, R("A", 8, 10, abort_at=3), R("B", 4, 2))
    assert recs[2].block_ids == {"A": [1, 2, 3]}
    assert recs[3].aborted == ["A"] and recs[3].new == ["B"]
    assert recs[3].block_ids == {"B": [3]}  # A's blocks came back reversed to the head


def test_rejection_of_a_prompt_with_no_room_for_one_token():
    recs = steps({"max_model_len": 16}, R("A", 16, 1), R("B", 15, 4))
    assert recs[0].rejected == [("A", "prompt_too_long")]
    assert recs[0].new == ["B"] and recs[0].scheduled == [("B", 15)]
    assert recs[0].finished == [("B", "max_model_len")]  # 16 tokens reached max_model_len


def test_rejection_of_a_request_that_can_never_fit_the_pool():
    # 4 usable blocks = 16 slots.  Peak footprint is prompt + max_tokens - 1.
    recs = steps({"num_blocks": 5}, R("A", 10, 8), R("B", 10, 7))
    assert recs[0].rejected == [("A", "never_fits")]
    assert sum(len(r.sampled) for r in recs.values()) == 7


def test_without_the_rejection_rule_a_too_large_request_livelocks():
    # What vLLM would do: A is admitted, grows past the pool, preempts itself, and can never
    # be re-admitted.  The liveness invariant flags it; without invariants the step limit does.
    cfg = {"num_blocks": 5, "reject_unservable": False, "max_steps": 200}
    with pytest.raises(InvariantViolation) as e:
        run(trace(cfg, R("A", 10, 8)), check_invariants=True)
    assert e.value.invariant_id == "LIVE.NO_IDLE_STALL"
    with pytest.raises(StepLimitError):
        run(trace(cfg, R("A", 10, 8)))


def test_stop_conditions():
    recs = steps(
        {"max_model_len": 12},
        R("eos", 4, 5, output_tokens=(7, 2, 9)),
        R("ignore", 4, 3, output_tokens=(7, 2, 9), ignore_eos=True),
        R("stop", 4, 5, output_tokens=(7, 50, 9), stop_token_ids=(50,)),
        R("len", 10, 9),
        R("eos_first", 4, 2, output_tokens=(5, 2)),
    )
    ends = {rid: (s, why) for s, r in recs.items() for rid, why in r.finished}
    assert ends == {
        "eos": (1, "eos"),
        "ignore": (2, "max_tokens"),
        "stop": (1, "stop_token"),
        "len": (1, "max_model_len"),  # 10 + 2 = 12 tokens
        "eos_first": (1, "eos"),  # EOS is checked before max_tokens
    }


def test_without_rejection_an_over_long_prompt_does_not_crash_the_cache():
    # prompt 20 > max_model_len 16 (vLLM's front end refuses it).  With the rule off the waiting
    # phase schedules the whole prompt, blocks cover only 16 slots, and full blocks past them
    # are not registered; the first sample reaches max_model_len.
    cfg = {"max_model_len": 16, "reject_unservable": False, "enable_prefix_caching": True}
    recs = steps(cfg, R("A", 20, 3))
    assert recs[0].scheduled == [("A", 20)] and recs[0].finished == [("A", "max_model_len")]


def test_requests_left_after_a_self_preemption_name_the_preemption_not_max_num_seqs():
    # The scenario above under "stop": X and Y are not reached because B preempted itself, with
    # budget and max_num_seqs to spare; the reason must say so (it used to name max_num_seqs).
    cfg = {"num_blocks": 4, "policy": "priority", "priority_self_preempt": "stop"}
    recs = steps(cfg, R("B", 3, 10, priority=5), R("X", 3, 3, at=1), R("Y", 3, 3, at=1))
    assert recs[2].scheduled == []
    for rid in ("X", "Y"):
        assert rules_for(recs[2], rid) == ["RUN.PREEMPT_FOR_BLOCKS"]
        assert "BATCH.MAX_NUM_SEQS_PER_STEP" not in rules_for(recs[2], rid)
