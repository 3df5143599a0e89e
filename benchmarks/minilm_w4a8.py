"""all-MiniLM-L6-v2 in W4A8: the int4 check on a model with original fp32 weights (SmolLM2's were dequantized from a
4-bit file, so int4 can land on its grid). Mean and worst embedding cosine vs fp32 on the demo's 32 sentences and
the paraphrase neighbours kept, for W8A8 and for int4 in groups (symmetric and with a zero point), rounded to nearest
and with GPTQ calibrated on the sentences of a text (quantize_model(scheme="w4a8", calibration=...)).

    python benchmarks/minilm_w4a8.py [--text /usr/share/common-licenses/GPL-3] [--group-size 32] [--json FILE]

Needs the demo extra (pip install 'w8a8-cpu[demo]'). Calibration sentences: the text split at '.', '!' or '?'
followed by white space, those of 40-400 characters, all in one batch. Accuracy only: the numbers do not depend on
the machine (nor on the variant: every variant computes the same values).
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
from pathlib import Path
from typing import List

import torch

import w8a8_cpu
from w8a8_cpu.cli import demo

SENTENCE_CHARACTERS = (40, 400)
INT4_FORMS = {"sym": True, "zero point": False}  # -> quantize_model's symmetric


def calibration_sentences(text: str) -> List[str]:
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    low, high = SENTENCE_CHARACTERS
    return [s for s in sentences if low <= len(s) <= high]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"),
                        help="calibration text for GPTQ (default: Debian's GPL-3)")
    parser.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128))
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.json and not args.json.parent.is_dir():  # before the run, not after it
        print(f"minilm_w4a8: --json: no directory {args.json.parent}", file=sys.stderr)
        return 2
    if not demo.available():
        print(f"minilm_w4a8: the demo extra is missing: {demo.INSTALL_HINT}", file=sys.stderr)
        return 2
    try:
        sentences = calibration_sentences(args.text.read_text(encoding="utf-8", errors="replace"))
    except OSError as e:
        print(f"minilm_w4a8: --text: {e}", file=sys.stderr)
        return 2
    if not sentences:
        print(f"minilm_w4a8: --text: no sentence of {SENTENCE_CHARACTERS[0]}-{SENTENCE_CHARACTERS[1]} characters "
              f"in {args.text}", file=sys.stderr)
        return 2
    fp32 = demo.load_model().eval()
    reference = demo.encode(fp32, demo.SENTENCES)
    options = {"W8A8": dict(scheme="w8a8")}
    for form, symmetric in INT4_FORMS.items():
        for rounding, calibration in (("RTN", None), ("GPTQ", lambda model: demo.encode(model, sentences))):
            options[f"W4A8 g{args.group_size} {form}, {rounding}"] = dict(
                scheme="w4a8", group_size=args.group_size, symmetric=symmetric, calibration=calibration)
    print(f"all-MiniLM-L6-v2 vs fp32 on the demo's {len(demo.SENTENCES)} sentences; GPTQ calibrated on "
          f"{len(sentences)} sentences of {args.text}")
    print(f"  {'model':<28} {'mean cos':>8} {'min cos':>8} {'paraphrase top-1':>17} {'quantize':>9}")
    rows = {}
    for name, kwargs in options.items():
        model = copy.deepcopy(fp32)
        start = time.perf_counter()
        w8a8_cpu.nn.quantize_model(model, **kwargs)
        seconds = time.perf_counter() - start
        embeddings = demo.encode(model, demo.SENTENCES)
        cosine = (reference * embeddings).sum(dim=1)  # both L2-normalized
        neighbours = demo.neighbour_report(reference, embeddings)
        rows[name] = {"cosine_mean": cosine.mean().item(), "cosine_min": cosine.min().item(),
                      "paraphrase_top1": neighbours["paraphrase_top1_w8a8"], "quantize_seconds": seconds}
        kept = f"{neighbours['paraphrase_top1_w8a8']}/{len(demo.SENTENCES)} (fp32 {neighbours['paraphrase_top1_fp32']})"
        print(f"  {name:<28} {rows[name]['cosine_mean']:8.4f} {rows[name]['cosine_min']:8.4f} {kept:>17} "
              f"{seconds:7.1f} s")
    if args.json:
        try:
            args.json.write_text(json.dumps({"calibration_sentences": len(sentences), "text": str(args.text),
                                             "group_size": args.group_size, "rows": rows}, indent=1))
        except OSError as e:
            print(f"minilm_w4a8: --json: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
