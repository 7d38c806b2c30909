"""The health gate on real hosts over real SSH (one sshd per host, each in its own mount and UTS namespace): a host
slowed by a CPU quota and a host with a full disk are left out, a clean cluster goes through, and a job the gate
leaves without enough hosts fails with the hosts and the fix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.launch.health_gate import HealthGateFailed, run_health_gate
from tasks.launch.ssh import SshLauncher
from tasks.launch.step import JobInputs, run
from tasks.recovery.config import RecoveryConfig
from tasks.recovery.quarantine import NodeMemory
from tests.integration.nodes.conftest import free_port, require
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, start_cluster
from training.health_gate import read_health_gate
from training.run_output import RunOutput

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Four hosts on loopback addresses: the job's two, and two more the inventory offers."""
    require("loopback")
    specs = [HostSpec("host-a"), HostSpec("host-b"), HostSpec("host-c"), HostSpec("host-d")]
    cluster = start_cluster(tmp_path_factory.mktemp("gate-hosts"), specs)
    try:
        yield cluster
    finally:
        for host in cluster.hosts:
            host.clear_cpu_limit()
            host.free_disk(cluster.scratch)
        cluster.close()


def _spec(make_spec, hosts: SshdCluster, **cluster: object):
    gate = {"port": free_port(), "storage_paths": [hosts.scratch], "compute_s": 1.0}
    return make_spec({"cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1, "health_gate": gate, **cluster},
                      "nodes": hosts.nodes_section(), "run": {"steps": 2}})  # fmt: skip


def _memory(tmp_path: Path) -> NodeMemory:
    return NodeMemory(str(tmp_path / "node-memory"), RecoveryConfig())


def test_a_clean_cluster_goes_through_with_every_probe_recorded(make_spec, hosts, tmp_path: Path) -> None:
    spec = _spec(make_spec, hosts)
    train = spec.training_config()
    memory = _memory(tmp_path)
    outcome = run_health_gate(SshLauncher(), spec.cluster, train, memory)
    assert outcome.cluster == spec.cluster
    record = read_health_gate(train.run.output_url)
    assert record is not None and record.passed, record and record.describe()
    assert [v.name for v in record.nodes] == ["host-a", "host-b"]
    for probe in record.probes:
        assert probe.compute_gflops and probe.compute_cpu_gflops
        assert [(s.path, s.ok) for s in probe.storage] == [(train.run.output_url, True), (hosts.scratch, True)]
    ring = {p.name: (p.peer, p.bandwidth_mb_s) for p in record.probes}
    assert ring["host-a"][0] == "host-b" and ring["host-b"][0] == "host-a"
    assert all(rate and rate > 0 for _, rate in ring.values())
    assert record.seconds > 0 and memory.events() == []


def test_a_host_slowed_by_a_cpu_quota_is_excluded_recorded_and_replaced(make_spec, hosts, tmp_path: Path) -> None:
    spec = _spec(make_spec, hosts, nodes=3)
    hosts.host("host-b").limit_cpu(0.1)
    try:
        memory = _memory(tmp_path)
        outcome = run_health_gate(SshLauncher(), spec.cluster, spec.training_config(), memory)
    finally:
        hosts.host("host-b").clear_cpu_limit()
    record = outcome.record
    assert record is not None and record.excluded == ["host-b"], record.describe()
    slowed = next(v for v in record.nodes if v.name == "host-b")
    assert slowed.reasons[0].startswith("its cgroup's CPU quota grants it 0.10 CPU"), slowed.reasons
    assert "and throttled it" in slowed.reasons[0], slowed.reasons
    assert outcome.cluster.ssh is not None
    assert [h.name for h in outcome.cluster.ssh.hosts] == ["host-a", "host-c", "host-d"]  # host-d took its place
    assert {v.name for v in record.nodes if v.healthy} == {"host-a", "host-c", "host-d"}  # host-d was probed too
    events = memory.events()
    assert [(e.kind, e.host) for e in events] == [("failure", "host-b")] and events[0].reason.startswith("health_gate")


def test_a_host_with_a_full_disk_is_excluded_and_an_elastic_job_starts_without_it(
    make_spec, hosts, tmp_path: Path
) -> None:
    spec = _spec(make_spec, hosts, nodes=4, min_nodes=3, max_restarts=1)
    hosts.host("host-c").fill_disk(hosts.scratch)
    try:
        outcome = run_health_gate(SshLauncher(), spec.cluster, spec.training_config(), _memory(tmp_path))
    finally:
        hosts.host("host-c").free_disk(hosts.scratch)
    record = outcome.record
    assert record is not None and record.excluded == ["host-c"], record.describe()
    full = next(v for v in record.nodes if v.name == "host-c")
    assert full.reasons == [r for r in full.reasons if r.startswith(f"storage {hosts.scratch}: ")]
    assert "No space left on device" in full.reasons[0]
    assert outcome.cluster.nodes == 3 and outcome.cluster.ssh is not None
    assert [h.name for h in outcome.cluster.ssh.hosts] == ["host-a", "host-b", "host-d"]


def test_a_job_the_gate_leaves_without_enough_hosts_fails_naming_the_host_and_the_fix(
    make_spec, hosts, tmp_path: Path
) -> None:
    spec = _spec(make_spec, hosts, nodes=4)
    hosts.host("host-d").fill_disk(hosts.scratch)
    memory = _memory(tmp_path)
    try:
        with pytest.raises(HealthGateFailed) as caught:
            run_health_gate(SshLauncher(), spec.cluster, spec.training_config(), memory)
    finally:
        hosts.host("host-d").free_disk(hosts.scratch)
    assert caught.value.record.excluded == ["host-d"], caught.value.record.model_dump_json(indent=1)
    assert read_health_gate(spec.training_config().run.output_url) == caught.value.record
    assert "no host is left to take the place of host-d for nodes=4" in str(caught.value)
    assert "cluster.min_nodes" in str(caught.value) and "No space left on device" in str(caught.value)
    assert [e.host for e in memory.events()] == ["host-d"]  # counted towards its quarantine all the same


def test_the_launch_step_runs_the_job_on_the_hosts_the_gate_let_through(make_spec, hosts, tmp_path: Path) -> None:
    """End to end: the gate before the agents leaves the slowed host out, the job's ranks run on the others."""
    spec = _spec(make_spec, hosts)
    train = spec.training_config()
    memory_url = str(tmp_path / "node-memory")
    hosts.host("host-b").limit_cpu(0.1)
    try:
        result = run(JobInputs(cluster=spec.cluster, train=train, name="gated", node_memory_url=memory_url))
    finally:
        hosts.host("host-b").clear_cpu_limit()
    assert result.state == "succeeded"
    ranks = RunOutput(result.output_dir).ranks()
    assert ranks is not None and sorted(r["host"] for r in ranks.ranks) == ["host-a", "host-c"]
    record = read_health_gate(result.output_dir)
    assert record is not None and record.excluded == ["host-b"]
    assert [e.host for e in NodeMemory(memory_url, RecoveryConfig()).events()] == ["host-b"]
