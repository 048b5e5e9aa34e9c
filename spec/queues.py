"""The waiting queue: the order in which requests are considered for admission.

Both queues hold requests that are waiting for the first time and requests
that were preempted.  ``peek``/``pop`` give the next candidate; ``add`` is an
arrival; ``prepend`` is a preemption victim going back (vLLM's
``prepend_request``).
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator, Protocol

from spec.rules import rule
from spec.slo import edf_key, predicted_remaining


class Queued(Protocol):
    request_id: str
    priority: int
    arrival_seq: int


class FCFSQueue:
    """First come, first served: a deque."""

    def __init__(self) -> None:
        self._q: deque = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator:
        return iter(self._q)

    @rule("QUEUE.FCFS", knobs=("policy",))
    def add(self, req: Queued) -> None:
        """Under FCFS an arriving request joins the tail; the head is admitted first."""
        self._q.append(req)

    @rule("QUEUE.VICTIM_TO_FRONT", knobs=("policy",))
    def prepend(self, req: Queued) -> None:
        """A preempted request goes back to the *front* of the FCFS queue.

        Victims are taken from the tail of the running list and each is put at the
        front, so after several preemptions the queue starts with the victims in
        their original running order: the queue stays sorted by arrival.
        """
        self._q.appendleft(req)

    def requeue_tail(self, req: Queued) -> None:
        """A retracted request (admission="estimate") goes to the tail (rule RETRACT.TO_TAIL)."""
        self._q.append(req)

    def peek(self) -> Queued:
        return self._q[0]

    def pop(self) -> Queued:
        return self._q.popleft()

    def remove(self, req: Queued) -> None:
        self._q.remove(req)


def priority_key(req: Queued) -> tuple:
    return (req.priority, getattr(req, "tie_time", req.arrival_seq), req.request_id)


class PriorityQueue:
    """Priority order: a binary heap on (priority, arrival, request id as a string)."""

    def __init__(self) -> None:
        self._heap: list[tuple] = []

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator:
        # entries sort as the heap orders them: the keys are unique (they end with the
        # request id), so a comparison never reaches the request itself
        return iter([entry[-1] for entry in sorted(self._heap)])

    @rule("QUEUE.PRIORITY", knobs=("policy",))
    def add(self, req: Queued) -> None:
        """Under "priority" the next candidate is the smallest (priority, arrival time, id).

        A smaller priority number is more important (vLLM's convention); ties go
        to the earlier arrival time — the trace's ``client_arrival_time`` (vLLM's
        ``Request.arrival_time``, which need not follow the order requests reach the
        scheduler), else the order of arrival — then to the request id compared as a
        string ("10" < "2").  A preempted request is simply pushed back: its place is
        given by the same key, not by when it was preempted.
        """
        heapq.heappush(self._heap, (*priority_key(req), req))

    prepend = add
    requeue_tail = add

    def peek(self) -> Queued:
        return self._heap[0][-1]

    def pop(self) -> Queued:
        return heapq.heappop(self._heap)[-1]

    def remove(self, req: Queued) -> None:
        self._heap = [e for e in self._heap if e[-1] is not req]
        heapq.heapify(self._heap)


class AgingQueue:
    """Priority or shortest-prompt-first order, optionally with aging: a plain list,
    the next candidate found by a scan (keys change as requests age)."""

    def __init__(self, policy: str, aging_steps: int, clock) -> None:
        self._items: list = []
        self.policy = policy
        self.aging_steps = aging_steps
        self.clock = clock  # () -> the engine's current step number

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator:
        now = self.clock()
        return iter(sorted(self._items, key=lambda r: self.key(r, now)))

    def base_key(self, req) -> int:
        """The key before aging: the priority number, the prompt length under "spf", the
        predicted remaining output under "sprpt" (rule QUEUE.SPRPT)."""
        if self.policy == "sprpt":
            return predicted_remaining(req)
        return len(req.prompt_token_ids) if self.policy == "spf" else req.priority

    @rule("QUEUE.AGING", knobs=("aging_steps", "policy"))
    def key(self, req, now: int) -> tuple:
        """With ``aging_steps`` = A > 0, a request's effective key is its base key minus
        one for every A steps of age: ``base - (now - arrival_step) // A``, where age
        counts every step since it arrived (waiting, running or preempted alike).

        The smallest (effective key, arrival, id) is admitted first.  A request that
        keeps losing to better keys ages until its key is the smallest there is, so it
        can only be passed by a request that arrived fewer than ``(base_r - base_x) x A``
        steps after it (invariant QUEUE.AGING_BOUNDED_OVERTAKING): no starvation.
        A = 0 turns aging off (the plain priority or spf order).  Steps are the
        engine's executed steps (``arrival_step`` is how many had run when it arrived;
        idle gaps, when nothing waits, are not counted).
        """
        base = self.base_key(req)
        if self.aging_steps:
            base -= (now - req.arrival_step) // self.aging_steps
        return (base, req.arrival_seq, req.request_id)

    @rule("QUEUE.SPF", knobs=("policy",))
    def add(self, req) -> None:
        """Under "spf" (shortest prompt first) the next candidate is the waiting request
        with the fewest prompt tokens, then the earliest arrival, then the id.

        Short requests finish sooner, so serving them first lowers mean latency
        (SGLang's shortest-prefill-first, vLLM's SJF scorer); without aging a stream of
        short prompts starves a long one.  A preempted request goes back by the same key.
        """
        self._items.append(req)

    prepend = add
    requeue_tail = add

    def peek(self):
        now = self.clock()
        return min(self._items, key=lambda r: self.key(r, now))

    def pop(self):
        req = self.peek()
        self._items.remove(req)
        return req

    def remove(self, req) -> None:
        self._items.remove(req)


class EDFQueue(PriorityQueue):
    """Earliest TTFT deadline first (rule QUEUE.EDF): the priority queue's heap, keyed by
    :func:`spec.slo.edf_key`.

    A request's key changes only when it is deferred (SLO.DEFER) or samples a token, and
    only deferral happens while it waits, so the heap stays valid; :meth:`defer` re-pushes
    a request with its new key."""

    def add(self, req) -> None:
        heapq.heappush(self._heap, (*edf_key(req), req))

    prepend = add
    requeue_tail = add

    def defer(self, req) -> None:
        """SLO.DEFER: ``req`` goes behind every request that was not deferred."""
        self.remove(req)
        req.deferred = True
        self.add(req)


class VTCQueue:
    """Per-tenant FCFS queues and virtual token counters (Sheng et al., OSDI'24)."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self.queues: dict[str, deque] = {}  # tenant -> its waiting requests, first seen first
        self.counters: dict[str, float] = {}
        self.last_left: str | None = None  # the tenant whose queue emptied last
        self.lifted: tuple[str, float, float] | None = None  # the last add's lift: tenant, counter before, after
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator:
        return (r for q in self.queues.values() for r in q)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def backlogged(self) -> list[str]:
        return [t for t, q in self.queues.items() if q]

    @rule("VTC.LIFT", knobs=("policy",), applies=bool)
    def lift(self, tenant: str) -> bool:
        """A tenant whose waiting queue is empty when its request arrives has its counter
        lifted: to ``max(own, min counter of the other backlogged tenants)``; if no other
        tenant is backlogged, to ``max(own, counter of the tenant that last left the
        queue)`` (the paper's Algorithm 2; the artifact has only the first branch).

        Without the lift a tenant that sent nothing for a while would bank credit and then
        monopolise the engine; with it, the service gap between backlogged tenants stays
        bounded.  A preempted request going back does not lift (its tenant never left).
        """
        others = [self.counters[t] for t in self.backlogged() if t != tenant]
        old = self.counters[tenant]
        if others:
            self.counters[tenant] = max(old, min(others))
        elif self.last_left is not None and self.last_left != tenant:
            self.counters[tenant] = max(old, self.counters[self.last_left])
        return self.counters[tenant] != old

    @rule("VTC.QUEUE", knobs=("policy", "tenant_weights"))
    def add(self, req) -> None:
        """Under "vtc" each tenant has a FCFS queue; an arrival joins its tenant's tail
        (first lifting the tenant's counter if its queue was empty, rule VTC.LIFT).
        The next candidate is the head of the backlogged tenant with the smallest
        counter (ties: the tenant seen first).  New tenants start at 0."""
        tenant = req.source.tenant
        if tenant not in self.queues:
            self.queues[tenant] = deque()
            self.counters[tenant] = 0.0
        self.lifted = None
        if not self.queues[tenant]:
            before = self.counters[tenant]
            self.lift(tenant)
            self.lifted = (tenant, before, self.counters[tenant])
        self.queues[tenant].append(req)
        self._n += 1

    def prepend(self, req) -> None:
        """A preempted request goes back to the front of its tenant's queue (no lift)."""
        self.queues.setdefault(req.source.tenant, deque()).appendleft(req)
        self.counters.setdefault(req.source.tenant, 0.0)
        self._n += 1

    def requeue_tail(self, req) -> None:
        """A retracted request goes to the tail of its tenant's queue (no lift)."""
        self.queues.setdefault(req.source.tenant, deque()).append(req)
        self.counters.setdefault(req.source.tenant, 0.0)
        self._n += 1

    @rule("VTC.PICK", knobs=("policy",))
    def pick(self) -> str:
        """Admission serves the backlogged tenant with the smallest virtual counter
        (ties: the tenant seen first), taking its oldest waiting request."""
        best = None
        for t, q in self.queues.items():
            if q and (best is None or self.counters[t] < self.counters[best]):
                best = t
        return best

    def peek(self):
        return self.queues[self.pick()][0]

    def pop(self):
        tenant = self.pick()
        return self._left(tenant, self.queues[tenant].popleft())

    def remove(self, req) -> None:
        self.queues[req.source.tenant].remove(req)
        self._left(req.source.tenant, req)

    def _left(self, tenant: str, req):
        self._n -= 1
        if not self.queues[tenant]:
            self.last_left = tenant
        return req

    def charge(self, tenant: str, cost: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weight(tenant)


def make_queue(policy: str, aging_steps: int = 0, clock=None, weights: dict[str, float] | None = None):
    if policy == "vtc":
        return VTCQueue(weights or {})
    if policy == "edf":
        return EDFQueue()
    if policy in ("spf", "sprpt") or (policy == "priority" and aging_steps):
        return AgingQueue(policy, aging_steps, clock)
    return PriorityQueue() if policy == "priority" else FCFSQueue()
