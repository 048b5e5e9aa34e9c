"""Trace and log formats: round trips, schemas, and clear errors on bad input."""
import dataclasses
import json
import subprocess
import sys

import pytest

from spec.config import SchedulerConfig, knob_names
from spec.formats import DecisionLog, Trace, TraceRequest
from spec.io import FormatError, load_log, load_trace, schema, write_log, write_trace
from spec.scheduler import run

HEADER = {"format": "batchspec-trace", "version": 1, "config": {"profile": "vllm-v1", "num_blocks": 16, "block_size": 4}}
GOOD = {"id": "a", "arrival_step": 0, "prompt_len": 5, "max_tokens": 3}


def write_lines(path, *objs, raw_tail: str | None = None):
    text = "".join(json.dumps(o) + "\n" for o in objs)
    if raw_tail is not None:
        text += raw_tail
    path.write_text(text)
    return path


def error_of(path) -> FormatError:
    with pytest.raises(FormatError) as e:
        load_trace(path)
    return e.value


def test_trace_round_trip(tmp_path):
    t = Trace(
        config={"profile": "vllm-v1", "num_blocks": 32, "policy": "priority"},
        requests=[
            TraceRequest(id="a", prompt_len=9, max_tokens=4, arrival_step=0, prefix_group="sys", prefix_len=8),
            TraceRequest(id="b", prompt_len=3, prompt=(5, 6, 7), max_tokens=2, arrival_step=1, priority=2,
                         stop_token_ids=(9,), abort_at=4, output_tokens=(11, 2), ignore_eos=True, tenant="t1"),
        ],
        vocab_size=100,
        eos_token_id=2,
        name="rt",
    )
    write_trace(t, tmp_path / "t.jsonl")
    back = load_trace(tmp_path / "t.jsonl")
    assert back.requests == t.requests and back.config == t.config and back.vocab_size == 100


def test_log_round_trip_at_each_level(tmp_path):
    t = load_trace(write_lines(tmp_path / "t.jsonl", HEADER, GOOD, {**GOOD, "id": "b", "prompt_len": 40}))
    records = run(t)
    for level in ("decisions", "memory", "exact"):
        write_log(DecisionLog("spec", level, records), tmp_path / f"{level}.jsonl")
        back = load_log(tmp_path / f"{level}.jsonl")
        assert [r.scheduled for r in back.records] == [r.scheduled for r in records]
        assert (back.records[0].block_ids is not None) == (level == "exact")
        assert (back.records[0].num_free_blocks is not None) == (level != "decisions")


def test_schema_lists_exactly_the_knobs():
    assert set(schema("trace-header")["properties"]["config"]["properties"]) == set(knob_names()) | {"profile"}
    types = {f.name: str(f.type) for f in dataclasses.fields(SchedulerConfig)}
    props = schema("trace-header")["properties"]["config"]["properties"]
    json_type = {"int": "integer", "bool": "boolean", "float": "number", "str": "string"}
    assert all(props[k]["type"] == json_type[types[k]] for k in knob_names())


@pytest.mark.parametrize(
    "bad, line, field, words",
    [
        ({**GOOD, "max_tokens": "3"}, 2, "max_tokens", "not of type 'integer'"),
        ({**GOOD, "prompt_len": -4}, 2, "prompt_len", "less than the minimum"),
        ({**GOOD, "colour": "red"}, 2, "(line)", "unknown field: 'colour'"),
        ({k: v for k, v in GOOD.items() if k != "max_tokens"}, 2, "max_tokens", "missing required field"),
        ({**GOOD, "prompt": [1, 2]}, 2, "prompt", "exactly one of prompt"),
        ({**GOOD, "abort_at": 0, "arrival_step": 3}, 2, "abort_at", "before arrival_step"),
        ({**GOOD, "prompt": [1, 99999], "prompt_len": None}, 2, "prompt", "outside the vocabulary"),
        ({**GOOD, "prompt_len": 2_000_000}, 2, "prompt_len", "exceeds the limit prompt_len"),
    ],
)
def test_bad_request_lines_name_line_and_field(tmp_path, bad, line, field, words):
    bad = {k: v for k, v in bad.items() if v is not None}
    e = error_of(write_lines(tmp_path / "bad.jsonl", HEADER, bad))
    assert (e.line, e.field) == (line, field), str(e)
    assert words in e.problem, str(e)
    assert str(e).startswith(str(tmp_path / "bad.jsonl") + f":{line}: {field}: ")


def test_duplicate_ids(tmp_path):
    e = error_of(write_lines(tmp_path / "d.jsonl", HEADER, GOOD, GOOD))
    assert (e.line, e.field) == (3, "id") and "first on line 2" in e.problem


def test_arrivals_out_of_order(tmp_path):
    e = error_of(write_lines(tmp_path / "o.jsonl", HEADER, {**GOOD, "arrival_step": 5}, {**GOOD, "id": "b"}))
    assert (e.line, e.field) == (3, "arrival_step")


def test_unknown_profile_and_knob(tmp_path):
    e = error_of(write_lines(tmp_path / "p.jsonl", {**HEADER, "config": {"profile": "nope"}}, GOOD))
    assert (e.line, e.field) == (1, "config.profile") and "unknown profile" in e.problem
    e = error_of(write_lines(tmp_path / "k.jsonl", {**HEADER, "config": {"profile": "vllm-v1", "max_num_seq": 4}}, GOOD))
    assert e.line == 1 and "max_num_seq" in str(e)
    e = error_of(write_lines(tmp_path / "v.jsonl", {**HEADER, "config": {"profile": "vllm-v1", "policy": "lifo"}}, GOOD))
    assert (e.line, e.field) == (1, "config.policy")


def test_truncated_last_line(tmp_path):
    e = error_of(write_lines(tmp_path / "t.jsonl", HEADER, GOOD, raw_tail='{"id": "b", "arrival_st'))
    assert (e.line, e.field) == (3, "(line)") and "truncated" in e.problem


def test_not_a_trace(tmp_path):
    e = error_of(write_lines(tmp_path / "x.jsonl", {"hello": 1}))
    assert (e.line, e.field) == (1, "format")
    (tmp_path / "empty.jsonl").write_text("")
    assert "empty file" in error_of(tmp_path / "empty.jsonl").problem


def test_cli_rejects_bad_trace_with_exit_2(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", HEADER, {**GOOD, "max_tokens": -1})
    proc = subprocess.run([sys.executable, "-m", "batchspec.cli", "run", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert f"{path}:2: max_tokens:" in proc.stderr.replace("\n", "")


def test_log_write_is_atomic(tmp_path):
    """A failing write leaves the previous file intact and no temporary behind."""
    target = tmp_path / "log.jsonl"
    target.write_text("previous\n")

    class Boom:
        level = "exact"

        def to_json(self, level):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_log(DecisionLog("spec", "exact", [Boom()]), target)  # type: ignore[list-item]
    assert target.read_text() == "previous\n"
    assert [p.name for p in tmp_path.iterdir()] == ["log.jsonl"]


def test_compiled_schema_checker_agrees_with_jsonschema(tmp_path):
    """spec.schemacheck (the fast path) accepts and refuses exactly what jsonschema does, on valid
    lines and on every single-field corruption of them (the schemas stay the single source of truth)."""
    from spec.io import _fast_check, _validator
    from spec.schemacheck import SchemaError

    trace = load_trace(write_lines(tmp_path / "t.jsonl", HEADER, GOOD, {**GOOD, "id": "b", "prompt_len": 40, "priority": 1,
                                                                          "prefix_group": "g", "prefix_len": 4, "tenant": "t"}))
    records = run(trace)
    samples = {
        "trace-header": [HEADER, {**HEADER, "vocab_size": 100, "eos_token_id": 2, "name": "n"}],
        "trace-request": [r.to_json() for r in trace.requests] + [{**GOOD, "prompt": [5, 6]}],
        "log-header": [DecisionLog("spec", "exact", records, trace="t.jsonl", config=HEADER["config"]).header_json()],
        "log-record": [r.to_json("exact") for r in records],
    }
    weird = [None, True, 0, -1, 1.5, 10.0, "", "x", "a\u0001", "y" * 300, [], [1], [["a", 1]], [["a", "eos"]], {}, {"a": 1},
             {"a\u0002": 1}, {"a": [1, -1]}, [{"rule": "R", "text": "t"}], [{"rule": "R"}]]
    checked = 0
    for name, objs in samples.items():
        fast, slow = _fast_check(name), _validator(name)
        for obj in objs:
            variants = [obj, {**obj, "unknown_field": 1}] + [{k: v for k, v in obj.items() if k != key} for key in obj]
            variants += [{**obj, key: value} for key in obj for value in weird]
            if name == "trace-header":
                variants += [{**obj, "config": {**obj["config"], knob: value}} for knob in knob_names() for value in weird[:8]]
            for variant in variants:
                try:
                    fast(variant, ())
                    fast_ok = True
                except SchemaError:
                    fast_ok = False
                slow_ok = not any(True for _ in slow.iter_errors(variant))
                assert fast_ok == slow_ok, (name, variant)
                checked += 1
    assert checked > 2000
