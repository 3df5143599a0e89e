"""What the vLLM plugin's tests (test_vllm_plugin.py) and the hostile suite's vllm surface share: the tiny
checkpoints, a vLLM engine's environment and start, and the comparison of every layer the plugin serves against
w8a8_cpu's own layer loaded from the same checkpoint. Imports vLLM only inside the functions that need it."""
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from tiny_models import tiny_causal_lm

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
KINDS = ("dynamic", "static", "static-asymmetric", "w4a8", "moe", "moe-w4a8")


def require_vllm():
    if not HAVE_VLLM and os.environ.get("W8A8_CPU_TEST_VLLM") == "1":
        pytest.fail("W8A8_CPU_TEST_VLLM=1 but vLLM does not import: bash ci/vllm-env.sh VENV")
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (bash ci/vllm-env.sh VENV sets up a venv with it)")


def tiny_checkpoint(directory: Path, kind: str) -> Path:
    """A tiny random Llama (or Mixtral for "moe..."), quantized by w8a8_cpu and saved as a compressed-tensors checkpoint
    (no tokenizer: the engine starts with skip_tokenizer_init); `kind` one of KINDS. head_dim 64: vLLM's CPU attention
    sizes."""
    from w8a8_cpu.llm import calibrate_static_activations, save_compressed
    from w8a8_cpu.nn import quantize_model
    model = tiny_causal_lm("mixtral" if kind.startswith("moe") else "llama", vocab_size=512, hidden_size=256,
                           intermediate_size=512, max_position_embeddings=256)
    quantize_model(model, skip=["lm_head", "*.gate"], **({"scheme": "w4a8"} if kind.endswith("w4a8") else {}))
    if kind.startswith("static"):
        calibrate_static_activations(model, torch.randint(0, 512, (2, 64)), symmetric=kind == "static")
    save_compressed(model, directory)
    return directory


def engine_env(tmp_path: Path, switch: str) -> dict:
    """A vLLM engine child's environment: the plugin's switch, one thread, a small KV cache, vLLM's caches and
    configuration under the test's folder (never the user's), no usage reports."""
    return dict(W8A8_CPU_VLLM=switch, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0",
                VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), VLLM_CONFIG_ROOT=str(tmp_path / "vllm-config"),
                VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")


def on_engine(checkpoint, use=lambda llm: None):
    """use(llm) on vLLM's LLM started on a checkpoint in this process (no engine subprocess: a load error is raised
    here), eager, no tokenizer; returns what use returns. vLLM's per-process distributed state is torn down after it,
    also after a failed start, so that the next engine in this process starts as in a fresh one (an MoE model after a
    dense one needs the expert-parallel group the dense one did not create)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory
    llm = None
    try:
        llm = LLM(model=str(checkpoint), max_model_len=256, enforce_eager=True, skip_tokenizer_init=True,
                  max_num_seqs=4)
        return use(llm)
    finally:
        del llm
        cleanup_dist_env_and_memory()


def compare_served_layers(llm, ours: dict) -> dict:
    """Every layer `llm` built with w8a8_cpu's kernel or scheme against w8a8_cpu's own layers `ours` (named modules of
    load_quantized's model on the same checkpoint), on the same bf16 inputs: [M, K] rows for linears (the fused q/k/v
    and gate/up layers against their parts' outputs side by side), tokens routed to two experts each for MoE layers.
    {"equal": {kind: count of layers equal and finite}, "mismatches": [the first three others, with why]}."""
    from w8a8_cpu.compat.vllm._linear import W8A8CpuInt8Kernel, W8A8CpuW4A8
    from w8a8_cpu.compat.vllm._moe import W8A8CpuMoE
    from w8a8_cpu.nn import W8A8Experts

    def compare(model):
        parts = getattr(model, "packed_modules_mapping", {})
        gen = torch.Generator().manual_seed(0)
        equal, mismatches = {}, []
        for name, layer in model.named_modules():
            method = getattr(layer, "quant_method", None)
            scheme = getattr(layer, "scheme", None)
            kind = (type(scheme).__name__ if isinstance(scheme, W8A8CpuW4A8) else
                    "int8:" + type(scheme).__name__ if isinstance(getattr(scheme, "kernel", None), W8A8CpuInt8Kernel)
                    else type(method).__name__ if isinstance(method, W8A8CpuMoE) else None)
            if kind is None:
                continue
            if isinstance(method, W8A8CpuMoE):
                layer_index = name.split(".layers.")[1].split(".")[0]
                mine = [m for n, m in ours.items() if isinstance(m, W8A8Experts) and f".layers.{layer_index}." in n]
                if len(mine) != 1:
                    mismatches.append(f"{name}: {len(mine)} expert layers of ours at layer {layer_index}")
                    continue
                experts = mine[0]
                x = torch.randn(5, experts.hidden_dim, generator=gen).to(torch.bfloat16)
                ids = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:2] for _ in range(5)])
                weights = torch.rand(5, 2, generator=gen).softmax(-1)
                got = method.apply(layer, x, weights, ids.to(torch.int32), None, None)
                want = experts(x, ids.to(torch.int32), weights)
            else:
                prefix, _, last = name.rpartition(".")
                names = [f"{prefix}.{p}" for p in parts.get(last, [last])]
                if not all(n in ours for n in names):
                    mismatches.append(f"{name}: ours has no {[n for n in names if n not in ours]}")
                    continue
                mine = [ours[n] for n in names]
                x = torch.randn(3, mine[0].in_features, generator=gen).to(torch.bfloat16)
                got = method.apply(layer, x, layer.bias)
                want = torch.cat([m(x) for m in mine], dim=-1)
            if got.shape != want.shape:
                mismatches.append(f"{name}: shape {tuple(got.shape)}, ours {tuple(want.shape)}")
            elif not torch.isfinite(got).all():
                mismatches.append(f"{name}: not finite")
            elif torch.equal(got, want):
                equal[kind] = equal.get(kind, 0) + 1
            else:
                mismatches.append(f"{name}: max |diff| {(got.float() - want.float()).abs().max().item()}")
        return equal, mismatches
    [(equal, mismatches)] = llm.apply_model(compare)
    return {"equal": equal, "mismatches": mismatches[:3]}
