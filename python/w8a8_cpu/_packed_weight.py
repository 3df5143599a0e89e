"""The packed weight blob's size and header, computed in Python (docs/ARCHITECTURE.md, "Packed weight blob").

packed_weight_nbytes is the one Python source of the blob's size (the fake pack_weight kernel uses it); it mirrors
packed_weight_sizes in csrc/common/packed_weight.cpp, and tests/test_ops.py checks it against pack_weight for every
runnable variant."""
from __future__ import annotations

import json
from typing import Optional, Tuple

import torch

from ._loader import ops
from .scheme import WeightScheme

HEADER_BYTES = 64  # sizeof(PackedWeightHeader), csrc/common/packed_weight.h
MAGIC = b"W8A8PKW\0"  # its first 8 bytes (kPackedMagic)


def header_sizes(blob) -> Tuple[int, int, int, int, int, int]:
    """(nr, kr, n, k, n_padded, k_padded) from the header of a blob (uint8 tensor) that ops._verify_packed_weight
    accepted: only then are they bounded and describe the blob. Offsets as PackedWeightHeader's."""
    nr, kr = int(blob[12]), int(blob[13])
    n, k, n_padded, k_padded = (int(v) for v in blob[16:48].clone().view(torch.int64).tolist())
    return nr, kr, n, k, n_padded, k_padded


def header_scheme(blob) -> WeightScheme:
    """The weights' form a verified blob's header states (its scheme byte, WeightScheme.from_header, and its group
    size along K, 0 for one group per channel)."""
    scheme, group_log2 = int(blob[14]), int(blob[15])
    return WeightScheme.from_header(scheme, (1 << group_log2) if group_log2 else 0)


def header_half_scales(blob) -> bool:
    """Whether a verified int4 blob stores its group scales as fp16 (the header's scale storage, ScaleStorage)."""
    return int(blob[10]) == 1


def scale_bytes(half_scales: bool) -> int:
    """Bytes of one stored group scale (csrc/common/microkernel.h, int4_scale_bytes)."""
    return 2 if half_scales else 4


def panel_layout() -> Tuple[int, int]:
    """(panel width NR, panel depth KR) of the variant active in this thread: the layout pack_weight writes."""
    info = json.loads(ops._info())
    return info["panel_width"], info["panel_depth"]


def int8_blob_nbytes(n_padded: int, k_padded: int) -> int:
    """Bytes of an int8 blob of padded size n_padded x k_padded: the header, the panels, one int32 sum per channel."""
    return HEADER_BYTES + n_padded * k_padded + 4 * n_padded


def int4_panels(raw) -> Tuple[torch.Tensor, int, int, int]:
    """(body uint8 [panels, panel bytes], nibble bytes of a panel, where its scales end, groups) of a verified int4
    blob: each panel's nibbles, then its scales [groups][nr] (fp32, or fp16: header_half_scales), then its minimums
    [groups][nr] (fp32) to the panel's end: pack_weight_int4's layout (csrc/common/packed_weight.h, WeightScheme)."""
    nr, kr, n, k, n_padded, k_padded = header_sizes(raw)
    weights = header_scheme(raw)
    groups = k_padded // (weights.group_size or k_padded)
    nibble_bytes = k_padded * nr // 2
    scales_end = nibble_bytes + groups * nr * scale_bytes(header_half_scales(raw))
    panel_bytes = scales_end + (0 if weights.symmetric else groups * nr * 4)
    body = raw[HEADER_BYTES:HEADER_BYTES + n_padded // nr * panel_bytes].view(n_padded // nr, panel_bytes)
    return body, nibble_bytes, scales_end, groups


def packed_weight_nbytes(n: int, k: int, int4_group: Optional[int] = None, int4_mins: bool = False,
                        half_scales: bool = False) -> int:
    """Bytes of pack_weight's blob for an int8 [n, k] weight in the active variant's layout: the header, the int8
    panels (N and K padded to whole panels) and one int32 channel sum per padded channel; with int4_group (0: per
    channel, else the group size), pack_weight_int4's: the header and the int4 panels (K padded to whole groups, or
    to 32 per channel), each with its group scales (fp16 with half_scales, else fp32) and fp32 minimums."""
    nr, kr = panel_layout()
    n_padded = (n + nr - 1) // nr * nr
    if int4_group is None:
        return int8_blob_nbytes(n_padded, (k + kr - 1) // kr * kr)
    step = int4_group or 32
    k_padded = (k + step - 1) // step * step
    groups = k_padded // (int4_group or k_padded)
    return HEADER_BYTES + n_padded * k_padded // 2 + n_padded * groups * (scale_bytes(half_scales) +
                                                                         (4 if int4_mins else 0))
