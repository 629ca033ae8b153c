"""Retry policies. Delays are computed here and stored in Postgres as ``run_at``: no
``countdown`` or ``eta`` ever reaches the broker."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with a cap: ``base * factor**(attempt-1)``, at most ``cap``, then
    jittered (half fixed, half random)."""

    base: float | None = None
    cap: float | None = None
    jitter: bool = True
    factor: float = 2.0

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"Backoff factor must be at least 1, not {self.factor}")

    def delay(self, attempt: int, *, default_base: float, default_cap: float) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        base = default_base if self.base is None else self.base
        cap = default_cap if self.cap is None else self.cap
        raw = min(cap, base * (self.factor ** max(0, attempt - 1)))
        # Half fixed, half random: spreads a thundering herd without ever retrying instantly.
        return float(raw / 2 + random.uniform(0, raw / 2)) if self.jitter else float(raw)


@dataclass(frozen=True)
class Schedule:
    """An explicit list of delays, e.g. ``Schedule((1, 5, 30, 120, 600))``; the last repeats."""

    delays: Sequence[float]

    def delay(self, attempt: int, *, default_base: float, default_cap: float) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        if not self.delays:
            return default_base
        return float(self.delays[min(len(self.delays), max(1, attempt)) - 1])


RetryPolicy = Backoff | Schedule


def requeue_delay(requeues: int, *, base: float, cap: float) -> float:
    """Seconds an attempt cut short by an outage of Conveyor's own database or Redis waits
    before it runs again, when the job was requeued ``requeues`` times before:
    ``base * 2**requeues``, at most ``cap``. Not jittered: the bound it keeps is a sum (with
    the defaults, ``max_requeues`` requeues take at least 15 minutes of waits)."""
    return float(min(cap, base * 2 ** max(0, requeues)))
