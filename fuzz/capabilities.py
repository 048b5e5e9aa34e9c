"""Capability declarations: the knob values an engine implements (its **envelope**).

An engine under test rarely implements the whole scheduling map.  It declares
what it does implement, and every generator — campaigns (``batchspec fuzz``),
``batchspec conform`` and the Hypothesis strategies (:mod:`fuzz.strategies`) —
draws only inside that envelope; a trace outside it is never run against the
engine (it would only measure a knob the engine never claimed).

A declaration names a **profile** (the base) and the knobs the engine lets vary::

    {"profile": "naive",
     "knobs": {"policy": ["fcfs", "priority"],              # these values, each one drawn
               "enable_chunked_prefill": [true, false],
               "long_prefill_token_threshold": {"min": 0, "max": 64},   # a range (inclusive)
               "watermark": "any"}}                          # whatever the spec accepts

* a knob in ``knobs`` may take the listed values (a list), any value in a range
  (``{"min": a, "max": b}``) or any value (``"any"``); a campaign draws each
  listed value in turn, so over ``n`` traces every value of a list of ``n`` appears;
* a *semantic* knob not in ``knobs`` (queue policy, batching, reservation,
  prefix caching, preemption, chunking, caps, watermark, ...) keeps the
  profile's value;
* workload sizes (``block_size``, ``num_blocks``, ``max_model_len``,
  ``max_num_batched_tokens``, ``max_num_seqs``, ``num_cpu_blocks``, ``max_steps``,
  tenant weights and prices) are drawn freely (in the default family's pressured
  ranges) unless the profile sets them tighter than ``vllm-v1`` (``max_num_seqs = 1``
  for ``naive``, :func:`fuzz.generate.profile_knobs`) or ``knobs`` restricts them.

It is written in code — a ``capabilities`` attribute (a dict as above, a
:class:`Envelope`, the path of a JSON file, or a callable returning one of these)
on the engine factory named by ``--engine MODULE:FACTORY`` or registered with
:func:`fuzz.replay.register_engine` — or, for an engine that only writes decision
logs, in a small JSON file (the same object, plus ``"format":
"batchspec-capabilities", "version": 1``) given with ``--capabilities FILE``.

The built-in engines declare theirs here (:func:`builtin`): ``gpu`` and
``gpu-model`` from gpu_engine's own allow-list (``gpu_engine.engine.SUPPORTED``),
``vllm`` from the adapter's mapped knobs, ``spec`` and ``reference`` everything.
An engine that declares nothing is held to the ``vllm-v1`` family (the
generator's default draws), as before.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import zlib
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

from spec.config import KNOB_CHOICES, PROFILES, ConfigError, SchedulerConfig, resolve

ANY = "any"
FORMAT = "batchspec-capabilities"

_TYPES = {f.name: {"int": int, "bool": bool, "float": float, "str": str}[str(f.type)]
          for f in fields(SchedulerConfig) if f.name != "profile"}

#: Values a campaign tries for a knob declared as a range or ``"any"`` (clipped to the range,
#: whose ends are always tried): the corners the spec's rules turn on.
SAMPLES: dict[str, tuple] = {
    "long_prefill_token_threshold": (0, 1, 3, 4, 8, 16, 40),
    "watermark": (0.0, 0.01, 0.05, 0.1, 0.2),
    "aging_steps": (0, 1, 4, 16),
    "num_cpu_blocks": (0, 1, 2, 4, 8, 256),
    "new_token_ratio_decay_steps": (600, 4),
    "retract_decode_steps": (20, 1),
    "block_size": (1, 2, 4, 8, 16),
    "max_num_seqs": (1, 2, 4, 16, 128),
    "max_num_batched_tokens": (4, 8, 16, 32, 64, 2048),
    "max_model_len": (24, 64, 128, 4096),
    "max_num_active_seqs": (0, 1, 2, 4),  # 0: no limit below max_num_seqs (clipped to it by the generator)
}

#: The share of a campaign's traces that carry the request features vLLM's scheduler sees
#: (``random_trace(..., request_features=True)``) against an engine that declares them.
REQUEST_FEATURE_SHARE = 0.3
#: The share of a campaign's traces drawn with speculative decoding (``num_speculative_tokens``
#: 1-4, issue 15) when neither ``--set`` nor the trace's profile fixes it and the engine's envelope
#: allows it: drafts are vLLM as deployed, and the default family never draws them itself.
SPEC_DECODE_SHARE = 0.15


class CapabilityError(ValueError):
    """A capability declaration that cannot be read (an unknown knob, a bad value)."""


@dataclass(frozen=True)
class Range:
    """Every value from ``lo`` to ``hi`` (inclusive); ``None`` is unbounded."""

    lo: float | None = None
    hi: float | None = None

    def __contains__(self, value: Any) -> bool:
        return (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)

    def __str__(self) -> str:
        if self.lo is None and self.hi is None:
            return "any"
        return f"{'' if self.lo is None else self.lo}..{'' if self.hi is None else self.hi}"


Allowed = tuple | Range


@functools.lru_cache(maxsize=None)
def _free_knobs(profile: str) -> frozenset[str]:
    """Knobs a trace for ``profile`` draws freely (workload sizes the profile leaves at vllm-v1's)."""
    from fuzz.generate import profile_knobs

    return frozenset(_TYPES) - set(profile_knobs(profile))


@dataclass(frozen=True)
class Envelope:
    """The knob values an engine implements (see the module docstring)."""

    profile: str = "vllm-v1"
    knobs: Mapping[str, Allowed] = field(default_factory=dict)
    #: The engine implements the whole map: every profile, every knob value.
    everything: bool = False
    #: Where the declaration came from (shown in the campaign summary).
    source: str = ""
    #: The engine implements the request features of :data:`fuzz.generate.REQUEST_FEATURES`
    #: (skip_prefix_cache, cache_salt, min_tokens, client_arrival_time): campaigns draw them
    #: in a share of the traces (:func:`draws_request_features`).
    request_features: bool = False

    # -- membership ------------------------------------------------------------

    def allows(self, knob: str, value: Any) -> bool:
        if self.everything:
            return True
        if knob in self.knobs:
            allowed = self.knobs[knob]
            return value in allowed
        if knob in _free_knobs(self.profile):
            return True
        return value == getattr(PROFILES[self.profile].config, knob)

    def violations(self, config: Mapping[str, Any] | SchedulerConfig) -> list[str]:
        """Why ``config`` (a trace header's config, or a resolved one) is outside, one line per knob."""
        if self.everything:
            return []
        cfg = config if isinstance(config, SchedulerConfig) else resolve(dict(config))
        out = []
        for knob in _TYPES:
            value = getattr(cfg, knob)
            if not self.allows(knob, value):
                out.append(f"{knob}={value!r} (implements {self.describe_knob(knob)})")
        return out

    def admits(self, config: Mapping[str, Any] | SchedulerConfig) -> bool:
        try:
            return not self.violations(config)
        except ConfigError:
            return False

    def partial_violations(self, knobs: Mapping[str, Any]) -> list[str]:
        """Like :meth:`violations` for some knobs only (``--set``, a profile's fixed knobs)."""
        return [f"{k}={v!r} (implements {self.describe_knob(k)})" for k, v in knobs.items()
                if k in _TYPES and not self.allows(k, v)]

    def profiles(self) -> list[str]:
        """The profiles whose fixed knobs all lie inside the envelope."""
        from fuzz.generate import profile_knobs

        return [p for p in sorted(PROFILES) if not self.partial_violations(profile_knobs(p))]

    # -- description -----------------------------------------------------------

    def describe_knob(self, knob: str) -> str:
        if self.everything or knob in _free_knobs(self.profile) and knob not in self.knobs:
            return "any"
        if knob in self.knobs:
            allowed = self.knobs[knob]
            return str(allowed) if isinstance(allowed, Range) else ", ".join(map(_show, allowed))
        return f"{_show(getattr(PROFILES[self.profile].config, knob))} only"

    def describe(self) -> str:
        """One line: ``profile naive; policy fcfs|priority; long_prefill_token_threshold 0..64`` (every
        other semantic knob at the profile's value; workload sizes drawn unless restricted)."""
        if self.everything:
            return "every profile and knob value" + ("; request features" if self.request_features else "")
        parts = [f"profile {self.profile}"]
        free = _free_knobs(self.profile)
        for knob, allowed in self.knobs.items():
            if knob in free and allowed == Range():
                continue  # a workload size, drawn anyway
            parts.append(f"{knob} {allowed}" if isinstance(allowed, Range) else f"{knob} {'|'.join(map(_show, allowed))}")
        if self.request_features:
            parts.append("request features")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        if self.everything:
            return {"format": FORMAT, "version": 1, "everything": True,
                    **({"request_features": True} if self.request_features else {})}
        knobs = {k: ({"min": v.lo, "max": v.hi} if isinstance(v, Range) and (v.lo, v.hi) != (None, None)
                     else ANY if isinstance(v, Range) else list(v)) for k, v in self.knobs.items()}
        out = {"format": FORMAT, "version": 1, "profile": self.profile, "knobs": knobs}
        if self.request_features:
            out["request_features"] = True
        return out

    # -- drawing ---------------------------------------------------------------

    def samples(self, knob: str) -> tuple:
        """The values a campaign draws for a declared knob: every listed value, or the
        ends of a range and the :data:`SAMPLES` corners inside it."""
        allowed = self.knobs[knob]
        if not isinstance(allowed, Range):
            return tuple(allowed)
        if _TYPES[knob] is bool:
            return (False, True)
        base = getattr(PROFILES[self.profile].config, knob)
        corners = [allowed.lo, base, *SAMPLES.get(knob, ()), allowed.hi]
        out: list = []
        for v in corners:
            if v is not None and v in allowed and v not in out:
                out.append(_TYPES[knob](v))
        return tuple(out) or (base,)

    def options(self, k: int, seed: int = 0, fixed: Iterable[str] = ()) -> dict[str, Any]:
        """Knob values for trace ``k`` of a campaign: the profile, and each declared knob not in
        ``fixed`` rotated through its :meth:`samples`, so that ``n`` consecutive traces take
        all ``n`` values of a knob (each block of ``n`` in its own seeded order, so knobs do not
        move in lock step).  A workload size declared ``"any"`` is left to the generator.  Combinations the spec refuses (aging without a priority order,
        estimate admission with full reservation) are moved to the next value.  Empty for an
        engine that implements everything: the generator's own draws stay unchanged."""
        if self.everything:
            return {}
        fixed = set(fixed)
        out: dict[str, Any] = {"profile": self.profile}
        order: dict[str, list] = {}
        free = _free_knobs(self.profile)
        for knob in sorted(self.knobs):
            if knob in fixed or (knob in free and self.knobs[knob] == Range()):
                continue  # fixed by the caller, or a workload size left to the generator's own draws
            values = list(self.samples(knob))
            n = len(values)
            block = values[:]  # a fresh permutation of the values for every n consecutive traces
            random.Random(zlib.crc32(f"{seed}:{knob}:{k // n}".encode())).shuffle(block)
            start = k % n
            order[knob] = block[start:] + block[:start]
            out[knob] = order[knob][0]
        return _consistent(self.profile, out, order)


def _consistent(profile: str, options: dict[str, Any], order: dict[str, list]) -> dict[str, Any]:
    """Move rotated knobs to their next value while the spec refuses the combination
    (:func:`repair`, with the knobs not rotated held fixed)."""
    fixed = set(options) - set(order) - {"profile"}
    return repair(options, fixed, prefer=order)


#: Sizes roomy enough that only the semantic knobs can make a configuration invalid (the
#: generator sizes the workload to the knobs afterwards).
_ROOMY = {"max_num_batched_tokens": 1 << 20, "max_model_len": 64, "max_num_seqs": 1 << 10, "num_blocks": 64}


def refusal(options: Mapping[str, Any]) -> ConfigError | None:
    """The spec's own config validation (:func:`spec.config.resolve`) of the knobs in
    ``options`` (a campaign's generator options) over its profile, at roomy sizes; ``None``
    when it accepts them."""
    from fuzz.generate import profile_knobs

    profile = options.get("profile") or "vllm-v1"
    knobs = {k: v for k, v in options.items() if k in _TYPES}
    try:
        resolve({**_ROOMY, **profile_knobs(profile), **knobs, "profile": profile})
    except ConfigError as e:
        return e
    return None


def repair(options: Mapping[str, Any], fixed: Iterable[str] = (), envelope: Envelope | None = None,
           key: str = "", prefer: Mapping[str, list] | None = None) -> dict[str, Any]:
    """``options`` made into a configuration the spec accepts, changing only knobs not in ``fixed``.

    While :func:`refusal` names a knob, that knob is re-drawn (:func:`_redraw`); when it
    names a fixed knob, the other knob of the conflict is: ``async_scheduling`` for one of
    its needs (:data:`spec.config.ASYNC_NEEDS`), the SLO knob for ``async_scheduling``.
    Deterministic in ``key`` (the campaign seed and trace), so any worker count draws the
    same configurations.  A conflict among fixed knobs only is left for the caller's
    validation to refuse (``--set`` is checked before the campaign)."""
    out = dict(options)
    fixed = set(fixed)
    for _ in range(4 * len(_TYPES)):
        err = refusal(out)
        if err is None:
            return out
        knob = _culprit(err, out, fixed)
        if knob is None:
            return out
        out[knob] = _redraw(knob, out, envelope, key, (prefer or {}).get(knob))
    return out


def _culprit(err: ConfigError, options: Mapping[str, Any], fixed: set[str]) -> str | None:
    """The knob to change for the refusal ``err``: the one it names, unless that one is fixed."""
    from spec.config import ASYNC_NEEDS

    if err.field not in fixed and err.field in _TYPES:
        return err.field
    if err.field in ASYNC_NEEDS and options.get("async_scheduling") and "async_scheduling" not in fixed:
        return "async_scheduling"
    if err.field == "async_scheduling":  # async is fixed: the SLO knob goes
        for knob, slo in (("policy", ("edf", "sprpt")), ("preemption_victim", ("slo-slack",))):
            if options.get(knob) in slo and knob not in fixed:
                return knob
    return None


def _redraw(knob: str, options: Mapping[str, Any], envelope: Envelope | None, key: str,
            prefer: list | None) -> Any:
    """A new value for ``knob`` that the spec accepts with the other options: async's need
    when async is on, else the envelope's values (``prefer``: the rotation's order) in an
    order seeded by ``key``, else the profile's value."""
    from fuzz.generate import profile_knobs
    from spec.config import ASYNC_NEEDS

    profile = options.get("profile") or "vllm-v1"
    base = profile_knobs(profile).get(knob, getattr(PROFILES[profile].config, knob))
    if knob == "async_scheduling":
        return False
    current = options.get(knob)
    if prefer:
        values = list(prefer)
        at = values.index(current) + 1 if current in values else 0
        values = values[at:] + values[:at]
    else:
        values = list(envelope.samples(knob)) if envelope is not None and knob in envelope.knobs else \
            list(KNOB_CHOICES.get(knob, ())) if envelope is not None and envelope.everything else []
        keyed_rng(key, knob).shuffle(values)
    if options.get("async_scheduling") and knob in ASYNC_NEEDS:
        values.insert(0, ASYNC_NEEDS[knob])
    before = str(refusal(options))
    for value in [*values, base]:
        if value == current or (envelope is not None and not envelope.allows(knob, value)):
            continue
        err = refusal({**options, knob: value})
        # (a value refused just as the current one, e.g. edf for sprpt under async, would cycle)
        if err is None or (err.field != knob and str(err) != before):
            return value
    return base


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


EVERYTHING = Envelope(everything=True, source="implements the whole map")


# -- reading declarations ---------------------------------------------------------


def parse(obj: Any, where: str = "capabilities") -> Envelope:
    """An :class:`Envelope` from a declaration object (module docstring); raises
    :class:`CapabilityError` naming ``where`` and the field on anything it cannot read."""
    if isinstance(obj, Envelope):
        return obj
    if not isinstance(obj, Mapping):
        raise CapabilityError(f"{where}: expected an object {{\"profile\": ..., \"knobs\": {{...}}}}, got {obj!r}")
    unknown = set(obj) - {"format", "version", "engine", "profile", "knobs", "everything", "description",
                          "request_features"}
    if unknown:
        raise CapabilityError(f"{where}: {sorted(unknown)[0]}: unknown field (known: profile, knobs, everything)")
    if "format" in obj and obj["format"] != FORMAT:
        raise CapabilityError(f"{where}: format: expected {FORMAT!r}, got {obj['format']!r}")
    features = obj.get("request_features", False)
    if not isinstance(features, bool):
        raise CapabilityError(f"{where}: request_features: expected true or false, got {features!r}")
    if obj.get("everything"):
        return dataclasses.replace(EVERYTHING, source=where, request_features=features)
    profile = obj.get("profile", "vllm-v1")
    if profile not in PROFILES:
        raise CapabilityError(f"{where}: profile: unknown profile {profile!r} (known: {', '.join(sorted(PROFILES))})")
    raw = obj.get("knobs", {})
    if not isinstance(raw, Mapping):
        raise CapabilityError(f"{where}: knobs: expected an object knob -> values, got {raw!r}")
    knobs: dict[str, Allowed] = {}
    for knob, spec in raw.items():
        knobs[knob] = _allowed(knob, spec, f"{where}: knobs.{knob}")
    return Envelope(profile, knobs, source=where, request_features=features)


def _allowed(knob: str, spec: Any, where: str) -> Allowed:
    if knob not in _TYPES:
        raise CapabilityError(f"{where}: unknown knob (known: {', '.join(_TYPES)})")
    kind = _TYPES[knob]
    if spec == ANY or spec is None:
        return (False, True) if kind is bool else Range()
    if isinstance(spec, Range):
        return spec
    if isinstance(spec, Mapping):
        if set(spec) - {"min", "max"} or kind not in (int, float):
            raise CapabilityError(f"{where}: a range is {{\"min\": a, \"max\": b}} of a numeric knob, got {spec!r}")
        lo, hi = spec.get("min"), spec.get("max")
        for v in (lo, hi):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise CapabilityError(f"{where}: range ends must be numbers, got {v!r}")
        if lo is not None and hi is not None and lo > hi:
            raise CapabilityError(f"{where}: min {lo} > max {hi}")
        return Range(lo, hi)
    if isinstance(spec, (list, tuple)) and spec:
        values = []
        for v in spec:
            ok = isinstance(v, bool) if kind is bool else (
                isinstance(v, (int, float)) and not isinstance(v, bool) if kind in (int, float) else isinstance(v, str))
            if not ok or (kind is int and isinstance(v, float)):
                raise CapabilityError(f"{where}: {v!r} is not a {kind.__name__}")
            if knob in KNOB_CHOICES and v not in KNOB_CHOICES[knob]:
                raise CapabilityError(f"{where}: {v!r} is not a value of {knob} ({', '.join(KNOB_CHOICES[knob])})")
            values.append(kind(v))
        return tuple(dict.fromkeys(values))
    raise CapabilityError(f"{where}: expected a non-empty list of values, {{\"min\": a, \"max\": b}} or \"any\", got {spec!r}")


def load(path: str | os.PathLike) -> Envelope:
    """Read a capability file (JSON); raises :class:`CapabilityError` as ``FILE: FIELD: problem``."""
    from spec.io import FormatError, read_json_document

    try:  # strict and bounded: a FIFO, a huge file, NaN, duplicate keys or deep nesting are refused
        obj, _ = read_json_document(path)
    except FormatError as e:
        raise CapabilityError(str(e)) from None
    return parse(obj, str(path))


def declared(obj: Any, where: str) -> Envelope | None:
    """The envelope an engine factory (or instance) declares with a ``capabilities`` attribute, if any."""
    caps = getattr(obj, "capabilities", None)
    if caps is None:
        return None
    if callable(caps) and not isinstance(caps, Envelope):
        caps = caps()
    if isinstance(caps, (str, os.PathLike)):
        return load(caps)
    return parse(caps, f"{where}.capabilities")


# -- the built-in engines ------------------------------------------------------------


def _from_allow_list(supported: Mapping[str, Any], source: str, request_features: bool = False) -> Envelope:
    """An envelope from an allow-list ``knob -> frozenset of values | None (any)`` whose other
    knobs must keep their ``vllm-v1`` defaults (gpu_engine's ``SUPPORTED``)."""
    knobs: dict[str, Allowed] = {}
    for knob, kind in _TYPES.items():
        if knob not in supported:
            continue  # held at the default: vllm-v1's value
        values = supported[knob]
        if values is None:
            knobs[knob] = (False, True) if kind is bool else Range()
        else:
            knobs[knob] = tuple(sorted(values, key=str))
    whole = all(k in knobs and (isinstance(v, Range) or _TYPES[k] is bool or set(v) >= set(KNOB_CHOICES.get(k, v)))
                for k, v in ((k, knobs.get(k)) for k in _TYPES))
    if whole:
        return dataclasses.replace(EVERYTHING, source=source, request_features=request_features)
    return Envelope("vllm-v1", knobs, source=source, request_features=request_features)


def _gpu() -> Envelope:
    from gpu_engine.engine import SUPPORTED, UNSUPPORTED_REQUEST_FIELDS

    return _from_allow_list(SUPPORTED, "gpu_engine.engine.SUPPORTED", request_features=not UNSUPPORTED_REQUEST_FIELDS)


def _gpu_model() -> Envelope:
    """With its model gpu_engine schedules synchronously and without drafts only (async_scheduling and
    num_speculative_tokens: scheduler-only mode)."""
    from gpu_engine.engine import SUPPORTED, UNSUPPORTED_REQUEST_FIELDS

    return _from_allow_list({k: v for k, v in SUPPORTED.items() if k not in ("async_scheduling", "num_speculative_tokens")},
                            "gpu_engine.engine.SUPPORTED, less async_scheduling and num_speculative_tokens (model mode)",
                            request_features=not UNSUPPORTED_REQUEST_FIELDS)


def _vllm() -> Envelope:
    from fuzz.vllm_adapter import MAPPED_KNOBS

    knobs: dict[str, Allowed] = {}
    for knob in sorted(MAPPED_KNOBS):
        # reject_unservable=false only makes both sides stall to max_steps: left at the profile's value
        if knob in _free_knobs("vllm-v1") or knob == "reject_unservable":
            continue
        if knob in ("async_scheduling", "num_speculative_tokens"):  # measured on their own:
            continue  # examples/vllm-v1-async.capabilities.json, vllm-v1-specdec*.capabilities.json
        knobs[knob] = ("fcfs", "priority") if knob == "policy" else (False, True) if _TYPES[knob] is bool else Range()
    return Envelope("vllm-v1", knobs, source="fuzz.vllm_adapter.MAPPED_KNOBS")


BUILTIN = {"spec": lambda: dataclasses.replace(EVERYTHING, source="the spec itself", request_features=True),
           "reference": lambda: dataclasses.replace(EVERYTHING, source="the spec's decisions drive the model",
                                                    request_features=True),
           "gpu": _gpu, "gpu-model": _gpu_model, "vllm": _vllm}

#: The envelope of an engine that declares nothing: the generator's own vllm-v1 family.
UNDECLARED = Envelope(everything=True, source="no declaration: the vllm-v1 family (every knob drawn)")


def keyed_rng(key: str, what: str) -> random.Random:
    """The campaign trace ``key``'s (seed and trace number) own generator for the draw ``what``: a hash
    of both, so that any worker count draws the same, and one draw leaves the others as they are."""
    return random.Random(zlib.crc32(f"{key}:{what}".encode()))


def draws_request_features(envelope: Envelope, key: str) -> bool:
    """Whether the campaign trace ``key`` (seed and trace number) carries the request features:
    :data:`REQUEST_FEATURE_SHARE` of the traces against an engine that declares them, chosen
    by a hash of ``key`` (the same traces for any worker count)."""
    if not envelope.request_features:
        return False
    return keyed_rng(key, "request_features").random() < REQUEST_FEATURE_SHARE


def spec_decode_draw(envelope: Envelope, key: str, options: Mapping[str, Any], fixed: Iterable[str]) -> dict[str, Any]:
    """``options`` with speculative decoding for :data:`SPEC_DECODE_SHARE` of the campaign traces
    (chosen and sized by a hash of ``key``, so any worker count draws the same traces): K in 1-4,
    with the knobs the spec specifies drafts with (vLLM V1's scheduler, FCFS or priority) where the
    trace left them free.  Unchanged when the knob is fixed, the envelope does not allow K, or the
    spec still refuses the combination (a fixed knob contradicts it)."""
    from spec.config import ASYNC_NEEDS

    fixed = set(fixed)
    rng = keyed_rng(key, "spec_decode")
    if "num_speculative_tokens" in fixed or "num_speculative_tokens" in options or rng.random() >= SPEC_DECODE_SHARE:
        return dict(options)
    k = rng.randint(1, 4)
    if not (envelope.everything or envelope.allows("num_speculative_tokens", k)):
        return dict(options)
    needs = {**ASYNC_NEEDS, "preemption_victim": "policy"}
    if options.get("policy", "fcfs") not in ("fcfs", "priority"):
        needs["policy"] = "fcfs"
    # a third with async scheduling, half caching accepted drafts at output (vLLM 0.33): their rules
    modes = {"async_scheduling": rng.random() < 0.35, "spec_cache_at_output": rng.random() < 0.5}
    needs.update({n: v for n, v in modes.items() if v and n not in options})
    out = {**options, "num_speculative_tokens": k, **{n: v for n, v in needs.items() if n not in fixed}}
    if any(not (envelope.everything or envelope.allows(n, out[n])) for n in needs if n in out) or refusal(out):
        return dict(options)
    return out


def builtin(name: str) -> Envelope | None:
    return BUILTIN[name]() if name in BUILTIN else None


def for_engine(name: str, override: str | os.PathLike | Envelope | Mapping | None = None) -> Envelope:
    """The envelope of ``--engine name``: ``override`` (``--capabilities FILE``) if given, else
    the built-in declaration, else the ``capabilities`` attribute of the registered or
    ``MODULE:FACTORY`` factory, else :data:`UNDECLARED`.  Raises
    :class:`fuzz.replay.EngineUnavailable` for an engine that cannot be found and
    :class:`CapabilityError` for a declaration that cannot be read."""
    if override is not None:
        return load(override) if isinstance(override, (str, os.PathLike)) else parse(override)
    found = builtin(name)
    if found is not None:
        return found
    factory = engine_factory(name)
    return declared(factory, name) or UNDECLARED


def engine_factory(name: str):
    """The factory behind ``--engine name`` (registering a ``MODULE:FACTORY`` on the way)."""
    from fuzz.replay import ENGINES, EngineUnavailable, _import_factory, register_engine

    if name not in ENGINES and ":" in name:
        register_engine(name, _import_factory(name), f"{name} (imported)")
    if name not in ENGINES:
        try:
            import fuzz.engines  # noqa: F401
        except ImportError:
            pass
    if name not in ENGINES:
        raise EngineUnavailable(f"unknown engine {name!r} (known: {', '.join(sorted(ENGINES))})")
    return ENGINES[name].factory


# -- rules reachable in an envelope (issue 20 item 6) -----------------------------------


def _positive(value: Any) -> bool:
    return bool(value) and value > 0


#: What a rule needs of its knobs (``Rule.knobs``) to fire: a knob -> the values it fires
#: with (a tuple) or a test (a callable).  A rule not listed here, or one whose knob test
#: cannot be decided, is counted as reachable.  ``request_features`` is the envelope's flag.
RULE_NEEDS: dict[str, dict[str, Any]] = {
    "QUEUE.EDF": {"policy": ("edf",)}, "EDF.AT_RISK_FIRST": {"policy": ("edf",)},
    "SLO.DEFER": {"slo_admission": lambda v: v != "off"}, "SLO.REFUSE": {"slo_admission": lambda v: v != "off"},
    "SLO.FEASIBLE": {"slo_admission": lambda v: v != "off"},
    "PREEMPT.VICTIM_SLO_SLACK": {"preemption_victim": ("slo-slack",)},
    "QUEUE.SPF": {"policy": ("spf",)}, "QUEUE.SPRPT": {"policy": ("sprpt",)},
    "QUEUE.PRIORITY": {"policy": ("priority", "edf")},  # EDF's queue is a priority queue
    # the hold is a phase of continuous and static batching (spec.config.step_plan), not of prefill-first
    "ADMIT.NONE_AFTER_PREEMPT": {"admit_after_preempt": (False,), "batching": ("continuous", "static")},
    "QUEUE.AGING": {"aging_steps": _positive, "policy": ("priority", "spf", "sprpt")},
    "VTC.CHARGE": {"policy": ("vtc",)}, "VTC.LIFT": {"policy": ("vtc",)}, "VTC.PICK": {"policy": ("vtc",)},
    "VTC.QUEUE": {"policy": ("vtc",)},
    **{f"ASYNC.{name}": {"async_scheduling": (True,)} for name in (
        "ABORT_DROPS_OUTPUT", "LAST_TOKEN_IN_FLIGHT", "OUTPUTS_NEXT_STEP", "PLACEHOLDER", "PLACEHOLDERS_COUNT",
        "PREEMPT_ZEROES_PLACEHOLDERS", "STALE_OUTPUT")},
    "ASYNC.CACHE_AFTER_OUTPUT": {"async_scheduling": (True,), "enable_prefix_caching": (True,)},
    **{f"SPEC.{name}": {"num_speculative_tokens": _positive} for name in (
        "PROPOSE", "DRAFT_SCHEDULE", "PAD_ADMISSION", "ACCEPT", "ROLLBACK", "PREEMPT_DISCARDS", "STOP_IN_DRAFTS")},
    "SPEC.ASYNC_DRAFT_PLACEHOLDERS": {"num_speculative_tokens": _positive, "async_scheduling": (True,)},
    **{f"SWAP.{name}": {"preemption_mode": ("swap",)} for name in ("BEFORE_WAITING", "FALLBACK_RECOMPUTE", "IN", "OUT")},
    "BATCH.PREFILL_FIRST": {"batching": ("prefill-first",)}, "BATCH.STATIC": {"batching": ("static",)},
    "BATCH.MAX_NUM_SEQS_PER_STEP": {"max_num_seqs_scope": ("step",)},
    "ADMIT.RESERVE_FULL": {"kv_reservation": ("full",)}, "ADMIT.RESERVE_SEQUENCE": {"kv_reservation": ("sequence",)},
    "ADMIT.WATERMARK": {"watermark": _positive}, "ADMIT.NO_CHUNKING": {"enable_chunked_prefill": (False,),
                                                                                    "no_chunking_cap": ("inclusive",)},
    "ADMIT.NO_CHUNKING_EXCLUSIVE": {"enable_chunked_prefill": (False,), "no_chunking_cap": ("exclusive",)},
    "ADMIT.MAX_NUM_ACTIVE_SEQS": {"max_num_active_seqs": _positive},
    "ADMIT.CHUNK_ONLY_FIRST": {"prefill_chunking": ("first-continues",)},
    "RUN.CONTINUE_PREFILL_FIRST": {"prefill_chunking": ("first-continues", "last-continues")},
    # SGLang's (issue 16 item 2)
    "REJECT.INPUT_LIMIT": {"length_limits": ("clip",)}, "ARRIVE.CLIP_MAX_TOKENS": {"length_limits": ("clip",)},
    "REJECT.PROMPT_TOO_LONG": {"length_limits": ("reject",)}, "REJECT.NEVER_FITS": {"length_limits": ("reject",)},
    "STOP.IGNORE_EOS_SCOPE": {"ignore_eos_scope": ("eos-and-stop-tokens",)},
    "ABORT.AFTER_NEXT_SAMPLE": {"abort_running": ("after-next-sample",)},
    "ABORT.CUT_PREFILL_AT_ONCE": {"abort_running": ("after-next-sample",)},
    "ESTIMATE.HOLD_UNTIL_DEPARTURE": {"admission_hold": ("until-departure",)},
    "ESTIMATE.IGNORE_EOS_RESERVE": {"admission": ("estimate",), "ignore_eos_admission": ("reserve",),
                                    "enable_prefix_caching": (False,)},
    "ESTIMATE.RUNNING_RATIO": {"admission": ("estimate",)},
    "ESTIMATE.OWN_HIT_LOCKED": {"admission": ("estimate",), "enable_prefix_caching": (True,)},
    "ESTIMATE.CONTINUED_CHUNK": {"admission": ("estimate",), "prefill_chunking": ("first-continues", "last-continues")},
    "BUDGET.LONG_PREFILL": {"long_prefill_token_threshold": _positive},
    "BUDGET.LONG_PREFILL_ADAPTIVE": {"long_prefill_token_threshold": _positive,
                                     "long_prefill_token_threshold_adaptive": (True,)},
    **{f"CACHE.{name}": {"enable_prefix_caching": (True,)} for name in ("HIT", "TOUCH")},
    "CACHE.EVICT_LRU": {"enable_prefix_caching": (True,), "cache_eviction": ("block-lru",)},
    # CACHE.BLOCK_HASH: block hashes are computed without prefix caching too (counted everywhere)
    "CACHE.SALT": {"enable_prefix_caching": (True,), "request_features": (True,)},
    "CACHE.SKIP_READ": {"enable_prefix_caching": (True,), "request_features": (True,)},
    "CACHE.LATEST_WINS": {"enable_prefix_caching": (True,), "cache_duplicates": ("latest",)},
    # the registration primitive (kv.cache_full_block) serves cache_register=computed too
    "CACHE.REGISTER_AT_ALLOCATION": {"enable_prefix_caching": (True,)},
    # every registration after the forward pass ("computed", SGLang's "prefill-and-finish")
    "CACHE.REGISTER_WHEN_COMPUTED": {"enable_prefix_caching": (True,), "cache_register": lambda v: v != "allocation"},
    "KV.FREE_TO_TAIL": {"free_block_order": ("tail",)},
    # SGLang's radix cache (issue 16, differences 8 and 13)
    "CACHE.EVICT_LEAF_LRU": {"enable_prefix_caching": (True,), "cache_eviction": ("leaf-lru",)},
    "CACHE.TOUCH_WAITING": {"enable_prefix_caching": (True,), "cache_eviction": ("leaf-lru",)},
    "KV.BATCH_ALLOCATION": {"cache_eviction": ("leaf-lru",), "batching": ("prefill-first",)},
    "CACHE.EVICT_ON_RETRACT": {"enable_prefix_caching": (True,), "cache_eviction": ("leaf-lru",),
                               "admission": ("estimate",)},
    "KV.FREE_TO_RELEASE": {"cache_eviction": ("leaf-lru",)},
    # the radix pool has its own pop, free and release order (spec.kv.RadixPool): vLLM's never fire there
    "KV.FREE_IN_ORDER": {"cache_eviction": ("leaf-lru",)}, "KV.FREE_REVERSED": {"cache_eviction": ("block-lru",)},
    "KV.POP_HEAD": {"cache_eviction": ("block-lru",)},
    "KV.FREE_ORDER": {"cache_eviction": ("block-lru",), "free_block_order": ("cached-last",)},
    "CACHE.DEDUP_ON_INSERT": {"enable_prefix_caching": (True,), "cache_dedup": ("on-insert",)},
    "CACHE.REGISTER_PREFILL_AND_FINISH": {"cache_register": ("prefill-and-finish",)},
    "ESTIMATE.ADMIT": {"admission": ("estimate",)}, "ESTIMATE.RATIO": {"admission": ("estimate",)},
    "ESTIMATE.REMAINING": {"admission": ("estimate",)}, "RETRACT.TO_TAIL": {"admission": ("estimate",)},
    "RETRACT.VICTIM_FEWEST_OUTPUTS": {"admission": ("estimate",)}, "RETRACT.BATCH_ORDER": {"admission": ("estimate",)},
    "RETRACT.BATCH_TEST": {"admission": ("estimate",)},
}

#: Rules a step plan names (:func:`spec.config.step_plan`) that the spec also reaches outside it:
#: the cache primitives and the budget and room checks the scheduler cites wherever they bind.
#: Found by running the spec in each envelope (tests/test_campaign_table.py).
PLAN_AND_ELSEWHERE = frozenset({"KV.NO_FREE_BLOCKS", "ADMIT.FULL_SEQUENCE", "PREEMPT.RECOMPUTE", "SWAP.OUT",
                                "ADMIT.MAX_NUM_SEQS", "BATCH.MAX_NUM_SEQS_PER_STEP", "VTC.CHARGE", "ABORT.FREE"})


@functools.lru_cache(maxsize=None)
def plan_gated() -> frozenset[str]:
    """The rules the step plan chooses among: the scheduler reaches each only through its plan (the
    victim order, the requeue, when outputs are applied, the admission checks, the speculative-decoding
    rules, the arrival refusals and shaping), so one fires only where some configuration inside the
    envelope, all its knobs taken together, puts it in the plan — SPEC.PROPOSE never with
    async_scheduling pinned true (drafts are placeholders there, SPEC.ASYNC_DRAFT_PLACEHOLDERS), the
    vLLM victim orders never under SGLang's estimate admission.  Derived, not listed: every rule id
    some profile's plan names, or names with one knob changed (:data:`KNOB_CHOICES` values, booleans
    flipped, one draft), less :data:`PLAN_AND_ELSEWHERE`."""
    out: set[str] = set()
    for prof in PROFILES.values():
        base = prof.config
        variants = [{}] + [{f.name: not getattr(base, f.name)} for f in fields(SchedulerConfig)
                           if isinstance(getattr(base, f.name), bool)]
        variants += [{k: v} for k, vs in KNOB_CHOICES.items() for v in vs]
        variants += [{"num_speculative_tokens": 1}, {"num_speculative_tokens": 1, "async_scheduling": True},
                     {"num_speculative_tokens": 1, "spec_cache_at_output": True}]
        for knobs in variants:
            try:
                cfg = resolve({**_ROOMY, **dataclasses.asdict(base), **knobs})
            except (ConfigError, TypeError, ValueError):
                continue
            out |= plan_rule_ids(cfg)
    return frozenset(out - PLAN_AND_ELSEWHERE)


def plan_rule_ids(cfg: SchedulerConfig) -> frozenset[str]:
    """The rule ids ``cfg``'s step plan names (victim, requeue, room, checks, outputs, drafts, ...)."""
    from spec.config import step_plan

    plan = step_plan(cfg)
    return frozenset({plan.victim, plan.preempt, plan.requeue, plan.room, plan.reservation, plan.outputs,
                      plan.abort_running, *plan.admission_checks, *plan.on_schedule, *plan.running_checks,
                      *plan.speculative, *plan.refusals, *plan.on_arrival})


#: Values tried for a numeric knob that is drawn freely or declared as a range.
_PROBES = (0, 0.05, 1, 2, 8, 1 << 20)


def async_pins(fixed: Mapping[str, Any] | None) -> dict[str, Any]:
    """The knob values a ``--set async_scheduling=true`` pins over every draw: the knobs async
    scheduling is specified with (:data:`spec.config.ASYNC_NEEDS`) that ``--set`` leaves free."""
    if not fixed or not fixed.get("async_scheduling"):
        return {}
    from spec.config import ASYNC_NEEDS

    return {name: value for name, value in ASYNC_NEEDS.items() if name not in fixed}


def knob_values(envelope: Envelope, knob: str, profile: str | None = None,
                fixed: Mapping[str, Any] | None = None) -> list:
    """The values of ``knob`` a campaign against ``envelope`` (over ``profile``, with ``fixed`` knobs
    from ``--set``) can draw, as far as a rule's needs tell them apart (numeric knobs: probes)."""
    if fixed and knob in fixed:
        return [fixed[knob]]
    pins = async_pins(fixed)
    if knob in pins:
        return [pins[knob]]
    if profile not in (None, "all"):
        from fuzz.generate import profile_knobs

        pinned = profile_knobs(profile)
        if knob in pinned:
            return [pinned[knob]]
    kind = _TYPES[knob]
    if kind is bool:
        values: Iterable = (False, True)
    elif knob in KNOB_CHOICES:
        values = KNOB_CHOICES[knob]
    elif not envelope.everything and knob in envelope.knobs and not isinstance(envelope.knobs[knob], Range):
        values = envelope.knobs[knob]
    else:
        allowed = envelope.knobs.get(knob, Range()) if not envelope.everything else Range()
        own = getattr(PROFILES[envelope.profile].config, knob)  # an undeclared knob keeps it
        values = [kind(v) for v in (*_PROBES, allowed.lo, allowed.hi, own) if v is not None and v in allowed]
    return list(dict.fromkeys(v for v in values if envelope.allows(knob, v)))


def knob_can(envelope: Envelope, knob: str, test: Any, profile: str | None = None,
             fixed: Mapping[str, Any] | None = None) -> bool:
    """Whether a campaign against ``envelope`` (over ``profile``, with ``fixed`` knobs from
    ``--set``) can draw a value of ``knob`` that passes ``test`` (values, or a callable)."""
    ok = test if callable(test) else (lambda v: v in test)
    if knob == "request_features":
        return ok(envelope.request_features)
    return any(ok(v) for v in knob_values(envelope, knob, profile, fixed))


#: The most configurations :func:`envelope_configs` enumerates; a larger envelope (one that varies
#: many knobs, such as the whole map) is judged knob by knob.
MAX_CONFIGS = 50_000


def envelope_configs(envelope: Envelope, profile: str | None = None,
                     fixed: Mapping[str, Any] | None = None) -> list[SchedulerConfig] | None:
    """The configurations a campaign against ``envelope`` can draw, as far as the rules' needs and
    the step plan tell them apart: every combination of the values of the knobs the envelope lets
    vary (:func:`knob_values`) that the spec accepts, the other knobs at the profile's values.
    None for an envelope with more than :data:`MAX_CONFIGS` combinations."""
    import itertools
    from math import prod

    base = envelope.profile if not envelope.everything else "vllm-v1"
    if profile not in (None, "all"):
        base = profile
    needs = {k for test in RULE_NEEDS.values() for k in test if k != "request_features"}
    varied = sorted(k for k in _TYPES if k not in _free_knobs(base) or k in needs)
    choices = [knob_values(envelope, k, profile, fixed) for k in varied]
    if any(not c for c in choices) or prod(len(c) for c in choices) > MAX_CONFIGS:
        return None
    out = []
    for combo in itertools.product(*choices):
        options = {"profile": base, **dict(zip(varied, combo))}
        if refusal(options) is None:
            out.append(resolve({**_ROOMY, **options}))
    return out


def _meets(cfg: SchedulerConfig, needs: Mapping[str, Any], request_features: bool) -> bool:
    """Whether ``cfg`` passes every test of a rule's needs."""
    for knob, test in needs.items():
        value = request_features if knob == "request_features" else getattr(cfg, knob)
        if not (test(value) if callable(test) else value in test):
            return False
    return True


def reachable_rules(envelope: Envelope, rule_ids: Iterable[str], profile: str | None = None,
                    fixed: Mapping[str, Any] | None = None) -> list[str]:
    """The rules of ``rule_ids`` a campaign against ``envelope`` can fire: some configuration inside
    the envelope, its knobs taken together, meets the rule's needs (:data:`RULE_NEEDS`) and, for a
    rule the step plan chooses (:func:`plan_gated`), has it in its plan.  A rule whose needs are not
    known is counted.  An envelope too large to enumerate (:data:`MAX_CONFIGS`) is judged knob by
    knob, each need on its own."""
    rule_ids = list(rule_ids)
    configs = envelope_configs(envelope, profile, fixed)
    if configs is None:
        return sorted(r for r in rule_ids
                      if all(knob_can(envelope, k, t, profile, fixed) for k, t in RULE_NEEDS.get(r, {}).items()))
    plans, gated = [plan_rule_ids(c) for c in configs], plan_gated()
    out = []
    for rule_id in rule_ids:
        needs = RULE_NEEDS.get(rule_id, {})
        if any(_meets(c, needs, envelope.request_features) and (rule_id not in gated or rule_id in plan)
               for c, plan in zip(configs, plans)):
            out.append(rule_id)
    return sorted(out)
