"""The soak's failure schedule: seeded exponential inter-arrival times with the configured mean (failures as a
Poisson process), the kinds in shuffled rounds (each kind once per round, in a random order) so that a short soak
meets every kind the cluster can take. Pure: the same seed gives the same schedule."""

from __future__ import annotations

import random
from dataclasses import dataclass

from tasks.soak.config import FailureKind


@dataclass(frozen=True)
class Injection:
    """One planned failure: when (seconds after the soak's first step) and what."""

    at_s: float
    kind: FailureKind


def failure_schedule(
    duration_s: float, mean_interval_s: float, kinds: tuple[FailureKind, ...], seed: int, tail_s: float = 0.0
) -> list[Injection]:
    """Failures at exponential inter-arrival times (mean `mean_interval_s`) within [0, duration_s - tail_s), their
    kinds from `kinds` in shuffled rounds; the last `tail_s` stay quiet so the last failure's recovery is seen."""
    if not kinds:
        return []
    draw = random.Random(seed)
    planned: list[Injection] = []
    round_: list[FailureKind] = []
    t = 0.0
    while True:
        t += draw.expovariate(1.0 / mean_interval_s)
        if t >= duration_s - tail_s:
            return planned
        if not round_:
            round_ = list(kinds)
            draw.shuffle(round_)
        planned.append(Injection(round(t, 3), round_.pop()))
