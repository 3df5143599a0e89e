"""python -m w8a8_cpu: the command line (w8a8_cpu.cli)."""
import sys

from w8a8_cpu import _loader

if _loader.override_error:  # e.g. W8A8_CPU_ISA naming no compiled variant: a bad setting, before any work
    print(f"python -m w8a8_cpu: {_loader.override_error}", file=sys.stderr)
    sys.exit(2)

from w8a8_cpu.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
