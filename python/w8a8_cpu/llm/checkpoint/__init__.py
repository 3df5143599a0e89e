"""W8A8 checkpoints in and out of transformers models, as safetensors.

save_compressed writes a model quantized by w8a8_cpu.nn.quantize_model as a compressed-tensors ``int-quantized``
checkpoint (int8 weights with one fp32 scale per output channel, int8 dynamic per-token activations), the format
vLLM, sglang and transformers read. load_quantized reads such checkpoints (and sglang's ``w8a8_int8`` layout) back
into a transformers model built from its config.json, with W8A8Linear / W8A8Experts in place of the quantized
layers and without ever creating their float weights; load is the same read with a shard plan (w8a8_cpu.distributed).

Checkpoint files are untrusted input: every field and tensor is validated before use, a scheme these kernels cannot
run exactly is refused, and every error is a ValueError naming the file and the tensor, layer or field.

Modules: layout (file names), naming (checkpoint names of modules), scheme (quantization_config both ways),
regex_guard (bounds on `re:` targets), reader (safetensors files), model_config (config.json, the meta-device model),
save and load (which never import each other)."""
from __future__ import annotations

from .layout import (CONFIG_FILE, GENERATION_FILE, INDEX_FILE, OWN_CONFIG_KEY, SINGLE_FILE, TOKENIZER_FILES,
                     TOKENIZER_FOLDER)
from .load import load, load_quantized
from .save import save_compressed

__all__ = ["save_compressed", "load_quantized", "load", "CONFIG_FILE", "SINGLE_FILE", "INDEX_FILE", "GENERATION_FILE",
           "OWN_CONFIG_KEY", "TOKENIZER_FILES", "TOKENIZER_FOLDER"]
