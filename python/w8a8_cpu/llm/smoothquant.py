"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before W8A8 quantization.

Per-token int8 activations lose precision when a few input channels are far larger than the rest: one
scale per token serves every channel, so the small channels get few int8 levels. For each smoothed input,
channel j is divided by

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

in the op that produces it and multiplied back into the weight columns of every module that reads it, so
the float model computes the same function while the activation becomes flatter and the (per-output-channel
quantized) weights absorb part of its range. Run it on the float model, before `quantize_model`.

Pairs: (producer, consumers) of module names relative to one decoder layer (an element of the model's `layers`
(or `h`) ModuleList), e.g. ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")).

- producer: a norm whose output is normalized(x) * weight (+ bias), or * (1 + weight) (+ bias) as in Gemma: its
  weight and bias are divided by s (Gemma's: 1 + weight); or a Linear, or a block of its output rows (Phi-3's
  fused qkv_proj: the v rows; gate_up_proj: the up half): those rows and their bias are divided by s, which
  requires the consumers to read them through per-channel positively homogeneous ops only (attention-weighted
  sums of v, act(gate) * up, ReLU); or a fused-experts module named as its own only consumer: per expert e,
  the up half of gate_up_proj is divided by s_e and the columns of down_proj[e] are multiplied by it.
- consumers: every module that reads the producer's output: Linears, modules with a 2-D [out, in] weight
  (MoE routers) and fused-experts modules (gate_up_proj columns). Their weight columns are multiplied by s.
  A consumer may read heads of the producer's output repeated (o_proj after v_proj with grouped-query
  attention: num_attention_heads heads reading num_key_value_heads); one scale is then shared by the
  o_proj channels that read the same v channel, and the statistics are taken over all of them.

By default the pairs are derived from the model itself, not from its name: one short float forward records
which norm's output each Linear, router and experts module reads (the same tensor, or a view of it) and which
Linears ran before it; each candidate fold is then checked by running the layer alone, in fp32, with random
positive scales folded in (its output must stay the same), which also tells a norm's weight convention and
rejects non-homogeneous paths (gate -> down, q -> o). Layers of one structure share the verdict. Inputs no fold
reaches stay as they are and are reported with the reason: OLMo 2 puts its norms after the projections, so
q/k/v and gate/up read the residual stream with no norm in front; GPT-NeoX interleaves q/k/v per head, so
no block of its fused rows is v.

Grouped scales (group_size=G, for int4 weights quantized in groups of G along K): s is constant over each aligned
group of G input channels of every consumer, taken from the group's largest activation and weight absmax. A
consumer's group then scales by one number, so its int4 grid scales with it: a group of values on a grid (SmolLM2's
weights, dequantized from Q4_1) stays on one, and a group's rounding error relative to its range does not change.
Per-channel scales make the columns of a group unequal again; they flatten the activations more, at that cost.

Explicit pairs (mappings=) apply to every layer that has the producer and all its consumers (so one list
serves models that mix dense and MoE layers), with norm weights scaled as weight / s; a consumer left out while
it reads the producer changes the function, which `SmoothingReport.logit_drift` shows.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..nn import ColumnScaledEmbedding, _expert_weights, _is_table_lookup

Mapping = Tuple[str, Sequence[str]]

# Floor of both absmax statistics: keeps s finite and nonzero for dead channels and all-zero weight columns.
_ABSMAX_FLOOR = 1e-5
# Pair discovery runs the float model on this many tokens of the first calibration batch (one sequence).
_DISCOVERY_TOKENS = 16
# A candidate fold is checked in fp32 with scales exp(U(-1.5, 1.5)), 0.22 .. 4.5: a wrong fold moves what the
# layer adds to its input by a good part of its size, a right one by rounding (~1e-6 of it).
_CHECK_LOG_SCALE = 1.5
_CHECK_TOLERANCE = 1e-4
# logit_drift compares the output on this many tokens of the first calibration sequence before and after folding
# (the statistics keep those logits: T x vocab floats, not the whole first batch's).
_DRIFT_TOKENS = 64


@dataclass(frozen=True)
class SmoothedInput:
    """One smoothed activation: outlier ratio = max / median of its per-channel absmax on the calibration
    tokens (for per-expert inputs: the largest ratio over the experts that received tokens)."""

    layer: Optional[int]  # None: the output layer's input (the final norm's output), outside the decoder layers
    producer: str
    consumers: Tuple[str, ...]
    outlier_before: float
    outlier_after: float


@dataclass(frozen=True)
class NotSmoothed:
    """Inputs of Linears (routers, experts) that no pair smooths, why, and the decoder layers where that holds."""

    layers: Tuple[int, ...]
    consumers: Tuple[str, ...]
    reason: str


def _layer_ranges(layers: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> '0-2, 5'."""
    runs: List[List[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


@dataclass(frozen=True)
class SmoothingReport:
    alpha: float
    group_size: Optional[int]  # one s per aligned group of this many input channels; None: per channel
    tokens: int
    discovery_seconds: float  # deriving the pairs (0 with explicit mappings)
    calibration_seconds: float  # forward passes of the float model with the statistics hooks
    total_seconds: float  # discovery + calibration (when measured by this call) + scales + folding + the drift forward
    logit_drift: float  # max |output after - before| / max |output before|, first 64 calibration tokens
    inputs: Tuple[SmoothedInput, ...]
    not_smoothed: Tuple[NotSmoothed, ...]  # derived pairs only; explicit mappings are not analysed
    output_alpha: Optional[float] = None  # the output layer's input smoothed with this alpha (None: not smoothed)

    def __str__(self) -> str:
        grouped = f" in groups of {self.group_size} channels" if self.group_size is not None else ""
        grouped += f", output layer alpha={self.output_alpha}" if self.output_alpha is not None else ""
        lines = [f"SmoothQuant alpha={self.alpha}{grouped}: {self.tokens} calibration tokens, "
                 f"{self.discovery_seconds:.1f} s pair discovery, {self.calibration_seconds:.1f} s calibration, "
                 f"{self.total_seconds:.1f} s total, logit drift {self.logit_drift:.1e}",
                 "layer  outliers (max/median) before -> after  producer -> consumers"]
        lines += [f"{'out' if entry.layer is None else entry.layer:>5}  {entry.outlier_before:17.1f}x -> "
                  f"{entry.outlier_after:6.1f}x    "
                  f"{entry.producer} -> {', '.join(entry.consumers)}" for entry in self.inputs]
        lines += ["not smoothed:"] * bool(self.not_smoothed)
        lines += [f"  layers {_layer_ranges(entry.layers)}: {', '.join(entry.consumers)}: {entry.reason}"
                  for entry in self.not_smoothed]
        return "\n".join(lines)


class _HeadGroups:
    """Maps producer channels to the consumer input channels that read them: consumer channel
    (kv_head * groups + g) * head_dim + d reads producer channel kv_head * head_dim + d (transformers'
    repeat_kv layout); groups = 1 is the identity."""

    def __init__(self, groups: int, head_dim: int):
        self.groups, self.head_dim = groups, head_dim

    def reduce(self, per_consumer_channel: torch.Tensor) -> torch.Tensor:
        """Max over the consumer channels that read each producer channel: [C] -> [P]."""
        return per_consumer_channel.view(-1, self.groups, self.head_dim).amax(dim=1).reshape(-1)

    def expand(self, per_producer_channel: torch.Tensor) -> torch.Tensor:
        """[P] -> [C]: each producer channel's value at every consumer channel that reads it."""
        heads = per_producer_channel.view(-1, 1, self.head_dim)
        return heads.expand(-1, self.groups, self.head_dim).reshape(-1)


@dataclass(frozen=True)
class _Pair:
    """A (producer, consumers) pair relative to a decoder layer and how s folds into it: the consumers read
    `groups` repeated heads of head_dim channels (groups 1: head_dim is every channel), made by the producer's
    output rows from first_row on; a norm producer scales by (norm_offset + weight)."""

    producer: str
    consumers: Tuple[str, ...]
    groups: int = 1
    head_dim: int = 0
    first_row: int = 0
    norm_offset: float = 0.0

    @property
    def heads(self) -> _HeadGroups:
        return _HeadGroups(self.groups, self.head_dim)


def _input_weight(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The weight whose last dimension runs over the module's input channels."""
    experts = _expert_weights(module)
    if experts is not None:
        return experts[0]
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight
    raise ValueError(f"mappings: consumer {name} ({type(module).__name__}) is not a Linear, a module with a "
                     f"2-D [out, in] weight or a fused-experts module")


def _is_norm(module: torch.nn.Module) -> bool:
    """A candidate norm producer: a 1-D weight (RMSNorm, LayerNorm, ...); the fold check tells what it computes."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1


def _is_consumer(module: torch.nn.Module) -> bool:
    """A module whose input a fold can smooth: a 2-D weight (Linear, router) or fused experts."""
    weight = getattr(module, "weight", None)
    return _expert_weights(module) is not None or (isinstance(weight, torch.Tensor) and weight.dim() == 2
                                                   and not isinstance(module, torch.nn.Embedding))


def _producer_channels(module: torch.nn.Module, name: str) -> int:
    experts = _expert_weights(module)
    if experts is not None:
        return experts[1].shape[-1]
    if isinstance(module, torch.nn.Linear):
        return module.out_features
    if _is_norm(module):
        return module.weight.numel()
    raise ValueError(f"mappings: producer {name} ({type(module).__name__}) is not a norm with a 1-D weight, a "
                     f"Linear or a fused-experts module")


def _channel_absmax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()


def _running_max(current: Optional[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
    return new if current is None else torch.maximum(current, new)


def _smoothing_scale(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    return x_absmax.clamp(min=_ABSMAX_FLOOR).pow(alpha) / w_absmax.clamp(min=_ABSMAX_FLOOR).pow(1 - alpha)


def _group_max(per_channel: torch.Tensor, group_size: Optional[int]) -> torch.Tensor:
    """[..., C] -> [..., C]: each aligned group of group_size channels set to its largest value (None: unchanged)."""
    if group_size is None:
        return per_channel
    grouped = per_channel.reshape(*per_channel.shape[:-1], -1, group_size)
    return grouped.amax(dim=-1, keepdim=True).expand_as(grouped).reshape(per_channel.shape)


def _outlier_ratio(absmax_rows: torch.Tensor) -> float:
    """max / median of each row's channel absmax, the largest over rows."""
    medians = absmax_rows.median(dim=-1).values.clamp(min=_ABSMAX_FLOOR)
    return (absmax_rows.amax(dim=-1) / medians).max().item()


def _scale_(tensor: torch.Tensor, factor: torch.Tensor, offset: float = 0.0) -> None:
    """(tensor + offset) *= factor (broadcast), computed in fp32 and rounded once to the tensor's dtype."""
    tensor.copy_(((tensor.float() + offset) * factor - offset).to(tensor.dtype))


def _scale_shape(pair: _Pair, modules: dict) -> Tuple[int, ...]:
    experts = _expert_weights(modules[pair.producer])
    if experts is not None:
        return tuple(experts[1].shape[::2])  # [E, I]: one s per expert
    return (_input_weight(modules[pair.consumers[0]], pair.consumers[0]).shape[-1] // pair.groups,)


def _fold(pair: _Pair, modules: dict, scale: torch.Tensor) -> None:
    """Divides the producer's smoothed output channels by scale and multiplies the consumers' columns by it."""
    producer = modules[pair.producer]
    experts = _expert_weights(producer)
    if experts is not None:
        gate_up, down = experts
        scale = scale.to(down.device)
        _scale_(gate_up[:, gate_up.shape[1] // 2:, :], 1 / scale[:, :, None])
        _scale_(down, scale[:, None, :])
        return
    scale = scale.to(producer.weight.device)
    rows = slice(pair.first_row, pair.first_row + scale.numel())
    if isinstance(producer, torch.nn.Linear):
        _scale_(producer.weight[rows], 1 / scale[:, None])
    else:
        _scale_(producer.weight, 1 / scale, pair.norm_offset)
    if getattr(producer, "bias", None) is not None:
        _scale_(producer.bias[rows], 1 / scale)
    for name in pair.consumers:
        _scale_(_input_weight(modules[name], name), pair.heads.expand(scale))


class _Site:
    """One pair in one decoder layer (layer None: the final norm and the output layer): its calibration statistic,
    then its folding."""

    def __init__(self, layer: Optional[int], pair: _Pair, modules: dict):
        self.layer, self.pair, self.modules = layer, pair, modules
        self.producer = modules[pair.producer]
        self.consumers = [modules[name] for name in pair.consumers]
        self.per_expert = _expert_weights(self.producer) is not None
        self.x_absmax = torch.zeros(_scale_shape(pair, modules)) if self.per_expert else None
        if self.per_expert:
            self.expert_seen = torch.zeros(self.x_absmax.shape[0], dtype=torch.bool)

    def attach(self, handles: list) -> None:
        """Registers the hook that records this site's input statistic; appends its handle to handles."""
        if self.per_expert:
            handles.append(self.producer.register_forward_pre_hook(self._record_expert_inputs))
        else:
            handles.append(self.consumers[0].register_forward_pre_hook(self._record_input))

    def _record_input(self, module, args):
        self.x_absmax = _running_max(self.x_absmax, _channel_absmax(args[0]).cpu())

    def _record_expert_inputs(self, experts, args):
        # down_proj[e] reads act(gate) * up of the tokens routed to e only: recompute it for those tokens.
        hidden, top_k_index = args[0], args[1]
        gate_up = experts.gate_up_proj
        for expert in top_k_index.unique().tolist():
            if expert >= gate_up.shape[0]:  # transformers' placeholder id for tokens routed elsewhere
                continue
            tokens = (top_k_index == expert).any(dim=-1)
            gate, up = torch.nn.functional.linear(hidden[tokens], gate_up[expert]).chunk(2, dim=-1)
            absmax = _channel_absmax(experts.act_fn(gate) * up).cpu()
            self.x_absmax[expert] = torch.maximum(self.x_absmax[expert], absmax)
            self.expert_seen[expert] = True

    def consumer_channels(self) -> int:
        """The input channels of each consumer (the producer's smoothed channels, times the heads' repeats)."""
        return _scale_shape(self.pair, self.modules)[-1] * self.pair.groups

    def check_group_size(self, group_size: int) -> None:
        """A ValueError unless every consumer's aligned groups of group_size input channels read one aligned group
        of the producer's channels (a multiple of group_size channels; with repeated heads, head_dim one too)."""
        channels = self.consumer_channels()
        spans_heads = self.pair.groups > 1 and self.pair.head_dim % group_size
        if channels % group_size or spans_heads:
            raise ValueError(f"group_size: layer {self.layer}: {self.pair.consumers[0]} reads {channels} channels"
                             f"{f' in heads of {self.pair.head_dim}' if self.pair.groups > 1 else ''}, not in "
                             f"whole groups of {group_size}")

    def scales(self, alpha: float, group_size: Optional[int]) -> torch.Tensor:
        """s over the producer's channels ([P], or [E, I] per expert), from the unsmoothed weights; with group_size,
        one s per aligned group of group_size channels."""
        received = self.expert_seen.any().item() if self.per_expert else self.x_absmax is not None
        if not received:
            raise ValueError(f"mappings: layer {self.layer}: {self.pair.consumers[0]} received no calibration "
                             f"tokens")
        if self.per_expert:
            down_columns = _expert_weights(self.producer)[1].detach().abs().amax(dim=1).float().cpu()
            scale = _smoothing_scale(_group_max(self.x_absmax, group_size), _group_max(down_columns, group_size),
                                     alpha)
            scale[~self.expert_seen] = 1.0  # no tokens, no statistic: leave that expert as it is
            return scale
        w_absmax = torch.stack([_channel_absmax(_input_weight(module, name)).cpu()
                                for name, module in zip(self.pair.consumers, self.consumers)]).amax(dim=0)
        heads = self.pair.heads
        return _smoothing_scale(_group_max(heads.reduce(self.x_absmax), group_size),
                                _group_max(heads.reduce(w_absmax), group_size), alpha)

    def fold(self, scale: torch.Tensor) -> SmoothedInput:
        _fold(self.pair, self.modules, scale)
        if self.per_expert:
            seen = self.expert_seen
            before, after = self.x_absmax[seen], self.x_absmax[seen] / scale[seen]
        else:
            before = self.pair.heads.reduce(self.x_absmax)
            after = before / scale
        return SmoothedInput(self.layer, self.pair.producer, self.pair.consumers, _outlier_ratio(before),
                             _outlier_ratio(after))


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rpartition(".")[2] in ("layers", "h"):  # h: Falcon
            return module
    raise ValueError(f"model: {type(model).__name__} has no ModuleList of decoder layers named 'layers' or 'h'")


def _attention_heads(model: torch.nn.Module) -> Tuple[int, Optional[int]]:
    """(query heads per key/value head, head_dim) from the model's config; (1, None) when it names none."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return 1, None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads // (getattr(config, "num_key_value_heads", None) or heads), head_dim


def _explicit_pair(producer: str, consumers: Tuple[str, ...], modules: dict, head_dim: Optional[int],
                   where: str) -> _Pair:
    if _expert_weights(modules[producer]) is not None:
        if consumers != (producer,):
            raise ValueError(f"mappings: {where}: fused-experts producer {producer} must be its own only "
                             f"consumer (up half of gate_up_proj -> down_proj), got {list(consumers)}")
        return _Pair(producer, consumers)
    produced = _producer_channels(modules[producer], f"{where} {producer}")
    read = {_input_weight(modules[name], f"{where} {name}").shape[-1] for name in consumers}
    if len(read) != 1:
        raise ValueError(f"mappings: {where}: consumers {list(consumers)} read different numbers of input "
                         f"channels {sorted(read)}")
    (consumed,) = read
    if consumed == produced:
        return _Pair(producer, consumers, head_dim=produced)
    if head_dim and consumed % produced == 0 and produced % head_dim == 0:
        return _Pair(producer, consumers, consumed // produced, head_dim)
    raise ValueError(f"mappings: {where}: {producer} makes {produced} channels but {list(consumers)} read "
                     f"{consumed} (not whole repeated heads of head_dim {head_dim})")


def _explicit_pairs(model: torch.nn.Module, layers: torch.nn.ModuleList,
                    mappings: Sequence[Mapping]) -> List[List[_Pair]]:
    """The given pairs that apply, layer by layer; one that matches no layer is taken for a misspelt name."""
    mappings = [(producer, tuple(consumers)) for producer, consumers in mappings]
    _, head_dim = _attention_heads(model)
    layer_pairs, used = [], set()
    for index, layer in enumerate(layers):
        modules, pairs = dict(layer.named_modules()), []
        for producer, consumers in mappings:
            if producer not in modules or any(name not in modules for name in consumers):
                continue
            if any(pair.producer == producer for pair in pairs):
                raise ValueError(f"mappings: layer {index}: two pairs apply to producer {producer}; list all "
                                 f"its consumers in one pair")
            used.add((producer, consumers))
            pairs.append(_explicit_pair(producer, consumers, modules, head_dim, f"layer {index}"))
        layer_pairs.append(pairs)
    unused = [pair for pair in mappings if pair not in used]
    if unused or not any(layer_pairs):
        raise ValueError(f"mappings: these pairs match no decoder layer (a producer or consumer name missing "
                         f"there): {unused}")
    return layer_pairs


def _signature(layer: torch.nn.Module) -> tuple:
    """A layer's structure: layers with equal signatures fold the same way."""
    return tuple((name, type(module).__name__, tuple(tuple(p.shape) for p in module.parameters(recurse=False)))
                 for name, module in layer.named_modules())


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values in the same memory: b is a (reshaped) view of a."""
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.shape[-1] == b.shape[-1]


def _first_tensor(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


class _CallRecorder:
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


class _LayerRecord:
    """One decoder layer during the discovery forward: its call (to run it again alone), the outputs of its
    norms and Linears, and the inputs of its Linears, routers and experts, each with its place in call order."""

    def __init__(self, index: int, layer: torch.nn.Module):
        self.index, self.layer, self.modules = index, layer, dict(layer.named_modules())
        self.call, self.input, self.made, self.read, self.clock = None, None, {}, {}, itertools.count()

    def attach(self, handles: list) -> None:
        handles.append(_CallRecorder(self.layer, self._record_call))
        for name, module in self.modules.items():
            if name and (_is_norm(module) or isinstance(module, torch.nn.Linear)):
                handles.append(module.register_forward_hook(partial(self._record_output, name)))
            if name and _is_consumer(module):
                handles.append(_CallRecorder(module, partial(self._record_input, name)))

    def _record_call(self, layer, args, kwargs):
        if self.call is None:
            self.call, self.input = (args, kwargs), args[0] if args else kwargs["hidden_states"]

    def _record_output(self, name, module, args, output):
        if name not in self.made and isinstance(output, torch.Tensor):
            self.made[name] = (next(self.clock), output)

    def _record_input(self, name, module, args, kwargs):
        inputs = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        if name not in self.read and inputs:
            self.read[name] = (next(self.clock), inputs[0])

    def run(self) -> torch.Tensor:
        """The layer's output for its recorded call, in fp32 (see _checked_in_fp32)."""
        args, kwargs = _to_fp32(self.call)
        return _first_tensor(self.layer(*args, **kwargs))


def _to_fp32(value):
    """value with its 16-bit floating tensors (also inside tuples, lists and dicts) in fp32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.element_size() < 4 else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_fp32(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_fp32(item) for key, item in value.items()}
    return value


@contextlib.contextmanager
def _checked_in_fp32(layer: torch.nn.Module):
    """The layer's 16-bit parameters and buffers in fp32 meanwhile, restored exactly after (bf16 and fp16 are
    subsets of fp32): in bf16 the rounding of a right fold (~1e-2) would hide the small error of a wrong one
    (silu(gate / s) * s is nearly silu(gate) for small gates). The layer takes twice its memory meanwhile."""
    tensors = [tensor for tensor in itertools.chain(layer.parameters(), layer.buffers())
               if tensor.is_floating_point() and tensor.element_size() < 4]
    dtypes = [tensor.dtype for tensor in tensors]
    for tensor in tensors:
        tensor.data = tensor.data.float()
    try:
        yield
    finally:
        for tensor, dtype in zip(tensors, dtypes):
            tensor.data = tensor.data.to(dtype)


def _derive_layer(record: _LayerRecord, kv_groups: int, head_dim: Optional[int]):
    """The pairs that fold exactly in one layer, and {consumer: why not} for the inputs none reaches."""
    with _checked_in_fp32(record.layer):
        return _fold_exactly(record, kv_groups, head_dim)


def _fold_exactly(record: _LayerRecord, kv_groups: int, head_dim: Optional[int]):
    modules, generator = record.modules, torch.Generator().manual_seed(0)
    reference = record.run()
    layer_input = _to_fp32(record.input)
    # Relative to what the layer adds to the residual stream, which a tiny random model keeps small.
    update = reference - layer_input if reference.shape == layer_input.shape else reference
    bound = _CHECK_TOLERANCE * update.abs().max().item()

    def best_fold(candidates: Iterable[_Pair]) -> Optional[_Pair]:
        return _best_fold(candidates, modules, record.run, reference, bound, generator)

    pairs, why_not = [], {}
    for norm, (_, output) in record.made.items():
        readers = tuple(name for name, (_, read) in record.read.items() if _same_tensor(output, read))
        if not _is_norm(modules[norm]) or not readers:
            continue
        misfits = [name for name in readers if _input_weight(modules[name], name).shape[-1] != output.shape[-1]]
        pair = None if misfits else best_fold(_Pair(norm, readers, head_dim=output.shape[-1], norm_offset=offset)
                                              for offset in (0.0, 1.0))  # weight, or Gemma's 1 + weight
        if pair:
            pairs.append(pair)
        else:
            why = f"the weight of {', '.join(misfits)} is not [out, in]" if misfits else \
                f"no fold into {norm} keeps the layer's output"
            why_not.update({name: f"reads {norm}'s output, but {why}" for name in readers})
    for name, (read_at, read) in record.read.items():
        if name in why_not or any(name in pair.consumers for pair in pairs):
            continue
        is_experts = _expert_weights(modules[name]) is not None  # reads a norm's output or nothing foldable
        pair = None if is_experts else best_fold(_linear_candidates(record, name, read_at, kv_groups, head_dim))
        if pair:
            pairs.append(pair)
        elif _same_tensor(record.input, read):
            why_not[name] = "reads the layer input (the residual stream): no norm in front"
        else:
            why_not[name] = "reads no norm's output, and no Linear's output folds into it"
    for name in record.read:  # each expert's up rows -> its down_proj
        if _expert_weights(modules[name]) is not None:
            if best_fold([_Pair(name, (name,))]):
                pairs.append(_Pair(name, (name,)))
            else:
                why_not[f"{name} (down_proj)"] = "act(gate) * up does not fold into the up rows"
    pairs.sort(key=lambda pair: record.read[pair.consumers[0]][0])  # call order, as the layer runs
    return pairs, why_not


def _best_fold(candidates: Iterable[_Pair], modules: dict, run: Callable[[], torch.Tensor], reference: torch.Tensor,
               bound: float, generator: torch.Generator) -> Optional[_Pair]:
    """The candidate fold that changes run()'s output least under random scales, if that is rounding only (at most
    bound): of two near-homogeneous paths (up -> down, and gate -> down with small gates) the exact one wins. The
    parameters are restored after each try."""
    def change_after_fold(pair: _Pair) -> float:
        saved = [(param, param.detach().clone()) for name in {pair.producer, *pair.consumers}
                 for param in modules[name].parameters(recurse=False)]
        scale = torch.empty(_scale_shape(pair, modules)).uniform_(-_CHECK_LOG_SCALE, _CHECK_LOG_SCALE,
                                                                  generator=generator).exp()
        try:
            _fold(pair, modules, scale)
            change = (run() - reference).abs().max().item()
        finally:
            for param, value in saved:
                param.copy_(value)
        return math.inf if math.isnan(change) else change

    change, pair = min(((change_after_fold(pair), pair) for pair in candidates), key=lambda item: item[0],
                       default=(math.inf, None))
    return pair if change <= bound else None


@contextlib.contextmanager
def _attached(attachers: Iterable[Callable[[list], None]]):
    """The recording hooks that each of `attachers` attaches (appending each handle to the list it is given as the
    hook is made) for the with block; all removed after, last made first (a forward wrapper restores the forward it
    saw), also when attaching fails partway."""
    handles: list = []
    try:
        for attach in attachers:
            attach(handles)
        yield
    finally:
        for handle in reversed(handles):
            handle.remove()


def _run_recorded(model: torch.nn.Module, sample: torch.Tensor, attachers: Iterable[Callable[[list], None]]) -> None:
    """One forward of the model on sample with the recording hooks of `attachers` (_attached). Without a KV cache:
    running a layer again must not append to the cache its recorded call holds."""
    no_cache = {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}
    with _attached(attachers):
        model(sample, **no_cache)


class _OutputPairRecorder:
    """The fold of the final norm into the output layer (names relative to the model), found as the layer pairs are:
    the norm outside the decoder layers whose output the output layer reads (hooks attached for one forward, the
    pair discovery's when there is one), checked by running the two alone in fp32 with random scales folded in.
    pair() -> (the pair, "") or (None, why not)."""

    def __init__(self, model: torch.nn.Module, layers: torch.nn.ModuleList):
        self.reason, self.seen = "", {}
        get = getattr(model, "get_output_embeddings", None)
        self.output = get() if callable(get) else None
        if not isinstance(self.output, torch.nn.Linear):
            self.reason = "the model's output layer (get_output_embeddings) is not an nn.Linear"
            return
        self.modules = dict(model.named_modules())
        self.output_name = next((name for name, module in self.modules.items() if module is self.output), None)
        if not self.output_name:
            self.reason = "the model's output layer is not one of its submodules"
            return
        in_layers = {id(module) for module in layers.modules()}
        self.norms = {name: module for name, module in self.modules.items()
                      if name and _is_norm(module) and id(module) not in in_layers}

    def attach(self, handles: list) -> None:
        """Hooks recording the norms' inputs and outputs and the output layer's input (none if there is no output
        layer to fold into, `reason`), appended to handles: the caller runs one forward and removes them."""
        if self.reason:
            return

        def record_norm(name, module, args, result):
            if isinstance(result, torch.Tensor) and args:
                self.seen.setdefault(name, (args[0], result))

        for name, module in self.norms.items():
            handles.append(module.register_forward_hook(partial(record_norm, name)))
        handles.append(self.output.register_forward_pre_hook(
            lambda module, args: self.seen.setdefault(self.output_name, args[0])))

    def pair(self) -> Tuple[Optional[_Pair], str]:
        if self.reason:
            return None, self.reason
        output, output_name, seen = self.output, self.output_name, self.seen
        read = seen.get(output_name)
        producer = next((name for name in self.norms if name in seen and read is not None and
                         _same_tensor(seen[name][1], read)), None)
        if producer is None:
            return None, f"{output_name} reads no norm's output"
        if output.in_features != read.shape[-1]:
            return None, f"{output_name} reads {read.shape[-1]} channels, has {output.in_features} inputs"
        pair_modules = {producer: self.modules[producer], output_name: output}
        with _checked_in_fp32(torch.nn.ModuleList(pair_modules.values())):
            norm_input = _to_fp32(seen[producer][0])

            def run() -> torch.Tensor:
                return output(self.modules[producer](norm_input))
            reference = run()
            candidates = (_Pair(producer, (output_name,), head_dim=read.shape[-1], norm_offset=offset)
                          for offset in (0.0, 1.0))  # weight, or Gemma's 1 + weight
            pair = _best_fold(candidates, pair_modules, run, reference,
                              _CHECK_TOLERANCE * reference.abs().max().item(), torch.Generator().manual_seed(0))
        return (pair, "") if pair else (None, f"no fold into {producer} keeps {output_name}'s output")


def _linear_candidates(record: _LayerRecord, consumer: str, read_at: int, kv_groups: int,
                       head_dim: Optional[int]) -> Iterator[_Pair]:
    """The Linears that ran before the consumer, each block of their output rows (at a multiple of its width)
    that the consumer could read once (groups 1) or as key/value heads repeated for the query heads."""
    consumed = _input_weight(record.modules[consumer], consumer).shape[-1]
    for producer, (made_at, _) in record.made.items():
        module = record.modules[producer]
        if not isinstance(module, torch.nn.Linear) or made_at > read_at:
            continue
        for groups in sorted({1, kv_groups}):
            width = consumed // groups
            if consumed % groups or (groups > 1 and width % head_dim):
                continue
            for first_row in range(0, module.out_features - width + 1, width):
                yield _Pair(producer, (consumer,), groups, head_dim if groups > 1 else width, first_row)


def _derived_pairs(model: torch.nn.Module, layers: torch.nn.ModuleList, sample: torch.Tensor,
                   more_attachers: List[Callable[[list], None]]) -> Tuple[List[List[_Pair]], Tuple[NotSmoothed, ...]]:
    """The pairs that fold exactly, layer by layer, from one forward of sample (module docstring), and the
    inputs no pair smooths, grouped by reason over the layers. more_attachers: other recording hooks for that forward
    (_run_recorded's attachers)."""
    signatures = [_signature(layer) for layer in layers]
    records = {}
    for index, (layer, signature) in enumerate(zip(layers, signatures)):
        records.setdefault(signature, _LayerRecord(index, layer))
    _run_recorded(model, sample, [record.attach for record in records.values()] + more_attachers)
    kv_groups, head_dim = _attention_heads(model)
    verdicts = {}
    for signature, record in records.items():
        if record.call is None:
            raise ValueError(f"model: decoder layer {record.index} did not run in a forward of the model")
        verdicts[signature] = _derive_layer(record, kv_groups, head_dim)
    left_out = {}  # (consumers, reason) -> layers
    for index, signature in enumerate(signatures):
        by_reason = {}
        for name, reason in verdicts[signature][1].items():
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            left_out.setdefault((tuple(names), reason), []).append(index)
    not_smoothed = tuple(NotSmoothed(tuple(indices), names, reason)
                         for (names, reason), indices in left_out.items())
    layer_pairs = [verdicts[signature][0] for signature in signatures]
    if not any(layer_pairs):
        found = "; ".join(f"{', '.join(entry.consumers)}: {entry.reason}" for entry in not_smoothed)
        raise ValueError(f"model: no SmoothQuant pair folds exactly into {type(model).__name__} "
                         f"({found or 'no Linear inputs'}); pass mappings=[(producer, [consumers]), ...]")
    return layer_pairs, not_smoothed


def _batches(calibration) -> Iterator[torch.Tensor]:
    for batch in [calibration] if isinstance(calibration, torch.Tensor) else calibration:
        if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.dtype.is_floating_point \
                or batch.numel() == 0:
            raise ValueError(f"calibration: expected non-empty integer token ids [B, T], got "
                             f"{type(batch).__name__} {getattr(batch, 'dtype', '')} "
                             f"{tuple(getattr(batch, 'shape', ()))}")
        yield batch


def _output_tensor(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output.logits if hasattr(output, "logits") else output[0]


class SmoothingStatistics:
    """What smooth_quant measures on a float model before it folds anything: the pairs (and the inputs left out),
    each smoothed input's per-channel absmax over the calibration tokens, and the model's output on the first
    calibration tokens (for logit_drift). calibrate_smoothing returns it; smooth_quant(copy, statistics=...) folds it
    into an unsmoothed copy of the model it was measured on (copy.deepcopy before any smoothing): one calibration for
    several alphas or group sizes (an alpha search, W8A8 and int4 copies of one model). The output layer's input is
    measured too when a norm's output reaches it through a fold (output_site_missing: why not, else "")."""

    def __init__(self, sites: Sequence[_Site], not_smoothed: Tuple[NotSmoothed, ...], layers: int, tokens: int,
                 discovery_seconds: float, calibration_seconds: float, drift_tokens: torch.Tensor,
                 output_before: torch.Tensor, output_site_missing: str):
        self._sites = [(site.layer, site.pair, site.x_absmax,
                        site.expert_seen if site.per_expert else None) for site in sites]
        self.output_site_missing = output_site_missing
        self.not_smoothed, self.layers, self.tokens = not_smoothed, layers, tokens
        self.discovery_seconds, self.calibration_seconds = discovery_seconds, calibration_seconds
        self.drift_tokens, self.output_before = drift_tokens, output_before

    def sites_of(self, model: torch.nn.Module) -> List[_Site]:
        """The measured sites bound to `model`'s modules (the same architecture, names and shapes), else
        ValueError."""
        layers = _decoder_layers(model)
        if len(layers) != self.layers:
            raise ValueError(f"statistics: measured on a model of {self.layers} decoder layers, this one has "
                             f"{len(layers)}")
        sites = []
        for index, pair, x_absmax, expert_seen in self._sites:
            modules = dict((model if index is None else layers[index]).named_modules())
            where = "the model" if index is None else f"layer {index} of this model"
            missing = [name for name in (pair.producer, *pair.consumers) if name not in modules]
            if missing or (index is None and not isinstance(modules[pair.consumers[0]], torch.nn.Linear)):
                raise ValueError(f"statistics: {where} has no {', '.join(missing) or f'Linear {pair.consumers[0]}'}"
                                 f": measured on another architecture (or a quantized model)")
            site = _Site(index, pair, modules)
            shape = tuple(site.x_absmax.shape) if site.per_expert else (site.consumer_channels(),)
            if x_absmax is not None and tuple(x_absmax.shape) != shape:
                raise ValueError(f"statistics: {where}: {pair.consumers[0]} reads {shape} channels here, "
                                 f"{tuple(x_absmax.shape)} where they were measured")
            site.x_absmax = x_absmax
            if expert_seen is not None:
                site.expert_seen = expert_seen
            sites.append(site)
        return sites


@torch.no_grad()
def calibrate_smoothing(model: torch.nn.Module, calibration: Union[torch.Tensor, Iterable[torch.Tensor]],
                        mappings: Optional[Sequence[Mapping]] = None) -> SmoothingStatistics:
    """smooth_quant's measuring half, the model left as it is: the pairs (derived, or mappings), then one float
    forward over the calibration batches with the statistics hooks. See smooth_quant for the arguments."""
    layers = _decoder_layers(model)
    batches = _batches(calibration)
    first_batch = next(batches, None)
    if first_batch is None:
        raise ValueError("calibration: no batches")
    device = next(model.parameters()).device
    first_batch = first_batch.to(device)
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        sample = first_batch[:1, :_DISCOVERY_TOKENS]
        output_recorder = _OutputPairRecorder(model, layers)
        if mappings is None:  # the output layer's input recorded in the same forward
            layer_pairs, not_smoothed = _derived_pairs(model, layers, sample, [output_recorder.attach])
        else:
            layer_pairs, not_smoothed = _explicit_pairs(model, layers, mappings), ()
            if not output_recorder.reason:  # a forward only where there is an output layer to fold into
                _run_recorded(model, sample, [output_recorder.attach])
        output_pair, output_site_missing = output_recorder.pair()
        discovery_seconds = time.perf_counter() - start
        sites = [_Site(index, pair, dict(layers[index].named_modules()))
                 for index, pairs in enumerate(layer_pairs) for pair in pairs]
        if output_pair is not None:
            sites.append(_Site(None, output_pair, dict(model.named_modules())))
        tokens, output_before = 0, None
        with _attached(site.attach for site in sites):
            for batch in itertools.chain([first_batch], batches):
                output = _output_tensor(model(batch.to(device)))
                if output_before is None:  # a causal model: the first positions' logits, whatever follows
                    output_before = output[:1, :_DRIFT_TOKENS].float()
                tokens += batch.numel()
    finally:
        model.train(was_training)
    return SmoothingStatistics(sites, not_smoothed, len(layers), tokens, discovery_seconds,
                               time.perf_counter() - start - discovery_seconds, first_batch[:1, :_DRIFT_TOKENS],
                               output_before, output_site_missing)


@torch.no_grad()
def smooth_quant(model: torch.nn.Module, calibration: Union[torch.Tensor, Iterable[torch.Tensor], None] = None,
                 alpha: float = 0.5, mappings: Optional[Sequence[Mapping]] = None,
                 group_size: Optional[int] = None, statistics: Optional[SmoothingStatistics] = None,
                 output_alpha: Optional[float] = None) -> SmoothingReport:
    """Smooth `model`'s activation outliers into its weights, in place; the float model keeps its function.

    calibration: token ids [B, T] or an iterable of such batches, run through the float model to collect
    each smoothed input's per-channel absmax. alpha in [0, 1]: the share of the outliers moved to the
    weights. mappings: (producer, consumers) pairs relative to a decoder layer (see the module docstring);
    by default derived from the model, on the first 16 tokens of the first batch, and the report lists the
    inputs left as they are (not_smoothed) with why. group_size: one s per aligned group of that many input
    channels (see the module docstring; for int4 weights in groups of that size; every smoothed input must hold
    whole groups, else ValueError before anything changes); None: per channel. Call before quantize_model.
    statistics: instead of calibration (and mappings), what calibrate_smoothing measured on this model before
    any smoothing (or on the model this one is an unsmoothed copy of): no forward passes but logit_drift's.
    output_alpha: also smooth the output layer's input (the final norm's output, which a W8A8 lm_head quantizes per
    token), per channel with this alpha whatever group_size is (an int8 lm_head has one scale per row). When the
    output layer is tied to the token embedding, the shared table's columns are scaled and the embedding becomes a
    ColumnScaledEmbedding that reads them back unscaled: still one table, which quantize_model(...,
    quantize_embedding=True) holds in int8 for both (W8A8Embedding with a column scale). None: left as it is.
    A model whose output layer no fold reaches (no norm in front of it) is a ValueError with output_alpha.

    Statistics: an input read by an MoE block (router, shared expert, all experts) is measured over every
    token reaching the block, because the norm in front of it has one scale per channel for all of them
    and the router and shared expert read every token; down_proj[e]'s input is measured over the tokens
    routed to expert e, since each expert gets its own s_e. Experts without calibration tokens keep s = 1.

    Cost: the pair discovery (a 16-token forward, then each distinct layer structure run alone once per
    candidate fold: tens of single-layer runs on 16 tokens), one float forward over the calibration tokens
    with light hooks (MoE layers also recompute each expert's gate_up for its tokens, about doubling the
    expert work), elementwise folds over the smoothed weights, and one forward of the first 64 tokens to measure
    logit_drift. Returns a SmoothingReport."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: must be in [0, 1], got {alpha}")
    if output_alpha is not None and not 0.0 <= output_alpha <= 1.0:
        raise ValueError(f"output_alpha: must be None or in [0, 1], got {output_alpha}")
    if group_size is not None and (not isinstance(group_size, int) or isinstance(group_size, bool) or
                                   group_size < 1):
        raise ValueError(f"group_size: expected None or an int >= 1, got {group_size!r}")
    if (statistics is None) == (calibration is None):
        raise ValueError("calibration: give calibration token ids or statistics (from calibrate_smoothing), "
                         "one of the two")
    if statistics is not None and mappings is not None:
        raise ValueError("mappings: the statistics hold the pairs they were measured with; pass mappings to "
                         "calibrate_smoothing")
    start = time.perf_counter()
    if statistics is None:
        statistics = calibrate_smoothing(model, calibration, mappings)
    elif not isinstance(statistics, SmoothingStatistics):
        raise ValueError(f"statistics: expected calibrate_smoothing's SmoothingStatistics, got "
                         f"{type(statistics).__name__}")
    sites = statistics.sites_of(model)
    output_site = next((site for site in sites if site.layer is None), None)
    sites = [site for site in sites if site.layer is not None]
    if group_size is not None:
        for site in sites:
            site.check_group_size(group_size)
    embedding = None  # the input embedding tied to the output layer, which gets the inverse column scale
    if output_alpha is not None:
        if output_site is None:
            raise ValueError(f"output_alpha: the output layer cannot be smoothed: {statistics.output_site_missing}")
        embedding = _embedding_tied_to(model, output_site.consumers[0])
    was_training = model.training
    model.eval()
    try:
        # all from the unsmoothed weights: order-independent
        scales = [site.scales(alpha, group_size) for site in sites]
        inputs = tuple(site.fold(scale) for site, scale in zip(sites, scales))
        if output_alpha is not None:
            scale = output_site.scales(output_alpha, None)
            inputs += (output_site.fold(scale),)
            if isinstance(embedding, ColumnScaledEmbedding):  # smoothed before: the scales compose
                embedding.column_scale.copy_(embedding.column_scale / scale)
            elif embedding is not None:
                model.set_input_embeddings(ColumnScaledEmbedding(embedding, 1 / scale))
        output_before = statistics.output_before
        output_after = _output_tensor(model(statistics.drift_tokens.to(output_before.device))).float()
    finally:
        model.train(was_training)
    drift = ((output_after - output_before).abs().max() / output_before.abs().max().clamp(min=1e-30)).item()
    return SmoothingReport(alpha, group_size, statistics.tokens, statistics.discovery_seconds,
                           statistics.calibration_seconds, time.perf_counter() - start, drift, inputs,
                           statistics.not_smoothed, output_alpha)


def _embedding_tied_to(model: torch.nn.Module, output: torch.nn.Linear) -> Optional[torch.nn.Embedding]:
    """The input embedding that shares the output layer's weight (None: not tied), checked to take a column scale
    (ValueError before anything is folded)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if getattr(embedding, "weight", None) is not output.weight:
        return None
    if not isinstance(embedding, torch.nn.Embedding) or not _is_table_lookup(embedding) or \
            embedding.max_norm is not None or not callable(getattr(model, "set_input_embeddings", None)):
        raise ValueError(f"output_alpha: the output layer is tied to {type(embedding).__name__}, which cannot take "
                         f"the inverse column scale (a plain nn.Embedding lookup without max_norm, "
                         f"set_input_embeddings)")
    return embedding

__all__ = ["smooth_quant", "calibrate_smoothing", "SmoothingStatistics", "SmoothingReport", "SmoothedInput",
           "NotSmoothed"]
