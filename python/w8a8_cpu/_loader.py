"""Loads the compiled op library once, at the package's import: the torch version pin and the ISA check.

Everything in the package reaches the ops through `ops` (torch.ops.w8a8_cpu), so importing any module of it loads
the library first."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from . import _build_info


def _load_library() -> None:
    built, running = _build_info.TORCH_VERSION.split(".")[:2], torch.__version__.split("+")[0].split(".")[:2]
    if built != running:
        raise ImportError(
            f"w8a8_cpu was compiled against torch {_build_info.TORCH_VERSION} but torch {torch.__version__} is "
            f"installed; the C++ extension only works with the torch minor it was built with. Reinstall w8a8-cpu "
            f"(pip install --no-build-isolation .) next to this torch, or install torch=={'.'.join(built)}.*"
        )
    candidates = sorted(Path(__file__).parent.glob("libw8a8_cpu_ops*.so"))
    if not candidates:
        raise ImportError(f"w8a8_cpu: compiled op library libw8a8_cpu_ops.so not found in {Path(__file__).parent}")
    torch.ops.load_library(str(candidates[0]))


_load_library()
ops = torch.ops.w8a8_cpu

# Set instead of raising when the package is imported to run `python -m w8a8_cpu` (sys.argv[0] is "-m" while
# runpy imports it): the command line reports it as a bad setting, one line and exit 2, not an import traceback.
override_error = None
try:  # first use applies $W8A8_CPU_ISA, so a bad value fails here, at import, naming the choices
    ops._info()
except (RuntimeError, ValueError) as e:
    if sys.argv[:1] != ["-m"]:
        raise ImportError(f"w8a8_cpu: {e}") from None
    override_error = str(e)
