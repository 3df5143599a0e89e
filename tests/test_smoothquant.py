"""SmoothQuant: the smoothed float model computes the same function, and its W8A8 model is closer to fp32."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from w8a8_cpu.nn import quantize_model  # noqa: E402
from w8a8_cpu.quant.calibration import CallRecorder  # noqa: E402
from w8a8_cpu.quant.smoothquant import calibrate_smoothing, smooth_quant  # noqa: E402
from w8a8_cpu.quant.smoothquant_pairs import run_recorded  # noqa: E402
from tiny_models import LLM_SKIP, logits, tiny_causal_lm, token_ids  # noqa: E402

transformers.logging.set_verbosity_error()

SIZES = dict(intermediate_size=128, max_position_embeddings=64)  # tiny_causal_lm's, beyond its TINY
ARCHITECTURES = {  # and each architecture's
    "llama": {},
    "qwen2": {},  # q/k/v biases: v_proj's bias is divided by the o_proj scale too
    "qwen3": {},  # q_norm / k_norm act after q/k_proj
    "mixtral": {},
    "qwen2_moe": dict(moe_intermediate_size=64, shared_expert_intermediate_size=64),
    "qwen3_moe": dict(moe_intermediate_size=64, mlp_only_layers=[1]),  # one MoE and one dense layer
}
# The smoothed weights differ from the originals by one fp32 rounding each (relative 6e-8); through two layers,
# softmax and norms the logits then move by about 1e-6 of their largest value, so 1e-5 leaves a margin of ~4x
# while any mis-folded channel (a factor s of 0.01..100) would show as an O(1) change.
FP32_TOLERANCE = 1e-5


def outlier_model(model_type):
    model = tiny_causal_lm(model_type, **SIZES, **ARCHITECTURES[model_type])
    with torch.no_grad():  # outliers like trained LLMs have: a few norm channels, a few up_proj outputs
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param[[3, 17, 40]] *= 50
            elif name.endswith("up_proj.weight"):
                param[[5, 9]] *= 20
            elif name.endswith("experts.gate_up_proj"):
                param[:, param.shape[1] // 2 + 5] *= 20
    return model


def relative_max_change(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def w8a8_error(model, ids, reference):
    quantized = quantize_model(copy.deepcopy(model), skip=LLM_SKIP)
    return ((logits(quantized, ids) - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_smoothing_keeps_the_float_function_and_helps_w8a8(model_type):
    model = outlier_model(model_type)
    ids = token_ids(shape=(2, 32), seed=2)
    reference = logits(model, ids)
    smoothed = copy.deepcopy(model)
    report = smooth_quant(smoothed, token_ids(shape=(4, 32), seed=1), alpha=0.5)

    change = relative_max_change(logits(smoothed, ids), reference)
    assert change < FP32_TOLERANCE and report.logit_drift < FP32_TOLERANCE, (change, report.logit_drift)
    assert report.tokens == 128 and {entry.layer for entry in report.inputs} == {0, 1}
    assert all(entry.outlier_after < entry.outlier_before for entry in report.inputs), str(report)
    assert "input_layernorm" in str(report)
    plain, with_smoothing = w8a8_error(model, ids, reference), w8a8_error(smoothed, ids, reference)
    print(f"{model_type}: smoothed fp32 logits change {change:.1e}; W8A8 logits relative error "
          f"{plain:.4f} without smoothing, {with_smoothing:.4f} with")
    assert with_smoothing < 0.75 * plain


def test_batches_iterable_equals_one_tensor():
    calibration = token_ids(shape=(4, 32), seed=1)
    whole, split = outlier_model("qwen3_moe"), outlier_model("qwen3_moe")
    smooth_quant(whole, calibration)
    report = smooth_quant(split, iter([calibration[:1], calibration[1:]]))
    assert report.tokens == calibration.numel()
    # The same running maxima; only the float GEMMs round differently for other batch shapes.
    for (name, got), want in zip(split.state_dict().items(), whole.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda detail: f"{name}: {detail}")


class ToyBlock(torch.nn.Module):
    def __init__(self, norm=None, act=torch.relu):
        super().__init__()
        self.norm = norm or torch.nn.LayerNorm(16)  # a bias too: divided by s with the weight
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)
        self.act = act

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


class Toy(torch.nn.Module):
    def __init__(self, **block):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleList([ToyBlock(**block), ToyBlock(**block)])
        with torch.no_grad():
            for block in self.layers:
                if block.norm.weight is not None:
                    block.norm.weight[[2, 7]] *= 30
                block.up.weight[[4]] *= 30

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return x


def test_explicit_mappings_on_a_toy_model():
    model, ids = Toy(), token_ids(shape=(2, 32), seed=2) % 64
    reference = model(ids).detach()
    report = smooth_quant(model, token_ids(shape=(2, 32), seed=1) % 64, alpha=0.6,
                          mappings=[("norm", ["up"]), ("up", ["down"])])
    assert relative_max_change(model(ids).detach(), reference) < FP32_TOLERANCE
    assert [(entry.layer, entry.producer) for entry in report.inputs] == [(0, "norm"), (0, "up"), (1, "norm"),
                                                                         (1, "up")]
    assert all(entry.outlier_before > 10 > entry.outlier_after for entry in report.inputs), str(report)
    derived = Toy()
    derived_report = smooth_quant(derived, token_ids(shape=(2, 32), seed=1) % 64, alpha=0.6)  # ReLU: up -> down folds
    assert [(entry.layer, entry.producer, entry.consumers) for entry in derived_report.inputs] == \
        [(entry.layer, entry.producer, entry.consumers) for entry in report.inputs]
    assert derived_report.not_smoothed == ()
    for got, want in zip(derived.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_a_model_with_nothing_to_fold_says_why():
    model = Toy(norm=torch.nn.LayerNorm(16, elementwise_affine=False), act=torch.nn.functional.gelu)
    weights = copy.deepcopy(model.state_dict())
    # A norm without a weight has nothing to divide by s; GELU is not homogeneous: up -> down does not fold.
    with pytest.raises(ValueError, match="no SmoothQuant pair folds exactly into Toy \\(up, down: reads no norm's "
                                         "output, and no Linear's output folds into it\\)"):
        smooth_quant(model, token_ids(shape=(2, 32), seed=1) % 64)
    assert all(torch.equal(model.state_dict()[name], want) for name, want in weights.items())


@pytest.mark.parametrize("mappings, message", [
    ([("norm", ["up"]), ("norm", ["upp"])], "match no decoder layer.*upp"),
    ([("norm", ["up"]), ("norm", ["down"])], "two pairs apply to producer norm"),
    ([("norm", ["down"])], "norm makes 16 channels but \\['down'\\] read 32"),
    ([("up", ["up", "down"])], "read different numbers of input channels"),
    ([("up", ["norm"])], "consumer layer 0 norm \\(LayerNorm\\) is not a Linear"),
    ([("act", ["up"])], "producer layer 0 act \\(ReLU\\) is not a norm"),
])
def test_bad_mappings(mappings, message):
    model = Toy()
    model.layers[0].act = torch.nn.ReLU()  # a module without weights: nothing to divide by s
    with pytest.raises(ValueError, match=message):
        smooth_quant(model, token_ids(shape=(2, 32), seed=1) % 64, mappings=mappings)


@pytest.mark.parametrize("alpha, calibration, message", [
    (-0.1, token_ids(shape=(2, 32), seed=1), "alpha"),
    (1.5, token_ids(shape=(2, 32), seed=1), "alpha"),
    (0.5, [], "calibration: no batches"),
    (0.5, torch.empty(0, 8, dtype=torch.long), "calibration"),
    (0.5, torch.zeros(2, 8), "calibration"),
    (0.5, token_ids(shape=(2, 32), seed=1)[0], "calibration"),
])
def test_bad_arguments(alpha, calibration, message):
    model = Toy()
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message):
        smooth_quant(model, calibration, alpha=alpha, mappings=[("norm", ["up"])])
    assert all(torch.equal(model.state_dict()[name], want) for name, want in weights.items())


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_grouped_scales_scale_each_weight_group_as_one(model_type):
    # group_size: every weight SmoothQuant touches is multiplied by one factor over each aligned group of 16 along
    # its input channels (consumers: s; norms, producer rows and biases: 1/s), so an int4 group on a grid stays on one
    group = 16  # SIZES: hidden 64, intermediate 128, experts 64, head_dim 16 (o_proj reads repeated v heads)
    model = outlier_model(model_type)
    before = copy.deepcopy(model.state_dict())
    report = smooth_quant(model, token_ids(shape=(4, 32), seed=1), alpha=0.85, group_size=group)
    assert report.group_size == group and report.logit_drift < FP32_TOLERANCE and "in groups of 16" in str(report)
    changed = 0
    for name, after in model.state_dict().items():
        if torch.equal(after, before[name]):
            continue
        changed += 1
        ratio = (after / before[name]).reshape(*after.shape[:-1], -1, group)
        assert torch.allclose(ratio, ratio[..., :1].expand_as(ratio), rtol=1e-6, atol=0), name
    assert changed >= 12, changed  # per layer: 2 norms, v and up (or experts) rows, and the consumers' columns
    per_channel = outlier_model(model_type)
    smooth_quant(per_channel, token_ids(shape=(4, 32), seed=1), alpha=0.85)
    weight = "model.layers.0.self_attn.q_proj.weight"
    ratio = (per_channel.state_dict()[weight] / before[weight]).reshape(64, -1, group)
    assert not torch.allclose(ratio, ratio[..., :1].expand_as(ratio), rtol=1e-3)  # per channel, they differ


@pytest.mark.parametrize("group_size, message", [
    (32, r"group_size: layer 0: self_attn.o_proj reads 64 channels in heads of 16, not in whole groups of 32"),
    (24, r"group_size: layer 0: .* reads 64 channels, not in whole groups of 24"),
    (0, "group_size: expected None or an int >= 1"),
    (True, "group_size: expected None or an int >= 1"),
    (16.0, "group_size: expected None or an int >= 1"),
])
def test_bad_group_size_changes_nothing(group_size, message):
    model = outlier_model("llama")
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message):
        smooth_quant(model, token_ids(shape=(2, 32), seed=1), group_size=group_size)
    assert all(torch.equal(model.state_dict()[name], want) for name, want in weights.items())


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_one_calibration_serves_several_copies(model_type):
    """calibrate_smoothing measures once (the model left as it is); smooth_quant(copy, statistics=...) then gives
    each unsmoothed copy exactly the weights smooth_quant with the calibration itself gives, per channel and in
    groups, with the same report but for its timings."""
    model = outlier_model(model_type)
    before = copy.deepcopy(model.state_dict())
    ids = token_ids(shape=(4, 32), seed=1)
    statistics = calibrate_smoothing(model, ids)
    assert all(torch.equal(model.state_dict()[name], want) for name, want in before.items())
    assert statistics.tokens == ids.numel()
    for alpha, group in ((0.5, None), (0.85, 16)):
        direct, reused = outlier_model(model_type), copy.deepcopy(model)
        want = smooth_quant(direct, ids, alpha=alpha, group_size=group)
        got = smooth_quant(reused, alpha=alpha, group_size=group, statistics=statistics)
        for name, tensor in direct.state_dict().items():
            assert torch.equal(reused.state_dict()[name], tensor), (alpha, name)
        assert got.inputs == want.inputs and got.not_smoothed == want.not_smoothed and got.tokens == want.tokens
        assert got.logit_drift == want.logit_drift < FP32_TOLERANCE


def test_statistics_arguments_are_checked():
    model = outlier_model("llama")
    ids = token_ids(shape=(2, 32), seed=1)
    statistics = calibrate_smoothing(model, ids)
    with pytest.raises(ValueError, match="calibration: give calibration token ids or statistics"):
        smooth_quant(copy.deepcopy(model), ids, statistics=statistics)
    with pytest.raises(ValueError, match="calibration: give calibration token ids or statistics"):
        smooth_quant(copy.deepcopy(model))
    with pytest.raises(ValueError, match="mappings: the statistics hold the pairs"):
        smooth_quant(copy.deepcopy(model), statistics=statistics, mappings=[("input_layernorm", ["self_attn.q_proj"])])
    with pytest.raises(ValueError, match="statistics: expected calibrate_smoothing's SmoothingStatistics"):
        smooth_quant(copy.deepcopy(model), statistics={"x": 1})
    other = outlier_model("qwen3_moe")  # another layer structure: the measured consumers are not there
    weights = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match="statistics: layer 0"):
        smooth_quant(other, statistics=statistics)
    assert all(torch.equal(other.state_dict()[name], want) for name, want in weights.items())
    wider = tiny_causal_lm("llama", **SIZES, num_hidden_layers=3)
    with pytest.raises(ValueError, match="statistics: measured on a model of 2 decoder layers, this one has 3"):
        smooth_quant(wider, statistics=statistics)


def with_output_outliers(model):
    with torch.no_grad():  # the final norm's output as trained LLMs have it: a few channels far larger
        model.model.norm.weight[[2, 30]] *= 40
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_output_layer_smoothing_keeps_the_function_and_one_table(tied, tmp_path):
    """output_alpha folds the final norm into the lm_head; tied to the embedding, the shared table's columns are
    scaled and the embedding reads them back through a column scale: the same function, one table, float and int8."""
    from w8a8_cpu.llm.checkpoint import save_compressed
    from w8a8_cpu.nn import ColumnScaledEmbedding, W8A8Embedding
    model = with_output_outliers(tiny_causal_lm("llama", tied=tied, **SIZES))
    ids, calibration = token_ids(shape=(2, 32), seed=2), token_ids(shape=(4, 32), seed=1)
    reference = logits(model, ids)
    statistics = calibrate_smoothing(model, calibration)
    assert statistics.output_site_missing == ""
    smoothed = copy.deepcopy(model)
    report = smooth_quant(smoothed, alpha=0.5, statistics=statistics, output_alpha=0.3)
    output_entry = [entry for entry in report.inputs if entry.layer is None]
    assert [(e.producer, e.consumers) for e in output_entry] == [("model.norm", ("lm_head",))]
    assert output_entry[0].outlier_after < output_entry[0].outlier_before / 2, str(report)
    assert "  out " in str(report) and "output layer alpha=0.3" in str(report)
    assert relative_max_change(logits(smoothed, ids), reference) < FP32_TOLERANCE > report.logit_drift
    embedding = smoothed.get_input_embeddings()
    assert isinstance(embedding, ColumnScaledEmbedding) == tied
    assert (smoothed.lm_head.weight is embedding.weight) == tied
    twice = copy.deepcopy(smoothed)  # smoothed again: the column scales compose
    smooth_quant(twice, calibration, alpha=0.5, output_alpha=0.5)
    assert relative_max_change(logits(twice, ids), reference) < 2 * FP32_TOLERANCE

    def int8_error(float_model):  # the int8 output layer and embedding alone, the layers float
        quantized = quantize_model(copy.deepcopy(float_model), lambda name, module: name != "lm_head",
                                   quantize_embedding=True)
        return quantized, ((logits(quantized, ids) - reference).norm() / reference.norm()).item()
    layers_only = copy.deepcopy(model)
    smooth_quant(layers_only, alpha=0.5, statistics=statistics)
    (_, without), (quantized, with_output) = int8_error(layers_only), int8_error(smoothed)
    print(f"tied={tied}: int8 lm_head logits relative error {without:.4f} without output smoothing, "
          f"{with_output:.4f} with")
    assert with_output < 0.75 * without
    table = quantized.get_input_embeddings()
    assert isinstance(table, W8A8Embedding) and (table.weight_packed is quantized.lm_head.weight_packed) == tied
    want = embedding(ids).float() if tied else model.get_input_embeddings()(ids)
    got = table(ids)  # int8 rows * row scale * column scale: the float embedding within the table's rounding
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.02
    if tied:
        assert torch.equal(table.column_scale, embedding.column_scale)
        assert torch.equal(table.dequantized()[ids], got)
        for holder in (smoothed, quantized):  # float readers would tie lm_head to the scaled table: refused
            with pytest.raises(ValueError, match="column scale .*cannot express"):
                save_compressed(holder, tmp_path / "ckpt")


def test_output_layer_smoothing_needs_a_norm_in_front():
    model = with_output_outliers(outlier_model("llama"))
    model.model.norm = torch.nn.Identity()
    statistics = calibrate_smoothing(model, token_ids(shape=(2, 32), seed=1))
    assert statistics.output_site_missing == "lm_head reads no norm's output"
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="output_alpha: the output layer cannot be smoothed: lm_head reads no norm"):
        smooth_quant(model, statistics=statistics, output_alpha=0.3)
    with pytest.raises(ValueError, match=r"output_alpha: must be None or in \[0, 1\], got 1.5"):
        smooth_quant(model, statistics=statistics, output_alpha=1.5)
    assert all(torch.equal(model.state_dict()[name], want) for name, want in weights.items())
    smooth_quant(model, statistics=statistics)  # the layers' pairs still fold


def test_an_embedding_that_computes_more_than_a_lookup_is_refused():
    """Gemma 3 scales its embedding's rows inside the embedding module: an int8 table, or a column scale wrapped
    around the plain lookup, would drop that scale, so both are refused."""
    model = tiny_causal_lm("gemma3_text", tied=True, head_dim=16, **SIZES)
    assert type(model.get_input_embeddings()).__name__ == "Gemma3TextScaledWordEmbedding"
    with pytest.raises(ValueError, match="computes more than a row lookup"):
        quantize_model(copy.deepcopy(model), quantize_embedding=True)
    statistics = calibrate_smoothing(model, token_ids(shape=(2, 32), seed=1))
    with pytest.raises(ValueError, match="output_alpha: the output layer is tied to Gemma3TextScaledWordEmbedding"):
        smooth_quant(copy.deepcopy(model), statistics=statistics, output_alpha=0.3)


def test_recording_hooks_are_removed_when_attaching_fails_partway():
    """An attacher appends each hook as it makes it: one that fails after its first hook leaves none behind; two
    forward wrappers on one module come off last first, so the module's own forward is back."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    calls = []

    def attach_two_then_fail(handles):
        handles.append(model[0].register_forward_hook(lambda *args: None))
        handles.append(model[1].register_forward_pre_hook(lambda *args: None))
        raise RuntimeError("attach failed")

    def wrap_first_layer(handles):
        handles.append(CallRecorder(model[0], lambda *args: calls.append(1)))

    with pytest.raises(RuntimeError, match="attach failed"):
        run_recorded(model, torch.randn(2, 8), [lambda handles: handles.append(
            model[1].register_forward_hook(lambda *args: None)), wrap_first_layer, wrap_first_layer,
            attach_two_then_fail])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert "forward" not in model[0].__dict__
    run_recorded(model, torch.randn(2, 8), [wrap_first_layer, wrap_first_layer])
    assert calls == [1, 1] and "forward" not in model[0].__dict__
