"""Architectures as data: one :class:`Arch` row per family holds every fact moeq keeps about it — how its
checkpoint keys map onto transformers 5.x modules, how its experts are laid out, the block adapter it needs, the
llama.cpp graph it exports to (:class:`GgufFamily`), whether the residual rotation supports it, and the tiny config
the tests and the demo build it from. Adding a family that transformers defines is a row in ``_TABLE`` below (the
architecture tests take every row).

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
class GgufFamily:
    """How llama.cpp names and runs a transformers MoE family (the GGUF exporter and reader)."""
    arch: str  # llama.cpp architecture
    norm_topk: bool | None  # llama.cpp renormalizes the top-k router weights for this graph (None: as configured)
    pre: str = "default"  # llama.cpp pre-tokenizer of the family's byte-level BPE tokenizers
    permute_qk: bool = False  # llama.cpp's "llama" graph uses interleaved RoPE: HF q/k rows are permuted to match
    mla: bool = False  # DeepSeek's multi-head latent attention: kv_b split into the absorbed attn_k_b / attn_v_b
    sigmoid_router: bool = False  # DeepSeek-style MoE: sigmoid scores, selection bias, groups, leading dense layers
    yarn: str | None = None  # the YaRN llama.cpp maps: "mscale" (DeepSeek's mscale pair) or "plain"
    oai_moe: bool = False  # gpt-oss: expert biases, clamped SwiGLU, sliding window on even layers, attention sinks


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
    gguf: GgufFamily | None = None  # the llama.cpp graph model_types[0] exports to (None: no GGUF export)
    rotate: bool = False  # moeq.rotate folds and rotates its residual stream
    tiny: tuple[tuple[str, object], ...] = ()  # model_types[0]'s tiny test config (beyond moeq.tiny's common one)
    dense: bool = False  # no experts: linears only
    notes: str = ""

    @property
    def weight_on_input(self) -> bool:
        """The router weight scales the expert's input, not its output (Llama 4)."""
        return self.moe_adapter == "llama4"

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

def _tiny(**kw) -> tuple[tuple[str, object], ...]:
    return tuple(kw.items())


_MIXTRAL_KEYS = dict(expert_names=("w1", "w3", "w2"), renames=((r"\.block_sparse_moe\.", ".mlp."),),
                     disk_renames=((r"\.mlp\.", ".block_sparse_moe."),))
_TABLE: tuple[Arch, ...] = (
    Arch(("mixtral",), **_MIXTRAL_KEYS, gguf=GgufFamily("llama", norm_topk=True, permute_qk=True), rotate=True,
         tiny=_tiny(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)),
    Arch(("minimax",), **_MIXTRAL_KEYS),
    Arch(("phimoe",), expert_names=("w1", "w3", "w2"),
         renames=((r"\.block_sparse_moe\.", ".mlp."), (r"\.mlp\.gate\.weight$", ".mlp.router.weight")),
         disk_renames=((r"\.mlp\.router(\.|$)", r".mlp.gate\1"), (r"\.mlp\.", ".block_sparse_moe.")),
         tiny=_tiny(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)),
    Arch(("qwen2_moe",), gguf=GgufFamily("qwen2moe", norm_topk=False, pre="qwen2"), rotate=True,
         tiny=_tiny(intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                    num_experts=4, num_experts_per_tok=2),
         notes="shared expert quantized; its sigmoid gate kept"),
    Arch(("qwen3_moe",), gguf=GgufFamily("qwen3moe", norm_topk=True, pre="qwen2"), rotate=True,
         tiny=_tiny(intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                    head_dim=32)),
    Arch(("olmoe",), gguf=GgufFamily("olmoe", norm_topk=False, pre="olmo"), rotate=True,
         tiny=_tiny(intermediate_size=128, num_experts=4, num_experts_per_tok=2)),
    Arch(("deepseek_v3",), gguf=GgufFamily("deepseek2", norm_topk=None, pre="deepseek-v3", mla=True,
                                           sigmoid_router=True, yarn="mscale"),
         notes="MLA projections and shared experts quantized; router + bias kept",
         tiny=_tiny(intermediate_size=256, moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
                    n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=128,
                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, n_group=1, topk_group=1)),
    Arch(("glm4_moe",), gguf=GgufFamily("glm4moe", norm_topk=None, pre="glm4", sigmoid_router=True), notes="GLM-4.5 (DeepSeek-style routing): shared experts quantized; router and its "
                              "e_score_correction_bias kept; the first dense layers' MLPs quantized as linears",
         tiny=_tiny(intermediate_size=256, moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
                    n_shared_experts=1, first_k_dense_replace=1, head_dim=32, n_group=1, topk_group=1)),
    Arch(("qwen3_next",), keep=("*.linear_attn.*",),
         notes="gated DeltaNet linear-attention layers kept in the compute dtype; shared expert quantized, its gate "
               "kept",
         tiny=_tiny(intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                    shared_expert_intermediate_size=128, head_dim=32,
                    layer_types=("linear_attention", "full_attention"))),
    Arch(("jamba",), notes="mamba mixers kept in the compute dtype",
         tiny=_tiny(intermediate_size=128, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                    attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0, mamba_d_state=8,
                    mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False)),
    Arch(("granitemoe",), renames=(
        (r"block_sparse_moe\.input_linear\.weight$", "block_sparse_moe.experts.gate_up_proj"),
        (r"block_sparse_moe\.output_linear\.weight$", "block_sparse_moe.experts.down_proj"),
        (r"block_sparse_moe\.router\.layer\.weight$", "block_sparse_moe.router.weight"),
    ), per_expert_on_disk=False, notes="3-D fused experts on disk",
         tiny=_tiny(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)),
    Arch(("llama4_text", "llama4"), transposed=True, per_expert_on_disk=False, moe_adapter="llama4",
         notes="fused 3-D experts; routed-only forward (transformers runs all experts); shared expert quantized",
         tiny=_tiny(intermediate_size=128, intermediate_size_mlp=256, num_local_experts=4, num_experts_per_tok=1,
                    head_dim=32, interleave_moe_layer_step=1)),
    Arch(("gpt_oss",), transposed=True, interleaved=True, activation="gptoss", per_expert_on_disk=False,
         gguf=GgufFamily("gpt-oss", norm_topk=None, pre="gpt-4o", yarn="plain", oai_moe=True),
         notes="from bf16 weights; expert biases; interleaved gate/up; attention sinks kept",
         tiny=_tiny(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, head_dim=32,
                    sliding_window=64, layer_types=("sliding_attention", "full_attention"))),
    Arch(("llama", "qwen2", "qwen3", "mistral"), rotate=True, dense=True, tiny=_tiny(intermediate_size=256),
         notes="dense models (no experts): linears only; e.g. a MoE's dense sibling to compare methods without "
               "routing"),
)
ARCHS: dict[str, Arch] = {mt: a for a in _TABLE for mt in a.model_types}


GGUF_FAMILIES: dict[str, GgufFamily] = {a.model_types[0]: a.gguf for a in _TABLE if a.gguf is not None}
ROTATABLE: tuple[str, ...] = tuple(mt for a in _TABLE if a.rotate for mt in a.model_types)


def mtp_keys(config: PretrainedConfig, keys) -> list[str]:
    """The checkpoint keys of multi-token-prediction (NextN) layers, which the transformers model does not run (it
    ignores them on load): DeepSeek-V3 / Kimi K2 / GLM-4.5 store them as ``model.layers.{i}`` past
    ``num_hidden_layers`` when ``num_nextn_predict_layers`` is set, Qwen3-Next under ``mtp.``."""
    n_layers = getattr(config, "num_hidden_layers", None)
    extra = re.compile(r"^model\.layers\.(\d+)\.") if getattr(config, "num_nextn_predict_layers", 0) else None
    out = []
    for k in keys:
        m = extra.match(k) if extra is not None and n_layers is not None else None
        if (m and int(m[1]) >= n_layers) or (getattr(config, "model_type", "") == "qwen3_next" and k.startswith("mtp.")):
            out.append(k)
    return out


def tiny_configs(dense: bool = False) -> dict[str, dict]:
    """``{model_type: tiny config}`` of every MoE family (``dense``: of the dense families) with one."""
    return {a.model_types[0]: {k: list(v) if isinstance(v, tuple) else v for k, v in a.tiny}
            for a in _TABLE if a.tiny and a.dense == dense}


def supported() -> list[str]:
    return sorted(ARCHS)


def get_arch(config: PretrainedConfig | str) -> Arch:
    mt = config if isinstance(config, str) else getattr(config, "model_type", None)
    if mt not in ARCHS:
        raise MoeqError(f"unsupported architecture {mt!r}; moeq supports: {', '.join(supported())}")
    return ARCHS[mt]
