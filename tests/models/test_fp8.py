"""FP8 block-scaled checkpoints (DeepSeek-V3 / Qwen3-*-FP8 layout, written by moeq.tiny.make_fp8_checkpoint after the
published layout): loaded bit for bit as transformers' own FP8 dequantization loads them, edge tiles exact against a
float64 reference, quantized in flight to any method exactly as the dequantized model would be, hostile scales
refused, and exported to GGUF in one command."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import moeq
from moeq.export import export
from moeq.cli import main
from moeq.nn import QuantExperts
from moeq.readers.fp8 import dequantize
from moeq.tiny import fp8_block_quantize, make_fp8_checkpoint


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    cache = {}

    def make(arch="qwen3_moe", block=(128, 128)):
        if (arch, block) not in cache:
            cache[(arch, block)] = make_fp8_checkpoint(arch, tmp_path_factory.mktemp(f"fp8-{arch}"), block=block)
        return cache[(arch, block)]

    return make


@pytest.mark.parametrize("arch,block", [("qwen3_moe", (128, 128)), ("mixtral", (128, 128)),
                                        ("deepseek_v3", (16, 128)), ("glm4_moe", (128, 128)),
                                        ("qwen3_next", (128, 128))])
def test_loads_as_transformers_dequantizes(fp8_ckpt, arch, block):
    """Where every weight is a whole number of tiles (DeepSeek's MLA kv_a_proj_with_mqa is kv_lora_rank + rope rows:
    144 here, so tiles of 16 rows); partial edge tiles are checked against float64 below, because transformers 5.24
    derives the tile from ``rows // scale_rows`` (72-row tiles for 144 rows in 2 scale rows), which is not DeepSeek's
    layout (``ceil(rows / 128)`` tiles of 128, the last one partial; DeepSeek-V3's own [576, 7168] kv_a_proj_with_mqa
    has 5 scale rows, which transformers refuses)."""
    path = fp8_ckpt(arch, block)
    assert "weight_scale_inv" in "".join(load_file(str(next(path.glob("*.safetensors")))))
    m = moeq.load(path, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()  # CPU: transformers dequantizes
    sd_m, sd_r = m.state_dict(), ref.state_dict()
    assert set(sd_r) <= set(sd_m)
    assert all(torch.equal(sd_r[k], sd_m[k]) for k in sd_r), [k for k in sd_r if not torch.equal(sd_r[k], sd_m[k])]
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        assert torch.equal(m(ids).logits, ref(ids).logits)


def test_transformers_quantizer_writes_the_same_codes():
    """The writer's block math equals transformers' own FP8 quantizer (Fp8Quantize) where tiles divide the weight."""
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)).bfloat16()
    hf = SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=(128, 128), scale_fmt=None))
    out = Fp8Quantize(hf)._quantize_one("x.weight", w)
    q, s = fp8_block_quantize(w, (128, 128))
    assert torch.equal(out["x.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out["x.weight_scale_inv"], s)


@pytest.mark.parametrize("shape,block", [((100, 200), (48, 80)), ((3, 70, 130), (32, 64)), ((64, 64), (128, 128))])
def test_edge_tiles_match_float64(shape, block):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=g) * 0.1
    q, s = fp8_block_quantize(w, block)
    got = dequantize(q, s, block, torch.bfloat16)
    ref = torch.empty(shape, dtype=torch.float64)
    n, k = shape[-2:]
    for i in range(0, n, block[0]):
        for j in range(0, k, block[1]):
            ref[..., i:i + block[0], j:j + block[1]] = (q[..., i:i + block[0], j:j + block[1]].double()
                                                        * s[..., i // block[0], j // block[1]].double()[..., None, None])
    assert torch.equal(got, ref.float().bfloat16())


@pytest.mark.parametrize("method", ["q4_0", "iq4nl-m", "nf4"])
def test_quantized_in_flight_equals_quantizing_the_dequantized_model(fp8_ckpt, method):
    path = fp8_ckpt("qwen3_moe", (48, 80))  # edge tiles on every weight
    m = moeq.load(path, method, progress=False)
    ref = moeq.quantize_(moeq.load(path, progress=False), method)
    sd_m, sd_r = m.state_dict(), ref.state_dict()
    assert set(sd_m) == set(sd_r) and all(torch.equal(sd_m[k], sd_r[k]) for k in sd_m)
    assert isinstance(m.model.layers[0].mlp.experts, QuantExperts)


@pytest.mark.parametrize("arch,block", [("qwen3_moe", (128, 128)), ("qwen3_moe", (48, 80)),
                                        ("deepseek_v3", (128, 128)), ("mixtral", (128, 128))])
def test_fp8_method_keeps_the_checkpoint_bytes(fp8_ckpt, arch, block, tmp_path):
    """``--method fp8``: every 2-D FP8 weight kept as its codes and scales (nothing rounded; tiles straddling the
    gate/up seam or DeepSeek's partial edge tiles included), logits as close to the dequantized model's as fp32
    products over bf16 ones allow, saved and reloaded bit for bit."""
    from moeq.api import packed_weights
    from moeq.formats import Fp8Weight
    path = fp8_ckpt(arch, block)
    m = moeq.load(path, "fp8", progress=False)
    sd = {}
    for f in path.glob("*.safetensors"):
        sd.update(load_file(str(f)))
    packed = packed_weights(m)
    assert packed and all(isinstance(w, Fp8Weight) for w in packed.values())
    checked = 0
    for key, t in sd.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        w = packed.get(key) or packed.get(key.removesuffix(".weight"))
        if w is not None:  # a linear kept as stored
            assert torch.equal(w.qdata, t.view(torch.uint8)) and torch.equal(
                w.dequantize(torch.float32), dequantize(t, sd[key + "_scale_inv"], block, torch.float32))
            checked += 1
    assert checked >= 4
    name, experts = next((n, e) for n, e in m.named_modules() if isinstance(e, QuantExperts))
    assert isinstance(experts.w13, Fp8Weight)
    layer = name.split(".layers.")[1].split(".")[0]
    key = next(k for k in sd if f"layers.{layer}." in k and ".experts.1." in k and k.endswith(("gate_proj.weight",
                                                                                              "w1.weight")))
    gate = sd[key]
    want = dequantize(gate, sd[key + "_scale_inv"], block, torch.float32)
    assert torch.equal(experts.w13[1].row_slice(0, gate.shape[0]).dequantize(torch.float32), want)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 8, 9]])
    ref = moeq.load(path, progress=False)
    with torch.no_grad():
        a, b = m(ids).logits.float(), ref(ids).logits.float()
    kl = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert kl.max() < 1e-3, kl.max()
    moeq.save(m, tmp_path / "s")
    back = moeq.load(tmp_path / "s", progress=False)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, m(ids).logits)


def test_fp8_method_from_the_cli_and_for_bf16_sources(fp8_ckpt, tmp_path, capsys):
    path = fp8_ckpt("qwen3_moe", (128, 128))
    assert main(["quantize", str(path), str(tmp_path / "q"), "--method", "fp8"]) == 0
    assert main(["inspect", str(tmp_path / "q"), "--json"]) == 0
    assert "fp8" in capsys.readouterr().out
    bf16 = moeq.tiny.make_checkpoint("qwen3_moe", tmp_path / "bf16")
    m = moeq.load(bf16, "fp8", progress=False)
    w = m.model.layers[0].self_attn.q_proj.qweight
    src = load_file(str(next(bf16.glob("*.safetensors"))))["model.layers.0.self_attn.q_proj.weight"]
    codes, s = fp8_block_quantize(src, (128, 128))
    assert torch.equal(w.qdata, codes.view(torch.uint8)) and torch.equal(w.scale, s)


def test_partial_edge_tiles_follow_deepseek_layout(fp8_ckpt):
    path = fp8_ckpt("deepseek_v3", (128, 128))  # kv_a_proj_with_mqa: 144 rows = one full and one partial tile
    sd = load_file(str(next(path.glob("*.safetensors"))))
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    q, s = sd[key], sd[key + "_scale_inv"]
    assert q.shape == (144, 128) and s.shape == (2, 1)
    want = torch.cat([q[:128].double() * s[0, 0].double(), q[128:].double() * s[1, 0].double()]).float().bfloat16()
    assert torch.equal(moeq.load(path, progress=False).state_dict()[key], want)


def test_per_tensor_scale_and_fp16(fp8_ckpt, tmp_path):
    path = make_fp8_checkpoint("qwen3_moe", tmp_path / "pt", block=None)
    m = moeq.load(path, dtype=torch.float16, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).eval()
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in ref.state_dict().items())


def _copy(path, tmp_path):
    import shutil

    out = tmp_path / "c"
    shutil.copytree(path, out)
    return out


@pytest.mark.parametrize("case,words", [
    ("nan scale", "scales must be finite"), ("negative scale", "scales must be finite"),
    ("huge scale", "overflows"), ("scale shape", "expected"), ("missing scale", "is missing"),
    ("orphan scale", "scales without an FP8 weight"), ("nan code", "NaN codes"), ("block size", "weight_block_size"),
    ("e5m2", "E5M2")])
def test_hostile_fp8_is_refused(fp8_ckpt, tmp_path, case, words):
    out = _copy(fp8_ckpt("qwen3_moe"), tmp_path)
    f = next(out.glob("*.safetensors"))
    sd = load_file(str(f))
    skey = next(k for k in sd if k.endswith("q_proj.weight_scale_inv"))
    wkey = skey[: -len("_scale_inv")]
    if case == "nan scale":
        sd[skey].view(-1)[0] = float("nan")
    elif case == "negative scale":
        sd[skey].view(-1)[0] = -1.0
    elif case == "huge scale":
        sd[skey].view(-1)[0] = 1e37
    elif case == "scale shape":
        sd[skey] = torch.ones(3, 3)
    elif case == "missing scale":
        del sd[skey]
    elif case == "orphan scale":
        sd["model.layers.0.self_attn.nothing.weight_scale_inv"] = torch.ones(1, 1)
    elif case == "nan code":
        sd[wkey].view(torch.uint8).view(-1)[5] = 0x7F
    elif case == "e5m2":
        sd[wkey] = sd[wkey].float().to(torch.float8_e5m2)
    if case == "block size":
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"]["weight_block_size"] = [0, 128]
        (out / "config.json").write_text(json.dumps(cfg))
    else:
        save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(moeq.MoeqError, match=words):
        moeq.load(out, progress=False)


def test_fp8_to_gguf_in_one_command(fp8_ckpt, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["export", str(fp8_ckpt("mixtral")), str(out), "--format", "gguf", "--method", "q4_0",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert out.exists() and summary["streamed"] and summary["checked_by_gguf_py"] > 0  # layer by layer, decoded back
    g = moeq.load(out, progress=False)
    ref = moeq.load(fp8_ckpt("mixtral"), "q4_0", progress=False)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(g(ids).logits.argmax(-1), ref(ids).logits.argmax(-1))


def test_fp8_kept_exports_to_gguf_only_with_requantize(fp8_ckpt, tmp_path, capsys):
    """GGUF has no e4m3 type: a model holding fp8 weights is refused (naming --requantize), then written as Q8_0
    (streamed), its logits within rounding of the fp8 model's; the loaded model's export is judged by what gguf-py's
    decoding of the file computes against it."""
    src = fp8_ckpt("mixtral")
    out = tmp_path / "m.gguf"
    assert main(["export", str(src), str(out), "--format", "gguf", "--method", "fp8"]) == 2
    assert "--requantize" in capsys.readouterr().err and not out.exists()
    assert main(["export", str(src), str(out), "--format", "gguf", "--method", "fp8", "--requantize",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["streamed"] and any("Q8_0" in r for r in summary["requantized"])
    fp8 = moeq.load(src, "fp8", progress=False)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        ref, got = fp8(ids).logits.float().log_softmax(-1), moeq.load(out, progress=False)(ids).logits.float()
    assert 0 < torch.nn.functional.kl_div(got.log_softmax(-1), ref, log_target=True, reduction="batchmean") < 1e-3
    whole = export(fp8, tmp_path / "w.gguf", "gguf", source=src, requantize=True)
    assert whole["kl_vs_moeq"] is not None and whole["kl_vs_moeq"] < 1e-3


def test_inspect_names_the_source(fp8_ckpt, capsys):
    assert main(["inspect", str(fp8_ckpt("qwen3_moe")), "--json"]) == 0
    src = json.loads(capsys.readouterr().out)["source"]
    assert src["reader"] == "fp8" and src["weight_block_size"] == [128, 128] and src["fp8_weights"] > 0
    assert "dequantized" in src["without_method"] and "re-quantized" in src["with_method"]
    assert main(["inspect", str(fp8_ckpt("qwen3_moe"))]) == 0
    out = capsys.readouterr().out
    assert "source: fp8" in out and "M = fp8: 2-D FP8 weights kept as stored" in out


def test_fused_expert_stacks(tmp_path):
    """transformers 5's own fused layout in FP8 (``experts.gate_up_proj`` + ``gate_up_proj_scale_inv`` [E, tiles,
    tiles], the names its FP8 quantizer gives): each expert's slice dequantized with its own scale tiles."""
    path = make_fp8_checkpoint("qwen3_moe", tmp_path / "f", block=(48, 80), fused_layout=True)
    sd = load_file(str(path / "model.safetensors"))
    m = moeq.load(path, progress=False)
    for i in range(2):
        for param in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{param}"
            q, s = sd[key], sd[key + "_scale_inv"]
            assert s.shape[0] == q.shape[0] == 4
            want = torch.stack([dequantize(q[e], s[e], (48, 80), torch.bfloat16) for e in range(4)])
            assert torch.equal(getattr(m.model.layers[i].mlp.experts, param).data, want)
    q4 = moeq.load(path, "q4_0", progress=False)
    assert isinstance(q4.model.layers[0].mlp.experts, QuantExperts)


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((100, 200), (48, 80)), ((3, 70, 130), (32, 64))])
def test_native_dequantizer_equals_torch_over_every_code(shape, block):
    """moeq_fp8_dequant against the plain-torch reference: every finite e4m3 code, edge tiles, stacked experts, each
    output dtype; NaN codes refused by both paths."""
    from moeq import native
    from moeq.readers.fp8 import dequantize_reference

    if native.lib() is None:
        pytest.skip("no native library: the reference path is the one that runs")
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 127) != 127]  # 0x7F / 0xFF are e4m3fn's NaNs
    q = codes[torch.randint(0, len(codes), shape, generator=g)].view(torch.float8_e4m3fn)
    n, k = shape[-2:]
    s = torch.rand(*shape[:-2], -(-n // block[0]), -(-k // block[1]), generator=g) * 1e-3 + 1e-5
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        got = dequantize(q, s, block, dtype)
        assert got.dtype == dtype and torch.equal(got, dequantize_reference(q, s, block, dtype))
    bad = q.clone()
    bad.view(torch.uint8).view(-1)[-1] = 0xFF
    with pytest.raises(moeq.MoeqError, match="NaN codes"):
        dequantize(bad, s, block, torch.bfloat16, "w")
