"""Rule ids: every decision the spec makes is tagged with one (DESIGN.md §2.3).

A rule is registered either by decorating the small function that decides it
(``@rule("PREEMPT.VICTIM_NEWEST")``) — its docstring is the rule's statement —
or, for rules that describe why nothing happened (the budget ran out, the
queue head did not fit), with :func:`declare`.  The reference documentation
is generated from this registry, and the triage report quotes it.
"""
from __future__ import annotations

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


RULES: dict[str, Rule] = {}


def _register(rule_id: str, statement: str, where: str, knobs: tuple[str, ...]) -> None:
    if rule_id in RULES and RULES[rule_id].where != where:
        raise ValueError(f"rule id {rule_id} registered twice ({RULES[rule_id].where}, {where})")
    RULES[rule_id] = Rule(rule_id, inspect.cleandoc(statement), where, knobs)


def rule(rule_id: str, knobs: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Register the decorated function as the implementation of ``rule_id``."""

    def wrap(fn: F) -> F:
        _register(rule_id, fn.__doc__ or "", f"{fn.__module__}.{fn.__qualname__}", knobs)
        fn.rule_id = rule_id  # type: ignore[attr-defined]
        return fn

    return wrap


def declare(rule_id: str, statement: str, where: str, knobs: tuple[str, ...] = ()) -> str:
    """Register a rule that has no function of its own; return its id."""
    _register(rule_id, statement, where, knobs)
    return rule_id


def reason(rule_id: str, request: str | None, text: str) -> dict:
    """One entry of a step record's ``reasons``: which rule decided what for whom."""
    if rule_id not in RULES:
        raise KeyError(f"unregistered rule id {rule_id}")
    out = {"rule": rule_id, "text": text}
    if request is not None:
        out["request"] = request
    return out
