"""python -m w8a8_cpu check: the CPU/dispatch report, a self-check of every runnable variant against the exact
reference, and a short benchmark of the W8A8 linear against torch fp32 and torch.ao dynamic int8."""
from __future__ import annotations

import os
from typing import Callable, Dict, List

import torch

import w8a8_cpu
from w8a8_cpu import reference
from w8a8_cpu._fake import _MAX_K

from .baselines import ao_dynamic
from .timing import Progress, interleaved, medians


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
        progress = Progress(len(SELF_CHECK_SHAPES) * 3, name=variant)
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
                progress.step(f"M={m} N={n} K={k} {str(dtype).replace('torch.', '')}")
        status = "ok" if worst == 0.0 else "MISMATCH"
        ok &= worst == 0.0
        print(f"  {variant:<12} {status}: {len(SELF_CHECK_SHAPES)} shapes x 3 dtypes, max |diff| = {worst:g}")
    return ok


ROUNDS = 5  # interleaved rounds of the check's benchmark
MAX_K = _MAX_K


def benchmark_bytes(m: int, n: int, k: int) -> int:
    """About what benchmark(m, n, k) allocates: the fp32 weight and its int8 copies (ours, torch.ao's), the input
    and its quantized rows, an output per candidate."""
    return 6 * n * k + 5 * m * k + 12 * m * n


def memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def benchmark(m: int, n: int, k: int, iters: int, rounds: int = ROUNDS) -> Dict[str, float]:
    """Median times in ms of the W8A8 linear (packed weights) vs torch fp32 and torch.ao dynamic quantized Linear,
    measured interleaved in the same run: per round, each candidate's median of `iters` calls."""
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
    progress = Progress(rounds, name=f"benchmark M={m} N={n} K={k}")
    values = interleaved(candidates, rounds, samples=iters, on_round=lambda r: progress.step(f"round {r}/{rounds}"))
    return medians(values, unit=1e-3)
