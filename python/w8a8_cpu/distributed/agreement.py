"""Agreement across ranks: what each rank was given (config and options, checkpoint headers, replicated tensors,
weights, forward inputs) is compared before it can matter, and every rank raises the same ValueError naming the first
difference, instead of a collective with mismatched sizes aborting a rank (gloo ends the process) or the ranks
computing a silently wrong answer."""
from __future__ import annotations

import json
import math
import zlib
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from .._functions import unpack_weight
from .._packed_weight import HEADER_BYTES, MAGIC
from .process_group import _collective


def agree(values: Dict[str, str], what: str, group=None) -> None:
    """Every rank's `values` equal to rank 0's, else ValueError on every rank naming the first key that differs and
    both values: what a rank was given (config, checkpoint headers, options) is compared once, before a collective
    with mismatched sizes could abort a rank (gloo ends the process) or the ranks compute a silently wrong answer."""
    everyone: List[Optional[Dict[str, str]]] = [None] * dist.get_world_size(group)
    _collective(f"{what}: agreement across ranks", lambda: dist.all_gather_object(everyone, values, group=group))
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        differ = [key for key in sorted(reference.keys() | theirs.keys()) if reference.get(key) != theirs.get(key)]
        if differ:
            key, more = differ[0], differ[1:4]
            also = f" (and in {', '.join(more)}{', ...' if len(differ) > 4 else ''})" if more else ""
            raise ValueError(f"{what}: rank {rank} differs from rank 0 in {key}: {_short(theirs.get(key))} on rank "
                             f"{rank}, {_short(reference.get(key))} on rank 0{also}; every rank must be given the "
                             f"same")


def _short(value: Optional[str]) -> str:
    if value is None:
        return "nothing"
    return repr(value if len(value) <= 120 else value[:120] + "...")


def agree_on_sharding(config, world_size: int, attention: str, exact: bool, dtype, what: str, group,
                      headers: Optional[Dict[str, str]] = None) -> None:
    """agree() on every config field, the world size, the attention split ("sharded" or "replicated"), exact and the
    dtype, and (load_sharded, before reading) every tensor header {name: "file dtype shape"}."""
    config_values = {f"config {k}": json.dumps(v, sort_keys=True, default=str) for k, v in config.to_dict().items()
                     if k not in ("_name_or_path", "transformers_version")}
    options = {"world size": str(world_size), "attention": attention, "exact": str(exact), "dtype": str(dtype)}
    agree({**config_values, **options, **{f"tensor {name}": header for name, header in (headers or {}).items()}},
          what, group)


def agree_on_replicated_tensors(model: torch.nn.Module, sharded_layers: Iterable[str], what: str, group) -> None:
    """agree() on the crc32 of every tensor outside the sharded layers (embeddings, norms, routers, lm_head, attention
    when replicated), which every rank holds whole."""
    sharded = set(sharded_layers)
    replicated = {name: str(crc) for name, crc in weight_checksums(model).items()
                  if not any(name.startswith(layer + ".") for layer in sharded)}
    agree({f"replicated tensor {name}": crc for name, crc in replicated.items()}, what, group)


def _shape_fingerprint(shape) -> List[int]:
    """[dims, the first 4 sizes (padded with -1), number of elements]: a fixed size, so that exchanging it cannot
    itself mismatch across ranks."""
    sizes = list(shape)
    return [len(sizes), *sizes[:4], *[-1] * (4 - min(len(sizes), 4)), math.prod(sizes)]


def _shape_of(fingerprint: torch.Tensor) -> tuple:
    return tuple(int(d) for d in fingerprint[1:1 + min(int(fingerprint[0]), 4)])


def _gathered(mine: torch.Tensor, what: str, group) -> List[torch.Tensor]:
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    _collective(what, lambda: dist.all_gather(everyone, mine, group=group), mine)
    return everyone


def require_same(tensors: Dict[str, torch.Tensor], what: str, advice: str, group) -> None:
    """Every rank's tensors equal to rank 0's (shape and crc32 of the bytes, one small all-gather), else the same
    ValueError on every rank naming the first that differs: a size that differed would abort a rank inside the next
    all-reduce (gloo ends the process), other values would give every rank a wrong answer."""
    def fingerprint(t: torch.Tensor) -> List[int]:
        t = t.detach().contiguous()
        return [*_shape_fingerprint(t.shape), zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().data)]

    everyone = _gathered(torch.tensor([fingerprint(t) for t in tensors.values()], dtype=torch.int64),
                         f"{what} agreement", group)
    for rank, theirs in enumerate(everyone):
        for name, a, b in zip(tensors, theirs, everyone[0]):
            if not torch.equal(a, b):
                raise ValueError(f"{name}: rank {rank}'s {what} differs from rank 0's (shape {_shape_of(a)} vs "
                                 f"{_shape_of(b)}, crc32 {int(a[-1]):#x} vs {int(b[-1]):#x}); {advice}")


def require_same_rows(x: torch.Tensor, in_features: int, name: str, group) -> None:
    """A row-parallel layer's input: every rank's rows of the same shape (one small all-gather; a row count that
    differed aborted a rank inside gloo) and each rank's K-slice as wide as its slice of the layer."""
    mine = torch.tensor([*_shape_fingerprint(x.shape[:-1]), x.shape[-1], in_features], dtype=torch.int64)
    everyone = _gathered(mine, f"{name}: input agreement", group)
    for rank, theirs in enumerate(everyone):
        if theirs[-2] != theirs[-1]:
            raise ValueError(f"x: rank {rank}'s input to {name} has {int(theirs[-2])} columns, but its slice "
                             f"of the layer takes {int(theirs[-1])}")
        if not torch.equal(theirs[:-2], everyone[0][:-2]):
            raise ValueError(f"x: rank {rank}'s input to {name} has rows of shape {_shape_of(theirs)}, rank "
                             f"0's {_shape_of(everyone[0])}; every rank passes the same rows (each its K-slice)")


def same_input_hook(group):
    """A forward pre-hook for a sharded model: every rank's input ids (or input embeddings) equal, checked with one
    small all-gather per forward."""
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor):
            require_same({"input": ids}, "forward input", "every rank must run the same tokens", group)
    return hook


def _is_packed(t: torch.Tensor) -> bool:
    """A packed weight blob, or one per row (packed experts): each row starts with the blob magic."""
    return t.dtype == torch.uint8 and t.dim() in (1, 2) and t.shape[-1] >= HEADER_BYTES and \
        all(bytes(row[:len(MAGIC)].tolist()) == MAGIC for row in t.reshape(-1, t.shape[-1]))


def weight_checksums(model: torch.nn.Module) -> Dict[str, int]:
    """crc32 of every tensor of the model's state (int8 weights, scales, float parameters), by name. Packed weights
    (one blob, or one per expert) are checksummed as the int8 [N, K] weights they hold: hosts whose CPUs pick
    different kernel variants pack the same weight differently (layout, the packing variant's name), and must still
    agree."""
    sums = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().contiguous()
        crc = 0
        for part in ([unpack_weight(row) for row in t.reshape(-1, t.shape[-1])] if _is_packed(t) else [t]):
            crc = zlib.crc32(part.contiguous().reshape(-1).view(torch.uint8).numpy().data, crc)
        sums[name] = crc
    return sums


def check_same_weights(model: torch.nn.Module, group=None) -> None:
    """Raise ValueError naming the first tensor and the ranks where the model differs from rank 0's."""
    mine = weight_checksums(model)
    everyone: List[Optional[Dict[str, int]]] = [None] * dist.get_world_size(group)
    _collective("weight checksum exchange", lambda: dist.all_gather_object(everyone, mine, group=group))
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs.keys() != reference.keys():
            raise ValueError(f"model: rank {rank} holds other tensors than rank 0 "
                             f"({sorted(theirs.keys() ^ reference.keys())[:3]}...); every rank must load the same "
                             f"model")
        differ = [name for name in reference if theirs[name] != reference[name]]
        if differ:
            more = f" and {len(differ) - 1} more tensors" if len(differ) > 1 else ""
            raise ValueError(f"model: rank {rank}'s weights differ from rank 0's at {differ[0]}{more} (crc32 of the "
                             f"int8 weights and tensors); every rank must load the same model")
