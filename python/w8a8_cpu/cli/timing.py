"""Timing and progress for every tool (check, demo, bench, llm): candidates timed in interleaved rounds, and one
progress bar on stderr."""
from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch


def interleaved(candidates: Dict[str, Callable[[], object]], rounds: int, warmup: int = 1, inner: int = 1,
                samples: int = 1, on_round: Optional[Callable[[int], None]] = None) -> Dict[str, List[float]]:
    """Seconds per call of each candidate, one value per round: `warmup` untimed rounds, then `rounds` rounds, each
    timing every candidate once before the next round starts, so drift and noise from other jobs hit all of them
    alike. Each round times them in its own order (a fixed shuffle per round): whatever runs right after the slowest
    candidate (a 256 MiB read, a stack of layers streamed through every cache) starts cold, and in one fixed order that
    was always the same one (bench's 192x576 GEMV right after the read reference: 0.3 ms against 0.04 ms elsewhere).
    A candidate's value in a round is the median of `samples` timings of `inner` back-to-back calls each (divided by
    `inner`: for calls too short for one clock read). on_round(r) runs after round r (from 1)."""
    values: Dict[str, List[float]] = {name: [] for name in candidates}
    with torch.inference_mode():
        for _ in range(warmup):
            for fn in candidates.values():
                fn()
        for r in range(rounds):
            order = list(candidates)
            random.Random(r).shuffle(order)
            for name in order:
                fn = candidates[name]
                timings = []
                for _ in range(samples):
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        fn()
                    timings.append((time.perf_counter() - t0) / inner)
                values[name].append(statistics.median(timings))
            if on_round:
                on_round(r + 1)
    return values


def medians(values: Dict[str, List[float]], unit: float = 1.0) -> Dict[str, float]:
    """Each candidate's median over the rounds of interleaved(), in seconds / unit (unit 1e-3: milliseconds)."""
    return {name: statistics.median(v) / unit for name, v in values.items()}


class Progress:
    """A one-line progress bar on stderr, named `name`. When stderr is not a terminal (a log), one line for the first
    and the last step and at most one per LOG_INTERVAL_S seconds between them."""

    LOG_INTERVAL_S = 10.0

    def __init__(self, total: int, enabled: bool = True, name: str = "bench"):
        self.total, self.done, self.enabled, self.name = max(total, 1), 0, enabled, name
        self.tty = sys.stderr.isatty()
        self.t0 = self.logged = time.perf_counter()

    def note(self, text: str) -> None:
        """A message on its own line (e.g. a slow first-use step)."""
        if self.enabled:
            sys.stderr.write(("\r" + " " * 100 + "\r" if self.tty else "") + f"  {self.name}: {text}\n")
            sys.stderr.flush()

    def step(self, label: str) -> None:
        self.done += 1
        self._draw(label, self.done in (1, self.total))

    def update(self, label: str) -> None:
        """Redraws the current step with a new label (work inside one step, e.g. layer i of n) without counting a
        step; in a log at most one line per LOG_INTERVAL_S."""
        self._draw(label, False)

    def _draw(self, label: str, always_logged: bool) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not self.tty and not always_logged and now - self.logged < self.LOG_INTERVAL_S:
            return
        self.logged = now
        width = 28
        filled = width * self.done // self.total
        elapsed = now - self.t0
        line = f"  {self.name} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:6.0f}s  {label}"
        end = "\n" if self.done >= self.total or not self.tty else ""
        sys.stderr.write(("\r" if self.tty else "") + f"{line:<100}"[:100] + end)
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled and self.tty and self.done < self.total:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()
