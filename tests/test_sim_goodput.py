"""Issue 19: SLO attainment per class and goodput in the simulator; SLO classes on real traces.

The expected numbers are worked out by hand in the comments (1 s per step, the unit cost model)."""
from __future__ import annotations

import pytest

from fuzz.sweep import modelled_step_s, parse_profile_spec, run_config, with_targets
from spec.costmodel import StepShape, preset
from spec.formats import Trace, TraceRequest
from spec.metrics import PER_REQUEST, summarize
from spec.simulate import simulate

UNIT = preset("unit")


def tiny(requests, **knobs):
    return Trace(config={"profile": "vllm-v1", "num_blocks": 64, "block_size": 4, **knobs}, requests=requests)


def req(rid, t, prompt, out, **kw):
    return TraceRequest(id=rid, prompt_len=prompt, max_tokens=out, arrival_time=t, **kw)


def test_attainment_and_goodput_by_hand():
    """As tests/test_sim_simulate.py's hand-computed run: A (arrives 0, 3 outputs) has TTFT 1 s and
    TPOT 1 s; B (arrives 0.5, 2 outputs) TTFT 1.5 s, TPOT 1 s.  Duration 3 s.

    (C joins A's first step and finishes in it; A's and B's times do not change.)
    A in class "chat" (ttft 1.2, tpot 0.5): TTFT met, TPOT missed.  B in "chat" too: TTFT missed,
    TPOT missed.  So chat: 2 requests, TTFT 1/2, TPOT 0/2, both 0.  C (arrives 0, prompt 4, 1 output,
    its own ttft 2): TTFT 1 s met, one output so TPOT 0 met: attains, goodput 1/3 per second."""
    trace = tiny([req("A", 0.0, 4, 3, slo_class="chat", ttft_slo=1.2, tpot_slo=0.5),
                  req("C", 0.0, 4, 1, ttft_slo=2.0),
                  req("B", 0.5, 4, 2, slo_class="chat", ttft_slo=1.2, tpot_slo=0.5)])
    m = summarize(simulate(trace, UNIT))
    chat, own = m.slo_classes["chat"], m.slo_classes[PER_REQUEST]
    assert (chat.requests, chat.ttft_attained, chat.tpot_attained, chat.attained) == (2, 0.5, 0.0, 0.0)
    assert (own.requests, own.attained) == (1, 1.0)
    assert m.duration_s == 3.0
    assert m.slo_attainment == pytest.approx(1 / 3) and m.slo_goodput == pytest.approx(1 / 3)
    assert own.goodput == pytest.approx(1 / 3) and chat.goodput == 0.0
    assert m.request_throughput == pytest.approx(1.0)  # all three completed: throughput is not goodput


def test_no_targets_no_attainment():
    m = summarize(simulate(tiny([req("A", 0.0, 4, 2)]), UNIT))
    assert m.slo_classes == {} and m.slo_attainment is None and m.slo_goodput is None


def test_a_refused_request_attains_nothing():
    """edf-ac, budget 4: R has 12 prompt tokens (3 full-budget steps) and a 1-step TTFT target
    (a step of the unit model lasts 1 s): refused at arrival; its class attains 0."""
    trace = tiny([req("R", 0.0, 12, 2, ttft_slo=1.0)], profile="edf-ac", max_num_batched_tokens=4, slo_step_s=1.0)
    m = summarize(simulate(trace, UNIT))
    assert m.rejected == 1 and m.slo_classes[PER_REQUEST].attained == 0.0 and m.slo_goodput == 0.0


def test_with_targets_splits_classes_by_share_deterministically():
    trace = tiny([req(f"r{i}", float(i), 4, 2) for i in range(400)])
    classes = [{"class": "interactive", "ttft": 0.5, "tpot": 0.05, "share": 0.25}, {"class": "batch", "ttft": 5.0}]
    out = with_targets(trace, classes, "oracle")
    again = with_targets(trace, classes, "oracle")
    assert out.requests == again.requests
    inter = [r for r in out.requests if r.slo_class == "interactive"]
    assert 60 <= len(inter) <= 140  # 25% of 400 = 100, within sampling noise of the hash
    assert all((r.ttft_slo, r.tpot_slo, r.priority) == (0.5, 0.05, 0) for r in inter)
    batch = [r for r in out.requests if r.slo_class == "batch"]
    assert len(batch) == 400 - len(inter) and all((r.ttft_slo, r.tpot_slo, r.priority) == (5.0, None, 1) for r in batch)
    assert all(r.predicted_output_len == r.max_tokens for r in out.requests)
    assert out.slo_classes == {"interactive": {"ttft": 0.5, "tpot": 0.05}, "batch": {"ttft": 5.0}}


def test_sweep_runs_set_the_step_the_slo_rules_model():
    """A trace with targets gets slo_step_s = the cost model's time for a step of the whole budget."""
    cost = preset("h200-llama-8b-bf16")
    plain = tiny([req("A", 0.0, 4, 2)])
    targeted = with_targets(plain, [{"ttft": 1.0}])
    cfg = run_config(targeted, parse_profile_spec("edf-ac"), cost)
    budget = cfg.max_num_batched_tokens
    assert cfg.slo_step_s == pytest.approx(cost.step_ns(StepShape(budget, 0, budget)) / 1e9)
    assert cfg.slo_step_s == modelled_step_s(cost, cfg)
    assert run_config(plain, parse_profile_spec("edf-ac"), cost).slo_step_s == 0.025  # untouched without targets


def test_sweep_with_targets_prints_attainment_per_class_and_plots(tmp_path, capsys):
    from batchspec import sim_cli
    from batchspec.data import TRACES

    plot, out = tmp_path / "slo.svg", tmp_path / "sweep.json"
    code = sim_cli.main(["sweep", str(TRACES / "burstgpt_1_first400.csv"), "--first", "120", "--profiles", "vllm-v1,edf-ac",
                         "--rates", "1,4", "--jobs", "1", "--all-rates", "--targets", "class=fast,ttft=0.2,share=0.5",
                         "--targets", "class=slow,ttft=5,tpot=0.2", "--slo-plot", str(plot), "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "SLO attainment per class" in stdout and "fast" in stdout and "slow" in stdout
    assert plot.stat().st_size > 0
    import json

    points = json.loads(out.read_text())["points"]
    assert {p["profile"] for p in points} == {"vllm-v1", "edf-ac"}
    assert all(set(p["metrics"]["slo_classes"]) == {"fast", "slow"} for p in points)


def test_bad_targets_exit_2(capsys):
    from batchspec import sim_cli

    for bad in ("ttft=0", "share=0.5", "ttft=1,e2e=3", "tpot=-1", "class=x"):
        assert sim_cli.main(["sweep", "x.csv", "--targets", bad]) == 2, bad
        err = capsys.readouterr().err
        assert "argument --targets" in err and err.count("\n") == 1, err
