"""fuzz.engines.WatchedEngine's timer: armed once, not per call (#18 item 6), and still exact.

The deadline of each call is kept in Python; the SIGALRM timer is re-armed by its handler up to
the running call's deadline.  These tests check the three ways that could go wrong: a call
with a shorter limit than the pending timer's, many quick calls spanning several limits, and a
process that exits with the timer still pending."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from fuzz.engines import EngineHang, WatchedEngine, _can_alarm

pytestmark = pytest.mark.skipif(not _can_alarm(), reason="needs SIGALRM in the main thread")


class Quick:
    def step(self):
        return "ok"


class Spin:
    """Loops in Python (so the signal is seen) for ``seconds``."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def step(self):
        t = time.monotonic()
        while time.monotonic() - t < self.seconds:
            pass
        return "done"


def test_a_shorter_limit_than_the_pending_timer_is_kept():
    WatchedEngine(Quick(), 30.0).step()  # leaves a 30 s timer pending
    hung = WatchedEngine(Spin(5.0), 0.2)
    t = time.monotonic()
    with pytest.raises(EngineHang):
        hung.step()
    assert time.monotonic() - t < 2.0
    assert hung.hung == "step" and hung.where is not None and hung.where[2] == "step"


def test_quick_calls_spanning_many_limits_never_hang():
    w = WatchedEngine(Quick(), 0.25)  # (not shorter: a loaded machine may pause a process that long)
    t, n = time.monotonic(), 0
    while time.monotonic() - t < 1.2:  # ~5 limits' worth of time, each call far within its own
        assert w.step() == "ok"
        n += 1
    assert w.hung is None and n > 5


def test_a_call_within_its_limit_survives_the_timer_firing_during_it():
    WatchedEngine(Quick(), 0.1).step()  # the pending timer fires 0.1 s from now ...
    time.sleep(0.05)
    assert WatchedEngine(Spin(0.15), 0.5).step() == "done"  # ... inside this call, which has 0.5 s


def test_a_process_exits_cleanly_with_the_timer_pending():
    """Python resets SIGALRM to its default (terminate) while finalizing, after the atexit
    handlers: a timer still pending then would kill the process.  Simulated by an atexit
    handler registered first (so it runs last): default action, then time for the timer."""
    code = ("import atexit, signal, sys, time; sys.path.insert(0, '.')\n"
            "atexit.register(lambda: (signal.signal(signal.SIGALRM, signal.SIG_DFL), time.sleep(0.4)))\n"
            "from fuzz.engines import WatchedEngine\n"
            "class Q:\n    def step(self): return 1\n"
            "WatchedEngine(Q(), 0.2).step()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
