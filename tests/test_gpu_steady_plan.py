"""gpu_engine's steady-decode streaks (Scheduler._phase_plan, #18 item 4) agree with the spec.

Long decode streaks of many requests whose block boundaries fall on different steps: the plan
(block pops, registrations and fills by token phase) is built and used, and the decisions and
memory (exact level: block ids, evictions) equal the spec's — with prefix caching, without, under
full reservation (where the closed forms do not hold and the plan must stay off) and with
arrivals and aborts breaking streaks."""
from __future__ import annotations

import pytest

import fuzz.engines  # noqa: F401  (registers gpu)
from fuzz.replay import replay
from gpu_engine.scheduler import Scheduler
from spec.formats import Trace, TraceRequest


def streak_trace(knobs: dict, late: bool = False) -> Trace:
    prompts = [5 + 3 * i for i in range(12)]  # lengths 5..38: boundaries on different steps (block size 4)
    requests = [TraceRequest(id=f"r{i}", prompt_len=p, max_tokens=40 + 7 * i, ignore_eos=True, arrival_step=0)
                for i, p in enumerate(prompts)]
    if late:  # an arrival and an abort in the middle of the streak
        requests.append(TraceRequest(id="late", prompt_len=9, max_tokens=20, ignore_eos=True, arrival_step=25))
        requests[3] = TraceRequest(id="r3", prompt_len=prompts[3], max_tokens=60, ignore_eos=True, arrival_step=0,
                                   abort_at=40)
    config = {"profile": "vllm-v1", "num_blocks": 400, "block_size": 4, "max_num_seqs": 16,
              "max_num_batched_tokens": 512, "max_model_len": 512, **knobs}
    return Trace(config=config, requests=requests, vocab_size=1000, eos_token_id=2, name="streak")


@pytest.mark.parametrize("knobs,late,planned", [
    ({"enable_prefix_caching": True}, False, True),
    ({"enable_prefix_caching": False}, False, True),
    ({"enable_prefix_caching": True}, True, True),
    ({"enable_prefix_caching": True, "kv_reservation": "full"}, False, False),
])
def test_steady_streaks_agree_with_the_spec(monkeypatch, knobs, late, planned):
    used = []
    real = Scheduler._phase_plan

    def counting(self, run):
        plan = real(self, run)
        used.append(plan is not None)
        return plan

    monkeypatch.setattr(Scheduler, "_phase_plan", counting)
    result = replay(streak_trace(knobs, late), "gpu", "exact", after=None)
    assert result.agreed, result.describe()
    assert any(used) == planned  # the plan ran (or, under full reservation, stayed off)


@pytest.mark.parametrize("knobs", [
    {"enable_prefix_caching": True},
    {"policy": "vtc", "tenant_weights": "a=2"},  # VTC charges the steady batch
    {"long_prefill_token_threshold": 8, "long_prefill_token_threshold_adaptive": True},  # the logged cap
    {"abort_running": "after-next-sample"},
    {"batching": "static"},
])
def test_steady_steps_skip_the_phase_gates_and_agree_with_the_spec(monkeypatch, knobs):
    """Scheduler._steady_step: a steady decode step with nothing waiting runs phase 1 alone, and the
    log (exact level, with the optional state fields) still equals the spec's, arrivals and aborts
    in the middle of the streak included."""
    taken = []
    real = Scheduler._steady_step

    def counting(self):
        batch = real(self)
        taken.append(batch is not None)
        return batch

    monkeypatch.setattr(Scheduler, "_steady_step", counting)
    result = replay(streak_trace(knobs, late=True), "gpu", "exact", after=None)
    assert result.agreed, result.describe()
    assert sum(taken) > 20, "the fast path ran for most of the streak"
