"""The Slurm launcher's reading of `squeue --json`, on output recorded from the test cluster (Slurm 22.05.8).

slurm_22_05/ holds one `squeue --json -t all -j 4` and `scontrol show job N` of the same moment, for five jobs:
1 failed (exit 3), 2 cancelled, 3 requeued (pending, BeginTime), 4 running, 5 pending (Resources). Recorded by
starting the cluster of tests/integration/launch/conftest.py and submitting `sbatch --wrap` jobs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tasks.launch.base import JobState
from tasks.launch.slurm import controller_job, slurm_state

RECORDED = Path(__file__).parent / "slurm_22_05"
SQUEUE_JSON = (RECORDED / "squeue.json").read_text()


def scontrol_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job`'s Key=Value pairs for the recorded job."""
    text = (RECORDED / f"scontrol_show_job_{job_id}.txt").read_text()
    return dict(re.findall(r"(\w+)=(\S*)", text))


@pytest.mark.parametrize("job_id", ["1", "2", "3", "4", "5"])
def test_squeue_json_gives_the_state_reason_exit_code_and_restarts_that_scontrol_shows(job_id: str) -> None:
    job = controller_job(SQUEUE_JSON, job_id)
    fields = scontrol_fields(job_id)
    assert job is not None, f"job {job_id} is in the recording"
    assert (job.state, job.reason) == (fields["JobState"], fields["Reason"])
    assert job.exit_code == int(fields["ExitCode"].split(":")[0])
    assert job.restarts == int(fields["Restarts"])


def test_recorded_jobs_map_to_the_launchers_states() -> None:
    jobs = {job_id: controller_job(SQUEUE_JSON, job_id) for job_id in "12345"}
    states = {job_id: slurm_state(job.state, job.exit_code) for job_id, job in jobs.items() if job is not None}
    assert states == {
        "1": JobState.FAILED,
        "2": JobState.CANCELLED,
        "3": JobState.PENDING,
        "4": JobState.RUNNING,
        "5": JobState.PENDING,
    }
    failed = controller_job(SQUEUE_JSON, "1")
    assert failed is not None and failed.exit_code == 3, "22.05 gives the wait status (768): the code is its high byte"


def test_queue_seconds_is_start_less_submit_and_none_while_pending() -> None:
    running, requeued, pending = (controller_job(SQUEUE_JSON, job_id) for job_id in "435")
    assert running is not None and requeued is not None and pending is not None
    assert running.submit_unix_s is not None and running.start_unix_s is not None
    assert running.queue_seconds() == running.start_unix_s - running.submit_unix_s >= 0
    assert requeued.queue_seconds() is None, "a requeued job waits again (start_time 0)"
    assert pending.start_unix_s and pending.queue_seconds() is None, "a pending job's start is only an estimate"


def test_a_job_the_controller_no_longer_holds_is_none() -> None:
    assert controller_job(SQUEUE_JSON, "99") is None
    assert controller_job('{"jobs": []}', "1") is None
