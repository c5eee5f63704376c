"""Hugging Face Hub ids (``mistralai/Mixtral-8x7B-v0.1``) resolved through the local Hub cache, offline: moeq never
downloads, but a model already fetched with ``hf download`` (or by transformers) is found by its id."""
from __future__ import annotations

import os
import re
from pathlib import Path

from moeq.errors import CheckpointNotFound

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def resolve(path: str | os.PathLike) -> Path:
    """``path`` itself when it exists; else, for something shaped like a Hub id, its snapshot in the local Hub cache;
    else a :class:`CheckpointNotFound` that says how to get it."""
    p = Path(path)
    if p.exists() or not _HUB_ID.match(str(path)):
        return p
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415
        from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: PLC0415
    except ImportError:
        raise CheckpointNotFound(f"{path}: no such folder (and huggingface_hub is not installed to look it up as a "
                                 "Hub id)") from None
    try:
        return Path(snapshot_download(str(path), local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError) as e:
        raise CheckpointNotFound(
            f"{path}: no such folder, and no snapshot of the Hub model {path!r} in the local Hugging Face cache "
            f"({type(e).__name__}). moeq does not download: run `hf download {path}` (or `huggingface-cli download "
            f"{path}`), then repeat this command") from None
