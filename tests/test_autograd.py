"""Gradients through the ops: straight-through w.r.t. the float activations (int8_scaled_mm_with_quant / W8A8Linear:
x; fused_experts / W8A8MoE: hidden and the router weights), checked against autograd through the same float
computation on the dequantized weights (w_int8 * w_scale). Ops or inputs without a gradient raise ValueError on
backward, naming the input, instead of leaving the upstream gradients None."""
import pytest
import torch

import w8a8_cpu
from test_moe import make_int4_moe, make_moe
from tiny_models import dequantized_int8

pytestmark = pytest.mark.skipif(not hasattr(torch.library, "register_autograd"),
                                reason=f"autograd formulas need torch >= 2.4 (this is torch {torch.__version__})")

# Ours and the reference are the same fp32 math in a different summation order.
FP32_TOL = dict(rtol=1e-5, atol=1e-4)


def float_moe(hidden, w13, w2, topk_weights, topk_ids, on_input=False):
    """The MoE the straight-through gradient differentiates: float experts w13 [E, 2I, H], w2 [E, H, I]."""
    inter = w13.shape[1] // 2
    rows = []
    for t in range(hidden.shape[0]):
        acc = torch.zeros(hidden.shape[1])
        for j in range(topk_ids.shape[1]):
            e, r = topk_ids[t, j], topk_weights[t, j]
            gate, up = (w13[e] @ (hidden[t] * r if on_input else hidden[t])).split(inter)
            y = w2[e] @ (torch.nn.functional.silu(gate) * up)
            acc = acc + (y if on_input else r * y)
        rows.append(acc)
    return torch.stack(rows)


# ---- int8_scaled_mm_with_quant / W8A8Linear ----------------------------------------------------------------------

@pytest.mark.parametrize("packed", [False, True], ids=["raw", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_input_grad_matches_float_linear(dtype, packed, gen):
    w_q, w_scale = w8a8_cpu.quantize_weight(torch.randn(24, 40, generator=gen))
    bias = torch.randn(24, generator=gen)
    x = torch.randn(2, 5, 40, generator=gen).to(dtype).requires_grad_()
    y = w8a8_cpu.int8_scaled_mm_with_quant(x, w8a8_cpu.pack_weight(w_q) if packed else w_q, w_scale, bias)
    assert y.requires_grad
    grad_out = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(grad_out)
    x_float = x.detach().float().requires_grad_()
    torch.nn.functional.linear(x_float, dequantized_int8(w_q, w_scale), bias).backward(grad_out.float())
    assert x.grad.dtype == dtype and x.grad.shape == x.shape
    # bf16: the fp32 gradient is rounded once to bf16, where a summation-order difference can move it one step.
    tol = FP32_TOL if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-4)
    torch.testing.assert_close(x.grad.float(), x_float.grad.to(dtype).float(), **tol)


def test_module_before_a_w8a8_linear_learns(gen):
    torch.manual_seed(0)
    first, last = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
    model = torch.nn.Sequential(first, torch.nn.ReLU(), w8a8_cpu.nn.W8A8Linear.from_linear(last))
    w_q, w_scale = w8a8_cpu.quantize_weight(last.weight)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    reference[0].load_state_dict(first.state_dict())
    reference[2].weight.data, reference[2].bias.data = dequantized_int8(w_q, w_scale), last.bias.detach().clone()
    x = torch.randn(6, 16, generator=gen)
    model(x).sum().backward()  # d loss / d out = 1: the same upstream gradient as the float model's
    reference(x).sum().backward()
    assert first.weight.grad is not None and first.bias.grad is not None
    torch.testing.assert_close(first.weight.grad, reference[0].weight.grad, **FP32_TOL)
    torch.testing.assert_close(first.bias.grad, reference[0].bias.grad, **FP32_TOL)
    assert all(b.grad is None for b in model[2].buffers())


@pytest.mark.parametrize("frozen", ["w_scale", "bias"])
def test_linear_frozen_input_requiring_grad_raises(frozen, gen):
    w_q, w_scale = w8a8_cpu.quantize_weight(torch.randn(8, 16, generator=gen))
    args = dict(w_scale=w_scale, bias=torch.randn(8, generator=gen))
    args[frozen].requires_grad_()
    y = w8a8_cpu.int8_scaled_mm_with_quant(torch.randn(3, 16, generator=gen, requires_grad=True), w_q, **args)
    with pytest.raises(ValueError, match=f"^{frozen}: requires grad, but int8_scaled_mm_with_quant is "
                                         f"differentiable w.r.t. x only"):
        y.sum().backward()


def test_ops_without_gradient_raise_on_backward(gen):
    x = torch.randn(4, 16, generator=gen, requires_grad=True)
    x_q, x_scale = w8a8_cpu.per_token_quant_int8(x)
    assert not x_q.requires_grad and x_scale.requires_grad
    with pytest.raises(ValueError, match="^x: requires grad, but per_token_quant_int8 has no gradient.*"
                                         "int8_scaled_mm_with_quant"):
        x_scale.sum().backward()
    w_q, w_scale = w8a8_cpu.quantize_weight(torch.randn(8, 16, generator=gen))
    y = w8a8_cpu.int8_scaled_mm(x_q, w_q, x_scale.detach().requires_grad_(), w_scale)
    with pytest.raises(ValueError, match="^x_scale: requires grad, but int8_scaled_mm has no gradient.*"
                                         "int8_scaled_mm_with_quant"):
        y.sum().backward()


def test_gated_mlp_backward_raises_instead_of_dropping_the_branch(gen):
    """W8A8GatedMLP's op had no autograd kernel: x.grad came back None and a model's MLP branch left its gradient,
    with only torch's generic warning."""
    mlp = torch.nn.Module()
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = (torch.nn.Linear(16, 24), torch.nn.Linear(16, 24),
                                                 torch.nn.Linear(24, 16))
    mlp.act_fn = torch.nn.SiLU()
    fused = w8a8_cpu.nn.W8A8GatedMLP.from_mlp(mlp)
    x = torch.randn(3, 16, generator=gen, requires_grad=True)
    with pytest.raises(ValueError, match="^x: requires grad, but int8_gated_mm_with_quant .* has no gradient; keep "
                                         "the MLP unfused"):
        (x + fused(x)).sum().backward()
    with torch.no_grad():  # inference as before
        assert not fused(x).requires_grad


@pytest.mark.parametrize("scale,zero_point,symmetric", [
    (0.02, None, True), (None, None, False), (0.02, 3, False)], ids=["tensor", "token-asymmetric", "tensor-asymmetric"])
def test_static_and_asymmetric_activations_have_the_straight_through_gradient(scale, zero_point, symmetric, gen):
    """A W8A8Linear with static or asymmetric activations gave an output without gradient: in a residual block
    x.grad came out as exactly 1, the layer's part missing, silently. Now its gradient is the dynamic layer's."""
    linear = torch.nn.Linear(16, 16)
    layer = w8a8_cpu.nn.W8A8Linear.from_linear(linear)
    layer.set_activations(None if scale is None else torch.tensor([scale]),
                          None if zero_point is None else torch.tensor([zero_point], dtype=torch.int32), symmetric)
    x = torch.randn(5, 16, generator=gen, requires_grad=True)
    (x + layer(x)).sum().backward()
    w_q, w_scale = w8a8_cpu.quantize_weight(linear.weight)
    x_float = x.detach().clone().requires_grad_()
    (x_float + torch.nn.functional.linear(x_float, dequantized_int8(w_q, w_scale), linear.bias)).sum().backward()
    torch.testing.assert_close(x.grad, x_float.grad, **FP32_TOL)


@pytest.mark.parametrize("frozen", ["w_scale", "bias", "input_scale"])
def test_static_activations_frozen_buffer_requiring_grad_raises(frozen, gen):
    """A static-activation layer whose only tensor requiring grad was w_scale, bias or input_scale skipped the
    autograd node: the output carried no gradient and that buffer's .grad stayed None, silently."""
    layer = w8a8_cpu.nn.W8A8Linear.from_linear(torch.nn.Linear(16, 8))
    layer.set_activations(torch.tensor([0.02]))
    getattr(layer, frozen).requires_grad_()
    y = layer(torch.randn(3, 16, generator=gen))
    assert y.requires_grad
    with pytest.raises(ValueError, match=f"^{frozen}: requires grad, but a W8A8 layer with static activations is "
                                         f"differentiable w.r.t. its input only"):
        y.sum().backward()


def test_no_grad_inputs_give_outputs_without_grad(gen):
    w_q, w_scale = w8a8_cpu.quantize_weight(torch.randn(8, 16, generator=gen))
    assert not w8a8_cpu.int8_scaled_mm_with_quant(torch.randn(3, 16, generator=gen), w_q, w_scale).requires_grad


# ---- fused_experts / W8A8MoE -------------------------------------------------------------------------------------

@pytest.mark.parametrize("experts", ["raw", "packed", "int4"])
@pytest.mark.parametrize("on_input,topk", [(False, 2), (True, 1)], ids=["weight-on-output", "weight-on-input"])
def test_fused_experts_grads_match_float_moe(on_input, topk, experts, gen):
    """int4 experts: the float MoE on their dequantized weights ((scale * q + min) * channel scale)."""
    if experts == "int4":
        a = make_int4_moe(6, 64, 32, 4, topk, gen, 32, "zero_point", dtype=torch.float32)
        w13, w2 = a["w13"], a["w2"]
        float_w13, float_w2 = (torch.stack([w8a8_cpu.dequantized_weight(b, s) for b, s in zip(a[w], a[f"{w}_scale"])])
                               for w in ("w13", "w2"))
    else:
        a = make_moe(6, 64, 32, 4, topk, gen, dtype=torch.float32)
        w13, w2 = w8a8_cpu.pack_moe_weights(a["w13"], a["w2"]) if experts == "packed" else (a["w13"], a["w2"])
        float_w13, float_w2 = dequantized_int8(a["w13"], a["w13_scale"]), dequantized_int8(a["w2"], a["w2_scale"])
    hidden, weights = a["hidden"].requires_grad_(), a["topk_weights"].requires_grad_()
    out = w8a8_cpu.fused_experts(hidden, w13, w2, weights, a["topk_ids"], a["w13_scale"], a["w2_scale"], "silu",
                                 on_input)
    grad_out = torch.randn(out.shape, generator=gen)
    out.backward(grad_out)
    hidden_f, weights_f = hidden.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    float_moe(hidden_f, float_w13, float_w2, weights_f, a["topk_ids"], on_input).backward(grad_out)
    torch.testing.assert_close(hidden.grad, hidden_f.grad, **FP32_TOL)
    torch.testing.assert_close(weights.grad, weights_f.grad, **FP32_TOL)


def test_w8a8_moe_passes_gradients_to_input_and_router(gen):
    e, h, inter = 4, 32, 16
    w13, w2 = torch.randn(e, 2 * inter, h, generator=gen) * 0.1, torch.randn(e, h, inter, generator=gen) * 0.1
    moe = w8a8_cpu.nn.W8A8MoE.from_float(w13, w2, top_k=2)
    x = torch.randn(5, h, generator=gen, requires_grad=True)
    logits = torch.randn(5, e, generator=gen, requires_grad=True)
    grad_out = torch.randn(5, h, generator=gen)
    moe(x, logits).backward(grad_out)
    x_f, logits_f = x.detach().clone().requires_grad_(), logits.detach().clone().requires_grad_()
    weights, ids = moe.route(logits_f)
    float_moe(x_f, expert_weights_as_quantized(w13), expert_weights_as_quantized(w2), weights, ids).backward(grad_out)
    torch.testing.assert_close(x.grad, x_f.grad, **FP32_TOL)
    torch.testing.assert_close(logits.grad, logits_f.grad, **FP32_TOL)


def expert_weights_as_quantized(w):
    """Float experts [E, N, K] -> the dequantized weights a W8A8MoE built from them holds (per output channel)."""
    w_q, w_scale = w8a8_cpu.quantize_weight(w.reshape(-1, w.shape[-1]))
    return dequantized_int8(w_q, w_scale).reshape(w.shape)


def test_fused_experts_frozen_scales_raise(gen):
    a = make_moe(3, 64, 32, 4, 2, gen, dtype=torch.float32)
    out = w8a8_cpu.fused_experts(a["hidden"].requires_grad_(), a["w13"], a["w2"], a["topk_weights"], a["topk_ids"],
                                 a["w13_scale"].requires_grad_(), a["w2_scale"])
    with pytest.raises(ValueError, match="^w13_scale: requires grad, but fused_experts is differentiable w.r.t. "
                                         "hidden and topk_weights only"):
        out.sum().backward()


# ---- torch.compile and opcheck -----------------------------------------------------------------------------------

@pytest.mark.slow_under_emulation  # inductor needs a host C++ compiler for the target
def test_compiled_backward_matches_eager(gen):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    model[2] = w8a8_cpu.nn.W8A8Linear.from_linear(model[2])  # packed weight: unpacked by the backward's own op
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    for m in (5, 9):  # a second M: the backward is traced with the fake kernels again
        x = torch.randn(m, 32, generator=gen)
        model.zero_grad()
        model(x).square().sum().backward()
        eager = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        compiled(x).square().sum().backward()
        for want, p in zip(eager, model.parameters()):
            torch.testing.assert_close(p.grad, want, **FP32_TOL)


def test_compiled_moe_backward_matches_eager(gen):
    moe = w8a8_cpu.nn.W8A8MoE.from_float(torch.randn(4, 64, 32, generator=gen) * 0.05,
                                         torch.randn(4, 32, 32, generator=gen) * 0.05, top_k=2)
    x = torch.randn(6, 32, generator=gen, requires_grad=True)
    logits = torch.randn(6, 4, generator=gen, requires_grad=True)
    moe(x, logits).sum().backward()
    eager = x.grad.clone(), logits.grad.clone()
    x.grad = logits.grad = None
    torch.compile(moe, backend="aot_eager", fullgraph=True)(x, logits).sum().backward()
    torch.testing.assert_close(x.grad, eager[0], rtol=0, atol=0)
    torch.testing.assert_close(logits.grad, eager[1], rtol=0, atol=0)


def test_opcheck_with_gradients(gen):
    """opcheck's autograd-registration and AOT-dispatch (dynamic shapes, backward included) tests."""
    w_q, w_scale = w8a8_cpu.quantize_weight(torch.randn(24, 40, generator=gen))
    packed = w8a8_cpu.pack_weight(w_q)
    x = torch.randn(5, 40, generator=gen, requires_grad=True)
    for w in (w_q, packed):
        torch.library.opcheck(torch.ops.w8a8_cpu.int8_scaled_mm_with_quant.default, (x, w, w_scale, None, None))
    torch.library.opcheck(torch.ops.w8a8_cpu._dequantized_weight.default, (packed, w_scale, 40))
    a = make_moe(5, 64, 32, 4, 2, gen, dtype=torch.float32)
    w13, w2 = w8a8_cpu.pack_moe_weights(a["w13"], a["w2"])
    moe_args = (a["hidden"], w13, w2, a["topk_weights"], a["topk_ids"], a["w13_scale"], a["w2_scale"])
    torch.library.opcheck(torch.ops.w8a8_cpu.fused_experts.default,
                          (a["hidden"].requires_grad_(), *moe_args[1:3], a["topk_weights"].requires_grad_(),
                           *moe_args[4:]))
    torch.library.opcheck(torch.ops.w8a8_cpu._fused_experts_backward.default,
                          (torch.randn(5, 64, generator=gen), *(t.detach() for t in moe_args), False))
