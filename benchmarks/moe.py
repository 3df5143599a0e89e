"""Fused W8A8 MoE benchmark: w8a8_cpu.fused_experts vs a torch bf16 / fp32 per-expert loop and vs a loop
of our own W8A8 linear op. Not a test: it reports times and ratios measured in one run, interleaved.

    python benchmarks/moe.py [--quick] [--reps N] [--json FILE] [--threads N]

A thin entry over the package's benchmark suite (w8a8_cpu.cli.bench, which also runs these cases as part of
`python -m w8a8_cpu bench`; `python benchmarks/linear.py --no-linear` is the same MoE run with targets).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import w8a8_cpu
from w8a8_cpu.cli import bench

H, I = bench.MOE_H, bench.MOE_I
CASES = bench.MOE_CASES
float_loop, linear_loop = bench.moe_float_loop, bench.moe_linear_loop  # kept importable under their old names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M=1 and 16 with E=8 only, 2 repetitions (smoke)")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per candidate (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per candidate first (default 1)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", metavar="FILE", help="write results as JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = bench.QUICK_MOE if args.quick else CASES
    reps = 2 if args.quick else args.reps
    gen = torch.Generator().manual_seed(0)
    info = w8a8_cpu.info()
    print(f"MoE benchmark: H={H} I={I}, bf16 activations, variant {info['selected_variant']}, "
          f"{torch.get_num_threads()} threads, median of {reps}")
    results = []
    for i, (m, experts, topk) in enumerate(cases):
        sys.stderr.write(f"\r  [{i + 1}/{len(cases)}] M={m} E={experts} topk={topk} ...")
        sys.stderr.flush()
        case = bench.bench_moe_case(m, experts, topk, reps, args.warmup, gen)
        times = case["ms"]
        ours = times[bench.MOE_OURS]
        sys.stderr.write("\r" + " " * 60 + "\r")
        print(f"M={m:<4} E={experts:<3} topk={topk}: " + " | ".join(
            f"{name} {ms:.2f} ms" + ("" if name == bench.MOE_OURS else f" (x{ms / ours:.2f})")
            for name, ms in times.items()))
        results.append({"m": m, "experts": experts, "topk": topk, "ms": times})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "H": H, "I": I, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
