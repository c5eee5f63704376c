"""Native CPU matmul kernels vs the plain-torch reference (dequantize + F.linear)."""
import pytest
import torch

from moeq.config import BNB4, RTN, Int8
from moeq.kernels import cpu_ops, linear, reference


CONFIGS = [RTN(4, 128), RTN(4, 32), RTN(8, 64), RTN(4, 128, symmetric=False), RTN(8, -1, symmetric=False),
           BNB4("nf4", 64, True), BNB4("fp4", 128, False), BNB4("nf4", 32, True), Int8()]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_reference(cfg, rows, dtype):
    torch.manual_seed(rows)
    w = (torch.randn(96, 256) * 0.05).to(dtype)
    q = cfg.quantize(w)
    x = torch.randn(rows, 256, dtype=dtype)
    bias = torch.randn(96, dtype=dtype)
    kernel = {"rtn": cpu_ops.rtn_gemv, "bnb4": cpu_ops.bnb4_gemv, "int8": cpu_ops.int8_gemv}[q.format]
    y = kernel(q, x, bias)
    assert y is not None and y.dtype == dtype and y.shape == (rows, 96)
    ref = reference(q, x.float(), bias.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(y.float(), ref, atol=tol * ref.abs().max(), rtol=tol)


def test_dispatch_declines_big_batches_and_3d_inputs():
    q = RTN(4, 64).quantize(torch.randn(32, 128))
    assert cpu_ops.rtn_gemv(q, torch.randn(cpu_ops.MAX_ROWS + 1, 128), None) is None
    x = torch.randn(2, 5, 128)  # [batch, seq, K] -> 10 rows: the reference path
    assert torch.allclose(linear(q, x), reference(q, x), atol=1e-5)
    x = torch.randn(1, 2, 128)
    assert linear(q, x).shape == (1, 2, 32)
