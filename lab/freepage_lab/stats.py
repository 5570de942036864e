"""Statistics for A/B comparisons measured in one run."""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass


@dataclass
class Summary:
    n: int
    median: float
    p25: float
    p75: float
    min: float
    max: float

    def as_dict(self) -> dict:
        return asdict(self)


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        raise ValueError("no samples")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarise(xs: list[float]) -> Summary:
    return Summary(len(xs), statistics.median(xs), quantile(xs, 0.25), quantile(xs, 0.75),
                   min(xs), max(xs))


def fmt_ratio(r: dict | Ratio) -> str:
    """"0.29x [0.24, 0.33]"; ratios below 0.1 keep two significant digits."""
    ratio, lo, hi = (r["ratio"], r["lo"], r["hi"]) if isinstance(r, dict) else (r.ratio, r.lo, r.hi)

    def num(x: float) -> str:
        return f"{x:.2f}" if abs(x) >= 0.1 or x == 0 else f"{x:.2g}"

    return f"{num(ratio)}x [{num(lo)}, {num(hi)}]"


@dataclass
class Ratio:
    """median(b) / median(a) with a bootstrap 95% interval."""

    ratio: float
    lo: float
    hi: float

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return fmt_ratio(self)


def median_ratio(a: list[float], b: list[float], iterations: int = 2000, seed: int = 1) -> Ratio:
    if not a or not b:
        raise ValueError("both sides need samples")
    rng = random.Random(seed)
    point = statistics.median(b) / statistics.median(a)
    boots = []
    for _ in range(iterations):
        ra = [rng.choice(a) for _ in a]
        rb = [rng.choice(b) for _ in b]
        ma = statistics.median(ra)
        if ma:
            boots.append(statistics.median(rb) / ma)
    return Ratio(point, quantile(boots, 0.025), quantile(boots, 0.975))
