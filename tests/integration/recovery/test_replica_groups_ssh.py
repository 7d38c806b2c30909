"""Live recovery through the SSH launcher: a job with fault_tolerance.mode=replica_groups on two hosts in network
namespaces (own names and addresses, real SSH) runs one replica group per host, the torchft lighthouse on the first
host (tasks/launch/replica_host.py). A group whose ranks are killed heals from the other host's group without
either reloading storage; cancel stops every group and the lighthouse. Real processes throughout."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.launch.base import JobHandle, JobState
from tasks.launch.environment import JobEnvironment
from tasks.launch.local import AGENTS_DIR, REPLICAS_DIR
from tasks.launch.replica_host import processes_file
from tasks.launch.ssh import SshLauncher, stop_remote
from tests.integration.nodes.conftest import require
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, start_cluster
from training.failure import read_failure
from training.preemption import PREEMPTED_EXIT_CODE
from training.process import alive, start_time
from training.recovery_record import recovery_events
from training.run_output import RunOutput

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Two hosts on a bridge, one replica group of one rank on each."""
    require("netns")
    cluster = start_cluster(tmp_path_factory.mktemp("replica-hosts"), [HostSpec("host-a"), HostSpec("host-b")], "netns")
    try:
        yield cluster
    finally:
        cluster.close()


def _spec(make_spec, hosts: SshdCluster, steps: int, name: str):  # noqa: ANN202 - a DeploymentSpec
    return make_spec(
        {
            "run": {"steps": steps, "log_every_steps": 1},
            "checkpoint": {"save_every_steps": 100},
            "cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1, "max_restarts": 1},
            "nodes": hosts.nodes_section(),
            "fault_tolerance": {"mode": "replica_groups", "replica_groups": 2, "heartbeat_timeout_s": 1.0},
        },
        name=name,
    )


def _until_step(launcher: SshLauncher, handle, out: RunOutput, step: int, timeout_s: float = 240) -> int:
    """Wait until `out` recorded `step` while the job runs; the step it reached."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if out.metric_ranks() and out.last_step() >= step:
            return out.last_step()
        status = launcher.status(handle)
        assert not status.state.terminal, (status.describe(), launcher._log_text(handle)[-3000:])
        time.sleep(0.1)
    raise AssertionError(f"{out} did not reach step {step} in {timeout_s} s")


def _started(out: Path) -> list[tuple[str, int, str]]:
    """What each host side started (the lighthouse, its group's agent) and the host sides themselves: role, pid and
    start time, as they recorded them (the namespace hosts share this machine's pids)."""
    found = []
    for group in (0, 1):
        recorded = json.loads(processes_file(out / REPLICAS_DIR, group).read_text())
        found += [(p["role"], p["pid"], p["start_time"]) for p in recorded]
        host_side = json.loads((out / AGENTS_DIR / f"node{group}.json").read_text())
        found.append((f"host side {group}", host_side["pid"], host_side["start_time"]))
    return found


def test_over_ssh_a_killed_replica_group_heals_from_the_other_hosts_group(make_spec, hosts: SshdCluster) -> None:
    spec = _spec(make_spec, hosts, steps=200, name="heal")
    train = spec.training_config()
    out = Path(train.run.output_url)
    launcher = SshLauncher()
    handle = launcher.submit(spec.cluster, train, "ft-ssh-heal")
    try:
        healthy, lost = RunOutput(out / "replica-0"), RunOutput(out / "replica-1")
        killed_at = _until_step(launcher, handle, lost, 8)
        ranks = lost.ranks().ranks
        assert {r["host"] for r in ranks} == {"host-b"}  # one group per host
        for rank in ranks:
            launcher.kill_rank(handle, rank, signal.SIGKILL)
        status = launcher.wait(handle, timeout_s=300)
    finally:
        if not launcher.status(handle).state.terminal:
            launcher.cancel(handle)
    assert status.state == JobState.SUCCEEDED, (status.describe(), launcher._log_text(handle)[-3000:])
    live = [e for e in recovery_events(str(lost.dir)) if e.rung == "live"]
    assert len(live) == 1 and live[0].restored_step >= killed_at  # pulled from host-a's group: no step lost
    assert [e.attempt for e in recovery_events(str(healthy.dir))] == [0]  # the healthy group never reloaded
    assert RunOutput(out).result() == healthy.result() and healthy.result().steps == 200
    assert lost.params() and {r: p.pieces for r, p in lost.params().items()} == {
        r: p.pieces for r, p in healthy.params().items()
    }
    assert (out / REPLICAS_DIR / "lighthouse.log").exists()
    assert not any(alive(pid, started) for _, pid, started in _started(out))  # the lighthouse went with the job


def test_over_ssh_cancel_stops_every_group_and_the_lighthouse(make_spec, hosts: SshdCluster) -> None:
    spec = _spec(make_spec, hosts, steps=100_000, name="cancel")
    train = spec.training_config()
    out = Path(train.run.output_url)
    launcher = SshLauncher()
    handle = launcher.submit(spec.cluster, train, "ft-ssh-cancel")
    try:
        _until_step(launcher, handle, RunOutput(out / "replica-1"), 2)
        started = _started(out)
        workers = [r["pid"] for g in (0, 1) for r in RunOutput(out / f"replica-{g}").ranks().ranks]
    finally:
        launcher.cancel(handle)
    assert launcher.status(handle).state == JobState.CANCELLED
    assert sorted(role for role, _, _ in started) == ["host side 0", "host side 1", "lighthouse", "replica-0",
                                                      "replica-1"]  # fmt: skip
    assert not [(role, pid) for role, pid, when in started if alive(pid, when)]
    assert workers and not any(alive(pid, None) for pid in workers)


def test_over_ssh_a_preempted_replica_groups_job_checkpoints_and_ends_preempted(make_spec, hosts: SshdCluster) -> None:
    spec = _spec(make_spec, hosts, steps=100_000, name="preempt")
    train = spec.training_config()
    out = Path(train.run.output_url)
    launcher = SshLauncher()
    handle = launcher.submit(spec.cluster, train, "ft-ssh-preempt")
    try:
        _until_step(launcher, handle, RunOutput(out / "replica-1"), 3)
        launcher.signal(handle, signal.SIGTERM)  # to each host side, as a scheduler delivers it
        status = launcher.wait(handle, timeout_s=120)
    finally:
        if not launcher.status(handle).state.terminal:
            launcher.cancel(handle)
    assert status.state == JobState.PREEMPTED and status.exit_code == PREEMPTED_EXIT_CODE, status.describe()
    assert "preempted at step" in status.reason  # group 0's record, surfaced under the job's id
    for group in (0, 1):  # each group wrote its checkpoint at the step it stopped
        assert RunOutput(out / f"replica-{group}").checkpoints()


def test_over_ssh_a_nan_loss_in_the_groups_is_recorded_for_the_restart_policy(make_spec, hosts: SshdCluster) -> None:
    spec = _spec(make_spec, hosts, steps=50, name="nan")
    train = spec.training_config()
    launcher = SshLauncher()
    environment = JobEnvironment().with_drill_points(nan_loss={"step": 3})
    handle = launcher.submit(spec.cluster, train, "ft-ssh-nan", environment=environment)
    try:
        status = launcher.wait(handle, timeout_s=240)
    finally:
        if not launcher.status(handle).state.terminal:
            launcher.cancel(handle)
    assert status.state == JobState.FAILED, status.describe()
    found = read_failure(train.run.output_url)  # the job's own output, where the launch step's policy reads it
    assert found is not None and (found.cause, found.step) == ("nan_loss", 3)
    assert "replica group" in launcher._log_text(handle)


def test_cancel_stops_a_recorded_process_by_pid_only_while_its_start_time_matches(
    make_spec, hosts: SshdCluster, tmp_path: Path
) -> None:
    ssh = _spec(make_spec, hosts, steps=10, name="stop").cluster.ssh
    handle = JobHandle("ssh", "stop", "stop", str(tmp_path), str(tmp_path / "log"),
                       details={"ssh": ssh.model_dump(mode="json")})  # fmt: skip
    proc = subprocess.Popen(["sleep", "600"])  # the namespace hosts share this machine's pids
    try:
        _, reused = stop_remote(handle, 1, proc.pid, 1.0, "1")  # the pid, but another process's start time
        assert reused.wait(timeout=60) == 0 and proc.poll() is None
        _, stop = stop_remote(handle, 1, proc.pid, 1.0, start_time(proc.pid))
        assert stop.wait(timeout=60) == 0 and proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
