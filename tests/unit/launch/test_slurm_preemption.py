"""The sbatch script's preemption handling and the Slurm states of a preempted job.

The script is run with bash against stand-in Slurm tools: an `srun` that stands for the trainer (on USR1 or
TERM it appends a preemption record and exits 75, as training/preemption.py says), a `scancel` that passes
the signal to it as Slurm passes one to a job's steps, and a `scontrol` that records a requeue and shows the
job with or without a PreemptTime.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tasks.errors import UserError
from tasks.launch.base import JobHandle, JobState
from tasks.launch.slurm import SlurmLauncher, slurm_state
from training.preemption import PREEMPTED_EXIT_CODE, PREEMPTIONS_FILE

SRUN = """#!/bin/bash
echo $$ > "$RECORDS/srun.pid"
record() { echo "{\\"step\\": 3, \\"signal\\": \\"$1\\"}" >> "$OUT/preemptions.jsonl"; exit 75; }
trap 'record SIGUSR1' USR1
trap 'record SIGTERM' TERM
touch "$RECORDS/started"
while [ ! -f "$RECORDS/finish" ]; do sleep 0.05; done
"""
SCANCEL = """#!/bin/sh
echo "$@" >> "$RECORDS/scancel"
kill -USR1 "$(cat "$RECORDS/srun.pid")"
"""
SCONTROL = """#!/bin/sh
case "$1 $2" in
  "show hostnames") echo node-1 ;;
  "show job") echo "JobId=$SLURM_JOB_ID JobState=RUNNING Restarts=0 PreemptTime=$PREEMPT_TIME" ;;
  "--all show") exit 1 ;;
  "show partition") printf '%s\\n' "PartitionName=debug Hidden=NO State=UP" \\
      "PartitionName=low Hidden=YES State=UP" "PartitionName=high Hidden=YES State=UP" ;;
  *) echo "$@" >> "$RECORDS/scontrol" ;;
esac
"""


@pytest.fixture
def job(tmp_path: Path, make_spec):  # noqa: ANN001, ANN201 - a small harness object
    """The rendered script of a preemptible tiny spec, with the stand-in tools and a runner."""
    bin_dir, records, out = tmp_path / "bin", tmp_path / "records", tmp_path / "out dir"
    for folder in (bin_dir, records, out):
        folder.mkdir()
    for name, text in {"srun": SRUN, "scancel": SCANCEL, "scontrol": SCONTROL}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # The stand-in srun is the trainer's step: the health gate's steps (tests/unit/launch/test_health_gate_render.py)
    # are left out.
    spec = make_spec({"cluster": {"scheduler": "slurm", "preemption": {"grace_period_s": 45},
                                  "health_gate": {"level": "off"}}})  # fmt: skip
    script = tmp_path / "job.sbatch"
    script.write_text(SlurmLauncher().render(spec.cluster, f"{out}/run.json", "tiny", str(out), None))

    class Job:
        def start(self, preempt_time: str = "None") -> subprocess.Popen[str]:
            env = {
                "PATH": f"{bin_dir}:/usr/bin:/bin", "RECORDS": str(records), "OUT": str(out),
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node-1", "PREEMPT_TIME": preempt_time,
            }  # fmt: skip
            proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 30
            while not (records / "started").exists():
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.05)
            time.sleep(0.2)  # the batch shell reaches its `wait`
            return proc

        def srun_pid(self) -> int:
            return int((records / "srun.pid").read_text())

        def finish(self, proc: subprocess.Popen[str]) -> tuple[int, str]:
            stdout, _ = proc.communicate(timeout=30)
            return proc.returncode, stdout

        def calls(self, tool: str) -> list[str]:
            path = records / tool
            return path.read_text().splitlines() if path.exists() else []

        def preemptions(self) -> list[dict]:
            return [json.loads(line) for line in (out / PREEMPTIONS_FILE).read_text().splitlines()]

    return Job()


def test_the_script_asks_for_the_warning_signal_at_the_grace_period_and_for_requeue(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "preemption": {"grace_period_s": 300}}})
    lines = SlurmLauncher().render(spec.cluster, "/r/run.json", "tiny", "/r", None).splitlines()
    assert "#SBATCH --signal=B:USR1@300" in lines and "#SBATCH --requeue" in lines
    off = make_spec({"cluster": {"scheduler": "slurm", "preemption": {"enabled": False}}})
    script = SlurmLauncher().render(off.cluster, "/r/run.json", "tiny", "/r", None)
    assert "--signal" not in script and "--requeue" not in script and "trap" not in script


def test_priority_fields_reach_sbatch_as_directives(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "slurm": {"partition": "low", "qos": "scavenger", "nice": 50}}})
    lines = SlurmLauncher().render(spec.cluster, "/r/run.json", "tiny", "/r", None).splitlines()
    assert {"#SBATCH --partition=low", "#SBATCH --qos=scavenger", "#SBATCH --nice=50"} <= set(lines)


def test_the_time_limit_warning_reaches_the_trainer_and_the_job_requeues_itself(job) -> None:  # noqa: ANN001
    proc = job.start()
    os.kill(proc.pid, signal.SIGUSR1)  # --signal=B:USR1@N: Slurm signals the batch shell only
    code, stdout = job.finish(proc)
    assert code == PREEMPTED_EXIT_CODE, stdout
    assert job.calls("scancel") == ["--signal=USR1 4242"], "forwarded to the job's steps"
    assert job.preemptions() == [{"step": 3, "signal": "SIGUSR1"}]
    assert job.calls("scontrol") == ["requeue 4242"]


def test_a_preempted_job_that_checkpointed_within_grace_time_requeues_itself(job) -> None:  # noqa: ANN001
    proc = job.start(preempt_time="2026-12-02T16:33:52")
    os.kill(job.srun_pid(), signal.SIGTERM)  # a preemption signals the tasks, not the batch shell
    code, stdout = job.finish(proc)
    assert code == PREEMPTED_EXIT_CODE, stdout
    assert job.calls("scontrol") == ["requeue 4242"] and not job.calls("scancel")


def test_a_cancelled_job_that_checkpointed_stays_cancelled(job) -> None:  # noqa: ANN001
    proc = job.start()
    os.kill(proc.pid, signal.SIGTERM)  # scancel signals the batch shell and the steps: the shell waits
    os.kill(job.srun_pid(), signal.SIGTERM)
    code, stdout = job.finish(proc)
    assert code == PREEMPTED_EXIT_CODE, stdout
    assert job.preemptions() == [{"step": 3, "signal": "SIGTERM"}]
    assert job.calls("scontrol") == [], "no PreemptTime and no warning: no requeue"


def test_a_job_that_finishes_exits_zero_without_requeue(job, tmp_path: Path) -> None:  # noqa: ANN001
    proc = job.start()
    (tmp_path / "records" / "finish").touch()
    code, stdout = job.finish(proc)
    assert code == 0, stdout
    assert job.calls("scontrol") == [] and not (tmp_path / "out dir" / PREEMPTIONS_FILE).exists()


def test_slurm_states_of_a_preempted_job() -> None:
    assert slurm_state("PREEMPTED") is JobState.PREEMPTED, "not requeued: resubmit to resume"
    assert slurm_state("FAILED", PREEMPTED_EXIT_CODE) is JobState.PREEMPTED, "checkpointed, requeue refused"
    assert slurm_state("TIMEOUT", PREEMPTED_EXIT_CODE) is JobState.PREEMPTED
    assert slurm_state("FAILED", 1) is JobState.FAILED and slurm_state("CANCELLED", PREEMPTED_EXIT_CODE).terminal
    assert slurm_state("CANCELLED by 0", PREEMPTED_EXIT_CODE) is JobState.CANCELLED
    assert slurm_state("REQUEUED") is JobState.PENDING


def test_a_requeued_job_reports_pending_with_slurms_reason(tmp_path: Path) -> None:
    squeue = tmp_path / "squeue"
    squeue.write_text("#!/bin/sh\necho 'PENDING|BeginTime'\n")
    squeue.chmod(0o755)
    handle = JobHandle("slurm", "7", "tiny", str(tmp_path), str(tmp_path / "slurm-7.out"))
    status = SlurmLauncher({"PATH": f"{tmp_path}:/usr/bin:/bin"}).status(handle)
    assert (status.state, status.reason) == (JobState.PENDING, "BeginTime")


def test_an_unknown_partition_offers_the_visible_ones_only(job, tmp_path: Path, make_spec) -> None:  # noqa: ANN001
    for tool in ("sbatch", "squeue", "scancel"):
        (tmp_path / "bin" / tool).write_text("#!/bin/sh\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    spec = make_spec({"cluster": {"scheduler": "slurm", "slurm": {"partition": "gpu"}}})
    launcher = SlurmLauncher({"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
    with pytest.raises(UserError, match=r"cluster\.slurm\.partition=gpu: no such partition; use one of \['debug'\]"):
        launcher.check(spec.cluster)
