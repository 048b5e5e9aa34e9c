"""Each closed form of :mod:`gpu_engine.formulas` equals the sequential loop it replaces.

The loops below are written out the way vLLM runs them (one request at a
time); Hypothesis draws the inputs, and every formula runs on both array
backends (numpy views on CPU, torch tensors elsewhere).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_engine import formulas as F
from gpu_engine.block_pool import FreeQueue
from gpu_engine.xp import Backend

BACKENDS = [lambda v: np.asarray(v, dtype=np.int64), lambda v: torch.as_tensor(np.asarray(v, dtype=np.int64))]
small = st.integers(0, 40)
settings.register_profile("gpu_formulas", max_examples=150, deadline=None)
settings.load_profile("gpu_formulas")


def cdiv(a, b):
    return -(-a // b)


def listify(x):
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


@pytest.mark.parametrize("arr", BACKENDS)
@given(ntok=st.lists(st.integers(1, 60), min_size=1, max_size=12), data=st.data(),
       budget=st.integers(1, 80), cap=st.integers(0, 20), mml=st.integers(2, 70))
def test_running_phase_budget_walk(arr, ntok, data, budget, cap, mml):
    comp = [data.draw(st.integers(0, t - 1)) for t in ntok]
    n_loop, reached_loop, left = [], [], budget
    for t, c in zip(ntok, comp):  # vLLM's loop
        if left <= 0:
            n_loop.append(0)
            reached_loop.append(False)
            continue
        reached_loop.append(True)
        n = t - c
        if 0 < cap < n:
            n = cap
        n = min(n, left)
        n = min(n, mml - c - 1)
        n_loop.append(max(n, 0))
        if n > 0:
            left -= n
    n, reached = F.grant_tokens(F.token_demand(arr(ntok) * 1, arr(comp) * 1, cap, mml), budget)
    assert listify(n) == n_loop
    assert [bool(v) for v in reached.tolist()] == reached_loop


@pytest.mark.parametrize("arr", BACKENDS)
@given(need=st.lists(small, max_size=12), free=small)
def test_first_failed_allocation(arr, need, free):
    expect, f = len(need), free
    for i, d in enumerate(need):  # allocate in order until one does not fit
        if d > f:
            expect = i
            break
        f -= d
    assert F.first_overflow(arr(need), free) == expect


@pytest.mark.parametrize("arr", BACKENDS)
@given(freed=st.lists(st.integers(0, 6), min_size=1, max_size=10), data=st.data(), free=small, need=st.integers(1, 30))
def test_victim_count(arr, freed, data, free, need):
    self_pos = data.draw(st.integers(0, len(freed) - 1))
    count, f, took_self = 0, free, False
    while need > f:  # preempt in order until it fits or the requester itself is taken
        f += freed[count]
        count += 1
        if count - 1 == self_pos:
            took_self = True
            break
    if count == 0:
        return  # the allocation did not fail: no preemption event
    assert F.victims_needed(arr(freed), free, need, self_pos) == (count, took_self)


@pytest.mark.parametrize("arr", BACKENDS)
@given(holders=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), max_size=12),
       nvict=st.integers(1, 8))
def test_blocks_return_with_their_last_holder(arr, holders, nvict):
    # holders[b] = the victims (by order position) that hold block b
    holders = [[v % nvict for v in h] for h in holders]
    holders = [sorted(set(h)) for h in holders]
    ref = {b: len(h) for b, h in enumerate(holders)}
    expect = []
    for v in range(nvict):  # free victims in order, decrementing ref counts
        back = 0
        for b, h in enumerate(holders):
            if v in h:
                ref[b] -= 1
                back += ref[b] == 0
        expect.append(back)
    position = [v for b, h in enumerate(holders) for v in h]
    last = [max(h) for b, h in enumerate(holders) for v in h]
    assert listify(F.freed_by_position(arr(position) * 1, arr(last) * 1, nvict)) == expect


def admission_walk(cands, budget, free, watermark, running, cap, chunked, full_isl, bs, mml):
    """vLLM's phase-2 loop over a known window of (tokens, hit blocks, evictable hits, reserve) candidates;
    a reserve ``R > 0`` (kv_reservation="full") allocates at least ``R`` slots and skips the whole-sequence check.
    Returns the clamped columns and how many are admitted."""
    ntok, nhit, evict, reserve = [], [], [], []
    for t, h, e, r in cands:
        h = min(h, (t - 1) // bs)
        ntok.append(t)
        nhit.append(h)
        evict.append(min(e, h))
        reserve.append(min(r, mml - 1))
    count, left, f = 0, budget, free
    for j, (t, h, e, r) in enumerate(zip(ntok, nhit, evict, reserve)):
        if left <= 0:
            break
        k = h * bs
        n = t - k
        if 0 < cap < n:
            n = cap
        if not chunked and n > left:
            break
        n = min(n, left)
        wm = watermark if running + j > 0 else 0
        if full_isl and not r and max(cdiv(min(t, mml), bs) - h, 0) + e + wm > f:
            break
        need = max(cdiv(max(min(k + n, mml), r), bs) - h, 0) + e
        if need + wm > f:
            break
        f -= need
        left -= n
        count += 1
    return ntok, nhit, evict, reserve, count


@pytest.mark.parametrize("arr", BACKENDS)
@given(cands=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=8),
       budget=st.integers(1, 80), free=st.integers(0, 30), watermark=st.integers(0, 4), running=st.integers(0, 2),
       cap=st.integers(0, 20), chunked=st.booleans(), full_isl=st.booleans(), bs=st.sampled_from([1, 2, 4, 16]),
       mml=st.integers(8, 80))
def test_admission_walk(arr, cands, budget, free, watermark, running, cap, chunked, full_isl, bs, mml):
    ntok, nhit, evict, _, count = admission_walk([c + (0,) for c in cands], budget, free, watermark, running, cap,
                                                 chunked, full_isl, bs, mml)
    got, n, need = F.admission(arr(ntok) * 1, arr(nhit) * bs, arr(nhit) * 1, arr(evict) * 1, budget=budget, free=free,
                               watermark=watermark, num_running=running, cap=cap, chunked=chunked,
                               full_isl=full_isl, block_size=bs, max_model_len=mml)
    assert got == count


@given(ops=st.lists(st.tuples(st.sampled_from(["pop", "prepend", "append", "remove"]), st.integers(0, 5)),
                    max_size=60))
def test_free_queue_is_a_deque_with_removal(ops):
    n = 12
    q = FreeQueue(Backend("cpu"), n, 1)
    model = list(range(1, n))
    out = []
    for op, k in ops:
        if op == "pop":
            k = min(k, len(model))
            got = listify(q.popleft(k))
            assert got == model[:k]
            out += got
            model = model[k:]
        elif op in ("prepend", "append") and out:
            blocks, out = out[:k], out[k:]
            (q.prepend if op == "prepend" else q.append)(np.asarray(blocks, dtype=np.int64))
            model = blocks + model if op == "prepend" else model + blocks
        elif op == "remove" and model:
            victims = model[k % len(model)::3][:2]
            q.remove(np.asarray(victims, dtype=np.int64))
            model = [b for b in model if b not in victims]
            out += victims
        assert q.ids() == model and len(q) == len(model)


@pytest.mark.parametrize("arr", BACKENDS)
def test_free_order_head_and_tail(arr):
    # two requests freed in order: A = blocks (reversed) [a2, a1h], B = [b1, shared]
    groups = arr([0, 0, 1, 1])
    last = arr([1, 1, 1, 1]) > 0
    zero = arr([1, 1, 1, 1]) > 0
    hashed = arr([0, 1, 0, 1]) > 0
    head, tail = F.free_order(groups, last, zero, hashed)
    assert listify(head) == [2, 0]  # B's unhashed block ends up ahead of A's
    assert listify(tail) == [1, 3]  # cached blocks in freeing order


@pytest.mark.parametrize("arr", BACKENDS)
def test_stop_codes_follow_vllm_order(arr):
    tok = arr([2, 5, 9, 9, 9, 2])
    code = F.stop_codes(tok, arr([1, 1, 1, 1, 1, 0]) > 0, arr([0, 1, 0, 0, 1, 0]) > 0,
                        num_tokens=arr([10, 10, 64, 10, 64, 10]), num_output=arr([1, 1, 1, 5, 5, 5]),
                        max_tokens=arr([5, 5, 5, 5, 5, 9]), eos_token_id=2, max_model_len=64)
    assert listify(code) == [F.STOP_EOS, F.STOP_TOKEN, F.STOP_MAX_MODEL_LEN, F.STOP_MAX_TOKENS,
                             F.STOP_TOKEN, F.STOP_NONE]


@pytest.mark.parametrize("arr", BACKENDS)
@given(cands=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 3), st.integers(0, 3), st.integers(0, 90)),
                      min_size=1, max_size=8),
       budget=st.integers(1, 80), free=st.integers(0, 30), watermark=st.integers(0, 4), running=st.integers(0, 2),
       cap=st.integers(0, 20), chunked=st.booleans(), full_isl=st.booleans(), bs=st.sampled_from([1, 2, 4, 16]),
       mml=st.integers(8, 80))
def test_admission_walk_with_reservation(arr, cands, budget, free, watermark, running, cap, chunked, full_isl, bs, mml):
    """kv_reservation="full": each candidate's allocation covers at least its reservation
    ``R`` slots, and the whole-sequence check is skipped where ``R > 0``."""
    ntok, nhit, evict, reserve, count = admission_walk(cands, budget, free, watermark, running, cap, chunked,
                                                       full_isl, bs, mml)
    got, n, need = F.admission(arr(ntok) * 1, arr(nhit) * bs, arr(nhit) * 1, arr(evict) * 1, budget=budget, free=free,
                               watermark=watermark, num_running=running, cap=cap, chunked=chunked,
                               full_isl=full_isl, block_size=bs, max_model_len=mml, reserve=arr(reserve) * 1)
    assert got == count


@pytest.mark.parametrize("arr", BACKENDS)
@given(cands=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 30)), min_size=1, max_size=8),
       budget=st.integers(1, 80), free=st.integers(0, 30), watermark=st.integers(0, 4), running=st.integers(0, 2),
       cap=st.integers(0, 20), full_isl=st.booleans(), bs=st.sampled_from([1, 2, 4, 16]), mml=st.integers(8, 100))
def test_swap_in_walk(arr, cands, budget, free, watermark, running, cap, full_isl, bs, mml):
    """SWAP.IN: swapped requests (no GPU block, ``computed`` tokens kept) resume in order
    while budget, blocks for computed + chunk (and the whole sequence) and the watermark allow."""
    comp = [c for c, _ in cands]
    ntok = [c + d for c, d in cands]
    count, left, f, grants, needs = 0, budget, free, [], []
    for j, (c, t) in enumerate(zip(comp, ntok)):
        if left <= 0:
            break
        n = t - c
        if 0 < cap < n:
            n = cap
        n = min(n, left, mml - c - 1)
        wm = watermark if running + j > 0 else 0
        if full_isl and cdiv(min(t, mml), bs) + wm > f:
            break
        need = cdiv(max(min(min(c, mml) + n, mml), 0), bs)
        if need + wm > f:
            break
        f -= need
        left -= n
        count += 1
        grants.append(n)
        needs.append(need)
    demand = F.token_demand(arr(ntok) * 1, arr(comp) * 1, cap, mml)
    got, n, need = F.swap_in(demand, arr(comp) * 1, arr(ntok) * 1, budget=budget, free=free, watermark=watermark,
                             num_running=running, full_isl=full_isl, block_size=bs, max_model_len=mml)
    assert got == count
    assert listify(n)[:count] == grants and listify(need)[:count] == needs


# -- host walks: the closed forms evaluated on plain ints for a short CPU window / segment --------


@given(cands=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 3), st.integers(0, 3), st.integers(0, 90)),
                      min_size=1, max_size=10),
       budget=st.integers(1, 80), free=st.integers(0, 30), watermark=st.integers(0, 4), running=st.integers(0, 2),
       cap=st.integers(0, 20), chunked=st.booleans(), full_isl=st.booleans(), bs=st.sampled_from([1, 2, 4, 16]),
       mml=st.integers(8, 80), reserved=st.booleans())
def test_admission_host_walk_equals_the_closed_form(cands, budget, free, watermark, running, cap, chunked, full_isl,
                                                     bs, mml, reserved):
    """formulas.admission_walk (host ints) admits as many as vLLM's loop and gives each admitted
    candidate the same grant and block count as formulas.admission (with and without a reservation)."""
    if not reserved:
        cands = [c[:3] + (0,) for c in cands]
    ntok, nhit, evict, reserve, count = admission_walk(cands, budget, free, watermark, running, cap, chunked,
                                                       full_isl, bs, mml)
    kw = dict(budget=budget, free=free, watermark=watermark, num_running=running, cap=cap, chunked=chunked,
              full_isl=full_isl, block_size=bs, max_model_len=mml)
    got, n, need = F.admission_walk(ntok, nhit, evict, reserve=reserve if reserved else None, **kw)
    a = BACKENDS[0]
    want, n_cf, need_cf = F.admission(a(ntok), a(nhit) * bs, a(nhit), a(evict), reserve=a(reserve) if reserved else None, **kw)
    assert got == count == want
    assert n == listify(n_cf)[:count] and need == listify(need_cf)[:count], "the admitted candidates' grants and blocks"


@given(ntok=st.lists(st.integers(1, 60), min_size=1, max_size=12), data=st.data(), budget=st.integers(1, 80),
       cap=st.integers(0, 20), mml=st.integers(2, 70), bs=st.sampled_from([1, 2, 4, 16]), free=st.integers(0, 12),
       limit=st.one_of(st.none(), st.integers(0, 6)))
def test_running_host_walk_equals_the_closed_forms(ntok, data, budget, cap, mml, bs, free, limit):
    """formulas.running_walk (host ints) equals token_demand, grant_tokens, block_demand and
    first_overflow over one segment up to its first failed allocation, the max_num_seqs limit
    on reached requests included."""
    comp = [data.draw(st.integers(0, t - 1)) for t in ntok]
    held = [data.draw(st.integers(0, cdiv(c, bs) + 1)) for c in comp]
    a = BACKENDS[0]
    n, reached = F.grant_tokens(F.token_demand(a(ntok), a(comp), cap, mml), budget)
    if limit is not None:
        reached = reached & ((n > 0).cumsum() - (n > 0) < limit)
    k = int(reached.sum())
    need = F.block_demand(a(comp[:k]), n[:k], a(held[:k]), bs, mml)
    f = F.first_overflow(need, free)
    n_w, need_w, f_w, failed = F.running_walk(ntok, comp, held, budget=budget, cap=cap, max_model_len=mml,
                                               block_size=bs, free=free, limit=limit)
    assert (f_w, failed) == (f, f < k)
    walked = f + 1 if failed else k  # (the walk stops at the first failed allocation)
    assert n_w == listify(n)[:walked] and need_w == listify(need)[:walked]


@pytest.mark.parametrize("formula", ["grant_tokens", "admission"])
def test_cpu_fuzzing_still_runs_the_closed_forms_the_cuda_path_runs(monkeypatch, formula):
    """Short CPU windows are walked on host ints, but only on even steps: a bug planted in the
    closed form alone (which is all a CUDA run uses) must still make CPU replays diverge."""
    import fuzz.engines  # noqa: F401  (registers gpu)
    from fuzz.generate import random_trace
    from fuzz.replay import replay

    orig = getattr(F, formula)
    if formula == "grant_tokens":
        def planted(demand, budget):  # charges one token more than is scheduled
            c = demand.clip(min=0)
            left = (budget - F.xp.exclusive_cumsum(c + 1)).clip(min=0)
            return F.xp.minimum(c, left), left > 0
    else:
        def planted(*args, **kw):  # admission without the watermark
            return orig(*args, **{**kw, "watermark": 0})
    monkeypatch.setattr(F, formula, planted)
    assert any(replay(random_trace(seed), "gpu", "exact").divergence is not None for seed in range(80)), (
        f"a bug in formulas.{formula} went unseen by 80 CPU replays: the closed form never ran")
