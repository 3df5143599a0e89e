"""The baselines the tools compare W8A8 with: torch.ao dynamic int8 (every tool), and CTranslate2 int8 (bench llm,
an inference engine of its own: its models are converted checkpoints, cached here)."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

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


def ctranslate2_int8(source: Path, progress=None) -> Path:
    """A CTranslate2 int8 conversion of the transformers checkpoint folder `source` (ctranslate2's
    TransformersConverter; source is a content-addressed cache folder), cached as a folder of its own keyed by the
    ctranslate2 version and the source folder (w8a8_cpu.llm.cache: built once under a staging name, published whole).
    Raises ImportError without ctranslate2."""
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    from w8a8_cpu.llm import cache

    source = Path(source)
    key = {"ctranslate2": ctranslate2.__version__, "quantization": "int8", "source": source.name}

    def build(staging: Path) -> None:
        with cache.in_use(source):  # force: the staging folder exists already (its name is ours alone)
            TransformersConverter(str(source)).convert(str(staging), quantization="int8", force=True)

    return cache.ensure(f"{source.name}-ctranslate2-int8", key, ("config.json", "model.bin"), build,
                        f"converting {source.name} to CTranslate2 int8", progress)


def ctranslate2_generator(model_dir: Path, threads: int):
    """A CTranslate2 int8 generator on the CPU with `threads` OpenMP threads, one generation at a time."""
    import ctranslate2

    return ctranslate2.Generator(str(model_dir), device="cpu", compute_type="int8", intra_threads=threads,
                                 inter_threads=1)


def ctranslate2_greedy(generator, prompt_tokens: Sequence[str], new_tokens: int,
                       on_token: Optional[Callable[[int], None]] = None) -> list:
    """Greedy generation of exactly `new_tokens` token ids after prompt_tokens (token strings) with a CTranslate2
    generator, batch 1. The prompt is forwarded at once (include_prompt_in_result=False: then max_length and
    min_length count the new tokens only; with True the prompt is decoded token by token and counted); min_length
    keeps the end token from stopping it early, as transformers' min_new_tokens does. new_tokens=1 is a prefill:
    the prompt forwarded and the first token's logits, computed for the last position only. on_token(token id) is
    called as each token is chosen (the search's own callback, in this thread: its generate_tokens stream runs a
    thread that can abort the interpreter at exit)."""
    callback = None if on_token is None else (lambda step: on_token(step.token_id) or False)  # False: go on
    (result,) = generator.generate_batch([list(prompt_tokens)], max_length=new_tokens, min_length=new_tokens,
                                         sampling_topk=1, beam_size=1, include_prompt_in_result=False,
                                         callback=callback)
    return result.sequences_ids[0]
