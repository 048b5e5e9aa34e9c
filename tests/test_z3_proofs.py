"""The Z3 proofs (``invariants.proofs``, ``invariants.bmc``).

* every shipped proof gives its expected result at the CI bound;
* the hand-written models agree with the code they model (concrete cross-checks);
* every kind of proof can fail: a deliberately broken model (a test-only
  mutant, built here from the real code by replacing one fragment) yields a
  counterexample;
* bounded model checking writes a trace that ``batchspec run`` replays and that
  shows the problem.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

z3 = pytest.importorskip("z3")

import gpu_engine.formulas as F  # noqa: E402
from invariants import bmc  # noqa: E402
from invariants.proofs import (  # noqa: E402
    COUNTEREXAMPLE, PROVED, all_ok, proof_names, run_proofs,
)
from invariants.proofs import budget as B  # noqa: E402
from invariants.proofs import lifted  # noqa: E402
from invariants.proofs import memory as M  # noqa: E402
from invariants.proofs import stepmodel as SM  # noqa: E402
from invariants.proofs import translation as T  # noqa: E402
from invariants.proofs.symex import Explorer, Sym, mutate, term, wrap  # noqa: E402

CORPUS = Path(__file__).parent / "corpus"

#: Proofs that currently find a real bug in the shipped code (strict xfail: the
#: test fails once the bug is fixed, so that the mark gets removed).
KNOWN_BUGS: dict[str, str] = {}


# --------------------------------------------------------------------------
# the shipped table
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    traces = tmp_path_factory.mktemp("bmc")
    rows = run_proofs("ci", trace_dir=str(traces), jobs=min(2, os.cpu_count() or 1))
    return {r.name: r for r in rows}, traces


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[n])) if n in KNOWN_BUGS else n
    for n in proof_names("ci")])
def test_shipped_proof_gives_its_expected_result_at_the_ci_bound(table, name):
    rows, _ = table
    row = rows[name]
    assert row.ok, f"{name}: {row.result} (expected {row.expected})\n{row.counterexample}"


def test_table_renders_every_row_with_result_and_time(table):
    from rich.console import Console

    from batchspec.render import proof_table as render_table

    rows, _ = table
    console = Console(width=240, record=True)
    console.print(render_table(list(rows.values())))
    text = console.export_text()
    for name in rows:
        assert name in text
    assert "proved" in text and "vllm-v1" in text and "s " in text


def test_bmc_rows_write_their_witness_traces(table):
    rows, traces = table
    assert rows["bmc.livelock.no_reject"].details["path"] == str(traces / "bmc_livelock.jsonl")
    assert (traces / "bmc_livelock.jsonl").exists()
    assert (traces / "bmc_starvation_priority.jsonl").exists()
    assert rows["bmc.passing.fcfs"].result == PROVED  # FCFS: no witness exists within the bound


def test_every_shipped_row_is_proved_and_witness_rows_carry_their_trace(table):
    rows, traces = table
    assert all(r.result == PROVED for r in rows.values())  # what `batchspec prove` exits 0 on
    for name in ("bmc.livelock.no_reject", "bmc.passing.priority"):
        row = rows[name]
        assert row.details["exists"] and "written to " + row.details["path"] in row.counterexample


def test_coverage_names_real_invariants_and_real_proofs():
    from invariants.catalogue import LOG_ONLY, catalogue
    from invariants.z3_proofs import COVERAGE
    from spec.invariants import INVARIANTS

    names = set(proof_names("ci"))
    assert set(proof_names("long")) == names
    for inv, proofs in COVERAGE.items():
        assert inv in INVARIANTS or inv in LOG_ONLY, inv
        assert proofs and set(proofs) <= names, (inv, set(proofs) - names)
    assert {e.id for e in catalogue() if "z3" in e.checked_by} == set(COVERAGE)


def test_cli_prove_prints_the_table_and_writes_a_replayable_trace(tmp_path, capsys):
    from batchspec.cli import main

    rc = main(["prove", "--only", "mem.free", "--only", "bmc.livelock", "--trace-dir", str(tmp_path), "--jobs", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for word in ("property", "profile", "bound", "result", "time", "mem.free", "bmc.livelock.no_reject",
                 "proved (witness)", "vllm-v1", str(tmp_path / "bmc_livelock.jsonl")):
        assert word in out, word
    assert main(["run", str(tmp_path / "bmc_livelock.jsonl"), "--quiet"]) == 1  # the stall is flagged
    assert main(["prove", "--only", "no.such.proof"]) == 2


def test_cli_prove_exits_1_unless_every_row_is_proved(monkeypatch, capsys):
    import invariants.z3_proofs as Z
    from batchspec.cli import main
    from invariants.proofs import ProofRow

    bad = ProofRow("mem.free", "MEM.REFCOUNT", "vllm-v1", "N≤1", COUNTEREXAMPLE, 0.1, "violates MEM.REFCOUNT", "memory")
    monkeypatch.setattr(Z, "run_proofs", lambda **kw: [bad])
    assert main(["prove"]) == 1
    assert "counterexample" in capsys.readouterr().out


def test_run_proofs_selects_by_prefix():
    rows = run_proofs("ci", only=["mem.free", "tv.chunking"])
    assert [r.name for r in rows] == ["mem.free", "tv.chunking"]
    assert all_ok(rows)
    with pytest.raises(KeyError):
        run_proofs("ci", only=["no.such.proof"])


# --------------------------------------------------------------------------
# the models are the code: concrete cross-checks
# --------------------------------------------------------------------------


def test_block_pool_model_agrees_with_spec_kv():
    assert M.cross_check(600, seed=1) >= 600


def test_block_pool_cross_check_catches_a_model_that_differs_from_the_code():
    wrong = mutate(M.free, "s.free[b] = OR(p.free[b], AND(p.mem[r][b], EQ(s.ref[b], 0)))", "s.free[b] = p.free[b]")
    with pytest.raises(AssertionError, match="disagree"):
        M.cross_check(300, model={"free": wrong})


def test_step_model_agrees_with_spec_engine():
    assert SM.cross_check(30, seed=11) > 200


def test_step_model_cross_check_catches_a_model_that_differs_from_the_code(monkeypatch):
    wrong = mutate(SM.schedule_waiting, "LE(cfg.max_num_seqs, nrun)", "LT(cfg.max_num_seqs, nrun)")
    monkeypatch.setattr(SM, "schedule_waiting", wrong)  # the cross-check drives the module's own step()
    with pytest.raises(AssertionError, match="disagree"):
        SM.cross_check(60, seed=2)


def test_xp_stand_in_and_formulas_on_z3_terms_equal_numpy_and_torch():
    assert T.cross_check_xp(60) == 120
    assert T.cross_check_formulas(60) == 120


def test_lifted_rule_equals_the_spec_function_through_its_z3_term():
    import random

    from spec.scheduler import chunk_size as real

    t = lifted.chunk_size()
    rng = random.Random(0)
    for _ in range(300):
        args = [rng.randint(0, 12) for _ in t.params]
        got = wrap(z3.simplify(z3.substitute(t.outputs[0], *[(p, z3.IntVal(a)) for p, a in zip(t.params, args)])), True)
        assert got == real(*args)


def test_lifted_allocate_slots_equals_the_spec_method_through_its_z3_term():
    import random

    rng = random.Random(1)
    t = lifted.allocate_slots(2, 2, True)
    for _ in range(300):
        comp, tok = 0, rng.randint(1, 20)
        nhit = rng.randint(0, min(2, (tok - 1) // 2))
        args = [comp, tok, rng.randint(1, tok - 2 * nhit), 0, nhit, 2 * nhit, rng.randint(0, 12), rng.randint(0, 2),
                rng.randint(2, 30), rng.randint(0, 1), rng.randint(0, 1)]
        want = lifted._run_allocate(2, True, *args[:9], *args[9:])
        got = tuple(wrap(z3.simplify(z3.substitute(o, *[(p, z3.IntVal(a)) for p, a in zip(t.params, args)])), True)
                    for o in t.outputs)
        assert got == want


def test_explorer_enumerates_the_paths_of_spec_code():
    import spec.scheduler as S
    from invariants.proofs.symex import rebind_module

    chunk = rebind_module(S)["chunk_size"]
    r, c, b = Sym("r"), Sym("c"), Sym("b")
    paths = Explorer([term(r > 0), term(c >= 0), term(b > 0)]).run(lambda: chunk(r, c, b))
    assert len(paths) == 3  # cap applies / cap >= remaining / no cap


# --------------------------------------------------------------------------
# every kind of proof can fail: mutants
# --------------------------------------------------------------------------

MEMORY_MUTANTS = {
    # VLLM-08/TRT-04: a free that returns blocks without dropping the reference
    "free forgets the ref decrement": (
        M.prove_free, mutate(M.free, "ite(p.mem[r][b], p.ref[b] - 1, p.ref[b])", "p.ref[b]")),
    # VLLM-08: shared blocks returned to the free queue while another request holds them
    "free returns shared blocks (double free)": (
        M.prove_free, mutate(M.free, "AND(p.mem[r][b], EQ(s.ref[b], 0))", "p.mem[r][b]")),
    "allocate leaves popped blocks in the free queue": (
        M.prove_allocate, mutate(M.allocate, "s.free[b] = AND(p.free[b], NOT(popped[b]))", "s.free[b] = p.free[b]")),
    # MSGL-01: a hit block stays evictable while in use
    "touch does not take the hit out of the free queue": (
        M.prove_touch, mutate(M.touch, "s.free[b] = AND(p.free[b], NOT(evictable))", "s.free[b] = p.free[b]")),
    # VLLM-19: an evicted block stays in the cache map (stale hit on recycled memory)
    "evict keeps the cache-map entry": (
        M.prove_evict, mutate(M.allocate, "s.inmap[b] = AND(p.inmap[b], NOT(popped[b]))", "s.inmap[b] = p.inmap[b]")),
    # LMD-02: the victim keeps its computed tokens
    "preempt keeps num_computed_tokens": (
        M.prove_preempt, mutate(M.preempt, "s.computed[r] = 0", "pass")),
}


@pytest.mark.parametrize("what", list(MEMORY_MUTANTS))
def test_memory_proof_fails_on_a_broken_pool(what):
    prove, action = MEMORY_MUTANTS[what]
    row = prove(n=6, R=3, action=action, cross=0)
    assert row.result == COUNTEREXAMPLE, what
    assert "violates" in row.counterexample and "before:" in row.counterexample


def _lift(name, fn, n):
    return lifted.lift(name, fn, ["int"] * n)


def test_budget_proof_fails_when_the_budget_rule_is_off_by_one():
    # BUDGET.TOKENS: ``min(n, budget + 1)`` instead of ``min(n, budget)``
    broken = _lift("chunk_size_plus_one", lambda rem, cap, budget: min(cap if 0 < cap < rem else rem, budget + 1), 3)
    row = B.prove_budget(3, "fcfs", rules={"chunk_size": broken})
    assert row.result == COUNTEREXAMPLE
    assert "BUDGET.TOKENS_LE_BUDGET" in row.counterexample


def test_max_num_seqs_proof_fails_when_the_admission_check_is_off_by_one():
    broken = mutate(SM.schedule_waiting, "LE(cfg.max_num_seqs, nrun)", "LT(cfg.max_num_seqs, nrun)")
    row = B.prove_max_num_seqs(3, "fcfs", impl={"schedule_waiting": broken})
    assert row.result == COUNTEREXAMPLE
    assert "SEQ.MAX_NUM_SEQS" in row.counterexample


def test_preempted_not_scheduled_fails_when_a_victim_keeps_its_grant():
    # VLLM-01: under "priority" a victim scheduled earlier in the step is not un-scheduled
    broken = mutate(SM.schedule_running, "d.sched[j] = ite(v, 0, d.sched[j])", "pass")
    row = B.prove_preempted_not_scheduled(3, "priority", impl={"schedule_running": broken})
    assert row.result == COUNTEREXAMPLE
    assert "PREEMPT.NOT_SCHEDULED" in row.counterexample


def test_liveness_proof_fails_when_never_fits_forgets_the_outputs():
    # TGI-01 / VLLM-05: the rejection rule checks the prompt only, not the peak footprint
    weak = _lift("never_fits_prompt_only", lambda p, m, L, U: -(-min(p, L - 1) // 2) > U, 4)
    row = B.prove_no_idle_stall(3, "fcfs", rules={"never_fits": weak})
    assert row.result == COUNTEREXAMPLE
    assert "nothing admitted" in row.counterexample


FORMULA_MUTANTS = {
    "grant_tokens with an inclusive prefix sum": (
        lambda f: T.prove_chunking(3, formulas=f), "grant_tokens",
        mutate(F.grant_tokens, "xp.exclusive_cumsum(c)", "c.cumsum(0)")),
    "first_overflow with an exclusive prefix sum": (
        lambda f: T.prove_allocation(3, formulas=f), "first_overflow",
        mutate(F.first_overflow, "need.cumsum(0) > free", "xp.exclusive_cumsum(need) > free")),
    "victims_needed stops one victim late": (
        lambda f: T.prove_preemption(3, "fcfs", formulas=f), "victims_needed",
        mutate(F.victims_needed, "freed_in_order.cumsum(0) >= need", "freed_in_order.cumsum(0) > need")),
    # the engine's first version: a victim frees every block it holds, shared prefix blocks included
    "freed_by_position frees a shared block with its first holder": (
        lambda f: T.prove_preemption(3, "fcfs", shared=True, formulas=f), "freed_by_position",
        mutate(F.freed_by_position, "position[position == last_position]", "position[position <= last_position]")),
    "admission applies the watermark to an empty engine": (
        lambda f: T.prove_admission(2, formulas=f), "admission",
        mutate(F.admission, "xp.where(position + num_running > 0, watermark, 0)", "c * 0 + watermark")),
    "stop_codes caps one token late": (
        lambda f: T.prove_stop_codes(2, formulas=f), "stop_codes",
        mutate(F.stop_codes, "num_tokens >= max_model_len", "num_tokens > max_model_len")),
}


@pytest.mark.parametrize("what", list(FORMULA_MUTANTS))
def test_translation_validation_fails_on_a_broken_formula(what):
    prove, name, broken = FORMULA_MUTANTS[what]
    row = prove({name: broken})
    assert row.result == COUNTEREXAMPLE, what
    assert "differs on" in row.counterexample


def test_bmc_finds_a_witness_when_fcfs_admission_skips_the_head():
    # VLLM-04-like: admission that skips a head that does not fit lets a later arrival pass
    skipping = mutate(SM.schedule_waiting,
                      "considered[j] = OR(considered[j], mine)", "considered[j] = OR(considered[j], AND(head[j], c1))",
                      "stop = OR(stop, AND(c1, NOT(admit)))", "stop = OR(stop, AND(c1, refuse))")
    # two sequences: the head waits for memory held by a running request while a
    # smaller later arrival fits (with max_num_seqs=1 the seq cap, not memory,
    # stops admission whenever something runs, so no head can be skipped)
    kw = dict(max_steps=5, passes=1, max_requests=3, policy="fcfs", max_num_seqs=2)
    res = bmc.find_passing(**kw, impl={"schedule_waiting": skipping})
    assert res.found and res.steps == 2
    row = bmc.as_row(res, "QUEUE.FCFS_SORTED")  # the shipped bmc.passing.fcfs row's claim, on the mutant
    assert row.result == COUNTEREXAMPLE and "shortest witness: 2 steps" in row.counterexample
    # (the shipped admission, same configuration, ≥ these bounds: the bmc.passing.fcfs row, proved)


def test_bmc_finds_a_livelock_when_never_fits_is_weakened():
    weak = _lift("never_fits_prompt_only_bmc", lambda p, m, L, U: -(-min(p, L - 1) // 2) > U, 4)
    res = bmc.find_livelock(max_steps=6, rules={"never_fits": weak})  # reject_unservable on
    assert res.found and res.steps == 3


# --------------------------------------------------------------------------
# BMC traces replay and show the problem
# --------------------------------------------------------------------------


def test_bmc_livelock_trace_replays_and_shows_the_stall(tmp_path):
    from batchspec.cli import main
    from spec.io import load_trace

    res = bmc.find_livelock(max_steps=8, out=tmp_path / "bmc_livelock.jsonl", reject_unservable=False)
    assert res.found and res.steps == 3  # admit, grow past the pool and preempt itself, then stall
    trace = load_trace(res.path)
    assert trace.config["reject_unservable"] is False and trace.description
    seen = bmc.replay_livelock(trace)
    assert seen["checked"] == "LIVE.NO_IDLE_STALL"
    assert seen["unchecked"] == "StepLimitError"
    assert seen["rejecting"] and all(why == "never_fits" for _, why in seen["rejecting"])
    assert main(["run", res.path, "--quiet"]) == 1  # `batchspec run` flags it


def test_bmc_starvation_trace_replays_and_shows_the_passing(table):
    from batchspec.cli import main
    from spec.io import load_trace

    rows, traces = table  # the trace the shipped bmc.passing.priority row wrote
    path = rows["bmc.passing.priority"].details["path"]
    assert path == str(traces / "bmc_starvation_priority.jsonl")
    seen = bmc.replay_starvation(load_trace(path))
    assert len(seen["passed_over_by"]) >= 3
    assert seen["admitted_at"] is not None and seen["admitted_at"] > seen["arrival"]
    assert main(["run", path, "--quiet"]) == 0  # no invariant broken: priority starves by design


@pytest.mark.parametrize("name", ["bmc_livelock", "bmc_starvation_priority"])
def test_corpus_keeps_the_bmc_witnesses(name):
    from spec.io import load_trace

    trace = load_trace(CORPUS / f"{name}.jsonl")
    assert "bounded model checking" in trace.description
    if name == "bmc_livelock":
        assert bmc.replay_livelock(trace)["checked"] == "LIVE.NO_IDLE_STALL"
    else:
        assert len(bmc.replay_starvation(trace)["passed_over_by"]) >= 3
