"""Hypothesis stateful testing of the spec: arrive, step and abort in any order.

The machine drives a :class:`spec.scheduler.SpecEngine` with three rules —
a request of any shape arrives (including ones that must be rejected), the
engine takes a step, a client aborts a waiting, running, finished or unknown
request — and after every rule checks every state invariant of
:mod:`spec.invariants` plus the machine's own bookkeeping: each request ends
exactly once, and nothing outlives its end.

    batchspec prove --hypothesis --examples 2000     # a longer campaign
"""
from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from invariants.strategies import configs, for_profile
from spec import invariants as spec_invariants
from spec.config import PROFILES, resolve
from spec.formats import TraceRequest
from spec.scheduler import SpecEngine, Status

VOCAB = 64

request_shapes = st.builds(
    TraceRequest,
    id=st.just("?"),
    # mostly short (they fit, grow and get preempted); sometimes too long: REJECT.*
    prompt_len=st.one_of(st.integers(1, 16), st.integers(17, 120)),
    max_tokens=st.integers(1, 16),
    prefix_group=st.sampled_from([None, "g"]),
    prefix_len=st.integers(0, 16),
    priority=st.integers(0, 3),
    tenant=st.sampled_from(["a", "b", "default"]),
    ignore_eos=st.booleans(),
    stop_token_ids=st.sampled_from([(), (6,)]),
    output_tokens=st.lists(st.sampled_from([2, 5, 6, 7]), max_size=3).map(tuple),
)


class SpecMachine(RuleBasedStateMachine):
    """Any interleaving of arrivals, steps and aborts keeps every invariant."""

    profile = "vllm-v1"

    @initialize(config=configs(), blocks=st.integers(4, 16))
    def start(self, config, blocks):
        # small pools: requests grow past them, so preemption and eviction happen often
        config = for_profile({**config, "num_blocks": blocks}, self.profile)
        self.engine = SpecEngine(resolve(config), vocab_size=VOCAB, eos_token_id=2, check_invariants=True)
        self.ids: list[str] = []
        self.ended: dict[str, int] = {}
        self.steps = 0

    @rule(shape=request_shapes)
    def arrive(self, shape: TraceRequest):
        rid = f"r{len(self.ids)}"
        self.ids.append(rid)
        self.engine.add_request(dataclasses.replace(shape, id=rid, arrival_step=self.steps))

    @rule()
    def step(self):
        self._step()

    @rule(steps=st.integers(1, 60))
    def run_for(self, steps):
        """Several steps in a row: requests grow, memory runs out, victims are preempted."""
        for _ in range(steps):
            if not self.engine.has_unfinished_requests():
                break
            self._step()

    def _step(self):
        record = self.engine.step()  # checks every invariant inside the step
        self.steps += 1
        for rid in [r for r, _ in record.finished] + record.aborted + [r for r, _ in record.rejected]:
            assert rid not in self.ended, f"{rid} ended twice"
            self.ended[rid] = self.steps
        for rid, _ in record.scheduled:
            assert rid not in self.ended or self.ended[rid] == self.steps, f"{rid} scheduled after it ended"

    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self.ids + ["unknown"]), label="abort")
        before = self.engine.requests.get(rid)
        live = before is not None and before.status in (Status.WAITING, Status.PREEMPTED, Status.RUNNING)
        self.engine.abort_request(rid)
        if live:
            assert self.engine.requests[rid].status == Status.ABORTED, f"{rid} not aborted"
            assert not self.engine.kv.blocks_of(rid), f"aborted {rid} still holds blocks"

    @invariant()
    def state_invariants(self):
        if hasattr(self, "engine"):
            spec_invariants.check_state(self.engine)

    @invariant()
    def waiting_and_running_are_disjoint_and_live(self):
        if not hasattr(self, "engine"):
            return
        running = {r.request_id for r in self.engine.running}
        waiting = {r.request_id for r in self.engine.waiting}
        assert not running & waiting, f"{running & waiting} both running and waiting"
        assert all(self.engine.requests[r].status == Status.RUNNING for r in running), "running list holds a non-running request"


def machine_for(profile: str) -> type[SpecMachine]:
    """The state machine for one profile (one TestCase class per profile)."""
    return type(f"SpecMachine_{profile.replace('-', '_')}", (SpecMachine,), {"profile": profile})


def run_campaign(examples: int, profiles: list[str] | None = None, seed: int | None = 0) -> list[tuple[str, int]]:
    """Run the machine for each profile; raise on the first failing example."""
    done = []
    for name in profiles or sorted(PROFILES):
        cfg = settings(max_examples=examples, stateful_step_count=40, deadline=None, database=None,
                       derandomize=seed is not None, suppress_health_check=list(HealthCheck))
        run_state_machine_as_test(machine_for(name), settings=cfg)
        done.append((name, examples))
    return done
