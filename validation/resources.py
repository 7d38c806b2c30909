"""Resource gates measured the right way: is the accelerator kept busy with the model's work, and how full is its
memory (the guide's > 70% utilization and < 90% memory).

NVML's utilization counts any time a kernel runs, whatever it keeps busy; a job whose data loader starves it reads
high there while it trains slowly. The gates here judge what the step records measured instead:

- CPU runs: the compute share, per rank the median over the steps of `compute_s / (compute_s + data_wait_s)`:
  of the time the rank was neither communicating nor syncing the loss (communication has its own gate,
  comm_share_max), the share it computed rather than waited for its data. Both terms are wall time of the same
  step, so a busy shared host, which stretches both alike, leaves the share where it was; an idle data loader
  (a slow read, too few workers) drives it down.
- GPU runs: the device's busy share, the CUDA events around the step's compute (`compute_device_s`) over the step's
  wall time, and where the caller measured them SM activity (DCGM's DCGM_FI_PROF_SM_ACTIVE: the share of the
  SMs' time with a warp resident, not "a kernel ran") and MFU; memory as the allocator's peak over the device's
  total (`peak_mem_bytes / gpu_mem_total_bytes`) and as the device's used share (`gpu_mem_bytes / total`, which
  counts the caching allocator's reserve and other processes). The GPU path is written against the step records'
  fields but has not run on a GPU in this project's CI (CPU only).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from training.run_output import StepRecord


@dataclass(frozen=True)
class ResourceLimits:
    """The gates' thresholds (None: that gate is off)."""

    compute_share_min: float | None = 0.7
    device_busy_min: float | None = None
    sm_active_min: float | None = None
    mfu_min: float | None = None
    memory_max: float | None = 0.9


@dataclass(frozen=True)
class ResourceGate:
    """The gates' figures and verdict (figures None: not measured)."""

    basis: str
    """cpu (compute share) or gpu (device busy share, SM activity, MFU, memory)."""
    share_per_rank: dict[int, float] = field(default_factory=dict)
    """The compute share (CPU) or the device busy share (GPU) of each rank."""
    sm_active: float | None = None
    mfu: float | None = None
    memory_peak_share: float | None = None
    memory_used_share: float | None = None
    failures: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """No gate failed."""
        return not self.failures

    @property
    def lowest_share(self) -> float | None:
        """The lowest rank's share."""
        return min(self.share_per_rank.values(), default=None)

    def to_json(self) -> dict[str, Any]:
        """For the report's measured figures."""
        return {**asdict(self), "failures": list(self.failures)}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def compute_share(record: StepRecord) -> float | None:
    """A CPU step's compute share: compute over compute plus data wait (None: not recorded)."""
    if record.compute_s is None or record.data_wait_s is None or record.compute_s + record.data_wait_s <= 0:
        return None
    return record.compute_s / (record.compute_s + record.data_wait_s)


def device_busy_share(record: StepRecord) -> float | None:
    """A GPU step's device busy share: the compute's CUDA-event time over the step's wall time (None: not
    recorded)."""
    if record.compute_device_s is None or not record.step_time_s:
        return None
    return min(1.0, record.compute_device_s / record.step_time_s)


def _memory_shares(records: list[StepRecord]) -> tuple[float | None, float | None]:
    """The largest allocator-peak share and device-used share of the device's total over the records."""
    peak = [r.peak_mem_bytes / r.gpu_mem_total_bytes for r in records if r.peak_mem_bytes and r.gpu_mem_total_bytes]
    used = [r.gpu_mem_bytes / r.gpu_mem_total_bytes for r in records if r.gpu_mem_bytes and r.gpu_mem_total_bytes]
    return max(peak, default=None), max(used, default=None)


def resource_gate(
    metrics: dict[int, dict[int, StepRecord]],
    steps: list[int],
    limits: ResourceLimits,
    *,
    sm_active: float | None = None,
    mfu: float | None = None,
) -> ResourceGate:
    """The gates over `steps` of every rank's records (`metrics`: rank -> step -> record); `sm_active` and `mfu`
    where the caller measured them (GPU runs)."""
    records = [m[s] for m in metrics.values() for s in steps if s in m]
    on_gpu = any(r.compute_device_s is not None for r in records)
    share = device_busy_share if on_gpu else compute_share
    shares = {
        rank: v
        for rank, m in metrics.items()
        if (v := _median([x for s in steps if s in m and (x := share(m[s])) is not None])) is not None
    }
    failures = []
    floor = limits.device_busy_min if on_gpu else limits.compute_share_min
    what = ("device busy share (CUDA events over step time)" if on_gpu
            else "compute share (compute / compute + data wait)")  # fmt: skip
    for rank, value in sorted(shares.items()):
        if floor is not None and value < floor:
            failures.append(f"rank {rank}'s {what} {value:.2f} < {floor} (look at the data loader first)")
    peak, used = _memory_shares(records) if on_gpu else (None, None)
    for name, value, limit in (("SM activity", sm_active, limits.sm_active_min), ("MFU", mfu, limits.mfu_min)):
        if value is not None and limit is not None and value < limit:
            failures.append(f"{name} {value:.2f} < {limit}")
    for name, value in (("allocator peak", peak), ("device memory used", used)):
        if value is not None and limits.memory_max is not None and value > limits.memory_max:
            failures.append(f"{name} {value:.2f} of the device > {limits.memory_max}")
    return ResourceGate("gpu" if on_gpu else "cpu", shares, sm_active, mfu, peak, used, tuple(failures))
