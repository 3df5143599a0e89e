"""load_quantized and load: a pre-quantized checkpoint directory into a transformers model built on the meta device,
quantized layers built from their stored integers (never from float weights)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from ..._functions import check_static_activation_params
from ..._untrusted import echo, listing
from ...nn import W4A8Experts, W4A8Linear, W8A8Experts, W8A8Linear, fuse_projections, quantize_model
from ...nn.experts import expert_weights, require_plain_silu_experts
from ...nn.transform import replace_module
from ...scheme import DYNAMIC, ActivationScheme
from ..pack_quantized import unpack_int4_rows
from .layout import CONFIG_FILE, GENERATION_FILE, OWN_CONFIG_KEY, PathLike
from .model_config import check_against_headers, empty_model, parse_model_config
from .naming import Naming, tied_weights
from .reader import FLOAT_DTYPES, StoredTensors, read_json
from .scheme import Int4Args, Scheme, read_scheme


def _require_fusable(name: str, module: torch.nn.Module, gate_up_q: torch.Tensor, down_q: torch.Tensor) -> None:
    """The checkpoint's experts module must compute what the fused experts do (nn.experts.require_plain_silu_experts: a
    clamp such as DeepSeek-V4's swiglu_limit would be dropped, silently), probed with one expert's stored integer
    weights: the forward's form is tested, not the values."""
    try:
        require_plain_silu_experts(module, gate_up_q, down_q)
    except ValueError as e:
        raise ValueError(f"model: {name}: {e}") from None


class _Loader:
    """Fills a model built on the meta device from the checkpoint, layer by layer. A layer given a shard (a
    LinearShard / ExpertShard of w8a8_cpu.distributed) is read only in that shard's part and built by it."""

    def __init__(self, model, tensors: StoredTensors, scheme: Scheme):
        self.model, self.tensors, self.scheme = model, tensors, scheme
        self.naming = Naming(model.config)

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
                self.scheme.activation_args(layer, classes) != DYNAMIC:
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

    def _int4_values(self, layer: str, args: "Int4Args", n: int, k: int):
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
                raise ValueError(f"{self.tensors._where(f'{layer}.weight_shape')} is {echo(shape.tolist())}; the "
                                 f"model's layer is [{n}, {k}]")
            q = unpack_int4_rows(packed, k)
        else:
            q = self.tensors.int8(f"{layer}.weight", [n, k])
            if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
                raise ValueError(f"{self.tensors._where(f'{layer}.weight')} holds values outside int4's [-8, 7]")
        scale = self.tensors.floating(f"{layer}.weight_scale", [n, groups], torch.float32)
        self.tensors.check_scales(f"{layer}.weight_scale", scale, 15)  # |code - zero point| <= 15
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

    def _int4_linear(self, name: str, layer: str, args: "Int4Args", module: torch.nn.Linear) -> None:
        """An int4 layer (_int4_values) as a W4A8Linear."""
        values = self._int4_values(layer, args, *module.weight.shape)
        bias = None if module.bias is None else self.tensors.floating(f"{layer}.bias", module.bias.shape,
                                                                      torch.float32)
        try:
            packed = W4A8Linear(*values, args.group_size, bias)
        except ValueError as e:  # the packer's bounds on the scales (their fp32 group sum)
            raise ValueError(f"{self.tensors._where(f'{layer}.weight_scale')} cannot be packed: {e}") from None
        replace_module(self.model, name, packed)

    def linear(self, name: str, module: torch.nn.Linear, shard=None) -> None:
        layer = self.naming.checkpoint_name(name)
        classes = [c.__name__ for c in type(module).__mro__ if issubclass(c, torch.nn.Module)]
        strategy = self._strategy(layer, classes)
        activations = self.scheme.activation_args(layer, classes)
        if activations != DYNAMIC and shard is not None:
            raise ValueError(f"{self.tensors.directory}: {layer} has static or asymmetric activations; a sharded load "
                             f"splits it, which w8a8_cpu.distributed does for dynamic per-token symmetric ones only")
        if isinstance(strategy, Int4Args):
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
            return replace_module(self.model, name, shard.build(weight, scale, bias))
        activation_params = self._activation_params(layer, activations)
        replace_module(self.model, name, W8A8Linear(weight, scale, bias, **activation_params))

    def _activation_params(self, layer: str, activations: ActivationScheme) -> dict:
        """W8A8Linear's activation arguments: a static layer's input_scale [1] (or a scalar), finite and > 0, and its
        input_zero_point [1] (int8 or int32) in [-128, 127] when asymmetric."""
        params = {"symmetric_activations": activations.symmetric}
        if activations.static:
            key = f"{layer}.input_scale"
            params["input_scale"] = self.tensors._take(key, tuple(FLOAT_DTYPES), [[1], []], "a static activation "
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
        gate_up, down = expert_weights(module)
        experts, inter2, hidden = gate_up.shape
        shapes = ((inter2 // 2, hidden), (inter2 // 2, hidden), (hidden, inter2 // 2))
        all_layers = self.naming.expert_linears(name, experts)
        strategies = [self._strategy(layer, ("Linear",)) for layers in all_layers for layer in layers]
        if any(isinstance(strategy, Int4Args) for strategy in strategies):
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
        replace_module(self.model, name, local if shard is None else shard.build(local))

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
        experts, inter2, hidden = expert_weights(module)[0].shape
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
        try:
            packed = W4A8Experts(*w13, *w2, args.group_size)
        except ValueError as e:  # the packer's bounds on the scales (their fp32 group sum)
            raise ValueError(f"{name}: the experts' weight_scale cannot be packed: {e}") from None
        replace_module(self.model, name, packed)

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
    model = load(directory, dtype=dtype)[0]
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


def load(directory: PathLike, plan=None, dtype: Optional[torch.dtype] = None):
    """(model, plan(model, headers) or None): the checkpoint as load_quantized reads it (without its fuse and
    quantize_embedding steps), or with `plan` (called on the model built on the meta device and the checkpoint's
    tensor headers, {name: "file dtype shape"}; it returns w8a8_cpu.distributed's ShardPlan) a sharded load: each
    layer in plan.linears / plan.experts is read only in its part and built by its shard."""
    from transformers import GenerationConfig

    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"directory: {directory} is not a directory")
    config_file = directory / CONFIG_FILE
    if not os.path.lexists(config_file):  # save_compressed puts it in place last
        raise ValueError(f"{directory}: no {CONFIG_FILE}; not a checkpoint directory, or a save into it was "
                         f"interrupted (save it again)")
    config_dict = read_json(config_file)
    scheme = read_scheme(config_dict, str(config_file))
    config, dtype = parse_model_config(config_dict, str(config_file), dtype)
    with contextlib.ExitStack() as stack:
        tensors = StoredTensors(directory, stack)
        check_against_headers(config, list(tensors.unused), str(config_file))
        model = empty_model(config, dtype, str(config_file))
        shards = None if plan is None else plan(model, tensors.headers())
        linear_shards, expert_shards = ({}, {}) if shards is None else (shards.linears, shards.experts)
        loader = _Loader(model, tensors, scheme)
        tied = set(tied_weights(model))
        unloaded_shards = set(linear_shards) | set(expert_shards)
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and f"{name}.weight" not in tied:
                loader.linear(name, module, linear_shards.get(name))
            elif expert_weights(module) is not None:
                loader.experts(name, module, expert_shards.get(name))
            else:
                continue
            unloaded_shards.discard(name)
        if unloaded_shards:  # never load a layer the plan splits whole: the sharded model would compute wrong sums
            raise ValueError(f"{directory}: layers to shard that the {config.model_type} model does not hold as linear "
                             f"layers or experts: {listing(sorted(unloaded_shards))}")
        loader.remaining(tied)
        if tensors.unused:
            raise ValueError(f"{directory}: holds tensors that belong to no part of the {config.model_type} model: "
                             f"{listing(list(tensors.unused))}")
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{directory}: the checkpoint does not provide {listing(left)}")
    generation_file = directory / GENERATION_FILE
    if os.path.lexists(generation_file):
        settings = read_json(generation_file)
        try:
            model.generation_config = GenerationConfig.from_dict(settings)
        except Exception as e:  # noqa: BLE001 - any failure to parse an untrusted file is that file's error
            raise ValueError(f"{generation_file}: not a valid generation config ({type(e).__name__})") from None
    return model.eval(), shards
