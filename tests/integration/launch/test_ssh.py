"""The SSH launcher on real hosts: one torchrun agent per host, each in its own network namespace with its own
address and host name, started over real SSH; the rendezvous on the first host's address."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.launch.base import JobState
from tasks.launch.local import LocalJob, TrainingFailed, run_local
from tasks.launch.ssh import SshLauncher, remote_agents
from tests.conftest import process_running
from tests.integration.nodes.conftest import require
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, start_cluster
from training.run_output import RunOutput

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Two hosts in network namespaces on a bridge."""
    require("netns")
    cluster = start_cluster(tmp_path_factory.mktemp("ssh-hosts"), [HostSpec("host-a"), HostSpec("host-b")], "netns")
    try:
        yield cluster
    finally:
        cluster.close()


def _spec(make_spec, hosts: SshdCluster, steps: int, **run: object):
    return make_spec(
        {
            "cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1},
            "nodes": hosts.nodes_section(),
            "run": {"steps": steps, **run},
        }
    )


def test_a_two_host_job_runs_one_agent_per_host_and_meets_on_the_first_hosts_address(make_spec, hosts) -> None:
    spec = _spec(make_spec, hosts, steps=4)
    assert spec.cluster.ssh is not None and [h.name for h in spec.cluster.ssh.hosts] == ["host-a", "host-b"]
    launcher = SshLauncher()
    handle = launcher.submit(spec.cluster, spec.training_config(), "ssh-ok")
    status = launcher.wait(handle, timeout_s=240)
    assert status.state is JobState.SUCCEEDED, launcher._log_text(handle)[-3000:]
    assert handle.details["endpoint"] == f"{hosts.host('host-a').address}:29500"
    ranks = RunOutput(handle.output_dir).ranks()
    assert ranks is not None and ranks.world_size == 2
    assert sorted((r["rank"], r["host"]) for r in ranks.ranks) == [(0, "host-a"), (1, "host-b")]
    agents = remote_agents(handle)
    assert sorted(a["host"] for a in agents) == ["host-a", "host-b"]  # each agent ran on its own host


def test_a_host_whose_agent_cannot_start_fails_the_job_with_sshs_reason(make_spec, hosts, tmp_path: Path) -> None:
    """A wrong key: ssh cannot log in, the wrapper records ssh's status, the job fails (it does not hang)."""
    other_key = tmp_path / "not-the-key"
    import subprocess

    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True)
    spec = make_spec(
        {
            "cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1},
            "nodes": hosts.nodes_section(ssh_key_path=str(other_key)),
            "run": {"steps": 4},
        }
    )
    with pytest.raises(TrainingFailed) as caught:
        run_local_ssh(spec)
    assert caught.value.status.state is JobState.FAILED and caught.value.returncode == 255  # ssh's own failure
    assert "Permission denied" in caught.value.log_tail


def run_local_ssh(spec) -> LocalJob:
    """run_local, through the SSH launcher."""
    launcher = SshLauncher()
    job = LocalJob(launcher.submit(spec.cluster, spec.training_config(), "ssh"), launcher)
    status = job.wait(timeout_s=240)
    if status.state is not JobState.SUCCEEDED:
        raise TrainingFailed(status, job.log_path, job.log_tail())
    return job


def test_cancel_stops_the_agents_and_workers_on_every_host(make_spec, hosts) -> None:
    spec = _spec(make_spec, hosts, steps=100_000)
    launcher = SshLauncher()
    handle = launcher.submit(spec.cluster, spec.training_config(), "ssh-cancel")
    deadline = time.monotonic() + 180
    while launcher.status(handle).state is not JobState.RUNNING:
        assert not launcher.status(handle).state.terminal, launcher._log_text(handle)[-3000:]
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.3)
    agents = remote_agents(handle)
    workers = [r["pid"] for r in RunOutput(handle.output_dir).ranks().ranks]
    assert len(agents) == 2 and len(workers) == 2
    launcher.cancel(handle, grace_s=20)
    assert launcher.status(handle).state is JobState.CANCELLED
    # the hosts share this machine's process table, so their processes can be checked from here
    left = [pid for pid in [a["pid"] for a in agents] + workers if process_running(pid)]
    assert left == [], f"still running after cancel: {left}"


def test_the_local_scheduler_still_runs_its_agents_here(make_spec) -> None:
    """The refactored local launcher: agents on 127.0.0.1, and each agent records where it ran."""
    spec = make_spec({"cluster": {"nodes": 2, "procs_per_node": 1}, "run": {"steps": 2}})
    job = run_local(spec.cluster, spec.training_config())
    assert job.handle.details["endpoint"].startswith("127.0.0.1:")
    import socket

    assert [a["host"] for a in remote_agents(job.handle)] == [socket.gethostname()] * 2
