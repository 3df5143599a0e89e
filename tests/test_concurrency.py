"""Thread safety: every op called from many Python threads at once on shared inputs gives the results of a
single-threaded run bit for bit and leaves its inputs untouched; and w8a8_cpu.use_variant from several threads."""
import threading
import time

import pytest
import torch

import w8a8_cpu
from conftest import intra_op_threads

THREADS = 8
SECONDS = 1.5     # per variant: each thread repeats the whole op list until this much time has passed ...
MIN_ROUNDS = 3    # ... and at least this many times (a slow variant or a sanitizer build still overlaps calls)
MAX_ROUNDS = 500


def _cases(gen):
    """name -> zero-argument call of one op on shared inputs (bf16 / fp32, raw / packed, odd sizes)."""
    x = torch.randn(37, 200, generator=gen)
    x_bf16 = (torch.randn(5, 3, 200, generator=gen) * 4).to(torch.bfloat16)
    w_q = torch.randint(-127, 128, (70, 200), dtype=torch.int8, generator=gen)
    w_scale = torch.rand(70, generator=gen) * 0.02 + 1e-3
    bias = torch.randn(70, generator=gen)
    x_q = torch.randint(-128, 128, (37, 200), dtype=torch.int8, generator=gen)
    x_scale = torch.rand(37, 1, generator=gen) * 0.05 + 1e-3
    packed = w8a8_cpu.pack_weight(w_q)

    e, h, inter, topk, m = 8, 96, 48, 2, 21
    hidden = torch.randn(m, h, generator=gen).to(torch.bfloat16)
    w13 = torch.randint(-127, 128, (e, 2 * inter, h), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-127, 128, (e, h, inter), dtype=torch.int8, generator=gen)
    w13_scale = torch.rand(e, 2 * inter, generator=gen) * 2e-3 + 1e-4
    w2_scale = torch.rand(e, h, generator=gen) * 2e-3 + 1e-4
    topk_weights = torch.rand(m, topk, generator=gen)
    topk_ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(m)])
    w13_p, w2_p = w8a8_cpu.pack_moe_weights(w13, w2)

    linear = torch.nn.Linear(200, 70)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(70, 200, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(70, generator=gen))
    module = w8a8_cpu.nn.W8A8Linear.from_linear(linear)

    norm_weight = torch.rand(200, generator=gen) + 0.5
    q, k, v = torch.randn(45, 6, 16, generator=gen), torch.randn(2, 45, 16, generator=gen), torch.randn(2, 45, 16,
                                                                                                        generator=gen)

    inputs = [x, x_bf16, w_q, w_scale, bias, x_q, x_scale, packed, hidden, w13, w2, w13_scale, w2_scale,
              topk_weights, topk_ids, w13_p, w2_p, norm_weight, q, k, v] + list(module.buffers())
    cases = {
        "per_token_quant_int8 fp32": lambda: w8a8_cpu.per_token_quant_int8(x),
        "per_token_quant_int8 bf16": lambda: w8a8_cpu.per_token_quant_int8(x_bf16[1]),
        "int8_scaled_mm raw": lambda: w8a8_cpu.int8_scaled_mm(x_q, w_q, x_scale, w_scale, bias, torch.bfloat16),
        "int8_scaled_mm packed": lambda: w8a8_cpu.int8_scaled_mm(x_q, packed, x_scale, w_scale, None, torch.float32),
        "int8_scaled_mm_with_quant raw": lambda: w8a8_cpu.int8_scaled_mm_with_quant(x, w_q, w_scale, bias),
        "int8_scaled_mm_with_quant packed 3-D": lambda: w8a8_cpu.int8_scaled_mm_with_quant(x_bf16, packed, w_scale),
        "pack_weight": lambda: w8a8_cpu.pack_weight(w_q),
        "fused_experts raw": lambda: w8a8_cpu.fused_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale,
                                                            w2_scale),
        "fused_experts packed": lambda: w8a8_cpu.fused_experts(hidden, w13_p, w2_p, topk_weights, topk_ids,
                                                               w13_scale, w2_scale),
        "W8A8Linear forward": lambda: module(x_bf16),
        "rms_norm bf16": lambda: torch.ops.w8a8_cpu.rms_norm(x_bf16, norm_weight, 1e-5),
        "causal_attention": lambda: torch.ops.w8a8_cpu.causal_attention(q, k, v, 0.25),
    }
    return cases, inputs


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _identical(a, b):
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow_under_emulation  # 8 threads x every op x every variant: minutes under qemu; the driver is shared code
def test_ops_from_many_threads_bit_identical(variant, gen):
    cases, inputs = _cases(gen)
    snapshot = [t.clone() for t in inputs]
    with intra_op_threads(1):  # the reference: one Python thread, one intra-op thread
        want = {name: _as_tuple(call()) for name, call in cases.items()}

    barrier = threading.Barrier(THREADS)
    errors, rounds = [], [0] * THREADS

    def worker(index):
        try:
            barrier.wait(timeout=30)
            with w8a8_cpu.use_variant(variant):  # the variant is per thread: each worker picks it
                run_rounds(index)
        except Exception as e:  # noqa: BLE001  (reported below, with the thread)
            errors.append(f"thread {index}: {type(e).__name__}: {e}")

    def run_rounds(index):
        names = list(cases)
        deadline = time.monotonic() + SECONDS
        while rounds[index] < MAX_ROUNDS and (rounds[index] < MIN_ROUNDS or time.monotonic() < deadline):
            # each thread starts the list at its own offset, so different ops overlap
            for name in names[index % len(names):] + names[:index % len(names)]:
                got = _as_tuple(cases[name]())
                if not _identical(got, want[name]):
                    errors.append(f"thread {index}, round {rounds[index]}: {name} differs from the 1-thread run")
                    return
            rounds[index] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    assert not errors, "\n".join(errors[:10])
    assert min(rounds) >= MIN_ROUNDS, rounds
    for before, after in zip(snapshot, inputs):
        assert torch.equal(before, after), "an op wrote to one of its shared inputs"


def _packed_by(blob):
    """The variant that packed a blob: the NUL-terminated name at byte 48 of the header (docs/ARCHITECTURE.md)."""
    return bytes(blob[48:60].tolist()).split(b"\0")[0].decode()


@pytest.mark.skipif(len(w8a8_cpu.info()["runnable_variants"]) < 2, reason="needs two runnable variants")
def test_use_variant_is_per_thread():
    """Two threads in overlapping use_variant blocks (A enters, B enters, A leaves, B leaves: forced with events)
    must each run on their own variant inside their block, and leave the process on its original variant."""
    original = w8a8_cpu.info()["selected_variant"]
    runnable = w8a8_cpu.info()["runnable_variants"]
    others = [v for v in runnable if v not in ("ref", original)]
    mine = {"A": "ref", "B": others[-1] if others else original}
    w_q = torch.randint(-127, 128, (16, 32), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    a_entered, b_entered, a_left = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, []

    def observe(who, when):  # what info() reports and which variant an op actually runs on
        seen[f"{who} {when}"] = (w8a8_cpu.info()["selected_variant"], _packed_by(w8a8_cpu.pack_weight(w_q)))

    def thread_a():
        try:
            with w8a8_cpu.use_variant(mine["A"]):
                observe("A", "after entering")
                a_entered.set()
                assert b_entered.wait(timeout=30), "B never entered"
                observe("A", "while B is inside")
        except Exception as e:  # noqa: BLE001
            errors.append(f"A: {type(e).__name__}: {e}")
        finally:
            a_entered.set()
            a_left.set()

    def thread_b():
        try:
            assert a_entered.wait(timeout=30), "A never entered"
            with w8a8_cpu.use_variant(mine["B"]):
                observe("B", "after entering")
                b_entered.set()
                assert a_left.wait(timeout=30), "A never left"
                observe("B", "after A left")
        except Exception as e:  # noqa: BLE001
            errors.append(f"B: {type(e).__name__}: {e}")
        finally:
            b_entered.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    after = w8a8_cpu.info()["selected_variant"]
    assert not errors, errors
    problems = [f"{k}: (reported, used by pack_weight) = {v}, its own is {mine[k[0]]!r}"
                for k, v in sorted(seen.items()) if v != (mine[k[0]], mine[k[0]])]
    if after != original:
        problems.append(f"after both blocks the main thread is on {after!r}, was {original!r}")
    assert len(seen) == 4 and not problems, "\n".join(problems)
