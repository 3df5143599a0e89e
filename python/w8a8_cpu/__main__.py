"""python -m w8a8_cpu: the command line (w8a8_cpu.cli)."""
import sys

from w8a8_cpu.cli import main

if __name__ == "__main__":
    sys.exit(main())
