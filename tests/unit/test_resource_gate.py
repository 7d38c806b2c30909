"""The resource gates over step records (validation/resources.py): the CPU compute share, and the GPU path's device
busy share and memory shares on synthetic GPU records (no GPU here: the arithmetic of the hooks is what runs)."""

from __future__ import annotations

import pytest

from training.run_output import StepRecord
from validation.resources import ResourceLimits, resource_gate


def _cpu(step: int, compute_s: float, data_wait_s: float) -> StepRecord:
    return StepRecord(step=step, loss=1.0, step_time_s=compute_s + data_wait_s + 0.01, compute_s=compute_s,
                      data_wait_s=data_wait_s)  # fmt: skip


def test_cpu_compute_share_is_compute_over_compute_plus_data_wait_median_per_rank() -> None:
    metrics = {0: {s: _cpu(s, 0.03, 0.01) for s in range(1, 6)},
               1: {1: _cpu(1, 0.01, 0.03), 2: _cpu(2, 0.01, 0.03), 3: _cpu(3, 0.03, 0.0)}}  # fmt: skip
    gate = resource_gate(metrics, [1, 2, 3, 4, 5], ResourceLimits())
    assert gate.basis == "cpu" and gate.share_per_rank == pytest.approx({0: 0.75, 1: 0.25})
    assert not gate.passed and gate.failures == ("rank 1's compute share (compute / compute + data wait) 0.25 < 0.7 "
                                                 "(look at the data loader first)",)  # fmt: skip
    assert resource_gate(metrics, [1, 2, 3], ResourceLimits(compute_share_min=None)).passed


def test_gpu_gates_judge_the_device_busy_share_and_the_allocator_peak_and_device_used_memory() -> None:
    gib = 2**30
    record = StepRecord(step=1, loss=1.0, step_time_s=1.0, compute_device_s=0.6, peak_mem_bytes=76 * gib,
                        gpu_mem_bytes=78 * gib, gpu_mem_total_bytes=80 * gib)  # fmt: skip
    gate = resource_gate({0: {1: record}}, [1], ResourceLimits(device_busy_min=0.7), sm_active=0.5, mfu=0.3)
    assert gate.basis == "gpu" and gate.share_per_rank == {0: pytest.approx(0.6)}
    assert gate.memory_peak_share == pytest.approx(0.95) and gate.memory_used_share == pytest.approx(0.975)
    assert len(gate.failures) == 3 and "device busy share" in gate.failures[0]
    limits = ResourceLimits(sm_active_min=0.6, mfu_min=0.4)
    strict = resource_gate({0: {1: record}}, [1], limits, sm_active=0.5, mfu=0.3)
    assert [f.split(" ")[0] for f in strict.failures[:2]] == ["SM", "MFU"]  # the busy share's gate is off by default
