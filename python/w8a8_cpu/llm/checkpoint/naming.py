"""Checkpoint names of a transformers model's modules: per-expert names of fused MoE experts, and tied weights."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class _ExpertNaming:
    block: str  # the MoE block's name in checkpoints (transformers 5 calls it `mlp` in the module tree)
    projections: Tuple[str, str, str]  # each expert's (gate, up, down) Linear


# transformers 5 fuses each MoE block's experts into 3-D gate_up_proj [E, 2I, H] / down_proj [E, H, I] parameters;
# checkpoints (vLLM, sglang, transformers 4, and transformers 5's own save_pretrained) keep one Linear per expert
# and projection. The names are transformers 5's conversion_mapping for these model types, reversed.
_EXPERT_NAMING: Dict[str, _ExpertNaming] = {
    "mixtral": _ExpertNaming("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": _ExpertNaming("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": _ExpertNaming("mlp", ("gate_proj", "up_proj", "down_proj")),
}


class Naming:
    """Checkpoint names of a transformers 5 model's modules: the model's own, except in MoE blocks."""

    def __init__(self, config):
        self.model_type = getattr(config, "model_type", None)
        self.experts = _EXPERT_NAMING.get(self.model_type)

    def checkpoint_name(self, name: str) -> str:
        if self.experts is None or self.experts.block == "mlp":
            return name
        return re.sub(r"(?<![^.])mlp(?![^.])", self.experts.block, name)

    def expert_linears(self, module_name: str, num_experts: int) -> List[Tuple[str, str, str]]:
        """Per expert, the checkpoint names of its (gate, up, down) Linear layers."""
        if self.experts is None:
            raise ValueError(f"model: {module_name} is a fused-experts module, but the per-expert checkpoint naming "
                             f"of model_type {self.model_type!r} is unknown (known: {sorted(_EXPERT_NAMING)})")
        prefix = self.checkpoint_name(module_name)
        return [tuple(f"{prefix}.{e}.{p}" for p in self.experts.projections) for e in range(num_experts)]


def tied_weights(model) -> Dict[str, str]:
    """{tied parameter: the parameter it is tied to} as the model's config has it now (lm_head.weight ->
    model.embed_tokens.weight when tie_word_embeddings); the tied one is not stored in checkpoints."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    return expand(all_submodels=True) if expand is not None else {}
