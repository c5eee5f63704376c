"""Atomic checkpoint writing: everything goes to a temporary sibling directory, renamed into place at the end, so
a crash never leaves a half-written checkpoint at the destination."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

SHARD_BYTES = 4 * 1024**3
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
              "merges.txt", "generation_config.json", "chat_template.jinja")


def copy_side_files(source: str | os.PathLike | None, out: Path) -> None:
    """Tokenizer and generation files travel with the weights (never overwriting what ``out`` already has)."""
    if source is None:
        return
    for f in SIDE_FILES:
        if (Path(source) / f).exists() and not (out / f).exists():
            shutil.copy2(Path(source) / f, out / f)


def write_json(path: str | os.PathLike, obj) -> None:
    """Write JSON to a temporary sibling, then rename it into place: readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()


def unique_tensors(items):
    """``(name, tensor)`` pairs with tied tensors (same storage, offset and shape) kept once, first name wins."""
    seen: set[tuple] = set()
    for name, t in items:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        yield name, t


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, metadata: dict[str, str],
                 shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write ``(name, tensor)`` pairs as safetensors shards of at most ``shard_bytes`` (plus an index when there is
    more than one). Returns the file names."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors:
        nb = t.numel() * t.element_size()
        if size and size + nb > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()  # GPU models are written from host copies
        size += nb
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(_unshare(shard), str(out / fname), metadata=metadata)
        weight_map.update({k: fname for k in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return names


def _unshare(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: set[int] = set()
    out = {}
    for k, t in shard.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    return out
