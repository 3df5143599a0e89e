"""The model transforms: quantize_model (walk the model, honour skip patterns and ties, build each layer of the
QuantScheme, calibrate what it needs) and fuse_projections; activation_layers, the layers whose activations a scheme
sets; replace_module."""
from __future__ import annotations

import fnmatch
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from ..quant import gptq_layers
from ..quant.calibration import Calibration
from ..scheme import QuantScheme, WeightScheme, check_bool, W4A8 as _W4A8, W8A8 as _W8A8
from .embedding import W8A8Embedding, is_table_lookup
from .experts import W4A8Experts, W8A8Experts, expert_weights, silu_expert_weights
from .fused import W8A8GatedMLP, W8A8LinearSlice
from .linear import W4A8Linear, W8A8Linear, concatenated, same_scheme
from .probes import computes_plain_gated_mlp, is_silu

SkipSpec = Union[None, Iterable[str], Callable[[str, torch.nn.Module], bool]]


def _skipped(skip: SkipSpec, name: str, module: torch.nn.Module) -> bool:
    if skip is None:
        return False
    if callable(skip):
        return bool(skip(name, module))
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in skip)


def _all_named_parameters(module: torch.nn.Module):
    """Every (name, parameter), a shared one under each of its names (named_parameters(remove_duplicate=False)
    needs torch >= 2.0; the ppc64le CI runs Debian's torch 1.13)."""
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for pname, p in owner._parameters.items():
            if p is not None:
                yield (f"{owner_name}.{pname}" if owner_name else pname), p


def _tied_elsewhere(holders: Dict[int, List[str]], names: List[str],
                    module: torch.nn.Module) -> List[Tuple[str, str]]:
    """(parameter of `module`, another name of the same tensor outside it) pairs: the ties replacing it breaks.
    holders: id(parameter) -> every name the model reaches it under."""
    own = {f"{name}.{pname}" for name in names for pname, _ in _all_named_parameters(module)}
    return [(f"{names[0]}.{pname}", other) for pname, p in module.named_parameters()
            for other in holders[id(p)] if other not in own]


SCHEMES = {"w8a8": _W8A8, "w4a8": _W4A8}  # quantize_model's scheme names (the keyword form)


def quantize_model(model: torch.nn.Module, skip: SkipSpec = None, *, quantize_embedding: bool = False,
                   fuse: bool = False, scheme: Union[str, QuantScheme] = "w8a8", group_size: Optional[int] = None,
                   symmetric: Optional[bool] = None, min_max: Optional[bool] = None,
                   calibration: Optional[Calibration] = None,
                   on_layer: Optional[Callable[[int, int], None]] = None) -> torch.nn.Module:
    """Replace every nn.Linear in `model` (in place) with W8A8Linear, and every transformers fused-experts module
    (Mixtral / Qwen2-MoE / Qwen3-MoE `experts`) with W8A8Experts; return the model.

    scheme: a QuantScheme (w8a8_cpu.scheme: W8A8, W8A8_STATIC, W4A8, W4A8_GPTQ, ... or one of your own), or the
    keyword form: "w8a8" (default) or "w4a8" with group_size (default 32), symmetric and min_max changing its int4
    weights (under "w8a8" they must stay unset or at int8's values) and calibration rounding them with GPTQ.
    int4 weights: the Linear layers become W4A8Linear and the fused-experts modules W4A8Experts instead
    (int4 per group of group_size k, 0: per channel; symmetric, or asymmetric with an integer zero point, or min_max:
    quantize_weight_int4; the experts' w13 and w2 alike, always rounded to nearest), except an output layer that
    shares its table with the int8 embedding (quantize_embedding=True), which stays W8A8. Static activations
    (W8A8_STATIC, W8A8_STATIC_ASYMMETRIC): each W8A8Linear then gets its scale (and zero point) from its input's range
    on the calibration inputs (calibrate_static_activations; fused layers stay dynamic); dynamic asymmetric
    activations: each W8A8Linear quantizes each token with a zero point. layer.scheme reports what each layer holds.

    calibration: the inputs of the scheme's calibrated steps (required by GPTQ rounding and static activations,
    refused otherwise). Model inputs (token ids [B, T], checked against config.vocab_size when the model has one), an
    iterable of such batches, or (GPTQ only) a callable(model) that runs the model (inputs of another form); a batch
    the model cannot run is a ValueError naming it. GPTQ: one run of the float model records each int4 layer's input
    second moment (its Hessian), and each layer is then rounded by quantize_weight_int4 with it, to minimize its
    output error on those inputs. on_layer(i, n) is called after each of the n layers GPTQ rounds (a progress bar:
    SmolLM2-135M takes ~40 s on 2 threads, its calibration run included).

    skip: module-name glob patterns (e.g. ["lm_head", "*.gate"]) or a callable(name, module) -> bool
    selecting layers to keep in floating point. What quantize_model cannot run in W8A8 is refused (ValueError naming
    the layer, before any layer is replaced) unless skipped, so that no layer is left float silently: transformers'
    Conv1D (GPT-2), and experts that compute more than silu(gate) * up (DeepSeek-V4's clamp).

    quantize_embedding: also hold the input token embedding (model.get_input_embeddings(), a transformers model's)
    as an int8 table with per-row scales (W8A8Embedding). When the output layer is tied to it and not skipped, both
    share one int8 table: the lm_head GEMM and the embedding lookup read the same tensors, one copy; a tied output
    layer kept float (skipped) is refused: the int8 embedding would untie it.

    fuse: also fuse each attention layer's q_proj / k_proj / v_proj into one GEMM (W8A8LinearSlice) and each SwiGLU
    MLP's gate_proj / up_proj into one GEMM with SiLU-and-multiply after it (W8A8GatedMLP); see fuse_projections.

    A module used at several places (one nn.Linear instance applied twice) is quantized once and the same
    replacement is installed at every place, so they stay shared; it is kept float if any of its names is skipped.
    A parameter tied to another module's (a transformers lm_head whose weight is the input embedding's, with
    tie_word_embeddings) cannot stay tied to an int8 copy: without quantize_embedding, quantizing that layer unties
    them, with a warning; the other module (the embedding) keeps the float tensor unchanged. Skip the layer
    (skip=["lm_head"]) to keep the float tie. Once quantized, model.get_output_embeddings() returns the W8A8Linear,
    which has no float `weight`: reading it raises AttributeError and assigning one (model.tie_weights(),
    resize_token_embeddings) raises ValueError."""
    scheme = _model_scheme(scheme, group_size, symmetric, min_max, calibration)
    weights, activations = scheme.weights, scheme.activations
    group_size, symmetric, min_max = weights.group_size, weights.symmetric, weights.min_max
    check_bool("quantize_embedding", quantize_embedding)
    check_bool("fuse", fuse)
    if isinstance(skip, str):
        skip = [skip]
    embedding = _input_embedding(model) if quantize_embedding else None
    places: Dict[torch.nn.Module, List[str]] = {}  # module -> every name it is used under (modules hash by identity)
    transposed: Dict[torch.nn.Module, List[str]] = {}  # the same for GPT-2's Conv1D layers, which are not supported
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, torch.nn.Linear) or expert_weights(module) is not None:
            places.setdefault(module, []).append(name)
        elif type(module).__name__ == "Conv1D":  # transformers.pytorch_utils.Conv1D: weight [in, out], no nn.Linear
            transposed.setdefault(module, []).append(name)
    for module, names in transposed.items():
        if not any(_skipped(skip, name, module) for name in names):  # left float, the model "W8A8" in name only
            raise ValueError(f"{names[0]}: {type(module).__name__} (transformers' transposed linear of GPT-2 and its "
                             f"kin, weight [in, out]) is not supported by quantize_model; skip these layers to keep "
                             f"them float (skip=['{names[0]}', ...] or a callable)")
    holders: Dict[int, List[str]] = {}
    for name, p in _all_named_parameters(model):
        holders.setdefault(id(p), []).append(name)
    shares_embedding = None  # the W8A8Linear tied to the embedding, which the int8 embedding reads
    chosen: Dict[torch.nn.Module, Tuple[List[str], bool]] = {}  # what is quantized: its names, tied to the embedding
    int4: Dict[torch.nn.Linear, str] = {}  # the Linear layers that become W4A8Linear, by their first name
    for module, names in places.items():
        if any(_skipped(skip, name, module) for name in names):
            continue
        if "" in names:
            raise ValueError("model: is itself a Linear / experts module; use W8A8Linear.from_linear or "
                             "W8A8Experts.from_experts instead")
        if not isinstance(module, torch.nn.Linear):  # refused before any layer is replaced: the model stays whole
            try:
                silu_expert_weights(module)
            except ValueError as error:
                raise ValueError(f"{names[0]}: {error}") from error
        tied_to_embedding = embedding is not None and getattr(module, "weight", None) is embedding.weight
        for tied, other in _tied_elsewhere(holders, names, module):
            if not tied_to_embedding:
                warnings.warn(f"quantize_model: {tied} is tied to {other}; quantizing {names[0]} unties them: it gets "
                              f"an int8 copy, {other} keeps the float tensor. Skip {names[0]} to keep the tie, or "
                              f"pass quantize_embedding=True to share one int8 table.", stacklevel=2)
        chosen[module] = names, tied_to_embedding
        if weights.bits == 4 and not tied_to_embedding and isinstance(module, torch.nn.Linear):
            int4[module] = names[0]
    if embedding is not None:
        _check_table_shared(model, embedding, holders, chosen)
    # GPTQ measures on the float model, before any layer is replaced
    gptq = gptq_layers.round_with_gptq(model, int4, calibration, group_size, symmetric, min_max, on_layer) \
        if weights.rounding == "gptq" else {}
    for module, (names, tied_to_embedding) in chosen.items():
        try:  # the layer's name in the error (a NaN weight): "w: ..." alone does not say which of hundreds
            if not isinstance(module, torch.nn.Linear):
                replacement = W4A8Experts.from_experts(module, group_size, symmetric, min_max) \
                    if weights.bits == 4 else W8A8Experts.from_experts(module)
            elif module in gptq:
                replacement = W4A8Linear(*gptq.pop(module), group_size, module.bias, weights=weights)
            elif module in int4:
                replacement = W4A8Linear.from_linear(module, group_size, symmetric, min_max)
            else:
                replacement = W8A8Linear.from_linear(module)
        except ValueError as error:
            raise ValueError(f"{names[0]}: {error}") from error
        if tied_to_embedding:
            shares_embedding = replacement
        for name in names:
            replace_module(model, name, replacement)
    if embedding is not None:
        model.set_input_embeddings(W8A8Embedding.sharing(shares_embedding, embedding.weight.dtype,
                                                         getattr(embedding, "column_scale", None))
                                   if shares_embedding is not None else W8A8Embedding.from_embedding(embedding))
    if fuse:
        fuse_projections(model)
    if activations.static:
        from ..quant.static_activations import calibrate_static_activations  # lazily: it builds on nn

        calibrate_static_activations(model, calibration, symmetric=activations.symmetric)
    elif not activations.symmetric:
        for layer in activation_layers(model).values():
            layer.set_activations(symmetric=False)
    return model


def _model_scheme(scheme: Union[str, QuantScheme], group_size: Optional[int], symmetric: Optional[bool],
                  min_max: Optional[bool], calibration) -> QuantScheme:
    """quantize_model's scheme: a QuantScheme as given, or the one its keyword form builds (calibration given: GPTQ
    rounding), validated; calibration given where the scheme has no use for it, or missing where it needs it, is an
    error."""
    if isinstance(scheme, QuantScheme):
        given = [name for name, value in (("group_size", group_size), ("symmetric", symmetric), ("min_max", min_max))
                 if value is not None]
        if given:
            raise ValueError(f"{given[0]}: the QuantScheme given as scheme states it; pass one or the other")
    elif isinstance(scheme, str) and scheme in SCHEMES:
        base = SCHEMES[scheme].weights
        scheme = QuantScheme(WeightScheme(base.bits, base.group_size if group_size is None else group_size,
                                          base.symmetric if symmetric is None else symmetric,
                                          base.min_max if min_max is None else min_max,
                                          "gptq" if calibration is not None else "nearest"))
    else:
        raise ValueError(f"scheme: expected one of {', '.join(SCHEMES)} or a QuantScheme, got {scheme!r}")
    scheme.validate()
    calibrated = [step for step, used in (("GPTQ rounding", scheme.weights.rounding == "gptq"),
                                          ("static activations", scheme.activations.static)) if used]
    if calibrated and calibration is None:
        raise ValueError(f"calibration: the scheme's {' and '.join(calibrated)} need calibration inputs")
    if calibration is not None and not calibrated:
        raise ValueError("calibration: the scheme rounds to nearest and quantizes activations dynamically: nothing "
                         "would use it")
    return scheme


def activation_layers(model: torch.nn.Module) -> Dict[str, W8A8Linear]:
    """The W8A8Linear layers (by name) whose input activations a scheme sets: int4 layers run dynamic symmetric ones,
    and the layer behind fused q/k/v slices runs one dynamic quantization for all three (checkpoints store it per
    slice without activation parameters: a static scale there would change the model and be lost on save)."""
    behind_slices = {id(m.fused) for m in model.modules() if isinstance(m, W8A8LinearSlice)}
    return {name: m for name, m in model.named_modules() if type(m) is W8A8Linear and id(m) not in behind_slices}


def _check_table_shared(model: torch.nn.Module, embedding: torch.nn.Embedding, holders: Dict[int, List[str]],
                        chosen: Dict[torch.nn.Module, Tuple[List[str], bool]]) -> None:
    """quantize_embedding: every other holder of the embedding's float table (a tied lm_head) must be quantized with
    it, to share the int8 table. One kept float (skipped) was untied silently: the model then held the table twice
    (int8 and float), and its config still said tied."""
    own = {f"{name}.weight" for name, m in model.named_modules(remove_duplicate=False) if m is embedding}
    sharing = {f"{name}.weight" for names, tied in chosen.values() if tied for name in names}
    kept = [name for name in holders.get(id(embedding.weight), []) if name not in own | sharing]
    if kept:
        layer = kept[0].rpartition(".")[0]
        raise ValueError(f"quantize_embedding: {layer} is tied to the input embedding ({kept[0]} is its table) and is "
                         f"kept float (skipped); an int8 embedding would untie them and hold the table twice. Quantize "
                         f"{layer} too (drop it from skip: both share one int8 table), or pass "
                         f"quantize_embedding=False to keep both float and tied")


def _input_embedding(model: torch.nn.Module) -> torch.nn.Embedding:
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if not isinstance(embedding, torch.nn.Embedding) or not hasattr(model, "set_input_embeddings"):
        raise ValueError(f"quantize_embedding: {type(model).__name__} has no nn.Embedding input embedding "
                         f"(get_input_embeddings / set_input_embeddings, as transformers models have)")
    if not is_table_lookup(embedding):
        raise ValueError(f"quantize_embedding: {type(model).__name__}'s input embedding ({type(embedding).__name__}) "
                         f"computes more than a row lookup (a scale after it, max_norm), which the int8 table would "
                         f"drop")
    return embedding


_QKV = ("q_proj", "k_proj", "v_proj")


def fuse_projections(model: torch.nn.Module) -> Dict[str, List[str]]:
    """Fuse the projections that read the same input into one W8A8 GEMM each, in place: every module whose q_proj,
    k_proj and v_proj are W8A8Linear layers of one input size (attention) gets W8A8LinearSlice views of one W8A8Linear
    over their concatenated output channels (one activation quantization, one weight stream); every SiLU-gated MLP
    with W8A8Linear gate_proj / up_proj / down_proj becomes a W8A8GatedMLP. The q, k, v, gate and up outputs are bit
    for bit those of the separate layers (per-channel weights, per-token activations); only the SiLU differs from
    torch's in the last bits. Returns {"attention": [names], "mlp": [names]} of what was fused."""
    fused: Dict[str, List[str]] = {"attention": [], "mlp": []}
    for name, module in list(model.named_modules()):
        parts = [getattr(module, p, None) for p in _QKV]
        if all(isinstance(p, W8A8Linear) for p in parts) and same_scheme(parts):
            whole = concatenated(parts)
            cache: list = []
            begin = 0
            for pname, p in zip(_QKV, parts):
                setattr(module, pname, W8A8LinearSlice(whole, begin, begin + p.out_features, cache))
                begin += p.out_features
            fused["attention"].append(name)
        elif all(isinstance(getattr(module, p, None), W8A8Linear) for p in ("gate_proj", "up_proj", "down_proj")) \
                and same_scheme([module.gate_proj, module.up_proj]) \
                and callable(getattr(module, "act_fn", None)) and is_silu(module.act_fn) and name \
                and computes_plain_gated_mlp(module):
            replace_module(model, name, W8A8GatedMLP.from_mlp(module))
            fused["mlp"].append(name)
    return fused


def replace_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put `module` at the dotted path `name` of `model` (torch.nn.Module.set_submodule, which torch 1.13 lacks)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
