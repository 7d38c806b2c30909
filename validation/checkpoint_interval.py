"""The checkpoint interval re-checked after a run: the interval it used, the Young/Daly optimum from the stall its
own saves measured (training/checkpoint/interval.py), and the goodput the difference cost.

The stall of a storage save is what checkpoints.jsonl records as `stall_s` (the wall time the save held training:
the whole save when synchronous, the staging when in the background); that of the in-memory tier what its
decisions record (memory_tier.jsonl, training/checkpoint/memory_auto.py); the step time is rank 0's median
`step_time_s`. All are medians, so that one slow save on a shared machine does not move the figure. The cost is the
difference of Young's first-order expected waste (`expected_waste`) between the interval used and the optimum, as
a share of the allocation; a run with no periodic save is charged as if its one interval were the whole run.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.checkpoint.interval import expected_waste, interval_steps
from training.checkpoint.memory_auto import tier_decisions
from training.run_output import RunOutput


@dataclass(frozen=True)
class RunStalls:
    """What a run measured of its saves (None: not measured)."""

    storage_stall_s: float | None
    storage_saves: int
    memory_stall_s: float | None
    step_s: float | None
    saved_steps: tuple[int, ...] = ()
    """Steps of the committed storage saves, ascending."""


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measured_stalls(output_dir: str | Path) -> RunStalls:
    """The medians of the run's storage stalls, in-memory stalls and rank 0's step times."""
    run = RunOutput(output_dir)
    saves = [c for c in run.checkpoints() if c.error is None]
    stalls = [c.stall_s for c in saves if c.stall_s is not None]
    memory = [d.stall_s for d in tier_decisions(str(run.dir)) if d.stall_s is not None]
    steps = [r.step_time_s for r in run.metric_records(0) if r.step_time_s is not None and r.step_time_s > 0]
    return RunStalls(_median(stalls), len(stalls), _median(memory), _median(steps[1:] or steps),
                     tuple(sorted({c.step for c in saves})))  # fmt: skip


@dataclass(frozen=True)
class IntervalCheck:
    """The re-check of a run's storage interval (figures None: not measured or not known)."""

    setting: str
    """checkpoint.save_every_steps as the spec has it: a number, auto or off."""
    used_steps: int | None
    """The interval the run saved at (the median gap between its periodic saves; None: none)."""
    optimum_steps: int | None
    stall_s: float | None
    step_s: float | None
    mtbf_s: float | None
    cost: float | None
    """Goodput share lost by saving at `used_steps` instead of the optimum (expected waste, Young's first order)."""
    memory_optimum_steps: int | None = None
    memory_stall_s: float | None = None

    def describe(self) -> str:
        """One line for the report and the summary."""
        used = f"every {self.used_steps} step(s)" if self.used_steps else "no periodic save"
        head = f"checkpoint interval ({self.setting}): {used}"
        if self.stall_s is None or self.step_s is None:
            return f"{head}; no save measured its stall"
        measured = f"stall {self.stall_s:.3g} s per save, step {self.step_s:.3g} s"
        if self.mtbf_s is None:
            return f"{head}; {measured}; optimum unknown: no failure rate (set cluster.mttf_hours)"
        memory = ("" if self.memory_optimum_steps is None
                  else f"; in-memory copies: optimum every {self.memory_optimum_steps} step(s)")  # fmt: skip
        cost = "" if self.cost is None else f", costing {100 * self.cost:.2f}% goodput"
        return (f"{head}; Young/Daly optimum every {self.optimum_steps} step(s) from this run's {measured}, "
                f"MTBF {self.mtbf_s / 3600:.3g} h{cost}{memory}")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """As stored in the report."""
        return {**asdict(self), "summary": self.describe()}


def used_interval(saved_steps: tuple[int, ...], first_step: int, last_step: int) -> int | None:
    """The median gap between the periodic saves (the save of the last step left out), counted from `first_step`."""
    periodic = [s for s in saved_steps if first_step < s < last_step]
    if not periodic:
        return None
    marks = [first_step, *periodic]
    return round(statistics.median(b - a for a, b in zip(marks, marks[1:], strict=False)))


def recheck_interval(
    setting: int | str | None, mtbf_s: float | None, stalls: RunStalls, first_step: int, last_step: int
) -> IntervalCheck:
    """The re-check of a run that trained from `first_step` to `last_step` with checkpoint.save_every_steps
    `setting` under a job MTBF `mtbf_s`, from its measured `stalls`."""
    used = setting if isinstance(setting, int) else used_interval(stalls.saved_steps, first_step, last_step)
    label = "off" if setting is None else str(setting)
    stall, step = stalls.storage_stall_s, stalls.step_s
    optimum = memory_optimum = cost = None
    if stall is not None and step is not None and mtbf_s is not None:
        optimum = interval_steps(stall, step, mtbf_s)
        assert optimum is not None
        length = used if used is not None else max(1, last_step - first_step)
        cost = max(0.0, expected_waste(length * step, stall, mtbf_s) - expected_waste(optimum * step, stall, mtbf_s))
        if stalls.memory_stall_s is not None:
            memory_optimum = interval_steps(stalls.memory_stall_s, step, mtbf_s)
    return IntervalCheck(label, used, optimum, stall, step, mtbf_s, cost, memory_optimum, stalls.memory_stall_s)


def recheck_run(output_dir: str | Path, setting: int | str | None, mtbf_s: float | None) -> IntervalCheck:
    """`recheck_interval` of the run in `output_dir`: from the step it started at (its resume) to its last."""
    run = RunOutput(output_dir)
    resume = run.resume()
    first = resume.loaded_step if resume is not None and resume.loaded_step is not None else 0
    return recheck_interval(setting, mtbf_s, measured_stalls(output_dir), first, run.last_step(0))
