"""The packed weight blob's size and header, computed in Python (docs/ARCHITECTURE.md, "Packed weight blob").

packed_weight_nbytes is the one Python source of the blob's size (the fake pack_weight kernel uses it); it mirrors
packed_weight_sizes in csrc/common/packed_weight.cpp, and tests/test_ops.py checks it against pack_weight for every
runnable variant."""
from __future__ import annotations

import json
from typing import Tuple

import torch

from ._loader import ops

HEADER_BYTES = 64  # sizeof(PackedWeightHeader), csrc/common/packed_weight.h
MAGIC = b"W8A8PKW\0"  # its first 8 bytes (kPackedMagic)


def header_sizes(blob) -> Tuple[int, int, int, int, int, int]:
    """(nr, kr, n, k, n_padded, k_padded) from the header of a blob (uint8 tensor) that ops._verify_packed_weight
    accepted: only then are they bounded and describe the blob. Offsets as PackedWeightHeader's."""
    nr, kr = (int(v) for v in blob[12:16].clone().view(torch.int16).tolist())
    n, k, n_padded, k_padded = (int(v) for v in blob[16:48].clone().view(torch.int64).tolist())
    return nr, kr, n, k, n_padded, k_padded


def panel_layout() -> Tuple[int, int]:
    """(panel width NR, panel depth KR) of the variant active in this thread: the layout pack_weight writes."""
    info = json.loads(ops._info())
    return info["panel_width"], info["panel_depth"]


def packed_weight_nbytes(n: int, k: int) -> int:
    """Bytes of pack_weight's blob for an int8 [n, k] weight in the active variant's layout: the header, the int8
    panels (N and K padded to whole panels) and one int32 channel sum per padded channel."""
    nr, kr = panel_layout()
    n_padded = (n + nr - 1) // nr * nr
    k_padded = (k + kr - 1) // kr * kr
    return HEADER_BYTES + n_padded * k_padded + 4 * n_padded
