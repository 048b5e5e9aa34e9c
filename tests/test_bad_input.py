"""The bad-input battery (issue 14): every command refuses malformed files and option values cleanly.

Each case builds one malformed input in a fresh directory and runs the command
in-process through ``batchspec.cli.main``.  It must exit 2 with exactly one
line on stderr that names the file, line and field (``FILE:LINE: FIELD:``) or
the option, and the problem; print no traceback; leave every file in the
directory as it was (nothing written, no input overwritten); and finish within
10 seconds.  A few cases run as real subprocesses to check the exit status and
the absence of tracebacks end to end.

``python -m pytest tests/test_bad_input.py --collect-only -q`` lists the cases;
the ids start with the command they exercise.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from batchspec.cli import main

#: Every case must be refused within this many seconds (the issue's bound).
SECONDS = 10.0

HEADER = {"format": "batchspec-trace", "version": 1, "config": {"profile": "vllm-v1", "num_blocks": 16, "block_size": 4}}
REQ = {"id": "a", "arrival_step": 0, "prompt_len": 5, "max_tokens": 3}
REQ_B = {"id": "b", "arrival_step": 1, "prompt_len": 7, "max_tokens": 2}


def j(obj) -> str:
    return json.dumps(obj)


def lines(*items) -> str:
    return "".join((i if isinstance(i, str) else j(i)) + "\n" for i in items)


@dataclass
class Case:
    """One malformed input: ``make(dir)`` writes what it needs and returns the argv."""

    id: str
    make: Callable[[Path], list]
    expect: tuple[str, ...]  # substrings of the error line; "{dir}" is replaced by the case's directory
    where: str | None = "file"  # "file": the line must read FILE:LINE: ...; "option": it names an option
    marks: tuple = field(default_factory=tuple)


CASES: list[Case] = []


def case(id: str, make, *expect: str, where: str | None = "file", marks=()) -> None:
    CASES.append(Case(id, make, expect, where, tuple(marks)))


# --------------------------------------------------------------------------
# File builders.
# --------------------------------------------------------------------------


def text_file(name: str, content: str | bytes):
    def build(d: Path) -> Path:
        p = d / name
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content, encoding="utf-8", errors="surrogatepass")
        return p

    return build


def directory(name: str):
    def build(d: Path) -> Path:
        (d / name).mkdir()
        return d / name

    return build


def fifo(name: str):
    def build(d: Path) -> Path:
        os.mkfifo(d / name)
        return d / name

    return build


def missing(name: str):
    return lambda d: d / name


def sparse(name: str, size: int):
    """A file of ``size`` bytes that takes no disk space (refused by its size, never read)."""

    def build(d: Path) -> Path:
        with open(d / name, "wb") as f:
            f.truncate(size)
        return d / name

    return build


def unreadable(name: str, content: str):
    def build(d: Path) -> Path:
        p = d / name
        p.write_text(content)
        p.chmod(0)
        return p

    return build


ROOT = pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads a file whatever its mode")

# --------------------------------------------------------------------------
# Traces: every class of malformation, through `run`.
# --------------------------------------------------------------------------

#: (id, file builder, expected words). The builder writes a trace named t.jsonl (or another input).
TRACE_FILES = [
    ("empty", text_file("t.jsonl", ""), ("t.jsonl:1: (file)", "empty")),
    ("blank-lines-only", text_file("t.jsonl", "\n\n  \n"), ("t.jsonl:1: (file)", "empty")),
    ("binary", text_file("t.jsonl", bytes(range(256)) * 4), ("t.jsonl:1: (line)",)),
    ("not-utf8", text_file("t.jsonl", b'{"format": "batchspec-trace", "name": "\xff\xfe"}\n'), ("t.jsonl:1: (line)", "UTF-8")),
    ("truncated-request", text_file("t.jsonl", lines(HEADER) + '{"id": "a", "arrival_st'), ("t.jsonl:2: (line)", "truncated")),
    ("truncated-header", text_file("t.jsonl", '{"format": "batchspec-trace", "vers'), ("t.jsonl:1: (line)", "truncated")),
    ("not-json", text_file("t.jsonl", "id,prompt_len\na,5\n"), ("t.jsonl:1: (line)", "invalid JSON")),
    ("wrong-format-tag", text_file("t.jsonl", lines({**HEADER, "format": "batchspec-log"}, REQ)), ("t.jsonl:1: format", "batchspec-trace")),
    ("no-format-tag", text_file("t.jsonl", lines({k: v for k, v in HEADER.items() if k != "format"}, REQ)), ("t.jsonl:1: format",)),
    ("version-2", text_file("t.jsonl", lines({**HEADER, "version": 2}, REQ)), ("t.jsonl:1: version", "unsupported version 2")),
    ("version-string", text_file("t.jsonl", lines({**HEADER, "version": "1"}, REQ)), ("t.jsonl:1: version",)),
    ("version-float", text_file("t.jsonl", lines({**HEADER, "version": 1.0}, REQ)), ("t.jsonl:1: version",)),
    ("header-is-a-list", text_file("t.jsonl", lines([HEADER], REQ)), ("t.jsonl:1: (line)", "header object")),
    ("header-null", text_file("t.jsonl", lines("null", REQ)), ("t.jsonl:1: (line)",)),
    ("header-missing-config", text_file("t.jsonl", lines({"format": "batchspec-trace", "version": 1}, REQ)),
     ("t.jsonl:1: config", "missing")),
    ("header-unknown-field", text_file("t.jsonl", lines({**HEADER, "colour": "red"}, REQ)), ("t.jsonl:1:", "unknown field", "colour")),
    ("header-duplicate-key", text_file("t.jsonl", '{"format": "batchspec-trace", "version": 1, "version": 1, "config": {}}\n'),
     ("t.jsonl:1: version", "duplicate key")),
    ("config-unknown-knob", text_file("t.jsonl", lines({**HEADER, "config": {"profile": "vllm-v1", "num_blokcs": 4}}, REQ)),
     ("t.jsonl:1: config", "num_blokcs")),
    ("config-unknown-profile", text_file("t.jsonl", lines({**HEADER, "config": {"profile": "nonesuch"}}, REQ)),
     ("t.jsonl:1: config.profile", "unknown profile")),
    ("config-num-blocks-zero", text_file("t.jsonl", lines({**HEADER, "config": {"profile": "vllm-v1", "num_blocks": 0}}, REQ)),
     ("t.jsonl:1: config.num_blocks",)),
    ("config-num-blocks-float", text_file("t.jsonl", lines({**HEADER, "config": {"profile": "vllm-v1", "num_blocks": 16.0}}, REQ)),
     ("t.jsonl:1: config.num_blocks", "integer")),
    ("config-num-blocks-bool", text_file("t.jsonl", lines({**HEADER, "config": {"profile": "vllm-v1", "num_blocks": True}}, REQ)),
     ("t.jsonl:1: config.num_blocks", "integer")),
    ("config-num-blocks-huge", text_file("t.jsonl", lines({**HEADER, "config": {"profile": "vllm-v1", "num_blocks": 10**9}}, REQ)),
     ("t.jsonl:1: config.num_blocks", "limit num_blocks")),
    ("config-block-size-zero", text_file("t.jsonl", lines({**HEADER, "config": {"profile": "vllm-v1", "block_size": 0}}, REQ)),
     ("t.jsonl:1: config.block_size",)),
    ("config-max-num-seqs-negative", text_file("t.jsonl", lines({**HEADER, "config": {"profile": "vllm-v1", "max_num_seqs": -1}}, REQ)),
     ("t.jsonl:1: config.max_num_seqs",)),
    ("config-watermark-nan", text_file("t.jsonl", lines(j(HEADER).replace('"block_size": 4', '"block_size": 4, "watermark": NaN'), REQ)),
     ("t.jsonl:1: config.watermark", "NaN")),
    ("config-watermark-one", text_file("t.jsonl", lines({**HEADER, "config": {"profile": "vllm-v1", "watermark": 1.0}}, REQ)),
     ("t.jsonl:1: config.watermark",)),
    ("config-policy-bogus", text_file("t.jsonl", lines({**HEADER, "config": {"profile": "vllm-v1", "policy": "lifo"}}, REQ)),
     ("t.jsonl:1: config.policy",)),
    ("config-max-steps-huge", text_file("t.jsonl", lines({**HEADER, "config": {"profile": "vllm-v1", "max_steps": 10**12}}, REQ)),
     ("t.jsonl:1: config.max_steps", "limit")),
    ("config-deep", text_file("t.jsonl", lines('{"format": "batchspec-trace", "version": 1, "config": ' + "[" * 5000 + "]" * 5000 + "}", REQ)),
     ("t.jsonl:1: (line)", "json_depth")),
    ("vocab-size-huge", text_file("t.jsonl", lines({**HEADER, "vocab_size": 10**12}, REQ)), ("t.jsonl:1: vocab_size", "limit vocab_size")),
    ("vocab-size-float", text_file("t.jsonl", lines({**HEADER, "vocab_size": 1000.0}, REQ)), ("t.jsonl:1: vocab_size", "integer")),
    ("eos-outside-vocab", text_file("t.jsonl", lines({**HEADER, "vocab_size": 100, "eos_token_id": 100}, REQ)),
     ("t.jsonl:1: eos_token_id", "vocabulary")),
    ("request-missing-max-tokens", text_file("t.jsonl", lines(HEADER, {k: v for k, v in REQ.items() if k != "max_tokens"})),
     ("t.jsonl:2: max_tokens", "missing")),
    ("request-missing-id", text_file("t.jsonl", lines(HEADER, {k: v for k, v in REQ.items() if k != "id"})), ("t.jsonl:2: id", "missing")),
    ("request-no-arrival", text_file("t.jsonl", lines(HEADER, {k: v for k, v in REQ.items() if k != "arrival_step"})),
     ("t.jsonl:2: arrival_step",)),
    ("request-unknown-field", text_file("t.jsonl", lines(HEADER, {**REQ, "colour": "red"})), ("t.jsonl:2:", "unknown field", "colour")),
    ("request-prompt-and-len", text_file("t.jsonl", lines(HEADER, {**REQ, "prompt": [5, 6]})), ("t.jsonl:2: prompt", "exactly one")),
    ("prompt-len-float", text_file("t.jsonl", lines(HEADER, {**REQ, "prompt_len": 10.0})), ("t.jsonl:2: prompt_len", "integer")),
    ("prompt-len-bool", text_file("t.jsonl", lines(HEADER, {**REQ, "prompt_len": True})), ("t.jsonl:2: prompt_len", "integer")),
    ("prompt-len-string", text_file("t.jsonl", lines(HEADER, {**REQ, "prompt_len": "5"})), ("t.jsonl:2: prompt_len",)),
    ("prompt-len-null", text_file("t.jsonl", lines(HEADER, {**REQ, "prompt_len": None})), ("t.jsonl:2: prompt_len",)),
    ("prompt-len-zero", text_file("t.jsonl", lines(HEADER, {**REQ, "prompt_len": 0})), ("t.jsonl:2: prompt_len", "minimum")),
    ("prompt-len-negative", text_file("t.jsonl", lines(HEADER, {**REQ, "prompt_len": -5})), ("t.jsonl:2: prompt_len", "minimum")),
    ("prompt-len-nan", text_file("t.jsonl", lines(HEADER, j(REQ).replace('"prompt_len": 5', '"prompt_len": NaN'))),
     ("t.jsonl:2: prompt_len", "NaN")),
    ("prompt-len-infinity", text_file("t.jsonl", lines(HEADER, j(REQ).replace('"prompt_len": 5', '"prompt_len": Infinity'))),
     ("t.jsonl:2: prompt_len", "Infinity")),
    ("prompt-len-1e999", text_file("t.jsonl", lines(HEADER, j(REQ).replace('"prompt_len": 5', '"prompt_len": 1e999'))),
     ("t.jsonl:2: prompt_len", "finite")),
    ("prompt-len-10e30", text_file("t.jsonl", lines(HEADER, {**REQ, "prompt_len": 10**30})), ("t.jsonl:2: prompt_len", "int_abs")),
    ("prompt-len-5000-digits", text_file("t.jsonl", lines(HEADER, j(REQ).replace('"prompt_len": 5', '"prompt_len": ' + "9" * 5000))),
     ("t.jsonl:2: prompt_len", "int_abs")),
    ("prompt-len-over-limit", text_file("t.jsonl", lines(HEADER, {**REQ, "prompt_len": 2_000_000})), ("t.jsonl:2: prompt_len", "limit prompt_len")),
    ("max-tokens-zero", text_file("t.jsonl", lines(HEADER, {**REQ, "max_tokens": 0})), ("t.jsonl:2: max_tokens", "minimum")),
    ("max-tokens-float", text_file("t.jsonl", lines(HEADER, {**REQ, "max_tokens": 3.5})), ("t.jsonl:2: max_tokens", "integer")),
    ("max-tokens-over-limit", text_file("t.jsonl", lines(HEADER, {**REQ, "max_tokens": 2**40})), ("t.jsonl:2: max_tokens", "limit max_tokens")),
    ("arrival-step-float", text_file("t.jsonl", lines(HEADER, {**REQ, "arrival_step": 1.5})), ("t.jsonl:2: arrival_step", "integer")),
    ("arrival-step-negative", text_file("t.jsonl", lines(HEADER, {**REQ, "arrival_step": -1})), ("t.jsonl:2: arrival_step", "minimum")),
    ("arrival-step-huge", text_file("t.jsonl", lines(HEADER, {**REQ, "arrival_step": 10**12})), ("t.jsonl:2: arrival_step", "limit steps")),
    ("arrival-time-negative", text_file("t.jsonl", lines(HEADER, {**REQ, "arrival_time": -0.5})), ("t.jsonl:2: arrival_time", "minimum")),
    ("arrival-time-huge", text_file("t.jsonl", lines(HEADER, {**REQ, "arrival_time": 1e300})), ("t.jsonl:2: arrival_time", "limit arrival_time")),
    ("arrival-time-minus-infinity", text_file("t.jsonl", lines(HEADER, j({**REQ, "arrival_time": 0}).replace('"arrival_time": 0', '"arrival_time": -Infinity'))),
     ("t.jsonl:2: arrival_time", "Infinity")),
    ("arrival-out-of-order", text_file("t.jsonl", lines(HEADER, {**REQ, "arrival_step": 5}, {**REQ_B, "arrival_step": 1})),
     ("t.jsonl:3: arrival_step", "arrival order")),
    ("abort-before-arrival", text_file("t.jsonl", lines(HEADER, {**REQ, "arrival_step": 3, "abort_at": 1})), ("t.jsonl:2: abort_at", "before")),
    ("abort-at-huge", text_file("t.jsonl", lines(HEADER, {**REQ, "abort_at": 10**13})), ("t.jsonl:2: abort_at", "limit steps")),
    ("priority-huge", text_file("t.jsonl", lines(HEADER, {**REQ, "priority": 2**40})), ("t.jsonl:2: priority", "limit")),
    ("priority-float", text_file("t.jsonl", lines(HEADER, {**REQ, "priority": 0.5})), ("t.jsonl:2: priority", "integer")),
    ("ignore-eos-int", text_file("t.jsonl", lines(HEADER, {**REQ, "ignore_eos": 1})), ("t.jsonl:2: ignore_eos", "boolean")),
    ("id-control-char", text_file("t.jsonl", lines(HEADER, {**REQ, "id": "a\u0001b"})), ("t.jsonl:2: id", "control")),
    ("id-newline", text_file("t.jsonl", lines(HEADER, {**REQ, "id": "a\nb"})), ("t.jsonl:2: id", "control")),
    ("id-escape-sequence", text_file("t.jsonl", lines(HEADER, {**REQ, "id": "\u001b[31mred"})), ("t.jsonl:2: id", "control")),
    ("id-lone-surrogate", text_file("t.jsonl", lines(HEADER, '{"id": "\\ud800", "arrival_step": 0, "prompt_len": 5, "max_tokens": 3}')),
     ("t.jsonl:2: id",)),
    ("id-empty", text_file("t.jsonl", lines(HEADER, {**REQ, "id": ""})), ("t.jsonl:2: id",)),
    ("id-number", text_file("t.jsonl", lines(HEADER, {**REQ, "id": 7})), ("t.jsonl:2: id", "string")),
    ("id-too-long", text_file("t.jsonl", lines(HEADER, {**REQ, "id": "x" * 300})), ("t.jsonl:2: id", "256")),
    ("tenant-control-char", text_file("t.jsonl", lines(HEADER, {**REQ, "tenant": "t\u0000"})), ("t.jsonl:2: tenant", "control")),
    ("duplicate-ids", text_file("t.jsonl", lines(HEADER, REQ, {**REQ_B, "id": "a"})), ("t.jsonl:3: id", "duplicate id 'a'", "line 2")),
    ("duplicate-json-key", text_file("t.jsonl", lines(HEADER, '{"id": "a", "id": "b", "arrival_step": 0, "prompt_len": 5, "max_tokens": 3}')),
     ("t.jsonl:2: id", "duplicate key")),
    ("request-deep-nesting", text_file("t.jsonl", lines(HEADER, "[" * 100_000 + "]" * 100_000)), ("t.jsonl:2: (line)", "json_depth")),
    ("request-deep-nesting-unclosed", text_file("t.jsonl", lines(HEADER, '{"id": ' + "{" * 50_000)), ("t.jsonl:2: (line)", "json_depth")),
    ("request-is-a-list", text_file("t.jsonl", lines(HEADER, [REQ])), ("t.jsonl:2: (line)", "object")),
    ("request-is-a-number", text_file("t.jsonl", lines(HEADER, "42")), ("t.jsonl:2: (line)", "object")),
    ("prefix-len-over-prompt", text_file("t.jsonl", lines(HEADER, {**REQ, "prefix_group": "g", "prefix_len": 9})), ("t.jsonl:2: prefix_len",)),
    ("prefix-group-alone", text_file("t.jsonl", lines(HEADER, {**REQ, "prefix_group": "g"})), ("t.jsonl:2:", "prefix_len")),
    ("token-outside-vocab", text_file("t.jsonl", lines({**HEADER, "vocab_size": 100}, {**{k: v for k, v in REQ.items() if k != "prompt_len"}, "prompt": [5, 100]})),
     ("t.jsonl:2: prompt", "vocabulary")),
    ("prompt-token-negative", text_file("t.jsonl", lines(HEADER, {**{k: v for k, v in REQ.items() if k != "prompt_len"}, "prompt": [5, -1]})),
     ("t.jsonl:2: prompt.1", "token id")),
    ("prompt-token-float", text_file("t.jsonl", lines(HEADER, {**{k: v for k, v in REQ.items() if k != "prompt_len"}, "prompt": [5, 6.0]})),
     ("t.jsonl:2: prompt.1", "token id")),
    ("prompt-huge-array", text_file("t.jsonl", lines(HEADER, '{"id": "a", "arrival_step": 0, "max_tokens": 3, "prompt": ['
                                                     + ",".join(["7"] * 1_100_000) + "]}")), ("t.jsonl:2: prompt_len", "limit prompt_len")),
    ("stop-tokens-huge-array", text_file("t.jsonl", lines(HEADER, {**REQ, "stop_token_ids": [9] * 70_000})),
     ("t.jsonl:2: stop_token_ids", "limit token_list")),
    ("line-over-limit", text_file("t.jsonl", lines(HEADER, '{"id": "' + "x" * (17 * 1024 * 1024) + '"}')), ("t.jsonl:2: (line)", "limit line_bytes")),
    ("file-200mb", sparse("t.jsonl", 200 * 1024 * 1024), ("t.jsonl:0: (file)", "limit trace_bytes")),
    ("directory", directory("t.jsonl"), ("t.jsonl:0: (file)", "directory")),
    ("fifo", fifo("t.jsonl"), ("t.jsonl:0: (file)", "not a regular file")),
    ("missing", missing("t.jsonl"), ("t.jsonl:0: (file)", "No such file")),
    ("below-a-file", lambda d: text_file("f", "x")(d) / "t.jsonl", ("t.jsonl:0: (file)", "Not a directory")),
]

for _id, _make, _expect in TRACE_FILES:
    case(f"run-{_id}", lambda d, m=_make: ["run", m(d)], *_expect)
case("run-unreadable", lambda d: ["run", unreadable("t.jsonl", lines(HEADER, REQ))(d)], "t.jsonl:0: (file)", "Permission denied", marks=(ROOT,))

#: A cross-section of the trace cases for every other command that reads a trace.
SHARED = ("empty", "binary", "truncated-request", "wrong-format-tag", "version-2", "prompt-len-float", "prompt-len-bool",
          "prompt-len-nan", "prompt-len-10e30", "id-control-char", "duplicate-ids", "duplicate-json-key",
          "request-deep-nesting", "request-unknown-field", "config-num-blocks-zero", "directory", "fifo", "missing")
_BY_ID = {i: (m, e) for i, m, e in TRACE_FILES}
TRACE_COMMANDS = {
    "explain": lambda t, d: ["explain", t, "a"],
    "replay": lambda t, d: ["replay", t, "--engine", "spec"],
    "generate": lambda t, d: ["generate", t],
    "simulate": lambda t, d: ["simulate", t, "--cost-model", "unit"],
    "compare": lambda t, d: ["compare", t, "--cost-model", "unit", "--profiles", "vllm-v1,static"],
    "sweep": lambda t, d: ["sweep", t, "--cost-model", "unit", "--rates", "1", "--jobs", "1"],
}
for _cmd, _argv in TRACE_COMMANDS.items():
    for _id in SHARED:
        _make, _expect = _BY_ID[_id]
        case(f"{_cmd}-{_id}", lambda d, m=_make, a=_argv: a(m(d), d), *_expect)


# --------------------------------------------------------------------------
# Decision logs: check-log LOG, check-log --trace, replay --engine-log.
# --------------------------------------------------------------------------

LOG_HEADER = {"format": "batchspec-log", "version": 1, "engine": "toy", "level": "exact"}
REC0 = {"step": 0, "scheduled": [["a", 5]], "new": ["a"], "resumed": [], "preempted": [], "finished": [], "aborted": [],
        "rejected": [], "sampled": {"a": 17}, "num_free_blocks": 13, "blocks": {"a": 2}, "cache_hits": {"a": 0},
        "num_evicted": 0, "block_ids": {"a": [1, 2]}, "evicted": []}
REC1 = {**REC0, "step": 1, "scheduled": [["a", 1]], "new": []}

LOG_FILES = [
    ("empty", text_file("l.jsonl", ""), ("l.jsonl:1: (file)", "empty")),
    ("binary", text_file("l.jsonl", b"\x89PNG\r\n\x1a\n" + bytes(200)), ("l.jsonl:1: (line)",)),
    ("truncated", text_file("l.jsonl", lines(LOG_HEADER, REC0) + j(REC1)[:40]), ("l.jsonl:3: (line)", "truncated")),
    ("trace-given-as-log", text_file("l.jsonl", lines(HEADER, REQ)), ("l.jsonl:1: format", "batchspec-log")),
    ("version-2", text_file("l.jsonl", lines({**LOG_HEADER, "version": 2}, REC0)), ("l.jsonl:1: version",)),
    ("level-bogus", text_file("l.jsonl", lines({**LOG_HEADER, "level": "everything"}, REC0)), ("l.jsonl:1: level",)),
    ("engine-missing", text_file("l.jsonl", lines({k: v for k, v in LOG_HEADER.items() if k != "engine"}, REC0)), ("l.jsonl:1: engine", "missing")),
    ("engine-control-char", text_file("l.jsonl", lines({**LOG_HEADER, "engine": "to\u0007y"}, REC0)), ("l.jsonl:1: engine", "control")),
    ("header-config-bad-knob", text_file("l.jsonl", lines({**LOG_HEADER, "config": {"profile": "vllm-v1", "block_size": 0}}, REC0)),
     ("l.jsonl:1: config.block_size",)),
    ("step-float", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "step": 0.0})), ("l.jsonl:2: step", "integer")),
    ("step-bool", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "step": False})), ("l.jsonl:2: step", "integer")),
    ("step-nan", text_file("l.jsonl", lines(LOG_HEADER, j(REC0).replace('"step": 0', '"step": NaN'))), ("l.jsonl:2: step", "NaN")),
    ("step-huge", text_file("l.jsonl", lines(LOG_HEADER, REC0, {**REC1, "step": 10**12})), ("l.jsonl:3: step", "limit steps")),
    ("step-10e30", text_file("l.jsonl", lines(LOG_HEADER, REC0, {**REC1, "step": 10**30})), ("l.jsonl:3: step", "int_abs")),
    ("step-repeats", text_file("l.jsonl", lines(LOG_HEADER, REC0, {**REC1, "step": 0})), ("l.jsonl:3: step", "does not increase")),
    ("step-missing", text_file("l.jsonl", lines(LOG_HEADER, {k: v for k, v in REC0.items() if k != "step"})), ("l.jsonl:2: step", "missing")),
    ("scheduled-wrong-shape", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "scheduled": [["a"]]})), ("l.jsonl:2: scheduled.0",)),
    ("scheduled-zero-tokens", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "scheduled": [["a", 0]]})), ("l.jsonl:2: scheduled.0.1", "minimum")),
    ("scheduled-float-tokens", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "scheduled": [["a", 5.0]]})), ("l.jsonl:2: scheduled.0.1", "integer")),
    ("finished-bad-reason", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "finished": [["a", "bored"]]})), ("l.jsonl:2: finished.0.1",)),
    ("sampled-negative", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "sampled": {"a": -1}})), ("l.jsonl:2: sampled.a", "minimum")),
    ("sampled-bool", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "sampled": {"a": True}})), ("l.jsonl:2: sampled.a", "integer")),
    ("sampled-key-control", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "sampled": {"a\u0002": 5}})), ("l.jsonl:2: sampled", "control")),
    ("blocks-infinity", text_file("l.jsonl", lines(LOG_HEADER, j(REC0).replace('"blocks": {"a": 2}', '"blocks": {"a": Infinity}'))),
     ("l.jsonl:2: blocks.a", "Infinity")),
    ("new-control-char", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "new": ["a\u0085"]})), ("l.jsonl:2: new.0", "control")),
    ("record-unknown-field", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "mood": "ok"})), ("l.jsonl:2:", "unknown field", "mood")),
    ("record-duplicate-key", text_file("l.jsonl", lines(LOG_HEADER, j(REC0).replace('"step": 0', '"step": 0, "step": 1'))),
     ("l.jsonl:2: step", "duplicate key")),
    ("record-deep-nesting", text_file("l.jsonl", lines(LOG_HEADER, '{"step": 0, "scheduled": ' + "[" * 20_000 + "]" * 20_000 + "}")),
     ("l.jsonl:2: (line)", "json_depth")),
    ("record-is-a-list", text_file("l.jsonl", lines(LOG_HEADER, [REC0])), ("l.jsonl:2: (line)", "object")),
    ("block-ids-huge-array", text_file("l.jsonl", lines(LOG_HEADER, {**REC0, "block_ids": {"a": [1] * 10} | {"b": [-1]}})),
     ("l.jsonl:2: block_ids.b.0", "minimum")),
    ("file-300mb", sparse("l.jsonl", 300 * 1024 * 1024), ("l.jsonl:0: (file)", "limit log_bytes")),
    ("directory", directory("l.jsonl"), ("l.jsonl:0: (file)", "directory")),
    ("fifo", fifo("l.jsonl"), ("l.jsonl:0: (file)", "not a regular file")),
    ("missing", missing("l.jsonl"), ("l.jsonl:0: (file)", "No such file")),
]


# A trace that gives arrival times in seconds only: the step-by-step commands refuse it at the
# first such request's line, and say how to convert it (item 5); simulate maps seconds to steps.
_SECONDS_ONLY = lines(HEADER, {"id": "a", "arrival_time": 0.0, "prompt_len": 5, "max_tokens": 3},
                      {"id": "b", "arrival_time": 0.25, "prompt_len": 7, "max_tokens": 2})
_NEEDS_STEPS = ("t.jsonl:2: arrival_step: missing", "batchspec import --step-seconds S", "batchspec simulate")
for _id, _argv in (("run", ["run", "{t}"]), ("explain", ["explain", "{t}", "a"]), ("replay", ["replay", "{t}", "--engine", "spec"]),
                   ("generate", ["generate", "{t}"])):
    case(f"{_id}-arrival-time-only", lambda d, a=_argv: [text_file("t.jsonl", _SECONDS_ONLY)(d) if x == "{t}" else x for x in a],
         *_NEEDS_STEPS)


def _good_trace(d: Path) -> Path:
    p = d / "good.jsonl"
    p.write_text(lines(HEADER, REQ, REQ_B))
    return p


for _id, _make, _expect in LOG_FILES:
    case(f"check-log-{_id}", lambda d, m=_make: ["check-log", m(d), "--trace", _good_trace(d)], *_expect)
for _id in ("empty", "binary", "step-float", "step-nan", "step-huge", "sampled-key-control", "record-duplicate-key",
            "record-deep-nesting", "fifo", "missing"):
    _make, _expect = {i: (m, e) for i, m, e in LOG_FILES}[_id]
    case(f"replay-engine-log-{_id}", lambda d, m=_make: ["replay", _good_trace(d), "--engine-log", m(d)], *_expect)
# the trace a log names (check-log --trace) is a trace: refused the same way
for _id in ("empty", "prompt-len-float", "id-control-char", "duplicate-ids", "fifo", "directory"):
    _make, _expect = _BY_ID[_id]

    def _log_and_bad_trace(d: Path, m=_make) -> list:
        (d / "l.jsonl").write_text(lines(LOG_HEADER, REC0))
        return ["check-log", d / "l.jsonl", "--trace", m(d)]

    case(f"check-log-trace-{_id}", _log_and_bad_trace, *_expect)


# --------------------------------------------------------------------------
# Cost models: simulate --cost-model FILE.
# --------------------------------------------------------------------------

COST = {"name": "mine", "fixed_s": 0.01, "per_prefill_token_s": 1e-5, "per_decode_seq_s": 1e-5, "per_kv_token_s": 1e-9,
        "knobs": {"num_blocks": 64}, "source": "test"}
COST_FILES = [
    ("empty", text_file("c.json", ""), ("c.json:1: (file)", "empty")),
    ("binary", text_file("c.json", bytes(range(256))), ("c.json:", "(file)")),
    ("not-json", text_file("c.json", "fixed_s = 0.01\n"), ("c.json:1: (file)", "invalid JSON")),
    ("truncated", text_file("c.json", j(COST)[:30]), ("c.json:1: (file)", "invalid JSON")),
    ("a-list", text_file("c.json", j([COST])), ("c.json:1: (file)", "object")),
    ("missing-fixed", text_file("c.json", j({k: v for k, v in COST.items() if k != "fixed_s"})), ("c.json:1: fixed_s", "missing")),
    ("unknown-field", text_file("c.json", j({**COST, "speed": 3})), ("c.json:1: speed", "unknown field")),
    ("fixed-string", text_file("c.json", j({**COST, "fixed_s": "0.01"})), ("c.json:1: fixed_s", "number")),
    ("fixed-bool", text_file("c.json", j({**COST, "fixed_s": True})), ("c.json:1: fixed_s", "number")),
    ("fixed-nan", text_file("c.json", j(COST).replace('"fixed_s": 0.01', '"fixed_s": NaN')), ("c.json:1: fixed_s", "NaN")),
    ("fixed-infinity", text_file("c.json", j(COST).replace('"fixed_s": 0.01', '"fixed_s": Infinity')), ("c.json:1: fixed_s", "Infinity")),
    ("fixed-negative", text_file("c.json", j({**COST, "fixed_s": -0.01})), ("c.json:1: fixed_s", "outside")),
    ("fixed-zero", text_file("c.json", j({**COST, "fixed_s": 0})), ("c.json:1: fixed_s", "1 ns")),
    ("fixed-huge", text_file("c.json", j({**COST, "fixed_s": 1e300})), ("c.json:1: fixed_s", "MAX_COEFFICIENT_S")),
    ("kv-1e999", text_file("c.json", j(COST).replace('"per_kv_token_s": 1e-09', '"per_kv_token_s": 1e999')), ("c.json:1: per_kv_token_s", "finite")),
    ("coefficient-huge-int", text_file("c.json", j({**COST, "per_decode_seq_s": 10**30})), ("c.json:1: per_decode_seq_s", "int_abs")),
    ("knobs-a-list", text_file("c.json", j({**COST, "knobs": [1]})), ("c.json:1: knobs", "object")),
    ("knobs-unknown", text_file("c.json", j({**COST, "knobs": {"gpus": 8}})), ("c.json:1: knobs.gpus", "unknown knob")),
    ("knobs-zero-blocks", text_file("c.json", j({**COST, "knobs": {"num_blocks": 0}})), ("c.json:1: knobs.num_blocks",)),
    ("knobs-float-blocks", text_file("c.json", j({**COST, "knobs": {"num_blocks": 64.0}})), ("c.json:1: knobs.num_blocks", "integer")),
    ("name-control-char", text_file("c.json", j({**COST, "name": "a\u0000"})), ("c.json:1: name", "control")),
    ("name-number", text_file("c.json", j({**COST, "name": 5})), ("c.json:1: name", "string")),
    ("duplicate-key", text_file("c.json", j(COST).replace('"fixed_s": 0.01', '"fixed_s": 0.01, "fixed_s": 0.02')), ("c.json:1: fixed_s", "duplicate key")),
    ("deep-nesting", text_file("c.json", '{"knobs": ' + "[" * 10_000 + "]" * 10_000 + "}"), ("c.json:1: (file)", "json_depth")),
    ("multi-line-field-line", text_file("c.json", json.dumps({**COST, "fixed_s": -1}, indent=1)), ("c.json:3: fixed_s",)),
    ("file-100mb", sparse("c.json", 100 * 1024 * 1024), ("c.json:0: (file)", "limit json_bytes")),
    ("directory", directory("c.json"), ("c.json:0: (file)", "directory")),
    ("fifo", fifo("c.json"), ("c.json:0: (file)", "not a regular file")),
    ("missing", missing("c.json"), ("c.json:0: (file)", "No such file")),
]
for _id, _make, _expect in COST_FILES:
    case(f"cost-model-{_id}", lambda d, m=_make: ["simulate", _good_trace(d), "--cost-model", m(d)], *_expect)
case("cost-model-unknown-preset", lambda d: ["simulate", _good_trace(d), "--cost-model", "tpu-v9"], "--cost-model", "unknown cost model",
     where="option")


# --------------------------------------------------------------------------
# Calibration rows: calibrate ROWS -o OUT.
# --------------------------------------------------------------------------

ROW = {"prefill_tokens": 128, "decode_seqs": 4, "kv_tokens": 900, "seconds": 0.01}


def rows_json(*rows) -> str:
    return json.dumps({"rows": list(rows) + [ROW] * 4}, indent=1)


ROWS_FILES = [
    ("json-empty", text_file("r.json", ""), ("r.json:1: (file)", "empty")),
    ("json-binary", text_file("r.json", bytes(range(255, -1, -1))), ("r.json:", "(file)")),
    ("json-invalid", text_file("r.json", "{rows: []}"), ("r.json:1: (file)", "invalid JSON")),
    ("json-truncated", text_file("r.json", rows_json()[:-20]), ("r.json:", "(file)", "invalid JSON")),
    ("json-a-number", text_file("r.json", "42"), ("r.json:1: rows", "list")),
    ("json-rows-not-list", text_file("r.json", j({"rows": {"a": 1}})), ("r.json:1: rows", "list")),
    ("json-unknown-top", text_file("r.json", j({"rows": [ROW] * 4, "gpu": "h100"})), ("r.json:1: gpu", "unknown field")),
    ("json-row-not-object", text_file("r.json", j([ROW, ROW, ROW, [1, 2, 3, 4]])), ("r.json:1: (row)",)),
    ("json-missing-column", text_file("r.json", rows_json({k: v for k, v in ROW.items() if k != "kv_tokens"})), ("r.json:3: kv_tokens", "missing")),
    ("json-unknown-column", text_file("r.json", rows_json({**ROW, "watts": 300})), ("r.json:3: watts", "unknown field")),
    ("json-count-float", text_file("r.json", rows_json({**ROW, "prefill_tokens": 10.5})), ("r.json:3: prefill_tokens", "whole number")),
    ("json-count-10.0", text_file("r.json", rows_json({**ROW, "decode_seqs": 10.0})), ("r.json:3: decode_seqs", "whole number")),
    ("json-count-bool", text_file("r.json", rows_json({**ROW, "decode_seqs": True})), ("r.json:3: decode_seqs", "whole number")),
    ("json-count-string", text_file("r.json", rows_json({**ROW, "kv_tokens": "many"})), ("r.json:3: kv_tokens", "whole number")),
    ("json-count-negative", text_file("r.json", rows_json({**ROW, "kv_tokens": -1})), ("r.json:3: kv_tokens", "MAX_ROW_COUNT")),
    ("json-count-huge", text_file("r.json", rows_json({**ROW, "kv_tokens": 10**30})), ("r.json:", "kv_tokens", "int_abs")),
    ("json-seconds-nan", text_file("r.json", rows_json(ROW).replace('"seconds": 0.01', '"seconds": NaN', 1)), ("r.json:", "seconds", "NaN")),
    ("json-seconds-infinity", text_file("r.json", rows_json(ROW).replace('"seconds": 0.01', '"seconds": Infinity', 1)), ("r.json:", "seconds", "Infinity")),
    ("json-seconds-negative", text_file("r.json", rows_json({**ROW, "seconds": -0.5})), ("r.json:3: seconds", "finite")),
    ("json-seconds-huge", text_file("r.json", rows_json({**ROW, "seconds": 1e12})), ("r.json:3: seconds", "MAX_ROW_SECONDS")),
    ("json-seconds-string", text_file("r.json", rows_json({**ROW, "seconds": "fast"})), ("r.json:3: seconds", "number")),
    ("json-too-few-rows", text_file("r.json", j([ROW, ROW])), ("r.json:0: (file)", "at least 4")),
    ("json-duplicate-key", text_file("r.json", rows_json().replace('"seconds": 0.01', '"seconds": 0.01, "seconds": 0.02', 1)),
     ("r.json:", "seconds", "duplicate key")),
    ("json-deep-nesting", text_file("r.json", "[" * 50_000 + "]" * 50_000), ("r.json:1: (file)", "json_depth")),
    ("csv-empty", text_file("r.csv", ""), ("r.csv:1: prefill_tokens", "empty")),
    ("csv-binary", text_file("r.csv", b"prefill_tokens,decode_seqs,kv_tokens,seconds\n\xff\xfe\x00\x01,2,3\n"), ("r.csv:", "UTF-8")),
    ("csv-missing-column", text_file("r.csv", "prefill_tokens,decode_seqs,seconds\n1,2,0.1\n"), ("r.csv:1: kv_tokens", "missing column")),
    ("csv-count-float", text_file("r.csv", "prefill_tokens,decode_seqs,kv_tokens,seconds\n" + "1,2,3,0.1\n" * 4 + "1.5,2,3,0.1\n"),
     ("r.csv:6: prefill_tokens", "whole number")),
    ("csv-count-word", text_file("r.csv", "prefill_tokens,decode_seqs,kv_tokens,seconds\n" + "1,2,3,0.1\n" * 4 + "1,two,3,0.1\n"),
     ("r.csv:6: decode_seqs", "whole number")),
    ("csv-seconds-nan", text_file("r.csv", "prefill_tokens,decode_seqs,kv_tokens,seconds\n" + "1,2,3,0.1\n" * 4 + "1,2,3,nan\n"),
     ("r.csv:6: seconds", "finite")),
    ("csv-seconds-inf", text_file("r.csv", "prefill_tokens,decode_seqs,kv_tokens,seconds\n" + "1,2,3,0.1\n" * 4 + "1,2,3,inf\n"),
     ("r.csv:6: seconds", "finite")),
    ("csv-extra-field", text_file("r.csv", "prefill_tokens,decode_seqs,kv_tokens,seconds\n" + "1,2,3,0.1\n" * 4 + "1,2,3,0.1,9\n"),
     ("r.csv:6: (row)", "more fields")),
    ("csv-missing-value", text_file("r.csv", "prefill_tokens,decode_seqs,kv_tokens,seconds\n" + "1,2,3,0.1\n" * 4 + "1,2,,0.1\n"),
     ("r.csv:6: kv_tokens", "missing")),
    ("file-200mb", sparse("r.csv", 200 * 1024 * 1024), ("r.csv:0: (file)", "limit MAX_FILE_BYTES")),
    ("directory", directory("r.json"), ("r.json:0: (file)", "directory")),
    ("fifo", fifo("r.csv"), ("r.csv:0: (file)", "not a regular file")),
    ("missing", missing("r.json"), ("r.json:0: (file)", "No such file")),
]
for _id, _make, _expect in ROWS_FILES:
    case(f"calibrate-{_id}", lambda d, m=_make: ["calibrate", m(d), "-o", d / "cost.json"], *_expect)


# --------------------------------------------------------------------------
# Reference weights: generate --model DIR (safetensors only; a pickle is never read).
# --------------------------------------------------------------------------

TINY = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 256}


def model_dir(config: str | dict | None, weights: bytes | str | None = "good"):
    """A model folder: ``config.json`` (text or dict) and ``model.safetensors`` ("good": matching seeded weights)."""

    def build(d: Path) -> Path:
        m = d / "model"
        m.mkdir()
        if config is not None:
            (m / "config.json").write_text(config if isinstance(config, str) else j(config))
        if weights == "good":
            from safetensors.torch import save_file

            from reference.model import TinyLlamaConfig, init_weights

            save_file({k: v.contiguous() for k, v in init_weights(TinyLlamaConfig(**TINY), 0).items()}, str(m / "model.safetensors"))
        elif weights == "wrong-shape":
            from safetensors.torch import save_file

            from reference.model import TinyLlamaConfig, init_weights

            save_file({k: v.contiguous() for k, v in init_weights(TinyLlamaConfig(**{**TINY, "vocab_size": 96}), 0).items()},
                      str(m / "model.safetensors"))
        elif isinstance(weights, bytes):
            (m / "model.safetensors").write_bytes(weights)
        return m

    return build


_PICKLE = b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94\x8c\x05echo!\x94\x85\x94R\x94."
WEIGHTS = [
    ("config-empty", model_dir(""), ("config.json:1: (file)", "empty")),
    ("config-not-json", model_dir("vocab_size: 64"), ("config.json:1: (file)", "invalid JSON")),
    ("config-a-list", model_dir("[1, 2]"), ("config.json:1: (file)", "object")),
    ("config-vocab-zero", model_dir({**TINY, "vocab_size": 0}), ("config.json:1: vocab_size", "outside")),
    ("config-hidden-float", model_dir({**TINY, "hidden_size": 16.0}), ("config.json:1: hidden_size", "integer")),
    ("config-layers-bool", model_dir({**TINY, "num_hidden_layers": True}), ("config.json:1: num_hidden_layers", "integer")),
    ("config-hidden-huge", model_dir({**TINY, "hidden_size": 10**30}), ("config.json:1: hidden_size", "int_abs")),
    ("config-too-many-parameters", model_dir({**TINY, "hidden_size": 16_384, "intermediate_size": 65_536, "num_hidden_layers": 64}),
     ("config.json:1: (config)", "MAX_PARAMETERS")),
    ("config-eps-nan", model_dir(j(TINY)[:-1] + ', "rms_norm_eps": NaN}'), ("config.json:1: rms_norm_eps", "NaN")),
    ("config-duplicate-key", model_dir(j(TINY)[:-1] + ', "vocab_size": 65}'), ("config.json:1: vocab_size", "duplicate key")),
    ("config-deep", model_dir('{"rope_scaling": ' + "[" * 5000 + "]" * 5000 + "}"), ("config.json:1: (file)", "json_depth")),
    ("config-heads-not-multiple", model_dir({**TINY, "num_attention_heads": 3, "num_key_value_heads": 2}), ("config.json:1: (config)", "multiple")),
    ("config-missing", model_dir(None), ("config.json:0: (file)", "missing")),
    ("weights-missing", model_dir(TINY, None), ("model.safetensors:0: (file)", "missing")),
    ("weights-empty", model_dir(TINY, b""), ("model.safetensors:0: (file)", "safetensors")),
    ("weights-garbage", model_dir(TINY, b"garbage" * 100), ("model.safetensors:0: (file)", "safetensors")),
    ("weights-a-pickle", model_dir(TINY, _PICKLE), ("model.safetensors:0: (file)", "safetensors")),
    ("weights-header-too-large", model_dir(TINY, (10**12).to_bytes(8, "little") + b"{}"), ("model.safetensors:0: (file)", "safetensors")),
    ("weights-wrong-shape", model_dir(TINY, "wrong-shape"), ("model.safetensors:0: (weights)", "shape")),
    ("model-is-a-file", text_file("model", "not a folder"), ("model:0: --model", "not a directory")),
    ("model-missing", missing("model"), ("model:0: --model", "not a directory")),
]
for _id, _make, _expect in WEIGHTS:
    case(f"generate-weights-{_id}", lambda d, m=_make: ["generate", _good_trace(d), "--model", m(d)], *_expect)


# --------------------------------------------------------------------------
# Imports of public traces: import FILE -o OUT.
# --------------------------------------------------------------------------

VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens\n"
IMPORTS = [
    ("empty", text_file("src.csv", ""), ("src.csv:",)),
    ("binary", text_file("src.csv", bytes(range(256)) * 8), ("src.csv:",)),
    ("unknown-format", text_file("src.csv", "a,b,c\n1,2,3\n"), ("src.csv:1: (format)", "unknown format")),
    ("tokens-not-a-number", text_file("src.csv", VIDUR + "0.0,12,3\n0.5,many,3\n"), ("src.csv:3: num_prefill_tokens",)),
    ("tokens-negative", text_file("src.csv", VIDUR + "0.0,12,3\n0.5,-4,3\n"), ("src.csv:3: num_prefill_tokens",)),
    ("tokens-huge", text_file("src.csv", VIDUR + "0.0,12,3\n0.5,99999999999999999999999,3\n"), ("src.csv:3: num_prefill_tokens",)),
    ("time-nan", text_file("src.csv", VIDUR + "0.0,12,3\nnan,4,3\n"), ("src.csv:3: arrived_at",)),
    ("time-infinity", text_file("src.csv", VIDUR + "0.0,12,3\ninf,4,3\n"), ("src.csv:3: arrived_at",)),
    ("mooncake-truncated", text_file("src.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
                                     '{"timestamp": 5, "input_len'), ("src.jsonl:2:",)),
    ("directory", directory("src.csv"), ("src.csv:0: (file)", "directory")),
    ("fifo", fifo("src.csv"), ("src.csv:0: (file)", "not a regular file")),
    ("missing", missing("src.csv"), ("src.csv:0: (file)", "No such file")),
]
for _id, _make, _expect in IMPORTS:
    case(f"import-{_id}", lambda d, m=_make: ["import", m(d), "-o", d / "out.jsonl"], *_expect)


# --------------------------------------------------------------------------
# Option values: numbers, knobs, choices, paths.
# --------------------------------------------------------------------------


def _vidur(d: Path) -> Path:
    p = d / "v.csv"
    p.write_text(VIDUR + "".join(f"{i * 0.5},16,4\n" for i in range(8)))
    return p


OPTIONS = [
    # run / explain / check-log / replay
    ("run", ["--max-rows", "0"], ("--max-rows", ">= 1")),
    ("run", ["--max-rows", "-3"], ("--max-rows",)),
    ("run", ["--max-rows", "2.5"], ("--max-rows", "integer")),
    ("run", ["--max-rows", "nan"], ("--max-rows", "integer")),
    ("run", ["--max-rows", "1e3"], ("--max-rows", "integer")),
    ("run", ["--max-rows", "9" * 40], ("--max-rows",)),
    ("run", ["--example", "nonesuch"], ("--example", "invalid choice")),
    ("check-log", ["l.jsonl", "--max-rows", "0"], ("--max-rows",)),
    ("check-log", ["l.jsonl", "--profile", "bogus"], ("--profile", "invalid choice")),
    ("replay", ["{trace}", "--level", "bits"], ("--level", "invalid choice")),
    ("replay", ["{trace}", "--engine", "bogus"], ("bogus",)),
    ("replay", ["{trace}", "--engine", "nosuchmodule:make"], ("nosuchmodule",)),
    # fuzz (validated before any work)
    ("fuzz", ["--seconds", "nan"], ("--seconds", "finite")),
    ("fuzz", ["--seconds", "inf"], ("--seconds", "finite")),
    ("fuzz", ["--seconds", "-1"], ("--seconds", "> 0")),
    ("fuzz", ["--seconds", "0"], ("--seconds", "> 0")),
    ("fuzz", ["--seconds", "soon"], ("--seconds", "number")),
    ("fuzz", ["--workers", "-1"], ("--workers", ">= 0")),
    ("fuzz", ["--workers", "1.5"], ("--workers", "integer")),
    ("fuzz", ["--workers", "100000"], ("--workers", "limit")),
    ("fuzz", ["--timeout", "-1"], ("--timeout", "> 0")),
    ("fuzz", ["--timeout", "0"], ("--timeout", "> 0")),
    ("fuzz", ["--timeout", "nan"], ("--timeout", "finite")),
    ("fuzz", ["--traces", "0"], ("--traces", ">= 1")),
    ("fuzz", ["--traces", "-5"], ("--traces",)),
    ("fuzz", ["--traces", "10.0"], ("--traces", "integer")),
    ("fuzz", ["--traces", str(10**30)], ("--traces",)),
    ("fuzz", ["--seed", "-1"], ("--seed", ">= 0")),
    ("fuzz", ["--seed", "abc"], ("--seed", "integer")),
    ("fuzz", ["--shard", "2/2"], ("--shard", "I/N")),
    ("fuzz", ["--shard", "1/0"], ("--shard",)),
    ("fuzz", ["--shard", "half"], ("--shard",)),
    ("fuzz", ["--shrink-tries", "-1"], ("--shrink-tries",)),
    ("fuzz", ["--profile", "bogus"], ("--profile", "invalid choice")),
    ("fuzz", ["--level", "bits"], ("--level", "invalid choice")),
    ("fuzz", ["--corpus", "{file}"], ("--corpus", "not a directory")),
    ("fuzz", ["--engine", "bogus", "--traces", "1"], ("bogus",)),
    # --set, on fuzz and the simulator commands
    ("fuzz", ["--set", "num_blocks=0"], ("--set num_blocks",)),
    ("fuzz", ["--set", "block_size=0"], ("--set block_size", ">= 1")),
    ("fuzz", ["--set", "max_num_seqs=0"], ("--set max_num_seqs", ">= 1")),
    ("fuzz", ["--set", "num_blocks=abc"], ("--set num_blocks", "integer")),
    ("fuzz", ["--set", "num_blocks=10.0"], ("--set num_blocks", "integer")),
    ("fuzz", ["--set", "num_blocks=1e3"], ("--set num_blocks", "integer")),
    ("fuzz", ["--set", "num_blocks=" + "9" * 30], ("--set num_blocks",)),
    ("fuzz", ["--set", "num_blocks=-4"], ("--set num_blocks",)),
    ("fuzz", ["--set", "watermark=nan"], ("--set watermark", "finite")),
    ("fuzz", ["--set", "watermark=inf"], ("--set watermark", "finite")),
    ("fuzz", ["--set", "watermark=1.5"], ("--set watermark",)),
    ("fuzz", ["--set", "null_block=1"], ("--set null_block", "true or false")),
    ("fuzz", ["--set", "policy=lifo"], ("--set policy", "one of")),
    ("fuzz", ["--set", "max_steps=" + str(10**9)], ("--set max_steps", "limit")),
    ("fuzz", ["--set", "no_such_knob=1"], ("--set", "unknown knob")),
    ("fuzz", ["--set", "num_blocks"], ("--set", "knob=value")),
    ("fuzz", ["--set", "num_blocks=8,num_blocks=9"], ("--set", "twice")),
    ("fuzz", ["--set", "tenant_weights=a=0"], ("--set tenant_weights",)),
    ("fuzz", ["--set", "aging_steps=-1"], ("--set aging_steps",)),
    ("simulate", ["{trace}", "--set", "num_blocks=0"], ("--set", "num_blocks")),
    ("simulate", ["{trace}", "--set", "block_size=abc"], ("--set", "block_size", "integer")),
    ("simulate", ["{trace}", "--set", "watermark=nan"], ("--set", "watermark", "finite")),
    ("compare", ["{trace}", "--profiles", "vllm-v1", "--set", "max_num_seqs=0"], ("--set", "max_num_seqs")),
    ("sweep", ["{trace}", "--set", "enable_prefix_caching=maybe"], ("--set", "enable_prefix_caching")),
    ("import", ["{vidur}", "-o", "{dir}/o.jsonl", "--set", "num_blocks=0"], ("--set", "num_blocks")),
    ("calibrate", ["{rows}", "-o", "{dir}/c.json", "--set", "num_blocks=2.5"], ("--set", "num_blocks")),
    # the simulator's options
    ("simulate", ["{trace}", "--first", "0"], ("--first", ">= 1")),
    ("simulate", ["{trace}", "--first", "1.5"], ("--first", "integer")),
    ("simulate", ["{trace}", "--speedup", "0"], ("--speedup", ">= 1e-06")),
    ("simulate", ["{trace}", "--speedup", "1e-300"], ("--speedup", ">= 1e-06")),
    ("simulate", ["{trace}", "--speedup", "nan"], ("--speedup", "finite")),
    ("simulate", ["{trace}", "--speedup", "-2"], ("--speedup",)),
    ("simulate", ["{trace}", "--rate", "0"], ("--rate", ">= 1e-06")),
    ("simulate", ["{trace}", "--rate", "1e-300"], ("--rate", ">= 1e-06")),
    ("simulate", ["{trace}", "--rate", "inf"], ("--rate", "finite")),
    ("simulate", ["{trace}", "--rate", "1e300"], ("--rate", "limit")),
    ("simulate", ["{trace}", "--cv", "0"], ("--cv",)),
    ("simulate", ["{trace}", "--seed", "-1"], ("--seed",)),
    ("simulate", ["{trace}", "--window", "5:1"], ("--window", "START < END")),
    ("simulate", ["{trace}", "--window", "a:b"], ("--window", "START:END")),
    ("simulate", ["{trace}", "--window", "nan:5"], ("--window",)),
    ("simulate", ["{trace}", "--window", "3"], ("--window", "START:END")),
    ("simulate", ["{trace}", "--format", "parquet"], ("--format", "invalid choice")),
    ("simulate", ["{trace}", "--slo", "ttft=nan"], ("--slo", "finite")),
    ("simulate", ["{trace}", "--slo", "ttft=-1"], ("--slo", "> 0")),
    ("simulate", ["{trace}", "--slo", "latency=3"], ("--slo", "unknown SLO")),
    ("simulate", ["{trace}", "--timeline", "{dir}/t.pdf"], ("--timeline", ".png or .svg")),
    ("simulate", ["{trace}", "--timeline-steps", "0"], ("--timeline-steps",)),
    ("simulate", ["{trace}", "--timeline-start", "-1"], ("--timeline-start",)),
    ("simulate", ["{trace}", "--tenant-column", "\x01"], ("--tenant-column", "control")),
    ("simulate", ["{trace}", "--profile", "vllm-v1:num_blocks=0"], ("num_blocks",)),
    ("sweep", ["{trace}", "--rates", "0,1"], ("--rates", ">= 1e-06")),
    ("sweep", ["{trace}", "--rates", "1e-300"], ("--rates", ">= 1e-06")),
    ("sweep", ["{trace}", "--rates", "1,nan"], ("--rates", "finite")),
    ("sweep", ["{trace}", "--rates", "fast"], ("--rates", "number")),
    ("sweep", ["{trace}", "--slo-ttft", "0"], ("--slo-ttft",)),
    ("sweep", ["{trace}", "--jobs", "-1"], ("--jobs",)),
    ("sweep", ["{trace}", "--plot", "{dir}/p.pdf"], ("--plot", ".png or .svg")),
    ("import", ["{vidur}", "-o", "{dir}/o.jsonl", "--first", "0"], ("--first",)),
    ("import", ["{vidur}", "-o", "{dir}/o.jsonl", "--speedup", "nan"], ("--speedup", "finite")),
    ("import", ["{vidur}", "-o", "{dir}/o.jsonl", "--step-seconds", "0"], ("--step-seconds",)),
    ("import", ["{vidur}", "-o", "{dir}/o.jsonl", "--profile", "nonesuch"], ("--profile", "invalid choice")),
    ("import", ["{vidur}", "-o", "{dir}/o.jsonl", "--format", "batchspec"], ("--format", "invalid choice")),
    ("calibrate", ["{rows}", "-o", "{dir}/c.json", "--name", ""], ("--name",)),
    ("generate", ["{trace}", "--seed", "-1"], ("--seed",)),
    ("generate", ["{trace}", "--level", "exact"], ("--level", "invalid choice")),
    ("generate", ["{trace}", "--max-rows", "0"], ("--max-rows",)),
    ("generate", ["{trace}", "--sampling", "temperature=nan"], ("temperature",)),
    ("generate", ["{trace}", "--sampling", "top_p=2"], ("top_p",)),
    ("conform", ["--traces", "0"], ("--traces",)),
    ("conform", ["--workers", "-2"], ("--workers",)),
    ("prove", ["--jobs", "-1"], ("--jobs",)),
    ("prove", ["--examples", "0", "--hypothesis"], ("--examples",)),
]


def _fill(arg: str, d: Path) -> str:
    if arg == "{trace}":
        return str(_good_trace(d))
    if arg == "{vidur}":
        return str(_vidur(d))
    if arg == "{rows}":
        p = d / "rows.json"
        p.write_text(json.dumps({"rows": [{"prefill_tokens": 64 * i, "decode_seqs": i, "kv_tokens": 100 * i, "seconds": 0.01 + 0.001 * i}
                                          for i in range(8)]}))
        return str(p)
    if arg == "{file}":
        (d / "plain-file").write_text("x")
        return str(d / "plain-file")
    if arg == "l.jsonl":
        (d / "l.jsonl").write_text(lines(LOG_HEADER, REC0))
        return str(d / "l.jsonl")
    return arg.replace("{dir}", str(d))


_SEEN: dict[str, int] = {}
for _cmd, _args, _expect in OPTIONS:
    _name = f"{_cmd}-option-" + re.sub(r"[^a-z0-9]+", "-", " ".join(a for a in _args if not a.startswith("{")).lower()).strip("-")[:40]
    _SEEN[_name] = _SEEN.get(_name, 0) + 1
    _name += f"-{_SEEN[_name]}" if _SEEN[_name] > 1 else ""
    case(_name, lambda d, c=_cmd, a=_args: [c, *(_fill(x, d) for x in a)], *_expect, where="option")


# --------------------------------------------------------------------------
# Nothing lost: an output that is an input, or a directory, is refused before any work.
# --------------------------------------------------------------------------


def _rows(d: Path) -> Path:
    return Path(_fill("{rows}", d))


def _link(d: Path) -> Path:
    t = _good_trace(d)
    (d / "link.jsonl").symlink_to(t)
    return d / "link.jsonl"


def _saved_log(d: Path) -> Path:
    (d / "l.jsonl").write_text(lines(LOG_HEADER, REC0))
    return d / "l.jsonl"


def _matplotlib_missing(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "matplotlib" else real(name, *a, **k))


NOTHING_LOST = [
    ("run-log-is-the-trace", lambda d: ["run", _good_trace(d), "--log", d / "good.jsonl"], ("--log", "also the input TRACE")),
    ("run-log-is-a-link-to-the-trace", lambda d: ["run", _link(d), "--log", d / "good.jsonl"], ("--log", "also the input TRACE")),
    ("run-log-is-a-directory", lambda d: ["run", _good_trace(d), "--log", d], ("--log", "is a directory")),
    ("run-log-is-a-fifo", lambda d: ["run", _good_trace(d), "--log", fifo("out.jsonl")(d)], ("--log", "not a regular file")),
    ("run-log-is-a-device", lambda d: ["run", _good_trace(d), "--log", "/dev/null"], ("--log", "not a regular file")),
    ("run-log-below-a-file", lambda d: ["run", _good_trace(d), "--log", d / "good.jsonl" / "log.jsonl"], ("--log", "not a directory")),
    ("replay-log-is-the-trace", lambda d: ["replay", _good_trace(d), "--engine", "spec", "--log", d / "good.jsonl"], ("--log", "also the input")),
    ("replay-spec-log-is-the-trace", lambda d: ["replay", _good_trace(d), "--engine", "spec", "--spec-log", d / "good.jsonl"],
     ("--spec-log", "also the input")),
    ("replay-log-is-the-engine-log", lambda d: ["replay", _good_trace(d), "--engine-log", _saved_log(d), "--log", d / "l.jsonl"],
     ("--log", "also the input --engine-log")),
    ("replay-log-and-spec-log-the-same", lambda d: ["replay", _good_trace(d), "--engine", "spec", "--log", d / "x.jsonl",
                                                    "--spec-log", d / "x.jsonl"], ("--spec-log", "also the output of --log")),
    ("generate-log-is-the-trace", lambda d: ["generate", _good_trace(d), "--log", d / "good.jsonl"], ("--log", "also the input")),
    ("import-output-is-the-input", lambda d: ["import", _vidur(d), "-o", d / "v.csv"], ("-o/--output", "also the input")),
    ("import-output-is-a-directory", lambda d: ["import", _vidur(d), "-o", d], ("-o/--output", "is a directory")),
    ("calibrate-output-is-the-input", lambda d: ["calibrate", _rows(d), "-o", d / "rows.json"], ("-o/--output", "also the input")),
    ("calibrate-output-is-a-directory", lambda d: ["calibrate", _rows(d), "-o", d], ("-o/--output", "is a directory")),
    ("simulate-json-is-the-trace", lambda d: ["simulate", _good_trace(d), "--cost-model", "unit", "--json", d / "good.jsonl"],
     ("--json", "also the input")),
    ("simulate-json-is-a-directory", lambda d: ["simulate", _good_trace(d), "--cost-model", "unit", "--json", d], ("--json", "is a directory")),
    ("simulate-json-is-the-cost-model", lambda d: ["simulate", _good_trace(d), "--cost-model", text_file("c.json", j(COST))(d),
                                                   "--json", d / "c.json"], ("--json", "also the input --cost-model")),
    ("compare-json-is-the-trace", lambda d: ["compare", _good_trace(d), "--cost-model", "unit", "--profiles", "vllm-v1",
                                             "--json", d / "good.jsonl"], ("--json", "also the input")),
    ("sweep-json-is-a-directory", lambda d: ["sweep", _good_trace(d), "--cost-model", "unit", "--rates", "1", "--json", d],
     ("--json", "is a directory")),
    ("conform-json-is-a-directory", lambda d: ["conform", "--engine", "spec", "--traces", "1", "--json", d], ("--json", "is a directory")),
]
for _id, _make, _expect in NOTHING_LOST:
    case(f"nothing-lost-{_id}", _make, *_expect, where="option")

# --------------------------------------------------------------------------
# Campaign state (fuzz --resume) and corpus directories (fuzz --corpus).
# --------------------------------------------------------------------------


def resume_state(content: str | bytes | None, kind: str = "file"):
    """``fuzz --resume`` on a corpus whose state file is ``content`` (None: no state file)."""

    def build(d: Path) -> list:
        from fuzz.campaign import CampaignConfig, state_path

        corpus = d / "corpus"
        corpus.mkdir()
        path = state_path(CampaignConfig(engine="gpu", profile="all", corpus=str(corpus)))
        if kind == "directory":
            path.mkdir()
        elif kind == "fifo":
            os.mkfifo(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        return ["fuzz", "--traces", "1", "--workers", "1", "--corpus", corpus, "--resume"]

    return build


RESUME = [
    ("no-state", resume_state(None), ("--resume", "no campaign state")),
    ("empty", resume_state(""), ("--resume", "empty")),
    ("binary", resume_state(bytes(range(256))), ("--resume",)),
    ("truncated", resume_state('{"format": "batchspec-campaign", "seed": 0, "engi'), ("--resume",)),
    ("a-trace", resume_state(lines(HEADER, REQ)), ("--resume",)),
    ("a-list", resume_state("[1, 2, 3]"), ("--resume",)),
    ("covered-a-string", resume_state(j({"covered": "ADMIT.NEW"})), ("--resume",)),
    ("nan", resume_state('{"seed": NaN}'), ("--resume",)),
    ("deep-nesting", resume_state("[" * 100_000 + "]" * 100_000), ("--resume",)),
    ("a-directory", resume_state(None, "directory"), ("--resume",)),
    ("a-fifo", resume_state(None, "fifo"), ("--resume",)),
]
for _id, _make, _expect in RESUME:
    case(f"fuzz-resume-{_id}", _make, *_expect, where="option")


def _corpus_below_a_file(d: Path) -> list:
    (d / "plain").write_text("x")
    return ["fuzz", "--traces", "1", "--corpus", d / "plain" / "corpus"]


def _corpus_fifo(d: Path) -> list:
    os.mkfifo(d / "corpus")
    return ["fuzz", "--traces", "1", "--corpus", d / "corpus"]


case("fuzz-corpus-below-a-file", _corpus_below_a_file, "--corpus", "not a directory", where="option")
case("fuzz-corpus-is-a-fifo", _corpus_fifo, "--corpus", "not a directory", where="option")
case("conform-save-divergent-is-a-file", lambda d: ["conform", "--engine", "spec", "--traces", "1", "--save-divergent", _fill("{file}", d)],
     "--save-divergent", "not a directory", where="option")

CAPABILITIES = [
    ("empty", text_file("cap.json", ""), ("cap.json:1: (file)", "empty")),
    ("not-json", text_file("cap.json", "knobs: all"), ("cap.json:1: (file)", "invalid JSON")),
    ("nan", text_file("cap.json", '{"knobs": {"watermark": {"min": NaN, "max": 0.5}}}'), ("cap.json:1: knobs.watermark.min", "NaN")),
    ("duplicate-key", text_file("cap.json", '{"knobs": {}, "knobs": {}}'), ("cap.json:1: knobs", "duplicate key")),
    ("deep-nesting", text_file("cap.json", "[" * 100_000 + "]" * 100_000), ("cap.json:1: (file)", "json_depth")),
    ("unknown-field", text_file("cap.json", j({"gpus": 8})), ("cap.json", "gpus")),
    ("directory", directory("cap.json"), ("cap.json:0: (file)", "directory")),
    ("fifo", fifo("cap.json"), ("cap.json:0: (file)", "not a regular file")),
    ("missing", missing("cap.json"), ("cap.json:0: (file)", "No such file")),
]
for _id, _make, _expect in CAPABILITIES:
    case(f"fuzz-capabilities-{_id}", lambda d, m=_make: ["fuzz", "--traces", "1", "--corpus", d / "corpus", "--capabilities", m(d)],
         *_expect, where=None)
for _id in ("nan", "fifo", "deep-nesting"):
    _make, _expect = {i: (m, e) for i, m, e in CAPABILITIES}[_id]
    case(f"conform-capabilities-{_id}", lambda d, m=_make: ["conform", "--engine", "spec", "--traces", "1", "--capabilities", m(d)],
         *_expect, where=None)
case("docs-out-is-a-file", lambda d: ["docs", "--check", "--out", _fill("{file}", d)], "--out", "not a directory", where="option")
case("prove-trace-dir-below-a-file", lambda d: ["prove", "--only", "mem", "--trace-dir", Path(_fill("{file}", d)) / "w"],
     "--trace-dir", "not a directory", where="option")

PLOTS_WITHOUT_MATPLOTLIB = [
    ("simulate-timeline", lambda d: ["simulate", _good_trace(d), "--cost-model", "unit", "--timeline", d / "t.png", "--json", d / "m.json"]),
    ("simulate-cdf", lambda d: ["simulate", _good_trace(d), "--cost-model", "unit", "--cdf", d / "c.svg"]),
    ("compare-cdf", lambda d: ["compare", _good_trace(d), "--cost-model", "unit", "--profiles", "vllm-v1", "--cdf", d / "c.png"]),
    ("sweep-plot", lambda d: ["sweep", _good_trace(d), "--cost-model", "unit", "--rates", "1", "--plot", d / "p.png"]),
]


# --------------------------------------------------------------------------
# Running a case.
# --------------------------------------------------------------------------


def snapshot(d: Path) -> dict[str, tuple]:
    """Every entry below ``d``: kind, size and modification time (what a write would change)."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = Path(root) / name
            st = p.lstat()
            out[str(p.relative_to(d))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def run_in_process(argv: list, capsys) -> tuple[int, str, str, float]:
    start = time.monotonic()
    code = main([str(a) for a in argv])
    seconds = time.monotonic() - start
    captured = capsys.readouterr()
    return code, captured.out, captured.err, seconds


def assert_refused(code: int, out: str, err: str, seconds: float, c: Case, d: Path, before: dict) -> None:
    assert "Traceback" not in out + err, err
    assert code == 2, f"exit {code}; stderr: {err!r}; stdout tail: {out[-300:]!r}"
    error_lines = [line for line in err.splitlines() if line.strip()]
    assert len(error_lines) == 1, f"expected one line on stderr, got {len(error_lines)}: {err!r}"
    line = error_lines[0]
    for word in c.expect:
        assert word.replace("{dir}", str(d)) in line, f"{word!r} not in {line!r}"
    if c.where == "file":
        assert re.search(r"\S+:\d+: \S", line), f"not FILE:LINE: FIELD: {line!r}"
    assert seconds < SECONDS, f"took {seconds:.1f} s"
    assert snapshot(d) == before, "the command wrote or changed a file"


def _param(c: Case):
    return pytest.param(c, id=c.id, marks=c.marks)


@pytest.mark.parametrize("c", [_param(c) for c in CASES])
def test_refused(c: Case, tmp_path, capsys):
    argv = c.make(tmp_path)
    before = snapshot(tmp_path)
    code, out, err, seconds = run_in_process(argv, capsys)
    assert_refused(code, out, err, seconds, c, tmp_path, before)


@pytest.mark.parametrize("name, make", PLOTS_WITHOUT_MATPLOTLIB, ids=[n for n, _ in PLOTS_WITHOUT_MATPLOTLIB])
def test_plot_without_matplotlib_is_refused_before_the_run(name, make, tmp_path, capsys, monkeypatch):
    _matplotlib_missing(monkeypatch)
    argv = make(tmp_path)
    before = snapshot(tmp_path)
    code, out, err, seconds = run_in_process(argv, capsys)
    c = Case(name, make, ("matplotlib", "not installed"), where="option")
    assert_refused(code, out, err, seconds, c, tmp_path, before)
    assert "TTFT" not in out, "the simulation ran before the refusal"


def test_json_is_written_before_a_plot_fails(tmp_path, capsys, monkeypatch):
    """A plotting error after the run (here: the plot module raises) never loses the --json metrics."""
    from batchspec import plots

    def broken(*a, **k):
        raise ValueError("plot failed")

    monkeypatch.setattr(plots, "latency_cdfs", broken)
    code, out, err, _ = run_in_process(["simulate", _good_trace(tmp_path), "--cost-model", "unit", "--json", tmp_path / "m.json",
                                        "--cdf", tmp_path / "c.png"], capsys)
    assert code == 2 and "plot failed" in err
    assert json.loads((tmp_path / "m.json").read_text())["metrics"]["requests"] == 2


def test_a_200_mb_trace_is_refused_without_reading_it(tmp_path, capsys):
    """Not sparse: 200 MB of real request lines.  Refused on its size before a line is parsed,
    so peak memory stays far below the file size."""
    import tracemalloc

    path = tmp_path / "big.jsonl"
    line = (j(REQ) + "\n").encode()
    with open(path, "wb") as f:
        f.write((j(HEADER) + "\n").encode())
        chunk = line * (1024 * 1024 // len(line) + 1)
        for _ in range(200):
            f.write(chunk)
    tracemalloc.start()
    code, out, err, seconds = run_in_process(["run", path], capsys)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert code == 2 and "limit trace_bytes" in err and seconds < SECONDS
    assert peak < 50 * 1024 * 1024, f"peak {peak / 1e6:.0f} MB while refusing a 200 MB file"


def test_a_long_line_is_refused_while_reading(tmp_path, capsys):
    """One 40 MB line inside the file-size limit: read at most line_bytes + 1 of it."""
    import tracemalloc

    from spec.formats import LIMITS

    path = tmp_path / "long.jsonl"
    with open(path, "wb") as f:
        f.write((j(HEADER) + "\n").encode())
        f.write(b'{"id": "' + b"x" * (40 * 1024 * 1024) + b'"}\n')
    tracemalloc.start()
    code, out, err, seconds = run_in_process(["run", path], capsys)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert code == 2 and "long.jsonl:2: (line)" in err and "limit line_bytes" in err
    assert peak < 4 * LIMITS["line_bytes"], f"peak {peak / 1e6:.0f} MB"


# --------------------------------------------------------------------------
# A handful end to end, as a user runs them: real exit status, no traceback.
# --------------------------------------------------------------------------

SUBPROCESS = ["run-prompt-len-float", "run-request-deep-nesting", "run-fifo", "check-log-step-huge", "cost-model-fixed-nan",
              "calibrate-json-count-float", "fuzz-option-seconds-nan", "fuzz-option-set-num-blocks-0",
              "nothing-lost-run-log-is-the-trace", "nothing-lost-import-output-is-the-input"]


@pytest.mark.parametrize("case_id", SUBPROCESS)
def test_refused_as_a_subprocess(case_id, tmp_path):
    c = next(c for c in CASES if c.id == case_id)
    argv = c.make(tmp_path)
    before = snapshot(tmp_path)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "batchspec.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "80"})
    assert_refused(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start, c, tmp_path, before)


def counts_by_command() -> dict[str, int]:
    """Cases per command (for the issue's closing note): ``python tests/test_bad_input.py``."""
    from collections import Counter

    commands = ("check-log", "cost-model", "nothing-lost", "run", "explain", "replay", "generate", "simulate", "compare", "sweep",
                "calibrate", "import", "fuzz", "conform", "prove", "docs")
    out: Counter = Counter()
    for c in CASES:
        out[next(k for k in commands if c.id.startswith(k + "-"))] += 1
    out["plots-without-matplotlib"] = len(PLOTS_WITHOUT_MATPLOTLIB)
    return dict(out)


if __name__ == "__main__":
    counts = counts_by_command()
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"{name:28} {n:4}")
    print(f"{'total':28} {sum(counts.values()):4}")


@pytest.mark.parametrize("command", ["run", "check-log", "calibrate", "cost-model"])
def test_an_unreadable_file_is_refused(command, tmp_path, capsys, monkeypatch):
    """EACCES on open (simulated: root reads any file whatever its mode, see run-unreadable)."""
    import builtins

    import spec.io

    real_open = builtins.open

    def no_permission(path, *a, **k):
        if str(path).endswith(("t.jsonl", "l.jsonl", "r.json", "c.json")):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(spec.io, "open", no_permission, raising=False)
    files = {"run": ("t.jsonl", lines(HEADER, REQ)), "check-log": ("l.jsonl", lines(LOG_HEADER, REC0)),
             "calibrate": ("r.json", rows_json()), "cost-model": ("c.json", j(COST))}
    name, content = files[command]
    path = text_file(name, content)(tmp_path)
    argv = {"run": ["run", path], "check-log": ["check-log", path, "--trace", _good_trace(tmp_path)],
            "calibrate": ["calibrate", path, "-o", tmp_path / "out.json"],
            "cost-model": ["simulate", _good_trace(tmp_path), "--cost-model", path]}[command]
    before = snapshot(tmp_path)
    code, out, err, seconds = run_in_process(argv, capsys)
    assert_refused(code, out, err, seconds, Case(command, None, (f"{name}:0: (file)", "Permission denied")), tmp_path, before)


def test_a_corpus_directory_lists_only_regular_trace_files(tmp_path):
    """A FIFO or a directory named like a trace is skipped, not opened (a FIFO would block the replay)."""
    from fuzz.corpus import corpus_traces

    (tmp_path / "good.jsonl").write_text(lines(HEADER, REQ))
    os.mkfifo(tmp_path / "pipe.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    assert [p.name for p in corpus_traces(tmp_path)] == ["good.jsonl"]


def test_docs_list_every_limit_with_its_value():
    """docs/inputs.md states the limits the readers enforce; a changed limit must change the doc."""
    from spec.formats import LIMITS

    doc = (Path(__file__).parent.parent / "docs" / "inputs.md").read_text()
    for name, value in LIMITS.items():
        assert f"| `{name}` | {int(value):,} |" in doc, name
