"""Reading and writing traces and decision logs.

Input files are data: they are parsed as JSON and validated against the
shipped JSON Schemas (``spec/schemas/``), then checked for what a schema
cannot say (duplicate ids, arrival order, token ids inside the vocabulary,
size limits).  Every problem is reported as ``FILE:LINE: FIELD: PROBLEM``.
Writes go to a temporary file that is renamed into place, so a failed or
interrupted write never leaves half a file.
"""
from __future__ import annotations

import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator

from spec.config import ConfigError, resolve
from spec.formats import (
    DEFAULT_EOS_TOKEN_ID,
    DEFAULT_VOCAB_SIZE,
    LIMITS,
    LOG_FORMAT,
    TRACE_FORMAT,
    DecisionLog,
    StepRecord,
    Trace,
    TraceRequest,
)

SCHEMA_DIR = Path(__file__).parent / "schemas"


class FormatError(ValueError):
    """A file is not a valid trace or log.  ``str()`` is ``FILE:LINE: FIELD: PROBLEM``."""

    def __init__(self, path: str, line: int, field: str, problem: str):
        super().__init__(f"{path}:{line}: {field}: {problem}")
        self.path, self.line, self.field, self.problem = str(path), line, field, problem


@lru_cache(maxsize=None)
def _validator(name: str):
    import jsonschema  # only file loading needs it; engines and the spec's semantics do not

    schema = json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())
    return jsonschema.Draft202012Validator(schema)


def schema(name: str) -> dict:
    """A shipped JSON Schema by name (``trace-header``, ``trace-request``, ``log-header``, ``log-record``)."""
    return json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())


def _check_schema(name: str, obj: Any, path: str, line: int) -> None:
    errors = sorted(_validator(name).iter_errors(obj), key=lambda e: (len(e.absolute_path), e.message))
    if not errors:
        return
    err = errors[0]
    where = ".".join(str(p) for p in err.absolute_path) or "(line)"
    message = err.message
    if err.validator == "additionalProperties":
        message = "unknown field: " + message.split("(")[-1].rstrip(")").replace(" were unexpected", "").replace(" was unexpected", "")
    elif err.validator == "required" and where == "(line)":
        where = message.split("'")[1] if "'" in message else where
        message = "missing required field"
    elif err.validator == "oneOf" and where == "(line)":
        where, message = "prompt", "give exactly one of prompt (token ids) or prompt_len"
    elif err.validator == "anyOf" and where == "(line)":
        where, message = "arrival_step", "give arrival_step (or arrival_time in seconds)"
    raise FormatError(path, line, where, message)


def _json_lines(path: str) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, parsed object)`` for each non-blank line."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise FormatError(path, 0, "(file)", e.strerror or str(e)) from None
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if len(raw) > LIMITS["line_bytes"]:
            raise FormatError(path, number, "(line)", f"longer than the limit line_bytes={LIMITS['line_bytes']}")
        if not raw.strip():
            continue
        try:
            yield number, json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            last = number == len(lines) and not data.endswith(b"\n")
            what = "truncated last line (no closing newline, invalid JSON)" if last else f"invalid JSON ({e})"
            raise FormatError(path, number, "(line)", what) from None


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace file; raise :class:`FormatError` on any problem."""
    path = str(path)
    rows = _json_lines(path)
    first = next(rows, None)
    if first is None:
        raise FormatError(path, 1, "(file)", "empty file: expected a header line")
    number, header = first
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        raise FormatError(path, number, "format", f"expected \"{TRACE_FORMAT}\" in the header line")
    _check_schema("trace-header", header, path, number)
    try:
        resolve(header["config"])
    except ConfigError as e:
        raise FormatError(path, number, f"config.{e.field}", e.problem) from None
    vocab = header.get("vocab_size", DEFAULT_VOCAB_SIZE)
    requests = [_request(obj, path, n, vocab) for n, obj in _limited(rows, path)]
    _check_requests(requests, path, number)
    return Trace(
        config=header["config"],
        requests=[r for r, _ in requests],
        vocab_size=vocab,
        eos_token_id=header.get("eos_token_id", DEFAULT_EOS_TOKEN_ID),
        name=header.get("name"),
        description=header.get("description"),
        source=path,
    )


def _limited(rows: Iterable[tuple[int, Any]], path: str) -> Iterator[tuple[int, Any]]:
    for count, (number, obj) in enumerate(rows, start=1):
        if count > LIMITS["requests"]:
            raise FormatError(path, number, "(file)", f"more requests than the limit requests={LIMITS['requests']}")
        yield number, obj


def _request(obj: Any, path: str, line: int, vocab: int) -> tuple[TraceRequest, int]:
    _check_schema("trace-request", obj, path, line)
    req = TraceRequest.from_json(obj)
    for name in ("prompt_len", "max_tokens"):
        if getattr(req, name) > LIMITS[name]:
            raise FormatError(path, line, name, f"{getattr(req, name)} exceeds the limit {name}={LIMITS[name]}")
    if req.prefix_group is not None and req.prefix_len > req.prompt_len:
        raise FormatError(path, line, "prefix_len", f"{req.prefix_len} is longer than the prompt ({req.prompt_len})")
    for name in ("prompt", "stop_token_ids", "output_tokens"):
        bad = [t for t in (getattr(req, name) or ()) if t >= vocab]
        if bad:
            raise FormatError(path, line, name, f"token id {bad[0]} outside the vocabulary (vocab_size {vocab})")
    if req.abort_at is not None and req.arrival_step is not None and req.abort_at < req.arrival_step:
        raise FormatError(path, line, "abort_at", f"{req.abort_at} is before arrival_step {req.arrival_step}")
    return req, line


def _check_requests(requests: list[tuple[TraceRequest, int]], path: str, header_line: int) -> None:
    seen: dict[str, int] = {}
    last_step, last_time = 0, 0.0
    for req, line in requests:
        if req.id in seen:
            raise FormatError(path, line, "id", f"duplicate id {req.id!r} (first on line {seen[req.id]})")
        seen[req.id] = line
        if req.arrival_step is not None:
            if req.arrival_step < last_step:
                raise FormatError(path, line, "arrival_step", f"{req.arrival_step} < {last_step} on an earlier line (lines must be in arrival order)")
            last_step = req.arrival_step
        if req.arrival_time is not None:
            if req.arrival_time < last_time:
                raise FormatError(path, line, "arrival_time", f"{req.arrival_time} < {last_time} on an earlier line (lines must be in arrival order)")
            last_time = req.arrival_time


def atomic_write_lines(path: str | os.PathLike, objects: Iterable[dict]) -> None:
    """Write JSON lines to ``path`` through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            for obj in objects:
                f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; these are ordinary data files
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_trace(trace: Trace, path: str | os.PathLike) -> None:
    atomic_write_lines(path, [trace.header_json(), *(r.to_json() for r in trace.requests)])


def write_log(log: DecisionLog, path: str | os.PathLike) -> None:
    atomic_write_lines(path, [log.header_json(), *(r.to_json(log.level) for r in log.records)])


def load_log(path: str | os.PathLike) -> DecisionLog:
    """Read and validate a decision log; raise :class:`FormatError` on any problem."""
    path = str(path)
    rows = _json_lines(path)
    first = next(rows, None)
    if first is None:
        raise FormatError(path, 1, "(file)", "empty file: expected a header line")
    number, header = first
    if not isinstance(header, dict) or header.get("format") != LOG_FORMAT:
        raise FormatError(path, number, "format", f"expected \"{LOG_FORMAT}\" in the header line")
    _check_schema("log-header", header, path, number)
    records: list[StepRecord] = []
    last = -1
    for n, obj in rows:
        _check_schema("log-record", obj, path, n)
        if obj["step"] <= last:
            raise FormatError(path, n, "step", f"{obj['step']} does not increase (previous {last})")
        last = obj["step"]
        records.append(StepRecord.from_json(obj))
    return DecisionLog(
        engine=header["engine"], level=header["level"], records=records,
        trace=header.get("trace"), config=header.get("config"), source=path,
    )
