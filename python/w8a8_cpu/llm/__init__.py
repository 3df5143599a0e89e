"""LLM-level tools: SmoothQuant (from w8a8_cpu.quant), W8A8 checkpoints in and out, and the SmolLM2 main job.

    smooth_quant(model, calibration_ids, alpha=0.5)   # fold activation outliers into the weights (float model)
    stats = calibrate_smoothing(model, calibration_ids)  # measure once, then smooth copies: smooth_quant(copy,
                                                         # alpha=a, statistics=stats)
    quantize_model(model, skip=["lm_head"])             # w8a8_cpu.nn: Linear -> W8A8Linear, experts -> W8A8Experts
    save_compressed(model, directory)                   # a compressed-tensors int-quantized checkpoint
    model = load_quantized(directory)                   # compressed-tensors int-quantized or sglang w8a8_int8
    calibrate_static_activations(model, calibration_ids)  # optional: static per-tensor activation scales

Imported lazily: the checkpoint code needs safetensors, which only the llm extra installs."""
from __future__ import annotations

import importlib

_EXPORTS = {  # name -> the module that defines it, relative to this package
    "smooth_quant": "..quant.smoothquant",
    "calibrate_smoothing": "..quant.smoothquant",
    "SmoothingReport": "..quant.smoothquant",
    "calibrate_static_activations": "..quant.static_activations",
    "save_compressed": ".checkpoint",
    "load_quantized": ".checkpoint",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'w8a8_cpu.llm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


__all__ = sorted(_EXPORTS)
