"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before W8A8 quantization.

Per-token int8 activations lose precision when a few input channels are far larger than the rest: one
scale per token serves every channel, so the small channels get few int8 levels. For each smoothed input,
channel j is divided by

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

in the op that produces it and multiplied back into the weight columns of every module that reads it, so
the float model computes the same function while the activation becomes flatter and the (per-output-channel
quantized) weights absorb part of its range. Run it on the float model, before `quantize_model`.

Mappings: a sequence of (producer, consumers) pairs of module names relative to one decoder layer (an
element of the model's `layers` ModuleList), e.g. ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")).

- producer: a norm whose output is normalized(x) * weight (+ bias), e.g. RMSNorm or LayerNorm: its weight
  and bias are divided by s; or a Linear: its output rows and bias are divided by s, which requires the
  consumers to read its output through per-channel positively homogeneous ops only (attention-weighted
  sums of v, act(gate) * up, ReLU); or a fused-experts module named as its own only consumer: per expert e,
  the up half of gate_up_proj is divided by s_e and the columns of down_proj[e] are multiplied by it.
- consumers: every module that reads the producer's output: Linears, modules with a 2-D [out, in] weight
  (MoE routers) and fused-experts modules (gate_up_proj columns). Their weight columns are multiplied by s.
  A consumer may read heads of the producer's output repeated (o_proj after v_proj with grouped-query
  attention: num_attention_heads heads reading num_key_value_heads); one scale is then shared by the
  o_proj channels that read the same v channel, and the statistics are taken over all of them.

A pair applies to every layer that has its producer and all its consumers (so one table serves models that
mix dense and MoE layers); a consumer left out while it reads the producer changes the function, which
`SmoothingReport.logit_drift` shows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch

from ..nn import _expert_weights

Mapping = Tuple[str, Sequence[str]]

_ATTENTION: Tuple[Mapping, ...] = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
)
_DENSE_MLP: Tuple[Mapping, ...] = (
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)
# The router reads the same normalized input as the experts: its columns take s too, or routing changes.
_ROUTED_EXPERTS: Tuple[Mapping, ...] = (
    ("post_attention_layernorm", ("mlp.gate", "mlp.experts")),
    ("mlp.experts", ("mlp.experts",)),
)
_SHARED_EXPERT_MOE: Tuple[Mapping, ...] = (
    ("post_attention_layernorm", ("mlp.gate", "mlp.experts", "mlp.shared_expert.gate_proj",
                                  "mlp.shared_expert.up_proj", "mlp.shared_expert_gate")),
    ("mlp.experts", ("mlp.experts",)),
    ("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",)),
)
# Qwen2-MoE and Qwen3-MoE may keep dense MLPs in some layers (mlp_only_layers, decoder_sparse_step).
MAPPINGS = {
    "llama": _ATTENTION + _DENSE_MLP,
    "mistral": _ATTENTION + _DENSE_MLP,
    "qwen2": _ATTENTION + _DENSE_MLP,
    "qwen3": _ATTENTION + _DENSE_MLP,
    "mixtral": _ATTENTION + _ROUTED_EXPERTS,
    "qwen3_moe": _ATTENTION + _DENSE_MLP + _ROUTED_EXPERTS,
    "qwen2_moe": _ATTENTION + _DENSE_MLP + _SHARED_EXPERT_MOE,
}

# Floor of both absmax statistics: keeps s finite and nonzero for dead channels and all-zero weight columns.
_ABSMAX_FLOOR = 1e-5


@dataclass(frozen=True)
class SmoothedInput:
    """One smoothed activation: outlier ratio = max / median of its per-channel absmax on the calibration
    tokens (for per-expert inputs: the largest ratio over the experts that received tokens)."""

    layer: int
    producer: str
    consumers: Tuple[str, ...]
    outlier_before: float
    outlier_after: float


@dataclass(frozen=True)
class SmoothingReport:
    alpha: float
    tokens: int
    calibration_seconds: float  # forward passes of the float model with the statistics hooks
    total_seconds: float  # calibration + scales + folding + the logit_drift forward
    logit_drift: float  # max |output after - before| / max |output before|, first calibration batch
    inputs: Tuple[SmoothedInput, ...]

    def __str__(self) -> str:
        lines = [f"SmoothQuant alpha={self.alpha}: {self.tokens} calibration tokens, "
                 f"{self.calibration_seconds:.1f} s calibration, {self.total_seconds:.1f} s total, "
                 f"logit drift {self.logit_drift:.1e}",
                 "layer  outliers (max/median) before -> after  producer -> consumers"]
        lines += [f"{entry.layer:>5}  {entry.outlier_before:17.1f}x -> {entry.outlier_after:6.1f}x    "
                  f"{entry.producer} -> {', '.join(entry.consumers)}" for entry in self.inputs]
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


def _producer_channels(module: torch.nn.Module, name: str) -> int:
    experts = _expert_weights(module)
    if experts is not None:
        return experts[1].shape[-1]
    if isinstance(module, torch.nn.Linear):
        return module.out_features
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return weight.numel()
    raise ValueError(f"mappings: producer {name} ({type(module).__name__}) is not a norm with a 1-D weight, a "
                     f"Linear or a fused-experts module")


def _channel_absmax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()


def _running_max(current: Optional[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
    return new if current is None else torch.maximum(current, new)


def _smoothing_scale(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    return x_absmax.clamp(min=_ABSMAX_FLOOR).pow(alpha) / w_absmax.clamp(min=_ABSMAX_FLOOR).pow(1 - alpha)


def _outlier_ratio(absmax_rows: torch.Tensor) -> float:
    """max / median of each row's channel absmax, the largest over rows."""
    medians = absmax_rows.median(dim=-1).values.clamp(min=_ABSMAX_FLOOR)
    return (absmax_rows.amax(dim=-1) / medians).max().item()


def _scale_(tensor: torch.Tensor, factor: torch.Tensor) -> None:
    """tensor *= factor (broadcast), computed in fp32 and rounded once to the tensor's dtype."""
    tensor.copy_((tensor.float() * factor).to(tensor.dtype))


class _Site:
    """One (producer, consumers) pair in one decoder layer: its calibration statistic, then its folding."""

    def __init__(self, layer: int, producer_name: str, consumer_names: Tuple[str, ...],
                 modules: dict, head_dim: Optional[int]):
        self.layer, self.producer_name, self.consumer_names = layer, producer_name, consumer_names
        where = f"layer {layer}"
        self.producer = modules[producer_name]
        self.consumers = [modules[name] for name in consumer_names]
        self.per_expert = _expert_weights(self.producer) is not None
        if self.per_expert and consumer_names != (producer_name,):
            raise ValueError(f"mappings: {where}: fused-experts producer {producer_name} must be its own only "
                             f"consumer (up half of gate_up_proj -> down_proj), got {list(consumer_names)}")
        produced = _producer_channels(self.producer, f"{where} {producer_name}")
        if self.per_expert:
            self.x_absmax = torch.zeros(_expert_weights(self.producer)[1].shape[0], produced)
            self.expert_seen = torch.zeros(self.x_absmax.shape[0], dtype=torch.bool)
            return
        read = {_input_weight(module, f"{where} {name}").shape[-1]
                for name, module in zip(consumer_names, self.consumers)}
        if len(read) != 1:
            raise ValueError(f"mappings: {where}: consumers {list(consumer_names)} read different numbers of "
                             f"input channels {sorted(read)}")
        (consumed,) = read
        if consumed == produced:
            self.groups = _HeadGroups(1, produced)
        elif head_dim and consumed % produced == 0 and produced % head_dim == 0:
            self.groups = _HeadGroups(consumed // produced, head_dim)
        else:
            raise ValueError(f"mappings: {where}: {producer_name} makes {produced} channels but "
                             f"{list(consumer_names)} read {consumed} (not whole repeated heads of "
                             f"head_dim {head_dim})")
        self.x_absmax = None

    def attach(self):
        """Registers the hook that records this site's input statistic; returns its handle."""
        if self.per_expert:
            return self.producer.register_forward_pre_hook(self._record_expert_inputs)
        return self.consumers[0].register_forward_pre_hook(self._record_input)

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

    def scales(self, alpha: float) -> torch.Tensor:
        """s over the producer's channels ([P], or [E, I] per expert), from the unsmoothed weights."""
        received = self.expert_seen.any().item() if self.per_expert else self.x_absmax is not None
        if not received:
            raise ValueError(f"mappings: layer {self.layer}: {self.consumer_names[0]} received no calibration "
                             f"tokens")
        if self.per_expert:
            down_columns = _expert_weights(self.producer)[1].detach().abs().amax(dim=1).float().cpu()
            scale = _smoothing_scale(self.x_absmax, down_columns, alpha)
            scale[~self.expert_seen] = 1.0  # no tokens, no statistic: leave that expert as it is
            return scale
        w_absmax = torch.stack([_channel_absmax(_input_weight(module, name)).cpu()
                                for name, module in zip(self.consumer_names, self.consumers)]).amax(dim=0)
        return _smoothing_scale(self.groups.reduce(self.x_absmax), self.groups.reduce(w_absmax), alpha)

    def fold(self, scale: torch.Tensor) -> SmoothedInput:
        """Divides the producer's output channels by scale and multiplies the consumers' columns by it."""
        device = _input_weight(self.consumers[0], self.consumer_names[0]).device
        if self.per_expert:
            gate_up, down = _expert_weights(self.producer)
            up_rows = gate_up[:, gate_up.shape[1] // 2:, :]
            _scale_(up_rows, 1 / scale.to(device)[:, :, None])
            _scale_(down, scale.to(device)[:, None, :])
            seen = self.expert_seen
            before, after = self.x_absmax[seen], self.x_absmax[seen] / scale[seen]
        else:
            producer_factor = (1 / scale).to(device)
            if isinstance(self.producer, torch.nn.Linear):
                _scale_(self.producer.weight, producer_factor[:, None])
            else:
                _scale_(self.producer.weight, producer_factor)
            if getattr(self.producer, "bias", None) is not None:
                _scale_(self.producer.bias, producer_factor)
            consumer_factor = self.groups.expand(scale).to(device)
            for name, module in zip(self.consumer_names, self.consumers):
                _scale_(_input_weight(module, name), consumer_factor)
            before = self.groups.reduce(self.x_absmax)
            after = before / scale
        return SmoothedInput(self.layer, self.producer_name, self.consumer_names,
                             _outlier_ratio(before), _outlier_ratio(after))


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and (name == "layers" or name.endswith(".layers")):
            return module
    raise ValueError(f"model: {type(model).__name__} has no ModuleList of decoder layers named 'layers'")


def _resolve_mappings(model: torch.nn.Module, mappings: Optional[Sequence[Mapping]]) -> Tuple[Mapping, ...]:
    if mappings is not None:
        return tuple((producer, tuple(consumers)) for producer, consumers in mappings)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MAPPINGS:
        raise ValueError(f"model: architecture {model_type!r} has no built-in SmoothQuant mappings (supported: "
                         f"{', '.join(sorted(MAPPINGS))}); pass mappings=[(producer, [consumers]), ...]")
    return MAPPINGS[model_type]


def _sites(model: torch.nn.Module, mappings: Tuple[Mapping, ...], every_pair_used: bool) -> list:
    """The pairs that apply, layer by layer. every_pair_used (explicit mappings): a pair that matches no layer
    is taken for a misspelt name; the built-in tables hold alternatives (dense / MoE layers) instead."""
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads if hasattr(config, "num_attention_heads") else None)
    sites, used = [], set()
    for index, layer in enumerate(_decoder_layers(model)):
        modules = dict(layer.named_modules())
        producers = set()
        for producer, consumers in mappings:
            if producer not in modules or any(name not in modules for name in consumers):
                continue
            if producer in producers:
                raise ValueError(f"mappings: layer {index}: two pairs apply to producer {producer}; list all "
                                 f"its consumers in one pair")
            producers.add(producer)
            used.add((producer, consumers))
            sites.append(_Site(index, producer, consumers, modules, head_dim))
    unused = [pair for pair in mappings if pair not in used]
    if not sites or (every_pair_used and unused):
        raise ValueError(f"mappings: these pairs match no decoder layer (a producer or consumer name missing "
                         f"there): {unused}")
    return sites


def _batches(calibration):
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


@torch.no_grad()
def smooth_quant(model: torch.nn.Module, calibration: Union[torch.Tensor, Iterable[torch.Tensor]],
                 alpha: float = 0.5, mappings: Optional[Sequence[Mapping]] = None) -> SmoothingReport:
    """Smooth `model`'s activation outliers into its weights, in place; the float model keeps its function.

    calibration: token ids [B, T] or an iterable of such batches, run through the float model to collect
    each smoothed input's per-channel absmax. alpha in [0, 1]: the share of the outliers moved to the
    weights. mappings: (producer, consumers) pairs relative to a decoder layer (see the module docstring);
    by default the table for model.config.model_type (MAPPINGS). Call before quantize_model.

    Statistics: an input read by an MoE block (router, shared expert, all experts) is measured over every
    token reaching the block, because the norm in front of it has one scale per channel for all of them
    and the router and shared expert read every token; down_proj[e]'s input is measured over the tokens
    routed to expert e, since each expert gets its own s_e. Experts without calibration tokens keep s = 1.

    Cost: one float forward over the calibration tokens with light hooks (MoE layers also recompute each
    expert's gate_up for its tokens, about doubling the expert work), elementwise folds over the smoothed
    weights, and one forward of the first batch to measure logit_drift. Returns a SmoothingReport."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: must be in [0, 1], got {alpha}")
    sites = _sites(model, _resolve_mappings(model, mappings), every_pair_used=mappings is not None)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        handles = [site.attach() for site in sites]
        tokens, first_batch, output_before = 0, None, None
        try:
            for batch in _batches(calibration):
                output = _output_tensor(model(batch.to(device)))
                if first_batch is None:
                    first_batch, output_before = batch.to(device), output.float()
                tokens += batch.numel()
        finally:
            for handle in handles:
                handle.remove()
        if first_batch is None:
            raise ValueError("calibration: no batches")
        calibration_seconds = time.perf_counter() - start
        scales = [site.scales(alpha) for site in sites]  # all from the unsmoothed weights: order-independent
        inputs = tuple(site.fold(scale) for site, scale in zip(sites, scales))
        output_after = _output_tensor(model(first_batch)).float()
    finally:
        model.train(was_training)
    drift = ((output_after - output_before).abs().max() / output_before.abs().max().clamp(min=1e-30)).item()
    return SmoothingReport(alpha, tokens, calibration_seconds, time.perf_counter() - start, drift, inputs)

__all__ = ["smooth_quant", "SmoothingReport", "SmoothedInput", "MAPPINGS"]
