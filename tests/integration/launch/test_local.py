"""The local launcher: a job succeeds, a crashing rank is named, cancel leaves nothing running."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tasks.errors import UserError
from tasks.launch.base import JobState, find_job
from tasks.launch.local import LocalLauncher, TrainingFailed, run_local, start_local
from tests.conftest import process_running
from tests.faults.job import injected

pytestmark = pytest.mark.integration


def _live_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            members.append(int(stat.parent.name))
    return members


def test_two_process_job_succeeds_and_is_found_again_by_reference(make_spec, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TDEPLOY_HOME", str(tmp_path / "home"))
    spec = make_spec({"run": {"steps": 6}})
    job = start_local(spec.cluster, spec.training_config(), name="ok")
    seen = {job.status().state}
    while not (state := job.status().state).terminal:
        seen.add(state)
        time.sleep(0.2)
    assert state is JobState.SUCCEEDED and JobState.RUNNING in seen
    again = find_job(job.handle.ref)
    assert again == job.handle and LocalLauncher().status(again).state is JobState.SUCCEEDED
    per_rank = sorted(p.parent.name for p in (job.output_dir / "logs").rglob("stderr.log"))
    assert per_rank == ["0", "1"]  # one log file per rank


def test_a_crashing_rank_is_reported_with_its_error(make_spec) -> None:
    spec = make_spec({"run": {"steps": 6}})
    faults = injected(crash_at_step=3, crash_rank=1)
    with pytest.raises(TrainingFailed) as caught:
        run_local(spec.cluster, spec.training_config(), environment=faults)
    status = caught.value.status
    assert status.state is JobState.FAILED and status.failure is not None
    assert status.failure.rank == 1 and status.failure.exitcode == 1
    assert "RuntimeError: test fault: injected crash on rank 1 after step 3" in status.failure.error
    assert "rank 1 (local rank 1)" in status.describe()


def test_cancel_ends_every_process_of_the_job(make_spec) -> None:
    spec = make_spec({"run": {"steps": 50}})
    job = start_local(spec.cluster, spec.training_config(), environment=injected(pause_after_step=2))
    deadline = time.monotonic() + 120
    while job.status().state is not JobState.RUNNING:
        assert time.monotonic() < deadline, job.log_tail()
        time.sleep(0.2)
    workers = [r["pid"] for r in json.loads((job.output_dir / "ranks.json").read_text())["ranks"]]
    agents = [a["pid"] for a in job.handle.details["agents"]]
    assert all(process_running(pid) for pid in workers + agents)
    job.cancel()
    assert job.status().state is JobState.CANCELLED
    assert not [pid for pid in workers + agents if process_running(pid)]
    assert not _live_members(agents[0])  # nothing of the agent's process group runs (zombies aside)


def test_a_second_job_in_the_folder_of_a_running_one_is_refused_before_anything_is_touched(make_spec) -> None:
    spec = make_spec({"run": {"steps": 50}})
    job = start_local(spec.cluster, spec.training_config(), environment=injected(pause_after_step=2))
    try:
        deadline = time.monotonic() + 120
        while job.status().state is not JobState.RUNNING:
            assert time.monotonic() < deadline, job.log_tail()
            time.sleep(0.2)
        before = {name: (job.output_dir / name).read_bytes() for name in ("run.json", "train.log", "job.json")}
        again = make_spec({"run": {"steps": 60}})  # same folders, another run.json
        with pytest.raises(UserError) as refused:
            start_local(again.cluster, again.training_config(), name="again")
        agent = job.handle.details["agents"][0]["pid"]
        message = str(refused.value)
        assert f"job {job.handle.ref} still runs there (agent pid {agent}, since " in message
        assert f"tdeploy cancel {job.handle.ref}" in message
        after = {name: (job.output_dir / name).read_bytes() for name in before}
        assert {name: after[name] for name in ("run.json", "job.json")} == {
            name: before[name] for name in ("run.json", "job.json")
        }
        # The running job keeps appending to its own log; the refused start must not have rewritten it.
        assert after["train.log"].startswith(before["train.log"])
        assert b"again" not in after["train.log"][len(before["train.log"]) :]
        assert job.status().state is JobState.RUNNING
    finally:
        job.cancel()
    start_local(spec.cluster, spec.training_config(), name="after").cancel()  # a finished job no longer blocks
