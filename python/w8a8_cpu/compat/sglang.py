"""Drop-in for sglang's CPU W8A8 ops: ``torch.ops.sgl_kernel.*`` backed by w8a8_cpu, and an sglang plugin.

sglang's W8A8 linear and MoE layers call ``torch.ops.sgl_kernel.{convert_weight_packed, per_token_quant_int8_cpu,
int8_scaled_mm_cpu, int8_scaled_mm_with_quant, fused_experts_cpu}``; the real sgl_kernel only provides them on
AMX x86 or i8mm Arm. ``register()`` defines them under the ``sgl_kernel`` namespace with upstream's schemas,
op by op, only where no library (a real sgl_kernel included) has already defined that op: it never overwrites.

Conventions kept from upstream (x86):
- per_token_quant_int8_cpu returns uint8 activations shifted by +128 and fp32 [M] scales; int8_scaled_mm_cpu
  takes them (uint8 is turned back into int8 exactly, x ^ 0x80; int8 activations are accepted as well).
- convert_weight_packed returns a tensor whose shape[0] is N (like upstream's [N, K + 4]), so sglang's own fake
  kernels, which read N from mat2.size(0), compute the right output shapes under torch.compile.
- is_vnni=True: the weight came from convert_weight_packed, or (sglang's Arm path) is a raw int8 [N, K] weight;
  is_vnni=False: raw int8 weight only.
- fused_experts_cpu supports moe_comp_method 1 (INT8_W8A8) with SiLU-and-mul only; inplace=True also writes the
  result into hidden_states.
- bias: any floating dtype (used in fp32); an integer bias is rejected.
Differences: convert_weight_packed takes int8 weights only and returns w8a8_cpu's packed layout: for [N, K] the
blob zero-padded to N whole rows and viewed as uint8 [N, ceil(bytes / N)] (the ops read the blob the header
describes, its first bytes); for [E, N, K] expert weights one blob per expert, [E, bytes]. fused_experts_cpu
declares hidden_states mutable (``Tensor(a0!)``, as vLLM's copy of the kernel declares it); upstream's schema
does not, and torch.compile then reorders or drops the inplace=True write.
The fake kernels are the implementations themselves (their w8a8_cpu ops have fake kernels), so tracing validates
the arguments as running does.

sglang plugin (read in sglang 0.5.23, ``sglang/srt/plugins/__init__.py``): this distribution declares the entry point
``w8a8_cpu = "w8a8_cpu.compat.sglang:plugin"`` in sglang's general-plugin group ``sglang.srt.plugins``. sglang's
``load_plugins()`` calls every such entry point with no arguments, once per process, early in each process it starts
(the engine, the scheduler, the detokenizer, the data-parallel controller, ``sglang serve``), so sglang's own CPU
W8A8 linear and MoE code (its Arm path calls these ops on raw int8 weights) finds the ops with no import by the
user. ``SGLANG_PLUGINS`` (comma-separated entry point names) restricts which plugins load: a list without
``w8a8_cpu`` leaves these ops undefined. An installed sgl_kernel is imported before anything is registered, so a
real sgl_kernel defines its ops first and is never overridden, whichever of the two sglang would import first.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import warnings
from typing import Dict, List, Optional, Tuple

import torch

import w8a8_cpu
from w8a8_cpu._packed_weight import HEADER_BYTES, header_sizes, int8_blob_nbytes

logger = logging.getLogger(__name__)

NAMESPACE = "sgl_kernel"
INT8_W8A8 = 1  # sglang's CPUQuantMethod.INT8_W8A8

SCHEMAS: Dict[str, str] = {
    "convert_weight_packed": "convert_weight_packed(Tensor weight) -> Tensor",
    "per_token_quant_int8_cpu": "per_token_quant_int8_cpu(Tensor A) -> (Tensor, Tensor)",
    "int8_scaled_mm_cpu": "int8_scaled_mm_cpu(Tensor mat1, Tensor mat2, Tensor scales1, Tensor scales2, Tensor? bias, "
    "ScalarType out_dtype, bool is_vnni) -> Tensor",
    "int8_scaled_mm_with_quant": "int8_scaled_mm_with_quant(Tensor mat1, Tensor mat2, Tensor scales2, Tensor? bias, "
    "ScalarType out_dtype, bool is_vnni) -> Tensor",
    "fused_experts_cpu": "fused_experts_cpu(Tensor(a0!) hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, "
    "Tensor topk_ids, bool inplace, int moe_comp_method, Tensor? w1_scale, Tensor? w2_scale, Tensor? w1_zero, "
    "Tensor? w2_zero, int[]? block_size, Tensor? w1_bias, Tensor? w2_bias, float? alpha, float? limit, "
    "bool is_vnni, str? activation=None) -> Tensor",
}

_ops = torch.ops.w8a8_cpu
_library: Optional[torch.library.Library] = None  # kept alive: dropping it would unregister our ops
_registered: List[str] = []


# ---- implementations (CPU) -------------------------------------------------------------------------------------

def _upstream_names(names: Dict[str, str]):
    """The implementation's ValueErrors name upstream's arguments: a w8a8_cpu op's error names its own ("x: ...",
    "w: ..."), which a caller of sgl_kernel's schema does not see; `names` maps them."""
    def wrap(fn):
        @functools.wraps(fn)
        def renamed(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except ValueError as e:
                head, colon, rest = str(e).partition(": ")
                if colon and head in names:
                    raise ValueError(f"{names[head]}: {rest}") from None
                raise
        return renamed
    return wrap


def _is_packed(w: torch.Tensor) -> bool:
    return w.dtype == torch.uint8


def _check_weight(w: torch.Tensor, is_vnni: bool, name: str) -> None:
    if _is_packed(w) and not is_vnni:
        raise ValueError(f"{name}: a packed weight (from convert_weight_packed) needs is_vnni=True; "
                         f"is_vnni=False takes a raw int8 weight")


def _activations_int8(mat1: torch.Tensor) -> torch.Tensor:
    if mat1.dtype == torch.uint8:  # upstream x86 convention: int8 value + 128; x ^ 0x80 undoes it exactly
        return torch.bitwise_xor(mat1, 0x80).view(torch.int8)
    return mat1


def _float_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if bias is None:
        return None
    if not bias.is_floating_point():
        raise ValueError(f"bias: expected a floating-point tensor, got {bias.dtype}")
    return bias.to(torch.float32)


@_upstream_names({"w": "weight"})
def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype != torch.int8:
        raise ValueError(f"weight: w8a8_cpu's sgl_kernel shim packs int8 weights only (W8A8), got {weight.dtype}")
    if weight.dim() == 2:
        blob = _ops.pack_weight(weight.contiguous())
        rows = weight.shape[0]
        padded = blob.new_zeros(rows * -(-blob.numel() // rows))
        padded[:blob.numel()] = blob
        return padded.view(rows, -1)
    if weight.dim() == 3 and weight.shape[0] > 0:
        return torch.stack([_ops.pack_weight(w) for w in weight.contiguous()])
    raise ValueError(f"weight: expected int8 [N, K] or [E, N, K], got shape {tuple(weight.shape)}")


def _blob(mat2: torch.Tensor) -> torch.Tensor:
    """The packed blob inside convert_weight_packed's [N, bytes / N] view: its first bytes, as many as its header
    describes (a bad header is left to the op, which rejects it naming mat2); under tracing, the whole buffer (the
    ops' fake kernels take N from the scales)."""
    if not _is_packed(mat2) or mat2.dim() != 2:
        return mat2
    flat = mat2.reshape(-1)
    if isinstance(flat, torch._subclasses.FakeTensor) or flat.is_meta or flat.numel() < HEADER_BYTES:
        return flat
    declared = int8_blob_nbytes(*header_sizes(flat)[4:])
    return flat[:declared] if HEADER_BYTES <= declared <= flat.numel() else flat


@_upstream_names({"x": "A"})
def per_token_quant_int8_cpu(A: torch.Tensor):
    a_q, a_scale = _ops.per_token_quant_int8(A)
    return torch.bitwise_xor(a_q.view(torch.uint8), 0x80), a_scale.reshape(-1)


@_upstream_names({"x_q": "mat1", "w": "mat2", "x_scale": "scales1", "w_scale": "scales2"})
def int8_scaled_mm_cpu(mat1, mat2, scales1, scales2, bias, out_dtype, is_vnni):
    _check_weight(mat2, is_vnni, "mat2")
    return _ops.int8_scaled_mm(_activations_int8(mat1), _blob(mat2), scales1.reshape(-1, 1), scales2.reshape(-1),
                               _float_bias(bias), out_dtype)


@_upstream_names({"x": "mat1", "w": "mat2", "w_scale": "scales2"})
def int8_scaled_mm_with_quant(mat1, mat2, scales2, bias, out_dtype, is_vnni):
    _check_weight(mat2, is_vnni, "mat2")
    return _ops.int8_scaled_mm_with_quant(mat1, _blob(mat2), scales2.reshape(-1), _float_bias(bias), out_dtype)


@_upstream_names({"hidden": "hidden_states", "w13": "w1", "w13_scale": "w1_scale"})
def fused_experts_cpu(hidden_states, w1, w2, topk_weights, topk_ids, inplace, moe_comp_method, w1_scale, w2_scale,
                      w1_zero, w2_zero, block_size, w1_bias, w2_bias, alpha, limit, is_vnni, activation=None):
    if moe_comp_method != INT8_W8A8:
        raise ValueError(f"moe_comp_method: only 1 (INT8_W8A8) is supported by w8a8_cpu's sgl_kernel shim, "
                         f"got {moe_comp_method}")
    unsupported = {"w1_zero": w1_zero, "w2_zero": w2_zero, "block_size": block_size, "w1_bias": w1_bias,
                   "w2_bias": w2_bias, "alpha": alpha, "limit": limit}
    given = [name for name, value in unsupported.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: not supported for INT8_W8A8 (per-channel, no zero points, blocks, "
                         f"biases or clamped activations); pass None")
    if w1_scale is None or w2_scale is None:
        raise ValueError("w1_scale, w2_scale: INT8_W8A8 needs per-channel fp32 weight scales")
    if activation not in (None, "silu"):
        raise ValueError(f"activation: only 'silu' (SiLU and mul) is supported, got '{activation}'")
    _check_weight(w1, is_vnni, "w1")
    _check_weight(w2, is_vnni, "w2")
    out = _ops.fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, "silu", False)
    if inplace:  # hidden_states is declared mutable, the output not an alias of it: a fresh tensor is returned
        hidden_states.copy_(out)
    return out


_IMPLS = {
    "convert_weight_packed": convert_weight_packed,
    "per_token_quant_int8_cpu": per_token_quant_int8_cpu,
    "int8_scaled_mm_cpu": int8_scaled_mm_cpu,
    "int8_scaled_mm_with_quant": int8_scaled_mm_with_quant,
    "fused_experts_cpu": fused_experts_cpu,
}


# ---- registration ----------------------------------------------------------------------------------------------

def _existing_definition(name: str) -> Optional[str]:
    """Why op sgl_kernel::<name> is taken (a description), or None when nobody has defined it."""
    qualname = f"{NAMESPACE}::{name}"
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
    except RuntimeError:
        return None
    try:
        has_cpu = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU")
    except RuntimeError:
        has_cpu = False
    schema = str(getattr(torch.ops.sgl_kernel, name).default._schema) if hasattr(torch.ops.sgl_kernel, name) else "?"
    return f"already defined by another library ({'with' if has_cpu else 'without'} a CPU kernel): {schema}"


def _import_installed_sgl_kernel() -> str:
    """Imports an installed sgl_kernel, so that its ops are defined before ours: defined after ours, they would collide
    with the names ours took, and its import would fail. One that fails to import (e.g. a CUDA build on a CPU-only
    host) defines nothing. Returns what happened, for the log line ("" when none is installed)."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return ""
    try:
        importlib.import_module("sgl_kernel")
    except Exception as e:  # whatever its import raises; sglang's own probes of sgl_kernel catch any Exception too
        return f"; sgl_kernel is installed but failed to import ({type(e).__name__}: {e})"
    return "; sgl_kernel imported first"


def _define_missing_ops() -> Tuple[Dict[str, object], str]:
    """register()'s work, without its warning and log: ({"registered": [...], "refused": {name: reason}}, the line
    to log)."""
    global _library
    sgl_kernel = _import_installed_sgl_kernel()
    registered: List[str] = []
    refused: Dict[str, str] = {}
    register_fake = getattr(torch.library, "register_fake", None)
    for name, schema in SCHEMAS.items():
        if name in _registered:
            registered.append(name)
            continue
        reason = _existing_definition(name)
        if reason is not None:
            refused[name] = reason
            continue
        if _library is None:
            _library = torch.library.Library(NAMESPACE, "FRAGMENT")
        _library.define(schema)
        _library.impl(name, _IMPLS[name], "CPU")
        if register_fake is not None:
            register_fake(f"{NAMESPACE}::{name}", _IMPLS[name], lib=_library)
        _registered.append(name)
        registered.append(name)
    line = (f"w8a8_cpu.compat.sglang: serving sgl_kernel::{', '.join(registered) or '(none)'} with w8a8_cpu "
            f"(variant {w8a8_cpu.info()['selected_variant']})")
    if refused:
        line += "; refused (never overwrites existing ops): " + "; ".join(
            f"sgl_kernel::{name} {why}" for name, why in refused.items())
    return {"registered": registered, "refused": refused}, line + sgl_kernel


def register() -> Dict[str, object]:
    """Register sglang's CPU W8A8 ops as ``torch.ops.sgl_kernel.*`` where nothing defines them yet.

    Returns {"registered": [names now served by w8a8_cpu], "refused": {name: reason}}. An installed sgl_kernel is
    imported first; an op it (or any other library) defines is refused and left untouched, with a warning naming it.
    Logs one line (a warning when something was refused). Idempotent: a second call reports the ops of the first as
    registered and registers nothing again."""
    outcome, line = _define_missing_ops()
    if outcome["refused"]:
        warnings.warn(line, RuntimeWarning, stacklevel=2)
        logger.warning(line)
    else:
        logger.info(line)
    return outcome


def plugin() -> None:
    """sglang's entry point (group ``sglang.srt.plugins``, see the module docstring): register() for sglang's
    processes, which logs one info line of what is served, what was refused and how an installed sgl_kernel
    imported; refusing is this plugin's expected outcome beside a real sgl_kernel, so it warns of nothing."""
    logger.info(_define_missing_ops()[1])


__all__ = ["register", "plugin", "SCHEMAS", "convert_weight_packed", "per_token_quant_int8_cpu", "int8_scaled_mm_cpu",
           "int8_scaled_mm_with_quant", "fused_experts_cpu"]
