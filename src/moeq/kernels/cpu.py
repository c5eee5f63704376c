"""Native CPU kernels (``cpu_kernels.c``), compiled on first use with the system C compiler into a per-user cache
and called through ctypes. No torch headers are involved, so the build takes about a second. When no compiler is
available, ``lib()`` returns None and every caller keeps its plain-torch path."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from moeq.errors import MoeqError

log = logging.getLogger(__name__)
SRC = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moeq" / "kernels"


def _cpu_flags() -> str:
    """-march=native binaries are CPU-specific: key the cache by the CPU's feature flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform  # noqa: PLC0415

    return platform.processor() or platform.machine()


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The native library, built on first use; None (plain-torch paths everywhere) when it cannot be built or
    loaded: no compiler, no kernel source, an unwritable cache folder, a failed compile."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: moeq uses its plain-torch CPU paths (slower)")
        return None
    try:
        so = _build(cc)
    except OSError as e:
        log.warning("cannot build moeq CPU kernels (%s): using plain-torch paths (slower)", e)
        return None
    if so is None:
        return None
    try:
        L = ctypes.CDLL(str(so))
    except OSError as e:
        log.warning("loading moeq CPU kernels failed (%s), using plain-torch paths", e)
        return None
    L.moeq_set_threads(torch.get_num_threads())
    return L


def _build(cc: str) -> Path | None:
    src = SRC.read_bytes()
    tag = hashlib.sha256(src + " ".join([cc, *FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    so = _cache_dir() / f"libmoeq_cpu_{tag}.so"
    if so.exists():
        return so
    so.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
        out = Path(tmp) / so.name
        proc = subprocess.run([cc, *FLAGS, str(SRC), "-o", str(out), "-lm"], capture_output=True, text=True)
        if proc.returncode:
            log.warning("building moeq CPU kernels failed, using plain-torch paths:\n%s", proc.stderr[-2000:])
            return None
        os.replace(out, so)
    return so


@functools.cache
def has_dpbf16() -> bool:
    """The kernels were built with AVX512-BF16 dot products (``moeq_rtn4_gemv_bf16``'s fast path)."""
    L = lib()
    return bool(L is not None and L.moeq_has_dpbf16())


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def i64(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(v)


def func(name: str, argtypes: list):
    """A native function declared with its argument types, so callers pass plain ints (pointers, sizes) and floats."""
    fn = getattr(lib(), name)
    if fn.argtypes is None:
        fn.argtypes = argtypes
    return fn


def fits(*pairs: tuple[torch.Tensor | None, int]) -> None:
    """Bounds check at the native boundary: each ``(tensor, bytes the kernel will read or write)`` must hold that
    many bytes. Weights are validated when they enter moeq; this is the last line if an invariant ever breaks."""
    for t, need in pairs:
        if t is not None and t.numel() * t.element_size() < need:
            raise MoeqError(f"refusing a native call: it would touch {need} bytes of a {t.dtype} tensor of shape "
                            f"{list(t.shape)} ({t.numel() * t.element_size()} bytes); the weight is inconsistent")


def usable(*tensors: torch.Tensor | None) -> bool:
    """The native path takes CPU, contiguous tensors only."""
    return all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors)


class PlanSlot:
    """Holds a module's prepared native-call arguments (raw pointers into its buffers). A copy or a pickle of the
    module gets an empty slot, and rebuilds the plan from its own buffers on first use."""
    __slots__ = ("value",)

    def __init__(self):
        self.value = None

    def __deepcopy__(self, memo) -> "PlanSlot":
        return PlanSlot()

    def __reduce__(self):
        return PlanSlot, ()


def plan_slot(module, name: str) -> PlanSlot:
    slot = module.__dict__.get(name)
    if slot is None:
        slot = module.__dict__[name] = PlanSlot()
    return slot
