"""Tensor-parallel W8A8 over torch.distributed (gloo on CPU; the same code runs under torchrun across hosts).

    group = w8a8_cpu.distributed.init(timeout_s=60)      # env:// (torchrun), gloo, a process-group timeout
    report = w8a8_cpu.distributed.shard_model(model)     # a model quantized by quantize_model / load_quantized
    model, report = w8a8_cpu.distributed.load_sharded(directory)  # a W8A8 checkpoint, each rank reading its part

Megatron-style split of each decoder layer: q/k/v and gate/up column-parallel (each rank keeps its rows: its heads,
its slice of the intermediate size), o_proj and down_proj row-parallel (each rank keeps the matching K columns),
MoE experts split across ranks (expert parallel). Embeddings, norms, routers and lm_head are replicated.

Exactness: a row-parallel layer quantizes each token over the whole K, which is spread across ranks. The row absmax
is reduced first (all-reduce MAX of M floats), each rank quantizes its slice with that shared scale, the int32 partial
products are summed exactly (all-reduce SUM of int32) and the fp32 epilogue runs once: the output is bit-identical to
the unsharded layer for any world size. The MoE combine keeps one process's float summation order: each rank computes
the (token, slot) outputs of its experts, one all-reduce fills in every slot (each slot has exactly one non-zero
contributor, so the sum is exact), and the slots are added in order as fused_experts adds them.
exact=False selects the usual scheme for comparison: per-rank scales and one fp32 all-reduce of partial outputs."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._functions import fused_experts, int8_mm, int8_scaled_mm_with_quant, per_token_quant_int8, scale_accumulators
from ..nn import W8A8Experts, W8A8Linear
from ..nn.experts import expert_weights
from ..nn.transform import replace_module
from .agreement import (agree, agree_on_replicated_tensors, agree_on_sharding, check_same_weights, require_same,
                        require_same_rows, same_input_hook, weight_checksums)
from .process_group import STATS, CommStats, RankFailure, all_reduce, finish, init


def _split(total: int, parts: int, rank: int, what: str) -> slice:
    if total % parts:
        raise ValueError(f"world size {parts} does not divide {what} ({total}); choose a world size that divides it")
    size = total // parts
    return slice(rank * size, (rank + 1) * size)


@dataclass(frozen=True)
class LinearShard:
    """This rank's part of one W8A8 Linear layer [N, K]. Column-parallel keeps the output channels `part` (weight
    rows, their scales and bias): the input is replicated and quantized over its whole K on every rank, so those
    output columns are bit-identical to the unsharded layer's. Row-parallel keeps the input columns `part` (scales
    and bias whole) and becomes a RowParallelW8A8Linear."""
    parallel: str  # "column" or "row"
    part: slice
    name: str
    exact: bool = True
    group: object = None

    @property
    def weight_index(self) -> tuple:
        """Index of this rank's part of the int8 [N, K] weight."""
        return (self.part,) if self.parallel == "column" else (slice(None), self.part)

    @property
    def channel_index(self) -> slice:
        """Index of this rank's part of the per-output-channel scales and bias."""
        return self.part if self.parallel == "column" else slice(None)

    def build(self, weight: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.nn.Module:
        """The sharded layer from this rank's tensors (the layer's, indexed by weight_index / channel_index)."""
        local = W8A8Linear(weight, w_scale, bias)
        return local if self.parallel == "column" else RowParallelW8A8Linear(local, self.name, self.exact, self.group)

    def of(self, layer: W8A8Linear) -> torch.nn.Module:
        """The sharded layer cut from a whole one."""
        if layer.activation_scheme != "token":
            raise ValueError(f"model: {self.name} has {layer.activation_scheme!r} activations; shard_model splits "
                             f"layers with dynamic per-token symmetric ('token') activations only")
        bias = None if layer.bias is None else layer.bias[self.channel_index]
        return self.build(layer.int8_weight()[self.weight_index], layer.w_scale[self.channel_index], bias)


@dataclass(frozen=True)
class ExpertShard:
    """This rank's experts `part` of a W8A8Experts module of `num_experts`."""
    part: slice
    num_experts: int
    name: str
    exact: bool = True
    group: object = None

    def build(self, local: W8A8Experts) -> "ExpertParallelW8A8Experts":
        """The expert-parallel module from this rank's experts."""
        return ExpertParallelW8A8Experts(local, self.part.start, self.num_experts, self.name, self.exact, self.group)

    def of(self, layer: W8A8Experts) -> "ExpertParallelW8A8Experts":
        """The expert-parallel module cut from a whole W8A8Experts."""
        w13, w2 = layer.int8_weights(self.part)  # this rank's experts only
        return self.build(W8A8Experts(w13, layer.w13_scale[self.part], w2, layer.w2_scale[self.part]))


def column_parallel(layer: W8A8Linear, rows: slice) -> W8A8Linear:
    """The output channels `rows` of `layer`, as a W8A8Linear (bit-identical to those columns of its output)."""
    return LinearShard("column", rows, "").of(layer)


def row_parallel(layer: W8A8Linear, cols: slice, name: str, exact: bool = True, group=None) -> "RowParallelW8A8Linear":
    """The input columns `cols` of `layer`, as a RowParallelW8A8Linear."""
    return LinearShard("row", cols, name, exact, group).of(layer)


class RowParallelW8A8Linear(torch.nn.Module):
    """This rank's input columns of a W8A8Linear (`local`: int8 weight [N, K / world size], the whole layer's
    scales and bias); forward takes this rank's K-slice of the input and returns the full output on every rank
    (see the module doc: exact=True is bit-identical to the unsharded layer). Every rank passes the same rows, each
    its own K-slice: on its own, each call compares the ranks' input shapes first (one small all-gather; a row count
    that differed aborted a rank inside gloo); in a model sharded by shard_model / load_sharded the model's input
    check covers it (inputs_agreed)."""

    def __init__(self, local: W8A8Linear, name: str, exact: bool = True, group=None):
        super().__init__()
        self.name, self.exact, self.group = name, exact, group
        self.out_features, self.in_features = local.out_features, local.in_features
        self.rank = dist.get_rank(group)
        self.inputs_agreed = False
        self.register_buffer("weight_packed", local.weight_packed)
        self.register_buffer("w_scale", local.w_scale)
        self.register_buffer("bias", local.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inputs_agreed:
            require_same_rows(x, self.in_features, self.name, self.group)
        x2 = x.reshape(-1, x.shape[-1])
        if self.exact:
            # a NaN row absmax as +Inf: gloo's MAX keeps or drops NaN by operand order (a NaN on one rank gave every
            # rank a finite row), Inf survives it and marks the row non-finite on every rank (per_token_quant_int8)
            row_amax = x2.abs().amax(dim=-1).float()
            row_amax.masked_fill_(row_amax.isnan(), math.inf)
            amax = all_reduce(row_amax, dist.ReduceOp.MAX, f"{self.name}: row absmax", self.group)
            x_q, x_scale = per_token_quant_int8(x2, amax)
            acc = all_reduce(int8_mm(x_q, self.weight_packed), dist.ReduceOp.SUM, f"{self.name}: int32 partial sums",
                             self.group)
            out = scale_accumulators(acc, x_scale, self.w_scale, self.bias, x.dtype)
        else:
            bias = self.bias if self.rank == 0 else None  # added once
            out = all_reduce(int8_scaled_mm_with_quant(x2, self.weight_packed, self.w_scale, bias, torch.float32),
                             dist.ReduceOp.SUM, f"{self.name}: fp32 partial outputs", self.group).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (slice), out_features={self.out_features}, exact={self.exact}"


class ExpertParallelW8A8Experts(torch.nn.Module):
    """This rank's experts (`local`, experts first_expert.. of num_experts) of a W8A8Experts; forward(hidden [T, H],
    top_k_index [T, k], top_k_weights [T, k]) returns the full MoE output on every rank (exact=True: bit-identical
    to the unsharded module). Every rank passes the same inputs: on its own, each call compares them first (shape
    and crc32, one small all-gather); in a model sharded by shard_model / load_sharded the model's input check covers
    it (inputs_agreed)."""

    def __init__(self, local: W8A8Experts, first_expert: int, num_experts: int, name: str, exact: bool = True,
                 group=None):
        super().__init__()
        self.name, self.exact, self.group = name, exact, group
        self.first_expert, self.num_experts, self.local = first_expert, num_experts, local
        self.inputs_agreed = False

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if not self.inputs_agreed:
            require_same({"hidden_states": hidden_states, "top_k_index": top_k_index, "top_k_weights": top_k_weights},
                         "MoE input", "every rank must pass the same tokens and routing", self.group)
        _check_expert_ids(top_k_index, self.num_experts)
        tokens, top_k = top_k_index.shape
        local_ids = top_k_index - self.first_expert
        token, slot = ((local_ids >= 0) & (local_ids < self.local.num_experts)).nonzero(as_tuple=True)
        # fp32 slots: fused_experts quantizes bf16 and fp32 inputs alike, and adds the slots in fp32 before one cast
        slots = torch.zeros(tokens, top_k, hidden_states.shape[-1], dtype=torch.float32)
        if token.numel():
            slots[token, slot] = fused_experts(
                hidden_states[token].float(), self.local.w13_packed, self.local.w2_packed,
                top_k_weights[token, slot].float().unsqueeze(1), local_ids[token, slot].unsqueeze(1),
                self.local.w13_scale, self.local.w2_scale)
        if not self.exact:
            return all_reduce(slots.sum(dim=1), dist.ReduceOp.SUM, f"{self.name}: fp32 partial outputs",
                              self.group).to(hidden_states.dtype)
        all_reduce(slots, dist.ReduceOp.SUM, f"{self.name}: per-slot outputs", self.group)
        out = torch.zeros(tokens, hidden_states.shape[-1], dtype=torch.float32)
        for k in range(top_k):  # fused_experts' order: 0 + slot 0 + slot 1 + ...
            out = out + slots[:, k]
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.local.num_experts - 1} of "
                f"{self.num_experts}, exact={self.exact}")


def _check_expert_ids(top_k_index: torch.Tensor, num_experts: int) -> None:
    """fused_experts' rule on the whole model's ids: each rank keeps the ids of its experts, so an id outside every
    rank's range was dropped on all of them (its slot added 0, silently)."""
    bad = (top_k_index < 0) | (top_k_index >= num_experts)
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"top_k_index: value {int(top_k_index[tuple(where)])} at {where} is outside "
                         f"[0, {num_experts})")


def _sharded_forward_checks(model: torch.nn.Module, group) -> None:
    """The model's input compared across ranks once per forward; its sharded modules then skip their own comparison
    (what they are given follows from that input and the weights, which are compared when sharding)."""
    model.register_forward_pre_hook(same_input_hook(group), with_kwargs=True)
    for module in model.modules():
        if isinstance(module, (RowParallelW8A8Linear, ExpertParallelW8A8Experts)):
            module.inputs_agreed = True


# ---- whole models ----------------------------------------------------------------------------------------------

@dataclass
class ShardReport:
    world_size: int
    attention: str  # "sharded" or "replicated"
    layers: Dict[str, str] = field(default_factory=dict)  # module name -> how it was split
    notes: List[str] = field(default_factory=list)


def _attention_split(config, world_size: int, attention: str) -> Tuple[bool, Optional[str]]:
    heads, kv_heads = (getattr(config, f, None) for f in ("num_attention_heads", "num_key_value_heads"))
    if not all(isinstance(h, int) and h > 0 for h in (heads, kv_heads)):
        raise ValueError("model: its config needs positive integers num_attention_heads and num_key_value_heads "
                         "(Llama / Qwen2 / Mixtral / Qwen2-MoE family); this one lacks them or holds other values")
    divides = heads % world_size == 0 and kv_heads % world_size == 0
    if divides or attention == "replicate":
        return attention != "replicate", None
    problem = (f"world size {world_size} does not divide the {heads} attention heads and {kv_heads} KV heads "
               f"(GQA: both must split)")
    if attention == "shard":
        raise ValueError(f"attention='shard': {problem}; choose a world size that divides both, or attention='auto' "
                         f"to replicate attention")
    return False, f"{problem}: attention is replicated on every rank, the MLP / experts are sharded"


@dataclass
class ShardPlan:
    """What this rank keeps of each sharded layer: the one rule that shard_model and load_sharded both apply."""
    report: ShardReport
    linears: Dict[str, LinearShard] = field(default_factory=dict)  # module name -> its part
    experts: Dict[str, ExpertShard] = field(default_factory=dict)


def _num_experts(module: torch.nn.Module) -> Optional[int]:
    """The number of experts of a W8A8Experts or of a transformers fused-experts module (also one built on the meta
    device, as load_sharded plans before reading), else None."""
    if isinstance(module, W8A8Experts):
        return module.num_experts
    weights = expert_weights(module)
    return None if weights is None else weights[0].shape[0]


def plan_shards(model: torch.nn.Module, group=None, attention: str = "auto", exact: bool = True) -> ShardPlan:
    """This rank's part of each layer that a world of `group`'s size splits (see shard_model), from the model's
    config and module tree only (layer sizes from out_features): no weight is read."""
    if attention not in ("auto", "shard", "replicate"):
        raise ValueError(f"attention: expected 'auto', 'shard' or 'replicate', got {attention!r}")
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    config = model.config
    split_attention, note = _attention_split(config, world_size, attention)
    plan = ShardPlan(ShardReport(world_size, "sharded" if split_attention else "replicated",
                                 notes=[note] if note else []))

    def split(projections, parallel: str, part: slice, name: str) -> None:
        for p in projections:
            plan.linears[f"{name}.{p}"] = LinearShard(parallel, part, f"{name}.{p}", exact, group)

    for name, module in model.named_modules():
        if split_attention and all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            head_dim = module.q_proj.out_features // config.num_attention_heads
            heads = _split(config.num_attention_heads, world_size, rank, f"the attention heads of {name}")
            kv_heads = _split(config.num_key_value_heads, world_size, rank, f"the KV heads of {name}")
            # contiguous head ranges keep GQA consistent: query head j reads KV head j // (heads / kv_heads)
            q_rows = slice(heads.start * head_dim, heads.stop * head_dim)
            split(("q_proj",), "column", q_rows, name)
            split(("k_proj", "v_proj"), "column", slice(kv_heads.start * head_dim, kv_heads.stop * head_dim), name)
            split(("o_proj",), "row", q_rows, name)
            plan.report.layers[name] = (f"heads {heads.start}..{heads.stop - 1}, KV heads {kv_heads.start}.."
                                        f"{kv_heads.stop - 1}")
        elif all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            rows = _split(module.gate_proj.out_features, world_size, rank, f"the intermediate size of {name}")
            split(("gate_proj", "up_proj"), "column", rows, name)
            split(("down_proj",), "row", rows, name)
            plan.report.layers[name] = f"intermediate {rows.start}..{rows.stop - 1}"
        elif _num_experts(module) is not None:
            total = _num_experts(module)
            plan.experts[name] = ExpertShard(_split(total, world_size, rank, f"the number of experts of {name}"),
                                             total, name, exact, group)
            plan.report.layers[name] = f"expert-parallel ({total // world_size} experts per rank)"
    return plan


def _require_quantized(module: torch.nn.Module, name: str, kind: type) -> torch.nn.Module:
    if not isinstance(module, kind):
        raise ValueError(f"model: {name} is {type(module).__name__}, not {kind.__name__}; shard_model splits "
                         f"quantized models (quantize_model or load_quantized first, without skipping it)")
    return module


def shard_model(model: torch.nn.Module, group=None, attention: str = "auto", exact: bool = True,
                check_weights: bool = True) -> ShardReport:
    """Shard, in place, a transformers decoder LM (Llama / Qwen2 / Mixtral / Qwen2-MoE family) whose layers are
    W8A8 across the ranks of `group`; every rank calls it on the same model. Returns what was split.

    attention: "shard" (heads and KV heads split; the world size must divide both), "replicate", or "auto"
    (shard when it divides, else replicate with a note in the report). MLPs (gate/up/down, including shared
    experts) are always split and experts always expert-parallel: a world size that does not divide the
    intermediate size or the number of experts raises ValueError, and so does a layer of these kept float.
    check_weights compares a checksum of every tensor across ranks first (ValueError naming the first that
    differs)."""
    plan = plan_shards(model, group, attention, exact)
    agree_on_sharding(model.config, plan.report.world_size, plan.report.attention, exact, model.dtype, "shard_model",
                      group)
    if check_weights:
        check_same_weights(model, group)
    for name, shard in plan.linears.items():
        replace_module(model, name, shard.of(_require_quantized(model.get_submodule(name), name, W8A8Linear)))
    for name, shard in plan.experts.items():
        replace_module(model, name, shard.of(_require_quantized(model.get_submodule(name), name, W8A8Experts)))
    _sharded_forward_checks(model, group)
    return plan.report


def load_sharded(directory, group=None, attention: str = "auto", exact: bool = True,
                 dtype: Optional[torch.dtype] = None):
    """(model, ShardReport): the W8A8 checkpoint in `directory` loaded as load_quantized loads it and sharded as
    shard_model shards it, but each rank reads from the safetensors files only its own part of each sharded layer
    (weight rows or columns, their scales and bias; its experts), and the replicated tensors (embeddings, norms,
    routers, lm_head, attention when replicated) whole. Same module structure and bits as
    shard_model(load_quantized(directory)) on this rank, and the same ValueErrors for bad files. Every rank calls it
    on the same directory; the checkpoint's sharded layers must be stored W8A8."""
    from ..llm.checkpoint import load

    def planned(empty: torch.nn.Module, headers: Dict[str, str]) -> ShardPlan:
        plan = plan_shards(empty, group, attention, exact)
        agree_on_sharding(empty.config, plan.report.world_size, plan.report.attention, exact, empty.dtype,
                          "load_sharded", group, headers)
        return plan

    model, plan = load(directory, planned, dtype)
    agree_on_replicated_tensors(model, [*plan.linears, *plan.experts], "load_sharded", group)
    _sharded_forward_checks(model, group)
    return model, plan.report


__all__ = ["init", "finish", "shard_model", "load_sharded", "plan_shards", "ShardPlan", "LinearShard", "ExpertShard",
           "check_same_weights", "weight_checksums", "column_parallel", "row_parallel", "RowParallelW8A8Linear",
           "ExpertParallelW8A8Experts", "RankFailure", "CommStats", "STATS", "all_reduce", "ShardReport", "agree"]
