"""The Triton paged-attention kernel agrees with the torch fallback within TOLERANCE.

Runs on CUDA when present.  Without a GPU it still runs where Triton is
installed, through Triton's interpreter (``TRITON_INTERPRET=1``, in a
subprocess because the flag must be set before the kernel is defined);
otherwise it is skipped (CI has no Triton).
"""
from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def compare(device: str) -> list[tuple[str, float, float]]:
    """Max |kernel - fallback| on mixed batches; returns (case, error, tolerance)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import mixed_batch

    from gpu_engine.attention import TOLERANCE, paged_attention_torch, paged_attention_triton

    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for bs, d, h, kvh in ((16, 64, 8, 2), (4, 16, 4, 2), (16, 32, 6, 2)):
            lens, starts = [1, 17, 40, 33], [0, 0, 35, 32]
            q, kc, vc, m = mixed_batch(g, lens, starts, bs, 64, kvh, d, h, dtype, device)
            scale = 1 / math.sqrt(d)
            want = paged_attention_torch(q, kc, vc, m["block_table"], m["seq_start"], m["query_start"],
                                         m["seq_lens"], scale)
            got = paged_attention_triton(q, kc, vc, m["block_table"], m["token_seq"], m["token_pos"], scale)
            out.append((f"{dtype} bs={bs} d={d} h={h}/{kvh}", (got.float() - want.float()).abs().max().item(),
                        TOLERANCE[dtype]))
    return out


@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA and Triton")
def test_cuda_triton_kernel_matches_fallback():
    for case, err, tol in compare("cuda"):
        assert err <= tol, case


@pytest.mark.skipif(torch.cuda.is_available() or not HAVE_TRITON, reason="needs Triton (interpreter, no GPU)")
def test_triton_kernel_matches_fallback_in_the_interpreter():
    code = ("import sys; sys.path.insert(0, 'tests'); from test_gpu_attention import compare; "
            "bad = [c for c in compare('cpu') if c[1] > c[2]]; print(bad); sys.exit(1 if bad else 0)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
