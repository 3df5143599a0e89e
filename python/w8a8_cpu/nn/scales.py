"""What every quantized layer's buffers share: fp32 scales kept fp32 through dtype casts (Fp32Scales), and weight-side
tensors checked finite where a layer is built (finite_fp32)."""
from __future__ import annotations

import torch


class Fp32Scales(torch.nn.Module):
    """Keeps the quantization scales fp32 through model.half() / .to(torch.bfloat16): the ops take fp32 scales,
    and rounding a scale to 16 bits would silently shift every output of its channel. Device moves still apply."""

    _fp32_buffers: tuple = ()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # weight-side values loaded into a built layer: refused as at construction (finite_fp32), before any is set
        for name in (*self._fp32_buffers, "bias"):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
                raise ValueError(f"{prefix}{name}: contains NaN or Inf")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        before = {name: getattr(self, name) for name in self._fp32_buffers}
        super()._apply(fn, *args, **kwargs)
        for name, scale in before.items():
            after = getattr(self, name)
            if after is not None and after.dtype != torch.float32:
                setattr(self, name, scale.to(device=after.device))
        return self


def finite_fp32(t: torch.Tensor, name: str) -> torch.Tensor:
    """A weight-side tensor (scales, bias) as contiguous fp32; NaN/Inf there is a bug in the weights, rejected where
    the layer is built (non-finite activations follow nn.Linear instead: NaN rows out)."""
    t32 = t.detach().to(torch.float32).contiguous()
    if not torch.isfinite(t32).all():
        raise ValueError(f"{name}: contains NaN or Inf")
    return t32
