"""Engine adapters registered for ``--engine NAME`` (beside ``spec`` and ``vllm`` in :mod:`fuzz.replay`).

* ``gpu``        — gpu_engine in scheduler-only mode (tokens synthesized): what fuzzing runs;
* ``gpu-model``  — gpu_engine running the tiny Llama (seed 0) through paged attention;
* ``reference``  — the spec's decisions driving the naive PyTorch model;
* a decision log written elsewhere is compared with :func:`fuzz.replay.replay_records`
  (``batchspec replay TRACE --engine-log LOG``).
"""
from __future__ import annotations

from fuzz.replay import register_engine
from spec.formats import Trace
from spec.protocol import Engine


def _gpu(trace: Trace) -> Engine:
    from gpu_engine.engine import GpuEngine

    return GpuEngine.from_trace(trace, log_state=True)  # state fields: a report names the cause


def _gpu_model(trace: Trace) -> Engine:
    from gpu_engine.engine import GpuEngine

    return GpuEngine.from_trace(trace, model="tiny")


def _reference(trace: Trace) -> Engine:
    from reference.engine import ReferenceEngine

    return ReferenceEngine.from_trace(trace, level="memory")


register_engine("gpu", _gpu, "gpu_engine, scheduler-only (synthesized tokens): the fuzzing target")
register_engine("gpu-model", _gpu_model, "gpu_engine with the tiny Llama through paged attention")
register_engine("reference", _reference, "reference engine: the spec's decisions + a naive PyTorch model")

from fuzz.sglang_adapter import factory as _sglang  # noqa: E402  (imports without SGLang; it loads on first use)

register_engine("sglang", _sglang, "SGLang 0.5.23's scheduler in-process, fake model (own venv: scripts/sglang-env.sh)")
