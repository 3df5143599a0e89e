"""Bad input gets a clear ValueError/RuntimeError naming the argument, never a crash or a wrong result."""
import numpy as np
import pytest
import torch

import w8a8_cpu

M, N, K = 4, 8, 32


@pytest.fixture
def good():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(M, K, generator=g)
    w_q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    w_scale = torch.rand(N, generator=g)
    x_q, x_scale = w8a8_cpu.per_token_quant_int8(x)
    return dict(x=x, w=w_q, w_scale=w_scale, x_q=x_q, x_scale=x_scale)


def mm(d, **over):
    a = {**d, **over}
    return w8a8_cpu.int8_scaled_mm(a["x_q"], a["w"], a["x_scale"], a["w_scale"], a.get("bias"),
                                   a.get("out_dtype", torch.float32))


def fused(d, **over):
    a = {**d, **over}
    return w8a8_cpu.int8_scaled_mm_with_quant(a["x"], a["w"], a["w_scale"], a.get("bias"), a.get("out_dtype"))


CASES = [
    # (description, call, expected message fragment)
    ("x_q float", lambda d: mm(d, x_q=d["x"]), "x_q: dtype must be int8"),
    ("x_q 1-D", lambda d: mm(d, x_q=d["x_q"][0]), "x_q: expected a 2-D"),
    ("x_q 3-D", lambda d: mm(d, x_q=d["x_q"][None]), "x_q: expected a 2-D"),
    ("x_q non-contiguous last dim", lambda d: mm(d, x_q=torch.zeros(K, M, dtype=torch.int8).t()), "x_q: last dimension"),
    ("K mismatch raw", lambda d: mm(d, w=d["w"][:, :16]), "w: K mismatch"),
    ("K mismatch packed", lambda d: mm(d, w=w8a8_cpu.pack_weight(d["w"][:, :16].contiguous())), "w: packed weight has K"),
    ("w wrong dtype", lambda d: mm(d, w=d["w"].float()), "w: expected a raw int8"),
    ("w 3-D", lambda d: mm(d, w=d["w"][None]), "w: expected a 2-D"),
    ("w uint8 not a blob", lambda d: mm(d, w=torch.zeros(200, dtype=torch.uint8)), "w: 1-D uint8 tensor is not a packed"),
    ("w truncated blob", lambda d: mm(d, w=w8a8_cpu.pack_weight(d["w"])[:-4].clone()), "w: packed weight header"),
    ("w tiny blob", lambda d: mm(d, w=torch.zeros(3, dtype=torch.uint8)), "too short"),
    ("w non-contiguous last dim", lambda d: mm(d, w=torch.zeros(K, N, dtype=torch.int8).t()), "w: last dimension"),
    ("w_scale wrong length", lambda d: mm(d, w_scale=d["w_scale"][:5]), "w_scale: expected shape [8]"),
    ("w_scale wrong length packed", lambda d: mm(d, w=w8a8_cpu.pack_weight(d["w"]), w_scale=d["w_scale"][:5]),
     "w_scale: expected shape [8]"),
    ("w_scale wrong dtype", lambda d: mm(d, w_scale=d["w_scale"].double()), "w_scale: dtype must be float32"),
    ("w_scale 2-D wrong", lambda d: mm(d, w_scale=d["w_scale"].reshape(2, 4)), "w_scale: expected shape"),
    ("x_scale wrong length", lambda d: mm(d, x_scale=d["x_scale"][:2]), "x_scale: expected shape [4]"),
    ("x_scale wrong dtype", lambda d: mm(d, x_scale=d["x_scale"].half()), "x_scale: dtype must be float32"),
    ("bias wrong length", lambda d: mm(d, bias=torch.zeros(3)), "bias: expected shape [8]"),
    ("bias wrong dtype", lambda d: mm(d, bias=torch.zeros(N, dtype=torch.int32)), "bias: dtype must be"),
    ("out_dtype int", lambda d: mm(d, out_dtype=torch.int32), "out_dtype: dtype must be"),
    ("K = 0", lambda d: mm(d, x_q=torch.zeros(M, 0, dtype=torch.int8), w=torch.zeros(N, 0, dtype=torch.int8)),
     "x_q: K (last dim) must be > 0"),
    ("N = 0", lambda d: mm(d, w=torch.zeros(0, K, dtype=torch.int8), w_scale=torch.zeros(0)), "w: N (dim 0) must be > 0"),
    ("K too large", lambda d: fused(d, x=torch.zeros(1, 131072), w=torch.zeros(1, 131072, dtype=torch.int8),
                                   w_scale=torch.ones(1)), "exceeds 131071"),
    ("x int", lambda d: fused(d, x=d["x_q"]), "x: dtype must be float32, bfloat16 or float16"),
    ("x float64", lambda d: fused(d, x=d["x"].double()), "x: dtype must be"),
    ("x scalar", lambda d: fused(d, x=torch.tensor(1.0)), "x: expected at least 1 dimension"),
    ("x non-contiguous last dim", lambda d: fused(d, x=torch.zeros(K, M).t()), "x: last dimension"),
    ("x K mismatch", lambda d: fused(d, x=d["x"][:, :10]), "w: K mismatch"),
    ("quant 3-D", lambda d: w8a8_cpu.per_token_quant_int8(d["x"][None]), "x: expected a 2-D"),
    ("quant int", lambda d: w8a8_cpu.per_token_quant_int8(d["x_q"]), "x: dtype must be"),
    ("pack float", lambda d: w8a8_cpu.pack_weight(d["w"].float()), "w: dtype must be int8"),
    ("pack 1-D", lambda d: w8a8_cpu.pack_weight(d["w"][0]), "w: expected a 2-D"),
    ("pack N = 0", lambda d: w8a8_cpu.pack_weight(torch.zeros(0, 4, dtype=torch.int8)), "w: N (dim 0) must be > 0"),
    ("pack K = 0", lambda d: w8a8_cpu.pack_weight(torch.zeros(4, 0, dtype=torch.int8)), "w: K (last dim) must be > 0"),
    ("quantize_weight NaN", lambda d: w8a8_cpu.quantize_weight(torch.tensor([[1.0, float("nan")]])), "w: weight contains NaN"),
    ("quantize_weight int", lambda d: w8a8_cpu.quantize_weight(d["w"]), "w: expected a floating-point"),
    ("quantize_weight 1-D", lambda d: w8a8_cpu.quantize_weight(d["x"][0]), "w: expected a non-empty 2-D"),
    ("unknown variant", lambda d: w8a8_cpu.use_variant("bogus").__enter__(), "is not a variant compiled"),
    # weight-side values must be finite in every op (activation-side NaN gives NaN rows instead)
    ("w_scale NaN", lambda d: mm(d, w_scale=nan_at(d["w_scale"], 3)), "w_scale: element 3 is nan"),
    ("w_scale Inf fused", lambda d: fused(d, w_scale=nan_at(d["w_scale"], 0, float("inf"))), "w_scale: element 0 is inf"),
    ("w_scale NaN packed", lambda d: fused(d, w=w8a8_cpu.pack_weight(d["w"]), w_scale=nan_at(d["w_scale"], 7)),
     "w_scale: element 7 is nan"),
    ("bias -Inf", lambda d: fused(d, bias=nan_at(torch.zeros(N), 5, float("-inf"))), "bias: element 5 is -inf"),
    ("gated w_scale NaN", lambda d: w8a8_cpu.int8_gated_mm_with_quant(d["x"], d["w"], nan_at(d["w_scale"], 1)),
     "w_scale: element 1 is nan"),
    ("scale_accumulators w_scale NaN", lambda d: w8a8_cpu.scale_accumulators(
        w8a8_cpu.int8_mm(d["x_q"], d["w"]), d["x_scale"], nan_at(d["w_scale"], 2)), "w_scale: element 2 is nan"),
]


def nan_at(t, i, value=float("nan")):
    t = t.clone()
    t.view(-1)[i] = value
    return t


@pytest.mark.parametrize("call,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_argument(good, call, fragment):
    with pytest.raises((ValueError, RuntimeError)) as exc:
        call(good)
    assert fragment in str(exc.value)


def test_non_cpu_tensor_rejected(good):
    # All-meta inputs are shape inference (the fake kernel); a non-CPU tensor among CPU ones is an error.
    out = w8a8_cpu.int8_scaled_mm(good["x_q"].to("meta"), good["w"].to("meta"), good["x_scale"].to("meta"),
                                  good["w_scale"].to("meta"))
    assert out.device.type == "meta" and out.shape == (M, N)
    with pytest.raises(ValueError, match="x_scale: expected a CPU tensor"):
        w8a8_cpu.int8_scaled_mm(good["x_q"], good["w"], good["x_scale"].to("meta"), good["w_scale"])
    with pytest.raises(ValueError, match="bias: expected a CPU tensor"):
        w8a8_cpu.int8_scaled_mm(good["x_q"], good["w"], good["x_scale"], good["w_scale"], torch.zeros(N, device="meta"))


def test_bad_input_leaves_variant_usable(good):
    with pytest.raises(ValueError):
        fused(good, x=good["x"][:, :10])
    assert torch.isfinite(fused(good)).all()


def test_misaligned_float_operands_are_exact(good):
    """Float operands starting at an address that is not a multiple of their element size (made over raw bytes:
    frombuffer, a safetensors file with an odd header length) give the aligned operands' result bit for bit (the
    kernels read elements through typed pointers: misaligned reads are undefined behaviour)."""
    def misaligned(t):  # numpy views a byte buffer at offset 1 (torch's view() refuses a misaligned one)
        raw = bytearray(1) + bytearray(t.contiguous().numpy().tobytes())
        out = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8)[1:].view(t.numpy().dtype)).reshape(t.shape)
        assert out.data_ptr() % t.element_size() != 0 and torch.equal(out, t)
        return out

    want = fused(good, bias=torch.ones(N))
    got = fused(good, x=misaligned(good["x"]), w_scale=misaligned(good["w_scale"]), bias=misaligned(torch.ones(N)))
    assert torch.equal(got, want)
    assert torch.equal(mm(good, x_scale=misaligned(good["x_scale"].reshape(-1))), mm(good))
