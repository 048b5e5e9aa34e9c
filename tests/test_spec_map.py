"""Scenario tests for the rest of the scheduling map (issue 8): swap preemption, SGLang's
output-length-estimation admission, VTC fairness and starvation protection by aging.

Every expected schedule below was worked out by hand from the rule statements (the
comments show the arithmetic) before the spec was run.
"""
import dataclasses
import itertools

import pytest

from batchspec.cli import example_path
from scenario_helpers import R, rules_for, scheduled, steps, trace
from spec.config import PROFILES, ConfigError, resolve
from spec.formats import StepRecord, Trace, TraceRequest
from spec.invariants import INVARIANTS, InvariantViolation
from spec.io import load_trace
from spec.protocol import drive
from spec.scheduler import Request, SpecEngine, fewest_outputs_victim, run, vtc_cost

# --------------------------------------------------------------------------
# Swap preemption
# --------------------------------------------------------------------------

SWAP = {"num_blocks": 5, "preemption_mode": "swap"}  # 4 usable blocks of 4 tokens


def test_swap_out_keeps_computed_tokens_and_swaps_in_before_waiting():
    # A and B (prompt 4, 8 out) each hold 2 blocks by step 4 (8 slots).  Step 5: A needs slot 9,
    # a 3rd block, none free -> the newest, B, is swapped out: ceil(8 computed / 4) = 2 CPU blocks.
    # Steps 6-7: B needs ceil(9/4) = 3 blocks for its whole sequence, 1 free -> stays swapped, and C
    # (arrived at 6, needs 1 block, which is free) may not pass it.  A finishes at 7 (8 outputs).
    # Step 8: B swaps in and computes just its 1 missing token; then C is admitted.
    recs = steps({**SWAP, "num_cpu_blocks": 8}, R("A", 4, 8), R("B", 4, 8), R("C", 1, 1, at=6))
    assert scheduled(recs)[5] == [("A", 1)]
    assert recs[5].preempted == ["B"] and recs[5].swapped_out == ["B"] and recs[5].num_free_cpu_blocks == 6
    assert "SWAP.OUT" in rules_for(recs[5], "B")
    for s in (6, 7):
        assert scheduled(recs)[s] == [("A", 1)] and not recs[s].swapped_in
        assert "SWAP.BEFORE_WAITING" in rules_for(recs[s], "C")
        assert "ADMIT.FULL_SEQUENCE" in rules_for(recs[s], "B")
    assert recs[7].finished == [("A", "max_tokens")]
    assert scheduled(recs)[8] == [("B", 1), ("C", 1)]  # 1 token, not a 9-token recompute
    assert recs[8].swapped_in == ["B"] and recs[8].resumed == ["B"] and recs[8].new == ["C"]
    # blocks: A [1, 3], B [2, 4]; B's swap-out frees 4, 2 to the head, A takes 4; A's finish frees
    # 4, 3, 1 to the head: free queue [4, 3, 1, 2] -> B gets [4, 3, 1], C gets [2]
    assert recs[8].num_free_cpu_blocks == 8 and recs[8].block_ids == {"B": [4, 3, 1]}
    assert recs[10].finished == [("B", "max_tokens")]


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    # Same trace with a 1-block CPU pool: B needs 2 CPU blocks, so it is preempted by recompute
    # (to the front of the waiting queue) and comes back at step 8 recomputing all 9 tokens.
    recs = steps({**SWAP, "num_cpu_blocks": 1}, R("A", 4, 8), R("B", 4, 8))
    assert recs[5].preempted == ["B"] and recs[5].swapped_out == [] and recs[5].num_free_cpu_blocks == 1
    assert "SWAP.FALLBACK_RECOMPUTE" in rules_for(recs[5], "B")
    assert scheduled(recs)[8] == [("B", 9)] and recs[8].resumed == ["B"] and recs[8].swapped_in == []


def test_swapped_requests_come_back_oldest_first():
    # A, B, C (prompt 4, 8 out) on 6 usable blocks: at step 4 all hold 2 blocks (8 slots each);
    # step 5: A needs a 3rd block -> C (newest) swapped out, 2 freed, A takes 1; B needs one,
    # 1 free, takes it.  Step 6: nothing grows (slots 10 <= 12); swap-in of C needs 3 blocks, 0 free.
    # B and A finish at step 7 (A first: it is first in the running list) -> C swaps in at step 8.
    recs = steps({"num_blocks": 7, "preemption_mode": "swap", "num_cpu_blocks": 8},
                 R("A", 4, 8), R("B", 4, 8), R("C", 4, 8))
    assert recs[5].swapped_out == ["C"] and scheduled(recs)[5] == [("A", 1), ("B", 1)]
    assert recs[7].finished == [("A", "max_tokens"), ("B", "max_tokens")]
    assert recs[8].swapped_in == ["C"] and scheduled(recs)[8] == [("C", 1)]


def test_vllm_v0_swap_resumes_swapped_requests_before_a_prefill_batch():
    # As above until step 8, where B swaps in as a decode step; C (arrived at 6) gets the next
    # step's prefill-only batch (9), and B decodes again only after it (10, 11).
    cfg = {"profile": "vllm-v0-swap", "num_blocks": 5, "max_num_batched_tokens": 64, "num_cpu_blocks": 8}
    recs = steps(cfg, R("A", 4, 8), R("B", 4, 8), R("C", 1, 1, at=6))
    assert recs[5].swapped_out == ["B"]
    assert "SWAP.BEFORE_WAITING" in rules_for(recs[8], "C")
    assert {s: scheduled(recs)[s] for s in range(8, 12)} == {8: [("B", 1)], 9: [("C", 1)], 10: [("B", 1)], 11: [("B", 1)]}
    assert recs[8].swapped_in == ["B"] and recs[9].new == ["C"] and recs[11].finished == [("B", "max_tokens")]


def test_swap_order_is_by_arrival_not_by_preemption():
    eng = SpecEngine(resolve({"profile": "vllm-v1", "preemption_mode": "swap", "num_cpu_blocks": 64}))
    for rid in "ABC":
        eng.add_request(TraceRequest(id=rid, prompt_len=4, max_tokens=4, arrival_step=0))
    eng.step()
    from spec.scheduler import SchedulerOutput
    out = SchedulerOutput()
    c, b = eng.requests["C"], eng.requests["B"]
    for victim in (c, b):  # newest first, as the victim rule takes them
        eng.running.remove(victim)
        eng._preempt(victim, out)
    assert [r.request_id for r in eng.swapped] == ["B", "C"] and out.swapped_out == ["C", "B"]
    assert eng.cpu_free == 62


# --------------------------------------------------------------------------
# SGLang: output-length estimation admission and retraction
# --------------------------------------------------------------------------

SGL = {"profile": "sglang", "block_size": 1, "num_blocks": 31, "max_num_batched_tokens": 64,
       "new_token_ratio_decay_steps": 2,  # 30 usable tokens; decay (0.7 - 0.098) / 2 = 0.301 a step
       "admission_hold": "off"}  # the head is re-tested every step (the profile's hold: tests/test_spec_sglang.py)


def test_estimate_admission_new_token_ratio_and_retraction():
    recs = steps(SGL, R("A", 2, 20), R("B", 2, 20))
    # step 0: A needs 2 + 20 + 1 = 23 < 30 -> admitted; rem = 30 - 23 = 7 < 23 for B
    assert recs[0].new == ["A"] and "ESTIMATE.ADMIT" in rules_for(recs[0], "B")
    # step 1 (ratio 0.7): rem = 28 - 0.7 x 19 = 14.7; step 2 (0.399): 27 - 0.399 x 18 = 19.818
    ratios = [r.new_token_ratio for s, r in sorted(recs.items())]
    assert ratios[:3] == pytest.approx([0.7, 0.399, 0.098])
    assert "14.700" in [x["text"] for x in recs[1].reasons if x["rule"] == "ESTIMATE.ADMIT"][0]
    # step 3 (0.098, floor): rem = 26 - 0.098 x 17 = 24.334 > 23 -> B admitted, as a prefill-only batch
    assert scheduled(recs)[3] == [("B", 2)] and recs[3].new == ["B"]
    assert all(scheduled(recs)[s] == [("A", 1), ("B", 1)] for s in range(4, 16))
    # free = 24 - 2 per step from step 4 -> 0 after step 15.  Step 16: A needs a block; B has 13
    # outputs, A 15 -> B (fewest outputs) is retracted; ratio = min(1, (15 + 20 x 1) / 20) = 1
    assert recs[15].num_free_blocks == 0
    assert recs[16].preempted == ["B"] and scheduled(recs)[16] == [("A", 1)]
    assert "RETRACT.VICTIM_FEWEST_OUTPUTS" in rules_for(recs[16], "B")
    assert recs[16].new_token_ratio == 1.0
    # the ratio decays again: 0.699, 0.398, then the floor 0.098
    assert ratios[17:20] == pytest.approx([0.699, 0.398, 0.098])
    # step 17: rem = 13 - 1.0 x 4 = 9 < B's 15 + 7 + 1 = 23
    assert "needs 23 tokens, 9.000" in [x["text"] for x in recs[17].reasons if x["rule"] == "ESTIMATE.ADMIT"][0]
    assert recs[20].finished == [("A", "max_tokens")]
    # step 21: B recomputes prompt + 13 outputs = 15 tokens; the ratio resets to 0.7 once idle
    assert scheduled(recs)[21] == [("B", 15)] and recs[21].resumed == ["B"]
    assert recs[27].finished == [("B", "max_tokens")] and recs[27].new_token_ratio == 0.7


def test_vllm_v1_admits_what_sglang_holds_back():
    # the same two requests under per-step reservation are admitted together at step 0
    recs = steps({"block_size": 1, "num_blocks": 31}, R("A", 2, 20), R("B", 2, 20))
    assert recs[0].new == ["A", "B"]


def _req(rid, prompt, outputs):
    r = Request(rid, list(range(3, 3 + prompt)), 50, 0, 0, None, frozenset(),
                TraceRequest(id=rid, prompt_len=prompt, max_tokens=50), 4)
    r.output_token_ids = [5] * outputs
    return r


def test_retraction_victim_fewest_outputs_then_longest_prompt_then_latest():
    a, b, c, d = _req("a", 4, 3), _req("b", 9, 2), _req("c", 6, 2), _req("d", 9, 2)
    assert fewest_outputs_victim([a, b, c]) is b  # 2 outputs < 3; prompt 9 > 6
    assert fewest_outputs_victim([a, b, c, d]) is d  # b and d tie: the later in the running list
    assert fewest_outputs_victim([a]) is a


def test_estimate_rejects_what_could_never_pass_the_estimate():
    # 30 usable tokens: prompt 10 + 20 out + 1 = 31 >= 30 (with o = 19 outputs: 10 + 19 + 1 + 1 = 31)
    recs = steps({**SGL, "length_limits": "reject"}, R("A", 10, 20), R("B", 10, 18))
    assert recs[0].rejected == [("A", "never_fits")] and recs[0].new == ["B"]
    # the sglang profile (length_limits=clip) admits it instead, max_tokens cut to 30 - 10 - 2 = 18
    # (ARRIVE.CLIP_MAX_TOKENS): it finishes after 18 tokens, with reason max_model_len
    recs = steps(SGL, R("A", 10, 20))
    assert recs[0].new == ["A"] and "ARRIVE.CLIP_MAX_TOKENS" in rules_for(recs[0], "A")
    assert [f for r in recs.values() for f in r.finished] == [("A", "max_model_len")]
    assert sum("A" in r.sampled for r in recs.values()) == 18
    # the same request fits vllm-v1's peak rule: 10 + 20 - 1 = 29 slots <= 30
    assert steps({"block_size": 1, "num_blocks": 31}, R("A", 10, 20))[0].new == ["A"]


# --------------------------------------------------------------------------
# VTC fairness
# --------------------------------------------------------------------------

VTC = {"profile": "vtc", "max_num_batched_tokens": 64, "max_num_seqs": 1}


def _vtc_run(config, *requests):
    """Run and return (records by step, counters after each step)."""
    t = trace(config, *requests)
    eng = SpecEngine.from_trace(t, check_invariants=True)
    counters = []
    records = drive(eng, t, 1000, on_step=lambda rec: counters.append(dict(eng.waiting.counters)))
    return {r.step: r for r in records}, counters


def test_vtc_alternates_tenants_where_fcfs_serves_in_arrival_order():
    reqs = [R(f"a{i}", 4, 2, tenant="a") for i in (1, 2, 3)] + [R(f"b{i}", 4, 2, tenant="b") for i in (1, 2)]
    recs, counters = _vtc_run(VTC, *reqs)
    # each request: 4 prompt tokens x 1 at admission, then 1 decode x 2 = 6; ties go to a (seen first)
    # a1 (a=4, 6) b1 (b=4, 6) a2 (a=10, 12) b2 (b=10, 12) a3 (a=16, 18)
    assert [recs[s].new for s in range(0, 10, 2)] == [["a1"], ["b1"], ["a2"], ["b2"], ["a3"]]
    assert [counters[s] for s in (0, 1, 3, 9)] == [{"a": 4, "b": 0}, {"a": 6, "b": 0}, {"a": 6, "b": 6},
                                                   {"a": 18, "b": 12}]
    fcfs = steps({**VTC, "policy": "fcfs"}, *reqs)
    assert [fcfs[s].new for s in range(0, 10, 2)] == [["a1"], ["a2"], ["a3"], ["b1"], ["b2"]]


def test_vtc_weights_halve_a_tenants_charges():
    reqs = [R(f"a{i}", 4, 2, tenant="a") for i in (1, 2, 3)] + [R(f"b{i}", 4, 2, tenant="b") for i in (1, 2)]
    recs, counters = _vtc_run({**VTC, "tenant_weights": "b=2"}, *reqs)
    # b pays half: b1 -> b=2, 3; at step 4 a=6 > b=3 -> b2 -> b=5, 6; then a2, a3
    assert [recs[s].new for s in range(0, 10, 2)] == [["a1"], ["b1"], ["b2"], ["a2"], ["a3"]]
    assert counters[5] == {"a": 6, "b": 6}


def test_vtc_lift_when_rejoining_beside_backlogged_tenants():
    # a1..a3 at step 0; b1, b2 arrive at step 3, when a (a3 waiting) has counter 10 (a1: 4 + 2,
    # a2 prefill: 4) -> b is lifted from 0 to 10.  Step 3: a2 decodes (a=12).  Step 4: b (10) < a (12)
    # -> b1 (b=14, 16); step 6: a (12) < b (16) -> a3.  Without the lift b would take steps 4-7.
    reqs = [R(f"a{i}", 4, 2, tenant="a") for i in (1, 2, 3)] + [R(f"b{i}", 4, 2, at=3, tenant="b") for i in (1, 2)]
    recs, counters = _vtc_run(VTC, *reqs)
    assert counters[3] == {"a": 12, "b": 10}  # b was charged nothing in step 3: 10 is the lift
    assert [recs[s].new for s in (4, 6, 8)] == [["b1"], ["a3"], ["b2"]]


def test_vtc_lift_to_the_tenant_that_last_left_when_no_one_is_backlogged():
    # a1 admitted at step 0 (a=4): a's queue empties, a is the last to leave.  b1 arrives at step 1
    # while no tenant is backlogged -> b = max(0, a's 4) = 4 (the paper's branch; the artifact keeps 0).
    recs, counters = _vtc_run(VTC, R("a1", 4, 2, tenant="a"), R("b1", 4, 2, at=1, tenant="b"))
    assert counters[1] == {"a": 6, "b": 4}
    assert recs[2].new == ["b1"] and counters[2] == {"a": 6, "b": 8}


def test_vtc_cost_prices_prompt_and_output_positions():
    r = _req("x", 4, 2)
    cfg = resolve({"profile": "vtc", "vtc_input_price": 1.5, "vtc_output_price": 3})
    assert vtc_cost(r, 0, 4, cfg) == 6.0  # 4 prompt tokens
    assert vtc_cost(r, 2, 4, cfg) == 1.5 * 2 + 3 * 2  # 2 prompt + 2 output positions (a recompute)
    assert vtc_cost(r, 5, 1, cfg) == 3.0  # a decode


def _vtc_service(requests, weights, mem):
    """Per step: the service each tenant received, and the tenants backlogged through the step's
    scheduling (a waiting request both before and after it)."""
    cfg = {"profile": "vtc", "block_size": 1, "num_blocks": mem + 1, "max_num_batched_tokens": 16, "max_model_len": 16,
           "max_num_seqs": 2, "tenant_weights": weights}
    t = Trace(config=cfg, requests=requests, vocab_size=64)
    eng = SpecEngine.from_trace(t, check_invariants=True)
    service, backlogged, now = [], [], {}
    charge, schedule = eng._charge, eng.schedule

    def metered_charge(req, start, n):
        now[req.source.tenant] = now.get(req.source.tenant, 0.0) + vtc_cost(req, start, n, eng.config)
        charge(req, start, n)

    def metered_schedule():
        before = {tenant for tenant, q in eng.waiting.queues.items() if q}
        out = schedule()
        backlogged.append(before & {tenant for tenant, q in eng.waiting.queues.items() if q})
        service.append(dict(now))
        now.clear()
        return out

    eng._charge, eng.schedule = metered_charge, metered_schedule
    drive(eng, t, 1000)
    return service, backlogged, eng.config.weights()


def test_vtc_service_gap_bound_exhaustively():
    """The VTC paper's fairness bound, checked on every trace of two tenants with two requests each
    (prompt 1 or 3, max_tokens 1 or 3, arrival 0 or 2), weights 1:1 and 1:2, on 4 and 8 tokens of KV:
    over every interval of steps in which both tenants stay backlogged,

        |W_a / w_a - W_b / w_b|  <=  2 U,   U = max(input_price x L, output_price x M) / min weight

    with L the longest prompt (3) and M the KV capacity in tokens (the paper's 2x bound, Theorem 4.x:
    U = max(w_p L_input, w_q M))."""
    shapes = list(itertools.product((1, 3), (1, 3), (0, 2)))
    worst, runs = 0.0, 0
    for weights, mem in itertools.product(("", "b=2"), (4, 8)):
        w_min = min([1.0] + list(resolve({"profile": "vtc", "tenant_weights": weights}).weights().values()))
        bound = 2 * max(1.0 * 3, 2.0 * mem) / w_min
        for sa, sb in itertools.product(itertools.product(shapes, repeat=2), repeat=2):
            reqs = [TraceRequest(id=f"{t}{i}", prompt_len=p, max_tokens=m, arrival_step=at, tenant=t)
                    for t, shape in (("a", sa), ("b", sb)) for i, (p, m, at) in enumerate(shape)]
            service, backlogged, w = _vtc_service(reqs, weights, mem)
            for t1 in range(len(service)):
                wa = wb = 0.0
                for t2 in range(t1, len(service)):
                    if not {"a", "b"} <= backlogged[t2]:
                        break
                    wa += service[t2].get("a", 0.0)
                    wb += service[t2].get("b", 0.0)
                    gap = abs(wa / w.get("a", 1.0) - wb / w.get("b", 1.0))
                    assert gap <= bound, (weights, mem, sa, sb, t1, t2, gap)
                    worst = max(worst, gap)
            runs += 1
    assert runs == 4 * 64 * 64
    from invariants.catalogue import EXHAUSTIVE
    assert "VTC.SERVICE_GAP_BOUND" in EXHAUSTIVE  # listed by `batchspec invariants`
    assert 0 < worst <= 8  # observed: 7, well inside 2U = 32 (the bound is loose at this size)


# --------------------------------------------------------------------------
# Starvation protection: aging
# --------------------------------------------------------------------------

STARVATION = load_trace(example_path("starvation"))


def _admitted_at(records, rid):
    return next(r.step for r in records if rid in r.new)


def _starvation(**knobs):
    t = dataclasses.replace(STARVATION, config={**STARVATION.config, **knobs})
    return run(t, check_invariants=True)


@pytest.mark.parametrize("policy", ["priority", "spf"])
def test_without_aging_the_long_low_priority_request_starves(policy):
    records = _starvation(policy=policy)
    # every one of the 40 short high-priority requests goes first: L waits until the stream ends
    assert _admitted_at(records, "L") == 40
    assert all(_admitted_at(records, f"H{i}") == i for i in range(40))


@pytest.mark.parametrize("policy, aging, admitted", [
    ("priority", 2, 10),  # 5 - t // 2 <= 0 from t = 10 = (5 - 0) x 2; the tie with H10 goes to L (earlier)
    ("priority", 1, 5),
    ("spf", 1, 6),  # prompt 8 - t <= 2 from t = 6 = (8 - 2) x 1
    ("spf", 3, 18),
])
def test_with_aging_it_is_served_within_the_bound(policy, aging, admitted):
    records = _starvation(policy=policy, aging_steps=aging)
    assert _admitted_at(records, "L") == admitted
    # only requests arriving within (key_L - key_H) x aging_steps steps after L overtook it
    assert all(_admitted_at(records, f"H{i}") == i for i in range(admitted))
    assert _admitted_at(records, f"H{admitted}") == admitted + 1


def test_aging_profiles_and_their_invariant_are_listed():
    assert PROFILES["priority-aging"].config.aging_steps == 16 and PROFILES["priority-aging"].config.policy == "priority"
    assert PROFILES["spf-aging"].config.policy == "spf"
    inv = INVARIANTS["QUEUE.AGING_BOUNDED_OVERTAKING"]
    assert "(key_r - key_x) x A" in inv.statement and "aging" in inv.profiles


def test_the_aging_invariant_catches_a_queue_that_ignores_age(monkeypatch):
    from spec.queues import AgingQueue

    monkeypatch.setattr(AgingQueue, "key", lambda self, req, now: (self.base_key(req), req.arrival_seq, req.request_id))
    with pytest.raises(InvariantViolation) as e:
        _starvation(policy="priority", aging_steps=2)
    assert e.value.invariant_id == "QUEUE.AGING_BOUNDED_OVERTAKING"


def test_spf_orders_by_prompt_length():
    recs = steps({"policy": "spf", "max_num_seqs": 1}, R("A", 9, 1), R("B", 3, 1), R("C", 5, 1), R("D", 3, 1))
    assert [recs[s].new for s in range(4)] == [["B"], ["D"], ["C"], ["A"]]


# --------------------------------------------------------------------------
# Knobs and profiles
# --------------------------------------------------------------------------


@pytest.mark.parametrize("knobs, field", [
    ({"preemption_mode": "hybrid"}, "preemption_mode"),
    ({"num_cpu_blocks": -1}, "num_cpu_blocks"),
    ({"aging_steps": 4}, "aging_steps"),  # with policy fcfs
    ({"policy": "priority", "aging_steps": -1}, "aging_steps"),
    ({"policy": "vtc", "tenant_weights": "a=0"}, "tenant_weights"),
    ({"policy": "vtc", "tenant_weights": "a"}, "tenant_weights"),
    ({"vtc_output_price": -1.0}, "vtc_output_price"),
    ({"admission": "guess"}, "admission"),
    ({"admission": "estimate", "kv_reservation": "full"}, "admission"),
    ({"new_token_ratio_init": 0.0}, "new_token_ratio_init"),
    ({"new_token_ratio_min_factor": 1.5}, "new_token_ratio_min_factor"),
    ({"new_token_ratio_decay_steps": 0}, "new_token_ratio_decay_steps"),
    ({"retract_decode_steps": -1}, "retract_decode_steps"),
    ({"clip_max_new_tokens": 0}, "clip_max_new_tokens"),
])
def test_bad_knob_values_name_the_knob(knobs, field):
    with pytest.raises(ConfigError) as e:
        resolve({"profile": "vllm-v1", **knobs})
    assert e.value.field == field


def test_new_knob_defaults_are_the_old_behaviour():
    cfg = PROFILES["vllm-v1"].config
    assert (cfg.preemption_mode, cfg.num_cpu_blocks, cfg.admission, cfg.aging_steps, cfg.policy) == \
        ("recompute", 0, "budget", 0, "fcfs")
    rec = run(trace({}, R("A", 4, 2)))[0]
    assert "swapped_out" not in rec.to_json() and "num_free_cpu_blocks" not in rec.to_json()
    assert "new_token_ratio" not in rec.to_json()


def test_sglang_and_vtc_profiles_state_their_knobs():
    sgl = PROFILES["sglang"].config
    assert (sgl.admission, sgl.batching, sgl.new_token_ratio_init, sgl.new_token_ratio_min_factor,
            sgl.new_token_ratio_decay_steps, sgl.retract_decode_steps, sgl.clip_max_new_tokens) == \
        ("estimate", "prefill-first", 0.7, 0.14, 600, 20, 4096)
    assert sgl.new_token_ratio_min == 0.7 * 0.14
    vtc = PROFILES["vtc"].config
    assert (vtc.policy, vtc.vtc_input_price, vtc.vtc_output_price, vtc.kv_reservation) == ("vtc", 1.0, 2.0, "full")
    assert PROFILES["vllm-v0-swap"].config.preemption_mode == "swap"
    for name in ("sglang", "vtc", "vllm-v0-swap", "priority-aging", "spf-aging"):
        assert PROFILES[name].sources and PROFILES[name].fixed


def test_swap_and_ratio_fields_round_trip_through_json():
    rec = StepRecord(step=3, preempted=["B"], swapped_out=["B"], num_free_blocks=2, blocks={}, cache_hits={},
                     num_evicted=0, num_free_cpu_blocks=6, new_token_ratio=0.5)
    back = StepRecord.from_json(rec.to_json("memory"))
    assert (back.swapped_out, back.num_free_cpu_blocks, back.new_token_ratio) == (["B"], 6, 0.5)
    assert "num_free_cpu_blocks" not in rec.to_json("decisions") and rec.to_json("decisions")["swapped_out"] == ["B"]


def test_swap_and_estimate_logs_validate_against_the_shipped_schema(tmp_path):
    from spec.formats import DecisionLog
    from spec.io import load_log, write_log

    for name, config, reqs in (("swap", {**SWAP, "num_cpu_blocks": 8}, (R("A", 4, 8), R("B", 4, 8))),
                               ("sgl", SGL, (R("A", 2, 20), R("B", 2, 20)))):
        records = run(trace(config, *reqs))
        write_log(DecisionLog("spec", "exact", records), tmp_path / f"{name}.jsonl")
        back = load_log(tmp_path / f"{name}.jsonl").records  # schema-checked on load
        assert [r.swapped_out for r in back] == [r.swapped_out for r in records]
        assert [r.new_token_ratio for r in back] == [r.new_token_ratio for r in records]
        assert [r.num_free_cpu_blocks for r in back] == [r.num_free_cpu_blocks for r in records]
