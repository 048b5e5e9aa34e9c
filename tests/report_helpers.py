"""Builders for the report-name tests: a spec reason, and the divergence plus finding group of two
hand-shrunk logs (what a campaign's report would name)."""
from __future__ import annotations

from fuzz.corpus import group_signature
from fuzz.diff import first_divergence
from fuzz.replay import ReplayResult
from spec.formats import StepRecord, Trace


def reason(rule: str, request: str, text: str = "") -> dict:
    return {"rule": rule, "request": request, "text": text}


def grouped(spec: list[StepRecord], eng: list[StepRecord], level: str = "decisions", config: dict | None = None):
    """The first divergence of the engine's records against the spec's, and its finding group."""
    div = first_divergence(spec, eng, level)
    assert div is not None
    return div, group_signature(ReplayResult(Trace(config=config or {}, requests=[]), "gpu", level, eng, spec, div))
