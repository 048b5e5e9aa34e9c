"""Engine adapters registered for ``--engine NAME`` (beside ``spec`` and ``vllm`` in :mod:`fuzz.replay`).

* ``gpu``        — gpu_engine in scheduler-only mode (tokens synthesized): what fuzzing runs;
* ``gpu-model``  — gpu_engine running the tiny Llama (seed 0) through paged attention;
* ``reference``  — the spec's decisions driving the naive PyTorch model;
* a decision log written elsewhere is compared with :func:`fuzz.replay.replay_records`
  (``batchspec replay TRACE --engine-log LOG``).
"""
from __future__ import annotations

import atexit
import signal
import time

from fuzz.replay import register_engine
from spec.formats import Trace
from spec.protocol import Engine


def _gpu(trace: Trace) -> Engine:
    from gpu_engine.engine import GpuEngine

    return GpuEngine.from_trace(trace, log_state=True)  # state fields: a report names the cause


def _gpu_model(trace: Trace) -> Engine:
    from gpu_engine.engine import GpuEngine

    return GpuEngine.from_trace(trace, model="tiny")


def _reference(trace: Trace) -> Engine:
    from reference.engine import ReferenceEngine

    return ReferenceEngine.from_trace(trace, level="memory")


def token_divergence(trace: Trace):
    """gpu_engine running its model (the tiny Llama, seed 0, in float64 so that no near-tie of two
    logits can flip a greedy pick) against the reference engine (the spec's decisions, the same
    weights computed naively: dense attention over each request's own contiguous KV): the first
    token they sample differently, as a :class:`fuzz.diff.Divergence` of kind ``tokens``, or None.
    None too when gpu_engine's model mode refuses the configuration (async scheduling, drafts).

    A scheduler-only campaign never runs the model; its paged attention, KV writes and batch
    flattening are checked here (DESIGN: same weights and greedy decoding, the same tokens)."""
    import torch

    from fuzz.diff import TOKENS, Divergence
    from fuzz.replay import raised_at
    from gpu_engine.engine import GpuEngine
    from reference.engine import ReferenceEngine
    from spec.config import resolve
    from spec.protocol import drive

    limit = resolve(trace.config).max_steps
    try:
        engine = GpuEngine.from_trace(trace, model="tiny", level="memory", dtype=torch.float64)
    except ValueError:  # a configuration its model mode does not implement
        return None
    try:
        reference = drive(ReferenceEngine.from_trace(trace, level="memory"), trace, limit)
    except Exception:  # noqa: BLE001 (the spec's decisions cannot run it: nothing to compare)
        return None
    try:
        mine = drive(engine, trace, limit)
    except Exception as e:  # noqa: BLE001 (its crash with the model running is the finding)
        return Divergence(0, "error", None, raised_at(e), None, None, "gpu_engine raised with its model running",
                          TOKENS, "gpu_engine")
    want = _token_steps(reference)
    wrong = [(step, rid, i, got, ref) for rid, steps in _token_steps(mine).items()
             for i, ((step, got), (_, ref)) in enumerate(zip(steps, want.get(rid, []))) if got != ref]
    if not wrong:
        return None
    step, rid, i, got, ref = min(wrong)  # (each request's first is enough: the earliest step of all)
    return Divergence(step, "sampled", {rid: ref}, {rid: got}, rid, None,
                      f"output {i} of {rid}: the reference engine (same weights, dense attention) samples {ref}, "
                      f"gpu_engine's model {got}", TOKENS, "gpu_engine")


def _token_steps(records) -> dict[str, list[tuple[int, int]]]:
    """Each request's sampled tokens with the step of each, in order."""
    out: dict[str, list[tuple[int, int]]] = {}
    for rec in records:
        for rid, token in rec.sampled.items():
            out.setdefault(rid, []).append((rec.step, token))
    return out


register_engine("gpu", _gpu, "gpu_engine, scheduler-only (synthesized tokens): the fuzzing target")
register_engine("gpu-model", _gpu_model, "gpu_engine with the tiny Llama through paged attention")
register_engine("reference", _reference, "reference engine: the spec's decisions + a naive PyTorch model")

from fuzz.sglang_adapter import factory as _sglang  # noqa: E402  (imports without SGLang; it loads on first use)

register_engine("sglang", _sglang, "SGLang 0.5.23's scheduler in-process, fake model (own venv: scripts/sglang-env.sh)")


# -- a real engine's failures, caught where they happen (campaigns against vLLM, SGLang) ----------


class EngineHang(Exception):
    """An engine call did not return within its time limit (raised inside it by the watchdog)."""


class WatchedEngine:
    """An engine whose every call is bounded in time and whose crashes keep their traceback.

    A real engine that loops inside ``step()`` (a scheduler ``while`` that never ends) would
    otherwise cost the whole per-trace timeout and be killed with nothing to show.  Here a
    ``SIGALRM`` timer raises :class:`EngineHang` *inside* the looping code after ``seconds``:
    the hang becomes a finding at the step it happened, with the line it was stuck on, and
    can be shrunk like any other.  (Code stuck in C never sees the signal; the campaign's
    per-trace timeout, which kills the worker, remains the fallback.)  The timer is only armed
    in the main thread of a process that has ``SIGALRM``; elsewhere calls are not bounded.

    Every exception an engine call raises is re-raised unchanged after its full traceback is
    kept in :attr:`traceback` (the replay reports only the innermost frame)."""

    def __init__(self, engine, seconds: float | None):
        self.engine = engine
        self.name = getattr(engine, "name", type(engine).__name__)
        self.seconds = seconds
        self.hung: str | None = None  # which call hung, once one did
        self.traceback: str | None = None  # the full traceback of the first call that raised
        self.where: tuple[str, int, str] | None = None  # its innermost frame: file, line, function
        self.error_type: str | None = None
        self._armed = bool(seconds) and _can_alarm()

    def __getattr__(self, attr):  # anything else (log_state, scheduler handles) is the engine's
        return getattr(self.engine, attr)

    def add_request(self, request) -> None:
        return self._call("add_request", request)

    def abort_request(self, request_id: str) -> None:
        return self._call("abort_request", request_id)

    def has_unfinished_requests(self) -> bool:
        return self._call("has_unfinished_requests")

    def step(self):
        return self._call("step")

    def _call(self, method: str, *args):
        if not self._armed:
            try:
                return getattr(self.engine, method)(*args)
            except Exception as e:
                self._keep(e)
                raise
        # the deadline is kept in Python; the timer is armed only when none is pending, and its
        # handler re-arms it up to the running call's deadline (see _on_alarm): no system call
        # per engine call (a signal.signal and two setitimer calls each cost ~10% of a campaign)
        deadline = time.monotonic() + self.seconds
        _WATCH["call"], _WATCH["seconds"], _WATCH["deadline"] = method, self.seconds, deadline
        if not _WATCH["armed"] or _WATCH["fires"] > deadline:  # (a shorter limit than the pending timer's)
            if signal.getsignal(signal.SIGALRM) is not _on_alarm:
                _WATCH["previous"] = signal.signal(signal.SIGALRM, _on_alarm)
                atexit.register(_disarm)  # (a timer pending at exit would fire on the default handler)
            _WATCH["armed"], _WATCH["fires"] = True, deadline
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        try:
            return getattr(self.engine, method)(*args)
        except EngineHang as e:
            self.hung = self.hung or method
            self._keep(e)
            raise
        except Exception as e:
            self._keep(e)
            raise
        finally:
            _WATCH["call"] = None

    def _keep(self, e: BaseException) -> None:
        """The first failure's full traceback and innermost frame (later ones follow from it)."""
        import traceback

        if self.traceback is not None:
            return
        self.traceback = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        frames = traceback.extract_tb(e.__traceback__)
        if isinstance(e, EngineHang) and len(frames) > 1:
            frames = frames[:-1]  # the innermost frame is the watchdog's handler; the engine was one up
        self.where = (frames[-1].filename, frames[-1].lineno, frames[-1].name) if frames else None
        self.error_type = type(e).__name__


#: the watched engine call now running (None between calls), its deadline (time.monotonic()),
#: whether the SIGALRM timer is pending and when it fires, and the SIGALRM handler found when
#: it was installed
_WATCH: dict = {"call": None, "seconds": 0.0, "deadline": 0.0, "armed": False, "fires": 0.0, "previous": None}


def _on_alarm(signum, frame):
    """The timer fired: a watched call past its deadline is interrupted (:class:`EngineHang`
    raised inside it); one still within it re-arms the timer for the time it has left.  The
    timer was armed by an earlier call, at the latest when this one began, so it never fires
    after the running call's deadline.  Between calls nothing happens (the next call re-arms);
    a timer someone else armed goes to the handler that was installed before."""
    _WATCH["armed"] = False
    if _WATCH["call"] is None:
        if callable(_WATCH["previous"]):
            _WATCH["previous"](signum, frame)
        return
    left = _WATCH["deadline"] - time.monotonic()
    if left > 0:
        _WATCH["armed"], _WATCH["fires"] = True, _WATCH["deadline"]
        signal.setitimer(signal.ITIMER_REAL, left)
        return
    raise EngineHang(f"{_WATCH['call']}() did not return within {_WATCH['seconds']:g} s")


def _disarm() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    _WATCH["armed"] = False


def _can_alarm() -> bool:
    import threading

    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
