"""Goodput of a real local job (2 ranks, gloo, the tiny model) that loses a rank after its checkpoint: torchrun
restarts it, it resumes from storage and trains the lost steps again; its records add up to the allocation and
name the recovery and the steps trained twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.acceptance.workspace import Job
from tasks.launch.environment import JobEnvironment
from training.drill_points import HOLD_MARKER_PREFIX, paused_ranks
from training.run_output import RunOutput
from validation.goodput import BADPUT_KINDS, goodput_of_run

pytestmark = pytest.mark.integration

SAVED, KILLED, STEPS = 4, 6, 8


def test_a_killed_rank_shows_as_recovery_and_redone_steps_and_the_parts_sum_to_the_allocation(
    make_spec, tmp_path: Path
) -> None:
    spec = make_spec({"run": {"steps": STEPS}, "cluster": {"max_restarts": 1},
                      "checkpoint": {"save_every_steps": SAVED, "async_save": False}})  # fmt: skip
    markers = tmp_path / "hold"
    held = JobEnvironment().with_drill_points(
        hold_after_step={"step": KILLED, "marker_dir": str(markers), "timeout_s": 300}
    )
    job = Job(spec.cluster, spec.training_config(), "goodput", held, None)
    job.wait_until(lambda: len(paused_ranks(str(markers), HOLD_MARKER_PREFIX)) == 2, f"both ranks at {KILLED}", 300)
    job.kill_rank(1)
    outcome = job.wait(300)
    assert outcome.ok, outcome.status.describe()

    result = goodput_of_run(outcome.output_dir, started_unix_s=job.handle.submitted_unix_s)

    run = RunOutput(outcome.output_dir)
    assert len(run.attempts()) == 2
    records = run.metric_records(0)
    first_attempt = records[: next(i for i, r in enumerate(records) if i and r.step <= records[i - 1].step)]
    trained_twice = [r for r in first_attempt if r.step > SAVED]
    assert [r.step for r in trained_twice] == list(range(SAVED + 1, KILLED + 1))
    assert result.badput_s["redone_steps"] >= sum(r.step_time_s for r in trained_twice) > 0
    assert result.badput_s["recovery"] > 0
    assert result.badput_s["checkpoint_restore"] > 0 and result.badput_s["checkpoint_save"] > 0
    assert result.badput_s["startup"] > 0 and result.productive_s > 0
    kept = run.metrics(0)
    assert result.productive_s + result.badput_s["data_wait"] == pytest.approx(
        sum(r.step_time_s for r in kept.values()), rel=1e-6
    )
    assert result.productive_s + sum(result.badput_s[k] for k in BADPUT_KINDS) == pytest.approx(
        result.allocation_s, rel=0.01
    )
