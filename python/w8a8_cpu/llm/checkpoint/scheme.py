"""A checkpoint's quantization_config, both ways: written from the layers' schemes (compressed-tensors), read and
validated into which layers are quantized and how (compressed-tensors, sglang's w8a8_int8). What a scheme is and
which ones run is w8a8_cpu.scheme's to say; this module translates the file's fields and checks their form."""
from __future__ import annotations

import re
from dataclasses import dataclass, field as dataclass_field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..._untrusted import check_fields, echo, require
from ...scheme import DYNAMIC, W8A8, ActivationScheme, QuantScheme, lower_enum
from .regex_guard import check_names

# ---- write ------------------------------------------------------------------------------------------------------


def compressed_tensors_config(ignore: List[str], schemes: Dict[str, QuantScheme], has_int8: bool) -> dict:
    """int8 layers: one group targeting Linear (W8A8: int-quantized, dynamic per-token activations); every other
    scheme of `schemes` ({layer: its scheme}, the layers not W8A8): one group naming its layers (exact names take
    precedence over the class target), static and asymmetric int8 activations first, then int4 weights
    (pack-quantized) by group size and symmetry."""
    groups = {}
    if has_int8 or all(s.weights.bits == 8 for s in schemes.values()):  # or no int4 layers
        groups["group_0"] = {"targets": ["Linear"], **W8A8.to_compressed_tensors()}
    kinds = sorted(set(schemes.values()), key=lambda s: (s.weights.bits == 4, s.weights.group_size, s.weights.symmetric,
                                                         s.activations.static, s.activations.symmetric))
    for i, scheme in enumerate(kinds, start=1):
        groups[f"group_{i}"] = {"targets": sorted(n for n, s in schemes.items() if s == scheme),
                                **scheme.to_compressed_tensors()}
    formats = {group["format"] for group in groups.values()}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
    }


# ---- read -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scheme:
    """Which Linear layers of a checkpoint are stored W8A8, and their weight-scale strategy."""

    where: str  # "<config.json path> quantization_config", for messages
    targets: Dict[str, Union[str, "Int4Args"]]  # target -> int8 strategy ("channel" / "tensor") or int4 args
    ignore: Tuple[str, ...]
    by_stored_dtype: bool  # sglang w8a8_int8: a layer is W8A8 iff its weight is stored int8
    activations: Dict[str, ActivationScheme] = dataclass_field(default_factory=dict)  # target -> its input activations

    def __post_init__(self):
        # every `re:` entry compiled once (re's own cache holds 512: more entries would be recompiled per layer)
        names = (*self.targets, *self.ignore)
        object.__setattr__(self, "_patterns", {t: re.compile(t[3:]) for t in names if t.startswith("re:")})
        object.__setattr__(self, "_ordered", sorted(self.targets, key=lambda t: ("re:" in t, t)))

    def _name_matches(self, target: str, name: str) -> bool:
        pattern = self._patterns.get(target)
        return pattern.match(name) is not None if pattern is not None else target == name

    def _ignored(self, layer: str, classes: Sequence[str]) -> bool:
        # compressed-tensors' rule: an exact module name, a `re:` regex matched at the name's start, or a class name
        return any(self._name_matches(t, layer) or t in classes for t in self.ignore)

    def _target(self, layer: str, classes: Sequence[str]) -> Optional[str]:
        """The target whose scheme the layer takes, None when it stays float."""
        if self._ignored(layer, classes):
            return None
        # compressed-tensors' precedence: exact names, then regexes (each sorted), then class names
        by_name = [t for t in self._ordered if self._name_matches(t, layer)]
        by_class = [t for t in self._ordered if t in classes and t not in by_name]
        matched = by_name + by_class
        return matched[0] if matched else None

    def weight_strategy(self, layer: str, classes: Sequence[str], stored_dtype: Optional[str]):
        """The layer's weight strategy, or None when the checkpoint keeps it float."""
        if self.by_stored_dtype:
            if stored_dtype == "I8" and self._ignored(layer, classes):
                raise ValueError(f"{self.where}: layer {echo(layer)} is in `ignore` but its weight is stored int8")
            return "channel" if stored_dtype == "I8" else None
        target = self._target(layer, classes)
        return None if target is None else self.targets[target]

    def activation_args(self, layer: str, classes: Sequence[str]) -> ActivationScheme:
        """The input activations of a layer the checkpoint quantizes."""
        target = None if self.by_stored_dtype else self._target(layer, classes)
        return DYNAMIC if target is None else self.activations.get(target, DYNAMIC)


_ARGS_FIELDS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
                "scale_dtype", "zp_dtype", "observer", "observer_kwargs")


@dataclass(frozen=True)
class Int4Args:
    """A layer's int4 weights: scales per group of group_size k (0: per channel), integer zero points unless
    symmetric; packed 8 per int32 (pack-quantized) or one per int8 (int-quantized, as compressed-tensors writes W4A8
    with int8 activations)."""
    group_size: int
    symmetric: bool
    packed: bool = True


def _check_int4_args(args: dict, where: str, field: str) -> None:
    """The form of 4-bit weights' fields: group or channel strategy (the group size and symmetry: the scheme's)."""
    require(lower_enum(args.get("type", "int")) == "int", where, f"{field}.type", args.get("type"),
            "w8a8_cpu runs int4 integer weights only")
    group_size = args.get("group_size")
    strategy = lower_enum(args.get("strategy")) or ("channel" if group_size in (None, -1) else "group")
    require(strategy in ("group", "channel"), where, f"{field}.strategy", strategy,
            "w8a8_cpu runs int4 weights per group or per channel")
    if strategy == "group":
        require(type(group_size) is int and group_size > 0, where, f"{field}.group_size", group_size,
                "expected the group size of strategy group")
    else:
        require(group_size in (None, -1), where, f"{field}.group_size", group_size, "expected none per channel")
    require(args.get("block_structure") is None, where, f"{field}.block_structure", args.get("block_structure"),
            "block-wise scales are not supported")
    require(args.get("dynamic", False) is False, where, f"{field}.dynamic", args.get("dynamic"),
            "expected false: weights carry static scales")
    require(args.get("actorder") in (None, False, "weight"), where, f"{field}.actorder", args.get("actorder"),
            "activation-ordered groups (g_idx) are not supported")


def _check_args(args, where: str, field: str, strategies: Sequence[str], dynamic: Optional[bool],
                weights: bool = False) -> Optional[str]:
    """Check the form of one compressed-tensors QuantizationArgs dict (its defaults applied); return its strategy
    (8 bits), or None for 4-bit weights. weights: the group's weights (their bits and symmetry are the scheme's to
    judge), else input activations (int8 by their form); dynamic None: left to the caller."""
    require(isinstance(args, dict), where, field, args, "expected an object")
    check_fields(args, _ARGS_FIELDS, where, field)
    if weights and args.get("num_bits") == 4:
        return _check_int4_args(args, where, field)
    require(weights or args.get("num_bits", 8) == 8, where, f"{field}.num_bits", args.get("num_bits"),
            "w8a8_cpu runs int8 activations only")
    require(lower_enum(args.get("type", "int")) == "int", where, f"{field}.type", args.get("type"),
            "w8a8_cpu runs int8 only (not float / fp8)")
    group_size = args.get("group_size")
    strategy = lower_enum(args.get("strategy"))
    if strategy is None:  # compressed-tensors infers it from group_size: none -> tensor, -1 -> channel, else group
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    require(strategy in strategies, where, f"{field}.strategy", strategy,
            f"w8a8_cpu runs {' / '.join(strategies)} here")
    require(group_size in (None, -1), where, f"{field}.group_size", group_size, "group-wise scales are not supported")
    require(args.get("block_structure") is None, where, f"{field}.block_structure", args.get("block_structure"),
            "block-wise scales are not supported")
    if dynamic is not None:
        require(args.get("dynamic", False) is dynamic, where, f"{field}.dynamic", args.get("dynamic"),
                "expected true: w8a8_cpu computes activation scales per token at run time"
                if dynamic else "expected false: weights carry static scales")
    require(args.get("actorder") in (None, False, "weight"), where, f"{field}.actorder", args.get("actorder"),
            "activation-ordered groups (g_idx) are not supported")
    return strategy


def _check_activation_args(args, where: str, field: str) -> None:
    """The form of int8 activations' fields: dynamic per token or static per tensor."""
    strategy = _check_args(args, where, field, ("token", "tensor"), dynamic=None)
    require(args.get("dynamic", False) is (strategy == "token"), where, f"{field}.dynamic", args.get("dynamic"),
            "w8a8_cpu runs dynamic per-token (strategy token, dynamic true) or static per-tensor (strategy tensor, "
            "dynamic false) activations")


_COMPRESSED_TENSORS_FIELDS = ("quant_method", "format", "quantization_status", "config_groups", "ignore",
                              "kv_cache_scheme", "global_compression_ratio", "sparsity_config", "transform_config",
                              "moe_sparsity_config", "version")
_GROUP_FIELDS = ("targets", "weights", "input_activations", "output_activations", "format")
_FORMATS = ("int-quantized", "naive-quantized")  # both store int8 weights and their scales as they are
_INT4_FORMAT = "pack-quantized"  # int4 weights packed 8 per int32


def _compressed_tensors_scheme(qc: dict, where: str) -> Scheme:
    check_fields(qc, _COMPRESSED_TENSORS_FIELDS, where, "quantization_config")
    status = qc.get("quantization_status")
    require(status == "compressed", where, "quantization_status", status,
            "expected 'compressed' (int8 weights stored); other statuses store float weights")
    for field in ("kv_cache_scheme", "moe_sparsity_config", "sparsity_config", "transform_config"):
        require(not qc.get(field), where, field, qc.get(field),
                "w8a8_cpu runs plain W8A8 linear layers only (no kv-cache quantization, sparsity or transforms)")
    groups = qc.get("config_groups")
    require(isinstance(groups, dict) and groups, where, "config_groups", groups, "expected a non-empty object")
    targets: Dict[str, str] = {}
    activations_of: Dict[str, ActivationScheme] = {}
    for group_name, group in groups.items():
        field = f"config_groups[{echo(group_name)}]"
        require(isinstance(group, dict), where, field, group,
                "expected a scheme object (preset-name groups are not supported)")
        check_fields(group, _GROUP_FIELDS, where, field)
        group_format = group.get("format") or qc.get("format")
        require(group_format in (*_FORMATS, _INT4_FORMAT), where, f"{field}.format", group_format,
                f"w8a8_cpu reads {' / '.join((*_FORMATS, _INT4_FORMAT))} only")
        require(group.get("weights") is not None, where, f"{field}.weights", None, "expected int8 weights")
        require(group.get("input_activations") is not None, where, f"{field}.input_activations", None,
                "weight-only quantization is not W8A8 (expected int8 dynamic per-token activations)")
        require(group.get("output_activations") is None, where, f"{field}.output_activations",
                group.get("output_activations"), "output quantization is not supported")
        strategy = _check_args(group["weights"], where, f"{field}.weights", ("channel", "tensor"), dynamic=False,
                               weights=True)
        require(group_format != _INT4_FORMAT or strategy is None, where, f"{field}.format",
                group_format, "pack-quantized holds 4-bit weights; int8 weights are int-quantized")
        _check_activation_args(group["input_activations"], where, f"{field}.input_activations")
        try:
            scheme = QuantScheme.from_compressed_tensors(group["weights"], group["input_activations"])
        except ValueError as e:
            raise ValueError(f"{where}: {field}.{e}") from None
        activations = scheme.activations
        if strategy is None:
            strategy = Int4Args(scheme.weights.group_size, scheme.weights.symmetric, group_format == _INT4_FORMAT)
        for target in check_names(group.get("targets"), where, f"{field}.targets"):
            # a later group's scheme replaces an earlier one's (compressed-tensors' rule)
            targets[target] = strategy
            activations_of[target] = activations
    ignore = check_names(qc.get("ignore") or [], where, "ignore")
    return Scheme(where, targets, ignore, by_stored_dtype=False, activations=activations_of)


_SGLANG_FIELDS = ("quant_method", "ignore", "activation_scheme")


def _sglang_scheme(qc: dict, where: str) -> Scheme:
    check_fields(qc, _SGLANG_FIELDS, where, "quantization_config")
    require(qc.get("activation_scheme", "dynamic") == "dynamic", where, "activation_scheme",
            qc.get("activation_scheme"), "w8a8_cpu computes activation scales per token at run time ('dynamic')")
    return Scheme(where, {}, check_names(qc.get("ignore") or [], where, "ignore"), by_stored_dtype=True)


def read_scheme(config_dict: dict, where: str) -> Scheme:
    qc = config_dict.get("quantization_config")
    require(isinstance(qc, dict), where, "quantization_config", qc,
            "expected an object: load_quantized reads pre-quantized checkpoints only")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, f"{where} quantization_config")
    if method == "w8a8_int8":
        return _sglang_scheme(qc, f"{where} quantization_config")
    raise ValueError(f"{where}: quantization_config.quant_method is {echo(method)}; w8a8_cpu reads "
                     f"'compressed-tensors' (int-quantized) and sglang's 'w8a8_int8' only")
