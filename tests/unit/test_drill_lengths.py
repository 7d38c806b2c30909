"""Drill jobs train only as far as their check needs (drills.relaunch_steps past the point they recover from), not
the acceptance run's whole length; a stalled job is stopped without the grace that only a checkpoint needs."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tasks.acceptance import workspace
from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext, drill_preemption, drill_storage_outage
from tasks.acceptance.ladder.hang import drill_hang
from tasks.launch.base import JobHandle, JobState, JobStatus
from tasks.launch.local import STALLED_STOP_GRACE_S, LocalLauncher
from training import drill_points
from training.config import TrainConfig
from training.drill_points import HOLD_MARKER_PREFIX, RELEASE_FILE, DrillPoints, paused_ranks

ACCEPTANCE = AcceptanceConfig(steps=200, save_every_steps=20)
RELAUNCH_STEPS = 3  # drills.relaunch_steps by default


class Submitted(Exception):
    """The drill submitted its (first) job: what it asked for."""

    def __init__(self, train: TrainConfig, environment: Any) -> None:  # noqa: ANN401 - a JobEnvironment
        super().__init__(train.run.output_url)
        self.train, self.environment = train, environment


def _context(make_spec, tmp_path: Path) -> DrillContext:
    """A drill context whose first job submission stops the drill with what was submitted."""
    spec = make_spec()
    ctx = DrillContext(spec.cluster, spec.training_config(), tmp_path, ACCEPTANCE)

    def job(train: TrainConfig, name: str, cluster: Any = None, environment: Any = None) -> None:  # noqa: ANN401
        raise Submitted(train, environment)

    ctx.job = job  # type: ignore[method-assign]
    reference = SimpleNamespace(ranks=lambda: SimpleNamespace(ranks=[{"rank": 0}, {"rank": 1}]), metrics=dict)
    ctx.reference = lambda: reference  # type: ignore[method-assign, assignment, return-value]
    return ctx


def test_the_preemption_drill_stops_a_save_interval_and_the_relaunch_steps_past_its_hold(make_spec, tmp_path) -> None:
    with pytest.raises(Submitted) as submitted:
        drill_preemption(_context(make_spec, tmp_path))
    held_at = ACCEPTANCE.save_every_steps + 1
    run = submitted.value.train.run
    assert run.steps == ACCEPTANCE.steps, "the schedule stays the acceptance run's"
    assert run.stop_after_steps == held_at + ACCEPTANCE.save_every_steps + RELAUNCH_STEPS


def test_the_hang_drill_stops_the_relaunch_steps_past_the_hung_step(make_spec, tmp_path) -> None:
    with pytest.raises(Submitted) as submitted:
        drill_hang(_context(make_spec, tmp_path))
    hang_step = submitted.value.environment.drill_points.hang_in_step.step
    assert submitted.value.train.run.stop_after_steps == hang_step + RELAUNCH_STEPS < ACCEPTANCE.steps


def test_the_storage_outage_drill_holds_around_its_outage_and_stops_past_the_save_after_it(make_spec, tmp_path) -> None:
    with pytest.raises(Submitted) as submitted:
        drill_storage_outage(_context(make_spec, tmp_path))
    every = ACCEPTANCE.save_every_steps
    points = submitted.value.environment.drill_points
    assert (points.hold_after_step.step, points.hold_again_after_step.step) == (every, 2 * every)
    assert points.hold_after_step.marker_dir != points.hold_again_after_step.marker_dir  # released apart
    assert submitted.value.train.run.stop_after_steps == 3 * every + RELAUNCH_STEPS


class StalledLauncher:
    """A launcher whose job runs on without progress; it records how it was stopped."""

    def __init__(self) -> None:
        self.stopped: str | None = None

    def status(self, handle: JobHandle) -> JobStatus:
        return JobStatus(JobState.CANCELLED if self.stopped else JobState.RUNNING, "")

    def unreachable_hosts(self, handle: JobHandle) -> list[str]:
        return []

    def cancel(self, handle: JobHandle) -> None:
        self.stopped = "cancel"

    def stop_stalled(self, handle: JobHandle) -> None:
        self.stopped = "stop_stalled"


def test_a_job_without_progress_is_stopped_as_stalled_not_cancelled_with_a_checkpoints_grace(
    make_spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = workspace.Job.__new__(workspace.Job)
    job.train, job.progress_step, job.phase = make_spec().training_config(), "acceptance", "test"
    job.launcher, job.output_dir = StalledLauncher(), tmp_path
    job.handle = JobHandle("local", "1", "stalled", str(tmp_path), str(tmp_path / "log"))
    monkeypatch.setattr(workspace, "last_step", lambda _: 5)
    monkeypatch.setattr(workspace, "steps_lost", lambda *_: SimpleNamespace(describe=lambda: "none"))
    started = time.monotonic()
    outcome = job.wait(timeout_s=30, stall_timeout_s=0.3)
    assert job.launcher.stopped == "stop_stalled" and outcome.stalled_after_step == 5
    assert time.monotonic() - started < 10


def test_the_local_launcher_stops_a_stalled_job_with_a_short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(LocalLauncher, "cancel", lambda self, handle, **kwargs: calls.append(kwargs))
    LocalLauncher().stop_stalled(JobHandle("local", "1", "stalled", "/nonexistent", "/nonexistent/log"))
    assert calls[0]["grace_s"] == STALLED_STOP_GRACE_S <= 5  # not torchrun's 30 s: no rank reaches a step boundary


def test_a_second_hold_waits_for_its_own_release_after_the_first_was_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "before", tmp_path / "after"
    points = DrillPoints(
        hold_after_step={"step": 2, "marker_dir": str(first), "timeout_s": 60},
        hold_again_after_step={"step": 4, "marker_dir": str(second), "timeout_s": 0.3},
    )
    monkeypatch.setattr(drill_points, "active", lambda: points)
    assert [drill_points.holds_after(s) for s in (1, 2, 3, 4, 5)] == [False, True, False, True, False]
    first.mkdir()
    (first / RELEASE_FILE).touch()
    drill_points.hold(2)
    started = time.monotonic()
    drill_points.hold(4)  # the first release does not let it go: its own timeout does
    assert time.monotonic() - started >= 0.3
    assert [m.step for m in paused_ranks(str(second), HOLD_MARKER_PREFIX)] == [4]
