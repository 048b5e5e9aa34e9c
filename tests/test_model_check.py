"""The model check: a campaign against gpu_engine (scheduler-only, which never runs its model) also runs,
now and then, its model against the reference engine (same weights, greedy): paged attention, KV writes and
the flattened batch, which no decision shows."""
import sys
from pathlib import Path

import fuzz.campaign as campaign
from batchspec.cli import main
from fuzz.campaign import Task, checks_model, model_check_trace
from fuzz.engines import token_divergence
from fuzz.generate import random_trace
from spec.io import write_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mutation_score as ms  # noqa: E402  (its planting mechanism: one line of one function changed)

SKIPS_SELF = next(m for m in ms.MUTANTS if m.name == "attention_skips_self")
SMALL = [s for s in range(40) if sum(r.prompt_len + r.max_tokens for r in random_trace(s).requests)
         <= campaign.MODEL_CHECK_TOKENS][:4]


def test_the_model_samples_the_reference_engines_tokens():
    assert len(SMALL) == 4
    assert [s for s in SMALL if token_divergence(random_trace(s, max_steps=2000)) is not None] == []


def test_an_attention_bug_is_named_at_the_first_token_it_changes():
    with ms.planted(SKIPS_SELF):
        d = token_divergence(random_trace(SMALL[0], max_steps=2000))
    assert d is not None and d.kind == "tokens" and d.field == "sampled"
    (rid, ref), = d.spec_value.items()
    assert d.request == rid and d.engine_value[rid] != ref and "reference engine" in d.reason


def test_the_check_runs_in_a_gpu_campaign_on_a_traces_leading_requests():
    at = campaign.MODEL_CHECK_FIRST
    assert checks_model(Task(at, 0, {}, "gpu", "exact", 0))
    assert checks_model(Task(at + campaign.MODEL_CHECK_EVERY, 0, {}, "gpu", "exact", 0))
    assert not checks_model(Task(at + 1, 0, {}, "gpu", "exact", 0))
    assert not checks_model(Task(at, 0, {}, "vllm", "exact", 0))
    big = next(t for t in map(random_trace, range(40))
               if sum(r.prompt_len + r.max_tokens for r in t.requests) > campaign.MODEL_CHECK_TOKENS)
    small = model_check_trace(big)
    assert 0 < len(small.requests) < len(big.requests) and small.requests == big.requests[:len(small.requests)]
    assert sum(r.prompt_len + r.max_tokens for r in small.requests) <= campaign.MODEL_CHECK_TOKENS
    assert model_check_trace(random_trace(SMALL[0])) == random_trace(SMALL[0])


def test_replay_check_tokens_exit_codes(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(random_trace(SMALL[0], max_steps=2000), str(path))
    assert main(["replay", str(path), "--engine", "gpu-model", "--check-tokens"]) == 0
    with ms.planted(SKIPS_SELF):
        assert main(["replay", str(path), "--engine", "gpu-model", "--check-tokens"]) == 1
    assert main(["replay", str(path), "--engine", "gpu", "--check-tokens"]) == 2  # (only gpu-model has a model)


def test_a_campaign_reports_a_model_bug_with_the_command_that_shows_it(tmp_path):
    reports = ms.first_reports(SKIPS_SELF, str(tmp_path), seconds=120)
    names = [n for n in reports if n.startswith("tokens-")]
    assert names, f"no tokens finding: {list(reports)}"
    report = reports[names[0]]
    assert f"batchspec replay {tmp_path / names[0]}.jsonl --engine gpu-model --check-tokens" in report
    assert "**engine-bug**" in report and "token divergence at step" in report
