"""Fuzzing checkpoint directories: load_quantized on mutated copies of small W8A8 and W4A8 (pack-quantized) checkpoints
(single-file and sharded, dense and MoE). Mutations: config.json and generation_config.json (values of other types and sizes, deleted or
added fields, quantization_config edits, byte flips, truncation), model.safetensors.index.json (weight_map entries,
bytes), and the safetensors files themselves (header length, header JSON bytes, dtypes, shapes, data offsets,
truncation). Every case must end in a ValueError or a model that loads and gives finite logits; anything else
(another exception, a crash, a hang, memory exhaustion) is a finding. The fuzzer runs in a child process with a
memory limit (not under ASan, which reserves terabytes of address space) and a time bound per case; the sanitizer
stage runs it under ASan + UBSan."""
import json
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path


from conftest import EMULATED, python_command, require_optional

CASE_SECONDS = 30
MEMORY_BYTES = 6 << 30
FUZZ_LINE = "fuzz checkpoints: cases {cases} value_errors {value_errors} loaded {loaded} failures {failures}"


def test_fuzz_checkpoint_directories(tmp_path):
    require_optional(all(_importable(m) for m in ("transformers", "safetensors")),
                     "pip install 'w8a8-cpu[llm]' (transformers, safetensors)")
    cases = 60 if EMULATED else 400
    proc = subprocess.run([*python_command(), __file__, str(tmp_path), str(cases)], capture_output=True, text=True,
                          timeout=1800 if EMULATED else 600, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"fuzzer exited with {proc.returncode} (negative: a signal):\n{out[-6000:]}"
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("fuzz checkpoints:")]
    print(line)
    numbers = dict(zip(line.split()[2::2], map(int, line.split()[3::2])))
    assert numbers["failures"] == 0 and numbers["cases"] == cases
    assert numbers["value_errors"] > cases // 2 and numbers["loaded"] > 0  # the mutations reach the checks


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---- the child -------------------------------------------------------------------------------------------------

def _base_checkpoints(root: Path) -> list:
    import transformers

    from tiny_models import LLM_SKIP, tiny_causal_lm
    from w8a8_cpu.llm.checkpoint import save_compressed
    from w8a8_cpu.nn import quantize_model

    transformers.logging.set_verbosity_error()
    smaller = dict(hidden_size=32, vocab_size=64, intermediate_size=48)
    models = {"llama": dict(arch="llama", tied=True, **smaller),
              "qwen2_moe": dict(arch="qwen2_moe", moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                **smaller)}
    models["llama-w4a8"] = models["llama"]
    bases = []
    for name, arguments in models.items():
        model = quantize_model(tiny_causal_lm(**arguments), skip=LLM_SKIP,
                               scheme="w4a8" if name.endswith("w4a8") else "w8a8")
        for shards in (None, 24 * 1024):
            folder = root / f"{name}-{'sharded' if shards else 'single'}"
            save_compressed(model, folder, max_shard_bytes=shards)
            (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 8, "do_sample": False}))
            bases.append(folder)
    return bases


ODD_VALUES = [None, True, -1, 0, 1, 3, 2 ** 31, 2 ** 63, 10 ** 400, 1.5, float("1e308"), "", "64", "x" * 300, [],
              [1, 2], {}, {"a": 1}, [[[[[]]]]]]


def _mutate_json(rng: random.Random, data: bytes) -> bytes:
    if rng.random() < 0.25:  # bytes
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            choice = rng.random()
            if choice < 0.5 and b:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif choice < 0.75:
                del b[rng.randrange(len(b) + 1):]
            else:
                b[rng.randrange(len(b) + 1):rng.randrange(len(b) + 1)] = rng.choice([b"{", b"[" * 3000, b"9" * 50])
        return bytes(b)
    value = json.loads(data)
    containers = [value]
    stack = [value]
    while stack:  # every dict or list inside, to pick one to edit
        node = stack.pop()
        for child in (node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()):
            if isinstance(child, (dict, list)):
                containers.append(child)
                stack.append(child)
    node = rng.choice(containers)
    odd = rng.choice(ODD_VALUES)
    if isinstance(node, dict) and node:
        key = rng.choice(list(node))
        action = rng.random()
        if action < 0.6:
            node[key] = odd
        elif action < 0.8:
            del node[key]
        else:
            node[key + rng.choice(["_x", ""]) + str(rng.randrange(3))] = odd
    elif isinstance(node, list) and node:
        i = rng.randrange(len(node))
        node[i] = odd if rng.random() < 0.7 else (node[i] + "x" if isinstance(node[i], str) else node[i])
    try:
        return json.dumps(value).encode()
    except (ValueError, OverflowError):  # e.g. 10 ** 400 beyond the int-to-str limit: write it by hand
        return json.dumps(value, default=str).encode()


def _mutate_safetensors(rng: random.Random, data: bytes) -> bytes:
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]
    choice = rng.random()
    if choice < 0.15:  # the length prefix
        new = rng.choice([0, 1, length - 1, length + 1, len(data), 2 ** 63, rng.randrange(2 ** 32)])
        return struct.pack("<Q", new % 2 ** 64) + data[8:]
    if choice < 0.3:  # truncation
        return data[:rng.randrange(len(data))]
    if choice < 0.45:  # header bytes
        raw = bytearray(data[8:8 + length])
        raw[rng.randrange(len(raw))] = rng.randrange(32, 127)
        return struct.pack("<Q", len(raw)) + bytes(raw) + body
    names = [k for k in header if k != "__metadata__"]
    entry = header[rng.choice(names)]
    field = rng.choice(["dtype", "shape", "data_offsets"])
    if field == "dtype":
        entry["dtype"] = rng.choice(["I8", "F32", "BF16", "F16", "I32", "U8", "F64", "BOOL", "Q4", 7])
    elif field == "shape":
        shape = list(entry["shape"])
        if shape and rng.random() < 0.6:
            shape[rng.randrange(len(shape))] = rng.choice([0, 1, -1, 2 ** 40, shape[0] * 2, "3"])
        else:
            shape = rng.choice([[], [1] * 9, shape + [1], shape[:-1]])
        entry["shape"] = shape
    else:
        start, end = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[start, end + 1], [start + 1, end], [end, start], [0, len(body) + 8],
                                            [start, 2 ** 62], [-1, end]])
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _mutated_copy(rng: random.Random, base: Path, work: Path) -> str:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    files = sorted(p.name for p in work.iterdir())
    target = rng.choice(files)
    path = work / target
    data = path.read_bytes()
    if target.endswith(".safetensors"):
        path.write_bytes(_mutate_safetensors(rng, data))
    else:
        path.write_bytes(_mutate_json(rng, data))
    return f"{base.name}/{target}"


def _run(root: Path, cases: int, seed: int = int(os.environ.get("W8A8_FUZZ_SEED", "20261201"))) -> dict:
    import torch

    from w8a8_cpu.llm.checkpoint import load_quantized

    torch.set_num_threads(1)
    bases = _base_checkpoints(root / "bases")
    rng = random.Random(seed)
    counts = {"cases": 0, "value_errors": 0, "loaded": 0, "failures": 0}

    def expired(*_):
        raise TimeoutError(f"a case ran longer than {CASE_SECONDS} s")

    signal.signal(signal.SIGALRM, expired)
    ids = torch.arange(10).unsqueeze(0)
    for i in range(cases):
        what = _mutated_copy(rng, bases[i % len(bases)], root / "case")
        counts["cases"] += 1
        signal.alarm(CASE_SECONDS)
        try:
            model = load_quantized(root / "case")
            with torch.inference_mode():
                logits = model(ids).logits
            if not torch.isfinite(logits).all():
                raise AssertionError("loaded, but the logits are not finite")
            counts["loaded"] += 1
        except ValueError:
            counts["value_errors"] += 1
        except Exception as e:  # noqa: BLE001 - anything but ValueError is a finding
            counts["failures"] += 1
            print(f"FINDING case {i} ({what}): {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            signal.alarm(0)
    return counts


if __name__ == "__main__":
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # ASan reserves terabytes of address space
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    t0 = time.monotonic()
    result = _run(Path(sys.argv[1]), int(sys.argv[2]))
    print(FUZZ_LINE.format(**result), f"seconds {time.monotonic() - t0:.0f}", flush=True)
    sys.exit(1 if result["failures"] else 0)
