"""w8a8_cpu as sglang's kernel provider (sglang 0.5.23): the entry point in the installed distribution's metadata and
the plugin itself (in every run); with sglang installed (the venv of ci/sglang-env.sh), sglang's own plugin loader
defining torch.ops.sgl_kernel.* with ours, never over a real sgl_kernel, and sglang's own W8A8 layers on their Arm
path giving exactly w8a8_cpu's results."""
import importlib.metadata
import importlib.util
import json
import os

import pytest
import torch

import w8a8_cpu
from conftest import run_python
from w8a8_cpu.compat import sglang as shim

PLUGIN_GROUP = "sglang.srt.plugins"  # sglang 0.5.23's GENERAL_PLUGINS_GROUP
LOGGER = "w8a8_cpu.compat.sglang"
OURS = {name: shim.__file__ for name in shim.SCHEMAS}  # the file that registered each op's CPU kernel
SERVED_ALL = (f"{LOGGER}: serving sgl_kernel::convert_weight_packed, per_token_quant_int8_cpu, int8_scaled_mm_cpu, "
              f"int8_scaled_mm_with_quant, fused_experts_cpu with w8a8_cpu (variant "
              f"{w8a8_cpu.info()['selected_variant']})")
SERVED_FOUR = SERVED_ALL.replace(" int8_scaled_mm_with_quant,", "")
REFUSED_ONE = ("; refused (never overwrites existing ops): sgl_kernel::int8_scaled_mm_with_quant already defined by "
               "another library (with a CPU kernel): sgl_kernel::" + shim.SCHEMAS["int8_scaled_mm_with_quant"])
CUDA_ONLY_ERROR = "libcudart.so.13: cannot open shared object file: No such file or directory"

# A stand-in for a real sgl_kernel: defines one of the ops (CPU kernel returning 42) at import time, as a real one's
# TORCH_LIBRARY does; or one whose import fails, as a CUDA build's does on a CPU-only host.
DEFINE_ONE_OP = f"""import torch
_library = torch.library.Library("sgl_kernel", "DEF")
_library.define({shim.SCHEMAS["int8_scaled_mm_with_quant"]!r})
_library.impl("int8_scaled_mm_with_quant", lambda *args: torch.full((1,), 42.0), "CPU")
"""
FAIL_TO_IMPORT = f"raise ImportError({CUDA_ONLY_ERROR!r})\n"

# In a child process: log records as "name|level|message", then `setup`, `load` (the plugin, by sglang's loader or
# directly), then a JSON line: which file registered each op's CPU kernel, what the stand-in's op returns,
# and the sglang / sgl_kernel modules imported.
CHILD = """
import json, logging, re, sys, torch
logging.basicConfig(level=logging.INFO, format="%(name)s|%(levelname)s|%(message)s")
{setup}
w8a8_cpu_imported_before = "w8a8_cpu" in sys.modules
{load}
def cpu_kernel_file(name):
    if not hasattr(torch.ops.sgl_kernel, name):
        return None
    return re.search(r"^CPU: registered at (.*):[0-9]+ ::", torch._C._dispatch_dump("sgl_kernel::" + name), re.M)[1]
x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
print(json.dumps({{
    "w8a8_cpu_imported_before": w8a8_cpu_imported_before,
    "cpu_kernels": {{name: cpu_kernel_file(name) for name in {names!r}}},
    "stand_in_op_returns": torch.ops.sgl_kernel.int8_scaled_mm_with_quant(x, x, x, None, torch.float32, True).tolist()
                           if {call_stand_in_op} else None,
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("sglang", "sgl_kernel")),
}}))
"""


PLUGIN_CALLED_DIRECTLY = "from w8a8_cpu.compat import sglang\nsglang.plugin()"


def run_child(setup: str = "", load: str = PLUGIN_CALLED_DIRECTLY, call_stand_in_op: bool = False, **env):
    """CHILD with `setup` and `load`; returns (its JSON result, its lines logged by w8a8_cpu.compat.sglang)."""
    r = run_python(CHILD.format(setup=setup, load=load, names=list(shim.SCHEMAS), call_stand_in_op=call_stand_in_op),
                   **env)
    assert r.returncode == 0, r.stderr[-4000:]
    logged = [line.split("|", 2)[1:] for line in r.stderr.splitlines() if line.startswith(LOGGER + "|")]
    return json.loads(r.stdout.splitlines()[-1]), logged


def installed_sgl_kernel(tmp_path, source: str) -> str:
    """A package sgl_kernel of `source` under tmp_path; returns the PYTHONPATH that makes it importable."""
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text(source)
    return os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))


# ---- every run: the entry point and the plugin --------------------------------------------------------------------

def test_installed_distribution_declares_the_sglang_plugin():
    declared = [ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP) if ep.dist.name == "w8a8-cpu"]
    assert [(ep.name, ep.value) for ep in declared] == [("w8a8_cpu", "w8a8_cpu.compat.sglang:plugin")]
    assert declared[0].load() is shim.plugin


def test_plugin_serves_every_op_and_imports_no_sglang():
    result, logged = run_child()
    assert logged == [["INFO", SERVED_ALL]]
    assert result["cpu_kernels"] == OURS
    assert result["modules"] == []


def test_plugin_imports_an_installed_sgl_kernel_first(tmp_path):
    """Imported after the plugin, a real sgl_kernel would fail on the op names ours took; imported first, its ops are
    defined and ours only fill the others. sglang importing it again later is a no-op."""
    pythonpath = installed_sgl_kernel(tmp_path, DEFINE_ONE_OP)
    result, logged = run_child(load=PLUGIN_CALLED_DIRECTLY + "\nimport sgl_kernel", call_stand_in_op=True,
                               PYTHONPATH=pythonpath)
    assert logged == [["INFO", SERVED_FOUR + REFUSED_ONE + "; sgl_kernel imported first"]]
    assert result["stand_in_op_returns"] == [42.0]
    assert result["cpu_kernels"] == {**OURS, "int8_scaled_mm_with_quant": str(tmp_path / "sgl_kernel" / "__init__.py")}
    assert result["modules"] == ["sgl_kernel"]


def test_plugin_serves_every_op_when_sgl_kernel_fails_to_import(tmp_path):
    result, logged = run_child(PYTHONPATH=installed_sgl_kernel(tmp_path, FAIL_TO_IMPORT))
    assert logged == [["INFO", SERVED_ALL + f"; sgl_kernel is installed but failed to import (ImportError: "
                                            f"{CUDA_ONLY_ERROR})"]]
    assert result["cpu_kernels"] == OURS


# ---- with sglang: its plugin loader and its own W8A8 layers --------------------------------------------------------

needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="sglang is not installed: bash ci/sglang-env.sh VENV, then "
                                         "VENV/bin/python -m pytest tests/test_sglang_plugin.py")
SGLANG_LOADS_PLUGINS = "from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins\nload_plugins()"


@needs_sglang
@pytest.mark.parametrize("selected", [None, "w8a8_cpu", "another_plugin"])
def test_sglangs_plugin_loader_defines_our_ops(selected):
    """sglang's loader, as each sglang process runs it, with no import of w8a8_cpu by the user: every op is ours, also
    when SGLANG_PLUGINS names ours; a list without it leaves the ops undefined."""
    result, logged = run_child(load=SGLANG_LOADS_PLUGINS + f"\nassert GENERAL_PLUGINS_GROUP == {PLUGIN_GROUP!r}",
                               SGLANG_PLUGINS=selected)
    assert not result["w8a8_cpu_imported_before"]
    if selected == "another_plugin":
        assert logged == [] and result["cpu_kernels"] == dict.fromkeys(shim.SCHEMAS)
    else:
        assert logged == [["INFO", SERVED_ALL]] and result["cpu_kernels"] == OURS


@needs_sglang
def test_sglangs_plugin_loader_never_overrides_a_real_sgl_kernel():
    result, logged = run_child(setup=DEFINE_ONE_OP, load=SGLANG_LOADS_PLUGINS, call_stand_in_op=True)
    assert logged == [["INFO", SERVED_FOUR + REFUSED_ONE]]
    assert result["stand_in_op_returns"] == [42.0]
    assert result["cpu_kernels"] == {**OURS, "int8_scaled_mm_with_quant": "<string>"}


@pytest.fixture
def sglang_w8a8_on_arm(monkeypatch):
    """sglang's w8a8_int8 module, its ops from sglang's own plugin loader, on its Arm CPU branch: the flags it computes
    from the host at import (x86 here, SGLANG_USE_CPU_ENGINE unset) set as an aarch64 CPU engine without AMX sets
    them."""
    from sglang.srt.layers.quantization import w8a8_int8
    from sglang.srt.plugins import load_plugins

    load_plugins()
    for flag, value in (("_is_cpu", True), ("_is_cpu_arm64", True), ("_is_cpu_amx_available", False)):
        monkeypatch.setattr(w8a8_int8, flag, value)
    return w8a8_int8


@needs_sglang
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("has_bias", [False, True])
def test_sglangs_w8a8_linear_layer_gives_our_result(sglang_w8a8_on_arm, gen, dtype, has_bias):
    """sglang's ReplicatedLinear with W8A8Int8Config (its W8A8Int8LinearMethod): create_weights, its weight loader,
    process_weights_after_loading, forward == w8a8_cpu.int8_scaled_mm_with_quant on the same int8 weights."""
    from sglang.srt.layers.linear import ReplicatedLinear

    n, k = 48, 96
    layer = ReplicatedLinear(k, n, bias=has_bias, params_dtype=dtype,
                             quant_config=sglang_w8a8_on_arm.W8A8Int8Config({}))
    assert type(layer.quant_method) is sglang_w8a8_on_arm.W8A8Int8LinearMethod
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    w_scale = torch.rand(n, generator=gen) * 1e-2
    bias = torch.randn(n, generator=gen).to(dtype) if has_bias else None
    checkpoint = {"weight": w_q, "weight_scale": w_scale[:, None], **({"bias": bias} if has_bias else {})}
    for name, param in layer.named_parameters():
        param.weight_loader(param, checkpoint.pop(name))
    assert checkpoint == {}
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, k, generator=gen).to(dtype)
    out, out_bias = layer(x)
    want = w8a8_cpu.int8_scaled_mm_with_quant(x, w_q, w_scale, bias.float() if has_bias else None, dtype)
    assert out_bias is None and out.dtype == dtype and torch.equal(out, want)


@needs_sglang
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sglangs_w8a8_moe_method_gives_our_result(sglang_w8a8_on_arm, gen, dtype):
    """sglang's W8A8Int8MoEMethod (its FusedMoE layer needs sglang's parallel runtime, so the method runs on a bare
    module, as FusedMoE drives it): create_weights, the expert weights and [E, N, 1] scales loaded,
    process_weights_after_loading, create_moe_runner, apply == w8a8_cpu.fused_experts on the same weights."""
    from sglang.srt.layers.moe import MoeRunnerConfig
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    experts, hidden, inter, tokens, top_k = 4, 64, 32, 6, 2
    method = sglang_w8a8_on_arm.W8A8Int8MoEMethod(sglang_w8a8_on_arm.W8A8Int8Config({}))
    layer = torch.nn.Module()
    method.create_weights(layer, num_experts=experts, hidden_size=hidden, intermediate_size_per_partition=inter,
                          params_dtype=dtype)
    w13 = torch.randint(-127, 128, (experts, 2 * inter, hidden), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-127, 128, (experts, hidden, inter), dtype=torch.int8, generator=gen)
    w13_scale = torch.rand(experts, 2 * inter, generator=gen) * 1e-2
    w2_scale = torch.rand(experts, hidden, generator=gen) * 1e-2
    for name, value in (("w13_weight", w13), ("w2_weight", w2), ("w13_weight_scale", w13_scale[..., None]),
                        ("w2_weight_scale", w2_scale[..., None])):
        getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    method.create_moe_runner(layer, MoeRunnerConfig(num_experts=experts, num_local_experts=experts, hidden_size=hidden,
                                                    intermediate_size_per_partition=inter, top_k=top_k,
                                                    params_dtype=dtype))
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    router_logits = torch.randn(tokens, experts, generator=gen)
    topk_weights, topk_ids = torch.topk(torch.softmax(router_logits, dim=-1), top_k)
    combined = method.apply(layer, StandardDispatchOutput(x, None, StandardTopKOutput(topk_weights, topk_ids,
                                                                                      router_logits)))
    want = w8a8_cpu.fused_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    assert combined.hidden_states.dtype == dtype and torch.equal(combined.hidden_states, want)
