"""A checkpoint's safetensors files read as untrusted input: the index validated, every tensor's dtype and shape
checked against its header before it is read, every tensor accounted for."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open

from ..._files import read_json_object
from ..._untrusted import check_weight_scales, echo, listing
from .layout import INDEX_FILE, SINGLE_FILE

FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}

# Largest config.json / generation_config.json and index a checkpoint may have (the largest real ones are ~100 KB and
# a few MB); anything larger is refused before it is read.
_MAX_CONFIG_BYTES = 1 << 24
_MAX_INDEX_BYTES = 1 << 26


def read_json(path: Path, max_bytes: int = _MAX_CONFIG_BYTES) -> dict:
    return read_json_object(path, max_bytes)


def _weight_map(directory: Path) -> Dict[str, str]:
    """tensor name -> file name, from the index (validated) or from the single weights file."""
    index, single = directory / INDEX_FILE, directory / SINGLE_FILE
    if index.exists() and single.exists():
        raise ValueError(f"{directory}: holds both {SINGLE_FILE} and {INDEX_FILE}; which one is the checkpoint "
                         f"is ambiguous")
    if not index.exists():
        if not single.is_file():
            raise ValueError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")
        return {}  # filled from the file's own header by StoredTensors
    weight_map = read_json(index, _MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: weight_map is missing or not a non-empty object")
    for key, file_name in weight_map.items():
        plain = (isinstance(file_name, str) and file_name.endswith(".safetensors") and "/" not in file_name
                 and "\\" not in file_name and Path(file_name).name == file_name and not file_name.startswith(".")
                 and len(file_name.encode("utf-8", "surrogatepass")) <= 255 and "\0" not in file_name)
        if not plain:
            raise ValueError(f"{index}: weight_map[{echo(key)}] is {echo(file_name)}; expected the plain name of a "
                             f".safetensors file in the checkpoint directory")
    for file_name in set(weight_map.values()):
        if not (directory / file_name).is_file():
            raise ValueError(f"{index}: names {echo(file_name)}, which does not exist in {directory}")
    return weight_map


class StoredTensors:
    """The checkpoint's tensors by name: files opened with safe_open (headers only), each tensor's dtype and shape
    validated before it is read, and every tensor taken accounted for."""

    def __init__(self, directory: Path, stack: contextlib.ExitStack):
        self.directory = directory
        weight_map = _weight_map(directory)
        self._files = {}
        for file_name in sorted(set(weight_map.values()) or {SINGLE_FILE}):
            try:
                self._files[file_name] = stack.enter_context(safe_open(str(directory / file_name), "pt", "cpu"))
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{directory / file_name}: not a readable safetensors file "
                                 f"({echo(str(e))})") from None
        if not weight_map:
            weight_map = dict.fromkeys(self._files[SINGLE_FILE].keys(), SINGLE_FILE)
        listed: Dict[str, set] = {file_name: set() for file_name in self._files}
        for key, file_name in weight_map.items():
            listed[file_name].add(key)
        for file_name, handle in self._files.items():
            held = set(handle.keys())
            absent = listed[file_name] - held
            if absent:
                raise ValueError(f"{directory / INDEX_FILE}: lists tensors that {file_name} does not hold: "
                                 f"{listing(list(absent))}")
            unlisted = held - listed[file_name]
            if unlisted:  # readers that take every tensor of every shard (transformers) would load them
                raise ValueError(f"{directory / file_name}: holds tensors that {INDEX_FILE} does not map to it: "
                                 f"{listing(list(unlisted))}")
        self._file_of = weight_map
        self.unused = set(weight_map)

    def headers(self) -> Dict[str, str]:
        """Every tensor's file, dtype and shape, by name (from the headers: nothing is read)."""
        described = {}
        for key, file_name in self._file_of.items():
            stored = self._files[file_name].get_slice(key)
            described[key] = f"{file_name} {stored.get_dtype()} {list(stored.get_shape())}"
        return described

    def _where(self, key: str) -> str:
        return f"{self.directory / self._file_of[key]}: tensor {echo(key)}"

    def stored_dtype(self, key: str) -> Optional[str]:
        """safetensors dtype name ("I8", "BF16", ...) of `key`, None if the checkpoint lacks it."""
        return self._files[self._file_of[key]].get_slice(key).get_dtype() if key in self._file_of else None

    def _take(self, key: str, dtypes: Sequence[str], shapes: Sequence[Sequence[int]], what: str,
              index: Optional[tuple] = None) -> torch.Tensor:
        """The tensor `key`, or its part `index` (a tuple of slices: only those bytes are read), once its header
        says it has one of `dtypes` and one of `shapes` (nothing is read before that, so a malformed header cannot
        make us read a huge tensor)."""
        if key not in self._file_of:
            raise ValueError(f"{self.directory}: tensor {echo(key)} ({what}) is missing from the checkpoint")
        stored = self._files[self._file_of[key]].get_slice(key)
        if stored.get_dtype() not in dtypes or list(stored.get_shape()) not in [list(s) for s in shapes]:
            raise ValueError(f"{self._where(key)} is {stored.get_dtype()} {echo(list(stored.get_shape()))}; "
                             f"expected {what}: {' or '.join(dtypes)} {' or '.join(str(list(s)) for s in shapes)}")
        self.unused.discard(key)
        if index is None:
            return self._files[self._file_of[key]].get_tensor(key)
        return stored[index]

    def leave(self, keys: Sequence[str]) -> None:
        """Account for tensors that another rank reads (a sharded load), without reading them."""
        self.unused.difference_update(keys)

    def int8(self, key: str, shape: Sequence[int], index: Optional[tuple] = None) -> torch.Tensor:
        return self._take(key, ("I8",), [shape], "an int8 weight", index)

    def floating(self, key: str, shape: Sequence[int], dtype: torch.dtype,
                 rows: Optional[slice] = None) -> torch.Tensor:
        """A float tensor in `dtype`, every value finite (a NaN or Inf weight, or one beyond `dtype`'s range, would
        make every logit NaN)."""
        tensor = self._take(key, tuple(FLOAT_DTYPES), [shape], "a float tensor",
                            None if rows is None else (rows,)).to(dtype)
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{self._where(key)} holds NaN or Inf values (as {str(dtype).removeprefix('torch.')})")
        return tensor

    def check_scales(self, key: str, scale: torch.Tensor, largest_code: int) -> None:
        """_untrusted.check_weight_scales, naming the file and tensor."""
        check_weight_scales(scale, largest_code, self._where(key))

    def scale(self, key: str, channels: int, strategy: str, rows: Optional[slice] = None) -> torch.Tensor:
        """fp32 weight scales of the `channels` output channels, or of their part `rows`, stored [n, 1] or [n]
        (n = channels, or 1 for a per-tensor scale, which is broadcast exactly to every channel), each finite and
        > 0."""
        n = channels if strategy == "channel" else 1
        shapes = [[n, 1], [n]] + ([[]] if n == 1 else [])
        index = (rows,) if rows is not None and strategy == "channel" else None
        scale = self._take(key, tuple(FLOAT_DTYPES), shapes, f"{strategy} weight scales", index).to(torch.float32)
        self.check_scales(key, scale, 128)
        kept = channels if rows is None else len(range(channels)[rows])
        return scale.reshape(-1).expand(kept).contiguous()
