"""bf12, the lossless 12-bit layout of kept bf16 heads (moeq.formats.bf12, native/csrc/bf12.c, moeq.nn.bf12): every
weight comes back bit for bit (zeros of both signs, subnormals, NaN, infinities, outliers, rows of one binade), the
native pack/unpack equal the plain-torch definition field by field, the gemv equals a float64 product within one
bf16 rounding, and a model's head in bf12 saves, reloads and generates as the bf16 head does."""
import pytest
import torch
from torch import nn

import moeq
from moeq import native
from moeq.formats import bf12
from moeq.nn.bf12 import Bf12Linear, to_linear

needs_lib = pytest.mark.skipif(native.lib() is None, reason="no native library")


def _bits(t):
    return t.view(torch.int16)


def _hostile(n=40, k=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    w[0, 5], w[0, 6] = 0.0, -0.0                      # signed zeros
    w[1, 7] = 1e-30                                   # far below its row's max: an exception
    w[2] = 0.0                                        # an all-zero row (base 0)
    w[3, 9], w[3, 10] = float("nan"), -float("nan")   # NaN keeps e = 127 in the window
    w[4, 3], w[4, 4] = float("inf"), -float("inf")
    w[5] = torch.randn(k, generator=g).bfloat16() * 1e-39  # subnormals only (base 0: stored as they are)
    w[6, 10] = 1e4                                    # one outlier: most of the row becomes exceptions
    w[7] = 1.0                                        # one binade
    w[8, ::2] = -w[8, ::2]
    w[9] = torch.randn(k, generator=g).bfloat16() * 1e-39
    w[9, 0] = 1.0                                     # subnormals under a normal max: exceptions
    return w


def test_positions_are_the_documented_byte_order():
    pos = bf12.positions()
    assert sorted(pos.tolist()) == list(range(128))
    for c in range(128):  # half, then per 128-bit lane: 8 columns of the first 32, then 8 of the last 32
        d = c % 64
        lane, hi8 = (d // 8, 0) if d < 32 else ((d - 32) // 8, 8)
        assert pos[c] == (c // 64) * 64 + lane * 16 + hi8 + d % 8


def test_reference_round_trip_is_exact_and_counts_exceptions():
    w = _hostile()
    p = bf12.pack_reference(w)
    assert p.lo.shape == w.shape and p.hi.shape == (w.shape[0], w.shape[1] // 2)
    assert torch.equal(_bits(bf12.unpack_reference(p)), _bits(w))
    counts = (p.xptr[1:] - p.xptr[:-1]).tolist()
    assert counts[2] == 0 and counts[5] == 0 and counts[7] == 0  # zeros, base-0 subnormals, one binade
    assert counts[1] >= 1 and counts[6] > 300 and counts[9] == int((w[9, 1:] != 0).sum()) > 300
    assert 1 in p.xcol[p.xptr[9]:p.xptr[10]].tolist() and 0 not in p.xcol[p.xptr[9]:p.xptr[10]].tolist()
    g = torch.randn(64, 1024, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert bf12.pack_reference(g).nbytes() < g.numel() * 2 * 0.76  # 12 bits + few exceptions + per-row metadata


@needs_lib
def test_native_pack_and_unpack_equal_the_reference():
    w = torch.cat([_hostile(), _hostile(seed=1)[:, :256].repeat(1, 3)[:, :384]])
    ref, got = bf12.pack_reference(w), bf12.pack(w)
    for name, a, b in zip(bf12.Bf12._fields, ref, got):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert torch.equal(_bits(bf12.unpack(got)), _bits(w))
    assert torch.equal(_bits(bf12.unpack(got, slice(3, 11))), _bits(w[3:11]))
    assert bf12.unpack(got, slice(5, 5)).shape == (0, w.shape[1])


def test_refuses_what_it_cannot_hold():
    with pytest.raises(moeq.MoeqError, match="multiple of 128"):
        bf12.pack(torch.zeros(4, 96, dtype=torch.bfloat16))
    with pytest.raises(moeq.MoeqError, match="bf16"):
        bf12.pack(torch.zeros(4, 128))


def _kernel(name):
    if name == "moeq_bf12_gemm_amx" and not native.amx_tiles():
        pytest.skip("the tile kernel needs AMX and Linux's permission for the tile data (this machine lacks one)")
    if name == "moeq_bf12_gemm_bf16" and not native.has_dpbf16():
        pytest.skip("the tile kernel's AVX512-BF16 form needs AVX512-BF16 (this machine lacks it)")
    if not native.has_simd():
        pytest.skip("the bf12 gemv needs AVX512-BF16 or AVX2")
    return getattr(native.lib(), name)


@pytest.mark.parametrize("kernel", ["moeq_bf12_gemv", "moeq_bf12_gemm_amx", "moeq_bf12_gemm_bf16", "moeq_bf12_matmul"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 12, 16])
def test_gemv_equals_the_float64_product(m, kernel):
    fn = _kernel(kernel)
    w = _hostile(n=300, k=512, seed=2)  # 300 rows: the tile kernel's last block of 32 is partial
    w[11, :256], w[11, 256:] = 0.0, 1e-6
    w[11, 17] = 50.0  # the row's sum carried by its exceptions: x is zero at the outlier's column, > 0 at theirs
    p = bf12.pack(w)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).bfloat16()
    x[:, 17] = 0
    x[:, 256:] = x[:, 256:].abs() + 0.1
    y = torch.empty(m, 300, dtype=torch.bfloat16)
    assert fn(p.describe(), x.data_ptr(), m, y.data_ptr()) == 1
    ref = x.double() @ w.double().T
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
    scale = x.double().abs() @ w.double().abs().T  # the summation error's scale, per output
    # + 1e-30: AVX512-BF16 dot products read subnormal weights (row 5, base 0) as zero, as the bf16 gemv does
    tol = 2 ** -8 * ref.abs() + 2 ** -12 * scale + 1e-30
    assert ((y.double() - ref).abs() <= tol)[fin].all()
    assert (ref[:, 11].abs() > 4 * tol[:, 11]).all()  # row 11 is all exceptions (and x 0 at its max): a kernel
    # dropping them would give 0 there
    assert fn(p.describe(), x.data_ptr(), 0, y.data_ptr()) == 0


@pytest.mark.parametrize("kernel", ["moeq_bf12_gemm_amx", "moeq_bf12_gemm_bf16"])
def test_tile_kernel_gives_each_row_the_same_bits_in_any_batch(kernel):
    fn = _kernel(kernel)
    w = (torch.randn(200, 256, generator=torch.Generator().manual_seed(3)) * 0.05).bfloat16()
    p = bf12.pack(w)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    y16 = torch.empty(16, 200, dtype=torch.bfloat16)
    assert fn(p.describe(), x.data_ptr(), 16, y16.data_ptr()) == 1
    for m in (1, 5):
        ym = torch.empty(m, 200, dtype=torch.bfloat16)
        assert fn(p.describe(), x.data_ptr(), m, ym.data_ptr()) == 1
        assert torch.equal(_bits(ym), _bits(y16[:m]))
    assert fn(p.describe(), x.data_ptr(), 17, y16.data_ptr()) == 0  # past 16 rows: declined, nothing written


@pytest.mark.skipif(not native.has_simd(), reason="the bf12 gemv needs AVX512-BF16 or AVX2")
def test_module_forward_state_dict_and_load():
    w = _hostile(n=70, k=256, seed=3)
    w = torch.where(torch.isfinite(w), w, 0.0).bfloat16()
    lin = nn.Linear(256, 70, bias=False).bfloat16().requires_grad_(False)
    lin.weight.copy_(w)
    mod = Bf12Linear.from_linear(lin)
    g = torch.Generator().manual_seed(4)
    for shape in [(1, 256), (2, 1, 256), (4, 256), (3, 5, 256)]:
        x = torch.randn(*shape, generator=g).bfloat16()
        got, ref = mod(x), lin(x)
        assert got.shape == ref.shape and got.dtype == torch.bfloat16
        assert ((got.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs() + 1e-3).all()
        if x.numel() // 256 > 4:  # many rows: F.linear on the unpacked weight, the same computation as the linear's
            assert torch.equal(got, ref)
    xf = torch.randn(2, 256, generator=g)
    torch.testing.assert_close(mod(xf), lin.float()(xf), rtol=1e-5, atol=1e-4)  # fp32: another summation order
    sd = mod.state_dict()
    assert list(sd) == ["weight"] and torch.equal(_bits(sd["weight"]), _bits(w))
    w2 = (torch.randn(70, 256, generator=g) * 3).bfloat16()
    mod.load_state_dict({"weight": w2})
    assert torch.equal(_bits(mod.unpack()), _bits(w2)) and torch.equal(_bits(to_linear(mod).weight), _bits(w2))
    with pytest.raises(RuntimeError, match="expected a bf16 tensor of shape"):
        mod.load_state_dict({"weight": torch.zeros(70, 128, dtype=torch.bfloat16)})
    with pytest.raises(RuntimeError, match="Missing key"):
        mod.load_state_dict({})
    assert torch.equal(_bits(mod.unpack()), _bits(w2))  # a refused load changed nothing


@pytest.mark.skipif(not native.has_simd(), reason="the bf12 head needs the native decode forwards")
def test_model_head_in_bf12_saves_reloads_and_generates(tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3_moe")
    m = moeq.load(src, quant="rtn-int4", progress=False)
    assert isinstance(m.lm_head, Bf12Linear)
    from safetensors.torch import load_file
    import glob
    raw = {}
    for f in glob.glob(str(src / "*.safetensors")):
        raw.update(load_file(f))
    assert torch.equal(_bits(m.state_dict()["lm_head.weight"]), _bits(raw["lm_head.weight"]))
    row = next(r for r in moeq.inspect(m)["modules"] if r["module"] == "lm_head.weight")
    assert row["format"] == "bfloat16" and row["bytes"] == raw["lm_head.weight"].numel() * 2
    assert row["detail"]["bytes_in_memory"] == m.lm_head.nbytes() < row["bytes"] * 0.8
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    fast = m.generate(ids, **kw)  # the native decode step reads the head in bf12
    m.lm_head = to_linear(m.lm_head)  # the plain bf16 head, through torch
    ref = m.generate(ids, **kw)
    assert torch.equal(fast.sequences, ref.sequences)
    for a, b in zip(fast.logits, ref.logits):
        assert ((a.float() - b.float()).abs() <= 2 ** -6 * b.float().abs() + 2e-2).all()
    m.lm_head = Bf12Linear.from_linear(m.lm_head)
    moeq.save(m, tmp_path / "out")
    again = moeq.load(tmp_path / "out", progress=False)
    assert isinstance(again.lm_head, Bf12Linear)
    assert torch.equal(_bits(again.lm_head.unpack()), _bits(raw["lm_head.weight"]))


@pytest.mark.skipif(not native.has_simd(), reason="the bf12 head needs the native decode forwards")
def test_tied_head_stays_a_linear(tiny_ckpt):
    m = moeq.load(tiny_ckpt("qwen3_moe", tie_word_embeddings=True), quant="rtn-int4", progress=False)
    assert type(m.lm_head) is nn.Linear and m.lm_head.weight is m.get_input_embeddings().weight


def test_outlier_weights_are_refused_before_their_exception_lists_exist():
    w = (torch.randn(64, 256, generator=torch.Generator().manual_seed(6)) * 1e-6).bfloat16()
    w[:, 0] = 1e4  # every row: one outlier, the rest ~2^33 below it -> all exceptions
    full = bf12.pack(w)
    assert int(full.xptr[-1]) == int((w[:, 1:] != 0).sum()) and full.nbytes() > w.numel() * 2 * 2
    assert torch.equal(_bits(bf12.unpack(full)), _bits(w))
    assert bf12.pack(w, max_bytes=int(0.8 * w.numel() * 2)) is None
    lin = nn.Linear(256, 64, bias=False).bfloat16().requires_grad_(False)
    lin.weight.copy_(w)
    assert Bf12Linear.from_linear(lin, max_fraction=0.8) is None


@pytest.mark.skipif(not native.has_simd(), reason="the bf12 head needs the native decode forwards")
def test_a_head_of_outliers_stays_bf16(tiny_ckpt):
    from moeq.nn import decode
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="rtn-int4", progress=False)
    head = to_linear(m.lm_head)
    head.weight.data.mul_(1e-6)[:, 0] = 1e4
    m.lm_head = head
    assert decode.try_head(m)  # the bf16 head's own native gemv instead
    assert m.lm_head is head and type(head) is nn.Linear and "forward" in head.__dict__
