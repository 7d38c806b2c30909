"""`checkpoint.memory_every_steps: auto`: whether the in-memory tier fits the node's host memory, and the interval
that keeps its stall within a share of a step.

Fit: a node holds, per kept step (`KEPT_STEPS`), each of its ranks' own copy and the peer copy each rank keeps for
a rank of another node: `KEPT_STEPS x 2 x state bytes x ranks per node`. That must fit in `checkpoint.memory_budget_mib`
or, when it is None, in `HEADROOM` of what the node has at the trainer's start: the smaller of the memory the kernel
can give without swapping (MemAvailable, what psutil.virtual_memory().available reads on Linux) and the free space
of memory_dir's filesystem (a tmpfs is limited by its own size too). The trainer measures its ranks' state at the
first snapshot point (the optimizer's state exists from the first step on); the planner computes the same from
the planned model states (tasks/capacity/plan.py `MemoryTierFit`).

Interval: every step while the measured stall per snapshot (the wall time training is held, the wait for the
previous copy's exchange included) is at most `STALL_GOAL` of a step; else the smallest interval that brings the
stall per step to the goal, at most checkpoint.save_every_steps (beyond it storage holds as fresh a state). Both
figures are medians over the last `WINDOW` snapshots of the same process, so a burst of load on a shared machine
stretches one sample, not the decision, and a uniformly loaded one stretches the stall and the step alike.

Decisions go to `<output>/memory_tier.jsonl` (rank 0; this module writes and reads it) and the log.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from training.storage import StorageConfig, append_control_line, read_control_lines

log = logging.getLogger(__name__)

KEPT_STEPS = 2
"""Steps whose copies a holder keeps (training/checkpoint/memory.py prunes to these)."""
COPIES_PER_RANK = 2
"""Each rank's node holds its own copy and the peer copy it keeps for a rank of another node."""
HEADROOM = 0.5
"""The share of the node's available host memory the tier may take when checkpoint.memory_budget_mib is None."""
STALL_GOAL = 0.05
"""The issue's goal: the in-memory save holds training at most 5% of a step, per step."""
WINDOW = 8
"""Snapshots whose stall and step time the interval is chosen from (medians)."""
FIRST_DECISION = 6
"""Snapshots measured at every step before the first choice of interval: the median of their 5 step times passes
over the first steps' warm-up (measured on the CPU tiny model: the steps between the first 4 copies took ~40 ms,
later ones ~11 ms; a choice after 3 copies took the warm-up for the step and chose 4 where 10 was needed)."""
REVIEW_EVERY = 8
"""Snapshots between later choices (a fresh window each time; each is one small all-reduce among the ranks)."""
DECISIONS_FILE = "memory_tier.jsonl"


def tier_bytes_per_node(state_bytes: float, ranks_per_node: int) -> float:
    """Host memory the tier holds on a node whose ranks each have `state_bytes` of state."""
    return KEPT_STEPS * COPIES_PER_RANK * state_bytes * ranks_per_node


def meminfo_available_bytes(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where the file or the line is missing)."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_bytes(folder: str) -> tuple[int, str]:
    """What the tier's copies may use on this node now, and where that figure came from: the smaller of
    MemAvailable and the free space of `folder`'s filesystem (its nearest existing parent)."""
    figures: list[tuple[int, str]] = []
    memory = meminfo_available_bytes()
    if memory is not None:
        figures.append((memory, "MemAvailable"))
    probe = folder
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    stat = os.statvfs(probe)
    figures.append((stat.f_bavail * stat.f_frsize, f"free space of {probe}"))
    return min(figures)


@dataclass(frozen=True)
class Fit:
    """Whether the tier fits a node: what it needs, what it may take, and why not (empty: it fits)."""

    need_bytes: float
    allowed_bytes: float
    basis: str
    """Where `allowed_bytes` came from (the budget field, or the headroom of the measured memory)."""

    @property
    def fits(self) -> bool:
        """The need is within what the tier may take."""
        return self.need_bytes <= self.allowed_bytes

    @property
    def reason(self) -> str:
        """Why the tier is off (empty when it fits), with the fix."""
        if self.fits:
            return ""
        return (
            f"the in-memory copies need {self.need_bytes / 2**20:.1f} MiB per node ({KEPT_STEPS} kept steps x own + "
            f"peer copy x the node's ranks) and may take {self.allowed_bytes / 2**20:.1f} MiB ({self.basis}); "
            "raise checkpoint.memory_budget_mib if the nodes have it, or set checkpoint.memory_every_steps to an "
            "interval to force the tier on"
        )


def fit(state_bytes: float, ranks_per_node: int, budget_mib: float | None, available: tuple[int, str]) -> Fit:
    """The tier's fit on a node: against `budget_mib` when set, else `HEADROOM` of the `available` figure."""
    need = tier_bytes_per_node(state_bytes, ranks_per_node)
    if budget_mib is not None:
        return Fit(need, budget_mib * 2**20, f"checkpoint.memory_budget_mib={budget_mib:g}")
    memory, where = available
    return Fit(need, HEADROOM * memory, f"{HEADROOM:.0%} of {memory / 2**20:.0f} MiB: {where} at start")


def choose_interval(stall_s: float, step_s: float, most: int | None, goal: float = STALL_GOAL) -> int:
    """The smallest interval (steps) whose stall per step, `stall_s / interval`, is at most `goal` of `step_s`;
    1 when every step is within it; at most `most` (checkpoint.save_every_steps; None: no bound)."""
    if step_s <= 0 or stall_s <= goal * step_s:
        return 1
    interval = math.ceil(stall_s / (goal * step_s) - 1e-9)
    return max(1, interval if most is None else min(interval, most))


@dataclass
class StallWindow:
    """The last `WINDOW` snapshots' stall and the mean step time between them, as the tier measured them."""

    stalls_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    steps_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    since_choice: int = 0
    chosen: int = 0
    """Times an interval was chosen."""

    def add(self, stall_s: float, step_s: float | None) -> None:
        """One snapshot's stall and the mean wall time of the steps since the previous one (None: the first)."""
        self.stalls_s.append(stall_s)
        if step_s is not None:
            self.steps_s.append(step_s)
        self.since_choice += 1

    def due(self) -> bool:
        """Whether enough snapshots were measured since the last choice to choose again."""
        wanted = FIRST_DECISION if self.chosen == 0 else REVIEW_EVERY
        return self.since_choice >= wanted and len(self.steps_s) >= min(FIRST_DECISION, WINDOW) - 1

    def medians(self) -> tuple[float, float]:
        """Median stall and median step (seconds)."""
        return statistics.median(self.stalls_s), statistics.median(self.steps_s)

    def proposal(self, most: int | None) -> int:
        """The interval these measurements call for (`choose_interval` of the medians); resets the count."""
        self.since_choice, self.chosen = 0, self.chosen + 1
        stall, step = self.medians()
        return choose_interval(stall, step, most)


@dataclass(frozen=True)
class TierDecision:
    """One line of memory_tier.jsonl: the tier's state after a decision of `memory_every_steps: auto`."""

    step: int
    fits: bool
    interval: int | None
    """Steps between copies from now on (None: off)."""
    need_bytes: float
    allowed_bytes: float
    state_bytes: float
    """The largest rank's state (one copy)."""
    stall_s: float | None = None
    """Median stall per snapshot the interval was chosen from (None: not measured yet)."""
    step_s: float | None = None
    reason: str = ""
    time: float = field(default_factory=time.time)

    def describe(self) -> str:
        """One line for the log."""
        if not self.fits:
            return f"in-memory copies off (checkpoint.memory_every_steps=auto): {self.reason}"
        measured = (
            "" if self.stall_s is None or self.step_s is None
            else f"; stall {1e3 * self.stall_s:.2f} ms per copy = {100 * self.stall_s / self.step_s:.1f}% of a "
            f"{1e3 * self.step_s:.1f} ms step"
        )  # fmt: skip
        return (
            f"in-memory copies every {self.interval} step(s) from step {self.step} (checkpoint.memory_every_steps="
            f"auto): {self.need_bytes / 2**20:.1f} MiB per node of {self.allowed_bytes / 2**20:.1f} MiB allowed"
            f"{measured}"
        )


def record_decision(output_url: str, storage: StorageConfig | None, decision: TierDecision) -> None:
    """Append the decision to the run's memory_tier.jsonl (rank 0's tier calls this; it logs it too)."""
    append_control_line(output_url, DECISIONS_FILE, json.dumps(asdict(decision)), storage)


def tier_decisions(output_url: str, storage: StorageConfig | None = None) -> list[TierDecision]:
    """The run's decisions, oldest first ([] when none); ValueError naming the file and line for a bad line."""
    path, lines = read_control_lines(output_url, DECISIONS_FILE, storage)
    decisions = []
    for number, text in lines:
        try:
            data: Any = json.loads(text)
            decisions.append(TierDecision(**data))
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"{path} line {number}: not a memory tier decision ({err}); it is written only by the trainer: "
                "remove that line (or the file) if it was edited by hand"
            ) from None
    return decisions
