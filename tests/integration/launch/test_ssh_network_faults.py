"""A 2-host SSH job against a closed rendezvous port or an unresolvable host name: what torchrun does and what the
diagnosis says. host-b's /etc/hosts lacks host-a; host-a firewalls the rendezvous port for (a) only."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tasks.diagnose import diagnose
from tasks.launch.base import JobState
from tasks.launch.ssh import TORCHRUN_DEFAULT_PORT, SshLauncher
from tests.integration.nodes.conftest import require
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, start_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """host-a and host-b in network namespaces; host-b cannot resolve host-a's name."""
    require("netns")
    specs = [HostSpec("host-a"), HostSpec("host-b", unresolvable=("host-a",))]
    cluster = start_cluster(tmp_path_factory.mktemp("net-faults"), specs, "netns")
    try:
        yield cluster
    finally:
        cluster.close()


def _submit(make_spec, hosts: SshdCluster, name: str):
    spec = make_spec(
        {
            "cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1, "network": {"rdzv_timeout_s": 15}},
            "nodes": hosts.nodes_section(connect_timeout_s=3),
            "run": {"steps": 4},
        },
        name=name,
    )
    launcher = SshLauncher()
    return launcher, launcher.submit(spec.cluster, spec.training_config(), name)


def test_a_closed_rendezvous_port_fails_the_job_and_the_diagnosis_names_the_host_and_port(make_spec, hosts) -> None:
    host_a = hosts.host("host-a")
    host_a.block_port(TORCHRUN_DEFAULT_PORT)
    try:
        launcher, handle = _submit(make_spec, hosts, "blocked")
        status = launcher.wait(handle, timeout_s=240)  # join_timeout 15 s, c10d's store connect 60 s
    finally:
        host_a.unblock_port(TORCHRUN_DEFAULT_PORT)
    assert status.state is JobState.FAILED
    assert "on host-a (node 0)" in status.reason or "on host-b (node 1)" in status.reason
    assert "host-a" in status.reason and "host-b" in status.reason
    [finding] = [f for f in diagnose(status.reason, launcher._log_text(handle)).findings if "rendezvous" in f.cause]
    assert finding.fix.startswith(f"host-b could not connect to the rendezvous at {host_a.address}:29500")
    assert f"open port 29500 on {host_a.address} (host-a) to host-b" in finding.fix


def test_an_unresolvable_rank0_host_name_hangs_the_workers_and_the_diagnosis_names_the_name(make_spec, hosts) -> None:
    """The rendezvous meets on host-a's IP, so the agents start the workers; host-b's worker then cannot resolve
    MASTER_ADDR=host-a and c10d retries the lookup: the job does not fail by itself, it stays in the rendezvous."""
    launcher, handle = _submit(make_spec, hosts, "unresolved")
    try:
        deadline = time.monotonic() + 120
        while "gai error" not in launcher._log_text(handle):
            assert launcher.status(handle).state is JobState.PENDING, launcher._log_text(handle)[-3000:]
            assert time.monotonic() < deadline, launcher._log_text(handle)[-3000:]
            time.sleep(0.5)
        assert launcher.status(handle).state is JobState.PENDING  # still waiting: no failure to report
    finally:
        launcher.cancel(handle, grace_s=10)
    [finding] = [f for f in diagnose("", launcher._log_text(handle)).findings if "rendezvous" in f.cause]
    assert "cannot resolve 'host-a'" in finding.fix and "/etc/hosts or DNS" in finding.fix
