"""Static and asymmetric int8 activations (issue #23): W8A8Linear with a checkpoint's static per-tensor input_scale
(symmetric, or with an input_zero_point) or with dynamic per-token asymmetric activations. Exact against the fp64
reference on every variant, non-finite rows, bad parameters, state_dict, fusion and sharding refusals, and
compressed-tensors checkpoints: our own round trip, one written by the compressed-tensors library, malformed ones."""
import json
import os
import re
import shutil

import pytest
import torch

import w8a8_cpu
from w8a8_cpu import reference
from w8a8_cpu._functions import MAX_K_ZERO_POINT, quantize_activations, weight_channel_sums
from w8a8_cpu.nn import W8A8Linear, fuse_projections, quantize_model
from tiny_models import logits, tiny_causal_lm, token_ids

STATIC = dict(input_scale=torch.tensor([0.04]))
STATIC_ASYMMETRIC = dict(input_scale=torch.tensor([0.05]), input_zero_point=torch.tensor([-20]),
                         symmetric_activations=False)
DYNAMIC_ASYMMETRIC = dict(symmetric_activations=False)
SCHEMES = {"tensor": STATIC, "tensor-asymmetric": STATIC_ASYMMETRIC, "token-asymmetric": DYNAMIC_ASYMMETRIC}


def inputs(m, k, seed, dtype=torch.float32):
    """Rows with an offset and a spread, some beyond the static ranges above (clipped to -128 / 127)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 2.5 + torch.linspace(-3, 3, m)[:, None]).to(dtype)


def expected_quantization(x, kwargs):
    """The rule spelled out: static scale s (zero point z or 0), or per row lo/hi widened to 0, s = (hi - lo) / 255,
    z = -128 - round(lo / s); q = clamp(round(x / s) + z, -128, 127), fp32 division."""
    x32 = x.float()
    if "input_scale" in kwargs:
        scale = kwargs["input_scale"].float().expand(x.shape[0])
        zero = kwargs.get("input_zero_point", torch.tensor([0])).expand(x.shape[0]).to(torch.int32)
    else:
        low, high = x32.amin(1).clamp(max=0), x32.amax(1).clamp(min=0)
        scale = ((high - low) / 255).clamp_min(1e-10)
        zero = (-128 - torch.round(low / scale)).clamp(-128, 127).to(torch.int32)
    q = (torch.round(x32 / scale[:, None]) + zero[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale, zero


def expected_output(x, w_q, w_scale, bias, kwargs):
    """The fp64 reference: exact integer sum of (q - zp) * w, then the ops' fp32 epilogue."""
    q, scale, zero = expected_quantization(x, kwargs)
    return reference.int8_scaled_mm(q.to(torch.int32) - zero[:, None], w_q, scale, w_scale, bias, x.dtype)


def layer_parts(n, k, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    w_q, w_scale = w8a8_cpu.quantize_weight(torch.randn(n, k, generator=g))
    return w_q, w_scale, torch.randn(n, generator=g) if bias else None


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantization_rule(scheme):
    kwargs = SCHEMES[scheme]
    x = inputs(9, 70, seed=1)
    x[3] = 0.0  # an all-zero row: scale at its floor, q = zero point
    q, scale, zero = quantize_activations(x, kwargs.get("input_scale"), kwargs.get("input_zero_point"),
                                          kwargs.get("symmetric_activations", True))
    want_q, want_scale, want_zero = expected_quantization(x, kwargs)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)
    assert q.dtype == torch.int8 and scale.shape == (9,)
    if scheme == "tensor":
        assert zero is None
        assert int(q.min()) == -128 and int(q.max()) == 127  # the inputs reach past the static range: clipped
    else:
        assert torch.equal(zero, want_zero)
    if scheme == "token-asymmetric":
        # each row's whole range is on the grid: the dequantized values are within half a step, and 0 is exact
        error = ((q.float() - zero[:, None].float()) * scale[:, None] - x).abs()
        assert (error <= scale[:, None] * 0.5 + 1e-6).all()
        assert torch.equal(q[3], zero[3].to(torch.int8).expand(70)) and float(scale[3]) == pytest.approx(1e-10)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (7, 40, 67), (33, 24, 200)])
def test_linear_exact_on_every_variant(variant, scheme, m, n, k):
    w_q, w_scale, bias = layer_parts(n, k, seed=m)
    kwargs = SCHEMES[scheme]
    layer = W8A8Linear(w_q, w_scale, bias, **kwargs)
    assert layer.activation_scheme == scheme and f"activations={scheme}" in repr(layer)
    for dtype in (torch.float32, torch.bfloat16):
        x = inputs(m, k, seed=k, dtype=dtype)
        out = layer(x.reshape(1, m, k))
        assert out.dtype == dtype and out.shape == (1, m, n)
        assert torch.equal(out[0], expected_output(x, w_q, w_scale, bias, kwargs)), dtype


@pytest.mark.parametrize("scheme", SCHEMES)
def test_close_to_float_within_the_range(scheme):
    """Inside the static range (no clipping) every scheme is as accurate as int8 allows: error well under 1% of the
    output range."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    x = inputs(16, 128, seed=4).clamp(-4.5, 4.5)  # within 127 * 0.04 and the asymmetric [-5.4, 7.4]
    layer = W8A8Linear(*w8a8_cpu.quantize_weight(w), **SCHEMES[scheme])
    want = x @ w.T
    assert (layer(x) - want).abs().max() <= 0.01 * want.abs().max()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_non_finite_rows(scheme, monkeypatch):
    w_q, w_scale, bias = layer_parts(8, 32, seed=5)
    layer = W8A8Linear(w_q, w_scale, bias, **SCHEMES[scheme])
    x = inputs(4, 32, seed=6)
    x[1, 3], x[2, 0] = float("nan"), float("inf")
    out = layer(x)
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    clean = [0, 3]
    assert torch.equal(out[clean], expected_output(x[clean], w_q, w_scale, bias, SCHEMES[scheme]))
    monkeypatch.setenv("W8A8_CPU_CHECK_FINITE", "1")
    with pytest.raises(ValueError, match="x: row 1 contains NaN or Inf"):
        layer(x)


BAD_PARAMETERS = [
    (dict(input_scale=torch.tensor([0.0])), "input_scale: expected one finite float > 0, got 0.0"),
    (dict(input_scale=torch.tensor([-1.0])), "input_scale: expected one finite float > 0"),
    (dict(input_scale=torch.tensor([float("nan")])), "input_scale: expected one finite float > 0"),
    (dict(input_scale=torch.tensor([1.0, 2.0])), "input_scale: expected one finite float > 0, got Tensor"),
    (dict(input_scale=torch.tensor([1])), "input_scale: expected one finite float > 0"),
    (dict(input_scale=torch.tensor([0.1]), symmetric_activations=False), "input_zero_point: static activations"),
    (dict(input_scale=torch.tensor([0.1]), input_zero_point=torch.tensor([1])), "input_zero_point: static"),
    (dict(input_scale=torch.tensor([0.1]), input_zero_point=torch.tensor([200]), symmetric_activations=False),
     r"input_zero_point: expected one integer in \[-128, 127\]"),
    (dict(input_scale=torch.tensor([0.1]), input_zero_point=torch.tensor([1.5]), symmetric_activations=False),
     "input_zero_point: expected one integer"),
    (dict(input_zero_point=torch.tensor([1]), symmetric_activations=False), "input_zero_point: given without"),
    (dict(symmetric_activations=0), "symmetric_activations: expected a bool"),
]


@pytest.mark.parametrize("kwargs,message", BAD_PARAMETERS)
def test_bad_parameters_refused(kwargs, message):
    w_q, w_scale, _ = layer_parts(8, 32, seed=7)
    with pytest.raises(ValueError, match=message):
        W8A8Linear(w_q, w_scale, **kwargs)


def test_weight_channel_sums_read_from_the_blob():
    """The asymmetric correction's weight sums come from the blob's stored channel sums (no unpacking): equal to the
    int8 weight's sums for any N, from a blob at any byte address; an int4 blob or a corrupted one is refused."""
    gen = torch.Generator().manual_seed(5)
    for n, k in ((1, 7), (17, 64), (40, 130)):
        w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        blob = w8a8_cpu.pack_weight(w)
        assert torch.equal(weight_channel_sums(blob), w.sum(dim=1, dtype=torch.int32))
        shifted = torch.zeros(blob.numel() + 3, dtype=torch.uint8)
        shifted[3:] = blob
        assert torch.equal(weight_channel_sums(shifted[3:]), w.sum(dim=1, dtype=torch.int32))
    q, scale, _ = w8a8_cpu.quantize_weight_int4(torch.randn(16, 64, generator=gen))
    with pytest.raises(ValueError, match="int4"):
        weight_channel_sums(w8a8_cpu.pack_weight_int4(q, scale))
    bad = blob.clone()
    bad[-1] ^= 1  # a channel sum changed: the checksum no longer matches
    with pytest.raises(ValueError):
        weight_channel_sums(bad)


def test_asymmetric_k_bound():
    """Beyond MAX_K_ZERO_POINT, q . w - zp * sum(w) could leave int32: refused at construction."""
    w_q = torch.ones(1, MAX_K_ZERO_POINT + 1, dtype=torch.int8)
    with pytest.raises(ValueError, match=f"K = {MAX_K_ZERO_POINT + 1} exceeds {MAX_K_ZERO_POINT}"):
        W8A8Linear(w_q, torch.ones(1), symmetric_activations=False)
    W8A8Linear(w_q, torch.ones(1), input_scale=torch.tensor([0.1]))  # symmetric: the kernels' own bound holds


def test_state_dict_half_and_reload():
    w_q, w_scale, bias = layer_parts(16, 48, seed=8)
    layer = W8A8Linear(w_q, w_scale, bias, **STATIC_ASYMMETRIC)
    assert set(layer.state_dict()) == {"weight_packed", "w_scale", "bias", "input_scale", "input_zero_point"}
    half = W8A8Linear(w_q, w_scale, bias, **STATIC_ASYMMETRIC).half()
    assert half.input_scale.dtype == torch.float32 and half.input_zero_point.dtype == torch.int32
    x = inputs(5, 48, seed=9)
    # a layer of another weight and scales takes this one's state: its weight sums follow the new weight
    other_q, other_scale, other_bias = layer_parts(16, 48, seed=10)
    other = W8A8Linear(other_q, other_scale, other_bias, input_scale=torch.tensor([0.3]),
                       input_zero_point=torch.tensor([5]), symmetric_activations=False)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other(x), layer(x))
    assert torch.equal(other(x), expected_output(x, w_q, w_scale, bias, STATIC_ASYMMETRIC))
    state = layer.state_dict()
    state["input_scale"] = torch.tensor([-0.5])
    with pytest.raises(ValueError, match="input_scale: expected one finite float > 0"):
        other.load_state_dict(state)


def with_schemes(model):
    """Layer 0's q/k/v static symmetric (one scale: they read one input), its o_proj static asymmetric, layer 1's
    down_proj dynamic asymmetric; the rest dynamic per-token symmetric."""
    def rebuilt(layer, **kwargs):
        return W8A8Linear(layer.int8_weight(), layer.w_scale, layer.bias, **kwargs)
    attention = model.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, rebuilt(getattr(attention, name), **STATIC))
    attention.o_proj = rebuilt(attention.o_proj, **STATIC_ASYMMETRIC)
    mlp = model.model.layers[1].mlp
    mlp.down_proj = rebuilt(mlp.down_proj, **DYNAMIC_ASYMMETRIC)
    return model


def test_fusion_leaves_static_and_asymmetric_layers_apart():
    model = with_schemes(quantize_model(tiny_causal_lm(), skip=["lm_head"]))
    before = logits(model)
    fused = fuse_projections(model)
    assert fused["attention"] == ["model.layers.1.self_attn"]  # layer 0's q/k/v are static: not fused
    assert model.model.layers[0].self_attn.q_proj.activation_scheme == "tensor"
    assert model.model.layers[1].mlp.down_proj.activation_scheme == "token-asymmetric"  # the fused MLP's down_proj
    after = logits(model)
    assert (after - before).abs().max() <= 1e-3 * before.abs().max()  # only the fused SiLU's last bits differ


def test_shard_refuses_static_layers():
    from w8a8_cpu.distributed import LinearShard
    layer = W8A8Linear(*layer_parts(8, 32, seed=11), **STATIC)
    shard = LinearShard("column", slice(0, 4), "model.layers.0.self_attn.q_proj")
    with pytest.raises(ValueError, match="has 'tensor' activations; shard_model splits"):
        shard.of(layer)


# ---- checkpoints (the llm extra: safetensors) -----------------------------------------------------------------

def checkpoint_functions():
    pytest.importorskip("safetensors")
    from w8a8_cpu.llm.checkpoint import load_quantized, save_compressed
    return load_quantized, save_compressed


def test_checkpoint_round_trip(tmp_path):
    load_quantized, save_compressed = checkpoint_functions()
    from safetensors.torch import load_file
    model = with_schemes(quantize_model(tiny_causal_lm(), skip=["lm_head"]))
    save_compressed(model, tmp_path)
    groups = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]
    by_kind = {(g["input_activations"]["strategy"], g["input_activations"]["dynamic"],
                g["input_activations"]["symmetric"]): g["targets"] for g in groups.values()}
    prefix = "model.layers.0.self_attn."
    assert by_kind == {("token", True, True): ["Linear"],
                       ("tensor", False, True): [prefix + p for p in ("k_proj", "q_proj", "v_proj")],
                       ("tensor", False, False): [prefix + "o_proj"],
                       ("token", True, False): ["model.layers.1.mlp.down_proj"]}
    stored = load_file(tmp_path / "model.safetensors")
    assert stored[prefix + "q_proj.input_scale"].dtype == torch.float32
    assert torch.equal(stored[prefix + "o_proj.input_zero_point"], torch.tensor([-20], dtype=torch.int8))
    assert not any(k.endswith(("input_scale", "input_zero_point")) for k in stored if "layers.1" in k)
    loaded = load_quantized(tmp_path)
    for name, module in model.named_modules():
        if isinstance(module, W8A8Linear):
            again = loaded.get_submodule(name)
            assert again.activation_scheme == module.activation_scheme, name
            assert torch.equal(again.input_scale if again.input_scale is not None else torch.zeros(0),
                               module.input_scale if module.input_scale is not None else torch.zeros(0)), name
    assert torch.equal(logits(loaded), logits(model))


def compressed_tensors_static_checkpoint(directory, symmetric):
    """A tiny Llama quantized by the compressed-tensors library itself: int8 channel weights and static per-tensor
    int8 activations (symmetric or with zero points), scales set from the activations' range as a calibration
    would, compressed and saved by the library."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    model = tiny_causal_lm()
    ranges = {}
    hooks = [module.register_forward_pre_hook(
        lambda module, args, name=name: ranges.__setitem__(name, (args[0].min(), args[0].max())))
        for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    logits(model)
    for hook in hooks:
        hook.remove()
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=symmetric, strategy="tensor",
                                           dynamic=False))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            module.weight_scale.data.copy_(w8a8_cpu.quantize_weight(module.weight.detach())[1].reshape(-1, 1))
            low, high = ranges[name]
            if symmetric:
                module.input_scale.data.fill_(float(torch.maximum(-low, high)) / 127)
            else:
                scale = float(high - low) / 255
                module.input_scale.data.fill_(scale)
                module.input_zero_point.data.fill_(int(-128 - round(float(low) / scale)))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    return model


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-point"])
def test_compressed_tensors_written_static_checkpoint_loads(symmetric, tmp_path):
    """The library's own forward fake-quantizes with the same scales (round(x / s + z) against our round(x / s) + z:
    equal but at exact fp32 ties), so the logits agree closely; each layer holds the library's scale and zero point
    exactly."""
    load_quantized, _ = checkpoint_functions()
    from safetensors.torch import load_file
    ct_model = compressed_tensors_static_checkpoint(tmp_path, symmetric)
    stored = load_file(tmp_path / "model.safetensors")
    loaded = load_quantized(tmp_path)
    o_proj = loaded.model.layers[0].self_attn.o_proj
    assert o_proj.activation_scheme == ("tensor" if symmetric else "tensor-asymmetric")
    assert torch.equal(o_proj.input_scale, stored["model.layers.0.self_attn.o_proj.input_scale"])
    if not symmetric:
        assert int(o_proj.input_zero_point) == int(stored["model.layers.0.self_attn.o_proj.input_zero_point"])
    got, want = logits(loaded), logits(ct_model)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


@pytest.fixture(scope="module")
def saved_static(tmp_path_factory):
    _, save_compressed = checkpoint_functions()
    directory = tmp_path_factory.mktemp("static")
    save_compressed(with_schemes(quantize_model(tiny_causal_lm(), skip=["lm_head"])), directory)
    return directory


O_PROJ = "model.layers.0.self_attn.o_proj"


def replaced_tensor(key, value):
    def change(tensors):
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    return change


MALFORMED = [
    ("scale missing", replaced_tensor(f"{O_PROJ}.input_scale", None),
     re.escape(f"'{O_PROJ}.input_scale' (a static activation scale) is missing")),
    ("scale shape", replaced_tensor(f"{O_PROJ}.input_scale", torch.ones(2)), "expected a static activation scale"),
    ("scale zero", replaced_tensor(f"{O_PROJ}.input_scale", torch.zeros(1)), "input_scale: expected one finite"),
    ("scale nan", replaced_tensor(f"{O_PROJ}.input_scale", torch.tensor([float("nan")])), "expected one finite"),
    ("zero point missing", replaced_tensor(f"{O_PROJ}.input_zero_point", None), "is missing"),
    ("zero point range", replaced_tensor(f"{O_PROJ}.input_zero_point", torch.tensor([300], dtype=torch.int32)),
     r"input_zero_point: expected one integer in \[-128, 127\]"),
    ("zero point float", replaced_tensor(f"{O_PROJ}.input_zero_point", torch.tensor([1.0])),
     "expected a static activation zero point"),
]


@pytest.mark.parametrize("change,message", [pytest.param(c, m, id=i) for i, c, m in MALFORMED])
def test_malformed_static_tensors_refused(saved_static, tmp_path, change, message):
    load_quantized, _ = checkpoint_functions()
    from safetensors.torch import load_file, save_file
    directory = shutil.copytree(saved_static, tmp_path / "ckpt")
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message) as raised:
        load_quantized(directory)
    assert str(directory) in str(raised.value)


def edit_groups(directory, change):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    change(config["quantization_config"]["config_groups"])
    with open(path, "w") as f:
        json.dump(config, f)


def test_static_activations_refused_where_the_kernels_lack_them(tmp_path):
    """Fused MoE experts and int4 layers take dynamic per-token symmetric activations only; a group saying
    otherwise is refused naming it."""
    load_quantized, save_compressed = checkpoint_functions()
    model = quantize_model(tiny_causal_lm(), skip=["lm_head"], scheme="w4a8")
    save_compressed(model, tmp_path)

    def static(groups):
        for group in groups.values():
            group["input_activations"].update(strategy="tensor", dynamic=False)
    edit_groups(tmp_path, static)
    with pytest.raises(ValueError, match=re.escape("input_activations") + ".*int4 weights run with int8 dynamic "
                       "per-token symmetric activations only"):
        load_quantized(tmp_path)


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-point"])
def test_calibrate_static_activations(symmetric):
    """Each W8A8Linear gets the scale of its input's range over the calibration tokens; on those tokens nothing is
    clipped, so the logits stay close to the dynamic model's."""
    pytest.importorskip("safetensors")
    from w8a8_cpu.llm import calibrate_static_activations
    model = quantize_model(tiny_causal_lm(), skip=["lm_head"])
    inputs_seen = {}
    q_proj = model.model.layers[0].self_attn.q_proj
    hook = q_proj.register_forward_pre_hook(lambda m, args: inputs_seen.setdefault("x", args[0].detach().clone()))
    dynamic = logits(model)
    hook.remove()
    made_static = calibrate_static_activations(model, token_ids(), symmetric=symmetric)
    assert len(made_static) == 2 * 7 and "model.layers.0.self_attn.q_proj" in made_static
    x = inputs_seen["x"]
    if symmetric:
        assert q_proj.activation_scheme == "tensor"
        assert float(q_proj.input_scale) == pytest.approx(float(x.abs().max()) / 127, rel=1e-6)
    else:
        assert q_proj.activation_scheme == "tensor-asymmetric"
        scale, zero = float(q_proj.input_scale), int(q_proj.input_zero_point)
        assert scale == pytest.approx((float(x.max()) - float(x.min())) / 255, rel=1e-6)
        assert -128 <= round(float(x.min()) / scale) + zero and round(float(x.max()) / scale) + zero <= 127
    static = logits(model)
    assert (static - dynamic).abs().max() <= 0.05 * dynamic.abs().max()
    with pytest.raises(ValueError, match="calibration: batch 0: expected non-empty integer token ids"):
        calibrate_static_activations(quantize_model(tiny_causal_lm(), skip=["lm_head"]), torch.zeros(2, 3))
