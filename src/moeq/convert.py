"""Turning transformers modules into quantized ones, piece by piece (shared by ``quantize_`` and the streaming
loader). An :class:`ExpertsBuilder` takes one expert's gate/up/down as they arrive (from per-expert checkpoint keys,
3-D checkpoint slices or an in-memory module), quantizes each at once and assembles ``w13``/``w2`` at the end.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moeq.arch import Arch
from moeq.config import FormatConfig, Keep, Policy, QuantConfig
from moeq.formats import PackedWeight
from moeq.formats.base import check_finite
from moeq.nn import Activation, Llama4MoeAdapter, QuantExperts, QuantLinear
from moeq.nn.bf12 import Bf12Linear
from moeq.errors import MoeqError

if TYPE_CHECKING:
    from moeq.importance import Importance

KINDS = ("gate", "up", "down")


def activation_for(arch: Arch, module: nn.Module, config) -> Activation:
    if arch.activation == "gptoss":
        return Activation("gptoss", alpha=float(module.alpha), limit=float(module.limit))
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
    return Activation("glu", act=act)


def is_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and isinstance(
        getattr(module, "down_proj", None), torch.Tensor)


def experts_dims(module: nn.Module, arch: Arch) -> tuple[int, int, int]:
    """(E, H, I) of a transformers experts module, from its (possibly meta) parameters."""
    e, a, b = module.gate_up_proj.shape
    h, two_i = (a, b) if arch.transposed else (b, a)
    return e, h, two_i // 2


def split_gate_up(arch: Arch, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's fused gate/up weight in the model's layout -> (gate [I, H], up [I, H])."""
    if arch.transposed:
        w = w.t()
    if arch.interleaved:
        return w[0::2], w[1::2]
    i = w.shape[0] // 2
    return w[:i], w[i:]


def split_gate_up_bias(arch: Arch, b: torch.Tensor) -> torch.Tensor:
    """Fused bias ``[E, 2I]`` -> gate-then-up order ``[E, 2I]``."""
    return torch.cat([b[:, 0::2], b[:, 1::2]], dim=1) if arch.interleaved else b


def down_weight(arch: Arch, w: torch.Tensor) -> torch.Tensor:
    return w.t() if arch.transposed else w


class ExpertsBuilder:
    """Collects one experts module's pieces; ``build()`` returns its replacement module."""

    def __init__(self, name: str, module: nn.Module, arch: Arch, fmt: FormatConfig, activation: Activation,
                 dtype: torch.dtype, fmt2: FormatConfig | None = None, importance: Importance | None = None):
        self.name, self.module, self.arch, self.fmt, self.activation, self.dtype = (
            name, module, arch, fmt, activation, dtype)
        self.importance = importance
        self.fmt2 = fmt if fmt2 is None else fmt2  # w2 (down) may have its own format
        if isinstance(self.fmt, Keep) != isinstance(self.fmt2, Keep):
            raise MoeqError(f"{name}: w13 and w2 must both be quantized or both kept (rules give "
                            f"{self.fmt.label()} and {self.fmt2.label()})")
        self.num_experts, self.hidden, self.inter = experts_dims(module, arch)
        self.pieces: dict[tuple[int, str], PackedWeight | torch.Tensor] = {}
        self.stacks: dict[str, PackedWeight] = {}  # a kind's weight for every expert at once ``[E, N, K]``
        self.has_bias = isinstance(getattr(module, "gate_up_proj_bias", None), torch.Tensor)
        self.biases: dict[str, torch.Tensor] = {}
        self.built = False
        self.decode_layout = "auto"  # "rows": the built module keeps row-major stacks (a streamed export's)

    def _check_open(self, where: str) -> None:
        if self.built:
            raise MoeqError(f"{where}: {self.name} is already complete: duplicate or extra expert tensor")

    def expected_shape(self, kind: str) -> tuple[int, int]:
        return (self.hidden, self.inter) if kind == "down" else (self.inter, self.hidden)

    def _check_piece(self, e: int, kind: str, shape, where: str) -> None:
        if not 0 <= e < self.num_experts:
            raise MoeqError(f"{where}: expert index {e} out of range: the config declares {self.num_experts} experts")
        if tuple(shape) != self.expected_shape(kind):
            raise MoeqError(f"{where}: shape {list(shape)} does not match the config "
                             f"(expected {list(self.expected_shape(kind))})")
        self._check_open(where)
        if (e, kind) in self.pieces or kind in self.stacks:
            raise MoeqError(f"{where}: expert {e} {kind} given twice")

    def put(self, e: int, kind: str, w: torch.Tensor, key: str = "") -> None:
        where = key or f"{self.name}[{e}].{kind}"
        self._check_piece(e, kind, w.shape, where)
        w = w.to(self.dtype)
        imp = None if self.importance is None else self.importance.expert(self.name, e, kind)
        q = (self.fmt2 if kind == "down" else self.fmt).quantize(w, name=where, importance=imp)
        if q is None:
            check_finite(w, where)
        self.pieces[(e, kind)] = w.clone() if q is None else q

    def put_packed(self, e: int, kind: str, q: PackedWeight, key: str) -> None:
        """An already-quantized piece (a pre-quantized checkpoint's per-expert weight)."""
        self._check_piece(e, kind, q.shape, key)
        self.pieces[(e, kind)] = q

    def put_packed_stack(self, kind: str, q: PackedWeight, key: str) -> None:
        """One kind (gate, up or down) already quantized for every expert as one ``[E, N, K]`` weight of a
        row-indexed format (a GGUF file's expert tensors): joined into ``w13``/``w2`` without a split per expert."""
        want = (self.num_experts, *self.expected_shape(kind))
        if tuple(q.shape) != want:
            raise MoeqError(f"{key}: shape {list(q.shape)} does not match the config (expected {list(want)})")
        self._check_open(key)
        if kind in self.stacks or any(k == kind for _, k in self.pieces):
            raise MoeqError(f"{key}: the experts' {kind} weight given twice")
        self.stacks[kind] = q

    def put_fused(self, param: str, get_slice, shape: tuple[int, ...], key: str) -> None:
        """A 3-D fused parameter; ``get_slice(e)`` returns expert e's 2-D slice in the model's layout."""
        want = tuple(getattr(self.module, param).shape)
        if tuple(shape) != want:
            raise MoeqError(f"{key}: shape {list(shape)} does not match the config (expected {list(want)})")
        for e in range(self.num_experts):
            w = get_slice(e)
            if param == "gate_up_proj":
                gate, up = split_gate_up(self.arch, w)
                self.put(e, "gate", gate, f"{key}[{e}]")
                self.put(e, "up", up, f"{key}[{e}]")
            else:
                self.put(e, "down", down_weight(self.arch, w), f"{key}[{e}]")

    def put_bias(self, param: str, b: torch.Tensor, key: str) -> None:
        want = tuple(getattr(self.module, f"{param}_bias").shape)
        if tuple(b.shape) != want:
            raise MoeqError(f"{key}: shape {list(b.shape)} does not match the config (expected {list(want)})")
        self._check_open(key)
        check_finite(b, key)
        self.biases[param] = (split_gate_up_bias(self.arch, b) if param == "gate_up_proj" else b).to(self.dtype)

    def missing(self) -> list[str]:
        if self.built:
            return []
        out = [f"{self.name}: expert {e} {k}" for e in range(self.num_experts) for k in KINDS
               if (e, k) not in self.pieces and k not in self.stacks]
        if self.has_bias:
            out += [f"{self.name}.{p}_bias" for p in ("gate_up_proj", "down_proj") if p not in self.biases]
        return out

    def build(self) -> nn.Module:
        if self.missing():
            raise MoeqError("incomplete experts: " + "; ".join(self.missing()[:8]))
        e_range = range(self.num_experts)
        if len(self.stacks) == len(KINDS):  # every kind as one stack: w13 = gate rows then up rows
            gate, up, down = (self.stacks[k] for k in ("gate", "up", "down"))
            try:
                w13 = type(gate).concat_rows([gate, up])
            except ValueError as err:
                raise MoeqError(f"{self.name}: {err}") from None
            self.stacks.clear()
            self.built = True
            return QuantExperts(w13, down, self.activation, self.biases.get("gate_up_proj"),
                                self.biases.get("down_proj"), weight_on_input=self.arch.weight_on_input,
                                decode_layout=self.decode_layout)
        for kind, q in self.stacks.items():  # stacks beside per-expert pieces: as pieces
            for e in e_range:
                self.pieces[(e, kind)] = q[e]
        self.stacks.clear()
        plain = [isinstance(p, torch.Tensor) for p in self.pieces.values()]
        if any(plain) and not all(plain):
            raise MoeqError(f"{self.name}: some expert weights are quantized in the checkpoint and some are not")
        if all(plain):  # unquantized: fill the original module in its own layout
            gate_up = torch.stack([torch.cat([self.pieces[(e, "gate")], self.pieces[(e, "up")]]) for e in e_range])
            down = torch.stack([self.pieces[(e, "down")] for e in e_range])
            fill_experts_module(self.module, self.arch, gate_up, down, self.biases.get("gate_up_proj"),
                                self.biases.get("down_proj"))
            self.pieces.clear()
            self.built = True
            return self.module
        cls = {}
        for slot, down in (("w13", False), ("w2", True)):
            kinds = {type(p) for (_, k), p in self.pieces.items() if (k == "down") == down}
            if len(kinds) != 1:
                raise MoeqError(f"{self.name}.{slot}: experts mix formats {sorted(k.__name__ for k in kinds)}; "
                                "every expert's weight of one slot must share a format")
            cls[slot] = kinds.pop()
        # the pieces leave the builder as they are joined (Format._join frees each group once copied)
        g13 = [[self.pieces.pop((e, "gate")), self.pieces.pop((e, "up"))] for e in e_range]
        g2 = [[self.pieces.pop((e, "down"))] for e in e_range]
        try:
            w13 = cls["w13"].join(g13)
            w2 = cls["w2"].join(g2)
        except ValueError as err:
            raise MoeqError(f"{self.name}: {err}") from None
        self.pieces.clear()
        self.built = True
        return QuantExperts(w13, w2, self.activation, self.biases.get("gate_up_proj"), self.biases.get("down_proj"),
                            decode_layout=self.decode_layout,
                            weight_on_input=self.arch.weight_on_input)


def module_layout(arch: Arch, gate_up: torch.Tensor, down: torch.Tensor, b13: torch.Tensor | None = None):
    """Canonical ``gate_up [E, 2I, H]`` (gate rows then up rows), ``down [E, H, I]`` and ``b13 [E, 2I]`` in the
    family's own fused layout (interleaved and/or transposed), as transformers' experts modules hold them."""
    def interleave(x: torch.Tensor, dim: int) -> torch.Tensor:
        i = x.shape[dim] // 2
        a, b = x.narrow(dim, 0, i), x.narrow(dim, i, i)
        return torch.stack([a, b], dim=dim + 1).flatten(dim, dim + 1)

    if arch.interleaved:
        gate_up = interleave(gate_up, 1)
        b13 = None if b13 is None else interleave(b13, 1)
    if arch.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up.contiguous(), down.contiguous(), b13


def fill_experts_module(module: nn.Module, arch: Arch, gate_up: torch.Tensor, down: torch.Tensor,
                        b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> None:
    """Set a transformers experts module's params from canonical ``gate_up [E, 2I, H]`` (gate rows then up rows),
    ``down [E, H, I]`` and biases, converting to the module's own layout (interleaved and/or transposed)."""
    gate_up, down, b13 = module_layout(arch, gate_up, down, b13)
    module.gate_up_proj = nn.Parameter(gate_up.contiguous(), requires_grad=False)
    module.down_proj = nn.Parameter(down.contiguous(), requires_grad=False)
    if b13 is not None:
        module.gate_up_proj_bias = nn.Parameter(b13.contiguous(), requires_grad=False)
        module.down_proj_bias = nn.Parameter(b2.contiguous(), requires_grad=False)


def existing_bias(linear: nn.Module, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias a replacement of ``linear`` should carry: the given one, else the module's own (possibly still on
    the meta device, so an unfilled bias is reported at the end of loading)."""
    if bias is not None:
        return bias
    return getattr(linear, "bias", None)


def quantize_linear(name: str, weight: torch.Tensor, bias: torch.Tensor | None, fmt: FormatConfig,
                    importance: Importance | None = None) -> QuantLinear:
    q = fmt.quantize(weight, name=f"{name}.weight", importance=None if importance is None else importance.linear(name))
    return QuantLinear(q, bias)


def set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


ADAPTERS = {"llama4": Llama4MoeAdapter}


def install_experts(root: nn.Module, name: str, new: nn.Module, arch: Arch) -> None:
    """Put a built experts module in place; families whose block runs every expert get their block adapted."""
    if arch.moe_adapter and isinstance(new, QuantExperts):
        block_name = name.rpartition(".")[0]
        block = root.get_submodule(block_name)
        if not isinstance(block, tuple(ADAPTERS.values())):
            set_module(root, block_name, ADAPTERS[arch.moe_adapter](block, new))
            return
    set_module(root, name, new)


def plan(model: nn.Module, arch: Arch, qcfg: QuantConfig) -> tuple[dict, dict]:
    """What to quantize how in ``model``: ``({experts module: (w13 format, w2 format)}, {linear: format})`` (kept
    linears omitted). Rules match module, checkpoint and ``inspect`` names (see :class:`~moeq.config.Policy`); a
    strict config's rule that matches nothing raises, listing close names."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    policy = Policy(qcfg, never=arch.keep, n_layers=getattr(text, "num_hidden_layers", None))
    experts, linears = {}, {}
    for name, mod in model.named_modules():
        disk = arch.to_disk(name)
        if is_experts(mod):
            per_expert = {kind: arch.disk_expert_key(name, 0, kind) for kind in KINDS}
            experts[name] = tuple(
                policy.format_for(name, disk, f"{name}.{slot}", f"{disk}.{slot}",
                                  *(x for k in kinds for x in (per_expert[k], per_expert[k] + ".weight")))
                for slot, kinds in (("w13", ("gate", "up")), ("w2", ("down",))))
        elif isinstance(mod, (nn.Linear, Bf12Linear)):
            fmt = policy.format_for(name, disk, f"{name}.weight", f"{disk}.weight")
            if fmt.name != "none":
                linears[name] = fmt
    policy.check_rules()
    return experts, linears
