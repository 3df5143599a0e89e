"""What a quantized layer computes, as one value: the weights' form (bits, group size, symmetry, grid, rounding) and
the input activations' (dynamic or static, symmetric or not).

    quantize_model(model, scheme=W4A8)                   # presets below, or QuantScheme(WeightScheme(...), ...)
    layer.scheme                                         # what a quantized layer holds and runs
    QuantScheme.from_compressed_tensors(weights, input_activations)   # a checkpoint group's QuantizationArgs

QuantScheme.validate() is the one place that decides which combinations the kernels run (quantize_model, the
quantize command and the checkpoint reader all ask it); a combination they cannot run exactly is a ValueError that
names the field. The packed blob's header stores the weights' form as an integer: WeightScheme.header_code /
from_header translate it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

GROUP_SIZE = 32  # the int4 group size along K of the W4A8 presets, and quantize_model's and the constructors' default
ROUNDINGS = ("nearest", "gptq")  # round to nearest, or GPTQ (int4: minimizes each layer's output error on inputs)
INT4_GROUPS = "0 (per channel) or a power of two in [32, 65536]"  # the blob header's group_log2: 5..16 (kMaxGroupLog2)


def is_int4_group(group_size) -> bool:
    """Whether group_size is one an int4 blob can hold: INT4_GROUPS."""
    return type(group_size) is int and (group_size == 0 or (32 <= group_size <= 65536 and
                                                            group_size & (group_size - 1) == 0))


def check_bool(name: str, value) -> None:
    if type(value) is not bool:  # a string such as 'no' is truthy and would be taken as True, silently
        raise ValueError(f"{name}: expected True or False, got {value!r}")


@dataclass(frozen=True)
class WeightScheme:
    """bits 8: int8, one fp32 scale per output channel, symmetric. bits 4: int4 per group of group_size along K (0:
    one group per channel), symmetric, or asymmetric with per-group minimums: an integer zero point (minimum = -scale
    * z, the form compressed-tensors stores) or with min_max the min-max grid (a float minimum). rounding: "nearest",
    or "gptq" (int4; needs calibration inputs)."""
    bits: int = 8
    group_size: int = 0
    symmetric: bool = True
    min_max: bool = False
    rounding: str = "nearest"

    @property
    def header_code(self) -> int:
        """The packed blob header's scheme byte (csrc/common/packed_weight.h, WeightScheme): 0 int8, 1 int4, 2 int4
        with minimums."""
        return 0 if self.bits == 8 else 1 if self.symmetric else 2

    @classmethod
    def from_header(cls, code: int, group_size: int) -> "WeightScheme":
        """The weights' form a blob header states (its scheme byte and group size); an int4 blob with minimums says
        nothing of how they were rounded: an integer zero point, to nearest."""
        forms = {0: dict(bits=8), 1: dict(bits=4, group_size=group_size), 2: dict(bits=4, group_size=group_size,
                                                                                  symmetric=False)}
        if code not in forms:
            raise ValueError(f"scheme byte {code!r}: expected 0 (int8), 1 (int4) or 2 (int4 with minimums)")
        return cls(**forms[code])


@dataclass(frozen=True)
class ActivationScheme:
    """int8 input activations: dynamic (each token's own scale, computed at run time) or static (one calibrated or
    stored scale per tensor); symmetric, or asymmetric with a zero point."""
    static: bool = False
    symmetric: bool = True

    @property
    def label(self) -> str:
        """W8A8Linear.activation_scheme's name of it: "token", "token-asymmetric", "tensor", "tensor-asymmetric"."""
        return ("tensor" if self.static else "token") + ("" if self.symmetric else "-asymmetric")


@dataclass(frozen=True)
class QuantScheme:
    """A layer's weights and input activations."""
    weights: WeightScheme = field(default_factory=WeightScheme)
    activations: ActivationScheme = field(default_factory=ActivationScheme)

    def validate(self) -> "QuantScheme":
        """self, when the kernels run it exactly; else ValueError "<field>: <why>", field one of bits, group_size,
        symmetric, min_max, rounding, static, activations. The only place these rules live."""
        w, a = self.weights, self.activations
        if not isinstance(w, WeightScheme) or not isinstance(a, ActivationScheme):
            raise ValueError(f"scheme: expected a WeightScheme and an ActivationScheme, got {type(w).__name__} and "
                             f"{type(a).__name__}")
        for name, value in (("symmetric", w.symmetric), ("min_max", w.min_max), ("static", a.static),
                            ("symmetric_activations", a.symmetric)):
            check_bool(name, value)
        if w.rounding not in ROUNDINGS:
            raise ValueError(f"rounding: expected one of {', '.join(ROUNDINGS)}, got {w.rounding!r}")
        if type(w.bits) is not int or w.bits not in (8, 4):
            raise ValueError(f"bits: expected 8 (int8 weights) or 4 (int4 weights), got {w.bits!r}")
        if w.bits == 8:
            for name, value, default in (("group_size", w.group_size, 0), ("symmetric", w.symmetric, True),
                                         ("min_max", w.min_max, False), ("rounding", w.rounding, "nearest")):
                if value != default or type(value) is not type(default):
                    raise ValueError(f"{name}: applies to 4-bit weights (W4A8); int8 weights have one scale per "
                                     f"output channel, symmetric, rounded to nearest (leave it at {default!r}, got "
                                     f"{value!r})")
            return self
        if not is_int4_group(w.group_size):
            raise ValueError(f"group_size: expected {INT4_GROUPS}, got {w.group_size!r}")
        if w.min_max and w.symmetric:
            raise ValueError("min_max: the min-max grid is asymmetric; pass symmetric=False with min_max=True "
                             "(symmetric=True rounds symmetric, which would ignore it)")
        if a != DYNAMIC:
            raise ValueError(f"activations: int4 weights run with int8 dynamic per-token symmetric activations only "
                             f"(the int4 ops quantize them), got {a.label}; static or asymmetric activations need "
                             f"int8 weights (W8A8)")
        return self

    def to_compressed_tensors(self) -> Dict[str, object]:
        """The config group compressed-tensors stores this scheme as (its targets apart): format, weights and
        input_activations QuantizationArgs. The rounding is not stored (GPTQ's codes are stored as any others); a
        min-max grid has no compressed-tensors form (ValueError)."""
        w, a = self.validate().weights, self.activations
        if w.min_max:
            raise ValueError("min_max: the min-max grid's float minimums have no compressed-tensors form (it stores "
                             "integer zero points); quantize without min_max to save it")
        weights = {"num_bits": w.bits, "type": "int", "symmetric": w.symmetric,
                   "strategy": "group" if w.group_size else "channel", "group_size": w.group_size or None,
                   "dynamic": False}
        activations = {"num_bits": 8, "type": "int", "symmetric": a.symmetric,
                       "strategy": "tensor" if a.static else "token", "group_size": None, "dynamic": not a.static}
        return {"weights": weights, "input_activations": activations, "output_activations": None,
                "format": "int-quantized" if w.bits == 8 else "pack-quantized"}

    @classmethod
    def from_compressed_tensors(cls, weights: dict, input_activations: dict) -> "QuantScheme":
        """The scheme of a config group's QuantizationArgs (their defaults applied: num_bits 8, symmetric true, the
        strategy inferred from group_size as compressed-tensors does), validated; a ValueError names the
        compressed-tensors field. What only concerns the file (type, block structure, actorder, dynamic weights, the
        format) is the checkpoint reader's to check."""
        group_size = weights.get("group_size")
        strategy = lower_enum(weights.get("strategy")) or ("channel" if group_size in (None, -1) else "group")
        static = lower_enum(input_activations.get("strategy")) == "tensor"
        scheme = cls(WeightScheme(bits=weights.get("num_bits", 8), symmetric=weights.get("symmetric", True),
                                  group_size=group_size if strategy == "group" else 0),
                     ActivationScheme(static=static, symmetric=input_activations.get("symmetric", True)))
        fields = {"bits": "weights.num_bits", "group_size": "weights.group_size", "symmetric": "weights.symmetric",
                  "activations": "input_activations", "symmetric_activations": "input_activations.symmetric"}
        try:
            return scheme.validate()
        except ValueError as e:
            name, _, reason = str(e).partition(": ")
            raise ValueError(f"{fields.get(name, name)}: {reason}") from None


def lower_enum(value):
    """compressed-tensors reads its enum fields (type, strategy) case-insensitively."""
    return value.lower() if isinstance(value, str) else value


DYNAMIC = ActivationScheme()  # per token, symmetric: the fused op's own quantization, the default

W8A8 = QuantScheme()
W8A8_DYNAMIC_ASYMMETRIC = QuantScheme(activations=ActivationScheme(symmetric=False))
W8A8_STATIC = QuantScheme(activations=ActivationScheme(static=True))
W8A8_STATIC_ASYMMETRIC = QuantScheme(activations=ActivationScheme(static=True, symmetric=False))
W4A8 = QuantScheme(WeightScheme(bits=4, group_size=GROUP_SIZE))
W4A8_GPTQ = QuantScheme(WeightScheme(bits=4, group_size=GROUP_SIZE, rounding="gptq"))
W4A8_ASYMMETRIC = QuantScheme(WeightScheme(bits=4, group_size=GROUP_SIZE, symmetric=False))
W4A8_MIN_MAX = QuantScheme(WeightScheme(bits=4, group_size=GROUP_SIZE, symmetric=False, min_max=True))

PRESETS: Dict[str, QuantScheme] = {
    "W8A8": W8A8, "W8A8_DYNAMIC_ASYMMETRIC": W8A8_DYNAMIC_ASYMMETRIC, "W8A8_STATIC": W8A8_STATIC,
    "W8A8_STATIC_ASYMMETRIC": W8A8_STATIC_ASYMMETRIC, "W4A8": W4A8, "W4A8_GPTQ": W4A8_GPTQ,
    "W4A8_ASYMMETRIC": W4A8_ASYMMETRIC, "W4A8_MIN_MAX": W4A8_MIN_MAX,
}


def preset_name(scheme: QuantScheme) -> Optional[str]:
    """The name of the preset equal to scheme, None when none is."""
    return next((name for name, preset in PRESETS.items() if preset == scheme), None)


__all__ = ["WeightScheme", "ActivationScheme", "QuantScheme", "GROUP_SIZE", "ROUNDINGS", "DYNAMIC", "PRESETS",
           "preset_name", *PRESETS]
