"""Paged attention over a block table: a Triton kernel on GPU, a torch fallback on CPU.

One flattened batch mixes prefill chunks and decodes.  Every query token ``t``
belongs to sequence ``seq[t]`` at absolute position ``pos[t]`` and attends to
that sequence's keys at positions ``0..pos[t]`` (causal), which live in the
paged cache ``[num_blocks, block_size, kv_heads, head_dim]`` at
``block_table[seq, p // block_size]``, offset ``p % block_size``.  The new
tokens' K/V are written into the cache *before* attention (so a prefill chunk
sees itself, earlier chunks, and prefix-cache hit blocks alike).

Tolerance (GPU kernel vs. this module's torch fallback on the same inputs):
max |Δ| per output element as in :data:`TOLERANCE` (fp32 2e-4, bf16 4e-2), checked
by ``benchmarks/gpu_check.py`` and by the CUDA-only tests in
``tests/test_gpu_attention.py``.  The CPU path is the fallback itself.
"""
from __future__ import annotations

import math

import torch

#: Max absolute difference allowed between the Triton kernel and the torch
#: fallback, per output dtype: outputs are convex combinations of V rows with
#: |out| < 4 here, both sides accumulate in fp32 and round once, so bf16 allows ~2 ulps (2^-5).
TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 4e-2, torch.float64: 1e-9}

try:  # Triton is optional (absent on CPU-only machines)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the machine
    triton = None


def paged_attention_torch(q, k_cache, v_cache, block_table, seq_start, query_start, seq_lens, scale):
    """Reference implementation: one dense causal attention per sequence.

    ``q``: [T, H, D]; caches: [N, bs, KVH, D]; ``block_table``: [S, B] (rows of
    the batch's sequences); ``query_start``: [S + 1] offsets of each sequence's
    queries in ``q``; ``seq_start``: [S] position of each sequence's first query;
    ``seq_lens``: [S] context length after this step (``seq_start + queries``).
    """
    T, H, D = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = H // kvh
    out = torch.empty_like(q)
    qs, ss, sl = query_start.tolist(), seq_start.tolist(), seq_lens.tolist()
    for i in range(len(sl)):
        a, b, L = qs[i], qs[i + 1], sl[i]
        if a == b:
            continue
        blocks = block_table[i, : (L + bs - 1) // bs]
        k = k_cache[blocks].reshape(-1, kvh, D)[:L].repeat_interleave(group, 1)  # [L, H, D]
        v = v_cache[blocks].reshape(-1, kvh, D)[:L].repeat_interleave(group, 1)
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32  # accumulate in >= fp32
        scores = torch.einsum("qhd,khd->hqk", q[a:b].to(ct), k.to(ct)) * scale
        qpos = torch.arange(ss[i], ss[i] + (b - a), device=q.device)
        causal = torch.arange(L, device=q.device)[None, :] > qpos[:, None]
        p = scores.masked_fill(causal[None], float("-inf")).softmax(-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", p, v.to(ct)).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, tok_seq_ptr, tok_pos_ptr,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
        scale, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One program per (query token, KV head): the GROUP query heads that share
        the KV head are processed together, so each cache block is read once per
        token and KV head.  Online softmax over the token's context, one cache
        block (BLOCK_SIZE keys) per iteration, fp32 accumulation."""
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.load(tok_seq_ptr + t)
        pos = tl.load(tok_pos_ptr + t)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        gmask = g < GROUP
        dmask = d < HEAD_DIM
        heads = kvh * GROUP + g
        q_offs = t * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        q = q * scale
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        num_blocks = pos // BLOCK_SIZE + 1
        for j in range(0, num_blocks):
            block = tl.load(bt_ptr + seq * stride_bt + j).to(tl.int64)
            kpos = j * BLOCK_SIZE + n
            valid = (n < BLOCK_SIZE) & (kpos <= pos)
            kv_offs = block * stride_kb + n[:, None] * stride_ks + kvh * stride_kh + d[None, :]
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        o_offs = t * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


def paged_attention_triton(q, k_cache, v_cache, block_table, token_seq, token_pos, scale):
    """The GPU kernel: ``q`` [T, H, D]; caches [N, bs, KVH, D]; ``token_seq``/``token_pos`` [T] int32."""
    T, H, D = q.shape
    N, bs, kvh, _ = k_cache.shape
    out = torch.empty_like(q)
    if T == 0:
        return out
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    bt = block_table.to(torch.int32).contiguous()
    group = H // kvh
    _paged_attn_kernel[(T, kvh)](
        q, k_cache, v_cache, out, bt, token_seq, token_pos,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), bt.stride(0),
        scale, GROUP=group, BLOCK_G=triton.next_power_of_2(group), BLOCK_SIZE=bs,
        BLOCK_N=triton.next_power_of_2(bs), HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
    )
    return out


def use_triton(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def paged_attention(q, k_cache, v_cache, meta, scale: float | None = None, backend: str = "auto"):
    """Dispatch: Triton on CUDA (``backend="auto"``/``"triton"``), else the torch fallback."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if backend == "triton" or (backend == "auto" and use_triton(q.device)):
        return paged_attention_triton(q, k_cache, v_cache, meta.block_table, meta.token_seq, meta.token_pos, scale)
    return paged_attention_torch(q, k_cache, v_cache, meta.block_table, meta.seq_start, meta.query_start,
                                 meta.seq_lens, scale)
