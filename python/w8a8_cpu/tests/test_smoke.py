"""Packaged smoke tests: exact-reference checks of every op on every runnable variant.

Installed with the package and run against the installed copy by the conda recipe's tests and by
cibuildwheel's test-command (`python -m pytest -q --pyargs w8a8_cpu.tests`). Self-contained (no conftest,
no numpy) and small, so it also runs quickly under qemu-user. The full suite lives in tests/ of the source.
"""
import pytest
import torch

import w8a8_cpu
from w8a8_cpu import reference

INFO = w8a8_cpu.info()
RUNNABLE = INFO["runnable_variants"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=RUNNABLE)
def variant(request):
    with w8a8_cpu.use_variant(request.param):
        yield request.param


def _gen():
    return torch.Generator().manual_seed(1234)


def _weight(n, k, gen):
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    return w_q, torch.rand(n, generator=gen) * 0.01 + 1e-4


def test_info_reports_a_runnable_selected_variant():
    assert INFO["arch"] in ("x86_64", "aarch64", "ppc64le")
    assert "ref" in RUNNABLE
    assert set(RUNNABLE) <= set(INFO["compiled_variants"])
    assert INFO["selected_variant"] in RUNNABLE


def test_per_token_quant_exact(variant):
    x = torch.randn(5, 77, generator=_gen())
    for dtype in DTYPES:
        got_q, got_s = w8a8_cpu.per_token_quant_int8(x.to(dtype))
        want_q, want_s = reference.per_token_quant_int8(x.to(dtype))
        assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)


@pytest.mark.parametrize("packed", [False, True], ids=["raw", "packed"])
def test_int8_scaled_mm_exact(variant, packed):
    gen = _gen()
    m, n, k = 7, 33, 70
    x_q = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
    x_scale = torch.rand(m, 1, generator=gen) * 0.05 + 1e-3
    w_q, w_scale = _weight(n, k, gen)
    bias = torch.randn(n, generator=gen)
    w = w8a8_cpu.pack_weight(w_q) if packed else w_q
    for out_dtype in DTYPES:
        got = w8a8_cpu.int8_scaled_mm(x_q, w, x_scale, w_scale, bias, out_dtype)
        want = reference.int8_scaled_mm(x_q, w_q, x_scale, w_scale, bias, out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, want)


def test_fused_quant_matmul_exact(variant):
    gen = _gen()
    x = torch.randn(2, 3, 70, generator=gen).to(torch.bfloat16)
    w_q, w_scale = _weight(45, 70, gen)
    got = w8a8_cpu.int8_scaled_mm_with_quant(x, w8a8_cpu.pack_weight(w_q), w_scale)
    x_q, x_scale = reference.per_token_quant_int8(x.reshape(6, 70))
    want = reference.int8_scaled_mm(x_q, w_q, x_scale, w_scale, None, torch.bfloat16).reshape(2, 3, 45)
    assert got.shape == (2, 3, 45) and torch.equal(got, want)


def test_fused_experts_close_to_reference(variant):
    gen = _gen()
    m, h, inter, e, topk = 4, 32, 24, 3, 2
    hidden = torch.randn(m, h, generator=gen)
    w13 = torch.randint(-127, 128, (e, 2 * inter, h), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-127, 128, (e, h, inter), dtype=torch.int8, generator=gen)
    w13_scale = torch.rand(e, 2 * inter, generator=gen) * 0.01 + 1e-4
    w2_scale = torch.rand(e, h, generator=gen) * 0.01 + 1e-4
    topk_weights = torch.rand(m, topk, generator=gen)
    topk_ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(m)]).to(torch.int32)
    got = w8a8_cpu.fused_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    want = reference.fused_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    scale = want.abs().max().item() + 1e-6
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * scale)
    w13_p, w2_p = w8a8_cpu.pack_moe_weights(w13, w2)
    assert torch.equal(w8a8_cpu.fused_experts(hidden, w13_p, w2_p, topk_weights, topk_ids, w13_scale, w2_scale), got)
