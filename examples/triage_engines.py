"""Engines "before and after a change", for ``batchspec triage-engines`` (and its tests).

Each factory takes a trace and returns an engine; ``--engine-b examples.triage_engines:gpu_continue``
imports it from the repository root.  They change one thing about the engine the trace asks for:

* :func:`gpu_continue` — ``gpu_engine`` with ``priority_self_preempt=continue`` (the vLLM 0.32 → 0.33
  change): under the priority policy a running request that preempts itself no longer ends the
  running phase.
* :func:`spec_continue` — the spec itself with that knob value.
"""
from __future__ import annotations

import dataclasses

from spec.formats import Trace


def _with(trace: Trace, **knobs) -> Trace:
    return dataclasses.replace(trace, config={**(trace.config or {}), **knobs})


def gpu_continue(trace: Trace):
    from gpu_engine.engine import GpuEngine

    return GpuEngine.from_trace(_with(trace, priority_self_preempt="continue"), log_state=True)


def spec_continue(trace: Trace):
    from spec.scheduler import SpecEngine

    return SpecEngine.from_trace(_with(trace, priority_self_preempt="continue"))


def gpu_crashes_at_step_3(trace: Trace):
    """``gpu_engine`` that raises in its fourth ``step()``: a crash is a difference too."""
    from gpu_engine.engine import GpuEngine

    engine = GpuEngine.from_trace(trace, log_state=True)
    step, calls = engine.step, [0]

    def crashing_step():
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("planted crash")
        return step()

    engine.step = crashing_step
    return engine
