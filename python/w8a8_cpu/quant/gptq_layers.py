"""quantize_model's GPTQ rounding: one run of the float model on the calibration inputs records each int4 layer's
input second moment H = sum of x x^T; then quantize_weight_int4 rounds each layer with it."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import calibration as runner
from .calibration import Calibration
from .weights import quantize_weight_int4

Int4Values = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def second_moments(model: torch.nn.Module, layers: Dict[torch.nn.Linear, str],
                   calibration: Calibration) -> List[Tuple[torch.Tensor, List[torch.nn.Linear]]]:
    """Runs the float model (eval mode, no gradient) on the calibration inputs, recording for the given nn.Linear
    layers (each with its name, for errors) the fp32 [K, K] sum of x x^T over every row x of their inputs. Layers
    called one after the other on the same input tensor (q/k/v, gate/up) share one sum: -> [(sum, [its layers])], in
    the order the run first reached them. Every layer is measured on the float model's activations, not on the
    outputs of layers already rounded: one run serves the whole model, whatever its architecture."""
    sums: Dict[torch.nn.Linear, torch.Tensor] = {}  # by the first layer that read the input
    leader: Dict[torch.nn.Linear, torch.nn.Linear] = {}
    previous: list = [None, None]  # (input tensor, its leader) of the last recorded call; holds the tensor alive

    def record(module: torch.nn.Linear, args) -> None:
        x = args[0]
        same_input = x is previous[0]
        if module not in leader:
            leader[module] = previous[1] if same_input else module
        elif leader[module] is not module and not (same_input and previous[1] is leader[module]):
            raise runner.Refused(f"calibration: {layers[module]} read the input of {layers[leader[module]]} in one "
                                 f"model call but not in another (one second moment cannot serve both)")
        previous[:] = x, leader[module]
        if leader[module] is module:
            rows = x.detach().reshape(-1, module.in_features).to(torch.float32)
            moment = rows.T @ rows
            sums[module] = moment if module not in sums else sums[module] + moment  # not in place: an inference tensor

    try:
        runner.run(model, calibration, [runner.pre_hooks({layer: record for layer in layers})],
                   **runner.last_logits_only(model, layers))
    finally:
        previous.clear()
    for layer, name in layers.items():
        if layer not in leader:
            raise ValueError(f"calibration: the run never reached {name} (no inputs to round its weights for)")
    sharing: Dict[torch.nn.Linear, List[torch.nn.Linear]] = {}
    for layer, first in leader.items():
        sharing.setdefault(first, []).append(layer)
    for first in sharing:
        if not torch.isfinite(sums[first]).all():
            raise ValueError(f"calibration: the inputs of {layers[first]} contain NaN or Inf")
    return [(sums[first], readers) for first, readers in sharing.items()]


def round_with_gptq(model: torch.nn.Module, layers: Dict[torch.nn.Linear, str], calibration: Calibration,
                    group_size: int, symmetric: bool, min_max: bool,
                    on_layer: Optional[Callable[[int, int], None]] = None) -> Dict[torch.nn.Linear, Int4Values]:
    """{layer: (q, scale, minimum)} of quantize_weight_int4 with each layer's calibration second moment (GPTQ). Layers
    sharing an input are rounded as one matrix of their rows side by side (GPTQ treats rows independently, so this is
    each layer's own result, at one factorization and one column loop for all of them). on_layer(i, n) after each
    layer is done."""
    values: Dict[torch.nn.Linear, Int4Values] = {}
    pending = second_moments(model, layers, calibration)[::-1]
    while pending:
        hessian, readers = pending.pop()  # dropped once used: the sums of a large model take much memory
        weights = torch.cat([layer.weight.detach().to(torch.float32) for layer in readers])
        q, scale, minimum = quantize_weight_int4(weights, group_size, symmetric, min_max, hessian)
        begin = 0
        for layer in readers:
            rows = slice(begin, begin + layer.out_features)
            values[layer] = q[rows], scale[rows], None if minimum is None else minimum[rows]
            begin = rows.stop
            if on_layer is not None:
                on_layer(len(values), len(layers))
    return values
