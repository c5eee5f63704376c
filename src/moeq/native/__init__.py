"""The native CPU library: C sources in ``csrc/`` (``moeq.h`` shared types and prototypes; ``quants.c``,
``gemv.c``, ``moe.c``, ``decode.c``, ``i8.c``, ``model.c``, ``rows16.c``, ``gemm.c``, ``bf12.c``, ``fp8.c``,
``iq2s.c`` split by concern),
compiled on first use with the system C compiler into one shared library in a per-user cache, and called through
ctypes.

This is moeq's bottom layer for native code: it imports only torch and :mod:`moeq.errors`, so formats, kernels and
modules all sit above it. Every export's return and argument types are declared once, in :data:`ABI`; callers pass
plain Python ints (pointers from :func:`ptr`, sizes), floats and tensors' addresses. :class:`Fmt` and
:class:`WStack` mirror ``enum moeq_fmt`` and ``moeq_wstack`` in ``moeq.h``.

When no compiler is available, the cache is unwritable or the build fails, :func:`lib` returns None and every caller
keeps its plain-torch path (the reference the kernels are tested against).

Adding a kernel: write it in the ``csrc`` file of its concern, declare it in ``moeq.h``, add its line to
:data:`ABI`, and call it with ``lib().moeq_name(...)`` behind a plain-torch reference of the same signature.
"""
from __future__ import annotations

import ctypes
import enum
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
CSRC = Path(__file__).with_name("csrc")
SOURCES = ("quants.c", "gemv.c", "moe.c", "decode.c", "i8.c", "model.c", "rows16.c", "gemm.c", "bf12.c", "fp8.c", "iq2s.c")
HEADERS = ("moeq.h", "rtn4_rows.h", "rows_avx2.h", "il16_rows.h")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
ISA_ENV = "MOEQ_NATIVE_MARCH"  # e.g. x86-64-v3 / skylake-avx512: build and test what CPUs without AVX512-BF16 get
# "address": an AddressSanitizer build (run the process with LD_PRELOAD=$(cc -print-file-name=libasan.so)), which the
# differential kernel tests use to catch any write past a buffer (tests/kernels/test_matrix.py)
SANITIZE_ENV = "MOEQ_NATIVE_SANITIZE"


def march() -> str:
    """The ``-march`` the library is built for: the build machine's own (``native``) unless ``MOEQ_NATIVE_MARCH``
    names another (a build-time choice, like CC; read when the library is first built)."""
    value = os.environ.get(ISA_ENV, "native")
    if not value or not all(c.isalnum() or c in "-_." for c in value):
        raise MoeqError(f"{ISA_ENV}={value!r} is not a -march value (e.g. native, x86-64-v3)")
    return value


def _sanitize_flags() -> list[str]:
    value = os.environ.get(SANITIZE_ENV, "")
    if value not in ("", "address"):
        raise MoeqError(f"{SANITIZE_ENV}={value!r}: the one sanitizer build is 'address'")
    return ["-fsanitize=address", "-fno-omit-frame-pointer", "-O1"] if value else []  # -O1 (last wins): builds 2x faster


MAX_KERNELS = 8  # MOEQ_MAX_KERNELS


class Layers(enum.IntFlag):
    """``enum moeq_layer``: the layer kernels a planned stack can be part of (``WStack.layers``)."""
    I8 = 1  # the int8-activation layer
    EXPERTS = 2  # the expert-parallel bf16 layer (4-bit RTN and codebook grids)
    GEMM = 4  # the prompt's grouped GEMM


class Fmt(enum.IntEnum):
    """``enum moeq_fmt``: the packed formats the fused kernels take."""
    RTN = 0
    BNB4 = 1
    FP8 = 2
    IQ2S = 3


class WStack(ctypes.Structure):
    """``moeq_wstack``: one weight or expert stack ``[E, N, K]`` described for the fused kernels."""
    _fields_ = [("fmt", ctypes.c_int), ("dot_bf16", ctypes.c_int), ("q", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("scale_bf16", ctypes.c_int), ("absmax_u8", ctypes.c_int),
                ("zero", ctypes.c_void_p), ("bits", ctypes.c_int), ("gs", ctypes.c_int64), ("code", ctypes.c_void_p),
                ("offset", ctypes.c_void_p), ("nested_absmax", ctypes.c_void_p), ("nested_code", ctypes.c_void_p),
                ("spe", ctypes.c_int64), ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("values", ctypes.c_void_p),
                ("lut", ctypes.c_void_p), ("scale_super", ctypes.c_void_p), ("act_i8", ctypes.c_int),
                ("rows16", ctypes.c_void_p), ("rows16_layout", ctypes.c_int), ("il16", ctypes.c_int),
                ("bn", ctypes.c_int64), ("kernels", ctypes.c_uint8 * MAX_KERNELS), ("layers", ctypes.c_int)]

    def kernel_names(self) -> list[str]:
        """The decode kernel rows ``moeq_wstack_plan`` ranked for this weight, best first (empty: not planned)."""
        L = lib()
        return [L.moeq_kernel_name(k).decode() for k in self.kernels if k] if L is not None else []


class Layer(ctypes.Structure):
    """``moeq_layer``: one MoE decoder layer described for ``moeq_layer_pre/attn/moe``."""
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("qn", ctypes.c_void_p), ("kn", ctypes.c_void_p),
                ("router", ctypes.c_void_p), ("bq", ctypes.c_void_p), ("bk", ctypes.c_void_p),
                ("bv", ctypes.c_void_p), ("bo", ctypes.c_void_p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
                ("eps_qk", ctypes.c_float), ("scale", ctypes.c_float), ("H", ctypes.c_int64), ("Hq", ctypes.c_int64),
                ("Hkv", ctypes.c_int64), ("D", ctypes.c_int64), ("E", ctypes.c_int64), ("topk", ctypes.c_int64),
                ("renorm", ctypes.c_int), ("cast", ctypes.c_int), ("qk_full", ctypes.c_int), ("q", WStack),
                ("k", WStack), ("v", WStack),
                ("o", WStack), ("w13", WStack), ("w2", WStack)]


class Bf12(ctypes.Structure):
    """``moeq_bf12``: a bf16 weight held losslessly in 12 bits per weight (:mod:`moeq.formats.bf12`)."""
    _fields_ = [("lo", ctypes.c_void_p), ("hi", ctypes.c_void_p), ("base", ctypes.c_void_p),
                ("xptr", ctypes.c_void_p), ("xcol", ctypes.c_void_p), ("xval", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64)]


class Model(ctypes.Structure):
    """``moeq_model``: a whole MoE model described for ``moeq_decode_step``."""
    _fields_ = [("layers", ctypes.POINTER(Layer)), ("L", ctypes.c_int64), ("H", ctypes.c_int64),
                ("vocab", ctypes.c_int64), ("V", ctypes.c_int64), ("P", ctypes.c_int64), ("B", ctypes.c_int64),
                ("Sc", ctypes.c_int64), ("embed", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("head", ctypes.c_void_p), ("hq", WStack), ("head_scratch", ctypes.c_void_p),
                ("head12", ctypes.POINTER(Bf12)),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("kc", ctypes.POINTER(ctypes.c_void_p)),
                ("vc", ctypes.POINTER(ctypes.c_void_p))]


_P, _I, _INT, _F, _WS = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.POINTER(WStack)
_LAYER = ctypes.POINTER(Layer)
_B12 = ctypes.POINTER(Bf12)
# name: (return type, argument types) -- exactly the prototypes in csrc/moeq.h
ABI: dict[str, tuple[type | None, list]] = {
    # quants.c
    "moeq_set_threads": (None, [_INT]),
    "moeq_rtn_quantize_sym": (None, [_P, _INT, _I, _I, _I, _INT, _P, _P]),
    "moeq_rtn_quantize_signed": (None, [_P, _INT, _I, _I, _I, _INT, _P, _P]),
    "moeq_rtn_quantize_asym": (None, [_P, _INT, _I, _I, _I, _INT, _P, _P, _P]),
    "moeq_rtn_dequant": (None, [_P, _P, _INT, _P, _INT, _I, _I, _I, _P, _INT]),
    "moeq_bnb4_quantize": (None, [_P, _INT, _I, _I, _P, _P, _P, _P]),
    "moeq_bnb4_quantize_search": (None, [_P, _INT, _I, _I, _P, _P, _P, _INT, _F, _P, _P]),
    "moeq_bnb4_dequant": (None, [_P, _P, _P, _I, _I, _P, _INT]),
    "moeq_bnb4_resolve_absmax": (None, [_P, _P, _P, _P, _I, _I, _P]),
    "moeq_cb4_search": (None, [_P, _INT, _I, _I, _I, _P, _INT, _INT, _INT, _P, _P, _P]),
    "moeq_cb4_dequant": (None, [_P, _P, _INT, _P, _P, _INT, _I, _I, _I, _P, _INT]),
    "moeq_cb4_requant": (None, [_P, _INT, _I, _I, _I, _P, _INT, _P, _P, _P]),
    "moeq_cb4_scale_codes": (None, [_P, _I, _I, _P, _P]),
    "moeq_int8_dequant": (None, [_P, _P, _I, _I, _P, _INT]),
    "moeq_fp8_dequant": (_INT, [_P, _P, _I, _I, _I, _I, _I, _P, _INT]),
    # iq2s.c
    "moeq_iq2s_quantize": (None, [_P, _I, _I, _P, _INT, _P, _P]),
    "moeq_iq2s_dequant": (None, [_P, _I, _I, _P, _P, _INT]),
    "moeq_iq2s_rows_bf16": (None, [_P, _I, _I, _P, _P]),
    "moeq_iq2s_gemv": (_INT, [_P, _I, _P, _I, _I, _P, _P]),
    "moeq_ggml_unpack": (None, [_P, _I, _INT, _INT, _P, _P]),
    # gemv.c
    "moeq_has_dpbf16": (_INT, []),
    "moeq_simd_level": (_INT, []),
    "moeq_has_cb3_dot": (_INT, []),
    "moeq_has_i8_dot": (_INT, []),
    "moeq_rtn_gemv": (None, [_P, _P, _P, _I, _P, _P, _INT, _P, _INT, _I, _I, _I, _P]),
    "moeq_rtn4_gemv_bf16": (None, [_P, _P, _I, _P, _P, _INT, _P, _I, _I, _I, _P, _INT]),
    "moeq_rtn8_gemv_bf16": (_INT, [_P, _I, _P, _P, _INT, _P, _I, _I, _I, _P]),
    "moeq_bf16_gemv": (_INT, [_P, _I, _P, _I, _I, _P]),
    "moeq_bnb4_gemv_bf16": (_INT, [_P, _I, _P, _P, _P, _I, _I, _I, _P]),
    "moeq_bnb4_gemv": (None, [_P, _P, _I, _P, _P, _P, _I, _I, _I, _P]),
    "moeq_cb4_gemv_bf16": (_INT, [_P, _I, _P, _P, _INT, _P, _P, _I, _I, _I, _INT, _P]),
    "moeq_cb4_gemv": (None, [_P, _I, _P, _P, _INT, _P, _P, _I, _I, _I, _INT, _P]),
    "moeq_int8_gemv": (None, [_P, _I, _P, _P, _I, _I, _P]),
    # rows16.c
    "moeq_rows16_size": (_I, [_WS]),
    "moeq_rows16_pack": (_INT, [_WS, _INT, _P]),
    "moeq_rows16_gemv": (_INT, [_WS, _P, _I, _P]),
    "moeq_il16_takes": (_INT, [_WS]),
    "moeq_il16_dequant": (_INT, [_WS, _I, _P, _INT]),
    # moe.c
    "moeq_wstack_plan": (_INT, [_WS]),
    "moeq_kernel_name": (ctypes.c_char_p, [_INT]),
    "moeq_quant_linear_bf16": (None, [_WS, _P, _I, _P, _P, _P]),
    "moeq_moe_forward": (None, [_WS, _WS, _P, _I, _I, _P, _P, _P, _I, _P, _P]),
    "moeq_gemm_takes": (_INT, [_WS]),
    "moeq_amx_ready": (_INT, []),
    "moeq_set_amx": (None, [_INT]),
    "moeq_set_il16_i16": (None, [_INT]),
    "moeq_set_linear_amx_rows": (None, [_INT]),
    "moeq_linear_amx_takes": (_INT, [_WS, _I]),
    "moeq_moe_prefill": (_INT, [_WS, _WS, _P, _I, _I, _I, _P, _P, _P, _I, _P]),
    "moeq_attn_prefill_bf16": (_INT, [_P, _P, _P, _I, _I, _I, _I, _I, _F, _P]),
    "moeq_moe_forward_rtn4_bf16": (None, [_WS, _WS, _P, _I, _I, _P, _P, _P, _I, _P, _P]),
    "moeq_moe_routed": (_INT, [_WS, _WS, _P, _I, _I, _P, _P, _I, _I, _I, _P, _P]),
    # decode.c
    "moeq_rmsnorm_bf16": (None, [_P, _P, _I, _I, _F, _P]),
    "moeq_attn_decode_bf16": (None, [_P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _P]),
    "moeq_rope_bf16": (None, [_P, _I, _I, _I, _P, _P]),
    "moeq_layer_pre": (None, [_LAYER, _P, _I, _P, _P, _P, _P, _P]),
    "moeq_layer_attn": (_INT, [_LAYER, _P, _I, _P, _P, _P, _I, _P, _P, _P, _P]),
    "moeq_layer_moe": (_INT, [_LAYER, _P, _P, _I, _P, _P, _P, _P]),
    # bf12.c
    "moeq_bf12_pack": (None, [_P, _I, _I, _P, _P, _P, _P]),
    "moeq_bf12_exceptions": (None, [_P, _I, _I, _P, _P, _P, _P]),
    "moeq_bf12_unpack": (None, [_B12, _I, _I, _P]),
    "moeq_bf12_gemv": (_INT, [_B12, _P, _I, _P]),
    "moeq_bf12_gemm_amx": (_INT, [_B12, _P, _I, _P]),
    "moeq_bf12_gemm_bf16": (_INT, [_B12, _P, _I, _P]),
    "moeq_bf12_matmul": (_INT, [_B12, _P, _I, _P]),
    # fp8.c
    "moeq_fp8_gemv": (None, [_P, _I, _P, _P, _I, _I, _I, _I, _P]),
    "moeq_fp8_gemv_bf16": (_INT, [_P, _I, _P, _P, _I, _I, _I, _I, _P]),
    # model.c
    "moeq_decode_step": (_I, [ctypes.POINTER(Model), _I, _P, _P, _I, _P, _I, _P, _P, _P, _P]),
    "moeq_argmax_bf16": (None, [_P, _I, _I, _P, _I, _P]),
}


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
    """The native library with every export typed from :data:`ABI`; None (plain-torch paths everywhere) when it
    cannot be built or loaded: no compiler, missing sources, an unwritable cache folder, a failed compile."""
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
        for name, (restype, argtypes) in ABI.items():
            fn = getattr(L, name)
            fn.restype, fn.argtypes = restype, argtypes
    except (OSError, AttributeError) as e:
        log.warning("loading moeq CPU kernels failed (%s), using plain-torch paths", e)
        return None
    L.moeq_set_threads(torch.get_num_threads())
    L.moeq_amx_ready()  # AMX permission asked once, from this thread, before any parallel kernel
    # several rows per 4-bit il16 block with int16 activations where the CPU has AMX (its bf16 dot product issues at a
    # third of the int16 one's rate; its kernels already change with the batch size); bf16 elsewhere: batch-invariant
    L.moeq_set_il16_i16(int(has_amx()))
    return L


def _build(cc: str) -> Path | None:
    """The library for these sources, flags and CPU: from the cache when a copy there is intact (its bytes match the
    digest written beside it when it was built, and neither it nor its folder is writable by other users), else
    compiled now. Concurrent builders each compile into a private temporary folder and rename into place, so a
    reader never sees a half-written library; a truncated or foreign file in the cache is rebuilt, never loaded."""
    files = [CSRC / f for f in (*SOURCES, *HEADERS)]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    flags = [*FLAGS, f"-march={march()}", *_sanitize_flags()]
    digest.update(" ".join([cc, *flags, _cpu_flags()]).encode())
    folder = _private_dir(_cache_dir())
    so = folder / f"libmoeq_cpu_{digest.hexdigest()[:16]}.so"
    stamp = so.with_suffix(".sha256")
    if _intact(so, stamp):
        return so
    if so.exists() or so.is_symlink():
        log.warning("the cached kernel library %s does not match its build digest: rebuilding it", so)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / so.name
        if not _compile(cc, flags, out):
            return None
        out.chmod(0o755)
        (Path(tmp) / stamp.name).write_text(_sha256(out))
        os.replace(out, so)  # the library first: a reader that finds the new digest finds the new library
        os.replace(Path(tmp) / stamp.name, stamp)
    if not _intact(so, stamp):  # another process replaced it between our two renames: use a private copy
        return _build_private(cc, flags)
    return so


def _build_private(cc: str, flags: list[str]) -> Path | None:
    folder = Path(tempfile.mkdtemp(prefix="moeq-kernels-"))
    out = folder / "libmoeq_cpu.so"
    return out if _compile(cc, flags, out) else None


def _compile(cc: str, flags: list[str], out: Path) -> bool:
    """Compile each source to an object beside ``out`` (as many compilers at once as this process may use cores:
    the largest file takes about half the serial time), then link ``out``."""
    objs = [out.with_name(f"{Path(f).stem}.o") for f in SOURCES]
    jobs = [([cc, *flags, "-c", str(CSRC / f), "-o", str(o)]) for f, o in zip(SOURCES, objs)]
    width = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    running: list[subprocess.Popen] = []
    failed = []
    for cmd in sorted(jobs, key=lambda c: -Path(c[-3]).stat().st_size):  # the biggest first
        while len(running) >= width:
            failed += _reap(running.pop(0))
        running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in running:
        failed += _reap(p)
    if not failed:
        proc = subprocess.run([cc, *flags, *map(str, objs), "-o", str(out), "-lm"], capture_output=True, text=True)
        failed += [proc.stderr] if proc.returncode else []
    for o in objs:
        o.unlink(missing_ok=True)
    if failed:
        log.warning("building moeq CPU kernels failed, using plain-torch paths:\n%s", "\n".join(failed)[-2000:])
    return not failed


def _reap(proc: subprocess.Popen) -> list[str]:
    _, err = proc.communicate()
    return [err] if proc.returncode else []


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _safe(path: Path) -> bool:
    """Owned by this user (or root) and not writable by group or others."""
    st = path.lstat()
    return st.st_uid in (os.getuid(), 0) and not st.st_mode & 0o022


def _intact(so: Path, stamp: Path) -> bool:
    try:
        if so.is_symlink() or stamp.is_symlink() or not so.is_file() or not (_safe(so) and _safe(stamp)):
            return False
        return stamp.read_text().strip() == _sha256(so)
    except OSError:
        return False


def _private_dir(folder: Path) -> Path:
    """``folder`` created 0700 if missing; if it (or a parent moeq made) is writable by others or owned by someone
    else, a fresh private temporary folder instead (a library another user can replace would run their code)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for p in (folder, folder.parent):
        if p.is_symlink() or not _safe(p):
            log.warning("the kernel cache %s is a link, or writable by or owned by another user: building in a "
                        "private temporary folder instead", p)
            return Path(tempfile.mkdtemp(prefix="moeq-kernels-"))
    return folder


@functools.cache
def has_dpbf16() -> bool:
    """The library was built with AVX512-BF16 (and VNNI) dot products."""
    L = lib()
    return bool(L is not None and L.moeq_has_dpbf16())


@functools.cache
def has_simd() -> bool:
    """The library has SIMD decode kernels: AVX512-BF16/VNNI (bf16 activations), or AVX2 + FMA (fp32 activations) on
    CPUs without AVX512-BF16. The native decode forwards (norms, routers, attention, heads, one-call linears) need one."""
    L = lib()
    return bool(L is not None and L.moeq_simd_level() > 0)


@functools.cache
def has_cb3_dot() -> bool:
    """The 3-bit codebook rows run on AVX512-BF16 with VBMI byte permutes (else they unpack in scalar code)."""
    L = lib()
    return bool(L is not None and L.moeq_has_cb3_dot())


@functools.cache
def has_amx() -> bool:
    """This CPU has AMX bf16 tiles (Sapphire Rapids and later), which torch's oneDNN bf16 GEMM uses: a few-row bf16
    GEMM there reads the weight at memory speed (a 151936 x 2048 head: 32-33 ms at 2-16 rows, 2 threads)."""
    return "amx_bf16" in set(_cpu_flags().split(":", 1)[-1].split())


def amx_tiles() -> bool:
    """moeq's own kernels run on the AMX tile unit here: built with AMX, a CPU with it, and Linux granted this process
    the tile data (``moeq_amx_ready``; llama.cpp's AMX build crashes where that is missing)."""
    L = lib()
    return L is not None and L.moeq_amx_ready() == 1


@functools.cache
def fast_bf16_matmul() -> bool:
    """This CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX): torch's bf16 GEMM is then as fast as fp32 or
    faster. Without (AVX2-only CPUs such as Zen 3: 9.6 vs 45 GFLOPS measured), the many-row matmuls of bf16 models
    run in fp32 — the same products (bf16 x bf16 is exact in fp32) and fp32 sums, rounded to bf16 once."""
    import platform  # noqa: PLC0415

    flags = set(_cpu_flags().split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"}) or platform.machine() not in ("x86_64", "AMD64")


@functools.cache
def has_i8_dot() -> bool:
    """The library has the int8-activation decode kernels (AVX2, or AVX512-VNNI: ``activations="int8"``)."""
    return i8_level() > 0


def i8_level() -> int:
    """The int8-activation kernels built: 0 none, 1 AVX2 (4-bit weights), 2 AVX512-VNNI (4-bit and 8-bit)."""
    L = lib()
    return int(L.moeq_has_i8_dot()) if L is not None else 0


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a pointer argument (None: NULL)."""
    return None if t is None else t.data_ptr()


def i64(v: int) -> int:
    return int(v)


def plan(stack: WStack) -> bool:
    """Plan a described weight once (``moeq_wstack_plan``): rank the decode kernels and layer kernels that take it on
    this build into ``stack.kernels`` / ``stack.layers``. False when no decode kernel takes it."""
    return lib().moeq_wstack_plan(ctypes.byref(stack)) > 0


def func(name: str):
    """A typed export of the library (its types come from :data:`ABI`)."""
    return getattr(lib(), name)


def fits(*pairs: tuple[torch.Tensor | None, int]) -> None:
    """Bounds check at the native boundary: each ``(tensor, bytes the kernel will read or write)`` must hold that
    many bytes. Weights are validated when they enter moeq; this is the last line if an invariant ever breaks."""
    for t, need in pairs:
        if t is not None and t.numel() * t.element_size() < need:
            raise MoeqError(f"refusing a native call: it would touch {need} bytes of a {t.dtype} tensor of shape "
                            f"{list(t.shape)} ({t.numel() * t.element_size()} bytes); the weight is inconsistent")


def fits_out(t: torch.Tensor, written: torch.dtype, count: int) -> None:
    """Bounds check for a buffer the C side writes ``count`` elements of type ``written`` into (bf16 or fp32: the C
    side's ``out_bf16`` flag): the tensor must be a contiguous CPU tensor of exactly that dtype with room for them.
    A buffer of another dtype (an fp16 model's) is refused here, before any byte is written: its element size is not
    the one the kernel writes."""
    if t.dtype != written or not t.is_contiguous() or t.device.type != "cpu":
        raise MoeqError(f"refusing a native call: it writes {written} elements, and its output buffer is a "
                        f"{'non-contiguous ' if not t.is_contiguous() else ''}{t.dtype} tensor on {t.device}")
    fits((t, count * t.element_size()))


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
