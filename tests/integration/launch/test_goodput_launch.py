"""Goodput where a launched job reports it: the job step's result and summary (local, no queue) and `tdeploy
status`'s history; Slurm's queue time from its accounting."""

from __future__ import annotations

import time

import pytest

from tasks.launch.base import JobHandle, JobState
from tasks.launch.history import job_history
from tasks.launch.local import LocalLauncher
from tasks.launch.slurm import SlurmLauncher
from tasks.launch.step import JobInputs, run
from training.health_gate import read_health_gate
from training.run_output import RunOutput

pytestmark = pytest.mark.integration


def test_a_finished_local_job_reports_its_goodput_in_the_step_result_and_its_status(make_spec) -> None:
    spec = make_spec({"run": {"steps": 4}, "checkpoint": {"save_every_steps": 2, "async_save": False}})
    result = run(JobInputs.of(spec, spec.training_config()))
    figures = result.goodput
    assert result.state == "succeeded" and figures is not None
    assert figures.badput_s["queue"] == 0.0  # a local job starts when it is submitted
    kept = RunOutput(result.output_dir).metrics(0)
    assert figures.productive_s + figures.badput_s["data_wait"] == pytest.approx(
        sum(r.step_time_s for r in kept.values()), rel=1e-6
    )
    assert figures.badput_s["startup"] > 0 and figures.badput_s["checkpoint_save"] > 0
    assert figures.badput_s["recovery"] == figures.badput_s["redone_steps"] == 0.0  # nothing failed
    gate = read_health_gate(result.output_dir)  # the local launcher's health gate, where it ran: start-up
    assert figures.badput_s["health_gate"] == pytest.approx(gate.seconds if gate else 0.0)
    assert figures.describe() in result.summary()

    handle = JobHandle.from_json(result.handle)
    history = job_history(handle, LocalLauncher())
    assert history.goodput is not None and history.lines()[-1].startswith("  goodput ")
    assert history.goodput.productive_s == figures.productive_s  # the same records


def test_slurm_reports_the_queue_time_of_a_job_from_its_submit_and_start_times(slurm_cluster, make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm"}, "run": {"steps": 2}})
    launcher = SlurmLauncher(slurm_cluster)
    handle = launcher.submit(spec.cluster, spec.training_config(), "tdeploy-goodput")
    deadline = time.monotonic() + 300
    running_seen = None
    while not (status := launcher.status(handle)).state.terminal:
        if running_seen is None and status.state is JobState.RUNNING:
            running_seen = time.time()
        assert time.monotonic() < deadline, launcher.logs(handle)[0][-20:]
        time.sleep(0.2)
    assert status.state is JobState.SUCCEEDED, "\n".join(launcher.logs(handle)[0][-40:])
    queue_s = launcher.queue_seconds(handle)
    assert queue_s is not None and queue_s >= 0.0
    if running_seen is not None:  # Slurm's times are whole seconds
        assert queue_s <= running_seen - handle.submitted_unix_s + 1.0
