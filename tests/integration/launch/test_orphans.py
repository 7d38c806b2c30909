"""Local jobs do not outlive their supervisor: killed outright, it takes its agents and workers along.

Each test stops exactly the processes it started (by pid, through the job's own cancel).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.launch.base import JobHandle, JobState
from tasks.launch.environment import JobEnvironment
from tasks.launch.local import LocalLauncher, start_local
from tests.conftest import REPO, process_running
from tests.faults.job import injected
from tests.processes import start_group

pytestmark = pytest.mark.integration

# A supervisor in a process of its own: submits a local job (supervised or not) and waits for it or not.
_SUBMITTER = """
import sys
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from tasks.launch.local import LocalLauncher, run_local
from training.config import TrainConfig
cluster, train = ClusterConfig.model_validate_json(sys.argv[1]), TrainConfig.from_json_file(sys.argv[2])
environment = JobEnvironment.model_validate_json(sys.argv[3])
if sys.argv[4] == "run":
    run_local(cluster, train, environment=environment)
else:
    LocalLauncher().submit(cluster, train, "detached", environment=environment, supervised=False)
"""


def _start_submitter(spec, tmp_path: Path, mode: str, faults: dict | None = None) -> subprocess.Popen:  # noqa: ANN001
    config = tmp_path / f"{mode}.json"
    spec.training_config().to_json_file(config)
    environment = (injected(**faults) if faults else JobEnvironment()).model_dump_json()
    command = [sys.executable, "-c", _SUBMITTER, spec.cluster.model_dump_json(), str(config), environment, mode]
    return start_group(command, cwd=REPO)


def _handle(out: Path, since: float, timeout_s: float = 120) -> JobHandle:
    deadline = time.monotonic() + timeout_s
    while True:
        record = out / "job.json"
        if record.exists() and record.stat().st_mtime >= since:
            return JobHandle.from_json(json.loads(record.read_text()))
        assert time.monotonic() < deadline, "the job was never recorded"
        time.sleep(0.1)


def _wait_running(handle: JobHandle, timeout_s: float = 120) -> list[int]:
    """Wait until every rank has started; returns the worker pids."""
    deadline = time.monotonic() + timeout_s
    while LocalLauncher().status(handle).state is not JobState.RUNNING:
        assert time.monotonic() < deadline, Path(handle.log_path).read_text()[-3000:]
        time.sleep(0.2)
    return [r["pid"] for r in json.loads(Path(handle.output_dir, "ranks.json").read_text())["ranks"]]


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _agents(wrapper: int) -> list[int]:
    """The torchrun agent under a job's wrapper (not the wrapper's watchdog)."""
    found = []
    for pid in _children(wrapper):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        argv = cmdline.split(b"\0")
        if argv[0] != b"/bin/sh" and (b"torch.distributed.run" in argv or b"tasks.launch.agent" in argv):
            found.append(pid)
    return found


def _gone_within(pids: list[int], timeout_s: float) -> list[int]:
    """Poll until none of `pids` runs (or the time is up); returns those still running."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if process_running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def test_sigkilling_a_supervised_runs_process_group_stops_every_agent_and_worker(make_spec, tmp_path: Path) -> None:
    spec = make_spec({"run": {"steps": 50}, "cluster": {"nodes": 2, "procs_per_node": 1}})
    out = Path(spec.run.output_url)
    since = time.time() - 1
    submitter = _start_submitter(spec, tmp_path, "run", {"pause_after_step": 2})
    handle = None
    try:
        handle = _handle(out, since)
        workers = _wait_running(handle)
        wrappers = [a["pid"] for a in handle.details["agents"]]
        agents = [agent for wrapper in wrappers for agent in _agents(wrapper)]
        assert len(agents) == 2 and all(process_running(p) for p in wrappers + agents + workers)
        assert handle.details["supervisor"]["pid"] == submitter.pid
        os.killpg(submitter.pid, signal.SIGKILL)
        submitter.wait(timeout=30)
        assert not _gone_within(wrappers + agents + workers, 120), "the job kept running without its supervisor"
        status = LocalLauncher().status(handle)
        assert status.state is JobState.CANCELLED
        assert f"its supervising process (pid {submitter.pid}) exited" in status.reason
    finally:
        if submitter.poll() is None:
            os.killpg(submitter.pid, signal.SIGKILL)
            submitter.wait(timeout=30)
        if handle is not None:
            LocalLauncher().cancel(handle, grace_s=10)


def test_a_detached_job_outlives_the_process_that_submitted_it(make_spec, tmp_path: Path) -> None:
    spec = make_spec({"run": {"steps": 8}, "checkpoint": {"save_every_steps": None}})
    out = Path(spec.run.output_url)
    since = time.time() - 1
    submitter = _start_submitter(spec, tmp_path, "submit")
    handle = _handle(out, since)
    try:
        assert submitter.wait(timeout=60) == 0 and handle.details["supervisor"] is None
        deadline = time.monotonic() + 180
        while not (status := LocalLauncher().status(handle)).state.terminal:
            assert time.monotonic() < deadline, Path(handle.log_path).read_text()[-3000:]
            time.sleep(0.2)
        assert status.state is JobState.SUCCEEDED, status.describe()
        assert json.loads((out / "result.json").read_text())["steps"] == 8
    finally:
        LocalLauncher().cancel(handle, grace_s=10)


def test_a_torchrun_agent_killed_outright_takes_its_workers_with_it(make_spec) -> None:
    spec = make_spec({"run": {"steps": 50}})
    job = start_local(spec.cluster, spec.training_config(), environment=injected(pause_after_step=2))
    try:
        workers = _wait_running(job.handle)
        (agent,) = _agents(job.handle.details["agents"][0]["pid"])
        os.kill(agent, signal.SIGKILL)
        assert not _gone_within(workers, 120), "workers kept training after their agent was killed"
        assert job.wait(timeout_s=60).state is JobState.FAILED  # the wrapper records the agent's end
    finally:
        job.cancel()
