"""bench's read limit: the fastest read from memory this core does, the reference of every decode (GEMV) case.

`torch.ops.w8a8_cpu._read_probe` reads a buffer three ways (plain wide loads, software prefetch ahead, non-temporal
prefetch). A buffer read again and again would come back from the last-level cache wherever that cache is as large
as the buffer (a 300 MiB L3 on some Xeons: a 256 MiB buffer read at ~2x the memory's speed), and a GEMV's weights in
a model come from memory. So the probe reads a ring of windows: each read takes the next window, and the ring holds
at least three last-level caches of other windows, so a window comes back after that many bytes of other reads.
"""
from __future__ import annotations

import glob
import math
import time
from typing import Callable

import torch

READ_WAYS = ("plain", "prefetch", "nta")
# The ring's size bound: a last-level cache reported larger than this (a bad sysfs value) does not make bench
# allocate more memory.
MAX_RING_BYTES = 4 << 30


def _cache_size_bytes(text: str) -> int:
    """A sysfs cache size ("307200K", "32M", "512") in bytes; 0 when it is not one."""
    text = text.strip()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    return int(digits) * scale if digits.isdigit() else 0


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 in bytes (Linux sysfs), 0 where the system does not say."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                sizes.append(_cache_size_bytes(f.read()))
        except OSError:
            continue
    return max(sizes, default=0)


def ring_windows(window_bytes: int, cache_bytes: int) -> int:
    """Windows in a ring whose other windows hold three caches of `cache_bytes` (two at least, MAX_RING_BYTES at
    most)."""
    windows = 1 + math.ceil(3 * cache_bytes / window_bytes)
    return max(2, min(windows, MAX_RING_BYTES // window_bytes))


class ReadRing:
    """A ring of ring_windows(window_bytes, the last-level cache) windows; each read takes the next one."""

    def __init__(self, window_bytes: int, cache_bytes: int | None = None):
        cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
        self.window_bytes, self.windows = window_bytes, ring_windows(window_bytes, cache_bytes)
        self.ring = torch.ones(self.windows * window_bytes, dtype=torch.uint8)
        self.next = 0

    def describe(self) -> str:
        return (f"{self.window_bytes >> 20} MiB windows of a {self.windows * self.window_bytes >> 20} MiB ring, each "
                f"read after {(self.windows - 1) * self.window_bytes >> 20} MiB of other reads")

    def reader(self, way: str) -> Callable[[], int]:
        """One read of the next window the probe's `way`, on torch's threads."""
        def read() -> int:
            start = self.next * self.window_bytes
            self.next = (self.next + 1) % self.windows
            return torch.ops.w8a8_cpu._read_probe(self.ring[start:start + self.window_bytes], way)
        return read

    def bandwidth(self, tries: int = 5) -> float:
        """The read limit in GB/s: the best of `tries` reads each way."""
        best = float("inf")
        for way in READ_WAYS:
            read = self.reader(way)
            read()  # warm up
            for _ in range(tries):
                t0 = time.perf_counter()
                read()
                best = min(best, time.perf_counter() - t0)
        return self.window_bytes / best / 1e9
