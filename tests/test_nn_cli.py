"""Python layer (quantize_weight, W8A8Linear, quantize_model), info/dispatch, and the CLI."""
import json
import os
import subprocess

import pytest
import torch

import w8a8_cpu
from conftest import python_command, run_python
from w8a8_cpu import _build_info, reference
from tiny_models import tiny_causal_lm

# A variant name of another architecture: never compiled into this build.
FOREIGN_VARIANT = "avx2" if "neon" in w8a8_cpu.info()["compiled_variants"] else "neon"


def test_quantize_weight_per_channel():
    w = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0], [-3.0, 1.5, 0.1]])
    w_q, w_scale = w8a8_cpu.quantize_weight(w)
    assert w_q.dtype == torch.int8 and w_scale.dtype == torch.float32 and w_scale.shape == (3,)
    assert w_q.tolist() == [[32, -64, 127], [0, 0, 0], [-127, 64, 4]]
    torch.testing.assert_close(w_scale, torch.tensor([2 / 127, 1e-10 / 127, 3 / 127]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_weight_is_the_activation_quantizer(dtype):
    """One rounding rule for weights and activations: 127 / amax as one fp32 division (torch's 127.0 / amax is
    reciprocal(amax) * 127, which rounds twice and moves a few values by one), then round half to even."""
    w = (torch.randn(64, 4096, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    w_q, w_scale = w8a8_cpu.quantize_weight(w)
    x_q, x_scale = w8a8_cpu.per_token_quant_int8(w)
    ref_q, ref_scale = reference.per_token_quant_int8(w)
    assert torch.equal(w_q, x_q) and torch.equal(w_q, ref_q)
    assert torch.equal(w_scale, x_scale.reshape(-1)) and torch.equal(w_scale, ref_scale.reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w8a8_linear_matches_float_linear(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96)
    layer = w8a8_cpu.nn.W8A8Linear.from_linear(linear)
    x = torch.randn(2, 9, 256).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (2, 9, 96)
    ref = linear(x.float())
    rel = (y.float() - ref).norm() / ref.norm()
    assert rel < 0.02, rel
    # exactly the reference math on the quantized operands
    w_q, w_scale = w8a8_cpu.quantize_weight(linear.weight)
    x_q, x_scale = reference.per_token_quant_int8(x.reshape(-1, 256))
    want = reference.int8_scaled_mm(x_q, w_q, x_scale, w_scale, linear.bias.detach(), dtype).reshape(2, 9, 96)
    torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_quantize_model_replaces_and_skips():
    model = torch.nn.Sequential()
    model.add_module("up", torch.nn.Linear(32, 64))
    model.add_module("act", torch.nn.ReLU())
    model.add_module("head", torch.nn.Linear(64, 10, bias=False))
    x = torch.randn(4, 32)
    expected = model(x)
    w8a8_cpu.nn.quantize_model(model, skip=["head"])
    assert isinstance(model.up, w8a8_cpu.nn.W8A8Linear) and isinstance(model.head, torch.nn.Linear)
    w8a8_cpu.nn.quantize_model(model, skip=lambda name, m: False)
    assert isinstance(model.head, w8a8_cpu.nn.W8A8Linear) and model.head.bias is None
    got = model(x)
    assert (got - expected).norm() / expected.norm() < 0.03
    restored = torch.nn.Sequential(w8a8_cpu.nn.W8A8Linear(torch.zeros(64, 32, dtype=torch.int8), torch.ones(64),
                                                          torch.zeros(64)), torch.nn.ReLU(),
                                   w8a8_cpu.nn.W8A8Linear(torch.zeros(10, 64, dtype=torch.int8), torch.ones(10)))
    restored.load_state_dict({k.replace("up", "0").replace("head", "2"): v for k, v in model.state_dict().items()})
    torch.testing.assert_close(restored(x), got, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_quantize_model_names_the_layer_of_a_nan_weight(scheme):
    model = torch.nn.Sequential()
    model.add_module("up", torch.nn.Linear(32, 64))
    model.add_module("head", torch.nn.Linear(64, 10))
    with torch.no_grad():
        model.head.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"^head: .*NaN or Inf"):
        w8a8_cpu.nn.quantize_model(model, scheme=scheme)


def test_info_reports_dispatch():
    info = w8a8_cpu.info()
    assert info["arch"] == "x86_64" or info["arch"] in ("aarch64", "ppc64le")
    assert info["compiled_variants"][0] == "ref"
    assert info["selected_variant"] in info["runnable_variants"]
    assert set(info["runnable_variants"]) <= set(info["compiled_variants"])
    assert info["selected_variant"] == info["runnable_variants"][-1]  # best runnable, no override
    assert info["threads"] == torch.get_num_threads() and info["torch_version"] == torch.__version__
    assert info["compiled_variants"] == _build_info.VARIANTS  # what CMake recorded as built into this library
    if info["arch"] == "x86_64":
        assert ("avx2" in info["runnable_variants"]) == ("avx2" in info["features"])


def test_isa_env_forces_variant():
    for name in w8a8_cpu.info()["runnable_variants"]:
        r = run_python("import w8a8_cpu; print(w8a8_cpu.info()['selected_variant'])", W8A8_CPU_ISA=name)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == name


@pytest.mark.parametrize(
    "name,fragment",
    [("bogus", "is not a variant compiled"), (FOREIGN_VARIANT, "is not a variant compiled")],
    ids=["bogus", "foreign"],
)
def test_isa_env_rejects_unknown(name, fragment):
    r = run_python("import w8a8_cpu", W8A8_CPU_ISA=name)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and fragment in r.stderr and "choices: ref" in r.stderr


def test_isa_env_rejects_unsupported_variant():
    missing = [v for v in w8a8_cpu.info()["compiled_variants"] if v not in w8a8_cpu.info()["runnable_variants"]]
    if not missing:
        pytest.skip("this CPU runs every compiled variant")
    r = run_python("import w8a8_cpu", W8A8_CPU_ISA=missing[0])
    assert r.returncode != 0 and "this CPU lacks the features" in r.stderr


@pytest.mark.slow_under_emulation
def test_cli_main_job():
    r = subprocess.run([*python_command(), "-m", "w8a8_cpu", "--shape", "4", "64", "128", "--iters", "2", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "selected variant" in r.stdout
    for variant in w8a8_cpu.info()["runnable_variants"]:
        assert f"{variant:<12} ok" in r.stdout
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["self_check_ok"] is True
    assert set(result["benchmark_ms"]) >= {"w8a8_cpu W8A8Linear", "torch fp32 linear"}
    assert all(v > 0 for v in result["benchmark_ms"].values())


def test_cli_help_and_bad_args():
    r = subprocess.run([*python_command(), "-m", "w8a8_cpu", "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "W8A8_CPU_ISA" in r.stdout and "--shape" in r.stdout
    r = subprocess.run([*python_command(), "-m", "w8a8_cpu", "--shape", "0", "1", "1"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "expected a positive integer, got 0" in r.stderr


# A child python per case (under qemu each re-imports torch: ~40 s); option parsing does not depend on the arch.
@pytest.mark.slow_under_emulation
@pytest.mark.parametrize("argv,env,message", [
    (["check", "--threads", "-1", "--no-bench"], {}, "--threads: expected a positive integer, got -1"),
    (["check", "--threads", "0", "--no-bench"], {}, "--threads: expected a positive integer, got 0"),
    (["check", "--shape", "1", "1", "131072"], {}, "K = 131072 exceeds 131071"),
    (["check", "--shape", "1000000", "1000000", "100000"], {}, "the benchmark needs ~"),
    (["llm", "--eval-tokens", "999999999"], {}, "--eval-tokens 999999999: /usr/share/common-licenses/GPL-3 has"),
    (["bench", "--json", "/nonexistent-w8a8-dir/x.json"], {}, "folder /nonexistent-w8a8-dir does not exist"),
    (["bench", "--plot", "/nonexistent-w8a8-dir/x.png"], {}, "folder /nonexistent-w8a8-dir does not exist"),
    (["bench", "--threads", "2", "0"], {}, "expected a positive integer, got 0"),
    (["check", "--no-bench"], {"W8A8_CPU_ISA": "bogus"}, "W8A8_CPU_ISA='bogus' is not a variant compiled"),
])
def test_bad_options_exit_2_before_any_work(argv, env, message):
    """Every bad option or environment value: one line on stderr and exit 2 at once (no traceback, no model loaded,
    no run whose results are lost at its end)."""
    r = subprocess.run([*python_command(), "-m", "w8a8_cpu", *argv], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_quantized_model_survives_dtype_cast():
    # model.to(bfloat16) after quantize_model is the usual serving sequence: the scales must stay fp32.
    torch.manual_seed(0)
    model = w8a8_cpu.nn.quantize_model(torch.nn.Sequential(torch.nn.Linear(16, 8)))
    x = torch.randn(2, 16)
    expected = model(x.bfloat16())
    model.to(torch.bfloat16)
    assert model[0].w_scale.dtype == torch.float32 and model[0].bias.dtype == torch.bfloat16
    torch.testing.assert_close(model(x.bfloat16()), expected, rtol=1e-2, atol=1e-2)
    moe = w8a8_cpu.nn.W8A8MoE.from_float(torch.randn(4, 32, 16) * 0.1, torch.randn(4, 16, 16) * 0.1, top_k=2).half()
    assert moe.w13_scale.dtype == moe.w2_scale.dtype == torch.float32
    assert moe(torch.randn(3, 16).half(), torch.randn(3, 4)).dtype == torch.float16


# ---- shared modules and tied parameters in quantize_model --------------------------------------------------------

def test_quantize_model_keeps_a_shared_linear_shared():
    torch.manual_seed(0)
    shared = torch.nn.Linear(16, 16)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    x = torch.randn(4, 16)
    expected = model(x)
    w8a8_cpu.nn.quantize_model(model)
    assert isinstance(model[0], w8a8_cpu.nn.W8A8Linear) and model[2] is model[0]
    assert (model(x) - expected).norm() / expected.norm() < 0.03


def test_quantize_model_skips_a_shared_linear_skipped_under_any_name():
    shared = torch.nn.Linear(16, 16)
    model = w8a8_cpu.nn.quantize_model(torch.nn.Sequential(shared, torch.nn.ReLU(), shared), skip=["2"])
    assert model[0] is shared and model[2] is shared


class TiedLM(torch.nn.Module):
    """An embedding and an lm_head sharing one weight, as transformers ties them (tie_word_embeddings)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.lm_head = torch.nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(self.embed(ids))


def test_quantizing_a_tied_lm_head_unties_it_knowingly():
    torch.manual_seed(0)
    model = TiedLM()
    embedding = model.embed.weight
    kept = embedding.detach().clone()
    ids = torch.arange(8)
    expected = model(ids)
    with pytest.warns(UserWarning, match=r"lm_head\.weight is tied to embed\.weight; quantizing lm_head unties them"):
        w8a8_cpu.nn.quantize_model(model)
    assert isinstance(model.lm_head, w8a8_cpu.nn.W8A8Linear)
    assert model.embed.weight is embedding and torch.equal(embedding, kept)  # the float embedding is untouched
    assert (model(ids) - expected).norm() / expected.norm() < 0.03
    # no float weight to read or to tie back: both fail with the reason instead of silently diverging
    assert not hasattr(model.lm_head, "weight")
    with pytest.raises(AttributeError, match="W8A8Linear has no float weight.*skip it in quantize_model"):
        model.lm_head.weight
    with pytest.raises(ValueError, match="^weight: W8A8Linear has no float weight"):
        model.lm_head.weight = model.embed.weight


def test_skipped_tied_lm_head_stays_tied(recwarn):
    model = w8a8_cpu.nn.quantize_model(TiedLM(), skip=["lm_head"])
    assert model.lm_head.weight is model.embed.weight and not recwarn.list


def test_transformers_tied_lm_head_quantized():
    model = tiny_causal_lm(tied=True, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embedding
    with pytest.warns(UserWarning, match=r"lm_head\.weight is tied to model\.embed_tokens\.weight"):
        w8a8_cpu.nn.quantize_model(model)
    assert isinstance(model.get_output_embeddings(), w8a8_cpu.nn.W8A8Linear)
    assert model.get_input_embeddings().weight is embedding
    with torch.no_grad():
        assert model(torch.arange(6)[None]).logits.shape == (1, 6, 64)
    with pytest.raises(ValueError, match="^weight: W8A8Linear has no float weight"):
        model.tie_weights()  # transformers would attach the float embedding to the int8 lm_head
