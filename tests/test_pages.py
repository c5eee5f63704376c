"""Weights on 2 MB pages (moeq.native.pages): the same bytes afterwards, 2 MB pages under them where the kernel gives
them, files left alone, and the opt-out."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from moeq.native import pages

MB = 1 << 20


def _huge_kb(ptr: int, nbytes: int) -> int:
    """AnonHugePages (kB) of the mappings overlapping [ptr, ptr + nbytes) in this process."""
    total, hit = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            hit = lo < ptr + nbytes and ptr < hi
        elif hit and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


class Holder(nn.Module):
    def __init__(self, t: torch.Tensor):
        super().__init__()
        self.register_buffer("w", t)


def test_back_keeps_every_byte_and_reports_what_it_collapsed():
    t = torch.randint(0, 256, (24 * MB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    before = t.clone()
    done = pages.back(Holder(t))
    assert torch.equal(t, before)
    assert 0 <= done <= t.numel()
    assert done % pages.PAGE == 0
    if done:  # collapsed: the kernel now maps that range with 2 MB pages
        assert _huge_kb(t.data_ptr(), t.numel()) * 1024 >= done


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="2 MB pages by madvise are Linux's")
def test_back_collapses_where_the_kernel_allows():
    mode = _thp_mode()
    if mode not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {mode} on this machine")
    t = torch.ones(16 * MB, dtype=torch.float32)  # 64 MB: many whole 2 MB pages inside
    done = pages.back_range(t.data_ptr(), t.numel() * 4)
    if done == 0:
        pytest.skip("MADV_COLLAPSE refused here (kernel before 6.1, or no free 2 MB page)")
    assert done >= 48 * MB
    assert _huge_kb(t.data_ptr(), t.numel() * 4) * 1024 >= done
    assert bool((t == 1).all())


def test_small_storages_are_left_alone():
    assert pages.back(Holder(torch.zeros(MB, dtype=torch.uint8))) == 0  # under MIN_BYTES


def test_a_file_mapping_is_not_written(tmp_path):
    data = torch.randint(0, 256, (16 * MB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "weights.bin"
    path.write_bytes(data.numpy().tobytes())
    mapped = torch.from_file(str(path), shared=False, size=data.numel(), dtype=torch.uint8)
    pages.back(Holder(mapped))
    assert torch.equal(mapped, data)
    assert path.read_bytes() == data.numpy().tobytes()


def test_opt_out(monkeypatch):
    monkeypatch.setenv("MOEQ_HUGE_PAGES", "0")
    t = torch.ones(8 * MB, dtype=torch.float32)
    assert pages.back(Holder(t)) == 0
    assert pages.back_range(t.data_ptr(), t.numel() * 4) == 0


def test_the_probe_buffer_reads_back_what_was_written():
    b = pages.empty((8 * MB,), torch.float32).fill_(3.0)
    assert b.dtype == torch.float32 and b.numel() == 8 * MB
    assert float(b.sum()) == 3.0 * 8 * MB


def test_empty_outlives_its_mapping_name_and_takes_2mb_pages():
    import gc

    t = pages.empty((4, 4 * MB), torch.uint8)
    assert t.shape == (4, 4 * MB) and t.dtype == torch.uint8
    t.fill_(7)
    gc.collect()  # the mapping lives as long as the tensor does
    assert int(t.sum()) == 7 * t.numel()
    if sys.platform.startswith("linux") and _thp_mode() in ("always", "madvise"):
        assert _huge_kb(t.data_ptr(), t.numel()) > 0
    small = pages.empty((3, 5), torch.float32)  # small ones: plain torch memory
    assert small.shape == (3, 5)


def test_il16_copies_and_bf12_heads_equal_their_sources():
    from moeq.formats import bf12
    from moeq.formats.packing import from_il16, to_il16

    w = torch.randint(0, 256, (2, 2048, 1024), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    il = to_il16(w, 2)  # 4 MB: on a mapping of its own
    assert torch.equal(from_il16(il, 2), w)
    h = (torch.randn(4096, 1024, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    assert torch.equal(bf12.unpack(bf12.pack(h)), h)


def test_the_heads_16_row_copy_is_on_2mb_pages():
    """The decode copy of an 8-bit head (rows16) is built when the plan is, after ``moeq.load`` collapsed the model's
    own storages: it has to come on 2 MB pages itself (it is the largest stream of a decode step; in 4 KB pages the
    bench model's Q8_0 head read at 78% of the probe, in 2 MB pages at 98%)."""
    import ctypes

    from moeq import native
    from moeq.config import RTN
    from moeq.kernels import plans
    from moeq.nn import QuantLinear

    if native.lib() is None:
        pytest.skip("no native library on this machine")
    torch.manual_seed(0)
    mod = QuantLinear(RTN(8, 32, grid="signed").quantize((torch.randn(4096, 1024) * 0.05).bfloat16()))
    plans.set_rows16(mod, True)
    stack = plans.linear_plan(mod).stack
    size = native.lib().moeq_rows16_size(ctypes.byref(stack))
    if not stack.rows16:
        pytest.skip("this build has no 16-row kernels")
    x = torch.randn(1, 1024).bfloat16()
    y = mod(x).float()
    want = x.float() @ mod.qweight.dequantize(torch.float32).T
    assert ((y - want).abs() <= want.abs() * 2 ** -6 + 1e-3).all()
    if sys.platform.startswith("linux") and _thp_mode() in ("always", "madvise") and pages._libc() is not None:
        assert _huge_kb(stack.rows16, size) > 0
