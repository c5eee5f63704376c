"""llama.cpp itself, through the C API that the ``xllamacpp`` wheel's extension exports (no build step): load a GGUF
file, decode, read the logits. Structs passed by value (model/context params, batches) are kept as opaque buffers
larger than llama.cpp's own: on x86-64 SysV such structs travel in memory, so the callee only reads/writes its
part, and the defaults llama.cpp returns are passed back unchanged."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np


class _Blob(ctypes.Structure):
    _fields_ = [("raw", ctypes.c_uint8 * 1024)]


_LOG_CB = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_silent = _LOG_CB(lambda level, text, user: None)
_lib = None


def library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        import xllamacpp  # noqa: PLC0415

        so = next(Path(xllamacpp.__file__).parent.glob("xllamacpp*.so"))
        lib = ctypes.CDLL(str(so))
        p, i32 = ctypes.c_void_p, ctypes.c_int32
        sigs = {"llama_backend_init": ([], None), "llama_log_set": ([_LOG_CB, p], None),
                "llama_model_default_params": ([], _Blob), "llama_context_default_params": ([], _Blob),
                "llama_model_load_from_file": ([ctypes.c_char_p, _Blob], p),
                "llama_init_from_model": ([p, _Blob], p), "llama_batch_get_one": ([p, i32], _Blob),
                "llama_decode": ([p, _Blob], i32), "llama_get_logits_ith": ([p, i32], ctypes.POINTER(ctypes.c_float)),
                "llama_model_get_vocab": ([p], p), "llama_vocab_n_tokens": ([p], i32), "llama_free": ([p], None),
                "llama_model_free": ([p], None),
                "llama_tokenize": ([p, ctypes.c_char_p, i32, p, i32, ctypes.c_bool, ctypes.c_bool], i32),
                "ggml_quantize_init": ([ctypes.c_int], None),
                "ggml_quantize_chunk": ([ctypes.c_int, p, p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p],
                                        ctypes.c_size_t)}
        for name, (args, res) in sigs.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, res
        lib.llama_log_set(_silent, None)
        lib.llama_backend_init()
        _lib = lib
    return _lib


class LlamaCpp:
    """A GGUF model in llama.cpp: ``logits(prompt)`` and ``greedy(prompt, n)`` (fresh context each call)."""

    def __init__(self, path: str | Path):
        self.lib = lib = library()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))

    def _run(self, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
        lib = self.lib
        ctx = lib.llama_init_from_model(self.model, lib.llama_context_default_params())
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        try:
            tokens, logits, feed = [], [], list(prompt)
            for _ in range(steps):
                buf = (ctypes.c_int32 * len(feed))(*feed)
                if lib.llama_decode(ctx, lib.llama_batch_get_one(buf, len(feed))) != 0:
                    raise RuntimeError("llama_decode failed")
                row = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), (self.n_vocab,)).copy()
                logits.append(row)
                tokens.append(int(row.argmax()))
                feed = [tokens[-1]]
            return tokens, logits
        finally:
            lib.llama_free(ctx)

    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        return self._run(prompt, steps)[0]

    def logits(self, prompt: list[int]) -> np.ndarray:
        return self._run(prompt, 1)[1][0]

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's tokenization of ``text`` (no BOS/EOS added) from the GGUF's own vocabulary metadata."""
        raw = text.encode()
        buf = (ctypes.c_int32 * (len(raw) + 8))()
        vocab = self.lib.llama_model_get_vocab(self.model)
        n = self.lib.llama_tokenize(vocab, raw, len(raw), ctypes.cast(buf, ctypes.c_void_p), len(buf), False, False)
        if n < 0:
            raise RuntimeError("llama_tokenize failed")
        return list(buf[:n])

    def close(self) -> None:
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None


def quantize(values: np.ndarray, qtype: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's own quantizer (``ggml_quantize_chunk``, what ``llama-quantize`` calls per tensor) on fp32 rows
    ``[rows, k]``: the GGML block bytes ``[rows, k / block * type_size]`` (uint8)."""
    import gguf  # noqa: PLC0415

    lib = library()
    gtype = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[gtype]
    src = np.ascontiguousarray(values, dtype=np.float32)
    rows, k = src.shape
    out = np.zeros((rows, k // block * size), dtype=np.uint8)
    lib.ggml_quantize_init(int(gtype))
    imat = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    n = lib.ggml_quantize_chunk(int(gtype), src.ctypes.data, out.ctypes.data, 0, rows, k,
                                None if imat is None else imat.ctypes.data)
    assert n == out.nbytes, (n, out.nbytes)
    return out
