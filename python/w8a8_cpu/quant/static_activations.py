"""Static activation scales from calibration tokens: the form of llm-compressor's static W8A8 checkpoints.

A static layer quantizes its input with one stored scale (and zero point) instead of measuring every token, which
is what some servers and checkpoints expect; dynamic per-token activations (the default) are usually more accurate,
since a static range must cover every token's outliers. See W8A8Linear.set_activations and quantize_activations."""
from __future__ import annotations

from typing import Iterable, List, Union

import torch

from .._functions import asymmetric_activation_params
from ..nn.transform import activation_layers
from . import calibration as runner


def calibrate_static_activations(model: torch.nn.Module, calibration: Union[torch.Tensor, Iterable[torch.Tensor]],
                                 symmetric: bool = True) -> List[str]:
    """Give every W8A8Linear of a quantized model that quantizes its input dynamically per token a static per-tensor
    scale from the range its input takes over the calibration tokens ([B, T] ids or an iterable of batches, run
    through the model as it is): symmetric, s = max|x| / 127; otherwise s and zero point over [min x, max x] (the
    grid widened to include 0, asymmetric_activation_params). Int4 and fused layers keep dynamic activations.
    Returns the names of the layers made static, in place."""
    layers = {name: module for name, module in activation_layers(model).items()
              if module.activation_scheme == "token"}
    ranges = {}

    def record(name):
        def hook(module, args):
            x = args[0].detach()
            low, high = x.amin().float(), x.amax().float()
            if name in ranges:
                low, high = torch.minimum(ranges[name][0], low), torch.maximum(ranges[name][1], high)
            ranges[name] = (low, high)
        return hook

    runner.run(model, calibration, [runner.pre_hooks({module: record(name) for name, module in layers.items()})],
               token_ids=True, **runner.last_logits_only(model, layers.values()))
    unreached = [name for name in layers if name not in ranges]
    if unreached:
        raise ValueError(f"calibration: layers {unreached[:4]}{' ...' if len(unreached) > 4 else ''} received no "
                         f"tokens (MoE experts never routed to?); give more calibration text")
    for name, layer in layers.items():
        low, high = ranges[name]
        if not (torch.isfinite(low) and torch.isfinite(high)):
            raise ValueError(f"calibration: the input of {name} holds NaN or Inf")
        if symmetric:
            layer.set_activations(torch.maximum(-low, high).clamp_min(1e-10).reshape(1) / 127)
        else:
            scale, zero_point = asymmetric_activation_params(low.reshape(1), high.reshape(1))
            layer.set_activations(scale, zero_point, symmetric=False)
    return list(layers)
