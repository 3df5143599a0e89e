"""compressed-tensors' pack-quantized form of int4 weights: eight 4-bit values to an int32 word (read and written by
the checkpoint package, read by the vLLM plugin)."""
from __future__ import annotations

import torch

_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized int32 form of int4 values [rows, count]: value j of a row, plus 8, in bits
    4 (j % 8) .. 4 (j % 8) + 3 of word j // 8; the last word padded with 0."""
    rows, count = q.shape
    words = -(-count // 8)
    u = torch.nn.functional.pad(q.to(torch.int64) + 8, (0, words * 8 - count)).view(rows, words, 8)
    packed = (u << _NIBBLE_SHIFTS).sum(dim=-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def unpack_int4_rows(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The int4 values [rows, count] of pack_int4_rows' form."""
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> _NIBBLE_SHIFTS) & 0xF
    return (nibbles.reshape(packed.shape[0], -1)[:, :count] - 8).to(torch.int8)
