"""llama.cpp's IQ2_S blocks as a moeq format: 2.5625 bits/weight, each 8 weights one point of a 1024-entry lattice
codebook (ggml's ``iq2s_grid``) with free signs, as ggml's ``block_iq2_s`` stores them byte for byte (GGUF export and
import are lossless; a llama.cpp IQ2_S tensor loads into it without decoding).

``blocks`` uint8 ``[..., N, K/256 * 82]``, per 256 weights of a row: ``d`` fp16 (2 bytes), ``qs`` 32 bytes (the low 8
bits of each group's grid index), ``signs`` 32 bytes (bit i of byte g: weight i of group g is negative), ``qh`` 8
bytes (the high 2 bits of the indices, four groups per byte), ``scales`` 8 bytes (a 4-bit scale per 16 weights, two
per byte, low nibble first). Weight ``8g + i`` of a block is
``d * (0.5 + scale[g // 2]) * 0.25 * GRID[index[g]][i] * (-1 if sign bit else 1)``, ``GRID`` values 8, 25 and 43.
K must be a multiple of 256.

``quantize`` is moeq's own search (``moeq_iq2s_quantize``), not llama.cpp's: every group's grid point is the exact
importance-weighted least-squares choice among all 1024 for each candidate sub-block scale (llama.cpp rounds each
weight to a level and searches the rounded point's lattice neighbours), and after the super-block scale is rounded to
fp16 and each sub-block scale to its 4-bit code, the points are chosen again for the scales actually stored (llama.cpp
keeps the points chosen for the unrounded scales), with the super-block scale refit by least squares.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

import torch

from moeq.errors import MoeqError
from moeq.formats.base import (
    PackedWeight, bad_stats, check_finite, check_float, check_result, expect_tensor, tensor_field,
)

QK = 256  # weights per block (ggml's QK_K)
BLOCK_BYTES = 82  # ggml's sizeof(block_iq2_s)
WEIGHTINGS = ("x2", "mse")  # llama.cpp's per-weight importance (x^2 on top) / the column importance alone
LEVELS = (8, 25, 43)
# ggml's iq2s_grid: 1024 points of 8 weights, each weight one of LEVELS stored as 2 bits (little-endian, four per byte)
_GRID_HEX = (
    "00000200050008000a0011001400160019002000220025002800410044004600490050005200550058006100640066006900800082008500"
    "880091009400a000a500aa000101040106010901100112011501180121012401400142014501480151015401560159016001650168018101"
    "8401900192019501a101a40100020202050208021102140220022a02410244024602490250025502800285028a029402a202010404040604"
    "09041004120415041804210424042604290440044204450448044a0451045404560459046004620465048104840486048904900495049804"
    "a104a40400050205050508050a05110514051605190520052505280541054405460549055005520555055805610564058005820585058805"
    "91059405a0050106040606060906100615064006450648065106540660068106840690060008020805080808110814081608190820082508"
    "2a084108440846084908500852085508580861086408800885089408aa080109040910091209150918092109400945094809510954096009"
    "81099009000a110a140a220a280a2a0a500a990a011004100610091010101210151018102110241026104010421045104810511054105610"
    "59106010621065106810811084108610901095109810a110a41000110211051108110a111111141116111911201122112511281141114411"
    "4611491150115211551158116111641180118211851188119111941101120412091210121512211224124012451251125412811284129012"
    "001402140514081411141414161419142014251428144114441446144914501452145514581461146414801482148514881491149414a014"
    "0115041506150915101512151515181521152415401542154515481551155415601581158415901500160516081611161416201641164416"
    "50168016aa160118041806180918101815181818211840184218451848185118541860188118841800190219051908191119141920194119"
    "441950196919a219041a101a401a561a00200220052008201120142016201920202025202a2041204420502052205520642080208a209420"
    "aa2001210421102112211521212140214221452151215421602181218421902100220a22222228222a224422502288228a22a82201240424"
    "0624092410241524182421242424402442244524482451245424602481248424902400250525082511251425202541254425502566258025"
    "0126042610264026592600280528112814284128442850288a28aa2801290429102995290a2a222a642a882a8a2a01400440064009401040"
    "1240154018401a4021402440264040404240454048404a40514054405640594060406240654081408440904095409840a140a44000410241"
    "0541084111411441164119412041224125414141444146414941504152415541584161416441804182418541884191419441a04101420442"
    "104212421542184224424042454248425142544260428142844200440244054408440a441144144416441944204422442544284441444444"
    "46444944504452445544584461446444804482448544884491449444a0440145044506450945104512451545184521452445404542454545"
    "48455145544560456a4581458445904500460246054608461146144620464146444650468046a54601480448094810481248154818482148"
    "2448404842484548484851485448604884489048004902490549084911491449204941494449504980499649014a044a104a404a00500250"
    "0550085011501450165019502050225025502850415044504650495050505250555058506150645080508250855088509150945001510451"
    "0651095110511251155118512151245140514251455148515151545160518151845190510052055208521152145220524152445250526952"
    "8052015404540654095410541254155418542154245440544254455448545154545460548154845490540055025505550855115514552055"
    "41554455505580550156045610562656405600580258055808581158145820584158445850585a5880580159045910594059005a195a855a"
    "a85a016004600660106012601560186021602460406045604860516054606060846090600061026105610861116114612061416144615061"
    "806199610462106240625662a162006405640864116414642064416444645064806401650465106540654a65686592650066946601680468"
    "10686568986800692a69426aa16a008002800580088011801480198020802580418044805080528055805880618080808580918094800181"
    "04810981108112811581188121812481408142814581488151815481818184819081a981008205820a821182148241824482508201840484"
    "0684098410841284158418842184408442844584488451845484608481848484908400850285058508851185148520854185448550858085"
    "8a85018604861086298640860088058811881488418844885088a2880189048940896589228a588a5a8a828aa28a01900490099010901290"
    "159018902490409042904590489051905490609081908490909000910591119114914191449150915a910192049210924092a69200940294"
    "059408941194149420944194449450948094969401950495109540959895a19500964696649601980498109826984098a998009949995299"
    "909a00a005a00aa014a022a02aa041a044a050a0a2a0aaa040a165a102a20aa222a228a22aa282a288a28aa2a8a201a404a410a440a489a4"
    "a4a400a519a551a60aa828a8a2a854a986a908aa0aaa20aa22aa28aa88aaaaaa"
)


def _grid() -> torch.Tensor:
    packed = torch.frombuffer(bytearray.fromhex("".join(_GRID_HEX)), dtype=torch.uint8).view(1024, 2)
    codes = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], -1).view(1024, 8)
    return torch.tensor(LEVELS, dtype=torch.uint8)[codes.long()].contiguous()


GRID = _grid()  # uint8 [1024, 8]: the values of each grid point


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[..., nb, 82]`` blocks as (d fp32 ``[..., nb]``, 4-bit scales ``[..., nb, 16]``, grid indices
    ``[..., nb, 32]`` int64, sign bits ``[..., nb, 32, 8]`` bool)."""
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    qs, signs, qh, sc = blocks[..., 2:34], blocks[..., 34:66], blocks[..., 66:74], blocks[..., 74:82]
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], -1).flatten(-2)
    index = qs.long() | (high.long() << 8)
    scales = torch.stack([sc & 15, sc >> 4], -1).flatten(-2)
    bits = torch.stack([(signs >> i) & 1 for i in range(8)], -1).bool()
    return d, scales, index, bits


def dequantize_reference(blocks: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Plain torch, as gguf-py's ``IQ2_S.dequantize_blocks`` computes it in fp32 (the kernels' ground truth)."""
    b = blocks.reshape(*shape[:-1], shape[-1] // QK, BLOCK_BYTES)
    d, scales, index, neg = unpack(b)
    db = d[..., None] * (0.5 + scales.float()) * 0.25  # [..., nb, 16]
    g = GRID.to(blocks.device)[index].float() * db.repeat_interleave(2, -1)[..., None]  # [..., nb, 32, 8]
    return torch.where(neg, -g, g).reshape(shape).to(dtype)


def dequantize_native(blocks: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor | None:
    from moeq import native  # noqa: PLC0415

    L = native.lib()
    if L is None or not native.usable(blocks):
        return None
    rows, k = math.prod(shape[:-1]), shape[-1]
    out = torch.empty(shape, dtype=dtype) if out is None else out
    native.fits((blocks, rows * (k // QK) * BLOCK_BYTES))
    native.fits_out(out, dtype, rows * k)
    L.moeq_iq2s_dequant(native.ptr(blocks), native.i64(rows), native.i64(k), native.ptr(GRID), native.ptr(out),
                        int(dtype == torch.bfloat16))
    return out


@dataclasses.dataclass(frozen=True, repr=False)
class Iq2sWeight(PackedWeight):
    blocks: torch.Tensor = tensor_field()  # uint8 [..., N, K/256 * 82]: ggml block_iq2_s
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.bfloat16
    format = "iq2s"
    bits: ClassVar[int] = 2  # what a requantizing exporter aims at

    def _problems(self) -> list[str]:
        if len(self.shape) < 2 or self.shape[-1] % QK:
            return [f"an iq2s weight is [..., N, K] with K a multiple of {QK}; shape {list(self.shape)}"]
        out = expect_tensor(self.blocks, "blocks", (*self.shape[:-1], self.shape[-1] // QK * BLOCK_BYTES),
                            (torch.uint8,))
        if out:
            return out
        d = self.blocks.reshape(-1, BLOCK_BYTES)[:, 0:2].contiguous().view(torch.float16)
        # the largest weight a block can decode to is d * 15.5 * 0.25 * 43
        return bad_stats(d, "d", torch.finfo(self.dtype).max / (15.5 * 0.25 * 43))

    def __getitem__(self, idx: int) -> Iq2sWeight:
        return dataclasses.replace(self, blocks=self.blocks[idx], shape=self.shape[1:])

    def _dequantize_native(self, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor | None:
        return dequantize_native(self.blocks, self.shape, dtype, out)

    def dequantize_reference(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_reference(self.blocks, self.shape, dtype or self.dtype)


def quantize(w: torch.Tensor, importance: torch.Tensor | None = None, weighting: Literal["x2", "mse"] = "x2",
             name: str | None = None) -> Iq2sWeight:
    """``[..., N, K]`` (K a multiple of 256) to IQ2_S blocks by moeq's search (module docstring). ``importance``:
    the mean square of each input column (``[K]``; :mod:`moeq.importance`), which weighs each weight's error —
    ``x2``: times ``sqrt(sigma^2 + w^2)`` as llama.cpp weighs its imatrix (``0.25 sigma^2 + w^2`` without one), ``mse``:
    alone. Needs the native library (a C compiler)."""
    from moeq import native  # noqa: PLC0415

    check_float(w, name)
    check_finite(w, name)
    where = name or "<unnamed>"
    if w.dim() < 2 or w.shape[-1] % QK:
        raise MoeqError(f"tensor {where}: iq2s needs [..., N, K] with K a multiple of {QK}, got {list(w.shape)}")
    if weighting not in WEIGHTINGS:
        raise MoeqError(f"unsupported iq2s weighting {weighting!r}; valid choices: {list(WEIGHTINGS)}")
    k = w.shape[-1]
    imp = None
    if importance is not None:
        imp = importance.detach().float().reshape(-1).contiguous()
        if imp.numel() != k or not torch.isfinite(imp).all() or bool((imp < 0).any()):
            raise MoeqError(f"tensor {where}: importance must be {k} finite non-negative values")
    L = native.lib()
    if L is None:
        raise MoeqError(f"tensor {where}: iq2s quantization needs moeq's native library (a C compiler)")
    x = w.detach().float().reshape(-1, k).contiguous()
    rows = x.shape[0]
    blocks = torch.empty(rows, k // QK * BLOCK_BYTES, dtype=torch.uint8)
    L.moeq_iq2s_quantize(native.ptr(x), native.i64(rows), native.i64(k), native.ptr(imp), int(weighting == "mse"),
                         native.ptr(GRID), native.ptr(blocks))
    q = Iq2sWeight(blocks=blocks.reshape(*w.shape[:-1], -1), shape=tuple(w.shape), dtype=w.dtype)
    return check_result(q, w, name)
