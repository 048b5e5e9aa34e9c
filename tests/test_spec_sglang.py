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
