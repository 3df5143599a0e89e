"""python -m w8a8_cpu quantize MODEL_DIR OUT_DIR: the checkpoint a user makes from a transformers directory, loaded
back; the alpha search; files readable by other users; bad options refused before any work."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import python_command
from test_llm import _require_model
from tiny_models import tiny_causal_lm

pytestmark = pytest.mark.slow_under_emulation


def quantize(*argv, timeout=900):
    return subprocess.run([*python_command(), "-m", "w8a8_cpu", "quantize", *map(str, argv), "--no-progress"],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


def tiny_checkpoint(directory: Path, model=None) -> Path:
    """A tiny random Llama of SmolLM2's vocabulary (or `model`) with SmolLM2's tokenizer (from the test cache), saved
    as a transformers checkpoint."""
    import transformers

    from w8a8_cpu.llm import smollm2

    source = smollm2.ensure_cache()
    (model or tiny_causal_lm(tied=True, vocab_size=49152, intermediate_size=128)).save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return directory


def test_quantize_command_searches_alpha_and_writes_a_servable_directory(tmp_path):
    _require_model()
    from w8a8_cpu.llm import load_quantized
    from w8a8_cpu.nn import W4A8Linear, W8A8Linear

    source = tiny_checkpoint(tmp_path / "tiny")
    r = quantize(source, tmp_path / "out", "--calibration-tokens", "256", "--held-out-tokens", "128")
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "README.md"} <= names
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in out.iterdir())
    readme = (out / "README.md").read_text()
    assert "| alpha | KL | ppl |" in readme and "held-out ppl" in readme and "Layers kept float: lm_head" in readme
    assert "SmoothQuant alpha" in r.stdout and "held-out perplexity" in r.stdout
    model = load_quantized(out)
    assert isinstance(model.model.layers[0].mlp.down_proj, W8A8Linear)
    r = quantize(source, tmp_path / "w4", "--scheme", "w4a8", "--smoothquant", "none", "--calibration-tokens", "64",
                 "--held-out-tokens", "64", "--max-shard-size", "2MB")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "W4A8 (GPTQ rounding)" in r.stdout  # the default for int4
    assert "rounded with GPTQ on the calibration tokens" in (tmp_path / "w4" / "README.md").read_text()
    assert (tmp_path / "w4" / "model.safetensors.index.json").is_file()
    assert isinstance(load_quantized(tmp_path / "w4").model.layers[1].self_attn.q_proj, W4A8Linear)
    r = quantize(source, tmp_path / "static", "--activations", "static-asymmetric", "--smoothquant", "none",
                 "--calibration-tokens", "64", "--held-out-tokens", "64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(static-asymmetric activations)" in r.stdout
    assert "static per-tensor activations with zero points" in (tmp_path / "static" / "README.md").read_text()
    layers = [m for m in load_quantized(tmp_path / "static").modules() if isinstance(m, W8A8Linear)]
    assert layers and {m.activation_scheme for m in layers} == {"tensor-asymmetric"}


def test_quantize_command_says_when_smoothquant_cannot_run(tmp_path):
    """GPT-2 (Conv1D weights, GELU MLP) has nothing SmoothQuant can fold: one line naming the way out, exit 2, no
    traceback. --smoothquant none then reaches quantize_model, which refuses its Conv1D layers in one line too (it
    used to leave them float and report a W8A8 checkpoint)."""
    _require_model()
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=49152, n_embd=64, n_layer=2, n_head=4))
    source = tiny_checkpoint(tmp_path / "gpt2", gpt2)
    r = quantize(source, tmp_path / "out", "--smoothquant", "0.5", "--calibration-tokens", "64",
                 "--held-out-tokens", "64")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "quantize: SmoothQuant cannot run on this model" in r.stderr and "--smoothquant none" in r.stderr
    r = quantize(source, tmp_path / "out", "--smoothquant", "none", "--calibration-tokens", "64",
                 "--held-out-tokens", "64")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "transformer.h.0.attn.c_attn: Conv1D (transformers' transposed linear" in r.stderr


def test_quantize_command_on_smollm2_holds_the_gate(tmp_path):
    """The cached SmolLM2 quantized by the command (alpha 0.6, as the main job), loaded back: perplexity on the main
    job's evaluation text within its +1.5% gate."""
    _require_model()
    from w8a8_cpu.cli.llm import EVAL_TEXT, PPL_GATE_PERCENT, _tokens
    from w8a8_cpu.llm import evaluate, load_quantized, smollm2

    r = quantize(smollm2.ensure_cache(), tmp_path / "out", "--smoothquant", "0.6")
    assert r.returncode == 0, r.stdout + r.stderr
    fp32, tokenizer = smollm2.load()
    quantized = load_quantized(tmp_path / "out")
    ids = _tokens(tokenizer, EVAL_TEXT, 1024, "evaluation")
    scores = evaluate.compare_on_text({"fp32": fp32, "w8a8": quantized}, "fp32", ids, 512, 256)
    assert scores["w8a8"]["ppl"] <= scores["fp32"]["ppl"] * (1 + PPL_GATE_PERCENT / 100)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == ["lm_head"]


@pytest.mark.parametrize("argv,message", [
    (["{src}", "{src}"], "OUT_DIR must differ from MODEL_DIR"),
    (["{tmp}", "{tmp}/out"], "no config.json"),
    (["{src}", "{tmp}/out", "--smoothquant", "1.5"], "expected an alpha in [0, 1]"),
    (["{src}", "{tmp}/out", "--max-shard-size", "lots"], "expected a size such as 2GB"),
    (["{src}", "{tmp}/out", "--scheme", "w4a8", "--group-size", "48"], "--group-size 48"),
    (["{src}", "{tmp}/out", "--scheme", "w4a8", "--group-size", "131072"],
     "--group-size 131072: expected 0 (per channel) or a power of two in [32, 65536]"),
    (["{src}", "{tmp}/out", "--group-size", "64"], "--group-size 64: applies to --scheme w4a8"),
    (["{src}", "{tmp}/out", "--scheme", "w4a8", "--activations", "static"],
     "--activations static: int4 weights run with int8 dynamic per-token symmetric activations only"),
    (["{src}", "{tmp}/out", "--rounding", "rtn"], "--rounding rtn: applies to --scheme w4a8"),
    (["{src}", "/nonexistent-w8a8-dir/out"], "does not exist"),
    (["{src}", "{tmp}/out", "--calibration", "/nonexistent.txt"], "--calibration /nonexistent.txt: not a file"),
])
def test_quantize_command_refuses_bad_options_before_loading(tmp_path, argv, message):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    argv = [a.format(src=tmp_path / "src", tmp=tmp_path) for a in argv]
    r = quantize(*argv, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_quantize_command_refuses_a_broken_model_directory_in_one_line(tmp_path):
    """What the directory holds is the user's input: a corrupt weight file, a config that breaks the model's
    construction, a NaN weight and a calibration text too short each end in one line naming the problem, exit 2, no
    traceback (each was a traceback: SafetensorError, ZeroDivisionError, the quantizer's ValueError not naming the
    layer, the token count's ValueError)."""
    _require_model()
    from safetensors.torch import load_file, save_file

    source = tiny_checkpoint(tmp_path / "tiny")
    common = ["--smoothquant", "none", "--calibration-tokens", "64", "--held-out-tokens", "32"]
    cases = {name: Path(shutil.copytree(source, tmp_path / name)) for name in ("garbage", "heads", "nan")}
    (cases["garbage"] / "model.safetensors").write_bytes(b"\xff" * 64)
    config = json.loads((cases["heads"] / "config.json").read_text())
    (cases["heads"] / "config.json").write_text(json.dumps({**config, "hidden_size": 0}))
    tensors = load_file(str(cases["nan"] / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(cases["nan"] / "model.safetensors"), metadata={"format": "pt"})
    short = tmp_path / "short.txt"
    short.write_text("Three short words.")
    expected = [(cases["garbage"], common, "cannot load"), (cases["heads"], common, "cannot load"),
                (cases["nan"], common, "model.layers.1.mlp.up_proj.weight holds NaN or Inf values"),
                (source, common + ["--calibration", short], "fewer than the 96 needed")]
    for directory, options, message in expected:
        r = quantize(directory, tmp_path / "out", *options, timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "quantize: " in r.stderr, r.stderr
        ours = [line for line in r.stderr.splitlines() if line.startswith("quantize: ")]  # (torch may warn too)
        assert len(ours) == 1 and message in ours[0], r.stderr


def test_quantize_command_reads_only_the_calibration_tokens_it_needs(tmp_path):
    """The calibration file is read only as far as its tokens are needed: the bundled text followed by a 1 GB hole
    (sparse) quantizes from the text; a 1 GB hole alone is refused in one line, exit 2, as 16 MB of blanks are (whole,
    the 1 GB file aborted the process: exit -6; 100 MB ended in a tokenizer panic after 17 s). The tokens read are
    the whole text's first ones."""
    _require_model()
    from transformers import AutoTokenizer

    from w8a8_cpu.cli.quantize import CALIBRATION_TEXT, _tokens

    source = tiny_checkpoint(tmp_path / "tiny")
    text_then_hole, hole, blanks = tmp_path / "text.txt", tmp_path / "hole.txt", tmp_path / "blanks.txt"
    text_then_hole.write_bytes(CALIBRATION_TEXT.read_bytes())
    hole.touch()
    for path in (text_then_hole, hole):
        os.truncate(path, 1 << 30)
    blanks.write_bytes(b" " * (1 << 24))
    common = ["--smoothquant", "none", "--calibration-tokens", "64", "--held-out-tokens", "32"]
    r = quantize(source, tmp_path / "out", *common, "--calibration", text_then_hole, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "- calibration: 64 tokens of" in (tmp_path / "out" / "README.md").read_text()
    for path, message in ((hole, r"a NUL byte at offset 0: not a text file$"),
                          (blanks, r"its first 6144 bytes hold 9\d tokens; 96 \(--calibration-tokens \+ "
                                   r"--held-out-tokens\) and 8 beyond them are needed")):
        r = quantize(source, tmp_path / "refused", *common, "--calibration", path, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        ours = [line for line in r.stderr.splitlines() if line.startswith("quantize: ")]
        assert len(ours) == 1 and re.search(message, ours[0]), r.stderr
    tokenizer = AutoTokenizer.from_pretrained(source)
    whole = tokenizer(CALIBRATION_TEXT.read_text(), return_tensors="pt")["input_ids"][0]
    for count in (96, 1000, 1536, whole.numel()):  # prefixes cut inside the text, and the whole text
        assert torch.equal(_tokens(tokenizer, CALIBRATION_TEXT, count), whole[:count]), count


def test_readme_says_that_moe_experts_are_rounded_to_nearest():
    """GPTQ rounds the Linear layers only; the README said every int4 weight was rounded with it."""
    from w8a8_cpu.cli.quantize import readme

    report = dict(model_dir="m", scheme="w4a8", activations="dynamic", group_size=32, rounding="gptq",
                  smoothquant_alpha=None, search=None, calibration="c", calibration_tokens=64, held_out_tokens=64,
                  float_ppl=10.0, quantized_ppl=10.5, kl=0.01, top1=0.9, kept_float=["lm_head"])
    for experts, said in ((True, True), (False, False)):
        text = readme({**report, "experts_to_nearest": experts})
        assert ("rounded with GPTQ on the calibration tokens (MoE experts: rounded to nearest)" in text) == said
