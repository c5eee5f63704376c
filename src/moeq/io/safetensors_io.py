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
from moeq.errors import CheckpointNotFound, MoeqError

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


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise MoeqError(f"duplicate key {k!r}")
        out[k] = v
    return out


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header as strictly as safetensors itself: a JSON object of
    ``{name: {dtype, shape, data_offsets}}`` plus optional string-to-string ``__metadata__``; non-negative integer
    shapes whose byte size matches the offsets; tensors that tile the data section exactly (no overlap, no gap, no
    trailing bytes). Every error names the file and tensor."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise MoeqError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise MoeqError(f"{path}: truncated or corrupt safetensors header (declares {n} header bytes, "
                            f"file has {size})")
        blob = f.read(n)
    try:
        header = json.loads(blob.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, MoeqError) as e:
        raise MoeqError(f"{path}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise MoeqError(f"{path}: safetensors header must be a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise MoeqError(f"{path}: __metadata__ must map strings to strings")
    base = 8 + n
    data_len = size - base
    out = {}
    for name, h in header.items():
        where = f"{path}: tensor {name}"
        if not isinstance(h, dict) or set(h) != {"dtype", "shape", "data_offsets"}:
            raise MoeqError(f"{where}: header entry must have exactly dtype, shape and data_offsets: {h!r}"[:400])
        dtype = _DTYPES.get(h["dtype"]) if isinstance(h["dtype"], str) else None
        if dtype is None:
            raise MoeqError(f"{where}: unsupported dtype {h['dtype']!r}; moeq reads {sorted(_DTYPES)}")
        shape, offs = h["shape"], h["data_offsets"]
        if not isinstance(shape, list) or any(type(x) is not int or x < 0 for x in shape):
            raise MoeqError(f"{where}: shape {shape!r} must be a list of non-negative integers")
        if not isinstance(offs, list) or len(offs) != 2 or any(type(x) is not int for x in offs) or not (
                0 <= offs[0] <= offs[1] <= data_len):
            raise MoeqError(f"{where}: data_offsets {offs!r} must be two integers 0 <= begin <= end <= {data_len} "
                            "(the data section's size; truncated file?)")
        a, b = offs
        if b - a != math.prod(shape) * torch.empty(0, dtype=dtype).element_size():
            raise MoeqError(f"{where}: data range {a}..{b} does not fit its shape {list(shape)} {h['dtype']}")
        out[name] = TensorInfo(path, name, dtype, tuple(shape), base + a, base + b)
    end = 0
    for info in sorted(out.values(), key=lambda i: (i.start, i.end)):
        if info.start - base != end:
            what = "overlaps the tensor before it" if info.start - base < end else "leaves a gap before it"
            raise MoeqError(f"{path}: tensor {info.name}: data range {info.start - base}..{info.end - base} {what} "
                            "(tensors must tile the data section)")
        end = info.end - base
    if end != data_len:
        raise MoeqError(f"{path}: {data_len - end} byte(s) after the last tensor's data (the header covers {end} of "
                        f"{data_len})")
    return out, meta


def _read_index(idx_path: Path) -> dict[str, str]:
    """A sharded checkpoint's ``weight_map``: tensor name -> shard file name in the same directory."""
    try:
        weight_map = json.loads(idx_path.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
        raise MoeqError(f"{idx_path}: unreadable index ({e!r})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise MoeqError(f"{idx_path}: weight_map must map tensor names to file names")
    bad = sorted({f for f in weight_map.values() if f in ("", ".", "..") or Path(f).name != f})
    if bad:
        raise MoeqError(f"{idx_path}: shard names must be plain file names in the checkpoint directory: {bad[:5]}")
    return weight_map


class Checkpoint:
    """A safetensors checkpoint directory (single file or sharded with ``model.safetensors.index.json``) or file."""

    def __init__(self, path: str | os.PathLike, device: torch.device | str = "cpu"):
        path = Path(path)
        if not path.exists():
            raise CheckpointNotFound(f"{path}: no such checkpoint")
        self.device = torch.device(device)  # where read() delivers tensors (a GPU: quantized there, in flight)
        self.dir = path if path.is_dir() else path.parent
        weight_map = None
        if path.is_file():
            files = [path]
        elif (path / "model.safetensors.index.json").exists():
            idx_path = path / "model.safetensors.index.json"
            weight_map = _read_index(idx_path)
            files = sorted({path / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise CheckpointNotFound(f"{idx_path}: shard(s) missing: {', '.join(missing)}")
        elif (path / "model.safetensors").exists():
            files = [path / "model.safetensors"]
        else:
            raise CheckpointNotFound(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.files = files
        self._maps: dict[Path, torch.Tensor] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        for f in files:
            infos, meta = read_header(f)
            self.metadata.update(meta)
            for name, info in infos.items():
                if name in self.tensors:
                    raise MoeqError(f"tensor {name} appears in both {self.tensors[name].file} and {f}")
                self.tensors[name] = info
        if weight_map is not None:
            wrong = [k for k, f in weight_map.items() if k not in self.tensors or self.tensors[k].file.name != f]
            extra = [k for k in self.tensors if k not in weight_map]
            if wrong or extra:
                raise MoeqError(f"{path / 'model.safetensors.index.json'}: the index disagrees with the shards: "
                                + "; ".join([f"not in the shard it names: {wrong[:5]}"] * bool(wrong)
                                            + [f"not listed: {extra[:5]}"] * bool(extra)))

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
            if not shape or not 0 <= index < shape[0]:
                raise MoeqError(f"{info.file}: tensor {name}: no slice {index} in shape {list(shape)}")
            per = info.nbytes // shape[0]
            start, shape = start + index * per, shape[1:]
        nbytes = math.prod(shape) * torch.empty(0, dtype=info.dtype).element_size()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with open(info.file, "rb") as f:
            f.seek(start)
            got = f.readinto(memoryview(buf.numpy()))
        if got != nbytes:
            raise MoeqError(f"{info.file}: tensor {name}: short read ({got} of {nbytes} bytes; truncated file?)")
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
