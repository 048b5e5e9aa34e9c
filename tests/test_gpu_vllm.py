"""gpu_engine against vLLM 0.32's real scheduler, at the ``exact`` level.

Marked ``vllm`` (deselected in normal CI); run it in the vLLM venv::

    .venv-vllm/bin/python -m pytest -m vllm tests/test_gpu_vllm.py

The spec is already checked against vLLM (test_vllm_conformance.py) and
gpu_engine against the spec; this closes the triangle directly, so a bug
shared by the spec and gpu_engine cannot hide.
"""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm

N_TRACES = int(os.environ.get("BATCHSPEC_GPU_VLLM_TRACES", "300"))


@pytest.mark.parametrize("stress,asynchronous", [(False, False), (True, False), (False, True)],
                         ids=["plain", "stress", "async"])
def test_gpu_engine_equals_vllm_exact(stress, asynchronous):
    from fuzz.diff import first_divergence
    from fuzz.generate import random_trace
    from fuzz.replay import EngineUnavailable
    from fuzz.vllm_adapter import VllmEngine, vllm_modules
    from spec.config import resolve
    from spec.protocol import StepLimitError, drive

    from gpu_engine import GpuEngine

    try:
        vllm_modules()
    except EngineUnavailable as e:
        pytest.fail(f"selected but vLLM cannot be used: {e}", pytrace=False)

    def replay(engine, trace):
        try:
            return drive(engine, trace, resolve(trace.config).max_steps)
        except StepLimitError as e:
            return e.records

    for seed in range(N_TRACES):
        options = {"async_scheduling": True} if asynchronous else {}  # vLLM's AsyncScheduler, batch queue of 2
        trace = random_trace(seed + (50_000 if stress else 0), stress=stress, **options)
        d = first_divergence(replay(VllmEngine(trace), trace), replay(GpuEngine.from_trace(trace), trace), "exact",
                             engine="gpu_engine")
        assert d is None, f"seed {seed} stress={stress} async={asynchronous}: {d.describe()}"
