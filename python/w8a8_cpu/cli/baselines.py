"""The baselines the tools compare W8A8 with: torch.ao dynamic int8 (every tool), and CTranslate2 int8 (bench llm,
an inference engine of its own: its models are converted checkpoints, cached here)."""
from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import torch


def ao_dynamic(model: torch.nn.Module, skip: Sequence[str] = ()) -> torch.nn.Module:
    """torch.ao dynamic int8 quantization of every nn.Linear in `model` but those named in `skip` (the baseline;
    its deprecation warnings silenced). Raises if this torch build has no quantized engine."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

        spec = {name: default_dynamic_qconfig for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and name not in skip}
        return quantize_dynamic(model, spec, dtype=torch.qint8)


CTRANSLATE2_STAMP = "w8a8_cpu_ctranslate2.json"  # in a finished conversion: what it was converted from, and by what


def ctranslate2_int8(source: Path, progress=None) -> Path:
    """A CTranslate2 int8 conversion of the transformers checkpoint folder `source` (ctranslate2's
    TransformersConverter), cached in a sibling folder named after the ctranslate2 version and rebuilt when the
    source's own cache stamp (w8a8_cpu_cache.json) changes. Built under a temporary name and renamed into place, one
    builder at a time, so a half-written conversion is never used. Raises ImportError without ctranslate2."""
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    from w8a8_cpu.llm.smollm2 import _exclusive  # the same one-builder-at-a-time lock as the float cache's

    source = Path(source)
    target = source.parent / f"{source.name}-ctranslate2-{ctranslate2.__version__}-int8"
    key = {"ctranslate2": ctranslate2.__version__, "quantization": "int8",
           "source": (source / "w8a8_cpu_cache.json").read_text()}

    def fresh() -> bool:
        try:
            return json.loads((target / CTRANSLATE2_STAMP).read_text()) == key
        except (OSError, ValueError):
            return False

    if fresh():
        return target
    with _exclusive(target, progress):
        if fresh():  # whoever held the lock before us may have built it
            return target
        if progress is not None:
            progress.note(f"first use: converting {source.name} to CTranslate2 int8 in {target} (once)")
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            # force: the staging folder exists already (mkdtemp made it, so its name is ours alone)
            TransformersConverter(str(source)).convert(str(staging), quantization="int8", force=True)
            (staging / CTRANSLATE2_STAMP).write_text(json.dumps(key))
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def ctranslate2_generator(model_dir: Path, threads: int):
    """A CTranslate2 int8 generator on the CPU with `threads` OpenMP threads, one generation at a time."""
    import ctranslate2

    return ctranslate2.Generator(str(model_dir), device="cpu", compute_type="int8", intra_threads=threads,
                                 inter_threads=1)


def ctranslate2_greedy(generator, prompt_tokens: Sequence[str], new_tokens: int) -> list:
    """Greedy generation of exactly `new_tokens` token ids after prompt_tokens (token strings) with a CTranslate2
    generator, batch 1. The prompt is forwarded at once (include_prompt_in_result=False: then max_length and
    min_length count the new tokens only; with True the prompt is decoded token by token and counted); min_length
    keeps the end token from stopping it early, as transformers' min_new_tokens does. new_tokens=1 is a prefill:
    the prompt forwarded and the first token's logits, computed for the last position only."""
    (result,) = generator.generate_batch([list(prompt_tokens)], max_length=new_tokens, min_length=new_tokens,
                                         sampling_topk=1, beam_size=1, include_prompt_in_result=False)
    return result.sequences_ids[0]
