"""The calibration runner: how every algorithm here measures a model on calibration inputs. GPTQ's second moments
(gptq_layers.py), SmoothQuant's pair discovery and statistics (smoothquant_pairs.py, smoothquant.py) and static
activation ranges (static_activations.py) all run the model through it: one input rule (batches) and one hook
mechanism (attachers, attached for the run and removed after, whatever happens)."""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Dict, Iterable, Iterator, Optional, Union

import torch

Calibration = Union[torch.Tensor, Iterable[torch.Tensor], Callable[[torch.nn.Module], object]]
# Attaches recording hooks to a model, appending each handle (anything with remove()) to the list it is given as the
# hook is made: attached() then removes exactly what was attached, also when attaching fails partway.
Attacher = Callable[[list], None]


class Refused(ValueError):
    """A recording hook's own refusal, raised inside the model's forward: passed on as it is, not as the model's
    failure to run a batch."""


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


def batches(calibration: Calibration, model: torch.nn.Module, token_ids: bool = False) -> Iterator[torch.Tensor]:
    """The input rule: calibration is one batch (a tensor) or an iterable of them, each a non-empty tensor of model
    inputs, moved to the model's device; integer batches of a model with config.vocab_size are token ids in
    [0, vocab_size). token_ids: each batch must be integer token ids [B, T] (a caller that slices sequences out of
    them). ValueError naming `calibration` (and the batch) otherwise, or when there is none. A callable(model) is
    run's alternative to batches, not one of them."""
    rule = "non-empty integer token ids [B, T]" if token_ids else "a non-empty tensor of model inputs"
    try:
        items = [calibration] if isinstance(calibration, torch.Tensor) else iter(calibration)
    except TypeError:
        items = None
    if items is None or isinstance(calibration, (str, bytes)):
        raise ValueError(f"calibration: expected model inputs (a tensor, e.g. token ids [B, T]), an iterable of them"
                         f"{'' if token_ids else ', or a callable(model) that runs the model'}, got "
                         f"{type(calibration).__name__}")
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    device = _device(model)
    count = 0
    for batch in items:
        if not isinstance(batch, torch.Tensor) or batch.numel() == 0 or \
                (token_ids and (batch.dim() != 2 or batch.is_floating_point() or batch.is_complex())):
            raise ValueError(f"calibration: batch {count}: expected {rule}, got {type(batch).__name__} "
                             f"{getattr(batch, 'dtype', '')} {tuple(getattr(batch, 'shape', ()))}")
        if isinstance(vocab_size, int) and not batch.is_floating_point() and not batch.is_complex():
            _check_token_ids(batch, count, vocab_size)  # token ids of a language model (config.vocab_size)
        yield batch.to(device)
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


@contextlib.contextmanager
def attached(attachers: Iterable[Attacher]):
    """The recording hooks that each of `attachers` attaches for the with block; all removed after, last made first
    (a forward wrapper restores the forward it saw), also when attaching fails partway."""
    handles: list = []
    try:
        for attach in attachers:
            attach(handles)
        yield
    finally:
        for handle in reversed(handles):
            handle.remove()


def pre_hooks(hooks: Dict[torch.nn.Module, Callable]) -> Attacher:
    """An attacher of forward pre-hooks: hook(module, args) before each call of its module."""
    def attach(handles: list) -> None:
        for module, hook in hooks.items():
            handles.append(module.register_forward_pre_hook(hook))
    return attach


class CallRecorder:
    """Calls record(module, args, kwargs) before each call of module.forward, on every torch version (forward
    pre-hooks see keyword arguments from torch 2.0 only): wraps the instance's forward; remove() restores it."""

    def __init__(self, module: torch.nn.Module, record):
        self.module, self.own = module, module.__dict__.get("forward")
        forward = module.forward

        def recording(*args, **kwargs):
            record(module, args, kwargs)
            return forward(*args, **kwargs)
        module.forward = recording

    def remove(self) -> None:
        if self.own is None:
            del self.module.forward
        else:
            self.module.forward = self.own


@contextlib.contextmanager
def measuring(model: torch.nn.Module):
    """The model in eval mode without gradients for the with block, its training mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def run_batches(model: torch.nn.Module, checked: Iterable[torch.Tensor], attachers: Iterable[Attacher] = (),
                on_output: Optional[Callable[[torch.Tensor, object], None]] = None, **options) -> None:
    """model(batch, **options) for each batch of `checked` (from batches()) with the hooks of `attachers` attached;
    on_output(batch, output) after each. A batch the model cannot run is a ValueError naming it (a hook's Refused
    passes as it is)."""
    with attached(attachers):
        for index, batch in enumerate(checked):
            try:
                output = model(batch, **options)
            except Refused:
                raise
            except Exception as error:  # the model's own error (a shape it cannot take), which names no batch
                message = str(error)  # (bounded: a model's message may quote a whole tensor)
                raise ValueError(f"calibration: batch {index}: the model cannot run it: {type(error).__name__}: "
                                 f"{message[:500]}{'...' if len(message) > 500 else ''}") from error
            if on_output is not None:
                on_output(batch, output)


def run(model: torch.nn.Module, calibration: Calibration, attachers: Iterable[Attacher], token_ids: bool = False,
        **options) -> None:
    """One measuring run (eval mode, no gradient) of the model with the hooks of `attachers` attached:
    calibration(model) for a callable (unless token_ids), else model(batch, **options) per batch of the input rule
    (batches)."""
    with measuring(model):
        if callable(calibration) and not token_ids:
            with attached(attachers):
                calibration(model)
        else:
            run_batches(model, batches(calibration, model, token_ids), attachers, **options)


def last_logits_only(model: torch.nn.Module, recorded: Iterable[torch.nn.Module]) -> dict:
    """model(batch)'s extra options for a run whose hooks record only the inputs of the `recorded` modules: a
    transformers causal LM whose output layer is not among them computes the logits of each batch's last position
    only (logits_to_keep=1), since no recorded module reads them: the output layer was a third of SmolLM2's GPTQ
    calibration run (its 49152-row GEMM over every position), and the recorded inputs are the same either way."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):  # not a transformers model, or one without an output layer
        head = None
    if head is None or any(module is head for module in recorded):
        return {}
    try:
        takes = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature to read: run it plainly
        takes = False
    return {"logits_to_keep": 1} if takes else {}
