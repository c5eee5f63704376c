"""Quantized fused experts: ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` packed weights.

Drop-in for transformers' ``*Experts`` modules (``forward(hidden [T, H], top_k_index [T, A], top_k_weights [T, A])``).
The forward groups the token-expert pairs by expert once and runs only the experts that received tokens; each
expert's matmuls go through :func:`moeq.kernels.expert_linear`, which picks a kernel per format and row count.

Legend: T tokens, A activated experts per token, E experts, H hidden, I expert intermediate size.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import nn
from transformers.activations import ACT2FN

from moeq.formats import PackedWeight
from moeq.kernels import expert_linear, matmul_dtype
from moeq.kernels.moe_cpu import MAX_ROWS as MOE_MAX_ROWS
from moeq.kernels.describe import il16_takes
from moeq.kernels.moe_cpu import held_stacks, il16_dequant, moe_forward, moe_prefill, moe_routed
from moeq.kernels.plans import ExpertsRoute, experts_route
from moeq.nn.packed import DecodeLayout, get_packed, set_packed

NO_ROUTE = ExpertsRoute(decode=False, fused=False, prefill=False)  # off the CPU: per expert (or Triton)

# Tokens per pass of the many-rows path: its gathered inputs and intermediates are [tokens x top-k, H or 2I]
# (~100 MB per 1000 tokens at Qwen3-30B-A3B's shapes); each further pass re-dequantizes the active experts once.
MAX_TOKENS_PER_PASS = 4096


@dataclasses.dataclass(frozen=True)
class Activation:
    """How gate and up combine: ``act(gate) * up`` (``kind="glu"``), or gpt-oss' clamped swiglu."""

    kind: Literal["glu", "gptoss"] = "glu"
    act: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def glu_(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """``act(h[:, :i]) * h[:, i:]`` written over ``h[:, :i]`` (returned: a view with row stride 2i), without
        temporaries; the same values as :meth:`__call__`."""
        if self.kind != "glu" or self.act != "silu":
            return self(h[:, :i], h[:, i:])
        gate = h[:, :i]
        torch.nn.functional.silu(gate, inplace=True)
        return gate.mul_(h[:, i:])

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "glu":
            return ACT2FN[self.act](gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class QuantExperts(DecodeLayout, nn.Module):
    IL16_SLOTS = ("w13", "w2")

    def __init__(self, w13: PackedWeight, w2: PackedWeight, activation: Activation,
                 b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, weight_on_input: bool = False,
                 decode_layout: str = "auto"):
        super().__init__()
        self.weight_on_input = weight_on_input  # Llama 4 scales each expert's input by its router score
        self.num_experts, two_i, self.hidden_dim = w13.shape
        self.intermediate_dim = two_i // 2
        self.activation = activation
        set_packed(self, "w13", w13)
        set_packed(self, "w2", w2)
        self.b13 = None if b13 is None else nn.Parameter(b13, requires_grad=False)  # [E, 2I]
        self.b2 = None if b2 is None else nn.Parameter(b2, requires_grad=False)  # [E, H]
        self._init_layout(decode_layout)  # "rows": never permuted to il16 (a streamed export writes it as built)
        self.choose_kernel()

    @property
    def w13(self) -> PackedWeight:
        """The gate/up stack, row-major (a permuted copy while the module holds the il16 decode layout)."""
        return get_packed(self, "w13")

    @property
    def w2(self) -> PackedWeight:
        return get_packed(self, "w2")

    def extra_repr(self) -> str:
        layout = "il16" if self.il16("w13") else "rows"
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, inter={self.intermediate_dim}, "
                f"kernel={self.kernel}, layout={layout}, w13={self.packed('w13', raw=True)!r}")

    def choose_kernel(self) -> str:
        """Pick the forward for where the weights live and what the module computes, once (at build and after
        ``.to()``): ``triton`` on CUDA, ``native`` on CPU for SiLU-GLU experts without biases or input weighting
        (the fused decode kernels), else ``torch`` (dequantize + matmul per routed expert); then the layout
        (:meth:`choose_layout`)."""
        dev = self.slot_device("w13").type
        plain = (self.b13 is None and self.activation.kind == "glu" and self.activation.act == "silu"
                 and not self.weight_on_input)
        self.kernel = "triton" if dev == "cuda" else "native" if dev == "cpu" and plain else "torch"
        self.choose_layout()
        return self.kernel

    def _il16_takes(self) -> bool:
        return il16_takes(self, self.IL16_SLOTS)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.kernel == "triton":
            from moeq.kernels import gpu  # noqa: PLC0415

            y = gpu.experts_forward(self, hidden_states, top_k_index, top_k_weights)
            if y is not None:
                return y
        t, a = top_k_index.shape
        if t > MAX_TOKENS_PER_PASS:  # long prompts: bounded [pairs, 2I] intermediates; tokens are independent
            n = MAX_TOKENS_PER_PASS
            return torch.cat([self(hidden_states[i:i + n], top_k_index[i:i + n], top_k_weights[i:i + n])
                              for i in range(0, t, n)])
        route = experts_route(self, hidden_states.dtype) if hidden_states.device.type == "cpu" else NO_ROUTE
        if route.decode and t <= MOE_MAX_ROWS:  # decode: routing and every routed expert in one native call
            y = moe_routed(self, hidden_states, top_k_index, top_k_weights)
            if y is not None:
                return y
        out = torch.zeros_like(hidden_states)  # [T, H]
        flat = top_k_index.reshape(-1)  # [T*A]
        order = torch.argsort(flat, stable=True)  # token-expert pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // a  # [T*A]
        weight_of = top_k_weights.reshape(-1)[order]  # [T*A]
        if route.fused:
            # decode-sized experts (few rows) run in one native call; experts with many rows (prefill) in the native
            # grouped GEMM (moe_prefill), or where it declines dequantize + bf16 matmul
            small = [c if c <= MOE_MAX_ROWS else 0 for c in counts]
            large = [c if c > MOE_MAX_ROWS else 0 for c in counts]
            keep = None if not any(small) or not any(large) else torch.tensor(counts)[flat[order]] <= MOE_MAX_ROWS
            fused = None
            if any(small):
                fused = moe_forward(self, hidden_states, *self._pairs(token_of, weight_of, keep, True), small)
                if fused is not None and not any(large):
                    return fused
            if fused is not None or not any(small):
                tl, wl = self._pairs(token_of, weight_of, keep, False)
                big = moe_prefill(self, hidden_states, tl, wl, large) if route.prefill else None
                if big is None:
                    big = self._forward_loop(hidden_states, tl, wl, large, out)
                return big.to(out.dtype) if fused is None else (big + fused).to(out.dtype)
        return self._forward_loop(hidden_states, token_of, weight_of, counts, out)

    @staticmethod
    def _pairs(token_of: torch.Tensor, weight_of: torch.Tensor, keep: torch.Tensor | None, small: bool):
        """The pairs of the small (decode-sized) or the large experts; all of them when only one kind is present."""
        if keep is None:
            return token_of, weight_of
        sel = keep if small else ~keep
        return token_of[sel], weight_of[sel]

    def _forward_loop(self, hidden_states, token_of, weight_of, counts, out):
        """Experts one by one (the many-rows path): each expert's weight is dequantized into one reused buffer for its
        matmul (stacks held in il16: dequantized natively from it), while the gather, activation and scatter run once
        over all pairs rather than once per expert."""
        i = self.intermediate_dim
        xs = hidden_states[token_of]  # [P, H], pairs grouped by expert
        if self.weight_on_input:
            xs = xs * weight_of[:, None].to(xs.dtype)
        stacks = held_stacks(self) if self.il16("w13") and xs.device.type == "cpu" else None
        if stacks is not None:
            h13 = self._per_expert_il16(stacks[0], self.b13, xs, counts)
            ys = self._per_expert_il16(stacks[1], self.b2, self.activation.glu_(h13, i), counts)
        else:
            w13, w2 = self.w13, self.w2
            buf = torch.empty(max(w13.numel, w2.numel) // self.num_experts, dtype=matmul_dtype(xs.dtype, xs.device),
                              device=xs.device)
            h13 = self._per_expert(w13, self.b13, xs, counts, buf)  # [P, 2I]
            ys = self._per_expert(w2, self.b2, self.activation.glu_(h13, i), counts, buf)  # [P, H]
        if not self.weight_on_input:
            wts = weight_of[:, None]
            ys = ys.mul_(wts) if wts.dtype == ys.dtype else ys * wts  # as transformers: promoted when they differ
        return out.index_add_(0, token_of, ys.to(out.dtype))

    @staticmethod
    def _per_expert(w: PackedWeight, bias: torch.Tensor | None, xs: torch.Tensor, counts: list[int],
                    buf: torch.Tensor) -> torch.Tensor:
        ys = torch.empty(xs.shape[0], w.shape[1], dtype=xs.dtype, device=xs.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                expert_linear(w, e, xs[start:start + n], None if bias is None else bias[e], buf, ys[start:start + n])
            start += n
        return ys

    @staticmethod
    def _per_expert_il16(stack, bias: torch.Tensor | None, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """:meth:`_per_expert` for a stack held in il16 (``stack``: its native description): the same dequantized
        values and matmul dtype as :func:`moeq.kernels.reference`."""
        ys = torch.empty(xs.shape[0], stack.N, dtype=xs.dtype, device=xs.device)
        cd = matmul_dtype(xs.dtype, xs.device)
        # one dequantized expert at a time, in a dtype the kernel writes (fp16 models: fp32, then cast)
        buf = torch.empty(stack.N * stack.K, dtype=cd if cd in (torch.bfloat16, torch.float32) else torch.float32)
        start = 0
        for e, n in enumerate(counts):
            if n:
                b = None if bias is None else bias[e].to(cd)
                w = il16_dequant(stack, e, cd, buf)
                ys[start:start + n] = torch.nn.functional.linear(xs[start:start + n].to(cd), w, b)
            start += n
        return ys


class Llama4MoeAdapter(nn.Module):
    """Llama 4's MoE block with quantized experts: transformers runs every expert on every token (scores of
    unrouted experts are 0); this runs only the top-k, scaling each expert's input by its sigmoid score as Llama 4
    does, and returns ``(out, router_logits)`` like ``Llama4TextMoe``."""

    def __init__(self, block: nn.Module, experts: QuantExperts):
        super().__init__()
        self.top_k, self.hidden_dim = block.top_k, block.hidden_dim
        self.router, self.shared_expert, self.experts = block.router, block.shared_expert, experts

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)  # [T, H]
        logits = nn.functional.linear(hidden_states, self.router.weight, self.router.bias)  # [T, E]
        top_v, top_i = torch.topk(logits, self.top_k, dim=1)
        scores = torch.sigmoid(top_v.float()).to(hidden_states.dtype)  # [T, A]
        out = self.shared_expert(hidden_states)
        out.add_(self.experts(hidden_states, top_i, scores))
        return out, logits
