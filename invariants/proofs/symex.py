"""A tiny symbolic executor: run the spec's and the engine's own Python on Z3 terms.

The proofs in this package avoid re-typing the code they are about.  Instead
they call the real functions — the spec's rules (``spec.scheduler.chunk_size``,
``never_fits``, ``check_stop`` …), ``KVCacheManager.allocate_slots``, the GPU
engine's ``gpu_engine.formulas`` and ``Scheduler._victim_order`` — with
*symbolic* arguments (the spec's step loops themselves are transliterated in
:mod:`~invariants.proofs.stepmodel` and cross-checked against ``SpecEngine``):

* :class:`Sym` wraps a Z3 integer term and :class:`SymBool` a Z3 boolean term.
  Arithmetic and comparisons build terms.  When Python needs a concrete truth
  value (``if``, ``while``, ``and``, a chained comparison, a ``sort``),
  :meth:`SymBool.__bool__` asks the :class:`Explorer`, which *forks*: the code
  is re-run once per feasible branch (depth-first, pruned by Z3).  When Python
  needs a concrete integer (``range(n)``, slicing, ``int(x)``), the value is
  forked over its feasible values the same way (bounded by ``index_bound``).
* :class:`ZArr` is a 1-D array of Z3 terms with the handful of tensor
  operations the engine's formulas use (operators, ``clip``, ``cumsum(0)``,
  ``sum``, indexing); :data:`SYM_XP` stands in for :mod:`gpu_engine.xp`.
* :func:`rebind` copies a function with extra globals: ``min``/``max`` that
  build ``If`` terms instead of forking (Python's ``min(a, b)`` *is*
  ``b if b < a else a``; the term is the same, the path count is not), ``len``
  that understands symbolic-length stubs, ``xp`` → :data:`SYM_XP`, and any
  test-only mutant the caller substitutes.  The original function and its
  module are never modified.

Each explored path ends with its path condition and the values the code
returned, so a proof checks ``pc ∧ ¬property`` per path.  The executor is
exact for the code it runs: it adds no abstraction, it only enumerates paths.
"""
from __future__ import annotations

import builtins
import operator
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import z3

# --------------------------------------------------------------------------
# terms
# --------------------------------------------------------------------------


#: The sort of symbolic integers: mathematical integers (the default), or
#: bit-vectors of a fixed width inside ``with bitvectors(w):`` (the block-pool
#: proofs: bounded ids and counts, where bit-blasting beats integer arithmetic).
_SORT: list = ["int", 0]


@contextmanager
def bitvectors(width: int):
    """Make new symbolic integers and constants ``width``-bit vectors (signed compare)."""
    old = list(_SORT)
    _SORT[:] = ["bv", width]
    try:
        yield
    finally:
        _SORT[:] = old


def num(v: int) -> z3.ExprRef:
    return z3.IntVal(v) if _SORT[0] == "int" else z3.BitVecVal(v, _SORT[1])


def int_var(name: str) -> z3.ExprRef:
    return z3.Int(name) if _SORT[0] == "int" else z3.BitVec(name, _SORT[1])


def term(x: Any) -> z3.ExprRef:
    """The Z3 term of a Python or symbolic value."""
    if isinstance(x, (Sym, SymBool)):
        return x.e
    if isinstance(x, bool):
        return z3.BoolVal(x)
    if isinstance(x, int):
        return num(x)
    if isinstance(x, z3.ExprRef):
        return x
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalar
        return term(x.item())
    raise TypeError(f"cannot make a Z3 term of {type(x).__name__}: {x!r}")


def wrap(e: z3.ExprRef, simplify: bool = False) -> "Sym | SymBool | int | bool":
    """A Python value for a term: a constant when it is (or, with ``simplify``, reduces to) one."""
    s = z3.simplify(e) if simplify else e
    if z3.is_int_value(s):
        return s.as_long()
    if z3.is_bv_value(s):
        return s.as_signed_long()
    if z3.is_true(s):
        return True
    if z3.is_false(s):
        return False
    return SymBool(e) if z3.is_bool(e) else Sym(e)


def _is_sym(x: Any) -> bool:
    return isinstance(x, (Sym, SymBool))


class Sym:
    """A symbolic integer."""

    __slots__ = ("e",)

    def __init__(self, e: z3.ArithRef | str):
        self.e = int_var(e) if isinstance(e, str) else e

    def _bin(self, other, op, swap=False):
        if isinstance(other, ZArr):
            return NotImplemented
        if not isinstance(other, (int, Sym, SymBool, z3.ExprRef)) and not hasattr(other, "item"):
            return NotImplemented
        a, b = (term(other), self.e) if swap else (self.e, term(other))
        return wrap(op(a, b))

    __add__ = lambda s, o: s._bin(o, operator.add)
    __radd__ = lambda s, o: s._bin(o, operator.add, True)
    __sub__ = lambda s, o: s._bin(o, operator.sub)
    __rsub__ = lambda s, o: s._bin(o, operator.sub, True)
    __mul__ = lambda s, o: s._bin(o, operator.mul)
    __rmul__ = lambda s, o: s._bin(o, operator.mul, True)
    __floordiv__ = lambda s, o: s._bin(o, _floordiv)
    __rfloordiv__ = lambda s, o: s._bin(o, _floordiv, True)
    __mod__ = lambda s, o: s._bin(o, _mod)
    __lt__ = lambda s, o: s._bin(o, operator.lt)
    __le__ = lambda s, o: s._bin(o, operator.le)
    __gt__ = lambda s, o: s._bin(o, operator.gt)
    __ge__ = lambda s, o: s._bin(o, operator.ge)
    __eq__ = lambda s, o: s._bin(o, operator.eq)  # type: ignore[assignment]
    __ne__ = lambda s, o: s._bin(o, operator.ne)  # type: ignore[assignment]

    def __neg__(self):
        return wrap(-self.e)

    def __pos__(self):
        return self

    def __bool__(self) -> bool:
        return bool(SymBool(self.e != 0))

    def __index__(self) -> int:
        return concretize(self)

    __int__ = __index__

    def __hash__(self) -> int:
        return id(self)

    def __format__(self, spec: str) -> str:  # reasons' f-strings: text only, never decisions
        return "?"

    __str__ = lambda s: f"<{s.e}>"
    __repr__ = __str__


class SymBool:
    """A symbolic truth value; ``bool()`` of it forks the current path."""

    __slots__ = ("e",)

    def __init__(self, e: z3.BoolRef):
        self.e = e

    def __bool__(self) -> bool:
        return current().decide(self.e)

    def _bin(self, other, op):
        if isinstance(other, ZArr):
            return NotImplemented
        return wrap(op(self.e, _as_bool(other)))

    __and__ = __rand__ = lambda s, o: s._bin(o, lambda a, b: z3.And(a, b))
    __or__ = __ror__ = lambda s, o: s._bin(o, lambda a, b: z3.Or(a, b))
    __xor__ = __rxor__ = lambda s, o: s._bin(o, lambda a, b: z3.Xor(a, b))
    __eq__ = lambda s, o: s._bin(o, operator.eq)  # type: ignore[assignment]
    __ne__ = lambda s, o: s._bin(o, lambda a, b: z3.Not(a == b))  # type: ignore[assignment]

    def __invert__(self):
        return wrap(z3.Not(self.e))

    # ``True + x`` / counting: a bool is an int in Python
    def _int(self):
        return Sym(z3.If(self.e, 1, 0))

    __add__ = lambda s, o: s._int() + o
    __radd__ = lambda s, o: o + s._int()

    def __hash__(self) -> int:
        return id(self)

    __format__ = Sym.__format__
    __str__ = lambda s: f"<{s.e}>"
    __repr__ = __str__


def _as_bool(x) -> z3.BoolRef:
    if isinstance(x, SymBool):
        return x.e
    if isinstance(x, Sym):
        return x.e != 0
    return term(bool(x))


def _floordiv(a, b):
    # Z3's integer division is Euclidean: floor division when the divisor is > 0.
    # Every divisor in the spec and the engine is a block size (> 0).
    return a / b


def _mod(a, b):
    return a % b


# --------------------------------------------------------------------------
# min / max / len without forking
# --------------------------------------------------------------------------


def _numeric(x) -> bool:
    return isinstance(x, (int, Sym, SymBool)) and not isinstance(x, ZArr)


def smin(*args, key=None, default=None):
    """``builtins.min``, as an ``If`` term when its arguments are numbers."""
    items = args[0] if len(args) == 1 else args
    items = list(items)
    if key is None and items and all(_numeric(x) for x in items) and any(_is_sym(x) for x in items):
        best = items[0]
        for x in items[1:]:
            best = wrap(z3.If(term(x) < term(best), term(x), term(best)))
        return best
    kw = {} if key is None else {"key": key}
    if default is not None:
        kw["default"] = default
    return builtins.min(items, **kw)


def smax(*args, key=None, default=None):
    """``builtins.max``, as an ``If`` term when its arguments are numbers."""
    items = args[0] if len(args) == 1 else args
    items = list(items)
    if key is None and items and all(_numeric(x) for x in items) and any(_is_sym(x) for x in items):
        best = items[0]
        for x in items[1:]:
            best = wrap(z3.If(term(x) > term(best), term(x), term(best)))
        return best
    kw = {} if key is None else {"key": key}
    if default is not None:
        kw["default"] = default
    return builtins.max(items, **kw)


def slen(x) -> Any:
    """``len``, or the symbolic length of a stub that has one."""
    sym = getattr(x, "symbolic_len", None)
    if sym is not None:
        return sym
    return builtins.len(x)


# --------------------------------------------------------------------------
# the explorer
# --------------------------------------------------------------------------


class PathLimit(RuntimeError):
    pass


_CURRENT: list["Explorer"] = []


def current() -> "Explorer":
    if not _CURRENT:
        raise RuntimeError("a symbolic condition was used outside Explorer.run()")
    return _CURRENT[-1]


def concretize(x: Sym, bound: int | None = None) -> int:
    """Fork ``x`` over its feasible values (``range(lo, hi)``; ints from slicing and ``range``)."""
    ex = current()
    lo, hi = ex.index_range
    for v in range(lo, hi):
        if ex.decide(x.e == v):
            return v
    ex.decide(z3.BoolVal(False))  # pragma: no cover - infeasible: the value is out of the bound
    raise AssertionError("unreachable")


@dataclass
class Path:
    """One explored path: its condition and what the code returned on it."""

    condition: z3.BoolRef
    result: Any
    decisions: int


class _Infeasible(Exception):
    pass


class Explorer:
    """Depth-first enumeration of the feasible paths of a piece of Python code.

    ``run(thunk)`` calls ``thunk()`` once per path.  The thunk must build its
    own (fresh) objects: the code under test mutates them.  Paths are pruned by
    an incremental Z3 solver holding ``assumptions`` and the decisions so far.
    """

    def __init__(self, assumptions: Iterable[z3.BoolRef] = (), max_paths: int = 200_000,
                 index_range: tuple[int, int] = (0, 64)):
        self.assumptions = [term(a) for a in assumptions]
        self.max_paths = max_paths
        self.index_range = index_range
        self.solver = z3.Solver()
        self.solver.add(*self.assumptions)
        self.stack: list[list] = []  # [value, alternative still open]
        self.depth = 0
        self.conds: list[z3.BoolRef] = []
        self.checks = 0

    def decide(self, cond: z3.BoolRef) -> bool:
        k = self.depth
        if k < len(self.stack):
            value = self.stack[k][0]
        else:
            s = z3.simplify(cond)
            if z3.is_true(s) or z3.is_false(s):
                value, alt = z3.is_true(s), False
            else:
                self.checks += 2
                can_t = self.solver.check(cond) != z3.unsat
                can_f = self.solver.check(z3.Not(cond)) != z3.unsat
                if not can_t and not can_f:
                    raise _Infeasible()
                value, alt = can_t, can_t and can_f
            self.stack.append([value, alt])
        chosen = cond if value else z3.Not(cond)
        self.solver.push()
        self.solver.add(chosen)
        self.conds.append(chosen)
        self.depth += 1
        return value

    def _backtrack(self) -> bool:
        while self.stack and not self.stack[-1][1]:
            self.stack.pop()
        if not self.stack:
            return False
        top = self.stack[-1]
        top[0], top[1] = not top[0], False
        return True

    def run(self, thunk: Callable[[], Any]) -> list[Path]:
        paths: list[Path] = []
        _CURRENT.append(self)
        try:
            while True:
                self.depth, self.conds = 0, []
                try:
                    result = thunk()
                    paths.append(Path(z3.And(*self.conds) if self.conds else z3.BoolVal(True), result, self.depth))
                except _Infeasible:
                    pass
                finally:
                    if self.depth:
                        self.solver.pop(self.depth)
                del self.stack[self.depth:]  # decisions past the end of this path are stale
                if len(paths) > self.max_paths:
                    raise PathLimit(f"more than {self.max_paths} paths")
                if not self._backtrack():
                    return paths
        finally:
            _CURRENT.pop()


# --------------------------------------------------------------------------
# arrays: the tensor operations gpu_engine.formulas uses
# --------------------------------------------------------------------------


class ZArr:
    """A 1-D array of Z3 terms (ints or bools), with numpy/torch-style operators."""

    __array_priority__ = 1000  # numpy: let ZArr's reflected operators win

    def __init__(self, items: Iterable[Any]):
        self.v = tuple(term(x) for x in items)

    @classmethod
    def ints(cls, name: str, n: int) -> "ZArr":
        return cls(z3.Int(f"{name}{i}") for i in range(n))

    def __len__(self) -> int:
        return len(self.v)

    def __iter__(self):
        return (wrap(x) for x in self.v)

    def _other(self, o) -> tuple:
        if isinstance(o, ZArr):
            if len(o) != len(self):
                raise ValueError(f"shape mismatch {len(self)} vs {len(o)}")
            return o.v
        if hasattr(o, "__len__") and not isinstance(o, (str, bytes)):
            return tuple(term(x) for x in o)
        t = term(o)
        return (t,) * len(self)

    def _map(self, o, op, swap=False):
        b = self._other(o)
        if swap:
            return ZArr(op(y, x) for x, y in zip(self.v, b))
        return ZArr(op(x, y) for x, y in zip(self.v, b))

    __add__ = lambda s, o: s._map(o, operator.add)
    __radd__ = lambda s, o: s._map(o, operator.add, True)
    __sub__ = lambda s, o: s._map(o, operator.sub)
    __rsub__ = lambda s, o: s._map(o, operator.sub, True)
    __mul__ = lambda s, o: s._map(o, operator.mul)
    __rmul__ = lambda s, o: s._map(o, operator.mul, True)
    __floordiv__ = lambda s, o: s._map(o, _floordiv)
    __rfloordiv__ = lambda s, o: s._map(o, _floordiv, True)
    __mod__ = lambda s, o: s._map(o, _mod)
    __lt__ = lambda s, o: s._map(o, operator.lt)
    __le__ = lambda s, o: s._map(o, operator.le)
    __gt__ = lambda s, o: s._map(o, operator.gt)
    __ge__ = lambda s, o: s._map(o, operator.ge)
    __eq__ = lambda s, o: s._map(o, operator.eq)  # type: ignore[assignment]
    __ne__ = lambda s, o: s._map(o, lambda a, b: z3.Not(a == b))  # type: ignore[assignment]
    __and__ = lambda s, o: s._map(o, lambda a, b: z3.And(a, b))
    __or__ = lambda s, o: s._map(o, lambda a, b: z3.Or(a, b))
    __rand__ = __and__
    __ror__ = __or__
    __hash__ = None  # type: ignore[assignment]

    def __neg__(self):
        return ZArr(-x for x in self.v)

    def __invert__(self):
        return ZArr(z3.Not(x) for x in self.v)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = (None if v is None else int(v) for v in (idx.start, idx.stop, idx.step))
            return ZArr(self.v[slice(start, stop, step)])
        if isinstance(idx, ZArr):
            # Boolean-mask indexing keeps the shape: dropped entries become -1.  Sound
            # only where the result feeds a reduction that ignores negative entries
            # (``bincount``, the one use in gpu_engine.formulas).
            if not all(z3.is_bool(m) for m in idx.v):
                raise TypeError("symbolic integer index arrays are not supported")
            return ZArr(z3.If(m, x, -1) for m, x in zip(idx.v, self.v))
        if hasattr(idx, "__len__"):
            return ZArr(self.v[int(i)] for i in idx)
        return wrap(self.v[int(idx)])

    def clip(self, min=None, max=None):  # noqa: A002 - numpy/torch keyword names
        out = self.v
        if min is not None:
            lo = term(min)
            out = tuple(z3.If(x < lo, lo, x) for x in out)
        if max is not None:
            hi = term(max)
            out = tuple(z3.If(x > hi, hi, x) for x in out)
        return ZArr(out)

    def cumsum(self, dim: int = 0):
        assert dim == 0
        acc, out = z3.IntVal(0), []
        for x in self.v:
            acc = acc + _as_int(x)
            out.append(acc)
        return ZArr(out)

    def sum(self):
        return wrap(z3.Sum([_as_int(x) for x in self.v]) if self.v else z3.IntVal(0))

    def any(self):
        return wrap(z3.Or(*self.v) if self.v else z3.BoolVal(False))

    def all(self):
        return wrap(z3.And(*self.v) if self.v else z3.BoolVal(True))

    def terms(self) -> tuple:
        return self.v

    def __repr__(self) -> str:
        return f"ZArr({list(self.v)})"


def _as_int(x):
    return z3.If(x, 1, 0) if z3.is_bool(x) else x


def _where(cond, a, b):
    n = len(cond)
    av = a._other(a) if isinstance(a, ZArr) else (term(a),) * n
    bv = b._other(b) if isinstance(b, ZArr) else (term(b),) * n
    return ZArr(z3.If(c, x, y) for c, x, y in zip(cond.v, av, bv))


def _minimum(a, b):
    return _where(a < b if isinstance(a, ZArr) else b > a, a, b)


def _maximum(a, b):
    return _where(a > b if isinstance(a, ZArr) else b < a, a, b)


def _first_true(mask: ZArr):
    """Index of the first True, or ``len(mask)`` (``gpu_engine.xp.first_true``)."""
    out = z3.IntVal(len(mask))
    for i in reversed(range(len(mask))):
        out = z3.If(mask.v[i], i, out)
    return wrap(out)


def _nonzero(mask: ZArr):
    """Indices of the True entries: concrete, by forking on each entry."""
    import numpy as np

    return np.asarray([i for i, m in enumerate(mask.v) if current().decide(m)], dtype=np.int64)


def _stable_argsort(keys: ZArr):
    """A stable ascending argsort, by forking on the comparisons Python's sort makes."""
    import numpy as np

    return np.asarray(sorted(range(len(keys)), key=lambda i: _Key(keys.v[i])), dtype=np.int64)


class _Key:
    __slots__ = ("e",)

    def __init__(self, e):
        self.e = e

    def __lt__(self, other):
        return current().decide(self.e < other.e)


def _bincount(x: ZArr, length: int):
    """``bincount(x, minlength=length)`` over the non-negative entries (see mask indexing)."""
    return ZArr(z3.Sum([z3.If(v == j, 1, 0) for v in x.v]) if x.v else z3.IntVal(0) for j in range(length))


def _exclusive_cumsum(x):
    from gpu_engine import xp

    return xp.exclusive_cumsum(x)  # the engine's own definition: ``x.cumsum(0) - x``


#: Stand-in for :mod:`gpu_engine.xp` when the engine's formulas run on :class:`ZArr`.
SYM_XP = types.SimpleNamespace(
    minimum=_minimum,
    maximum=_maximum,
    where=_where,
    exclusive_cumsum=_exclusive_cumsum,
    first_true=_first_true,
    nonzero=_nonzero,
    stable_argsort=_stable_argsort,
    bincount=_bincount,
)


# --------------------------------------------------------------------------
# rebinding: the same code, symbolic builtins
# --------------------------------------------------------------------------

SHADOWS = {"min": smin, "max": smax, "len": slen}


def unwrap(fn: Callable) -> Callable:
    """The plain function under ``staticmethod`` and ``functools.wraps`` wrappers.

    The spec's ``@rule`` wrapper only counts how often a rule fired (for fuzz
    coverage); it decides nothing, so the proofs run the function it wraps.
    """
    fn = getattr(fn, "__func__", fn)
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def rebind(fn: Callable, overrides: dict[str, Any] | None = None, namespace: dict | None = None) -> Callable:
    """A copy of ``fn`` whose globals add :data:`SHADOWS` and ``overrides``.

    ``namespace``: share one globals dict between several rebound functions
    (so that a rebound function calling another one by name gets the rebound one).
    """
    fn = unwrap(fn)
    if namespace is None:
        namespace = dict(fn.__globals__)
        namespace.update(SHADOWS)
        namespace.update(overrides or {})
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update({k: v for k, v in fn.__dict__.items() if k != "__wrapped__"})
    new.__doc__ = fn.__doc__
    return new


def rebind_module(module, overrides: dict[str, Any] | None = None) -> dict:
    """A globals dict for ``module`` whose plain functions are all rebound into it."""
    ns = dict(module.__dict__)
    ns.update(SHADOWS)
    for name, obj in list(ns.items()):
        if isinstance(obj, types.FunctionType) and obj.__module__ == module.__name__:
            ns[name] = rebind(obj, namespace=ns)
    ns.update(overrides or {})
    return ns


def rebind_class(cls: type, namespace: dict, overrides: dict[str, Any] | None = None) -> type:
    """A subclass-free copy of ``cls`` whose methods run with ``namespace`` as globals.

    Only the methods are copied; instances are made with ``object.__new__`` and
    given the attributes the code under test reads (stubs for the rest).
    """
    body: dict[str, Any] = {}
    for name, obj in cls.__dict__.items():
        if isinstance(obj, types.FunctionType):
            body[name] = rebind(obj, namespace=namespace)
        elif isinstance(obj, staticmethod):
            body[name] = staticmethod(rebind(obj.__func__, namespace=namespace))
        elif isinstance(obj, property):
            body[name] = property(rebind(obj.fget, namespace=namespace) if obj.fget else None)
    body.update(overrides or {})
    return type(f"Sym{cls.__name__}", (), body)


def mutate(fn: Callable, old: str, new: str, *more: str) -> Callable:
    """Test-only: ``fn`` with source fragments replaced (a deliberately broken model).

    ``more``: further ``old, new`` pairs.  Each fragment must occur exactly once.
    The mutant is compiled in a copy of ``fn``'s globals; nothing shipped changes.
    """
    import inspect
    import textwrap

    fn = unwrap(fn)
    src = getattr(fn, "__mutant_source__", None) or textwrap.dedent(inspect.getsource(fn))
    pairs = [(old, new)] + list(zip(more[::2], more[1::2]))
    for a, b in pairs:
        if src.count(a) != 1:
            raise ValueError(f"mutant fragment {a!r} found {src.count(a)} times in {fn.__qualname__}")
        src = src.replace(a, b)
    lines = [ln for ln in src.splitlines() if not ln.lstrip().startswith("@")]
    ns = dict(fn.__globals__)
    exec(compile("\n".join(lines), f"<mutant of {fn.__qualname__}>", "exec"), ns)
    out = ns[fn.__name__]
    out.__mutant_source__ = "\n".join(lines)
    return out
