"""W8A8 checkpoints: save_compressed / load_quantized round trips on tiny dense and MoE models, interop with the
compressed-tensors library and transformers in both directions, sglang's w8a8_int8 layout, refusal of schemes the
kernels cannot run exactly, and validation of malformed (untrusted) checkpoint files."""
import copy
import json
import os
import re
import shutil
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import alarm
import w8a8_cpu
from w8a8_cpu.nn import W8A8Experts, W8A8Linear, quantize_model
from w8a8_cpu import unpack_weight

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built from configs; nothing may be downloaded
transformers = pytest.importorskip("transformers")  # brings safetensors
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from w8a8_cpu.llm.checkpoint import INDEX_FILE, SINGLE_FILE, load_quantized, save_compressed  # noqa: E402
from tiny_models import (LLM_SKIP, MOE_ARCHITECTURES, TINY, dequantized_int8, logits,  # noqa: E402
                         tiny_causal_lm)

MODELS = {  # test id: tiny_causal_lm's arguments
    "llama-tied": dict(arch="llama", tied=True),
    "qwen2": dict(arch="qwen2"),
    "mixtral": dict(arch="mixtral", intermediate_size=48),
    "qwen2_moe": dict(arch="qwen2_moe"),
    "qwen3_moe": dict(arch="qwen3_moe"),
}
SHARD_BYTES = 24_000  # splits every tiny model into several shards
Q_PROJ = "model.layers.0.self_attn.q_proj"


def float_model(name, dtype=torch.float32):
    return tiny_causal_lm(**MODELS[name], dtype=dtype)


def stored(directory):
    """All tensors of a checkpoint directory, single-file or sharded."""
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def dequantized_weights(model):
    """Float weights int8 * scale of every W8A8 layer, by module name (experts fused as in transformers 5)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, W8A8Linear):
            out[f"{name}.weight"] = dequantized_int8(module.int8_weight(), module.w_scale)
        elif isinstance(module, W8A8Experts):
            w13, w2 = module.int8_weights()
            out[f"{name}.gate_up_proj"] = dequantized_int8(w13, module.w13_scale)
            out[f"{name}.down_proj"] = dequantized_int8(w2, module.w2_scale)
    return out


@pytest.fixture(scope="module")
def quantized():
    """Quantized models by arch, built once per module (tests must not modify them)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = quantize_model(float_model(arch), skip=LLM_SKIP)
        return cache[arch]
    return get


# ---- round trips -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shard_bytes", [None, SHARD_BYTES], ids=["single", "sharded"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_round_trip_logits_bit_identical(arch, shard_bytes, quantized, tmp_path):
    model = quantized(arch)
    save_compressed(model, tmp_path, max_shard_bytes=shard_bytes)
    assert (tmp_path / INDEX_FILE).exists() == (shard_bytes is not None)
    assert (tmp_path / SINGLE_FILE).exists() == (shard_bytes is None)
    loaded = load_quantized(tmp_path)
    assert torch.equal(logits(loaded), logits(model))
    assert type(loaded) is type(model)
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in stored(tmp_path)
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    else:
        assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_float_experts_round_trip(tmp_path):
    """Experts left float by quantize_model are stored per expert in float and stacked back on load."""
    model = quantize_model(float_model("qwen3_moe"), skip=LLM_SKIP + ["*.experts"])
    save_compressed(model, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.experts.3.down_proj" in qc["ignore"]
    loaded = load_quantized(tmp_path)
    assert not any(isinstance(m, W8A8Experts) for m in loaded.modules())
    assert torch.equal(logits(loaded), logits(model))


def test_bfloat16_model_round_trip(tmp_path):
    # built in bfloat16 as from_pretrained would: model.to(bfloat16) would also round the rotary inv_freq buffer
    model = quantize_model(float_model("qwen2", torch.bfloat16), skip=LLM_SKIP)
    save_compressed(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_quantized(tmp_path)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(logits(loaded), logits(model))
    assert load_quantized(tmp_path, dtype=torch.float32).model.embed_tokens.weight.dtype == torch.float32


def test_written_config_and_layout(quantized, tmp_path):
    save_compressed(quantized("mixtral"), tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == \
        ("compressed-tensors", "int-quantized", "compressed")
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == \
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    assert {k: group["input_activations"][k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == \
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    assert set(qc["ignore"]) == {"lm_head", "model.layers.0.block_sparse_moe.gate",
                                 "model.layers.1.block_sparse_moe.gate"}
    with safe_open(str(tmp_path / SINGLE_FILE), "pt") as f:
        assert f.get_slice("model.layers.1.block_sparse_moe.experts.3.w3.weight").get_dtype() == "I8"
        scale = f.get_slice("model.layers.1.block_sparse_moe.experts.3.w3.weight_scale")
        assert (scale.get_dtype(), scale.get_shape()) == ("F32", [48, 1])
        assert f.get_slice("model.layers.1.block_sparse_moe.gate.weight").get_dtype() == "F32"
    assert (tmp_path / "generation_config.json").exists()


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_tensor_names_match_transformers_save_pretrained(arch, quantized, tmp_path):
    """Our names are those transformers 5 itself writes for the float model (per-expert MoE names included)."""
    float_model(arch).save_pretrained(tmp_path / "float")
    save_compressed(quantized(arch), tmp_path / "w8a8")
    ours = {k for k in stored(tmp_path / "w8a8") if not k.endswith(".weight_scale")}
    assert ours == set(stored(tmp_path / "float"))


def test_resave_of_a_loaded_model_replaces_previous_shards(quantized, tmp_path):
    save_compressed(quantized("qwen2_moe"), tmp_path / "first")
    loaded = load_quantized(tmp_path / "first")
    save_compressed(loaded, tmp_path / "second", max_shard_bytes=SHARD_BYTES)
    save_compressed(loaded, tmp_path / "second")
    assert sorted(p.name for p in (tmp_path / "second").iterdir() if "safetensors" in p.name) == [SINGLE_FILE]
    first, second = stored(tmp_path / "first"), stored(tmp_path / "second")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


# ---- no float weights of quantized layers on load --------------------------------------------------------------

class _FloatTensorSpy(TorchDispatchMode):
    """Records the shape of every real (non-meta) floating-point tensor any torch op produces."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta:
                self.shapes.add(tuple(t.shape))
        return out


def test_load_never_creates_float_weights_of_quantized_layers(quantized, tmp_path):
    model = quantized("qwen2_moe")
    save_compressed(model, tmp_path)
    quantized_shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, W8A8Linear)}
    for m in model.modules():
        if isinstance(m, W8A8Experts):
            e, h, i = m.num_experts, m.hidden_dim, m.intermediate_dim
            quantized_shapes |= {(e, 2 * i, h), (e, h, i), (i, h), (h, i), (2 * i, h)}
    float_shapes = {tuple(p.shape) for p in model.parameters()}
    assert not quantized_shapes & float_shapes  # the spy below could not tell them apart
    with _FloatTensorSpy() as spy:
        loaded = load_quantized(tmp_path)
    assert (TINY["vocab_size"], TINY["hidden_size"]) in spy.shapes  # it does see the float tensors loaded
    assert not spy.shapes & quantized_shapes
    float_bytes = sum(p.numel() * p.element_size() for p in loaded.parameters())
    assert float_bytes == sum(p.numel() * p.element_size() for p in model.parameters())  # embeddings, norms, routers


# ---- compressed-tensors / transformers read our checkpoints ----------------------------------------------------

@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # only `dequantize` is taken
@pytest.mark.parametrize("arch", ["llama-tied", "qwen2"])
def test_transformers_compressed_tensors_dequantizes_ours(arch, quantized, tmp_path):
    """transformers' compressed-tensors integration reads our config and decompresses int8 * scale exactly."""
    pytest.importorskip("compressed_tensors")
    model = quantized(arch)
    save_compressed(model, tmp_path)
    ct = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    weights = ct.state_dict()
    for name, want in dequantized_weights(model).items():
        assert torch.equal(weights[name], want), name
    assert torch.isfinite(logits(ct)).all()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_compressed_tensors_converter_dequantizes_our_moe(arch, quantized, tmp_path):
    """transformers 5.24's compressed-tensors loader dequantizes only packed (int4) and fp8 MoE experts, so MoE
    checkpoints are read back with compressed-tensors' own file-level dequantizer, then loaded by transformers."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.convert_checkpoint import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    model = quantized(arch)
    save_compressed(model, tmp_path / "w8a8", max_shard_bytes=SHARD_BYTES)
    # Its file-level matcher takes target "Linear" as every `*.weight`; embeddings and norms must be named
    dequantizer = CompressedTensorsDequantizer(tmp_path / "w8a8", ignore=["model.embed_tokens", "re:.*norm$"],
                                               dtype=torch.float32)
    convert_checkpoint(tmp_path / "w8a8", tmp_path / "float", dequantizer, device="cpu", max_workers=1)
    assert not any(k.endswith("_scale") for k in stored(tmp_path / "float"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float")
    weights = reloaded.state_dict()
    for name, want in dequantized_weights(model).items():
        assert torch.equal(weights[name], want), name
    assert torch.isfinite(logits(reloaded)).all()


# ---- checkpoints written by others load with ours --------------------------------------------------------------

def compressed_tensors_checkpoint(model, directory, strategy):
    """Quantize `model` with compressed-tensors (int8 `strategy` weights, int8 dynamic per-token activations,
    lm_head ignored), set absmax weight scales as a calibration would, and let compressed-tensors compress and
    save it. Returns the model (now decompressing itself on its first forward)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy=strategy, dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            weight = module.weight.detach()
            scale = w8a8_cpu.quantize_weight(weight)[1] if strategy == "channel" else weight.abs().amax() / 127
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    return model


def test_compressed_tensors_written_channel_checkpoint_loads_bit_identical(tmp_path):
    """Same scales as quantize_weight, so the int8 weights agree too (compressed-tensors rounds w / scale, ours
    w * (127 / amax): a one-step difference is possible at exact ties, about 1 weight in 10^6, none here) and the
    logits are bit-identical to our own quantize_model of the same float model."""
    pytest.importorskip("compressed_tensors")
    ours = quantize_model(float_model("qwen2"), skip=["lm_head"])
    compressed_tensors_checkpoint(float_model("qwen2"), tmp_path, "channel")
    loaded = load_quantized(tmp_path)
    for name, module in ours.named_modules():
        if isinstance(module, W8A8Linear):
            assert torch.equal(loaded.get_submodule(name).int8_weight(), module.int8_weight()), name
    assert torch.equal(logits(loaded), logits(ours))


def test_compressed_tensors_written_tensor_strategy_checkpoint_loads(tmp_path):
    """One scale per weight, broadcast exactly to every channel. compressed-tensors' own forward fake-quantizes
    activations with scale amax / 127.5 (its symmetric range is [-128, 127]) rather than vLLM's amax / 127, so the
    logits are compared to it with a tolerance; the weights are compared exactly."""
    pytest.importorskip("compressed_tensors")
    ct_model = compressed_tensors_checkpoint(float_model("llama-tied"), tmp_path, "tensor")
    files = stored(tmp_path)
    loaded = load_quantized(tmp_path)
    q_proj = loaded.model.layers[0].self_attn.q_proj
    assert torch.equal(q_proj.int8_weight(), files["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(q_proj.w_scale, files["model.layers.0.self_attn.q_proj.weight_scale"].expand(64))
    got, want = logits(loaded), logits(ct_model)
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


def sglang_checkpoint(model, directory):
    """sglang's w8a8_int8 layout written directly: int8 `weight` and fp32 `weight_scale` [N, 1] per W8A8Linear,
    everything else float as state_dict has it."""
    tensors = {}
    for key, value in model.state_dict().items():
        owner = key.rpartition(".")[0]
        module = model.get_submodule(owner)
        if not isinstance(module, W8A8Linear):
            tensors[key] = value.contiguous()
        elif key.endswith(".w_scale"):
            tensors[f"{owner}.weight"] = module.int8_weight()
            tensors[f"{owner}.weight_scale"] = module.w_scale.reshape(-1, 1).clone()
        elif key.endswith(".bias"):
            tensors[key] = value.clone()
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, SINGLE_FILE), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "w8a8_int8"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def test_sglang_w8a8_int8_checkpoint_loads(tmp_path):
    """A layer stored float (here one down_proj, and lm_head) stays float; the rest runs W8A8, bit-identical."""
    model = quantize_model(float_model("qwen2"), skip=["lm_head", "model.layers.1.mlp.down_proj"])
    sglang_checkpoint(model, tmp_path)
    loaded = load_quantized(tmp_path)
    assert type(loaded.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert isinstance(loaded.model.layers[0].mlp.down_proj, W8A8Linear)
    assert torch.equal(logits(loaded), logits(model))


def test_sglang_experts_partly_float_are_refused(quantized, tmp_path):
    save_compressed(quantized("qwen3_moe"), tmp_path)
    edit_config(tmp_path, lambda qc: {"quant_method": "w8a8_int8"})
    edit_tensors(tmp_path, lambda t: (t.pop("model.layers.0.mlp.experts.1.up_proj.weight_scale"),
                                      t.update({"model.layers.0.mlp.experts.1.up_proj.weight": torch.zeros(48, 64)})))
    with pytest.raises(ValueError, match=r"experts of model\.layers\.0\.mlp\.experts are partly int8"):
        load_quantized(tmp_path)


# ---- refusals: schemes the kernels cannot run exactly ----------------------------------------------------------

def edit_config(directory, change):
    """Rewrite config.json's quantization_config as change(qc) returns it (or as change edits it in place)."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    new = change(config["quantization_config"])
    config["quantization_config"] = config["quantization_config"] if new is None else new
    with open(path, "w") as f:
        json.dump(config, f)


def edit_tensors(directory, change):
    path = os.path.join(directory, SINGLE_FILE)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def saved_llama(quantized, tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save_compressed(quantized("llama-tied"), directory)
    return directory


@pytest.fixture
def checkpoint(saved_llama, tmp_path):
    """A private copy of the saved tied Llama checkpoint, to corrupt."""
    return shutil.copytree(saved_llama, tmp_path / "ckpt")


def group_field(path, value):
    """A change setting config_groups.group_0.<path> (dotted) to value."""
    def change(qc):
        section = qc["config_groups"]["group_0"]
        *parents, leaf = path.split(".")
        for p in parents:
            section = section[p]
        section[leaf] = value
    return change


def top_field(field, value):
    return lambda qc: qc.update({field: value})


def top_level_format(value):
    """The format given at the top level only (the group has none), as older compressed-tensors wrote it."""
    def change(qc):
        qc["config_groups"]["group_0"].pop("format")
        qc["format"] = value
    return change


REFUSED = [
    ("asymmetric weights", group_field("weights.symmetric", False), "weights.symmetric"),
    ("static per-token activations", group_field("input_activations.dynamic", False), "input_activations.dynamic"),
    ("dynamic per-tensor activations", group_field("input_activations.strategy", "tensor"),
     "input_activations.dynamic"),
    ("group activations", group_field("input_activations.strategy", "group"), "input_activations.strategy"),
    ("group weights", group_field("weights.strategy", "group"), "weights.strategy"),
    ("group size", group_field("weights.group_size", 128), "weights.group_size"),
    ("block weights", group_field("weights.block_structure", [128, 128]), "weights.block_structure"),
    ("2-bit weights", group_field("weights.num_bits", 2), "weights.num_bits"),
    ("4-bit activations", group_field("input_activations.num_bits", 4), "input_activations.num_bits"),
    ("fp8 weights", group_field("weights.type", "float"), "weights.type"),
    ("fp8 activations", group_field("input_activations.type", "float"), "input_activations.type"),
    ("dynamic weights", group_field("weights.dynamic", True), "weights.dynamic"),
    ("weight-only", group_field("input_activations", None), "input_activations"),
    ("output activations", group_field("output_activations", {"num_bits": 8}), "output_activations"),
    ("actorder group", group_field("weights.actorder", "group"), "weights.actorder"),
    ("unknown scheme field", group_field("weights.zero_point_mode", "x"), "'zero_point_mode'"),
    ("pack-quantized", group_field("format", "pack-quantized"), "format"),
    ("float-quantized", group_field("format", "float-quantized"), "format"),
    ("top-level pack-quantized", top_level_format("pack-quantized"), "format"),
    ("preset group", lambda qc: qc.update(config_groups={"W8A8": ["Linear"]}), "preset"),
    ("frozen status", top_field("quantization_status", "frozen"), "quantization_status"),
    ("kv cache", top_field("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    ("sparsity", top_field("sparsity_config", {"format": "sparse-24-bitmask"}), "sparsity_config"),
    ("transforms", top_field("transform_config", {"config_groups": {}}), "transform_config"),
    ("unknown top field", top_field("mystery", 1), "'mystery'"),
    ("bad ignore regex", top_field("ignore", ["re:("]), "ignore"),
    ("gptq", lambda qc: {"quant_method": "gptq", "bits": 4}, "quant_method"),
    ("fp8 method", lambda qc: {"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method"),
    ("sglang static", lambda qc: {"quant_method": "w8a8_int8", "activation_scheme": "static"}, "activation_scheme"),
    ("no quantization", lambda qc: "none", "quantization_config"),
]


@pytest.mark.parametrize("change,field", [pytest.param(c, f, id=i) for i, c, f in REFUSED])
def test_unsupported_scheme_refused(checkpoint, change, field):
    edit_config(checkpoint, change)
    with pytest.raises(ValueError, match=re.escape(field)) as raised:
        load_quantized(checkpoint)
    assert "config.json" in str(raised.value)


def test_naive_quantized_top_level_format_loads(checkpoint, quantized):
    """naive-quantized stores the same int8 weights and scales as int-quantized."""
    edit_config(checkpoint, top_level_format("naive-quantized"))
    assert torch.equal(logits(load_quantized(checkpoint)), logits(quantized("llama-tied")))


def test_regex_targets_and_ignore_are_honoured(tmp_path):
    """Only the MLPs are targeted (by regex) and layer 1's MLP is ignored (by name and by regex): those layers
    load float, the rest W8A8, and the logits match the model saved."""
    model = quantize_model(float_model("llama-tied"), skip=["lm_head", "*.self_attn.*", "model.layers.1.mlp.*"])
    save_compressed(model, tmp_path)

    def narrow(qc):
        qc["config_groups"]["group_0"]["targets"] = ["re:.*mlp\\.(gate|up|down)_proj$"]
        qc["ignore"] = ["model.layers.1.mlp.gate_proj", "re:model\\.layers\\.1\\.mlp\\.(up|down)_proj"]
    edit_config(tmp_path, narrow)
    loaded = load_quantized(tmp_path)
    assert isinstance(loaded.model.layers[0].mlp.up_proj, W8A8Linear)
    assert type(loaded.model.layers[1].mlp.up_proj) is torch.nn.Linear
    assert type(loaded.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert torch.equal(logits(loaded), logits(model))


def test_stored_int8_layer_outside_targets_refused(checkpoint):
    edit_config(checkpoint, group_field("targets", ["re:.*mlp\\.(gate|up|down)_proj$"]))
    with pytest.raises(ValueError, match=re.escape(f"'{Q_PROJ}.weight' is I8 [64, 64]; expected a float tensor")):
        load_quantized(checkpoint)  # attention is not targeted, so it must be stored float


# ---- untrusted files -------------------------------------------------------------------------------------------

@pytest.fixture
def sharded(quantized, tmp_path):
    save_compressed(quantized("llama-tied"), tmp_path, max_shard_bytes=SHARD_BYTES)
    return tmp_path


def edit_index(directory, change):
    path = os.path.join(directory, INDEX_FILE)
    with open(path) as f:
        index = json.load(f)
    change(index["weight_map"])
    with open(path, "w") as f:
        json.dump(index, f)


@pytest.mark.parametrize("file_name", ["../model-00001-of-00006.safetensors", "/etc/passwd.safetensors",
                                       "sub/model.safetensors", "..", 7])
def test_index_path_outside_directory_refused(sharded, file_name):
    edit_index(sharded, lambda m: m.update({"model.norm.weight": file_name}))
    with pytest.raises(ValueError, match=r"index\.json: weight_map\['model\.norm\.weight'\] is .*plain name"):
        load_quantized(sharded)


def test_missing_shard_refused(sharded):
    shard = sorted(p for p in sharded.iterdir() if p.name.startswith("model-"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=re.escape(f"names '{shard.name}', which does not exist")):
        load_quantized(sharded)


def test_malformed_index_refused(sharded):
    (sharded / INDEX_FILE).write_text('{"weight_map": ["model-00001-of-00006.safetensors"]}')
    with pytest.raises(ValueError, match=re.escape(f"{INDEX_FILE}: weight_map is missing or not a non-empty object")):
        load_quantized(sharded)


def test_index_and_single_file_together_refused(sharded):
    shutil.copy(sorted(sharded.glob("model-*.safetensors"))[0], sharded / SINGLE_FILE)
    with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
        load_quantized(sharded)


def test_index_listing_absent_tensor_refused(sharded):
    def move_norm(weight_map):  # to a shard that does not hold it
        weight_map["model.norm.weight"] = min(set(weight_map.values()) - {weight_map["model.norm.weight"]})
    edit_index(sharded, move_norm)
    with pytest.raises(ValueError, match=r"lists tensors that .* does not hold: 'model\.norm\.weight'"):
        load_quantized(sharded)


CORRUPTIONS = [
    ("float weight", lambda t: t.update({f"{Q_PROJ}.weight": torch.zeros(64, 64)}),
     f"'{Q_PROJ}.weight' is F32 [64, 64]; expected an int8 weight"),
    ("wrong weight shape", lambda t: t.update({f"{Q_PROJ}.weight": torch.zeros(64, 63, dtype=torch.int8)}),
     f"'{Q_PROJ}.weight' is I8 [64, 63]; expected an int8 weight"),
    ("int scale", lambda t: t.update({f"{Q_PROJ}.weight_scale": torch.ones(64, 1, dtype=torch.int32)}),
     f"'{Q_PROJ}.weight_scale' is I32 [64, 1]; expected channel weight scales: F16 or BF16 or F32 or F64 "
     f"[64, 1] or [64]"),
    ("fp8 scale dtype", lambda t: t.update({f"{Q_PROJ}.weight_scale": torch.ones(64, 1).to(torch.float8_e4m3fn)}),
     f"'{Q_PROJ}.weight_scale' is F8_E4M3"),
    ("wrong scale count", lambda t: t.update({f"{Q_PROJ}.weight_scale": torch.ones(63, 1)}),
     f"'{Q_PROJ}.weight_scale' is F32 [63, 1]; expected channel weight scales"),
    ("nan scale", lambda t: t[f"{Q_PROJ}.weight_scale"].__setitem__(3, float("nan")), "not finite and > 0"),
    ("zero scale", lambda t: t[f"{Q_PROJ}.weight_scale"].__setitem__(3, 0.0), "not finite and > 0"),
    ("negative scale", lambda t: t[f"{Q_PROJ}.weight_scale"].__setitem__(3, -1.0), "not finite and > 0"),
    ("missing scale", lambda t: t.pop(f"{Q_PROJ}.weight_scale"), f"'{Q_PROJ}.weight_scale' (channel weight scales) "
                                                                   f"is missing"),
    ("missing norm", lambda t: t.pop("model.norm.weight"), "'model.norm.weight' (a float tensor) is missing"),
    ("wrong norm shape", lambda t: t.update({"model.norm.weight": torch.ones(65)}), "'model.norm.weight' is F32 [65]"),
    ("int embedding", lambda t: t.update({"model.embed_tokens.weight": torch.ones(256, 64, dtype=torch.int8)}),
     "'model.embed_tokens.weight' is I8 [256, 64]; expected a float tensor"),
    ("unexpected tensor", lambda t: t.update({f"{Q_PROJ}.input_scale": torch.ones(1)}),
     f"belong to no part of the llama model: '{Q_PROJ}.input_scale'"),
    ("untied lm_head stored", lambda t: t.update({"lm_head.weight": torch.ones(256, 64)}),
     "belong to no part of the llama model: 'lm_head.weight'"),
]


@pytest.mark.parametrize("change,message", [pytest.param(c, m, id=i) for i, c, m in CORRUPTIONS])
def test_malformed_tensor_refused(checkpoint, change, message):
    edit_tensors(checkpoint, change)
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        load_quantized(checkpoint)
    assert str(checkpoint) in str(raised.value)


def test_echoed_names_are_truncated(checkpoint):
    edit_tensors(checkpoint, lambda t: t.update({"x" * 10_000: torch.ones(1)}))
    with pytest.raises(ValueError, match="belong to no part") as raised:
        load_quantized(checkpoint)
    assert len(str(raised.value)) < 500


@pytest.mark.parametrize("text,message", [("[1, 2]", "expected a JSON object, got list"),
                                          ("{", "cannot be read as JSON"),
                                          ("{}", "quantization_config is None")])
def test_malformed_config_refused(checkpoint, text, message):
    (checkpoint / "config.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        load_quantized(checkpoint)
    assert "config.json" in str(raised.value)


def test_unknown_model_type_refused(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "nonsense"}))
    with pytest.raises(ValueError, match="config.json: model_type is 'nonsense'"):
        load_quantized(checkpoint)


@pytest.mark.parametrize("field", ["num_attention_heads", "num_key_value_heads"])
def test_zero_heads_refused(checkpoint, field):
    """transformers divides by these while building the config or the model: ZeroDivisionError becomes ValueError."""
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, field: 0}))
    with pytest.raises(ValueError, match="config.json: (not a valid|no causal LM|num_.*_heads must be an integer in)"):
        load_quantized(checkpoint)


def test_not_a_safetensors_file_refused(checkpoint):
    (checkpoint / SINGLE_FILE).write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_quantized(checkpoint)


def test_missing_weights_refused(checkpoint):
    (checkpoint / SINGLE_FILE).unlink()
    with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
        load_quantized(checkpoint)


# ---- save refusals ---------------------------------------------------------------------------------------------

def test_save_refuses_quantized_tied_lm_head(tmp_path):
    model = quantize_model(float_model("llama-tied"), skip=["*.gate"])
    with pytest.raises(ValueError, match="ties lm_head.weight to model.embed_tokens.weight, but the model holds"):
        save_compressed(model, tmp_path)
    model.config.tie_word_embeddings = False  # the way out the message names
    save_compressed(model, tmp_path)
    assert torch.equal(logits(load_quantized(tmp_path)), logits(model))


def test_save_refuses_bad_shard_size(quantized, tmp_path):
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_compressed(quantized("qwen2"), tmp_path, max_shard_bytes=0)


def test_save_refuses_unknown_moe_naming(tmp_path):
    model = quantize_model(float_model("qwen3_moe"), skip=LLM_SKIP)
    model.config = copy.deepcopy(model.config)
    model.config.model_type = "olmoe"  # fused experts whose per-expert names this module does not know
    with pytest.raises(ValueError, match="per-expert checkpoint naming of model_type 'olmoe' is unknown"):
        save_compressed(model, tmp_path)


@pytest.mark.parametrize("arch", ["llama-tied", "qwen2"])
def test_fused_model_saves_per_layer_names_and_loads_fused(arch, quantized, tmp_path):
    """save splits the fused q/k/v and gate/up layers into the per-layer names on disk (the same tensors as the
    unfused model's checkpoint), load_quantized(fuse=True) fuses them again: logits bit-identical to the fused model."""
    from w8a8_cpu.nn import W8A8GatedMLP, W8A8LinearSlice, fuse_projections

    unfused = quantized(arch)
    save_compressed(unfused, tmp_path / "unfused")
    fused = copy.deepcopy(unfused)
    fuse_projections(fused)
    save_compressed(fused, tmp_path / "fused")
    on_disk, expected = stored(tmp_path / "fused"), stored(tmp_path / "unfused")
    assert sorted(on_disk) == sorted(expected)
    assert all(torch.equal(on_disk[k], expected[k]) for k in expected)
    loaded = load_quantized(tmp_path / "fused", fuse=True)
    assert isinstance(loaded.model.layers[0].self_attn.k_proj, W8A8LinearSlice)
    assert isinstance(loaded.model.layers[1].mlp, W8A8GatedMLP)
    assert torch.equal(logits(loaded), logits(fused))


@pytest.mark.parametrize("arch", ["llama-tied", "qwen2"])
def test_int8_embedding_saves_as_float_table_and_loads_int8(arch, tmp_path):
    """An int8 embedding (and the lm_head sharing its table when tied) is stored as the float table int8 * scale, the
    tied lm_head not written and in `ignore`, so float readers see an ordinary checkpoint (transformers loads it to
    the same logits); load_quantized holds it in int8 again by the config's flag: fp32 int8 values equal, one table
    shared by embedding and tied lm_head, logits equal to the saved model's to float rounding of the scales."""
    from w8a8_cpu.nn import W8A8Embedding

    model = quantize_model(float_model(arch), quantize_embedding=True)
    save_compressed(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["w8a8_cpu"] == {"int8_embedding": True}
    on_disk = stored(tmp_path)
    embedding = model.get_input_embeddings()
    assert on_disk["model.embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(on_disk["model.embed_tokens.weight"], embedding.dequantized())
    tied = arch == "llama-tied"
    assert ("lm_head.weight" in on_disk) != tied and ("lm_head" in config["quantization_config"]["ignore"]) == tied

    loaded = load_quantized(tmp_path)
    table = loaded.get_input_embeddings()
    assert isinstance(table, W8A8Embedding)
    assert torch.equal(unpack_weight(table.weight_packed), unpack_weight(embedding.weight_packed))
    torch.testing.assert_close(table.w_scale, embedding.w_scale, rtol=2 ** -23, atol=0)
    if tied:
        assert loaded.lm_head.weight_packed is table.weight_packed
    torch.testing.assert_close(logits(loaded), logits(model), rtol=1e-5, atol=1e-5)
    float_view = load_quantized(tmp_path, quantize_embedding=False)
    assert isinstance(float_view.get_input_embeddings(), torch.nn.Embedding)


@pytest.mark.parametrize("entry", ['"yes"', '{"int8_embedding": 1}', '{"int8_embedding": true, "x": 1}'])
def test_malformed_int8_embedding_flag_refused(entry, tmp_path):
    save_compressed(quantize_model(float_model("qwen2"), quantize_embedding=True), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["w8a8_cpu"] = json.loads(entry)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match='config.json: "w8a8_cpu" must be'):
        load_quantized(tmp_path)


# ---- files that are not what they claim (reliability round 2) ---------------------------------------------------

@pytest.mark.parametrize("name", ["config.json", "generation_config.json", INDEX_FILE])
@pytest.mark.parametrize("odd,message", [("fifo", "is not a regular file"), ("/dev/zero", "is not a regular file"),
                                         ("deep", "nested too deeply"), ("digits", "cannot be read as JSON"),
                                         ("huge", "larger than")])
def test_odd_json_files_refused_naming_them(sharded, name, odd, message):
    """A FIFO, a link to /dev/zero, 100000-deep nesting, a 5000-digit integer, a file beyond the size bound: a
    ValueError naming the file, at once (no hang, no memory exhaustion, no RecursionError)."""
    path = sharded / name
    path.unlink(missing_ok=True)
    if odd == "fifo":
        os.mkfifo(path)
    elif odd == "/dev/zero":
        os.symlink("/dev/zero", path)
    elif odd == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif odd == "digits":
        path.write_text('{"vocab_size": ' + "9" * 5000 + "}")
    else:
        with open(path, "wb") as f:
            f.truncate((1 << 26) + 1)
    with alarm(20, "blocked"), pytest.raises(ValueError, match=rf"{re.escape(name)}: .*{message}"):
        load_quantized(sharded)


@pytest.mark.parametrize("field,value", [("hidden_size", "64"), ("hidden_size", 64.5), ("hidden_size", 1e400),
                                         ("hidden_size", True), ("vocab_size", 0), ("num_hidden_layers", 100000),
                                         ("tie_word_embeddings", "yes")])
def test_wrong_typed_config_values_refused_naming_config(checkpoint, field, value):
    config = json.loads((checkpoint / "config.json").read_text())
    config[field] = value
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config.json: {field} must be"):
        load_quantized(checkpoint)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["rope_parameters"].update(rope_theta=-1), "rope_theta must be a number >= 1, got -1"),
    (lambda c: c["rope_parameters"].update(rope_theta=0.0), "rope_theta must be a number >= 1, got 0.0"),
    (lambda c: c.update(rope_theta="1e4"), "rope_theta must be a number >= 1, got '1e4'"),
    (lambda c: c.update(rms_norm_eps=-1e-6), "rms_norm_eps must be a number >= 0, got -1e-06"),
    (lambda c: c.update(rms_norm_eps=float("nan")), "'rms_norm_eps' must be a finite number, got nan"),
    (lambda c: c.update(initializer_range=float("inf")), "'initializer_range' must be a finite number, got inf"),
    (lambda c: c["rope_parameters"].update(rope_theta=1e-300), "rope_theta must be a number >= 1, got 1e-300"),
    (lambda c: c["rope_parameters"].update(rope_type="linear", factor=0.0), "factor must be a number >= 1, got 0.0"),
], ids=["rope_theta<0", "rope_theta=0", "rope_theta_string", "eps<0", "eps_nan", "inf", "rope_theta_tiny",
        "rope_factor_0"])
def test_config_numbers_out_of_their_range_refused(checkpoint, edit, message):
    """Values of the right type that would make the loaded model compute NaN logits (found by the fuzzer: a negative
    rope_theta loaded and gave NaN; by a review: rope_theta 1e-300 and a linear rope factor of 0 too), and non-finite
    numbers anywhere (Python's json reads NaN and Infinity)."""
    config = json.loads((checkpoint / "config.json").read_text())
    config.setdefault("rope_parameters", {"rope_theta": 10000.0, "rope_type": "default"})
    edit(config)
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(f"config.json: {message}")):
        load_quantized(checkpoint)


def test_layer_count_beyond_the_weights_refused_before_building(checkpoint):
    """num_hidden_layers larger than the layers the headers hold: refused from the headers, before a model of that
    many layers is built (1000 layers would take seconds and memory; this must be quick)."""
    config = json.loads((checkpoint / "config.json").read_text())
    config["num_hidden_layers"] = 1000
    (checkpoint / "config.json").write_text(json.dumps(config))
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"config.json: num_hidden_layers is 1000, but the weights hold layers 0\.\.1"):
        load_quantized(checkpoint)
    assert time.monotonic() - start < 5


def test_expert_count_beyond_the_weights_refused(quantized, tmp_path):
    save_compressed(quantized("qwen3_moe"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_local_experts"] = 60000
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: num_local_experts is 60000, but the weights hold experts 0\.\.3"):
        load_quantized(tmp_path)


@pytest.mark.parametrize("key,value", [("model.norm.weight", float("nan")), ("model.embed_tokens.weight", float("inf")),
                                       ("model.layers.0.input_layernorm.weight", 1e6)])
def test_non_finite_float_tensors_refused(checkpoint, key, value):
    """NaN/Inf in a float tensor (or a value beyond the load dtype's range: 1e6 in float16) would make every logit
    NaN: the load names the tensor instead."""
    def poison(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[3] = value

    edit_tensors(checkpoint, poison)
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(key)}' holds NaN or Inf values \(as float16\)"):
        load_quantized(checkpoint, dtype=torch.float16)


@pytest.mark.parametrize("pattern", ["re:([a-z._0-9]+)+#", "re:(a|a)*b", "re:(?:x*)*y", "re:((q)+_proj){2,}"])
def test_exponential_regex_targets_refused(checkpoint, pattern):
    """A `re:` entry that nests repetition would backtrack exponentially on a layer name: refused at once, naming it."""
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"]["ignore"] = [pattern]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with alarm(20, "blocked"), pytest.raises(ValueError, match=r"ignore entry .* repeats a group that itself repeats"):
        load_quantized(checkpoint)


@pytest.mark.parametrize("entries,message", [
    (["re:(?<=a+)lm_head"], "is not a valid regex (look-behind requires fixed-width pattern)"),
    (["re:" + ".*" * 20 + "#"], "holds 20 repeats (* + {m,n}), which can take a long time to match"),
    (["re:(?>" + ".*" * 12 + "#)"], "holds 12 repeats"),
    (["re:(a)?(?(1)" + ".*" * 12 + "#|x)"], "holds 12 repeats"),
    (["re:" + ".*" * 3 + f"x{i}" for i in range(22)], "holds too many `re:` entries with repeats"),
], ids=["compiler-only error", "20 repeats in sequence", "in an atomic group", "in a conditional group",
        "22 entries of three repeats"])
def test_slow_or_uncompilable_regex_targets_refused(checkpoint, entries, message):
    """A pattern only the compiler refuses is a ValueError naming config.json (it escaped as re.error), and repeats
    in sequence are bounded: `.*` 20 times backtracks through ~C(len(name) + 20, 20) positions on a failed match (the
    load never finished), so an entry holds at most 3 repeats and the list a bounded sum of that work, counted inside
    atomic and conditional groups too (they passed the first version of the check)."""
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"]["ignore"] = entries
    (checkpoint / "config.json").write_text(json.dumps(config))
    with alarm(20, "blocked"), pytest.raises(ValueError,
                                             match=r"config.json quantization_config: ignore .*" + re.escape(message)):
        load_quantized(checkpoint)


def test_real_world_regex_targets_load(checkpoint):
    """Targets as published checkpoints write them pass the bounds: alternatives count as the longest one (they are
    tried one after another), a fixed {n} is no repeat, and three entries of three repeats are well within the sum."""
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"]["ignore"] = [
        "lm_head", "re:.*vision_tower.*|.*multi_modal_projector.*|.*lm_head", "re:.*layers\\.\\d{2}\\.mlp\\.gate$",
        *[f"re:.*layers\\.\\d+\\..*(w[1-3]|gate_proj|up_proj|down_proj){i}$" for i in range(3)]]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with alarm(20, "blocked"):
        load_quantized(checkpoint)


def test_model_specific_size_names_are_bounded(checkpoint):
    """GPT-2 names its layer count n_layer; transformers reads it as num_hidden_layers through the config's
    attribute_map. 4000 of them passed the bound on num_hidden_layers (built for 21 s, +341 MiB, then failed on a
    missing tensor; 10^6 would exhaust memory): the bound holds under the model's own name too, before any model."""
    config = {"model_type": "gpt2", "n_layer": 4000, "n_embd": 32, "n_head": 4, "vocab_size": 256,
              "quantization_config": json.loads((checkpoint / "config.json").read_text())["quantization_config"]}
    (checkpoint / "config.json").write_text(json.dumps(config))
    start = time.monotonic()
    with pytest.raises(ValueError, match=re.escape("config.json: n_layer (num_hidden_layers) must be an integer in "
                                                   "[1, 1024] (or a list of them), got 4000")):
        load_quantized(checkpoint)
    assert time.monotonic() - start < 5
    # GPT-Neo's attention_types expand to their counts of layers in the config's constructor (10^9: a long loop)
    config = {"model_type": "gpt_neo", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 256,
              "attention_types": [[["global"], 10 ** 9]], "quantization_config": config["quantization_config"]}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with alarm(20, "blocked"), pytest.raises(ValueError,
                                             match=r"config.json: attention_types must be \[\[kinds, count\], "):
        load_quantized(checkpoint)


def test_buffers_that_grow_with_the_config_are_bounded(checkpoint):
    """GPT-Neo holds a bool causal mask of max_position_embeddings squared in every layer, given memory before any
    tensor is read: 65536 positions would be 8 GiB for 2 layers. Refused from the meta model, naming the file."""
    config = {"model_type": "gpt_neo", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 256,
              "attention_types": [[["global", "local"], 1]], "max_position_embeddings": 65536,
              "quantization_config": json.loads((checkpoint / "config.json").read_text())["quantization_config"]}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: the gpt_neo model of this config holds 8\.0 GiB of buffers"):
        load_quantized(checkpoint)


@pytest.mark.parametrize("arch,change,message", [
    ("llama-tied", {"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ("llama-tied", {"num_key_value_heads": 8}, "num_attention_heads (4) must be a multiple of num_key_value_heads (8)"),
    ("qwen2_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok (5) exceeds the 4 experts"),
])
def test_sizes_that_do_not_fit_together_refused(quantized, tmp_path, arch, change, message):
    """Each size in range, together impossible: it loaded, and the first forward failed deep in transformers
    (RuntimeError: size mismatch; selected index k out of range). Refused at load, naming config.json."""
    save_compressed(quantized(arch), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=re.escape(f"config.json: {message}")):
        load_quantized(tmp_path)


@pytest.mark.parametrize("scheme,largest", [("w8a8", 128), ("w4a8", 15)])
def test_scales_whose_weights_overflow_refused(tmp_path, scheme, largest):
    """A weight scale of 3e38 is finite and > 0, but its weights (codes times it) are Inf in fp32 and every logit was
    Inf: refused as a float checkpoint's Inf weight is, naming the tensor."""
    model = quantize_model(float_model("llama-tied"), skip=["lm_head"], scheme=scheme,
                           **({"group_size": 32} if scheme == "w4a8" else {}))
    save_compressed(model, tmp_path)
    key = "model.layers.0.mlp.down_proj.weight_scale"

    def huge(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[1] = 3e38

    edit_tensors(tmp_path, huge)
    with pytest.raises(ValueError, match=re.escape(f"tensor '{key}' holds a scale whose weights ({largest} x the "
                                                   f"scale) overflow fp32")):
        load_quantized(tmp_path)


@pytest.mark.parametrize("value", [0.0, -1.0])  # NaN / Inf: refused as any float tensor's
def test_int4_scales_not_finite_and_positive_refused(tmp_path, value):
    """An int4 group scale of 0 or below is no quantization grid (the int8 path refuses it too): refused naming the
    tensor, in a linear layer and in an expert projection alike (both read through one loader)."""
    model = quantize_model(float_model("llama-tied"), skip=["lm_head"], scheme="w4a8", group_size=32)
    save_compressed(model, tmp_path)
    key = "model.layers.0.mlp.down_proj.weight_scale"

    def edit(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[1] = value

    edit_tensors(tmp_path, edit)
    with pytest.raises(ValueError, match=re.escape(f"tensor '{key}' holds a scale that is not finite and > 0")):
        load_quantized(tmp_path)


def test_many_or_long_targets_bounded(checkpoint):
    """20000 entries (each was compiled per layer: 17 s) or a 10000-character one: refused naming the field; 1000
    regex entries load quickly (compiled once)."""
    config = json.loads((checkpoint / "config.json").read_text())
    qc = config["quantization_config"]
    for ignore, message in ((["x"] * 20000, "ignore length is 20000"), (["x" * 10000], "ignore entry is 'xxx.*at most 512 characters")):
        qc["ignore"] = ignore
        (checkpoint / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            load_quantized(checkpoint)
    qc["ignore"] = [f"re:.*nothing_{i}$" for i in range(1000)] + ["lm_head"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    start = time.monotonic()
    load_quantized(checkpoint)
    assert time.monotonic() - start < 10


# ---- W4A8 (pack-quantized) -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama-tied", "qwen2"])
@pytest.mark.parametrize("fuse", [False, True])
def test_w4a8_checkpoint_round_trip_is_bit_identical(arch, fuse, tmp_path):
    """Symmetric W4A8 layers are written pack-quantized (int4 packed 8 per int32, group scales, weight_shape) under
    their per-layer names; load_quantized builds W4A8Linear layers with the same int4 values and scales."""
    from w8a8_cpu.nn import W4A8Linear

    model = quantize_model(float_model(arch), skip=["lm_head"], scheme="w4a8", group_size=32, fuse=fuse)
    save_compressed(model, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and list(qc["config_groups"]) == ["group_1"]
    group = qc["config_groups"]["group_1"]
    assert group["weights"]["num_bits"] == 4 and group["weights"]["group_size"] == 32
    assert "model.layers.1.self_attn.k_proj" in group["targets"]
    files = stored(tmp_path)
    assert files["model.layers.0.mlp.down_proj.weight_packed"].dtype == torch.int32
    assert files["model.layers.0.mlp.down_proj.weight_shape"].tolist() == [64, 96]
    loaded = load_quantized(tmp_path, fuse=fuse)
    assert isinstance(loaded.model.layers[0].mlp.down_proj, W4A8Linear)
    assert torch.equal(logits(loaded), logits(model))


def test_w4a8_zero_points_round_trip_and_min_max_is_refused(tmp_path):
    """Asymmetric W4A8 with integer zero points is written pack-quantized with weight_zero_point (packed along the
    channels) and reads back bit-identical; min-max minimums (not integer zero points) are refused, naming why."""
    model = quantize_model(float_model("qwen2"), skip=["lm_head"], scheme="w4a8", symmetric=False)
    save_compressed(model, tmp_path / "zp")
    qc = json.loads((tmp_path / "zp" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_1"]["weights"]["symmetric"] is False
    assert stored(tmp_path / "zp")["model.layers.0.mlp.up_proj.weight_zero_point"].shape == (96 // 8, 2)
    assert torch.equal(logits(load_quantized(tmp_path / "zp")), logits(model))
    model = quantize_model(float_model("qwen2"), skip=["lm_head"], scheme="w4a8", symmetric=False, min_max=True)
    with pytest.raises(ValueError, match="not integer zero points .* quantize without min_max to save it"):
        save_compressed(model, tmp_path / "mm")


@pytest.mark.parametrize("arch,symmetric", [("mixtral", True), ("qwen3_moe", False)])
def test_w4a8_experts_round_trip_is_bit_identical(arch, symmetric, tmp_path):
    """W4A8Experts are written per expert as pack-quantized layers (the per-expert names, as int4 Linear layers are)
    and load back as W4A8Experts with the same int4 values: the logits are bit-identical. min_max experts are
    refused, naming the expert."""
    from w8a8_cpu.nn import W4A8Experts

    model = quantize_model(float_model(arch), skip=LLM_SKIP, scheme="w4a8", group_size=32, symmetric=symmetric)
    save_compressed(model, tmp_path / "q", max_shard_bytes=SHARD_BYTES)
    block = "block_sparse_moe.experts.3.w2" if arch == "mixtral" else "mlp.experts.3.down_proj"
    files = stored(tmp_path / "q")
    assert files[f"model.layers.1.{block}.weight_packed"].dtype == torch.int32
    assert (f"model.layers.1.{block}.weight_zero_point" in files) == (not symmetric)
    loaded = load_quantized(tmp_path / "q")
    experts = [m for m in loaded.modules() if isinstance(m, W4A8Experts)]
    assert len(experts) == 2
    assert torch.equal(logits(loaded), logits(model))
    # one expert layer of another group size: the module is not wholly one int4 kind
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    layer = f"model.layers.0.{block.replace('.3.', '.1.')}"
    groups["group_1"]["targets"].remove(layer)
    groups["group_2"] = {**groups["group_1"], "targets": [layer],
                         "weights": {**groups["group_1"]["weights"], "group_size": 64}}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="experts of model.layers.0.* are partly int4, or int4 of several group sizes"):
        load_quantized(tmp_path / "q")
    model = quantize_model(float_model(arch), skip=lambda name, module: isinstance(module, torch.nn.Linear),
                           scheme="w4a8", symmetric=False, min_max=True)  # the experts alone
    with pytest.raises(ValueError, match=r"model.layers.0.\S*experts \(expert 0\) holds int4 weights whose per-group "
                                         r"minimums are not integer zero points"):
        save_compressed(model, tmp_path / "mm")


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_written_int4_checkpoint_loads(symmetric, tmp_path):
    """A W4A8 checkpoint written by the compressed-tensors library itself (int4 groups of 32, symmetric or with
    integer zero points, int8 dynamic per-token activations): our layers hold exactly its int4 values and scales
    (w = scale * (q - zero point)), and the logits follow its own forward (which fake-quantizes activations with
    scale amax / 127.5 rather than amax / 127: compared with a tolerance)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from w8a8_cpu.nn import W4A8Linear

    model = float_model("qwen2")
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=32),
        input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    expected = {}
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.detach().view(module.weight.shape[0], -1, 32)
            if symmetric:
                scale, zero = w.abs().amax(dim=-1) / 7.5, torch.zeros(w.shape[:2])
            else:
                low, high = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)
                scale = (high - low) / 15
                zero = (torch.round(-low / scale) - 8).clamp(-8, 7)
                module.weight_zero_point.data.copy_(zero.to(module.weight_zero_point.dtype))
            module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
            q = torch.clamp(torch.round(w / scale.unsqueeze(-1)) + zero.unsqueeze(-1), -8, 7)
            expected[name] = (q.reshape(module.weight.shape).to(torch.int8), scale, zero)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(tmp_path)
    compressor.update_config(tmp_path)
    loaded = load_quantized(tmp_path)
    for name, (q, scale, zero) in expected.items():
        layer = loaded.get_submodule(name)
        assert isinstance(layer, W4A8Linear), name
        got_q, got_scale, got_min, group = layer.int4_weight()
        assert torch.equal(got_q, q) and torch.equal(got_scale, scale) and group == 32, name
        assert (got_min is None) == symmetric
        if not symmetric:
            assert torch.equal(got_min, -scale * zero)
    got, want = logits(loaded), logits(model)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_experts_whose_forward_clamps_are_refused_at_load(scheme, tmp_path, monkeypatch):
    """A checkpoint whose experts class computes more than silu(gate) * up (DeepSeek-V4's swiglu_limit clamps gate
    and up) was loaded into the fused experts, which drop the clamp: outputs silently off. Stood in for here by
    Mixtral's experts with a clamp patched into their forward."""
    from transformers.models.mixtral import modeling_mixtral

    save_compressed(quantize_model(float_model("mixtral"), skip=LLM_SKIP, scheme=scheme), tmp_path)
    plain = modeling_mixtral.MixtralExperts.forward

    def clamped(self, hidden_states, top_k_index, top_k_weights):
        return plain(self, hidden_states.clamp(-10, 10), top_k_index, top_k_weights)

    monkeypatch.setattr(modeling_mixtral.MixtralExperts, "forward", clamped)
    with pytest.raises(ValueError, match=r"^model: model\.layers\.0\.mlp\.experts: experts: MixtralExperts "
                                         r"computes more than silu\(gate\) \* up"):
        load_quantized(tmp_path)
