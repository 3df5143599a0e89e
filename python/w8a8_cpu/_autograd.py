"""Autograd formulas for the ops (torch >= 2.4, torch.library.register_autograd: eager and torch.compile alike).

int8_scaled_mm_with_quant is differentiable w.r.t. x, and fused_experts w.r.t. hidden and topk_weights, with
straight-through estimates: the per-token int8 rounding of the activations counts as the identity, so the
gradient is the float computation's with the dequantized weights (w_int8 * w_scale per output channel), in fp32,
cast to the input's dtype. Weights, scales and biases are frozen. per_token_quant_int8 and int8_scaled_mm have
no useful gradient. Backward through any op raises ValueError naming the input that asked for a gradient it does
not get, instead of leaving that gradient None. (pack_weight takes only int8, which cannot require grad.) The lean
decode loop's layer ops have no gradient either: rms_norm and causal_attention raise at backward; the in-place ones
(add_rms_norm_, rotary_embedding_, decode_attention_, decode_step_: torch registers no autograd formula for an op that
mutates its input) raise at the call when an input, or a tensor of a list input, requires grad with grad mode on.

Older torch keeps the ops without autograd formulas: their outputs then do not carry gradients."""
from __future__ import annotations

from typing import Tuple

import torch

from ._functions import dequantized_weight, int8_scaled_mm_with_activations
from ._loader import ops as _ops


def _dequantize(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] float weight of a raw int8 [N, K] weight or a packed blob (int8, or int4 with its group scales),
    times w_scale: the weight the straight-through gradients differentiate."""
    if w.dtype == torch.int8:
        return w.float() * w_scale.float().reshape(-1, 1)
    return dequantized_weight(w, w_scale)


def _reject_frozen_inputs(ctx, op: str, differentiable: Tuple[str, ...], why: str) -> None:
    for arg, needs_grad in zip(getattr(_ops, op).default._schema.arguments, ctx.needs_input_grad):
        if needs_grad and arg.name not in differentiable:
            raise ValueError(f"{arg.name}: requires grad, but {op} {why}")


_STRAIGHT_THROUGH = ("int8_scaled_mm_with_quant (or W8A8Linear) has a straight-through gradient w.r.t. its float "
                     "activations")


def _no_gradient(op: str, why: str):
    def backward(ctx, *grads):
        _reject_frozen_inputs(ctx, op, (), why)

    return backward


# ---- int8_scaled_mm_with_quant ---------------------------------------------------------------------------------

def _dequantized_weight(w: torch.Tensor, w_scale: torch.Tensor, k: int) -> torch.Tensor:
    # An op of its own so that torch.compile can trace the backward: a packed blob's N and K are in its header
    # (data), so only the real kernel can unpack it; the fake takes K from the activations.
    return _dequantize(w, w_scale)


def _dequantized_weight_fake(w, w_scale, k):
    return w_scale.new_empty((w_scale.shape[0], k), dtype=torch.float32)


def _linear_setup_context(ctx, inputs, output):
    x, w, w_scale = inputs[:3]
    ctx.save_for_backward(w, w_scale)
    ctx.x_dtype, ctx.k = x.dtype, x.shape[-1]


def _straight_through(ctx, grad_out: torch.Tensor) -> torch.Tensor:
    """d loss / d x of a W8A8 layer whose ctx saved (w, w_scale), x_dtype and k: the float computation's gradient with
    the dequantized weight, in fp32, cast to x's dtype."""
    w, w_scale = ctx.saved_tensors
    weight = _ops._dequantized_weight(w, w_scale, ctx.k) if AVAILABLE else _dequantize(w, w_scale)
    return (grad_out.float() @ weight).to(ctx.x_dtype)


def _linear_backward(ctx, grad_out):
    _reject_frozen_inputs(ctx, "int8_scaled_mm_with_quant", ("x",),
                          "is differentiable w.r.t. x only (straight-through); its weight, w_scale and bias are "
                          "frozen: detach them")
    return _straight_through(ctx, grad_out), None, None, None, None, None


class StaticActivationsLinear(torch.autograd.Function):
    """int8_scaled_mm_with_activations (static and/or asymmetric activations: W8A8Linear.set_activations) with the
    dynamic layer's straight-through gradient w.r.t. x (its int8 rounding counts as the identity, zero point and
    clamp included). Without it the output carried no gradient and a residual branch through the layer dropped out of
    a model's gradient, silently."""

    @staticmethod
    def forward(ctx, x, w, w_scale, bias, input_scale, input_zero_point, symmetric, w_sum):
        ctx.save_for_backward(w, w_scale)
        ctx.x_dtype, ctx.k = x.dtype, x.shape[-1]
        return int8_scaled_mm_with_activations(x, w, w_scale, bias, input_scale=input_scale,
                                               input_zero_point=input_zero_point, symmetric=symmetric, w_sum=w_sum)

    @staticmethod
    def backward(ctx, grad_out):
        for name, needs_grad in zip(("w_scale", "bias", "input_scale", "input_zero_point"), ctx.needs_input_grad[2:6]):
            if needs_grad:
                raise ValueError(f"{name}: requires grad, but a W8A8 layer with static activations is differentiable "
                                 f"w.r.t. its input only (straight-through): detach it")
        return _straight_through(ctx, grad_out), None, None, None, None, None, None, None


# ---- fused_experts ---------------------------------------------------------------------------------------------

def _fused_experts_backward(grad_out: torch.Tensor, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_scale: torch.Tensor,
                            w2_scale: torch.Tensor,
                            apply_router_weight_on_input: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad hidden, grad topk_weights) of the float MoE with dequantized experts, expert by expert.

    Per (token t, slot j) routed to expert e, with router weight r: a = x_t (r * x_t when the weight is applied
    on the input), [g; u] = W13_e a, y = W2_e (silu(g) * u), out_t += y (r * y otherwise)."""
    on_input = apply_router_weight_on_input
    x, grad, weights = hidden.float(), grad_out.float(), topk_weights.float()
    grad_x, grad_weights = x.new_zeros(x.shape), weights.new_zeros(weights.shape)
    inter = w13_scale.shape[1] // 2
    ids = topk_ids.long()
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        r = weights[tokens, slots][:, None]
        w13_e, w2_e = _dequantize(w13[e], w13_scale[e]), _dequantize(w2[e], w2_scale[e])
        a = x[tokens] * r if on_input else x[tokens]
        gate, up = (a @ w13_e.T).split(inter, dim=1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_y = grad[tokens] if on_input else grad[tokens] * r
        grad_act = grad_y @ w2_e
        grad_gate = grad_act * up * sig * (1 + gate * (1 - sig))  # silu'(g) = sig(g) (1 + g (1 - sig(g)))
        grad_a = torch.cat([grad_gate, grad_act * silu], dim=1) @ w13_e
        if on_input:
            grad_x.index_add_(0, tokens, grad_a * r)
            grad_weights[tokens, slots] = (grad_a * x[tokens]).sum(dim=1)
        else:
            grad_x.index_add_(0, tokens, grad_a)
            grad_weights[tokens, slots] = (grad[tokens] * ((silu * up) @ w2_e.T)).sum(dim=1)
    return grad_x.to(hidden.dtype), grad_weights.to(topk_weights.dtype)


def _fused_experts_backward_fake(grad_out, hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                                 apply_router_weight_on_input):
    return hidden.new_empty(hidden.shape), topk_weights.new_empty(topk_weights.shape)


def _moe_setup_context(ctx, inputs, output):
    hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, _, apply_router_weight_on_input = inputs
    ctx.save_for_backward(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    ctx.apply_router_weight_on_input = apply_router_weight_on_input


def _moe_backward(ctx, grad_out):
    _reject_frozen_inputs(ctx, "fused_experts", ("hidden", "topk_weights"),
                          "is differentiable w.r.t. hidden and topk_weights only (straight-through); its expert "
                          "weights and scales are frozen: detach them")
    grad_hidden, grad_weights = _ops._fused_experts_backward(grad_out, *ctx.saved_tensors,
                                                             ctx.apply_router_weight_on_input)
    return grad_hidden, None, None, grad_weights, None, None, None, None, None


_INFERENCE_ONLY = "has no gradient (a layer op of the lean decode loop, for inference)"


def _refuse_gradient(op: str):
    """An Autograd-key kernel for an in-place op: ValueError naming the first input that requires grad (with grad mode
    on), else the op below autograd. Without it torch's fallback let backward through such an op run on, with a
    warning and the op's part of the gradient missing."""
    overload = getattr(_ops, op).default
    names = [arg.name for arg in overload._schema.arguments]

    def kernel(*args, **kwargs):
        if torch.is_grad_enabled():
            for name, value in [*zip(names, args), *kwargs.items()]:
                # list arguments too (decode_step_'s weights hold the norms' Parameters)
                for i, t in enumerate(value if isinstance(value, (list, tuple)) else [value]):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        where = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
                        raise ValueError(f"{where}: requires grad, but {op} {_INFERENCE_ONLY}; call it under "
                                         f"torch.no_grad() or torch.inference_mode()")
        with torch._C._AutoDispatchBelowAutograd():
            return overload(*args, **kwargs)

    return kernel


# Whether this torch can register the formulas (torch >= 2.4); without them the ops have no Python autograd kernel.
AVAILABLE = hasattr(torch.library, "register_autograd")
_library = None  # the Library holding the in-place ops' Autograd kernels (kept alive: dropping it unregisters them)


def register() -> None:
    if not AVAILABLE:
        return
    for name, fn, fake in (("_dequantized_weight", _dequantized_weight, _dequantized_weight_fake),
                           ("_fused_experts_backward", _fused_experts_backward, _fused_experts_backward_fake)):
        torch.library.custom_op(f"w8a8_cpu::{name}", fn, mutates_args=()).register_fake(fake)
    torch.library.register_autograd("w8a8_cpu::int8_scaled_mm_with_quant", _linear_backward,
                                    setup_context=_linear_setup_context)
    torch.library.register_autograd("w8a8_cpu::fused_experts", _moe_backward, setup_context=_moe_setup_context)
    torch.library.register_autograd(
        "w8a8_cpu::per_token_quant_int8",
        _no_gradient("per_token_quant_int8", f"has no gradient (int8 rounding); {_STRAIGHT_THROUGH}"))
    torch.library.register_autograd(
        "w8a8_cpu::int8_scaled_mm",
        _no_gradient("int8_scaled_mm", f"has no gradient (x_q is int8 already; scales and bias are frozen); "
                                       f"{_STRAIGHT_THROUGH}"))
    torch.library.register_autograd(
        "w8a8_cpu::int8_gated_mm_with_quant",
        _no_gradient("int8_gated_mm_with_quant", "(W8A8GatedMLP: fuse_projections) has no gradient; keep the MLP "
                                                 "unfused (W8A8Linear layers) to train through it"))
    torch.library.register_autograd(
        "w8a8_cpu::scale_accumulators",
        _no_gradient("scale_accumulators", f"has no gradient (its accumulators are int32); {_STRAIGHT_THROUGH}"))
    for op in ("rms_norm", "causal_attention"):
        torch.library.register_autograd(f"w8a8_cpu::{op}", _no_gradient(op, _INFERENCE_ONLY))
    global _library
    _library = torch.library.Library("w8a8_cpu", "IMPL")
    for op in ("add_rms_norm_", "rotary_embedding_", "decode_attention_", "decode_step_"):
        _library.impl(op, _refuse_gradient(op), "Autograd")
