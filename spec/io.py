"""Reading and writing traces and decision logs, and checking every input a command takes.

Input files are data.  Before a byte is read, the path must be a regular file
(a directory is refused; a FIFO is refused without opening it, which would
block) under a size limit.  Lines are then streamed: each is bounded
(``line_bytes``), its nesting measured before parsing (``json_depth``), and
parsed strictly (NaN, Infinity, integers beyond ``int_abs`` and duplicate keys
are refused, naming the field).  Each line is validated against the shipped
JSON Schemas (``spec/schemas/``; an integer field takes no ``10.0`` and no
``true``), then checked for what a schema cannot say (duplicate ids, arrival
order, token ids inside the vocabulary, the ``LIMITS`` of
:mod:`spec.formats`).  Every problem is one :class:`FormatError`,
``FILE:LINE: FIELD: PROBLEM``; a bad option value is an :class:`OptionError`,
``OPTION: PROBLEM``.

Writes go to a temporary file that is renamed into place, so a failed or
interrupted write never leaves half a file; :func:`check_outputs` refuses,
before any work, an output path that is one of the command's inputs.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator

from spec.config import ConfigError, resolve
from spec.formats import (
    DEFAULT_EOS_TOKEN_ID,
    DEFAULT_VOCAB_SIZE,
    FORMAT_VERSION,
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
    """A file is not a valid trace or log.  ``str()`` is ``FILE:LINE: FIELD: PROBLEM``.

    Line 0 means the file as a whole (it is missing, a directory, too large, ...).
    """

    def __init__(self, path: str, line: int, field: str, problem: str):
        super().__init__(f"{path}:{line}: {field}: {problem}")
        self.path, self.line, self.field, self.problem = str(path), line, field, problem


class OptionError(ValueError):
    """A command-line option has a bad value.  ``str()`` is ``OPTION: PROBLEM``."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"{option}: {problem}")
        self.option, self.problem = option, problem


# --------------------------------------------------------------------------
# Opening input files: regular files only, size-limited before a byte is read.
# --------------------------------------------------------------------------


def open_input(path: str | os.PathLike, limit: str, limit_bytes: int | None = None):
    """Open ``path`` for binary reading after checking what it is.

    Refused (``FormatError`` at line 0): a missing or unreadable path, a
    directory, anything that is not a regular file (a FIFO would block the
    ``open`` itself, so the type is checked on ``stat`` first), and a file
    larger than ``LIMITS[limit]`` bytes (or ``limit_bytes``, a limit named ``limit`` elsewhere).
    """
    path = str(path)
    size_limit = LIMITS[limit] if limit_bytes is None else limit_bytes
    try:
        st = os.stat(path)
    except OSError as e:
        raise FormatError(path, 0, "(file)", e.strerror or str(e)) from None
    if stat.S_ISDIR(st.st_mode):
        raise FormatError(path, 0, "(file)", "is a directory, expected a file")
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(path, 0, "(file)", "not a regular file (a FIFO, socket or device), expected a file")
    if st.st_size > size_limit:
        raise FormatError(path, 0, "(file)", f"{st.st_size:,} bytes exceeds the limit {limit}={size_limit:,}")
    try:
        return open(path, "rb")
    except OSError as e:
        raise FormatError(path, 0, "(file)", e.strerror or str(e)) from None


# --------------------------------------------------------------------------
# Strict JSON: no NaN / Infinity, no huge integers, no duplicate keys, bounded nesting.
# --------------------------------------------------------------------------

#: Digits of the largest integer an input may hold (longer literals are refused unparsed).
_INT_DIGITS = len(str(LIMITS["int_abs"]))


class _Refused(Exception):
    """Raised from inside ``json.loads`` hooks; carries the field and the problem."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field, self.problem = field, problem


class _BadNumber:
    """Stands in for a number the formats refuse, so the walk after parsing can name its field."""

    def __init__(self, text: str, problem: str):
        self.text, self.problem = text, problem


#: A JSON string, removed before nesting is measured (its brackets are text).  Deep nesting
#: would make every recursive consumer of the parsed value fail, so it is refused unparsed.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_LONG_DIGITS = re.compile(rb"[0-9]{%d,}" % len(str(LIMITS["int_abs"])))


def _nesting(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (strings skipped), without parsing it."""
    if raw.count(b"[") + raw.count(b"{") <= LIMITS["json_depth"]:
        return 0  # cannot be deeper than the limit
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for c in brackets:
        if c == 91 or c == 123:  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
    return deepest


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(key, "duplicate key")
            seen.add(key)
    return out


def _constant(text: str):
    return _BadNumber(text, f"{text} is not a number (NaN and Infinity are refused)")


def _int(text: str):
    if len(text.lstrip("-")) > _INT_DIGITS or abs(int(text)) > LIMITS["int_abs"]:
        shown = text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"
        return _BadNumber(text, f"integer {shown} exceeds the limit int_abs={LIMITS['int_abs']}")
    return int(text)


def _float(text: str):
    value = float(text)
    if not math.isfinite(value):
        return _BadNumber(text, f"{text} is not a finite number")
    return value


def _first_bad_number(obj: Any) -> tuple[str, _BadNumber] | None:
    """The first refused number in ``obj`` and its dotted path (iterative: depth is bounded anyway)."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, _BadNumber):
            return where or "(line)", value
        if isinstance(value, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((f"{where}.{i}" if where else str(i), v) for i, v in reversed(list(enumerate(value))))
    return None


def parse_json(raw: bytes | str, path: str, line: int, truncated: bool = False) -> Any:
    """Parse one JSON value strictly; raise :class:`FormatError` naming the field on any problem."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    depth = _nesting(raw)
    if depth > LIMITS["json_depth"]:
        raise FormatError(path, line, "(line)", f"nesting deeper than the limit json_depth={LIMITS['json_depth']}")
    flagged = []

    def constant(text):
        flagged.append(text)
        return _constant(text)

    def integer(text):
        value = _int(text)
        if isinstance(value, _BadNumber):
            flagged.append(text)
        return value

    def number(text):
        value = _float(text)
        if isinstance(value, _BadNumber):
            flagged.append(text)
        return value

    # integers are checked one by one only when a long run of digits could hold a huge one
    hooks = {"parse_int": integer} if _LONG_DIGITS.search(raw) else {}
    try:
        obj = json.loads(raw, object_pairs_hook=_no_duplicate_keys, parse_constant=constant, parse_float=number, **hooks)
    except _Refused as e:
        raise FormatError(path, line, e.field, e.problem) from None
    except json.JSONDecodeError as e:
        what = "truncated (no closing newline, invalid JSON)" if truncated else f"invalid JSON ({e.msg} at column {e.colno})"
        raise FormatError(path, line, "(line)", what) from None
    except UnicodeDecodeError:
        raise FormatError(path, line, "(line)", "not UTF-8 text (a binary file?)") from None
    except (ValueError, RecursionError) as e:
        raise FormatError(path, line, "(line)", f"invalid JSON ({e})") from None
    if flagged:
        found = _first_bad_number(obj)
        if found:
            raise FormatError(path, line, found[0], found[1].problem)
    return obj


def read_json_document(path: str | os.PathLike, limit: str = "json_bytes",
                       limit_bytes: int | None = None) -> tuple[Any, str]:
    """Read a whole-file JSON document (cost model, calibration rows, campaign state).

    Returns the value and the text (to find the line of a field for messages).
    """
    path = str(path)
    size_limit = LIMITS[limit] if limit_bytes is None else limit_bytes
    with open_input(path, limit, size_limit) as f:
        data = f.read(size_limit + 1)
    if len(data) > size_limit:
        raise FormatError(path, 0, "(file)", f"exceeds the limit {limit}={size_limit:,} bytes")
    if not data.strip():
        raise FormatError(path, 1, "(file)", "empty file: expected a JSON document")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise FormatError(path, line, "(file)", "not UTF-8 text (a binary file?)") from None
    try:
        return parse_json(data, path, 1, truncated=False), text
    except FormatError as e:
        if e.field == "(line)" and e.problem.startswith("invalid JSON"):
            try:
                json.loads(text)
            except json.JSONDecodeError as d:
                raise FormatError(path, d.lineno, "(file)", f"invalid JSON ({d.msg} at column {d.colno})") from None
            except ValueError:
                pass
        raise FormatError(path, line_of(text, e.field), e.field if e.field != "(line)" else "(file)", e.problem) from None


def line_of(text: str, field: str) -> int:
    """The line of a whole-file JSON document on which ``field`` (dotted path) first appears, else 1."""
    key = field.rsplit(".", 1)[-1]
    if not key or key.startswith("("):
        return 1
    for number, line in enumerate(text.splitlines(), start=1):
        if f'"{key}"' in line:
            return number
    return 1


# --------------------------------------------------------------------------
# Schemas.
# --------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _validator(name: str):
    import jsonschema  # only file loading needs it; engines and the spec's semantics do not

    schema = json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())
    # JSON Schema calls 10.0 an integer; Python would then compute with a float.  An
    # integer field takes an integer literal only (and never a bool: True is an int in Python).
    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, x: isinstance(x, int) and not isinstance(x, bool))
    strict = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=checker)
    return strict(schema)


def schema(name: str) -> dict:
    """A shipped JSON Schema by name (``trace-header``, ``trace-request``, ``log-header``, ``log-record``)."""
    return json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())


@lru_cache(maxsize=None)
def _fast_check(name: str):
    from spec.schemacheck import compile_schema

    return compile_schema(schema(name))


def _check_schema(name: str, obj: Any, path: str, line: int) -> None:
    """Validate one line against a shipped schema.

    The compiled checker (:mod:`spec.schemacheck`, ~100x faster than jsonschema)
    decides; only a line it refuses goes through jsonschema, whose first error
    (shallowest, then by message) is the one reported.
    """
    from spec.schemacheck import SchemaError

    if not isinstance(obj, dict):
        raise FormatError(path, line, "(line)", f"expected a JSON object, got {type(obj).__name__}")
    try:
        _fast_check(name)(obj, ())
        return
    except SchemaError as fast:
        errors = sorted(_validator(name).iter_errors(obj), key=lambda e: (len(e.absolute_path), e.message)) or [fast]
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
    elif err.validator == "pattern" or err.validator == "propertyNames":
        message = f"{_short(err.instance)}: ids may not contain control characters or lone surrogates"
    elif err.validator in ("maxLength", "maxItems"):
        message = f"longer than the limit of {err.validator_value} " + ("characters" if err.validator == "maxLength" else "items")
    raise FormatError(path, line, where, message)


def _short(value: Any) -> str:
    text = ascii(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _json_lines(path: str, limit: str) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, parsed object)`` for each non-blank line, streaming.

    The file's size, each line's length and each value's nesting are checked
    before the bytes are parsed, so memory stays bounded by ``line_bytes``.
    """
    with open_input(path, limit) as f:
        total, number = 0, 0
        while True:
            raw = f.readline(LIMITS["line_bytes"] + 1)
            if not raw:
                return
            number += 1
            total += len(raw)
            if total > LIMITS[limit]:  # the file grew after the size check
                raise FormatError(path, number, "(file)", f"exceeds the limit {limit}={LIMITS[limit]:,} bytes")
            if len(raw) > LIMITS["line_bytes"]:
                raise FormatError(path, number, "(line)", f"longer than the limit line_bytes={LIMITS['line_bytes']:,}")
            if not raw.strip():
                continue
            # a line shorter than the limit without a newline is the last one, cut short
            yield number, parse_json(raw, path, number, truncated=not raw.endswith(b"\n"))


def _header(rows: Iterator[tuple[int, Any]], path: str, fmt: str, schema_name: str) -> tuple[int, dict]:
    """The first line: the format tag, then the header schema."""
    first = next(rows, None)
    if first is None:
        raise FormatError(path, 1, "(file)", "empty file: expected a header line")
    number, header = first
    if not isinstance(header, dict):
        raise FormatError(path, number, "(line)", f"expected a header object with \"format\": \"{fmt}\"")
    if header.get("format") != fmt:
        got = header.get("format")
        raise FormatError(path, number, "format",
                          f"expected \"{fmt}\" in the header line, got {_short(got) if got is not None else 'no format tag'}")
    version = header.get("version")
    if "version" in header and (type(version) is not int or version != FORMAT_VERSION):  # 1.0 and true equal 1 in Python
        raise FormatError(path, number, "version",
                          f"unsupported version {_short(header['version'])} (this batchspec reads version {FORMAT_VERSION})")
    _check_schema(schema_name, header, path, number)
    return number, header


def _check_config(raw: dict, path: str, line: int) -> None:
    try:
        resolve(raw)
    except ConfigError as e:
        raise FormatError(path, line, f"config.{e.field}", e.problem) from None


#: Why a step-by-step command refuses a request without ``arrival_step`` (load_trace(steps=True)).
NEEDS_ARRIVAL_STEP = ("missing (this trace gives arrival times in seconds; step-by-step commands need arrival_step: "
                      "re-import with `batchspec import --step-seconds S`, or use `batchspec simulate`, "
                      "which maps seconds to steps)")


def load_trace(path: str | os.PathLike, steps: bool = False) -> Trace:
    """Read and validate a trace file; raise :class:`FormatError` on any problem.

    The file is streamed: its size (``trace_bytes``), each line (``line_bytes``),
    the number of requests (``requests``) and every value are checked as it is read.
    ``steps=True`` is for the commands that replay a trace step by step (run, explain,
    replay, generate): a request with only ``arrival_time`` (seconds) is refused at its
    line, since steps are the only clock those commands have.
    """
    path = str(path)
    rows = _json_lines(path, "trace_bytes")
    number, header = _header(rows, path, TRACE_FORMAT, "trace-header")
    _check_config(header["config"], path, number)
    vocab = header.get("vocab_size", DEFAULT_VOCAB_SIZE)
    if vocab > LIMITS["vocab_size"]:
        raise FormatError(path, number, "vocab_size", f"{vocab} exceeds the limit vocab_size={LIMITS['vocab_size']}")
    eos = header.get("eos_token_id", DEFAULT_EOS_TOKEN_ID)
    if eos >= vocab:
        raise FormatError(path, number, "eos_token_id", f"{eos} is outside the vocabulary (vocab_size {vocab})")
    order = _ArrivalOrder(path)
    requests = []
    classes = header.get("slo_classes") or {}
    for n, obj in _limited(rows, path):
        req = _slo_checked(_request(obj, path, n, vocab), classes, path, n)
        if steps and req.arrival_step is None:
            raise FormatError(path, n, "arrival_step", NEEDS_ARRIVAL_STEP)
        order.check(req, n)
        requests.append(req)
    return Trace(
        config=header["config"],
        requests=requests,
        vocab_size=vocab,
        eos_token_id=eos,
        name=header.get("name"),
        description=header.get("description"),
        source=path,
        slo_classes=classes or None,
    )


def _slo_checked(req: TraceRequest, classes: dict, path: str, line: int) -> TraceRequest:
    """Issue 19: fill the targets a request leaves out from its ``slo_class``, and check the
    units: a step trace (``arrival_step`` only) counts targets in whole steps, at most the limit
    ``steps``; a timed trace (``arrival_time``, with or without steps) in seconds, at most the
    limit ``arrival_time``."""
    given = req
    if req.slo_class is not None:
        if req.slo_class not in classes:
            known = ", ".join(sorted(classes)) or "none in the header's slo_classes"
            raise FormatError(path, line, "slo_class", f"unknown class {req.slo_class!r} (known: {known})")
        targets = classes[req.slo_class]
        req = dataclasses.replace(req, ttft_slo=req.ttft_slo if req.ttft_slo is not None else targets.get("ttft"),
                                  tpot_slo=req.tpot_slo if req.tpot_slo is not None else targets.get("tpot"))
    steps = req.arrival_time is None  # a trace with arrival times counts seconds, even with arrival steps too
    for name in ("ttft_slo", "tpot_slo"):
        value = getattr(req, name)
        if value is None:
            continue
        where = name if value is getattr(given, name) else f"{name} (from slo_class {req.slo_class!r})"
        if steps and type(value) is not int:
            raise FormatError(path, line, where, f"{value!r} is not a whole number of steps (a step trace counts "
                                                 "targets in steps; seconds need arrival_time)")
        limit = ("steps", LIMITS["steps"]) if steps else ("arrival_time", LIMITS["arrival_time"])
        if value > limit[1]:
            raise FormatError(path, line, where, f"{value} exceeds the limit {limit[0]}={limit[1]:,}")
    if req.predicted_output_len is not None and req.predicted_output_len > LIMITS["max_tokens"]:
        raise FormatError(path, line, "predicted_output_len",
                          f"{req.predicted_output_len} exceeds the limit max_tokens={LIMITS['max_tokens']:,}")
    return req


def _limited(rows: Iterable[tuple[int, Any]], path: str) -> Iterator[tuple[int, Any]]:
    for count, (number, obj) in enumerate(rows, start=1):
        if count > LIMITS["requests"]:
            raise FormatError(path, number, "(file)", f"more requests than the limit requests={LIMITS['requests']:,}")
        yield number, obj


#: Request fields with an upper limit, and the limit's name.
_REQUEST_LIMITS = {"prompt_len": "prompt_len", "max_tokens": "max_tokens", "arrival_step": "steps",
                   "abort_at": "steps", "arrival_time": "arrival_time", "client_arrival_time": "arrival_time"}


#: Token-id arrays of a request, and the limit on their length.
_TOKEN_LISTS = {"prompt": "prompt_len", "stop_token_ids": "token_list", "output_tokens": "max_tokens"}


def _token_lists_checked(obj: Any, path: str, line: int) -> Any:
    """Check the token-id arrays here (length first, then a tight loop over the items) and
    return ``obj`` with each array cut to one item for the schema: a million-item array
    through jsonschema takes seconds."""
    if not isinstance(obj, dict):
        return obj
    short = None
    for name, limit in _TOKEN_LISTS.items():
        tokens = obj.get(name)
        if not isinstance(tokens, list) or len(tokens) <= 1:
            continue
        if len(tokens) > LIMITS[limit]:
            what = "prompt_len" if name == "prompt" else name
            raise FormatError(path, line, what, f"{len(tokens):,} tokens exceed the limit {limit}={LIMITS[limit]:,}")
        for i, t in enumerate(tokens):
            if type(t) is not int or t < 0:
                raise FormatError(path, line, f"{name}.{i}", f"{t!r} is not a token id (an integer >= 0)")
        short = short if short is not None else dict(obj)
        short[name] = tokens[:1]
    return obj if short is None else short


def _request(obj: Any, path: str, line: int, vocab: int) -> TraceRequest:
    _check_schema("trace-request", _token_lists_checked(obj, path, line), path, line)
    return check_request(TraceRequest.from_json(obj), path, line, vocab)


def check_request(req: TraceRequest, path: str, line: int, vocab: int) -> TraceRequest:
    """The checks of a trace request beyond its schema (limits, fields that bound each other),
    raising :class:`FormatError` at ``path:line``.  Whoever makes requests in memory (the
    shrinker) runs them too, so that every trace it writes reads back."""
    for name, limit in _REQUEST_LIMITS.items():
        value = getattr(req, name)
        if value is not None and value > LIMITS[limit]:
            raise FormatError(path, line, name, f"{value} exceeds the limit {limit}={LIMITS[limit]:,}")
    if abs(req.priority) > LIMITS["priority"]:
        raise FormatError(path, line, "priority", f"{req.priority} exceeds the limit |priority| <= {LIMITS['priority']}")
    if len(req.stop_token_ids) > LIMITS["token_list"]:
        raise FormatError(path, line, "stop_token_ids", f"{len(req.stop_token_ids)} ids exceed the limit token_list={LIMITS['token_list']}")
    if len(req.output_tokens) > LIMITS["max_tokens"]:
        raise FormatError(path, line, "output_tokens", f"{len(req.output_tokens)} tokens exceed the limit max_tokens={LIMITS['max_tokens']}")
    if req.prefix_group is not None and req.prefix_len > req.prompt_len:
        raise FormatError(path, line, "prefix_len", f"{req.prefix_len} is longer than the prompt ({req.prompt_len})")
    for name in ("prompt", "stop_token_ids", "output_tokens"):
        bad = [t for t in (getattr(req, name) or ()) if t >= vocab]
        if bad:
            raise FormatError(path, line, name, f"token id {bad[0]} outside the vocabulary (vocab_size {vocab})")
    if req.min_tokens > req.max_tokens:
        raise FormatError(path, line, "min_tokens", f"{req.min_tokens} is more than max_tokens ({req.max_tokens})")
    if req.spec_accept and req.spec_accept_rate is not None:
        raise FormatError(path, line, "spec_accept_rate", "give spec_accept or spec_accept_rate, not both")
    if len(req.spec_accept) > LIMITS["token_list"]:
        raise FormatError(path, line, "spec_accept", f"{len(req.spec_accept)} entries exceed the limit token_list={LIMITS['token_list']}")
    if req.abort_at is not None and req.arrival_step is not None and req.abort_at < req.arrival_step:
        raise FormatError(path, line, "abort_at", f"{req.abort_at} is before arrival_step {req.arrival_step}")
    return req


class _ArrivalOrder:
    """Unique ids and arrivals in file order, checked line by line as the trace streams in."""

    def __init__(self, path: str):
        self.path, self.seen, self.last_step, self.last_time = path, {}, 0, 0.0

    def check(self, req: TraceRequest, line: int) -> None:
        if req.id in self.seen:
            raise FormatError(self.path, line, "id", f"duplicate id {req.id!r} (first on line {self.seen[req.id]})")
        self.seen[req.id] = line
        if req.arrival_step is not None:
            if req.arrival_step < self.last_step:
                raise FormatError(self.path, line, "arrival_step",
                                  f"{req.arrival_step} < {self.last_step} on an earlier line (lines must be in arrival order)")
            self.last_step = req.arrival_step
        if req.arrival_time is not None:
            if req.arrival_time < self.last_time:
                raise FormatError(self.path, line, "arrival_time",
                                  f"{req.arrival_time} < {self.last_time} on an earlier line (lines must be in arrival order)")
            self.last_time = req.arrival_time


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


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_trace(trace: Trace, path: str | os.PathLike) -> None:
    atomic_write_lines(path, [trace.header_json(), *(r.to_json() for r in trace.requests)])


def write_log(log: DecisionLog, path: str | os.PathLike) -> None:
    atomic_write_lines(path, [log.header_json(), *(r.to_json(log.level) for r in log.records)])


def load_log(path: str | os.PathLike) -> DecisionLog:
    """Read and validate a decision log; raise :class:`FormatError` on any problem.

    Format only: the schemas, strictly increasing steps below the ``steps`` limit,
    ids without control characters.  Whether the log is consistent with itself and
    its trace is :mod:`invariants.log_checker`'s job.
    """
    path = str(path)
    rows = _json_lines(path, "log_bytes")
    number, header = _header(rows, path, LOG_FORMAT, "log-header")
    if header.get("config") is not None:
        _check_config(header["config"], path, number)
    records: list[StepRecord] = []
    last = -1
    for n, obj in rows:
        _check_schema("log-record", obj, path, n)
        if obj["step"] > LIMITS["steps"]:
            raise FormatError(path, n, "step", f"{obj['step']} exceeds the limit steps={LIMITS['steps']:,}")
        if obj["step"] <= last:
            raise FormatError(path, n, "step", f"{obj['step']} does not increase (previous {last})")
        last = obj["step"]
        records.append(StepRecord.from_json(obj))
    return DecisionLog(
        engine=header["engine"], level=header["level"], records=records,
        trace=header.get("trace"), config=header.get("config"), source=path,
    )


# --------------------------------------------------------------------------
# Option values shared by every command line (batchspec, fuzz campaigns).
# --------------------------------------------------------------------------

_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def parse_int_value(text: str, what: str, minimum: int | None = None, maximum: int = LIMITS["int_abs"]) -> int:
    """An integer written as one (``10``, not ``10.0``, ``1e3`` or ``true``), inside ``[minimum, maximum]``."""
    text = str(text).strip()
    if not _INT_TEXT.fullmatch(text) or len(text.lstrip("+-")) > _INT_DIGITS + 1:
        raise OptionError(what, f"expected an integer, got {_short(text)}")
    value = int(text)
    if minimum is not None and value < minimum:
        raise OptionError(what, f"must be >= {minimum}, got {value}")
    if value > maximum:
        raise OptionError(what, f"{value} exceeds the limit {maximum:,}")
    return value


def parse_float_value(text: str, what: str, minimum: float | None = None, maximum: float = 1e15,
                      exclusive_minimum: bool = False) -> float:
    """A finite number (never NaN or infinity), inside the given range."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise OptionError(what, f"expected a number, got {_short(text)}") from None
    if not math.isfinite(value):
        raise OptionError(what, f"must be a finite number, got {_short(text)}")
    if minimum is not None and (value <= minimum if exclusive_minimum else value < minimum):
        raise OptionError(what, f"must be {'>' if exclusive_minimum else '>='} {minimum:g}, got {value:g}")
    if value > maximum:
        raise OptionError(what, f"{value:g} exceeds the limit {maximum:g}")
    return value


def _knob_value(name: str, text: str, kind: type, option: str) -> Any:
    what = f"{option} {name}"
    if kind is bool:
        low = text.strip().lower()
        if low not in ("true", "false"):
            raise OptionError(what, f"expected true or false, got {_short(text)}")
        return low == "true"
    if kind is int:
        return parse_int_value(text, what)
    if kind is float:
        return parse_float_value(text, what, maximum=LIMITS["int_abs"])
    text = text.strip()
    if _CONTROL.search(text):
        raise OptionError(what, f"{_short(text)} contains a control character")
    return text


def check_knob(name: str, value: Any, option: str = "--set") -> None:
    """Refuse a knob value that is out of range for every profile (e.g. ``num_blocks=0``).

    The knob is checked on its own, over defaults that satisfy its cross-knob rules
    (``aging_steps`` needs a priority policy, ...); a conflict between knobs is
    reported later, when the full configuration is resolved.
    """
    import dataclasses

    from spec.config import SchedulerConfig, validate

    if name == "profile":
        from spec.config import PROFILES

        if value not in PROFILES:
            raise OptionError(f"{option} profile", f"unknown profile {_short(value)} (known: {', '.join(sorted(PROFILES))})")
        return
    base = SchedulerConfig(policy="priority" if name == "aging_steps" else "fcfs", null_block=name != "num_blocks")
    try:
        validate(dataclasses.replace(base, **{name: value}))
    except ConfigError as e:
        if e.field == name:
            raise OptionError(f"{option} {name}", e.problem) from None


def parse_knob_settings(text: str, option: str = "--set", allow_profile: bool = True) -> dict[str, Any]:
    """``knob=value,...`` from a command line: each value read as its knob's declared type and range-checked.

    ``10.0`` is not an integer, ``nan`` is not a number, ``yes`` is not a boolean,
    an unknown knob names the known ones.  Raises :class:`OptionError`.
    """
    import dataclasses

    from spec.config import SchedulerConfig, knob_names

    kinds = {f.name: {"int": int, "bool": bool, "float": float, "str": str}[str(f.type)]
             for f in dataclasses.fields(SchedulerConfig)}
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or not name:
            raise OptionError(option, f"expected knob=value, got {_short(part)}")
        if name not in kinds or (name == "profile" and not allow_profile):
            raise OptionError(option, f"unknown knob {_short(name)} (known: {', '.join(knob_names())})")
        if name in out:
            raise OptionError(option, f"knob {name} given twice")
        out[name] = _knob_value(name, value, kinds[name], option)
        check_knob(name, out[name], option)
    return out


def check_outputs(outputs: dict[str, str | os.PathLike | None], inputs: dict[str, str | os.PathLike | None]) -> None:
    """Refuse, before any work, an output path that would destroy an input or cannot be written.

    ``outputs`` and ``inputs`` map an option (``--log``, ``TRACE``) to a path.  An
    output that is an input (same file, through any link), a directory, below a
    non-directory, or the same as another output raises :class:`OptionError`.
    """
    seen: dict[str, str] = {}
    for option, out in outputs.items():
        if not out:
            continue
        out = str(out)
        if os.path.isdir(out):
            raise OptionError(option, f"{out} is a directory; give a file path")
        if os.path.exists(out) and not stat.S_ISREG(os.stat(out).st_mode):
            # a device or FIFO (/dev/stdout...): the rename would replace it with a plain file
            raise OptionError(option, f"{out} is not a regular file (a device or FIFO); give a file path")
        parent = os.path.dirname(os.path.abspath(out))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise OptionError(option, f"{out}: {parent} is not a directory")
        for in_option, src in inputs.items():
            if src and _same_file(out, str(src)):
                raise OptionError(option, f"{out} is also the input {in_option}; refusing to overwrite it")
        key = os.path.realpath(out)
        if key in seen:
            raise OptionError(option, f"{out} is also the output of {seen[key]}")
        seen[key] = option


def _same_file(a: str, b: str) -> bool:
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def check_input_file(path: str | os.PathLike) -> None:
    """Refuse a missing, unreadable or non-regular input (a directory, a FIFO) before any reader opens it.

    For readers that are not in this module (importers): opening a FIFO would block.
    """
    with open_input(path, "(no size limit)", limit_bytes=2**63):
        pass
