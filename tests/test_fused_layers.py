"""Fused projections, the int8 embedding shared with the lm_head, and the lean decode loop, on tiny random models
(transformers): fused outputs against the separate layers bit for bit, the shared table against its int8 rows
exactly, and the Decoder's logits and greedy tokens against the model's own forward and generate."""
import copy
import re

import pytest
import torch

import w8a8_cpu
from w8a8_cpu.nn import (W8A8Embedding, W8A8GatedMLP, W8A8Linear, W8A8LinearSlice, fuse_projections,
                         quantize_model)
from conftest import intra_op_threads
from tiny_models import tiny_causal_lm, token_ids

transformers = pytest.importorskip("transformers")
VOCAB = 300


def random_norms_model(arch="llama", tied=True, **overrides):
    """tiny_causal_lm of VOCAB tokens (qwen2 and mistral without a sliding window) with random norms."""
    window = {} if arch == "llama" else dict(sliding_window=None)
    model = tiny_causal_lm(arch, tied=tied, **{"vocab_size": VOCAB, "max_position_embeddings": 128, **window,
                                               **overrides})
    with torch.no_grad():  # random norms, so a norm mixed up with another shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_fused_qkv_and_gate_up_equal_the_separate_layers_bit_for_bit():
    model = quantize_model(random_norms_model(), skip=["lm_head"])
    separate = copy.deepcopy(model)
    fused = fuse_projections(model)
    assert fused == {"attention": ["model.layers.0.self_attn", "model.layers.1.self_attn"],
                     "mlp": ["model.layers.0.mlp", "model.layers.1.mlp"]}
    x = torch.randn(3, 5, 64)
    for i in range(2):
        attn, attn0 = model.model.layers[i].self_attn, separate.model.layers[i].self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            assert isinstance(getattr(attn, name), W8A8LinearSlice)
            assert torch.equal(getattr(attn, name)(x), getattr(attn0, name)(x)), (i, name)
            assert torch.equal(getattr(attn, name).int8_weight(), getattr(attn0, name).int8_weight())
            assert torch.equal(getattr(attn, name).w_scale, getattr(attn0, name).w_scale)
        mlp, mlp0 = model.model.layers[i].mlp, separate.model.layers[i].mlp
        assert isinstance(mlp, W8A8GatedMLP)
        gate, up = (layer(x) for layer in mlp.projections().values())
        assert torch.equal(gate, mlp0.gate_proj(x)) and torch.equal(up, mlp0.up_proj(x))
        act = torch.nn.functional.silu(gate.double()) * up.double()
        torch.testing.assert_close(mlp.down_proj(act.float()), mlp0(x), rtol=1e-4, atol=1e-4)
    # the whole model: the same function up to the SiLU's last bits
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, separate(ids).logits, rtol=1e-3, atol=1e-3)


def test_slices_reuse_one_gemm_per_input_and_recompute_for_another():
    model = quantize_model(random_norms_model(), skip=["lm_head"], fuse=True)
    attn = model.model.layers[0].self_attn
    calls = []
    attn.q_proj.fused.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(2, 64)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert len(calls) == 1
    x.add_(1.0)  # an in-place edit bumps the version: the slices do not serve the stale output
    assert not torch.equal(attn.k_proj(x), k) and len(calls) == 2
    with torch.inference_mode():
        y = torch.randn(2, 64)
        attn.q_proj(y), attn.k_proj(y)
        assert len(calls) == 3


def test_tied_lm_head_and_embedding_share_one_int8_table():
    model = random_norms_model()
    emb_float = model.model.embed_tokens.weight.detach().clone()
    quantize_model(model, quantize_embedding=True)
    emb, head = model.model.embed_tokens, model.lm_head
    assert isinstance(emb, W8A8Embedding) and isinstance(head, W8A8Linear)
    assert emb.weight_packed is head.weight_packed and emb.w_scale is head.w_scale
    ids = torch.tensor([[0, 7, 299, 7]])
    w_q = head.int8_weight()
    expected = w_q[ids].float() * head.w_scale[ids].unsqueeze(-1)
    assert torch.equal(emb(ids), expected)
    torch.testing.assert_close(emb(ids), emb_float[ids], rtol=0, atol=float(emb_float.abs().max()) / 127)
    names = [name for name, _ in model.named_buffers(remove_duplicate=True)]
    assert sum("weight_packed" in name and ("embed" in name or "lm_head" in name) for name in names) == 1
    with pytest.raises(IndexError, match=r"\[0, 300\)"):
        emb(torch.tensor([300]))


def test_untied_embedding_gets_its_own_table_and_no_warning(recwarn):
    model = random_norms_model(tied=False)
    quantize_model(model, quantize_embedding=True)
    assert isinstance(model.model.embed_tokens, W8A8Embedding)
    assert model.model.embed_tokens.weight_packed is not model.lm_head.weight_packed
    tied = random_norms_model()
    quantize_model(tied, quantize_embedding=True)
    assert not [w for w in recwarn if "unties" in str(w.message)]
    with pytest.warns(UserWarning, match="quantize_embedding=True"):
        quantize_model(random_norms_model())


def test_int8_embedding_follows_the_model_through_to_save_and_load(tmp_path):
    """model.to(bfloat16) after quantize_model(quantize_embedding=True): the embedding kept returning fp32, and so did
    every logit after it; torch.save of such a model refused the int8 view the embedding kept of its blob."""
    model = quantize_model(random_norms_model(), quantize_embedding=True, fuse=True)
    ids = token_ids(VOCAB, (1, 9), seed=7)
    with torch.no_grad():
        before = model(ids).logits
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)
        model.to(torch.bfloat16)
        assert model.get_input_embeddings()(ids).dtype == torch.bfloat16 and model(ids).logits.dtype == torch.bfloat16


def test_an_embedding_with_max_norm_stays_float():
    """max_norm renormalizes the rows a lookup reads: an int8 table read plainly returned rows 3-4x its norm."""
    model = random_norms_model()
    model.model.embed_tokens.max_norm = 0.05
    with pytest.raises(ValueError, match=r"computes more than a row lookup \(a scale after it, max_norm\)"):
        quantize_model(model, quantize_embedding=True)
    with pytest.raises(ValueError, match="max_norm=0.05 renormalizes the rows it reads"):
        W8A8Embedding.from_embedding(model.model.embed_tokens)


class ScaledGatedMLP(torch.nn.Module):
    """Looks like a SiLU-gated MLP (gate/up/down_proj, act_fn) but scales and clamps as well, as Falcon-H1's
    mlp_multipliers and DeepSeek-V4's swiglu_limit do."""

    def __init__(self, multiplier=1.0, limit=None):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False)
        self.down_proj, self.act_fn = torch.nn.Linear(96, 64, bias=False), torch.nn.SiLU()
        self.multiplier, self.limit = multiplier, limit

    def forward(self, x):
        gate = self.act_fn(self.gate_proj(x) * self.multiplier)
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
        return self.down_proj(gate * self.up_proj(x))


@pytest.mark.parametrize("mlp", [ScaledGatedMLP(multiplier=0.88), ScaledGatedMLP(limit=1.0)], ids=["scaled", "clamped"])
def test_an_mlp_that_computes_more_than_the_plain_gated_form_stays_unfused(mlp):
    """Fusing by structure alone replaced these with W8A8GatedMLP, silently: outputs 2x and 8x off."""
    model = quantize_model(torch.nn.Sequential(mlp))
    x = torch.randn(5, 64) * 4
    with torch.no_grad():
        before = model(x)
    assert fuse_projections(model) == {"attention": [], "mlp": []}
    with torch.no_grad():
        assert torch.equal(model(x), before)
    plain = quantize_model(torch.nn.Sequential(ScaledGatedMLP()))
    assert fuse_projections(plain) == {"attention": [], "mlp": ["0"]}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_decoder_follows_the_model(model_type):
    """The lean loop on the model's own weights: fp32 logits equal the model's forward to float rounding (one fused
    rms_norm kernel instead of four ops), and greedy tokens equal generate's (streamed to on_token as they are chosen, by both); on the W8A8 model (fused, int8
    lm_head) it agrees with the model's argmax on nearly every position (W8A8 is chaotic in the last bits)."""
    from w8a8_cpu.llm import evaluate
    from w8a8_cpu.llm.decoder import Decoder

    model = random_norms_model(model_type)
    ids = token_ids(VOCAB, (40,), seed=3)
    with torch.no_grad():
        expected = model(ids.unsqueeze(0)).logits[0]
    decoder = Decoder(model)
    torch.testing.assert_close(decoder.prefill(ids), expected[-1], rtol=1e-4, atol=1e-4)
    # the last 25 positions' logits, as perplexity reads them (the lm_head on those positions only)
    torch.testing.assert_close(decoder.logits(ids, 25), expected[-25:], rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        generated = model.generate(ids.unsqueeze(0), attention_mask=torch.ones(1, 40, dtype=torch.long),
                                   do_sample=False, max_new_tokens=20, min_new_tokens=20)[0, 40:].tolist()
    streamed, streamed_by_generate = [], []  # each token as soon as it is chosen (bench llm --context times them)
    assert decoder.greedy(ids, 20, on_token=streamed.append) == generated == streamed
    assert evaluate.greedy(model, ids, 20, on_token=streamed_by_generate.append)["tokens"] == streamed_by_generate
    assert streamed_by_generate == generated

    quantized = quantize_model(copy.deepcopy(model), quantize_embedding=True, fuse=True)
    lean = Decoder(quantized)
    agree = 0
    for end in range(2, 41):
        with torch.no_grad():
            agree += int(lean.prefill(ids[:end]).argmax() == quantized(ids[:end].unsqueeze(0)).logits[0, -1].argmax())
    assert agree >= 37


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_op_decode_step_equals_the_loop_bit_for_bit(model_type, scheme, threads):
    """decode_step_ runs the lean loop's decode step (every layer, then the final norm) as one op: the same functions
    in the same order, so the same bits as the loop (qwen2: q/k/v biases; int4 layers with minimums): the greedy
    tokens, every position of every layer's KV cache (each layer's keys read the hidden state before it), and a step's
    lm_head input."""
    from w8a8_cpu.llm.decoder import Decoder

    options = dict(scheme=scheme, group_size=32, symmetric=False, min_max=True) if scheme == "w4a8" else {}
    model = quantize_model(random_norms_model(model_type), quantize_embedding=True, fuse=True, **options)
    fast, loop = Decoder(model), Decoder(model)
    assert fast._step_weights() is not None
    loop.one_op_step = False
    ids = token_ids(VOCAB, (23,), seed=8)
    with intra_op_threads(threads):
        tokens = fast.greedy(ids, 15)
        assert loop.greedy(ids, 15) == tokens
        for layer in range(2):
            assert torch.equal(fast.k_cache[layer], loop.k_cache[layer]), layer
            assert torch.equal(fast.v_cache[layer], loop.v_cache[layer]), layer
        assert fast.k_cache[1][:, 36].abs().sum() > 0  # the last step's position was written
        with torch.inference_mode():
            step = torch.tensor([tokens[-1]])
            assert torch.equal(fast._forward(step, 36, fast._step_weights()), loop._forward(step, 36))


def test_one_op_decode_step_only_where_it_computes_the_loop():
    """decode_step_ serves fp32 models of fused W8A8 / W4A8 layers with per-token activations running their own forward,
    judged at each greedy call; float or unfused models, a layer with another forward (a subclass's, or one patched on
    the instance), static activation scales set after the Decoder was built, and modules with forward hooks (which an
    op cannot call) decode through the loop, hooks called."""
    from w8a8_cpu.llm.decoder import Decoder

    assert Decoder(random_norms_model())._step_weights() is None
    assert Decoder(quantize_model(random_norms_model(), quantize_embedding=True))._step_weights() is None  # unfused

    class Doubled(W8A8Linear):  # a layer whose forward does more than the op (e.g. a collective)
        def forward(self, x):
            return super().forward(x) * 2

    model = quantize_model(random_norms_model(), quantize_embedding=True, fuse=True)
    changed = copy.deepcopy(model)
    changed.model.layers[1].self_attn.o_proj.__class__ = Doubled
    assert Decoder(changed)._step_weights() is None
    changed = copy.deepcopy(model)
    decoder = Decoder(changed)
    down = changed.model.layers[0].mlp.down_proj
    down.forward = lambda x, forward=down.forward: forward(x) * 2
    assert decoder._step_weights() is None
    changed = copy.deepcopy(model)
    decoder = Decoder(changed)
    assert decoder._step_weights() is not None
    changed.model.layers[1].self_attn.o_proj.set_activations(torch.tensor([0.05]))
    assert decoder._step_weights() is None
    decoder = Decoder(model)
    assert decoder.one_op_step and decoder._step_weights() is not None
    calls = []
    handle = model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda *args: calls.append(1))
    ids = token_ids(VOCAB, (10,), seed=1)
    try:
        assert decoder._step_weights() is None
        decoder.greedy(ids, 4)
        assert len(calls) == 4  # the prompt and three decode steps
    finally:
        handle.remove()
    assert decoder._step_weights() is not None


def test_one_op_decode_step_refuses_bad_input_naming_it():
    from w8a8_cpu.llm.decoder import Decoder

    ops = torch.ops.w8a8_cpu
    decoder = Decoder(quantize_model(random_norms_model(), quantize_embedding=True, fuse=True))
    decoder.greedy(torch.arange(5), 2)
    # detached: the norms' Parameters require grad, and the op refuses inputs that do (tested below)
    weights = [None if w is None else w.detach() for w in decoder._step_weights()]
    first = decoder.layers[0]

    def step(h=None, weights=weights, position=3, cos=decoder.cos, heads=first.heads):
        h = torch.randn(1, 1, 64) if h is None else h
        return ops.decode_step_(h, weights, decoder.k_cache, decoder.v_cache, cos, decoder.sin, position, heads,
                                first.scaling, decoder.norm.eps)

    assert step().shape == (1, 1, 64)
    with pytest.raises(ValueError,
                       match="weights: expected 14 a layer .2 layers. and the final norm's, 29 in all, got 28"):
        step(weights=weights[:-1])
    with pytest.raises(ValueError, match="position: expected 0 <= position < 6"):
        step(position=6)
    with pytest.raises(ValueError, match="h: expected one fp32 row"):
        step(h=torch.randn(2, 64))
    with pytest.raises(ValueError, match="heads: expected 1 <= heads <= 2147483647, got 1099511627776"):
        step(heads=2 ** 40)
    with pytest.raises(ValueError, match="layer 1, k_cache: h: overlaps the layer's k_cache"):
        step(h=decoder.k_cache[1].view(-1)[:64].view(1, 1, 64))
    swapped = list(weights)
    swapped[14 + 4] = weights[14 + 8]  # layer 1's o_proj as its gate/up projection: K 64 as o_proj's, N 192
    swapped[14 + 5] = weights[14 + 9]
    with pytest.raises(ValueError, match=r"layer 1, o_proj: expected 64 outputs \(h's\), got 192"):
        step(weights=swapped)
    missing = list(weights)
    missing[1] = None
    with pytest.raises(ValueError, match=r"layer 0, q/k/v projection: weights\[1\] is None"):
        step(weights=missing)
    missing = weights[:-1] + [None]
    with pytest.raises(ValueError, match=r"layer 1, the final norm: weights\[28\] is None"):
        step(weights=missing)
    with pytest.raises(ValueError, match="layer 0, k_cache: expected contiguous, non-empty caches"):
        ops.decode_step_(torch.randn(1, 1, 64), weights, [decoder.k_cache[0][:, ::2], decoder.k_cache[1]],
                         decoder.v_cache, decoder.cos, decoder.sin, 3, first.heads, first.scaling, decoder.norm.eps)
    with pytest.raises(ValueError, match=r"weights\[7\]: requires grad, but decode_step_ has no gradient"):
        with torch.enable_grad():
            grad_weights = list(weights)
            grad_weights[7] = weights[7].detach().clone().requires_grad_()
            step(weights=grad_weights)
    if hasattr(torch.library, "opcheck"):
        torch.library.opcheck(ops.decode_step_.default,
                              (torch.randn(1, 1, 64), weights, decoder.k_cache, decoder.v_cache, decoder.cos,
                               decoder.sin, 3, first.heads, first.scaling, decoder.norm.eps))


def test_main_jobs_window_timer_scores_as_the_decoder_and_times_full_windows_only():
    """The main job's perplexity scorer (cli.llm.WindowPrefillTimer): the same logits as Decoder.logits (the last
    position's through the lm_head on its own, as prefill computes it: bit-identical for an int8 lm_head, whose rows
    are independent), and one time per window of the prefill length after the first (a warm-up), none for a shorter
    one."""
    from w8a8_cpu.cli.llm import WindowPrefillTimer
    from w8a8_cpu.llm import evaluate
    from w8a8_cpu.llm.decoder import Decoder

    model = quantize_model(random_norms_model(), quantize_embedding=True, fuse=True)
    decoder = Decoder(model)
    timer = WindowPrefillTimer(decoder, 32)
    ids = token_ids(VOCAB, (56,), seed=5)
    for window, last in ((ids[:32], 17), (ids[:32], 1), (ids[30:], 9)):
        assert torch.equal(timer(window, last), decoder.logits(window, last))
    assert len(timer.seconds) == 1 and all(0 < s < 60 for s in timer.seconds)
    scores = evaluate.compare_on_text({"lean": decoder, "timed": timer}, "lean", ids, window=32, stride=16)
    assert scores["timed"]["ppl"] == scores["lean"]["ppl"] and scores["timed"]["kl"] == 0.0
    assert len(timer.seconds) == 1 + 2  # windows (0, 32), (16, 48), (32, 56): the last is 24 tokens long


def test_decoder_of_a_bf16_model_follows_it():
    """A 16-bit model decodes through scaled_dot_product_attention (the fused decode attention op is fp32): each greedy
    token is the bf16 model's own argmax after the tokens before it, on nearly every step (bf16 rounds differently in
    the fused norm)."""
    from w8a8_cpu.llm.decoder import Decoder

    model = random_norms_model("llama").to(torch.bfloat16)
    ids = token_ids(VOCAB, (30,), seed=4)
    tokens = Decoder(model).greedy(ids, 10)
    with torch.no_grad():
        logits = model(torch.cat([ids, torch.tensor(tokens[:-1])]).unsqueeze(0)).logits[0, 29:]
    assert sum(int(a == b) for a, b in zip(logits.argmax(-1).tolist(), tokens)) >= 8


def test_decoder_calls_from_two_threads_give_each_its_own_logits():
    """Two threads calling one Decoder share its KV cache: unguarded, 20-34 of 200 calls each returned logits computed
    over the other thread's keys. Calls run one at a time, so every one equals the same call made alone."""
    import threading

    from w8a8_cpu.llm.decoder import Decoder

    decoder = Decoder(quantize_model(random_norms_model(), quantize_embedding=True, fuse=True))
    prompts = [token_ids(VOCAB, (n,), seed=n) for n in (20, 45)]
    alone = [(decoder.logits(p, 5), decoder.greedy(p, 4)) for p in prompts]
    start, differing = threading.Barrier(2, timeout=60), [0, 0]

    def calls(i):
        start.wait()
        for _ in range(100):
            differing[i] += not torch.equal(decoder.logits(prompts[i], 5), alone[i][0])
            differing[i] += decoder.greedy(prompts[i], 4) != alone[i][1]

    threads = [threading.Thread(target=calls, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads) and differing == [0, 0]


def test_decoder_refuses_a_model_changed_under_it():
    """A Decoder built on the float model, then quantize_model in place: it ran the old float q/k/v/o with the new
    W8A8 MLP linears (logits matching neither model): refused now. A norm's weight is read from its module at each
    call: in-place edits, swapped .data and a new Parameter are followed (a new Parameter was left out: 0.5 off)."""
    from w8a8_cpu.llm.decoder import Decoder

    model = random_norms_model()
    decoder = Decoder(model)
    ids = token_ids(VOCAB, (12,), seed=6)
    with torch.no_grad():
        model.model.norm.weight.mul_(2)  # in place: the Decoder reads it
        torch.testing.assert_close(decoder.prefill(ids), model(ids.unsqueeze(0)).logits[0, -1], rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # its data swapped, as smooth_quant does to 16-bit norms: read at each call (0.57 off)
        model.model.norm.weight.data = model.model.norm.weight.data * 1.5
        torch.testing.assert_close(decoder.prefill(ids), model(ids.unsqueeze(0)).logits[0, -1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(copy.deepcopy(decoder).prefill(ids), decoder.prefill(ids), rtol=0, atol=0)
    model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight * 2)
    with torch.no_grad():
        torch.testing.assert_close(decoder.prefill(ids), model(ids.unsqueeze(0)).logits[0, -1], rtol=1e-4, atol=1e-4)
    quantize_model(model, skip=["lm_head"])
    for call in (lambda: decoder.prefill(ids), lambda: decoder.greedy(ids, 2), lambda: decoder.head(torch.zeros(1, 64)),
                 lambda: decoder.logits(ids, 3)):
        with pytest.raises(ValueError, match="replaced after this Decoder was built.*build a new Decoder"):
            call()
    converted = Decoder(copy.deepcopy(model))
    converted._model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="converted to torch.bfloat16 after this Decoder was built for torch.float32"):
        converted.prefill(ids)
    with torch.no_grad():  # a Decoder built now runs the W8A8 model
        assert int(Decoder(model).prefill(ids).argmax()) == int(model(ids.unsqueeze(0)).logits[0, -1].argmax())


def test_decoder_refuses_a_fused_layer_replaced_under_it():
    """The fused q/k/v layer that the slices read (layer.self_attn.q_proj.fused) replaced on the model: an existing
    Decoder decoded on with the old weights, no error (tokens [51, 116, ...] where a fresh Decoder and the model's own
    generate gave [3, 61, 191, ...]). Refused now, as any other module replaced under it; a new Decoder follows the
    model."""
    from w8a8_cpu.llm.decoder import Decoder

    model = quantize_model(random_norms_model(), skip=["lm_head"], fuse=True)
    decoder = Decoder(model)
    ids = token_ids(VOCAB, (12,), seed=6)
    before = decoder.greedy(ids, 4)
    attn = model.model.layers[1].self_attn
    other = copy.deepcopy(attn.q_proj.fused)
    other.w_scale.mul_(3)
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(attn, name).fused = other
    with pytest.raises(ValueError, match="replaced after this Decoder was built.*build a new Decoder"):
        decoder.greedy(ids, 4)
    with torch.no_grad():
        want = model(ids.unsqueeze(0)).logits[0, -1]
    after = Decoder(model)
    torch.testing.assert_close(after.prefill(ids), want, rtol=1e-4, atol=1e-4)
    assert after.greedy(ids, 4) != before


def test_decoder_kv_cache_that_cannot_be_had_is_a_value_error():
    """A KV cache larger than the memory this process can allocate: a ValueError saying what was asked (positions,
    bytes) and why it cannot be had, before allocating (max_position_embeddings 2^31, 2^28 new tokens: a 34 GB
    allocation failed with torch's RuntimeError). The Decoder still runs afterwards."""
    from w8a8_cpu.llm.decoder import Decoder

    decoder = Decoder(random_norms_model(max_position_embeddings=1 << 40))  # 140 TB asked: more than any machine has
    ids = token_ids(VOCAB, (12,), seed=6)
    positions = 12 + (1 << 38) - 1
    needed = positions * (2 * 2 * 2 * 16 * 4 + 16 * (8 + 2 * 4))  # 2 layers, k and v, 2 KV heads of 16, fp32; rotary
    with pytest.raises(ValueError, match=re.escape(f"length: a KV cache of {positions} positions needs {needed} bytes "
                                                   f"(2 layers, fp32 KV), more than the ") +
                       r"\d+ bytes this process can still allocate; ask for fewer positions"):
        decoder.greedy(ids, 1 << 38)
    with torch.no_grad():
        model_tokens = decoder._model.generate(ids.unsqueeze(0), max_new_tokens=3, do_sample=False)[0, 12:]
    assert decoder.greedy(ids, 3) == model_tokens.tolist()


def test_decoder_rejects_what_it_does_not_run():
    from w8a8_cpu.llm.decoder import Decoder

    with pytest.raises(ValueError, match="Decoder supports"):
        Decoder(torch.nn.Linear(2, 2))
    decoder = Decoder(random_norms_model())
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 300\)"):
        decoder.prefill(torch.tensor([300]))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        decoder.greedy(torch.zeros(100, dtype=torch.long), 30)
    assert len(decoder.greedy(torch.zeros(100, dtype=torch.long), 29)) == 29  # 128 positions: the last token's keys
    # are never written
    with pytest.raises(ValueError, match="new_tokens"):
        decoder.greedy(torch.zeros(3, dtype=torch.long), 0)
    for last in (0, 4, 1.0):
        with pytest.raises(ValueError, match=r"last: expected an int in \[1, 3\]"):
            decoder.logits(torch.zeros(3, dtype=torch.long), last)


ROPE = {"linear": {"rope_type": "linear", "factor": 2.0},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0},
        "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
        "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32}}


@pytest.mark.parametrize("rope", ROPE)
def test_decoder_follows_every_rotary_type_it_accepts(rope):
    """The rotary types whose tables do not depend on the call (yarn and llama3 past their original length): the
    Decoder's logits are the model's, for a short call after a long one and for greedy's prompt."""
    from w8a8_cpu.llm.decoder import Decoder

    model = random_norms_model(rope_scaling=ROPE[rope])
    decoder, ids = Decoder(model), token_ids(VOCAB, (100,), seed=0)
    with torch.no_grad():
        want = model(ids[:40].unsqueeze(0)).logits[0]
        decoder.logits(ids, 1)
        torch.testing.assert_close(decoder.logits(ids[:40], 40), want, rtol=1e-4, atol=1e-4)
        tokens = decoder.greedy(ids[:40], 30)
        assert tokens[0] == int(want[-1].argmax())
        torch.testing.assert_close(decoder.logits(ids[:40], 40), want, rtol=1e-4, atol=1e-4)


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)], "original_max_position_embeddings": 64}


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("case,overrides,message", [
    # the table of a long call gave later short calls the long factors: logits 0.44 off
    ("longrope", dict(rope_scaling=LONGROPE), "rotary embedding of type 'longrope' is not supported"),
    # a 8-wide table on 16-dim heads: the op rotated the wrong elements where the model's own forward fails
    ("partial rotary", dict(rope_parameters={"rope_type": "linear", "factor": 1.0, "partial_rotary_factor": 0.5,
                                             "rope_theta": 10000.0}),
     "covers 8 of each head's 16 dimensions"),
    ("window 0", dict(sliding_window=0, use_sliding_window=True), "sliding-window attention"),
    # qwen2's window switched off while its layers say sliding: the model's own forward fails
    ("sliding layer types", dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=False,
                                 sliding_window=16), "sliding-window attention")])
def test_decoder_refuses_attention_it_would_compute_wrongly(model_type, case, overrides, message):
    """Configurations whose attention the Decoder did not compute as the model does (or where the model itself
    fails) returned logits silently: now a ValueError naming what is missing."""
    from w8a8_cpu.llm.decoder import Decoder

    if (model_type == "llama" and "window" in case) or (model_type != "qwen2" and "layer_types" in overrides):
        pytest.skip(f"{model_type} has no such setting")
    model = random_norms_model(model_type, max_position_embeddings=256, head_dim=16, **overrides)
    with pytest.raises(ValueError, match=message):
        Decoder(model)


@pytest.mark.parametrize("name", ["w_scale", "bias"])
def test_load_state_dict_refuses_non_finite_weight_side_values(name):
    """load_state_dict into a built W8A8Linear checks what its constructor checks: NaN/Inf scales or bias refused,
    naming the key, and the layer is left as it was."""
    from w8a8_cpu.nn import W8A8Linear

    layer = W8A8Linear.from_linear(torch.nn.Linear(32, 8))
    before = layer.w_scale.clone()
    state = layer.state_dict()
    state[name] = state[name].clone()
    state[name][2] = float("inf") if name == "bias" else float("nan")
    with pytest.raises(ValueError, match=rf"^{name}: contains NaN or Inf"):
        layer.load_state_dict(state)
    assert torch.equal(layer.w_scale, before)


@pytest.mark.parametrize("model_class", ["LlamaModel", "LlamaForSequenceClassification"])
def test_decoder_refuses_a_llama_that_is_not_a_causal_lm(model_class):
    """A Llama base model (no lm_head) or a classifier (no model.model): Decoder names what it needs, as a ValueError
    (it raised AttributeError)."""
    from w8a8_cpu.llm.decoder import Decoder

    config = random_norms_model().config
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=rf"model\.model\.layers and model\.lm_head .*got {model_class}"):
        Decoder(getattr(transformers, model_class)(config).eval())
