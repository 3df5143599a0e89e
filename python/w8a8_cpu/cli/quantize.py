"""python -m w8a8_cpu quantize MODEL_DIR OUT_DIR: a W8A8 (or W4A8) checkpoint from a transformers checkpoint directory.

Loads the float model and its tokenizer from MODEL_DIR (offline), tokenizes the calibration text (default: the
bundled one, the Apache License 2.0 text), runs SmoothQuant on its first --calibration-tokens and keeps the next
--held-out-tokens for the report (a given alpha, or `search`: each of SEARCH_ALPHAS on a copy, the one with the
lowest KL to the float model on the held-out tokens), quantizes every Linear (MoE experts included; --skip keeps
layers float; W4A8 rounds with GPTQ on the calibration tokens unless --rounding rtn; --activations static gives the
W8A8 layers static activation scales from the calibration tokens), and writes OUT_DIR:
config.json with the compressed-tensors quantization_config, the weights (sharded with --max-shard-size), the
tokenizer files, generation_config.json, and README.md with what was done and the held-out perplexity before and
after. Every file is readable by other users. vLLM serves the directory as it is; load_quantized reads it back."""
from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..scheme import DYNAMIC, GROUP_SIZE, W8A8_STATIC, W8A8_STATIC_ASYMMETRIC, QuantScheme, WeightScheme
from .options import output_folder_parent, positive_int
from .timing import Progress

DEFAULT_SKIP = ["lm_head", "*.gate", "*shared_expert_gate"]

DESCRIPTION = __doc__.split("\n\n", 1)[1].replace("\n", " ")
CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "llm" / "data" / "calibration.txt"
SEARCH_ALPHAS = (0.4, 0.5, 0.6, 0.7, 0.8)
ACTIVATIONS = {"dynamic": "int8 dynamic per-token activations",
               "static": "int8 static per-tensor activations (calibrated)",
               "static-asymmetric": "int8 static per-tensor activations with zero points (calibrated)"}
ACTIVATION_SCHEMES = {"dynamic": DYNAMIC, "static": W8A8_STATIC.activations,
                      "static-asymmetric": W8A8_STATIC_ASYMMETRIC.activations}
ROUNDINGS = {"gptq": "gptq", "rtn": "nearest"}  # --rounding -> WeightScheme.rounding
# The calibration text is read in prefixes of these many bytes a needed token (English text: ~5), the last one the
# most read; TOKEN_MARGIN more tokens than needed in a prefix keep an end token (EOS) out of the ones used.
PREFIX_BYTES_PER_TOKEN = (8, 32, 64)
MAX_BYTES_PER_TOKEN = PREFIX_BYTES_PER_TOKEN[-1]
TOKEN_MARGIN = 8
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)B?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1.5G', '1000000' -> bytes (powers of 1000, as transformers' max_shard_size)."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GB or 500MB, got {text!r}")
    value = float(match.group(1)) * 1000 ** "KMGT".find(match.group(2).upper()) if match.group(2) else \
        float(match.group(1))
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return int(value)


def smoothquant_option(text: str):
    if text in ("search", "none"):
        return text
    try:
        alpha = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an alpha in [0, 1], 'search' or 'none', got {text!r}") from None
    if not 0.0 <= alpha <= 1.0:
        raise argparse.ArgumentTypeError(f"expected an alpha in [0, 1], got {alpha}")
    return alpha


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="transformers checkpoint directory (float weights)")
    parser.add_argument("out_dir", metavar="OUT_DIR", type=output_folder_parent,
                        help="where to write the quantized checkpoint (created; its weight files are replaced)")
    parser.add_argument("--scheme", choices=("w8a8", "w4a8"), default="w8a8",
                        help="w8a8 (default) or w4a8: int4 weights per --group-size, symmetric (the form "
                             "compressed-tensors stores)")
    parser.add_argument("--group-size", type=int, default=None, help="W4A8 group size along K (default 32; 0: per "
                        "channel)")
    parser.add_argument("--activations", choices=ACTIVATIONS, default="dynamic",
                        help="int8 activations: dynamic per token (default), or static per tensor from the "
                             "calibration tokens, symmetric or with a zero point (W8A8 only)")
    parser.add_argument("--rounding", choices=("gptq", "rtn"), default=None,
                        help="W4A8 weight rounding: gptq (default: minimizes each layer's output error on the "
                             "calibration tokens) or rtn (round to nearest)")
    parser.add_argument("--smoothquant", type=smoothquant_option, default="search", metavar="ALPHA|search|none",
                        help=f"SmoothQuant migration strength, 'search' (default: each of {SEARCH_ALPHAS}, the "
                             f"lowest KL to the float model on the held-out tokens) or 'none'")
    parser.add_argument("--calibration", type=Path, default=CALIBRATION_TEXT, metavar="FILE",
                        help="calibration text (default: the bundled Apache License 2.0 text)")
    parser.add_argument("--calibration-tokens", type=positive_int, default=1024,
                        help="calibration tokens (default 1024)")
    parser.add_argument("--held-out-tokens", type=positive_int, default=512,
                        help="tokens after the calibration tokens kept for the report and the alpha search "
                             "(default 512)")
    parser.add_argument("--skip", nargs="+", default=DEFAULT_SKIP, metavar="PATTERN",
                        help=f"module-name globs kept float (default: {' '.join(DEFAULT_SKIP)}: the output layer and "
                             f"MoE routers, as W8A8 checkpoints keep them; servers build the routers float)")
    parser.add_argument("--max-shard-size", type=parse_size, default=None, metavar="SIZE",
                        help="split the weights into files of at most SIZE (e.g. 2GB)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def check_arguments(args, parser) -> None:
    """Everything checkable before loading the model (parser.error: exit 2)."""
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        parser.error(f"MODEL_DIR {model_dir}: no config.json (expected a transformers checkpoint directory)")
    if not args.calibration.is_file():
        parser.error(f"--calibration {args.calibration}: not a file")
    if args.group_size is not None and args.scheme != "w4a8":
        parser.error(f"--group-size {args.group_size}: applies to --scheme w4a8 (int8 weights have one scale per "
                     f"channel)")
    if args.rounding is not None and args.scheme != "w4a8":
        parser.error(f"--rounding {args.rounding}: applies to --scheme w4a8 (int8 weights round to nearest)")
    args.quant_scheme = quant_scheme(args, parser)
    if Path(args.out_dir).resolve() == model_dir.resolve():
        parser.error("OUT_DIR must differ from MODEL_DIR (its weight files would be replaced)")


def quant_scheme(args, parser) -> QuantScheme:
    """The QuantScheme the options ask for, validated: a combination the kernels cannot run is a usage error naming
    the option (exit 2)."""
    weights = WeightScheme(4, GROUP_SIZE if args.group_size is None else args.group_size,
                           rounding=ROUNDINGS[args.rounding or "gptq"]) if args.scheme == "w4a8" else WeightScheme()
    try:
        return QuantScheme(weights, ACTIVATION_SCHEMES[args.activations]).validate()
    except ValueError as e:
        field, _, reason = str(e).partition(": ")
        options = {"group_size": ("--group-size", args.group_size), "activations": ("--activations", args.activations)}
        option, value = options.get(field, ("--scheme", args.scheme))
        parser.error(f"{option} {value}: {reason}")


def _tokens(tokenizer, path: Path, count: int) -> torch.Tensor:
    """The first `count` token ids of the calibration text, read only as far as they need: a prefix of the file, grown
    PREFIX_BYTES_PER_TOKEN times `count` bytes at a time up to MAX_BYTES_PER_TOKEN, cut before the whitespace that
    ends its last word, so that its tokens are the whole file's (a tokenizer splits words at whitespace first). The
    whole file was read and tokenized: a 1 GB one aborted the process, 100 MB ended in a tokenizer panic after 17 s."""
    for bytes_per_token in PREFIX_BYTES_PER_TOKEN:
        size = count * bytes_per_token
        with open(path, "rb") as f:
            data = f.read(size + 1)
        if b"\0" in data:
            raise CommandError(f"--calibration {path}: a NUL byte at offset {data.index(0)}: not a text file")
        whole = len(data) <= size
        text = data.decode("utf-8", errors="replace")
        if not whole:  # up to the whitespace before its last word (possibly cut): no word cut short
            words = text.rsplit(None, 1)
            text = words[0] if len(words) == 2 else text
        ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
        if ids.numel() >= count + TOKEN_MARGIN or (whole and ids.numel() >= count):
            return ids[:count]
        if whole:
            raise CommandError(f"--calibration {path}: {ids.numel()} tokens, fewer than the {count} needed "
                               f"(--calibration-tokens + --held-out-tokens); give a longer text or fewer tokens")
    raise CommandError(f"--calibration {path}: its first {size} bytes hold {ids.numel()} tokens; {count} "
                       f"(--calibration-tokens + --held-out-tokens) and {TOKEN_MARGIN} beyond them are needed, and a "
                       f"calibration text is read up to {MAX_BYTES_PER_TOKEN} bytes a token: give one with fewer blanks "
                       f"or repeats")


def _held_out(models: Dict[str, torch.nn.Module], ids: torch.Tensor) -> Dict[str, dict]:
    from w8a8_cpu.llm import evaluate

    window = min(512, ids.numel())
    return evaluate.compare_on_text(models, "float", ids, window, max(1, window // 2))


class CommandError(Exception):
    """A problem of the model or the options found while working: one line on stderr, exit status 2."""


def run(args, parser) -> int:
    try:
        return _run(args, parser)
    except (CommandError, ValueError) as e:  # ValueError: the library's refusal of an input, naming it
        print(f"quantize: {e}", file=sys.stderr)
        return 2


def _run(args, parser) -> int:
    check_arguments(args, parser)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never the network
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # this command's own progress bar reports the steps

    from w8a8_cpu._files import write_file
    from w8a8_cpu.llm.checkpoint import save_compressed
    from w8a8_cpu.quant.smoothquant import calibrate_smoothing, smooth_quant
    from w8a8_cpu.nn import W4A8Experts, quantize_model

    progress = Progress(5, enabled=not args.no_progress, name="quantize")  # load, smooth + quantize (or the
    # search), held-out scores, write, done
    progress.step(f"loading {args.model_dir}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype="auto").eval()
    except Exception as e:  # noqa: BLE001 - an untrusted directory: a corrupt weight file, a config that breaks
        # the model's construction (0 heads: ZeroDivisionError), ... each is the directory's fault, reported as such
        reason = " ".join(str(e).split())  # one line: transformers' messages span several
        raise CommandError(f"cannot load {args.model_dir} with transformers ({type(e).__name__}: "
                           f"{reason[:300]})") from None
    not_finite = next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)
    if not_finite is not None:
        raise CommandError(f"{args.model_dir}: {not_finite} holds NaN or Inf values; quantizing needs finite weights")
    ids = _tokens(tokenizer, args.calibration, args.calibration_tokens + args.held_out_tokens)
    calibration, held_out = ids[:args.calibration_tokens].unsqueeze(0), ids[args.calibration_tokens:]
    scheme = args.quant_scheme
    rounding = (args.rounding or "gptq") if scheme.weights.bits == 4 else None
    calibrated = scheme.weights.rounding == "gptq" or scheme.activations.static  # the steps that need calibration
    t0 = time.perf_counter()

    statistics = None  # the float model's SmoothQuant statistics, measured once for every alpha of a search

    def quantized(alpha: Optional[float]) -> torch.nn.Module:
        """A quantized copy of the float model, smoothed first with alpha (None: not); `model` stays float."""
        nonlocal statistics
        candidate = copy.deepcopy(model)
        if alpha is not None:
            try:
                if statistics is None:
                    statistics = calibrate_smoothing(model, calibration)
                smooth_quant(candidate, alpha=alpha, statistics=statistics)
            except ValueError as e:
                raise CommandError(f"SmoothQuant cannot run on this model: {e}; quantize without it: "
                                   f"--smoothquant none") from None
        return quantize_model(candidate, skip=args.skip, scheme=scheme, calibration=calibration if calibrated else None,
                              on_layer=lambda i, n: progress.update(f"GPTQ rounding, layer {i}/{n}"))

    def held_out_scores(candidate: torch.nn.Module) -> Dict[str, dict]:
        return _held_out({"float": model, "quantized": candidate}, held_out)

    search: List[dict] = []
    if args.smoothquant == "search":  # one candidate at a time: the float model and two quantized copies at most
        progress.step(f"SmoothQuant alpha search over {SEARCH_ALPHAS} ({args.calibration_tokens} calibration tokens)")
        best = None
        for a in SEARCH_ALPHAS:
            candidate = quantized(a)
            candidate_scores = held_out_scores(candidate)
            search.append({"alpha": a, "kl": candidate_scores["quantized"]["kl"],
                           "ppl": candidate_scores["quantized"]["ppl"]})
            if best is None or search[-1]["kl"] < best[0]["kl"]:
                best = (search[-1], candidate, candidate_scores)
            del candidate
        alpha, model_q, scores = best[0]["alpha"], best[1], best[2]
        progress.step(f"held-out perplexity of the search's alpha {alpha}")
    else:
        alpha = None if args.smoothquant == "none" else args.smoothquant
        progress.step(f"SmoothQuant and quantizing ({args.scheme})" if alpha is not None else
                      f"quantizing ({args.scheme}; SmoothQuant skipped: --smoothquant none)")
        model_q = quantized(alpha)
        progress.step("held-out perplexity")
        scores = held_out_scores(model_q)
    progress.step(f"writing {args.out_dir}")
    model = model_q
    out = Path(args.out_dir)
    save_compressed(model, out, max_shard_bytes=args.max_shard_size, tokenizer=args.model_dir)
    report = {"model_dir": str(args.model_dir), "scheme": args.scheme, "group_size": scheme.weights.group_size,
              "activations": args.activations, "rounding": rounding,
              "smoothquant_alpha": alpha, "search": search, "calibration": str(args.calibration),
              "calibration_tokens": args.calibration_tokens, "held_out_tokens": held_out.numel(),
              "float_ppl": scores["float"]["ppl"], "quantized_ppl": scores["quantized"]["ppl"],
              "kl": scores["quantized"]["kl"], "top1": scores["quantized"]["top1_agreement"],
              "kept_float": _float_layers(model), "seconds": time.perf_counter() - t0,
              # GPTQ rounds the Linear layers; quantize_model rounds int4 experts to nearest
              "experts_to_nearest": rounding == "gptq" and any(isinstance(m, W4A8Experts) for m in model.modules())}
    write_file(out / "README.md", readme(report).encode())  # as save_compressed writes: never through a link
    progress.step("done")
    print(summary(report))
    return 0


def _float_layers(model: torch.nn.Module) -> List[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def summary(r: dict) -> str:
    alpha = "none" if r["smoothquant_alpha"] is None else f"{r['smoothquant_alpha']}"
    change = 100.0 * (r["quantized_ppl"] / r["float_ppl"] - 1.0)
    static = "" if r["activations"] == "dynamic" else f" ({r['activations']} activations)"
    rounding = f" ({r['rounding'].upper()} rounding)" if r["rounding"] else ""
    return (f"quantize: {r['model_dir']} -> {r['scheme'].upper()}{rounding}{static}, SmoothQuant alpha {alpha}; "
            f"held-out perplexity {r['float_ppl']:.3f} float, {r['quantized_ppl']:.3f} quantized ({change:+.2f}%), "
            f"KL {r['kl']:.4f}, top-1 {100 * r['top1']:.1f}%; {len(r['kept_float'])} layers kept float; "
            f"{r['seconds']:.0f} s")


_ROUNDING = {"gptq": "rounded with GPTQ on the calibration tokens", "rtn": "rounded to nearest"}


def readme(r: dict) -> str:
    lines = [f"# {Path(r['model_dir']).name}, {r['scheme'].upper()} (w8a8-cpu)", "",
             f"Quantized from `{r['model_dir']}` by `python -m w8a8_cpu quantize`: {ACTIVATIONS[r['activations']]}"
             f"; weights " + ("int8 per output channel" if r["scheme"] == "w8a8" else
                              f"int4 per group of {r['group_size'] or 'K (per channel)'}, symmetric, "
                              f"{_ROUNDING[r['rounding']]}" +
                              (" (MoE experts: rounded to nearest)" if r.get("experts_to_nearest") else "")) +
             ". compressed-tensors format: vLLM serves this directory; `w8a8_cpu.llm.load_quantized` reads it.", "",
             f"- SmoothQuant alpha: {'none' if r['smoothquant_alpha'] is None else r['smoothquant_alpha']}"
             f"{' (searched)' if r['search'] else ''}",
             f"- calibration: {r['calibration_tokens']} tokens of `{r['calibration']}`",
             f"- held-out: the next {r['held_out_tokens']} tokens of it", "",
             "| model | held-out ppl | vs float | KL | top-1 |", "|---|---|---|---|---|",
             f"| float | {r['float_ppl']:.3f} | | | |",
             f"| quantized | {r['quantized_ppl']:.3f} | {100 * (r['quantized_ppl'] / r['float_ppl'] - 1):+.2f}% | "
             f"{r['kl']:.4f} | {100 * r['top1']:.1f}% |", ""]
    if r["search"]:
        lines += ["Alpha search (held-out KL to the float model):", "", "| alpha | KL | ppl |", "|---|---|---|"]
        lines += [f"| {row['alpha']} | {row['kl']:.4f} | {row['ppl']:.3f} |" for row in r["search"]] + [""]
    lines += [f"Layers kept float: {', '.join(r['kept_float']) or 'none'}.", ""]
    return "\n".join(lines)
