"""Ops against the exact reference (integer matmul in fp64, the kernels' fp32 epilogue), every variant."""
import os

import pytest
import torch

import w8a8_cpu
from w8a8_cpu import reference
from w8a8_cpu._packed_weight import packed_weight_nbytes

from conftest import EMULATED, intra_op_threads

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MS = [1, 2, 3, 5, 17, 64, 257]
NKS = [(1, 1), (7, 33), (16, 16), (33, 100), (100, 7), (4096, 33), (33, 4096), (1, 4096), (100, 4096)]
if EMULATED:  # documented emulation subset: every tile edge case, fewer sizes (the C++ sweep covers the rest)
    MS = [1, 3, 5, 17, 64]
    NKS = [(1, 1), (7, 33), (16, 16), (33, 100), (100, 7), (33, 4096)]


@pytest.mark.skipif(not os.environ.get("W8A8_CPU_EXPECT_SELECTED"), reason="W8A8_CPU_EXPECT_SELECTED not set")
def test_selected_variant_is_the_expected_one():
    """The emulated CI stage (ci/emulated-python-matrix.sh) names the variant dispatch must pick on its qemu CPU
    model: it must be compiled into the build (a build without it fails here, never passes silently) and selected."""
    expected, info = os.environ["W8A8_CPU_EXPECT_SELECTED"], w8a8_cpu.info()
    assert expected in info["compiled_variants"], (
        f"variant {expected!r} is not compiled into this build (compiled: {info['compiled_variants']})")
    assert info["selected_variant"] == expected, f"selected {info['selected_variant']!r}, expected {expected!r}"


def random_weight(n, k, gen):
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), torch.rand(n, generator=gen) * 0.02 + 1e-3


def test_reference_on_known_numbers():
    # Hand-checked: amax 2 -> scale 2/127; 0.5 * 63.5 = 31.75 -> 32; -1 * 63.5 = -63.5 -> -64 (half to even).
    x = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    x_q, x_scale = reference.per_token_quant_int8(x)
    assert x_q.tolist() == [[32, -64, 127, 0]]
    assert x_scale.item() == pytest.approx(2 / 127)
    w = torch.tensor([[1, 2, 3, 4], [-127, 0, 127, 5]], dtype=torch.int8)
    assert reference.int8_matmul(x_q, w).tolist() == [[32 - 128 + 381, -4064 + 16129]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 1), (3, 7), (5, 33), (17, 100), (64, 4096), (2, 4099)])
def test_per_token_quant_matches_reference(variant, dtype, m, k, gen):
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    x[0, 0] = 0.5 * x[0].float().abs().max()  # some exact-tie candidates
    x_q, x_scale = w8a8_cpu.per_token_quant_int8(x)
    want_q, want_scale = reference.per_token_quant_int8(x)
    assert x_q.dtype == torch.int8 and x_scale.dtype == torch.float32 and x_scale.shape == (m, 1)
    assert torch.equal(x_q, want_q)
    assert torch.equal(x_scale, want_scale)
    assert int(x_q.abs().max()) == 127


def test_quant_ties_round_half_to_even(variant):
    # amax = 127 makes inv_scale exactly 1, so x.5 values are exact ties.
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 127.0, 3.5]] * 5).repeat(1, 5)
    x_q, _ = w8a8_cpu.per_token_quant_int8(x)
    assert x_q[0, :8].tolist() == [0, 2, 2, 0, -2, -2, 127, 4]


def test_quant_zero_row(variant):
    x_q, x_scale = w8a8_cpu.per_token_quant_int8(torch.zeros(2, 40))
    assert not x_q.any()
    assert torch.all(x_scale == torch.tensor(1e-10, dtype=torch.float32) / 127)


@pytest.mark.parametrize("packed", [False, True], ids=["raw", "packed"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", NKS)
def test_int8_scaled_mm_exact(variant, m, n, k, packed, gen):
    x_q = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)  # full int8 range, incl. -128
    x_scale = torch.rand(m, 1, generator=gen) * 0.05 + 1e-3
    w_q, w_scale = random_weight(n, k, gen)
    bias = torch.randn(n, generator=gen) if (m + n) % 2 else None
    w = w8a8_cpu.pack_weight(w_q) if packed else w_q
    for out_dtype in DTYPES:
        got = w8a8_cpu.int8_scaled_mm(x_q, w, x_scale, w_scale, bias, out_dtype)
        want = reference.int8_scaled_mm(x_q, w_q, x_scale, w_scale, bias, out_dtype)
        assert got.dtype == out_dtype and got.shape == (m, n)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    ideal = reference.int8_scaled_mm_fp64(x_q, w_q, x_scale, w_scale, bias)
    got32 = w8a8_cpu.int8_scaled_mm(x_q, w, x_scale, w_scale, bias, torch.float32)
    torch.testing.assert_close(got32.double(), ideal, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias_dtype", DTYPES)
def test_bias_dtypes_and_scale_shapes(variant, bias_dtype, gen):
    x_q = torch.randint(-127, 128, (4, 50), dtype=torch.int8, generator=gen)
    x_scale = torch.rand(4, generator=gen)  # [M] accepted as well as [M, 1]
    w_q, w_scale = random_weight(9, 50, gen)
    bias = torch.randn(9, generator=gen).to(bias_dtype)
    got = w8a8_cpu.int8_scaled_mm(x_q, w_q, x_scale, w_scale.reshape(9, 1), bias, torch.float32)
    want = reference.int8_scaled_mm(x_q, w_q, x_scale, w_scale, bias.float(), torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert w8a8_cpu.int8_scaled_mm(x_q, w_q, x_scale, w_scale).dtype == torch.float32  # default out_dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_quant_matmul_exact_and_batched(variant, dtype, gen):
    x = torch.randn(2, 3, 70, generator=gen).to(dtype)
    w_q, w_scale = random_weight(45, 70, gen)
    bias = torch.randn(45, generator=gen)
    got = w8a8_cpu.int8_scaled_mm_with_quant(x, w8a8_cpu.pack_weight(w_q), w_scale, bias)
    assert got.shape == (2, 3, 45) and got.dtype == dtype
    x_q, x_scale = reference.per_token_quant_int8(x.reshape(6, 70))
    want = reference.int8_scaled_mm(x_q, w_q, x_scale, w_scale, bias, dtype).reshape(2, 3, 45)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got32 = w8a8_cpu.int8_scaled_mm_with_quant(x, w_q, w_scale, bias, out_dtype=torch.float32)
    assert got32.dtype == torch.float32


def test_bf16_within_sglang_tolerance_of_float_linear(variant, gen):
    # sglang's style: bf16 output vs an fp32 reference of the same quantized math, 1e-2 relative.
    x = torch.randn(33, 512, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    w_q, w_scale = random_weight(256, 512, gen)
    got = w8a8_cpu.int8_scaled_mm_with_quant(x, w_q, w_scale, out_dtype=torch.bfloat16)
    x_q, x_scale = reference.per_token_quant_int8(x)
    ideal = reference.int8_scaled_mm_fp64(x_q, w_q, x_scale, w_scale).float()
    torch.testing.assert_close(got.float(), ideal, rtol=1e-2, atol=1e-2 * ideal.abs().max().item())


def test_strided_rows(variant, gen):
    base = torch.randint(-127, 128, (6, 80), dtype=torch.int8, generator=gen)
    x_q = base[::2, 5:69]  # row stride 160, last dim contiguous
    x_scale = torch.rand(3, 1, generator=gen)
    w_base, w_scale = random_weight(20, 100, gen)
    w_q = w_base[:, 10:74]
    got = w8a8_cpu.int8_scaled_mm(x_q, w_q, x_scale, w_scale, None, torch.float32)
    want = reference.int8_scaled_mm(x_q, w_q, x_scale, w_scale)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_threads_bit_identical(variant, gen):
    x = torch.randn(70, 512, generator=gen)
    w_q, w_scale = random_weight(1000, 512, gen)
    w = w8a8_cpu.pack_weight(w_q)
    with intra_op_threads(1):
        one = w8a8_cpu.int8_scaled_mm_with_quant(x, w, w_scale)
        one_q = w8a8_cpu.per_token_quant_int8(x)
    with intra_op_threads(max(2, torch.get_num_threads())):
        many = w8a8_cpu.int8_scaled_mm_with_quant(x, w, w_scale)
        many_q = w8a8_cpu.per_token_quant_int8(x)
    assert torch.equal(one, many)
    assert torch.equal(one_q[0], many_q[0]) and torch.equal(one_q[1], many_q[1])


def test_variants_bit_identical(gen):
    x = torch.randn(19, 300, generator=gen).to(torch.bfloat16)
    w_q, w_scale = random_weight(77, 300, gen)
    outputs = {}
    for name in w8a8_cpu.info()["runnable_variants"]:
        with w8a8_cpu.use_variant(name):
            outputs[name] = w8a8_cpu.int8_scaled_mm_with_quant(x, w8a8_cpu.pack_weight(w_q), w_scale)
    first = next(iter(outputs.values()))
    for name, out in outputs.items():
        assert torch.equal(out, first), name


def test_packed_weight_read_by_reference_variant(gen):
    # A blob packed by the selected variant is readable by the reference (it reads any panel width).
    w_q, w_scale = random_weight(37, 90, gen)
    packed = w8a8_cpu.pack_weight(w_q)
    x = torch.randn(5, 90, generator=gen)
    best = w8a8_cpu.int8_scaled_mm_with_quant(x, packed, w_scale)
    with w8a8_cpu.use_variant("ref"):
        assert torch.equal(w8a8_cpu.int8_scaled_mm_with_quant(x, packed, w_scale), best)


def test_packed_blob_format(gen):
    w_q, _ = random_weight(37, 90, gen)
    packed = w8a8_cpu.pack_weight(w_q)
    nr, kr = w8a8_cpu.info()["panel_width"], w8a8_cpu.info()["panel_depth"]
    n_pad, k_pad = -(-37 // nr) * nr, -(-90 // kr) * kr
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert packed.numel() == 64 + n_pad * k_pad + 4 * n_pad
    assert bytes(packed[:7].tolist()) == b"W8A8PKW"
    sums = packed[64 + n_pad * k_pad:].view(torch.int32)
    assert sums[:37].tolist() == w_q.sum(dim=1, dtype=torch.int32).tolist()
    assert not sums[37:].any()


PACKED_SHAPES = [(n, k) for n in (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 48, 100)
                 for k in (1, 2, 3, 4, 5, 8, 31, 32, 33, 63, 64, 65, 127, 257)] + [(4096, 1), (1, 4096), (1000, 1000)]


def test_packed_weight_nbytes_matches_pack_weight(variant):
    """The one Python source of the packed size (w8a8_cpu._packed_weight, mirroring packed_weight_sizes in
    csrc/common/gemm_driver.cpp; the fake pack_weight uses it) against the real blob, in every variant's layout."""
    for n, k in PACKED_SHAPES:
        real = w8a8_cpu.pack_weight(torch.ones(n, k, dtype=torch.int8)).numel()
        fake = torch.ops.w8a8_cpu.pack_weight(torch.empty(n, k, dtype=torch.int8, device="meta")).numel()
        assert packed_weight_nbytes(n, k) == real == fake, (variant, n, k)


def test_empty_m_returns_empty(variant, gen):
    w_q, w_scale = random_weight(8, 16, gen)
    out = w8a8_cpu.int8_scaled_mm_with_quant(torch.empty(0, 16), w_q, w_scale)
    assert out.shape == (0, 8)
    out = w8a8_cpu.int8_scaled_mm(torch.empty(0, 16, dtype=torch.int8), w_q, torch.empty(0, 1), w_scale)
    assert out.shape == (0, 8)
    x_q, x_scale = w8a8_cpu.per_token_quant_int8(torch.empty(0, 16))
    assert x_q.shape == (0, 16) and x_scale.shape == (0, 1)


def test_large_k_exact(variant, gen):
    k = 20000
    x_q = torch.full((2, k), -128, dtype=torch.int8)
    w_q = torch.full((3, k), -128, dtype=torch.int8)
    got = w8a8_cpu.int8_scaled_mm(x_q, w_q, torch.ones(2, 1), torch.ones(3), None, torch.float32)
    assert got[0, 0].item() == float(k * 16384)


@pytest.mark.parametrize("packed", [False, True], ids=["raw", "packed"])
def test_int8_mm_and_scale_accumulators_give_int8_scaled_mm_bits(variant, packed, gen):
    # The tensor-parallel split: exact int32 partial products over K slices, summed, then one epilogue.
    m, n, k = 9, 37, 300
    x_q = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
    x_scale = torch.rand(m, 1, generator=gen) * 0.05 + 1e-3
    w_q, w_scale = random_weight(n, k, gen)
    bias = torch.randn(n, generator=gen)
    acc = w8a8_cpu.int8_mm(x_q, w8a8_cpu.pack_weight(w_q) if packed else w_q)
    assert acc.dtype == torch.int32 and torch.equal(acc.long(), x_q.long() @ w_q.long().t())
    parts = [w8a8_cpu.int8_mm(x_q[:, a:b].contiguous(), w_q[:, a:b].contiguous()) for a, b in ((0, 100), (100, 300))]
    assert torch.equal(parts[0] + parts[1], acc)
    for out_dtype in DTYPES:
        want = w8a8_cpu.int8_scaled_mm(x_q, w_q, x_scale, w_scale, bias, out_dtype)
        got = w8a8_cpu.scale_accumulators(acc, x_scale, w_scale, bias, out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, want)


def test_shared_amax_quantizes_slices_as_the_whole_row(variant, gen):
    x = torch.randn(6, 300, generator=gen) * torch.linspace(0.1, 3, 300)
    x[2] = 0  # all-zero row: the eps floor applies to the shared absmax too
    q, s = w8a8_cpu.per_token_quant_int8(x)
    amax = x.abs().amax(dim=1)
    for a, b in ((0, 100), (100, 299), (299, 300)):
        q_part, s_part = w8a8_cpu.per_token_quant_int8(x[:, a:b].contiguous(), amax)
        assert torch.equal(q_part, q[:, a:b]) and torch.equal(s_part, s)
    w_q, w_scale = random_weight(20, 300, gen)
    fused = w8a8_cpu.int8_scaled_mm_with_quant(x, w_q, w_scale, amax=amax)
    assert torch.equal(fused, w8a8_cpu.int8_scaled_mm_with_quant(x, w_q, w_scale))
    with pytest.raises(ValueError, match="amax"):
        w8a8_cpu.per_token_quant_int8(x, amax[:3])


def test_a_given_amax_keeps_the_row_rules(variant, gen):
    """A caller's amax skipped the row's own pass: a NaN/Inf row became finite +-127 codes (finite outputs, also under
    W8A8_CPU_CHECK_FINITE=1), and an amax below the row's absmax saturated it, silently. Now the row's own absmax is
    read too: a non-finite row (or a NaN / +Inf amax, as the maximum over ranks gives) is a NaN row, an amax below the
    row's is a ValueError naming amax."""
    x = torch.randn(4, 40, generator=gen)
    x[1, 7], x[2, 3] = float("nan"), float("-inf")
    amax = torch.full((4,), 8.0)
    q, s = w8a8_cpu.per_token_quant_int8(x, amax)
    assert s[1:3].isnan().all() and not q[1:3].any()
    assert torch.equal(s[[0, 3]], torch.full((2, 1), 8.0 / 127))
    amax[3] = float("inf")
    amax[0] = float("nan")
    q, s = w8a8_cpu.per_token_quant_int8(x, amax)
    assert s.isnan().all() and not q.any()
    w_q, w_scale = random_weight(5, 40, gen)
    out = w8a8_cpu.int8_scaled_mm_with_quant(x, w_q, w_scale, amax=torch.full((4,), 8.0))
    assert out[1:3].isnan().all() and not out[[0, 3]].isnan().any()
    clean = torch.randn(3, 40, generator=gen)
    own = clean.abs().amax(dim=1)
    for given in (own * 0.99, -own, torch.zeros(3)):
        given[0], given[2] = own[0], own[2]  # row 1 only
        for call in (lambda: w8a8_cpu.per_token_quant_int8(clean, given),
                     lambda: w8a8_cpu.int8_scaled_mm_with_quant(clean, w_q, w_scale, amax=given)):
            with pytest.raises(ValueError, match=r"^amax: row 1's amax .* is below the row's own absolute maximum"):
                call()


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"),
                    reason=f"torch.library.opcheck needs torch >= 2.4 (this is torch {torch.__version__})")
@pytest.mark.parametrize(
    "op",
    ["per_token_quant_int8", "int8_scaled_mm", "int8_scaled_mm_with_quant", "pack_weight", "int8_mm",
     "scale_accumulators", "int8_gated_mm_with_quant"],
)
def test_opcheck(op, gen):
    w_q, w_scale = random_weight(24, 40, gen)
    x = torch.randn(5, 40, generator=gen)
    x_q, x_scale = w8a8_cpu.per_token_quant_int8(x)
    packed = w8a8_cpu.pack_weight(w_q)
    args = {
        "per_token_quant_int8": [(x,), (x.bfloat16(),), (x, x.abs().amax(1) * 2)],
        "int8_mm": [(x_q, w_q)],
        "scale_accumulators": [(w8a8_cpu.int8_mm(x_q, w_q), x_scale, w_scale, torch.randn(24), torch.bfloat16)],
        "int8_scaled_mm": [(x_q, w_q, x_scale, w_scale, None, torch.float32),
                           (x_q, packed, x_scale, w_scale, torch.randn(24), torch.bfloat16)],
        "int8_scaled_mm_with_quant": [(x, packed, w_scale, None, None),
                                      (x.reshape(1, 5, 40).half(), w_q, w_scale, torch.randn(24), torch.float32)],
        "pack_weight": [(w_q,)],
        "int8_gated_mm_with_quant": [(x, packed, w_scale, None, None),
                                     (x.reshape(1, 5, 40).bfloat16(), w_q, w_scale, torch.randn(24), torch.float32)],
    }[op]
    for a in args:
        torch.library.opcheck(getattr(torch.ops.w8a8_cpu, op).default, a)


@pytest.mark.slow_under_emulation  # inductor needs a host C++ compiler for the target
@pytest.mark.skipif(not hasattr(torch, "compile"), reason=f"torch.compile needs torch >= 2.0 (this is torch {torch.__version__})")
def test_torch_compile_model(gen):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32))
    w8a8_cpu.nn.quantize_model(model)
    x = torch.randn(7, 64, generator=gen)
    eager = model(x)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    x2 = torch.randn(3, 64, generator=gen)  # another M
    torch.testing.assert_close(compiled(x2), model(x2), rtol=0, atol=0)


@pytest.mark.parametrize("n,k", [(1, 1), (17, 33), (64, 1000)])
def test_unpack_weight_inverts_pack_weight(variant, n, k, gen):
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    blob = w8a8_cpu.pack_weight(w)
    assert torch.equal(w8a8_cpu.unpack_weight(blob), w)
    blob[64 + (blob.numel() - 64) // 2] ^= 1  # one body bit: the checksum catches it
    with pytest.raises(ValueError, match="checksum"):
        w8a8_cpu.unpack_weight(blob)
    with pytest.raises(ValueError, match="blob"):
        w8a8_cpu.unpack_weight(w)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp64 over [..., 2I] (gate half first)."""
    g, u = gate_up.double().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


@pytest.mark.parametrize("m, n, k", [(1, 2, 1), (3, 32, 100), (17, 3072, 576), (64, 66, 4096)])
def test_gated_mm_is_silu_of_the_fused_gemm(variant, m, n, k, gen):
    """int8_gated_mm_with_quant: its GEMM is the plain op's over all 2I channels, and the plain op's output over all
    channels is bit for bit the concatenation of the gate and up halves run separately (per-channel weights,
    per-token activations); the SiLU * up on top agrees with fp64 to fp32 rounding, on every variant."""
    w_q, w_scale = random_weight(n, k, gen)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    both = w8a8_cpu.int8_scaled_mm_with_quant(x, w_q, w_scale, bias)
    i = n // 2
    halves = [w8a8_cpu.int8_scaled_mm_with_quant(x, w_q[s], w_scale[s], bias[s]) for s in (slice(0, i), slice(i, n))]
    assert torch.equal(both, torch.cat(halves, dim=1))
    out = w8a8_cpu.int8_gated_mm_with_quant(x, w8a8_cpu.pack_weight(w_q), w_scale, bias)
    assert out.shape == (m, i) and out.dtype == torch.float32
    ideal = silu_mul_reference(both)
    torch.testing.assert_close(out.double(), ideal, rtol=2e-6, atol=1e-6 * float(ideal.abs().max()))
    out_bf16 = w8a8_cpu.int8_gated_mm_with_quant(x.bfloat16(), w_q, w_scale, bias, torch.bfloat16)
    assert out_bf16.dtype == torch.bfloat16


def test_gated_mm_bit_identical_across_variants_and_threads(gen):
    w_q, w_scale = random_weight(192, 300, gen)
    x = torch.randn(37, 300, generator=gen)
    with w8a8_cpu.use_variant("ref"):
        expected = w8a8_cpu.int8_gated_mm_with_quant(x, w_q, w_scale)
    for variant in w8a8_cpu.info()["runnable_variants"]:
        for t in {1, 2, torch.get_num_threads()}:
            with intra_op_threads(t), w8a8_cpu.use_variant(variant):
                assert torch.equal(w8a8_cpu.int8_gated_mm_with_quant(x, w_q, w_scale), expected), (variant, t)


@pytest.mark.parametrize("scheme", ["int8", "int4 g32 minimums"])
@pytest.mark.parametrize("m, inter, k", [(3, 16, 64), (37, 96, 300), (17, 24, 64), (9, 40, 96)])
def test_gated_mm_rows_equal_each_row_alone(variant, scheme, m, inter, k, gen):
    """Rows of tiles run each gate panel with its up panel and apply silu(gate) * up to the task's own block (when I
    is whole panels: inter 16, 96), a row alone goes through the decode path (all 2I channels, then one pass): per-token
    quantization makes each output row a function of its input row only, so the two must agree bit for bit, for int8
    and int4 weights, fp32 and bf16 outputs, 1 and 2 threads."""
    n = 2 * inter
    if scheme == "int8":
        w_q, _ = random_weight(n, k, gen)
        blob = w8a8_cpu.pack_weight(w_q)
    else:
        q, scale, minimum = w8a8_cpu.quantize_weight_int4(torch.randn(n, k, generator=gen), 32, False)
        blob = w8a8_cpu.pack_weight_int4(q, scale, minimum, 32)
    w_scale = torch.rand(n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    whole = {}
    for t in (1, 2):
        with intra_op_threads(t):
            for dtype in (torch.float32, torch.bfloat16):
                rows = x.to(dtype)
                whole[dtype] = w8a8_cpu.int8_gated_mm_with_quant(rows, blob, w_scale, bias, dtype)
                alone = torch.cat([w8a8_cpu.int8_gated_mm_with_quant(rows[i:i + 1], blob, w_scale, bias, dtype)
                                   for i in range(m)])
                assert torch.equal(whole[dtype], alone), (t, dtype)
    ideal = silu_mul_reference(w8a8_cpu.int8_scaled_mm_with_quant(x, blob, w_scale, bias))
    torch.testing.assert_close(whole[torch.float32].double(), ideal, rtol=2e-6, atol=1e-6 * float(ideal.abs().max()))


def test_gated_mm_rejects_odd_channels(gen):
    w_q, w_scale = random_weight(5, 8, gen)
    with pytest.raises(ValueError, match="even number of output channels"):
        w8a8_cpu.int8_gated_mm_with_quant(torch.randn(2, 8), w_q, w_scale)


@pytest.mark.parametrize("n, k", [(1, 1), (33, 100), (100, 7)])
def test_packed_rows_gathers_the_weight_rows(variant, n, k, gen):
    w_q, _ = random_weight(n, k, gen)
    rows = torch.randint(0, n, (3, 5), generator=gen)
    assert torch.equal(w8a8_cpu.packed_rows(w8a8_cpu.pack_weight(w_q), rows), w_q[rows])
    with pytest.raises(IndexError, match=rf"\[0, {n}\)"):
        w8a8_cpu.packed_rows(w8a8_cpu.pack_weight(w_q), torch.tensor([n]))
