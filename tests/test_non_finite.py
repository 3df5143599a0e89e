"""One rule for non-finite activations, as nn.Linear: a NaN/Inf row of x gives a NaN output row and leaves every other
row exactly as without it (one bad request must not fail a whole serving batch); W8A8_CPU_CHECK_FINITE=1 makes the ops
raise instead. Weight-side values (weights, scales, bias) must be finite where a layer is built or loaded."""
import os
import subprocess

import pytest
import torch

import w8a8_cpu
from conftest import python_command


@pytest.fixture
def linear_case(gen):
    x = torch.randn(5, 96, generator=gen)
    w = torch.randint(-127, 128, (24, 96), dtype=torch.int8, generator=gen)
    return x, w, torch.rand(24, generator=gen) + 0.01, torch.randn(24, generator=gen)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_row_gives_nan_row_others_exact(variant, linear_case, bad, dtype):
    x, w, w_scale, bias = linear_case
    x = x.to(dtype)
    poisoned = x.clone()
    poisoned[2, 7] = bad
    got = w8a8_cpu.int8_scaled_mm_with_quant(poisoned, w8a8_cpu.pack_weight(w), w_scale, bias)
    want = w8a8_cpu.int8_scaled_mm_with_quant(x[[0, 1, 3, 4]], w, w_scale, bias)
    assert got[2].isnan().all()
    assert torch.equal(got[[0, 1, 3, 4]], want)
    q, scale = w8a8_cpu.per_token_quant_int8(poisoned)
    assert scale[2].isnan().all() and (q[2] == 0).all() and torch.isfinite(scale[[0, 1, 3, 4]]).all()
    y = w8a8_cpu.int8_scaled_mm(q, w, scale, w_scale)
    assert y[2].isnan().all() and torch.isfinite(y[[0, 1, 3, 4]]).all()


def test_moe_non_finite_token_gives_nan_row_others_exact(variant, gen):
    e, h, inter, m = 4, 64, 32, 6
    w13 = torch.randint(-127, 128, (e, 2 * inter, h), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-127, 128, (e, h, inter), dtype=torch.int8, generator=gen)
    s13, s2 = torch.rand(e, 2 * inter, generator=gen) * 1e-2, torch.rand(e, h, generator=gen) * 1e-2
    hidden = torch.randn(m, h, generator=gen)
    weights = torch.rand(m, 2, generator=gen)
    ids = torch.randint(0, e, (m, 2), generator=gen)
    poisoned = hidden.clone()
    poisoned[3, 0] = float("nan")
    got = w8a8_cpu.fused_experts(poisoned, w13, w2, weights, ids, s13, s2)
    keep = [0, 1, 2, 4, 5]
    want = w8a8_cpu.fused_experts(hidden[keep], w13, w2, weights[keep], ids[keep], s13, s2)
    assert got[3].isnan().all()
    assert torch.equal(got[keep], want)


STRICT_CHILD = r"""
import torch, w8a8_cpu
x = torch.randn(3, 16); x[1, 2] = float("inf")
w = torch.randint(-127, 128, (8, 16), dtype=torch.int8)
checks = [lambda: w8a8_cpu.int8_scaled_mm_with_quant(x, w, torch.ones(8)), lambda: w8a8_cpu.per_token_quant_int8(x),
          lambda: w8a8_cpu.fused_experts(x, torch.zeros(2, 8, 16, dtype=torch.int8), torch.zeros(2, 16, 4,
          dtype=torch.int8), torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long), torch.ones(2, 8), torch.ones(2, 16))]
for check in checks:
    try:
        check()
        print("no error")
    except ValueError as e:
        print("ValueError:", str(e).splitlines()[0])
"""


def test_strict_mode_raises_naming_the_row():
    env = {**os.environ, "W8A8_CPU_CHECK_FINITE": "1"}
    r = subprocess.run([*python_command(), "-c", STRICT_CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3, r.stdout
    assert "x: row 1 contains NaN or Inf" in lines[0] and "x: row 1 contains NaN or Inf" in lines[1], lines
    assert "hidden: row 1 contains NaN or Inf" in lines[2], lines


@pytest.mark.parametrize("field", ["w_scale", "bias"])
def test_w8a8_linear_rejects_non_finite_weight_side_values(field):
    args = {"w_q": torch.ones(4, 8, dtype=torch.int8), "w_scale": torch.ones(4), "bias": torch.zeros(4)}
    args[field] = args[field].clone()
    args[field][1] = float("nan")
    with pytest.raises(ValueError, match=field):
        w8a8_cpu.nn.W8A8Linear(**args)
