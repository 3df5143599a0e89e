"""A lean decode loop for Llama-family decoder LLMs: greedy generation without transformers' per-step machinery.

A 135M-parameter model reads ~130 MB of int8 weights per token, ~8 ms at memory speed; transformers' generate adds
several milliseconds of Python per token on top (module calls, cache objects, mask building, logits processors), so
a small model's decode rate is set by that overhead, not by the kernels. Decoder runs the same layers of the same
model object (its W8A8 linears, norms' weights, rotary tables, embedding and lm_head) in one flat loop: a static KV
cache allocated once, rotary cos/sin computed once for every position, the fused q/k/v and gate/up GEMMs of
fuse_projections, and the lm_head on the last position only; a decode step of an fp32 model whose layers are fused
W8A8 / W4A8 ones runs the loop's ops for every layer as one op (decode_step_: the same bits, without ~240 Python
dispatches a token, ~25% of SmolLM2's 1-thread decode time). It is an inference path, not a new model: every
weight is the model's own, and its logits follow the model's (tests compare them over a text: perplexity and top-1
agreement, the statistical gate a whole W8A8 model needs; greedy tokens follow the model's own argmax).

Supported: transformers models whose config.model_type is in SUPPORTED (pre-norm decoder layers with RMSNorm, rotary
attention over whole heads with a rotary type in ROPE_TYPES and grouped KV heads, a SiLU-gated MLP, no sliding
window). Anything else raises ValueError naming what is missing; use model.generate for those."""
from __future__ import annotations

import threading
from typing import Callable, List, Optional

import torch

from .._untrusted import echo, listing
from ..nn import W8A8GatedMLP, W8A8Linear, W8A8LinearSlice

SUPPORTED = ("llama", "mistral", "qwen2")
# transformers' rotary types whose frequencies do not depend on the sequence within max_position_embeddings (which
# Decoder does not exceed): one table serves every call. "longrope" switches between two sets of factors with the
# sequence's length (a table made for a long call gave a later short one the long factors: logits 0.44 off) and
# newer types are unknown: refused.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# The KV cache's storage (Decoder's kv_cache): fp32 rows, fp16 rows, or int8 rows with one fp32 scale per token and KV
# head (per_token_quant_int8's rule on each head's row of head_dim values: scale = max|x| / 127, round half to even,
# an all-zero row zeros, a NaN/Inf row scale NaN so the head's attention is NaN, as an fp32 cache's would be). Per
# token and head, not per block of 32 values: SmolLM2-135M (fp32 weights), GPL-3, 2,048-token windows, stride 1,024,
# 7,657 tokens scored: perplexity 15.7827 with the fp32 cache, fp16 15.7825 (-0.001%), int8 per token and head 15.7936
# (+0.069%, KL 0.0012, top-1 98.2%), int8 per 32 values 15.7983 (+0.099%, KL 0.0006, top-1 98.6%). Both within +0.1%
# (per 32 at its edge); a scale per head row keeps the bytes at 0.266x of fp32 (68 of 256 bytes a row at head_dim 64;
# fp32 scales per 32 values: 72, 0.281x) and costs one product a key in the attention's dot products and weights.
KV_CACHES = ("fp32", "fp16", "int8")


class _RMSNorm:
    """An RMSNorm module as the library's fused op: norm(x) = x * rsqrt(mean(x^2) + eps) * weight in one pass
    (transformers' RMSNorm, computed in fp32 and rounded once: the same up to the last bits), and
    add_(h, delta): h += delta in place (the residual stream), then norm(h), in the same pass."""

    def __init__(self, module: torch.nn.Module, where: str):
        weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float) or \
                not type(module).__name__.endswith("RMSNorm"):
            raise ValueError(f"{where}: expected an RMSNorm (weight, variance_epsilon), got {type(module).__name__}")
        # The module's weight read at each call (the op reads it as fp32: no copy): a tensor held from construction
        # kept the old values when its data was swapped (smooth_quant does that to 16-bit norms: logits 0.57 off).
        # From the module's own dict: nn.Module's attribute lookup costs ~1 us, 61 norms a token.
        self.tensors = module._parameters if "weight" in module._parameters else module._buffers
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.w8a8_cpu.rms_norm(x, self.tensors["weight"], self.eps)

    def add_(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return torch.ops.w8a8_cpu.add_rms_norm_(h, delta, self.tensors["weight"], self.eps)


class _Layer:
    """One decoder layer's parts as plain callables and shapes."""

    def __init__(self, layer: torch.nn.Module, index: int, config):
        where = f"model.layers.{index}"
        attn = layer.self_attn
        self.input_norm = _RMSNorm(layer.input_layernorm, f"{where}.input_layernorm")
        self.post_norm = _RMSNorm(layer.post_attention_layernorm, f"{where}.post_attention_layernorm")
        q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        if isinstance(q, W8A8LinearSlice) and k.fused is q.fused and v.fused is q.fused and q.begin == 0:
            self.qkv = q.fused  # one GEMM for the three (fuse_projections)
        else:
            self.qkv = lambda x: torch.cat([q(x), k(x), v(x)], dim=-1)
        self.o_proj = attn.o_proj
        self.mlp = layer.mlp
        self.scaling = float(attn.scaling)
        self.head_dim = int(attn.head_dim)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads


class Decoder:
    """Greedy decoding and prefill of a Llama-family transformers model (W8A8 or float) in a flat loop with a static
    KV cache. decoder.greedy(prompt_ids, n) -> n token ids; decoder.prefill(ids) -> the last position's logits;
    decoder.logits(ids, last) -> the last `last` positions' logits (perplexity); decoder.hidden(ids) -> the lm_head's
    input at every position. Calls on one Decoder from several threads run one at a time: they share its KV cache
    (unguarded, two threads' prompts overwrote each other's keys: wrong logits, silently); give each thread a Decoder
    of its own to run them side by side (the model's weights are shared, not copied). one_op_step (default True): a
    greedy call runs its decode steps as one decode_step_ op each where the model, at that call, allows it (fp32,
    fused W8A8 / W4A8 layers with per-token activations running their own forward, no forward hooks), else the loop;
    False: always the loop's ops one by one (the same bits). kv_cache: the KV cache's storage, "fp32" (the default for
    an fp32 model), "fp16" or "int8" (KV_CACHES; fp32 models: the decode ops' dtype), or None: the model's dtype. The
    prompt's keys and values are stored so, and every position attends to them as stored (the prompt's attention on
    the cache dequantized, decode_attention_ on the cache itself): perplexity measures what decode computes."""

    def __init__(self, model: torch.nn.Module, kv_cache: Optional[str] = None):
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED:
            raise ValueError(f"model: Decoder supports transformers models of type {', '.join(SUPPORTED)}, got "
                             f"{model_type!r}; use model.generate for it")
        # (a window of 0 too: the model's own forward fails on it; qwen2 sets a window it does not use)
        windowed = {kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"}
        if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
            windowed.add(f"sliding_window={config.sliding_window}")
        if windowed:
            raise ValueError(f"model: sliding-window attention ({listing(list(windowed))}) is not supported by "
                             f"Decoder; use model.generate")
        inner = getattr(model, "model", None)
        if not isinstance(getattr(inner, "layers", None), torch.nn.ModuleList) or \
                not isinstance(getattr(model, "lm_head", None), torch.nn.Module):
            raise ValueError(f"model: Decoder runs a causal LM with model.model.layers and model.lm_head "
                             f"({model_type.capitalize()}ForCausalLM), got {type(model).__name__}; load the model with "
                             f"AutoModelForCausalLM")
        self.config = config
        self.embed = inner.embed_tokens
        self.layers = [_Layer(layer, i, config) for i, layer in enumerate(inner.layers)]
        self.norm = _RMSNorm(inner.norm, "model.norm")
        self.lm_head = model.lm_head
        self.rotary = inner.rotary_emb
        rope_type = getattr(self.rotary, "rope_type", None)
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"model: rotary embedding of type {echo(rope_type)} is not supported by Decoder (it "
                             f"supports {', '.join(ROPE_TYPES)}); use model.generate")
        self.dtype = _dtype(model)
        head_dim = self.layers[0].head_dim
        width = self.rotary(torch.zeros(1, 1, head_dim, dtype=self.dtype), torch.zeros(1, 1, dtype=torch.long))[0]
        if width.shape[-1] != head_dim:  # a partial rotary factor: the rotary op would rotate the wrong elements
            raise ValueError(f"model: its rotary embedding covers {width.shape[-1]} of each head's {head_dim} "
                             f"dimensions (partial_rotary_factor); Decoder rotates whole heads; use model.generate")
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
        if kv_cache is not None and kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache: expected one of {', '.join(KV_CACHES)} or None (the model's dtype), got "
                             f"{kv_cache!r}")
        if kv_cache is not None and self.dtype != torch.float32:
            raise ValueError(f"kv_cache: {kv_cache!r} needs an fp32 model (the decode ops' dtype), got a {self.dtype} "
                             f"model; leave kv_cache None for its dtype's cache")
        self.kv_cache = kv_cache or {torch.float32: "fp32"}.get(self.dtype)  # None: a 16-bit model's own dtype
        self._model, self._parts = model, _parts(model)
        self.one_op_step = True  # decode steps through decode_step_ where the model allows (see _step_weights)
        self._cache_len = 0
        self._cache_lock = threading.Lock()  # held by every call that sizes, writes or reads the KV cache

    def _check_unchanged(self) -> None:
        """The Decoder holds the model's modules as they were when it was built: one replaced since (quantize_model in
        place, fuse_projections) would be left out or mixed in (a half-float, half-W8A8 model, logits matching
        neither), silently; its KV cache and rotary tables have the dtype the model had."""
        now = _parts(self._model)
        if len(now) != len(self._parts) or any(a is not b for a, b in zip(now, self._parts)):
            raise ValueError("model: its modules were replaced after this Decoder was built (quantize_model, "
                             "fuse_projections); build a new Decoder(model)")
        dtype = _dtype(self._model)
        if dtype != self.dtype:
            raise ValueError(f"model: converted to {dtype} after this Decoder was built for {self.dtype}; build a new "
                             f"Decoder(model)")

    def __getstate__(self):  # copy.deepcopy / pickle: a lock is neither, a fresh one is made
        return {name: value for name, value in self.__dict__.items() if name != "_cache_lock"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._cache_lock = threading.Lock()

    def _allocate(self, length: int) -> None:
        """KV cache and rotary tables for `length` positions (kept and reused while large enough)."""
        if self.max_positions and length > self.max_positions:
            raise ValueError(f"length: {length} positions exceed the model's max_position_embeddings "
                             f"{self.max_positions}")
        if length <= self._cache_len:
            return
        first = self.layers[0]
        dtype = {"fp16": torch.float16, "int8": torch.int8}.get(self.kv_cache, self.dtype)
        element = self.dtype.itemsize
        # keys and values of every layer (and their scales), and the rotary tables (fp32 cos and sin, and the
        # rotary's own output)
        needed = self.kv_bytes(length) + length * first.head_dim * (8 + 2 * element)
        what = f"{length} positions needs {needed} bytes ({len(self.layers)} layers, {self.kv_cache or self.dtype} KV)"
        available = _memory_available()
        if available is not None and needed > available:
            raise ValueError(f"length: a KV cache of {what}, more than the {available} bytes this process can still "
                             f"allocate; ask for fewer positions (prompt + new_tokens)")
        self.k_cache = self.v_cache = None  # the old cache's memory free for the new one
        self.k_scale = self.v_scale = []
        self._cache_len = 0
        scales = self.kv_cache == "int8"  # each row's scale (per token and KV head); [] otherwise, as decode_step_
        try:
            k_cache = [torch.zeros(l.kv_heads, length, l.head_dim, dtype=dtype) for l in self.layers]
            v_cache = [torch.zeros(l.kv_heads, length, l.head_dim, dtype=dtype) for l in self.layers]
            k_scale = [torch.zeros(l.kv_heads, length) for l in self.layers] if scales else []
            v_scale = [torch.zeros(l.kv_heads, length) for l in self.layers] if scales else []
            probe = torch.zeros(1, 1, first.head_dim, dtype=self.dtype)
            cos, sin = self.rotary(probe, torch.arange(length).unsqueeze(0))
        except RuntimeError as e:  # the allocator's refusal (memory counted by another process meanwhile)
            raise ValueError(f"length: a KV cache of {what}, which cannot be allocated "
                             f"({' '.join(str(e).split())[:200]}); ask for fewer positions (prompt + new_tokens)"
                             ) from None
        self.k_cache, self.v_cache, self.k_scale, self.v_scale = k_cache, v_cache, k_scale, v_scale
        self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()  # [length, head_dim]
        self._cache_len = length

    def kv_bytes(self, positions: int) -> int:
        """Bytes of the KV cache (every layer's keys, values and their scales) holding `positions` positions."""
        element = {"fp16": 2, "int8": 1}.get(self.kv_cache, self.dtype.itemsize)
        row = sum(l.kv_heads * (l.head_dim * element + (4 if self.kv_cache == "int8" else 0)) for l in self.layers)
        return 2 * positions * row

    def _store(self, i: int, heads: torch.Tensor, start: int) -> None:
        """Writes the key and value heads [T, kv_heads, d] of positions start.. into layer i's cache, as it stores
        them (decode_attention_ stores one position by the same rule)."""
        t, kv_heads, d = heads[:, 0].shape
        for cache, scale, part in ((self.k_cache, self.k_scale, heads[:, 0]),
                                   (self.v_cache, self.v_scale, heads[:, 1])):
            rows = part.transpose(0, 1)  # [kv_heads, T, d]
            if self.kv_cache == "int8":
                q, s = torch.ops.w8a8_cpu.per_token_quant_int8(rows.reshape(-1, d))
                cache[i][:, start:start + t] = q.view(kv_heads, t, d)
                scale[i][:, start:start + t] = s.view(kv_heads, t)
            else:
                cache[i][:, start:start + t] = rows  # fp16: rounded to nearest even, as the C++ op rounds

    def _stored(self, i: int, end: int) -> tuple:
        """Layer i's keys and values of positions 0..end-1 as attention reads them: fp32, an int8 row times its scale
        (one fp32 product a value)."""
        if self.kv_cache == "int8":
            return tuple(c[i][:, :end].float() * s[i][:, :end, None]
                         for c, s in ((self.k_cache, self.k_scale), (self.v_cache, self.v_scale)))
        return self.k_cache[i][:, :end].float(), self.v_cache[i][:, :end].float()

    def _forward(self, ids: torch.Tensor, start: int, step_weights: Optional[list] = None) -> torch.Tensor:
        """Positions start .. start + T - 1 of ids [T] through the model (their K/V written to the cache); returns the
        final norm's output [T, hidden], the lm_head's input. start == 0 (a prompt) or T == 1 (a decode step; with
        step_weights, _step_weights(): through decode_step_)."""
        t = ids.numel()
        end = start + t
        # The residual stream h [1, T, H] is updated in place by the norms (h is the embedding's fresh output).
        h = self.embed(ids.view(1, t))
        if step_weights is not None:  # the loop below as one op (decode_step_): the same functions, the same bits
            first = self.layers[0]
            return torch.ops.w8a8_cpu.decode_step_(h, step_weights, self.k_cache, self.v_cache, self.cos, self.sin,
                                                   start, first.heads, first.scaling, self.norm.eps, self.k_scale,
                                                   self.v_scale)[0]
        x = self.layers[0].input_norm(h)
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, self.k_cache, self.v_cache)):
            d, nq, nkv = layer.head_dim, layer.heads, layer.kv_heads
            qkv = layer.qkv(x)  # [1, T, (nq + 2 nkv) d]
            torch.ops.w8a8_cpu.rotary_embedding_(qkv, self.cos[start:end], self.sin[start:end], nq + nkv)
            if t == 1 and self.dtype == torch.float32:  # the cache writes and the attention in one op
                scales = (self.k_scale[i], self.v_scale[i]) if self.k_scale else (None, None)
                attn = torch.ops.w8a8_cpu.decode_attention_(qkv.view(nq + 2 * nkv, d), k_cache, v_cache, start, nq,
                                                            layer.scaling, *scales)
            else:
                heads = qkv.view(t, nq + 2 * nkv, d)
                if self.kv_cache in ("fp16", "int8"):
                    self._store(i, heads[:, nq:].view(t, 2, nkv, d), start)
                else:
                    k_cache[:, start:end] = heads[:, nq:nq + nkv].transpose(0, 1)
                    v_cache[:, start:end] = heads[:, nq + nkv:].transpose(0, 1)
                if t == 1:  # a 16-bit model
                    attn = torch.nn.functional.scaled_dot_product_attention(
                        heads[:, :nq].transpose(0, 1).unsqueeze(0), k_cache[None, :, :end], v_cache[None, :, :end],
                        scale=layer.scaling, enable_gqa=True)
                    attn = attn.transpose(1, 2)
                else:
                    # the library's blocked causal attention (fp32; a no-op conversion for fp32 models) on the cache
                    # as stored
                    attn = torch.ops.w8a8_cpu.causal_attention(heads[:, :nq].float(), *self._stored(i, end),
                                                               layer.scaling).to(self.dtype)
            x = layer.post_norm.add_(h, layer.o_proj(attn.reshape(1, t, nq * d)))
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x = following.add_(h, layer.mlp(x))
        return x[0]

    def _step_weights(self) -> Optional[list]:
        """decode_step_'s weights where it computes this model's decode step as the loop would, judged on the modules
        as they are now (a greedy call asks once; static activation scales or hooks may have come since the Decoder
        was built), else None (one_op_step False, or see _one_op_step_layers): per layer its input norm, q/k/v,
        o_proj, post-attention norm, gate/up and down (packed weight, scales, bias or None each), then the final norm,
        read from the modules as the loop reads them."""
        if not (self.one_op_step and self.dtype == torch.float32 and _one_op_step_layers(self.layers, self.norm)):
            return None
        weights = []
        for layer in self.layers:
            qkv, out, mlp = layer.qkv._buffers, layer.o_proj._buffers, layer.mlp._buffers
            down = layer.mlp._modules["down_proj"]._buffers
            weights += [layer.input_norm.tensors["weight"], qkv["weight_packed"], qkv["w_scale"], qkv["bias"],
                        out["weight_packed"], out["w_scale"], out["bias"], layer.post_norm.tensors["weight"],
                        mlp["gate_up_packed"], mlp["gate_up_scale"], mlp["gate_up_bias"], down["weight_packed"],
                        down["w_scale"], down["bias"]]
        weights.append(self.norm.tensors["weight"])
        return weights

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [vocab] of the position after ids [T] (the prompt's forward pass; the cache is reset)."""
        return self.logits(ids)[0]

    def logits(self, ids: torch.Tensor, last: int = 1) -> torch.Tensor:
        """Logits [last, vocab] of the last `last` positions of ids [T] (position p's predict token p + 1), from one
        forward pass of the whole of ids (the cache is reset); the lm_head runs on those positions only."""
        ids = _check_ids(ids, self.config.vocab_size)
        if not isinstance(last, int) or not 1 <= last <= ids.numel():
            raise ValueError(f"last: expected an int in [1, {ids.numel()}] (the positions of ids), got {last!r}")
        return self._head(self._prompt(ids)[-last:])

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The lm_head's input [T, hidden] at every position of ids [T] (one forward pass; the cache is reset):
        logits(ids, last) is head(hidden(ids)[-last:])."""
        return self._prompt(_check_ids(ids, self.config.vocab_size))

    def _prompt(self, ids: torch.Tensor) -> torch.Tensor:
        """hidden() of ids already checked (logits checks them once)."""
        with self._cache_lock, torch.inference_mode():
            self._check_unchanged()
            self._allocate(ids.numel())
            return self._forward(ids, 0)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head on rows [R, hidden] of hidden(ids) -> logits [R, vocab]."""
        self._check_unchanged()
        return self._head(hidden)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.lm_head(hidden)

    def greedy(self, prompt_ids: torch.Tensor, new_tokens: int,
               on_token: Optional[Callable[[int], None]] = None) -> List[int]:
        """Exactly new_tokens greedy tokens after prompt_ids [T] (no stop at an end token), each the argmax of the
        model's logits; on_token(token id) is called with each as soon as it is chosen (streaming)."""
        ids = _check_ids(prompt_ids, self.config.vocab_size)
        if not isinstance(new_tokens, int) or new_tokens < 1:
            raise ValueError(f"new_tokens: expected an int >= 1, got {new_tokens!r}")
        out: List[int] = []
        with self._cache_lock, torch.inference_mode():
            self._check_unchanged()
            self._allocate(ids.numel() + new_tokens - 1)  # the last token's keys are never needed
            logits = self.lm_head(self._forward(ids, 0)[-1:])[0]
            position = ids.numel()
            step_weights = self._step_weights()
            for _ in range(new_tokens):
                token = logits.argmax()
                out.append(int(token))
                if on_token is not None:
                    on_token(out[-1])
                if len(out) == new_tokens:
                    break
                logits = self.lm_head(self._forward(token.view(1), position, step_weights))[0]
                position += 1
        return out


def _runs_its_own_forward(module, cls) -> bool:
    """An instance of cls running cls's forward and nothing else: not a subclass's forward (e.g. one with a collective
    in it), not one patched onto the instance (accelerate's hooks do that), no forward hooks."""
    return isinstance(module, cls) and type(module).forward is cls.forward and "forward" not in module.__dict__ and \
        not (module._forward_hooks or module._forward_pre_hooks)


def _plain_w8a8(module) -> bool:
    """A W8A8Linear / W4A8Linear computing what decode_step_'s GEMMs compute: its own forward, per-token dynamic
    activations."""
    return _runs_its_own_forward(module, W8A8Linear) and module._buffers["input_scale"] is None and \
        module.symmetric_activations


def _one_op_step_layers(layers: List[_Layer], final_norm: _RMSNorm) -> bool:
    """Whether decode_step_ computes these layers' decode step as the loop would, now: fused q/k/v and gate/up GEMMs of
    W8A8 / W4A8 layers running their own forward with per-token activations (quantize_model(..., fuse=True)), one
    attention geometry and one norm epsilon in every layer, and no global forward hooks (the op calls no module: a
    hook would not run)."""
    modules = torch.nn.modules.module
    if modules._global_forward_hooks or modules._global_forward_pre_hooks:
        return False
    first = layers[0]
    for layer in layers:
        mlp = layer.mlp
        if not (_plain_w8a8(layer.qkv) and _plain_w8a8(layer.o_proj) and _runs_its_own_forward(mlp, W8A8GatedMLP) and
                _plain_w8a8(mlp._modules.get("down_proj"))):
            return False
        if (layer.heads, layer.kv_heads, layer.head_dim, layer.scaling) != \
                (first.heads, first.kv_heads, first.head_dim, first.scaling):
            return False
        if layer.input_norm.eps != final_norm.eps or layer.post_norm.eps != final_norm.eps:
            return False
    return True


def _memory_available() -> Optional[int]:
    """Bytes this process can still allocate, as far as it can tell (None: it cannot): the system's available memory
    (/proc/meminfo's MemAvailable) and the room left under an address-space limit (RLIMIT_AS), the smaller one."""
    import resource

    limits = []
    try:
        with open("/proc/meminfo") as meminfo:
            limits += [int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")]
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as statm:
                limits.append(soft - int(statm.read().split()[0]) * resource.getpagesize())
    except (OSError, ValueError, IndexError):
        pass
    return min(limits) if limits else None


def _dtype(model: torch.nn.Module) -> torch.dtype:
    """The model's float dtype, as its first norm holds it: the KV cache's and the rotary tables'."""
    return model.model.layers[0].input_layernorm.weight.dtype


def _parts(model: torch.nn.Module) -> list:
    """The modules a Decoder calls or reads, in a fixed order (a norm's weight is read from its module at each call,
    so a new norm Parameter is followed, not refused)."""
    inner = model.model
    parts = [inner.embed_tokens, inner.norm, model.lm_head, inner.rotary_emb]
    for layer in inner.layers:
        attn = layer.self_attn
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        parts += [layer, layer.input_layernorm, layer.post_attention_layernorm, attn, *projections, attn.o_proj,
                  layer.mlp]
        # the fused layer a slice reads (_Layer calls q_proj.fused itself: a new one was left out, silently)
        parts += [getattr(p, "fused", None) for p in projections]
    return parts


def _check_ids(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0 or ids.dtype != torch.long:
        raise ValueError(f"ids: expected a non-empty 1-D int64 tensor of token ids, got "
                         f"{getattr(ids, 'dtype', type(ids))} {tuple(getattr(ids, 'shape', ()))}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"ids: token ids must be in [0, {vocab_size})")
    return ids

