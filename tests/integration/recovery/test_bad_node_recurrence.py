"""The same host lost in two jobs on real hosts (network namespaces, real SSH): the second loss quarantines it and
the launch step requeues the job without it; on the local launcher, whose nodes are all this machine, the drill
is skipped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext
from tasks.acceptance.ladder.bad_node_recurrence import drill_bad_node_recurrence
from tests.integration.nodes.conftest import require
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, start_cluster

pytestmark = pytest.mark.integration

SHORT = AcceptanceConfig(steps=10, save_every_steps=3, job_timeout_s=300)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Three hosts on a bridge: two run the job, the third is where the requeue goes without the bad one."""
    require("netns")
    specs = [HostSpec("host-a"), HostSpec("host-b"), HostSpec("host-c")]
    cluster = start_cluster(tmp_path_factory.mktemp("recurrence-hosts"), specs, "netns")
    try:
        yield cluster
    finally:
        cluster.close()


def test_a_host_lost_twice_is_quarantined_and_the_requeue_runs_without_it(
    make_spec, hosts: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TDEPLOY_HOME", str(tmp_path / "home"))
    spec = make_spec({"cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1},
                      "nodes": hosts.nodes_section(), "run": {"steps": 10}})  # fmt: skip
    result = drill_bad_node_recurrence(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    assert result.passed, (result.message, result.evidence)
    evidence = result.evidence
    assert evidence["victim"] == "host-b" and evidence["quarantined"] == ["host-b"]
    assert evidence["hosts_after"] == ["host-a", "host-c"]  # the requeued job's ranks are not on the bad host
    first, second, *_ = evidence["decisions"]
    assert (first["cause"], first["action"], first["quarantined_hosts"]) == ("lost_node", "stop", [])
    assert "requeues are used up" in first["why"]
    assert (second["cause"], second["action"]) == ("lost_node", "requeue_excluding")
    assert second["quarantined_hosts"] == ["host-b"] and second["excluded_hosts"] == ["host-b"]
    assert result.steps_lost == evidence["killed_at_step"] - evidence["resumed_from_step"] == 1
    assert result.detection_s is not None and result.recovery_s is not None


def test_on_the_local_launcher_the_drill_is_skipped_for_want_of_another_host(make_spec, tmp_path: Path) -> None:
    spec = make_spec({"cluster": {"nodes": 2, "procs_per_node": 1}})
    result = drill_bad_node_recurrence(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    assert result.passed is None and result.message.startswith("skipped: the local launcher does not run each node on a host")
