"""The layer ops of the lean decoder (csrc/common/layer_ops.h): RMSNorm with the residual add, rotary embedding,
causal prompt attention and the decode step's attention (its KV cache storages: test_kv_cache.py), against fp64 references of their formulas (and against the torch expressions they replace,
bit for bit where the operation order is the same), in every float dtype, at 1 and 2 threads; bad input is a
ValueError naming the argument, from the op and from its fake kernel alike."""
import re

import pytest
import torch

import w8a8_cpu  # also registers torch.ops.w8a8_cpu
from conftest import intra_op_threads

ops = torch.ops.w8a8_cpu
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# one rounding to the dtype after an fp32 computation: half an ulp plus the fp32 error
RTOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}


def rms_norm_reference(x, weight, eps):
    v = x.double()
    return weight.double() * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (3, 70, 37), (2, 16)])
def test_rms_norm_equals_the_formula(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    weight = torch.rand(shape[-1], generator=g).to(dtype) + 0.5
    got = ops.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    expected = rms_norm_reference(x, weight, 1e-5)
    torch.testing.assert_close(got.double(), expected, rtol=RTOL[dtype], atol=1e-6)
    with intra_op_threads(2):
        assert torch.equal(ops.rms_norm(x, weight, 1e-5), got)  # rows are independent


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_stream_in_place(dtype):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(1, 300, 96, generator=g).to(dtype)
    delta = torch.randn(1, 300, 96, generator=g).to(dtype)
    weight = torch.rand(96, generator=g) + 0.5
    stream = h.clone()
    normed = ops.add_rms_norm_(stream, delta, weight, 1e-6)
    assert torch.equal(stream, h + delta)  # the add is torch's (fp32 add, one rounding)
    assert torch.equal(normed, ops.rms_norm(h + delta, weight, 1e-6))
    torch.testing.assert_close(normed.double(), rms_norm_reference(h + delta, weight, 1e-6), rtol=RTOL[dtype],
                               atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("positions", [1, 45])
def test_rotary_embedding_rotates_the_first_heads_in_place(dtype, positions):
    g = torch.Generator().manual_seed(positions)
    heads, kv_heads, d = 4, 2, 16
    qkv = torch.randn(1, positions, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    angle = torch.rand(positions, d // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = (f(torch.cat([angle, angle], dim=-1)).float() for f in (torch.cos, torch.sin))
    x = qkv.clone()
    ops.rotary_embedding_(x, cos, sin, heads + kv_heads)
    rotated = (heads + kv_heads) * d
    assert torch.equal(x[..., rotated:], qkv[..., rotated:])  # the v heads are left as they are
    qk = qkv[..., :rotated].view(1, positions, heads + kv_heads, d)
    c, s = cos.view(1, positions, 1, d), sin.view(1, positions, 1, d)
    half = d // 2
    if dtype == torch.float32:  # the same operations as transformers' apply_rotary_pos_emb in fp32: the same bits
        expected = qk * c + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * s
        assert torch.equal(x[..., :rotated].view_as(expected), expected)
    q = qk.double()
    exact = q * c.double() + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * s.double()
    torch.testing.assert_close(x[..., :rotated].view_as(exact).double(), exact, rtol=RTOL[dtype], atol=1e-6)


@pytest.mark.parametrize("t", [1, 31, 32, 33, 70, 97])
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_attention_equals_sdpa(t, threads):
    """Blocked causal attention of a prompt (query heads grouped per KV head, each block of positions against the
    keys up to its last one, blocks paired across threads) equals causal grouped-query attention in fp64 on every
    position and head, q given as a strided view of a fused q/k/v output as the Decoder does."""
    g = torch.Generator().manual_seed(t)
    q = torch.randn(t, 10, 16, generator=g)[:, :6]
    k, v = (torch.randn(2, t, 16, generator=g) for _ in range(2))
    with intra_op_threads(threads):
        got = ops.causal_attention(q, k, v, 0.3)
    assert got.shape == (t, 6, 16) and got.is_contiguous()
    torch.testing.assert_close(got.double(), attention_reference(q, k, v, 0.3), rtol=0, atol=2e-6)


def test_decode_attention_non_finite_and_overlap():
    """A NaN or Inf in a query head makes that head's output NaN, in a cached key every head of its KV group; caches
    that overlap each other or qkv are a ValueError."""
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 30, 8, generator=g), torch.randn(2, 30, 8, generator=g)
    qkv = torch.randn(8, 8, generator=g)
    for bad in (float("nan"), float("inf")):
        q_bad = qkv.clone()
        q_bad[1, 2] = bad
        out = ops.decode_attention_(q_bad, k_cache.clone(), v_cache.clone(), 10, 4, 0.5)
        assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()
        k_bad = k_cache.clone()
        k_bad[1, 5, 0] = bad
        out = ops.decode_attention_(qkv, k_bad, v_cache.clone(), 10, 4, 0.5)
        assert out[2:].isnan().all() and not out[:2].isnan().any()
    both = torch.randn(2, 2, 30, 8)
    with pytest.raises(ValueError, match="must not overlap each other or qkv"):
        ops.decode_attention_(qkv, both[0], both[0], 3, 4, 0.5)
    flat = torch.randn(2 * 30 * 8 + 32)
    with pytest.raises(ValueError, match="must not overlap each other or qkv"):
        ops.decode_attention_(flat[:64].view(8, 8), flat[32:].view(2, 30, 8), v_cache, 3, 4, 0.5)


def attention_reference(q, k, v, scale):
    """softmax(scale q k^T + causal mask) v in fp64, query head h reading KV head h // (heads / kv_heads)."""
    t, heads, _ = q.shape
    kv = k.double().repeat_interleave(heads // k.shape[0], dim=0), v.double().repeat_interleave(heads // k.shape[0],
                                                                                                 dim=0)
    scores = torch.einsum("thd,hsd->hts", q.double(), kv[0]) * scale
    scores.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,hsd->thd", torch.softmax(scores, dim=-1), kv[1])


# (op, args: tensors made on the CPU, moved to the test's device; expected message fragment)
Z = torch.zeros
BAD = [
    (ops.rms_norm, (Z(3, 8).int(), Z(8) + 1, 1e-5), "x: dtype must be float32"),
    (ops.rms_norm, (Z(8, 3).t(), Z(3) + 1, 1e-5), "x: must be contiguous"),
    (ops.rms_norm, (Z(2, 0), Z(0), 1e-5), "x: expected a tensor [..., N] with N > 0"),
    (ops.rms_norm, (Z(1, 16385), Z(16385), 1e-5), "exceeds 16384"),
    (ops.rms_norm, (Z(3, 8), Z(7), 1e-5), "weight: expected shape [8]"),
    (ops.rms_norm, (Z(3, 8), Z(8, dtype=torch.int64), 1e-5), "weight: dtype must be"),
    (ops.rms_norm, (Z(3, 8), Z(8), float("nan")), "eps: expected a finite float32 value >= 0"),
    (ops.rms_norm, (Z(3, 8), Z(8), -1.0), "eps: expected a finite float32 value >= 0"),
    (ops.rms_norm, (Z(3, 8), Z(8), 1e300), "eps: expected a finite float32 value >= 0"),
    (ops.add_rms_norm_, (Z(3, 8), Z(3, 7), Z(8), 1e-5), "delta: expected the shape and dtype"),
    (ops.add_rms_norm_, (Z(3, 8), Z(3, 8).half(), Z(8), 1e-5), "delta: expected the shape and dtype"),
    (ops.rotary_embedding_, (Z(2, 32), Z(2, 8).double(), Z(2, 8), 1), "cos: dtype must be float32"),
    (ops.rotary_embedding_, (Z(2, 32), Z(2, 8), Z(2, 6), 1), "sin: expected the shape"),
    (ops.rotary_embedding_, (Z(2, 32), Z(2, 7), Z(2, 7), 1), "head_dim (dim 1) must be even"),
    (ops.rotary_embedding_, (Z(2, 32), Z(3, 8), Z(3, 8), 1), "cos: expected one row per row"),
    (ops.rotary_embedding_, (Z(2, 32), Z(2, 8), Z(2, 8), 5), "heads: expected 1 <= heads <= 4"),
    (ops.rotary_embedding_, (Z(2, 32), Z(2, 8), Z(2, 8), 0), "heads: expected 1 <= heads"),
    (ops.rotary_embedding_, (Z(32, 2).t(), Z(2, 8), Z(2, 8), 1), "x: must be contiguous"),
    (ops.causal_attention, (Z(4, 2, 8).half(), Z(1, 4, 8), Z(1, 4, 8), 1.0), "q: dtype must be float32"),
    (ops.causal_attention, (Z(4, 8, 2).transpose(1, 2), Z(1, 4, 8), Z(1, 4, 8), 1.0),
     "q: expected [positions, heads, head_dim] with contiguous heads"),
    (ops.causal_attention, (Z(4, 2, 8), Z(1, 4, 8), Z(1, 5, 8), 1.0), "v: expected the shape of k"),
    (ops.causal_attention, (Z(4, 2, 8), Z(1, 3, 8), Z(1, 3, 8), 1.0), "k: expected [kv_heads, 4, 8]"),
    (ops.causal_attention, (Z(4, 3, 8), Z(2, 4, 8), Z(2, 4, 8), 1.0), "k: kv_heads (dim 0) must divide q's 3 heads"),
    (ops.causal_attention, (Z(4, 0, 8), Z(1, 4, 8), Z(1, 4, 8), 1.0), "q: expected at least one head"),
    (ops.causal_attention, (Z(4, 2, 8), Z(1, 4, 8), Z(1, 4, 8), float("inf")), "scale: expected a finite float32 value"),
    (ops.causal_attention, (Z(4, 2, 8), Z(1, 4, 8), Z(1, 4, 8), -1e300), "scale: expected a finite float32 value"),
    (ops.decode_attention_, (Z(8, 8).half(), Z(2, 5, 8), Z(2, 5, 8), 0, 4, 1.0), "qkv: dtype must be float32"),
    (ops.decode_attention_, (Z(8, 8), Z(2, 8, 5).transpose(1, 2), Z(2, 5, 8), 0, 4, 1.0),
     "k_cache: expected a non-empty contiguous tensor"),
    (ops.decode_attention_, (Z(8, 8), Z(2, 5, 0), Z(2, 5, 0), 0, 4, 1.0), "k_cache: expected a non-empty"),
    (ops.decode_attention_, (Z(8, 8), Z(2, 5, 8, 1), Z(2, 5, 8, 1), 0, 4, 1.0), "k_cache: expected [kv_heads, length"),
    (ops.decode_attention_, (Z(8, 1025), Z(2, 1, 1025), Z(2, 1, 1025), 0, 4, 1.0), "head_dim <= 1024"),
    (ops.decode_attention_, (Z(8, 8), Z(2, 5, 8), Z(2, 6, 8), 0, 4, 1.0), "v_cache: expected the shape of k_cache"),
    (ops.decode_attention_, (Z(8, 8), Z(2, 5, 8), Z(2, 5, 8), 0, 3, 1.0), "heads: expected a positive multiple"),
    (ops.decode_attention_, (Z(8, 8), Z(2, 5, 8), Z(2, 5, 8), 0, 0, 1.0), "heads: expected a positive multiple"),
    (ops.decode_attention_, (Z(7, 8), Z(2, 5, 8), Z(2, 5, 8), 0, 4, 1.0), "qkv: expected [8, 8]"),
    (ops.decode_attention_, (Z(8, 8), Z(2, 5, 8), Z(2, 5, 8), 5, 4, 1.0), "position: expected 0 <= position < 5"),
    (ops.decode_attention_, (Z(8, 8), Z(2, 5, 8), Z(2, 5, 8), -1, 4, 1.0), "position: expected 0 <= position"),
    (ops.decode_attention_, (Z(8, 8), Z(2, 5, 8), Z(2, 5, 8), 0, 4, float("nan")), "scale: expected a finite"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("op, args, fragment", BAD)
def test_bad_input_raises_naming_the_argument(op, args, fragment, device):
    """The op on CPU tensors and its fake kernel on meta tensors (torch.compile's view) raise the same error."""
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(ValueError, match=re.escape(fragment)):
        op(*args)


def test_overlapping_operands_are_rejected():
    """An in-place op whose other operand shares x's memory would read what it has already written: a ValueError (an
    operand that is x itself, h += h, is fine: each row reads its own elements before writing them)."""
    buffer = torch.randn(5, 8)
    with pytest.raises(ValueError, match="delta: overlaps x in part"):
        ops.add_rms_norm_(buffer[:4], buffer[1:], torch.ones(8), 1e-5)
    h = torch.randn(3, 8)
    doubled = ops.add_rms_norm_(h.clone(), h.clone(), torch.ones(8), 1e-5)
    same = h.clone()
    assert torch.equal(ops.add_rms_norm_(same, same, torch.ones(8), 1e-5), doubled) and torch.equal(same, h + h)
    qkv = torch.randn(2, 32)
    with pytest.raises(ValueError, match="cos: overlaps x"):
        ops.rotary_embedding_(qkv, qkv.view(-1)[:16].view(2, 8), torch.ones(2, 8), 2)
    stream = torch.randn(4, 8)  # an fp32 weight is read in place while x is written: the result hung on the threads
    with pytest.raises(ValueError, match="weight: overlaps x"):
        ops.add_rms_norm_(stream, torch.randn(4, 8), stream[2], 1e-5)


def test_layer_ops_refuse_gradients_instead_of_dropping_them():
    """They have no autograd formula: y = rms_norm(x) + x gave x.grad = 1 (rms_norm's part missing) with only torch's
    warning. The functional ones raise at backward, the in-place ones at the call."""
    x = torch.randn(3, 8, requires_grad=True)
    y = ops.rms_norm(x, torch.ones(8), 1e-6) + x
    with pytest.raises(ValueError, match="^x: requires grad, but rms_norm has no gradient"):
        y.sum().backward()
    q = torch.randn(5, 2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="^q: requires grad, but causal_attention has no gradient"):
        ops.causal_attention(q, torch.randn(1, 5, 8), torch.randn(1, 5, 8), 0.5).sum().backward()
    weight = torch.ones(8, requires_grad=True)
    with pytest.raises(ValueError, match="^weight: requires grad, but add_rms_norm_ has no gradient.*no_grad"):
        ops.add_rms_norm_(torch.randn(3, 8), torch.randn(3, 8), weight, 1e-6)
    with pytest.raises(ValueError, match="^x: requires grad, but rotary_embedding_ has no gradient"):
        ops.rotary_embedding_(x.clone(), torch.ones(3, 4), torch.zeros(3, 4), 1)
    with torch.no_grad():  # inference, as the lean loop runs them
        ops.add_rms_norm_(torch.randn(3, 8), torch.randn(3, 8), weight, 1e-6)


def test_non_finite_scores_give_nan_rows():
    """A NaN or Inf in q makes that position's output NaN (every head of its KV group reads it), as torch's softmax
    would; a non-finite key makes every later position NaN; the positions before it stay exact."""
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(40, 4, 8, generator=g), torch.randn(2, 40, 8, generator=g), torch.randn(2, 40, 8, generator=g)
    for bad in (float("nan"), float("inf")):
        q_bad = q.clone()
        q_bad[7, 0, 3] = bad
        out = ops.causal_attention(q_bad, k, v, 0.5)
        assert out[7, 0].isnan().all() and not out[7, 1:].isnan().any()
        assert not out[torch.arange(40) != 7].isnan().any()
        k_bad = k.clone()
        k_bad[1, 20, 0] = bad
        out = ops.causal_attention(q, k_bad, v, 0.5)
        assert out[20:, 2:].isnan().all() and not out[:20].isnan().any() and not out[:, :2].isnan().any()
        torch.testing.assert_close(out[:20].double(), attention_reference(q, k, v, 0.5)[:20], rtol=0, atol=2e-6)


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"),
                    reason=f"torch.library.opcheck needs torch >= 2.4 (this is torch {torch.__version__})")
def test_opcheck():
    g = torch.Generator().manual_seed(5)
    x, delta = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    cos, sin = torch.rand(10, 8, generator=g), torch.rand(10, 8, generator=g)
    q, k = torch.randn(7, 4, 8, generator=g), torch.randn(2, 7, 8, generator=g)
    for op, args in ((ops.rms_norm, (x, torch.rand(32), 1e-5)), (ops.add_rms_norm_, (x, delta, torch.rand(32), 1e-5)),
                     (ops.rotary_embedding_, (x, cos, sin, 3)), (ops.causal_attention, (q, k, k.clone(), 0.5)),
                     (ops.decode_attention_, (torch.randn(8, 8, generator=g), k, k.clone(), 3, 4, 0.5))):
        torch.library.opcheck(op.default, args)
