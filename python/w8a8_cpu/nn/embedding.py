"""Token embeddings: ColumnScaledEmbedding (a float table read back through SmoothQuant's column scale) and
W8A8Embedding (an int8 table with per-row scales, which a tied W8A8Linear lm_head can share)."""
from __future__ import annotations

from typing import Optional

import torch

from .._functions import _gather_rows, _verified_panels, pack_weight, unpack_weight
from .._loader import ops as _ops
from ..quant.weights import quantize_weight
from .linear import W8A8Linear
from .scales import Fp32Scales, finite_fp32


class ColumnScaledEmbedding(Fp32Scales, torch.nn.Embedding):
    """A token embedding whose table holds each column c times s_c, read as table rows * column_scale (1 / s, fp32,
    then cast to the table's dtype): what SmoothQuant's fold into the output layer (smooth_quant(...,
    output_alpha=...)) leaves when that layer is tied to the embedding. The output layer's input channels are
    multiplied by s in the one shared table (the final norm's output divided by s), and the embedding reads it back
    unscaled, so the model keeps one table and its function."""

    _fp32_buffers = ("column_scale",)

    def __init__(self, embedding: torch.nn.Embedding, column_scale: torch.Tensor):
        if embedding.max_norm is not None:
            raise ValueError("embedding: an embedding with max_norm renormalizes the rows it reads; a column scale "
                             "cannot fold into it")
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                         sparse=embedding.sparse, device="meta")
        self.weight = embedding.weight  # the same Parameter: a tie to the output layer stays a tie
        self.register_buffer("column_scale", _column_scale(column_scale, embedding.embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (super().forward(ids).float() * self.column_scale).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", column-scaled"


def _column_scale(column_scale: torch.Tensor, embedding_dim: int) -> torch.Tensor:
    scale = finite_fp32(column_scale, "column_scale").reshape(-1)
    if scale.numel() != embedding_dim or not (scale > 0).all():
        raise ValueError(f"column_scale: expected {embedding_dim} positive values, got {scale.numel()}"
                         f"{'' if scale.numel() != embedding_dim else ' with some <= 0'}")
    return scale


class W8A8Embedding(Fp32Scales):
    """A token embedding held as an int8 [V, H] table with one fp32 scale per row (per-row symmetric, the weights'
    rounding rule), read by gathering rows and dequantizing (int8 * scale, fp32, cast to `dtype`); with a
    column_scale (from a ColumnScaledEmbedding), the fp32 rows are then multiplied by it.

    The table is a packed weight blob, so the same tensors can also serve a W8A8Linear lm_head tied to this
    embedding (quantize_model(..., quantize_embedding=True)): the model holds one int8 copy for both."""

    _fp32_buffers = ("w_scale", "column_scale")

    def __init__(self, weight_packed: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                 column_scale: Optional[torch.Tensor] = None):
        super().__init__()
        panels, self.num_embeddings, self.embedding_dim = _verified_panels(weight_packed, "weight_packed")
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("w_scale", finite_fp32(w_scale, "w_scale").reshape(-1))
        if self.w_scale.numel() != self.num_embeddings:
            raise ValueError(f"w_scale: expected {self.num_embeddings} row scales, got {self.w_scale.numel()}")
        self.register_buffer("column_scale", None if column_scale is None else
                             _column_scale(column_scale, self.embedding_dim))
        self.dtype = dtype
        self._panels = (weight_packed, panels)  # the checked view of the blob it was made from

    def _apply(self, fn, *args, **kwargs):
        # the output dtype follows the model's as a float table would (model.to(bfloat16) after quantize_model: it
        # stayed fp32, and so did every logit after it, silently)
        super()._apply(fn, *args, **kwargs)
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return self

    def __getstate__(self):
        # not the int8 view of the blob: torch.save refuses two views of one storage as different dtypes (forward
        # checks the blob again and views it)
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {**state, "_panels": (None, None)}

    @classmethod
    def from_embedding(cls, embedding: torch.nn.Embedding) -> "W8A8Embedding":
        if getattr(embedding, "max_norm", None) is not None:  # a lookup that renormalizes rows: not a table read
            raise ValueError(f"embedding: max_norm={embedding.max_norm} renormalizes the rows it reads; W8A8Embedding "
                             f"reads a fixed table (keep this embedding float)")
        w_q, w_scale = quantize_weight(embedding.weight)
        return cls(pack_weight(w_q), w_scale, embedding.weight.dtype, getattr(embedding, "column_scale", None))

    @classmethod
    def sharing(cls, lm_head: W8A8Linear, dtype: torch.dtype,
                column_scale: Optional[torch.Tensor] = None) -> "W8A8Embedding":
        """The embedding read from a W8A8Linear's own int8 weight and scales (one copy for both)."""
        if lm_head.bias is not None:
            raise ValueError("lm_head: a layer with a bias cannot double as an embedding table")
        embedding = cls(lm_head.weight_packed, lm_head.w_scale, dtype, column_scale)
        embedding.w_scale = lm_head.w_scale  # the same tensor, not a checked copy of it: one table, one set of scales
        return embedding

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows if self.column_scale is None else rows * self.column_scale).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _ops._verify_packed_weight(self.weight_packed)  # cached per tensor version, as the GEMM ops do
        blob, panels = self._panels
        if blob is not self.weight_packed:  # replaced since (load_state_dict, to()): check the new blob
            panels = _verified_panels(self.weight_packed, "weight_packed")[0]
            self._panels = (self.weight_packed, panels)
        rows = _gather_rows(panels, self.num_embeddings, self.embedding_dim, ids, "ids")
        return self._scaled(rows * self.w_scale[ids].unsqueeze(-1))

    def dequantized(self) -> torch.Tensor:
        """The whole table as floats [V, H] in `dtype` (int8 * row scale in fp32, times the column scale, then cast):
        what checkpoints store, so that float readers (transformers, vLLM) read the model's embedding."""
        return self._scaled(unpack_weight(self.weight_packed).float() * self.w_scale.unsqueeze(1))

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, int8 rows"
                f"{'' if self.column_scale is None else ', column-scaled'}, dtype={self.dtype}")


def is_table_lookup(embedding: torch.nn.Embedding) -> bool:
    """Whether the embedding's output is its table's rows (times a column scale): the forward of nn.Embedding or of
    ColumnScaledEmbedding, not a subclass's own (Gemma's multiplies by sqrt(hidden)), and no max_norm (which
    renormalizes the rows it reads)."""
    return type(embedding).forward in (torch.nn.Embedding.forward, ColumnScaledEmbedding.forward) and \
        getattr(embedding, "max_norm", None) is None
