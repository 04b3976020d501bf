"""Arrival processes for open-loop runs: Poisson, bursty, diurnal.

    gaps = Bursty().gaps(rng, rate=2.0)     # an iterator of inter-arrival gaps (s)
    simulate(w, lay, rate=2.0, arrivals=Bursty())

Every process has the mean ``rate`` it is given, so loads compare across them;
they differ in how arrivals bunch. Sources and parameters: ``docs/sources.md``
(section "Arrivals").

- ``Poisson``: exponential gaps, coefficient of variation (CV) 1. What DistServe
  and Splitwise evaluate with.
- ``Bursty``: a two-state Markov-modulated Poisson process. A burst state at
  ``peak`` x the rate holding ``burst_arrivals`` arrivals on average, a calm
  state slower such that the mean stays ``rate``; the share of time in the burst
  is ``burst_share``. Burst length is counted in arrivals, so the shape (and the
  gaps' CV, well above 1: ``Bursty.cv``) is the same at every rate and a run of a
  thousand arrivals sees dozens of bursts. The first state is drawn from the
  stationary distribution.
- ``Diurnal``: a sinusoidal rate, ``rate * (1 + swing * sin(2 pi t / period))``,
  sampled by thinning (Lewis and Shedler); a day compressed into a period of
  ``period_arrivals`` arrivals, so a run sees whole cycles at every rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Arrivals", "Bursty", "Diurnal", "Poisson"]


class Arrivals(Protocol):
    """An arrival process: ``gaps`` yields inter-arrival gaps with mean ``1 / rate``."""

    name: str

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]: ...


@dataclass(frozen=True)
class Poisson:
    name: str = "poisson"

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        while True:
            yield rng.expovariate(rate)


@dataclass(frozen=True)
class Bursty:
    """Two-state MMPP; ``peak`` x rate during bursts, which take ``burst_share`` of
    the time and hold ``burst_arrivals`` on average (``peak * burst_share`` < 1)."""

    peak: float = 4.0
    burst_share: float = 0.15
    burst_arrivals: float = 20.0
    name: str = "bursty"

    def rates(self, rate: float) -> tuple[float, float]:
        """(burst, calm) rates whose time-weighted mean is ``rate``."""
        if not self.peak * self.burst_share < 1.0:
            raise ValueError("peak * burst_share must be < 1")
        calm = rate * (1 - self.peak * self.burst_share) / (1 - self.burst_share)
        return rate * self.peak, calm

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        hi, lo = self.rates(rate)
        burst_s = self.burst_arrivals / hi
        calm_s = burst_s * (1 - self.burst_share) / self.burst_share
        burst = rng.random() < self.burst_share
        left = rng.expovariate(1 / (burst_s if burst else calm_s))  # time left in the state
        gap = 0.0
        while True:
            lam = hi if burst else lo
            t = rng.expovariate(lam) if lam > 0 else math.inf
            if t < left:
                left -= t
                yield gap + t
                gap = 0.0
            else:  # the state ends before the next arrival: memoryless, redraw
                gap += left
                burst = not burst
                left = rng.expovariate(1 / (burst_s if burst else calm_s))

    def cv(self, rate: float, n: int = 50_000, seed: int = 0) -> float:
        """Coefficient of variation of the gaps, estimated from ``n`` draws."""
        it = self.gaps(random.Random(seed), rate)
        xs = [next(it) for _ in range(n)]
        m = sum(xs) / n
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) / m


@dataclass(frozen=True)
class Diurnal:
    """Sinusoidal rate with relative ``swing`` (< 1) over ``period_arrivals`` arrivals."""

    swing: float = 0.5
    period_arrivals: float = 250.0
    name: str = "diurnal"

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        if not 0 <= self.swing < 1:
            raise ValueError("swing must be in [0, 1)")
        top = rate * (1 + self.swing)
        period_s = self.period_arrivals / rate
        t = last = 0.0
        while True:
            t += rng.expovariate(top)
            now = rate * (1 + self.swing * math.sin(2 * math.pi * t / period_s))
            if rng.random() * top <= now:
                yield t - last
                last = t
