"""Weights on 2 MB pages. A decode step streams each routed expert's few megabytes once, from memory, and an expert
stack held in 4 KB pages costs a TLB miss (a page walk) every 4 KB of that stream: on a 2-core Sapphire Rapids one
layer's 8 routed experts (21 MB at q4_0) read at 52-68% of the read probe in 4 KB pages and at 94% in 2 MB pages
(``benchmarks/bench_expert_pass.py``). Linux backs anonymous memory with 2 MB pages where asked
(``madvise(MADV_HUGEPAGE)``; the common ``transparent_hugepage=madvise`` setting does nothing otherwise), and
``MADV_COLLAPSE`` (Linux 6.1+) rebuilds already-written memory in them at once, in place: the same bytes.
The collapse copies (about 0.5 GB/s here, 4.8 s for the 4-layer bench model's 2.4 GB; more threads did not help),
so the layouts moeq writes itself come on pre-advised mappings (:func:`empty`) and the collapse finds them done
(0.0 s at load on the bench model). Asking torch for 2 MB pages for every large allocation instead
(``THP_MEM_ALLOC_ENABLE=1``) made the copy unnecessary but slowed prefill ~6% and made it erratic (its temporaries
then fault 2 MB pages, with compaction stalls): moeq leaves that setting to the user.

:func:`back` asks both for the 2 MB-aligned inside of every large CPU tensor storage of a model, once it is built
(``moeq.load``, and after :func:`moeq.set_activations` re-lays weights out). Nothing else changes: where the kernel
lacks ``MADV_COLLAPSE``, transparent huge pages are off, the memory is a file mapping (a memory-mapped checkpoint) or
no 2 MB page is free, the call fails quietly and the pages stay as they were. ``MOEQ_HUGE_PAGES=0`` turns it off."""
from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import sys
import time

import torch
from torch import nn

log = logging.getLogger(__name__)

PAGE = 2 << 20
MIN_BYTES = 2 * PAGE  # smaller storages hold less than one whole 2 MB page for certain
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25


_LIBC: list = []  # the C library's madvise, loaded once


def _libc():
    if not sys.platform.startswith("linux") or os.environ.get("MOEQ_HUGE_PAGES", "1") == "0":
        return None
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            libc = None
        _LIBC.append(libc)
    return _LIBC[0]


def _inside(ptr: int, nbytes: int) -> tuple[int, int]:
    """The 2 MB-aligned inside ``[lo, hi)`` of ``[ptr, ptr + nbytes)`` (empty: hi <= lo)."""
    return (ptr + PAGE - 1) & ~(PAGE - 1), (ptr + nbytes) & ~(PAGE - 1)


def back_range(ptr: int, nbytes: int, libc=None) -> int:
    """Ask for 2 MB pages under the 2 MB-aligned inside of ``[ptr, ptr + nbytes)``; returns the bytes collapsed into
    them now (0 where nothing could be: see the module)."""
    libc = libc or _libc()
    lo, hi = _inside(ptr, nbytes)
    if libc is None or hi <= lo:
        return 0
    libc.madvise(lo, hi - lo, MADV_HUGEPAGE)  # later faults there (and khugepaged) take 2 MB pages
    return hi - lo if libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0 else 0


def back(model: nn.Module) -> int:
    """:func:`back_range` over each distinct CPU storage of at least :data:`MIN_BYTES` among ``model``'s parameters
    and buffers, but for embedding tables; returns the bytes collapsed."""
    libc = _libc()
    if libc is None:
        return 0
    seen, done, t0 = set(), 0, time.perf_counter()
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):  # a token's row is read, not the table: not worth a copy
            continue
        for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            if t.device.type != "cpu" or t.is_sparse:
                continue
            s = t.untyped_storage()
            if s.nbytes() >= MIN_BYTES and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                done += back_range(s.data_ptr(), s.nbytes(), libc)
    if done:
        log.info("%.2f GB of weights on 2 MB pages (%.1f s)", done / 1e9, time.perf_counter() - t0)
    return done


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor, asked onto 2 MB pages before its first write when it is large (the first write
    then faults them in: no collapse, no copy): for the weights moeq lays out itself (il16 stacks, bf12 heads)."""
    shape = tuple(shape)
    n = math.prod(shape) * dtype.itemsize
    if n < MIN_BYTES or _libc() is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    # a mapping of its own: memory never touched before (a recycled heap chunk may already sit on 4 KB pages)
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mm, dtype=dtype, count=math.prod(shape)).view(shape)  # the tensor keeps mm alive
