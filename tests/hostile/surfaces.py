"""One generator of hostile cases per surface. case(seed) -> (what, call, exact): `call()` runs the case; it must raise
a ValueError whose message names `what` (the input: an argument, a file, a tensor), or return what `exact()` (None:
nothing to compare, only finite) says, never another exception, a crash, a hang or a non-finite result. Every case is
a pure function of its seed."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import w8a8_cpu
from w8a8_cpu import reference

HERE = Path(__file__).resolve().parent


def _edited(rng: random.Random, data: bytes, edits: int) -> bytes:
    b = bytearray(data)
    for _ in range(edits):
        choice = rng.random()
        if choice < 0.85 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif choice < 0.93:
            del b[rng.randrange(len(b) + 1):]  # truncated
        else:
            b[rng.randrange(len(b) + 1):0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(b)


def blob_case(seed: int):
    """A packed int8 or int4 weight (random shape, group, storage, variant) with bytes edited, maybe resealed: a
    ValueError naming `w`, or exactly the result of the weights the edited blob holds."""
    sys.path.insert(0, str(HERE.parent))
    from test_packed_weight_safety import as_tensor, seal

    rng = random.Random(seed)
    variant = rng.choice(w8a8_cpu.info()["runnable_variants"])
    gen = torch.Generator().manual_seed(seed)
    n, k = rng.randint(1, 40), rng.choice([1, 7, 32, 64, 100, 256])
    with w8a8_cpu.use_variant(variant):
        if rng.random() < 0.5:
            blob = w8a8_cpu.pack_weight(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen))
        else:
            group = rng.choice([0, 32, 64])
            q, scale, minimum = w8a8_cpu.quantize_weight_int4(torch.randn(n, k, generator=gen), group, rng.random() < .5)
            blob = w8a8_cpu.pack_weight_int4(q, scale, minimum, group)
    data = _edited(rng, bytes(blob.numpy()), rng.randint(1, 4))
    if rng.random() < 0.5 and len(data) >= 64:
        data = bytes(seal(bytearray(data)))
    edited = as_tensor(data) if data else torch.empty(0, dtype=torch.uint8)
    x = torch.randn(rng.randint(1, 5), k, generator=gen)
    w_scale = torch.rand(n, generator=gen) + 0.5

    def call():
        with w8a8_cpu.use_variant(variant):
            return w8a8_cpu.int8_scaled_mm_with_quant(x, edited, w_scale)

    def exact():
        x_q, x_scale = reference.per_token_quant_int8(x)
        try:
            q2, s2, m2, g2 = w8a8_cpu.int4_weight_values(edited)
        except ValueError:  # an int8 blob
            return reference.int8_scaled_mm(x_q, w8a8_cpu.unpack_weight(edited), x_scale, w_scale)
        return reference.int4_scaled_mm(x_q, q2, x_scale, w_scale, s2, m2, g2)
    return "w: ", call, exact


def checkpoint_case(seed: int, built: dict):
    """A saved checkpoint (int8, int4, static, static-asymmetric, sharded files, MoE) with one file edited (bytes of a
    weight file, a JSON value of config.json or the index): load_quantized raises a ValueError naming the folder or a
    file in it, or loads a model whose logits are finite."""
    from w8a8_cpu.llm import load_quantized

    rng = random.Random(seed)
    kind = rng.choice(sorted(built))
    source = Path(built[kind])
    folder = Path(tempfile.mkdtemp(prefix="hostile-ckpt-"))
    for f in source.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    files = sorted(p.name for p in folder.iterdir())
    target = folder / rng.choice(files)
    if target.suffix == ".json" and rng.random() < 0.7:
        document = json.loads(target.read_text())
        _edit_json(rng, document)
        target.write_text(json.dumps(document))
    else:
        target.write_bytes(_edited(rng, target.read_bytes(), rng.randint(1, 3)))

    def call():
        model = load_quantized(folder)
        with torch.inference_mode():
            return model(torch.tensor([[1, 2, 3, 4]])).logits
    return str(folder), call, lambda: None


def _edit_json(rng: random.Random, document) -> None:
    """One value somewhere in a JSON document replaced by a hostile one (or a key removed)."""
    node = document
    for _ in range(rng.randint(1, 4)):
        if isinstance(node, dict) and node:
            key = rng.choice(sorted(node))
            if not isinstance(node[key], (dict, list)) or rng.random() < 0.3:
                if rng.random() < 0.2:
                    del node[key]
                else:
                    node[key] = rng.choice([0, -1, 2 ** 31, 2 ** 63, 1e308, "x" * 600, None, [], {}, True, 0.5,
                                            "int4", "../../etc/passwd"])
                return
            node = node[key]
        elif isinstance(node, list) and node:
            i = rng.randrange(len(node))
            if not isinstance(node[i], (dict, list)):
                node[i] = rng.choice([0, -1, "x" * 600, None, 2 ** 40])
                return
            node = node[i]
        else:
            return


def decoder_case(seed: int, models: dict):
    """The Decoder on hostile arguments: ids of other dtypes / shapes / ranges, token counts, positions past the
    model's: a ValueError naming the argument, or new_tokens token ids of the vocabulary (finite logits). Its logits
    against the model's are tests/test_fused_layers.py's: they follow the model's up to rounding, so its greedy tokens
    may take the other side of a near-tie than the model's generate."""
    from w8a8_cpu.llm.decoder import Decoder

    rng = random.Random(seed)
    model = models[rng.choice(sorted(models))]
    decoder = Decoder(model)
    vocab = model.config.vocab_size
    choices = [torch.tensor([1, 2, 3]), torch.tensor([]), torch.tensor([[1, 2]]), torch.tensor([1.5, 2.0]),
               torch.tensor([vocab]), torch.tensor([-1, 3]), torch.randint(0, vocab, (rng.randint(1, 40),)),
               torch.zeros(200, dtype=torch.long), torch.tensor([1, 2], dtype=torch.int32), "1 2 3", None]
    ids = choices[rng.randrange(len(choices))]
    new_tokens = rng.choice([1, 2, 5, 0, -3, 2.5, 10 ** 9, 1 << 40, True, "3"])
    method = rng.choice(["greedy", "prefill", "logits"])
    if method == "greedy":
        def call():
            return decoder.greedy(ids, new_tokens)

        def exact():  # new_tokens ids of the vocabulary (the model's own generate may break a near-tie otherwise)
            return lambda got: len(got) == new_tokens and all(0 <= t < vocab for t in got)
        return ("ids", "new_tokens", "length"), call, exact
    last = rng.choice([1, 2, 0, -1, 1000, 1.0])
    if method == "prefill":
        return ("ids", "length"), (lambda: decoder.prefill(ids)), lambda: None
    return ("ids", "last", "length"), (lambda: decoder.logits(ids, last)), lambda: None


def cache_case(seed: int):
    """The model cache under a hostile root: a file, a link, a FIFO, a folder of another mode, /dev/zero as a marker;
    ensure() raises a ValueError naming the root or the entry, or publishes what the builder wrote."""
    from w8a8_cpu.llm import cache

    rng = random.Random(seed)
    base = Path(tempfile.mkdtemp(prefix="hostile-cache-"))
    root = base / "cache"
    kind = rng.choice(["file", "link", "dangling", "fifo", "mode", "fine", "marker"])
    if kind == "file":
        root.write_text("x")
    elif kind == "link":
        (base / "real").mkdir()
        root.symlink_to(base / "real")
    elif kind == "dangling":
        root.symlink_to(base / "nothing")
    elif kind == "fifo":
        os.mkfifo(root)
    elif kind == "mode":
        root.mkdir(mode=0o777)
        os.chmod(root, 0o777)
    os.environ["W8A8_CPU_CACHE"] = str(root)

    def build(staging):
        for name in ("config.json", "model.safetensors"):
            (staging / name).write_bytes(b"x")
        if kind == "marker":
            os.symlink("/dev/zero", staging / "extra")

    def call():
        folder = cache.ensure("model", {"format": 1, "seed": seed}, ("config.json", "model.safetensors"), build, "b")
        return sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("."))
    return ("cache", str(root)), call, lambda: None


def cli_case(seed: int):
    """A command line of hostile options and paths (quantize, llm, bench): exit status 0 or 2 with one line naming
    the problem, never a traceback. Runs the command in a child (it is the surface)."""
    rng = random.Random(seed)
    paths = ["/dev/zero", "/nonexistent", "/", tempfile.gettempdir(), "", "-", "x" * 5000, "/proc/self/mem"]
    numbers = ["0", "-1", "1e309", "nan", "abc", "", "1.5", "0x10"]  # none a valid count: nothing runs
    command = rng.choice(["quantize", "llm", "bench"])
    argv = {"quantize": lambda: [rng.choice(paths), rng.choice(paths),
                                 *rng.choice([["--calibration-tokens", rng.choice(numbers)],
                                              ["--group-size", rng.choice(numbers)], ["--calibration", rng.choice(paths)],
                                              ["--max-shard-size", rng.choice(numbers + ["1TB", "0B"])],
                                              ["--smoothquant", rng.choice(numbers)]])],
            "llm": lambda: rng.choice([["--eval-tokens", rng.choice(numbers)], ["--new-tokens", rng.choice(numbers)],
                                       ["--calibration-tokens", rng.choice(numbers)]]),
            "bench": lambda: rng.choice([["--threads", rng.choice(numbers)], ["--repeats", rng.choice(numbers)],
                                         ["--no-such-option", rng.choice(paths)]])}[command]()

    def call():
        r = subprocess.run([sys.executable, "-m", "w8a8_cpu", command, *argv],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        if r.returncode != 2 or "Traceback" in r.stderr or not r.stderr.strip():
            raise AssertionError(f"{command} {argv}: exit {r.returncode}, stderr {r.stderr[-2000:]!r}")
        return None
    return (command,), call, lambda: None


LAYER_OP_ARGUMENTS = ("x", "weight", "eps", "cos", "sin", "heads", "q", "k", "v", "scale", "qkv", "k_cache", "v_cache",
                      "position", "delta")


def layer_op_case(seed: int):
    """The Decoder's layer ops (rms_norm, add_rms_norm_, rotary_embedding_, causal_attention, decode_attention_) on
    hostile shapes, dtypes, strides, sizes and scalars: a ValueError naming the argument, or the fp64 formula's result
    to the op's rounding (finite for finite inputs)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ops = torch.ops.w8a8_cpu

    def tensor(*shape):
        dtype = rng.choice([torch.float32] * 30 + [torch.bfloat16, torch.float16, torch.float64, torch.int32])
        t = torch.randn(*shape, generator=gen) * rng.choice([1, 1, 1e3, 1e-3])
        if rng.random() < 0.1 and t.dim() >= 1 and t.shape[-1] > 1:
            t = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)[..., ::2]  # strided
        return t.to(dtype)

    def size():
        return rng.choice([0, 17, 4097]) if rng.random() < 0.05 else rng.choice([1, 2, 3, 4, 8, 16, 33, 64])

    op = rng.choice(["rms_norm", "add_rms_norm_", "rotary_embedding_", "causal_attention", "decode_attention_"])
    eps = rng.choice([1e-5] * 12 + [1e-6, 0.0, -1.0, float("nan"), float("inf"), 1e30])
    if op in ("rms_norm", "add_rms_norm_"):
        rows, width = size(), size() * 8
        x, weight = tensor(rows, width), tensor(rng.choice([width] * 8 + [width + 1]))
        if op == "rms_norm":
            def call():
                return ops.rms_norm(x, weight, eps)

            def exact():
                v = x.double()
                want = weight.double() * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
                return lambda got: torch.allclose(got.double(), want, rtol=2e-2, atol=1e-5)
            return LAYER_OP_ARGUMENTS, call, exact
        delta = tensor(*rng.choice([(rows, width)] * 8 + [(rows + 1, width)]))
        return LAYER_OP_ARGUMENTS, (lambda: ops.add_rms_norm_(x, delta, weight, eps)), lambda: None
    heads, kv_heads, d = rng.choice([2, 4, 6]), rng.choice([1, 2]), rng.choice([8, 16, 64] * 6 + [3, 0])
    if op == "rotary_embedding_":
        positions = size()
        qkv = tensor(1, positions, (heads + 2 * kv_heads) * d)
        # tables of cosines and sines (in [-1, 1]: the finite result of finite inputs is then the op's promise)
        cos = torch.cos(tensor(rng.choice([positions] * 8 + [positions + 1]), d))
        sin = torch.sin(tensor(positions, rng.choice([d] * 8 + [d // 2])))
        rotated = rng.choice([heads + kv_heads] * 8 + [0, -1, heads + 2 * kv_heads + 1])
        return LAYER_OP_ARGUMENTS, (lambda: ops.rotary_embedding_(qkv, cos, sin, rotated) or qkv), lambda: None
    scale = rng.choice([0.3] * 12 + [0.0, -1.0, float("nan"), float("inf"), 1e30])
    if op == "causal_attention":
        t = size()
        q, k, v = tensor(t, heads, d), tensor(kv_heads, rng.choice([t] * 8 + [t + 1]), d), tensor(kv_heads, t, d)
        return LAYER_OP_ARGUMENTS, (lambda: ops.causal_attention(q, k, v, scale)), lambda: None
    length = size()
    qkv = tensor(heads + 2 * kv_heads, d)
    k_cache, v_cache = tensor(kv_heads, length, d), tensor(kv_heads, rng.choice([length] * 8 + [length + 1]), d)
    position = rng.choice([0, length - 1, length // 2] * 3 + [length, -1, 1 << 40])
    return LAYER_OP_ARGUMENTS, (lambda: ops.decode_attention_(qkv, k_cache, v_cache, position, heads, scale)), \
        lambda: None


HOSTILE_SCALES = [0.0, -0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e30, 3e38, 1e20, 1e-30, 1e-40, 1e-45]
HOSTILE_DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.float32, torch.int8, torch.uint8, torch.int16,
                  torch.int32, torch.int64, torch.bool]
QUANTIZED = ("weight", "weight_scale", "input_scale", "input_zero_point", "weight_packed", "weight_shape")


def vllm_case(seed: int, built: dict):
    """vLLM with the plugin (W8A8_CPU_VLLM=all) loading a tiny checkpoint (tests/vllm_served.py's kinds) after one or
    two hostile edits: a quantized tensor's values (weight scales 0, negative, NaN, Inf, huge, denormal; input scales
    and zero points out of range; int4 words of garbage; int8 -128), its dtype or shape (truncated, transposed,
    flattened), a tensor missing or one extra, or a quantization_config value (num_bits, group_size, strategy,
    symmetric, dynamic, type, format, targets, ignore). The oracle is load_quantized on the same folder: where it
    refuses, vLLM must refuse too (an exception; the plugin's own a ValueError naming the layer); where it loads,
    vLLM refuses or every layer the plugin serves equals ours bit for bit and is finite. Verdicts "refused" (both),
    "vllm_stricter" (ours loads, vLLM refuses) and "exact", with who refused ("by") and the case ("about")."""
    sys.path.insert(0, str(HERE.parent))
    from test_checkpoint import edit_tensors

    rng = random.Random(seed)
    kind = rng.choice(sorted(built))
    folder = Path(tempfile.mkdtemp(prefix="hostile-vllm-"))
    shutil.copytree(built[kind], folder, dirs_exist_ok=True)
    edits = []
    for _ in range(rng.choice([1, 1, 1, 2])):
        if rng.random() < 0.35:
            config_path = folder / "config.json"
            config = json.loads(config_path.read_text())
            edits.append(_edit_quantization_config(rng, config["quantization_config"]))
            config_path.write_text(json.dumps(config))
        else:
            edit_tensors(folder, lambda tensors: edits.append(_edit_quantized_tensor(rng, tensors)))
    about = f"{kind} {' + '.join(edits)}"

    def call():
        try:
            return {**_served_or_refused(folder), "kind": kind, "edits": edits}
        except AssertionError as e:
            raise AssertionError(f"{about}: {e}") from e
        finally:
            shutil.rmtree(folder)
    return (), call, lambda: None


def _edit_quantized_tensor(rng: random.Random, tensors: dict) -> str:
    """One hostile edit of a checkpoint's quantized tensors (in place); returns what it did."""
    names = sorted(n for n, t in tensors.items()
                   if n.rsplit(".", 1)[-1] in QUANTIZED and (not n.endswith(".weight") or t.dtype == torch.int8))
    name = rng.choice(names)
    layer, _, leaf = name.rpartition(".")
    t = tensors[name]
    family = rng.choice(["value", "value", "dtype/shape", "missing/extra"])
    if family == "value":
        t = t.clone()
        flat = t.view(-1)
        where = slice(None) if rng.random() < 0.3 else rng.randrange(flat.numel())
        if leaf in ("weight_scale", "input_scale"):
            value = rng.choice(HOSTILE_SCALES + [1e-10, 1e10])
            flat[where] = value
        elif leaf == "input_zero_point":
            value = rng.choice([-129, 128, 300, -(1 << 31), (1 << 31) - 1, 0.5, float("nan")])
            t = torch.tensor([value], dtype=torch.float32 if isinstance(value, float) else torch.int64)
        elif leaf == "weight_packed":
            value = rng.choice(["random", -1, 0, -(1 << 31), -2004318072])  # -2004318072: 0x88888888, every nibble 8
            if value == "random":
                flat[where] = torch.randint(-(1 << 31), 1 << 31, flat[where].shape, dtype=torch.int64,
                                            generator=torch.Generator().manual_seed(rng.randrange(1 << 30))).int()
            else:
                flat[where] = value
        elif leaf == "weight_shape":
            value = rng.choice([[0, 0], [t[1].item(), t[0].item()], [t[0].item(), t[1].item() + 8], [1 << 40, 2],
                                [-1, -1], [t[0].item() * 2, t[1].item() // 2]])
            t = torch.tensor(value, dtype=torch.int64)
        else:  # an int8 weight: -128 (outside the symmetric grid) or the extremes
            value = rng.choice([-128, 127, 0])
            flat[where] = value
        tensors[name] = t
        return f"value:{leaf}({value}{'' if isinstance(where, int) else ', all'})"
    if family == "dtype/shape":
        change = rng.choice(["dtype", "truncate rows", "truncate columns", "transpose", "flatten", "scalar"])
        if change == "dtype":
            dtype = rng.choice([d for d in HOSTILE_DTYPES if d != t.dtype])
            tensors[name] = t.to(dtype)
            return f"dtype:{leaf}({str(dtype).replace('torch.', '')})"
        if change == "truncate rows" and t.shape[0] > 1:
            tensors[name] = t[:-1].clone()
        elif change == "truncate columns" and t.dim() == 2 and t.shape[1] > 1:
            tensors[name] = t[:, :-1].clone()
        elif change == "transpose" and t.dim() == 2:
            tensors[name] = t.t().contiguous()
        elif change == "scalar":
            tensors[name] = t.reshape(-1)[:1].reshape(()).clone()
        else:
            tensors[name] = t.reshape(-1).clone()
            change = "flatten"
        return f"shape:{leaf}({change})"
    if rng.random() < 0.5:
        del tensors[name]
        return f"missing:{leaf}"
    n = t.shape[0] if t.dim() else 1
    extra, value = rng.choice([("input_scale", torch.tensor([0.02])),
                               ("input_zero_point", torch.tensor([3], dtype=torch.int8)),
                               ("weight_zero_point", torch.zeros(n, 1, dtype=torch.int8)), ("bias", torch.ones(n)),
                               ("weight_g_idx", torch.arange(n, dtype=torch.int32)),
                               ("weight", torch.ones(n, 256, dtype=torch.int8)),
                               ("weight_packed", torch.zeros(n, 32, dtype=torch.int32))])
    if rng.random() < 0.2:
        layer = "model.layers.7.mlp.down_proj"  # a layer the model does not have
    tensors[f"{layer}.{extra}"] = value
    return f"extra:{extra}"


CONFIG_VALUES = {
    "num_bits": [2, 3, 4, 8, 16, 0, -1, None, "8"],
    "group_size": [None, 1, 16, 24, 32, 48, 64, 96, 100, 128, 256, 512, 0, -32, 1 << 20, 1 << 40, "32"],
    "strategy": ["channel", "group", "tensor", "token", "block", "tensor_group", "x", None],
    "symmetric": [True, False, None, "yes"],
    "dynamic": [True, False, None, "local"],
    "type": ["int", "float", None],
}
FORMATS = ["int-quantized", "pack-quantized", "float-quantized", "naive-quantized", "marlin-24", "dense", None, 5]


def _edit_quantization_config(rng: random.Random, qc: dict) -> str:
    """One hostile value in a compressed-tensors quantization_config (in place); returns what it did."""
    group = qc["config_groups"][rng.choice(sorted(qc["config_groups"]))]
    where = rng.choice(["weights", "weights", "input_activations", "format", "targets", "ignore", "top format"])
    if where in ("weights", "input_activations"):
        if group.get(where) is None or rng.random() < 0.1:
            group[where] = None
            return f"config:{where}(None)"
        field = rng.choice(sorted(CONFIG_VALUES))
        value = rng.choice(CONFIG_VALUES[field])
        group[where][field] = value
        return f"config:{where}.{field}({value})"
    if where in ("format", "top format"):
        value = rng.choice(FORMATS)
        (group if where == "format" else qc)["format"] = value
        return f"config:{where}({value})"
    layer_names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head", "re:.*", "re:.*proj",
                   "Linear", "model.layers.0.block_sparse_moe.experts.1.w2", "", "x" * 300]
    if where == "targets":
        targets = group.get("targets") if isinstance(group.get("targets"), list) else []
        value = rng.choice([[rng.choice(layer_names)], targets[1:], targets + ["Embedding"], None])
        group["targets"] = value
    else:
        ignore = qc.get("ignore") if isinstance(qc.get("ignore"), list) else []
        value = rng.choice([ignore + [rng.choice(layer_names)], [], None, "lm_head"])
        qc["ignore"] = value
    return f"config:{where}({str(value)[:60]})"


def _served_or_refused(folder: Path) -> dict:
    """load_quantized and vLLM with the plugin on one folder; the verdict (AssertionError for a finding)."""
    from vllm_served import compare_served_layers, on_engine
    from w8a8_cpu.llm import load_quantized

    try:
        ours, refusal = dict(load_quantized(folder).named_modules()), None
    except ValueError as e:
        ours, refusal = None, str(e)
    except Exception as e:  # noqa: BLE001 - ours must refuse with a ValueError
        raise AssertionError(f"load_quantized raised {type(e).__name__}: {e}") from e

    def compare(llm):  # what it raises would read as a refused start: returned instead
        if ours is None and _vllm_never_loads(refusal):
            return {"equal": {}, "mismatches": [], "skips": True}
        if ours is None:
            return f"load_quantized refuses ({refusal[:300]}) but vLLM with the plugin serves it"
        try:
            return compare_served_layers(llm, ours)
        except Exception as e:  # noqa: BLE001 - a served layer must run
            return f"a served layer fails: {type(e).__name__}: {e}"
    try:
        served = on_engine(folder, compare)
    except Exception as e:  # noqa: BLE001 - vLLM refuses: whose refusal it is
        return {"verdict": "refused" if ours is None else "vllm_stricter", "by": _refuser(e)}
    if isinstance(served, str) or served["mismatches"]:
        raise AssertionError(served if isinstance(served, str) else f"served layers differ: {served['mismatches']}")
    if served.get("skips"):
        return {"verdict": "vllm_skips", "by": ""}
    return {"verdict": "exact", "by": "", "layers": sum(served["equal"].values())}


def _vllm_never_loads(refusal: str) -> bool:
    """Whether load_quantized refuses only tensors that vLLM's model code never hands to a layer, so that no plugin
    check can see them: bias tensors of layers without one (vLLM skips them, for GPTQ checkpoints), or a float
    lm_head that `ignore` does not list (vLLM's lm_head is never a quantized layer)."""
    extra = re.search(r"belong to no part of the \w+ model: (.*)$", refusal)
    if extra:
        return all(name.endswith(".bias") for name in re.findall(r"'([^']+)'", extra.group(1)))
    return re.search(r"tensor 'lm_head\.weight' is F\d+ .*expected an int8 weight", refusal) is not None


def _refuser(error: BaseException) -> str:
    """Who refused a load: "plugin" (the plugin's ValueError naming a layer), or "vllm:<exception>" when vLLM's own
    code raised (also where the plugin called it); AssertionError for anything else raised in the plugin's code."""
    import traceback

    import vllm
    plugin = str(Path(w8a8_cpu.__file__).parent / "compat" / "vllm")
    vllm_code = str(Path(vllm.__file__).parent)
    chain = [error]
    while chain[-1].__cause__ or chain[-1].__context__:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    for e in chain:
        frames = traceback.extract_tb(e.__traceback__)
        inside = [i for i, f in enumerate(frames) if f.filename.startswith(plugin)]
        if not inside:
            continue
        after = frames[inside[-1] + 1:]
        if after and after[0].filename.startswith(vllm_code):
            return f"vllm:{type(e).__name__}"
        if isinstance(e, ValueError) and re.search(r"model\.layers\.\d+\.\w+", str(e)):
            return "plugin"
        raise AssertionError(f"the plugin raised {type(e).__name__} at {frames[-1].filename}:{frames[-1].lineno}, not "
                             f"a ValueError naming the layer: {e}") from e
    return f"vllm:{type(error).__name__}"
