"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before W8A8 quantization.

Per-token int8 activations lose precision when a few input channels are far larger than the rest: one
scale per token serves every channel, so the small channels get few int8 levels. For each smoothed input,
channel j is divided by

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

in the op that produces it and multiplied back into the weight columns of every module that reads it, so
the float model computes the same function while the activation becomes flatter and the (per-output-channel
quantized) weights absorb part of its range. Run it on the float model, before `quantize_model`.

Which op's output each s divides and which weights it multiplies back (the pairs) is smoothquant_pairs.py's
concern: derived from the model, or given as mappings.

Grouped scales (group_size=G, for int4 weights quantized in groups of G along K): s is constant over each aligned
group of G input channels of every consumer, taken from the group's largest activation and weight absmax. A
consumer's group then scales by one number, so its int4 grid scales with it: a group of values on a grid (SmolLM2's
weights, dequantized from Q4_1) stays on one, and a group's rounding error relative to its range does not change.
Per-channel scales make the columns of a group unequal again; they flatten the activations more, at that cost.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ..nn.embedding import ColumnScaledEmbedding, is_table_lookup
from ..nn.experts import expert_weights
from . import calibration as runner
from .smoothquant_pairs import (DISCOVERY_TOKENS, Mapping, NotSmoothed, OutputPairRecorder, Pair, decoder_layers,
                                derived_pairs, explicit_pairs, fold, input_weight, run_recorded, scale_shape)

# Floor of both absmax statistics: keeps s finite and nonzero for dead channels and all-zero weight columns.
_ABSMAX_FLOOR = 1e-5
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


class _Site:
    """One pair in one decoder layer (layer None: the final norm and the output layer): its calibration statistic,
    then its folding."""

    def __init__(self, layer: Optional[int], pair: Pair, modules: dict):
        self.layer, self.pair, self.modules = layer, pair, modules
        self.producer = modules[pair.producer]
        self.consumers = [modules[name] for name in pair.consumers]
        self.per_expert = expert_weights(self.producer) is not None
        self.x_absmax = torch.zeros(scale_shape(pair, modules)) if self.per_expert else None
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
        return scale_shape(self.pair, self.modules)[-1] * self.pair.groups

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
            down_columns = expert_weights(self.producer)[1].detach().abs().amax(dim=1).float().cpu()
            scale = _smoothing_scale(_group_max(self.x_absmax, group_size), _group_max(down_columns, group_size),
                                     alpha)
            scale[~self.expert_seen] = 1.0  # no tokens, no statistic: leave that expert as it is
            return scale
        w_absmax = torch.stack([_channel_absmax(input_weight(module, name)).cpu()
                                for name, module in zip(self.pair.consumers, self.consumers)]).amax(dim=0)
        heads = self.pair.heads
        return _smoothing_scale(_group_max(heads.reduce(self.x_absmax), group_size),
                                _group_max(heads.reduce(w_absmax), group_size), alpha)

    def fold(self, scale: torch.Tensor) -> SmoothedInput:
        fold(self.pair, self.modules, scale)
        if self.per_expert:
            seen = self.expert_seen
            before, after = self.x_absmax[seen], self.x_absmax[seen] / scale[seen]
        else:
            before = self.pair.heads.reduce(self.x_absmax)
            after = before / scale
        return SmoothedInput(self.layer, self.pair.producer, self.pair.consumers, _outlier_ratio(before),
                             _outlier_ratio(after))


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
        layers = decoder_layers(model)
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


def calibrate_smoothing(model: torch.nn.Module, calibration: Union[torch.Tensor, Iterable[torch.Tensor]],
                        mappings: Optional[Sequence[Mapping]] = None) -> SmoothingStatistics:
    """smooth_quant's measuring half, the model left as it is: the pairs (derived, or mappings), then one float
    forward over the calibration batches with the statistics hooks. See smooth_quant for the arguments."""
    layers = decoder_layers(model)
    batches = runner.batches(calibration, model, token_ids=True)
    first_batch = next(batches)  # (the input rule refuses calibration without batches)
    start = time.perf_counter()
    with runner.measuring(model):
        sample = first_batch[:1, :DISCOVERY_TOKENS]
        output_recorder = OutputPairRecorder(model, layers)
        if mappings is None:  # the output layer's input recorded in the same forward
            layer_pairs, not_smoothed = derived_pairs(model, layers, sample, [output_recorder.attach])
        else:
            layer_pairs, not_smoothed = explicit_pairs(model, layers, mappings), ()
            if not output_recorder.reason:  # a forward only where there is an output layer to fold into
                run_recorded(model, sample, [output_recorder.attach])
        output_pair, output_site_missing = output_recorder.pair()
        discovery_seconds = time.perf_counter() - start
        sites = [_Site(index, pair, dict(layers[index].named_modules()))
                 for index, pairs in enumerate(layer_pairs) for pair in pairs]
        if output_pair is not None:
            sites.append(_Site(None, output_pair, dict(model.named_modules())))
        tokens, outputs_before = [], []

        def count(batch: torch.Tensor, output) -> None:
            if not outputs_before:  # a causal model: the first positions' logits, whatever follows
                outputs_before.append(_output_tensor(output)[:1, :_DRIFT_TOKENS].float())
            tokens.append(batch.numel())

        runner.run_batches(model, itertools.chain([first_batch], batches), [site.attach for site in sites],
                           on_output=count)
    return SmoothingStatistics(sites, not_smoothed, len(layers), sum(tokens), discovery_seconds,
                               time.perf_counter() - start - discovery_seconds, first_batch[:1, :_DRIFT_TOKENS],
                               outputs_before[0], output_site_missing)


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
    if not isinstance(embedding, torch.nn.Embedding) or not is_table_lookup(embedding) or \
            embedding.max_norm is not None or not callable(getattr(model, "set_input_embeddings", None)):
        raise ValueError(f"output_alpha: the output layer is tied to {type(embedding).__name__}, which cannot take "
                         f"the inverse column scale (a plain nn.Embedding lookup without max_norm, "
                         f"set_input_embeddings)")
    return embedding

__all__ = ["smooth_quant", "calibrate_smoothing", "SmoothingStatistics", "SmoothingReport", "SmoothedInput",
           "NotSmoothed"]
