"""The checkpoint interval re-checked after a run (validation/checkpoint_interval.py): the interval used, the
optimum from the run's own measured stall and step time, and the goodput the difference cost, worked by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.checkpoint.interval import expected_waste
from training.run_output import CheckpointEvent, RunOutputWriter, StepRecord
from training.storage import StorageConfig
from validation.checkpoint_interval import recheck_run, used_interval


def _run(folder: Path, saves: list[int], stall_s: float, step_s: float, steps: int) -> Path:
    out = RunOutputWriter(str(folder), StorageConfig())
    for step in range(1, steps + 1):
        out.append_metrics(StepRecord(step=step, loss=1.0, step_time_s=step_s, tokens_per_s=100.0,
                                      compute_s=step_s, data_wait_s=0.0))
    for step in saves:
        out.append_checkpoint(CheckpointEvent(step, 1e6, stall_s + 1.0, stall_s=stall_s))
    out.close()
    return folder


def test_a_run_saving_every_50_steps_against_its_optimum_of_237(tmp_path: Path) -> None:
    run = _run(tmp_path / "out", [50, 100, 150, 200], stall_s=2.0, step_s=0.5, steps=200)
    check = recheck_run(run, 50, 3600.0)
    assert (check.used_steps, check.optimum_steps) == (50, 237)  # Daly: 118.67 s / 0.5 s
    # Young's first-order waste at 25 s (2/25 + 27/7200 = 0.08375) less that at 118.5 s
    assert check.cost == pytest.approx(0.08375 - expected_waste(118.5, 2.0, 3600.0))
    assert check.cost == pytest.approx(0.08375 - (2 / 118.5 + 120.5 / 7200))
    assert "optimum every 237 step(s)" in check.describe() and "5.01% goodput" in check.describe()


def test_auto_s_interval_used_is_the_median_gap_of_its_periodic_saves(tmp_path: Path) -> None:
    assert used_interval((10, 40, 70, 100), 0, 100) == 30  # gaps 10, 30, 30: the save at the last step left out
    assert used_interval((100,), 0, 100) is None
    run = _run(tmp_path / "out", [10, 40, 70, 100], stall_s=2.0, step_s=0.5, steps=100)
    assert recheck_run(run, "auto", 3600.0).used_steps == 30


def test_without_a_failure_rate_the_re_check_says_what_to_set(tmp_path: Path) -> None:
    run = _run(tmp_path / "out", [20], stall_s=0.1, step_s=0.5, steps=20)
    check = recheck_run(run, None, None)
    assert check.used_steps is None and check.optimum_steps is None and check.cost is None
    assert "no periodic save" in check.describe() and "set cluster.mttf_hours" in check.describe()


def test_the_re_check_goes_into_the_performance_dimension_and_the_job_s_summary(tmp_path: Path) -> None:
    from tasks.launch.step import JobResult
    from validation.acceptance import AcceptanceThresholds, check_performance, rank_metrics

    run = _run(tmp_path / "out", [50, 100], stall_s=2.0, step_s=0.5, steps=100)
    check = recheck_run(run, 50, 3600.0)
    metrics = rank_metrics(run)
    result = check_performance(metrics, metrics[0], 1, AcceptanceThresholds(), interval=check)
    assert result.measured["checkpoint_interval"]["optimum_steps"] == 237
    assert result.measured["checkpoint_interval"]["summary"] == check.describe()
    job = JobResult(job="local:1", state="succeeded", output_dir=str(run), handle={}, interval=check.describe())
    assert job.summary().endswith(check.describe())
