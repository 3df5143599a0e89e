"""Fused W8A8 MoE benchmark: w8a8_cpu.fused_experts vs a torch bf16 / fp32 per-expert loop and vs a loop
of our own W8A8 linear op. Not a test: it reports times and ratios measured in one run, interleaved.

    python benchmarks/moe.py [--quick] [--json FILE] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import w8a8_cpu

H, I = 2048, 768
CASES = [(m, e, k) for m in (1, 16, 128) for e, k in ((8, 2), (64, 8))]


def float_loop(x, w13, w2, weights, ids):
    """The torch reference: per-expert dense matmuls in the weights' dtype."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate_up = x[tokens] @ w13[e].T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (weights[tokens, slots, None] * (act @ w2[e].T)).float())
    return out.to(x.dtype)


def linear_loop(x, w13_p, s13, w2_p, s2, weights, ids, inter):
    """The same MoE from our W8A8 linear op, one call per expert and projection."""
    out = torch.zeros(x.shape[0], s2.shape[1], dtype=torch.float32)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate_up = w8a8_cpu.int8_scaled_mm_with_quant(x[tokens], w13_p[e], s13[e], out_dtype=torch.float32)
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = w8a8_cpu.int8_scaled_mm_with_quant(act, w2_p[e], s2[e])
        out.index_add_(0, tokens, weights[tokens, slots, None] * down)
    return out.to(x.dtype)


def timed(fn, reps):
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def bench_case(m, experts, topk, reps, gen):
    w13 = torch.randn(experts, 2 * I, H, generator=gen) * 0.02
    w2 = torch.randn(experts, H, I, generator=gen) * 0.02
    moe = w8a8_cpu.nn.W8A8MoE.from_float(w13, w2, top_k=topk)
    x = torch.randn(m, H, generator=gen).to(torch.bfloat16)
    weights, ids = moe.route(torch.randn(m, experts, generator=gen))
    w13_bf16, w2_bf16 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    # the same int8 experts, packed as one linear weight each
    w13_p = [w8a8_cpu.pack_weight(w) for w in moe._quantize_experts(w13)[0]]
    w2_p = [w8a8_cpu.pack_weight(w) for w in moe._quantize_experts(w2)[0]]
    candidates = {
        "w8a8_cpu fused_experts": lambda: w8a8_cpu.fused_experts(x, moe.w13_packed, moe.w2_packed, weights, ids,
                                                                 moe.w13_scale, moe.w2_scale),
        "loop of w8a8_cpu linear": lambda: linear_loop(x, w13_p, moe.w13_scale, w2_p, moe.w2_scale, weights, ids, I),
        "torch bf16 loop": lambda: float_loop(x, w13_bf16, w2_bf16, weights.to(torch.bfloat16), ids),
        "torch fp32 loop": lambda: float_loop(x.float(), w13, w2, weights, ids),
    }
    samples = {name: [] for name in candidates}
    with torch.inference_mode():
        for fn in candidates.values():
            fn()  # warm-up
        for _ in range(reps):  # interleaved, so noise hits every candidate alike
            for name, fn in candidates.items():
                samples[name] += timed(fn, 1)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M=1 and 16 with E=8 only, 2 repetitions (smoke)")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per candidate (default 10)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", metavar="FILE", help="write results as JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [(1, 8, 2), (16, 8, 2)] if args.quick else CASES
    reps = 2 if args.quick else args.reps
    gen = torch.Generator().manual_seed(0)
    info = w8a8_cpu.info()
    print(f"MoE benchmark: H={H} I={I}, bf16 activations, variant {info['selected_variant']}, "
          f"{torch.get_num_threads()} threads, median of {reps}")
    results = []
    for i, (m, experts, topk) in enumerate(cases):
        sys.stderr.write(f"\r  [{i + 1}/{len(cases)}] M={m} E={experts} topk={topk} ...")
        sys.stderr.flush()
        times = bench_case(m, experts, topk, reps, gen)
        ours = times["w8a8_cpu fused_experts"]
        sys.stderr.write("\r" + " " * 60 + "\r")
        print(f"M={m:<4} E={experts:<3} topk={topk}: " + " | ".join(
            f"{name} {ms:.2f} ms" + ("" if ms == ours else f" (x{ms / ours:.2f})") for name, ms in times.items()))
        results.append({"m": m, "experts": experts, "topk": topk, "ms": times})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "H": H, "I": I, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
