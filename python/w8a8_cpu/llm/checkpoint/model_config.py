"""config.json validated as untrusted input (sizes, flags, numbers, types, against the weights' headers) and the model
it describes built on the meta device."""
from __future__ import annotations

import math
import re
from typing import Dict, Optional, Sequence

import torch

from ..._untrusted import echo

_MODEL_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

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
                raise ValueError(f"{where}: {echo(key)} must be a finite number, got {echo(value)}")
            number = type(value) in (int, float)
            if key in _CONFIG_AT_LEAST_ONE and not (number and value >= 1):
                raise ValueError(f"{where}: {key} must be a number >= 1, got {echo(value)}")
            if key in _CONFIG_NON_NEGATIVE and not (number and value >= 0):
                raise ValueError(f"{where}: {key} must be a number >= 0, got {echo(value)}")


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
                                 f"{echo(value)}")
    # GPT-Neo's attention_types, [[kinds, count], ...], expand to that many layers in its config's constructor
    layer_types = config_dict.get("attention_types")
    if isinstance(layer_types, list):
        counts = [entry[1] if isinstance(entry, list) and len(entry) == 2 else None for entry in layer_types]
        if not all(type(c) is int and c >= 1 for c in counts) or sum(counts) > _CONFIG_SIZES["num_hidden_layers"]:
            raise ValueError(f"{where}: attention_types must be [[kinds, count], ...] with counts >= 1 summing to at "
                             f"most {_CONFIG_SIZES['num_hidden_layers']} layers, got {echo(layer_types)}")


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
            raise ValueError(f"{where}: {key} must be true or false, got {echo(config_dict[key])}")
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
                                 f"{echo(value)}")
            continue
        expected, got = _json_kind(default), _json_kind(value)
        if got != expected and not (expected == "a number" and got == "an integer"):
            raise ValueError(f"{where}: {key} must be {expected} (as {type(default).__name__} in transformers' "
                             f"config), got {echo(value)}")


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d{1,9})\.")
_EXPERT_INDEX = re.compile(r"\.experts\.(\d{1,9})\.")


def check_against_headers(config, names: Sequence[str], where: str) -> None:
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


def parse_model_config(config_dict: dict, where: str, dtype: Optional[torch.dtype]):
    from transformers import CONFIG_MAPPING

    model_type = config_dict.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(f"{where}: model_type is {echo(model_type)}; expected a model type this transformers knows")
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
        raise ValueError(f"{where}: not a valid {model_type} config ({type(e).__name__}: {echo(str(e))})") from None
    if dtype is None:
        stored = config_dict.get("dtype", config_dict.get("torch_dtype")) or "float32"
        if not isinstance(stored, str) or stored not in _MODEL_DTYPES:
            raise ValueError(f"{where}: dtype is {echo(stored)}; expected one of {sorted(_MODEL_DTYPES)}")
        dtype = _MODEL_DTYPES[stored]
    elif dtype not in _MODEL_DTYPES.values():
        raise ValueError(f"dtype: expected torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
    return config, dtype


_MAX_BUFFER_BYTES = 1 << 30  # a model's non-parameter tensors (masks, rotary tables): tens of MiB in real models


def empty_model(config, dtype: torch.dtype, where: str):
    """The causal LM of `config` with every parameter on the meta device, so that no float weight is ever allocated,
    and real buffers. This is transformers' own from_pretrained path: build on meta, then give each buffer real
    storage and let the model's _init_weights compute it (rotary inv_freq and the like). Errors name `where`."""
    from transformers import AutoModelForCausalLM

    def building(step):
        try:
            return step()
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError, RuntimeError, AssertionError) as e:
            raise ValueError(f"{where}: no causal LM can be built from it ({type(e).__name__}: "
                             f"{echo(str(e))})") from None

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
