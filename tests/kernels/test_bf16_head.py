"""The native bf16 gemv behind kept heads and routers (``moeq_bf16_gemv``): within one bf16 rounding of a float64
product at every row count 1-16 (the one-row form up to 4 rows, pairs of weight rows past it), and batch-invariant —
a row's logits have the same bits whatever batch it is in, so batched greedy decoding equals decoding alone."""
import pytest
import torch

from moeq import native
from moeq.nn import decode

needs_lib = pytest.mark.skipif(native.lib() is None or not native.has_dpbf16(),
                               reason="no native library with AVX512-BF16 on this CPU")


def _case(n=1031, k=256, rows=16, seed=0):  # odd n: the pair loop's last row alone; n * k past the parallel threshold
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()


@needs_lib
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 16])
def test_bf16_gemv_within_one_rounding(rows):
    w, x = _case(rows=rows)
    y = decode.bf16_linear(x, w)
    assert y is not None and y.shape == (rows, w.shape[0])
    ref = x.double() @ w.double().t()
    tol = 2.0 ** -8 * ref.abs() + 1e-6 * ref.abs().amax()
    assert bool(((y.double() - ref).abs() <= tol).all())


@needs_lib
def test_bf16_gemv_is_batch_invariant():
    w, x = _case()
    alone = torch.cat([decode.bf16_linear(x[i:i + 1], w) for i in range(16)])
    for rows in (2, 4, 5, 7, 8, 12, 16):
        got = decode.bf16_linear(x[:rows], w)
        assert torch.equal(got.view(torch.int16), alone[:rows].view(torch.int16)), rows
