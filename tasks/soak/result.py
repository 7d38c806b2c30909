"""The soak's typed result: every injected failure and how it was recovered, the goodput, the memory verdicts and
the loss band."""

from __future__ import annotations

from collections import Counter
from pydantic import BaseModel, ConfigDict

from tasks.results import Figure, StepResult
from tasks.soak.config import FailureKind
from tasks.soak.memory import ProcessMemory
from validation.goodput import GoodputField

NO_RESTART = "none"
"""The rung of a failure the job absorbed without a restart (a slow node, a storage outage)."""
REQUEUE = "requeue"
"""The launch step's rung: the job ended and was submitted again (a lost node without a spare)."""


class FailureOutcome(BaseModel):
    """One injected failure: what, when, on whom, the rung expected and the rung the job's records show."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: FailureKind
    planned_at_s: float
    """Seconds after the soak's first step, per the schedule."""
    injected_at_s: float
    """When it was injected (later than planned while the previous failure was still recovering)."""
    target: str
    at_step: int
    """The last step trained when it struck."""
    expected: tuple[str, ...]
    """The rungs that may recover it (recovery.jsonl's, or 'none': no restart)."""
    rung: str | None = None
    """The rung that did (None: not recovered)."""
    requeued: bool = False
    restored_step: int | None = None
    steps_lost: int | None = None
    recovery_s: float | None = None
    """Failure to the first step trained after the restore (None for failures absorbed without a restart)."""
    problem: str = ""

    @property
    def recovered(self) -> bool:
        """Recovered by an expected rung."""
        return not self.problem and self.rung in self.expected


class LossBand(BaseModel):
    """Rank 0's training loss over the soak."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    first: float | None
    last: float | None
    low: float | None
    high: float | None
    nonfinite_steps: int

    def describe(self) -> str:
        """One line."""
        if self.first is None:
            return "no loss recorded"
        return (f"loss {self.first:.3f} -> {self.last:.3f} (band {self.low:.3f}..{self.high:.3f}"
                f"{f', {self.nonfinite_steps} non-finite' if self.nonfinite_steps else ''})")  # fmt: skip


class SoakResult(StepResult):
    """A soak: passed only if every failure was recovered by its expected rung, no process leaked and every loss
    was finite."""

    passed: bool
    scheduler: str
    duration_s: float
    mean_interval_s: float
    seed: int
    memory_tier: bool
    failures: list[FailureOutcome]
    left_out: dict[str, str]
    """Failure kinds of the config that this cluster cannot take, and why."""
    steps_trained: int
    goodput: GoodputField | None
    """The soak job's goodput and badput (None: not computed, see problems)."""
    processes: list[ProcessMemory]
    loss: LossBand
    problems: list[str]
    output_dir: str
    files: dict[str, str] = {}

    @property
    def recoveries_per_rung(self) -> dict[str, int]:
        """How many failures each rung recovered."""
        return dict(Counter(f.rung for f in self.failures if f.recovered and f.rung is not None))

    @property
    def steps_lost(self) -> int:
        """Steps trained again after the failures, in all."""
        return sum(f.steps_lost or 0 for f in self.failures)

    @property
    def leaks(self) -> list[ProcessMemory]:
        """The processes whose memory grew beyond their noise."""
        return [p for p in self.processes if p.verdict == "leak"]

    def figures(self) -> dict[str, Figure]:
        """The soak's length, failures injected and recovered, steps lost, goodput and leaking processes."""
        judged = [p for p in self.processes if p.verdict != "short"]
        return {"duration_s": self.duration_s, "failures": len(self.failures),
                "failures_recovered": sum(f.recovered for f in self.failures), "steps_lost": self.steps_lost,
                "steps_trained": self.steps_trained,
                "goodput_share": None if self.goodput is None else self.goodput.goodput,
                "processes_judged": len(judged), "processes_leaked": len(self.leaks),
                "output_dir": self.output_dir}  # fmt: skip

    def summary(self) -> str:
        """The verdict and the key figures in one line."""
        recovered = sum(f.recovered for f in self.failures)
        rungs = ", ".join(f"{rung} {n}" for rung, n in sorted(self.recoveries_per_rung.items())) or "none"
        judged = [p for p in self.processes if p.verdict != "short"]
        memory = (f"{len(self.leaks)} of {len(judged)} processes leaked" if self.leaks
                  else f"no leak in {len(judged)} processes")  # fmt: skip
        return (f"{'passed' if self.passed else 'FAILED'}: {recovered}/{len(self.failures)} failures recovered "
                f"(by rung: {rungs}), {self.steps_lost} steps lost, "
                f"{self.goodput.describe() if self.goodput else 'goodput not computed'}, {memory}, "
                f"{self.loss.describe()}")  # fmt: skip
