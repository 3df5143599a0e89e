"""The calibration run of quantize_model's GPTQ rounding: each layer's input second moment H = sum of x x^T."""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Union

import torch

Calibration = Union[torch.Tensor, Iterable[torch.Tensor], Callable[[torch.nn.Module], object]]


def _run(model: torch.nn.Module, calibration: Calibration) -> None:
    """Runs the model on the calibration inputs: calibration(model) for a callable, else model(batch) per batch."""
    if callable(calibration):
        calibration(model)
        return
    try:
        batches = [calibration] if isinstance(calibration, torch.Tensor) else iter(calibration)
    except TypeError:
        batches = None
    if batches is None or isinstance(calibration, (str, bytes)):
        raise ValueError(f"calibration: expected model inputs (a tensor, e.g. token ids [B, T]), an iterable of them, "
                         f"or a callable(model) that runs the model, got {type(calibration).__name__}")
    count = 0
    for batch in batches:
        if not isinstance(batch, torch.Tensor) or batch.numel() == 0:
            raise ValueError(f"calibration: batch {count}: expected a non-empty tensor of model inputs, got "
                             f"{type(batch).__name__} {tuple(getattr(batch, 'shape', ()))}")
        model(batch)
        count += 1
    if count == 0:
        raise ValueError("calibration: no batches")


def hessians(model: torch.nn.Module, layers: Dict[torch.nn.Linear, str],
             calibration: Calibration) -> Dict[torch.nn.Linear, torch.Tensor]:
    """{layer: fp32 [K, K] sum of x x^T over every row x of its inputs} from one run of the float model (eval mode,
    no gradient) on the calibration inputs. layers: the nn.Linear layers to measure, each with its name (for errors).
    Every layer is measured on the float model's activations (not on the outputs of layers already rounded): one run
    for the whole model, any architecture."""
    sums: Dict[torch.nn.Linear, torch.Tensor] = {}

    def record(module: torch.nn.Linear, args) -> None:
        x = args[0].detach().reshape(-1, module.in_features).to(torch.float32)
        moment = x.T @ x
        sums[module] = moment if module not in sums else sums[module] + moment  # not in place: an inference tensor

    handles = [layer.register_forward_pre_hook(record) for layer in layers]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _run(model, calibration)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    for layer, name in layers.items():
        if layer not in sums:
            raise ValueError(f"calibration: the run never reached {name} (no inputs to round its weights for)")
        if not torch.isfinite(sums[layer]).all():
            raise ValueError(f"calibration: the inputs of {name} contain NaN or Inf")
    return sums
