"""`batchspec docs`: the committed reference docs are exactly what the spec generates (issue #10)."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from batchspec import docs
from batchspec.cli import main
from spec.config import PROFILES, knob_names
from spec.rules import HITS, all_rules

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return docs.generate()


def test_committed_docs_match_the_spec():
    """CI's check: regenerate in memory and compare with docs/ (run `batchspec docs` to fix)."""
    assert main(["docs", "--out", str(DOCS), "--check"]) == 0, "docs/ is stale: run `batchspec docs` and commit"


def _copy_generated(tmp_path: Path, generated: dict[str, str]) -> Path:
    out = tmp_path / "docs"
    for rel in generated:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DOCS / rel, out / rel)
    return out


def test_a_tampered_copy_fails_the_check_and_names_the_files(tmp_path, generated, capsys):
    out = _copy_generated(tmp_path, generated)
    assert docs.differences(out, generated) == []
    (out / "semantics.md").write_text((out / "semantics.md").read_text().replace("PREEMPT.VICTIM_NEWEST", "PREEMPT.OLDEST", 1))
    (out / "profiles" / "naive.md").unlink()
    (out / "profiles" / "retired.md").write_text("a profile that no longer exists\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["docs", "--out", str(out), "--check"]) == 1
    err = capsys.readouterr().err
    for rel in ("semantics.md", "profiles/naive.md", "profiles/retired.md"):
        assert rel in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before, "--check must write nothing"
    # writing repairs it: changed and missing files rewritten, the stale page removed
    assert main(["docs", "--out", str(out)]) == 0
    assert docs.differences(out) == []
    assert not (out / "profiles" / "retired.md").exists()


def test_generation_is_deterministic_and_writes_atomically(tmp_path, generated):
    again = docs.generate()
    assert again == generated
    changed, removed = docs.write(tmp_path)
    assert sorted(changed) == sorted(generated) and removed == []
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()], "no temporary files left behind"
    assert docs.write(tmp_path) == ([], []), "a second write changes nothing"
    assert all("\r" not in text for text in generated.values())


def test_generation_does_not_count_toward_rule_coverage(generated):
    before = HITS.copy()
    docs.generate()
    assert HITS == before


def test_every_rule_knob_profile_and_invariant_is_documented(generated):
    semantics = generated["semantics.md"]
    for rule_id, rule in all_rules().items():
        assert f"### `{rule_id}`" in semantics
        assert docs.md(rule.statement).split("\n")[0][:60] in semantics
    for knob in knob_names():
        assert f"| `{knob}` |" in semantics
    for name, profile in PROFILES.items():
        page = generated[f"profiles/{name}.md"]
        assert f"# Profile `{name}` (version {profile.version})" in page
        for knob in knob_names():
            assert f"| `{knob}` | `{docs.value(getattr(profile.config, knob))}` |" in page
        for setting in profile.fixed:
            assert docs.cell(setting) in page
    for entry in docs.invariant_catalogue():
        assert f"`{entry.id}`" in semantics


def test_every_invariant_is_linked_to_the_rules_it_constrains():
    """Add new invariants to batchspec.docs.INVARIANT_RULES (the docs flag unlinked ones with *)."""
    linked, unlinked = docs.rule_invariants()
    assert unlinked == []
    assert set(linked) <= set(all_rules())


def test_examples_are_traces_in_the_project_format(generated, tmp_path):
    from spec.io import load_trace
    from spec.scheduler import run

    names = [rel for rel in generated if rel.startswith("examples/")]
    assert len(names) >= 7
    for rel in names:
        path = tmp_path / Path(rel).name
        path.write_text(generated[rel])
        trace = load_trace(path)  # schema-valid
        assert run(trace, check_invariants=True)
        assert f"docs/{rel}" in generated["examples.md"], f"{rel} is not referenced from examples.md"


def test_each_classic_situation_is_worked(generated):
    page = generated["examples.md"]
    for slug in ("hol-blocking", "static-batching", "continuous-batching", "chunked-prefill", "preemption", "prefix-cache"):
        assert f'<a id="{slug}"></a>' in page


def test_the_fairness_example_is_required_once_the_vtc_profile_exists(generated):
    page = generated["examples.md"]
    if "vtc" in PROFILES:
        assert '<a id="fairness"></a>' in page
        assert "examples/fairness.jsonl" in generated
    else:
        assert '<a id="fairness"></a>' not in page


def test_an_example_whose_story_stops_being_true_fails_generation(monkeypatch):
    """Head-of-line blocking needs max_num_seqs = 1: with 2 the story is false, and generation says so."""
    naive = PROFILES["naive"]
    monkeypatch.setitem(PROFILES, "naive", dataclasses.replace(naive, config=dataclasses.replace(naive.config, max_num_seqs=2)))
    with pytest.raises(docs.ExampleDrift, match="hol-blocking"):
        docs.ex_hol_blocking()
    assert main(["docs", "--out", str(DOCS), "--check"]) == 1


def test_a_stale_invariant_link_is_an_error(monkeypatch):
    monkeypatch.setitem(docs.INVARIANT_RULES, "MEM.CONSERVATION", ("KV.RENAMED_AWAY",))
    with pytest.raises(docs.DocsError, match="KV.RENAMED_AWAY"):
        docs.rule_invariants()
