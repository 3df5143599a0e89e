"""Fused W8A8 / W4A8 MoE against a per-expert torch loop with the same math (the reference: exact, bit for bit),
every runnable variant."""
import pytest
import torch

import w8a8_cpu
from w8a8_cpu import reference
from conftest import intra_op_threads


def make_moe(m, h, inter, experts, topk, gen, dtype=torch.bfloat16, ids_dtype=torch.int64, skew=False):
    hidden = torch.randn(m, h, generator=gen).to(dtype)
    w13 = torch.randint(-127, 128, (experts, 2 * inter, h), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-127, 128, (experts, h, inter), dtype=torch.int8, generator=gen)
    w13_scale = torch.rand(experts, 2 * inter, generator=gen) * 2e-3 + 1e-4
    w2_scale = torch.rand(experts, h, generator=gen) * 2e-3 + 1e-4
    topk_weights = torch.rand(m, topk, generator=gen)
    if skew:  # every token to expert 0 (and the rest of its slots to 1, 2, ...)
        ids = torch.arange(topk).repeat(m, 1)
    else:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(m)] or
                          [torch.empty(0, topk, dtype=torch.int64)]).reshape(m, topk)
    return dict(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=ids.to(ids_dtype),
                w13_scale=w13_scale, w2_scale=w2_scale)


def run(args, **over):
    a = {**args, **over}
    return w8a8_cpu.fused_experts(a["hidden"], a["w13"], a["w2"], a["topk_weights"], a["topk_ids"], a["w13_scale"],
                                  a["w2_scale"], a.get("activation", "silu"), a.get("on_input", False))


def assert_matches_reference(got, args, on_input=False):
    """The reference computes the op's math operation for operation (its SiLU too): equal bit for bit."""
    want = reference.fused_experts(args["hidden"], args.get("ref_w13", args["w13"]), args.get("ref_w2", args["w2"]),
                                   args["topk_weights"], args["topk_ids"], args["w13_scale"], args["w2_scale"], on_input)
    assert got.dtype == args["hidden"].dtype and got.shape == args["hidden"].shape
    assert torch.equal(got, want)


CASES = [  # m, h, inter, experts, topk, ids dtype, skew
    (1, 256, 256, 8, 2, torch.int64, False),
    (6, 512, 512, 8, 4, torch.int32, False),
    (32, 256, 256, 64, 8, torch.int64, False),
    (64, 97, 45, 8, 2, torch.int32, False),
    (200, 256, 128, 64, 4, torch.int64, False),
    (200, 200, 136, 8, 8, torch.int32, False),
    (64, 256, 256, 1, 1, torch.int64, False),
    (32, 256, 256, 8, 2, torch.int64, True),
    (17, 512, 256, 64, 1, torch.int32, True),
]


@pytest.mark.parametrize("m,h,inter,experts,topk,ids_dtype,skew", CASES)
def test_fused_experts_matches_reference(variant, m, h, inter, experts, topk, ids_dtype, skew, gen):
    args = make_moe(m, h, inter, experts, topk, gen, ids_dtype=ids_dtype, skew=skew)
    assert_matches_reference(run(args), args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_experts_dtypes_and_packed(variant, dtype, gen):
    args = make_moe(9, 160, 96, 8, 2, gen, dtype=dtype)
    raw = run(args)
    assert_matches_reference(raw, args)
    w13_p, w2_p = w8a8_cpu.pack_moe_weights(args["w13"], args["w2"])
    assert torch.equal(run(args, w13=w13_p, w2=w2_p, topk_weights=args["topk_weights"].to(dtype)),
                       run(args, w13=w13_p, w2=w2_p, topk_weights=args["topk_weights"].to(dtype).float()))
    assert torch.equal(run(args, w13=w13_p, w2=w2_p), raw)
    assert torch.equal(run(args, w13_scale=args["w13_scale"][..., None], w2_scale=args["w2_scale"][..., None]), raw)


def test_fused_experts_router_weight_on_input(variant, gen):
    args = make_moe(12, 128, 64, 8, 1, gen)
    assert_matches_reference(run(args, on_input=True), args, on_input=True)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_fused_experts_bit_identical_across_variants_and_threads(weights):
    def moe_args():
        """The same experts every time; int4 ones packed for the active variant (blobs are in its panel layout)."""
        gen = torch.Generator().manual_seed(1234)
        return make_moe(40, 256, 128, 16, 4, gen) if weights == "int8" else \
            make_int4_moe(40, 256, 128, 16, 4, gen, 64, "min_max")
    outputs = []
    for name in w8a8_cpu.info()["runnable_variants"]:
        with w8a8_cpu.use_variant(name):
            outputs.append(run(moe_args()))
    with intra_op_threads(1):
        outputs.append(run(moe_args()))
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


def test_fused_experts_empty_m(variant, gen):
    args = make_moe(0, 64, 32, 4, 2, gen)
    out = run(args)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"),
                    reason=f"torch.library.opcheck needs torch >= 2.4 (this is torch {torch.__version__})")
def test_fused_experts_opcheck(gen):
    args = make_moe(5, 64, 32, 4, 2, gen)
    w13_p, w2_p = w8a8_cpu.pack_moe_weights(args["w13"], args["w2"])
    int4 = make_int4_moe(5, 64, 32, 4, 2, gen, 32, "zero_point")
    for a in [args, {**args, "w13": w13_p, "w2": w2_p}, int4]:
        torch.library.opcheck(torch.ops.w8a8_cpu.fused_experts.default,
                              (a["hidden"], a["w13"], a["w2"], a["topk_weights"], a["topk_ids"], a["w13_scale"],
                               a["w2_scale"]))


@pytest.mark.slow_under_emulation  # inductor needs a host C++ compiler for the target
@pytest.mark.skipif(not hasattr(torch, "compile"), reason=f"torch.compile needs torch >= 2.0 (this is torch {torch.__version__})")
def test_w8a8_moe_module_and_compile(gen):
    torch.manual_seed(0)
    e, h, inter = 8, 128, 64
    w13, w2 = torch.randn(e, 2 * inter, h) * 0.05, torch.randn(e, h, inter) * 0.05
    moe = w8a8_cpu.nn.W8A8MoE.from_float(w13, w2, top_k=2)
    x, logits = torch.randn(10, h, generator=gen), torch.randn(10, e, generator=gen)
    y = moe(x, logits)
    # float reference: same routing, unquantized experts
    weights, ids = moe.route(logits)
    want = torch.zeros_like(x)
    for t in range(10):
        for k in range(2):
            g_u = w13[ids[t, k]] @ x[t]
            want[t] += weights[t, k] * (w2[ids[t, k]] @ (torch.nn.functional.silu(g_u[:inter]) * g_u[inter:]))
    assert (y - want).norm() / want.norm() < 0.03
    compiled = torch.compile(moe, fullgraph=True)
    torch.testing.assert_close(compiled(x, logits), y)  # inductor's softmax may round the router weights differently


def quantize_experts_int4(w, group_size, form):
    """Float experts [E, N, K] -> (the int4 experts as reference.fused_experts takes them, pack_experts_int4's blobs):
    form "symmetric", "zero_point" (asymmetric with an integer zero point) or "min_max"."""
    e, n, k = w.shape
    q, scale, minimum = w8a8_cpu.quantize_weight_int4(w.reshape(e * n, k), group_size, form == "symmetric",
                                                      form == "min_max")
    q, scale = q.reshape(e, n, k), scale.reshape(e, n, -1)
    minimum = None if minimum is None else minimum.reshape(e, n, -1)
    return (q, scale, minimum, group_size), w8a8_cpu.pack_experts_int4(q, scale, minimum, group_size)


def make_int4_moe(m, h, inter, experts, topk, gen, group_size=32, form="symmetric", dtype=torch.bfloat16,
                  skew=False, channel_scales=True):
    """make_moe's routing with int4 experts (float weights quantized per group); the channel scales [E, N] that
    multiply on top random around 1, or ones (plain W4A8)."""
    args = make_moe(m, h, inter, experts, topk, gen, dtype=dtype, skew=skew)
    for name, shape in (("w13", (experts, 2 * inter, h)), ("w2", (experts, h, inter))):
        args[f"ref_{name}"], args[name] = quantize_experts_int4(torch.randn(*shape, generator=gen) * 0.05, group_size,
                                                                form)
        channels = shape[:2]
        args[f"{name}_scale"] = (torch.rand(*channels, generator=gen) + 0.5 if channel_scales else
                                 torch.ones(*channels))
    return args


INT4_FORMS = [(32, "symmetric"), (64, "zero_point"), (128, "min_max"), (0, "symmetric"), (0, "zero_point"),
              (32, "min_max")]


@pytest.mark.parametrize("group_size,form", INT4_FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_fused_experts_equal_the_reference(variant, group_size, form, dtype, gen):
    """H = 200 and I = 72 are not multiples of the groups: the last group of each row is partial (K padded)."""
    args = make_int4_moe(19, 200, 72, 8, 2, gen, group_size, form, dtype)
    assert_matches_reference(run(args), args)
    plain = make_int4_moe(6, 128, 64, 4, 2, gen, group_size, form, dtype, channel_scales=False)
    assert_matches_reference(run(plain), plain)


@pytest.mark.parametrize("on_input", [False, True])
def test_int4_fused_experts_router_weight_and_idle_experts(variant, on_input, gen):
    """Both router-weight conventions; experts no token is routed to (all tokens on experts 0..topk-1: the others
    idle), and no tokens at all."""
    topk = 1 if on_input else 3
    for skew in (False, True):
        args = make_int4_moe(23, 96, 64, 6, topk, gen, 32, "zero_point", skew=skew)
        assert_matches_reference(run(args, on_input=on_input), args, on_input)
    empty = make_int4_moe(0, 64, 32, 4, topk, gen)
    assert run(empty, on_input=on_input).shape == (0, 64)


def test_int4_and_int8_projections_mix(gen):
    """w13 int4 and w2 int8 (or the other way round): each projection runs its own scheme."""
    args = make_int4_moe(11, 96, 64, 4, 2, gen, 32, "symmetric")
    int8 = make_moe(11, 96, 64, 4, 2, gen)
    for over in ({"w2": int8["w2"], "ref_w2": int8["w2"]}, {"w13": int8["w13"], "ref_w13": int8["w13"]}):
        mixed = {**args, **over}
        assert_matches_reference(run(mixed), mixed)


def test_int4_bad_expert_blobs_are_refused(gen):
    args = make_int4_moe(5, 64, 32, 4, 2, gen, 64, "symmetric")
    corrupt = args["w13"].clone()
    corrupt[2, 100] ^= 1
    with pytest.raises(ValueError, match=r"w13 \(expert 2\).*checksum"):
        run(args, w13=corrupt)
    # per channel and groups of 64 over H = 64 give blobs of one size, but not one format: refused, not mixed
    per_channel = make_int4_moe(5, 64, 32, 4, 2, gen, 0, "symmetric")["w13"]
    mixed = torch.cat([args["w13"][:2], per_channel[2:]])
    with pytest.raises(ValueError, match="w13: expert 2 is packed in another layout or weight format"):
        run(args, w13=mixed)
    with pytest.raises(ValueError, match=r"w2: expert 0 was packed with shape \[64, 64\], expected \[64, 32\]"):
        run(args, w2=args["w13"])
    with pytest.raises(ValueError, match="w13: 1-D uint8 tensor is not a packed"):
        run(args, w13=torch.zeros_like(args["w13"]))
    q, scale, _, _ = args["ref_w13"]
    with pytest.raises(ValueError, match=r"q: expected a non-empty int8 \[E, N, K\]"):
        w8a8_cpu.pack_experts_int4(q[0], scale[0])
    with pytest.raises(ValueError, match=r"scale: expected \[4, N, groups\]"):
        w8a8_cpu.pack_experts_int4(q, scale[:3], None, 64)
    with pytest.raises(ValueError, match=r"int4 weights must lie in \[-8, 7\]"):
        w8a8_cpu.pack_experts_int4(q * 2, scale, None, 64)


BAD = [
    ("id too large", lambda a: run(a, topk_ids=a["topk_ids"].clone().fill_(4)), "topk_ids: value 4 at [0, 0] is outside [0, 4)"),
    ("id negative", lambda a: run(a, topk_ids=a["topk_ids"].clone().fill_(-1)), "topk_ids: value -1"),
    ("ids float", lambda a: run(a, topk_ids=a["topk_ids"].float()), "topk_ids: dtype must be int32 or int64"),
    ("ids wrong m", lambda a: run(a, topk_ids=a["topk_ids"][:2]), "topk_ids: expected shape [5, topk]"),
    ("topk 0", lambda a: run(a, topk_ids=a["topk_ids"][:, :0], topk_weights=a["topk_weights"][:, :0]),
     "topk_ids: topk (dim 1) must be > 0"),
    ("weights shape", lambda a: run(a, topk_weights=a["topk_weights"][:, :1]), "topk_weights: expected shape [5, 2]"),
    ("weights int", lambda a: run(a, topk_weights=a["topk_ids"]), "topk_weights: dtype must be"),
    ("w13 wrong H", lambda a: run(a, w13=a["w13"][:, :, :32].contiguous()), "w13: expected a raw int8 weight of shape [4, 64, 64]"),
    ("w13 wrong E", lambda a: run(a, w13=a["w13"][:3].contiguous()), "w13: expected a raw int8 weight"),
    ("w2 wrong I", lambda a: run(a, w2=a["w2"][:, :, :16].contiguous()), "w2: expected a raw int8 weight of shape [4, 64, 32]"),
    ("w2 float", lambda a: run(a, w2=a["w2"].float()), "w2: expected a raw int8"),
    ("w13_scale E", lambda a: run(a, w13_scale=a["w13_scale"][:3]), "w2_scale: expected shape [3, 64]"),
    ("w13_scale odd", lambda a: run(a, w13_scale=a["w13_scale"][:, :63]), "w13_scale: dim 1 must be 2 * intermediate"),
    ("w13_scale dtype", lambda a: run(a, w13_scale=a["w13_scale"].double()), "w13_scale: dtype must be float32"),
    ("w2_scale shape", lambda a: run(a, w2_scale=a["w2_scale"][:, :10]), "w2_scale: expected shape [4, 64]"),
    ("hidden int", lambda a: run(a, hidden=a["w13"][0]), "hidden: dtype must be"),
    ("hidden 3-D", lambda a: run(a, hidden=a["hidden"][None]), "hidden: expected a 2-D"),
    ("activation", lambda a: run(a, activation="gelu"), "activation: only 'silu' is supported, got 'gelu'"),
    ("on input topk 2", lambda a: run(a, on_input=True), "apply_router_weight_on_input: requires topk == 1"),
    ("packed wrong shape", lambda a: run(a, w13=w8a8_cpu.pack_moe_weights(a["w2"], a["w2"])[0]),
     "w13: expert 0 was packed with shape [64, 32], expected [64, 64]"),
    ("packed garbage", lambda a: run(a, w13=torch.zeros(4, 100, dtype=torch.uint8)), "w13: 1-D uint8 tensor is not a packed"),
    ("pack_moe 2-D", lambda a: w8a8_cpu.pack_moe_weights(a["w13"][0], a["w2"]), "w13: expected a non-empty int8 [E, N, K]"),
]


@pytest.mark.parametrize("call,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_fused_experts_bad_input(call, fragment, gen):
    args = make_moe(5, 64, 32, 4, 2, gen)
    with pytest.raises((ValueError, RuntimeError)) as exc:
        call(args)
    assert fragment in str(exc.value)


@pytest.mark.parametrize("which", ["w13_scale", "w2_scale"])
def test_non_finite_expert_scales_refused(gen, which):
    """Weight-side values are finite in every op: a NaN expert scale is a ValueError naming it and the element."""
    args = make_moe(4, 32, 16, 4, 2, gen)
    bad = args[which].clone()
    bad[1, 5] = float("nan")
    with pytest.raises(ValueError, match=rf"{which}: element {bad.shape[1] + 5} is nan"):
        run(args, **{which: bad})
