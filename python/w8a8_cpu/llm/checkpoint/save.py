"""save_compressed: a model quantized by quantize_model written as a compressed-tensors checkpoint directory."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..._files import open_regular, publish, staging_folder, writing
from ..._untrusted import echo
from ...nn import (ColumnScaledEmbedding, W4A8Experts, W4A8Linear, W8A8Embedding, W8A8Experts, W8A8GatedMLP,
                   W8A8Linear, W8A8LinearSlice, W8A8MoE)
from ...nn.experts import expert_weights
from ...scheme import W8A8, QuantScheme, WeightScheme
from ..pack_quantized import pack_int4_rows
from .layout import (CONFIG_FILE, GENERATION_FILE, INDEX_FILE, OWN_CONFIG_KEY, SHARD_PATTERN, SINGLE_FILE,
                     TOKENIZER_FILES, TOKENIZER_FOLDER, PathLike)
from .naming import Naming, tied_weights
from .scheme import compressed_tensors_config


def _is_router(module: torch.nn.Module) -> bool:
    """A float layer that other readers build as a Linear: transformers 5's MoE routers (TopKRouter modules that
    hold a 2-D `weight` of their own) are plain nn.Linear in vLLM, sglang and transformers 4."""
    weight = dict(module.named_parameters(recurse=False)).get("weight")
    return weight is not None and weight.dim() == 2 and not isinstance(module, (torch.nn.Linear, torch.nn.Embedding))


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


def _checkpoint_tensors(model: torch.nn.Module, naming: Naming):
    """(tensors by checkpoint name, checkpoint names of the Linear-like layers kept float, the schemes of the layers
    not W8A8 by checkpoint name)."""
    tensors: Dict[str, torch.Tensor] = {}
    float_layers: List[str] = []
    schemes: Dict[str, QuantScheme] = {}  # int4 layers, int8 layers whose activations are not dynamic symmetric
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
        schemes[prefix] = QuantScheme(WeightScheme(4, group, symmetric=zero is None))  # integer zero points

    def layer(name: str, module: W8A8Linear) -> None:
        """A W8A8Linear as int-quantized tensors, a W4A8Linear as pack-quantized ones."""
        if isinstance(module, W4A8Linear):
            return int4(naming.checkpoint_name(name), name, *module.int4_weight(), module.w_scale, module.bias)
        linear(name, module.int8_weight(), module.w_scale, module.bias)
        if module.scheme != W8A8:
            prefix = naming.checkpoint_name(name)
            schemes[prefix] = module.scheme
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
        elif expert_weights(module) is not None:  # experts that quantize_model was told to skip
            gate_up, down = (w.detach() for w in expert_weights(module))
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
    tied = set(tied_weights(model))
    seen = set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if key in tied or key.rpartition(".")[0] in written_per_layer:
            continue
        tensors[naming.checkpoint_name(key)] = tensor.detach().clone() if id(tensor) in seen else \
            tensor.detach().contiguous()
        seen.add(id(tensor))
    return tensors, float_layers, schemes


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


def _save_tokenizer(tokenizer, directory: Path) -> None:
    """tokenizer: an object with save_pretrained (a transformers tokenizer), or a directory whose tokenizer files
    (TOKENIZER_FILES) are copied: each a regular file or a link to one (a Hugging Face snapshot links every file into
    its blobs); any other kind of entry raises ValueError naming it."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
        return
    source = Path(tokenizer)
    if not source.is_dir():
        raise ValueError(f"tokenizer: expected a tokenizer or a directory holding its files, got "
                         f"{echo(str(tokenizer))}")
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
    files there are left as they are. config.json is what marks the directory complete: an earlier one is removed
    first and ours is put in place last, so a save killed midway leaves the earlier checkpoint whole (killed while
    staging), the new one whole, or a directory without config.json, which no reader (load_quantized, vLLM,
    transformers) takes for a checkpoint; it leaves a .w8a8_cpu-staging-* folder there (delete it). The earlier
    checkpoint stays whole until the new one is staged, so the disk needs room for both."""
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
    for target, source in tied_weights(model).items():
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
    tensors, float_layers, schemes = _checkpoint_tensors(model, Naming(config))
    has_int8 = any(t.dtype == torch.int8 for t in tensors.values())  # int8 weights (int4 ones are packed in int32)

    config_dict = config.to_dict()
    config_dict["architectures"] = [type(model).__name__]
    config_dict["dtype"] = str(model.dtype).removeprefix("torch.")
    config_dict["quantization_config"] = compressed_tensors_config(float_layers, schemes, has_int8)
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
        files = sorted(stage.iterdir(), key=lambda file: file.name == CONFIG_FILE)  # config.json last
        _remove_earlier_checkpoint(directory, [f.name for f in files], tokenizer is not None)
        for file in files:
            publish(file, directory / file.name)


def _remove_earlier_checkpoint(directory: Path, staged: List[str], tokenizer_written: bool) -> None:
    """Before the `staged` files are put in place: remove what an earlier checkpoint in `directory` left that would be
    read with ours, its config.json first (from then on no reader takes the directory for a checkpoint until ours is
    in place), its weight files (single file, shards, index) always, and its tokenizer files (TOKENIZER_FILES,
    TOKENIZER_FOLDER) when this save writes a tokenizer (a stale chat_template.jinja would ship with it). A tokenizer
    the caller saved there stays when this save writes none; other files are the caller's. A directory at the name of
    a file to remove or to write raises ValueError naming it, before anything is removed."""
    names = {SINGLE_FILE, INDEX_FILE, *(TOKENIZER_FILES if tokenizer_written else ())}
    stale = [entry for entry in directory.iterdir() if entry.name in names or SHARD_PATTERN.fullmatch(entry.name)
             or (tokenizer_written and entry.name == TOKENIZER_FOLDER)]
    if os.path.lexists(directory / CONFIG_FILE):
        stale.insert(0, directory / CONFIG_FILE)
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
