"""SmoothQuant's pairs: which op's output channels a scale s divides and which modules' weight columns it multiplies
back, per architecture, and how s folds into them (smoothquant.py, the algorithm, measures and computes s).

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

Explicit pairs (mappings=) apply to every layer that has the producer and all its consumers (so one list
serves models that mix dense and MoE layers), with norm weights scaled as weight / s; a consumer left out while
it reads the producer changes the function, which `SmoothingReport.logit_drift` shows.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from ..nn.experts import expert_weights
from . import calibration as runner

Mapping = Tuple[str, Sequence[str]]

# Pair discovery runs the float model on this many tokens of the first calibration batch (one sequence).
DISCOVERY_TOKENS = 16
# A candidate fold is checked in fp32 with scales exp(U(-1.5, 1.5)), 0.22 .. 4.5: a wrong fold moves what the
# layer adds to its input by a good part of its size, a right one by rounding (~1e-6 of it).
_CHECK_LOG_SCALE = 1.5
_CHECK_TOLERANCE = 1e-4


@dataclass(frozen=True)
class NotSmoothed:
    """Inputs of Linears (routers, experts) that no pair smooths, why, and the decoder layers where that holds."""

    layers: Tuple[int, ...]
    consumers: Tuple[str, ...]
    reason: str


class HeadGroups:
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
class Pair:
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
    def heads(self) -> HeadGroups:
        return HeadGroups(self.groups, self.head_dim)


def input_weight(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The weight whose last dimension runs over the module's input channels."""
    experts = expert_weights(module)
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
    return expert_weights(module) is not None or (isinstance(weight, torch.Tensor) and weight.dim() == 2
                                                   and not isinstance(module, torch.nn.Embedding))


def _producer_channels(module: torch.nn.Module, name: str) -> int:
    experts = expert_weights(module)
    if experts is not None:
        return experts[1].shape[-1]
    if isinstance(module, torch.nn.Linear):
        return module.out_features
    if _is_norm(module):
        return module.weight.numel()
    raise ValueError(f"mappings: producer {name} ({type(module).__name__}) is not a norm with a 1-D weight, a "
                     f"Linear or a fused-experts module")


def _scale_(tensor: torch.Tensor, factor: torch.Tensor, offset: float = 0.0) -> None:
    """(tensor + offset) *= factor (broadcast), computed in fp32 and rounded once to the tensor's dtype."""
    tensor.copy_(((tensor.float() + offset) * factor - offset).to(tensor.dtype))


def scale_shape(pair: Pair, modules: dict) -> Tuple[int, ...]:
    experts = expert_weights(modules[pair.producer])
    if experts is not None:
        return tuple(experts[1].shape[::2])  # [E, I]: one s per expert
    return (input_weight(modules[pair.consumers[0]], pair.consumers[0]).shape[-1] // pair.groups,)


def fold(pair: Pair, modules: dict, scale: torch.Tensor) -> None:
    """Divides the producer's smoothed output channels by scale and multiplies the consumers' columns by it."""
    producer = modules[pair.producer]
    experts = expert_weights(producer)
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
        _scale_(input_weight(modules[name], name), pair.heads.expand(scale))


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
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
                   where: str) -> Pair:
    if expert_weights(modules[producer]) is not None:
        if consumers != (producer,):
            raise ValueError(f"mappings: {where}: fused-experts producer {producer} must be its own only "
                             f"consumer (up half of gate_up_proj -> down_proj), got {list(consumers)}")
        return Pair(producer, consumers)
    produced = _producer_channels(modules[producer], f"{where} {producer}")
    read = {input_weight(modules[name], f"{where} {name}").shape[-1] for name in consumers}
    if len(read) != 1:
        raise ValueError(f"mappings: {where}: consumers {list(consumers)} read different numbers of input "
                         f"channels {sorted(read)}")
    (consumed,) = read
    if consumed == produced:
        return Pair(producer, consumers, head_dim=produced)
    if head_dim and consumed % produced == 0 and produced % head_dim == 0:
        return Pair(producer, consumers, consumed // produced, head_dim)
    raise ValueError(f"mappings: {where}: {producer} makes {produced} channels but {list(consumers)} read "
                     f"{consumed} (not whole repeated heads of head_dim {head_dim})")


def explicit_pairs(model: torch.nn.Module, layers: torch.nn.ModuleList,
                   mappings: Sequence[Mapping]) -> List[List[Pair]]:
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


class _LayerRecord:
    """One decoder layer during the discovery forward: its call (to run it again alone), the outputs of its
    norms and Linears, and the inputs of its Linears, routers and experts, each with its place in call order."""

    def __init__(self, index: int, layer: torch.nn.Module):
        self.index, self.layer, self.modules = index, layer, dict(layer.named_modules())
        self.call, self.input, self.made, self.read, self.clock = None, None, {}, {}, itertools.count()

    def attach(self, handles: list) -> None:
        handles.append(runner.CallRecorder(self.layer, self._record_call))
        for name, module in self.modules.items():
            if name and (_is_norm(module) or isinstance(module, torch.nn.Linear)):
                handles.append(module.register_forward_hook(partial(self._record_output, name)))
            if name and _is_consumer(module):
                handles.append(runner.CallRecorder(module, partial(self._record_input, name)))

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

    def best_fold(candidates: Iterable[Pair]) -> Optional[Pair]:
        return _best_fold(candidates, modules, record.run, reference, bound, generator)

    pairs, why_not = [], {}
    for norm, (_, output) in record.made.items():
        readers = tuple(name for name, (_, read) in record.read.items() if _same_tensor(output, read))
        if not _is_norm(modules[norm]) or not readers:
            continue
        misfits = [name for name in readers if input_weight(modules[name], name).shape[-1] != output.shape[-1]]
        pair = None if misfits else best_fold(Pair(norm, readers, head_dim=output.shape[-1], norm_offset=offset)
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
        is_experts = expert_weights(modules[name]) is not None  # reads a norm's output or nothing foldable
        pair = None if is_experts else best_fold(_linear_candidates(record, name, read_at, kv_groups, head_dim))
        if pair:
            pairs.append(pair)
        elif _same_tensor(record.input, read):
            why_not[name] = "reads the layer input (the residual stream): no norm in front"
        else:
            why_not[name] = "reads no norm's output, and no Linear's output folds into it"
    for name in record.read:  # each expert's up rows -> its down_proj
        if expert_weights(modules[name]) is not None:
            if best_fold([Pair(name, (name,))]):
                pairs.append(Pair(name, (name,)))
            else:
                why_not[f"{name} (down_proj)"] = "act(gate) * up does not fold into the up rows"
    pairs.sort(key=lambda pair: record.read[pair.consumers[0]][0])  # call order, as the layer runs
    return pairs, why_not


def _best_fold(candidates: Iterable[Pair], modules: dict, run: Callable[[], torch.Tensor], reference: torch.Tensor,
               bound: float, generator: torch.Generator) -> Optional[Pair]:
    """The candidate fold that changes run()'s output least under random scales, if that is rounding only (at most
    bound): of two near-homogeneous paths (up -> down, and gate -> down with small gates) the exact one wins. The
    parameters are restored after each try."""
    def change_after_fold(pair: Pair) -> float:
        saved = [(param, param.detach().clone()) for name in {pair.producer, *pair.consumers}
                 for param in modules[name].parameters(recurse=False)]
        scale = torch.empty(scale_shape(pair, modules)).uniform_(-_CHECK_LOG_SCALE, _CHECK_LOG_SCALE,
                                                                  generator=generator).exp()
        try:
            fold(pair, modules, scale)
            change = (run() - reference).abs().max().item()
        finally:
            for param, value in saved:
                param.copy_(value)
        return math.inf if math.isnan(change) else change

    change, pair = min(((change_after_fold(pair), pair) for pair in candidates), key=lambda item: item[0],
                       default=(math.inf, None))
    return pair if change <= bound else None


def run_recorded(model: torch.nn.Module, sample: torch.Tensor, attachers: Iterable[runner.Attacher]) -> None:
    """One forward of the model on sample with the recording hooks of `attachers` (the calibration runner's). Without
    a KV cache: running a layer again must not append to the cache its recorded call holds."""
    no_cache = {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}
    runner.run_batches(model, [sample], attachers, **no_cache)


class OutputPairRecorder:
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

    def pair(self) -> Tuple[Optional[Pair], str]:
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
            candidates = (Pair(producer, (output_name,), head_dim=read.shape[-1], norm_offset=offset)
                          for offset in (0.0, 1.0))  # weight, or Gemma's 1 + weight
            pair = _best_fold(candidates, pair_modules, run, reference,
                              _CHECK_TOLERANCE * reference.abs().max().item(), torch.Generator().manual_seed(0))
        return (pair, "") if pair else (None, f"no fold into {producer} keeps {output_name}'s output")


def _linear_candidates(record: _LayerRecord, consumer: str, read_at: int, kv_groups: int,
                       head_dim: Optional[int]) -> Iterator[Pair]:
    """The Linears that ran before the consumer, each block of their output rows (at a multiple of its width)
    that the consumer could read once (groups 1) or as key/value heads repeated for the query heads."""
    consumed = input_weight(record.modules[consumer], consumer).shape[-1]
    for producer, (made_at, _) in record.made.items():
        module = record.modules[producer]
        if not isinstance(module, torch.nn.Linear) or made_at > read_at:
            continue
        for groups in sorted({1, kv_groups}):
            width = consumed // groups
            if consumed % groups or (groups > 1 and width % head_dim):
                continue
            for first_row in range(0, module.out_features - width + 1, width):
                yield Pair(producer, (consumer,), groups, head_dim if groups > 1 else width, first_row)


def derived_pairs(model: torch.nn.Module, layers: torch.nn.ModuleList, sample: torch.Tensor,
                  more_attachers: List[runner.Attacher]) -> Tuple[List[List[Pair]], Tuple[NotSmoothed, ...]]:
    """The pairs that fold exactly, layer by layer, from one forward of sample (module docstring), and the
    inputs no pair smooths, grouped by reason over the layers. more_attachers: other recording hooks for that forward
    (run_recorded's attachers)."""
    signatures = [_signature(layer) for layer in layers]
    records = {}
    for index, (layer, signature) in enumerate(zip(layers, signatures)):
        records.setdefault(signature, _LayerRecord(index, layer))
    run_recorded(model, sample, [record.attach for record in records.values()] + more_attachers)
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
