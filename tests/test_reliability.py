"""Tracing rejects what running rejects: every bad call of test_bad_input / test_moe that the op refuses from its
arguments' metadata raises the same ValueError from the fake kernel (FakeTensorMode, torch.compile) as from the
op, instead of tracing to an invented output. Plus: a missing tensor argument is a ValueError naming it."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import w8a8_cpu
from test_bad_input import CASES, good  # noqa: F401  (good: the fixture the CASES take)
from test_moe import BAD, make_moe

# Refused by reading data, which fake tensors do not have (the fake kernels' docstring); or not an op at all.
NEEDS_DATA = {
    "K mismatch packed": "K is in the blob's header",
    "w uint8 not a blob": "the magic is data",
    "w truncated blob": "the header's sizes are data",
    "w_scale wrong length packed": "N is in the blob's header",
    "id too large": "values", "id negative": "values",
    "packed wrong shape": "N and K are in each expert's header",
    "packed garbage": "the magic is data",
    **dict.fromkeys(("w_scale NaN", "w_scale Inf fused", "w_scale NaN packed", "bias -Inf", "gated w_scale NaN",
                     "scale_accumulators w_scale NaN"), "finiteness is a property of the values"),
}
NOT_OPS = {"quantize_weight NaN", "quantize_weight int", "quantize_weight 1-D", "unknown variant", "pack_moe 2-D"}


def traced_cases(table):
    kept = [case for case in table if case[0] not in NEEDS_DATA and case[0] not in NOT_OPS]
    return pytest.mark.parametrize("call,fragment", [c[1:] for c in kept], ids=[c[0] for c in kept])


def test_left_out_cases_exist():
    assert set(NEEDS_DATA) | NOT_OPS <= {case[0] for case in CASES + BAD}


def assert_op_and_fake_raise(call, args, fragment):
    with pytest.raises(ValueError) as real:
        call(args)
    assert fragment in str(real.value)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError) as fake:
        call(args)
    assert fragment in str(fake.value)


@traced_cases(CASES)
def test_fake_kernels_raise_like_the_ops(good, call, fragment):  # noqa: F811
    assert_op_and_fake_raise(call, good, fragment)


@traced_cases(BAD)
def test_fused_experts_fake_raises_like_the_op(call, fragment, gen):
    assert_op_and_fake_raise(call, make_moe(5, 64, 32, 4, 2, gen), fragment)


def test_torch_compile_rejects_bad_shapes_while_tracing(gen):
    w_q = torch.randint(-127, 128, (8, 32), dtype=torch.int8, generator=gen)
    w_scale = torch.rand(8, generator=gen)
    fn = torch.compile(lambda x: w8a8_cpu.int8_scaled_mm_with_quant(x, w_q, w_scale), backend="eager", fullgraph=True)
    for x, fragment in [(torch.randn(4, 10), "w: K mismatch: weight has K = 32 but the activations have K = 10"),
                        (torch.tensor(1.0), "x: expected at least 1 dimension"),
                        (torch.ones(4, 32, dtype=torch.int8), "x: dtype must be float32, bfloat16 or float16")]:
        with pytest.raises(Exception, match="ValueError") as exc:  # dynamo wraps the fake kernel's ValueError
            fn(x)
        assert fragment in str(exc.value)


def test_fake_pack_weight_matches_the_op(gen):
    w_q = torch.randint(-127, 128, (37, 90), dtype=torch.int8, generator=gen)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = w8a8_cpu.pack_weight(w_q)
    real = w8a8_cpu.pack_weight(w_q)
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


# ---- missing tensors ---------------------------------------------------------------------------------------------

WRAPPERS = {  # wrapper: its required tensor arguments, in order
    w8a8_cpu.per_token_quant_int8: ["x"],
    w8a8_cpu.int8_scaled_mm: ["x_q", "w", "x_scale", "w_scale"],
    w8a8_cpu.int8_scaled_mm_with_quant: ["x", "w", "w_scale"],
    w8a8_cpu.pack_weight: ["w"],
    w8a8_cpu.fused_experts: ["hidden", "w13", "w2", "topk_weights", "topk_ids", "w13_scale", "w2_scale"],
}


@pytest.mark.parametrize("wrapper,arg", [(f, a) for f, args in WRAPPERS.items() for a in args],
                         ids=[f"{f.__name__}-{a}" for f, args in WRAPPERS.items() for a in args])
def test_missing_tensor_is_a_value_error_naming_it(wrapper, arg):
    args = {name: torch.zeros(1) for name in WRAPPERS[wrapper]}
    args[arg] = None
    with pytest.raises(ValueError, match=f"^{arg}: expected a tensor, got NoneType"):
        wrapper(**args)
