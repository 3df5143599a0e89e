"""W8A8 linear + MoE benchmark suite on Llama-3-8B-like shapes: `python -m w8a8_cpu bench` (the implementation is
w8a8_cpu/cli/bench.py, so it also runs from an installed wheel), followed by the project's performance targets of
each run (targets.py; also in the JSON). See benchmarks/README.md.

    python benchmarks/linear.py [--quick] [--threads N] [--shapes 4096x4096 ...] [--m 1 16] [--json F] [--plot F.png]
"""
import argparse
import sys

import targets
from w8a8_cpu.cli import bench


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/linear.py",
                                     description=bench.DESCRIPTION + " Then the performance targets (targets.py).")
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv), on_result=targets.add_targets)


if __name__ == "__main__":
    sys.exit(main())
