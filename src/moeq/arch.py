"""Architectures as data: how a family's checkpoint keys map onto transformers 5.x modules and how its experts are
laid out. Adding a family that transformers defines is a table entry plus a test (an :class:`Arch` row in
``ARCHS`` below, and the family in ``moeq.tiny`` and ``tests/models/test_architectures.py``).

Checkpoint keys are first rewritten by ``renames`` (regex, replacement), then matched as
- per-expert 2-D weights ``{moe}.experts.{expert}.{gate|up|down}.weight`` (names from ``expert_names``),
- fused 3-D params ``{moe}.experts.gate_up_proj|down_proj[_bias]`` (transformers' own names),
- anything else: a parameter or buffer of the model by its name.
"""
from __future__ import annotations

import dataclasses
import re

from transformers import PretrainedConfig
from moeq.errors import MoeqError


@dataclasses.dataclass(frozen=True)
class Arch:
    model_types: tuple[str, ...]
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # on-disk per-expert names
    renames: tuple[tuple[str, str], ...] = ()  # regex rewrites of checkpoint keys -> model names
    transposed: bool = False  # fused params stored [E, in, out] (gpt-oss, Llama 4)
    interleaved: bool = False  # gate/up interleaved along the fused output dim (gpt-oss)
    activation: str = "glu"  # "glu": act(gate) * up with config.hidden_act; "gptoss": clamped swiglu
    keep: tuple[str, ...] = ()  # extra never-quantize module globs (beyond the default policy)
    disk_renames: tuple[tuple[str, str], ...] = ()  # model names -> per-expert (transformers 4.x) on-disk names
    per_expert_on_disk: bool = True  # the family's classic checkpoints hold one 2-D tensor per expert
    moe_adapter: str | None = None  # a block wrapper routing to the quantized experts (see moeq.convert.ADAPTERS)
    notes: str = ""

    def to_disk(self, name: str) -> str:
        for pat, rep in self.disk_renames:
            name = re.sub(pat, rep, name)
        return name

    def disk_expert_key(self, experts_module: str, e: int, kind: str) -> str:
        """The classic per-expert module name of expert ``e``'s ``kind`` (gate/up/down) projection."""
        proj = self.expert_names[("gate", "up", "down").index(kind)]
        return f"{self.to_disk(experts_module)}.{e}.{proj}"

    def rename(self, key: str) -> str:
        for pat, rep in self.renames:
            key = re.sub(pat, rep, key)
        return key

    @property
    def expert_key_re(self) -> re.Pattern:
        g, u, d = (re.escape(n) for n in self.expert_names)
        return re.compile(rf"^(?P<mod>.+\.experts)\.(?P<e>\d+)\.(?P<proj>{g}|{u}|{d})\.weight$")

    def proj_kind(self, name: str) -> str:
        return {self.expert_names[0]: "gate", self.expert_names[1]: "up", self.expert_names[2]: "down"}[name]


FUSED_KEY_RE = re.compile(r"^(?P<mod>.+\.experts)\.(?P<param>gate_up_proj|down_proj)(?P<bias>_bias)?$")

_TABLE: tuple[Arch, ...] = (
    Arch(("mixtral", "minimax"), expert_names=("w1", "w3", "w2"), renames=((r"\.block_sparse_moe\.", ".mlp."),),
         disk_renames=((r"\.mlp\.", ".block_sparse_moe."),)),
    Arch(("phimoe",), expert_names=("w1", "w3", "w2"),
         renames=((r"\.block_sparse_moe\.", ".mlp."), (r"\.mlp\.gate\.weight$", ".mlp.router.weight")),
         disk_renames=((r"\.mlp\.router(\.|$)", r".mlp.gate\1"), (r"\.mlp\.", ".block_sparse_moe."))),
    Arch(("qwen2_moe",), notes="shared expert quantized; its sigmoid gate kept"),
    Arch(("qwen3_moe",)),
    Arch(("olmoe",)),
    Arch(("deepseek_v3",), notes="MLA projections and shared experts quantized; router + bias kept"),
    Arch(("glm4_moe",), notes="GLM-4.5 (DeepSeek-style routing): shared experts quantized; router and its "
                              "e_score_correction_bias kept; the first dense layers' MLPs quantized as linears"),
    Arch(("qwen3_next",), keep=("*.linear_attn.*",),
         notes="gated DeltaNet linear-attention layers kept in the compute dtype; shared expert quantized, its gate "
               "kept"),
    Arch(("jamba",), notes="mamba mixers kept in the compute dtype"),
    Arch(("granitemoe",), renames=(
        (r"block_sparse_moe\.input_linear\.weight$", "block_sparse_moe.experts.gate_up_proj"),
        (r"block_sparse_moe\.output_linear\.weight$", "block_sparse_moe.experts.down_proj"),
        (r"block_sparse_moe\.router\.layer\.weight$", "block_sparse_moe.router.weight"),
    ), per_expert_on_disk=False, notes="3-D fused experts on disk"),
    Arch(("llama4_text", "llama4"), transposed=True, per_expert_on_disk=False, moe_adapter="llama4",
         notes="fused 3-D experts; routed-only forward (transformers runs all experts); shared expert quantized"),
    Arch(("gpt_oss",), transposed=True, interleaved=True, activation="gptoss", per_expert_on_disk=False,
         notes="from bf16 weights; expert biases; interleaved gate/up; attention sinks kept"),
    Arch(("llama", "qwen2", "qwen3", "mistral"), notes="dense models (no experts): linears only; e.g. a MoE's dense "
                                                       "sibling to compare methods without routing"),
)
ARCHS: dict[str, Arch] = {mt: a for a in _TABLE for mt in a.model_types}


def supported() -> list[str]:
    return sorted(ARCHS)


def get_arch(config: PretrainedConfig | str) -> Arch:
    mt = config if isinstance(config, str) else getattr(config, "model_type", None)
    if mt not in ARCHS:
        raise MoeqError(f"unsupported architecture {mt!r}; moeq supports: {', '.join(supported())}")
    return ARCHS[mt]
