"""Calibrating the step cost model (:mod:`spec.costmodel`) from measured step times.

A measurement is one row per executed step: the batch's shape and how long
the step took::

    {"prefill_tokens": 512, "decode_seqs": 31, "kv_tokens": 40960, "seconds": 0.0183}

(JSON: a list of such objects, or ``{"rows": [...]}``; CSV: the same four
columns.)  :func:`fit` finds the non-negative coefficients that minimize the
squared error of ``fixed + a·prefill + b·decode + c·kv`` over the rows
(non-negative least squares; with four unknowns it is solved exactly by trying
every set of free coefficients, the others held at 0).  ``prefill_step=True``
(``batchspec calibrate --prefill-step``) adds ``d·[prefill > 0]``, a fixed cost of
any step that computes prompt tokens (``CostModel.per_prefill_step_s``); ``robust=True``
(``--robust``) fits the typical step, leaving out steps stalled by other processes.

Where the rows come from:

* :func:`measure` times any engine of the protocol in this process: it runs a
  trace step by step, times each ``step()`` (synchronizing CUDA when the
  engine runs on it) and reads the shape from the step record.  With
  ``gpu_engine.GpuEngine`` in model mode (``model=`` a ``LlamaConfig`` or a
  checkpoint folder, ``device="cuda"``) the times are real forward passes;
* any other engine's logs: per step, the number of prompt tokens computed, the
  sequences that decoded, the KV tokens their attention read, and the step's
  wall time (vLLM's ``--collect-detailed-traces`` or a profiler trace gives them).

``python -m fuzz.calibrate measure -o rows.json [--model 8b --device cuda]``
and ``python -m fuzz.calibrate fit rows.json -o cost.json --name my-gpu``
(``batchspec calibrate`` is the same fit); ``--cost-model cost.json`` then
uses the result in ``batchspec simulate / compare / sweep``.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from spec.costmodel import CostModel
from spec.formats import Trace, TraceRequest
from spec.io import FormatError, atomic_write_text
from spec.simulate import BatchTracker

COLUMNS = ("prefill_tokens", "decode_seqs", "kv_tokens", "seconds")
#: Rows in one calibration file.
MAX_ROWS = 1_000_000
#: Bytes in one calibration file (JSON or CSV), checked before and while reading.
MAX_FILE_BYTES = 128 * 1024 * 1024
#: Largest token / sequence count in one row (a step of 2^40 tokens is no measurement).
MAX_ROW_COUNT = 2**40
#: Longest step time in one row, in seconds (the cost model's coefficient limit).
MAX_ROW_SECONDS = 3600.0


@dataclass(frozen=True)
class Fit:
    """A fitted cost model and how well it explains the rows."""

    model: CostModel
    rows: int
    r_squared: float
    median_relative_error: float
    max_relative_error: float


def load_rows(path: str) -> list[tuple[int, int, int, float]]:
    """Read ``(prefill_tokens, decode_seqs, kv_tokens, seconds)`` rows from JSON or CSV.

    Refused with ``FILE:LINE: FIELD: problem``: anything that is not a regular
    file under ``MAX_FILE_BYTES``, invalid or non-strict JSON (NaN, duplicate
    keys, deep nesting), a count that is not a whole number (``10.5``, ``true``)
    or above ``MAX_ROW_COUNT``, a time that is not finite or above
    ``MAX_ROW_SECONDS``, more than ``MAX_ROWS`` rows, fewer than 4.
    """
    path = str(path)
    items = _csv_items(path) if path.endswith(".csv") else _json_items(path)
    rows = [_row(path, where, row) for where, row in items]
    if len(rows) < 4:
        raise FormatError(path, 0, "(file)", f"{len(rows)} rows: a fit of 4 coefficients needs at least 4")
    return rows


def _json_items(path: str):
    from spec.io import line_of, read_json_document

    obj, text = read_json_document(path, "MAX_FILE_BYTES", MAX_FILE_BYTES)
    if isinstance(obj, dict):
        unknown = sorted(set(obj) - {"rows"})
        if unknown:
            raise FormatError(path, line_of(text, unknown[0]), unknown[0], "unknown field (expected {\"rows\": [...]})")
        obj = obj.get("rows")
    if not isinstance(obj, list):
        raise FormatError(path, 1, "rows", "expected a list of rows (or {\"rows\": [...]})")
    if len(obj) > MAX_ROWS:
        raise FormatError(path, 0, "(file)", f"{len(obj):,} rows exceeds the limit MAX_ROWS={MAX_ROWS:,}")
    starts = _row_lines(text, len(obj))
    return list(zip(starts, obj))


def _row_lines(text: str, count: int) -> list[int]:
    """The line on which each row of the (already validated) JSON list starts, for messages."""
    import re

    decoder = json.JSONDecoder()
    m = re.search(r'"rows"\s*:\s*\[', text) if text.lstrip().startswith("{") else re.search(r"\[", text)
    pos, out = (m.end() if m else len(text)), []
    try:
        while len(out) < count:
            pos = len(text) - len(text[pos:].lstrip(" \t\r\n,"))
            out.append(text.count("\n", 0, pos) + 1)
            _, pos = decoder.raw_decode(text, pos)
    except ValueError:
        pass
    return out + [1] * (count - len(out))


def _csv_items(path: str):
    import io

    from spec.io import open_input

    raw = open_input(path, "MAX_FILE_BYTES", MAX_FILE_BYTES)
    with raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        try:
            names = reader.fieldnames or []
            missing = [c for c in COLUMNS if c not in names]
            if missing:
                raise FormatError(path, 1, missing[0], "missing column" if names else "empty file: expected a CSV header")
            for row in reader:
                if reader.line_num > MAX_ROWS + 1:
                    raise FormatError(path, reader.line_num, "(file)", f"more rows than the limit MAX_ROWS={MAX_ROWS:,}")
                if None in row:
                    raise FormatError(path, reader.line_num, "(row)", "more fields than the header has")
                yield reader.line_num, row
        except UnicodeDecodeError:
            raise FormatError(path, reader.line_num + 1, "(row)", "not UTF-8 text (a binary file?)") from None
        except csv.Error as e:
            raise FormatError(path, reader.line_num, "(row)", f"invalid CSV ({e})") from None


def _row(path: str, where: int, row: Any) -> tuple[int, int, int, float]:
    if not isinstance(row, dict):
        raise FormatError(path, where, "(row)", "expected an object with " + ", ".join(COLUMNS))
    unknown = sorted(set(row) - set(COLUMNS))
    if unknown and not path.endswith(".csv"):
        raise FormatError(path, where, str(unknown[0]), f"unknown field (known: {', '.join(COLUMNS)})")
    values: list[Any] = []
    for name in COLUMNS:
        if name not in row or row[name] in (None, ""):
            raise FormatError(path, where, name, "missing")
        values.append(_seconds(path, where, row[name]) if name == "seconds" else _count(path, where, name, row[name]))
    return values[0], values[1], values[2], values[3]


def _count(path: str, where: int, name: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(path, where, name, f"expected a whole number, got {value!r}")
    if not 0 <= value <= MAX_ROW_COUNT:
        raise FormatError(path, where, name, f"{value} is outside [0, MAX_ROW_COUNT={MAX_ROW_COUNT}]")
    return value


def _seconds(path: str, where: int, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise FormatError(path, where, "seconds", f"expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FormatError(path, where, "seconds", f"expected a number, got {value!r}")
    if not (math.isfinite(value) and 0 <= value <= MAX_ROW_SECONDS):
        raise FormatError(path, where, "seconds", f"must be a finite number >= 0 and <= MAX_ROW_SECONDS={MAX_ROW_SECONDS:g}, got {value!r}")
    return float(value)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: the best feasible unconstrained
    least-squares solution over every subset of free columns (exact for small ``a``)."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(b * b))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.all(sub >= 0):
                x = np.zeros(n)
                x[list(cols)] = sub
                err = float(np.sum((a @ x - b) ** 2))
                if err < best_err:
                    best, best_err = x, err
    return best


#: ``fit(robust=True)``: a row is an outlier when its residual is more than this many scaled
#: median absolute deviations from the median residual (3: ~0.3 % of rows of Gaussian noise).
OUTLIER_MADS = 3.0
#: Refits of the robust fit (each drops the current outliers of *all* rows, so it settles).
ROBUST_ROUNDS = 5


def fit(rows: list[tuple[int, int, int, float]], name: str = "calibrated", source: str = "",
        knobs: dict[str, Any] | None = None, prefill_step: bool = False, robust: bool = False) -> Fit:
    """The cost model that best explains ``rows`` (non-negative coefficients), and its errors.

    ``prefill_step``: also fit ``per_prefill_step_s``, a cost paid once by any step that computes
    prefill tokens (a fifth column: 1 where ``prefill_tokens > 0``).  Off by default, so a fit of
    the four classic coefficients is unchanged.

    ``robust``: fit the typical step, not the mean.  The fit is repeated (``ROBUST_ROUNDS``) on the
    rows whose residual under the previous fit lies within ``OUTLIER_MADS`` scaled MADs of the
    median residual.  Why: on a shared machine a step is now and then descheduled for tens of
    milliseconds by *other* processes (issue 17: a 2.5 ms decode step measured at 100 ms), a
    heavy tail that says nothing about the engine and, in a least-squares fit, moves every
    coefficient.  The errors reported are over all rows."""
    data = np.asarray(rows, dtype=float)
    columns = [np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2]]
    if prefill_step:
        columns.append((data[:, 0] > 0).astype(float))
    a = np.column_stack(columns)
    b = data[:, 3]
    x = _nnls_scaled(a, b)
    kept = len(rows)
    for _ in range(ROBUST_ROUNDS if robust else 0):
        residual = b - a @ x
        mad = 1.4826 * float(np.median(np.abs(residual - np.median(residual))))
        inliers = np.abs(residual - np.median(residual)) <= OUTLIER_MADS * mad + 1e-12
        if inliers.sum() < a.shape[1]:
            break
        x, kept = _nnls_scaled(a[inliers], b[inliers]), int(inliers.sum())
    x[0] = max(x[0], 1e-9)  # the model needs a positive fixed cost (at least 1 ns per step)
    pred = a @ x
    ss_res, ss_tot = float(np.sum((b - pred) ** 2)), float(np.sum((b - b.mean()) ** 2))
    rel = np.abs(pred - b) / np.maximum(b, 1e-12)
    how = f", robust: {kept} of them within {OUTLIER_MADS:g} MADs" if robust else ""
    model = CostModel(name=name, fixed_s=float(x[0]), per_prefill_token_s=float(x[1]), per_decode_seq_s=float(x[2]),
                      per_kv_token_s=float(x[3]), knobs=dict(knobs or {}),
                      source=(source or f"fitted to {len(rows)} measured steps (fuzz.calibrate)") + how,
                      per_prefill_step_s=float(x[4]) if prefill_step else 0.0)
    return Fit(model, len(rows), 1 - ss_res / ss_tot if ss_tot > 0 else 1.0, float(np.median(rel)), float(rel.max()))


def _nnls_scaled(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    return nnls(a / scale, b) / scale  # columns scaled to unit norm: tokens and seconds differ by 1e6


def calibration_trace(n: int = 96, seed: int = 0, max_prompt: int = 1024, max_output: int = 64) -> Trace:
    """Requests whose steps mix prefill chunks and decodes of many sizes (for :func:`measure`)."""
    rng = random.Random(seed)
    reqs = [TraceRequest(id=f"c{i}", prompt_len=rng.randint(8, max_prompt), max_tokens=rng.randint(1, max_output),
                         arrival_step=(i // 8) * rng.randint(1, 12)) for i in range(n)]
    reqs.sort(key=lambda r: r.arrival_step)
    return Trace(config={"profile": "vllm-v1"}, requests=reqs)


def measure(engine, trace: Trace, warmup: int = 5, sync=None) -> list[tuple[int, int, int, float]]:
    """Run ``trace`` through ``engine`` (arrivals by step) and time each step; return the rows.

    ``sync`` is called before each clock read (``torch.cuda.synchronize`` on a
    GPU).  The first ``warmup`` steps are run but not returned.
    """
    from spec.protocol import arrival_order

    pending, i, step = arrival_order(trace), 0, 0
    tracker = BatchTracker(trace.requests)
    rows = []
    while i < len(pending) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and pending[i].arrival_step > step:
            step = pending[i].arrival_step
        while i < len(pending) and pending[i].arrival_step <= step:
            engine.add_request(pending[i])
            i += 1
        if sync:
            sync()
        t0 = time.perf_counter()
        record = engine.step()
        if sync:
            sync()
        seconds = time.perf_counter() - t0
        shape, parts = tracker.shape(record)
        if parts and step >= warmup:
            rows.append((shape.prefill_tokens, shape.decode_seqs, shape.kv_tokens, seconds))
        step += 1
    return rows


def write_rows(rows, path: str) -> None:
    """Write measured rows as JSON through a temporary file and a rename."""
    atomic_write_text(path, json.dumps({"rows": [dict(zip(COLUMNS, r)) for r in rows]}))


def _write_json(path: str, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fuzz.calibrate", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    me = sub.add_parser("measure", help="time gpu_engine steps on a calibration trace")
    me.add_argument("-o", "--output", required=True)
    me.add_argument("--model", default="tiny", help="tiny, 8b (Llama-3-8B shapes, seeded weights) or a checkpoint folder")
    me.add_argument("--device", default="cpu")
    me.add_argument("--requests", type=int, default=96)
    me.add_argument("--num-blocks", type=int, default=4096)
    ft = sub.add_parser("fit", help="fit the cost model to measured rows")
    ft.add_argument("rows")
    ft.add_argument("-o", "--output", required=True)
    ft.add_argument("--name", default="calibrated")
    args = p.parse_args(argv)
    if args.cmd == "measure":
        import torch

        from gpu_engine import GpuEngine
        from gpu_engine.model import LlamaConfig
        from spec.config import resolve

        model = args.model
        if model == "8b":
            model = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)
        trace = calibration_trace(args.requests)
        cfg = resolve({"profile": "vllm-v1", "num_blocks": args.num_blocks})
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        engine = GpuEngine(cfg, trace.vocab_size, trace.eos_token_id, device=args.device, model=model, level="memory", dtype=dtype)
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else None
        rows = measure(engine, trace, sync=sync)
        write_rows(rows, args.output)
        print(f"{len(rows)} steps measured -> {args.output}")
        return 0
    result = fit(load_rows(args.rows), name=args.name)
    _write_json(args.output, result.model.to_json())
    print(json.dumps(result.model.to_json(), indent=1))
    print(f"R^2 {result.r_squared:.4f}, median relative error {result.median_relative_error:.1%}, "
          f"max {result.max_relative_error:.1%} over {result.rows} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
