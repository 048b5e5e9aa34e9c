"""Importers: public LLM-serving traces to batchspec traces (arrivals in seconds).

Formats (``FORMATS``; ``detect`` picks one from the file's header line):

``azure``          Azure LLM inference trace 2023 (Splitwise): CSV ``TIMESTAMP,
                   ContextTokens,GeneratedTokens``, wall-clock timestamps with 7
                   fractional digits (100 ns), CRLF lines, no final newline.
``mooncake``       Mooncake FAST'25 JSONL: ``timestamp`` (ms), ``input_length``,
                   ``output_length``, ``hash_ids`` (one id per 512-token block);
                   shared leading ids become shared prompt prefixes.
``burstgpt``       BurstGPT CSV, read by column name (``Timestamp``, ``Request
                   tokens``, ``Response tokens``; optional ``Model``, ``Session ID``,
                   ``Log Type``); failed rows (zero tokens) are dropped and counted.
``lengths``        length-only tables (``num_prefill_tokens,num_decode_tokens``, the
                   Sarathi / Vidur ShareGPT and arXiv tables): arrivals come from a
                   seeded Poisson or gamma process.
``vidur``          Vidur trace-replay CSV: ``arrived_at`` (s), ``num_prefill_tokens``,
                   ``num_decode_tokens``.
``llmservingsim``  LLMServingSim JSONL: ``input_toks``, ``output_toks``,
                   ``arrival_time_ns``, optional ``input_tok_ids`` (kept as the
                   prompt, so prefix caching sees the real tokens).

Every imported request gets ``id = "r<row>"`` (its 0-based data row in the
source file, so sampling never renames a request), ``prompt_len`` = the
prompt tokens and ``max_tokens`` = the output tokens (synthetic tokens never
produce EOS, so each request generates exactly that many, unless the
profile's ``max_model_len`` cuts it).  Times are re-based so that the first
kept request arrives at 0.

Each request carries both clocks, so that every command accepts what an
import writes: ``arrival_time`` (seconds; what ``simulate``, ``compare`` and
``sweep`` read) and ``arrival_step = ceil(arrival_time / step_seconds)`` (what
``run``, ``explain``, ``replay`` and ``fuzz`` read, since they count steps, not
seconds).  The default of 1 s per step is the inverse of
:func:`fuzz.sweep.with_arrival_times`, which reads step ``k`` as ``k`` s.

Sampling, in this order (:class:`ImportOptions`): drop failed rows; keep the
time window ``[start, end)`` (seconds from the source's first row); keep the
first N; re-base to 0; divide times by the speed-up factor.

Bad input is a :class:`spec.io.FormatError` (``FILE:LINE: FIELD: PROBLEM``),
raised before anything is written; :func:`spec.io.write_trace` writes atomically.
"""
from __future__ import annotations

import csv
import datetime as dt
import json
import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from spec.config import ConfigError, resolve
from spec.formats import DEFAULT_VOCAB_SIZE, LIMITS, Trace, TraceRequest
from spec.io import FormatError, load_trace

#: Bytes in one imported file (a full Azure week is ~1.5 GB; the samples are < 2 MB).
MAX_FILE_BYTES = 4 * 1024**3
#: Mooncake's prefix-hash block: 512 tokens per ``hash_ids`` entry (FAST25-release/README.md).
MOONCAKE_BLOCK_TOKENS = 512

FORMATS = ("azure", "mooncake", "burstgpt", "lengths", "vidur", "llmservingsim")


@dataclass(frozen=True)
class ImportOptions:
    """How to sample and time an imported trace (see the module docstring for the order)."""

    speedup: float = 1.0  # divide every arrival time by this (2 = twice the rate)
    first: int | None = None  # keep the first N requests (after the window)
    window: tuple[float, float] | None = None  # keep arrivals in [start, end) seconds from the source's start
    config: dict[str, Any] = field(default_factory=lambda: {"profile": "vllm-v1"})  # the trace header's config
    tenant_column: str | None = None  # CSV column whose value becomes the request's tenant
    # length-only tables: the arrival process
    rate: float | None = None  # mean arrivals per second (required for "lengths")
    process: str = "poisson"  # "poisson" or "gamma"
    cv: float = 1.0  # gamma: coefficient of variation of the gaps (1 = Poisson; > 1 burstier)
    seed: int = 0
    keep_token_ids: bool = True  # llmservingsim: keep input_tok_ids as the prompt
    #: Seconds per step for ``arrival_step`` (the step-by-step commands' clock).
    step_seconds: float = 1.0


@dataclass
class ImportReport:
    """What an import read, dropped and produced (printed by ``batchspec import``)."""

    source: str
    format: str
    rows: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> rows
    requests: int = 0
    span_s: float = 0.0
    rate: float = 0.0  # mean arrivals per second after sampling and speed-up
    notes: list[str] = field(default_factory=list)


@dataclass
class Row:
    """One parsed source row, before sampling."""

    index: int  # 0-based data row
    line: int  # line in the file, for messages
    time: float  # seconds from an arbitrary origin
    prompt_len: int
    output_len: int
    tenant: str = "default"
    prompt: tuple[int, ...] | None = None
    prefix_group: str | None = None
    prefix_len: int = 0


# --------------------------------------------------------------------------
# Reading helpers: every problem is FILE:LINE: FIELD: PROBLEM.
# --------------------------------------------------------------------------


def _check_size(path: str) -> None:
    try:
        size = Path(path).stat().st_size
    except OSError as e:
        raise FormatError(path, 0, "(file)", e.strerror or str(e)) from None
    if size > MAX_FILE_BYTES:
        raise FormatError(path, 0, "(file)", f"{size} bytes exceeds the import limit of {MAX_FILE_BYTES} bytes")


def _csv_rows(path: str, required: tuple[str, ...]) -> Iterator[tuple[int, int, dict[str, str]]]:
    """Yield ``(data row index, line number, row)``; CRLF or LF, a BOM, no final newline are all fine."""
    _check_size(path)
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in required if c not in header]
        if missing:
            raise FormatError(path, 1, missing[0], f"missing column (header has: {', '.join(header) or 'nothing'})")
        for index, row in enumerate(reader):
            if index >= LIMITS["requests"]:
                raise FormatError(path, reader.line_num, "(file)", f"more rows than the limit requests={LIMITS['requests']}")
            if None in row:
                raise FormatError(path, reader.line_num, "(line)", f"{len(header) + len(row[None])} fields, header has {len(header)}")
            yield index, reader.line_num, row


def _jsonl_rows(path: str) -> Iterator[tuple[int, int, dict[str, Any]]]:
    _check_size(path)
    with open(path, "rb") as f:
        index = 0
        for number, raw in enumerate(f, start=1):
            if len(raw) > LIMITS["line_bytes"]:
                raise FormatError(path, number, "(line)", f"longer than the limit line_bytes={LIMITS['line_bytes']}")
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise FormatError(path, number, "(line)", f"invalid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise FormatError(path, number, "(line)", "expected a JSON object")
            if index >= LIMITS["requests"]:
                raise FormatError(path, number, "(file)", f"more rows than the limit requests={LIMITS['requests']}")
            yield index, number, obj
            index += 1


def _int(value: Any, path: str, line: int, name: str, whole_float: bool = False, limit: int = LIMITS["prompt_len"]) -> int:
    """A non-negative integer field up to ``limit`` (``"12"`` in CSV; ``12.0`` too when ``whole_float``)."""
    try:
        if isinstance(value, str):
            number = float(value) if whole_float else int(value.strip())
        elif isinstance(value, bool):
            raise ValueError
        else:
            number = value
        if isinstance(number, float):
            if not number.is_integer():
                raise ValueError
            number = int(number)
        if not isinstance(number, int):
            raise ValueError
    except (ValueError, TypeError):
        raise FormatError(path, line, name, f"expected an integer, got {value!r}") from None
    if number < 0:
        raise FormatError(path, line, name, f"must be >= 0, got {number}")
    if number > limit:
        raise FormatError(path, line, name, f"{number} exceeds the limit {limit}")
    return number


def _float(value: Any, path: str, line: int, name: str) -> float:
    try:
        number = float(value)
        if isinstance(value, bool) or not math.isfinite(number):
            raise ValueError
    except (ValueError, TypeError):
        raise FormatError(path, line, name, f"expected a finite number, got {value!r}") from None
    return number


def _field(obj: dict[str, Any], name: str, path: str, line: int) -> Any:
    if name not in obj:
        raise FormatError(path, line, name, "missing required field")
    return obj[name]


# --------------------------------------------------------------------------
# One reader per format: the file's rows as Row objects.
# --------------------------------------------------------------------------


def parse_azure_timestamp(text: str, path: str, line: int) -> int:
    """``2023-11-16 18:17:03.9799600`` to integer nanoseconds since 1970 (naive; the zone is unstated).

    Python's ``%f`` takes at most 6 digits and a float of seconds since 1970
    keeps only about 7 fractional digits, so the fraction is read as digits and
    the result is an exact integer (the trace's 100 ns resolution survives).
    """
    whole, _, frac = text.strip().partition(".")
    try:
        base = dt.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
        if frac and (not frac.isdigit() or len(frac) > 9):
            raise ValueError
    except ValueError:
        raise FormatError(path, line, "TIMESTAMP", f"expected YYYY-MM-DD HH:MM:SS[.fraction], got {text!r}") from None
    seconds = (base - dt.datetime(1970, 1, 1)) // dt.timedelta(seconds=1)
    return seconds * 1_000_000_000 + (int(frac.ljust(9, "0")) if frac else 0)


def read_azure(path: str, opts: ImportOptions, report: ImportReport) -> list[Row]:
    rows = []
    t0 = None
    for index, line, r in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        t = parse_azure_timestamp(r["TIMESTAMP"], path, line)
        t0 = t if t0 is None else t0
        rows.append(Row(index, line, (t - t0) / 1e9, _int(r["ContextTokens"], path, line, "ContextTokens"),
                        _int(r["GeneratedTokens"], path, line, "GeneratedTokens", limit=LIMITS["max_tokens"]),
                        _tenant(r, opts, path, line)))
    return rows


def _read_timed_csv(path: str, opts: ImportOptions, time: str, prompt: str, output: str) -> list[Row]:
    """A CSV with arrival seconds and prompt / output token counts in the named columns."""
    rows = []
    for index, line, r in _csv_rows(path, (time, prompt, output)):
        rows.append(Row(index, line, _float(r[time], path, line, time),
                        _int(r[prompt], path, line, prompt, whole_float=True),
                        _int(r[output], path, line, output, whole_float=True, limit=LIMITS["max_tokens"]),
                        _tenant(r, opts, path, line)))
    return rows


def read_burstgpt(path: str, opts: ImportOptions, report: ImportReport) -> list[Row]:
    return _read_timed_csv(path, opts, "Timestamp", "Request tokens", "Response tokens")


def read_vidur(path: str, opts: ImportOptions, report: ImportReport) -> list[Row]:
    return _read_timed_csv(path, opts, "arrived_at", "num_prefill_tokens", "num_decode_tokens")


def read_lengths(path: str, opts: ImportOptions, report: ImportReport) -> list[Row]:
    if opts.rate is None or not opts.rate > 0:
        raise FormatError(path, 1, "(arrivals)", "a length-only table has no arrival times: give a rate > 0 (--rate)")
    rows = []
    for index, line, r in _csv_rows(path, ("num_prefill_tokens", "num_decode_tokens")):
        rows.append(Row(index, line, 0.0, _int(r["num_prefill_tokens"], path, line, "num_prefill_tokens", whole_float=True),
                        _int(r["num_decode_tokens"], path, line, "num_decode_tokens", whole_float=True, limit=LIMITS["max_tokens"]),
                        _tenant(r, opts, path, line)))
    for row, t in zip(rows, arrival_process(len(rows), opts.rate, opts.process, opts.cv, opts.seed)):
        row.time = t
    report.notes.append(f"arrivals: seeded {opts.process} process, rate {opts.rate:g}/s"
                        + (f", cv {opts.cv:g}" if opts.process == "gamma" else "") + f", seed {opts.seed}")
    return rows


def read_llmservingsim(path: str, opts: ImportOptions, report: ImportReport) -> list[Row]:
    rows = []
    for index, line, obj in _jsonl_rows(path):
        if "sub_requests" in obj:
            raise FormatError(path, line, "sub_requests", "agentic sessions are closed-loop (each call waits for the "
                              "previous one); only flat requests can be imported as an open-loop trace")
        prompt = None
        ids = obj.get("input_tok_ids")
        plen = _int(_field(obj, "input_toks", path, line), path, line, "input_toks")
        if ids is not None and opts.keep_token_ids:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise FormatError(path, line, "input_tok_ids", "expected a list of non-negative integers")
            if len(ids) != plen:
                raise FormatError(path, line, "input_tok_ids", f"{len(ids)} ids but input_toks is {plen}")
            prompt = tuple(ids)
        t_ns = _float(_field(obj, "arrival_time_ns", path, line), path, line, "arrival_time_ns")
        out = _int(_field(obj, "output_toks", path, line), path, line, "output_toks", limit=LIMITS["max_tokens"])
        rows.append(Row(index, line, t_ns / 1e9, plen, out, prompt=prompt))
    return rows


def read_mooncake(path: str, opts: ImportOptions, report: ImportReport) -> list[Row]:
    rows, chains = [], []
    for index, line, obj in _jsonl_rows(path):
        plen = _int(_field(obj, "input_length", path, line), path, line, "input_length")
        out = _int(_field(obj, "output_length", path, line), path, line, "output_length", limit=LIMITS["max_tokens"])
        hash_ids = _field(obj, "hash_ids", path, line)
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raise FormatError(path, line, "hash_ids", "expected a list of integers")
        if len(hash_ids) != math.ceil(plen / MOONCAKE_BLOCK_TOKENS):
            raise FormatError(path, line, "hash_ids", f"{len(hash_ids)} ids for {plen} tokens "
                              f"(expected ceil({plen}/{MOONCAKE_BLOCK_TOKENS}) = {math.ceil(plen / MOONCAKE_BLOCK_TOKENS)})")
        t = _float(_field(obj, "timestamp", path, line), path, line, "timestamp") / 1000.0
        rows.append(Row(index, line, t, plen, out))
        chains.append(hash_ids)
    assign_prefix_groups(rows, chains, MOONCAKE_BLOCK_TOKENS, report)
    return rows


def _tenant(row: dict[str, str], opts: ImportOptions, path: str, line: int) -> str:
    if opts.tenant_column is None:
        return "default"
    if opts.tenant_column not in row:
        raise FormatError(path, 1, opts.tenant_column, f"--tenant-column names no column (header has: {', '.join(k for k in row if k)})")
    return (row[opts.tenant_column] or "").strip()[:256] or "(none)"


READERS: dict[str, Callable[[str, ImportOptions, ImportReport], list[Row]]] = {
    "azure": read_azure,
    "mooncake": read_mooncake,
    "burstgpt": read_burstgpt,
    "lengths": read_lengths,
    "vidur": read_vidur,
    "llmservingsim": read_llmservingsim,
}


# --------------------------------------------------------------------------
# Shared prefixes from hash chains; arrival processes.
# --------------------------------------------------------------------------


def _trie_paths(chains: list[list[int]]) -> list[list[int]]:
    """Each chain as a path of trie nodes: node ``k`` of a path stands for the prefix
    ``chain[:k+1]`` (equal prefixes, equal nodes), numbered in order of first appearance."""
    nodes: dict[tuple[int, int], int] = {}
    paths = []
    for chain in chains:
        path, parent = [], -1
        for h in chain:
            parent = nodes.setdefault((parent, h), len(nodes))
            path.append(parent)
        paths.append(path)
    return paths


def assign_prefix_groups(rows: list[Row], chains: list[list[int]], block_tokens: int, report: ImportReport) -> None:
    """Turn per-block hash chains into (``prefix_group``, ``prefix_len``) pairs.

    The chains form a trie (a shared leading run of ids is a shared prefix).  A
    batchspec prefix group is one *chain* from the root: two requests of a group
    share ``min(prefix_len)`` tokens, requests of different groups share none.
    So the trie is cut into chains by heavy-path decomposition: each node
    continues along its child visited by the most requests (ties: the child
    seen first).  A request belongs to the chain it follows last, and
    ``prefix_len`` is how far it follows it.  A request that leaves its chain
    into blocks nobody else has stays in the chain, with ``prefix_len`` where it left.

    The result never invents sharing (the modelled shared prefix of two requests
    is never longer than their real one); it loses the sharing between
    different chains above their branch point (e.g. a system prompt shared by
    several conversations).  The report gives the share kept: modelled
    reusable tokens over real ones (:func:`reusable_tokens`).
    """
    paths = _trie_paths(chains)
    weight: Counter = Counter(node for path in paths for node in path)
    heavy: dict[int, int] = {}
    for path in paths:
        for parent, child in zip([-1] + path, path):
            best = heavy.get(parent)
            if best is None or (weight[child], -child) > (weight[best], -best):
                heavy[parent] = child
    for row, path in zip(rows, paths):
        if not path:
            continue
        top, depth = path[0], len(path)
        for i in range(1, len(path)):
            if heavy[path[i - 1]] != path[i]:  # a light edge: leave the current chain
                if weight[path[i]] < 2:
                    depth = i  # the rest is this request's own: stay, sharing up to here
                    break
                top = path[i]  # a shared branch: it is this request's chain from here
        row.prefix_group = f"p{top}"
        row.prefix_len = min(depth * block_tokens, row.prompt_len)
    real, modelled = reusable_tokens(rows, paths, block_tokens)
    if real:
        report.notes.append(f"shared prefixes: {modelled:,} of {real:,} reusable prompt tokens kept "
                            f"({modelled / real:.1%}) in {len({r.prefix_group for r in rows})} prefix groups")


def reusable_tokens(rows: list[Row], paths: list[list[int]], block_tokens: int) -> tuple[int, int]:
    """Prompt tokens that could hit a cache warmed by every earlier request: real and modelled.

    Real: each request's longest run of trie nodes already visited by an earlier
    request, in full blocks.  Modelled: the same under the prefix groups (the
    ``min`` of two ``prefix_len`` within a group), in full blocks.
    """
    seen: set[int] = set()
    longest: dict[str | None, int] = defaultdict(int)
    real = modelled = 0
    for row, path in zip(rows, paths):
        depth = 0
        while depth < len(path) and path[depth] in seen:
            depth += 1
        seen.update(path)
        full = row.prompt_len // block_tokens * block_tokens
        real += min(depth * block_tokens, full)
        modelled += min(longest[row.prefix_group], row.prefix_len, full)
        longest[row.prefix_group] = max(longest[row.prefix_group], row.prefix_len)
    return real, modelled


def arrival_process(n: int, rate: float, process: str = "poisson", cv: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` arrival times from 0: gaps i.i.d. exponential (Poisson) or gamma, mean ``1/rate``.

    Gamma gaps have shape ``1/cv**2`` and scale ``cv**2/rate``: ``cv = 1`` is
    Poisson, larger is burstier (vLLM's ``--burstiness`` is ``1/cv**2``).  The
    stream comes from ``random.Random(seed)``: same arguments, same times.
    """
    if process not in ("poisson", "gamma"):
        raise ValueError(f"process must be poisson or gamma, got {process!r}")
    if not rate > 0 or not cv > 0:
        raise ValueError("rate and cv must be > 0")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate) if process == "poisson" else rng.gammavariate(1 / cv**2, cv**2 / rate)
    return times


# --------------------------------------------------------------------------
# Format detection, sampling, and the trace.
# --------------------------------------------------------------------------


def detect(path: str) -> str:
    """The format of ``path`` from its first line: a CSV header's columns or a JSON line's keys."""
    try:
        with open(path, "rb") as f:
            first = f.readline(LIMITS["line_bytes"]).decode("utf-8-sig", errors="replace").strip()
    except OSError as e:
        raise FormatError(path, 0, "(file)", e.strerror or str(e)) from None
    if first.startswith("{"):
        try:
            keys = set(json.loads(first))
        except (json.JSONDecodeError, TypeError):
            raise FormatError(path, 1, "(line)", "starts like JSON but is not a JSON object") from None
        if "format" in keys:
            return "batchspec"
        if "hash_ids" in keys:
            return "mooncake"
        if keys & {"input_toks", "sub_requests"}:
            return "llmservingsim"
        raise FormatError(path, 1, "(format)", f"unknown JSON lines format (keys: {', '.join(sorted(keys))})")
    columns = set(next(csv.reader([first]), []))
    for fmt, needs in (("azure", {"TIMESTAMP", "ContextTokens"}), ("burstgpt", {"Request tokens", "Response tokens"}),
                       ("vidur", {"arrived_at", "num_prefill_tokens"}), ("lengths", {"num_prefill_tokens", "num_decode_tokens"})):
        if needs <= columns:
            return fmt
    raise FormatError(path, 1, "(format)", f"unknown format (first line: {first[:80]!r}); give --format")


def import_trace(path: str, fmt: str = "auto", opts: ImportOptions | None = None) -> tuple[Trace, ImportReport]:
    """Read ``path`` in format ``fmt`` (or detect it) and return the trace and a report."""
    path = str(path)
    opts = opts or ImportOptions()
    fmt = detect(path) if fmt == "auto" else fmt
    if fmt == "batchspec":
        raise FormatError(path, 1, "format", "already a batchspec trace; nothing to import")
    if fmt not in READERS:
        raise FormatError(path, 0, "(format)", f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    _check_options(opts, path)
    report = ImportReport(source=path, format=fmt)
    rows = READERS[fmt](path, opts, report)
    report.rows = len(rows)
    rows = _sample(rows, opts, report)
    requests = [_request(r, opts) for r in rows]
    _check_arrival_steps(requests, opts, path)
    report.requests = len(requests)
    if requests:
        report.span_s = requests[-1].arrival_time - requests[0].arrival_time
        report.rate = (len(requests) - 1) / report.span_s if report.span_s > 0 else 0.0
    vocab = max([DEFAULT_VOCAB_SIZE] + [max(r.prompt) + 1 for r in requests if r.prompt])
    trace = Trace(config=dict(opts.config), requests=requests, vocab_size=vocab, name=Path(path).stem,
                  description=f"imported from {Path(path).name} ({fmt})", source=path)
    return trace, report


def _check_options(opts: ImportOptions, path: str) -> None:
    if not opts.speedup > 0 or not math.isfinite(opts.speedup):
        raise FormatError(path, 0, "--speedup", f"must be a finite number > 0, got {opts.speedup}")
    if opts.first is not None and opts.first < 1:
        raise FormatError(path, 0, "--first", f"must be >= 1, got {opts.first}")
    if not opts.step_seconds > 0 or not math.isfinite(opts.step_seconds):
        raise FormatError(path, 0, "--step-seconds", f"must be a finite number > 0, got {opts.step_seconds}")
    if opts.window is not None and not opts.window[0] < opts.window[1]:
        raise FormatError(path, 0, "--window", f"start must be before end, got {opts.window}")
    try:
        resolve(opts.config)
    except ConfigError as e:
        raise FormatError(path, 0, f"config.{e.field}", e.problem) from None


def _sample(rows: list[Row], opts: ImportOptions, report: ImportReport) -> list[Row]:
    """Drop failed rows, sort by time (stable), apply the window and first N, re-base, speed up."""
    kept = []
    for r in rows:
        if r.prompt_len == 0 and r.output_len == 0:
            report.dropped["failed request (0 prompt and 0 output tokens)"] += 1
        elif r.prompt_len == 0:
            report.dropped["no prompt tokens"] += 1
        elif r.output_len == 0:
            report.dropped["no output tokens"] += 1
        else:
            kept.append(r)
    unsorted = sum(1 for a, b in zip(kept, kept[1:]) if b.time < a.time)
    if unsorted:
        kept.sort(key=lambda r: r.time)
        report.notes.append(f"{unsorted} rows were out of time order; sorted (stable)")
    if kept:
        origin = min(r.time for r in rows)
        if opts.window is not None:
            start, end = opts.window
            before = len(kept)
            kept = [r for r in kept if start <= r.time - origin < end]
            report.dropped[f"outside the window [{start:g}, {end:g}) s"] += before - len(kept)
        if opts.first is not None and len(kept) > opts.first:
            report.dropped[f"after the first {opts.first}"] += len(kept) - opts.first
            kept = kept[: opts.first]
    if kept:
        t0 = kept[0].time
        kept = [replace(r, time=(r.time - t0) / opts.speedup) for r in kept]
    report.dropped = Counter({k: v for k, v in report.dropped.items() if v})
    return kept


def arrival_step(seconds: float, step_seconds: float) -> int:
    """The first step that starts at or after ``seconds`` when each step lasts ``step_seconds``.

    A relative tolerance of 1e-9 absorbs float noise in the division, so that
    an arrival on a step boundary (0.6 s at 0.2 s per step) is that step, 3,
    whichever way the quotient rounds.
    """
    steps = seconds / step_seconds
    return max(0, math.ceil(steps - 1e-9 * max(1.0, steps)))


def _check_arrival_steps(requests: list[TraceRequest], opts: ImportOptions, path: str) -> None:
    """Refuse a trace whose last arrival step no step-by-step run could reach.

    ``drive`` stops at the profile's ``max_steps``, and the trace format caps
    steps at ``LIMITS["steps"]``; a longer trace needs more seconds per step.
    """
    if not requests:
        return
    last = requests[-1].arrival_step
    limit = min(resolve(opts.config).max_steps, LIMITS["steps"])
    if last >= limit:
        raise FormatError(path, 0, "--step-seconds",
                          f"the last arrival ({requests[-1].arrival_time:g} s) falls at step {last:,}, beyond "
                          f"max_steps {limit:,}; give more seconds per step (e.g. --step-seconds "
                          f"{requests[-1].arrival_time / (limit / 2):.3g}), a shorter --window or --set max_steps=N")


def _request(row: Row, opts: ImportOptions) -> TraceRequest:
    seconds = round(row.time, 9)
    return TraceRequest(
        id=f"r{row.index}",
        prompt_len=row.prompt_len,
        max_tokens=row.output_len,
        prompt=row.prompt,
        arrival_step=arrival_step(seconds, opts.step_seconds),
        arrival_time=seconds,
        prefix_group=row.prefix_group if row.prefix_len else None,
        prefix_len=row.prefix_len if row.prefix_group else 0,
        tenant=row.tenant,
    )


def load_any(path: str, fmt: str = "auto", opts: ImportOptions | None = None) -> tuple[Trace, ImportReport | None]:
    """A batchspec trace as it is, or any importable file imported in memory."""
    fmt = detect(str(path)) if fmt == "auto" else fmt
    if fmt == "batchspec":
        return load_trace(path), None
    return import_trace(str(path), fmt, opts)
