"""Closed forms of vLLM V1's sequential scheduling loops, as small pure array functions.

vLLM walks requests one at a time: every grant shrinks the token budget and
every allocation shrinks the free-block count seen by the next request.  Each
function here computes the outcome of such a walk for a whole batch at once
with prefix sums and masks.  They take arrays (torch tensors or numpy arrays,
see :mod:`gpu_engine.xp`) and plain ints, touch no engine state, and each
docstring states the identity it relies on, so that a prover (a later issue:
Z3 translation validation) can check it against the spec's loop.

Notation: ``excl(x)[i] = x[0] + ... + x[i-1]`` (exclusive prefix sum),
``cdiv(a, b) = ceil(a / b)``.
"""
from __future__ import annotations

import zlib

from gpu_engine import xp
from gpu_engine.xp import Array

INF_KEY = 1 << 62  # queue key of a request that is not waiting / a block not in the free queue

# Stop codes, in vLLM's check order (0 = keep going).
STOP_NONE, STOP_EOS, STOP_TOKEN, STOP_MAX_MODEL_LEN, STOP_MAX_TOKENS = range(5)


def cdiv(a, b: int):
    return -(-a // b)


def token_demand(num_tokens: Array, num_computed: Array, cap: int, max_model_len: int) -> Array:
    """Tokens each running request asks for before the budget cut.

    ``c = min(capT(num_tokens - num_computed), max_model_len - num_computed - 1)``
    where ``capT(x) = T if 0 < T < x else x`` is the long-prefill cap.  The
    loop's ``min(n, budget)`` is applied by :func:`grant_tokens`; since ``min``
    commutes, cutting by the budget first (as vLLM does) gives the same value.
    """
    c = num_tokens - num_computed
    if cap > 0:
        c = xp.minimum(c, cap)
    return xp.minimum(c, max_model_len - 1 - num_computed)


def grant_tokens(demand: Array, budget: int) -> tuple[Array, Array]:
    """Phase 1 budget walk: ``(n, reached)``.

    Loop: ``while budget > 0: n_i = min(c_i, budget); if n_i <= 0: skip; budget -= n_i``.
    With ``c⁺ = max(c, 0)`` the budget left before request ``i`` is
    ``left_i = max(0, B - excl(c⁺)_i)`` (induction: ``left_{i+1} = max(0, left_i - c⁺_i)``),
    so ``n_i = min(c⁺_i, left_i)`` and request ``i`` is reached iff ``left_i > 0``.
    A reached request with ``n_i = 0`` is skipped, not a stop.
    """
    c = xp.maximum(demand, 0)
    left = xp.maximum(budget - xp.exclusive_cumsum(c), 0)
    return xp.minimum(c, left), left > 0


def block_demand(num_computed: Array, n: Array, held: Array, block_size: int, max_model_len: int) -> Array:
    """New blocks each scheduled running request pops (0 where ``n <= 0``).

    vLLM's ``allocate_slots`` without hits: ``slots = min(min(computed, L) + n, L)``
    which equals ``min(computed + n, L)`` for ``n > 0``;
    ``need = max(cdiv(slots, bs) - held, 0)``.
    """
    slots = xp.minimum(num_computed + n, max_model_len)
    need = xp.maximum(cdiv(slots, block_size) - held, 0)
    return xp.where(n > 0, need, 0)


def decode_grows(num_tokens: Array, held: Array, block_size: int) -> Array:
    """Steady decode: which requests pop a block (:func:`block_demand` with ``n = 1``).

    Every running request decodes: ``computed = t - 1`` with ``t = num_tokens < L``
    (a request stops when ``t`` reaches ``min(prompt + max_tokens, L)``), and its
    computed tokens have slots, ``held * bs >= t - 1``.  Then
    ``need = max(cdiv(t, bs) - held, 0)`` is 0 or 1 (``cdiv(t, bs) <= cdiv(t - 1, bs) + 1
    <= held + 1``), and 1 iff ``cdiv(t, bs) > held`` iff ``t > held * bs``: one compare.
    """
    return num_tokens > held * block_size


def first_overflow(need: Array, free: int) -> int:
    """Index of the first request whose allocation fails, or ``len(need)``.

    Allocations run in order and each takes ``need_i`` of the free blocks, so
    request ``i`` fails first iff ``excl(need)_i + need_i > free`` for the
    smallest such ``i`` (the inclusive prefix sum is non-decreasing).
    """
    return xp.first_true(need.cumsum(0) > free)


def running_walk(num_tokens: list, num_computed: list, held: list, *, budget: int, cap: int, max_model_len: int,
                 block_size: int, free: int, limit: int | None = None) -> tuple[list, list, int, bool]:
    """One segment of the running walk over host lists of ints, request by request up to its
    first failed allocation: :func:`token_demand`, :func:`grant_tokens`, :func:`block_demand`
    and :func:`first_overflow`.  Returns ``(n, need, f, failed)``: the grants and new blocks of
    the requests walked, the first whose allocation fails (else the number reached: with
    ``limit``, only while fewer than ``limit`` were granted tokens, BATCH.MAX_NUM_SEQS_PER_STEP),
    and whether one failed (the walk stops there: ``n`` and ``need`` end with its values).  For
    a short CPU segment these plain-int steps cost a fraction of the closed forms' array calls;
    the CUDA path keeps the closed forms."""
    n_all, need, spent, granted = [], [], 0, 0
    for t, c, h in zip(num_tokens, num_computed, held):
        left = budget - spent
        if left <= 0 or (limit is not None and granted >= limit):
            break  # not reached: neither is any later one
        d = t - c
        if cap > 0:
            d = min(d, cap)
        d = max(min(d, max_model_len - 1 - c), 0)
        n = min(d, left)
        x = max(cdiv(min(c + n, max_model_len), block_size) - h, 0) if n > 0 else 0
        n_all.append(n)
        need.append(x)
        free -= x
        if free < 0:
            return n_all, need, len(need) - 1, True
        spent += d
        granted += n > 0
    return n_all, need, len(need), False


def victims_needed(freed_in_order: Array, free: int, need: int, self_pos: int) -> tuple[int, bool]:
    """How many victims one failed allocation preempts: ``(count, self_preempted)``.

    Loop: ``while need > free: v = next victim; free += freed(v); if v is r: stop``.
    Victims come in a fixed order (FCFS: the running list from the tail;
    priority: by descending (priority, arrival)), so after ``j + 1`` victims
    ``free_j = free + incl(freed)_j``, where ``freed_j`` counts the blocks whose
    *last* holder is victim ``j`` (see :func:`freed_by_position`).  The loop
    preempts ``j* + 1`` victims with ``j* = min(first j with free_j >= need, self_pos)``
    where ``self_pos`` is the requester's own place in the victim order; it
    preempted itself iff ``j* == self_pos``.
    """
    fits = xp.first_true(free + freed_in_order.cumsum(0) >= need)
    j = min(fits, self_pos)
    return j + 1, j == self_pos


def freed_by_position(position: Array, last_position: Array, length: int) -> Array:
    """Blocks each victim returns to the free queue, if victims are freed in order.

    Input: one entry per (victim, held block): ``position`` = the victim's place
    in the order, ``last_position`` = the largest place among that block's
    holders.  A block's ref count equals its number of holders (only running
    requests hold blocks), so it reaches 0 exactly when its last holder is
    freed: ``freed_j = #{entries : position = last_position = j}``.
    """
    return xp.bincount(position[position == last_position], length)


def admission(
    num_tokens: Array,
    hit_tokens: Array,
    num_hit_blocks: Array,
    evictable_hits: Array,
    *,
    budget: int,
    free: int,
    watermark: int,
    num_running: int,
    cap: int,
    chunked: bool,
    full_isl: bool,
    block_size: int,
    max_model_len: int,
    reserve: Array | None = None,
    pad: Array | None = None,
) -> tuple[int, Array, Array]:
    """Phase 2 admission walk over the queue head: ``(count, n, need)``.

    Candidate ``j`` (in queue order, hits already known) asks
    ``c_j = capT(num_tokens_j - hit_tokens_j)``.  If all before it were admitted,
    ``left_j = max(0, B - excl(c)_j)``, ``n_j = min(c_j, left_j)``; it needs
    ``need_j = max(cdiv(min(hit_j + n_j, L), bs) - nhit_j, 0) + E_j`` blocks
    (``E_j`` = its hit blocks that sit in the free queue, which touching consumes)
    and, with ``full_isl``, ``full_j = max(cdiv(min(num_tokens_j, L), bs) - nhit_j, 0) + E_j``.
    The free count it sees is ``F_j = F - excl(need)_j``; the watermark applies
    iff anything is running: ``W_j = W if num_running + j > 0 else 0``.
    ``ok_j = left_j > 0 ∧ (chunked ∨ c_j <= left_j) ∧ (¬full_isl ∨ full_j + W_j <= F_j)
    ∧ need_j + W_j <= F_j``, and the loop admits exactly the longest all-``ok`` prefix
    (it stops at the first failure: head-of-line blocking).

    ``reserve`` (kv_reservation="full"): the slots ``R_j`` each candidate reserves
    to completion.  Its allocation then covers ``max(min(hit_j + n_j, L), R_j)``
    slots, ``need_j = max(cdiv(max(min(hit_j + n_j, L), R_j), bs) - nhit_j, 0) + E_j``,
    and the whole-sequence check applies only where ``R_j = 0`` (a reservation
    already covers the whole sequence).

    ``pad`` (speculative decoding, :func:`draft_padding`): dummy drafts added to a
    candidate's tokens, ``c_j = capT(num_tokens_j - hit_tokens_j + pad_j)``; a padded
    candidate is admitted whole or stops the walk (``pad_j = 0 ∨ c_j <= left_j``), and its
    whole-sequence check still counts its real ``num_tokens_j``.
    """
    rem = num_tokens - hit_tokens
    if pad is not None:
        rem = rem + pad
    c = xp.minimum(rem, cap) if cap > 0 else rem
    left = xp.maximum(budget - xp.exclusive_cumsum(c), 0)
    n = xp.minimum(c, left)
    slots = xp.minimum(hit_tokens + n, max_model_len)
    if reserve is not None:
        slots = xp.maximum(slots, reserve)
    need = xp.maximum(cdiv(slots, block_size) - num_hit_blocks, 0) + evictable_hits
    seen_free = free - xp.exclusive_cumsum(need)
    position = xp.exclusive_cumsum(c * 0 + 1)  # 0, 1, 2, ... (j)
    wm = xp.where(position + num_running > 0, watermark, 0)
    ok = (left > 0) & (need + wm <= seen_free)
    if not chunked:
        ok = ok & (c <= left)
    if full_isl:
        full = xp.maximum(cdiv(xp.minimum(num_tokens, max_model_len), block_size) - num_hit_blocks, 0) + evictable_hits
        fits = full + wm <= seen_free
        ok = ok & (fits if reserve is None else (fits | (reserve > 0)))
    if pad is not None:
        ok = ok & ((pad == 0) | (c <= left))
    count = xp.first_true(~ok)
    return count, n, need


def admission_walk(
    num_tokens: list,
    num_hit_blocks: list,
    evictable_hits: list,
    *,
    budget: int,
    free: int,
    watermark: int,
    num_running: int,
    cap: int,
    chunked: bool,
    full_isl: bool,
    block_size: int,
    max_model_len: int,
    reserve: list | None = None,
) -> tuple[int, list, list]:
    """:func:`admission` (without ``pad``) over host lists of ints, candidate by candidate up
    to the first that fails: the same ``count``, and ``n`` and ``need`` of the ``count``
    admitted candidates (as lists).  For a CPU window of a few candidates these plain-int
    steps cost a fraction of the closed form's ~35 array calls; the CUDA path keeps the
    closed form."""
    n_all, need_all = [], []
    spent = taken = 0  # excl(c)_j and excl(need)_j
    for j, (t, h, e) in enumerate(zip(num_tokens, num_hit_blocks, evictable_hits)):
        hit = h * block_size
        c = min(t - hit, cap) if cap > 0 else t - hit
        left = max(budget - spent, 0)
        n = min(c, left)
        slots = min(hit + n, max_model_len)
        if reserve is not None:
            slots = max(slots, reserve[j])
        need = max(cdiv(slots, block_size) - h, 0) + e
        seen_free = free - taken
        wm = watermark if num_running + j > 0 else 0
        ok = left > 0 and need + wm <= seen_free and (chunked or c <= left)
        if ok and full_isl:
            fits = max(cdiv(min(t, max_model_len), block_size) - h, 0) + e + wm <= seen_free
            ok = fits or (reserve is not None and reserve[j] > 0)
        if not ok:
            break
        n_all.append(n)
        need_all.append(need)
        spent += c
        taken += need
    return len(n_all), n_all, need_all


# -- speculative decoding (knob num_speculative_tokens K > 0) ---------------------------------


def draft_padding(rest: Array, hit_tokens: Array, k: int, others_scheduled: bool, others_mid_prefill: bool,
                  max_model_len: int) -> Array:
    """Dummy drafts per admission candidate: vLLM pads an admission left with exactly one
    token to compute (``rest = num_tokens - hit = 1``) to a uniform ``1 + K`` decode when no
    running request of the step is mid-prefill, something else runs in the step or it had a
    prefix hit, and ``hit + 1 + K + 1 <= L``: ``K`` there, else 0."""
    if others_mid_prefill:
        return rest * 0
    ok = (rest == 1) & (hit_tokens + k + 2 <= max_model_len)
    if not others_scheduled:
        ok = ok & (hit_tokens > 0)
    return xp.where(ok, rest * 0 + k, rest * 0)


def scheduled_drafts(start: Array, n: Array, num_tokens: Array, placeholders: Array) -> Array:
    """Drafts among each request's ``n`` scheduled tokens: those past its known tokens and
    placeholders, ``clip(start + n - num_tokens - placeholders, 0, n)``."""
    return xp.minimum(xp.maximum(start + n - num_tokens - placeholders, 0), n)


def accept_draw(request_id: str, verification: int, draft: int) -> float:
    """The trace format's seeded uniform draw for one draft (``spec_accept_rate``):
    ``crc32("<id>#acc<verification>#<draft>") / 2**32``."""
    return zlib.crc32(f"{request_id}#acc{verification}#{draft}".encode()) / 2**32


def accepted_count(request_id: str, spec_accept: tuple, rate: float | None, verification: int, drafts: int) -> int:
    """Drafts the model accepts at a request's ``verification``-th verification of ``drafts``:
    the trace's ``spec_accept`` cycled, or the leading drafts whose draw is below
    ``spec_accept_rate``, or all of them; never more than ``drafts``."""
    if spec_accept:
        return min(drafts, spec_accept[verification % len(spec_accept)])
    if rate is None:
        return drafts
    n = 0
    while n < drafts and accept_draw(request_id, verification, n) < rate:
        n += 1
    return n


def swap_in(
    demand: Array,
    num_computed: Array,
    num_tokens: Array,
    *,
    budget: int,
    free: int,
    watermark: int,
    num_running: int,
    full_isl: bool,
    block_size: int,
    max_model_len: int,
) -> tuple[int, Array, Array]:
    """Swap-in walk over the swapped queue (SWAP.IN): ``(count, n, need)``.

    Candidate ``j`` holds no GPU block and keeps its ``computed_j`` tokens; it
    asks ``c_j = demand_j`` (:func:`token_demand`).  Loop: ``while budget > 0:
    n_j = min(c_j, budget); budget -= n_j``, so, all before it swapped in,
    ``left_j = B - excl(c)_j`` (not clipped: once a grant is cut by the budget,
    every later ``left`` is <= 0 and the prefix has ended), ``n_j = min(c_j, left_j)``.
    It needs ``need_j = cdiv(max(min(min(computed_j, L) + n_j, L), 0), bs)`` blocks
    and, with ``full_isl``, ``full_j = cdiv(min(num_tokens_j, L), bs) <= F_j - W_j``;
    ``F_j = F - excl(need)_j``, ``W_j = W if num_running + j > 0 else 0``.  The loop
    swaps in the longest prefix with ``left_j > 0 ∧ need_j + W_j <= F_j`` (∧ the full check).
    """
    left = budget - xp.exclusive_cumsum(demand)
    n = xp.minimum(demand, left)
    slots = xp.maximum(xp.minimum(xp.minimum(num_computed, max_model_len) + n, max_model_len), 0)
    need = cdiv(slots, block_size)
    seen_free = free - xp.exclusive_cumsum(need)
    position = xp.exclusive_cumsum(demand * 0 + 1)
    wm = xp.where(position + num_running > 0, watermark, 0)
    ok = (left > 0) & (need + wm <= seen_free)
    if full_isl:
        ok = ok & (cdiv(xp.minimum(num_tokens, max_model_len), block_size) + wm <= seen_free)
    return xp.first_true(~ok), n, need


def free_order(groups: Array, last: Array, zero: Array, hashed: Array) -> tuple[Array, Array]:
    """Where freed blocks re-enter the free queue: ``(to_head, to_tail)`` index arrays.

    Input: the blocks being freed as one sequence (request after request in
    freeing order, each request's blocks tail first), ``groups[i]`` = which
    request, ``last[i]`` = this is the block's last occurrence in the sequence,
    ``zero[i]`` = its ref count is 0 after all decrements, ``hashed[i]`` = it is
    a cached block (and caching is on).  A block enters the queue at its last
    occurrence, when its count reaches 0.  vLLM's per-request
    ``free_blocks`` prepends the unhashed ones (keeping order, so a later
    request's blocks end up ahead of an earlier one's) and appends the hashed
    ones: in one batch that is ``to_tail`` = hashed entries in sequence order,
    ``to_head`` = unhashed entries sorted by descending group, stable.
    """
    enter = last & zero
    tail = xp.nonzero(enter & hashed)
    head = xp.nonzero(enter & ~hashed)
    if len(head) and int(groups[head[-1]]) != int(groups[head[0]]):
        head = head[xp.stable_argsort(-groups[head])]
    return head, tail


def stop_codes(
    token: Array,
    eos_ok: Array,
    stop_hit: Array,
    num_tokens: Array,
    num_output: Array,
    max_tokens: Array,
    eos_token_id: int,
    max_model_len: int,
) -> Array:
    """vLLM's ``check_stop`` for every sampled token at once (after the append).

    ``EOS if token == eos ∧ ¬ignore_eos, else STOP_TOKEN if token ∈ stop_ids,
    else MAX_MODEL_LEN if num_tokens >= L, else MAX_TOKENS if num_output >= max_tokens, else NONE``.
    """
    code = xp.where(num_output >= max_tokens, STOP_MAX_TOKENS, STOP_NONE)
    code = xp.where(num_tokens >= max_model_len, STOP_MAX_MODEL_LEN, code)
    code = xp.where(stop_hit, STOP_TOKEN, code)
    return xp.where(eos_ok & (token == eos_token_id), STOP_EOS, code)


# -- service-level targets (issue 19): the SLO-aware policies' decisions as array formulas -----
#
# Targets and token times are counted in steps.  A request without a target has the due step
# NEVER; every finite step count is clamped to NEVER - 1, so sums of two stay far inside int64.

NEVER = 1 << 40  # due step / target of a request without that target
DUE_BITS = 29  # the EDF queue key's field for the due step: due steps up to 2^29 - 2 order exactly


def target_steps(value: float | None, timed: bool, step_s: float) -> int:
    """A target in steps (host scalar): a step trace's target as given; a timed trace's
    seconds as ``max(1, floor(seconds / step_s))`` steps (with a 1e-9 guard against a quotient
    like 2.9999999 that should be 3); ``NEVER`` without a target.  Rounding down keeps a
    step count the scheduler meets within the target at the modelled step time."""
    if value is None:
        return NEVER
    steps = int(value) if not timed else max(1, int(value / step_s + 1e-9))
    return min(steps, NEVER - 1)


def due_steps(first: Array, last: Array, deadline: Array, tpot: Array) -> Array:
    """When each request's next token is due: its TTFT deadline (``arrival + ttft - 1``)
    while its first token is not out (``first < 0``), then ``last + tpot``; NEVER without
    the target in question."""
    next_token = xp.where(tpot >= NEVER, NEVER, last + tpot)
    return xp.where(first < 0, deadline, next_token)


def edf_keys(deferred: Array, due: Array, arrival: Array) -> Array:
    """EDF queue keys, ascending = served first: ``(deferred, due, arrival)`` packed as
    ``deferred * 2^61 + min(due, 2^29 - 1) * 2^32 + arrival`` (arrivals < 2^32 and unique, so
    the packing orders exactly like the tuple while due steps stay below 2^29 - 1; a request
    without a deadline gets 2^29 - 1, after every request with one).  Deferred requests
    (refused a feasible slot by SLO admission control) come after every other."""
    cap = (1 << DUE_BITS) - 1
    due = xp.where(due >= NEVER, cap, xp.minimum(due, cap - 1))
    return deferred * (1 << 61) + due * (1 << 32) + arrival


def at_risk(first: Array, last: Array, tpot: Array, num_computed: Array, num_tokens: Array, now: int) -> Array:
    """Running decodes whose TPOT slack is spent: a token out (``first >= 0``), a TPOT
    target, the prompt and all outputs but the newest computed, and the next token due now
    or earlier (``now >= last + tpot``).  EDF serves them before every other request."""
    return (first >= 0) & (tpot < NEVER) & (num_computed == num_tokens - 1) & (now >= last + tpot)


def at_risk_grants(need: Array, free: int, limit: int) -> Array:
    """Which at-risk decodes (in running order, one token each) get their token: positions.

    Loop: ``for r in at_risk: if granted == limit: stop; if need_r > free: skip; free -= need_r;
    grant r`` with ``need_r`` in {0, 1} (one token needs at most one new block) and
    ``limit = min(budget, max_num_seqs - already scheduled)``.  A skipped request takes
    nothing, and once a one-block request fails every later one fails too, so request ``r``
    succeeds iff ``need_r = 0`` or ``incl(need)_r <= free`` (the inclusive prefix sum counts the
    one-block requests up to it); the grants are the first ``limit`` successes."""
    ok = (need == 0) | (need.cumsum(0) <= free)
    return xp.nonzero(ok)[:max(limit, 0)]


def feasible(now: int, tokens: Array, budget: int, deadline: Array) -> Array:
    """SLO admission control: a waiting request could still sample its first token by its
    deadline given the whole budget ``B`` every step from now on:
    ``now + cdiv(tokens, B) - 1 <= deadline`` (always, without a deadline)."""
    return (deadline >= NEVER) | (now + cdiv(tokens, budget) - 1 <= deadline)


def slack_victim_order(missed: Array, due: Array) -> Array:
    """Positions of the running list in the order the SLO-slack victim rule picks them:
    the rule takes the request with the largest ``(missed, due)`` (a target already missed,
    then the most slack: the latest next-token due step), the latest in the running list on
    a tie, one at a time; keys do not change within a step, so that is descending
    ``(missed, due)``, ties from the tail.  ``missed`` in {0, 1}, ``due`` <= NEVER."""
    n = len(due)
    key = missed * (NEVER * 2) + due
    rev = xp.exclusive_cumsum(due * 0 + 1)
    rev = (n - 1) - rev  # n-1, ..., 0: the tail first
    return rev[xp.stable_argsort(-key[rev])]


def note_tokens(first: Array, last: Array, missed: Array, deadline: Array, tpot: Array,
                now: int) -> tuple[Array, Array, Array]:
    """Requests that sampled a token in step ``now``: ``(first, last, missed)`` after it.  The
    first token misses if it comes after the TTFT deadline, a later one if it comes more
    than ``tpot`` steps after the one before; a request that missed once stays missed."""
    new = first < 0
    late = xp.where(new, now > deadline, (tpot < NEVER) & (now - last > tpot))
    return xp.where(new, now, first), last * 0 + now, xp.where(late, 1, missed)
