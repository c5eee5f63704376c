"""Reading llama.cpp's blocks: the native one-pass unpack equals the torch path and gguf-py's own decoding."""
import gguf
import numpy as np
import pytest
import torch

from moeq import native
from moeq.errors import MoeqError
from moeq.formats.fp8 import Fp8Weight
from moeq.readers import gguf as reader

# (gguf type, bits, grid): the types moeq reads as its own packed weights
TYPES = [("Q4_0", 4, "signed"), ("Q8_0", 8, "signed"), ("IQ4_NL", 4, "iq4nl"), ("MXFP4", 4, "mxfp4"),
         ("Q5_0", 5, "signed")]


def _blocks(qtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random block bytes of ``qtype`` with finite scales (fp16 in [-2, 2] or an E8M0 exponent near 127)."""
    g = np.random.default_rng(seed)
    block, per = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rows = int(np.prod(shape[:-1]))
    b = g.integers(0, 256, size=(rows, shape[-1] // block, per), dtype=np.uint8)
    if qtype == "MXFP4":
        b[..., 0] = g.integers(110, 140, size=b.shape[:-1])
    else:
        b[..., :2] = g.uniform(-2, 2, size=b.shape[:-1]).astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(*shape[:-1], -1)


@pytest.mark.skipif(native.lib() is None, reason="no C compiler: the native library is not built")
@pytest.mark.parametrize("qtype,bits,grid", TYPES)
def test_native_unpack_equals_torch_and_gguf_py(qtype, bits, grid, monkeypatch):
    shape = (3, 32, 96)
    data = _blocks(qtype, shape, seed=bits)
    w = reader._rtn_from_blocks(data, bits, shape, "t", grid)
    with monkeypatch.context() as m:
        m.setattr(native, "lib", lambda: None)
        ref = reader._rtn_from_blocks(data, bits, shape, "t", grid)
    assert torch.equal(w.qdata, ref.qdata) and torch.equal(w.scale, ref.scale) and w.scale.dtype == ref.scale.dtype
    want = gguf.quants.dequantize(data.reshape(-1, data.shape[-1]), gguf.GGMLQuantizationType[qtype])
    got = w.dequantize(torch.float32).reshape(want.shape).numpy()
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_native_unpack_reads_strided_input_through_the_copy():
    """A non-contiguous block array (a view) takes the copying path: same weight."""
    shape = (2, 32, 64)
    data = _blocks("Q4_0", (2, 32, 128), seed=1)
    view = data[..., : data.shape[-1] // 2]
    assert not view.flags.c_contiguous
    w = reader._rtn_from_blocks(view, 4, shape, "t")
    ref = reader._rtn_from_blocks(np.ascontiguousarray(view), 4, shape, "t")
    assert torch.equal(w.qdata, ref.qdata) and torch.equal(w.scale, ref.scale)


def test_concat_rows_joins_stacks_and_refuses_tiled_scales():
    a = reader._rtn_from_blocks(_blocks("Q4_0", (2, 16, 64), 2), 4, (2, 16, 64), "a")
    b = reader._rtn_from_blocks(_blocks("Q4_0", (2, 32, 64), 3), 4, (2, 32, 64), "b")
    j = type(a).concat_rows([a, b])
    assert j.shape == (2, 48, 64)
    full = j.dequantize(torch.float32)
    assert torch.equal(full[:, :16], a.dequantize(torch.float32)) and torch.equal(full[:, 16:],
                                                                                  b.dequantize(torch.float32))
    f = Fp8Weight(qdata=torch.zeros(2, 256, 128, dtype=torch.uint8), scale=torch.ones(2, 2, 1), shape=(2, 256, 128))
    with pytest.raises(MoeqError, match="one row of each tensor per weight row"):
        Fp8Weight.concat_rows([f, f])
