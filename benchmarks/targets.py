"""The project's performance targets as PASS/FAIL lines, from the numbers of one `python -m w8a8_cpu bench` run
(reported, never asserted; `n/a` when the run lacks the case, e.g. with --quick or filters).

    python benchmarks/targets.py bench.json    # the JSON of `python -m w8a8_cpu bench --json bench.json` (a
                                               # --threads sweep: the targets of each run)

benchmarks/linear.py runs the suite and prints them after each run (and writes them into its JSON as "targets").
"""
from __future__ import annotations

import json
import sys
from typing import List, Optional

from w8a8_cpu.cli.bench import AO, FP32, MOE_BF16, MOE_LOOP, ORT_RR, OURS, STACK, W4A8, W4A8_STACK

INT8_PEERS = (AO, ORT_RR)  # the exact-enough int8 peers the speed targets compare with (ORT without reduce_range
#                            saturates on CPUs without VNNI: its error column shows it)


def _find(cases: List[dict], shape: str, m: int) -> Optional[dict]:
    return next((c for c in cases if c["shape"] == shape and c["m"] == m), None)


def evaluate_targets(result: dict) -> List[dict]:
    """The issue's performance targets, each from this run's numbers; value None when the run lacks the case."""
    cases = result["linear"]
    targets: List[dict] = []

    def add(name: str, value: Optional[float], goal: float, higher_is_better: bool, unit: str = "x") -> None:
        ok = None if value is None else (value >= goal if higher_is_better else value <= goal)
        targets.append({"name": name, "value": value, "goal": goal, "op": ">=" if higher_is_better else "<=",
                        "unit": unit, "pass": ok})

    def time_ratio(case: Optional[dict], baseline: str) -> Optional[float]:  # w8a8 time / baseline time
        if case is None or baseline not in case["results"]:
            return None
        return case["results"][OURS]["ms"] / case["results"][baseline]["ms"]

    for case in cases:  # every case: the faster of the int8 peers (issue: AVX2 speed vs ONNX Runtime and fbgemm)
        peers = [case["results"][p]["ms"] for p in INT8_PEERS if p in case["results"]]
        if peers:
            add(f"{case['phase']} M={case['m']} {case['shape']}: time / faster of {' and '.join(INT8_PEERS)}",
                case["results"][OURS]["ms"] / min(peers), 1.0, False)
    c = _find(cases, "14336x4096", 1)
    add("decode M=1 14336x4096: weight bandwidth / streaming-read bandwidth",
        None if c is None else c["decode_efficiency"], 0.90, True)
    for case in cases:  # issue #20: every M <= 4 shape at the read-bandwidth limit, as a model's decode reads them
        if case["m"] <= 4 and "stack_decode_efficiency" in case:
            add(f"decode M={case['m']} {case['shape']}: weight bandwidth in a layer stack / streaming-read bandwidth",
                case["stack_decode_efficiency"], 0.90, True)
    add("decode M=1 14336x4096: time / torch.ao", time_ratio(c, AO), 1.0, False)
    add("decode M=1 4096x4096: time / torch.ao", time_ratio(_find(cases, "4096x4096", 1), AO), 1.0, False)
    add("decode M=16 4096x4096: time / torch.ao", time_ratio(_find(cases, "4096x4096", 16), AO), 0.8, False)
    c = _find(cases, "4096x4096", 512)
    r = time_ratio(c, AO)
    add("prefill M=512 4096x4096: throughput / torch.ao", None if r is None else 1.0 / r, 1.25, True)
    r = time_ratio(c, FP32)
    add("prefill M=512 4096x4096: throughput / torch fp32", None if r is None else 1.0 / r, 2.0, True)
    ov = result.get("overhead_us")
    add("per-call overhead M=1 N=K=64 (W8A8Linear, Python API)", None if not ov else ov["W8A8Linear(x)"], 15.0,
        False, unit="us")
    def w4a8_time(case: Optional[dict]) -> Optional[float]:  # W4A8 time / W8A8 time
        r = time_ratio(case, W4A8)
        return None if r is None else 1.0 / r

    w4a8 = f"W4A8 g{result.get('w4a8_group_size', 32)}"  # bench --w4a8-group-size (32 before the option)
    for shape in ("14336x4096", "4096x4096"):  # W4A8 (issue #21): half the bytes, read at the bandwidth limit
        c = _find(cases, shape, 1)
        add(f"decode M=1 {shape}: {w4a8} time / W8A8 time", w4a8_time(c), 0.6, False)
        add(f"decode M=1 {shape}: {w4a8} bytes read / streaming-read bandwidth",
            None if c is None else c.get("w4a8_decode_efficiency"), 0.85, True)
        stacked = c is not None and STACK in c["results"]
        add(f"decode M=1 {shape}: {w4a8} time / W8A8 time, in a layer stack",
            c["results"][W4A8_STACK]["ms"] / c["results"][STACK]["ms"] if stacked else None, 0.6, False)
        add(f"decode M=1 {shape}: {w4a8} bytes read in a layer stack / streaming-read bandwidth",
            c["w4a8_stack_decode_efficiency"] if stacked else None, 0.85, True)
    add(f"prefill M=512 4096x4096: {w4a8} time / W8A8 time", w4a8_time(_find(cases, "4096x4096", 512)), 1.15, False)
    moe = result.get("moe") or []
    for m in (1, 16, 128):
        rows = [c for c in moe if c["m"] == m]
        add(f"fused MoE M={m}: speedup vs torch bf16 loop (worst E/topk)",
            min((c["speedup"][MOE_BF16] for c in rows), default=None), 3.0, True)
        add(f"fused MoE M={m}: speedup vs loop of w8a8_cpu linear (worst E/topk)",
            min((c["speedup"][MOE_LOOP] for c in rows), default=None), 1.5, True)
    return targets


def print_targets(targets: List[dict]) -> None:
    print("targets (from this run; not asserted):")
    for t in targets:
        status = "n/a " if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        if t["value"] is None:
            value = "not measured in this run"
        elif t["unit"] == "us":
            value = f"{t['value']:.2f} us (goal {t['op']} {t['goal']:g} us)"
        else:
            value = f"{t['value']:.2f}x (goal {t['op']} {t['goal']:g}x)"
        print(f"  {status}  {t['name']:<66} {value}")


def add_targets(result: dict) -> None:
    """Evaluates and prints one run's targets and stores them in it as result["targets"]."""
    result["targets"] = evaluate_targets(result)
    print_targets(result["targets"])


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        data = json.load(f)
    runs = data.get("sweep", [data])
    for run in runs:
        if len(runs) > 1:
            print(f"{run['threads']} threads:")
        print_targets(evaluate_targets(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
