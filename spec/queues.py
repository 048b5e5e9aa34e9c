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

    def peek(self) -> Queued:
        return self._q[0]

    def pop(self) -> Queued:
        return self._q.popleft()

    def remove(self, req: Queued) -> None:
        self._q.remove(req)


def priority_key(req: Queued) -> tuple:
    return (req.priority, req.arrival_seq, req.request_id)


class PriorityQueue:
    """Priority order: a binary heap on (priority, arrival, request id as a string)."""

    def __init__(self) -> None:
        self._heap: list[tuple] = []

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator:
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:-1]))

    @rule("QUEUE.PRIORITY", knobs=("policy",))
    def add(self, req: Queued) -> None:
        """Under "priority" the next candidate is the smallest (priority, arrival, id).

        A smaller priority number is more important (vLLM's convention); ties go
        to the earlier arrival, then to the request id compared as a string
        ("10" < "2").  A preempted request is simply pushed back: its place is
        given by the same key, not by when it was preempted.
        """
        heapq.heappush(self._heap, (*priority_key(req), req))

    prepend = add

    def peek(self) -> Queued:
        return self._heap[0][-1]

    def pop(self) -> Queued:
        return heapq.heappop(self._heap)[-1]

    def remove(self, req: Queued) -> None:
        self._heap = [e for e in self._heap if e[-1] is not req]
        heapq.heapify(self._heap)


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
