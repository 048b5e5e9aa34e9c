"""Shared pieces of the proofs: values that are Python ints or Z3 terms, and the result record."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import z3

from invariants.proofs.symex import Sym, SymBool, term, wrap

# --------------------------------------------------------------------------
# branch-free helpers: concrete in, concrete out; symbolic in, term out
# --------------------------------------------------------------------------


def concrete(*xs) -> bool:
    return all(isinstance(x, (int, bool)) for x in xs)


def ite(c, a, b):
    """``a if c else b``, without forking when ``c`` is symbolic."""
    if isinstance(c, bool):
        return a if c else b
    return wrap(z3.If(term(c), term(a), term(b)))


def AND(*xs):
    if all(isinstance(x, bool) for x in xs):
        return all(xs)
    if any(x is False for x in xs):
        return False
    return wrap(z3.And(*[term(x) for x in xs if x is not True]))


def OR(*xs):
    if all(isinstance(x, bool) for x in xs):
        return any(xs)
    if any(x is True for x in xs):
        return True
    return wrap(z3.Or(*[term(x) for x in xs if x is not False]))


def NOT(x):
    return (not x) if isinstance(x, bool) else wrap(z3.Not(term(x)))


def EQ(a, b):
    if concrete(a, b):
        return a == b
    return wrap(term(a) == term(b))


def NE(a, b):
    return NOT(EQ(a, b))


def LT(a, b):
    return a < b if concrete(a, b) else wrap(term(a) < term(b))


def LE(a, b):
    return a <= b if concrete(a, b) else wrap(term(a) <= term(b))


def IMPLIES(a, b):
    return OR(NOT(a), b)


def SUM(xs: Iterable) -> Any:
    xs = list(xs)
    if all(isinstance(x, (int, bool)) for x in xs):
        return sum(int(x) for x in xs)
    ts = [z3.If(term(x), term(1), term(0)) if isinstance(x, (bool, SymBool)) else term(x) for x in xs]
    out = ts[0]
    for t in ts[1:]:
        out = out + t
    return wrap(out)


def COUNT(preds: Iterable) -> Any:
    return SUM(ite(p, 1, 0) for p in preds)


def MIN(a, b):
    return ite(LT(b, a), b, a)


def MAX(a, b):
    return ite(LT(a, b), b, a)


def select(items: Sequence, idx, default=0):
    """``items[idx]`` for a symbolic ``idx`` (``default`` out of range)."""
    if isinstance(idx, int):
        return items[idx] if 0 <= idx < len(items) else default
    out = default
    for i in reversed(range(len(items))):
        out = ite(EQ(idx, i), items[i], out)
    return out


def one_hot_select(flags: Sequence, values: Sequence, default=0):
    """The value whose flag is set (at most one flag is set)."""
    out = default
    for f, v in zip(reversed(flags), reversed(values)):
        out = ite(f, v, out)
    return out


def ints(prefix: str, n: int) -> list[Sym]:
    return [Sym(f"{prefix}{i}") for i in range(n)]


def bools(prefix: str, n: int) -> list[SymBool]:
    return [SymBool(z3.Bool(f"{prefix}{i}")) for i in range(n)]


# --------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------

PROVED = "proved"
COUNTEREXAMPLE = "counterexample"
UNKNOWN = "unknown"


@dataclass
class ProofRow:
    """One line of ``batchspec prove``: what was proved, for which sizes, and how it went."""

    name: str  # short id, e.g. "mem.free"
    property: str  # what is claimed (invariant ids from spec.invariants where they exist)
    profile: str
    bound: str  # the sizes the claim covers
    result: str  # "proved" / "counterexample" / "unknown"
    seconds: float
    counterexample: str = ""  # readable witness when result == "counterexample"
    kind: str = ""  # memory / budget / translation / bmc
    details: dict = field(default_factory=dict)
    #: what the shipped spec and engine should give (every shipped row: "proved"; a BMC
    #: reachability row is proved by the witness it finds, see ``invariants.bmc.as_row``)
    expected: str = PROVED

    @property
    def ok(self) -> bool:
        return self.result == self.expected


def check_unsat(constraints: Sequence, timeout_ms: int = 600_000) -> tuple[str, z3.ModelRef | None]:
    """``proved`` if the constraints are unsatisfiable, else the model of a counterexample."""
    s = z3.Solver()
    s.set("timeout", timeout_ms)
    s.add(*[term(c) for c in constraints])
    r = s.check()
    if r == z3.unsat:
        return PROVED, None
    if r == z3.sat:
        return COUNTEREXAMPLE, s.model()
    return UNKNOWN, None


def value(model: z3.ModelRef, x) -> Any:
    """Concrete value of an int/bool/Sym/SymBool in ``model``."""
    if isinstance(x, (bool, int)):
        return x
    v = model.eval(term(x), model_completion=True)
    if z3.is_int_value(v):
        return v.as_long()
    if z3.is_bv_value(v):
        return v.as_signed_long()
    if z3.is_true(v):
        return True
    if z3.is_false(v):
        return False
    return str(v)


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
