"""The KV cache's storages (fp32, fp16, int8 with a scale per token and KV head) through the decode attention op and the
Decoder: what decode_attention_ stores (fp16: torch's rounding; int8: per_token_quant_int8's rule, the reference's),
its output against fp64 attention over the values as stored, the same bits in every variant and at 1-3 threads (key
blocks combined in a fixed order), the prompt path and the decode path attending to the same stored cache, and bad
arguments refused with a ValueError naming them, by the op and its fake alike."""
import re

import pytest
import torch

import w8a8_cpu
from conftest import intra_op_threads
from test_fused_layers import VOCAB, random_norms_model
from test_layer_ops import attention_reference
from tiny_models import token_ids
from w8a8_cpu import reference
from w8a8_cpu.llm.decoder import KV_CACHES, Decoder
from w8a8_cpu.nn import quantize_model

ops = torch.ops.w8a8_cpu


def stored_cache(kind, kv_heads, length, d, g):
    """(k_cache, v_cache, scales: (k_scale, v_scale) or ()) holding random rows as the kind stores them."""
    rows = [torch.randn(kv_heads * length, d, generator=g) * 2 for _ in range(2)]
    if kind == "int8":
        quantized = [ops.per_token_quant_int8(r) for r in rows]
        return (*(q.view(kv_heads, length, d) for q, _ in quantized),
                tuple(s.view(kv_heads, length) for _, s in quantized))
    dtype = torch.float16 if kind == "fp16" else torch.float32
    return (*(r.view(kv_heads, length, d).to(dtype) for r in rows), ())


def as_stored(cache, scale=None):
    """The cache's values in fp64: an int8 row times its scale."""
    return cache.double() * scale.double()[..., None] if scale is not None else cache.double()


@pytest.mark.parametrize("kind", KV_CACHES)
@pytest.mark.parametrize("position", [0, 40, 255, 256, 700])
def test_decode_attention_stores_by_the_rule_and_attends_to_the_stored_values(kind, position):
    """The position's key and value heads are stored as the kind stores them (fp32 exactly, fp16 as torch rounds,
    int8 as per_token_quant_int8 and the Python reference quantize them), nothing else of the caches changes, and the
    output is fp64 attention over the cache as stored (positions 0..position: one key block, several, and a block's
    first and last key); the same bits at 1, 2 and 3 threads."""
    g = torch.Generator().manual_seed(position)
    heads, kv_heads, d, length = 6, 2, 64, 701
    k_cache, v_cache, scales = stored_cache(kind, kv_heads, length, d, g)
    qkv = torch.randn(heads + 2 * kv_heads, d, generator=g) * 2
    before = [t.clone() for t in (k_cache, v_cache, *scales)]
    results = []
    for threads in (1, 2, 3):
        caches = [t.clone() for t in before]
        with intra_op_threads(threads):
            results.append(ops.decode_attention_(qkv, *caches[:2], position, heads, 0.125, *caches[2:]))
    got = results[0]
    assert all(torch.equal(r, got) for r in results[1:])
    k_cache, v_cache, *scales = caches
    new_k, new_v = qkv[heads:heads + kv_heads], qkv[heads + kv_heads:]
    if kind == "int8":
        for new, cache, scale in ((new_k, k_cache, scales[0]), (new_v, v_cache, scales[1])):
            q, s = ops.per_token_quant_int8(new)
            assert torch.equal(cache[:, position], q) and torch.equal(scale[:, position], s[:, 0])
            q_ref, s_ref = reference.per_token_quant_int8(new)
            assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    else:
        assert torch.equal(k_cache[:, position], new_k.to(k_cache.dtype))
        assert torch.equal(v_cache[:, position], new_v.to(v_cache.dtype))
    others = torch.arange(length) != position
    for now, then in zip((k_cache, v_cache, *scales), before):
        assert torch.equal(now[:, others], then[:, others])
    keys = position + 1
    q_all = torch.zeros(keys, heads, d)
    q_all[-1] = qkv[:heads]
    k_scale, v_scale = scales if scales else (None, None)
    want = attention_reference(q_all, as_stored(k_cache, k_scale)[:, :keys], as_stored(v_cache, v_scale)[:, :keys],
                               0.125)[-1]
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)  # values up to ~6


@pytest.mark.parametrize("kind", KV_CACHES)
@pytest.mark.parametrize("d", [16, 24, 64, 128])
def test_decode_attention_has_the_reference_variants_bits_for_every_cache(variant, kind, d):
    """Every variant's key blocks (x86: 8 keys' dot products at once, int8 / fp16 widened in vectors) give the bits of
    the reference variant's (activation.h's row), at key counts around its blocks, tiles and key blocks."""
    g = torch.Generator().manual_seed(d)
    heads, kv_heads, length = 6, 2, 600
    k_cache, v_cache, scales = stored_cache(kind, kv_heads, length, d, g)
    qkv = torch.randn(heads + 2 * kv_heads, d, generator=g) * 3
    for position in (0, 7, 8, 127, 128, 255, 256, 599):
        args = lambda: (qkv, k_cache.clone(), v_cache.clone(), position, heads, 0.3, *(s.clone() for s in scales))
        got = ops.decode_attention_(*args())
        with w8a8_cpu.use_variant("ref"):
            want = ops.decode_attention_(*args())
        assert torch.equal(got, want), (variant, kind, d, position)


def test_int8_rows_of_zeros_and_of_non_finite_values():
    """An all-zero key row is stored as zeros (and attends as zeros); a row holding NaN or Inf gets scale NaN and
    codes 0, so every query head of its KV head is NaN, as with an fp32 cache, and the other KV head's are exact."""
    g = torch.Generator().manual_seed(4)
    k_cache, v_cache, (k_scale, v_scale) = stored_cache("int8", 2, 30, 16, g)
    qkv = torch.randn(8, 16, generator=g)
    qkv[4] = 0  # KV head 0's key at position 10
    out = ops.decode_attention_(qkv, k_cache, v_cache, 10, 4, 0.5, k_scale, v_scale)
    assert not k_cache[0, 10].any() and not out.isnan().any()
    for bad in (float("nan"), float("inf")):
        poisoned = qkv.clone()
        poisoned[5, 3] = bad  # KV head 1's key
        caches = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
        out_bad = ops.decode_attention_(poisoned, caches[0], caches[1], 10, 4, 0.5, caches[2], caches[3])
        assert caches[2][1, 10].isnan() and not caches[0][1, 10].any()
        assert out_bad[2:].isnan().all() and torch.equal(out_bad[:2], out[:2])


@pytest.mark.parametrize("kv_cache", KV_CACHES)
def test_decoder_decodes_what_its_prompt_path_computes_over_the_stored_cache(kv_cache):
    """A decode step (decode_attention_ on the cache) and a prompt one token longer (the prompt path: the cache stored
    by the same rule, dequantized for the prompt attention) give the same logits up to fp32 rounding, for every
    kv_cache of an fp32 model; the cache holds what its kind stores, and its bytes are reported (int8 <= 0.27x of
    fp32 at SmolLM2's head_dim, 64)."""
    model = random_norms_model()
    decoder = Decoder(model, kv_cache=kv_cache)
    ids = token_ids(VOCAB, (40,), seed=2)
    tokens = decoder.greedy(ids[:30], 10)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}[kv_cache]
    assert decoder.k_cache[0].dtype == dtype and bool(decoder.k_scale) == (kv_cache == "int8")
    for end in (31, 40):
        step = Decoder(model, kv_cache=kv_cache)
        whole = step.prefill(ids[:end])  # (sizes the cache for the step below)
        step.prefill(ids[:end - 1])
        with torch.inference_mode():
            decoded = step.lm_head(step._forward(ids[end - 1:end], end - 1))[0]
        torch.testing.assert_close(decoded, whole, rtol=0, atol=2e-4)
    prompt_path = Decoder(model, kv_cache=kv_cache)
    expected = []
    for _ in range(10):  # greedy by prompts alone: the tokens the decode steps chose
        expected.append(int(prompt_path.prefill(torch.cat([ids[:30], torch.tensor(expected, dtype=torch.long)]))
                            .argmax()))
    assert tokens == expected
    fp32_bytes = Decoder(model).kv_bytes(4096)
    assert fp32_bytes == 2 * 2 * 4096 * 2 * 16 * 4  # layers, K and V, positions, KV heads, head_dim, bytes
    ratio = decoder.kv_bytes(4096) / fp32_bytes
    assert ratio == {"fp32": 1, "fp16": 0.5, "int8": (16 + 4) / 64}[kv_cache]  # head_dim 16: a scale is 4 bytes of 20
    one_head = random_norms_model(num_attention_heads=1, num_key_value_heads=1)  # head_dim 64
    ratio = Decoder(one_head, kv_cache=kv_cache).kv_bytes(4096) / Decoder(one_head).kv_bytes(4096)
    assert ratio == {"fp32": 1, "fp16": 0.5, "int8": (64 + 4) / 256}[kv_cache] and ratio <= 0.27 or kv_cache != "int8"


@pytest.mark.parametrize("kv_cache", KV_CACHES)
@pytest.mark.parametrize("threads", [1, 2])
def test_one_op_decode_step_equals_the_loop_for_every_kv_cache(kv_cache, threads):
    """decode_step_ with each cache storage (int8: the scale lists) gives the loop's bits: the greedy tokens and every
    layer's cache and scales."""
    model = quantize_model(random_norms_model(), quantize_embedding=True, fuse=True)
    fast, loop = Decoder(model, kv_cache=kv_cache), Decoder(model, kv_cache=kv_cache)
    loop.one_op_step = False
    ids = token_ids(VOCAB, (23,), seed=8)
    with intra_op_threads(threads):
        assert fast.greedy(ids, 12) == loop.greedy(ids, 12)
    for mine, theirs in ((fast.k_cache, loop.k_cache), (fast.v_cache, loop.v_cache), (fast.k_scale, loop.k_scale),
                         (fast.v_scale, loop.v_scale)):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_decoder_refuses_a_kv_cache_it_does_not_have():
    with pytest.raises(ValueError, match="kv_cache: expected one of fp32, fp16, int8 or None"):
        Decoder(random_norms_model(), kv_cache="q8_0")
    with pytest.raises(ValueError, match="kv_cache: 'int8' needs an fp32 model"):
        Decoder(random_norms_model().to(torch.bfloat16), kv_cache="int8")


Z = torch.zeros
I8 = dict(dtype=torch.int8)
BAD = [
    ((Z(8, 8), Z(2, 5, 8).bfloat16(), Z(2, 5, 8).bfloat16(), 0, 4, 1.0), "k_cache: dtype must be float32, float16"),
    ((Z(8, 8), Z(2, 5, 8), Z(2, 5, 8).half(), 0, 4, 1.0), "v_cache: expected the dtype of k_cache"),
    ((Z(8, 8), Z(2, 5, 8, **I8), Z(2, 5, 8, **I8), 0, 4, 1.0), "k_scale: an int8 cache needs a contiguous float32"),
    ((Z(8, 8), Z(2, 5, 8, **I8), Z(2, 5, 8, **I8), 0, 4, 1.0, Z(2, 5), Z(2, 4)), "v_scale: an int8 cache needs"),
    ((Z(8, 8), Z(2, 5, 8, **I8), Z(2, 5, 8, **I8), 0, 4, 1.0, Z(2, 5).half(), Z(2, 5)), "k_scale: an int8 cache needs"),
    ((Z(8, 8), Z(2, 5, 8, **I8), Z(2, 5, 8, **I8), 0, 4, 1.0, Z(5, 2).t(), Z(2, 5)), "k_scale: an int8 cache needs"),
    ((Z(8, 8), Z(2, 5, 8), Z(2, 5, 8), 0, 4, 1.0, Z(2, 5)), "k_scale: only an int8 cache has scales"),
    ((Z(8, 8), Z(2, 5, 8).half(), Z(2, 5, 8).half(), 0, 4, 1.0, None, Z(2, 5)), "v_scale: only an int8 cache has"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("args, fragment", BAD)
def test_bad_kv_cache_arguments_raise_naming_them(args, fragment, device):
    """The op on CPU tensors and its fake kernel on meta tensors raise the same error."""
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(ValueError, match=re.escape(fragment)):
        ops.decode_attention_(*args)


def test_scales_that_do_not_match_their_caches_are_refused():
    """decode_step_: a scale list per layer of int8 caches and none otherwise, h apart from every scale;
    decode_attention_: scales apart from each other (both written in place)."""
    k_cache, v_cache, (k_scale, _) = stored_cache("int8", 2, 7, 8, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="k_cache, v_cache, k_scale, v_scale: must not overlap each other or qkv"):
        ops.decode_attention_(torch.randn(8, 8), k_cache, v_cache, 3, 4, 0.5, k_scale, k_scale)
    decoder = Decoder(quantize_model(random_norms_model(), quantize_embedding=True, fuse=True), kv_cache="int8")
    decoder.greedy(torch.arange(5), 2)
    weights = [None if w is None else w.detach() for w in decoder._step_weights()]
    first = decoder.layers[0]

    def step(k_scales, v_scales):
        return ops.decode_step_(torch.randn(1, 1, 64), weights, decoder.k_cache, decoder.v_cache, decoder.cos,
                                decoder.sin, 3, first.heads, first.scaling, decoder.norm.eps, k_scales, v_scales)

    assert step(decoder.k_scale, decoder.v_scale).shape == (1, 1, 64)
    with pytest.raises(ValueError, match=r"k_scales: expected none or one per layer of k_caches \(2\), got 1"):
        step(decoder.k_scale[:1], decoder.v_scale)
    with pytest.raises(ValueError, match="layer 0, k_cache: k_scales, v_scales: expected one per layer with int8"):
        step(None, None)
    with pytest.raises(ValueError, match="layer 0, k_cache: h: overlaps the layer's k_cache, v_cache or their scales"):
        shared = torch.zeros(64 + 8)  # h and layer 0's key scales overlapping
        ops.decode_step_(shared[:64].view(1, 1, 64), weights, decoder.k_cache, decoder.v_cache, decoder.cos,
                         decoder.sin, 3, first.heads, first.scaling, decoder.norm.eps,
                         [shared[60:].view(2, 6), decoder.k_scale[1]], decoder.v_scale)
    if hasattr(torch.library, "opcheck"):
        torch.library.opcheck(ops.decode_step_.default,
                              (torch.randn(1, 1, 64), weights, decoder.k_cache, decoder.v_cache, decoder.cos,
                               decoder.sin, 3, first.heads, first.scaling, decoder.norm.eps, decoder.k_scale,
                               decoder.v_scale))
        k_cache, v_cache, (k_scale, v_scale) = stored_cache("int8", 2, 7, 8, torch.Generator().manual_seed(2))
        torch.library.opcheck(ops.decode_attention_.default,
                              (torch.randn(8, 8), k_cache, v_cache, 3, 4, 0.5, k_scale, v_scale))
