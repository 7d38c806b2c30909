"""The checkpoint interval of each tier that `tdeploy plan` prints: the Young/Daly optimum
(training/checkpoint/interval.py) from the stall per save and the job's MTBF, with where each input came from.

Stall: measured where the deployment's last run (run.output_url, a local folder) recorded saves (checkpoints.jsonl's
stall per storage save, memory_tier.jsonl's per in-memory copy: medians), else estimated from the planned state per
rank and the copy rates below. Step time: that run's median, else the plan's. MTBF: the ledger's observed failures,
else cluster.mttf_hours (tasks/recovery/exposure.py). The in-memory tier restores a lost rank or node from its peer
copies, storage every failure; without a breakdown of the failures by kind both tiers are planned for every
failure, which makes the in-memory tier's optimum a lower bound (more frequent than needed where some failures are
beyond it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.recovery.exposure import FailureRate, failure_rate, read_exposures
from training.checkpoint.interval import expected_waste, interval_steps, young_daly_s
from training.storage import is_local, local_path
from validation.checkpoint_interval import RunStalls, measured_stalls

if TYPE_CHECKING:
    from tasks.capacity.plan import CapacityPlan
    from tasks.capacity.step import CapacityInputs

HOST_COPY_BYTES_PER_S = 2e9
"""Estimate of a rank's copy of its state into host memory (a tmpfs file for the in-memory tier, the staging of a
background save): a conservative memcpy rate, for planning before a run measured the stall."""
STORAGE_WRITE_BYTES_PER_S = 0.5e9
"""Estimate of a rank's synchronous write of its state to storage (checkpoint.async_save false)."""


@dataclass(frozen=True)
class TierInterval:
    """One tier's optimum and its inputs."""

    tier: str
    stall_s: float
    stall_source: str
    step_s: float
    step_source: str
    optimum_s: float | None
    steps: int | None
    waste: float | None
    """Young's expected waste at the optimum (share of the allocation)."""

    def describe(self) -> str:
        """One line: the optimum, or why there is none, and the inputs."""
        inputs = (f"stall {self.stall_s:.3g} s per save ({self.stall_source}), step {self.step_s:.3g} s "
                  f"({self.step_source})")  # fmt: skip
        if self.steps is None or self.optimum_s is None:
            return f"{self.tier}: optimum unknown; {inputs}"
        waste = "" if self.waste is None else f", {100 * self.waste:.2f}% of the time lost to saves and re-done work"
        return f"{self.tier}: every {self.steps} step(s) ({self.optimum_s:.3g} s of training){waste}; {inputs}"


@dataclass(frozen=True)
class IntervalPlan:
    """The optimum of each tier under the job's failure rate, and the spec's setting."""

    rate: FailureRate
    setting: str
    tiers: tuple[TierInterval, ...]

    def lines(self) -> list[str]:
        """Lines for `tdeploy plan`."""
        head = f"checkpoint interval (Young/Daly; checkpoint.save_every_steps={self.setting}): {self.rate.describe()}"
        return [head, *(f"  {t.describe()}" for t in self.tiers)]

    def as_dict(self) -> dict[str, Any]:
        """For plan.json readers."""
        return {"rate": asdict(self.rate), "setting": self.setting, "tiers": [asdict(t) for t in self.tiers]}


def tier_interval(
    tier: str, stall: tuple[float, str], step: tuple[float, str], mtbf_s: float | None
) -> TierInterval:
    """The optimum of one tier from its (stall seconds, source) and (step seconds, source)."""
    (stall_s, stall_source), (step_s, step_source) = stall, step
    steps = interval_steps(stall_s, step_s, mtbf_s)
    optimum = None if mtbf_s is None else young_daly_s(stall_s, mtbf_s)
    waste = None if steps is None or mtbf_s is None else expected_waste(steps * step_s, stall_s, mtbf_s)
    return TierInterval(tier, stall_s, stall_source, step_s, step_source, optimum, steps, waste)


def plan_intervals(
    per_rank_bytes: float, planned_step_s: float, async_save: bool, measured: RunStalls | None, rate: FailureRate,
    setting: str,
) -> IntervalPlan:
    """Both tiers' optima: measured figures where `measured` has them, else estimated from `per_rank_bytes`."""
    m = measured or RunStalls(None, 0, None, None)
    copy_s = per_rank_bytes / HOST_COPY_BYTES_PER_S
    write_s = copy_s if async_save else per_rank_bytes / STORAGE_WRITE_BYTES_PER_S
    rate_text = f"{HOST_COPY_BYTES_PER_S / 1e9:g} GB/s" if async_save else f"{STORAGE_WRITE_BYTES_PER_S / 1e9:g} GB/s"
    step = (m.step_s, "measured: last run") if m.step_s else (planned_step_s, "planned")
    memory = ((m.memory_stall_s, "measured: last run") if m.memory_stall_s is not None
              else (copy_s, f"estimated: state / {HOST_COPY_BYTES_PER_S / 1e9:g} GB/s"))  # fmt: skip
    storage = ((m.storage_stall_s, f"measured: last run, {m.storage_saves} save(s)") if m.storage_stall_s is not None
               else (write_s, f"estimated: state / {rate_text}"))  # fmt: skip
    return IntervalPlan(rate, setting, (tier_interval("in-memory copies", memory, step, rate.mtbf_s),
                                        tier_interval("storage", storage, step, rate.mtbf_s)))  # fmt: skip


def interval_plan_of(inputs: CapacityInputs, plan: CapacityPlan) -> IntervalPlan:
    """The deployment's interval plan: its ledger's failures, its last run's measured stalls, the plan's state."""
    checkpoint, cluster = inputs.checkpoint, inputs.cluster
    assert checkpoint is not None, "the capacity step's inputs carry the spec's checkpoint section"
    exposures = read_exposures(inputs.exposure_url, inputs.storage) if inputs.exposure_url else []
    rate = failure_rate(exposures, cluster.nodes, cluster.mttf_hours)
    if checkpoint.mtbf_s is not None:
        rate = FailureRate(checkpoint.mtbf_s, "checkpoint.mtbf_s", "set in the spec")
    output = inputs.run.output_url
    measured = measured_stalls(output) if is_local(output) and Path(local_path(output)).is_dir() else None
    setting = checkpoint.save_every_steps
    return plan_intervals(plan.memory_tier().per_rank_bytes, plan.requested.step_seconds, checkpoint.async_save,
                          measured, rate, "off" if setting is None else str(setting))  # fmt: skip
