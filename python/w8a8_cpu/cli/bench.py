"""python -m w8a8_cpu bench: W8A8 linear and fused MoE vs torch baselines on shapes from real models.

Every number comes from one run: the same process, the same torch thread count, candidates timed in interleaved
repetitions (round r times every candidate once, in an order of its own, before round r+1 starts, so drift and noise
from other jobs hit all of them alike and no candidate always runs right after the slowest) after warm-up, median of
the repetitions. It prints (and with --json writes) results only; the project's performance targets are
benchmarks/targets.py's, computed from that JSON. Nothing here asserts a timing.

Linear candidates (fp32 activations unless noted; weights made once per shape):
  w8a8_cpu        w8a8_cpu.nn.W8A8Linear: fused per-token quant + int8 GEMM on packed weights, fp32 in/out
  torch fp32      x @ w.t() with fp32 x, w
  torch bf16      x @ w.t() with bf16 x, w
  torch.ao int8   torch.ao.quantization.quantize_dynamic nn.Linear (engine: x86/fbgemm on x86, qnnpack on Arm)
  torch int8 wo   torch._weight_int8pack_mm(x bf16 [M, K], w int8 [N, K], scales bf16 [N]): weight-only int8
  w8a8_cpu W4A8   w8a8_cpu.nn.W4A8Linear: int4 weights in symmetric groups of 32 (--w4a8-group-size: 32, 64 or 128;
                  ~half the weight bytes), the same op
Per case: median time, GOPS (2*M*N*K / time), effective weight bandwidth (each candidate's own weight bytes / time)
and time ratios (baseline time / w8a8_cpu time: > 1 means w8a8_cpu is faster). The read limit: the fastest read from
memory this core does (read_limit.py: w8a8_cpu's _read_probe three ways, plain wide loads, software prefetch ahead,
non-temporal prefetch, over a ring of 256 MiB windows past the last-level cache; best of a few before and after the
cases, printed), each way also a candidate of every decode case's interleaved rounds; a case's limit is the best of
those reads and of every baseline's weight bytes per second in the same rounds (a peer GEMV that reads faster than the
probe sets the limit). Decode efficiency = w8a8_cpu weight bytes per second / that limit (medians of the same rounds,
which the load of other jobs on the memory bus hits alike); W4A8's counts its own bytes (nibbles and group scales,
fp16-stored: quantize_weight_int4's scales are fp16 values).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

import w8a8_cpu

from .._packed_weight import header_half_scales, scale_bytes
from ..nn.experts import quantize_experts
from .baselines import ao_dynamic
from .options import output_file, positive_int
from .read_limit import READ_WAYS, ReadRing
from .timing import Progress, interleaved, medians

# Llama-3-8B-like linear layers (N output features x K input features).
SHAPES: Dict[str, tuple] = {
    "4096x4096": (4096, 4096),     # o_proj
    "14336x4096": (14336, 4096),   # gate_proj / up_proj
    "4096x14336": (4096, 14336),   # down_proj
    "6144x4096": (6144, 4096),     # fused qkv_proj (GQA: 4096 + 2 * 1024)
}
SHAPE_ROLES = {"4096x4096": "o_proj", "14336x4096": "gate/up_proj", "4096x14336": "down_proj",
               "6144x4096": "qkv_proj"}
# SmolLM2-135M (the main job's LLM): hidden 576, 9 query / 3 KV heads of 64, intermediate 1536, vocabulary 49152.
# Selected with --shapes smollm2 (not in the default run).
SMALL_SHAPES: Dict[str, tuple] = {"576x576": (576, 576), "192x576": (192, 576), "1536x576": (1536, 576),
                                  "576x1536": (576, 1536), "49152x576": (49152, 576)}
SHAPES.update(SMALL_SHAPES)
SHAPE_ROLES.update({"576x576": "SmolLM2 q/o_proj", "192x576": "SmolLM2 k/v_proj", "1536x576": "SmolLM2 gate/up",
                    "576x1536": "SmolLM2 down_proj", "49152x576": "SmolLM2 lm_head"})
DEFAULT_SHAPES = ("4096x4096", "14336x4096", "4096x14336", "6144x4096")
DECODE_M = (1, 4, 16)
PREFILL_M = (128, 512)
ALL_M = DECODE_M + PREFILL_M


def phase_of(m: int) -> str:
    return "decode" if m <= max(DECODE_M) else "prefill"

OURS = "w8a8_cpu"
FP32, BF16, AO, WO = "torch fp32", "torch bf16", "torch.ao int8", "torch int8 wo"
ORT_RR, ORT = "onnxruntime rr", "onnxruntime int8"
W4A8, W4A8_GROUPS = "w8a8_cpu W4A8", (32, 64, 128)
PEERS = (FP32, BF16, AO, WO, ORT_RR, ORT)  # other libraries' GEMMs
BASELINES = PEERS + (W4A8,)
# The read probe's ways (read_limit.py), each a pseudo-candidate "read <way>" of decode cases.
READS = tuple(f"read {way}" for way in READ_WAYS)
# Decode cases also time ours as a model's decode runs its layers: distinct copies of the layer (STACK_MIB of int8
# weights in all; a copy comes back after the whole stack and a round's reads of the ring, over 1 GiB) called back to
# back, so each reads its weights from memory while the code and the activations stay warm; the per-layer time is the
# stack's over the copies. A lone call after the other candidates also pays for its code and data coming back from
# memory (~0.1-0.3 ms a call on a Zen4 VM: 4096x4096 M=1 63% of the read bandwidth alone, 88% in a stack), which a
# model's decode does not.
STACK, W4A8_STACK = "w8a8_cpu stack", "W4A8 stack"
STACKS = (STACK, W4A8_STACK)
STACK_MIB, QUICK_STACK_MIB = 256, 64

# MoE (Qwen/DeepSeek-like small experts): hidden H, intermediate I, cases (M, E, topk).
MOE_H, MOE_I = 2048, 768
MOE_CASES = [(m, e, k) for m in (1, 16, 128) for e, k in ((8, 2), (64, 8))]
MOE_OURS, MOE_LOOP, MOE_BF16, MOE_FP32 = ("w8a8_cpu fused_experts", "loop of w8a8_cpu linear", "torch bf16 loop",
                                          "torch fp32 loop")

QUICK_SHAPES = ("4096x4096",)
QUICK_M = (1, 16)
QUICK_MOE = [(1, 8, 2), (16, 8, 2)]


# --------------------------------------------------------------------------------------------------- linear

def _ao_engine() -> str:
    engines = torch.backends.quantized.supported_engines
    arm = w8a8_cpu.info()["arch"] == "aarch64"
    for engine in (("qnnpack",) if arm else ("x86", "fbgemm")) + ("qnnpack", "x86", "fbgemm", "onednn"):
        if engine in engines:
            return engine
    return torch.backends.quantized.engine


# A candidate's reason for being left out, as printed and stored: one line of the report
MAX_REASON_CHARS = 300


def ort_linear(w: torch.Tensor, reduce_range: bool, threads: int):
    """ONNX Runtime's dynamic int8 MatMul of x [M, K] by w.T (per-channel int8 weights, u8 activations with a zero
    point, MLAS kernels): quantize_dynamic of a one-MatMul float model. Returns fn(x float32 numpy) -> numpy.
    Its thread pool does not spin between calls (session.intra_op.allow_spinning = 0): a spinning pool keeps a core
    busy after each call and slows down whichever candidate runs next."""
    import tempfile
    from pathlib import Path

    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    n, k = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(w.t().contiguous().numpy(), "W")])
    with tempfile.TemporaryDirectory() as tmp:
        fp32_path, int8_path = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        # The file format's IR version is pinned to 8 (opset 17's): onnx otherwise writes its own newest, which an
        # older installed ONNX Runtime refuses to load (onnx 1.23 writes IR 14, ONNX Runtime 1.30 reads up to 13).
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        onnx.save(model, str(fp32_path))
        logging_level = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)  # quantize_dynamic logs a pre-processing hint on the root logger
        try:
            quantize_dynamic(str(fp32_path), str(int8_path), per_channel=True, reduce_range=reduce_range,
                             weight_type=QuantType.QInt8)
        finally:
            logging.getLogger().setLevel(logging_level)
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(str(int8_path), options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"X": x})[0]


def relative_error(got, ideal: torch.Tensor) -> float:
    """||got - ideal|| / ||ideal|| against the fp64 product of the unquantized operands."""
    got = torch.as_tensor(got).double()
    return ((got - ideal).norm() / ideal.norm()).item()


def linear_candidates(n: int, k: int, gen: torch.Generator, errors: Dict[str, str], stack_mib: int,
                      w4a8_group: int):
    """Builds every linear candidate for one [N, K] weight (W4A8 in symmetric groups of w4a8_group). Returns
    (make(m) -> ({name: fn}, {name: relative error vs the fp64 product}), weight bytes, the layer copies of each
    decode stack)."""
    linear = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
    w = linear.weight.detach()
    ours = w8a8_cpu.nn.W8A8Linear.from_linear(linear)
    int4 = w8a8_cpu.nn.W4A8Linear.from_linear(linear, group_size=w4a8_group)
    w_bf16 = w.to(torch.bfloat16)
    weight_bytes = {OURS: n * k + 4 * n, FP32: 4 * n * k, BF16: 2 * n * k, AO: n * k + 4 * n, WO: n * k + 2 * n,
                    ORT_RR: n * k + 4 * n, ORT: n * k + 4 * n,
                    W4A8: n * k // 2 + scale_bytes(header_half_scales(int4.weight_packed)) * n * -(-k // w4a8_group) +
                    4 * n}
    weight_bytes.update({STACK: weight_bytes[OURS], W4A8_STACK: weight_bytes[W4A8]})
    copies = max(2, -(-(stack_mib << 20) // (n * k))) if stack_mib else 1
    stacks = {STACK: [ours] + [copy.deepcopy(ours) for _ in range(copies - 1)],
              W4A8_STACK: [int4] + [copy.deepcopy(int4) for _ in range(copies - 1)]}
    ort_fns = {}
    for name, reduce_range in ((ORT_RR, True), (ORT, False)):
        try:
            ort_fns[name] = ort_linear(w, reduce_range, torch.get_num_threads())
        except ImportError as e:  # optional: pip install 'w8a8-cpu[bench]'
            errors[name] = f"{type(e).__name__}: {e} (pip install 'w8a8-cpu[bench]')"
        except Exception as e:
            # Installed but refusing (an onnx and an ONNX Runtime that disagree): this row says why, the other
            # candidates still run. The message's first line names the cause; ONNX Runtime's go on with a C++ trace.
            first_line = (str(e).strip().splitlines() or [""])[0]
            errors[name] = f"{type(e).__name__}: {first_line[:MAX_REASON_CHARS]}"
    dyn = None
    try:
        dyn = ao_dynamic(torch.nn.Sequential(linear))
    except Exception as e:  # not every torch build ships a quantized engine
        errors[AO] = f"{type(e).__name__}: {e}"
    wo_w = wo_s = None
    try:
        w_q, w_scale = w8a8_cpu.quantize_weight(w)
        wo_w, wo_s = w_q, w_scale.to(torch.bfloat16)
        torch._weight_int8pack_mm(torch.zeros(1, k, dtype=torch.bfloat16), wo_w, wo_s)
    except Exception as e:
        errors[WO] = f"{type(e).__name__}: {e}"
        wo_w = None
    del linear

    def make(m: int):
        x = torch.randn(m, k, generator=gen)
        xb, xn = x.to(torch.bfloat16), x.numpy()
        fns = {OURS: lambda: ours(x), FP32: lambda: x @ w.t(), BF16: lambda: xb @ w_bf16.t(), W4A8: lambda: int4(x)}
        if dyn is not None:
            fns[AO] = lambda: dyn(x)
        if wo_w is not None:
            fns[WO] = lambda: torch._weight_int8pack_mm(xb, wo_w, wo_s)
        for name, fn in ort_fns.items():
            fns[name] = lambda fn=fn: fn(xn)
        ideal = x.double() @ w.double().t()
        with torch.inference_mode():
            errs = {name: relative_error(fn(), ideal) for name, fn in fns.items()}
        if phase_of(m) == "decode":
            for name, layers in stacks.items():
                fns[name] = lambda layers=layers: [layer(x) for layer in layers]
            errs.update({STACK: errs[OURS], W4A8_STACK: errs[W4A8]})  # the same layer
        return fns, errs

    return make, weight_bytes, copies


def summarize_linear(name: str, n: int, k: int, m: int, samples: Dict[str, List[float]],
                     weight_bytes: Dict[str, int], bw_ref: Optional[float], read_bytes: int,
                     errors: Dict[str, float], stack_copies: int) -> dict:
    samples = dict(samples)
    read_samples = {cand: samples.pop(cand) for cand in READS if cand in samples}
    results = {}
    for cand, s in samples.items():
        sec = statistics.median(s) / (stack_copies if cand in STACKS else 1)  # a stack: per layer
        results[cand] = {"ms": sec * 1e3, "gops": 2.0 * m * n * k / sec / 1e9,
                         "weight_gbs": weight_bytes[cand] / sec / 1e9, "weight_bytes": weight_bytes[cand],
                         "rel_error": errors[cand], "samples": len(s)}
    ours = results[OURS]["ms"]
    ratios = {cand: r["ms"] / ours for cand, r in results.items() if cand != OURS and cand not in STACKS}
    case = {"shape": name, "role": SHAPE_ROLES.get(name, ""), "m": m, "n": n, "k": k,
            "phase": phase_of(m), "results": results, "speedup": ratios}
    if read_samples:  # the read probe timed in the same rounds as the candidates
        reads = {cand: read_bytes / statistics.median(s) / 1e9 for cand, s in read_samples.items()}
        case["read_gbs"], case["read_way"] = max((gbs, cand) for cand, gbs in reads.items())
        peers = {cand: r["weight_gbs"] for cand, r in results.items() if cand in PEERS}
        case["limit_gbs"], case["limit_source"] = max([(case["read_gbs"], case["read_way"])] +
                                                      [(gbs, cand) for cand, gbs in peers.items()])
    if STACK in results:
        case["stack_copies"] = stack_copies
    bw = case.get("limit_gbs", bw_ref)
    if bw:
        for key, cand in (("decode_efficiency", OURS), ("w4a8_decode_efficiency", W4A8),
                          ("stack_decode_efficiency", STACK), ("w4a8_stack_decode_efficiency", W4A8_STACK)):
            if cand in results:
                case[key] = results[cand]["weight_gbs"] / bw
    return case


# --------------------------------------------------------------------------------------------------- MoE

def moe_float_loop(x, w13, w2, weights, ids):
    """The torch reference: per-expert dense matmuls in the weights' dtype."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate_up = x[tokens] @ w13[e].T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (weights[tokens, slots, None] * (act @ w2[e].T)).float())
    return out.to(x.dtype)


def moe_linear_loop(x, w13_p, s13, w2_p, s2, weights, ids, inter):
    """The same MoE from our W8A8 linear op, one call per expert and projection."""
    out = torch.zeros(x.shape[0], s2.shape[1], dtype=torch.float32)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate_up = w8a8_cpu.int8_scaled_mm_with_quant(x[tokens], w13_p[e], s13[e], out_dtype=torch.float32)
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = w8a8_cpu.int8_scaled_mm_with_quant(act, w2_p[e], s2[e])
        out.index_add_(0, tokens, weights[tokens, slots, None] * down)
    return out.to(x.dtype)


def moe_candidates(m: int, experts: int, topk: int, gen: torch.Generator,
                   h: int = MOE_H, inter: int = MOE_I) -> Dict[str, Callable[[], object]]:
    w13 = torch.randn(experts, 2 * inter, h, generator=gen) * 0.02
    w2 = torch.randn(experts, h, inter, generator=gen) * 0.02
    moe = w8a8_cpu.nn.W8A8MoE.from_float(w13, w2, top_k=topk)
    x = torch.randn(m, h, generator=gen).to(torch.bfloat16)
    weights, ids = moe.route(torch.randn(m, experts, generator=gen))
    w13_bf16, w2_bf16 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    # the same int8 experts, packed as one linear weight each
    w13_p = [w8a8_cpu.pack_weight(w) for w in quantize_experts(w13)[0]]
    w2_p = [w8a8_cpu.pack_weight(w) for w in quantize_experts(w2)[0]]
    return {
        MOE_OURS: lambda: w8a8_cpu.fused_experts(x, moe.w13_packed, moe.w2_packed, weights, ids,
                                                 moe.w13_scale, moe.w2_scale),
        MOE_LOOP: lambda: moe_linear_loop(x, w13_p, moe.w13_scale, w2_p, moe.w2_scale, weights, ids, inter),
        MOE_BF16: lambda: moe_float_loop(x, w13_bf16, w2_bf16, weights.to(torch.bfloat16), ids),
        MOE_FP32: lambda: moe_float_loop(x.float(), w13, w2, weights, ids),
    }


def bench_moe_case(m: int, experts: int, topk: int, reps: int, warmup: int, gen: torch.Generator) -> dict:
    ms = medians(interleaved(moe_candidates(m, experts, topk, gen), reps, warmup), unit=1e-3)
    ours = ms[MOE_OURS]
    return {"m": m, "experts": experts, "topk": topk, "H": MOE_H, "I": MOE_I, "ms": ms,
            "speedup": {name: t / ours for name, t in ms.items() if name != MOE_OURS}}


# --------------------------------------------------------------------------------------------------- overhead

def bench_overhead(reps: int, warmup: int, inner: int = 2000) -> dict:
    """Per-call time of a tiny linear (M=1, N=K=64) through the Python API: the fixed cost of a call."""
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(64, 64)
    layer = w8a8_cpu.nn.W8A8Linear.from_linear(linear)
    x = torch.randn(1, 64, generator=gen)
    w_packed, w_scale, bias = layer.weight_packed, layer.w_scale, layer.bias
    fns = {"W8A8Linear(x)": lambda: layer(x),
           "int8_scaled_mm_with_quant": lambda: w8a8_cpu.int8_scaled_mm_with_quant(x, w_packed, w_scale, bias),
           "torch nn.Linear(x) fp32": lambda: linear(x)}
    return medians(interleaved(fns, reps, warmup, inner=inner), unit=1e-6)


# --------------------------------------------------------------------------------------------------- report

def print_linear(case: dict) -> None:
    eff = ""
    if "read_gbs" in case:  # every decode case
        eff = (f", decode efficiency {case['decode_efficiency'] * 100:.0f}% (W4A8 "
               f"{case.get('w4a8_decode_efficiency', float('nan')) * 100:.0f}%), in a stack of "
               f"{case['stack_copies']} layers {case['stack_decode_efficiency'] * 100:.0f}% (W4A8 "
               f"{case['w4a8_stack_decode_efficiency'] * 100:.0f}%) of the same rounds' read limit "
               f"({case['limit_gbs']:.2f} GB/s: {case['limit_source']}; best read {case['read_gbs']:.2f} GB/s, "
               f"{case['read_way']})")
    print(f"{case['phase']} M={case['m']:<4} N={case['n']} K={case['k']} ({case['role']}){eff}")
    for cand, r in case["results"].items():
        ratio = ("" if cand == OURS else "  (per layer)" if cand in STACKS
                 else f"  w8a8_cpu speedup x{case['speedup'][cand]:.2f}")
        print(f"  {cand:<16} {r['ms']:10.3f} ms {r['gops']:9.1f} GOPS {r['weight_gbs']:8.2f} GB/s weights  "
              f"error {r['rel_error']:.1e}{ratio}")


def plot(result: dict, path: str) -> None:
    """Speedup bars (baseline time / w8a8_cpu time) per linear case and baseline, and per MoE case."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'w8a8-cpu[bench]' (or pip install matplotlib)")
    cases, moe = result["linear"], result.get("moe") or []
    panels = [p for p in (cases, moe) if p]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.8 * max(len(cases), len(moe), 1) + 3),
                                                      4.5 * len(panels)), squeeze=False)
    for ax, rows in zip(axes[:, 0], panels):
        is_moe = rows is moe
        names = [MOE_LOOP, MOE_BF16, MOE_FP32] if is_moe else [b for b in BASELINES
                                                               if any(b in c["speedup"] for c in rows)]
        labels = ([f"M={c['m']} E={c['experts']} k={c['topk']}" for c in rows] if is_moe else
                  [f"{c['shape']}\nM={c['m']}" for c in rows])
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(rows))]
            ax.bar(xs, [c["speedup"].get(name, 0.0) for c in rows], width, label=f"vs {name}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("w8a8_cpu speedup (x, log)")
        ax.set_title(("fused MoE " if is_moe else "W8A8 linear ") + f"({result['info']['selected_variant']}, "
                     f"{result['threads']} threads; > 1: w8a8_cpu faster)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------- driver

def _parse_shapes(spec: Optional[Sequence[str]]) -> List[str]:
    if not spec:
        return list(DEFAULT_SHAPES)
    names = []
    by_role = {"o_proj": "4096x4096", "gate_proj": "14336x4096", "up_proj": "14336x4096",
               "down_proj": "4096x14336", "qkv_proj": "6144x4096"}
    for item in ",".join(spec).split(","):
        item = item.strip().lower()
        if not item:
            continue
        if item in SHAPES:
            names.append(item)
        elif item == "smollm2":
            names.extend(SMALL_SHAPES)
        elif item in by_role:
            names.append(by_role[item])
        else:
            raise ValueError(f"unknown shape {item!r}: choose from {', '.join(SHAPES)} "
                             f"(or {', '.join(sorted(by_role))}, or smollm2 for all of SmolLM2's)")
    return list(dict.fromkeys(names))


def _parse_ms(spec: Optional[Sequence[str]]) -> Optional[List[int]]:
    if not spec:
        return None
    ms = [int(v) for v in ",".join(spec).split(",") if v.strip()]
    if any(m <= 0 for m in ms):
        raise ValueError("--m values must be positive")
    return ms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke: 4096x4096 at M=1,16, MoE E=8 at M=1,16, 3 repetitions (numbers are rough)")
    parser.add_argument("--threads", type=positive_int, nargs="+", default=None, metavar="N",
                        help="torch threads (default: torch's choice); several values run the suite once per count")
    parser.add_argument("--busy", action="store_true",
                        help="run with a competing process spinning on one CPU (a busy serving host)")
    parser.add_argument("--shapes", nargs="+", metavar="NxK",
                        help=f"linear shapes to run, comma- or space-separated: {', '.join(SHAPES)}, a role "
                        "(o_proj, gate_proj, up_proj, down_proj, qkv_proj) or smollm2 (its five shapes); default "
                        f"{', '.join(DEFAULT_SHAPES)}")
    parser.add_argument("--m", nargs="+", metavar="M",
                        help=f"token counts to run (linear: any; MoE: of 1, 16, 128); default "
                        f"{', '.join(map(str, ALL_M))}")
    parser.add_argument("--reps", type=positive_int, default=None, help="timed interleaved repetitions (default 10, quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per candidate first (default 2, --quick 1)")
    parser.add_argument("--w4a8-group-size", type=int, choices=W4A8_GROUPS, default=W4A8_GROUPS[0],
                        help="the W4A8 candidate's group along K (default 32: 0.5625 weight bytes per weight of W8A8's "
                        "1 with its fp16-stored scales; 128: 0.52)")
    parser.add_argument("--no-moe", action="store_true", help="skip the fused MoE cases")
    parser.add_argument("--no-linear", action="store_true", help="skip the linear cases")
    parser.add_argument("--json", metavar="FILE", type=output_file, help="write every number of the run as JSON to FILE")
    parser.add_argument("--plot", metavar="FILE.png", type=output_file, help="speedup bar chart (needs matplotlib: the bench extra)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def start_busy_process() -> "tuple[subprocess.Popen, int]":
    """A second Python spinning on the last CPU this process may use: the load of another job on a serving host."""
    cpu = max(os.sched_getaffinity(0))
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(cpu)]), cpu


def run(args, on_result: Optional[Callable[[dict], None]] = None) -> int:
    """The suite, once per --threads value. on_result(result) runs after each run's report is printed and before the
    JSON is written (benchmarks/linear.py adds the project's targets there)."""
    counts = args.threads or [None]
    try:
        plan = _plan(args)
    except ValueError as e:  # before the busy process and the long run
        print(f"bench: {e}", file=sys.stderr)
        return 2
    busy = None
    if args.busy:
        busy, cpu = start_busy_process()
        print(f"busy: a competing process spins on CPU {cpu} for the whole run")
    try:
        results = []
        for threads in counts:
            if threads:
                torch.set_num_threads(threads)
            result = run_once(args, plan)
            result["busy_cpu"] = cpu if busy else None
            if on_result:
                on_result(result)
            results.append(result)
    finally:
        if busy:
            busy.kill()
            busy.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0] if len(results) == 1 else {"sweep": results}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(results[-1], args.plot)
        print(f"wrote {args.plot}")
    return 0


@dataclass
class Plan:
    """What a run measures, from the options (checked once, before any run of a --threads sweep)."""
    linear_shapes: List[str]  # each measured at every M of ms
    ms: List[int]
    moe_cases: list
    reps: int
    warmup: int


def _plan(args) -> Plan:
    """The run's cases and repetitions; ValueError on a bad option (--plot without matplotlib included: it fails
    before the long run, not after it)."""
    shapes = QUICK_SHAPES if args.quick and not args.shapes else _parse_shapes(args.shapes)
    m_filter = _parse_ms(args.m)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'w8a8-cpu[bench]' (or pip install matplotlib)")
    reps = args.reps if args.reps is not None else (3 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if warmup < 0:
        raise ValueError("--warmup must be non-negative")
    ms = m_filter or list(QUICK_M if args.quick else ALL_M)
    moe_cases = [] if args.no_moe else [c for c in (QUICK_MOE if args.quick else MOE_CASES)
                                        if m_filter is None or c[0] in m_filter]
    return Plan([] if args.no_linear else list(dict.fromkeys(shapes)), ms, moe_cases, reps, warmup)


def run_once(args, plan: Plan) -> dict:
    reps, warmup = plan.reps, plan.warmup

    info = w8a8_cpu.info()
    threads = torch.get_num_threads()
    engine = _ao_engine()
    torch.backends.quantized.engine = engine
    print(f"w8a8-cpu {w8a8_cpu.__version__} bench: variant {info['selected_variant']} ({info['arch']}), "
          f"torch {torch.__version__}, {threads} threads, torch.ao engine {engine}")
    print(f"  median of {reps} interleaved repetitions after {warmup} warm-up call(s) per candidate; "
          f"speedup = baseline time / w8a8_cpu time; W4A8: symmetric int4 in groups of {args.w4a8_group_size}")
    progress = Progress(len(plan.linear_shapes) * len(plan.ms) + len(plan.moe_cases) + 3,
                        enabled=not args.no_progress)
    reads = ReadRing((64 if args.quick else 256) << 20)
    bw_samples = [reads.bandwidth(3 if args.quick else 5)]
    progress.step("read bandwidth")
    gen = torch.Generator().manual_seed(0)
    errors: Dict[str, str] = {}
    result = {"version": w8a8_cpu.__version__, "info": info, "threads": threads, "torch_ao_engine": engine,
              "reps": reps, "warmup": warmup, "quick": bool(args.quick), "w4a8_group_size": args.w4a8_group_size,
              "linear": [], "moe": [],
              "read_bandwidth_method": f"best read ({', '.join(READ_WAYS)}) of {reads.describe()}"}
    linear_out: List[tuple] = []
    has_decode = any(phase_of(m) == "decode" for m in plan.ms)
    stack_mib = (QUICK_STACK_MIB if args.quick else STACK_MIB) if has_decode else 0  # no decode case, no stack
    for shape in plan.linear_shapes:
        n, k = SHAPES[shape]
        make, weight_bytes, copies = linear_candidates(n, k, gen, errors, stack_mib, args.w4a8_group_size)
        for m in plan.ms:
            progress.step(f"linear {shape} M={m}")
            candidates, rel_errors = make(m)
            if phase_of(m) == "decode":
                candidates.update({cand: reads.reader(way) for cand, way in zip(READS, READ_WAYS)})
            linear_out.append((shape, n, k, m, interleaved(candidates, reps, warmup), weight_bytes, rel_errors,
                               copies))
        del make
    if plan.linear_shapes:
        bw_samples.append(reads.bandwidth(3 if args.quick else 5))
    progress.step("overhead (M=1 N=K=64)")
    result["overhead_us"] = bench_overhead(reps, warmup, inner=200 if args.quick else 2000)
    for m, e, k in plan.moe_cases:
        progress.step(f"MoE M={m} E={e} topk={k}")
        result["moe"].append(bench_moe_case(m, e, k, reps, warmup, gen))
    progress.step("done")
    progress.clear()

    bw = max(bw_samples)
    result["read_bandwidth_gbs"] = bw
    result["read_bandwidth_samples_gbs"] = bw_samples
    result["linear"] = [summarize_linear(s, n, k, m, smp, wb, bw, reads.window_bytes, err, copies)
                        for s, n, k, m, smp, wb, err, copies in linear_out]
    result["unavailable"] = errors
    print(f"read limit: {bw:.2f} GB/s ({result['read_bandwidth_method']}; samples "
          f"{', '.join(f'{b:.2f}' for b in bw_samples)})")
    for cand, err in errors.items():
        print(f"  ({cand} unavailable: {err})")
    for case in result["linear"]:
        print_linear(case)
    ov = result["overhead_us"]
    print("per-call overhead, M=1 N=K=64 (median per call): " + " | ".join(f"{k} {v:.2f} us" for k, v in ov.items()))
    for c in result["moe"]:
        ours = c["ms"][MOE_OURS]
        print(f"MoE M={c['m']:<4} E={c['experts']:<3} topk={c['topk']} H={MOE_H} I={MOE_I} bf16: " + " | ".join(
            f"{name} {t:.2f} ms" + ("" if name == MOE_OURS else f" (x{t / ours:.2f})") for name, t in c["ms"].items()))
    return result


DESCRIPTION = ("Benchmark the W8A8 linear (Llama-3-8B-like shapes, decode M=1/4/16 and prefill M=128/512) against "
               "torch fp32, torch bf16, torch.ao dynamic int8 and torch._weight_int8pack_mm, the per-call overhead, "
               "and the fused MoE against torch loops; all in one run, interleaved, median of --reps (default 10). "
               "Prints time, GOPS, effective weight bandwidth, speedups, the candidates' errors and a streaming-read "
               "bandwidth reference.")

