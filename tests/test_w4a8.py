"""W4A8: int4 weights in groups along K (symmetric, or with a minimum per group) with per-token int8 activations, on
every variant: bit-exact against the reference's fixed fp32 order over exact int32 group products, close to the fp64
product of the dequantized weight, the blob untrusted as int8 blobs are, and the modules (W4A8Linear,
quantize_model(scheme="w4a8"), fusion) built on the same ops."""
import copy
import random
import re

import pytest
import torch

import w8a8_cpu
from w8a8_cpu import reference
from w8a8_cpu.nn import W4A8Linear, W8A8GatedMLP, W8A8Linear, W8A8LinearSlice, quantize_model
from tiny_models import dequantized_int4, tiny_causal_lm

CASES = [  # (m, n, k, group_size, symmetric)
    (1, 40, 100, 32, True), (5, 33, 300, 64, False), (17, 64, 1000, 0, False), (70, 48, 512, 128, True),
    (3, 16, 4096, 32, False), (9, 20, 33, 0, True), (2, 7, 64, 32, False),
]


def int4_case(gen, n, k, group_size, symmetric):
    w = torch.randn(n, k, generator=gen)
    q, scale, minimum = w8a8_cpu.quantize_weight_int4(w, group_size, symmetric)
    return w, q, scale, minimum


@pytest.mark.parametrize("m,n,k,group_size,symmetric", CASES)
def test_int4_linear_is_exact_on_every_variant(variant, gen, m, n, k, group_size, symmetric):
    _, q, scale, minimum = int4_case(gen, n, k, group_size, symmetric)
    blob = w8a8_cpu.pack_weight_int4(q, scale, minimum, group_size)
    x = torch.randn(m, k, generator=gen)
    w_scale = torch.rand(n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    x_q, x_scale = reference.per_token_quant_int8(x)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = w8a8_cpu.int8_scaled_mm_with_quant(x, blob, w_scale, bias, out_dtype)
        want = reference.int4_scaled_mm(x_q, q, x_scale, w_scale, scale, minimum, group_size, bias, out_dtype)
        assert torch.equal(got, want), (variant, out_dtype)
    # and the fp32 order is a rounding of the exact product with the dequantized weight
    weight = dequantized_int4(q, scale, minimum, group_size, torch.float64)
    exact = (x_q.double() @ weight.T) * x_scale.double() * w_scale.double() + bias.double()
    got = w8a8_cpu.int8_scaled_mm_with_quant(x, blob, w_scale, bias, torch.float32).double()
    assert (got - exact).abs().max() <= 1e-4 * exact.abs().max()


def test_int4_values_round_trip_and_rounding_rules(gen):
    w = torch.randn(24, 96, generator=gen)
    for group_size, symmetric in ((32, True), (64, False), (0, False)):
        q, scale, minimum = w8a8_cpu.quantize_weight_int4(w, group_size, symmetric)
        assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
        blob = w8a8_cpu.pack_weight_int4(q, scale, minimum, group_size)
        assert torch.equal(w8a8_cpu.unpack_weight(blob), q)
        q2, scale2, minimum2, group2 = w8a8_cpu.int4_weight_values(blob)
        assert torch.equal(q2, q) and torch.equal(scale2, scale) and group2 == group_size
        assert (minimum is None and minimum2 is None) or torch.equal(minimum, minimum2)
        error = (dequantized_int4(q, scale, minimum, group_size, torch.float64) - w.double()).abs()
        step = scale.double().repeat_interleave(group_size or 96, dim=1)[:, :96]
        # round to nearest: within half a step of every weight (the fp16 step: up to 7.5 * 2^-11 of one more where
        # the symmetric grid's top level clips)
        assert (error <= step * (0.5 + 7.5 * 2 ** -11) + 1e-6).all()
    # a weight already on an asymmetric grid of its groups (levels 0 and 15 present in each) comes back exactly
    levels = torch.randint(0, 16, (8, 64), generator=gen)
    levels[:, ::32], levels[:, 1::32] = 0, 15
    grid = levels.float() * 0.25 - 1.0
    q, scale, minimum = w8a8_cpu.quantize_weight_int4(grid, 32, symmetric=False)
    assert torch.allclose(dequantized_int4(q, scale, minimum, 32, torch.float64).float(), grid, atol=1e-6)


def test_int4_blob_size_matches_the_python_rule(variant, gen):
    from w8a8_cpu._packed_weight import packed_weight_nbytes

    for n, k, group_size, symmetric in ((33, 100, 32, True), (16, 300, 0, False), (5, 64, 64, False)):
        _, q, scale, minimum = int4_case(gen, n, k, group_size, symmetric)
        for half_scales in (False, True):
            blob = w8a8_cpu.pack_weight_int4(q, scale, minimum, group_size, half_scales)
            assert blob.numel() == packed_weight_nbytes(n, k, group_size, minimum is not None, half_scales)


@pytest.mark.parametrize("call,message", [
    (lambda q, s, m: w8a8_cpu.pack_weight_int4(q * 2, s, m, 32), "^q: int4 weights must lie in \\[-8, 7\\]"),
    # finite weights whose range overflows fp32: an inf step, refused only at packing (naming scale)
    (lambda q, s, m: w8a8_cpu.quantize_weight_int4(q.float() * 4e37, 32, symmetric=False),
     r"^w: a group's range \(max - min\) overflows float32"),
    (lambda q, s, m: w8a8_cpu.pack_weight_int4(q, s, m, 48), "group_size: expected 0 \\(per channel\\) or a power"),
    (lambda q, s, m: w8a8_cpu.pack_weight_int4(q, s, m, 16), "group_size"),
    # the blob's limit, stated before any work (it used to pass quantize_weight_int4 and fail only at packing)
    (lambda q, s, m: w8a8_cpu.quantize_weight_int4(q.float(), 131072), r"group_size: expected 0 \(per channel\) or a "
                                                                       r"power of two in \[32, 65536\], got 131072"),
    (lambda q, s, m: w8a8_cpu.pack_weight_int4(q, s[:, :1], m, 32), "scale: expected shape \\[12, 3\\]"),
    (lambda q, s, m: w8a8_cpu.pack_weight_int4(q, s.double(), m, 32), "scale: dtype must be float32"),
    (lambda q, s, m: w8a8_cpu.pack_weight_int4(q, s.index_fill(1, torch.tensor([1]), float("nan")), m, 32),
     "scale: element 1 is nan"),
    (lambda q, s, m: w8a8_cpu.pack_weight_int4(q, s, m.index_fill(0, torch.tensor([2]), float("inf")), 32),
     "minimum: element 6 is inf"),
    (lambda q, s, m: w8a8_cpu.int8_mm(torch.zeros(1, 90, dtype=torch.int8), w8a8_cpu.pack_weight_int4(q, s, m, 32)),
     "int4 weights are computed by the linear ops"),
])
def test_bad_int4_input_raises_naming_it(gen, call, message):
    _, q, scale, minimum = int4_case(gen, 12, 90, 32, False)
    with pytest.raises(ValueError, match=message):
        call(q, scale, minimum)


@pytest.mark.parametrize("m", [1, 2, 3, 17])
def test_int4_scales_stored_as_fp16_give_the_same_bits(variant, gen, m):
    """Scales that are fp16 values (quantize_weight_int4 rounds them so) are packed in 2 bytes by default (half_scales):
    the blob shrinks by 2 bytes per group and padded channel, reads back the same values, and every variant's output
    is bit for bit the fp32-stored blob's and the reference's, at decode and prefill row counts, with and without
    minimums, per group and per channel."""
    from w8a8_cpu._packed_weight import header_half_scales, packed_weight_nbytes

    for n, k, group_size, symmetric in ((40, 100, 32, True), (33, 300, 64, False), (20, 4096, 32, False),
                                        (16, 96, 0, True)):
        _, q, scale, minimum = int4_case(gen, n, k, group_size, symmetric)
        assert torch.equal(scale.half().float(), scale)
        b16 = w8a8_cpu.pack_weight_int4(q, scale, minimum, group_size)
        b32 = w8a8_cpu.pack_weight_int4(q, scale, minimum, group_size, half_scales=False)
        assert header_half_scales(b16) and not header_half_scales(b32)
        assert b16.numel() == packed_weight_nbytes(n, k, group_size, minimum is not None, half_scales=True)
        nr = int(b16[12])
        assert b32.numel() - b16.numel() == 2 * -(-n // nr) * nr * scale.shape[1]
        q2, scale2, minimum2, group2 = w8a8_cpu.int4_weight_values(b16)
        assert torch.equal(q2, q) and torch.equal(scale2, scale) and group2 == group_size
        assert (minimum is None and minimum2 is None) or torch.equal(minimum2, minimum)
        x = torch.randn(m, k, generator=gen)
        w_scale = torch.rand(n, generator=gen) + 0.5
        got = w8a8_cpu.int8_scaled_mm_with_quant(x, b16, w_scale, None, torch.float32)
        assert torch.equal(got, w8a8_cpu.int8_scaled_mm_with_quant(x, b32, w_scale, None, torch.float32))
        x_q, x_scale = reference.per_token_quant_int8(x)
        assert torch.equal(got, reference.int4_scaled_mm(x_q, q, x_scale, w_scale, scale, minimum, group_size, None,
                                                         torch.float32))


def test_int4_scale_storage_is_chosen_by_the_values(gen):
    """half_scales None stores fp16 exactly when every scale is an fp16 value, else fp32 (the same results); True with
    a scale that is not one is a ValueError naming it; experts share one storage (their blobs stack); a layer loads
    a state_dict whose blob stores its scales in the other width."""
    from w8a8_cpu._packed_weight import header_half_scales

    _, q, scale, minimum = int4_case(gen, 12, 90, 32, False)
    off_grid = scale.clone()
    off_grid[3, 1] *= 1 + 2 ** -20  # between two fp16 values
    assert not header_half_scales(w8a8_cpu.pack_weight_int4(q, off_grid, minimum, 32))
    with pytest.raises(ValueError, match=r"^scale: fp16 storage holds only fp16 values; row 3, group 1 is not one"):
        w8a8_cpu.pack_weight_int4(q, off_grid, minimum, 32, half_scales=True)
    with pytest.raises(ValueError, match=r"^half_scales: expected None or a bool, got 'yes'"):
        w8a8_cpu.pack_weight_int4(q, scale, minimum, 32, half_scales="yes")
    # an all-zero group's step, 1e-10: below fp16's normal range, kept fp32 by the quantizer (so is the blob)
    q0, scale0, _ = w8a8_cpu.quantize_weight_int4(torch.cat([torch.zeros(1, 32), torch.randn(1, 32)], 1), 32)
    assert scale0[0, 0] == 1e-10 and not header_half_scales(w8a8_cpu.pack_weight_int4(q0, scale0, None, 32))
    experts = w8a8_cpu.pack_experts_int4(torch.stack([q, q]), torch.stack([scale, off_grid]),
                                         torch.stack([minimum, minimum]), 32)
    assert experts.shape[0] == 2 and not any(header_half_scales(b) for b in experts)
    x = torch.randn(4, 90, generator=gen)
    donor, taker = (W4A8Linear(q, s, minimum, 32) for s in (off_grid, scale))
    assert taker.weight_packed.numel() < donor.weight_packed.numel()
    taker.load_state_dict(donor.state_dict())
    assert torch.equal(taker(x), donor(x))


def test_int4_blob_is_untrusted_input(gen):
    """Edited nibbles, scales or header fields of an int4 blob: a ValueError (the checksum, the header bounds, the
    content checks), or, for an edit resealed with a new checksum (a blob describing other int4 weights: int4 panels
    carry no channel sums), exactly the result of the weights the edited blob holds. A resealed NaN scale is refused by
    the content check."""
    from test_packed_weight_safety import HEADER, as_tensor, put, raw_bytes, seal

    _, q, scale, minimum = int4_case(gen, 20, 96, 32, False)
    blob = w8a8_cpu.pack_weight_int4(q, scale, minimum, 32)
    x = torch.randn(3, 96, generator=gen)
    ones = torch.ones(20)
    want = w8a8_cpu.int8_scaled_mm_with_quant(x, blob, ones)
    rng = random.Random(5)
    outcomes = {"value_error": 0, "exact": 0}
    for _ in range(300):
        b = raw_bytes(blob)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        if rng.random() < 0.5:
            seal(b)
        try:
            got = w8a8_cpu.int8_scaled_mm_with_quant(x, as_tensor(bytes(b)), ones)
        except ValueError:
            outcomes["value_error"] += 1
            continue
        q2, scale2, minimum2, group2 = w8a8_cpu.int4_weight_values(as_tensor(bytes(b)))
        x_q, x_scale = reference.per_token_quant_int8(x)
        assert torch.equal(got, reference.int4_scaled_mm(x_q, q2, x_scale, ones, scale2, minimum2, group2))
        outcomes["exact"] += 1
    assert outcomes["value_error"] > 150 and outcomes["exact"] > 0
    assert torch.equal(w8a8_cpu.int8_scaled_mm_with_quant(x, blob, ones), want)
    b = raw_bytes(blob)
    nr = b[12]
    scales_at = HEADER + 96 * nr // 2
    b[scales_at:scales_at + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(ValueError, match="group scale or minimum is NaN or Inf"):
        w8a8_cpu.int8_scaled_mm_with_quant(x, as_tensor(bytes(seal(b))), ones)
    b = put(raw_bytes(blob), "scheme", 0)  # an int4 blob relabelled int8: its size no longer fits
    with pytest.raises(ValueError, match="packed weight header"):
        w8a8_cpu.int8_scaled_mm_with_quant(x, as_tensor(bytes(seal(b))), ones)


def test_int4_scales_that_could_overflow_the_group_sum_are_refused(variant, gen, tmp_path):
    """The W4A8 epilogue sums each group's products times its scale in fp32 before the activation scale multiplies
    the sum: weights ~1e36 gave Inf / NaN where nn.Linear and W8A8 stay finite, and so did a pack-quantized checkpoint
    whose weight_scale was ~1e35. Scales whose worst-case sum (int8 activations of 128, int4 weights of 8, in every
    group of a channel) passes fp32's range are refused when packing (a layer, MoE experts), in a resealed blob and
    at checkpoint load; the largest scales accepted give the exact, finite result of the worst-case input."""
    from test_checkpoint import edit_tensors, float_model
    from test_packed_weight_safety import HEADER, as_tensor, raw_bytes, seal

    from w8a8_cpu.llm import load_quantized, save_compressed

    n, k, group = 16, 64, 32
    q = torch.full((n, k), -8, dtype=torch.int8)
    largest = torch.finfo(torch.float32).max / (1024 * k) * 0.999  # 1024 * group * scale per group, 2 groups
    x = -torch.ones(3, k)  # int8 -127 everywhere: t = 2 * 32512 * scale, 0.99 of fp32's largest
    ones = torch.ones(n)
    blob = w8a8_cpu.pack_weight_int4(q, torch.full((n, 2), largest), None, group)
    got = w8a8_cpu.int8_scaled_mm_with_quant(x, blob, ones)
    x_q, x_scale = reference.per_token_quant_int8(x)
    assert torch.isfinite(got).all()
    assert torch.equal(got, reference.int4_scaled_mm(x_q, q, x_scale, ones, torch.full((n, 2), largest), None, group))
    past = "let the W4A8 kernel's fp32 sum of group products .* reach .*, past fp32's 3.4e\\+38; scale the weights down"
    with pytest.raises(ValueError, match="scale: channel 0: its group scales " + past):
        w8a8_cpu.pack_weight_int4(q, torch.full((n, 2), largest * 1.01), None, group)
    with pytest.raises(ValueError, match="scale, minimum: channel 0: its group scales and minimums " + past):
        w8a8_cpu.pack_weight_int4(q, torch.full((n, 2), largest / 2), torch.full((n, 2), largest * 8), group)
    with pytest.raises(ValueError, match="scale: channel 0: its group scales " + past):  # from float weights
        linear = torch.nn.Linear(k, n)
        torch.nn.init.constant_(linear.weight, 1e36)
        W4A8Linear.from_linear(linear)
    with pytest.raises(ValueError, match="expert 1: scale: channel 3: its group scales " + past):
        scale = torch.full((2, n, 2), largest)
        scale[1, 3] *= 1.01
        w8a8_cpu.pack_experts_int4(q.expand(2, n, k), scale, None, group)
    b = raw_bytes(blob)
    scales_at = HEADER + k * b[12] // 2  # channel 0's first group scale
    b[scales_at:scales_at + 4] = torch.tensor([largest * 2]).numpy().tobytes()
    with pytest.raises(ValueError, match="packed weight channel 0: its group scales " + past):
        w8a8_cpu.int8_scaled_mm_with_quant(x, as_tensor(bytes(seal(b))), ones)
    for arch, key, where in (("llama-tied", "model.layers.0.mlp.down_proj.weight_scale",
                              "model.layers.0.mlp.down_proj.weight_scale' cannot be packed: scale: channel 0"),
                             ("mixtral", "model.layers.0.block_sparse_moe.experts.1.w1.weight_scale",
                              "model.layers.0.mlp.experts: the experts' weight_scale cannot be packed: expert 1: "
                              "scale: channel 0")):
        model = quantize_model(float_model(arch), skip=["lm_head", "*.gate"], scheme="w4a8", group_size=32)
        save_compressed(model, tmp_path / arch)

        def huge(tensors):
            tensors[key] = tensors[key].clone()
            tensors[key].view(-1)[1] = 1e35

        edit_tensors(tmp_path / arch, huge)
        with pytest.raises(ValueError, match=re.escape(where) + ": its group scales " + past):
            load_quantized(tmp_path / arch)


def test_gated_int4_equals_the_separate_int4_layers(variant, gen):
    _, q, scale, minimum = int4_case(gen, 64, 128, 32, False)
    fused = w8a8_cpu.pack_weight_int4(q, scale, minimum, 32)
    parts = [w8a8_cpu.pack_weight_int4(q[i:i + 32], scale[i:i + 32], minimum[i:i + 32], 32) for i in (0, 32)]
    x = torch.randn(5, 128, generator=gen)
    gate, up = (w8a8_cpu.int8_scaled_mm_with_quant(x, p, torch.ones(32), None, torch.float32) for p in parts)
    got = w8a8_cpu.int8_gated_mm_with_quant(x, fused, torch.ones(64), None, torch.float32)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_quantize_model_w4a8_and_fusion(gen):
    model = tiny_causal_lm(tied=True, vocab_size=300)
    ids = torch.randint(0, 300, (1, 12), generator=gen)
    unfused = quantize_model(copy.deepcopy(model), scheme="w4a8", group_size=32, symmetric=False,
                             quantize_embedding=True)
    layers = dict(unfused.named_modules())
    assert isinstance(layers["model.layers.0.self_attn.q_proj"], W4A8Linear)
    assert isinstance(layers["model.layers.1.mlp.down_proj"], W4A8Linear)
    assert type(layers["lm_head"]) is W8A8Linear  # shares its int8 table with the embedding
    fused = copy.deepcopy(unfused)
    w8a8_cpu.nn.fuse_projections(fused)
    assert isinstance(fused.model.layers[0].self_attn.k_proj, W8A8LinearSlice)
    assert isinstance(fused.model.layers[0].mlp, W8A8GatedMLP)
    attention = fused.model.layers[0].self_attn
    x = torch.randn(1, 5, 64, generator=gen)
    for name in ("q_proj", "k_proj", "v_proj"):  # bit for bit the separate int4 layers
        assert torch.equal(getattr(attention, name)(x), getattr(unfused.model.layers[0].self_attn, name)(x))
    with torch.no_grad():
        want, got = unfused(ids).logits, fused(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # the fused SiLU differs in the last bits
    with pytest.raises(ValueError, match="scheme: expected one of w8a8, w4a8"):
        quantize_model(copy.deepcopy(model), scheme="w3a8")


def test_w4a8_linear_follows_the_float_layer(gen):
    linear = torch.nn.Linear(256, 48)
    x = torch.randn(4, 256, generator=gen)
    for symmetric in (True, False):
        layer = W4A8Linear.from_linear(linear, 32, symmetric)
        q, scale, minimum, group = layer.int4_weight()
        weight = dequantized_int4(q, scale, minimum, group, torch.float64)
        expected = torch.nn.functional.linear(x.double(), weight, linear.bias.double())
        torch.testing.assert_close(layer(x).double(), expected, rtol=0.05, atol=0.05)  # int8 activations
        with pytest.raises(ValueError, match="use int4_weight"):
            layer.int8_weight()


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck needs torch >= 2.4")
def test_int4_ops_trace_and_layers_reload():
    """The fake kernels of pack_weight_int4 and of the linear op on an int4 blob agree with the ops (opcheck); a
    W4A8Linear runs under torch.compile (fullgraph) bit for bit as eager, and reloads from its state_dict."""
    q, scale, minimum = w8a8_cpu.quantize_weight_int4(torch.randn(40, 96), 32, False)
    checks = ("test_schema", "test_faketensor")
    for half_scales in (False, True):  # (scale: fp16 values, as quantize_weight_int4 rounds them)
        torch.library.opcheck(torch.ops.w8a8_cpu.pack_weight_int4.default, (q, scale, minimum, 32, half_scales),
                              test_utils=checks)
    blob = w8a8_cpu.pack_weight_int4(q, scale, minimum, 32)
    x = torch.randn(3, 96)
    torch.library.opcheck(torch.ops.w8a8_cpu.int8_scaled_mm_with_quant.default,
                          (x, blob, torch.ones(40), None, None, None), test_utils=checks)
    layer = W4A8Linear.from_linear(torch.nn.Linear(96, 40), 32, symmetric=False)
    compiled = torch.compile(lambda t: layer(t) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x) * 2)
    other = W4A8Linear.from_linear(torch.nn.Linear(96, 40), 32, symmetric=False)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other(x), layer(x))


@pytest.mark.skipif(not w8a8_cpu._autograd.AVAILABLE, reason="the op's autograd kernel needs torch >= 2.4")
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_straight_through_gradient_uses_the_dequantized_weight(gen, symmetric):
    """grad_x of the linear op on an int4 blob is grad_out @ (q * group scale (+ minimum)) * w_scale, the weight the
    blob stands for (not q * w_scale)."""
    _, q, scale, minimum = int4_case(gen, 24, 96, 32, symmetric)
    blob = w8a8_cpu.pack_weight_int4(q, scale, minimum, 32)
    w_scale = torch.rand(24, generator=gen) + 0.5
    x = torch.randn(3, 96, generator=gen, requires_grad=True)
    grad_out = torch.randn(3, 24, generator=gen)
    w8a8_cpu.int8_scaled_mm_with_quant(x, blob, w_scale).backward(grad_out)
    weight = dequantized_int4(q, scale, minimum, 32, torch.float64) * w_scale.double()[:, None]
    torch.testing.assert_close(x.grad.double(), grad_out.double() @ weight, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w8a8_cpu.dequantized_weight(blob, w_scale).double(), weight, rtol=1e-6, atol=1e-6)
