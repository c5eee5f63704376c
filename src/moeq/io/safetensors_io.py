"""Safetensors reading that never holds more than one tensor (or one expert slice) at a time, plus memory-mapped
reading for saved moeq checkpoints. Every failure names the file and tensor at fault."""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I8": torch.int8,
    "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: truncated or corrupt safetensors header (declares {n} header bytes, "
                             f"file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header: {e}") from None
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out = {}
    for name, h in header.items():
        try:
            dtype = _DTYPES[h["dtype"]]
            shape = tuple(int(x) for x in h["shape"])
            a, b = (int(x) for x in h["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: tensor {name}: malformed header entry {h!r} ({e!r})") from None
        if b - a != math.prod(shape) * torch.empty(0, dtype=dtype).element_size() or base + b > size:
            raise ValueError(f"{path}: tensor {name}: data range {a}..{b} does not fit its shape {list(shape)} "
                             f"{h['dtype']} or the file size {size} (truncated file?)")
        out[name] = TensorInfo(path, name, dtype, shape, base + a, base + b)
    return out, meta


class Checkpoint:
    """A safetensors checkpoint directory (single file or sharded with ``model.safetensors.index.json``) or file."""

    def __init__(self, path: str | os.PathLike, device: torch.device | str = "cpu"):
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such checkpoint")
        self.device = torch.device(device)  # where read() delivers tensors (a GPU: quantized there, in flight)
        self.dir = path if path.is_dir() else path.parent
        if path.is_file():
            files = [path]
        elif (path / "model.safetensors.index.json").exists():
            idx_path = path / "model.safetensors.index.json"
            try:
                weight_map = json.loads(idx_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{idx_path}: unreadable index ({e!r})") from None
            files = sorted({path / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise FileNotFoundError(f"{idx_path}: shard(s) missing: {', '.join(missing)}")
        elif (path / "model.safetensors").exists():
            files = [path / "model.safetensors"]
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.files = files
        self._maps: dict[Path, torch.Tensor] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        for f in files:
            infos, meta = read_header(f)
            self.metadata.update(meta)
            for name, info in infos.items():
                if name in self.tensors:
                    raise ValueError(f"tensor {name} appears in both {self.tensors[name].file} and {f}")
                self.tensors[name] = info

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> list[str]:
        """Tensor names in file order (sequential reads)."""
        return sorted(self.tensors, key=lambda k: (str(self.tensors[k].file), self.tensors[k].start))

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        """Read one tensor (or its slice ``index`` along dim 0) into fresh memory (no mmap: RSS stays bounded),
        delivered on ``self.device``."""
        info = self.tensors[name]
        start, shape = info.start, info.shape
        if index is not None:
            per = info.nbytes // shape[0]
            start, shape = start + index * per, shape[1:]
        nbytes = math.prod(shape) * torch.empty(0, dtype=info.dtype).element_size()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with open(info.file, "rb") as f:
            f.seek(start)
            got = f.readinto(memoryview(buf.numpy()))
        if got != nbytes:
            raise ValueError(f"{info.file}: tensor {name}: short read ({got} of {nbytes} bytes; truncated file?)")
        t = buf.view(info.dtype).reshape(shape)
        return t if self.device.type == "cpu" else t.to(self.device)

    def mmap(self, name: str) -> torch.Tensor:
        """A zero-copy, read-only-by-convention view of a tensor through a private memory map of its file."""
        info = self.tensors[name]
        whole = self._maps.get(info.file)
        if whole is None:
            whole = torch.from_file(str(info.file), shared=False, size=info.file.stat().st_size, dtype=torch.uint8)
            self._maps[info.file] = whole
        t = whole[info.start:info.end]
        try:
            return t.view(info.dtype).reshape(info.shape)
        except RuntimeError:  # misaligned offset for the dtype: copy this one
            return t.clone().view(info.dtype).reshape(info.shape)
