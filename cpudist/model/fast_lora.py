"""LoRA's hot path without PEFT's per-call overhead (lora.fast_path, on by default).

PEFT keeps the adapter's parameters, their names and its save format; only the forward of each
adapted linear layer is replaced. What the replacement saves, per adapted layer and step:
- PEFT casts the layer's bf16 input to the adapter's fp32 dtype, then autocast casts it back to
  bf16 for the matmul: two copies of the activation forward, two more in backward. Here the input
  goes to the matmul as it is (autocast casts the small fp32 adapter weights once per step).
- PEFT scales the adapter's output (tokens x out_features); here the rank-sized intermediate
  (tokens x r) is scaled, which is the same product with out_features / r fewer multiplications.
- PEFT adds the adapter's output to the frozen layer's; here the adapter's output is the
  accumulator the frozen GEMM adds into (addmm): no separate add forward, none in backward.
- Projections that read the same input (q/k/v of an attention block, gate/up of an MLP) compute
  their A products in one GEMM over the concatenated A matrices (SHARED_INPUT_GROUPS), and the
  input's gradient gets one LoRA contribution instead of three.
- The B product's backward computes its two rank-wide results as wide ones (LoraUp): CPU GEMM
  kernels vectorise along an output's columns, and r-wide outputs leave them mostly idle.
A layer the fast path cannot serve exactly (dropout > 0, several adapters, a PEFT variant such
as DoRA, adapters disabled or merged) keeps PEFT's forward, decided per call.
docs/PERFORMANCE.md ("LoRA fast path") has the measured effect; tests/model/test_fast_lora.py
checks outputs and gradients against PEFT's forward.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("cpudist")

# Sibling projections that a decoder block calls on one and the same input tensor.
SHARED_INPUT_GROUPS: tuple[frozenset[str], ...] = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"gate_proj", "up_proj"}),
)
ADAPTER = "default"


class SharedInputA:
    """The A products of sibling LoRA layers that read the same input, in one GEMM.

    The first member called with a new input computes x @ [A_1; A_2; ...]^T and keeps the result
    until every member has taken its slice; a member called with any other tensor (a model that
    feeds them different inputs) computes its own product, so the result is right either way.
    """

    def __init__(self, members: Sequence[nn.Module]) -> None:
        self.members = list(members)
        self.ranks = [m.lora_A[ADAPTER].weight.shape[0] for m in self.members]
        self._input: torch.Tensor | None = None
        self._slices: dict[int, torch.Tensor] = {}

    def product(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """Member `slot`'s A product of x."""
        if self._input is not x or slot not in self._slices:
            weight = torch.cat([m.lora_A[ADAPTER].weight for m in self.members])
            slices = F.linear(x, weight).split(self.ranks, dim=-1)
            self._input = x
            self._slices = dict(enumerate(slices))
        result = self._slices.pop(slot)
        if not self._slices:
            self._input = None  # every member served: let the input go
        return result


class LoraUp(torch.autograd.Function):
    """h @ B^T (+ bias), the adapter's up-projection, with its backward laid out for CPU GEMMs.

    Autograd would compute grad_B = g^T @ h and grad_h = g @ B, whose outputs are r columns wide
    (r = 8-64). CPU GEMM kernels vectorise along the output's columns, so those leave most of each
    AVX-512 register empty: here both are computed as their r-row transposes (h^T @ g, B^T @ g^T)
    and handed back transposed. The same products, summed in another order: the results differ
    from autograd's by rounding only (measured per shape by docs/bench/perf4/lora_gemm_layouts.py;
    docs/PERFORMANCE.md, "LoRA fast path"). The layout is fixed, not measured per run, so a
    resumed run computes exactly what the uninterrupted one did.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        return F.linear(h, weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        h, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_h = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # Autocast (bf16 runs) casts the fp32 weight in mm; the explicit cast serves the rest.
            grad_h = torch.mm(weight.to(g.dtype).t(), g.t()).t().reshape(h.shape)
        if ctx.needs_input_grad[1]:
            # Returned in the compute dtype; autograd casts it to the fp32 weight's, as it does
            # for the cast that autocast puts in front of a plain F.linear.
            grad_weight = torch.mm(h.reshape(-1, h.shape[-1]).t(), g).t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g.sum(0)
        return grad_h, grad_weight, grad_bias


def _servable(layer: nn.Module) -> bool:
    """True when the fast forward computes exactly what PEFT's would, for this layer's setup."""
    return (list(layer.lora_A.keys()) == [ADAPTER] and not getattr(layer, "lora_variant", {})
            and isinstance(layer.lora_dropout[ADAPTER], nn.Identity))


def _fast_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if (self.disable_adapters or self.merged or args or kwargs
            or ADAPTER not in self.active_adapters):
        return self._peft_forward(x, *args, **kwargs)
    shared: SharedInputA | None = self._cpudist_shared
    a = (shared.product(self._cpudist_slot, x) if shared
         else F.linear(x, self.lora_A[ADAPTER].weight))
    base = self.base_layer
    h, up = a * self.scaling[ADAPTER], self.lora_B[ADAPTER].weight
    if not self._cpudist_eager:  # compiled: Inductor plans the GEMMs and fuses the add itself
        return base(x) + F.linear(h, up)
    if type(base) is not nn.Linear:  # quantized: its own kernel, no accumulator to hand it
        # The adapter first: the quantized matmul saves no tensor for backward, so in a
        # checkpointed layer's recompute, which stops once the last saved tensor is back, the
        # layer's last projection (down_proj) is neither dequantized nor multiplied again.
        lora = LoraUp.apply(h, up, None)
        return base(x) + lora
    # The adapter's output (with the frozen bias, added in that small GEMM) is the accumulator of
    # the frozen GEMM: one addmm instead of a GEMM, an add and the add's extra pass in backward.
    lora = LoraUp.apply(h, up, base.bias)
    out = torch.addmm(lora.reshape(-1, lora.shape[-1]), x.reshape(-1, x.shape[-1]), base.weight.t())
    return out.view(lora.shape)


def install_fast_path(model: nn.Module) -> int:
    """Give every servable PEFT LoRA linear layer the fast forward; returns how many got it."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    layers = {name: module for name, module in model.named_modules()
              if isinstance(module, LoraLinear) and _servable(module)}
    for module in layers.values():
        module._peft_forward = module.forward
        module._cpudist_shared = None
        module._cpudist_slot = 0
        module._cpudist_eager = True
        module.forward = types.MethodType(_fast_forward, module)
    by_parent: dict[str, dict[str, nn.Module]] = {}
    for name, module in layers.items():
        parent, _, leaf = name.rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = module
    groups = 0
    for siblings in by_parent.values():
        for group in SHARED_INPUT_GROUPS:
            members = [siblings[leaf] for leaf in sorted(group) if leaf in siblings]
            if len(members) > 1:
                shared = SharedInputA(members)
                for slot, member in enumerate(members):
                    member._cpudist_shared = shared
                    member._cpudist_slot = slot
                groups += 1
    skipped = sum(isinstance(m, LoraLinear) for m in model.modules()) - len(layers)
    log.info("LoRA fast path: %d layers (%d shared-input groups)%s", len(layers), groups,
             f", {skipped} kept on PEFT's forward (dropout, variants or several adapters)"
             if skipped else "")
    return len(layers)


def prepare_for_compile(model: nn.Module) -> None:
    """Switch the fast path to what suits layers that run under torch.compile: no shared A GEMM
    (its sibling modules would make Inductor specialise and recompile each layer's graph), no
    addmm accumulation (Inductor fuses the add itself) and autograd's own B product."""
    for module in model.modules():
        if hasattr(module, "_cpudist_shared"):
            module._cpudist_shared = None
            module._cpudist_slot = 0
            module._cpudist_eager = False
