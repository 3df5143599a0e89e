"""W8A8 linear + MoE benchmark suite on Llama-3-8B-like shapes: a thin entry for `python -m w8a8_cpu bench`
(the implementation is w8a8_cpu/bench.py, so it also runs from an installed wheel). See benchmarks/README.md.

    python benchmarks/linear.py [--quick] [--threads N] [--shapes 4096x4096 ...] [--m 1 16] [--json F] [--plot F.png]
"""
import sys

from w8a8_cpu import bench

if __name__ == "__main__":
    sys.exit(bench.main())
