"""w8a8_cpu as vLLM's kernels (w8a8_cpu.compat.vllm, vLLM 0.32): the entry point in the installed metadata and the
version rule (every run); with vLLM installed (the venv of ci/vllm-env.sh, where W8A8_CPU_TEST_VLLM=1 makes a missing
vLLM a failure): an unsupported version, a missing internal and the off switch change nothing; every layer the plugin
serves in a real vLLM model (W8A8 dynamic, static, static asymmetric; W4A8; int8 MoE) gives exactly what w8a8_cpu's own
layers give on the same checkpoint; and a real `vllm serve` on loopback answers through the OpenAI API with our kernels,
its prompt perplexity within 0.2% of our own path's on the same text."""
import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

from conftest import run_python
from vllm_served import engine_env, require_vllm, tiny_checkpoint

pytestmark = pytest.mark.slow_under_emulation

GROUP = "vllm.general_plugins"
LOGGER = "vllm.plugins.w8a8_cpu"


# ---- every run -------------------------------------------------------------------------------------------------

def test_the_installed_distribution_declares_the_entry_point():
    points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=GROUP)}
    assert points.get("w8a8_cpu") == "w8a8_cpu.compat.vllm:register"


@pytest.mark.parametrize("version, supported", [("0.32.0", True), ("0.32.1.dev3+g1234.cpu", True), ("0.31.9", False),
                                                ("0.33.0", False), ("1.32.0", False), ("0.3", False), ("", False)])
def test_supported_versions(version, supported):
    from w8a8_cpu.compat import vllm as plugin
    assert plugin.supported(version) is supported


@pytest.mark.parametrize("value, mode", [(None, "1"), ("0", "0"), ("1", "1"), ("all", "all"), (" ALL ", "all"),
                                         ("yes", ""), ("", "")])
def test_switch_values(monkeypatch, value, mode):
    from w8a8_cpu.compat import vllm as plugin
    if value is None:
        monkeypatch.delenv(plugin.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(plugin.ENV_SWITCH, value)
    assert plugin.mode() == mode


def test_bench_serve_tables_give_the_plugins_ratio_to_vllms_own():
    from w8a8_cpu.cli.bench_serve import format_tables
    row = dict(model="m", threads=1, concurrency=8, ttft_s=0.1, tpot_s=0.02, failed=0, round=0)
    rows = [{**row, "mode": "1", "output_tok_s": 150.0}, {**row, "mode": "0", "output_tok_s": 100.0}]
    profiles = [{**row, "mode": "1", "linear_ms": 30.0, "wall_ms": 100.0}, {**row, "mode": "0", "linear_ms": 40.0,
                                                                             "wall_ms": 120.0}]
    soaked = dict(model="m", mode="1", concurrency=32, seconds=600, served=640, failed=0,
                  samples=[{"rss_mib": 1000.0}, {"rss_mib": 1012.0}, {"rss_mib": 1004.0}])
    assert format_tables(rows, profiles, soaked).splitlines() == [
        "| model | threads | concurrency | mode | output tok/s | TTFT ms | TPOT ms | failed | plugin / own |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
        "| m | 1 | 8 | w8a8_cpu (default) | 150.0 | 100 | 20.0 | 0 | 1.50x |",
        "| m | 1 | 8 | vLLM's own | 100.0 | 100 | 20.0 | 0 |  |",
        "",
        "| model | threads | concurrency | mode | linear/MoE ops ms | engine ms | share | plugin / own |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
        "| m | 1 | 8 | w8a8_cpu (default) | 30 | 100 | 30% | 0.75x |",
        "| m | 1 | 8 | vLLM's own | 40 | 120 | 33% |  |",
        "",
        "soak: m, w8a8_cpu (default), concurrency 32, 600 s: 640 requests served, 0 failed; resident memory 1000 MiB "
        "after the first batch, 1012 max, 1004 at the end"]


def test_bench_serve_rounds_take_medians_and_pair_each_ratio_with_its_round():
    from w8a8_cpu.cli.bench_serve import _rounds, combine_rounds, format_tables
    assert _rounds(["all", "0"], 3) == [(0, "all"), (0, "0"), (1, "0"), (1, "all"), (2, "all"), (2, "0")]
    row = dict(model="m", threads=2, concurrency=32, failed=0)
    rounds = [(100.0, 90.0), (120.0, 100.0), (95.0, 100.0)]  # (plugin, own) output tok/s; ratios 1.11, 1.2, 0.95
    rows = [{**row, "mode": mode, "round": r, "output_tok_s": tok_s, "ttft_s": 0.1 * (r + 1), "tpot_s": 0.01,
             "failed": int(mode == "0" and r == 2)}
            for r, pair in enumerate(rounds) for mode, tok_s in zip(("all", "0"), pair)]
    assert format_tables(rows, [], {}).splitlines()[2:] == [
        "| m | 2 | 32 | w8a8_cpu (W8A8_CPU_VLLM=all) | 100.0 | 200 | 10.0 | 0 | 1.11x (0.95-1.20) |",
        "| m | 2 | 32 | vLLM's own | 100.0 | 200 | 10.0 | 1 |  |",
        "",
        "medians of 3 rounds (servers started in turn); plugin / own: the median of the rounds' ratios (their range)"]
    rows[1]["output_tok_s"] = 0.0  # round 0: every request of vLLM's own failed
    assert combine_rounds(rows, "output_tok_s", ["output_tok_s"])[0]["ratios"] == [0.95, 1.2]


def test_bench_serve_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    child = run_python("import sys; from w8a8_cpu.cli import main; sys.exit(main(sys.argv[1:]))", "bench", "serve",
                       str(tmp_path))
    assert child.returncode == 2
    assert child.stderr.strip().splitlines()[-1].endswith(f"{tmp_path}: not a checkpoint directory (no config.json)")


# ---- vLLM's registries before and after register() -------------------------------------------------------------

# In a child: vLLM's CPU int8 kernel list and compressed-tensors config class after `setup` and the plugin's
# register(), and the plugin's log records.
REGISTRIES = """
import json, logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.levelname + " " + record.getMessage())
logging.getLogger("vllm.plugins.w8a8_cpu").addHandler(Keep())
{setup}
from w8a8_cpu.compat import vllm as plugin
plugin.register()
from vllm.model_executor.kernels.linear import _POSSIBLE_INT8_KERNELS
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.platforms import PlatformEnum
print(json.dumps({{"cpu_int8_kernels": [k.__name__ for k in _POSSIBLE_INT8_KERNELS[PlatformEnum.CPU]],
                  "config": get_quantization_config("compressed-tensors").__name__, "records": records}}))
"""
VLLM_OWN = {"cpu_int8_kernels": ["ZentorchInt8ScaledMMLinearKernel", "CPUInt8ScaledMMLinearKernel"],
            "config": "CompressedTensorsConfig"}


def registries(setup: str = "", **env) -> dict:
    child = run_python(REGISTRIES.format(setup=setup), **env)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_register_puts_our_kernels_first():
    require_vllm()
    result = registries(W8A8_CPU_VLLM=None)
    assert result["cpu_int8_kernels"] == ["W8A8CpuInt8Kernel", *VLLM_OWN["cpu_int8_kernels"]]
    assert result["config"] == "W8A8CpuCompressedTensorsConfig"
    assert result["records"] == []  # what it serves is logged when a model's layers load


@pytest.mark.parametrize("setup, env, warning", [
    ("import vllm; vllm.__version__ = '0.31.0'", {},
     "WARNING w8a8_cpu: vLLM 0.31.0 is not supported by this plugin (supported: 0.32.x); changing nothing, vLLM's own "
     "kernels run"),
    ("import vllm.model_executor.layers.quantization as q; del q.register_quantization_config", {},
     "WARNING w8a8_cpu: vLLM 0.32.0 lacks an internal this plugin needs (ImportError: cannot import name "
     "'register_quantization_config' from 'vllm.model_executor.layers.quantization'"),
    ("", {"W8A8_CPU_VLLM": "0"}, "WARNING w8a8_cpu: plugin off (W8A8_CPU_VLLM='0'); vLLM's own kernels run"),
    ("", {"W8A8_CPU_VLLM": "on"},
     "WARNING w8a8_cpu: plugin off (W8A8_CPU_VLLM='on': not one of 0, 1, all); vLLM's own kernels run"),
], ids=["unsupported-version", "missing-internal", "switched-off", "unknown-switch-value"])
def test_what_cannot_apply_changes_nothing_and_says_so_in_one_line(setup, env, warning):
    require_vllm()
    result = registries(setup, **env)
    assert {k: result[k] for k in VLLM_OWN} == VLLM_OWN
    assert len(result["records"]) == 1 and result["records"][0].startswith(warning), result["records"]


# ---- vLLM engines on tiny checkpoints, many in one child ----------------------------------------------------------

# In a child, vLLM in this process (vllm_served.on_engine, each engine torn down before the next): for each argument
# "layers:PATH" every layer vLLM built with w8a8_cpu's kernel or scheme against w8a8_cpu's own layers loaded from the
# same checkpoint (vllm_served.compare_served_layers: {"equal": {kind: count of layers equal}, "mismatches": [the first
# three others]}); for "load:PATH" the load alone (null). A JSON line a case: {"case": ARGUMENT, "result": ...} or,
# where the engine raised, {"case": ARGUMENT, "error": the exception with its causes, as a traceback prints them}.
# One child for many engines: each child pays vLLM's import (~15-30 s), an engine on a tiny checkpoint a few seconds.
ENGINES = """
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
from vllm_served import compare_served_layers, on_engine
from w8a8_cpu.llm import load_quantized
for case in sys.argv[2:]:
    what, checkpoint = case.split(":", 1)
    try:
        if what == "layers":
            ours = dict(load_quantized(checkpoint).named_modules())
            line = {"result": on_engine(checkpoint, lambda llm: compare_served_layers(llm, ours))}
        else:
            line = {"result": on_engine(checkpoint)}
    except Exception as e:
        line = {"error": "".join(traceback.format_exception(e))}
    print(json.dumps({"case": case, **line}), flush=True)
"""
TESTS = str(Path(__file__).resolve().parent)


def on_engines(cases: list, tmp_path: Path, switch: str) -> dict:
    """ENGINES' outcome of each case ("layers:PATH" or "load:PATH") in one child: {case: its JSON line}."""
    child = run_python(ENGINES, TESTS, *cases, timeout=300 + 60 * len(cases), **engine_env(tmp_path, switch))
    lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith('{"case"')]
    assert child.returncode == 0 and len(lines) == len(cases), child.stderr[-4000:]
    return {line["case"]: line for line in lines}


def served_layers(checkpoints: list, tmp_path: Path, switch: str) -> list:
    """compare_served_layers' result for each checkpoint, their engines in one child."""
    cases = [f"layers:{checkpoint}" for checkpoint in checkpoints]
    outcomes = on_engines(cases, tmp_path, switch)
    for case in cases:
        assert "result" in outcomes[case], outcomes[case]["error"][-4000:]
    return [outcomes[case]["result"] for case in cases]


LAYER_KINDS = {
    "dynamic": {"int8:W8A8CpuInt8Scheme": 8},  # 2 layers x q/k/v, o, gate/up, down
    "static": {"int8:W8A8CpuInt8Scheme": 8},
    "static-asymmetric": {"int8:W8A8CpuInt8Scheme": 8},
    "w4a8": {"W8A8CpuW4A8": 8},
    "moe": {"int8:W8A8CpuInt8Scheme": 4, "W8A8CpuMoE": 2},  # attention linears, each layer's experts
    "moe-w4a8": {"W8A8CpuW4A8": 4, "W8A8CpuW4A8MoE": 2},
}


@pytest.fixture(scope="module")
def served_layers_of_every_kind(tmp_path_factory):
    """{kind: served_layers' result} for every kind of LAYER_KINDS, the plugin serving all (one child)."""
    require_vllm()
    tmp_path = tmp_path_factory.mktemp("layers")
    kinds = list(LAYER_KINDS)
    results = served_layers([tiny_checkpoint(tmp_path / kind, kind) for kind in kinds], tmp_path, "all")
    return dict(zip(kinds, results))


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_every_served_layer_equals_w8a8_cpus_own_layer(served_layers_of_every_kind, kind):
    assert served_layers_of_every_kind[kind] == {"equal": LAYER_KINDS[kind], "mismatches": []}


def tensor_edit(key: str, value=None, dtype=None):
    """An edit of a checkpoint folder: tensor `key`'s element 3 (of a single value: all) set to value, or the
    tensor (value a list: replaced by it) converted to dtype."""
    def edit(directory):
        from test_checkpoint import edit_tensors

        def change(tensors):
            t = tensors[key]
            if isinstance(value, list):
                t = torch.tensor(value, dtype=dtype)
            elif value is not None:
                t = t.clone()
                t.view(-1)[3 if t.numel() > 3 else slice(None)] = value
            else:
                t = t.to(dtype)
            tensors[key] = t
        edit_tensors(directory, change)
    return edit


def tensors_edit(change):
    """An edit: change(tensors) on the checkpoint's tensors (a dict, in place)."""
    def edit(directory):
        from test_checkpoint import edit_tensors
        edit_tensors(directory, change)
    return edit


def config_edit(field: str, value):
    """An edit: config.json's quantization_config group_0 (the first group) field "section.key" set to value."""
    def edit(directory):
        config = json.loads((directory / "config.json").read_text())
        section, key = field.split(".")
        next(iter(config["quantization_config"]["config_groups"].values()))[section][key] = value
        (directory / "config.json").write_text(json.dumps(config))
    return edit


DOWN, EXPERT_W2 = "model.layers.1.mlp.down_proj", "model.layers.1.block_sparse_moe.experts.2.w2"
PACKED_W2 = f"{EXPERT_W2}.weight_packed"


# Checkpoints load_quantized refuses, each a tiny one of a kind, edited: {case id: (kind, edit, the ValueError)}
REFUSALS = {
    "scale-0": ("dynamic", tensor_edit(f"{DOWN}.weight_scale", 0.0),
     f"{DOWN}.weight_scale: holds a weight scale that is not finite and > 0"),
    "int4-scale-negative": ("w4a8", tensor_edit(f"{DOWN}.weight_scale", -1.0),
     f"{DOWN}.weight_scale: holds a weight scale that is not finite and > 0"),
    "moe-scale-0": ("moe", tensor_edit(f"{EXPERT_W2}.weight_scale", 0.0),
     "model.layers.1.block_sparse_moe.experts.w2_weight_scale: holds a weight scale that is not finite and > 0"),
    "scale-overflows": ("dynamic", tensor_edit(f"{DOWN}.weight_scale", 3e38),
     f"{DOWN}.weight_scale: holds a scale whose weights (128 x the scale) overflow fp32"),
    "input-scale-inf": ("static", tensor_edit(f"{DOWN}.input_scale", float("inf")),
     f"{DOWN}: input_scale: expected one finite float > 0, got inf"),
    "fused-input-scales-differ": ("static", tensors_edit(lambda t: t.update(
        {"model.layers.1.mlp.gate_proj.input_scale": t["model.layers.1.mlp.gate_proj.input_scale"] * 2})),
     "model.layers.1.mlp.gate_up_proj: input_scale / input_zero_point: the fused parts' static activation parameters "
     "differ"),
    "zero-point-300": ("static-asymmetric",
                       tensor_edit("model.layers.1.self_attn.o_proj.input_zero_point", [300], torch.int32),
     "model.layers.1.self_attn.o_proj: input_zero_point: expected one integer in [-128, 127]"),
    "int16-weight": ("dynamic", tensor_edit(f"{DOWN}.weight", dtype=torch.int16),
     f"{DOWN}.weight: the checkpoint's tensor is int16; expected int8"),
    "int4-weight-shape": ("w4a8",
                          tensor_edit("model.layers.0.self_attn.k_proj.weight_shape", [256, 128], torch.int64),
     "model.layers.0.self_attn.qkv_proj.weight_shape: the checkpoint's tensor is int64 [256, 128]; expected int64 or "
     "int32 [128, 256]"),
    "moe-int4-weight-shape": ("moe-w4a8", tensor_edit(f"{EXPERT_W2}.weight_shape", [512, 256], torch.int64),
     "model.layers.1.block_sparse_moe.experts.w2_weight_shape: the checkpoint's tensor is int64 [512, 256]; expected "
     "int64 or int32 [256, 512]"),
    "float-activations": ("dynamic", config_edit("input_activations.type", "float"),
     "model.layers.0.self_attn.qkv_proj: load_quantized refuses this checkpoint: config.json quantization_config: "
     "config_groups['group_0'].input_activations.type is 'float'"),
    "missing-part": ("dynamic", tensors_edit(lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")),
     "model.layers.1.self_attn.qkv_proj: weight: the checkpoint holds 2 of its 3 parts (['q', 'v']); a tensor is "
     "missing"),
    "moe-narrower-tensor": ("moe-w4a8",
                            tensors_edit(lambda t: t.update({PACKED_W2: t[PACKED_W2][:, 1:].contiguous()})),
     "model.layers.1.block_sparse_moe.experts.w2_weight_packed: the checkpoint's tensor is int32 [256, 63]; expected "
     "int32 [256, 64]"),
}


@pytest.fixture(scope="module")
def refused_loads(tmp_path_factory):
    """{case id: ENGINES' JSON line} for each of REFUSALS' checkpoints loaded by vLLM with the plugin serving all
    (one child)."""
    require_vllm()
    tmp_path = tmp_path_factory.mktemp("refusals")
    cases = {}
    for case_id, (kind, edit, _) in REFUSALS.items():
        checkpoint = tiny_checkpoint(tmp_path / case_id, kind)
        edit(checkpoint)
        cases[case_id] = f"load:{checkpoint}"
    outcomes = on_engines(list(cases.values()), tmp_path, "all")
    return {case_id: outcomes[case] for case_id, case in cases.items()}


@pytest.mark.parametrize("case_id", REFUSALS)
def test_a_checkpoint_load_quantized_refuses_stops_the_load_naming_the_layer(refused_loads, case_id):
    """An untrusted checkpoint through vLLM, edited where load_quantized refuses it (found by tests/hostile's vllm
    surface): the plugin refuses it at load with a ValueError naming the layer and the parameter, before anything is
    served. vLLM alone takes each of them: its loaders convert a tensor to the parameter's dtype (an int32 zero point
    300 became int8 44), keep one of the fused parts' activation scales and weight shapes, count a fused parameter
    loaded when one part is (the others left as allocated), copy what fits of an expert's narrower tensor, and read
    int8 tensors whatever the config's type says."""
    outcome = refused_loads[case_id]
    assert "error" in outcome, f"vLLM loaded it: {outcome}"
    assert f"ValueError: {REFUSALS[case_id][2]}" in outcome["error"], outcome["error"][-3000:]


def test_the_default_leaves_to_vllm_what_it_runs_on_amx(tmp_path):
    """W8A8_CPU_VLLM=1 on a CPU with AMX tiles: the dynamic W8A8 and the int8 MoE layers stay with vLLM's AMX kernels,
    the int4 MoE (which vLLM cannot run on x86) is ours; without AMX the default serves them all."""
    require_vllm()
    amx = torch.cpu._is_amx_tile_supported()
    dense_moe, int4_moe = served_layers([tiny_checkpoint(tmp_path / kind, kind) for kind in ("moe", "moe-w4a8")],
                                        tmp_path, "1")
    assert dense_moe == {"equal": {} if amx else {"int8:W8A8CpuInt8Scheme": 4, "W8A8CpuMoE": 2}, "mismatches": []}
    assert int4_moe == {"equal": {"W8A8CpuW4A8MoE": 2} if amx else {"W8A8CpuW4A8": 4, "W8A8CpuW4A8MoE": 2},
                        "mismatches": []}


# ---- a real server, a real client -------------------------------------------------------------------------------

def test_vllm_serve_answers_with_our_kernels_and_its_perplexity_is_ours(tmp_path):
    """`python -m w8a8_cpu quantize`'s SmolLM2 W8A8 served by vLLM (fp32 activations, as our own path runs; the
    plugin takes every int8 layer): greedy completions through the OpenAI API, the same tokens on every call, and the
    prompt perplexity on 4096 tokens of GPL-3 within 0.25% of load_quantized's on the same windows. Every layer is
    exactly ours (the test above); what differs is vLLM's attention, norms and rotary embedding, whose last bits a
    W8A8 model amplifies (per-token rounding): our own two paths, transformers' forward and the lean Decoder, differ
    by 0.11% on this text, and served vs transformers measured -0.20%."""
    require_vllm()
    from test_llm import _require_model
    _require_model()
    from test_quantize_command import quantize
    from w8a8_cpu.cli import serving
    from w8a8_cpu.cli.llm import EVAL_TEXT
    from w8a8_cpu.llm import evaluate, load_quantized, smollm2

    import transformers

    checkpoint = tmp_path / "smollm2-w8a8"
    made = quantize(smollm2.ensure_cache(), checkpoint, "--smoothquant", "0.6")
    assert made.returncode == 0, made.stderr[-3000:]
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(EVAL_TEXT.read_text(), return_tensors="pt").input_ids[0, :4096]
    with serving.vllm_server(str(checkpoint), tmp_path / "vllm.log", threads=2, plugin="all",
                             cache_root=tmp_path / "vllm-cache", extra_args=["--dtype", "float32"]) as server:
        served = [serving.stream_completion(server, "The GNU General Public License is", 16, ignore_eos=False)
                  for _ in range(2)]
        served_ppl = serving.served_perplexity(server, ids.tolist())
        log = server.log.read_text(errors="replace")
    assert "serves W8A8 int8 linear layers (dynamic symmetric activations)" in log
    assert 0 < len(served[0].tokens) <= 16 and served[0].text.strip()
    assert served[1].tokens == served[0].tokens
    ours = evaluate.compare_on_text({"ours": load_quantized(checkpoint)}, "ours", ids)["ours"]["ppl"]
    assert abs(served_ppl / ours - 1) <= 0.0025, (served_ppl, ours)


def test_vllm_serve_w4a8_with_the_plugin_on_and_off(tmp_path):
    """A W4A8 checkpoint (`quantize --scheme w4a8`) served with the plugin (W8A8_CPU_VLLM=all: our W4A8 layers) and
    without it (vLLM's CPUWNA16, bf16 after dequantizing): both answer greedy completions; each server's log names its
    kernels."""
    require_vllm()
    from test_llm import _require_model
    _require_model()
    from test_quantize_command import quantize
    from w8a8_cpu.cli import serving
    from w8a8_cpu.llm import smollm2

    checkpoint = tmp_path / "smollm2-w4a8"
    made = quantize(smollm2.ensure_cache(), checkpoint, "--scheme", "w4a8", "--rounding", "rtn", "--smoothquant",
                    "none")
    assert made.returncode == 0, made.stderr[-3000:]
    for plugin in ("all", "0"):  # all: ours on every CPU (with AMX, the default leaves W4A8 to vLLM)
        with serving.vllm_server(str(checkpoint), tmp_path / f"vllm-{plugin}.log", threads=2, plugin=plugin,
                                 cache_root=tmp_path / "vllm-cache", extra_args=["--enforce-eager"]) as server:
            served = serving.stream_completion(server, "The GNU General Public License is", 8, ignore_eos=True)
            log = server.log.read_text(errors="replace")
        assert len(served.tokens) == 8 and served.text.strip()
        assert ("serves W4A8 linear layers (int4 groups of 32)" in log) == (plugin == "all")
        assert ("Using CPUWNA16LinearKernel for CompressedTensorsWNA8Int" in log) == (plugin == "0")
