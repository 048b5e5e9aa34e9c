"""The spec's decision rules as Z3 terms, obtained by running the spec's own code.

Each rule function of :mod:`spec.scheduler` and the block arithmetic of
:meth:`spec.kv.KVCacheManager.allocate_slots` is executed once on fresh
symbolic arguments (:mod:`invariants.proofs.symex`); its feasible paths are
merged into one ``If`` term, a *template*.  Applying a rule substitutes actual
arguments into the template.  With concrete (``int``) arguments the real
function is called instead, so the step model computes exactly what the spec
computes on concrete inputs too.

Nothing here restates a rule: change ``spec.scheduler.chunk_size`` and the
proofs see the change.  What the proofs *do* restate (the loop skeleton that
calls these rules) is in :mod:`invariants.proofs.stepmodel`.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, Sequence

import z3

import spec.kv as spec_kv
import spec.scheduler as spec_sched
from spec.config import SchedulerConfig
from invariants.proofs.symex import Explorer, Sym, SymBool, rebind, rebind_class, rebind_module, term, wrap, unwrap


def merge(paths, pick: Callable[[Any], Any]) -> z3.ExprRef:
    """One term equal to ``pick(result)`` on every path (paths partition the inputs)."""
    out = term(pick(paths[-1].result))
    for p in reversed(paths[:-1]):
        out = z3.If(p.condition, term(pick(p.result)), out)
    return out


class Template:
    """A rule lifted to a Z3 term over named parameters; :meth:`__call__` substitutes."""

    def __init__(self, name: str, params: Sequence[z3.ExprRef], outputs: Sequence[z3.ExprRef], paths: int,
                 concrete: Callable | None = None):
        self.name, self.params, self.outputs, self.paths = name, list(params), list(outputs), paths
        self.concrete = concrete

    def __call__(self, *args):
        if self.concrete is not None and all(isinstance(a, (int, bool)) for a in args):
            return self.concrete(*args)
        pairs = [(p, term(a)) for p, a in zip(self.params, args)]
        outs = [wrap(z3.substitute(o, *pairs), simplify=all(isinstance(a, (int, bool)) for a in args))
                for o in self.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)


def lift(name: str, fn: Callable, kinds: Sequence[str], outputs: int = 1, assumptions=(),
         concrete: Callable | None = None) -> Template:
    """Explore ``fn`` on fresh symbols (``kinds``: "int" or "bool" per argument)."""
    params = [z3.Int(f"{name}_a{i}") if k == "int" else z3.Bool(f"{name}_a{i}") for i, k in enumerate(kinds)]
    args = [Sym(p) if k == "int" else SymBool(p) for p, k in zip(params, kinds)]
    pre = [a(*params) if callable(a) else a for a in assumptions]
    paths = Explorer(pre).run(lambda: fn(*args))
    if outputs == 1:
        outs = [merge(paths, lambda r: r)]
    else:
        outs = [merge(paths, lambda r, i=i: r[i]) for i in range(outputs)]
    return Template(name, params, outs, len(paths), concrete)


# --------------------------------------------------------------------------
# spec.scheduler rules
# --------------------------------------------------------------------------

_SCHED = rebind_module(spec_sched)


_DEFAULTS = SchedulerConfig()


def config_stub(**kw) -> types.SimpleNamespace:
    """A config stand-in: every knob at its ``SchedulerConfig`` default (the shipped
    behaviour the proofs are about; knobs added later default to the old behaviour),
    the given ones (possibly symbolic) overridden."""
    base = {f.name: getattr(_DEFAULTS, f.name) for f in dataclasses.fields(SchedulerConfig)}
    base.update(kw)
    return types.SimpleNamespace(**base)


_cfg = config_stub


@functools.lru_cache(maxsize=None)
def chunk_size() -> Template:
    """``spec.scheduler.chunk_size(remaining, cap, budget)``."""
    fn = _SCHED["chunk_size"]
    return lift("chunk_size", fn, ["int"] * 3, concrete=unwrap(spec_sched.chunk_size))


@functools.lru_cache(maxsize=None)
def model_len_cap() -> Template:
    """``spec.scheduler.model_len_cap(n, num_computed_tokens, cfg)`` with ``cfg.max_model_len``."""
    fn = _SCHED["model_len_cap"]
    real = unwrap(spec_sched.model_len_cap)
    return lift("model_len_cap", lambda n, c, L: fn(n, c, _cfg(max_model_len=L)), ["int"] * 3,
                concrete=lambda n, c, L: real(n, c, _cfg(max_model_len=L)))


@functools.lru_cache(maxsize=None)
def long_prefill_cap() -> Template:
    """``spec.scheduler.long_prefill_cap(cfg, num_eligible)`` with ``cfg.long_prefill_token_threshold``."""
    fn = _SCHED["long_prefill_cap"]
    real = unwrap(spec_sched.long_prefill_cap)
    return lift("long_prefill_cap", lambda T, e: fn(_cfg(long_prefill_token_threshold=T), e), ["int"] * 2,
                concrete=lambda T, e: real(_cfg(long_prefill_token_threshold=T), e))


@functools.lru_cache(maxsize=None)
def never_fits(block_size: int) -> Template:
    """``spec.scheduler.never_fits(prompt_len, max_tokens, cfg)`` (block size fixed)."""
    fn = _SCHED["never_fits"]
    real = unwrap(spec_sched.never_fits)

    def cfg(L, U):
        return _cfg(max_model_len=L, block_size=block_size, usable_blocks=U)

    return lift(f"never_fits_bs{block_size}", lambda p, m, L, U: fn(p, m, cfg(L, U)), ["int"] * 4,
                assumptions=[lambda p, m, L, U: L >= 1],
                concrete=lambda p, m, L, U: real(p, m, cfg(L, U)))


@functools.lru_cache(maxsize=None)
def prompt_too_long() -> Template:
    """``spec.scheduler.prompt_too_long(prompt_len, cfg)``."""
    fn = _SCHED["prompt_too_long"]
    real = unwrap(spec_sched.prompt_too_long)
    return lift("prompt_too_long", lambda p, L: fn(p, _cfg(max_model_len=L)), ["int"] * 2,
                concrete=lambda p, L: real(p, _cfg(max_model_len=L)))


@functools.lru_cache(maxsize=None)
def length_capped() -> Template:
    """``spec.scheduler.length_capped(req, cfg)``: 0 keep going, 1 max_model_len, 2 max_tokens."""
    fn = _SCHED["length_capped"]
    real = unwrap(spec_sched.length_capped)
    codes = {None: 0, spec_sched.FINISH_MAX_MODEL_LEN: 1, spec_sched.FINISH_MAX_TOKENS: 2}

    class _Outputs:
        def __init__(self, n):
            self.symbolic_len = n

    def call(f, tok, nout, max_tokens, L):
        req = types.SimpleNamespace(num_tokens=tok, output_token_ids=_Outputs(nout), max_tokens=max_tokens)
        return codes[f(req, _cfg(max_model_len=L))]

    def concrete(tok, nout, max_tokens, L):
        req = types.SimpleNamespace(num_tokens=tok, output_token_ids=[0] * nout, max_tokens=max_tokens)
        return codes[real(req, _cfg(max_model_len=L))]

    return lift("length_capped", lambda *a: call(fn, *a), ["int"] * 4, concrete=concrete)


# --------------------------------------------------------------------------
# spec.kv.KVCacheManager.allocate_slots: the block arithmetic of one allocation
# --------------------------------------------------------------------------

_KV = rebind_module(spec_kv)
# ``_failure`` only classifies a failure for its reason text (which rule id to cite);
# it decides nothing, and its chained comparison would only multiply paths.
_SymManager = rebind_class(spec_kv.KVCacheManager, _KV, {
    "_failure": staticmethod(lambda rule_id, need, wm, free, what: spec_kv.AllocFailure(rule_id, "symbolic"))})
_SymPool = rebind_class(spec_kv.BlockPool, _KV)


class _SymLen(list):
    """A list stand-in whose ``len`` (under :func:`symex.slen`) is symbolic."""

    def __init__(self, items, n):
        super().__init__(items)
        self.symbolic_len = n

    def __bool__(self):
        return bool(self.symbolic_len > 0) if isinstance(self.symbolic_len, Sym) else self.symbolic_len > 0


class _Block:
    def __init__(self, ref_cnt):
        self.ref_cnt = ref_cnt
        self.block_hash = None


class _FreeCounter:
    """The free queue reduced to its length (what allocate_slots reads) and its pops."""

    def __init__(self, n):
        self.n = n
        self.symbolic_len = n

    def remove(self, block):
        self.n = self.n - 1
        self.symbolic_len = self.n


def _stub_manager(block_size, L, held, free):
    m = object.__new__(_SymManager)
    m.cfg = _cfg(max_model_len=L)
    m.block_size = block_size
    m.req_blocks = {"r": _SymLen([], held)}
    m.num_cached_block = {}
    pool = object.__new__(_SymPool)
    pool.caching = False
    pool.free = _FreeCounter(free)
    pool.popped = 0

    def get_new_blocks(n):
        pool.popped = pool.popped + n
        pool.free.n = pool.free.n - n
        pool.free.symbolic_len = pool.free.n
        return []

    pool.get_new_blocks = get_new_blocks
    m.pool = pool
    # ``num_free_blocks`` is a property reading ``len(self.free)``: the counter's symbolic length.
    return m


def _run_allocate(block_size: int, full: bool, comp, tok, n, held, nhit, hit_tokens, free, wm, L, *refs):
    """The real ``allocate_slots`` on a stub manager; ``(ok, popped, free_after)``."""
    m = _stub_manager(block_size, L, held, free)
    hits = _SymLen([_Block(r if isinstance(nhit, int) and k < nhit else
                           (1 if isinstance(nhit, int) else wrap(z3.If(term(nhit) > k, term(r), 1))))
                    for k, r in enumerate(refs)], nhit)
    if isinstance(nhit, int):
        hits = _SymLen(list(hits)[:nhit], nhit)
    req = types.SimpleNamespace(request_id="r", num_computed_tokens=comp, num_tokens=tok, block_hashes=[])
    out = m.allocate_slots(req, n, hits, hit_tokens, full, wm)
    ok = not isinstance(out, spec_kv.AllocFailure)
    return ok, m.pool.popped, m.pool.free.n


@functools.lru_cache(maxsize=None)
def allocate_slots(block_size: int, max_hits: int, full_sequence_must_fit: bool) -> Template:
    """``KVCacheManager.allocate_slots`` for one request, reduced to counts.

    Arguments: ``(num_computed, num_tokens, n, held, num_hit_blocks, hit_tokens, free,
    watermark, max_model_len, ref_0 .. ref_{max_hits-1})`` where ``ref_k`` is the ref
    count of hit block ``k`` (a block with ref 0 sits in the free queue: touching it
    consumes a free block).  Returns ``(ok, popped, free_after)``: whether it
    succeeded, how many new blocks it popped, and the free count afterwards (pops
    and touched evictable hits removed).  On failure nothing changes.  The real
    method runs on a stub pool whose free queue is a counter; with concrete
    arguments the real method runs directly.
    """
    def run(*args):
        return _run_allocate(block_size, full_sequence_must_fit, *args)

    return lift(f"alloc_bs{block_size}_h{max_hits}_f{int(full_sequence_must_fit)}", run, ["int"] * (9 + max_hits),
                outputs=3,
                assumptions=[lambda comp, tok, n, held, nhit, ht, free, wm, L, *refs: z3.And(
                    n >= 0, held >= 0, nhit >= 0, nhit <= max_hits, free >= 0, wm >= 0, comp >= 0, L >= 1,
                    *[r >= 0 for r in refs])],
                concrete=run)


def allocate(block_size: int, max_hits: int, full: bool, *, comp, tok, n, held, free, L, wm=0,
             nhit=0, hit_tokens=0, refs: Sequence = ()) -> tuple:
    """Apply :func:`allocate_slots`: ``(ok, popped, free_after)``."""
    refs = list(refs) + [1] * (max_hits - len(refs))
    return allocate_slots(block_size, max_hits, full)(comp, tok, n, held, nhit, hit_tokens, free, wm, L, *refs)
