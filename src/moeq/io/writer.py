"""Atomic checkpoint writing: everything goes to a temporary sibling directory, renamed into place at the end, so
a crash never leaves a half-written checkpoint at the destination."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from moeq.errors import MoeqError

log = logging.getLogger(__name__)

SHARD_BYTES = 4 * 1024**3
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
              "merges.txt", "generation_config.json", "chat_template.jinja")


def model_sources(model, source=None) -> tuple:
    """Where a model was read from (never to be replaced by writing it): ``source`` and the path transformers'
    config records."""
    return (source, getattr(getattr(model, "config", None), "_name_or_path", None) or None)


def copy_side_files(source: str | os.PathLike | None, out: Path) -> None:
    """Tokenizer and generation files travel with the weights (never overwriting what ``out`` already has)."""
    if source is None:
        return
    for f in SIDE_FILES:
        if (Path(source) / f).exists() and not (out / f).exists():
            shutil.copy2(Path(source) / f, out / f)


def umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike, obj) -> None:
    """Write JSON to a temporary sibling, then rename it into place: readers never see a half-written file. The
    file gets the umask's normal mode (as ``open`` would give), not ``mkstemp``'s 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


MARKER = ".moeq-output.json"  # written last into every output directory: what moeq wrote there
# Every name moeq writes into an output directory (checkpoints, exports): a marker listing anything else is not
# moeq's, and --overwrite refuses it
_OUTPUT_NAMES = {"config.json", "model.safetensors", "model.safetensors.index.json", "model.gguf", *SIDE_FILES}
_LEGACY_NAMES = {"config.json", "model.safetensors", "model.safetensors.index.json", *SIDE_FILES}
_LEGACY_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _ours_by_name(name: str) -> bool:
    return name in _OUTPUT_NAMES or bool(_LEGACY_SHARD.fullmatch(name))


def _plain_file(p: Path) -> bool:
    return not p.is_symlink() and p.is_file()


def _is_legacy_output(out: Path) -> bool:
    try:
        qc = json.loads((out / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == "moeq" and all(
        (p.name in _LEGACY_NAMES or _LEGACY_SHARD.fullmatch(p.name)) and p.is_file() and not p.is_symlink()
        for p in out.iterdir())


def _written_by_moeq(out: Path) -> str | None:
    """None when ``out`` holds only what a previous moeq output wrote there, else why it does not."""
    try:
        listed = json.loads((out / MARKER).read_text())["files"]
        listed = set(listed) if isinstance(listed, list) else None
    except (OSError, ValueError, KeyError, TypeError):
        listed = None
    if listed is None:
        return None if _is_legacy_output(out) else "it is not a moeq output (no readable " + MARKER + ")"
    if not all(isinstance(n, str) and _ours_by_name(n) for n in listed):
        odd = sorted(str(n) for n in listed if not (isinstance(n, str) and _ours_by_name(n)))
        return f"its {MARKER} lists names moeq never writes: {odd[:5]}"
    if not _plain_file(out / MARKER):
        return f"its {MARKER} is not a plain file"
    foreign = sorted(p.name for p in out.iterdir() if p.name != MARKER and (
        p.name not in listed or not _ours_by_name(p.name) or not _plain_file(p)))
    return f"it holds entries moeq did not write there (folders, links or other files): {foreign[:5]}" if foreign \
        else None


def _remove_output(folder: Path, also: str | None = None) -> None:
    """Delete a previous moeq output moved aside: only the plain files moeq writes, then the folder if it is empty;
    never recursive, so anything that appeared there since it was checked stays (with a warning)."""
    for p in folder.iterdir():
        if _plain_file(p) and (p.name in (MARKER, also) or _ours_by_name(p.name) or p.name.startswith(
                f".{MARKER}.tmp-")):
            with contextlib.suppress(OSError):
                p.unlink()
    try:
        folder.rmdir()
    except OSError:
        log.warning("kept %s: it holds entries moeq did not write", folder)


def check_target(out: Path, overwrite: bool, sources=()) -> None:
    """Refuse (raising :class:`MoeqError`, touching nothing) to write ``out`` where replacing it could lose data: it
    exists without ``overwrite``; it is a link, a file, ``.``, the home or root folder or a mount point; it is or
    contains a source of the model being written; or it holds anything a previous moeq output did not write."""
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise MoeqError(f"{out} exists; pass overwrite=True (--overwrite) to replace a previous moeq output there")
    if out.is_symlink():
        raise MoeqError(f"{out} is a symbolic link; moeq replaces only directories it wrote: give another path")
    if not out.is_dir():
        raise MoeqError(f"{out} is a file, not a moeq output directory; moeq will not replace it")
    real = out.resolve()
    for special in (Path.cwd(), Path.home(), Path("/")):
        if real == special.resolve():
            raise MoeqError(f"{out} is the current, home or root folder; moeq will not replace it")
    if os.path.ismount(real):
        raise MoeqError(f"{out} is a mount point; moeq will not replace it")
    for src in sources:
        if src is None:
            continue
        s = Path(src).resolve()
        if s == real or real in s.parents:
            raise MoeqError(f"{out} is or contains the source {src}; moeq will not replace it")
    why = _written_by_moeq(out)
    if why is not None:
        raise MoeqError(f"{out}: --overwrite replaces only a previous moeq output, and {why}; remove it yourself "
                        "or choose another path")


def _clean_stale(parent: Path, name: str) -> None:
    """Remove temporary/old siblings that an earlier, killed moeq run on this host left for ``name``."""
    pat = re.compile(rf"\.{re.escape(name)}\.(tmp|old)-{re.escape(socket.gethostname())}-(\d+)-[0-9a-f]+")
    for p in parent.iterdir():
        m = pat.fullmatch(p.name)
        if not m or p.is_symlink() or not p.is_dir() or _alive(int(m[2])):
            continue
        log.info("removing %s, left by a killed moeq run", p)
        _remove_output(p, also=name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False, sources=()) -> Iterator[Path]:
    """Write an output directory atomically: everything goes into a temporary sibling, which replaces ``out`` only
    when complete (a failure removes it and leaves ``out`` as it was). ``overwrite`` replaces only a previous moeq
    output (see :func:`check_target`; ``sources``: what the written model was read from, never replaced). Folders
    and files get the umask's normal modes."""
    out = Path(out)
    check_target(out, overwrite, sources)
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(parent, out.name)
    tag = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp = parent / f".{out.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        mode = 0o666 & ~umask()
        for p in tmp.rglob("*"):  # some writers (safetensors) create 0600 files: serve them as open() would
            if p.is_file() and not p.is_symlink():
                p.chmod(mode)
        names = sorted(p.name for p in tmp.iterdir())
        write_json(tmp / MARKER, {"producer": "moeq", "files": names})
        old = None
        if out.exists() or out.is_symlink():
            check_target(out, overwrite, sources)  # again: it may have changed while we wrote
            old = parent / f".{out.name}.old-{tag}"
            os.replace(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:
            if old is not None:  # put the previous output back
                os.replace(old, out)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        _remove_output(old)


@contextlib.contextmanager
def atomic_file(out: str | os.PathLike, overwrite: bool = False, sources=(), ours=None) -> Iterator[Path]:
    """Write one output file atomically: yields a temporary path beside it, renamed over ``out`` when complete.
    ``overwrite`` replaces only a file ``ours(path)`` recognises as moeq's own output (never a link, a folder or
    somebody else's file)."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise MoeqError(f"{out} exists; pass --overwrite to replace a previous moeq output there")
        if out.is_symlink() or not out.is_file():
            raise MoeqError(f"{out} is a link or not a file; moeq replaces only files it wrote: give another path")
        if ours is None or not ours(out):
            raise MoeqError(f"{out}: --overwrite replaces only a file moeq wrote, and this one is not; remove it "
                            "yourself or choose another path")
        for src in sources:
            if src is not None and Path(src).resolve() == out.resolve():
                raise MoeqError(f"{out} is the source of the model; moeq will not replace it")
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(parent, out.name)
    tmp = parent / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp / out.name
        (tmp / out.name).chmod(0o666 & ~umask())
        os.replace(tmp / out.name, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
        try:
            save_file(_unshare(shard), str(out / fname), metadata=metadata)
        except SafetensorError as e:  # e.g. "No space left on device": neither an OSError nor a MoeqError
            raise MoeqError(f"writing {out / fname} failed: {e}") from None
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
