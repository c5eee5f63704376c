"""Editing checkpoints the way a damaged download or a hostile file would be: raw safetensors headers and bytes,
tensors, config.json and the quant_state JSON inside bnb checkpoints."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ST = "model.safetensors"


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".moeq-output.json"))
    return dst


def read_raw(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path: Path, header, data: bytes, header_bytes: bytes | None = None) -> None:
    hb = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def tensors(d: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(d / ST), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def save_tensors(d: Path, sd: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / ST), metadata={"format": "pt"})


def edit_tensors(d: Path, fn) -> None:
    sd = tensors(d)
    out = fn(sd)
    save_tensors(d, out if isinstance(out, dict) else sd)


def edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    out = fn(cfg)
    (d / "config.json").write_text(json.dumps(out if isinstance(out, (dict, list)) else cfg))


def modules(cfg: dict) -> dict:
    return cfg["quantization_config"]["modules"]


def quant_state(sd: dict, key: str) -> tuple[str, dict]:
    """The quant_state tensor name and its JSON for a bnb 4-bit weight ``key``."""
    qk = next(k for k in sd if k.startswith(key + ".quant_state."))
    return qk, json.loads(bytes(sd[qk].tolist()).decode())


def set_quant_state(sd: dict, qk: str, qs: dict) -> None:
    sd[qk] = torch.tensor(list(json.dumps(qs).encode()), dtype=torch.uint8)
