"""python -m w8a8_cpu bench serve MODEL_DIR ...: vLLM serving compressed-tensors checkpoints with the w8a8_cpu plugin
and with vLLM's own kernels, from a real OpenAI-API client on loopback: output tokens a second, TTFT and TPOT at each
concurrency and thread count, the plugin's ratio to vLLM's own in the same run; optionally (--profile) the share of an
engine step spent in the quantized linear / MoE ops (torch profiler, vLLM in one process), and (--soak) a long run at
the highest concurrency watching for failed requests and the server's resident memory.

Run it with the Python of vLLM's venv (ci/vllm-env.sh makes one): the server is that interpreter's vLLM."""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

from . import serving
from .options import positive_int

DESCRIPTION = __doc__.split("\n\n", 1)[0].split(": ", 1)[1].replace("\n", " ")
MODES = {"all": "w8a8_cpu (W8A8_CPU_VLLM=all)", "1": "w8a8_cpu (default)", "0": "vLLM's own"}
# Ops of the quantized linear and MoE layers, ours and vLLM 0.32's CPU ones (the float lm_head's onednn_mm is not one)
LINEAR_OPS = re.compile(r"^(w8a8_cpu::|_C::(int8_scaled_mm|onednn_scaled|int4_scaled_mm|cpu_gemm_wna16|"
                        r"fused_experts|convert_weight))")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", metavar="MODEL_DIR", help="compressed-tensors checkpoint directories")
    parser.add_argument("--concurrency", nargs="+", type=positive_int, default=[1, 8, 32],
                        help="requests in flight (default 1 8 32)")
    parser.add_argument("--threads", nargs="+", type=positive_int, default=[1, 2],
                        help="vLLM's OpenMP threads, bound to cores 0.. (default 1 2)")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["all", "0"],
                        help="W8A8_CPU_VLLM values to compare (default: all 0)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128, help="tokens a prompt (default 128)")
    parser.add_argument("--output-tokens", type=positive_int, default=128,
                        help="tokens generated a request, end of sequence ignored (default 128)")
    parser.add_argument("--requests", type=positive_int, default=2,
                        help="requests a level, times its concurrency (at least 4; default 2)")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="servers a (model, threads, mode), started in turn with the other modes' (order reversed "
                             "every other round): each level's numbers are the median over rounds, the plugin's "
                             "ratio the median of the rounds' ratios, their range beside it (default 1)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="vLLM's model dtype (default bfloat16, vLLM's on CPU)")
    parser.add_argument("--hide-amx", action="store_true",
                        help="vLLM's kernels as on a CPU without AMX (oneDNN AVX-512 VNNI) where this one has AMX")
    parser.add_argument("--profile", action="store_true",
                        help="also the linear/MoE ops' share of the engine's time (torch profiler, one process)")
    parser.add_argument("--soak", type=positive_int, default=0, metavar="SECONDS",
                        help="then serve the first model with the plugin at the highest concurrency for SECONDS")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")


def _prompts(count: int, tokens: int, seed: int = 0) -> List[List[int]]:
    """Fixed pseudo-random token ids (ids 1000..39999: ordinary tokens of SmolLM2's and similar vocabularies)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(tokens)] for _ in range(count)]


def _median(values: List[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.median(finite) if finite else float("nan")


def _no_amx(args, work: Path):
    return work / "no-amx" if args.hide_amx else None


def _rounds(modes: List[str], rounds: int) -> List[Tuple[int, str]]:
    """(round, mode) in the order their servers run: every mode each round, the order reversed every other round
    (a drift of the machine's speed over the run then favours no mode)."""
    return [(r, mode) for r in range(rounds) for mode in (modes if r % 2 == 0 else modes[::-1])]


def serve_matrix(args, work: Path) -> List[dict]:
    rows = []
    for model in args.models:
        for threads in args.threads:
            for round_, mode in _rounds(args.modes, args.rounds):
                with serving.vllm_server(model, work / "server.log", threads, mode, cache_root=work / "vllm-cache",
                                         hide_amx_in=_no_amx(args, work), max_num_seqs=max(args.concurrency),
                                         extra_args=["--dtype", args.dtype]) as server:
                    serving.run_load(server, _prompts(2, args.prompt_tokens, seed=99), 8, 2)  # warm up
                    for concurrency in args.concurrency:
                        requests = max(4, args.requests * concurrency)
                        load = serving.run_load(server, _prompts(requests, args.prompt_tokens), args.output_tokens,
                                                concurrency)
                        rows.append({"model": Path(model).name, "threads": threads, "mode": mode, "round": round_,
                                     "concurrency": concurrency, "requests": requests, "failed": load.failed,
                                     "output_tok_s": load.output_tok_s, "ttft_s": _median(load.ttft_s),
                                     "tpot_s": _median(load.tpot_s)})
                        print(_row_line(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _row_line(r: dict) -> str:
    return (f"  {r['model']}, {r['threads']} thread(s), {MODES[r['mode']]}, concurrency {r['concurrency']}: "
            f"{r['output_tok_s']:.1f} tok/s, TTFT {r['ttft_s'] * 1e3:.0f} ms, TPOT {r['tpot_s'] * 1e3:.1f} ms"
            + (f", {r['failed']} failed" if r["failed"] else ""))


PROFILE_CHILD = """
import json, os, random, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from vllm import LLM, SamplingParams
model, dtype, concurrency, prompt_tokens, output_tokens, pattern = sys.argv[1:7]
import re
linear = re.compile(pattern)
llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=int(concurrency))
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(int(prompt_tokens))]}
           for _ in range(int(concurrency))]
params = SamplingParams(max_tokens=int(output_tokens), temperature=0.0, ignore_eos=True)
llm.generate(prompts, params, use_tqdm=False)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
events = prof.key_averages()
ops = {e.key: e.self_cpu_time_total / 1e3 for e in events if linear.match(e.key)}
print(json.dumps({"wall_ms": wall * 1e3, "linear_ms": sum(ops.values()), "linear_ops": ops}))
"""


def profile_matrix(args, work: Path) -> List[dict]:
    """The quantized ops' self time during one generate() of `concurrency` prompts (after a warm-up one), vLLM in
    this interpreter with no engine process (the profiler sees the engine's ops)."""
    rows = []
    for model in args.models:
        for threads in args.threads:
            for mode in args.modes:
                for concurrency in (min(args.concurrency), max(args.concurrency)):
                    child = subprocess.run(
                        [sys.executable, "-c", PROFILE_CHILD, model, args.dtype, str(concurrency),
                         str(args.prompt_tokens), str(args.output_tokens), LINEAR_OPS.pattern],
                        capture_output=True, text=True, timeout=1800,
                        env=serving.server_env(threads, mode, work / "vllm-cache", hide_amx_in=_no_amx(args, work)))
                    if child.returncode != 0:
                        raise RuntimeError(f"profile of {model} ({mode}, {threads} threads) failed:\n"
                                           f"{child.stderr[-3000:]}")
                    result = json.loads(child.stdout.strip().splitlines()[-1])
                    rows.append({"model": Path(model).name, "threads": threads, "mode": mode, "round": 0,
                                 "concurrency": concurrency, **result})
                    print(f"  profile {rows[-1]['model']}, {threads} thread(s), {MODES[mode]}, concurrency "
                          f"{concurrency}: linear/MoE ops {result['linear_ms']:.0f} of {result['wall_ms']:.0f} ms",
                          file=sys.stderr, flush=True)
    return rows


def soak(args, work: Path) -> dict:
    """The first model with the plugin (the first mode but "0") at the highest concurrency for args.soak seconds:
    requests sent back to back, failures counted, the server's resident memory (all its processes) each minute."""
    mode = next(m for m in args.modes if m != "0")
    concurrency = max(args.concurrency)
    samples, served, failed = [], 0, 0
    with serving.vllm_server(args.models[0], work / "soak.log", max(args.threads), mode, cache_root=work / "vllm-cache",
                             hide_amx_in=_no_amx(args, work), max_num_seqs=concurrency,
                             extra_args=["--dtype", args.dtype]) as server:
        start = time.monotonic()
        batch = 0
        while time.monotonic() - start < args.soak:
            load = serving.run_load(server, _prompts(concurrency * 2, args.prompt_tokens, seed=batch),
                                    args.output_tokens, concurrency)
            served, failed, batch = served + load.requests - load.failed, failed + load.failed, batch + 1
            samples.append({"s": round(time.monotonic() - start), "rss_mib": serving.resident_bytes(
                server.process.pid) / 2 ** 20, "tok_s": load.output_tok_s})
            print(f"  soak {samples[-1]['s']} s: {served} served, {failed} failed, resident "
                  f"{samples[-1]['rss_mib']:.0f} MiB, {load.output_tok_s:.0f} tok/s", file=sys.stderr, flush=True)
    return {"model": Path(args.models[0]).name, "mode": mode, "concurrency": concurrency, "seconds": args.soak,
            "served": served, "failed": failed, "samples": samples}


def combine_rounds(items: List[dict], value: str, fields: List[str]) -> List[dict]:
    """One item per model, threads, concurrency and mode (first-seen order): the median over its rounds of `fields`,
    failures summed, and (modes but vLLM's own) `ratios`: value over vLLM's own in the same round, sorted (a round
    where vLLM's own value is 0, every request failed, gives none)."""
    cells: Dict[tuple, List[dict]] = {}
    for i in items:
        cells.setdefault((i["model"], i["threads"], i["concurrency"], i["mode"]), []).append(i)
    combined = []
    for (model, threads, concurrency, mode), runs in cells.items():
        own = {o["round"]: o[value] for o in cells.get((model, threads, concurrency, "0"), [])}
        ratios = sorted(r[value] / own[r["round"]] for r in runs
                        if mode != "0" and own.get(r["round"], 0) > 0)  # none where vLLM's own served nothing
        combined.append({"model": model, "threads": threads, "concurrency": concurrency, "mode": mode,
                         "rounds": len(runs), "failed": sum(r.get("failed", 0) for r in runs), "ratios": ratios,
                         **{f: _median([r[f] for r in runs]) for f in fields}})
    return combined


def _table(columns: List[str], items: List[dict], cells) -> List[str]:
    """A markdown table of combine_rounds' items: per item its model, threads, concurrency and mode, cells(item), and
    the plugin's ratio to vLLM's own (the median of the rounds', their range when there are several)."""
    def ratio(item):
        r = item["ratios"]
        if not r:
            return ""
        spread = f" ({r[0]:.2f}-{r[-1]:.2f})" if len(r) > 1 else ""
        return f"{_median(r):.2f}x{spread}"

    lines = ["| model | threads | concurrency | mode | " + " | ".join(columns) + " | plugin / own |",
             "|---|---:|---:|---|" + "---:|" * len(columns) + "---:|"]
    for i in items:
        lines.append(f"| {i['model']} | {i['threads']} | {i['concurrency']} | {MODES[i['mode']]} | "
                     + " | ".join(cells(i)) + f" | {ratio(i)} |")
    return lines


def format_tables(rows: List[dict], profiles: List[dict], soaked: dict) -> str:
    served = combine_rounds(rows, "output_tok_s", ["output_tok_s", "ttft_s", "tpot_s"])
    lines = _table(["output tok/s", "TTFT ms", "TPOT ms", "failed"], served,
                   lambda r: [f"{r['output_tok_s']:.1f}", f"{r['ttft_s'] * 1e3:.0f}", f"{r['tpot_s'] * 1e3:.1f}",
                              str(r["failed"])])
    if max((r["rounds"] for r in served), default=1) > 1:
        lines += ["", f"medians of {served[0]['rounds']} rounds (servers started in turn); plugin / own: the median "
                      "of the rounds' ratios (their range)"]
    if profiles:
        lines += [""] + _table(["linear/MoE ops ms", "engine ms", "share"],
                               combine_rounds(profiles, "linear_ms", ["linear_ms", "wall_ms"]),
                               lambda p: [f"{p['linear_ms']:.0f}", f"{p['wall_ms']:.0f}",
                                          f"{p['linear_ms'] / p['wall_ms']:.0%}"])
    if soaked:
        rss = [s["rss_mib"] for s in soaked["samples"]]
        lines += ["", f"soak: {soaked['model']}, {MODES[soaked['mode']]}, concurrency {soaked['concurrency']}, "
                      f"{soaked['seconds']} s: {soaked['served']} requests served, {soaked['failed']} failed; resident "
                      f"memory {rss[0]:.0f} MiB after the first batch, {max(rss):.0f} max, {rss[-1]:.0f} at the end"]
    return "\n".join(lines)


def run(args, parser) -> int:
    for model in args.models:
        if not (Path(model) / "config.json").is_file():
            parser.error(f"{model}: not a checkpoint directory (no config.json)")
    try:
        import vllm  # noqa: F401  (the server runs this interpreter's vLLM)
    except ImportError:
        parser.error(f"vLLM does not import in {sys.executable}: run bench serve with the Python of vLLM's venv "
                     f"(bash ci/vllm-env.sh VENV makes one)")
    with tempfile.TemporaryDirectory(prefix="w8a8_cpu-bench-serve-") as work:
        work = Path(work)
        rows = serve_matrix(args, work)
        profiles = profile_matrix(args, work) if args.profile else []
        soaked = soak(args, work) if args.soak else {}
    print(format_tables(rows, profiles, soaked))
    if args.json:
        args.json.write_text(json.dumps({"serve": rows, "profile": profiles, "soak": soaked, "vllm": vllm.__version__,
                                         "amx_hidden": args.hide_amx, "dtype": args.dtype}, indent=1))
    return 1 if any(r["failed"] for r in rows) or soaked.get("failed") else 0
