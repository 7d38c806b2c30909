"""Preemption in the spec, torchrun's arguments, the Kubernetes manifest and states, the local launcher's state of
a preempted job, and preemptions.jsonl as an untrusted file."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.errors import UserError
from tasks.launch.base import JobHandle, JobState
from tasks.launch.kubernetes import job_status, render_manifests, validate_pytorchjob
from tasks.launch.local import LocalLauncher
from tasks.launch.torchrun import agent_args
from training.preemption import (
    PREEMPTED_EXIT_CODE,
    PREEMPTIONS_FILE,
    PreemptionFileError,
    PreemptionRecord,
    append_record,
    read_records,
    records_since,
)


def test_torchrun_passes_sigusr1_on_and_waits_the_grace_period(make_spec) -> None:
    spec = make_spec({"cluster": {"preemption": {"grace_period_s": 300}}})
    args = agent_args(spec.cluster)
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in args
    assert "--shutdown-timeout=300" in args
    off = agent_args(make_spec({"cluster": {"preemption": {"enabled": False}}}).cluster)
    assert not [a for a in off if a.startswith(("--signals-to-handle", "--shutdown-timeout"))]


@pytest.mark.parametrize(
    ("preemption", "expected"),
    [
        ({"grace_period_s": 5}, "cluster.preemption.grace_period_s=5: must be >= 10"),
        ({"grace_period_s": 100_000}, "cluster.preemption.grace_period_s=100000: must be <= 3600"),
        ({"grace_period_s": "2m"}, "cluster.preemption.grace_period_s=2m"),
        ({"enabled": "yes"}, "cluster.preemption.enabled=yes: 'yes' is not true or false"),
        ({"signal": "SIGKILL"}, "cluster.preemption.signal"),
    ],
)
def test_bad_preemption_settings_are_refused_by_the_spec(make_spec, preemption: dict, expected: str) -> None:
    with pytest.raises((ValidationError, UserError, ValueError)) as caught:
        make_spec({"cluster": {"preemption": preemption}})
    assert expected in str(caught.value)


def test_the_pods_get_the_grace_period_and_an_agent_that_exits_75(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "kubernetes": {"api": "pytorchjob"}, "nodes": 2,
                                  "preemption": {"grace_period_s": 240}}})
    _, job = render_manifests(spec.cluster, spec.training_config(), "tiny", "img:1")
    validate_pytorchjob(job)
    for role in ("Master", "Worker"):
        pod = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 240
        command = pod["containers"][0]["command"]
        assert command[:3] == ["python", "-m", "training.preemption"]
        assert "--shutdown-timeout=240" in command and any("SIGUSR1" in word for word in command)
    off = make_spec({"cluster": {"scheduler": "kubernetes", "kubernetes": {"api": "pytorchjob"},
                                 "preemption": {"enabled": False}}})
    _, job = render_manifests(off.cluster, off.training_config(), "tiny", "img:1")
    assert "terminationGracePeriodSeconds" not in job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def _pod(name: str, code: int, key: str = "state") -> dict:
    return {
        "metadata": {"name": name},
        "status": {"containerStatuses": [{"name": "pytorch", key: {"terminated": {"exitCode": code}}}]},
    }


def test_a_failed_pytorchjob_whose_pods_exited_75_is_preempted() -> None:
    failed = {"status": {"conditions": [{"type": "Running"}, {"type": "Failed", "reason": "PyTorchJobFailed"}]}}
    status = job_status(failed, [_pod("llm-master-0", 75), _pod("llm-worker-0", 75, "lastState")])
    assert status.state is JobState.PREEMPTED and status.exit_code == PREEMPTED_EXIT_CODE
    assert "llm-master-0, llm-worker-0" in status.reason and "resubmit" in status.reason
    crashed = job_status(failed, [_pod("llm-master-0", 1)])
    assert crashed.state is JobState.FAILED and crashed.reason == "PyTorchJobFailed"
    done = job_status({"status": {"conditions": [{"type": "Succeeded"}]}}, [])
    assert done.state is JobState.SUCCEEDED


def _finished_job(out: Path, codes: list[int], submitted: float) -> JobHandle:
    """A local job whose agents have exited with `codes` (the pid of a process that is gone)."""
    out.mkdir(parents=True, exist_ok=True)
    for node, code in enumerate(codes):
        (out / f"exit-{node}.txt").write_text(f"{code}\n")
    (out / "train.log").write_text("")
    gone = {"pid": 2**22 + 1, "start_time": "1"}
    return JobHandle("local", "job-1", "job", str(out), str(out / "train.log"), submitted,
                     details={"agents": [gone] * len(codes)})  # fmt: skip


def _record(step: int, when: float, run_id: str | None = "job-1") -> PreemptionRecord:
    return PreemptionRecord(step, "SIGTERM", 1.5, f"/ck/step-{step:08d}", when, run_id, 2)


def test_the_local_launcher_reports_a_preempted_job_as_preempted_not_failed(tmp_path: Path) -> None:
    handle = _finished_job(tmp_path / "out", [75, 75], submitted=time.time() - 10)
    assert LocalLauncher().status(handle).state is JobState.FAILED  # exit 75 without a record: not a preemption
    append_record(handle.output_dir, _record(3, time.time() - 100))  # an earlier job's
    append_record(handle.output_dir, _record(4, time.time(), run_id="another-job"))
    assert LocalLauncher().status(handle).state is JobState.FAILED
    append_record(handle.output_dir, _record(7, time.time()))
    status = LocalLauncher().status(handle)
    assert status.state is JobState.PREEMPTED and status.exit_code == PREEMPTED_EXIT_CODE
    assert status.reason == "preempted at step 7 by SIGTERM; resubmit to resume from checkpoint step 7"


def test_a_malformed_preemption_record_is_refused_with_its_file_and_line(tmp_path: Path) -> None:
    handle = _finished_job(tmp_path / "out", [75], submitted=time.time() - 10)
    append_record(handle.output_dir, _record(7, time.time()))
    path = tmp_path / "out" / PREEMPTIONS_FILE
    with path.open("a") as file:
        file.write('{"step": "7; rm -rf /", "signal": "SIGTERM"}\n')
    with pytest.raises(PreemptionFileError, match=rf"{PREEMPTIONS_FILE} line 2: field 'step'"):
        read_records(handle.output_dir)
    status = LocalLauncher().status(handle)
    assert status.state is JobState.FAILED and f"{path} line 2" in status.reason and "remove that line" in status.reason
    path.write_text("not json\n")
    with pytest.raises(PreemptionFileError, match="line 1: not JSON"):
        read_records(handle.output_dir)


def test_records_round_trip_and_are_kept_apart_by_time_and_run(tmp_path: Path) -> None:
    now = time.time()
    for step, when, run in [(2, now - 50, "a"), (5, now, "b"), (6, now, None)]:
        append_record(str(tmp_path), _record(step, when, run))
    assert [r.step for r in read_records(str(tmp_path))] == [2, 5, 6]
    assert [r.step for r in records_since(str(tmp_path), now - 1, run_id="b")] == [5, 6]
    lines = (tmp_path / PREEMPTIONS_FILE).read_text().splitlines()
    assert json.loads(lines[0])["signal_to_exit_s"] == 1.5 and not list(tmp_path.glob("*.tmp-*"))


def test_only_preemption_signals_are_delivered(tmp_path: Path) -> None:
    handle = _finished_job(tmp_path / "out", [0], submitted=time.time())
    with pytest.raises(UserError, match="SIGKILL: not a preemption signal"):
        LocalLauncher().signal(handle, signal.SIGKILL)
    LocalLauncher().signal(handle, signal.SIGUSR1)  # no agent runs any more: nothing to deliver to
