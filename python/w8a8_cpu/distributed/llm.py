"""The LLM main job (python -m w8a8_cpu llm) with its W8A8 models tensor-parallel across ranks:

    torchrun --nproc-per-node 2 -m w8a8_cpu.distributed.llm [--eval-tokens N ...] [--attention auto|shard|replicate]

Every rank runs the whole job in lockstep (the fp32 and torch.ao models replicated, the W8A8 ones sharded by
w8a8_cpu.distributed.shard_model); rank 0 prints the single-process report, then per-rank timing of the W8A8
(SmoothQuant) model: decode and prefill with the exact int32 all-reduce and with the usual fp32 all-reduce, and the
share of each spent in collectives. Started without torchrun it runs as a world of one (no sharding): the baseline."""
from __future__ import annotations

import os
import socket
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import ExpertParallelW8A8Experts, RowParallelW8A8Linear, shard_model
from .process_group import DEFAULT_TIMEOUT_S, STATS, _collective, finish, init


def _parser():
    from w8a8_cpu.cli import _parsers

    parser = _parsers()[1]["llm"]
    parser.prog = "torchrun --nproc-per-node N -m w8a8_cpu.distributed.llm"
    parser.description = __doc__
    parser.add_argument("--attention", choices=("auto", "shard", "replicate"), default="auto",
                        help="split attention heads across ranks (auto: when the world size divides the heads and "
                             "KV heads, else replicate attention; default auto)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"process-group timeout in seconds: a lost rank fails the others after it "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    return parser


def _set_exact(model: torch.nn.Module, exact: bool) -> None:
    for module in model.modules():
        if isinstance(module, (RowParallelW8A8Linear, ExpertParallelW8A8Experts)):
            module.exact = exact


def time_model(model: torch.nn.Module, prompt_ids: torch.Tensor, prefill_ids: torch.Tensor, new_tokens: int) -> dict:
    """Decode rate and prefill time of `model`, each with the seconds its collectives took (STATS)."""
    from w8a8_cpu.cli.llm import prefill_seconds
    from w8a8_cpu.llm import evaluate

    STATS.reset()
    decode = evaluate.greedy(model, prompt_ids, new_tokens)
    decode_s = new_tokens / decode["tokens_per_s"]
    decode_comm = STATS.seconds
    rounds = 3
    STATS.reset()
    prefill_s = prefill_seconds({"model": model}, prefill_ids, rounds)["model"]
    return {"decode_tokens_per_s": decode["tokens_per_s"], "decode_allreduce_share": decode_comm / decode_s,
            "prefill_s": prefill_s, "prefill_allreduce_share": STATS.seconds / rounds / prefill_s,
            "prefill_allreduce_mib": STATS.bytes / rounds / 2 ** 20}


def print_rank_timing(timings: List[Dict[str, dict]], new_tokens: int, prefill_tokens: int) -> None:
    print(f"  per-rank timing, W8A8 (SmoothQuant): decode {new_tokens} tokens, prefill {prefill_tokens} tokens "
          f"(median of 3); all-reduce: share of that time spent in collectives")
    print(f"  {'rank':>4} {'threads':>7} {'all-reduce':<11} {'decode':>11} {'all-reduce':>10} {'prefill':>9} "
          f"{'all-reduce':>10} {'payload':>10}")
    for rank, timing in enumerate(timings):
        for scheme, t in timing["schemes"].items():
            print(f"  {rank:>4} {timing['threads']:>7} {scheme:<11} {t['decode_tokens_per_s']:6.1f} tok/s "
                  f"{100 * t['decode_allreduce_share']:9.1f}% {t['prefill_s']:7.3f} s "
                  f"{100 * t['prefill_allreduce_share']:9.1f}% {t['prefill_allreduce_mib']:6.1f} MiB")


def _standalone_world() -> None:
    """Started without torchrun: a world of one on loopback."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main(argv: Optional[List[str]] = None) -> int:
    from w8a8_cpu.cli import _llm_failure, _llm_ready, _report
    from w8a8_cpu.cli import llm as job

    parser = _parser()
    args = parser.parse_args(argv)
    if args.compile_decode:
        parser.error("--compile-decode runs single-process only (python -m w8a8_cpu llm --compile-decode)")
    if not _llm_ready(args, parser, parser.prog):
        return 2
    _standalone_world()
    init(timeout_s=args.timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    sharded: Dict[str, torch.nn.Module] = {}
    notes: List[str] = []

    def shard(name: str, model: torch.nn.Module) -> None:
        if world_size > 1:
            notes.extend(f"{name}: {note}" for note in shard_model(model, attention=args.attention).notes)
        sharded[name] = model

    inputs: Dict[str, torch.Tensor] = {}
    result = job.run(eval_tokens=args.eval_tokens, window=args.window, stride=args.stride,
                     calibration_tokens=args.calibration_tokens, new_tokens=args.new_tokens, bench=not args.no_bench,
                     show_progress=not args.no_progress and rank == 0, prepare_w8a8=shard,
                     on_inputs=lambda prompt, prefill: inputs.update(prompt=prompt, prefill=prefill))
    model = sharded[job.SQ]
    schemes = {}
    for scheme, exact in (("exact int32", True), ("fp32", False)) if world_size > 1 else (("none", True),):
        _set_exact(model, exact)
        schemes[scheme] = time_model(model, inputs["prompt"], inputs["prefill"], args.new_tokens)
    _set_exact(model, True)
    timing = {"threads": torch.get_num_threads(), "run_seconds": time.perf_counter() - t0, "schemes": schemes}
    timings: List[Optional[dict]] = [None] * world_size
    _collective("timing exchange", lambda: dist.all_gather_object(timings, timing))
    finish()
    if rank != 0:
        return 0
    result.update(world_size=world_size, shard_notes=notes, rank_timing=timings)
    print(f"tensor parallel: {world_size} rank(s) x {timing['threads']} thread(s); W8A8 models sharded "
          f"(attention {args.attention}), fp32 and torch.ao replicated")
    for note in notes:
        print(f"  note: {note}")
    return _report(result, lambda r: (job.print_report(r), print_rank_timing(timings, args.new_tokens,
                                                                             r["prefill_tokens"])),
                   args.json, _llm_failure)


if __name__ == "__main__":
    sys.exit(main())
