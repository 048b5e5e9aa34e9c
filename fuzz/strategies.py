"""Hypothesis strategies for batchspec traces, for your own property-based tests.

Documentation: ``docs/strategies.md``.  The short version::

    from hypothesis import given, settings
    from fuzz.strategies import assert_agrees, traces

    @settings(max_examples=200, deadline=None)
    @given(traces(engine="mypkg.engine:make_engine", max_requests=6))
    def test_my_engine_agrees_with_the_spec(trace):
        assert_agrees(trace, "mypkg.engine:make_engine")   # on failure: a trace file + the replay command

:func:`traces` draws whole traces (configuration and requests) inside the knob
values an engine implements (its capability envelope, :mod:`fuzz.capabilities`);
:func:`assert_agrees` replays one against an engine and, when they disagree,
writes the minimal failing example as a trace file and prints the ``batchspec
replay`` command that reproduces it; :func:`note_trace` does the writing for a
property of your own.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from hypothesis import note, strategies as st
from hypothesis.errors import InvalidArgument

from fuzz import capabilities as caps
from invariants.strategies import configs
from spec.config import ConfigError, PROFILES, SchedulerConfig, resolve
from spec.formats import Trace, TraceRequest

__all__ = ["traces", "configs", "assert_agrees", "note_trace", "FAILURES_DIR"]

#: Where :func:`assert_agrees` and :func:`note_trace` write failing examples (``$BATCHSPEC_FAILURES`` overrides).
FAILURES_DIR = "batchspec-failures"

#: Candidate values of the workload sizes a configuration draws (kept where the envelope allows them).
_SIZES: dict[str, list] = {
    "block_size": [1, 2, 4, 8, 16],
    "max_num_seqs": [1, 2, 3, 4, 6, 128],
    "max_model_len": [8, 16, 24, 48, 96],
}


def traces(profile: str | None = None, knobs: Mapping[str, Any] | None = None, *, engine: str | None = None,
           capabilities: str | os.PathLike | Mapping | caps.Envelope | None = None, min_requests: int = 1,
           max_requests: int = 8, max_prompt_len: int = 60, max_tokens: int = 20, max_arrival_step: int = 12,
           ) -> st.SearchStrategy[Trace]:
    """A strategy for :class:`spec.formats.Trace` — a configuration header and its requests —
    that ``batchspec replay``, :func:`fuzz.replay.replay` and every engine accept.

    **What is drawn.**  A configuration: the profile's semantic knobs (queue policy, batching,
    reservation, chunking, prefix caching, preemption, caps, watermark), then workload sizes
    chosen to make schedulers work hard — 1- to 16-token blocks, 3 to 32 KV blocks (memory
    pressure: preemption, rejections), a token budget of 1 to 64 (chunked prefill), 1 to 6
    running requests, ``max_model_len`` 8 to 96.  Then ``min_requests`` to ``max_requests``
    requests: prompts of 1 to ``max_prompt_len`` tokens, some sharing a prefix group (prefix
    cache hits), 1 to ``max_tokens`` output tokens, arrivals at steps 0 to
    ``max_arrival_step``, priorities 0-3, tenants, EOS / stop tokens, ignore_eos, aborts.

    **Where.**  Only inside the knob values the engine implements: its *capability envelope*
    (:mod:`fuzz.capabilities`), taken from ``capabilities`` (a JSON file, a declaration dict
    or an :class:`fuzz.capabilities.Envelope`) or else from ``engine`` (a name for
    ``--engine``: built-in, registered, or ``MODULE:FACTORY`` with a ``capabilities``
    attribute).  Every knob the envelope declares is drawn over its allowed values; the
    other semantic knobs keep the envelope's profile's values.

    Args:
        profile: hold every semantic knob at this profile's values (``"naive"``, ``"tgi"``,
            ...; as ``batchspec fuzz --profile``); the sizes stay drawn.  It must lie inside
            the envelope.  Default: the envelope's profile, with its declared knobs drawn.
        knobs: knob values fixed in every trace, over the profile (as ``--set``), e.g.
            ``{"policy": "priority"}``; each must lie inside the envelope.
        engine: the engine whose declared envelope bounds the draws.
        capabilities: an envelope given directly (overrides ``engine``'s).
        min_requests, max_requests: how many requests (1 <= min <= max).
        max_prompt_len, max_tokens, max_arrival_step: bounds on each request.

    With no ``profile``, ``engine`` or ``capabilities`` it draws the whole scheduling map —
    every profile family's modes (swap, SGLang estimation, SPF, VTC, priority aging) — as
    the spec's own property tests do (``knobs`` still fixed over it).

    **Shrinking** goes toward fewer requests, shorter prompts, fewer output tokens, earlier
    arrivals, the first listed value of each knob and the smallest sizes.

    **A failing example** is printed by Hypothesis as a Python object; call
    :func:`assert_agrees` (or :func:`note_trace`) in the test to also get it as a trace file
    and the ``batchspec replay`` command that reproduces it.

    Raises :class:`hypothesis.errors.InvalidArgument` (when the strategy is built) for an
    unknown profile or knob, a value the envelope does not contain, or bad bounds.

    Example::

        @given(traces(profile="naive", knobs={"policy": "priority"}, max_requests=4))
        def test_priority_order(trace): ...
    """
    if not 1 <= min_requests <= max_requests:
        raise InvalidArgument(f"need 1 <= min_requests <= max_requests, got {min_requests}, {max_requests}")
    for name, value in (("max_prompt_len", max_prompt_len), ("max_tokens", max_tokens)):
        if value < 1:
            raise InvalidArgument(f"{name} must be >= 1, got {value}")
    if max_arrival_step < 0:
        raise InvalidArgument(f"max_arrival_step must be >= 0, got {max_arrival_step}")
    knobs = dict(knobs or {})
    envelope = _envelope(engine, capabilities)
    if profile is not None and profile not in PROFILES:
        raise InvalidArgument(f"unknown profile {profile!r} (known: {', '.join(sorted(PROFILES))})")
    _check_knobs(knobs)
    bad = envelope.partial_violations(knobs)
    if profile is not None:
        from fuzz.generate import profile_knobs

        bad += envelope.partial_violations({k: v for k, v in profile_knobs(profile).items() if k not in knobs})
    if bad:
        raise InvalidArgument(f"outside the engine's capabilities ({envelope.describe()}): {'; '.join(bad)}")
    if profile is None and envelope.everything:  # the whole map, with ``knobs`` fixed over it
        config = configs() if not knobs else configs().map(lambda c: {**c, **knobs}).filter(_valid)
    else:
        config = _configs_inside(envelope, profile, knobs)
    return _traces(config, envelope, min_requests, max_requests, max_prompt_len, max_tokens, max_arrival_step)


def _valid(config: dict[str, Any]) -> bool:
    try:
        resolve(config)
        return True
    except ConfigError:
        return False


def _envelope(engine: str | None, capabilities) -> caps.Envelope:
    try:
        if capabilities is not None:
            return caps.load(capabilities) if isinstance(capabilities, (str, os.PathLike)) else caps.parse(capabilities)
        return caps.for_engine(engine) if engine else caps.EVERYTHING
    except caps.CapabilityError as e:
        raise InvalidArgument(str(e)) from None


def _check_knobs(knobs: Mapping[str, Any]) -> None:
    try:
        resolve({"profile": "vllm-v1", **{k: v for k, v in knobs.items()}, "max_num_batched_tokens": 1 << 20})
    except ConfigError as e:
        if e.field in knobs or "unknown knob" in str(e):
            raise InvalidArgument(f"knobs: {e}") from None


@st.composite
def _configs_inside(draw, envelope: caps.Envelope, profile: str | None, knobs: dict[str, Any]) -> dict[str, Any]:
    """A configuration inside ``envelope`` (``profile``'s semantics when given), ``knobs`` fixed."""
    from fuzz.generate import profile_knobs

    base = profile or (envelope.profile if not envelope.everything else "vllm-v1")
    fixed = set(knobs) | (set(profile_knobs(profile)) if profile else set())
    config: dict[str, Any] = {"profile": base}
    if not envelope.everything:
        for knob in sorted(envelope.knobs):
            if knob not in fixed and knob not in _SIZES:
                config[knob] = draw(st.sampled_from(envelope.samples(knob)))
    pinned = set(profile_knobs(base)) | fixed

    def size(knob: str, candidates: list) -> None:
        if knob in pinned and knob not in (envelope.knobs if not envelope.everything else ()):
            return
        ok = [v for v in candidates if envelope.allows(knob, v)] or [getattr(PROFILES[base].config, knob)]
        config[knob] = draw(st.sampled_from(ok))

    for knob, candidates in _SIZES.items():
        if knob not in fixed:
            size(knob, candidates)
    config["num_blocks"] = draw(st.integers(3, 32))
    config["max_steps"] = 5000
    chunked = knobs.get("enable_chunked_prefill", config.get("enable_chunked_prefill",
                                                              PROFILES[base].config.enable_chunked_prefill))
    mml = knobs.get("max_model_len", config.get("max_model_len", PROFILES[base].config.max_model_len))
    if "max_num_batched_tokens" not in pinned or "max_num_batched_tokens" in (envelope.knobs if not envelope.everything else ()):
        budget = draw(st.integers(1, 64))
        config["max_num_batched_tokens"] = budget if chunked else max(budget, mml)
    config.update(knobs)
    try:
        cfg = resolve(config)
    except ConfigError:
        cfg = None
    from hypothesis import assume

    assume(cfg is not None and envelope.admits(cfg))
    return config


@st.composite
def _traces(draw, config_strategy, envelope, min_requests, max_requests, max_prompt_len, max_tokens, max_arrival_step):
    config = draw(config_strategy)
    n = draw(st.integers(min_requests, max_requests))
    arrivals = sorted(draw(st.lists(st.integers(0, max_arrival_step), min_size=n, max_size=n)))
    requests = []
    for i, at in enumerate(arrivals):
        prompt_len = draw(st.integers(1, max_prompt_len))
        group = draw(st.sampled_from([None, "g1", "g2"]))
        outputs = draw(st.lists(st.sampled_from([2, 5, 6, 7]), max_size=4))
        requests.append(TraceRequest(
            id=f"r{i}", prompt_len=prompt_len, max_tokens=draw(st.integers(1, max_tokens)), arrival_step=at,
            prefix_group=group, prefix_len=draw(st.integers(0, prompt_len)) if group else 0,
            priority=draw(st.integers(0, 3)), tenant=draw(st.sampled_from(["a", "b", "default"])),
            ignore_eos=draw(st.booleans()), stop_token_ids=(6,) if draw(st.booleans()) else (),
            abort_at=at + draw(st.integers(0, 15)) if draw(st.integers(0, 4)) == 0 else None,
            output_tokens=tuple(outputs),
        ))
    return Trace(config=config, requests=requests, vocab_size=64, eos_token_id=2)


# -- failing examples as trace files -------------------------------------------------------


def _is_final() -> bool:
    """True outside Hypothesis, and in the final replay of the minimal failing example;
    False while Hypothesis is still searching or shrinking (nothing is written then)."""
    try:
        from hypothesis.control import _current_build_context

        context = _current_build_context.value
    except (ImportError, AttributeError):
        return True
    return context is None or bool(getattr(context, "is_final", True))


def _engine_arg(engine: Any) -> str:
    if isinstance(engine, str):
        from fuzz.corpus import replay_engine_arg

        return replay_engine_arg(engine)
    factory = engine if callable(engine) else type(engine)
    module, qual = getattr(factory, "__module__", ""), getattr(factory, "__qualname__", "")
    return f"{module}:{qual}" if module and qual.isidentifier() else "ENGINE"


def write_trace_file(trace: Trace, directory: str | os.PathLike | None = None) -> Path:
    """Write ``trace`` as a trace file named after its content (so one example is one file)."""
    from spec.io import write_trace

    folder = Path(directory or os.environ.get("BATCHSPEC_FAILURES") or FAILURES_DIR)
    body = json.dumps([trace.header_json(), *(r.to_json() for r in trace.requests)], sort_keys=True)
    path = folder / f"hypothesis-{hashlib.sha256(body.encode()).hexdigest()[:12]}.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    write_trace(trace, path)
    return path


def replay_command(path: str | os.PathLike, engine: Any = None, level: str = "exact") -> str:
    """The ``batchspec replay`` command for a trace file (``engine``: a name, ``MODULE:FACTORY``
    or the factory itself)."""
    return f"batchspec replay {path}" + (f" --engine {_engine_arg(engine)}" if engine is not None else "") \
        + f" --level {level}"


def note_trace(trace: Trace, engine: Any = None, level: str = "exact", directory: str | os.PathLike | None = None
               ) -> Path | None:
    """For a property of your own: when this is the minimal failing example, write ``trace`` as a
    trace file and :func:`hypothesis.note` the ``batchspec replay`` command that reproduces it
    (Hypothesis prints notes with the falsifying example; outside a test it is printed).
    Returns the path, or None while Hypothesis is still searching or shrinking."""
    if not _is_final():
        return None
    path = write_trace_file(trace, directory)
    line = f"trace written to {path}; reproduce with: {replay_command(path, engine, level)}"
    from hypothesis.control import currently_in_test_context

    note(line) if currently_in_test_context() else print(line)
    return path


def assert_agrees(trace: Trace, engine: str | Callable | Any, level: str = "exact",
                  directory: str | os.PathLike | None = None) -> None:
    """Replay ``trace`` through ``engine`` and the spec (:func:`fuzz.replay.replay`); on a
    divergence raise ``AssertionError`` with the explanation — and, for the minimal failing
    example, the path of the trace file written and the ``batchspec replay`` command that
    reproduces it.  ``engine``: a name for ``--engine`` (``MODULE:FACTORY`` included), an
    engine factory ``factory(trace) -> Engine``, or an engine instance."""
    from fuzz.replay import replay

    target = engine(trace) if callable(engine) and not isinstance(engine, str) and not hasattr(engine, "step") else engine
    result = replay(trace, target, level)
    if result.agreed:
        return
    message = result.describe()
    if _is_final():
        path = write_trace_file(trace, directory)
        message += f"\ntrace written to {path}; reproduce with:\n  {replay_command(path, engine, level)}"
    raise AssertionError(message)
