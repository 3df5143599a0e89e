"""What quantize_model, its calibration and the layers' load_state_dict refuse instead of answering wrong: experts
whose forward does more than silu(gate) * up (DeepSeek-V4's swiglu_limit clamp), GPT-2's Conv1D layers (left float
under a "W8A8" model), an int8 embedding whose tied lm_head is kept float (silently untied), options that would be
ignored, calibration batches the model cannot run, and packed blobs of another layer. Tiny models built from configs
(no download); the accepted cases are checked against the float model."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from w8a8_cpu.nn import W4A8Experts, W4A8Linear, W8A8Embedding, W8A8Experts, W8A8Linear, quantize_model  # noqa: E402
from w8a8_cpu.nn.probes import computes_plain_silu_experts  # noqa: E402
from tiny_models import tiny_causal_lm, token_ids  # noqa: E402

transformers.logging.set_verbosity_error()
LLAMA = dict(vocab_size=300, max_position_embeddings=64)  # the tiny Llama of these tests (tiny_causal_lm)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


class Block(torch.nn.Module):
    """An experts module where a model holds it (any container), with a Linear before it."""

    def __init__(self, experts):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)
        self.experts = experts

    def forward(self, h, ids, weights):
        return self.experts(self.proj(h), ids, weights)


def deepseek_v4_experts(limit=None):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    config = transformers.DeepseekV4Config(hidden_size=64, intermediate_size=64, num_local_experts=4,
                                           hidden_act="silu")
    if limit is not None:
        config.swiglu_limit = limit
    return random_experts(modeling_deepseek_v4.DeepseekV4Experts, config, "eager")


def mixtral_experts(implementation="grouped_mm"):
    from transformers.models.mixtral import modeling_mixtral

    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=64, num_local_experts=4)
    return random_experts(modeling_mixtral.MixtralExperts, config, implementation)


def random_experts(cls, config, implementation):
    """cls(config) with weights of std 0.5 (pre-activations past a clamp of 10 for a few % of them), run by
    transformers' experts backend `implementation`."""
    config._experts_implementation = implementation
    torch.manual_seed(0)
    experts = cls(config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.5)
    torch.nn.init.normal_(experts.down_proj, std=0.5)
    return experts


def routing(tokens=16):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(tokens, 64, generator=gen), torch.randint(0, 4, (tokens, 2), generator=gen),
            torch.softmax(torch.randn(tokens, 2, generator=gen), dim=-1))


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_clamping_experts_are_refused_and_kept_float_when_skipped(scheme):
    """DeepSeek-V4's experts clamp gate and up at swiglu_limit; the fused experts computed plain silu(gate) * up
    (relative error 0.08 w8a8 here, 0.78 on larger weights, instead of 0.02). Refused, naming the layer, before any
    layer is replaced; skipped, they stay float and the model computes what it did."""
    block = Block(deepseek_v4_experts()).eval()
    inputs = routing()
    with torch.no_grad():
        want = block(*inputs)
    with pytest.raises(ValueError, match=r"^experts: experts: DeepseekV4Experts computes more than silu\(gate\) \* up"
                                         r".*skip it"):
        quantize_model(block, scheme=scheme)
    assert type(block.proj) is torch.nn.Linear  # the model is left whole
    kept = quantize_model(copy.deepcopy(block), skip=["*experts"], scheme=scheme)
    assert type(kept.experts).__name__ == "DeepseekV4Experts"
    assert isinstance(kept.proj, W8A8Linear)
    with torch.no_grad():
        got = kept(*inputs)
    assert 0 < rel(got, want) < (0.03 if scheme == "w8a8" else 0.15)  # the error of the int8 / int4 proj only
    for build in (W8A8Experts.from_experts, W4A8Experts.from_experts):
        with pytest.raises(ValueError, match="computes more than silu"):
            build(block.experts)


def test_the_same_experts_without_a_clamp_are_quantized_and_close_to_float():
    """With swiglu_limit = inf the clamp does nothing and the probe finds the plain form: quantized, and the W8A8
    experts follow the float module (which is what the refusal above protects)."""
    block = Block(deepseek_v4_experts(limit=float("inf"))).eval()
    inputs = routing()
    with torch.no_grad():
        want = block(*inputs)
        quantized = quantize_model(copy.deepcopy(block))
        got = quantized(*inputs)
    assert isinstance(quantized.experts, W8A8Experts)
    assert rel(got, want) < 0.03


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_probe_accepts_plain_experts_under_every_backend_and_restores_the_config(implementation):
    """Mixtral's experts under each transformers backend (batched_mm's bmm rounds otherwise than F.linear: the probe
    runs the eager loop), and the config's choice is left as it was."""
    experts = mixtral_experts(implementation)
    assert computes_plain_silu_experts(experts, experts.gate_up_proj[0], experts.down_proj[0])
    assert experts.config._experts_implementation == implementation
    block = Block(experts).eval()
    inputs = routing()
    with torch.no_grad():
        want = block(*inputs)
        got = quantize_model(copy.deepcopy(block))(*inputs)
    assert rel(got, want) < 0.03


def test_probe_runs_on_experts_whose_parameters_are_on_the_meta_device():
    """The checkpoint loader's case: the module built on meta, one expert's float weights from the checkpoint."""
    with torch.device("meta"):
        clamped, plain = deepseek_v4_experts(), mixtral_experts()
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(128, 64, generator=gen), torch.randn(64, 64, generator=gen)
    assert computes_plain_silu_experts(plain, gate_up, down)
    assert not computes_plain_silu_experts(clamped, gate_up, down)
    assert plain.gate_up_proj.is_meta and clamped.gate_up_proj.is_meta


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def test_gpt2_conv1d_layers_are_refused_unless_skipped():
    """GPT-2's Conv1D layers are no nn.Linear: quantize_model left them float and the model was "W8A8" in name only
    (the CLI reported success). Refused, naming the first; skipped, the model stays the float one."""
    model = gpt2()
    with pytest.raises(ValueError, match=r"^transformer\.h\.0\.attn\.c_attn: Conv1D .* not supported"):
        quantize_model(model, skip=["lm_head"])
    assert type(model.lm_head) is torch.nn.Linear
    ids = token_ids(300, (1, 8), seed=1)
    kept = quantize_model(copy.deepcopy(model), skip=lambda name, module: type(module).__name__ == "Conv1D")
    assert isinstance(kept.lm_head, W8A8Linear)
    with torch.no_grad():
        assert rel(kept(ids).logits, model(ids).logits) < 0.02


def test_int8_embedding_with_its_tied_lm_head_skipped_is_refused():
    """quantize_embedding with the tied lm_head kept float untied them silently (an int8 table and the float one,
    the config still tied). Refused before anything is replaced; quantizing both shares one table."""
    model = tiny_causal_lm(tied=True, **LLAMA)
    with pytest.raises(ValueError, match=r"^quantize_embedding: lm_head is tied .*quantize_embedding=False"):
        quantize_model(model, skip=["lm_head"], quantize_embedding=True)
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert type(model.get_input_embeddings()) is torch.nn.Embedding
    ids = token_ids(300, (1, 8), seed=1)
    shared = quantize_model(copy.deepcopy(model), quantize_embedding=True)
    assert shared.get_input_embeddings().weight_packed is shared.lm_head.weight_packed
    with torch.no_grad():
        assert rel(shared(ids).logits, model(ids).logits) < 0.05
    untied = quantize_model(tiny_causal_lm(**LLAMA), skip=["lm_head"], quantize_embedding=True)
    assert isinstance(untied.get_input_embeddings(), W8A8Embedding) and type(untied.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("options, argument", [
    (dict(scheme="w4a8", min_max=True), "min_max"),  # symmetric=True by default: min_max was ignored
    (dict(scheme="w4a8", symmetric="no"), "symmetric"),  # a truthy string was taken as True
    (dict(scheme="w4a8", symmetric=False, min_max=1), "min_max"),
    (dict(scheme="w4a8", group_size=48), "group_size"),
    (dict(fuse="no"), "fuse"),
    (dict(quantize_embedding=1), "quantize_embedding"),
    (dict(group_size=64), "group_size"),  # int4 options under w8a8: ignored
    (dict(symmetric=False), "symmetric"),
    (dict(min_max=True), "min_max"),
])
def test_options_that_would_be_ignored_are_refused(options, argument):
    model = tiny_causal_lm(tied=True, **LLAMA)
    with pytest.raises(ValueError, match=rf"^{argument}: "):
        quantize_model(model, skip=["lm_head"], **options)
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear


def test_the_main_jobs_options_stay_valid_and_min_max_applies():
    """cli/llm.py's quantize_for_job with each of the job's schemes; min_max with symmetric=False rounds otherwise
    than symmetric."""
    from w8a8_cpu.cli.llm import quantize_for_job
    from w8a8_cpu.scheme import W4A8, W4A8_MIN_MAX

    model = tiny_causal_lm(tied=True, **LLAMA)
    ids = token_ids(300, (1, 8), seed=1)
    with torch.no_grad():
        want = model(ids).logits
        w8a8 = quantize_for_job(copy.deepcopy(model), False)(ids).logits
        w8a8_head = quantize_for_job(copy.deepcopy(model), True)(ids).logits
        min_max = quantize_for_job(copy.deepcopy(model), True, scheme=W4A8_MIN_MAX)
        symmetric = quantize_for_job(copy.deepcopy(model), True, scheme=W4A8)
    assert isinstance(min_max.model.layers[0].mlp.down_proj, W4A8Linear)
    assert rel(w8a8, want) < 0.02 and rel(w8a8_head, want) < 0.05
    with torch.no_grad():
        got_min_max, got_symmetric = min_max(ids).logits, symmetric(ids).logits
    assert rel(got_min_max, want) < 0.3 and rel(got_symmetric, want) < 0.3
    assert not torch.equal(got_min_max, got_symmetric)
    with pytest.raises(ValueError, match="^min_max: "):
        W4A8Linear.from_linear(torch.nn.Linear(64, 8), min_max=True)


@pytest.mark.parametrize("batches, message", [
    (torch.randn(2, 8), r"batch 0: the model cannot run it: RuntimeError"),  # float ids: the model's own error
    ([torch.randint(0, 300, (1, 8)), torch.full((1, 8), 300)], r"batch 1: token ids must be in \[0, 300\) "
                                                                r"\(config\.vocab_size\), got \[300, 300\]"),
    (torch.full((1, 8), -1), r"batch 0: token ids must be in \[0, 300\)"),
    ([torch.randint(0, 300, (1, 8)), torch.zeros(2, 2, 2, 2, dtype=torch.long)], r"batch 1: the model cannot run it"),
])
def test_calibration_batches_the_model_cannot_run_are_value_errors(batches, message):
    """Float ids or ids past the table failed deep in the embedding (RuntimeError, IndexError), naming no batch."""
    with pytest.raises(ValueError, match=rf"^calibration: {message}"):
        quantize_model(tiny_causal_lm(tied=True, **LLAMA), skip=["lm_head"], scheme="w4a8", calibration=batches)


def test_calibration_of_a_model_without_a_vocabulary_takes_float_inputs_and_names_the_failing_batch():
    """Tensor batches are checked as token ids only for a language model (config.vocab_size); any model's failure on
    a batch names it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"^calibration: batch 1: the model cannot run it: RuntimeError"):
        quantize_model(copy.deepcopy(model), scheme="w4a8", calibration=[x, torch.randn(4, 48)])
    gptq = quantize_model(copy.deepcopy(model), scheme="w4a8", calibration=x)
    with torch.no_grad():
        assert rel(gptq(x), model(x)) < 0.15


def int8_layer(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return W8A8Linear(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
                      torch.rand(n, generator=gen) + 0.1)


def int4_layer(n, k, group, minimums, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = k // (group or k)
    scale = torch.rand(n, groups, generator=gen) + 0.1
    return W4A8Linear(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen), scale,
                      -scale * 8 if minimums else None, group)


@pytest.mark.parametrize("layer, donor, holds", [
    (int8_layer(64, 64), int8_layer(32, 132), r"an int8 \[32, 132\] weight"),  # the same byte count
    (int8_layer(64, 64), int8_layer(57, 64), r"an int8 \[57, 64\] weight"),  # the same panel count
    (int8_layer(64, 64), int4_layer(64, 128, 0, False), r"an int4 \[64, 128\] weight per channel, symmetric"),
    (int4_layer(64, 64, 64, True), int4_layer(64, 64, 32, False),
     r"an int4 \[64, 64\] weight in groups of 32, symmetric"),
    (int4_layer(64, 64, 32, False), int8_layer(64, 64), r"an int8 \[64, 64\] weight"),
])
def test_load_state_dict_refuses_a_blob_of_another_layer(layer, donor, holds):
    """load_state_dict checks only byte counts, which these blobs share with the layer's: the load passed and
    forward failed later (or, for another group size, ran the donor's weights under this layer's group_size)."""
    model = torch.nn.Sequential(layer)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    before = model(x)
    state = model.state_dict()
    state["0.weight_packed"] = donor.weight_packed
    if state["0.weight_packed"].numel() == layer.weight_packed.numel():
        with pytest.raises(ValueError, match=rf"^0\.weight_packed: holds {holds}; this {type(layer).__name__}"):
            model.load_state_dict(state)
    else:
        with pytest.raises((ValueError, RuntimeError)):
            model.load_state_dict(state)
    assert torch.equal(model(x), before)


@pytest.mark.parametrize("make", [lambda seed: int8_layer(64, 64, seed), lambda seed: int4_layer(64, 64, 32, True,
                                                                                                 seed)])
def test_load_state_dict_of_a_layer_of_the_same_form_takes_its_weights(make):
    layer, donor = make(0), make(1)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    layer.load_state_dict(donor.state_dict())
    assert torch.equal(layer(x), donor(x))
    with pytest.raises(ValueError, match=r"^weight_packed: blob: "):
        layer.load_state_dict({**donor.state_dict(), "weight_packed": torch.zeros_like(donor.weight_packed)})
