"""quantize_model's GPTQ rounding: one run of the float model on the calibration inputs records each int4 layer's
input second moment H = sum of x x^T; then quantize_weight_int4 rounds each layer with it."""
from __future__ import annotations

import inspect
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .._functions import quantize_weight_int4

Calibration = Union[torch.Tensor, Iterable[torch.Tensor], Callable[[torch.nn.Module], object]]
Int4Values = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def _run(model: torch.nn.Module, calibration: Calibration, **options) -> None:
    """Runs the model on the calibration inputs: calibration(model) for a callable, else model(batch, **options) per
    batch."""
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
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    count = 0
    for batch in batches:
        if not isinstance(batch, torch.Tensor) or batch.numel() == 0:
            raise ValueError(f"calibration: batch {count}: expected a non-empty tensor of model inputs, got "
                             f"{type(batch).__name__} {tuple(getattr(batch, 'shape', ()))}")
        if isinstance(vocab_size, int) and not batch.is_floating_point() and not batch.is_complex():
            _check_token_ids(batch, count, vocab_size)  # token ids of a language model (config.vocab_size)
        try:
            model(batch, **options)
        except _Refused:
            raise
        except Exception as error:  # the model's own error (a shape it cannot take), which names no batch
            message = str(error)  # (bounded: a model's message may quote a whole tensor)
            raise ValueError(f"calibration: batch {count}: the model cannot run it: {type(error).__name__}: "
                             f"{message[:500]}{'...' if len(message) > 500 else ''}") from error
        count += 1
    if count == 0:
        raise ValueError("calibration: no batches")


def _check_token_ids(batch: torch.Tensor, index: int, vocab_size: int) -> None:
    """Integer batches of a model with config.vocab_size are token ids in [0, vocab_size): ids past the table failed
    deep in the embedding, as an IndexError that named neither the batch nor the argument. (Float batches are left
    to the model: some with a vocab_size take float inputs, e.g. a CTC head's; one that cannot run them fails as a
    ValueError naming the batch.)"""
    low, high = int(batch.min()), int(batch.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"calibration: batch {index}: token ids must be in [0, {vocab_size}) (config.vocab_size), "
                         f"got [{low}, {high}]")


class _Refused(ValueError):
    """second_moments' own refusal, raised by its hook inside the model's forward: passed on as it is, not as the
    model's failure to run a batch."""


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
            raise _Refused(f"calibration: {layers[module]} read the input of {layers[leader[module]]} in one model "
                             f"call but not in another (one second moment cannot serve both)")
        previous[:] = x, leader[module]
        if leader[module] is module:
            rows = x.detach().reshape(-1, module.in_features).to(torch.float32)
            moment = rows.T @ rows
            sums[module] = moment if module not in sums else sums[module] + moment  # not in place: an inference tensor

    handles = [layer.register_forward_pre_hook(record) for layer in layers]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _run(model, calibration, **_last_logits_only(model, layers))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
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


def _last_logits_only(model: torch.nn.Module, layers: Dict[torch.nn.Linear, str]) -> dict:
    """model(batch)'s extra options for a run that records `layers`: a transformers causal LM whose output layer is
    not among them computes the logits of each batch's last position only (logits_to_keep=1), since no recorded
    layer reads them: the output layer was a third of SmolLM2's calibration run (its 49152-row GEMM over every
    position), and the layers' inputs are the same either way."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):  # not a transformers model, or one without an output layer
        head = None
    if head is None or head in layers:
        return {}
    try:
        takes = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature to read: run it plainly
        takes = False
    return {"logits_to_keep": 1} if takes else {}


def gptq_int4(model: torch.nn.Module, layers: Dict[torch.nn.Linear, str], calibration: Calibration, group_size: int,
              symmetric: bool, min_max: bool, on_layer: Optional[Callable[[int, int], None]] = None
              ) -> Dict[torch.nn.Linear, Int4Values]:
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
