"""Live recovery under `tdeploy train`'s own launcher: a local job with fault_tolerance.mode=replica_groups runs its
groups under a torchft lighthouse through the local launcher (tasks/launch/replica_supervisor.py), and status,
cancel, preemption and the workload-error record work on it as on any local job. Real processes throughout."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tasks.launch.base import JobState
from tasks.launch.environment import JobEnvironment
from tasks.launch.local import REPLICAS_DIR, LocalLauncher
from tasks.launch.replica_supervisor import PROCESSES_FILE
from training.failure import read_failure
from training.preemption import PREEMPTED_EXIT_CODE
from training.process import alive
from training.recovery_record import recovery_events
from training.run_output import RunOutput

pytestmark = pytest.mark.integration


def _spec(make_spec, steps: int, name: str):
    return make_spec(
        {
            "run": {"steps": steps, "log_every_steps": 1},
            "checkpoint": {"save_every_steps": 100},
            "cluster": {"max_restarts": 1},
            "fault_tolerance": {"mode": "replica_groups", "replica_groups": 2, "heartbeat_timeout_s": 1.0},
        },
        name=name,
    )


def _until_step(launcher: LocalLauncher, handle, out: RunOutput, step: int, timeout_s: float = 240) -> int:
    """Wait until `out` recorded `step` while the job runs; the step it reached."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if out.metric_ranks() and out.last_step() >= step:
            return out.last_step()
        status = launcher.status(handle)
        assert not status.state.terminal, (status.describe(), launcher._log_text(handle)[-3000:])
        time.sleep(0.1)
    raise AssertionError(f"{out} did not reach step {step} in {timeout_s} s")


def _started(out: Path) -> list[tuple[int, str]]:
    """The lighthouse's and the group agents' pids and start times, as the supervisor recorded them."""
    return [(p["pid"], p["start_time"]) for p in json.loads((out / REPLICAS_DIR / PROCESSES_FILE).read_text())]


def test_a_local_job_heals_a_killed_replica_group_from_its_peer_and_ends_with_the_groups_result(make_spec) -> None:
    spec = _spec(make_spec, steps=200, name="heal")
    train = spec.training_config()
    out = Path(train.run.output_url)
    launcher = LocalLauncher()
    handle = launcher.submit(spec.cluster, train, "ft-heal")
    try:
        healthy, lost = RunOutput(out / "replica-0"), RunOutput(out / "replica-1")
        killed_at = _until_step(launcher, handle, lost, 8)
        for rank in lost.ranks().ranks:
            os.kill(rank["pid"], signal.SIGKILL)
        status = launcher.wait(handle, timeout_s=300)
    finally:
        if not launcher.status(handle).state.terminal:
            launcher.cancel(handle)
    assert status.state == JobState.SUCCEEDED, (status.describe(), launcher._log_text(handle)[-3000:])
    live = [e for e in recovery_events(str(lost.dir)) if e.rung == "live"]
    assert len(live) == 1 and live[0].restored_step >= killed_at  # pulled from the peer: no step lost
    assert [e.attempt for e in recovery_events(str(healthy.dir))] == [0]  # the healthy group never reloaded
    assert RunOutput(out).result() == healthy.result() and healthy.result().steps == 200
    assert lost.params() and {r: p.pieces for r, p in lost.params().items()} == {
        r: p.pieces for r, p in healthy.params().items()
    }
    assert not any(alive(pid, started) for pid, started in _started(out))  # the lighthouse went with the job


def test_cancel_stops_every_group_and_the_lighthouse(make_spec) -> None:
    spec = _spec(make_spec, steps=100_000, name="cancel")
    train = spec.training_config()
    out = Path(train.run.output_url)
    launcher = LocalLauncher()
    handle = launcher.submit(spec.cluster, train, "ft-cancel")
    try:
        _until_step(launcher, handle, RunOutput(out / "replica-1"), 2)
        started = _started(out)
        workers = [r["pid"] for g in (0, 1) for r in RunOutput(out / f"replica-{g}").ranks().ranks]
    finally:
        launcher.cancel(handle)
    assert launcher.status(handle).state == JobState.CANCELLED
    assert len(started) == 3 and not any(alive(pid, when) for pid, when in started)
    assert workers and not any(alive(pid, None) for pid in workers)


def test_a_preempted_replica_groups_job_checkpoints_and_ends_preempted(make_spec) -> None:
    spec = _spec(make_spec, steps=100_000, name="preempt")
    train = spec.training_config()
    out = Path(train.run.output_url)
    launcher = LocalLauncher()
    handle = launcher.submit(spec.cluster, train, "ft-preempt")
    try:
        _until_step(launcher, handle, RunOutput(out / "replica-1"), 3)
        launcher.signal(handle, signal.SIGTERM)
        status = launcher.wait(handle, timeout_s=120)
    finally:
        if not launcher.status(handle).state.terminal:
            launcher.cancel(handle)
    assert status.state == JobState.PREEMPTED and status.exit_code == PREEMPTED_EXIT_CODE, status.describe()
    assert "preempted at step" in status.reason
    for group in (0, 1):  # each group wrote its checkpoint at the step it stopped
        assert RunOutput(out / f"replica-{group}").checkpoints()


def test_a_nan_loss_in_the_groups_is_recorded_for_the_restart_policy_and_fails_the_job(make_spec) -> None:
    spec = _spec(make_spec, steps=50, name="nan")
    train = spec.training_config()
    launcher = LocalLauncher()
    environment = JobEnvironment().with_drill_points(nan_loss={"step": 3})
    handle = launcher.submit(spec.cluster, train, "ft-nan", environment=environment)
    try:
        status = launcher.wait(handle, timeout_s=240)
    finally:
        if not launcher.status(handle).state.terminal:
            launcher.cancel(handle)
    assert status.state == JobState.FAILED, status.describe()
    found = read_failure(train.run.output_url)  # the job's own output, where the launch step's policy reads it
    assert found is not None and (found.cause, found.step) == ("nan_loss", 3)
    assert "replica group" in launcher._log_text(handle)
