"""Where the plugin attaches to vLLM 0.32, resolved before anything changes (resolve() raises ImportError /
AttributeError / KeyError when an internal is missing; install() then cannot fail halfway)."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import List

logger = logging.getLogger("vllm.plugins.w8a8_cpu")


@functools.lru_cache(maxsize=None)
def announce(what: str) -> None:
    """One line per process and kind of layer: which w8a8_cpu kernel serves it."""
    import w8a8_cpu
    logger.info("w8a8_cpu %s (variant %s) serves %s (W8A8_CPU_VLLM=0 switches it off)", w8a8_cpu.__version__,
                w8a8_cpu.info()["selected_variant"], what)


@dataclass
class Hooks:
    cpu_int8_kernels: List[type]  # vLLM's CPU int8 scaled-mm kernels, in priority order (a list vLLM reads per layer)
    int8_kernel: type
    config: type                  # our CompressedTensorsConfig subclass
    register_config: object       # vLLM's register_quantization_config

    def install(self) -> None:
        if self.int8_kernel not in self.cpu_int8_kernels:
            self.cpu_int8_kernels.insert(0, self.int8_kernel)
        self.register_config("compressed-tensors")(self.config)


def resolve() -> Hooks:
    from vllm.model_executor.kernels.linear import _POSSIBLE_INT8_KERNELS
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.platforms import PlatformEnum

    from ._config import W8A8CpuCompressedTensorsConfig
    from ._linear import W8A8CpuInt8Kernel
    return Hooks(_POSSIBLE_INT8_KERNELS[PlatformEnum.CPU], W8A8CpuInt8Kernel, W8A8CpuCompressedTensorsConfig,
                 register_quantization_config)
