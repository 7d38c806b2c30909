"""Calibration of the plan per accelerator: measured / planned ratios, from a file of self-check corrections
(capacity.calibration_url) and, where it has some, from the ledger's accepted runs (validation/plan_accuracy.py).

The memory scale widens the fragmentation margin (a plan that read 20% low reserves 20% more); the step-time
scale multiplies the compute terms (matmuls and memory-bound work: the accelerator's sustained rates are what
the planner knows least). The ledger's runs take precedence over the file: they measured this deployment's own
jobs. The median of the newest runs is used, so one noisy run moves nothing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

import fsspec

from validation.plan_accuracy import PlanAccuracy

LEDGER_RUNS = 5
"""Newest accepted runs on an accelerator whose median ratio calibrates it."""


@dataclass(frozen=True)
class Calibration:
    """Measured / planned factors applied to a plan; 1.0 each when nothing calibrates it."""

    memory_scale: float = 1.0
    step_time_scale: float = 1.0
    runs: int = 0
    """Accepted runs (ledger) or self-check cases (file) the factors come from."""
    source: str = "none"
    """none, the calibration file's URL, or `ledger`."""

    def as_dict(self) -> dict[str, Any]:
        """For plan.json."""
        return asdict(self)


NONE = Calibration()


def from_file(url: str, accelerator: str) -> Calibration:
    """The file's entry for `accelerator` ({name: {peak_scale, step_time_scale, cases}}), NONE without one."""
    with fsspec.open(url, "r") as handle:
        corrections = json.load(handle)
    entry = corrections.get(accelerator)
    if not isinstance(entry, dict):
        return NONE
    return Calibration(
        memory_scale=float(entry.get("peak_scale", 1.0)),
        step_time_scale=float(entry.get("step_time_scale", 1.0)),
        runs=int(entry.get("cases", 0)),
        source=url,
    )


def from_runs(accuracies: list[PlanAccuracy], newest: int = LEDGER_RUNS) -> Calibration | None:
    """The median measured / planned ratios of the newest `newest` runs (oldest first in `accuracies`); None
    when no run measured anything."""
    recent = accuracies[-newest:]
    steps = [r["step_time"] for a in recent if "step_time" in (r := a.ratios())]
    memory = [r["memory"] for a in recent if "memory" in (r := a.ratios())]
    if not steps and not memory:
        return None
    return Calibration(
        memory_scale=median(memory) if memory else 1.0,
        step_time_scale=median(steps) if steps else 1.0,
        runs=len(recent),
        source="ledger",
    )


def calibration_for(url: str | None, accelerator: str, accuracies: list[PlanAccuracy]) -> Calibration:
    """The ledger's runs where there are some, else the file's entry, else NONE."""
    runs = from_runs(accuracies)
    if runs is not None:
        return runs
    return from_file(url, accelerator) if url else NONE
