"""A job's history from its output folder (metrics, preemptions.jsonl) and the scheduler's state now."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tasks.errors import UserError
from tasks.launch.base import JobHandle, JobState, JobStatus
from tasks.launch.history import build_history, steps_lost
from tests.conftest import TINY_SPEC
from tests.unit.checkpoints import saved_steps
from training.config import TrainConfig
from training.preemption import PREEMPTIONS_FILE, PreemptionRecord, append_record
from training.run_output import RunOutputWriter, StepRecord
from training.storage import StorageConfig

T0 = 1_796_229_000.0


def write_steps(out: Path, steps: list[int], start_s: float) -> None:
    """Rank 0's metrics of `steps`, one second apart from `start_s`."""
    writer = RunOutputWriter(str(out), StorageConfig())
    for i, step in enumerate(steps):
        writer.append_metrics(StepRecord(step=step, loss=1.0, time_unix_s=start_s + i))
    writer.close()


def preempt(out: Path, step: int, at_s: float, signal: str = "SIGTERM") -> None:
    append_record(str(out), PreemptionRecord(step, signal, 2.5, f"{out}/ckpt/step-{step:08d}", at_s))


def texts(history) -> list[str]:  # noqa: ANN001
    return [event.text for event in history.events]


def test_an_uninterrupted_run_ran_from_step_zero_and_finished(tmp_path: Path) -> None:
    write_steps(tmp_path, [1, 2, 3, 4], T0)
    history = build_history(tmp_path, JobStatus(JobState.SUCCEEDED, "COMPLETED"))
    assert texts(history) == ["running from step 0", "finished at step 4"] and history.steps_lost() == 0


def test_a_preempted_and_requeued_job_shows_each_phase_and_loses_no_step(tmp_path: Path) -> None:
    write_steps(tmp_path, [1, 2, 3, 4, 5], T0)
    preempt(tmp_path, 5, T0 + 4.5)
    pending = build_history(tmp_path, JobStatus(JobState.PENDING, "PENDING", "BeginTime"), restarts=1)
    assert texts(pending) == [
        "running from step 0",
        "preempted at step 5 (SIGTERM, 2.5 s from signal to exit, checkpoint saved)",
        "pending (BeginTime) to resume from step 5",
    ]
    assert pending.lines()[-1] == "  scheduler restarts (requeues): 1"
    starting = build_history(tmp_path, JobStatus(JobState.RUNNING, "RUNNING"))
    assert texts(starting)[-1] == "running again from step 5 (no new step recorded yet)"
    write_steps(tmp_path, [6, 7, 8], T0 + 30)
    done = build_history(tmp_path, JobStatus(JobState.SUCCEEDED, "COMPLETED"))
    assert [e.kind for e in done.events] == ["running", "preempted", "resumed", "finished"]
    assert texts(done)[2:] == ["running again from step 5", "finished at step 8"]
    assert done.steps_lost() == 0


def test_a_restart_from_an_older_checkpoint_counts_the_steps_that_ran_again(tmp_path: Path) -> None:
    write_steps(tmp_path, [1, 2, 3, 4, 5, 6], T0)
    write_steps(tmp_path, [5, 6, 7], T0 + 20)  # a crash after step 6; the checkpoint was step 4
    history = build_history(tmp_path, JobStatus(JobState.RUNNING, "RUNNING"))
    assert texts(history) == ["running from step 0", "restarted from step 4 (2 steps ran again)"]
    assert history.steps_lost() == 2


def test_a_job_preempted_for_good_says_to_resubmit(tmp_path: Path) -> None:
    write_steps(tmp_path, [1, 2, 3], T0)
    preempt(tmp_path, 3, T0 + 2.2, "SIGUSR1")
    history = build_history(tmp_path, JobStatus(JobState.PREEMPTED, "PREEMPTED"))
    assert texts(history)[1:] == [
        "preempted at step 3 (SIGUSR1, 2.5 s from signal to exit, checkpoint saved)",
        "stopped: preempted; resubmit to resume from step 3",
    ]


def test_a_malformed_preemption_record_is_refused_by_file_and_line(tmp_path: Path) -> None:
    write_steps(tmp_path, [1], T0)
    (tmp_path / PREEMPTIONS_FILE).write_text('{"step": 1, "signal": "SIGTERM"}\n')
    with pytest.raises(UserError, match=rf"{PREEMPTIONS_FILE} line 1: field 'signal_to_exit_s' is None"):
        build_history(tmp_path, JobStatus(JobState.RUNNING, "RUNNING"))


def test_tdeploy_status_of_a_local_output_folder_prints_the_history(tmp_path: Path) -> None:
    out = tmp_path / "output"
    write_steps(out, [1, 2], T0)
    preempt(out, 2, T0 + 1.5)
    write_steps(out, [3, 4], T0 + 10)
    (out / "exit-0.txt").write_text("0\n")
    dead_agent = {"pid": 2**22 + 1, "start_time": 1}  # above pid_max's default: never a live process
    handle = JobHandle("local", "x1", "tiny", str(out), str(out / "train.log"), details={"agents": [dead_agent]})
    (out / "job.json").write_text(json.dumps(handle.to_json()))
    result = CliRunner().invoke(app, ["status", str(out)], terminal_width=200)
    assert result.exit_code == 0, result.output
    lines = [re.sub(r"^ +(\d\d:\d\d:\d\d)? +", "", line) for line in result.output.splitlines()]
    assert lines == [
        "local:x1: succeeded (exited)",
        "running from step 0",
        "preempted at step 2 (SIGTERM, 2.5 s from signal to exit, checkpoint saved)",
        "running again from step 2",
        "finished at step 4",
    ], result.output


def test_a_stopped_job_loses_the_steps_it_trained_after_its_newest_checkpoint(tmp_path: Path) -> None:
    train = TrainConfig.model_validate({
        **{section: TINY_SPEC[section] for section in ("model", "parallel", "precision", "optim")},
        "data": {"dataset_url": str(tmp_path / "data")}, "checkpoint": {"url": str(tmp_path / "ckpt")},
        "run": {"output_url": str(tmp_path / "out"), "steps": 20},
    })  # fmt: skip
    write_steps(tmp_path / "out", [1, 2, 3, 4, 5, 6, 7], T0)
    saved_steps(tmp_path / "ckpt", 3, 6, 9)  # step 9: a later run's, past where this one stopped

    lost = steps_lost(train, tmp_path / "out")
    assert (lost.trained_to_step, lost.checkpoint_step, lost.steps) == (7, 6, 1)
    assert lost.describe() == "1 step(s) lost: trained to step 7, a resubmission resumes from the checkpoint of step 6"
    nothing = steps_lost(train.model_copy(update={"checkpoint": train.checkpoint.model_copy(
        update={"url": str(tmp_path / "none")})}), tmp_path / "out")  # fmt: skip
    assert nothing.steps == 7 and "resumes from no checkpoint" in nothing.describe()
