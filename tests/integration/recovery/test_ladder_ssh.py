"""The recovery ladder's drills that the local launcher already runs, through the SSH launcher: two hosts in network
namespaces (own names and addresses, real SSH, one rank on each) sharing this machine's files. memory_restore loses
host-b past a storage checkpoint and restores from host-a's copies in host memory; workload_error stops a NaN loss
with restarts and a requeue left; replica_loss kills host-b's replica group, which heals from host-a's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext
from tasks.acceptance.ladder.memory_restore import MEMORY_EVERY_STEPS, drill_memory_restore, hold_step
from tasks.acceptance.ladder.replica_loss import drill_replica_loss
from tasks.acceptance.ladder.workload_error import drill_workload_error
from tests.integration.nodes.conftest import require
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, start_cluster
from training.recovery_record import recovery_events

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Two hosts on a bridge, one rank on each."""
    require("netns")
    cluster = start_cluster(tmp_path_factory.mktemp("ladder-hosts"), [HostSpec("host-a"), HostSpec("host-b")], "netns")
    try:
        yield cluster
    finally:
        cluster.close()


def _ssh_spec(make_spec, hosts: SshdCluster, **sections: dict[str, object]):  # noqa: ANN202 - a DeploymentSpec
    return make_spec({"cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1},
                      "nodes": hosts.nodes_section(), **sections})  # fmt: skip


def test_over_ssh_a_lost_host_resumes_from_the_peer_memory_copy_without_reading_storage(
    make_spec, hosts: SshdCluster, tmp_path: Path, record_property
) -> None:
    # Host memory per host: the namespace hosts share this machine's files, so each node's folder is its own.
    spec = _ssh_spec(make_spec, hosts, checkpoint={"memory_dir": str(tmp_path / "shm")})
    acceptance = AcceptanceConfig(steps=10, save_every_steps=4, job_timeout_s=300)
    result = drill_memory_restore(DrillContext(spec.cluster, spec.training_config(), tmp_path, acceptance))
    for figure in ("detection_s", "recovery_s", "steps_lost"):  # the figures, in --junitxml
        record_property(figure, getattr(result, figure))
    assert result.passed, (result.message, result.evidence)
    evidence = result.evidence
    killed_at = hold_step(acceptance.save_every_steps)
    assert evidence["lost"]["host"] == "host-b" and evidence["killed_at_step"] == killed_at
    assert evidence["storage_checkpoint_step"] == acceptance.save_every_steps < killed_at
    event = evidence["recovery_event"]
    assert event["rung"] == "memory" and event["restored_step"] == killed_at
    assert "sent by rank" in event["source"]["rank 1"]  # host-b's rank came back from the copy kept on host-a
    assert result.steps_lost == 0 <= MEMORY_EVERY_STEPS and result.state_matched
    assert [e.rung for e in recovery_events(evidence["output_dir"])].count("memory") == 1


def test_over_ssh_a_nan_loss_is_stopped_and_not_retried(
    make_spec, hosts: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property
) -> None:
    monkeypatch.setenv("TDEPLOY_HOME", str(tmp_path / "home"))
    spec = _ssh_spec(make_spec, hosts)
    acceptance = AcceptanceConfig(steps=10, save_every_steps=3, job_timeout_s=300)
    result = drill_workload_error(DrillContext(spec.cluster, spec.training_config(), tmp_path, acceptance))
    record_property("detection_s", result.detection_s)
    assert result.passed, (result.message, result.evidence)
    evidence = result.evidence
    assert evidence["failure"]["class"] == "workload" and evidence["failure"]["step"] == 4
    assert [(d["class"], d["action"]) for d in evidence["decisions"]] == [("workload", "stop")]
    assert result.steps_lost == 0 and evidence["steps_after_failure"] == 0


def test_over_ssh_the_replica_loss_drill_heals_host_bs_group_from_host_as_without_reloading(
    make_spec, hosts: SshdCluster, tmp_path: Path, record_property
) -> None:
    # One replica group per host; the drill holds every rank after the kill step, so the SSH round trip of the kill
    # lands before the job could end, however fast its steps.
    spec = _ssh_spec(make_spec, hosts)
    acceptance = AcceptanceConfig(steps=12, save_every_steps=100, job_timeout_s=300)
    result = drill_replica_loss(DrillContext(spec.cluster, spec.training_config(), tmp_path, acceptance))
    for figure in ("detection_s", "recovery_s", "steps_lost"):  # the figures, in --junitxml
        record_property(figure, getattr(result, figure))
    assert result.passed, (result.message, result.evidence)
    assert result.steps_lost == 0 and result.state_matched
    lost = recovery_events(str(Path(result.evidence["output_dir"]) / "replica-1"))
    assert [(e.attempt, e.rung) for e in lost] == [(0, "fresh"), (1, "live")]
