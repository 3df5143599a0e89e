"""Tiny random transformers causal LMs built from configs (nothing is downloaded), the token ids and logits the tests
run them on, and the float weights that int8 / int4 values stand for. transformers is imported only by the builder,
so that tests which need no model import this module without it (a model without it skips its test)."""
import pytest
import torch

# Every tiny model's sizes unless its test says otherwise.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
MOE_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
# What an architecture needs beyond TINY to be tiny: a head_dim of hidden / heads, 4 experts of which 2 route.
ARCHITECTURES = {
    "qwen3": dict(head_dim=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(MOE_EXPERTS, shared_expert_intermediate_size=96),
    "qwen3_moe": dict(MOE_EXPERTS, head_dim=16),
}
MOE_ARCHITECTURES = ["mixtral", "qwen2_moe", "qwen3_moe"]
LLM_SKIP = ["lm_head", "*.gate", "*shared_expert_gate"]  # the usual LLM choice: lm_head and MoE routers stay float


def tiny_causal_lm(arch: str = "llama", tied: bool = False, dtype=None, **overrides):
    """A random `arch` model (a transformers model_type) of TINY sizes with ARCHITECTURES[arch], `overrides` on top,
    the lm_head tied to the embedding or not, in eval mode, in dtype (None: float32, the config naming none); the
    same weights for the same arguments (seed 0)."""
    transformers = pytest.importorskip("transformers")
    settings = {**TINY, **ARCHITECTURES.get(arch, {}), "tie_word_embeddings": tied, **overrides}
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(arch, **settings)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def token_ids(vocab_size: int = TINY["vocab_size"], shape=(2, 9), seed: int = 7) -> torch.Tensor:
    """Random token ids below vocab_size, the same for the same seed."""
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def logits(model, ids=None) -> torch.Tensor:
    """The model's logits on `ids` (by default token_ids of its vocabulary), without autograd."""
    with torch.no_grad():
        return model(token_ids(model.config.vocab_size) if ids is None else ids).logits


def dequantized_int8(w_q: torch.Tensor, w_scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """w_int8 * w_scale per output channel, in dtype: [N, K] with [N], or experts [E, N, K] with [E, N]."""
    return w_q.to(dtype) * w_scale.to(dtype).unsqueeze(-1)


def dequantized_int4(q, scale, minimum, group_size: int, dtype=torch.float32) -> torch.Tensor:
    """The weight [N, K] that int4 values q stand for, in dtype: q * scale (+ minimum) of each group of group_size
    along K (0: one group)."""
    group = torch.arange(q.shape[-1]) // (group_size or q.shape[-1])
    w = q.to(dtype) * scale.to(dtype)[:, group]
    return w if minimum is None else w + minimum.to(dtype)[:, group]
