"""Accuracy and speed of causal LMs against a reference model: sliding-window perplexity, KL divergence and top-1
agreement with the reference on the same windows, greedy generation and its decode rate (prefill timing, which
interleaves the models, is the llm command's: w8a8_cpu.cli.llm).

A whole W8A8 model is chaotic (a 1e-7 relative change of its input moves logits by units), so its quality is
judged statistically over thousands of tokens, never by one output being equal."""
from __future__ import annotations

import copy
import time
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from .decoder import Decoder

LastLogits = Callable[[torch.Tensor, int], torch.Tensor]  # (ids [T], last) -> logits [last, vocab]


def windows(n_tokens: int, window: int, stride: int) -> List[tuple]:
    """(begin, end, first_scored) of each sliding window: each token is scored at most once, with at least
    window - stride tokens of context once the first window is full; a window's first token has no context in it
    and is not scored, so with stride < window every token after the text's first is scored."""
    if not 0 < stride <= window or n_tokens < 2:
        raise ValueError(f"window {window}, stride {stride}, tokens {n_tokens}: need 0 < stride <= window and "
                         f">= 2 tokens")
    spans, scored_to = [], 1
    for begin in range(0, max(n_tokens - window, 0) + stride, stride):
        end = min(begin + window, n_tokens)
        if end <= scored_to:
            break
        spans.append((begin, end, max(scored_to, begin + 1)))
        scored_to = end
    return spans


def compare_on_text(models: Dict[str, Union[torch.nn.Module, Decoder, LastLogits]], reference: str,
                    ids: torch.Tensor, window: int = 512, stride: int = 256,
                    on_window: Optional[Callable[[int, int], None]] = None) -> Dict[str, dict]:
    """Perplexity of every model on token ids [T], plus KL(reference || model) and top-1 agreement with
    `reference` (one of the names) on the same scored positions. A model is a causal LM module (its forward), a
    Decoder (its lean loop's forward) or a function (ids [T], last) -> the logits [last, vocab] of the last `last`
    positions. Models run window by window, one after the other on each, so no model's full-text logits are held at
    once."""
    if reference not in models:
        raise ValueError(f"reference: {reference!r} is not one of the models {list(models)}")
    spans = windows(ids.numel(), window, stride)
    totals = {name: {"nll": 0.0, "kl": 0.0, "top1": 0} for name in models}
    scored = 0
    with torch.inference_mode():
        for i, (begin, end, first) in enumerate(spans):
            inputs = ids[begin:end]
            targets = ids[first:end]
            ref_p = ref_plogp = ref_top = None
            for name in [reference] + [n for n in models if n != reference]:
                # position p predicts token p + 1: the logits of positions first-1 .. end-2 score the targets, so
                # the LM head runs on the last end-first+1 positions only (it is a large share of the work)
                logits = _last_logits(models[name], inputs, end - first + 1)[:-1].float()
                logp = torch.log_softmax(logits, dim=-1)
                totals[name]["nll"] -= logp.gather(1, targets.unsqueeze(1)).sum().item()
                if ref_p is None:  # the reference's terms once a window, not once per model
                    ref_p, ref_top = logp.exp(), logp.argmax(-1)
                    ref_plogp = torch.linalg.vecdot(ref_p, logp)
                else:
                    # KL per position = sum p log p - sum p log q: one fused product a model (~1/3 of the time of
                    # the elementwise form over the [positions, vocab] logits). The difference of two fp32 sums of
                    # a few nats each: SmolLM2's W8A8 KL (0.016 a position) keeps ~4 significant digits
                    kl = ref_plogp - torch.linalg.vecdot(ref_p, logp)
                    totals[name]["kl"] += kl.double().sum().item()
                    totals[name]["top1"] += int((logp.argmax(-1) == ref_top).sum())
            scored += targets.numel()
            if on_window:
                on_window(i + 1, len(spans))
    out = {}
    for name, t in totals.items():
        ppl = float(torch.tensor(t["nll"] / scored).exp())
        out[name] = {"ppl": ppl, "scored_tokens": scored}
        if name != reference:
            out[name].update(kl=t["kl"] / scored, top1_agreement=t["top1"] / scored)
    return out


def _last_logits(model: Union[torch.nn.Module, Decoder, LastLogits], ids: torch.Tensor, last: int) -> torch.Tensor:
    """Logits [last, vocab] of the last `last` positions of ids [T]."""
    if isinstance(model, Decoder):
        return model.logits(ids, last)
    if isinstance(model, torch.nn.Module):
        return model(ids.unsqueeze(0), logits_to_keep=last).logits[0]
    return model(ids, last)


class _TokenStreamer:
    """A transformers streamer calling on_token(id) for each new token as generate() chooses it (generate puts the
    prompt first: skipped)."""

    def __init__(self, on_token: Callable[[int], None]):
        self.on_token, self.prompt_seen = on_token, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            for token in value.reshape(-1).tolist():
                self.on_token(int(token))
        self.prompt_seen = True

    def end(self) -> None:
        pass


def greedy(model: torch.nn.Module, prompt_ids: torch.Tensor, new_tokens: int,
           on_token: Optional[Callable[[int], None]] = None) -> dict:
    """Greedy generation (KV cache, batch 1) of exactly `new_tokens` tokens after prompt_ids [T]: the tokens and
    the rate in tokens/s over the whole call (the short prompt's prefill included); on_token(token id) is called with
    each new token as soon as it is chosen."""
    streamer = None if on_token is None else _TokenStreamer(on_token)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(prompt_ids.unsqueeze(0), attention_mask=torch.ones(1, prompt_ids.numel(), dtype=torch.long),
                             do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=streamer)
        elapsed = time.perf_counter() - t0
    return {"tokens": out[0, prompt_ids.numel():].tolist(), "tokens_per_s": new_tokens / elapsed}


def compiled_greedy(model: torch.nn.Module, prompt_ids: torch.Tensor, new_tokens: int, warmups: int = 2) -> dict:
    """greedy() on a copy of the model whose forward is torch.compile'd (inductor; our ops through their fake
    kernels) with a static KV cache, so decode steps run compiled code instead of Python module calls, which dominate
    a small model's decode. The first `warmups` generations compile (their total time is `compile_s`); the next is
    timed. Inductor fuses the float ops (norms, rotary, softmax) differently from eager, so the W8A8 tokens may
    differ from the eager model's (per-token quantization amplifies last-bit differences)."""
    compiled = copy.deepcopy(model)
    compiled.generation_config.cache_implementation = "static"
    compiled.forward = torch.compile(compiled.forward, dynamic=False)
    t0 = time.perf_counter()
    for _ in range(warmups):
        greedy(compiled, prompt_ids, new_tokens)
    compile_s = time.perf_counter() - t0
    return {**greedy(compiled, prompt_ids, new_tokens), "compile_s": compile_s}


def agreeing_prefix(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """Number of leading tokens equal to the reference's."""
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's state (parameters, buffers and torch.ao's packed int8 weights, which live in the
    state dict only), each storage counted once: tied embeddings are one tensor."""
    seen, total = set(), 0

    def count(value) -> None:
        nonlocal total
        if isinstance(value, (tuple, list)):
            for v in value:
                count(v)
        elif isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()

    for value in model.state_dict(keep_vars=True).values():
        count(value)
    return total
