"""GPTQ rounding of int4 weights (quantize_weight_int4 with a hessian, quantize_model(scheme="w4a8", calibration=...)):
lower output error than round-to-nearest on correlated inputs for every int4 form, layers that run exactly the int4
values they hold, bounded group scales, and calibration input refused with errors that name it."""
import pytest
import torch

import w8a8_cpu
from w8a8_cpu import reference
from w8a8_cpu.nn import W4A8Linear, quantize_model
from w8a8_cpu.quant import gptq_layers, refit
from w8a8_cpu.quant.grid import Int4Grid, fp16_step
from tiny_models import dequantized_int4, tiny_causal_lm, token_ids

FORMS = {"symmetric": (True, False), "zero point": (False, False), "min-max": (False, True)}


def correlated_inputs(gen, rows, k):
    """Activations like a model's: channels of very different size, mixed so that they correlate."""
    mixing = torch.eye(k) + torch.randn(k, k, generator=gen) / k ** 0.5
    return (torch.randn(rows, k, generator=gen) * (torch.rand(k, generator=gen) * 4 + 0.1)) @ mixing


def stack(seed=0):
    """A small float model; the same weights for the same seed."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(192, 160), torch.nn.GELU(), torch.nn.Linear(160, 96)).eval()


@pytest.mark.parametrize("form", FORMS)
def test_gptq_has_lower_output_error_than_round_to_nearest(gen, form):
    symmetric, min_max = FORMS[form]
    model = stack()
    calibration, held_out = correlated_inputs(gen, 1024, 192).split(512)  # one distribution
    options = dict(scheme="w4a8", group_size=32, symmetric=symmetric, min_max=min_max)
    rtn = quantize_model(stack(), **options)
    gptq = quantize_model(stack(), calibration=calibration, **options)
    with torch.no_grad():
        inputs = {"0": (calibration, held_out)}
        inputs["2"] = tuple(torch.nn.functional.gelu(model[0](x)) for x in inputs["0"])  # the float model's
    for name, linear in (("0", model[0]), ("2", model[2])):
        for x in inputs[name]:  # the calibration rows and rows it never saw
            want = x @ linear.weight.detach().T
            errors = {kind: ((x @ dequantized_int4(*m.get_submodule(name).int4_weight()).T - want).norm()
                             / want.norm()).item() for kind, m in (("rtn", rtn), ("gptq", gptq))}
            assert errors["gptq"] < 0.8 * errors["rtn"], (form, name, errors)
            assert errors["rtn"] < 0.2


def test_gptq_layer_runs_the_int4_values_it_holds(gen):
    for form, (symmetric, min_max) in FORMS.items():
        linear = torch.nn.Linear(160, 40)
        x = correlated_inputs(gen, 256, 160)
        layer = quantize_model(torch.nn.Sequential(linear), scheme="w4a8", group_size=32, symmetric=symmetric,
                               min_max=min_max, calibration=[x[:100], x[100:]])[0]
        assert isinstance(layer, W4A8Linear)
        q, scale, minimum, group = layer.int4_weight()
        assert group == 32 and (minimum is None) == symmetric
        assert int(q.min()) >= -8 and int(q.max()) <= 7
        # group scales finite, positive and of the float weight's size (GPTQ's updates do not blow them up)
        rtn_scale = w8a8_cpu.quantize_weight_int4(linear.weight, 32, symmetric, min_max)[1]
        assert torch.isfinite(scale).all() and (scale > 0).all() and scale.max() <= 2 * rtn_scale.max(), form
        assert minimum is None or torch.isfinite(minimum).all()
        x_q, x_scale = reference.per_token_quant_int8(x[:7])
        want = reference.int4_scaled_mm(x_q, q, x_scale, torch.ones(40), scale, minimum, 32, linear.bias)
        assert torch.equal(layer(x[:7]), want), form


@pytest.mark.parametrize("form", FORMS)
def test_gptq_with_uncorrelated_inputs_is_round_to_nearest_on_its_searched_grid(gen, form):
    """A diagonal H has no cross terms: no error moves between columns, so GPTQ rounds each group to nearest on the
    grid its range search picks (weighted by the dampened diagonal), which is round-to-nearest's grid or a clipped one
    with less weighted error. Each row's scales are then refitted to those codes: with no cross terms, each group's
    weighted least-squares scale (an fp16 value), kept where it lowers the row's error."""
    symmetric, min_max = FORMS[form]
    w = torch.randn(24, 100, generator=gen)
    w[:, 3] *= 6  # an outlier column: clipping it pays where its input is small
    diagonal = torch.rand(100, generator=gen) + 0.5
    for group_size in (32, 0):
        group = group_size or 100
        k_padded = -(-100 // group) * group
        padded = torch.nn.functional.pad(w, (0, k_padded - 100)).view(24, -1, group)
        importance = torch.cat([diagonal, torch.ones(k_padded - 100)])
        importance = (importance + 0.1 * importance.mean()).view(-1, group)
        grids = [Int4Grid(*(field[:, None] for field in Int4Grid.searched(padded[:, g], symmetric, min_max,
                                                                             importance[g])))
                 for g in range(padded.shape[1])]
        want_q = torch.cat([grid.quantize(padded[:, g]) for g, grid in enumerate(grids)], 1)[:, :100]
        q, scale, minimum = w8a8_cpu.quantize_weight_int4(w, group_size, symmetric, min_max,
                                                          hessian=torch.diag(diagonal))
        assert torch.equal(q, want_q.to(torch.int8)), (form, group_size)

        def error(g, s, grid, weights=None):  # each row's weighted error in group g at scales s [24, 1], grid's codes
            codes = grid.quantize(padded[:, g]) - grid.shift
            return (s * codes + grid.origin - padded[:, g]).double().square().mul(
                importance[g] if weights is None else weights[g]).sum(1)

        grid_scale = fp16_step(torch.cat([grid.scale for grid in grids], 1))  # stored as fp16 values
        counted = importance * (torch.arange(k_padded) < 100).view(-1, group)  # the padding is never computed with
        fitted = torch.cat([(codes * (padded[:, g] - grid.origin) * counted[g]).sum(1, keepdim=True)
                            / (codes.square() * counted[g]).sum(1, keepdim=True)
                            for g, grid in enumerate(grids) for codes in [grid.quantize(padded[:, g]) - grid.shift]], 1)
        refitted = ~torch.isclose(scale, grid_scale, rtol=1e-6, atol=0).all(1)
        assert 12 < int(refitted.sum()), (form, group_size)  # most rows: the searched grid's scale is not the best
        # the least-squares scale stored as an fp16 value (the nearest: within one fp16 step of the fp64 solve's)
        assert torch.equal(scale.half().float(), scale)
        torch.testing.assert_close(scale[refitted], fitted[refitted], rtol=2 ** -10, atol=0)
        assert torch.equal(scale[~refitted], grid_scale[~refitted])
        before = sum(error(g, grid_scale[:, g:g + 1], grid, counted) for g, grid in enumerate(grids))
        after = sum(error(g, scale[:, g:g + 1], grid, counted) for g, grid in enumerate(grids))
        # (the refit compares fp32 steps; rounded to fp16 after, a near tie may cost up to that rounding)
        assert (after <= before * (1 + 2 ** -10)).all() and (after[refitted] < before[refitted]).all(), \
            (form, group_size)
        torch.testing.assert_close(minimum if minimum is not None else torch.zeros_like(scale),
                                   torch.cat([grid.origin for grid in grids], 1) - torch.cat(
                                       [grid.shift for grid in grids], 1) * scale)
        rtn = w8a8_cpu.quantize_weight_int4(w, group_size, symmetric, min_max)
        for g, grid in enumerate(grids):  # never worse than round-to-nearest's grid, by the weighted error
            rtn_grid = Int4Grid.of(padded[:, g], symmetric, min_max)
            assert (error(g, grid.scale, grid) <= error(g, rtn_grid.scale, rtn_grid)).all(), (form, group_size)
        assert not torch.equal(rtn[1], scale), (form, group_size)  # the outlier groups were clipped


def test_searched_grid_keeps_weights_already_on_a_grid():
    """Ties go to the unclipped range: weights on a min-max grid (llama.cpp Q4_1's, as SmolLM2's dequantized ones are)
    keep that grid and round back to themselves, as round-to-nearest does; clipping would only add error."""
    gen = torch.Generator().manual_seed(3)
    u = torch.randint(0, 16, (16, 64), generator=gen).float()
    u[:, 0], u[:, 31], u[:, 32], u[:, 63] = 0, 15, 0, 15
    w = u * 0.01 - 0.07 + torch.randn(16, 2, generator=gen).repeat_interleave(32, dim=1) * 0.1
    got = w8a8_cpu.quantize_weight_int4(w, 32, False, True, hessian=torch.diag(torch.rand(64, generator=gen) + 0.5))
    want = w8a8_cpu.quantize_weight_int4(w, 32, False, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_gptq_tolerates_dead_inputs_and_per_channel_groups(gen):
    x = correlated_inputs(gen, 300, 96)
    x[:, 5] = 0  # an input channel the calibration never exercises keeps its rounded-to-nearest weight
    w = torch.randn(16, 96, generator=gen)
    hessian = x.T @ x
    for group_size in (0, 32):
        q, scale, minimum = w8a8_cpu.quantize_weight_int4(w, group_size, False, hessian=hessian)
        assert q.shape == (16, 96) and scale.shape == (16, 96 // (group_size or 96))
        rtn_q = w8a8_cpu.quantize_weight_int4(w, group_size, False)[0]
        assert not torch.equal(q, rtn_q)


def test_scale_refit_is_each_rows_least_squares_through_the_cross_terms(gen):
    """Correlated inputs: every row's scales are the dense least-squares solution over its groups, solve(C^T H C,
    C^T H w) with C the codes block by group and H dampened as GPTQ dampens it (zero point form: origin 0)."""
    x = correlated_inputs(gen, 400, 96)
    w = torch.randn(6, 96, generator=gen)
    hessian = (x.T @ x).double()
    q, scale, minimum = w8a8_cpu.quantize_weight_int4(w, 32, False, hessian=hessian)
    h = hessian.clone()
    h.diagonal().add_(0.1 * h.diagonal().mean())
    shift = -(minimum / scale).round()  # minimum = -shift * scale, an integer shift
    torch.testing.assert_close(minimum, -shift * scale)
    for row in range(6):
        codes = (q[row].double() - shift[row].repeat_interleave(32)).view(3, 32)
        blocks = torch.block_diag(*codes.unsqueeze(1)).T  # [96, 3]: column g holds group g's codes
        want = torch.linalg.solve(blocks.T @ h @ blocks, blocks.T @ h @ w[row].double())
        torch.testing.assert_close(scale[row].double(), want, rtol=2 ** -10, atol=0)  # stored as the nearest fp16


def test_scale_refit_with_one_row_or_a_group_of_zeros(gen):
    """One output row gives that row's result of a larger call (GPTQ's updates never reach the weights the refit
    reads); a group of zero weights (all codes at the zero point: no equation for its scale) keeps finite scales."""
    x = correlated_inputs(gen, 300, 64)
    hessian = x.T @ x
    hessian[:32, 32:] = hessian[32:, :32] = 0  # no error flows into the second group: its zeros stay zeros
    w = torch.randn(3, 64, generator=gen)
    w[2, 32:] = 0
    for symmetric in (True, False):
        one = w8a8_cpu.quantize_weight_int4(w[:1], 32, symmetric, hessian=hessian)
        three = w8a8_cpu.quantize_weight_int4(w, 32, symmetric, hessian=hessian)
        assert torch.equal(one[0], three[0][:1])
        torch.testing.assert_close(one[1], three[1][:1], rtol=1e-6, atol=0)
        assert torch.isfinite(three[1]).all() and (three[1] > 0).all()
        assert (three[0][2, 32:] == three[0][2, 32]).all()  # one code: the group's zero
        zero = three[1][2, 1] * three[0][2, 32] + (0 if symmetric else three[2][2, 1])
        assert float(zero) == 0.0


def test_scale_refit_gives_the_same_scales_in_row_chunks(gen, monkeypatch):
    x = correlated_inputs(gen, 300, 96)
    w = torch.randn(40, 96, generator=gen)
    whole = w8a8_cpu.quantize_weight_int4(w, 32, False, hessian=x.T @ x)
    monkeypatch.setattr(refit, "REFIT_BYTES", 1)  # one row at a time
    chunked = w8a8_cpu.quantize_weight_int4(w, 32, False, hessian=x.T @ x)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_bad_calibration_is_refused_naming_it(gen):
    model = stack()
    good = correlated_inputs(gen, 16, 192)
    nan = good.clone()
    nan[3, 7] = float("nan")
    for calibration, message in [
        ("some text", "calibration: expected model inputs"), (42, "calibration: expected model inputs"),
        ([], "calibration: no batches"), ([good, "x"], "calibration: batch 1: expected a non-empty tensor"),
        (torch.empty(0, 192), "calibration: batch 0"), (nan, "calibration: the inputs of 0 contain NaN or Inf"),
        (lambda m: m[2](torch.randn(4, 160)), "calibration: the run never reached 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            quantize_model(stack(), scheme="w4a8", calibration=calibration)
    with pytest.raises(ValueError, match="rounding: applies to 4-bit weights"):  # calibration given: GPTQ
        quantize_model(model, calibration=good)
    w = torch.randn(8, 64)
    for hessian, message in [(torch.eye(32), r"hessian: expected a floating-point \[64, 64\]"),
                             (torch.full((64, 64), float("inf")), "hessian: contains NaN or Inf"),
                             (-torch.eye(64), "hessian: not positive semi-definite")]:
        with pytest.raises(ValueError, match=message):
            w8a8_cpu.quantize_weight_int4(w, 32, hessian=hessian)
    with pytest.raises(ValueError, match="damping: expected a positive number"):
        w8a8_cpu.quantize_weight_int4(w, 32, hessian=torch.eye(64), damping=0)


def test_gptq_gives_the_same_codes_and_scales_for_any_positive_multiple_of_the_hessian(gen):
    """The promise of quantize_weight_int4's docstring, far beyond float32's range (the column loop runs in fp32):
    H * 1e100 and * 1e-100 gave NaN scales, * 1e40, 1e60 and 1e-60 other codes than H. A dead input and K padded
    to whole groups included (their unit diagonal is relative to H's scale)."""
    x = correlated_inputs(gen, 300, 100)
    x[:, 7] = 0
    hessian = (x.T @ x).double()
    w = torch.randn(24, 100, generator=gen)
    for form, (symmetric, min_max) in FORMS.items():
        want = w8a8_cpu.quantize_weight_int4(w, 32, symmetric, min_max, hessian=hessian)
        assert torch.isfinite(want[1]).all() and (want[1] > 0).all()
        for power in (-100, -60, -40, 0, 40, 60, 100):
            got = w8a8_cpu.quantize_weight_int4(w, 32, symmetric, min_max, hessian=hessian * 10.0 ** power)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (form, power)
            assert symmetric or torch.equal(got[2], want[2]), (form, power)


def test_a_hessian_or_damping_gptq_cannot_represent_is_refused_naming_it(gen):
    """A ValueError naming the argument instead of NaN scales (only pack_weight_int4 failed, later)."""
    w = torch.randn(8, 64, generator=gen)
    eye = torch.eye(64, dtype=torch.float64)
    negative = eye.clone()
    negative[5, 5] = -1e-3
    cross_terms_only = torch.ones(64, 64, dtype=torch.float64) - eye
    for hessian, message in [(negative, "hessian: not positive semi-definite"),
                             (cross_terms_only, "hessian: not positive semi-definite"),
                             (eye * 1e-300 + cross_terms_only * 1e-5, "hessian: not positive semi-definite")]:
        with pytest.raises(ValueError, match=message):
            w8a8_cpu.quantize_weight_int4(w, 32, hessian=hessian)
    for damping in (1e300, 1e7, float("inf"), float("nan"), -0.1, 0.0, "0.1", None):
        with pytest.raises(ValueError, match="^damping: expected a positive number up to 1e"):
            w8a8_cpu.quantize_weight_int4(w, 32, hessian=eye, damping=damping)
    tiny = eye.clone()
    tiny[1, 1] = 1e-100  # an input of almost no curvature: with a damping of 1e-300, H's inverse overflows float32
    steep = eye.clone()
    steep[1, 1], steep[0, 1], steep[1, 0] = 1e-74, 0.99e-37, 0.99e-37  # its inverse fits, column 0's error * ~1e37 not
    for hessian, symmetric, why in [(tiny, True, "the inverse's factor overflows"),
                                    (steep, True, "GPTQ's updates overflow"),
                                    (steep, False, "GPTQ's updates overflow")]:
        with pytest.raises(ValueError, match=rf"^hessian: .*too near singular for damping 1e-300 \(raise "
                                             rf"damping\): {why} float32"):
            w8a8_cpu.quantize_weight_int4(w * 1e3, 32, symmetric, hessian=hessian, damping=1e-300)
    # the largest damping: H is still a multiple of the identity, whose result any damping gives
    largest = w8a8_cpu.quantize_weight_int4(w, 32, hessian=eye, damping=1e6)
    assert all(torch.equal(a, b) for a, b in zip(largest[:2], w8a8_cpu.quantize_weight_int4(w, 32, hessian=eye)))


def test_calibration_callable_and_progress(gen):
    model = stack()
    x = correlated_inputs(gen, 64, 192)
    seen = []
    quantize_model(model, scheme="w4a8", calibration=lambda m: m(x), on_layer=lambda i, n: seen.append((i, n)))
    assert seen == [(1, 2), (2, 2)]
    assert all(isinstance(m, W4A8Linear) for m in (model[0], model[2]))


class TwoHeads(torch.nn.Module):
    """Two layers reading one input tensor (as q/k/v do), a third reading another."""

    def __init__(self, shared_input: bool = True):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(64, 40), torch.nn.Linear(64, 24), torch.nn.Linear(64, 8)
        self.shared_input = shared_input
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        other = x if self.shared_input or self.calls == 1 else x.clone()  # the second call breaks the sharing
        return torch.cat([self.a(x), self.b(other), self.c(x * 2)], dim=-1)


def test_layers_reading_one_input_share_its_second_moment(gen):
    """a and b read the same tensor: rounded as one matrix with one H, each gets exactly the rows GPTQ gives it on
    its own with that H (GPTQ treats rows independently)."""
    x = correlated_inputs(gen, 200, 64)
    probe = TwoHeads()
    moments = gptq_layers.second_moments(probe, {probe.a: "a", probe.b: "b", probe.c: "c"}, [x[:80], x[80:]])
    assert [readers for _, readers in moments] == [[probe.a, probe.b], [probe.c]]
    torch.testing.assert_close(moments[0][0], x.T @ x, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(moments[1][0], 4 * x.T @ x, rtol=1e-5, atol=1e-3)
    torch.manual_seed(0)
    reference_model = TwoHeads()
    torch.manual_seed(0)
    model = quantize_model(TwoHeads(), scheme="w4a8", group_size=32, symmetric=False, calibration=x)
    for name in ("a", "b"):
        want = w8a8_cpu.quantize_weight_int4(getattr(reference_model, name).weight, 32, False, hessian=x.T @ x)
        got = getattr(model, name).int4_weight()
        assert torch.equal(got[0], want[0]), name
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="calibration: b read the input of a in one model call but not in another"):
        quantize_model(TwoHeads(shared_input=False), scheme="w4a8", calibration=[x[:100], x[100:]])


@pytest.mark.parametrize("head_rounded", [False, True])
def test_calibration_computes_the_logits_only_the_rounded_layers_need(head_rounded):
    """A transformers causal LM whose output layer is not rounded runs its calibration batches with logits_to_keep=1
    (a third of SmolLM2's calibration run was its lm_head over every position): the output layer sees one position
    a batch, and every rounded layer gets the weights of a run with all the logits (a callable calibration, run as
    given). An output layer that GPTQ rounds still sees every position."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    one_layer = dict(vocab_size=300, num_hidden_layers=1, max_position_embeddings=64)
    ids = token_ids(300, (2, 40), seed=1)
    skip = [] if head_rounded else ["lm_head"]
    model, positions = tiny_causal_lm(**one_layer), []
    model.lm_head.register_forward_pre_hook(lambda module, args: positions.append(args[0].shape[1]))
    quantize_model(model, skip=skip, scheme="w4a8", group_size=32, calibration=ids)
    assert positions == [40 if head_rounded else 1]
    full = quantize_model(tiny_causal_lm(**one_layer), skip=skip, scheme="w4a8", group_size=32,
                          calibration=lambda m: m(ids))
    layers = [name for name, module in model.named_modules() if isinstance(module, W4A8Linear)]
    assert len(layers) == 7 + head_rounded
    for name in layers:
        got, want = model.get_submodule(name).int4_weight(), full.get_submodule(name).int4_weight()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
