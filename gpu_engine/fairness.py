"""Virtual Token Counter bookkeeping (policy "vtc"; Sheng et al., OSDI'24) for the tensor scheduler.

Tenants are numbered in the order they are first queued; a request slot's
``tenant`` column holds that number.  Per tenant, on the host (numpy): the
virtual counter (float64), the weight, and how many requests wait.  The
waiting requests themselves stay in the scheduler's FCFS ``queue_key`` column:
a tenant's queue is its waiting slots in key order, so "the head of tenant
``t``" is one masked ``argmin``.

The counters are sums of floats, so their values depend on the order of the
additions; to agree with any sequential implementation bit for bit, charges
are applied in batch order with ``numpy.add.at`` (sequential, unbuffered),
never with a parallel reduction.
"""
from __future__ import annotations

import numpy as np

from spec.config import SchedulerConfig


class TenantCounters:
    """Counters, weights, waiting counts and the last tenant whose queue emptied."""

    def __init__(self, config: SchedulerConfig):
        self.weights_by_name = config.weights()
        self.input_price, self.output_price = config.vtc_input_price, config.vtc_output_price
        self.index: dict[str, int] = {}
        # two tenants' room, doubled as more appear (fuzz traces draw up to four: the growth runs too)
        self.counter = np.zeros(2)
        self.weight = np.ones(2)
        self.waiting = np.zeros(2, dtype=np.int64)
        self.last_left: int | None = None
        self.lifts: dict[int, float] = {}  # tenant -> counter after its lift, since the last record

    def tenant(self, name: str) -> int:
        """The tenant's number, registering it (counter 0) when first seen."""
        t = self.index.get(name)
        if t is None:
            t = self.index[name] = len(self.index)
            if t == len(self.counter):
                grow = len(self.counter)
                self.counter = np.concatenate([self.counter, np.zeros(grow)])
                self.weight = np.concatenate([self.weight, np.ones(grow)])
                self.waiting = np.concatenate([self.waiting, np.zeros(grow, dtype=np.int64)])
            self.weight[t] = self.weights_by_name.get(name, 1.0)
        return t

    def arrive(self, t: int) -> None:
        """VTC.LIFT then queue: a tenant returning to an empty queue is lifted to the
        smallest counter among the other backlogged tenants, or, when none is
        backlogged, to the counter of the tenant whose queue emptied last."""
        if self.waiting[t] == 0:
            n = len(self.index)
            others = self.waiting[:n] > 0
            others[t] = False
            if others.any():
                self.counter[t] = max(self.counter[t], self.counter[:n][others].min())
            elif self.last_left is not None and self.last_left != t:
                self.counter[t] = max(self.counter[t], self.counter[self.last_left])
            self.lifts[t] = float(self.counter[t])  # (logged state: the lift as tested, until the step's record)
        self.waiting[t] += 1

    def requeue(self, t: int) -> None:
        """A preempted request goes back to its tenant's queue: no lift."""
        self.waiting[t] += 1

    def leave(self, tenants) -> None:
        """Requests left their queues (admitted or aborted), in this order."""
        for t in tenants:
            self.waiting[t] -= 1
            if self.waiting[t] == 0:
                self.last_left = t

    def pick(self) -> int:
        """VTC.PICK: the backlogged tenant with the smallest counter (ties: first seen)."""
        n = len(self.index)
        masked = np.where(self.waiting[:n] > 0, self.counter[:n], np.inf)
        return int(masked.argmin())

    def charge(self, tenants: np.ndarray, prompt_len: np.ndarray, start: np.ndarray, n: np.ndarray) -> None:
        """VTC.CHARGE for chunks ``start .. start+n-1``, in batch order: positions below
        the prompt length cost ``input_price``, the rest ``output_price``; divided by weight."""
        if len(tenants) == 0:
            return
        prompt = np.maximum(np.minimum(start + n, prompt_len) - start, 0)
        cost = self.input_price * prompt + self.output_price * (n - prompt)
        np.add.at(self.counter, tenants, cost / self.weight[tenants])
