"""transformers MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) under quantize_model: the fused-experts modules become
W8A8Experts, the model's own router keeps routing, and the W8A8 logits stay close to the float model's.
Tiny random models built from configs (no download)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import w8a8_cpu  # noqa: E402
from w8a8_cpu import reference  # noqa: E402
from w8a8_cpu.nn import W8A8Experts, quantize_model  # noqa: E402

pytestmark = pytest.mark.slow_under_emulation
transformers.logging.set_verbosity_error()

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)
CONFIGS = {
    "mixtral": dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                      num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                      head_dim=16),
}
SKIP = ["lm_head", "*.gate", "*shared_expert_gate"]


def tiny(arch):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(arch, **COMMON, **CONFIGS[arch])
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_w8a8_moe_model_close_to_float(arch):
    model = tiny(arch)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids).logits
    quantized = quantize_model(copy.deepcopy(model), skip=SKIP)
    experts = [m for m in quantized.modules() if isinstance(m, W8A8Experts)]
    assert len(experts) == 2  # one per layer, in place of the float experts
    assert not any(isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter) for m in quantized.modules())
    with torch.inference_mode():
        got = quantized(ids).logits
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.05, rel  # measured 0.008-0.018 (per-token int8 activations, per-channel int8 weights)


def test_w8a8_experts_match_the_reference_moe():
    """W8A8Experts is fused_experts on the routing the model's own router chose: compare one layer's experts with
    the reference MoE (exact integer matmuls; only the SiLU differs, as in test_moe.py)."""
    model = tiny("mixtral")
    block = model.model.layers[0].mlp
    hidden = torch.randn(10, 64, generator=torch.Generator().manual_seed(2))
    _, weights, ids = block.gate(hidden)
    layer = W8A8Experts.from_experts(block.experts)
    w13, w2 = layer.int8_weights()
    want = reference.fused_experts(hidden, w13, w2, weights.float(), ids, layer.w13_scale, layer.w2_scale)
    got = layer(hidden, ids, weights)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_non_silu_experts_are_refused():
    model = tiny("mixtral")
    experts = model.model.layers[0].mlp.experts
    experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="SiLU-gated experts only"):
        W8A8Experts.from_experts(experts)
