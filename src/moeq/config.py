"""Typed quantization configs: one frozen dataclass per format, plus rules that map modules to formats.

Every config has ``version`` and a ``to_dict``/``from_dict`` round trip; that dict is what a saved checkpoint's
``quantization_config`` holds.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import logging
from typing import Any, ClassVar, Literal

import torch

from moeq.formats import PackedWeight, bnb4, fp8, int8, iq2s, rtn
from moeq.formats.grids import grid
from moeq.errors import MoeqError

log = logging.getLogger(__name__)
FORMAT_CONFIGS: dict[str, type[FormatConfig]] = {}


def register(cls):
    FORMAT_CONFIGS[cls.name] = cls
    return cls


CONFIG_VERSION = 1  # the newest config layout this moeq reads and writes


def _check_version(v: Any, what: str) -> None:
    if type(v) is not int or v < 1:
        raise MoeqError(f"{what}: version must be a positive integer, got {v!r}")
    if v > CONFIG_VERSION:
        raise MoeqError(f"{what}: config version {v} was written by a newer moeq (this one reads up to "
                        f"{CONFIG_VERSION}); upgrade moeq")


@dataclasses.dataclass(frozen=True)
class FormatConfig:
    name: ClassVar[str] = ""
    version: int = dataclasses.field(default=CONFIG_VERSION, kw_only=True)  # per instance: old configs stay old

    def quantize(self, w: torch.Tensor, name: str | None = None, slices: int | None = None,
                 importance: torch.Tensor | None = None) -> PackedWeight | None:
        """Quantize ``w`` (any leading dims); None means "keep in the compute dtype". ``importance``: the mean square
        of each input column (:mod:`moeq.importance`), used by formats whose quantizer searches (:meth:`uses_importance`)
        and ignored by the others."""
        raise NotImplementedError

    def uses_importance(self) -> bool:
        return False

    def needs_importance(self) -> bool:
        """Whether this format is unusable without column importance (:func:`moeq.load` then measures it)."""
        return False

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.name, "version": self.version, **dataclasses.asdict(self)}

    def __post_init__(self):
        _check_version(self.version, f"{self.name} config")

    @staticmethod
    def from_dict(d: dict[str, Any]) -> FormatConfig:
        if not isinstance(d, dict):
            raise MoeqError(f"a format config must be an object, got {type(d).__name__}")
        d = dict(d)
        name = d.pop("format", None)
        if not isinstance(name, str) or name not in FORMAT_CONFIGS:
            raise MoeqError(f"unknown format {name!r}; valid: {sorted(FORMAT_CONFIGS)}")
        _check_version(d.get("version", 1), f"{name} config")
        try:
            return FORMAT_CONFIGS[name](**d)
        except TypeError as e:
            raise MoeqError(f"{name} config {d}: {e}") from None

    def label(self) -> str:
        return self.name


@register
@dataclasses.dataclass(frozen=True)
class RTN(FormatConfig):
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    grid: Literal["vllm", "signed", "iq4nl", "nl3", "nl2", "mxfp4"] = "vllm"
    search: int = 0  # clip candidates per group; signed/codebook grids: importance-weighted scale search steps
    refine: int = 0  # least-squares (scale, zero) rounds
    hqq: int = 0  # HQQ-style half-quadratic iterations (asymmetric)
    weighting: Literal["x2", "row", "mse"] = "x2"  # importance of each weight in the signed/codebook scale search
    double_quant: bool = False  # codebook grids: int8 codes of a per-row bf16 scale (8 instead of 16 bits per group)
    name: ClassVar[str] = "rtn"

    def __post_init__(self):
        super().__post_init__()
        if self.grid not in rtn.GRIDS:
            raise MoeqError(f"unsupported RTN grid {self.grid!r}; valid choices: {list(rtn.GRIDS)}")
        if self.bits not in rtn.BITS:
            raise MoeqError(f"unsupported RTN bits {self.bits}; valid choices: {list(rtn.BITS)}")
        if not rtn.valid_group_size(self.group_size):
            raise MoeqError(f"unsupported RTN group_size {self.group_size}; valid choices: a multiple of 16 up to "
                             "4096 or -1")
        if self.weighting not in rtn.WEIGHTINGS:
            raise MoeqError(f"unsupported search weighting {self.weighting!r}; valid choices: {list(rtn.WEIGHTINGS)}")
        if not 0 <= self.search <= 127:
            raise MoeqError(f"search must be 0..127, got {self.search}")
        row = grid(self.grid)
        row = row if self.symmetric or row.codebook else grid("asym")
        problem = row.problem(self.bits, self.symmetric, self.search, self.refine, self.hqq, self.double_quant,
                              self.group_size)
        if problem:
            raise MoeqError(problem)

    def quantize(self, w, name=None, slices=None, importance=None):
        # with measured column importance the search weighs errors by it alone (llama.cpp's imatrix weighs
        # sqrt(sigma^2 + x^2) on top; "mse" x importance measured 0.124 vs 0.194 KL for "row" on the fixture)
        imp = importance if importance is not None and self.uses_importance() else None
        return rtn.quantize(w, self.bits, self.group_size_for(w.shape[-1]), self.symmetric, self.grid, name=name,
                            search=self.search, refine=self.refine, hqq=self.hqq,
                            weighting=self.weighting if imp is None else "mse", importance=imp,
                            double_quant=self.double_quant)

    def uses_importance(self) -> bool:
        return rtn.searched_natively(self.grid, self.bits, self.symmetric, self.search)

    def group_size_for(self, k: int) -> int:
        """The group size used on a tensor with last dim ``k``: ``group_size`` when it divides ``k``, else the
        largest of its halvings (down to 16) that does — e.g. 64 for K=576 at g128, the group sizes kernels and
        engines support —, else one group per row (-1). The default path then fits any model; ``inspect`` shows
        each tensor's actual group size."""
        gs = self.group_size
        if gs == -1 or k % gs == 0:
            return gs
        while gs > 16:
            gs //= 2
            if gs % 16 == 0 and k % gs == 0:
                return gs
        return -1

    def label(self) -> str:
        kind = "asym" if not self.symmetric else ("" if self.grid == "vllm" else self.grid)
        opt = ((f"-s{self.search}" if self.search else "") + (f"-r{self.refine}" if self.refine else "")
               + (f"-h{self.hqq}" if self.hqq else ""))
        if self.search and self.symmetric and self.grid != "vllm" and self.weighting != "x2":
            opt += f"-w{self.weighting}"
        return f"rtn-int{self.bits}{'-' + kind if kind else ''}-g{self.group_size}{opt}{'-dq' if self.double_quant else ''}"


@register
@dataclasses.dataclass(frozen=True)
class BNB4(FormatConfig):
    quant_type: Literal["nf4", "fp4"] = "nf4"
    blocksize: int = 64
    double_quant: bool = True
    search: int = 0  # absmax candidates tried per block (0: bitsandbytes' plain absmax)
    name: ClassVar[str] = "bnb4"

    def __post_init__(self):
        super().__post_init__()
        if self.quant_type not in ("nf4", "fp4"):
            raise MoeqError(f"unsupported quant_type {self.quant_type!r}; valid choices: ['nf4', 'fp4']")
        if self.blocksize not in bnb4.BLOCKSIZES:
            raise MoeqError(f"unsupported blocksize {self.blocksize}; valid choices: {list(bnb4.BLOCKSIZES)}")

    def quantize(self, w, name=None, slices=None, importance=None):
        return bnb4.quantize(w, self.quant_type, self.blocksize, self.double_quant, slices=slices, name=name,
                             search=self.search)

    def label(self) -> str:
        return f"{self.quant_type}-b{self.blocksize}{'-dq' if self.double_quant else ''}" + (
            f"-s{self.search}" if self.search else "")


def NF4(blocksize: int = 64, double_quant: bool = True) -> BNB4:
    return BNB4("nf4", blocksize, double_quant)


def FP4(blocksize: int = 64, double_quant: bool = True) -> BNB4:
    return BNB4("fp4", blocksize, double_quant)


@register
@dataclasses.dataclass(frozen=True)
class Int8(FormatConfig):
    name: ClassVar[str] = "int8"

    def quantize(self, w, name=None, slices=None, importance=None):
        return int8.quantize(w, name=name)

    def label(self) -> str:
        return "llm-int8"


@register
@dataclasses.dataclass(frozen=True)
class FP8(FormatConfig):
    """FP8 e4m3 with one fp32 scale per ``block`` tile (DeepSeek's layout). An FP8 checkpoint's weights load into
    it as stored (no rounding); float weights are quantized as transformers' ``Fp8Quantize`` does."""
    name: ClassVar[str] = "fp8"
    block: tuple[int, int] = fp8.BLOCK

    def __post_init__(self):
        super().__post_init__()
        b = self.block
        if (not isinstance(b, (tuple, list)) or len(b) != 2
                or not all(type(v) is int and 1 <= v <= 1 << 16 for v in b)):
            raise MoeqError(f"fp8 config: block must be two integers in 1..65536, got {b!r}")
        object.__setattr__(self, "block", tuple(b))

    def quantize(self, w, name=None, slices=None, importance=None):
        return fp8.quantize(w, self.block, name=name)

    def label(self) -> str:
        return f"fp8-e4m3-b{self.block[0]}x{self.block[1]}"


@register
@dataclasses.dataclass(frozen=True)
class IQ2S(FormatConfig):
    """llama.cpp's IQ2_S blocks (2.5625 bits/weight, a 1024-point lattice codebook per 8 weights) by moeq's search
    (:mod:`moeq.formats.iq2s`); GGUF export lossless. A tensor whose input width is not a multiple of 256 gets
    ``fallback`` instead (llama.cpp falls back too), said in the log."""
    weighting: Literal["x2", "mse"] = "x2"
    fallback: str = "nl2"
    name: ClassVar[str] = "iq2s"

    def __post_init__(self):
        super().__post_init__()
        if self.weighting not in iq2s.WEIGHTINGS:
            raise MoeqError(f"unsupported iq2s weighting {self.weighting!r}; valid choices: {list(iq2s.WEIGHTINGS)}")
        known = globals().get("METHODS")  # None while the presets below are being built
        if self.fallback == self.name or (known is not None and (
                self.fallback not in known or isinstance(known[self.fallback], IQ2S))):
            raise MoeqError(f"iq2s fallback {self.fallback!r} is not a named method other than iq2s")

    def quantize(self, w, name=None, slices=None, importance=None):
        if w.dim() >= 2 and w.shape[-1] % iq2s.QK:
            log.info("%s: input width %d is not a multiple of %d: %s instead of iq2s", name or "<unnamed>",
                     w.shape[-1], iq2s.QK, self.fallback)
            return METHODS[self.fallback].quantize(w, name, slices, importance)
        if importance is None and not IQ2S._warned:
            IQ2S._warned = True
            log.warning("iq2s without column importance: its grid has no zero level, and outlier input channels then "
                        "ruin it (KL 5.3 against 0.97 with importance on the real-weights fixture); moeq.load measures "
                        "the data-free importance itself")
        return iq2s.quantize(w, importance, self.weighting, name)

    _warned: ClassVar[bool] = False

    def uses_importance(self) -> bool:
        return True

    def needs_importance(self) -> bool:
        return True

    def label(self) -> str:
        return "iq2s" + ("-wmse" if self.weighting == "mse" else "")


@register
@dataclasses.dataclass(frozen=True)
class Keep(FormatConfig):
    """Leave the module in the compute dtype."""
    name: ClassVar[str] = "none"

    def quantize(self, w, name=None, slices=None, importance=None):
        return None

    def label(self) -> str:
        return "none"


METHODS: dict[str, FormatConfig] = {
    "rtn-int4": RTN(4, 128),
    "rtn-int4-asym": RTN(4, 128, symmetric=False),
    "rtn-int4-signed": RTN(4, 128, grid="signed"),
    "rtn-int8": RTN(8, 128),
    "q4_0": RTN(4, 32, grid="signed"),  # llama.cpp's Q4_0 rounding (d = signed max / -8); GGUF export is lossless
    "q8_0": RTN(8, 32, grid="signed"),  # llama.cpp's Q8_0 blocks; GGUF export is lossless
    # importance-weighted scale search (native): same Q4_0 blocks, lower error; GGUF export stays lossless
    "q4_0-opt": RTN(4, 32, grid="signed", search=7, weighting="row"),
    "q5_0": RTN(5, 32, grid="signed"),  # llama.cpp's Q5_0 codes bit for bit; GGUF export is lossless
    "q5_0-opt": RTN(5, 32, grid="signed", search=7, weighting="row"),
    # llama.cpp's IQ4_NL values and search (7 steps each way, here over both signs) with row-aware weights (lower
    # KL than x^2, measured; 5 steps: KL +6%); GGUF export lossless (IQ4_NL)
    "iq4nl": RTN(4, 32, grid="iq4nl", search=7, weighting="row"),
    # the same with int8 codes of a per-row bf16 scale: 4.25 + 16/K bits per weight (GGUF: IQ4_NL, scales to fp16)
    "iq4nl-dq": RTN(4, 32, grid="iq4nl", search=7, weighting="row", double_quant=True),
    # 3 bits: every other IQ4_NL value (grid nl3), the same search with llama.cpp's x^2 weights (at 3 bits lower KL
    # than the row-aware ones, measured), group 16 with double-quantized scales: 3.5 + 16/K bits per weight
    # (llama.cpp's Q3_K: 3.44). Its mixes below add bits where llama.cpp's Q3_K_S / Q3_K_M do.
    "nl3": RTN(3, 16, grid="nl3", search=7, weighting="x2", double_quant=True),
    # the same at group 32: 3.25 + 16/K bits (27% more weight error than group 16, measured), a cheaper rung for bit
    # allocation on the tensors that need it least
    "nl3-g32": RTN(3, 32, grid="nl3", search=7, weighting="x2", double_quant=True),
    # 2 bits for the experts of very large MoEs (nl2-m below keeps the rest at 4-8 bits): 4 levels with a zero, group 16,
    # double-quantized scales: 2.5 + 16/K bits per weight (llama.cpp's Q2_K: 2.625, IQ2_S: 2.5)
    "nl2": RTN(2, 16, grid="nl2", search=7, weighting="x2", double_quant=True),
    # llama.cpp's IQ2_S blocks by moeq's exhaustive lattice search, 2.5625 bits/weight (GGUF: IQ2_S, lossless)
    "iq2s": IQ2S(),
    # OCP MXFP4 (gpt-oss' expert format; llama.cpp's MXFP4): E2M1 codes, a power-of-two scale per 32, rounded as
    # llama.cpp's quantize_row_mxfp4_ref; gpt-oss MXFP4 checkpoints load into it exactly; GGUF export lossless
    "mxfp4": RTN(4, 32, grid="mxfp4"),
    # FP8 e4m3, one scale per 128x128 tile (DeepSeek-V3 / Qwen3-FP8 layout): an FP8 checkpoint's weights as stored
    "fp8": FP8(),
    "rtn-int4-opt": RTN(4, 128, symmetric=False, search=20, refine=2),
    "rtn-int3": RTN(3, 64, symmetric=False),
    "rtn-int2": RTN(2, 32, symmetric=False),
    "nf4": NF4(),
    "nf4-opt": BNB4("nf4", 32, True, search=20),
    "fp4": FP4(),
    "int8": Int8(),
    "none": Keep(),
}


_KV = ("*.k_proj", "*.v_proj", "*.kv_a_proj_with_mqa", "*.kv_b_proj")  # k and v (MLA: its compressed kv path)
# Data-free mixes in the spirit of llama.cpp's _M/_L types: named methods whose default format is a 4-bit method and
# whose own rules give the tensors where a bit buys the most 8 bits (k,v first: ~6% of an attention+experts model;
# then the experts' down projections). Measured on the real-weights fixture (README, benchmarks/bench_accuracy.py).
# A preset pattern ending in ``@more`` matches only in llama.cpp's "use more bits" layers (its use_more_bits():
# the first and last eighth, and every third layer between).
MORE = "@more"
MIXES: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "iq4nl-m": ("iq4nl", tuple((p, "q8_0") for p in _KV)),
    "iq4nl-l": ("iq4nl", tuple((p, "q8_0") for p in (*_KV, "*.experts.w2", "*shared_expert.down_proj"))),
    "q4_0-m": ("q4_0-opt", tuple((p, "q8_0") for p in _KV)),  # every tensor Q4_0/Q8_0 in GGUF, losslessly
    # 3-bit mixes where llama.cpp's Q3_K_S / Q3_K_M spend their bits (for MoE: k,v 8-bit; o 4-bit+, _M: every down
    # projection at 4 bits)
    "nl3-s": ("nl3", (*((p, "q8_0") for p in _KV), ("*.o_proj", "iq4nl-dq"))),
    "nl3-m": ("nl3", (*((p, "q8_0") for p in _KV), *((p, "iq4nl-dq") for p in (
        "*.o_proj", "*.experts.w2", "*shared_expert.down_proj", "*.mlp.down_proj")))),
    # 2-bit experts, as the big-MoE recipes do (DeepSeek / Kimi on one machine): the routed experts nl2, attention,
    # shared experts and dense MLPs 4-bit (iq4nl-dq), k,v 8-bit
    "nl2-m": ("iq4nl-dq", (("*.experts", "nl2"), *((p, "q8_0") for p in _KV))),
    # the same recipe with the experts in IQ2_S blocks (a vector codebook: 43% below nl2-m's KL, measured)
    "iq2s-m": ("iq4nl-dq", (("*.experts", "iq2s"), *((p, "q8_0") for p in _KV))),
    # 5-bit everywhere, k,v and the down projections of llama.cpp's more-bits layers 8-bit (Q5_0/Q8_0 in GGUF)
    "q5_0-m": ("q5_0-opt", tuple((p, "q8_0") for p in (*_KV, "*.experts.w2" + MORE, "*shared_expert.down_proj" + MORE))),
}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits (``use_more_bits`` in llama-quant.cpp)."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("layers", "h", "blocks") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def rule_matches(pattern: str, names: tuple[str, ...], n_layers: int | None) -> bool:
    """A rule's glob against a module's names; ``@more`` patterns also need a more-bits layer (known layer count)."""
    if pattern.endswith(MORE):
        layer = _layer_of(names[0])
        if n_layers is None or layer is None or not use_more_bits(layer, n_layers):
            return False
        pattern = pattern[: -len(MORE)]
    return any(fnmatch.fnmatchcase(n, pattern) for n in names)


def mix(name: str, group_size: int | None = None) -> QuantConfig:
    """A named mix (:data:`MIXES`) as a :class:`QuantConfig`; ``group_size`` overrides its default format's."""
    base, rules = MIXES[name]
    return QuantConfig(method(base, group_size), preset_rules=tuple((p, method(m)) for p, m in rules))


def method(name: str, group_size: int | None = None) -> FormatConfig:
    """A named preset (``rtn-int4``, ``nf4``, ...); ``group_size`` overrides RTN group / bnb block size."""
    if name not in METHODS:
        raise MoeqError(f"unknown method {name!r}; valid: {sorted(METHODS)}")
    cfg = METHODS[name]
    if group_size is not None:
        if not isinstance(cfg, (RTN, BNB4)):
            raise MoeqError(f"method {name!r} has no group size: --group-size applies to rtn-* and nf4/fp4 methods")
        if isinstance(cfg, RTN):
            cfg = dataclasses.replace(cfg, group_size=group_size)
        elif isinstance(cfg, BNB4):
            cfg = dataclasses.replace(cfg, blocksize=group_size)
    return cfg


# Default policy: quantize experts, attention projections and shared-expert MLPs; keep routers, shared-expert
# gates, norms, embeddings and lm_head in the compute dtype. First matching rule wins; user rules come first.
DEFAULT_KEEP = ("lm_head", "*.gate", "*.router", "*.router.*", "*shared_expert_gate*", "*.mamba.*", "*.mixer.*",
                "*embed*", "*.norm", "*norm*")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """What to quantize how: ``default`` for every quantizable module, ``rules`` (glob on the module name, first
    match wins) override it, then the keep-list of the default policy applies."""

    default: FormatConfig = dataclasses.field(default_factory=lambda: RTN())
    rules: tuple[tuple[str, FormatConfig], ...] = ()
    version: int = dataclasses.field(default=CONFIG_VERSION, kw_only=True)
    strict: bool = dataclasses.field(default=True, kw_only=True)  # a rule that matches nothing is an error
    # a named mix's own rules (:data:`MIXES`): after ``rules``, and free to match nothing (not every family has them)
    preset_rules: tuple[tuple[str, FormatConfig], ...] = dataclasses.field(default=(), kw_only=True)

    def __post_init__(self):
        _check_version(self.version, "quantization config")
        if isinstance(self.rules, dict):
            object.__setattr__(self, "rules", tuple(self.rules.items()))

    @property
    def all_rules(self) -> tuple[tuple[str, FormatConfig], ...]:
        return self.rules + self.preset_rules

    @staticmethod
    def of(cfg: QuantConfig | FormatConfig | str) -> QuantConfig:
        if isinstance(cfg, QuantConfig):
            return cfg
        if isinstance(cfg, str):
            return mix(cfg) if cfg in MIXES else QuantConfig(method(cfg))
        return QuantConfig(cfg)

    def for_module(self, name: str, never: tuple[str, ...] = ()) -> FormatConfig:
        """The format for module ``name``: ``never`` (an architecture's never-quantize globs) wins over
        everything, then the first matching rule, then the default policy. One glob dialect everywhere:
        :func:`fnmatch.fnmatchcase` on module names."""
        if any(fnmatch.fnmatchcase(name, p) for p in never):
            return Keep()
        for pattern, cfg in self.all_rules:
            if rule_matches(pattern, (name,), None):
                return cfg
        if any(fnmatch.fnmatchcase(name, p) for p in DEFAULT_KEEP):
            return Keep()
        return self.default

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "default": self.default.to_dict(),
                "rules": [[p, c.to_dict()] for p, c in self.rules], "strict": self.strict,
                "preset_rules": [[p, c.to_dict()] for p, c in self.preset_rules]}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> QuantConfig:
        if not isinstance(d, dict) or "default" not in d or not isinstance(d.get("rules", []), list):
            raise MoeqError(f"a quantization config must be an object with default and rules, got {d!r}"[:300])
        _check_version(d.get("version", 1), "quantization config")
        if not isinstance(d.get("preset_rules", []), list):
            raise MoeqError("quantization config preset_rules must be a list")
        try:
            rules = tuple((p, FormatConfig.from_dict(c)) for p, c in d.get("rules", []))
            preset = tuple((p, FormatConfig.from_dict(c)) for p, c in d.get("preset_rules", []))
        except (TypeError, ValueError) as e:
            raise MoeqError(f"quantization config rules malformed: {e}") from None
        return QuantConfig(FormatConfig.from_dict(d["default"]), rules, version=d.get("version", 1),
                           strict=bool(d.get("strict", True)), preset_rules=preset)


def presets() -> dict[str, QuantConfig]:
    """Mixed-precision presets, as rules (first match wins)."""
    opt4 = RTN(4, 64, symmetric=False, search=20, refine=2)
    eight = RTN(8, 64)
    return {
        # attention, shared experts and lm_head 8-bit; routed experts 4-bit with the calibration-free optimizer
        "balanced": QuantConfig(opt4, rules={"*.self_attn.*": eight, "*shared_expert*": eight, "lm_head": eight},
                                strict=False),
        # everything 4-bit with the optimizer; lm_head 8-bit
        "small": QuantConfig(opt4, rules={"lm_head": eight}, strict=False),
    }


class Policy:
    """A :class:`QuantConfig` applied to one model: which format each module (or expert slot) gets, matching rules
    against every name a user sees for it — the module name (``model.layers.0.mlp.experts``), the checkpoint's name
    (``model.layers.0.block_sparse_moe.experts``, ``....experts.0.w2``) and the names ``inspect`` prints
    (``....experts.w13`` / ``.w2``) — and remembering which rules matched, so a rule that matches nothing is an
    error listing close names instead of being silently ignored. ``never``: an architecture's never-quantize globs."""

    def __init__(self, qcfg: QuantConfig, never: tuple[str, ...] = (), n_layers: int | None = None):
        self.qcfg, self.never, self.n_layers = qcfg, never, n_layers
        self.used: set[int] = set()
        self.seen: list[str] = []

    def format_for(self, *names: str) -> FormatConfig:
        """The format for a module or slot known under ``names`` (first: its module name)."""
        self.seen.extend(names)
        if any(fnmatch.fnmatchcase(names[0], p) for p in self.never):
            return Keep()
        for i, (pattern, cfg) in enumerate(self.qcfg.all_rules):
            if rule_matches(pattern, names, self.n_layers):
                self.used.add(i)
                return cfg
        if any(fnmatch.fnmatchcase(names[0], p) for p in DEFAULT_KEEP):
            return Keep()
        return self.qcfg.default

    def check_rules(self) -> None:
        """Raise for a rule that matched no module (or only modules an earlier rule already took)."""
        if not self.qcfg.strict:
            return
        import difflib  # noqa: PLC0415

        for i, (pattern, _) in enumerate(self.qcfg.rules):
            if i in self.used:
                continue
            close = difflib.get_close_matches(pattern, sorted(set(self.seen)), n=5, cutoff=0.4)
            earlier = any(fnmatch.fnmatchcase(n, pattern) for n in self.seen)
            raise MoeqError(f"rule {pattern!r} matches no module" + (
                " that an earlier rule did not already take" if earlier else "") + (
                f"; close names: {close}" if close else "") + " (names: module, checkpoint or inspect names, "
                "e.g. 'model.layers.0.mlp.experts', '*.experts.w2', '*.self_attn.*', 'lm_head')")
