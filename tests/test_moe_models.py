"""transformers MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) under quantize_model: the fused-experts modules become
W8A8Experts (W4A8Experts with scheme="w4a8"), the model's own router keeps routing, and the logits stay close to the
float model's (W4A8: to the float model with the same dequantized int4 weights). Tiny random models built from
configs (no download)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import w8a8_cpu  # noqa: E402
from w8a8_cpu import reference  # noqa: E402
from w8a8_cpu.nn import W4A8Experts, W4A8Linear, W8A8Experts, quantize_model  # noqa: E402
from tiny_models import LLM_SKIP, MOE_ARCHITECTURES, logits, tiny_causal_lm, token_ids  # noqa: E402

pytestmark = pytest.mark.slow_under_emulation
transformers.logging.set_verbosity_error()


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_w8a8_moe_model_close_to_float(arch):
    model = tiny_causal_lm(arch)
    ids = token_ids(shape=(2, 24), seed=1)
    want = logits(model, ids)
    quantized = quantize_model(copy.deepcopy(model), skip=LLM_SKIP)
    experts = [m for m in quantized.modules() if isinstance(m, W8A8Experts)]
    assert len(experts) == 2  # one per layer, in place of the float experts
    assert not any(isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter) for m in quantized.modules())
    got = logits(quantized, ids)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.05, rel  # measured 0.008-0.018 (per-token int8 activations, per-channel int8 weights)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("group_size,symmetric,min_max", [(32, True, False), (0, False, False), (64, False, True)])
def test_w4a8_moe_model_close_to_its_dequantized_float_model(arch, group_size, symmetric, min_max):
    """scheme="w4a8" makes the experts W4A8Experts (and the Linear layers W4A8Linear). Against the float model
    holding the same int4 weights dequantized (w = (scale * q (+ min)) * channel scale), the one remaining difference
    is the per-token int8 rounding of each GEMM's input (step amax / 127: ~0.3-1% of a row's rms per GEMM) and the
    routing flips it may cause through the float routers. Measured 0.005-0.008 relative (both architectures, every
    form); the bound is 2.5x the worst of that, an order of magnitude below the int4 weight rounding itself (~0.1 from
    the float model)."""
    model = tiny_causal_lm(arch)
    ids = token_ids(shape=(2, 24), seed=1)
    quantized = quantize_model(copy.deepcopy(model), skip=LLM_SKIP, scheme="w4a8", group_size=group_size,
                               symmetric=symmetric, min_max=min_max)
    fake_quantized = model
    experts = 0
    for name, module in quantized.named_modules():
        if isinstance(module, W4A8Experts):
            experts += 1
            float_experts = fake_quantized.get_submodule(name)
            for param, blobs, scales in (("gate_up_proj", module.w13_packed, module.w13_scale),
                                         ("down_proj", module.w2_packed, module.w2_scale)):
                getattr(float_experts, param).data = torch.stack(
                    [w8a8_cpu.dequantized_weight(blob, scale) for blob, scale in zip(blobs, scales)])
        elif isinstance(module, W4A8Linear):
            fake_quantized.get_submodule(name).weight.data = w8a8_cpu.dequantized_weight(module.weight_packed,
                                                                                         module.w_scale)
    assert experts == 2
    got, want = logits(quantized, ids), logits(fake_quantized, ids)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.02, rel


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_experts_module_equals_the_reference_moe(scheme):
    """W8A8Experts / W4A8Experts is fused_experts on the routing the model's own router chose: one layer's experts
    equal the reference MoE (exact integer matmuls, the ops' SiLU and order) bit for bit."""
    model = tiny_causal_lm("mixtral")
    block = model.model.layers[0].mlp
    hidden = torch.randn(10, 64, generator=torch.Generator().manual_seed(2))
    _, weights, ids = block.gate(hidden)
    if scheme == "w8a8":
        layer = W8A8Experts.from_experts(block.experts)
        w13, w2 = layer.int8_weights()
    else:
        layer = W4A8Experts.from_experts(block.experts, 32, symmetric=False)
        w13, w2 = layer.int4_weights()
        assert w13[0].shape == (4, 192, 64) and w13[1].shape == (4, 192, 2) and w2[1].shape == (4, 64, 3)
        with pytest.raises(ValueError, match="use int4_weights"):
            layer.int8_weights()
    want = reference.fused_experts(hidden, w13, w2, weights.float(), ids, layer.w13_scale, layer.w2_scale)
    assert torch.equal(layer(hidden, ids, weights), want)


def test_non_silu_experts_are_refused():
    model = tiny_causal_lm("mixtral")
    experts = model.model.layers[0].mlp.experts
    experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="SiLU-gated experts only"):
        W8A8Experts.from_experts(experts)
