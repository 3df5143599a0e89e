"""SmoothQuant derives its pairs from the model: on a tiny random model of each decoder architecture transformers
ships, the float function stays (logits within 1e-5 of their range), exactly the expected pairs are smoothed, and
every other Linear / router / experts input is reported with the reason."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from w8a8_cpu.quant.smoothquant import smooth_quant  # noqa: E402
from tiny_models import tiny_causal_lm, token_ids  # noqa: E402

transformers.logging.set_verbosity_error()

SIZES = dict(vocab_size=128, intermediate_size=128, max_position_embeddings=64, pad_token_id=0)  # beyond TINY
MOE = dict(moe_intermediate_size=64, mlp_only_layers=[1])  # MoE, then dense
# See tests/test_smoothquant.py: one fp32 rounding per folded weight moves the logits by ~1e-6 of their range.
FP32_TOLERANCE = 1e-5

# The table SmoothQuant held for the 7 types it knew before it derived its pairs: the same pairs must be found.
_ATTENTION = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
              ("self_attn.v_proj", ("self_attn.o_proj",)))
_DENSE_MLP = (("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")), ("mlp.up_proj", ("mlp.down_proj",)))
_ROUTED_EXPERTS = (("post_attention_layernorm", ("mlp.gate", "mlp.experts")), ("mlp.experts", ("mlp.experts",)))
_SHARED_EXPERT_MOE = (("post_attention_layernorm", ("mlp.gate", "mlp.experts", "mlp.shared_expert.gate_proj",
                                                    "mlp.shared_expert.up_proj", "mlp.shared_expert_gate")),
                      ("mlp.experts", ("mlp.experts",)),
                      ("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",)))
FORMER_TABLE = {
    "llama": _ATTENTION + _DENSE_MLP,
    "mistral": _ATTENTION + _DENSE_MLP,
    "qwen2": _ATTENTION + _DENSE_MLP,
    "qwen3": _ATTENTION + _DENSE_MLP,
    "mixtral": _ATTENTION + _ROUTED_EXPERTS,
    "qwen3_moe": _ATTENTION + _DENSE_MLP + _ROUTED_EXPERTS,
    "qwen2_moe": _ATTENTION + _DENSE_MLP + _SHARED_EXPERT_MOE,
}

V_O, UP_DOWN = ("self_attn.v_proj", ("self_attn.o_proj",)), ("mlp.up_proj", ("mlp.down_proj",))
NOT_FOLDABLE = "reads no norm's output, and no Linear's output folds into it"
# Norms after the projections (OLMo 2 / 3, EXAONE 4): q/k/v read the layer input, gate/up the residual after attention.
NORMS_AFTER = {("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
               "reads the layer input (the residual stream): no norm in front",
               ("mlp.gate_proj", "mlp.up_proj"): NOT_FOLDABLE}
UP_ONLY = _ATTENTION + (("post_attention_layernorm", ("mlp.up_proj",)),)  # ReLU^2 / xIELU MLPs: not homogeneous
PRE_FEEDFORWARD = _ATTENTION + (("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")), UP_DOWN)
FUSED_GATE_UP = (("post_attention_layernorm", ("mlp.gate_up_proj",)), ("mlp.gate_up_proj", ("mlp.down_proj",)))

# model_type: (config beyond SIZES and tiny_models.ARCHITECTURES, the pairs expected (each where the layer holds its
# modules), not smoothed)
ARCHITECTURES = {
    "llama": ({}, FORMER_TABLE["llama"], {}),
    "mistral": ({}, FORMER_TABLE["mistral"], {}),
    "qwen2": ({}, FORMER_TABLE["qwen2"], {}),  # biases on q/k/v: v_proj's is divided too
    "qwen3": ({}, FORMER_TABLE["qwen3"], {}),  # q_norm / k_norm after q/k_proj feed no Linear
    "mixtral": ({}, FORMER_TABLE["mixtral"], {}),
    "qwen2_moe": (dict(MOE, shared_expert_intermediate_size=64), FORMER_TABLE["qwen2_moe"], {}),
    "qwen3_moe": (MOE, FORMER_TABLE["qwen3_moe"], {}),
    "phi3": ({}, (("input_layernorm", ("self_attn.qkv_proj",)), ("self_attn.qkv_proj", ("self_attn.o_proj",)))
             + FUSED_GATE_UP, {}),  # fused: the v rows of qkv_proj, the up half of gate_up_proj
    "glm4": ({}, _ATTENTION + FUSED_GATE_UP, {}),
    "olmo2": ({}, (V_O, UP_DOWN), NORMS_AFTER),
    "olmo3": ({}, (V_O, UP_DOWN), NORMS_AFTER),
    "exaone4": ({}, (V_O, UP_DOWN), NORMS_AFTER),
    "granite": ({}, FORMER_TABLE["llama"], {}),
    "granitemoe": ({}, _ATTENTION + (("post_attention_layernorm", ("block_sparse_moe.router", "block_sparse_moe.experts")),
                                     ("block_sparse_moe.experts", ("block_sparse_moe.experts",))), {}),
    "olmoe": (dict(num_experts=4, num_experts_per_tok=2), FORMER_TABLE["mixtral"], {}),
    "gemma": (dict(head_dim=16), FORMER_TABLE["llama"], {}),  # RMSNorm scaling by (1 + weight)
    "gemma2": (dict(head_dim=16), PRE_FEEDFORWARD, {}),
    "gemma3_text": (dict(head_dim=16), PRE_FEEDFORWARD, {}),
    "cohere": ({}, (("input_layernorm", _ATTENTION[0][1] + _DENSE_MLP[0][1]), V_O, UP_DOWN), {}),  # parallel blocks
    "stablelm": ({}, FORMER_TABLE["llama"], {}),  # LayerNorm with a bias
    "nemotron": ({}, UP_ONLY, {("mlp.down_proj",): NOT_FOLDABLE}),  # LayerNorm1P: (1 + weight) and a bias
    "arcee": ({}, UP_ONLY, {("mlp.down_proj",): NOT_FOLDABLE}),
    "phi": ({}, (("input_layernorm", _ATTENTION[0][1] + ("mlp.fc1",)), ("self_attn.v_proj", ("self_attn.dense",))),
            {("mlp.fc2",): NOT_FOLDABLE}),  # GELU
    "starcoder2": ({}, _ATTENTION + (("post_attention_layernorm", ("mlp.c_fc",)),), {("mlp.c_proj",): NOT_FOLDABLE}),
    # q/k/v interleaved per head in one Linear: no block of its rows is v.
    "gpt_neox": ({}, (("input_layernorm", ("attention.query_key_value",)),
                      ("post_attention_layernorm", ("mlp.dense_h_to_4h",))),
                 {("attention.dense", "mlp.dense_4h_to_h"): NOT_FOLDABLE}),
    # Multi-head latent attention: norms inside attention feed q_b_proj / kv_b_proj; v comes interleaved with k.
    "deepseek_v3": (dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
                    (("input_layernorm", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
                     ("self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
                     ("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",))) + _DENSE_MLP + (
                        ("post_attention_layernorm", ("mlp.gate", "mlp.experts", "mlp.shared_experts.gate_proj",
                                                      "mlp.shared_experts.up_proj")),
                        ("mlp.experts", ("mlp.experts",)),
                        ("mlp.shared_experts.up_proj", ("mlp.shared_experts.down_proj",))),
                    {("self_attn.o_proj",): NOT_FOLDABLE}),
    "falcon": (dict(num_kv_heads=2, new_decoder_architecture=True),
               (("ln_attn", ("self_attention.query_key_value",)), ("ln_mlp", ("mlp.dense_h_to_4h",))),
               {("self_attention.dense", "mlp.dense_4h_to_h"): NOT_FOLDABLE}),
}


INPUT_NORMS = tuple(f"{name}.weight" for name in ("input_layernorm", "post_attention_layernorm",
                                                   "pre_feedforward_layernorm", "ln_attn", "ln_mlp"))


def trained_norms_model(model_type):
    model = tiny_causal_lm(model_type, **{**SIZES, **ARCHITECTURES[model_type][0]})
    with torch.no_grad():  # norm weights away from their initial 0 or 1; outlier channels in those before Linears
        for name, param in model.named_parameters():
            if param.dim() == 1 and ("norm" in name or ".ln_" in name) and name.endswith(".weight"):
                param.add_(torch.randn(param.shape) * 0.3)
            if name.endswith(INPUT_NORMS):
                param[[3, 9]] *= 20
    return model


def decoder_layers(model):
    return next(module for name, module in model.named_modules()
                if isinstance(module, torch.nn.ModuleList) and name.rpartition(".")[2] in ("layers", "h"))


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_derived_pairs_keep_the_function_and_cover_every_linear(model_type):
    _, expected_table, expected_not_smoothed = ARCHITECTURES[model_type]
    expected = {(producer, frozenset(consumers)) for producer, consumers in expected_table}
    model = trained_norms_model(model_type)
    ids = token_ids(SIZES["vocab_size"], (2, 24), seed=2)
    with torch.no_grad():
        reference = model(ids).logits
    calibration = token_ids(SIZES["vocab_size"], (2, 32), seed=1)
    report = smooth_quant(model, calibration)
    with torch.no_grad():
        change = ((model(ids).logits - reference).abs().max() / reference.abs().max()).item()
    assert change < FP32_TOLERANCE and report.logit_drift < FP32_TOLERANCE, (change, str(report))

    used = set()
    for index, layer in enumerate(decoder_layers(model)):
        modules = dict(layer.named_modules())
        applies = {(producer, consumers) for producer, consumers in expected
                   if producer in modules and consumers <= modules.keys()}
        found = {(entry.producer, frozenset(entry.consumers)) for entry in report.inputs if entry.layer == index}
        assert found == applies, (index, str(report))
        used |= applies
        # Every Linear, router and experts module reads a smoothed input or is reported with its reason.
        smoothed = {name for _, consumers in found for name in consumers}
        reported = {name for entry in report.not_smoothed if index in entry.layers for name in entry.consumers}
        readers = {name for name, module in modules.items() if isinstance(getattr(module, "gate_up_proj", None),
                                                                           torch.Tensor)
                   or isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 2}
        assert smoothed | reported == readers and not smoothed & reported, (index, str(report))
    assert used == expected, "an expected pair applies to no layer"
    assert {entry.consumers: entry.reason for entry in report.not_smoothed} == expected_not_smoothed, str(report)
    assert all(entry.layers == (0, 1) and f"layers 0-1: {', '.join(entry.consumers)}: {entry.reason}" in str(report)
               for entry in report.not_smoothed)
    # The outlier channels put into the norms shrink wherever a norm is smoothed.
    assert all(entry.outlier_after < entry.outlier_before for entry in report.inputs
               if entry.producer.endswith("norm") or entry.producer.startswith("ln_")), str(report)


@pytest.mark.parametrize("model_type", ["olmo2", "phi3"])
def test_a_bf16_model_is_checked_in_fp32_and_stays_bf16(model_type):
    # In bf16, a right fold's rounding (~1e-2) would hide gate -> down's small error on a tiny model's small gates.
    model = trained_norms_model(model_type).to(torch.bfloat16)
    report = smooth_quant(model, token_ids(SIZES["vocab_size"], (2, 32), seed=1))
    found = {(entry.producer, frozenset(entry.consumers)) for entry in report.inputs}
    assert found == {(producer, frozenset(consumers)) for producer, consumers in ARCHITECTURES[model_type][1]}
    assert {tensor.dtype for tensor in model.state_dict().values() if tensor.is_floating_point()} == {torch.bfloat16}
    assert report.logit_drift < 0.1  # bf16 rounding of the folded weights


def test_an_architecture_where_nothing_folds_says_why():
    # GPT-2's Conv1D keeps its weight [in, out]; its MLP is GELU.
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"no SmoothQuant pair folds exactly into GPT2LMHeadModel \(attn\.c_attn: reads "
                                         r"ln_1's output, but the weight of attn\.c_attn is not \[out, in\]; .*"
                                         r"attn\.c_proj, mlp\.c_proj: reads no norm's output"):
        smooth_quant(model, torch.randint(0, 64, (1, 16)))
    assert all(torch.equal(model.state_dict()[name], want) for name, want in weights.items())
