"""The capacity plan against what a run measured: peak memory per rank and step time, each with its error.

The plan (tasks/capacity) predicts the tensor peak of each pipeline stage and the step time of its layout; an
accepted run measured both. Their relative error, (planned - measured) / measured, is recorded in the acceptance
report and the ledger after every acceptance run, so the planner is held to what jobs do. One run's error beyond the
tolerance is shown; the same error in each of the last few accepted runs on the same accelerator is a planner
finding (the planner's model is off for this job, not the run noisy), reported, never hidden by calibration.

What the run measured: on GPUs torch.cuda.max_memory_allocated (the plan's allocated peak is the same quantity);
on CPU the peak resident set of the process less its resident set before the model was built (the Python
runtime, torch's libraries, the process group), which is the nearest thing the CPU allocator offers.
"""

from __future__ import annotations

import math
from statistics import median
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from training.run_output import StepRecord


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PlannedFigures(_Record):
    """What the capacity plan predicts for a layout, as acceptance compares it (uncalibrated: the model's own)."""

    accelerator: str = Field(description="The cluster's accelerator (the calibration key).")
    layout: str = Field(description="The planned layout's name (Layout.describe()).")
    step_seconds: float = Field(gt=0, description="Planned seconds per optimizer step.")
    stage_peak_bytes: list[float] = Field(
        min_length=1, description="Planned tensor peak (allocated, before margins) of each pipeline stage, in order."
    )


class RankMemory(_Record):
    """One rank's planned and measured peak memory."""

    rank: int
    stage: int
    planned_bytes: float
    measured_bytes: float

    @property
    def error(self) -> float:
        """(planned - measured) / measured."""
        return relative_error(self.planned_bytes, self.measured_bytes)


class PlanAccuracy(_Record):
    """A run's measured peak memory per rank and step time beside the plan's, with the errors and the verdict."""

    accelerator: str
    layout: str
    planned_step_s: float
    measured_step_s: float | None = Field(description="Median step time of rank 0 after warm-up (None: no steps).")
    memory: list[RankMemory] = Field(description="Per rank (ranks that recorded no memory are left out).")
    memory_measure: str = Field(description="What the measured memory is (GPU allocator peak or CPU resident set).")
    tolerance: float = Field(description="Largest |relative error| taken as agreement.")
    finding: str | None = Field(
        default=None, description="A planner finding: the error beyond the tolerance in this and the last runs."
    )

    @property
    def step_time_error(self) -> float | None:
        """(planned - measured) / measured of the step time."""
        return None if self.measured_step_s is None else relative_error(self.planned_step_s, self.measured_step_s)

    @property
    def worst_memory(self) -> RankMemory | None:
        """The rank whose memory error is largest in magnitude."""
        return max(self.memory, key=lambda m: abs(m.error), default=None)

    @property
    def memory_error(self) -> float | None:
        """The worst rank's memory error."""
        worst = self.worst_memory
        return None if worst is None else worst.error

    def beyond(self) -> list[str]:
        """The figures whose error exceeds the tolerance: `step_time`, `memory`."""
        errors = {"step_time": self.step_time_error, "memory": self.memory_error}
        return [name for name, err in errors.items() if err is not None and abs(err) > self.tolerance]

    @property
    def within_tolerance(self) -> bool:
        """Both errors within the tolerance (a figure not measured does not count against it)."""
        return not self.beyond()

    def ratios(self) -> dict[str, float]:
        """measured / planned of step time and memory (the worst rank's): what calibration multiplies by."""
        out = {}
        if self.measured_step_s is not None:
            out["step_time"] = self.measured_step_s / self.planned_step_s
        worst = self.worst_memory
        if worst is not None:
            out["memory"] = worst.measured_bytes / worst.planned_bytes
        return out

    def line(self) -> str:
        """One line for the summary: both figures planned vs measured with the error."""
        parts = []
        if self.measured_step_s is not None:
            parts.append(
                f"step {self.planned_step_s:.3g} s planned, {self.measured_step_s:.3g} s measured "
                f"({self.step_time_error:+.0%})"
            )
        worst = self.worst_memory
        if worst is not None:
            parts.append(
                f"peak memory {worst.planned_bytes / 2**20:.1f} MiB planned, {worst.measured_bytes / 2**20:.1f} MiB "
                f"measured on rank {worst.rank} ({worst.error:+.0%})"
            )
        verdict = "within" if self.within_tolerance else "beyond"
        text = f"plan vs run ({self.layout}): {'; '.join(parts) or 'nothing measured'}; {verdict} ±{self.tolerance:.0%}"
        return text + (f". Planner finding: {self.finding}" if self.finding else "")

    def to_json(self) -> dict[str, Any]:
        """For the acceptance report: the record with each error."""
        return self.model_dump(mode="json") | {
            "step_time_error": self.step_time_error,
            "memory_error": self.memory_error,
            "memory_errors": {m.rank: m.error for m in self.memory},
            "within_tolerance": self.within_tolerance,
            "beyond": self.beyond(),
            "line": self.line(),
        }


def relative_error(planned: float, measured: float) -> float:
    """(planned - measured) / measured."""
    return (planned - measured) / measured


def measured_memory(record: StepRecord) -> float | None:
    """A metrics record's training memory: the GPU allocator's peak, or on CPU the peak resident set less the
    runtime's (None: not recorded)."""
    peak = record.peak_mem_bytes
    if not isinstance(peak, int | float) or peak <= 0:
        return None
    runtime = record.runtime_mem_bytes
    if isinstance(runtime, int | float) and runtime > 0:
        return float(peak - runtime) if peak > runtime else None
    return float(peak)


def compare_plan(
    planned: PlannedFigures,
    metrics: dict[int, dict[int, StepRecord]],
    stage_of: dict[int, int],
    tolerance: float,
    warmup_steps: int,
) -> PlanAccuracy:
    """The run's figures beside the plan's: each rank's last recorded memory against its pipeline stage's planned
    peak (`stage_of`: rank -> stage; ranks not in it are stage 0), and rank 0's median step time after
    `warmup_steps` against the planned step."""
    memory = []
    measure = "torch.cuda.max_memory_allocated"
    for rank in sorted(metrics):
        steps = metrics[rank]
        if not steps:
            continue
        last = steps[max(steps)]
        used = measured_memory(last)
        if used is None:
            continue
        if last.runtime_mem_bytes:
            measure = "peak resident set less the runtime's before the model was built (CPU)"
        stage = min(stage_of.get(rank, 0), len(planned.stage_peak_bytes) - 1)
        memory.append(RankMemory(rank=rank, stage=stage, planned_bytes=planned.stage_peak_bytes[stage],
                                 measured_bytes=used))  # fmt: skip
    rank0 = metrics.get(0, {})
    times = [m.step_time_s for s, m in rank0.items() if s > warmup_steps and _positive(m.step_time_s)]
    if not times:  # a short run: every step but the first
        times = [m.step_time_s for s, m in rank0.items() if s > 1 and _positive(m.step_time_s)]
    return PlanAccuracy(
        accelerator=planned.accelerator,
        layout=planned.layout,
        planned_step_s=planned.step_seconds,
        measured_step_s=float(median(times)) if times else None,
        memory=memory,
        memory_measure=measure,
        tolerance=tolerance,
    )


def with_history(accuracy: PlanAccuracy, earlier: list[PlanAccuracy], runs: int) -> PlanAccuracy:
    """`accuracy` with a planner finding when a figure is beyond the tolerance, on the same side, in it and in
    each of the `runs` - 1 newest `earlier` records of the same accelerator and layout (newest last)."""
    same = [a for a in earlier if a.accelerator == accuracy.accelerator and a.layout == accuracy.layout]
    history = [*same[-(runs - 1) :], accuracy] if runs > 1 else [accuracy]
    if len(history) < runs:
        return accuracy
    findings = []
    for name, error_of in (("step time", _step_error), ("peak memory", _memory_error)):
        errors = [error_of(a) for a in history]
        if any(e is None or abs(e) <= accuracy.tolerance for e in errors):
            continue
        signs = {math.copysign(1, e) for e in errors if e is not None}
        if len(signs) != 1:
            continue
        side = "over" if signs == {1.0} else "under"
        spread = ", ".join(f"{e:+.0%}" for e in errors if e is not None)
        findings.append(
            f"the plan {side}estimates {name} beyond ±{accuracy.tolerance:.0%} in the last {runs} accepted runs "
            f"on {accuracy.accelerator} ({spread}); later plans for {accuracy.accelerator} are calibrated from these "
            "runs (plan.json `calibration`), and the planner's model of this layout needs a look"
        )
    if not findings:
        return accuracy
    return accuracy.model_copy(update={"finding": "; ".join(findings)})


def _step_error(a: PlanAccuracy) -> float | None:
    return a.step_time_error


def _memory_error(a: PlanAccuracy) -> float | None:
    return a.memory_error


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0
