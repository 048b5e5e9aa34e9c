"""scripts/campaign-table.py (the findings table per campaign corpus) and the rule reachability it
counts against (fuzz.capabilities.reachable_rules: knobs taken together, the step plan's choices)."""
from __future__ import annotations

import glob
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.campaign import CampaignConfig, run_campaign
from fuzz.capabilities import for_engine, load, parse, reachable_rules
from spec.rules import all_rules

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "campaign-table.py"
RULES = sorted(r.id for r in all_rules().values() if r.fires)
EXAMPLES = sorted(glob.glob(str(ROOT / "examples" / "*.capabilities.json")))


def _script():
    spec = importlib.util.spec_from_file_location("campaign_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _envelopes():
    return [("vllm", for_engine("vllm")), ("sglang", for_engine("sglang")), ("spec", for_engine("spec")),
            *((Path(p).name, load(p)) for p in EXAMPLES)]


@pytest.mark.parametrize("name,envelope", _envelopes(), ids=[n for n, _ in _envelopes()])
def test_a_states_envelope_line_reads_back_to_the_same_envelope(name, envelope):
    """The state keeps only the envelope's one-line description: read back, it is the same envelope
    (same line, same reachable rules) — what the table's 'of reachable' is counted on."""
    back = parse(_script().envelope_declaration(envelope.describe()))
    assert back.describe() == envelope.describe()
    assert reachable_rules(back, RULES) == reachable_rules(envelope, RULES)


def test_async_speculative_decoding_cannot_fire_the_synchronous_draft_rules():
    """SPEC.PROPOSE (drafts proposed after the output) and SPEC.CACHE_AT_OUTPUT are synchronous-only:
    with async_scheduling pinned true the drafts are placeholders (SPEC.ASYNC_DRAFT_PLACEHOLDERS)."""
    for path in ("vllm-v1-async-specdec", "vllm-v1-0.33-async-specdec"):
        can = set(reachable_rules(load(ROOT / "examples" / f"{path}.capabilities.json"), RULES))
        assert "SPEC.ASYNC_DRAFT_PLACEHOLDERS" in can and "SPEC.ROLLBACK" in can
        assert not {"SPEC.PROPOSE", "SPEC.CACHE_AT_OUTPUT"} & can
    sync = set(reachable_rules(load(ROOT / "examples" / "vllm-v1-0.33-specdec.capabilities.json"), RULES))
    assert {"SPEC.PROPOSE", "SPEC.CACHE_AT_OUTPUT"} <= sync and "SPEC.ASYNC_DRAFT_PLACEHOLDERS" not in sync
    # 0.32 keeps spec_cache_at_output at its default (false): drafts are cached at the next step
    assert "SPEC.CACHE_AT_OUTPUT" not in set(reachable_rules(load(ROOT / "examples" / "vllm-v1-specdec.capabilities.json"), RULES))


def test_sglang_only_knob_values_are_outside_vllms_envelope_and_vllms_victim_orders_outside_sglangs():
    vllm = set(reachable_rules(for_engine("vllm"), RULES))
    sglang_only = {"REJECT.INPUT_LIMIT", "ARRIVE.CLIP_MAX_TOKENS", "STOP.IGNORE_EOS_SCOPE", "ABORT.AFTER_NEXT_SAMPLE",
                   "ESTIMATE.CONTINUED_CHUNK", "ESTIMATE.HOLD_UNTIL_DEPARTURE", "ESTIMATE.RUNNING_RATIO",
                   "RETRACT.VICTIM_FEWEST_OUTPUTS"}
    assert not sglang_only & vllm
    assert not any(r.startswith("SPEC.") for r in vllm)  # measured with their own envelopes
    assert {"PREEMPT.VICTIM_NEWEST", "QUEUE.VICTIM_TO_FRONT", "ADMIT.NO_CHUNKING"} <= vllm
    sglang = set(reachable_rules(for_engine("sglang"), RULES))
    assert {"RETRACT.VICTIM_FEWEST_OUTPUTS", "RETRACT.TO_TAIL", "ARRIVE.CLIP_MAX_TOKENS"} <= sglang
    assert not {"PREEMPT.VICTIM_NEWEST", "PREEMPT.VICTIM_LOWEST_PRIORITY", "QUEUE.VICTIM_TO_FRONT"} & sglang
    assert set(reachable_rules(for_engine("spec"), RULES, "all")) == set(RULES)


@pytest.mark.parametrize("envelope", ["sglang", "vllm-v1-0.33-async-specdec"])
def test_what_the_spec_fires_inside_an_envelope_was_counted_reachable(tmp_path, envelope):
    """The reachability is not too strict: a campaign of the spec against itself, drawn inside the
    envelope, fires only rules counted reachable there."""
    env = for_engine(envelope) if envelope == "sglang" else load(ROOT / "examples" / f"{envelope}.capabilities.json")
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps(env.to_json()))
    state = run_campaign(CampaignConfig(seed=1, engine="spec", capabilities=str(caps), traces=120, workers=1,
                                        corpus=str(tmp_path / "c")))
    assert state.errors == 0, state.first_error
    assert set(state.covered) <= set(reachable_rules(env, RULES)), sorted(set(state.covered) - set(reachable_rules(env, RULES)))


def test_the_table_row_sums_the_state_across_resumes_and_counts_the_triage_classes(tmp_path):
    corpus = tmp_path / "c"
    cfg = dict(seed=2, engine="spec", workers=1, corpus=str(corpus))
    first = run_campaign(CampaignConfig(traces=16, **cfg))
    again = run_campaign(CampaignConfig(traces=32, resume=True, **cfg))
    # the state carries time and traces over --resume: the budget (--traces, --seconds) is the total
    assert again.traces == 32 and again.seconds > first.seconds and again.steps > first.steps
    spent = run_campaign(CampaignConfig(seconds=again.seconds / 2, resume=True, **cfg))  # time already spent
    assert (spent.traces, spent.steps) == (again.traces, again.steps)
    for name, cls in (("a", "engine-bug"), ("b", "spec-wrong"), ("c", None)):
        group = {"signature": ["decision", "x", name], "count": 1}
        if cls:
            group["triage"] = {"class": cls, "status": "confirmed", "by": "human"}
        (corpus / f"{name}.group.json").write_text(json.dumps(group))
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", str(corpus)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert (row["traces"], row["steps"], row["seconds"]) == (again.traces, again.steps, round(again.seconds, 1))
    # the spec's envelope: every rule is reachable (and a rule that fired counts, whatever its needs)
    assert row["rules_hit"] == len(again.covered) <= row["rules_reachable"] == len(set(RULES) | set(again.covered))
    assert row["findings"] == 3 and row["classes"] == {"engine-bug": 1, "deliberate-difference": 0, "spec-wrong": 1,
                                                       "untriaged": 1}
    table = subprocess.run([sys.executable, str(SCRIPT), str(corpus)], capture_output=True, text=True, timeout=120).stdout
    assert f"| c | spec | every mode | 0 min | 32 | {again.steps:,} | 0 | 0 | {len(again.covered)}/" in table
    assert "c: finding a: engine-bug" in table and "c: finding c: untriaged" in table


def test_rules_of_counts_the_rule_ids_of_the_campaigns_own_code(tmp_path):
    """--rules-of SRC: a checkout whose spec has fewer rules (here: one) is the denominator's rule set."""
    run_campaign(CampaignConfig(seed=3, engine="spec", traces=4, workers=1, corpus=str(tmp_path / "c")))
    src = tmp_path / "src" / "spec"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "rules.py").write_text("class R:\n    id, fires = 'ADMIT.NEW', True\n\ndef all_rules():\n    return {'ADMIT.NEW': R()}\n")
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", "--rules-of", str(tmp_path / "src"), str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row["rules_reachable"] == len({"ADMIT.NEW"} | set(json.loads(next((tmp_path / "c").glob(".campaign-*.json")).read_text())["covered"]))
    bad = subprocess.run([sys.executable, str(SCRIPT), "--rules-of", str(tmp_path), str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == f"error: {tmp_path}: --rules-of: not a batchspec checkout (no spec/rules.py)"


def test_a_directory_without_a_campaign_state_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == f"error: {tmp_path}: corpus: no campaign state (.campaign-*.json) in this directory"
