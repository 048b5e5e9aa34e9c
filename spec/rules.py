"""Rule ids: every decision the spec makes is tagged with one (DESIGN.md §2.3).

A rule is registered either by decorating the small function that decides it
(``@rule("PREEMPT.VICTIM_NEWEST")``) — its docstring is the rule's statement —
or, for rules that describe why nothing happened (the budget ran out, the
queue head did not fit), with :func:`declare`.  The reference documentation
is generated from this registry, and the triage report quotes it.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Rule:
    id: str
    statement: str  # what the rule is, and why engines do it
    where: str  # the function or module that implements it
    knobs: tuple[str, ...] = ()  # knobs that change it
    fires: bool = True  # False for statements of structure that no single decision shows


RULES: dict[str, Rule] = {}

class RuleHits(dict):
    """Rule id -> how often it fired; a rule that never fired reads as 0, as in a Counter.

    A plain dict otherwise: a Counter's Python-level ``__delitem__`` routes every
    ``HITS[rule_id] += 1`` through Python, about twice the cost, a dozen times a step."""

    def __missing__(self, rule_id: str) -> int:
        return 0


#: How often each rule fired (its function returned a decision, or a reason cited it);
#: fuzz campaigns read it for rule-id coverage.
HITS: RuleHits = RuleHits()


def _register(rule_id: str, statement: str, where: str, knobs: tuple[str, ...], fires: bool = True) -> None:
    if rule_id in RULES and RULES[rule_id].where != where:
        raise ValueError(f"rule id {rule_id} registered twice ({RULES[rule_id].where}, {where})")
    RULES[rule_id] = Rule(rule_id, inspect.cleandoc(statement), where, knobs, fires)


def rule(rule_id: str, knobs: tuple[str, ...] = (), applies: Callable | None = None) -> Callable[[F], F]:
    """Register the decorated function as the implementation of ``rule_id``.

    Every call counts as the rule firing, unless ``applies(result)`` says the
    rule did not apply (a predicate that returned False, a lookup that found nothing).
    """

    def wrap(fn: F) -> F:
        _register(rule_id, fn.__doc__ or "", f"{fn.__module__}.{fn.__qualname__}", knobs)

        # Two wrappers, one chosen here rather than testing ``applies`` on every call: most
        # rules count every call, and the spec's step calls about a dozen of them.
        def count_every_call(*args, **kwargs):
            result = fn(*args, **kwargs)
            HITS[rule_id] += 1
            return result

        def count_when_applies(*args, **kwargs):
            result = fn(*args, **kwargs)
            if applies(result):
                HITS[rule_id] += 1
            return result

        counted = functools.wraps(fn)(count_every_call if applies is None else count_when_applies)
        counted.rule_id = rule_id  # type: ignore[attr-defined]
        return counted  # type: ignore[return-value]

    return wrap


@dataclass(frozen=True)
class Phase:
    name: str
    statement: str  # what the phase does, in which order, and which rules decide in it
    where: str  # the method that implements it


#: Phase name -> the phase; a configuration's step is a list of these (spec.config.step_plan).
PHASES: dict[str, Phase] = {}


def phase(name: str) -> Callable[[F], F]:
    """Register the decorated engine method as the phase ``name`` of a step; its
    docstring is the phase's statement."""

    def wrap(fn: F) -> F:
        PHASES[name] = Phase(name, inspect.cleandoc(fn.__doc__ or ""), f"{fn.__module__}.{fn.__qualname__}")
        fn.phase_name = name  # type: ignore[attr-defined]
        return fn

    return wrap


def declare(rule_id: str, statement: str, where: str, knobs: tuple[str, ...] = (), fires: bool = True) -> str:
    """Register a rule that has no function of its own; return its id."""
    _register(rule_id, statement, where, knobs, fires)
    return rule_id


def fired(rule_id: str) -> None:
    """Count a declared rule as fired when no reason is written for it."""
    HITS[rule_id] += 1


def reason(rule_id: str, request: str | None, text: str, tenant: str | None = None) -> dict:
    """One entry of a step record's ``reasons``: which rule decided what for whom (``tenant``:
    the tenant a fairness rule acted on, so that a report can match it to a counter)."""
    if rule_id not in RULES:
        raise KeyError(f"unregistered rule id {rule_id}")
    HITS[rule_id] += 1
    out = {"rule": rule_id, "text": text}
    if request is not None:
        out["request"] = request
    if tenant is not None:
        out["tenant"] = tenant
    return out


def all_rules() -> dict[str, Rule]:
    """Every rule of the spec (importing the modules that register them)."""
    import spec.scheduler  # noqa: F401  (imports kv and queues too)

    return RULES
