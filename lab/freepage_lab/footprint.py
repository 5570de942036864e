"""Sampling a guest's host memory footprint, and reading a timeline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Sample:
    t: float  # host monotonic seconds
    bytes: int


class Sampler:
    """Calls `probe` every `interval` seconds on a thread (default 20 Hz).

    A slow probe delays the next call (no catching up); rate_hz() tells
    what was achieved.

    A probe answering None (the guest is not there yet, or gone) adds no sample.
    """

    def __init__(self, probe: Callable[[], int | None], interval: float = 0.05) -> None:
        self.probe = probe
        self.interval = interval
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            value = self.probe()
            if value is not None:
                self.samples.append(Sample(time.monotonic(), value))
            next_t += self.interval
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def rate_hz(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        return (len(self.samples) - 1) / (self.samples[-1].t - self.samples[0].t)


@dataclass
class Reclaim:
    """How the footprint fell after the guest freed `freed_bytes` at `t_freed`."""

    before_bytes: int
    after_bytes: int
    freed_bytes: int
    t50_s: float | None
    t90_s: float | None
    fraction: float
    settled_s: float | None
    t99_s: float | None = None


def value_at(samples: list[Sample], t: float) -> int:
    """The last sample at or before t (or the first one)."""
    best = samples[0].bytes
    for s in samples:
        if s.t > t:
            break
        best = s.bytes
    return best


def settle_time(samples: list[Sample], t0: float, window: float = 3.0, tol: float = 0.01) -> float | None:
    """First time after t0 from which the footprint stays within tol for `window` s."""
    after = [s for s in samples if s.t >= t0]
    for i, s in enumerate(after):
        rest = [x.bytes for x in after[i:] if x.t <= s.t + window]
        if after[-1].t < s.t + window:
            return None
        lo, hi = min(rest), max(rest)
        if hi - lo <= tol * max(hi, 1):
            return s.t - t0
    return None


def analyse_reclaim(samples: list[Sample], t_freed: float, freed_bytes: int) -> Reclaim:
    """Seconds to give back 50% / 90% / 99% of the freed memory, and the final fraction."""
    if not samples:
        raise ValueError("no footprint samples")
    before = max(s.bytes for s in samples if s.t <= t_freed + 0.5) if any(
        s.t <= t_freed + 0.5 for s in samples) else samples[0].bytes
    after_samples = [s for s in samples if s.t >= t_freed]
    after = min(s.bytes for s in after_samples) if after_samples else before
    t50 = t90 = t99 = None
    for s in after_samples:
        dropped = before - s.bytes
        if t50 is None and dropped >= 0.5 * freed_bytes:
            t50 = s.t - t_freed
        if t90 is None and dropped >= 0.9 * freed_bytes:
            t90 = s.t - t_freed
        if t99 is None and dropped >= 0.99 * freed_bytes:
            t99 = s.t - t_freed
    return Reclaim(before, after, freed_bytes, t50, t90, (before - after) / freed_bytes,
                   settle_time(samples, t_freed), t99)
