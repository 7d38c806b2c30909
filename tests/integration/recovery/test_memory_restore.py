"""The in-memory checkpoint tier on real jobs: a 2-node local job (one rank per node, gloo, the tiny model) loses a
node past a storage checkpoint and comes back from the surviving node's host-memory copies; a peer copy whose
bytes were altered is refused and storage restores instead."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext
from tasks.acceptance.ladder.memory_restore import MEMORY_EVERY_STEPS, drill_memory_restore, hold_step
from tasks.acceptance.workspace import Job, variant
from tasks.launch.environment import JobEnvironment
from training.checkpoint.memory import copy_name, node_folder
from training.drill_points import HOLD_MARKER_PREFIX, paused_ranks
from training.recovery_record import recovery_events

pytestmark = pytest.mark.integration

SHORT = AcceptanceConfig(steps=12, save_every_steps=5, job_timeout_s=300)


def _two_nodes(make_spec, tmp_path: Path, sharding: str = "ddp"):  # noqa: ANN202 - a DeploymentSpec
    return make_spec({"cluster": {"nodes": 2, "procs_per_node": 1}, "parallel": {"sharding": sharding},
                      "checkpoint": {"memory_dir": str(tmp_path / "shm")}})  # fmt: skip


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_lost_node_resumes_from_the_peer_memory_copy_with_no_step_lost_and_the_same_losses(
    make_spec, tmp_path: Path, sharding: str
) -> None:
    spec = _two_nodes(make_spec, tmp_path, sharding)
    ctx = DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT)
    result = drill_memory_restore(ctx)
    killed_at = hold_step(SHORT.save_every_steps)
    assert result.evidence["storage_checkpoint_step"] == SHORT.save_every_steps < killed_at
    assert result.passed, result.message
    assert result.steps_lost == 0 <= MEMORY_EVERY_STEPS
    assert result.state_matched  # losses after the restore bit-identical to the uninterrupted run
    event = result.evidence["recovery_event"]
    assert event["rung"] == "memory" and event["restored_step"] == killed_at
    # the lost node's rank came back from the copy its peer kept on the surviving node
    assert "sent by rank" in event["source"]["rank 1"] and "by-00000" in event["source"]["rank 1"]


def test_an_altered_peer_copy_is_refused_named_in_the_record_and_storage_restores(make_spec, tmp_path: Path) -> None:
    spec = _two_nodes(make_spec, tmp_path)
    train = variant(spec.training_config(), tmp_path, "altered", run={"steps": 6},
                    checkpoint={"memory_every_steps": 1, "save_every_steps": 2, "async_save": False})  # fmt: skip
    markers = tmp_path / "hold"
    held = JobEnvironment().with_drill_points(hold_after_step={"step": 4, "marker_dir": str(markers), "timeout_s": 300})
    job = Job(spec.cluster, train, "altered", held, None)
    job.wait_until(lambda: len(paused_ranks(str(markers), HOLD_MARKER_PREFIX)) == 2, "both ranks at step 4", 300)
    for node in (1, 0):  # both hosts lost at once: only host memory (and storage, step 4) survive
        job.kill_node(node, signal.SIGKILL)
    job.wait(300)
    peer = Path(node_folder(train.checkpoint, 0)) / "step-00000004" / f"{copy_name(1, 0)}.pt"
    own = Path(node_folder(train.checkpoint, 1)) / "step-00000004" / f"{copy_name(1, 1)}.pt"
    own.unlink()  # rank 1's own copy is gone with its node: only the peer copy could restore it
    own.with_suffix(".json").unlink()
    data = bytearray(peer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    peer.write_bytes(bytes(data))
    outcome = Job(spec.cluster, train, "altered", None, None).wait(300)
    assert outcome.ok, outcome.status.describe()
    event = recovery_events(train.run.output_url)[-1]
    assert event.rung == "storage" and event.restored_step == 4, event
    refused = {r.copy: r.reason for r in event.refused}
    name = f"node-0/step-00000004/{copy_name(1, 0)}"
    assert refused == {name: "fails its sha256 check (the copy was altered or torn)"}, refused
    assert "step 4" in event.reason


def test_the_drill_is_skipped_where_the_launcher_cannot_lose_a_node_and_names_those_that_can(
    make_spec, tmp_path: Path
) -> None:
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "nodes": 2, "procs_per_node": 1}})
    result = drill_memory_restore(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    assert result.passed is None
    assert result.message == ("skipped: not drilled on scheduler kubernetes: its launcher cannot lose one node of a "
                              "running job (needs a node to lose: local or ssh or slurm)")  # fmt: skip
