"""The files of a checkpoint directory: their names, the shards' pattern, the tokenizer's files."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Union

PathLike = Union[str, Path]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
# config.json key of what only this package reads back: {"int8_embedding": true} when the token embedding (and an
# lm_head tied to it) was held as one int8 table; the checkpoint stores that table as floats, so other readers load it
# as a float embedding and ignore the key
OWN_CONFIG_KEY = "w8a8_cpu"
SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Tokenizer files a transformers checkpoint directory may hold (copied by save_compressed from a source directory).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
# the folder where a transformers tokenizer saves its chat templates beyond the default one (transformers'
# CHAT_TEMPLATE_DIR): the writer's own, replaced whole
TOKENIZER_FOLDER = "additional_chat_templates"
