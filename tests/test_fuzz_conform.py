"""Conformance runs: the report, its per-area table and the command's exit status."""
from __future__ import annotations

import json

from fuzz.conform import conform_command, render_markdown, render_table, run_conformance
from fuzz.generate import FEATURES


def test_spec_conforms_to_itself_and_the_table_adds_up():
    report = run_conformance(40, seed=7, level="exact", engine="spec", progress=False)
    assert report.n_traces == 40 and report.all_agreed and not report.divergent
    areas = report.areas()
    assert list(areas)[: len(FEATURES)] == list(FEATURES) and areas["all"].traces == 40
    assert all(a.agreed == a.traces for a in areas.values())
    assert areas["fcfs"].traces + areas["priority"].traces == 40
    assert [o.seed for o in report.outcomes] == list(range(7, 47))
    assert "| **all** | 40 | 40 | 100.0 |" in render_markdown(report)
    assert render_table(report).row_count == len(areas)


def test_report_counts_divergences(monkeypatch):
    import fuzz.conform as conform
    from fuzz.conform import TraceOutcome

    real = conform.check_one

    def flaky(seed, engine, level):
        out = real(seed, engine, level)
        if seed % 5 == 0:
            out.agreed, out.divergence, out.explanation = False, {"step": 1, "field": "scheduled"}, "planted"
        return out

    monkeypatch.setattr(conform, "check_one", flaky)
    report = run_conformance(10, seed=0, engine="spec", progress=False)
    assert [o.seed for o in report.divergent] == [0, 5]
    assert report.areas()["all"].agreed == 8 and not report.all_agreed
    assert report.to_json()["divergences"][0]["seed"] == 0
    assert isinstance(report.outcomes[0], TraceOutcome)


def test_conform_command(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert conform_command("spec", traces=12, seed=3, json_path=str(out), progress=False) == 0
    data = json.loads(out.read_text())
    assert data["traces"] == 12 and data["agreed"] == 12
    assert data["command"] == "batchspec conform --engine spec --traces 12 --seed 3 --level exact"
    assert "12/12 traces agree" in capsys.readouterr().out
    assert conform_command("spec", traces=0) == 2
    assert conform_command("no-such-engine", traces=2, progress=False) == 2
