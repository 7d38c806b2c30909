"""Hot spares on real jobs: a 2-node job (one rank per node, gloo, the tiny model) with one spare agent loses a node
past its first checkpoint; the spare joins the same job's rendezvous and the job finishes on it with the same world
and the same losses as the uninterrupted run. Locally (acted-out nodes) and over SSH (namespace hosts)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext
from tasks.acceptance.ladder.spare_takeover import MEMORY_EVERY_STEPS, drill_spare_takeover
from tests.integration.nodes.conftest import require
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, start_cluster
from training.recovery_record import recovery_events

pytestmark = pytest.mark.integration

SHORT = AcceptanceConfig(steps=10, save_every_steps=4, job_timeout_s=300)


def _cluster(**section: object) -> dict[str, object]:
    return {"cluster": {"nodes": 2, "procs_per_node": 1, "max_restarts": 1, **section}}


def test_a_lost_node_is_replaced_by_the_spare_in_the_same_job_with_the_same_world_and_losses(
    make_spec, tmp_path: Path
) -> None:
    spec = make_spec({**_cluster(spares=1), "checkpoint": {"memory_dir": str(tmp_path / "shm")}})
    result = drill_spare_takeover(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    assert result.passed, (result.message, result.evidence)
    evidence = result.evidence
    assert evidence["spare_nodes"] == [2] and evidence["world_after"] == 2
    lost_agent = f"{evidence['lost']['host']}:{evidence['lost']['agent_pid']}"
    assert lost_agent in evidence["agents_before"] and lost_agent not in evidence["agents_after"]
    event = evidence["spare_event"]
    # One takeover; which node index the spare gets in the new round is c10d's choice (the order its participants
    # joined in), not the lost node's: either is right, as long as the lost agent is the one replaced.
    assert event["rung"] == "spare" and len(event["source"]) == 1
    ((node, took_over),) = event["source"].items()
    assert node in ("node 0", "node 1") and took_over.endswith(f"in place of {lost_agent}")
    assert result.state_matched  # the losses after the takeover equal the uninterrupted run's
    assert evidence["data_consistency"] == {"passed": True, "message": ""}
    assert result.steps_lost == evidence["killed_at_step"] - evidence["resumed_from_step"]
    # the state came back from host memory (the survivor's peer copies): no step lost beyond the memory interval
    assert evidence["restore_event"]["rung"] == "memory" and result.steps_lost <= MEMORY_EVERY_STEPS
    assert result.detection_s is not None and result.recovery_s is not None
    assert 0 < result.detection_s <= result.recovery_s
    rungs = [e.rung for e in recovery_events(evidence["output_dir"])]
    assert rungs.count("spare") == 1  # one takeover, recorded once


def test_the_drill_is_skipped_and_says_what_it_needs_without_spares(make_spec, tmp_path: Path) -> None:
    spec = make_spec(_cluster())
    result = drill_spare_takeover(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    assert result.passed is None and result.message.startswith("skipped: needs cluster.spares >= 1")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Three hosts on a bridge (network namespaces, own names and addresses, real SSH): two run the job, the third
    stands by as its spare."""
    require("netns")
    specs = [HostSpec("host-a"), HostSpec("host-b"), HostSpec("host-c")]
    cluster = start_cluster(tmp_path_factory.mktemp("spare-hosts"), specs, "netns")
    try:
        yield cluster
    finally:
        cluster.close()


def test_over_ssh_the_spare_host_takes_the_lost_hosts_place_in_the_same_job(
    make_spec, hosts: SshdCluster, tmp_path: Path
) -> None:
    spec = make_spec({"cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1, "max_restarts": 1,
                                  "spares": 1}, "nodes": hosts.nodes_section(),
                      "checkpoint": {"memory_dir": str(tmp_path / "shm")}})  # fmt: skip
    result = drill_spare_takeover(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    assert result.passed, (result.message, result.evidence)
    evidence = result.evidence
    assert evidence["spare_hosts"] == ["host-c"] and evidence["lost"]["host"] == "host-b"
    assert evidence["hosts_after"] == ["host-a", "host-c"] and evidence["world_after"] == 2
    assert result.state_matched and evidence["data_consistency"] == {"passed": True, "message": ""}
    # the spare's node index in the new round is c10d's choice (see the local test): one takeover, by host-c
    (took_over,) = evidence["spare_event"]["source"].values()
    assert took_over.startswith("spare host-c:")


def test_the_drill_is_skipped_where_the_launcher_cannot_lose_a_node_and_names_those_that_can(
    make_spec, tmp_path: Path
) -> None:
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "nodes": 2, "procs_per_node": 1, "max_restarts": 1,
                                  "spares": 1}})  # fmt: skip
    result = drill_spare_takeover(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    assert result.passed is None
    assert result.message == (
        "skipped: not drilled on scheduler kubernetes (needs hot spares and a node to lose: local or ssh or slurm)"
    )
