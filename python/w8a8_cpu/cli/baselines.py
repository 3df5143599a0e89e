"""The torch.ao dynamic int8 baseline that every tool compares W8A8 with."""
from __future__ import annotations

import warnings
from typing import Sequence

import torch


def ao_dynamic(model: torch.nn.Module, skip: Sequence[str] = ()) -> torch.nn.Module:
    """torch.ao dynamic int8 quantization of every nn.Linear in `model` but those named in `skip` (the baseline;
    its deprecation warnings silenced). Raises if this torch build has no quantized engine."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

        spec = {name: default_dynamic_qconfig for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and name not in skip}
        return quantize_dynamic(model, spec, dtype=torch.qint8)
