"""w8a8_cpu.scheme: the presets through compressed-tensors config dicts and the blob header, validate() refusing
each combination the kernels cannot run (naming the field), and quantize_model / its layers speaking in schemes."""
import copy
import json
from dataclasses import replace

import pytest
import torch

import w8a8_cpu
from w8a8_cpu._packed_weight import header_scheme
from w8a8_cpu.nn import W4A8Linear, W8A8Linear, quantize_model
from w8a8_cpu.scheme import (DYNAMIC, GROUP_SIZE, PRESETS, W4A8, W4A8_ASYMMETRIC, W4A8_GPTQ, W4A8_MIN_MAX, W8A8,
                             W8A8_DYNAMIC_ASYMMETRIC, W8A8_STATIC, W8A8_STATIC_ASYMMETRIC, ActivationScheme,
                             QuantScheme, WeightScheme, preset_name)
from tiny_models import token_ids


def test_presets():
    assert GROUP_SIZE == 32
    assert PRESETS == {"W8A8": W8A8, "W8A8_DYNAMIC_ASYMMETRIC": W8A8_DYNAMIC_ASYMMETRIC, "W8A8_STATIC": W8A8_STATIC,
                       "W8A8_STATIC_ASYMMETRIC": W8A8_STATIC_ASYMMETRIC, "W4A8": W4A8, "W4A8_GPTQ": W4A8_GPTQ,
                       "W4A8_ASYMMETRIC": W4A8_ASYMMETRIC, "W4A8_MIN_MAX": W4A8_MIN_MAX}
    for name, scheme in PRESETS.items():
        assert scheme.validate() is scheme and preset_name(scheme) == name
    assert preset_name(QuantScheme(WeightScheme(4, 128))) is None
    assert W4A8.weights == WeightScheme(bits=4, group_size=32, symmetric=True, min_max=False, rounding="nearest")
    assert W8A8_STATIC_ASYMMETRIC.activations == ActivationScheme(static=True, symmetric=False)


@pytest.mark.parametrize("name", [n for n, s in PRESETS.items() if not s.weights.min_max])
def test_presets_round_trip_through_compressed_tensors_config_dicts(name):
    """Through JSON as a checkpoint's config group holds them; the rounding is not stored (GPTQ's codes are codes)."""
    scheme = PRESETS[name]
    group = json.loads(json.dumps(scheme.to_compressed_tensors()))
    assert group["format"] == ("pack-quantized" if scheme.weights.bits == 4 else "int-quantized")
    assert group["weights"]["num_bits"] == scheme.weights.bits and group["output_activations"] is None
    assert group["input_activations"]["dynamic"] is not scheme.activations.static
    back = QuantScheme.from_compressed_tensors(group["weights"], group["input_activations"])
    assert back == replace(scheme, weights=replace(scheme.weights, rounding="nearest"))


def test_compressed_tensors_forms_of_the_writers():
    """compressed-tensors' own spellings: per channel (group_size -1 or none), upper-case enums, defaults left out."""
    channel = QuantScheme.from_compressed_tensors({"num_bits": 4, "strategy": "CHANNEL", "group_size": -1},
                                                  {"strategy": "token", "dynamic": True})
    assert channel == QuantScheme(WeightScheme(4, 0))
    assert QuantScheme.from_compressed_tensors({"strategy": "tensor"}, {"strategy": "tensor"}) == W8A8_STATIC
    assert QuantScheme(WeightScheme(4, 0)).to_compressed_tensors()["weights"]["strategy"] == "channel"


@pytest.mark.parametrize("scheme, message", [
    (QuantScheme(WeightScheme(bits=2)), r"^bits: expected 8 \(int8 weights\) or 4"),
    (QuantScheme(WeightScheme(bits=True)), "^bits: "),
    (QuantScheme(WeightScheme(bits=8, group_size=32)), "^group_size: applies to 4-bit weights"),
    (QuantScheme(WeightScheme(bits=8, symmetric=False)), "^symmetric: applies to 4-bit weights"),
    (QuantScheme(WeightScheme(bits=8, min_max=True)), "^min_max: "),
    (QuantScheme(WeightScheme(bits=8, rounding="gptq")), "^rounding: applies to 4-bit weights"),
    (QuantScheme(WeightScheme(bits=4, group_size=48)), r"^group_size: expected 0 \(per channel\) or a power of two"),
    (QuantScheme(WeightScheme(bits=4, group_size=16)), "^group_size: "),
    (QuantScheme(WeightScheme(bits=4, group_size=1 << 17)), "^group_size: "),
    (QuantScheme(WeightScheme(bits=4, group_size=32.0)), "^group_size: "),
    (QuantScheme(WeightScheme(bits=4, min_max=True)), "^min_max: the min-max grid is asymmetric"),
    (QuantScheme(WeightScheme(bits=4, symmetric="no")), "^symmetric: expected True or False"),
    (QuantScheme(WeightScheme(bits=4, rounding="awq")), "^rounding: expected one of nearest, gptq"),
    (QuantScheme(WeightScheme(bits=4), ActivationScheme(static=True)), "^activations: int4 weights run with int8 "
                                                                       "dynamic per-token symmetric activations only"),
    (QuantScheme(WeightScheme(bits=4), ActivationScheme(symmetric=False)), "^activations: "),
    (QuantScheme(W8A8.weights, ActivationScheme(static=1)), "^static: expected True or False"),
    (QuantScheme(W8A8.weights, "token"), "^scheme: expected a WeightScheme and an ActivationScheme"),
])
def test_validate_refuses_each_illegal_combination_naming_it(scheme, message):
    with pytest.raises(ValueError, match=message):
        scheme.validate()


@pytest.mark.parametrize("weights, activations, field", [
    ({"num_bits": 8, "symmetric": False}, {}, "weights.symmetric"),
    ({"num_bits": 3}, {}, "weights.num_bits"),
    ({"num_bits": 4, "strategy": "group", "group_size": 100}, {}, "weights.group_size"),
    ({"num_bits": 4, "strategy": "group", "group_size": 32}, {"strategy": "tensor"}, "input_activations"),
    ({}, {"symmetric": "yes"}, "input_activations.symmetric"),
])
def test_from_compressed_tensors_names_the_field(weights, activations, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        QuantScheme.from_compressed_tensors(weights, {"strategy": "token", **activations})


def test_min_max_has_no_compressed_tensors_form():
    with pytest.raises(ValueError, match="^min_max: .*integer zero points"):
        W4A8_MIN_MAX.to_compressed_tensors()


@pytest.mark.parametrize("weights", [WeightScheme(), WeightScheme(4, 32), WeightScheme(4, 0, symmetric=False),
                                     WeightScheme(4, 128, symmetric=False)])
def test_header_code_maps_to_and_from_the_blob(weights):
    """The header byte pack_weight / pack_weight_int4 write, read back as the WeightScheme they were given."""
    gen = torch.Generator().manual_seed(3)
    assert WeightScheme.from_header(weights.header_code, weights.group_size) == weights
    if weights.bits == 8:
        blob = w8a8_cpu.pack_weight(torch.randint(-128, 128, (8, 256), generator=gen, dtype=torch.int8))
    else:
        q = torch.randint(-8, 8, (8, 256), generator=gen, dtype=torch.int8)
        groups = 256 // (weights.group_size or 256)
        scale = torch.rand(8, groups, generator=gen) + 0.5
        blob = w8a8_cpu.pack_weight_int4(q, scale, None if weights.symmetric else -scale * 3, weights.group_size)
    assert header_scheme(blob) == weights
    with pytest.raises(ValueError, match="scheme byte 3"):
        WeightScheme.from_header(3, 0)


def tiny(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 64), torch.nn.Linear(64, 96), torch.nn.ReLU(),
                               torch.nn.Linear(96, 64)).eval()


IDS = token_ids(50, (2, 12), seed=1)


@pytest.mark.parametrize("name", list(PRESETS))
def test_quantize_model_takes_a_scheme_and_each_layer_reports_it(name):
    scheme = PRESETS[name]
    calibration = IDS if scheme.weights.rounding == "gptq" or scheme.activations.static else None
    model = quantize_model(tiny(), scheme=scheme, calibration=calibration)
    layers = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 2 and all(layer.scheme == scheme for layer in layers)
    assert all(isinstance(layer, W4A8Linear) == (scheme.weights.bits == 4) for layer in layers)


@pytest.mark.parametrize("flags, scheme", [
    (dict(), W8A8), (dict(scheme="w4a8"), W4A8), (dict(scheme="w4a8", symmetric=False), W4A8_ASYMMETRIC),
    (dict(scheme="w4a8", symmetric=False, min_max=True), W4A8_MIN_MAX),
    (dict(scheme="w4a8", calibration=IDS), W4A8_GPTQ),
])
def test_keyword_flags_build_the_same_scheme(flags, scheme):
    """The keyword form is a way of writing a scheme: the same layers, the same outputs bit for bit."""
    by_flags = quantize_model(tiny(), **flags)
    by_scheme = quantize_model(tiny(), scheme=scheme, calibration=flags.get("calibration"))
    assert [m.scheme for m in by_flags.modules() if isinstance(m, W8A8Linear)] == [scheme, scheme]
    with torch.no_grad():
        assert torch.equal(by_flags(IDS), by_scheme(IDS))


def test_static_scheme_is_quantize_then_calibrate():
    from w8a8_cpu.quant.static_activations import calibrate_static_activations

    for scheme in (W8A8_STATIC, W8A8_STATIC_ASYMMETRIC):
        want = quantize_model(tiny())
        calibrate_static_activations(want, IDS, symmetric=scheme.activations.symmetric)
        got = quantize_model(tiny(), scheme=scheme, calibration=IDS)
        x = token_ids(50, (1, 9), seed=2)
        with torch.no_grad():
            assert torch.equal(got(x), want(x))
    asymmetric = quantize_model(tiny(), scheme=W8A8_DYNAMIC_ASYMMETRIC)
    assert [m.activation_scheme for m in asymmetric.modules() if isinstance(m, W8A8Linear)] == ["token-asymmetric"] * 2


@pytest.mark.parametrize("options, message", [
    (dict(scheme=W4A8_GPTQ), "^calibration: the scheme's GPTQ rounding need calibration inputs"),
    (dict(scheme=W8A8_STATIC), "^calibration: the scheme's static activations need"),
    (dict(scheme=W8A8, calibration=IDS), "^calibration: the scheme rounds to nearest"),
    (dict(scheme=W4A8, group_size=64), "^group_size: the QuantScheme given as scheme states it"),
    (dict(scheme=QuantScheme(WeightScheme(4, 48))), "^group_size: expected"),
    (dict(scheme="w3a8"), "^scheme: expected one of w8a8, w4a8 or a QuantScheme"),
])
def test_quantize_model_refuses_before_replacing_anything(options, message):
    model = tiny()
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=message):
        quantize_model(model, **options)
    assert all(type(a) is type(b) for a, b in zip(model.modules(), before.modules()))


def test_a_layer_built_by_hand_reports_what_it_holds():
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-8, 8, (8, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(8, 2, generator=gen) + 0.5
    assert W4A8Linear(q, scale, -scale * 2, 32).scheme == W4A8_ASYMMETRIC
    assert W4A8Linear(q, scale, None, 32, weights=W4A8_GPTQ.weights).scheme == W4A8_GPTQ
    with pytest.raises(ValueError, match="^weights: .* does not describe int4 values in groups of 32, symmetric"):
        W4A8Linear(q, scale, None, 32, weights=W4A8_ASYMMETRIC.weights)
    layer = W8A8Linear(torch.randint(-128, 128, (8, 64), generator=gen, dtype=torch.int8), torch.rand(8) + 0.5)
    assert layer.scheme == W8A8 and layer.scheme.activations == DYNAMIC
    layer.set_activations(torch.tensor([0.1]))
    assert layer.scheme == W8A8_STATIC
