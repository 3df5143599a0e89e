"""Error messages about untrusted input (checkpoint files, configs, a model's config values): what the input supplied
is quoted back cut short, and a field is checked against what is known; every failure a ValueError naming the file
and field."""
from __future__ import annotations

from typing import Sequence

import torch

_MAX_ECHO = 96  # characters of an input-supplied name or value quoted back in an error message
_MAX_LISTED = 5  # names listed when reporting a set of missing / unexpected names


def echo(value) -> str:
    """repr of an input-supplied value, cut to _MAX_ECHO characters."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > _MAX_ECHO:
        text = text[:_MAX_ECHO] + "..."
    return repr(text) if isinstance(value, str) else text


def listing(names: Sequence[str]) -> str:
    """The first _MAX_LISTED of names, sorted and each echoed, and how many more."""
    shown = ", ".join(echo(n) for n in sorted(names)[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def require(condition: bool, where: str, field: str, value, supported: str) -> None:
    """ValueError "where: field is value; supported" unless condition."""
    if not condition:
        raise ValueError(f"{where}: {field} is {echo(value)}; {supported}")


def check_fields(section: dict, known: Sequence[str], where: str, field: str) -> None:
    """A section of an input file holds only the known fields: an unknown one may change what the rest means."""
    unknown = [k for k in section if k not in known]
    if unknown:
        raise ValueError(f"{where}: {field} has a field {echo(unknown[0])} that w8a8_cpu does not know; it refuses "
                         f"rather than guess what it changes (known: {', '.join(known)})")


def check_weight_scales(scale: torch.Tensor, largest_code: int, where: str, what: str = "scale") -> None:
    """Weight scales are finite and > 0 (docs/numerics.md: a zero or negative one is no quantization grid), and the
    weights they describe (codes up to largest_code in magnitude, times the scale) finite in fp32, as a float
    checkpoint's weights must be: a scale of 3e38 is finite, its weights are not, and every logit would be Inf.
    ValueError "where holds ..." otherwise."""
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(f"{where} holds a {what} that is not finite and > 0")
    if not torch.isfinite(scale * largest_code).all():
        raise ValueError(f"{where} holds a scale whose weights ({largest_code} x the scale) overflow fp32")
