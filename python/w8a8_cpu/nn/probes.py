"""Checks by behaviour that a float module computes what a fused replacement computes, and nothing more: a SiLU
activation (is_silu), a plain gated MLP (computes_plain_gated_mlp, for fuse_projections) and plain SiLU-gated experts
(computes_plain_silu_experts, for the fused experts). Models whose modules look the same but scale or clamp too are
kept out of the fused layers this way, instead of computing something else silently."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch


def is_silu(act: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether an activation module computes SiLU, judged by behaviour: transformers wraps SiLU in classes of its
    own, and the fused experts implement SiLU-gated experts only."""
    probe = torch.linspace(-8.0, 8.0, 33)
    with torch.no_grad():
        return torch.allclose(act(probe), torch.nn.functional.silu(probe))


# the probe rows' scales: large enough to reach any clamp, each with both signs (a one-sided clamp, gate.clamp(max=l),
# is reached by one of x and -x: the projections are linear)
_PROBE_MAGNITUDES = (1.0, -1.0, 10.0, -10.0, 100.0, -100.0, 1000.0, -1000.0)


def computes_plain_gated_mlp(mlp: torch.nn.Module) -> bool:
    """Whether mlp's own forward is down(act(gate(x)) * up(x)) and nothing more, checked bit for bit on probe rows of
    growing magnitude through its own layers: some models' MLPs look the same and scale or clamp too (Falcon-H1's
    mlp_multipliers, DeepSeek-V4's swiglu_limit), and fusing those gave outputs 2x and 8x off, silently. One that
    does not (or whose forward needs more than x) stays unfused. The probe is [1, 8, K], as transformers passes
    hidden states; forward hooks on mlp and its layers see it."""
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    probe = torch.randn(1, len(_PROBE_MAGNITUDES), gate.in_features, generator=torch.Generator().manual_seed(0)) * \
        torch.tensor(_PROBE_MAGNITUDES).view(1, -1, 1)
    try:
        with torch.no_grad():
            own = mlp(probe)
            plain = down(mlp.act_fn(gate(probe)) * up(probe))
    except Exception:  # a forward that needs other arguments or shapes: not the plain form
        return False
    return isinstance(own, torch.Tensor) and own.shape == plain.shape and own.dtype == plain.dtype and \
        torch.equal(own, plain)


def computes_plain_silu_experts(experts: torch.nn.Module, gate_up_e: torch.Tensor, down_e: torch.Tensor) -> bool:
    """Whether a fused-experts module's own forward is down(act_fn(gate) * up) per expert and nothing more, checked
    bit for bit (fp32) on probe rows of growing magnitude, all routed to expert 0 with weight 1, against F.linear as
    transformers' experts compute it: some look like Mixtral's and clamp too (DeepSeek-V4's swiglu_limit clamps gate
    and up in _apply_gate), and the fused experts dropped that, silently (output error 0.78 instead of 0.02).

    The forward runs through functional_call with gate_up_proj / down_proj replaced by one intermediate channel of the
    one expert's weights gate_up_e [2I, H], down_e [H, I] (any dtype) expanded to every expert (stride 0: no memory for E copies, and parameters on
    the meta device are never read). transformers' other experts backends (grouped_mm, batched_mm) apply the same
    class gate and differ from its eager loop only in their GEMMs' rounding (bmm), so the probe runs the eager loop.
    A forward that fails (other arguments, other layouts, its other parameters on meta) is not the plain form."""
    inter = gate_up_e.shape[0] // 2
    # one intermediate channel is enough to see a clamp or scale (they act per element): the probe's weights are
    # [2, H] and [H, 1], not a float copy of the expert
    gate_up = gate_up_e.detach()[[0, inter]].to(torch.float32)
    down = down_e.detach()[:, :1].to(torch.float32)
    try:
        num_experts = experts.gate_up_proj.shape[0]
        params = {"gate_up_proj": gate_up.expand(num_experts, *gate_up.shape),
                  "down_proj": down.expand(num_experts, *down.shape)}
        probe = torch.randn(len(_PROBE_MAGNITUDES), gate_up.shape[1], generator=torch.Generator().manual_seed(0))
        probe = (probe * torch.tensor(_PROBE_MAGNITUDES).view(-1, 1)).to(gate_up.device)
        ids = torch.zeros(len(_PROBE_MAGNITUDES), 1, dtype=torch.int64, device=gate_up.device)
        weights = torch.ones(len(_PROBE_MAGNITUDES), 1, device=gate_up.device)
        with torch.no_grad(), _eager_experts(experts):
            own = _functional_call(experts, params, (probe, ids, weights))
            gate, up = torch.nn.functional.linear(probe, gate_up).chunk(2, dim=-1)
            plain = torch.nn.functional.linear(experts.act_fn(gate) * up, down)
    except Exception:  # see above: not the plain form
        return False
    return isinstance(own, torch.Tensor) and own.shape == plain.shape and own.dtype == plain.dtype and \
        torch.equal(own, plain)


# torch.func arrived in torch 2.0 (the older name warns there); the ppc64le CI runs torch 1.13
_functional_call = torch.func.functional_call if hasattr(torch, "func") else torch.nn.utils.stateless.functional_call


@contextlib.contextmanager
def _eager_experts(experts: torch.nn.Module):
    """transformers' experts dispatch on config._experts_implementation; within, `experts` runs the eager loop. Set
    on the internal attribute, as transformers' set_experts_implementation does per module: the property's setter
    would also overwrite the sub-configs' choices."""
    config = getattr(experts, "config", None)
    if "_experts_implementation_internal" not in getattr(config, "__dict__", {}):
        yield
        return
    before = config._experts_implementation_internal
    config._experts_implementation_internal = "eager"
    try:
        yield
    finally:
        config._experts_implementation_internal = before
