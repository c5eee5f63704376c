"""llama.cpp's own tools for the head-to-head benchmarks: found in the cache where they are built from the
``llama-cpp-python`` sdist's vendored llama.cpp (no network at run time):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d ~/.cache/moeq-llamacpp
    tar -xzf ~/.cache/moeq-llamacpp/llama_cpp_python-0.3.36.tar.gz -C ~/.cache/moeq-llamacpp
    cd ~/.cache/moeq-llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \\
          -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2 --target llama-bench llama-quantize \\
          llama-batched-bench

and, for the AVX2 head-to-head (what CPUs without AVX512 run; bench_vs_llamacpp.py --isa avx2), a second build:

    cmake -B build-avx2 -DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
          -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release \
          && cmake --build build-avx2 -j2 --target llama-bench llama-batched-bench

ik_llama.cpp (the CPU-MoE fork: fused MoE up/gate, run-time repacked rows), the second anchor, from the
``ik-llama-cpp-python`` sdist the same way (``GGML_NATIVE=ON`` is safe on AMX machines: the fork has no AMX backend;
over 20 minutes on 2 cores):

    pip download --no-deps --no-binary :all: ik-llama-cpp-python==0.1.5 -d ~/.cache/moeq-ikllamacpp
    tar -xzf ~/.cache/moeq-ikllamacpp/ik_llama_cpp_python-0.1.5.tar.gz -C ~/.cache/moeq-ikllamacpp
    cd ~/.cache/moeq-ikllamacpp/ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp
    # the sdist lacks common/cmake/build-info-gen-cpp.cmake: write the file it would generate
    sed -e 's/@BUILD_NUMBER@/0/; s/@BUILD_COMMIT@/sdist-0.1.5/; s/@BUILD_COMPILER@/gcc/; s/@BUILD_TARGET@/x86_64/' \
        common/build-info.cpp.in > common/build-info.cpp
    cmake -B build -DGGML_NATIVE=ON -DGGML_IQK_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
          -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2 --target llama-bench llama-batched-bench

``convert_hf_to_gguf.py`` (same folder) needs ``sentencepiece`` for Llama-family checkpoints; it is not a moeq
dependency: ``pip install --target ~/.cache/moeq-llamacpp/pydeps sentencepiece`` (put on PYTHONPATH by
:func:`convert`)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

CACHE = Path.home() / ".cache" / "moeq-llamacpp"
IK_CACHE = Path.home() / ".cache" / "moeq-ikllamacpp"
ATTN_EXPERTS = (".attn_q.", ".attn_k.", ".attn_v.", ".attn_output.", "_exps.")  # what both sides quantize


def vendor_dir(ik: bool = False) -> Path | None:
    hits = sorted(IK_CACHE.glob("ik_llama_cpp_python-*/vendor/ik_llama.cpp") if ik else
                  CACHE.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return hits[-1] if hits else None


def build_flags(exe: Path) -> str:
    """The ISA switches a llama.cpp build was configured with (its CMakeCache), to name the build behind a number."""
    cache = Path(exe).resolve().parent.parent / "CMakeCache.txt"
    if not cache.exists():
        return "unknown"
    keys = ("GGML_NATIVE", "GGML_AVX2", "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AMX_INT8",
            "GGML_AMX_BF16", "GGML_IQK_MUL_MAT")
    got = {}
    for line in cache.read_text().splitlines():
        name, _, value = line.partition("=")
        name = name.split(":")[0]
        if name in keys:
            got[name] = value
    return ", ".join(f"{k.removeprefix('GGML_')}={got[k]}" for k in keys if k in got)


def find_tool(name: str, given: str | None = None, build: str = "build", ik: bool = False) -> Path | None:
    if given:
        return Path(given)
    v = vendor_dir(ik)
    exe = v / build / "bin" / name if v else None
    return exe if exe is not None and exe.exists() else None


def convert(src: Path, out: Path) -> Path:
    """llama.cpp's own converter: the HF checkpoint as a BF16 GGUF."""
    v = vendor_dir()
    if v is None:
        raise FileNotFoundError("no vendored llama.cpp in " + str(CACHE))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(CACHE / "pydeps"),
                                                                     os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, str(v / "convert_hf_to_gguf.py"), str(src), "--outtype", "bf16", "--outfile",
                    str(out)], check=True, capture_output=True, env=env, timeout=1800)
    return out


def same_tensors(a: Path, b: Path) -> bool:
    """Two GGUF files hold the same tensors: names, types and bytes."""
    import gguf  # noqa: PLC0415

    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    return set(ta) == set(tb) and all(
        ta[n].tensor_type == tb[n].tensor_type and np.array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data))
        for n in ta)


# the big-MoE recipe as moeq's nl2-m spends it: experts at the row's type, attention (and shared experts, dense MLPs)
# IQ4_NL, k and v Q8_0 (llama-quantize --tensor-type overrides on an IQ4_NL base)
EXPERTS_RECIPE = ("IQ4_NL", ("attn_k=q8_0", "attn_v=q8_0", "attn_kv_a_mqa=q8_0", "attn_k_b=q8_0", "attn_v_b=q8_0"))


def quantize(exe: Path, src: Path, dst: Path, qtype: str, pure: bool = False, imatrix: Path | None = None,
             experts_only: bool = False) -> Path:
    """``llama-quantize`` (with ``imatrix``: weighted by that importance matrix); token embeddings and output kept
    BF16, as moeq keeps them, so both sides quantize the same tensors (attention and experts; llama.cpp never
    quantizes the router). ``experts_only``: ``qtype`` on the routed experts only, the rest as
    :data:`EXPERTS_RECIPE`."""
    cmd = [str(exe), "--token-embedding-type", "bf16", "--output-tensor-type", "bf16"]
    cmd += ["--pure"] if pure else []
    cmd += ["--imatrix", str(imatrix)] if imatrix is not None else []
    if experts_only:
        base, overrides = EXPERTS_RECIPE
        for o in (*overrides, *(f"ffn_{k}_exps={qtype.lower()}" for k in ("gate", "up", "down"))):
            cmd += ["--tensor-type", o]
        qtype = base
    subprocess.run(cmd + [str(src), str(dst), qtype], check=True, capture_output=True, timeout=3600)
    return dst


def imatrix(exe: Path, model: Path, text: Path, out: Path, chunks: int, ctx: int = 512) -> Path:
    """``llama-imatrix`` over ``chunks`` windows of ``ctx`` tokens of ``text`` (2 threads), as the Hub's uploaders
    make theirs."""
    subprocess.run([str(exe), "-m", str(model), "-f", str(text), "-o", str(out), "-c", str(ctx), "--chunks",
                    str(chunks), "-t", "2", "--no-ppl"], check=True, capture_output=True, timeout=7200)
    return out


def bits_per_weight(path: Path, names: tuple[str, ...] = ATTN_EXPERTS) -> tuple[float, dict[str, int], int]:
    """Bits per weight over attention (q, k, v, o) and expert tensors (``names``: tensors whose name holds one of
    them), how many tensors of each type, and how many weights."""
    import gguf  # noqa: PLC0415

    bits = count = 0
    types: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        if any(s in t.name for s in names):
            block, per = gguf.GGML_QUANT_SIZES[t.tensor_type]
            n = int(np.prod(t.shape))
            bits += n * per * 8 / block
            count += n
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return bits / count, types, count
