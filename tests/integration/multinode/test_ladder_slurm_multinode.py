"""The recovery ladder's node-loss drills through the Slurm launcher on a real multi-node Slurm cluster (three
hosts in namespaces, one slurmd each, one rank per host): the lost node's agent and workers are killed through a
step of the job on its host. memory_restore: the job ends (--kill-on-bad-exit) and its relaunch restores from the
surviving host's copies in host memory; spare_takeover: the third host, allocated as the job's spare, joins the
same job."""

from __future__ import annotations

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext
from tasks.acceptance.ladder.memory_restore import MEMORY_EVERY_STEPS, drill_memory_restore, hold_step
from tasks.acceptance.ladder.spare_takeover import drill_spare_takeover
from tests.integration.multinode.conftest import HOST_NAMES, SlurmMultinode

pytestmark = pytest.mark.integration


def _context(slurm: SlurmMultinode, make_spec, monkeypatch: pytest.MonkeyPatch, name: str, acceptance: AcceptanceConfig,
             **cluster: object) -> DrillContext:  # fmt: skip
    """The drill's context on `slurm`: two nodes, one rank each, every folder on the hosts' shared storage."""
    for key, value in slurm.env.items():
        monkeypatch.setenv(key, value)
    root = slurm.hosts.shared / name
    spec = make_spec({
        "cluster": {"scheduler": "slurm", "nodes": 2, "procs_per_node": 1,
                    "env": {"GLOO_SOCKET_IFNAME": "eth0"}, **cluster},  # the hosts' link to each other
        "checkpoint": {"memory_dir": str(root / "shm")},  # each node's folder of its own
    })  # fmt: skip
    return DrillContext(spec.cluster, spec.training_config(), root, acceptance)


def test_through_slurm_a_lost_node_resumes_from_the_peer_memory_copy_without_reading_storage(
    slurm_multinode: SlurmMultinode, make_spec, monkeypatch: pytest.MonkeyPatch, record_property
) -> None:
    acceptance = AcceptanceConfig(steps=10, save_every_steps=4, job_timeout_s=300)
    result = drill_memory_restore(_context(slurm_multinode, make_spec, monkeypatch, "memory", acceptance))
    for figure in ("detection_s", "recovery_s", "steps_lost"):  # the figures, in --junitxml
        record_property(figure, getattr(result, figure))
    assert result.passed, (result.message, result.evidence, slurm_multinode.logs())
    evidence = result.evidence
    killed_at = hold_step(acceptance.save_every_steps)
    assert evidence["lost"]["host"] in HOST_NAMES and evidence["killed_at_step"] == killed_at
    event = evidence["recovery_event"]
    assert event["rung"] == "memory" and event["restored_step"] == killed_at
    assert result.steps_lost == 0 <= MEMORY_EVERY_STEPS and result.state_matched


def test_through_slurm_the_spare_node_takes_the_lost_nodes_place_in_the_same_job(
    slurm_multinode: SlurmMultinode, make_spec, monkeypatch: pytest.MonkeyPatch, record_property
) -> None:
    acceptance = AcceptanceConfig(steps=10, save_every_steps=4, job_timeout_s=300)
    ctx = _context(slurm_multinode, make_spec, monkeypatch, "spare", acceptance, spares=1, max_restarts=1)
    result = drill_spare_takeover(ctx)
    for figure in ("detection_s", "recovery_s", "steps_lost"):
        record_property(figure, getattr(result, figure))
    assert result.passed, (result.message, result.evidence, slurm_multinode.logs())
    evidence = result.evidence
    assert evidence["world_after"] == 2 and evidence["requeues"] == 0
    assert evidence["lost"]["host"] not in evidence["hosts_after"] and len(evidence["hosts_after"]) == 2
    assert evidence["spare_event"]["rung"] == "spare" and evidence["restore_event"]["rung"] == "memory"
    assert result.state_matched and evidence["data_consistency"] == {"passed": True, "message": ""}
