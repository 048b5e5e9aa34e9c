"""Token sampling that depends only on the request, never on its batch.

Greedy decoding is ``argmax`` (ties go to the smallest token id).  Random
sampling (temperature, top-k, top-p) draws one uniform number per output
token from a generator seeded by ``(seed, request id, token index)``
(:func:`token_seed`).  The ``k``-th output token of a request is thus a
function of its logits and of ``(seed, id, k)`` alone: it does not depend on
which requests shared the step, how the prompt was chunked, or whether the
request was preempted and recomputed (the generator is never "restarted"
or advanced by recomputation, because there is no long-lived generator).

The procedure, precise enough to reimplement in another engine:

1. ``p = softmax(logits / temperature)`` in float64;
2. sort tokens by ``p`` descending, ties by token id ascending (stable sort);
3. top-k: keep the first ``top_k`` (0 = all);
4. top-p: keep the shortest head whose cumulative ``p`` reaches ``top_p``
   (always at least one token);
5. ``u = torch.rand((), generator=torch.Generator().manual_seed(token_seed(...)),
   dtype=torch.float64)``; the token is the first kept one whose cumulative
   ``p`` exceeds ``u × (sum of kept p)``.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How every request of a run samples.  ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature <= 1e6:  # NaN fails this too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def parse(cls, text: str | None) -> SamplingParams:
        """``"greedy"`` or ``"temperature=0.8,top_k=50,top_p=0.9,seed=1"`` (for the CLI)."""
        if not text or text == "greedy":
            return cls()
        kinds = {"temperature": float, "top_k": int, "top_p": float, "seed": int}
        kw = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            key = key.strip()
            if key not in kinds or not value:
                raise ValueError(f"bad sampling option {part!r} (use {', '.join(k + '=…' for k in kinds)})")
            try:
                kw[key] = kinds[key](value)
            except ValueError:
                raise ValueError(f"--sampling {key}: expected {'an integer' if kinds[key] is int else 'a number'}, got {value!r}") from None
        return cls(**kw)

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        return f"temperature={self.temperature},top_k={self.top_k},top_p={self.top_p},seed={self.seed}"


GREEDY = SamplingParams()


def token_seed(seed: int, request_id: str, index: int) -> int:
    """Seed of the generator that draws output token ``index`` of ``request_id``."""
    return zlib.crc32(f"{seed}:{request_id}:{index}".encode())


def sample(logits: Tensor, params: SamplingParams, request_id: str, index: int) -> int:
    """Output token ``index`` of ``request_id`` from its last position's ``logits`` ``[vocab]``."""
    if params.greedy:
        return int(torch.argmax(logits))  # first maximum: ties go to the smallest id
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    probs, order = torch.sort(probs, descending=True, stable=True)
    if params.top_k:
        probs, order = probs[: params.top_k], order[: params.top_k]
    cumulative = torch.cumsum(probs, dim=0)
    if params.top_p < 1.0:
        keep = int(torch.searchsorted(cumulative, torch.tensor(params.top_p, dtype=cumulative.dtype))) + 1
        probs, order, cumulative = probs[:keep], order[:keep], cumulative[:keep]
    g = torch.Generator().manual_seed(token_seed(params.seed, request_id, index))
    u = torch.rand((), generator=g, dtype=torch.float64)
    pick = int(torch.searchsorted(cumulative, u * cumulative[-1], right=True))
    return int(order[min(pick, len(order) - 1)])
