"""Hub ids resolve through the local Hugging Face cache (offline); a missing one says how to download it."""
import shutil

import huggingface_hub.constants as hf_constants
import pytest

import moeq
from moeq.cli import main
from moeq.io.hub import resolve


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_ckpt):
    cache = tmp_path / "hub"
    snap = cache / "models--tiny-org--tiny-moe" / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_ckpt("qwen3_moe"), snap)
    (cache / "models--tiny-org--tiny-moe" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-moe" / "refs" / "main").write_text(snap.name)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    return snap


def test_hub_id_from_local_cache(hub_cache, tmp_path, capsys):
    assert resolve("tiny-org/tiny-moe") == hub_cache
    m = moeq.load("tiny-org/tiny-moe", quant="rtn-int4", progress=False)
    assert m.config.model_type == "qwen3_moe"
    assert main(["quantize", "tiny-org/tiny-moe", str(tmp_path / "q")]) == 0
    assert (tmp_path / "q" / "tokenizer.json").exists()  # side files from the snapshot


def test_missing_hub_id_says_how_to_download(hub_cache, tmp_path, capsys):
    assert main(["quantize", "mistralai/Mixtral-8x7B-v0.1", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "hf download mistralai/Mixtral-8x7B-v0.1" in err and "local Hugging Face cache" in err
    assert resolve(tmp_path) == tmp_path  # an existing folder is itself
