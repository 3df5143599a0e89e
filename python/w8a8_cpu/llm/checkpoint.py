"""W8A8 checkpoints in and out of transformers models, as safetensors.

save_compressed writes a model quantized by w8a8_cpu.nn.quantize_model as a compressed-tensors ``int-quantized``
checkpoint (int8 weights with one fp32 scale per output channel, int8 dynamic per-token activations), the format
vLLM, sglang and transformers read. load_quantized reads such checkpoints (and sglang's ``w8a8_int8`` layout) back
into a transformers model built from its config.json, with W8A8Linear / W8A8Experts in place of the quantized
layers and without ever creating their float weights.

Checkpoint files are untrusted input: every field and tensor is validated before use, a scheme these kernels cannot
run exactly is refused, and every error is a ValueError naming the file and the tensor, layer or field.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field as dataclass_field

try:  # the regex parser, to refuse patterns that backtrack exponentially
    from re import _parser as _re_parser
except ImportError:  # Python < 3.11
    import sre_parse as _re_parser
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .._files import open_regular, publish, read_json_object, staging_folder, writing
from .._functions import check_static_activation_params
from .._packed_weight import is_int4_group
from .pack_quantized import pack_int4_rows, unpack_int4_rows
from ..nn import (ColumnScaledEmbedding, W4A8Experts, W4A8Linear, W8A8Embedding, W8A8Experts, W8A8GatedMLP,
                  W8A8Linear, W8A8LinearSlice, W8A8MoE, _expert_weights,
                  fuse_projections, quantize_model, _replace_module, _require_plain_silu_experts)

PathLike = Union[str, Path]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
# config.json key of what only this package reads back: {"int8_embedding": true} when the token embedding (and an
# lm_head tied to it) was held as one int8 table; the checkpoint stores that table as floats, so other readers load it
# as a float embedding and ignore the key
OWN_CONFIG_KEY = "w8a8_cpu"
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_MAX_ECHO = 96  # characters of a checkpoint-supplied name or value quoted back in an error message
_MAX_LISTED = 5  # names listed when reporting a set of missing / unexpected tensors

_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_MODEL_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _echo(value) -> str:
    """repr of a checkpoint-supplied value, cut to _MAX_ECHO characters (the files are untrusted)."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > _MAX_ECHO:
        text = text[:_MAX_ECHO] + "..."
    return repr(text) if isinstance(value, str) else text


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(_echo(n) for n in sorted(names)[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


# ---- checkpoint naming -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _ExpertNaming:
    block: str  # the MoE block's name in checkpoints (transformers 5 calls it `mlp` in the module tree)
    projections: Tuple[str, str, str]  # each expert's (gate, up, down) Linear


# transformers 5 fuses each MoE block's experts into 3-D gate_up_proj [E, 2I, H] / down_proj [E, H, I] parameters;
# checkpoints (vLLM, sglang, transformers 4, and transformers 5's own save_pretrained) keep one Linear per expert
# and projection. The names are transformers 5's conversion_mapping for these model types, reversed.
_EXPERT_NAMING: Dict[str, _ExpertNaming] = {
    "mixtral": _ExpertNaming("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": _ExpertNaming("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": _ExpertNaming("mlp", ("gate_proj", "up_proj", "down_proj")),
}


class _Naming:
    """Checkpoint names of a transformers 5 model's modules: the model's own, except in MoE blocks."""

    def __init__(self, config):
        self.model_type = getattr(config, "model_type", None)
        self.experts = _EXPERT_NAMING.get(self.model_type)

    def checkpoint_name(self, name: str) -> str:
        if self.experts is None or self.experts.block == "mlp":
            return name
        return re.sub(r"(?<![^.])mlp(?![^.])", self.experts.block, name)

    def expert_linears(self, module_name: str, num_experts: int) -> List[Tuple[str, str, str]]:
        """Per expert, the checkpoint names of its (gate, up, down) Linear layers."""
        if self.experts is None:
            raise ValueError(f"model: {module_name} is a fused-experts module, but the per-expert checkpoint naming "
                             f"of model_type {self.model_type!r} is unknown (known: {sorted(_EXPERT_NAMING)})")
        prefix = self.checkpoint_name(module_name)
        return [tuple(f"{prefix}.{e}.{p}" for p in self.experts.projections) for e in range(num_experts)]


def _tied_weights(model) -> Dict[str, str]:
    """{tied parameter: the parameter it is tied to} as the model's config has it now (lm_head.weight ->
    model.embed_tokens.weight when tie_word_embeddings); the tied one is not stored in checkpoints."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    return expand(all_submodels=True) if expand is not None else {}


def _is_router(module: torch.nn.Module) -> bool:
    """A float layer that other readers build as a Linear: transformers 5's MoE routers (TopKRouter modules that
    hold a 2-D `weight` of their own) are plain nn.Linear in vLLM, sglang and transformers 4."""
    weight = dict(module.named_parameters(recurse=False)).get("weight")
    return weight is not None and weight.dim() == 2 and not isinstance(module, (torch.nn.Linear, torch.nn.Embedding))


# ---- save ------------------------------------------------------------------------------------------------------

_INT8_CHANNEL_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
                         "dynamic": False}


def _int4_weights(group_size: int, symmetric: bool) -> dict:
    """compressed-tensors' QuantizationArgs of int4 weights per group (0: per channel), symmetric or with zero
    points."""
    return {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group" if group_size else "channel",
            "group_size": group_size or None, "dynamic": False}


@dataclass(frozen=True)
class ActivationArgs:
    """A layer's int8 input activations: static (one stored scale, `input_scale`, strategy "tensor") or dynamic
    per token (strategy "token"), symmetric or with a zero point (`input_zero_point` when static)."""
    static: bool
    symmetric: bool


DYNAMIC_TOKEN = ActivationArgs(static=False, symmetric=True)  # the default: the fused op's per-token quantization


def _activation_quantization_args(activations: ActivationArgs) -> dict:
    """compressed-tensors' QuantizationArgs of int8 input activations (static: per tensor; dynamic: per token)."""
    return {"num_bits": 8, "type": "int", "symmetric": activations.symmetric,
            "strategy": "tensor" if activations.static else "token", "group_size": None,
            "dynamic": not activations.static}


def _compressed_tensors_config(ignore: List[str], int4_layers: Dict[str, Tuple[int, bool]],
                               activation_layers: Dict[str, ActivationArgs], has_int8: bool) -> dict:
    """int8 layers: one group targeting Linear (int-quantized, dynamic per-token activations), and one group per other
    activation kind naming its layers; int4 layers ({name: (group size, symmetric)}): one pack-quantized group per kind
    naming them (exact names take precedence over the class target)."""
    groups = {}
    if has_int8 or not int4_layers:
        groups["group_0"] = {"targets": ["Linear"], "weights": dict(_INT8_CHANNEL_WEIGHTS),
                             "input_activations": _activation_quantization_args(DYNAMIC_TOKEN),
                             "output_activations": None, "format": "int-quantized"}
    names = (f"group_{i}" for i in range(1, len(activation_layers) + len(int4_layers) + 1))
    for activations in sorted(set(activation_layers.values()), key=lambda a: (a.static, a.symmetric)):
        groups[next(names)] = {
            "targets": sorted(n for n, a in activation_layers.items() if a == activations),
            "weights": dict(_INT8_CHANNEL_WEIGHTS), "input_activations": _activation_quantization_args(activations),
            "output_activations": None, "format": "int-quantized"}
    for kind in sorted(set(int4_layers.values())):
        groups[next(names)] = {
            "targets": sorted(n for n, k in int4_layers.items() if k == kind), "weights": _int4_weights(*kind),
            "input_activations": _activation_quantization_args(DYNAMIC_TOKEN), "output_activations": None,
            "format": "pack-quantized"}
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


def _expert_tensors(names, gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale=None, down_scale=None):
    """Per-expert checkpoint tensors of fused experts (int8 + scales, or float when the scales are None)."""
    inter = gate_up.shape[1] // 2
    out = {}
    for e, (gate, up, down_name) in enumerate(names):
        for name, rows in ((gate, slice(0, inter)), (up, slice(inter, 2 * inter))):
            out[f"{name}.weight"] = gate_up[e, rows].clone()  # clones: safetensors refuses tensors sharing storage
            if gate_up_scale is not None:
                out[f"{name}.weight_scale"] = gate_up_scale[e, rows].reshape(-1, 1).clone()
        out[f"{down_name}.weight"] = down[e].clone()
        if down_scale is not None:
            out[f"{down_name}.weight_scale"] = down_scale[e].reshape(-1, 1).clone()
    return out


def _checkpoint_tensors(model: torch.nn.Module, naming: _Naming):
    """(tensors by checkpoint name, checkpoint names of the Linear-like layers kept float)."""
    tensors: Dict[str, torch.Tensor] = {}
    float_layers: List[str] = []
    int4_layers: Dict[str, Tuple[int, bool]] = {}  # checkpoint name -> (group size (0: per channel), symmetric)
    activation_layers: Dict[str, ActivationArgs] = {}  # int8 layers whose activations are not DYNAMIC_TOKEN
    written_per_layer = set()  # model names of the modules whose tensors are written here, not from state_dict

    def linear(name: str, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        prefix = naming.checkpoint_name(name)
        tensors[f"{prefix}.weight"] = weight.contiguous()
        tensors[f"{prefix}.weight_scale"] = scale.reshape(-1, 1).clone()  # clones: no storage shared in safetensors
        if bias is not None:
            tensors[f"{prefix}.bias"] = bias.clone()

    def int4(prefix: str, where: str, q: torch.Tensor, scale: torch.Tensor, minimum: Optional[torch.Tensor],
             group: int, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """int4 values (a W4A8Linear's, or one expert projection's) as pack-quantized tensors under `prefix`:
        symmetric, or minimums that are integer zero points (-scale * z, z in [-8, 7]); `where` names the module."""
        zero = None if minimum is None else torch.round(-minimum / scale).clamp(-8, 7)
        if (zero is not None and not torch.equal(-scale * zero, minimum)) or \
                not torch.equal(w_scale, torch.ones_like(w_scale)):
            raise ValueError(f"model: {where} holds int4 weights whose per-group minimums are not integer zero points "
                             f"(min_max rounding) or that have channel scales, which compressed-tensors' int4 format "
                             f"cannot hold exactly; quantize without min_max to save it")
        if zero is not None:  # packed 8 per int32 along the channels, as compressed-tensors packs zero points
            tensors[f"{prefix}.weight_zero_point"] = pack_int4_rows(zero.to(torch.int8).T.contiguous()).T.contiguous()
        tensors[f"{prefix}.weight_packed"] = pack_int4_rows(q)
        tensors[f"{prefix}.weight_scale"] = scale.clone()
        tensors[f"{prefix}.weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
        if bias is not None:
            tensors[f"{prefix}.bias"] = bias.clone()
        int4_layers[prefix] = (group, zero is None)

    def layer(name: str, module: W8A8Linear) -> None:
        """A W8A8Linear as int-quantized tensors, a W4A8Linear as pack-quantized ones."""
        if isinstance(module, W4A8Linear):
            return int4(naming.checkpoint_name(name), name, *module.int4_weight(), module.w_scale, module.bias)
        linear(name, module.int8_weight(), module.w_scale, module.bias)
        activations = ActivationArgs(module.input_scale is not None, module.symmetric_activations)
        if activations != DYNAMIC_TOKEN:
            prefix = naming.checkpoint_name(name)
            activation_layers[prefix] = activations
            for key in ("input_scale", "input_zero_point"):  # compressed-tensors' dtypes: fp32 [1], int8 [1]
                value = getattr(module, key)
                if value is not None:
                    tensors[f"{prefix}.{key}"] = value.to(torch.int8 if key == "input_zero_point" else torch.float32)

    def int4_experts(name: str, module: W4A8Experts) -> None:
        """Each expert's gate, up and down projections as pack-quantized layers (the per-expert names)."""
        inter = module.intermediate_dim
        w13, w2 = module.int4_weights()
        for e, names in enumerate(naming.expert_linears(name, module.num_experts)):
            parts = ((w13, module.w13_scale, slice(0, inter)), (w13, module.w13_scale, slice(inter, 2 * inter)),
                     (w2, module.w2_scale, slice(None)))
            for prefix, ((q, scale, minimum, group), w_scale, rows) in zip(names, parts):
                int4(prefix, f"{name} (expert {e})", q[e, rows], scale[e, rows],
                     None if minimum is None else minimum[e, rows], group, w_scale[e, rows])

    # an int8 embedding is written as floats (what every reader takes for an embedding), and an lm_head reading the
    # same int8 table as the tied float lm_head that it stands for: not written, float in the config
    int8_tables = {id(m.weight_packed) for m in model.modules() if isinstance(m, W8A8Embedding)}
    # the fused layers behind W8A8LinearSlice views are written per slice, under the unfused names
    behind_slices = {id(m.fused) for m in model.modules() if isinstance(m, W8A8LinearSlice)}
    written_per_layer.update(name for name, module in model.named_modules(remove_duplicate=False)
                             if id(module) in behind_slices)
    for name, module in model.named_modules():
        if isinstance(module, W8A8MoE):
            raise ValueError(f"model: {name} is a W8A8MoE, which has no checkpoint layout; quantize_model's "
                             f"W8A8Experts replaces transformers' experts modules and can be saved")
        if id(module) in behind_slices:
            continue
        if isinstance(module, W8A8Embedding):
            tensors[naming.checkpoint_name(f"{name}.weight")] = module.dequantized().contiguous()
        elif isinstance(module, W8A8Linear) and id(module.weight_packed) in int8_tables:
            float_layers.append(naming.checkpoint_name(name))
        elif isinstance(module, W8A8Linear):
            layer(name, module)
        elif isinstance(module, W8A8LinearSlice):
            layer(name, module.layer())
        elif isinstance(module, W8A8GatedMLP):  # written as gate_proj / up_proj; down_proj is a W8A8Linear child
            for part, projection in module.projections().items():
                layer(f"{name}.{part}", projection)
        elif isinstance(module, W4A8Experts):
            int4_experts(name, module)
        elif isinstance(module, W8A8Experts):
            names = naming.expert_linears(name, module.num_experts)
            tensors.update(_expert_tensors(names, *module.int8_weights(), module.w13_scale, module.w2_scale))
        elif _expert_weights(module) is not None:  # experts that quantize_model was told to skip
            gate_up, down = (w.detach() for w in _expert_weights(module))
            names = naming.expert_linears(name, gate_up.shape[0])
            tensors.update(_expert_tensors(names, gate_up, down))
            float_layers += [layer for expert in names for layer in expert]
        else:
            if isinstance(module, torch.nn.Linear) or _is_router(module):
                float_layers.append(naming.checkpoint_name(name))
            continue
        written_per_layer.add(name)

    # the ties the config declares (lm_head.weight = embed_tokens.weight) are not written: readers tie them again. A
    # tensor shared under other names (tied by hand, the config saying untied) is written under each, as readers
    # build those apart; a copy, since safetensors refuses two names of one storage.
    tied = set(_tied_weights(model))
    seen = set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if key in tied or key.rpartition(".")[0] in written_per_layer:
            continue
        tensors[naming.checkpoint_name(key)] = tensor.detach().clone() if id(tensor) in seen else \
            tensor.detach().contiguous()
        seen.add(id(tensor))
    return tensors, float_layers, int4_layers, activation_layers


def _shards(tensors: Dict[str, torch.Tensor], max_shard_bytes: Optional[int]) -> List[Dict[str, torch.Tensor]]:
    """Tensors grouped in order into shards of at most max_shard_bytes (a larger tensor gets a shard of its own)."""
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def _owner(model: torch.nn.Module, parameter: str) -> Optional[torch.nn.Module]:
    """The module holding the parameter named `parameter`, None when the model has no such module."""
    try:
        return model.get_submodule(parameter.rpartition(".")[0])
    except AttributeError:
        return None


def _is_int8_table(model: torch.nn.Module, source: str) -> bool:
    """Whether the tied-to `source` weight is the table of a W8A8Embedding (quantize_embedding=True)."""
    return isinstance(_owner(model, source), W8A8Embedding)


def _reads_int8_table(model: torch.nn.Module, target: str, source: str) -> bool:
    """Whether the tied `target` weight is a W8A8Linear reading the int8 table of the W8A8Embedding at `source` (the
    tie of quantize_model(quantize_embedding=True): one table for both)."""
    layer = _owner(model, target)
    return isinstance(layer, W8A8Linear) and _is_int8_table(model, source) and \
        layer.weight_packed is _owner(model, source).weight_packed


# Tokenizer files a transformers checkpoint directory may hold (copied by save_compressed from a source directory).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
# the folder where a transformers tokenizer saves its chat templates beyond the default one (transformers'
# CHAT_TEMPLATE_DIR): the writer's own, replaced whole
TOKENIZER_FOLDER = "additional_chat_templates"


def _save_tokenizer(tokenizer, directory: Path) -> None:
    """tokenizer: an object with save_pretrained (a transformers tokenizer), or a directory whose tokenizer files
    (TOKENIZER_FILES) are copied: each a regular file or a link to one (a Hugging Face snapshot links every file into
    its blobs); any other kind of entry raises ValueError naming it."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
        return
    source = Path(tokenizer)
    if not source.is_dir():
        raise ValueError(f"tokenizer: expected a tokenizer or a directory holding its files, got {_echo(str(tokenizer))}")
    present = [name for name in TOKENIZER_FILES if os.path.lexists(source / name)]
    if not present:
        raise ValueError(f"tokenizer: {source} holds none of the tokenizer files ({', '.join(TOKENIZER_FILES)})")
    for name in present:
        with os.fdopen(open_regular(source / name), "rb") as src, writing(directory / name), \
                open(directory / name, "xb") as dst:
            shutil.copyfileobj(src, dst)  # streamed: no whole file of the source in memory


def save_compressed(model: torch.nn.Module, directory: PathLike, max_shard_bytes: Optional[int] = None,
                    tokenizer=None) -> None:
    """Write a transformers model quantized by quantize_model as a compressed-tensors checkpoint in `directory`.

    config.json is the model's config plus a quantization_config (quant_method "compressed-tensors", format
    "int-quantized", status "compressed"; one group targeting Linear: int8 symmetric per-channel weights, int8
    symmetric dynamic per-token input activations; `ignore` names every Linear-like layer kept float, MoE routers
    included). Quantized layers are stored as `<layer>.weight` int8 [N, K] and `<layer>.weight_scale` fp32 [N, 1];
    everything else in the model's float dtype. Fused MoE experts are written per expert under the names vLLM,
    sglang and transformers read (Mixtral `block_sparse_moe.experts.E.w1/w3/w2`, Qwen2/3-MoE
    `mlp.experts.E.gate_proj/up_proj/down_proj`; W4A8Experts as pack-quantized layers under those names, as W4A8Linear
    layers are written); a tied lm_head is not written. An int8 token embedding
    (W8A8Embedding, quantize_embedding=True) is written as its float table (int8 * row scale, in the model's dtype),
    and an lm_head reading that table is written as the tied float lm_head it stands for (in `ignore`; vLLM and
    transformers read such a checkpoint as they read any other), with config.json's "w8a8_cpu": {"int8_embedding":
    true} telling load_quantized to hold the table in int8 again. With max_shard_bytes the tensors are
    split into `model-0000i-of-0000n.safetensors` shards listed by model.safetensors.index.json (one shard is
    written as model.safetensors). generation_config.json is written when the model has one; tokenizer (a
    transformers tokenizer, or the source checkpoint directory whose tokenizer files are copied) is saved beside it,
    so that servers (vLLM) load the directory as it is. Every file written is readable by other users (0644: a
    server often runs as another user). Every file is written whole into a staging folder and put in place by one
    rename, which replaces a link at its name instead of writing through it (a copied Hugging Face snapshot links its
    files into the source model's blobs) and never opens a FIFO; a directory at one of those names raises
    ValueError naming it. Before the files are put in place, an earlier checkpoint's weight files (and its tokenizer
    files, when a tokenizer is written) are removed from `directory`, so that none of it ships with this one; other
    files there are left as they are. A save killed midway leaves a .w8a8_cpu-staging-* folder there (delete it); the
    earlier checkpoint stays whole until the new one is staged, so the disk needs room for both."""
    if max_shard_bytes is not None and (not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0):
        raise ValueError(f"max_shard_bytes: expected a positive int or None, got {max_shard_bytes!r}")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"model: expected a transformers model with a config, got {type(model).__name__}")
    for name, module in model.named_modules():
        if isinstance(module, ColumnScaledEmbedding) or getattr(module, "column_scale", None) is not None:
            # the float readers would take the scaled table for the embedding, or tie the lm_head to it
            raise ValueError(f"model: {name} reads its table through a column scale (smooth_quant's output_alpha), "
                             f"which compressed-tensors checkpoints cannot express; smooth without output_alpha "
                             f"to save")
    for target, source in _tied_weights(model).items():
        try:
            tied = model.get_parameter(target) is model.get_parameter(source)
        except AttributeError:  # e.g. lm_head replaced by a W8A8Linear, which has no weight parameter
            tied = _reads_int8_table(model, target, source)
        if not tied and _is_int8_table(model, source):
            raise ValueError(f"model: its config ties {target} to {source}, an int8 embedding table "
                             f"(quantize_embedding=True), but {target} is held apart from it (e.g. kept float by "
                             f"`skip`), which a checkpoint cannot express: quantize with quantize_embedding=True "
                             f"without skipping {target.rpartition('.')[0]} (it then reads the int8 table), or "
                             f"with quantize_embedding=False")
        if not tied:
            raise ValueError(f"model: its config ties {target} to {source}, but the model holds {target} apart "
                             f"(quantized or untied); keep it float and tied (skip it in quantize_model), or set "
                             f"config.tie_word_embeddings = False")
    tensors, float_layers, int4_layers, activation_layers = _checkpoint_tensors(model, _Naming(config))
    has_int8 = any(t.dtype == torch.int8 for t in tensors.values())  # int8 weights (int4 ones are packed in int32)

    config_dict = config.to_dict()
    config_dict["architectures"] = [type(model).__name__]
    config_dict["dtype"] = str(model.dtype).removeprefix("torch.")
    config_dict["quantization_config"] = _compressed_tensors_config(float_layers, int4_layers, activation_layers,
                                                                    has_int8)
    config_dict.pop(OWN_CONFIG_KEY, None)
    if any(isinstance(m, W8A8Embedding) for m in model.modules()):
        config_dict[OWN_CONFIG_KEY] = {"int8_embedding": True}

    directory = Path(directory)
    with writing(directory):
        directory.mkdir(parents=True, exist_ok=True)
    with staging_folder(directory) as stage:
        with writing(directory / CONFIG_FILE):
            (stage / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        if getattr(model, "generation_config", None) is not None:
            with writing(directory / GENERATION_FILE):
                model.generation_config.save_pretrained(stage)
        if tokenizer is not None:
            _save_tokenizer(tokenizer, stage)
        shards = _shards(tensors, max_shard_bytes)
        names = [SINGLE_FILE] if len(shards) == 1 else \
            [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        for file_name, shard in zip(names, shards):
            try:
                save_file(shard, str(stage / file_name), metadata={"format": "pt"})
            except (OSError, SafetensorError) as e:  # safetensors reports I/O errors as SafetensorError
                raise ValueError(f"{directory / file_name}: cannot be written ({e})") from None
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map = {key: file_name for file_name, shard in zip(names, shards) for key in shard}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with writing(directory / INDEX_FILE):
                (stage / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        files = sorted(stage.iterdir())
        _remove_earlier_checkpoint(directory, [f.name for f in files], tokenizer is not None)
        for file in files:
            publish(file, directory / file.name)


def _remove_earlier_checkpoint(directory: Path, staged: List[str], tokenizer_written: bool) -> None:
    """Before the `staged` files are put in place: remove what an earlier checkpoint in `directory` left that would be
    read with ours, its weight files (single file, shards, index) always, and its tokenizer files (TOKENIZER_FILES,
    TOKENIZER_FOLDER) when this save writes a tokenizer (a stale chat_template.jinja would ship with it). A tokenizer
    the caller saved there stays when this save writes none; other files are the caller's. A directory at the name of
    a file to remove or to write raises ValueError naming it, before anything is removed."""
    names = {SINGLE_FILE, INDEX_FILE, *(TOKENIZER_FILES if tokenizer_written else ())}
    stale = [entry for entry in directory.iterdir() if entry.name in names or _SHARD_PATTERN.fullmatch(entry.name)
             or (tokenizer_written and entry.name == TOKENIZER_FOLDER)]
    for entry in [*stale, *(directory / name for name in staged)]:
        if entry.name != TOKENIZER_FOLDER and entry.is_dir() and not entry.is_symlink():
            raise ValueError(f"{entry}: is a directory where the checkpoint writes a file; delete it or write the "
                             f"checkpoint elsewhere")
    for entry in stale:
        with writing(entry):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()  # a link itself, never what it points to


# ---- quantization schemes (read) -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Scheme:
    """Which Linear layers of a checkpoint are stored W8A8, and their weight-scale strategy."""

    where: str  # "<config.json path> quantization_config", for messages
    targets: Dict[str, Union[str, "_Int4Args"]]  # target -> int8 strategy ("channel" / "tensor") or int4 args
    ignore: Tuple[str, ...]
    by_stored_dtype: bool  # sglang w8a8_int8: a layer is W8A8 iff its weight is stored int8
    activations: Dict[str, ActivationArgs] = dataclass_field(default_factory=dict)  # target -> its input activations

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
                raise ValueError(f"{self.where}: layer {_echo(layer)} is in `ignore` but its weight is stored int8")
            return "channel" if stored_dtype == "I8" else None
        target = self._target(layer, classes)
        return None if target is None else self.targets[target]

    def activation_args(self, layer: str, classes: Sequence[str]) -> ActivationArgs:
        """The input activations of a layer the checkpoint quantizes."""
        target = None if self.by_stored_dtype else self._target(layer, classes)
        return DYNAMIC_TOKEN if target is None else self.activations.get(target, DYNAMIC_TOKEN)


def _require(condition: bool, where: str, field: str, value, supported: str) -> None:
    if not condition:
        raise ValueError(f"{where}: {field} is {_echo(value)}; {supported}")


def _check_fields(section: dict, known: Sequence[str], where: str, field: str) -> None:
    unknown = [k for k in section if k not in known]
    if unknown:
        raise ValueError(f"{where}: {field} has a field {_echo(unknown[0])} that w8a8_cpu does not know; it refuses "
                         f"rather than guess what it changes (known: {', '.join(known)})")


# Bounds on a checkpoint's target lists: real ones name a few dozen layers or patterns.
_MAX_NAMES = 1024
_MAX_NAME_CHARS = 512
# Every layer name is matched against every `re:` entry, and a failed match of an entry with k repeats can backtrack
# through ~C(len(name) + k, k) positions: 0.5 us for k = 1 on a 59-character name, 6 us for k = 2, 135 us for k = 3,
# 2.2 ms for k = 4. So an entry holds at most _MAX_REPEATS, and the entries of one list at most _MAX_MATCH_STEPS of
# C(64 + k, k) together (1024 entries of one repeat each, or 488 of two, or 21 of three): a few ms a layer name at
# most.
# (compressed-tensors' own presets use one or two entries of one or two repeats.)
_MAX_REPEATS = 3
_MAX_MATCH_STEPS = 1 << 20


_BACKTRACKING_REPEATS = (_re_parser.MAX_REPEAT, _re_parser.MIN_REPEAT)
# Python 3.11's possessive repeats and atomic groups (a sentinel before: the parser has no such items there)
_POSSESSIVE_REPEAT = getattr(_re_parser, "POSSESSIVE_REPEAT", object())
_ATOMIC_GROUP = getattr(_re_parser, "ATOMIC_GROUP", object())
_ALTERNATIVES = (_re_parser.BRANCH, _re_parser.GROUPREF_EXISTS)  # tried one after another


def _parts(op, arg) -> list:
    """The parsed sub-patterns one item of a parsed regex holds (none for a leaf). An item of another kind holding a
    sub-pattern is refused: the checks below must see every part a matcher can backtrack in."""
    if op in _BACKTRACKING_REPEATS or op is _POSSESSIVE_REPEAT:
        return [arg[2]]
    if op is _re_parser.BRANCH:
        return list(arg[1])
    if op is _re_parser.GROUPREF_EXISTS:  # (?(group)yes|no)
        return [part for part in arg[1:] if part is not None]
    if op is _re_parser.SUBPATTERN:
        return [arg[-1]]
    if op in (_re_parser.ASSERT, _re_parser.ASSERT_NOT):
        return [arg[1]]
    if op is _ATOMIC_GROUP:
        return [arg]
    if any(isinstance(x, _re_parser.SubPattern) for x in (arg if isinstance(arg, tuple) else (arg,))):
        raise ValueError(f"a regex construct these checks do not know ({op})")
    return []


def _repeats(parsed) -> int:
    """How many variable repeats (*, +, {m,n} with m < n, n > 1) a parsed regex holds in sequence, the most of any
    alternative (alternatives are tried one after another). Each one multiplies the backtracking a failed match can do
    by the name's length: k of them take ~len(name)^k / k! steps (`.*` twenty times over a 30-character name never
    finishes). Possessive repeats and atomic groups are not backtracked into, but their parts are while they match."""
    count = 0
    for op, arg in parsed:
        count += max((_repeats(part) for part in _parts(op, arg)), default=0)
        if op in _BACKTRACKING_REPEATS and arg[1] > 1 and arg[0] != arg[1]:
            count += 1
    return count


def _repeats_a_backtracker(parsed, repeated: bool = False) -> bool:
    """Whether a parsed regex repeats (*, +, {m,n} with n > 1) a part that itself repeats or alternates: the shapes
    (`(a+)+`, `(a|a)*`) on which a backtracking matcher takes exponential time. (A possessive repeat is not
    backtracked into: what it repeats is not `repeated`.)"""
    for op, arg in parsed:
        many = op in _BACKTRACKING_REPEATS and arg[1] > 1
        if (many or op in _ALTERNATIVES) and repeated:
            return True
        if any(_repeats_a_backtracker(part, repeated or many) for part in _parts(op, arg)):
            return True
    return False


def _check_names(value, where: str, field: str) -> Tuple[str, ...]:
    """A list of compressed-tensors targets (names, `re:` regexes, class names), bounded in count and length; each
    regex must compile, must not nest repetition and may hold at most _MAX_REPEATS repeats, the list's regexes at most
    _MAX_MATCH_STEPS together (a pattern that backtracks exponentially, or as a high power of the name's length, on a
    layer name would hang the load)."""
    _require(isinstance(value, list) and all(isinstance(v, str) for v in value), where, field, value,
             "expected a list of strings")
    _require(len(value) <= _MAX_NAMES, where, f"{field} length", len(value), f"at most {_MAX_NAMES} entries")
    steps = 0
    for target in value:
        _require(len(target) <= _MAX_NAME_CHARS, where, f"{field} entry", target,
                 f"at most {_MAX_NAME_CHARS} characters")
        if target.startswith("re:"):
            try:
                parsed = _re_parser.parse(target[3:])
                re.compile(target[3:])  # what the parser lets through and the compiler refuses (look-behinds)
                repeats = _repeats(parsed)
            except (re.error, RecursionError, OverflowError, ValueError) as e:
                raise ValueError(f"{where}: {field} entry {_echo(target)} is not a valid regex ({e})") from None
            if repeats > _MAX_REPEATS:
                raise ValueError(f"{where}: {field} entry {_echo(target)} holds {repeats} repeats (* + {{m,n}}), "
                                 f"which can take a long time to match a layer name; at most {_MAX_REPEATS} (e.g. "
                                 f"re:.*q_proj)")
            steps += math.comb(64 + repeats, repeats)
            if steps > _MAX_MATCH_STEPS:
                raise ValueError(f"{where}: {field} holds too many `re:` entries with repeats to match every layer "
                                 f"name against them in reasonable time (at most {_MAX_MATCH_STEPS} of C(64 + "
                                 f"repeats, repeats) in all: 1024 entries of one repeat, 488 of two, 21 of three)")
            if _repeats_a_backtracker(parsed):
                raise ValueError(f"{where}: {field} entry {_echo(target)} repeats a group that itself repeats or "
                                 f"alternates, which can take exponential time to match; write it without nested "
                                 f"repetition (e.g. re:.*q_proj)")
    return tuple(value)


def _lower(value):
    """compressed-tensors reads its enum fields (type, strategy) case-insensitively."""
    return value.lower() if isinstance(value, str) else value


_ARGS_FIELDS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
                "scale_dtype", "zp_dtype", "observer", "observer_kwargs")


@dataclass(frozen=True)
class _Int4Args:
    """A layer's int4 weights: scales per group of group_size k (0: per channel), integer zero points unless
    symmetric; packed 8 per int32 (pack-quantized) or one per int8 (int-quantized, as compressed-tensors writes W4A8
    with int8 activations)."""
    group_size: int
    symmetric: bool
    packed: bool = True


def _check_int4_args(args: dict, where: str, field: str, packed: bool) -> _Int4Args:
    """4-bit weights: group or channel strategy, symmetric or with zero points."""
    _require(_lower(args.get("type", "int")) == "int", where, f"{field}.type", args.get("type"),
             "w8a8_cpu runs int4 integer weights only")
    _require(args.get("symmetric", True) in (True, False), where, f"{field}.symmetric", args.get("symmetric"),
             "expected true or false")
    group_size = args.get("group_size")
    strategy = _lower(args.get("strategy")) or ("channel" if group_size in (None, -1) else "group")
    _require(strategy in ("group", "channel"), where, f"{field}.strategy", strategy,
             "w8a8_cpu runs int4 weights per group or per channel")
    if strategy == "group":
        _require(is_int4_group(group_size) and group_size != 0,
                 where, f"{field}.group_size", group_size, "w8a8_cpu runs int4 groups of a power of two from 32 to 65536")
    else:
        _require(group_size in (None, -1), where, f"{field}.group_size", group_size, "expected none per channel")
    _require(args.get("block_structure") is None, where, f"{field}.block_structure", args.get("block_structure"),
             "block-wise scales are not supported")
    _require(args.get("dynamic", False) is False, where, f"{field}.dynamic", args.get("dynamic"),
             "expected false: weights carry static scales")
    _require(args.get("actorder") in (None, False, "weight"), where, f"{field}.actorder", args.get("actorder"),
             "activation-ordered groups (g_idx) are not supported")
    return _Int4Args(group_size if strategy == "group" else 0, args.get("symmetric", True), packed)


def _check_args(args, where: str, field: str, strategies: Sequence[str], dynamic: Optional[bool],
                int4_format: Optional[str] = None, asymmetric: bool = False):
    """Validate one compressed-tensors QuantizationArgs dict (its defaults applied); return its strategy (int8), or
    for 4-bit weights (int4_format: the group's format, given for weights) an _Int4Args. asymmetric: zero points
    allowed; dynamic None: left to the caller."""
    _require(isinstance(args, dict), where, field, args, "expected an object")
    _check_fields(args, _ARGS_FIELDS, where, field)
    if int4_format is not None and args.get("num_bits") == 4:
        return _check_int4_args(args, where, field, packed=int4_format == _INT4_FORMAT)
    _require(args.get("num_bits", 8) == 8, where, f"{field}.num_bits", args.get("num_bits"),
             "w8a8_cpu runs 8-bit quantization only (4-bit weights: pack-quantized)")
    _require(_lower(args.get("type", "int")) == "int", where, f"{field}.type", args.get("type"),
             "w8a8_cpu runs int8 only (not float / fp8)")
    _require(args.get("symmetric", True) in ((True, False) if asymmetric else (True,)), where, f"{field}.symmetric",
             args.get("symmetric"), "w8a8_cpu runs symmetric int8 weights only (no zero points)")
    group_size = args.get("group_size")
    strategy = _lower(args.get("strategy"))
    if strategy is None:  # compressed-tensors infers it from group_size: none -> tensor, -1 -> channel, else group
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    _require(strategy in strategies, where, f"{field}.strategy", strategy,
             f"w8a8_cpu runs {' / '.join(strategies)} here")
    _require(group_size in (None, -1), where, f"{field}.group_size", group_size, "group-wise scales are not supported")
    _require(args.get("block_structure") is None, where, f"{field}.block_structure", args.get("block_structure"),
             "block-wise scales are not supported")
    if dynamic is not None:
        _require(args.get("dynamic", False) is dynamic, where, f"{field}.dynamic", args.get("dynamic"),
                 "expected true: w8a8_cpu computes activation scales per token at run time"
                 if dynamic else "expected false: weights carry static scales")
    _require(args.get("actorder") in (None, False, "weight"), where, f"{field}.actorder", args.get("actorder"),
             "activation-ordered groups (g_idx) are not supported")
    return strategy


def _check_activation_args(args, where: str, field: str) -> ActivationArgs:
    """int8 activations: dynamic per token or static per tensor, symmetric or not (quantize_activations)."""
    strategy = _check_args(args, where, field, ("token", "tensor"), dynamic=None, asymmetric=True)
    _require(args.get("dynamic", False) is (strategy == "token"), where, f"{field}.dynamic", args.get("dynamic"),
             "w8a8_cpu runs dynamic per-token (strategy token, dynamic true) or static per-tensor (strategy tensor, "
             "dynamic false) activations")
    return ActivationArgs(static=strategy == "tensor", symmetric=args.get("symmetric", True))


_COMPRESSED_TENSORS_FIELDS = ("quant_method", "format", "quantization_status", "config_groups", "ignore",
                              "kv_cache_scheme", "global_compression_ratio", "sparsity_config", "transform_config",
                              "moe_sparsity_config", "version")
_GROUP_FIELDS = ("targets", "weights", "input_activations", "output_activations", "format")
_FORMATS = ("int-quantized", "naive-quantized")  # both store int8 weights and their scales as they are
_INT4_FORMAT = "pack-quantized"  # int4 weights packed 8 per int32


def _compressed_tensors_scheme(qc: dict, where: str) -> _Scheme:
    _check_fields(qc, _COMPRESSED_TENSORS_FIELDS, where, "quantization_config")
    status = qc.get("quantization_status")
    _require(status == "compressed", where, "quantization_status", status,
             "expected 'compressed' (int8 weights stored); other statuses store float weights")
    for field in ("kv_cache_scheme", "moe_sparsity_config", "sparsity_config", "transform_config"):
        _require(not qc.get(field), where, field, qc.get(field),
                 "w8a8_cpu runs plain W8A8 linear layers only (no kv-cache quantization, sparsity or transforms)")
    groups = qc.get("config_groups")
    _require(isinstance(groups, dict) and groups, where, "config_groups", groups, "expected a non-empty object")
    targets: Dict[str, str] = {}
    activations_of: Dict[str, ActivationArgs] = {}
    for group_name, group in groups.items():
        field = f"config_groups[{_echo(group_name)}]"
        _require(isinstance(group, dict), where, field, group,
                 "expected a scheme object (preset-name groups are not supported)")
        _check_fields(group, _GROUP_FIELDS, where, field)
        group_format = group.get("format") or qc.get("format")
        _require(group_format in (*_FORMATS, _INT4_FORMAT), where, f"{field}.format", group_format,
                 f"w8a8_cpu reads {' / '.join((*_FORMATS, _INT4_FORMAT))} only")
        _require(group.get("weights") is not None, where, f"{field}.weights", None, "expected int8 weights")
        _require(group.get("input_activations") is not None, where, f"{field}.input_activations", None,
                 "weight-only quantization is not W8A8 (expected int8 dynamic per-token activations)")
        _require(group.get("output_activations") is None, where, f"{field}.output_activations",
                 group.get("output_activations"), "output quantization is not supported")
        strategy = _check_args(group["weights"], where, f"{field}.weights", ("channel", "tensor"), dynamic=False,
                               int4_format=group_format)
        _require(group_format != _INT4_FORMAT or isinstance(strategy, _Int4Args), where, f"{field}.format",
                 group_format, "pack-quantized holds 4-bit weights; int8 weights are int-quantized")
        activations = _check_activation_args(group["input_activations"], where, f"{field}.input_activations")
        _require(activations == DYNAMIC_TOKEN or not isinstance(strategy, _Int4Args), where,
                 f"{field}.input_activations", group["input_activations"],
                 "int4 weights run with int8 dynamic per-token symmetric activations only")
        for target in _check_names(group.get("targets"), where, f"{field}.targets"):
            # a later group's scheme replaces an earlier one's (compressed-tensors' rule)
            targets[target] = strategy
            activations_of[target] = activations
    ignore = _check_names(qc.get("ignore") or [], where, "ignore")
    return _Scheme(where, targets, ignore, by_stored_dtype=False, activations=activations_of)


_SGLANG_FIELDS = ("quant_method", "ignore", "activation_scheme")


def _sglang_scheme(qc: dict, where: str) -> _Scheme:
    _check_fields(qc, _SGLANG_FIELDS, where, "quantization_config")
    _require(qc.get("activation_scheme", "dynamic") == "dynamic", where, "activation_scheme",
             qc.get("activation_scheme"), "w8a8_cpu computes activation scales per token at run time ('dynamic')")
    return _Scheme(where, {}, _check_names(qc.get("ignore") or [], where, "ignore"), by_stored_dtype=True)


def _read_scheme(config_dict: dict, where: str) -> _Scheme:
    qc = config_dict.get("quantization_config")
    _require(isinstance(qc, dict), where, "quantization_config", qc,
             "expected an object: load_quantized reads pre-quantized checkpoints only")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, f"{where} quantization_config")
    if method == "w8a8_int8":
        return _sglang_scheme(qc, f"{where} quantization_config")
    raise ValueError(f"{where}: quantization_config.quant_method is {_echo(method)}; w8a8_cpu reads "
                     f"'compressed-tensors' (int-quantized) and sglang's 'w8a8_int8' only")


# ---- checkpoint files (read) -----------------------------------------------------------------------------------

# Largest config.json / generation_config.json and index a checkpoint may have (the largest real ones are ~100 KB and
# a few MB); anything larger is refused before it is read.
_MAX_CONFIG_BYTES = 1 << 24
_MAX_INDEX_BYTES = 1 << 26


def _read_json(path: Path, max_bytes: int = _MAX_CONFIG_BYTES) -> dict:
    return read_json_object(path, max_bytes)


def _weight_map(directory: Path) -> Dict[str, str]:
    """tensor name -> file name, from the index (validated) or from the single weights file."""
    index, single = directory / INDEX_FILE, directory / SINGLE_FILE
    if index.exists() and single.exists():
        raise ValueError(f"{directory}: holds both {SINGLE_FILE} and {INDEX_FILE}; which one is the checkpoint "
                         f"is ambiguous")
    if not index.exists():
        if not single.is_file():
            raise ValueError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")
        return {}  # filled from the file's own header by _StoredTensors
    weight_map = _read_json(index, _MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: weight_map is missing or not a non-empty object")
    for key, file_name in weight_map.items():
        plain = (isinstance(file_name, str) and file_name.endswith(".safetensors") and "/" not in file_name
                 and "\\" not in file_name and Path(file_name).name == file_name and not file_name.startswith(".")
                 and len(file_name.encode("utf-8", "surrogatepass")) <= 255 and "\0" not in file_name)
        if not plain:
            raise ValueError(f"{index}: weight_map[{_echo(key)}] is {_echo(file_name)}; expected the plain name of a "
                             f".safetensors file in the checkpoint directory")
    for file_name in set(weight_map.values()):
        if not (directory / file_name).is_file():
            raise ValueError(f"{index}: names {_echo(file_name)}, which does not exist in {directory}")
    return weight_map


class _StoredTensors:
    """The checkpoint's tensors by name: files opened with safe_open (headers only), each tensor's dtype and shape
    validated before it is read, and every tensor taken accounted for."""

    def __init__(self, directory: Path, stack: contextlib.ExitStack):
        self.directory = directory
        weight_map = _weight_map(directory)
        self._files = {}
        for file_name in sorted(set(weight_map.values()) or {SINGLE_FILE}):
            try:
                self._files[file_name] = stack.enter_context(safe_open(str(directory / file_name), "pt", "cpu"))
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{directory / file_name}: not a readable safetensors file "
                                 f"({_echo(str(e))})") from None
        if not weight_map:
            weight_map = dict.fromkeys(self._files[SINGLE_FILE].keys(), SINGLE_FILE)
        listed: Dict[str, set] = {file_name: set() for file_name in self._files}
        for key, file_name in weight_map.items():
            listed[file_name].add(key)
        for file_name, handle in self._files.items():
            held = set(handle.keys())
            absent = listed[file_name] - held
            if absent:
                raise ValueError(f"{directory / INDEX_FILE}: lists tensors that {file_name} does not hold: "
                                 f"{_listing(list(absent))}")
            unlisted = held - listed[file_name]
            if unlisted:  # readers that take every tensor of every shard (transformers) would load them
                raise ValueError(f"{directory / file_name}: holds tensors that {INDEX_FILE} does not map to it: "
                                 f"{_listing(list(unlisted))}")
        self._file_of = weight_map
        self.unused = set(weight_map)

    def headers(self) -> Dict[str, str]:
        """Every tensor's file, dtype and shape, by name (from the headers: nothing is read)."""
        described = {}
        for key, file_name in self._file_of.items():
            stored = self._files[file_name].get_slice(key)
            described[key] = f"{file_name} {stored.get_dtype()} {list(stored.get_shape())}"
        return described

    def _where(self, key: str) -> str:
        return f"{self.directory / self._file_of[key]}: tensor {_echo(key)}"

    def stored_dtype(self, key: str) -> Optional[str]:
        """safetensors dtype name ("I8", "BF16", ...) of `key`, None if the checkpoint lacks it."""
        return self._files[self._file_of[key]].get_slice(key).get_dtype() if key in self._file_of else None

    def _take(self, key: str, dtypes: Sequence[str], shapes: Sequence[Sequence[int]], what: str,
              index: Optional[tuple] = None) -> torch.Tensor:
        """The tensor `key`, or its part `index` (a tuple of slices: only those bytes are read), once its header
        says it has one of `dtypes` and one of `shapes` (nothing is read before that, so a malformed header cannot
        make us read a huge tensor)."""
        if key not in self._file_of:
            raise ValueError(f"{self.directory}: tensor {_echo(key)} ({what}) is missing from the checkpoint")
        stored = self._files[self._file_of[key]].get_slice(key)
        if stored.get_dtype() not in dtypes or list(stored.get_shape()) not in [list(s) for s in shapes]:
            raise ValueError(f"{self._where(key)} is {stored.get_dtype()} {_echo(list(stored.get_shape()))}; "
                             f"expected {what}: {' or '.join(dtypes)} {' or '.join(str(list(s)) for s in shapes)}")
        self.unused.discard(key)
        if index is None:
            return self._files[self._file_of[key]].get_tensor(key)
        return stored[index]

    def leave(self, keys: Sequence[str]) -> None:
        """Account for tensors that another rank reads (a sharded load), without reading them."""
        self.unused.difference_update(keys)

    def int8(self, key: str, shape: Sequence[int], index: Optional[tuple] = None) -> torch.Tensor:
        return self._take(key, ("I8",), [shape], "an int8 weight", index)

    def floating(self, key: str, shape: Sequence[int], dtype: torch.dtype,
                 rows: Optional[slice] = None) -> torch.Tensor:
        """A float tensor in `dtype`, every value finite (a NaN or Inf weight, or one beyond `dtype`'s range, would
        make every logit NaN)."""
        tensor = self._take(key, tuple(_FLOAT_DTYPES), [shape], "a float tensor",
                            None if rows is None else (rows,)).to(dtype)
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{self._where(key)} holds NaN or Inf values (as {str(dtype).removeprefix('torch.')})")
        return tensor

    def check_positive(self, key: str, scale: torch.Tensor) -> None:
        """Weight scales are finite and > 0 (README, Numerics): a zero or negative one is no quantization grid."""
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"{self._where(key)} holds a scale that is not finite and > 0")

    def check_weight_range(self, key: str, scale: torch.Tensor, largest_code: int) -> None:
        """The weights a scale describes (codes up to largest_code in magnitude, times the scale) finite in fp32, as
        a float checkpoint's weights must be: a scale of 3e38 is finite, its weights are not, and every logit would
        be Inf."""
        if not torch.isfinite(scale * largest_code).all():
            raise ValueError(f"{self._where(key)} holds a scale whose weights ({largest_code} x the scale) overflow "
                             f"fp32")

    def scale(self, key: str, channels: int, strategy: str, rows: Optional[slice] = None) -> torch.Tensor:
        """fp32 weight scales of the `channels` output channels, or of their part `rows`, stored [n, 1] or [n]
        (n = channels, or 1 for a per-tensor scale, which is broadcast exactly to every channel), each finite and
        > 0."""
        n = channels if strategy == "channel" else 1
        shapes = [[n, 1], [n]] + ([[]] if n == 1 else [])
        index = (rows,) if rows is not None and strategy == "channel" else None
        scale = self._take(key, tuple(_FLOAT_DTYPES), shapes, f"{strategy} weight scales", index).to(torch.float32)
        self.check_positive(key, scale)
        self.check_weight_range(key, scale, 128)
        kept = channels if rows is None else len(range(channels)[rows])
        return scale.reshape(-1).expand(kept).contiguous()


# ---- load ------------------------------------------------------------------------------------------------------


def _require_fusable(name: str, module: torch.nn.Module, gate_up_q: torch.Tensor, down_q: torch.Tensor) -> None:
    """The checkpoint's experts module must compute what the fused experts do (nn._require_plain_silu_experts: a
    clamp such as DeepSeek-V4's swiglu_limit would be dropped, silently), probed with one expert's stored integer
    weights: the forward's form is tested, not the values."""
    try:
        _require_plain_silu_experts(module, gate_up_q, down_q)
    except ValueError as e:
        raise ValueError(f"model: {name}: {e}") from None

class _Loader:
    """Fills a model built on the meta device from the checkpoint, layer by layer. A layer given a shard (a
    LinearShard / ExpertShard of w8a8_cpu.distributed) is read only in that shard's part and built by it."""

    def __init__(self, model, tensors: _StoredTensors, scheme: _Scheme):
        self.model, self.tensors, self.scheme = model, tensors, scheme
        self.naming = _Naming(model.config)

    def _strategy(self, layer: str, classes: Sequence[str]) -> Optional[str]:
        return self.scheme.weight_strategy(layer, classes, self.tensors.stored_dtype(f"{layer}.weight"))

    def _linear(self, layer: str, classes: Sequence[str], shape: Sequence[int], dtype: torch.dtype, shard=None,
                any_activations: bool = False):
        """(int8 weight, fp32 scale) of a W8A8 layer (of its part `shard`, when given), or (float weight, None) of
        a layer stored float. any_activations: the caller reads static / asymmetric activation parameters itself;
        otherwise (fused experts) only dynamic per-token symmetric activations are accepted."""
        weight = f"{layer}.weight"
        strategy = self._strategy(layer, classes)
        if not any_activations and strategy is not None and \
                self.scheme.activation_args(layer, classes) != DYNAMIC_TOKEN:
            raise ValueError(f"{self.tensors.directory}: {layer} has static or asymmetric activations; w8a8_cpu runs "
                             f"those in Linear layers only, fused MoE experts take dynamic per-token symmetric ones")
        if strategy is None:
            if shard is not None:
                raise ValueError(f"{self.tensors._where(weight)}: stored float, but a sharded load splits this "
                                 f"layer, which must be W8A8")
            return self.tensors.floating(weight, shape, dtype), None
        if shard is None:
            return self.tensors.int8(weight, shape), self.tensors.scale(f"{layer}.weight_scale", shape[0], strategy)
        return (self.tensors.int8(weight, shape, shard.weight_index),
                self.tensors.scale(f"{layer}.weight_scale", shape[0], strategy, shard.channel_index))

    def _int4_values(self, layer: str, args: "_Int4Args", n: int, k: int):
        """(q int8 [n, k], group scales [n, groups], group minimums or None) of an int4 layer [n, k]: pack-quantized,
        weight_packed int32 [N, ceil(K / 8)], weight_shape [N, K], weight_scale [N, groups], and without symmetry
        weight_zero_point int32 [ceil(N / 8), groups] (packed along the channels); or int-quantized (one value per
        int8). w = scale * (q - zero point) = scale * q + (-scale * zero point)."""
        groups = -(-k // args.group_size) if args.group_size else 1
        if args.packed:
            packed = self.tensors._take(f"{layer}.weight_packed", ("I32",), [[n, -(-k // 8)]],
                                        "int4 weights, 8 per int32")
            shape = self.tensors._take(f"{layer}.weight_shape", ("I64", "I32"), [[2]], "the weight's shape [N, K]")
            if shape.tolist() != [n, k]:
                raise ValueError(f"{self.tensors._where(f'{layer}.weight_shape')} is {_echo(shape.tolist())}; the "
                                 f"model's layer is [{n}, {k}]")
            q = unpack_int4_rows(packed, k)
        else:
            q = self.tensors.int8(f"{layer}.weight", [n, k])
            if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
                raise ValueError(f"{self.tensors._where(f'{layer}.weight')} holds values outside int4's [-8, 7]")
        scale = self.tensors.floating(f"{layer}.weight_scale", [n, groups], torch.float32)
        self.tensors.check_positive(f"{layer}.weight_scale", scale)
        self.tensors.check_weight_range(f"{layer}.weight_scale", scale, 15)  # |code - zero point| <= 15
        minimum = None
        if not args.symmetric:
            key = f"{layer}.weight_zero_point"
            if args.packed:
                zero = self.tensors._take(key, ("I32",), [[-(-n // 8), groups]],
                                          "int4 zero points, 8 per int32 along the channels")
                zero = unpack_int4_rows(zero.T.contiguous(), n).T
            else:
                zero = self.tensors._take(key, ("I8", "I32"), [[n, groups]], "int4 zero points")
                if zero.numel() and (int(zero.min()) < -8 or int(zero.max()) > 7):
                    raise ValueError(f"{self.tensors._where(key)} holds values outside int4's [-8, 7]")
            minimum = -scale * zero.to(torch.float32)
        return q, scale, minimum

    def _int4_linear(self, name: str, layer: str, args: "_Int4Args", module: torch.nn.Linear) -> None:
        """An int4 layer (_int4_values) as a W4A8Linear."""
        values = self._int4_values(layer, args, *module.weight.shape)
        bias = None if module.bias is None else self.tensors.floating(f"{layer}.bias", module.bias.shape,
                                                                      torch.float32)
        _replace_module(self.model, name, W4A8Linear(*values, args.group_size, bias))

    def linear(self, name: str, module: torch.nn.Linear, shard=None) -> None:
        layer = self.naming.checkpoint_name(name)
        classes = [c.__name__ for c in type(module).__mro__ if issubclass(c, torch.nn.Module)]
        strategy = self._strategy(layer, classes)
        activations = self.scheme.activation_args(layer, classes)
        if activations != DYNAMIC_TOKEN and shard is not None:
            raise ValueError(f"{self.tensors.directory}: {layer} has static or asymmetric activations; a sharded load "
                             f"splits it, which w8a8_cpu.distributed does for dynamic per-token symmetric ones only")
        if isinstance(strategy, _Int4Args):
            if shard is not None:
                raise ValueError(f"{self.tensors.directory}: {layer} holds int4 weights; a sharded load splits it, "
                                 f"which w8a8_cpu.distributed does for W8A8 layers only")
            return self._int4_linear(name, layer, strategy, module)
        weight, scale = self._linear(layer, classes, module.weight.shape, module.weight.dtype, shard,
                                     any_activations=True)
        if scale is None:
            module.weight = torch.nn.Parameter(weight, requires_grad=False)  # its bias: with the other parameters
            return
        rows = None if shard is None else shard.channel_index
        bias = None if module.bias is None else self.tensors.floating(f"{layer}.bias", module.bias.shape,
                                                                      torch.float32, rows)
        if shard is not None:
            return _replace_module(self.model, name, shard.build(weight, scale, bias))
        _replace_module(self.model, name, W8A8Linear(weight, scale, bias, **self._activation_params(layer, activations)))

    def _activation_params(self, layer: str, activations: ActivationArgs) -> dict:
        """W8A8Linear's activation arguments: a static layer's input_scale [1] (or a scalar), finite and > 0, and its
        input_zero_point [1] (int8 or int32) in [-128, 127] when asymmetric."""
        params = {"symmetric_activations": activations.symmetric}
        if activations.static:
            key = f"{layer}.input_scale"
            params["input_scale"] = self.tensors._take(key, tuple(_FLOAT_DTYPES), [[1], []], "a static activation "
                                                       "scale").to(torch.float32)
            if not activations.symmetric:
                params["input_zero_point"] = self.tensors._take(f"{layer}.input_zero_point", ("I8", "I32"), [[1], []],
                                                                "a static activation zero point")
            try:
                check_static_activation_params(params.get("input_scale"), params.get("input_zero_point"),
                                               activations.symmetric)
            except ValueError as e:
                raise ValueError(f"{self.tensors._where(key)}: {e}") from None
        return params

    def experts(self, name: str, module: torch.nn.Module, shard=None) -> None:
        """The experts module from its per-expert Linear layers (only the experts `shard.part` when sharded: the
        others' headers decide whether the module is int8, their tensors are left to their ranks)."""
        gate_up, down = _expert_weights(module)
        experts, inter2, hidden = gate_up.shape
        shapes = ((inter2 // 2, hidden), (inter2 // 2, hidden), (hidden, inter2 // 2))
        all_layers = self.naming.expert_linears(name, experts)
        strategies = [self._strategy(layer, ("Linear",)) for layers in all_layers for layer in layers]
        if any(isinstance(strategy, _Int4Args) for strategy in strategies):
            return self._int4_experts(name, module, strategies, shard)
        quantized = {strategy is not None for strategy in strategies}
        if len(quantized) > 1:
            raise ValueError(f"{self.tensors.directory}: the experts of {self.naming.checkpoint_name(name)} are "
                             f"partly int8, partly float; w8a8_cpu runs an experts module wholly one or the other")
        if shard is not None:
            if quantized == {False}:
                raise ValueError(f"{self.tensors.directory}: the experts of {self.naming.checkpoint_name(name)} are "
                                 f"stored float, but a sharded load splits them, which must be W8A8")
            for layers in all_layers[:shard.part.start] + all_layers[shard.part.stop:]:
                self.tensors.leave([f"{layer}.{t}" for layer in layers for t in ("weight", "weight_scale")])
        mine = all_layers if shard is None else all_layers[shard.part]
        loaded = [[self._linear(layer, ("Linear",), shape, gate_up.dtype) for layer, shape in zip(layers, shapes)]
                  for layers in mine]
        w13 = torch.stack([torch.cat([gate[0], up[0]]) for gate, up, _ in loaded])
        w2 = torch.stack([down[0] for _, _, down in loaded])
        if quantized == {False}:
            module.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
            module.down_proj = torch.nn.Parameter(w2, requires_grad=False)
            return
        _require_fusable(name, module, w13[0], w2[0])
        w13_scale = torch.stack([torch.cat([gate[1], up[1]]) for gate, up, _ in loaded])
        w2_scale = torch.stack([down[1] for _, _, down in loaded])
        local = W8A8Experts(w13, w13_scale, w2, w2_scale)
        _replace_module(self.model, name, local if shard is None else shard.build(local))

    def _int4_experts(self, name: str, module: torch.nn.Module, strategies: List, shard) -> None:
        """Experts whose projections are all int4 of one kind (group size, symmetry, packing) as a W4A8Experts."""
        where = f"{self.tensors.directory}: the experts of {self.naming.checkpoint_name(name)}"
        if len(set(strategies)) != 1:
            raise ValueError(f"{where} are partly int4, or int4 of several group sizes or symmetries; w8a8_cpu runs "
                             f"an experts module wholly in one weight format")
        if shard is not None:
            raise ValueError(f"{where} hold int4 weights; a sharded load splits them, which w8a8_cpu.distributed "
                             f"does for W8A8 experts only")
        args = strategies[0]
        experts, inter2, hidden = _expert_weights(module)[0].shape
        shapes = ((inter2 // 2, hidden), (inter2 // 2, hidden), (hidden, inter2 // 2))
        loaded = [[self._int4_values(layer, args, *shape) for layer, shape in zip(layers, shapes)]
                  for layers in self.naming.expert_linears(name, experts)]

        def stacked(projections, value):  # one value (q, scale, minimum) of every expert, gate and up concatenated
            if value == 2 and args.symmetric:
                return None
            return torch.stack([torch.cat([expert[p][value] for p in projections]) for expert in loaded])

        w13 = [stacked((0, 1), value) for value in range(3)]
        w2 = [stacked((2,), value) for value in range(3)]
        _require_fusable(name, module, w13[0][0], w2[0][0])
        _replace_module(self.model, name, W4A8Experts(*w13, *w2, args.group_size))

    def remaining(self, tied: Sequence[str]) -> None:
        """Every parameter still on the meta device (norms, embeddings, routers, float layers' biases) from its
        float tensor, and persistent buffers the checkpoint holds."""
        replaced = {n for n, m in self.model.named_modules() if isinstance(m, (W8A8Linear, W8A8Experts))}
        for key, tensor in self.model.state_dict(keep_vars=True).items():
            owner, _, leaf = key.rpartition(".")
            stored = self.naming.checkpoint_name(key)
            if key in tied or owner in replaced or not (tensor.is_meta or stored in self.tensors.unused):
                continue
            module = self.model.get_submodule(owner)
            value = self.tensors.floating(stored, tensor.shape, tensor.dtype)
            if isinstance(tensor, torch.nn.Parameter):
                setattr(module, leaf, torch.nn.Parameter(value, requires_grad=False))
            else:
                module.register_buffer(leaf, value)


# The config.json sizes that decide shapes, time and memory before any tensor is read: positive ints (not bools,
# not floats), at most these bounds (far above any real model). A flag must be a JSON bool.
_CONFIG_SIZES = {"hidden_size": 1 << 20, "intermediate_size": 1 << 22, "moe_intermediate_size": 1 << 22,
                 "shared_expert_intermediate_size": 1 << 22, "num_hidden_layers": 1 << 10,
                 "num_attention_heads": 1 << 14, "num_key_value_heads": 1 << 14, "head_dim": 1 << 14,
                 "vocab_size": 1 << 24, "max_position_embeddings": 1 << 26, "num_local_experts": 1 << 16,
                 "num_experts": 1 << 16, "num_experts_per_tok": 1 << 16}
_CONFIG_FLAGS = ("tie_word_embeddings",)


# Numbers the model's arithmetic needs in a range, at any depth of config.json (rope_theta also sits in rope_parameters,
# per layer type in some models): out of it, a loaded model computes NaN logits (a rope_theta below 1 raised to
# fractional powers, 1e-300 overflowing the frequencies to Inf; a rope scaling factor of 0 dividing them; a negative
# epsilon under a square root). transformers' own rope validation asks factor >= 1 too (it only warns).
_CONFIG_AT_LEAST_ONE = ("rope_theta", "factor")
_CONFIG_NON_NEGATIVE = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")


def _check_config_numbers(config_dict: dict, where: str) -> None:
    """Every number in config.json finite (Python's json reads NaN and Infinity), and the ranges above; walked with a
    stack, not recursion (the nesting is the file's)."""
    pending = [config_dict]
    while pending:
        node = pending.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(value, (dict, list)):
                pending.append(value)
                continue
            if value is None:  # unset: the config class's default
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{where}: {_echo(key)} must be a finite number, got {_echo(value)}")
            number = type(value) in (int, float)
            if key in _CONFIG_AT_LEAST_ONE and not (number and value >= 1):
                raise ValueError(f"{where}: {key} must be a number >= 1, got {_echo(value)}")
            if key in _CONFIG_NON_NEGATIVE and not (number and value >= 0):
                raise ValueError(f"{where}: {key} must be a number >= 0, got {_echo(value)}")


def _config_field(config_dict: dict, key: str, aliases: Dict[str, str]):
    """(name, value) of a size in config.json under the model's own name for it when the config class has one (its
    attribute_map: GPT-2's n_layer is num_hidden_layers, Hunyuan's moe_topk num_experts_per_tok), else under key."""
    name = aliases.get(key, key)
    if not isinstance(name, str) or name not in config_dict:
        name = key
    return name, config_dict.get(name)


def _check_config_sizes(config_dict: dict, aliases: Dict[str, str], where: str) -> None:
    """The _CONFIG_SIZES, under both names: an int in range, or a list of them (per-layer sizes)."""
    for key, bound in _CONFIG_SIZES.items():
        for name in {key, aliases.get(key, key)}:
            value = config_dict.get(name) if isinstance(name, str) else None
            values = value if isinstance(value, list) else [value]
            if value is not None and not all(type(v) is int and 1 <= v <= bound for v in values):
                shown = key if name == key else f"{name} ({key})"
                raise ValueError(f"{where}: {shown} must be an integer in [1, {bound}] (or a list of them), got "
                                 f"{_echo(value)}")
    # GPT-Neo's attention_types, [[kinds, count], ...], expand to that many layers in its config's constructor
    layer_types = config_dict.get("attention_types")
    if isinstance(layer_types, list):
        counts = [entry[1] if isinstance(entry, list) and len(entry) == 2 else None for entry in layer_types]
        if not all(type(c) is int and c >= 1 for c in counts) or sum(counts) > _CONFIG_SIZES["num_hidden_layers"]:
            raise ValueError(f"{where}: attention_types must be [[kinds, count], ...] with counts >= 1 summing to at "
                             f"most {_CONFIG_SIZES['num_hidden_layers']} layers, got {_echo(layer_types)}")


def _check_config_consistency(config_dict: dict, aliases: Dict[str, str], where: str) -> None:
    """Sizes each in range but not fitting together, which would load and then fail in the first forward, deep in
    transformers: query heads in groups over the KV heads, at most as many experts per token as experts (plain
    ints only: per-layer lists are the model's own business)."""
    def size(key):
        name, value = _config_field(config_dict, key, aliases)
        return (name, value) if type(value) is int else (name, None)

    (heads_name, heads), (kv_name, kv_heads) = size("num_attention_heads"), size("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise ValueError(f"{where}: {heads_name} ({heads}) must be a multiple of {kv_name} ({kv_heads})")
    experts = size("num_local_experts")[1] or size("num_experts")[1]
    per_token_name, per_token = size("num_experts_per_tok")
    if experts and per_token and per_token > experts:
        raise ValueError(f"{where}: {per_token_name} ({per_token}) exceeds the {experts} experts")


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (int, float)):
        return "an integer" if isinstance(value, int) else "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _check_config_values(config_dict: dict, defaults: dict, aliases: Dict[str, str], where: str) -> None:
    """Sizes and flags checked first (type and range), then every field against the type of the config class's
    default for it (null is always allowed: it means unset): transformers accepts many wrongly typed values and fails
    later, deep in model code, without naming the file."""
    _check_config_sizes(config_dict, aliases, where)
    _check_config_consistency(config_dict, aliases, where)
    for key in _CONFIG_FLAGS:
        if key in config_dict and type(config_dict[key]) is not bool:
            raise ValueError(f"{where}: {key} must be true or false, got {_echo(config_dict[key])}")
    _check_config_numbers(config_dict, where)
    for key, value in config_dict.items():
        default = defaults.get(key)
        if value is None or default is None:
            continue
        if key.endswith("_token_id"):  # an id, or several (Llama 3's eos_token_id)
            ids = value if isinstance(value, list) else [value]
            vocab = config_dict.get("vocab_size")
            if not all(type(i) is int and 0 <= i < (vocab if type(vocab) is int else 2 ** 31) for i in ids):
                raise ValueError(f"{where}: {key} must be a token id in [0, vocab_size) or a list of them, got "
                                 f"{_echo(value)}")
            continue
        expected, got = _json_kind(default), _json_kind(value)
        if got != expected and not (expected == "a number" and got == "an integer"):
            raise ValueError(f"{where}: {key} must be {expected} (as {type(default).__name__} in transformers' "
                             f"config), got {_echo(value)}")


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d{1,9})\.")
_EXPERT_INDEX = re.compile(r"\.experts\.(\d{1,9})\.")


def _check_against_headers(config, names: Sequence[str], where: str) -> None:
    """The config's layer and expert counts against the tensor names of the headers (largest index + 1), in time
    linear in the headers: a count the weights do not back would build a model (time, memory) before any tensor is
    found missing. (More layers or experts in the weights than declared are tensors of no part of the model: the
    load reports them after.)"""
    layers = {int(m.group(1)) for m in map(_LAYER_INDEX.search, names) if m}
    declared = getattr(config, "num_hidden_layers", None)
    if isinstance(declared, int) and layers and declared > max(layers) + 1:
        raise ValueError(f"{where}: num_hidden_layers is {declared}, but the weights hold layers 0..{max(layers)}")
    experts = {int(m.group(1)) for m in map(_EXPERT_INDEX.search, names) if m}
    for key in ("num_local_experts", "num_experts"):
        declared = getattr(config, key, None)
        if isinstance(declared, int) and experts and declared > max(experts) + 1:
            raise ValueError(f"{where}: {key} is {declared}, but the weights hold experts 0..{max(experts)}")


def _model_config(config_dict: dict, where: str, dtype: Optional[torch.dtype]):
    from transformers import CONFIG_MAPPING

    model_type = config_dict.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(f"{where}: model_type is {_echo(model_type)}; expected a model type this transformers knows")
    try:
        defaults = CONFIG_MAPPING[model_type]().to_dict()
    except Exception:  # noqa: BLE001 - a config class without usable defaults: only the explicit checks apply
        defaults = {}
    aliases = getattr(CONFIG_MAPPING[model_type], "attribute_map", None)
    _check_config_values(config_dict, defaults, aliases if isinstance(aliases, dict) else {}, where)
    architecture = {k: v for k, v in config_dict.items() if k != "quantization_config"}
    try:
        config = CONFIG_MAPPING[model_type].from_dict(architecture)
    except Exception as e:  # noqa: BLE001 - parsing an untrusted file (huggingface_hub's validation errors too)
        raise ValueError(f"{where}: not a valid {model_type} config ({type(e).__name__}: {_echo(str(e))})") from None
    if dtype is None:
        stored = config_dict.get("dtype", config_dict.get("torch_dtype")) or "float32"
        if not isinstance(stored, str) or stored not in _MODEL_DTYPES:
            raise ValueError(f"{where}: dtype is {_echo(stored)}; expected one of {sorted(_MODEL_DTYPES)}")
        dtype = _MODEL_DTYPES[stored]
    elif dtype not in _MODEL_DTYPES.values():
        raise ValueError(f"dtype: expected torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
    return config, dtype


_MAX_BUFFER_BYTES = 1 << 30  # a model's non-parameter tensors (masks, rotary tables): tens of MiB in real models


def _empty_model(config, dtype: torch.dtype, where: str):
    """The causal LM of `config` with every parameter on the meta device, so that no float weight is ever allocated,
    and real buffers. This is transformers' own from_pretrained path: build on meta, then give each buffer real
    storage and let the model's _init_weights compute it (rotary inv_freq and the like). Errors name `where`."""
    from transformers import AutoModelForCausalLM

    def building(step):
        try:
            return step()
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError, RuntimeError, AssertionError) as e:
            raise ValueError(f"{where}: no causal LM can be built from it ({type(e).__name__}: "
                             f"{_echo(str(e))})") from None

    def on_meta():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)

    model = building(on_meta)
    # Buffers get real memory before any tensor is read, and some grow with the config's sizes (GPT-Neo's causal
    # mask: max_position_embeddings squared, per layer): their total is bounded first.
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    if buffer_bytes > _MAX_BUFFER_BYTES:
        raise ValueError(f"{where}: the {config.model_type} model of this config holds {buffer_bytes / 2 ** 30:.1f} "
                         f"GiB of buffers (e.g. attention masks of max_position_embeddings squared); at most "
                         f"{_MAX_BUFFER_BYTES >> 30} GiB")

    def with_real_buffers():
        owners = set()
        for name, buffer in list(model.named_buffers()):
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            module.register_buffer(leaf, torch.empty_like(buffer, device="cpu"),
                                   persistent=leaf not in module._non_persistent_buffers_set)
            owners.add(owner)
        for owner in owners:
            model._init_weights(model.get_submodule(owner))
        return model

    return building(with_real_buffers)


def load_quantized(directory: PathLike, dtype: Optional[torch.dtype] = None, fuse: bool = False,
                   quantize_embedding: Optional[bool] = None):
    """Load a pre-quantized checkpoint from `directory` into a transformers causal LM, eval mode.

    Reads compressed-tensors `int-quantized` / `naive-quantized` checkpoints (int8 symmetric weights with
    "channel" or "tensor" scales, int8 symmetric dynamic per-token activations; `targets` and `ignore` honoured
    as compressed-tensors does) and sglang `w8a8_int8` ones (int8 weight and fp32 weight_scale [N, 1]; a layer
    whose weight is stored float stays float), from model.safetensors or a sharded model.safetensors.index.json.
    The model is built from config.json on the meta device (buffers real), each quantized Linear becomes a
    W8A8Linear and each MoE experts module a W8A8Experts from the stored int8 tensors (4-bit layers: W4A8Linear,
    experts all 4-bit of one kind: W4A8Experts; float weights of quantized
    layers are never created), and everything else is loaded in `dtype` (default: config.json's dtype, else
    float32). Any other scheme, and any file, field or tensor that is malformed, missing, unexpected or of the
    wrong dtype or shape, raises ValueError naming it. fuse: then fuse the projections as quantize_model(fuse=True)
    does (w8a8_cpu.nn.fuse_projections; checkpoints keep the per-layer names, save_compressed splits them again).
    quantize_embedding: hold the token embedding, and an lm_head tied to it, as one int8 table as
    quantize_model(quantize_embedding=True) does, from the stored float table (per-row round to nearest: for a
    table saved by save_compressed from such a model in float32 the int8 values come back exactly; a bfloat16 or
    float16 table can move a value by one step). None (the default): as the checkpoint says (config.json's
    "w8a8_cpu": {"int8_embedding": true}, written by save_compressed)."""
    model = _load(directory, dtype)[0]
    if quantize_embedding is None:
        quantize_embedding = _int8_embedding_flag(model.config, Path(directory) / CONFIG_FILE)
    if quantize_embedding:
        output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        tied = output is not None and getattr(output, "weight", None) is getattr(embedding, "weight", False)
        quantize_model(model, skip=lambda name, module: not (tied and module is output), quantize_embedding=True)
    if fuse:
        fuse_projections(model)
    return model


def _int8_embedding_flag(config, config_file: Path) -> bool:
    """config.json's OWN_CONFIG_KEY entry: {"int8_embedding": bool} or absent (False)."""
    entry = getattr(config, OWN_CONFIG_KEY, None)
    if entry is None:
        return False
    if not isinstance(entry, dict) or set(entry) != {"int8_embedding"} or \
            not isinstance(entry["int8_embedding"], bool):
        raise ValueError(f'{config_file}: "{OWN_CONFIG_KEY}" must be {{"int8_embedding": true or false}}')
    return entry["int8_embedding"]


def _load(directory: PathLike, dtype: Optional[torch.dtype], plan=None):
    """(model, plan(model, headers) or None): load_quantized, or with `plan` (called on the model built on the meta
    device and the checkpoint's tensor headers, {name: "file dtype shape"};
    it returns w8a8_cpu.distributed's ShardPlan) a sharded load: each layer in plan.linears / plan.experts is read
    only in its part and built by its shard."""
    from transformers import GenerationConfig

    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"directory: {directory} is not a directory")
    config_file = directory / CONFIG_FILE
    config_dict = _read_json(config_file)
    scheme = _read_scheme(config_dict, str(config_file))
    config, dtype = _model_config(config_dict, str(config_file), dtype)
    with contextlib.ExitStack() as stack:
        tensors = _StoredTensors(directory, stack)
        _check_against_headers(config, list(tensors.unused), str(config_file))
        model = _empty_model(config, dtype, str(config_file))
        shards = None if plan is None else plan(model, tensors.headers())
        linear_shards, expert_shards = ({}, {}) if shards is None else (shards.linears, shards.experts)
        loader = _Loader(model, tensors, scheme)
        tied = set(_tied_weights(model))
        unloaded_shards = set(linear_shards) | set(expert_shards)
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and f"{name}.weight" not in tied:
                loader.linear(name, module, linear_shards.get(name))
            elif _expert_weights(module) is not None:
                loader.experts(name, module, expert_shards.get(name))
            else:
                continue
            unloaded_shards.discard(name)
        if unloaded_shards:  # never load a layer the plan splits whole: the sharded model would compute wrong sums
            raise ValueError(f"{directory}: layers to shard that the {config.model_type} model does not hold as linear "
                             f"layers or experts: {_listing(sorted(unloaded_shards))}")
        loader.remaining(tied)
        if tensors.unused:
            raise ValueError(f"{directory}: holds tensors that belong to no part of the {config.model_type} model: "
                             f"{_listing(list(tensors.unused))}")
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{directory}: the checkpoint does not provide {_listing(left)}")
    generation_file = directory / "generation_config.json"
    if os.path.lexists(generation_file):
        settings = _read_json(generation_file)
        try:
            model.generation_config = GenerationConfig.from_dict(settings)
        except Exception as e:  # noqa: BLE001 - any failure to parse an untrusted file is that file's error
            raise ValueError(f"{generation_file}: not a valid generation config ({type(e).__name__})") from None
    return model.eval(), shards


__all__ = ["save_compressed", "load_quantized"]
