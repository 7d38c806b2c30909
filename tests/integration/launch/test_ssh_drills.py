"""Faults across real hosts (network namespaces, own addresses and host names, real SSH): a host lost mid-training,
and a host's link cut; each reports when it was noticed, when training was back, and the steps lost."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext, drill_node_loss
from tasks.acceptance.workspace import Job, last_step
from tests.conftest import process_running
from tests.integration.nodes.conftest import require
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, start_cluster
from validation.acceptance import AcceptanceThresholds, check_stability

pytestmark = pytest.mark.integration

SHORT = AcceptanceConfig(steps=16, save_every_steps=5, job_timeout_s=300)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Three hosts on a bridge: two run the job, the third is the spare a lost host is replaced with."""
    require("netns")
    specs = [HostSpec("host-a"), HostSpec("host-b"), HostSpec("host-c")]
    cluster = start_cluster(tmp_path_factory.mktemp("drill-hosts"), specs, "netns")
    try:
        yield cluster
    finally:
        cluster.close()


def _spec(make_spec, hosts: SshdCluster, **cluster: object):
    section = {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1, **cluster}
    return make_spec({"cluster": section, "nodes": hosts.nodes_section()})


def test_an_elastic_job_that_loses_a_host_goes_on_by_itself_on_the_other_from_the_last_checkpoint(
    make_spec, hosts, tmp_path: Path
) -> None:
    spec = _spec(make_spec, hosts, min_nodes=1, max_restarts=1)
    result = drill_node_loss(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    assert result.passed, (result.message, result.evidence)
    evidence = result.evidence
    assert evidence["lost"]["host"] == "host-b" and evidence["lost"]["ranks"] == [1]
    assert evidence["elastic"] and evidence["world_after"] == 1 and evidence["hosts_after"] == ["host-a"]
    assert evidence["data_consistency"] is None  # one rank left draws another order: the resume point is checked
    assert evidence["resumed_from_step"] == evidence["checkpoint_step"] <= evidence["killed_at_step"]
    assert result.steps_lost == evidence["killed_at_step"] - evidence["checkpoint_step"]
    assert result.detection_s is not None and result.recovery_s is not None
    assert 0 < result.detection_s <= result.recovery_s


def test_a_job_that_loses_a_host_is_relaunched_on_the_spare_and_continues_bit_identically(
    make_spec, hosts, tmp_path: Path
) -> None:
    spec = _spec(make_spec, hosts)
    result = drill_node_loss(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    assert result.passed, (result.message, result.evidence)
    evidence = result.evidence
    assert not evidence["elastic"] and evidence["relaunched_on"] == ["host-a", "host-c"]
    assert evidence["hosts_after"] == ["host-a", "host-c"] and evidence["losses_compared"]
    assert result.state_matched and result.detection_s is not None and result.steps_lost is not None
    assert evidence["data_consistency"] == {"passed": True, "message": ""}  # across the lost host and its spare


def test_a_host_whose_link_is_cut_mid_training_is_caught_by_the_stall_watchdog_and_named(
    make_spec, hosts, tmp_path: Path
) -> None:
    spec = make_spec(
        {
            "cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1},
            "nodes": hosts.nodes_section(connect_timeout_s=3),
            "run": {"steps": 100_000},
        }
    )
    job = Job(spec.cluster, spec.training_config(), "partition", None, None)
    victim = hosts.host("host-b")
    try:
        deadline = time.monotonic() + 180
        while last_step(job.output_dir) < 3:
            assert not job.status().state.terminal and time.monotonic() < deadline, job.handle.ref
            time.sleep(0.2)
        workers = [r["pid"] for r in job.ranks_record().ranks if r["host"] == "host-a"]
        subprocess.run(["ip", "-n", victim.netns, "link", "set", "eth0", "down"], check=True)
        t_cut = time.monotonic()
        outcome = job.wait(timeout_s=300, stall_timeout_s=10)
        noticed = time.monotonic() - t_cut
    finally:
        subprocess.run(["ip", "-n", victim.netns, "link", "set", "eth0", "up"], check=True)
    assert outcome.stalled_after_step is not None and outcome.unreachable_hosts == ["host-b"]
    assert not outcome.ok and noticed > 10  # caught by the watchdog, after its timeout, not by the job ending
    stability = check_stability(
        outcome.metrics(), AcceptanceThresholds(stall_timeout_s=10), outcome.ok, outcome.status.describe(),
        outcome.stalled_after_step, outcome.unreachable_hosts,
    )  # fmt: skip
    assert not stability.passed and "not answering: host-b" in stability.message
    assert [pid for pid in workers if process_running(pid)] == []  # the reachable host's ranks were stopped
