"""python child.py SURFACE FIRST COUNT WORKDIR: runs cases FIRST .. FIRST + COUNT - 1 of one surface (surfaces.py) in
this process (memory and time limited by the parent) and prints one JSON line per case: its seed and verdict
("value_error", "exact", "finite", or "finding" with why). A crash or hang ends the lines early: the parent names the
case that was running."""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import surfaces  # noqa: E402


def fixtures(surface: str, workdir: Path):
    """What a surface's cases share, built once per child (tiny models, saved checkpoints)."""
    if surface not in ("checkpoint", "decoder", "vllm"):
        return ()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if surface == "vllm":  # every kind of the plugin's tests; vLLM's caches and logs under workdir, errors only
        from vllm_served import KINDS, engine_env, tiny_checkpoint
        os.environ.update(engine_env(workdir, "all"), VLLM_LOGGING_LEVEL="ERROR")
        return ({kind: tiny_checkpoint(workdir / kind, kind) for kind in KINDS},)
    from test_checkpoint import float_model
    from w8a8_cpu.llm import save_compressed
    from w8a8_cpu.quant.static_activations import calibrate_static_activations
    from w8a8_cpu.nn import quantize_model

    skip = ["lm_head", "*.gate", "*shared_expert_gate"]
    calibration = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    models = {"int8": quantize_model(float_model("llama-tied"), skip=skip),
              "int4": quantize_model(float_model("qwen2"), skip=skip, scheme="w4a8", group_size=32),
              "moe": quantize_model(float_model("mixtral"), skip=skip)}
    for name, symmetric in (("static", True), ("asymmetric", False)):
        models[name] = quantize_model(float_model("llama-tied"), skip=skip)
        calibrate_static_activations(models[name], calibration, symmetric=symmetric)
    if surface == "decoder":
        return ({name: models[name] for name in ("int8", "int4")},)
    built = {}
    for name, model in models.items():
        built[name] = workdir / name
        save_compressed(model, built[name])
    built["sharded"] = workdir / "sharded"
    save_compressed(models["int8"], built["sharded"], max_shard_bytes=24_000)
    return (built,)


def verdict(what, call, exact) -> dict:
    names = (what,) if isinstance(what, str) else what
    try:
        got = call()
    except ValueError as e:
        if any(name in str(e) for name in names):
            return {"verdict": "value_error"}
        return {"verdict": "finding", "why": f"ValueError not naming {names}: {str(e)[:300]}"}
    except Exception as e:  # noqa: BLE001 - any other exception is a finding
        return {"verdict": "finding", "why": f"{type(e).__name__}: {str(e)[:300]}"}
    if isinstance(got, dict) and "verdict" in got:  # a case that judges itself (vllm: two loaders compared)
        return got
    want = exact()
    if isinstance(got, torch.Tensor) and got.is_floating_point() and not torch.isfinite(got).all() and \
            not (isinstance(want, torch.Tensor) and torch.equal(got, want)):
        return {"verdict": "finding", "why": "non-finite result"}
    if want is None:
        return {"verdict": "finite"}
    if callable(want):  # a check of the result to the op's rounding
        return {"verdict": "exact"} if want(got) else {"verdict": "finding", "why": "result off the formula's"}
    same = torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want
    return {"verdict": "exact"} if same else {"verdict": "finding", "why": "result differs from the exact one"}


def main(surface: str, first: int, count: int, workdir: str) -> None:
    torch.set_num_threads(1)
    shared = fixtures(surface, Path(workdir))
    make = getattr(surfaces, f"{surface}_case")
    for seed in range(first, first + count):
        print(json.dumps({"seed": seed, **verdict(*make(seed, *shared))}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
