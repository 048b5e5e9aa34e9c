"""Array backend: the few operations the scheduler needs, on torch tensors or numpy.

Scheduler state lives in torch tensors on the engine's device.  On CUDA the
decisions run as torch ops on those tensors.  On CPU the tensors are tiny and
torch's per-op dispatch (~5 µs) would dominate a step, so the same code runs on
**numpy views of the same CPU tensors** (``tensor.numpy()`` shares memory: one
state, two front ends, 1-4 µs per op).  Everything else in :mod:`gpu_engine`
is written against the operations common to both (operators, indexing,
``.cumsum(0)``, ``.sum()``, ``.tolist()``) plus this module.
"""
from __future__ import annotations

import mmap
from typing import Any, Union

import numpy as np
import torch

Array = Union[np.ndarray, torch.Tensor]
INT = torch.int64
BOOL = torch.bool
NP_INT, NP_BOOL = np.dtype(np.int64), np.dtype(np.bool_)  # (dtype objects: no per-call dtype lookup)
LAZY_BYTES = 1 << 20  # zero-filled CPU tensors from this size up are mapped lazily (Backend.tensor)


def is_np(x: Any) -> bool:
    return isinstance(x, np.ndarray)


class Backend:
    """Creates arrays and runs the non-common operations for one device."""

    def __init__(self, device: str | torch.device = "cpu", use_numpy: bool | None = None):
        self.device = torch.device(device)
        self.numpy = self.device.type == "cpu" if use_numpy is None else use_numpy
        if self.numpy and self.device.type != "cpu":
            raise ValueError("numpy views need CPU tensors")
        self._empty = self.arange(0)  # shared: nothing writes into a 0-length array

    # -- storage: always a torch tensor; the working view is numpy on CPU --
    def tensor(self, shape, fill: int = 0, dtype=INT) -> torch.Tensor:
        """A new tensor of ``shape`` filled with ``fill``.  A large zero-filled CPU tensor lives in
        an anonymous memory map, whose pages are mapped (zeroed, 4 KiB each) when first written:
        a sparsely used table (the scheduler's token rows, a few KiB used of each 64 KiB row)
        then costs what is written, not its size.  (``torch.full`` writes every page, and numpy's
        ``zeros`` asks for huge pages, which zero 2 MiB at the first write into any of it.)"""
        if fill == 0 and self.device.type == "cpu":
            np_dtype = NP_BOOL if dtype is torch.bool else NP_INT
            size = int(np.prod(shape)) * np_dtype.itemsize
            if size >= LAZY_BYTES:
                return torch.from_numpy(np.frombuffer(mmap.mmap(-1, size), np_dtype).reshape(shape))
        return torch.full(shape, fill, dtype=dtype, device=self.device)

    def view(self, t: torch.Tensor) -> Array:
        """The array the scheduler works on: ``t`` itself, or its numpy view on CPU."""
        return t.numpy() if self.numpy else t

    def host(self, a: Array) -> np.ndarray:
        """A numpy copy (or view, on CPU) of ``a`` for host-side work."""
        return a if is_np(a) else a.cpu().numpy()

    def storage(self, a: Array) -> torch.Tensor:
        return torch.from_numpy(a) if is_np(a) else a

    # -- construction --
    def asarray(self, values, dtype=INT) -> Array:
        if self.numpy:
            return np.asarray(values, NP_BOOL if dtype is torch.bool else NP_INT)
        return torch.as_tensor(values, dtype=dtype, device=self.device)

    def arange(self, n: int, start: int = 0) -> Array:
        return np.arange(start, start + n, dtype=np.int64) if self.numpy else torch.arange(start, start + n, device=self.device)

    def empty_int(self) -> Array:
        """A 0-length int array (one shared array: a step makes many empty phases)."""
        return self._empty

    def cat(self, parts: list) -> Array:
        parts = [p for p in parts if len(p)]
        if not parts:
            return self.empty_int()
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if self.numpy else torch.cat(parts)


# -- operations that differ between numpy and torch (dispatch on the array) --


def minimum(a: Array, b) -> Array:
    """Elementwise ``min(a, b)``; ``b`` an array or a number (not ``ndarray.clip``: ~10x slower)."""
    if is_np(a):
        return np.minimum(a, b)
    return torch.minimum(a, b) if isinstance(b, torch.Tensor) else a.clamp(max=b)


def maximum(a: Array, b) -> Array:
    if is_np(a):
        return np.maximum(a, b)
    return torch.maximum(a, b) if isinstance(b, torch.Tensor) else a.clamp(min=b)


def where(cond: Array, a, b) -> Array:
    return np.where(cond, a, b) if is_np(cond) else torch.where(cond, a, b)


def as_int(mask: Array) -> Array:
    return mask.astype(np.int64) if is_np(mask) else mask.to(INT)


def exclusive_cumsum(x: Array) -> Array:
    """``out[i] = x[0] + ... + x[i-1]`` (``out[0] = 0``)."""
    return x.cumsum(0) - x


def nonzero(mask: Array) -> Array:
    return mask.nonzero()[0] if is_np(mask) else torch.nonzero(mask).flatten()


SMALL = 64  # numpy arrays up to this length are reduced on the host list (a reduction call costs more)


def total(x: Array) -> int:
    """``int(x.sum())``.  A numpy reduction costs ~1-2 µs whatever the length; a short
    array's sum is cheaper as a list."""
    if is_np(x):
        return sum(x.tolist()) if len(x) <= SMALL else int(x.sum())  # (add.reduce of bools is "or")
    return int(x.sum())


def largest(x: Array) -> int:
    """``int(x.max())`` of a non-empty array (a short numpy array's on the host list, as in :func:`total`)."""
    if is_np(x):
        return max(x.tolist()) if len(x) <= SMALL else int(x.max())
    return int(x.max())


def smallest_value(x: Array) -> int:
    """``int(x.min())`` of a non-empty array (short numpy arrays: on the host list)."""
    if is_np(x):
        return min(x.tolist()) if len(x) <= SMALL else int(x.min())
    return int(x.min())


def contains(x: Array, value: int) -> bool:
    """``bool((x == value).any())`` (short numpy arrays: a host list search)."""
    if is_np(x) and len(x) <= SMALL:
        return value in x.tolist()
    return any_true(x == value)


def any_true(mask: Array) -> bool:
    """``bool(mask.any())`` (numpy: ``count_nonzero``, several times cheaper than ``any``)."""
    return np.count_nonzero(mask) > 0 if is_np(mask) else bool(mask.any())


def all_true(mask: Array) -> bool:
    return np.count_nonzero(mask) == mask.size if is_np(mask) else bool(mask.all())


def first_true(mask: Array) -> int:
    """Index of the first True, or ``len(mask)`` if none (one reduction, no Python loop)."""
    n = len(mask)
    if n == 0:
        return 0
    if is_np(mask):
        i = int(mask.argmax())
    else:
        i = int(mask.to(torch.uint8).argmax())
    return i if bool(mask[i]) else n


def repeat(x: Array, counts: Array) -> Array:
    return np.repeat(x, counts) if is_np(x) else torch.repeat_interleave(x, counts)


def add_at(target: Array, index: Array, value: int) -> None:
    """``target[index] += value`` with repeated indices accumulating."""
    if is_np(target):
        np.add.at(target, index, value)
    else:
        target.index_add_(0, index, torch.full_like(index, value))


def bincount(x: Array, length: int) -> Array:
    return np.bincount(x, minlength=length) if is_np(x) else torch.bincount(x, minlength=length)


def stable_argsort(x: Array) -> Array:
    return x.argsort(kind="stable") if is_np(x) else torch.sort(x, stable=True).indices  # (the method: no wrapper)


def searchsorted(sorted_seq: Array, values: Array, right: bool = False) -> Array:
    if is_np(sorted_seq):
        return np.searchsorted(sorted_seq, values, side="right" if right else "left")
    return torch.searchsorted(sorted_seq, values, right=right)


SORT_ALL = 256  # numpy key arrays up to this length are sorted whole by smallest_k (measured: 2-5x cheaper)


def smallest_k(keys: Array, k: int) -> Array:
    """Indices of the ``k`` smallest keys, in increasing key order (keys distinct)."""
    if k >= len(keys):
        return stable_argsort(keys)
    if is_np(keys):
        if len(keys) <= SORT_ALL:  # one sort (the method: no dispatch wrapper) beats partition + sort
            return keys.argsort(kind="stable")[:k]
        part = np.argpartition(keys, k - 1)[:k]
        return part[np.argsort(keys[part], kind="stable")]
    return torch.topk(keys, k, largest=False, sorted=True).indices


def copy(x: Array) -> Array:
    return x.copy() if is_np(x) else x.clone()


def isin(x: Array, values: Array) -> Array:
    return np.isin(x, values) if is_np(x) else torch.isin(x, values)


def scatter_max(target: Array, index: Array, values: Array) -> None:
    """``target[index[i]] = max(target[index[i]], values[i])`` with repeats."""
    if is_np(target):
        np.maximum.at(target, index, values)
    else:
        target.scatter_reduce_(0, index, values, reduce="amax")


SCAN = 24  # numpy arrays up to this length are scanned on the host list by nonzero_items (measured crossover ~30)


def nonzero_items(x: Array) -> tuple[list[int], list[int]]:
    """The indices of ``x``'s nonzero entries and their values, in index order (a short
    numpy array's read from its host list: four array calls cost more than the loop)."""
    if is_np(x) and len(x) <= SCAN:
        values = x.tolist()
        idx = [i for i, v in enumerate(values) if v]
        return idx, [values[i] for i in idx]
    idx = nonzero(x != 0)
    return to_list(idx), to_list(x[idx])


WALK = 16  # CPU windows / walk segments up to this length are walked on host ints (measured crossover ~16)


def to_list(x: Array) -> list:
    return x.tolist()
