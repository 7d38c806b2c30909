"""checkpoint.memory_every_steps=auto on real jobs: a 2-node local job (one rank per node, gloo, the tiny model)
takes its copies with no interval set and a restart after both nodes are lost restores from them; with a budget the
copies do not fit, the tier stays off, says why, and the restart reads storage."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tasks.acceptance.workspace import Job, variant
from tasks.launch.environment import JobEnvironment
from training.checkpoint.memory import node_folder
from training.checkpoint.memory_auto import tier_decisions
from training.drill_points import HOLD_MARKER_PREFIX, paused_ranks
from training.recovery_record import recovery_events
from training.run_output import RunOutput

pytestmark = pytest.mark.integration

HELD_AT = 4
SAVED_AT = 3  # storage's newest checkpoint when the nodes are lost: a restore of step 4 came from memory


def _killed_and_restarted(make_spec, tmp_path: Path, name: str, **checkpoint: object):  # noqa: ANN202 - a TrainConfig
    """Run `name` with memory_every_steps=auto to step HELD_AT, lose both nodes there, then start it again."""
    spec = make_spec({"cluster": {"nodes": 2, "procs_per_node": 1},
                      "checkpoint": {"memory_dir": str(tmp_path / "shm")}})  # fmt: skip
    train = variant(spec.training_config(), tmp_path, name, run={"steps": 6},
                    checkpoint={"memory_every_steps": "auto", "save_every_steps": SAVED_AT, "async_save": False,
                                **checkpoint})  # fmt: skip
    markers = tmp_path / "hold"
    held = JobEnvironment().with_drill_points(
        hold_after_step={"step": HELD_AT, "marker_dir": str(markers), "timeout_s": 300}
    )
    job = Job(spec.cluster, train, name, held, None)
    job.wait_until(lambda: len(paused_ranks(str(markers), HOLD_MARKER_PREFIX)) == 2, "both ranks held", 300)
    copies = sorted(p.name for p in Path(node_folder(train.checkpoint, 0)).rglob("*.pt"))
    for node in (1, 0):
        job.kill_node(node, signal.SIGKILL)
    job.wait(300)
    outcome = Job(spec.cluster, train, name, None, None).wait(300)
    assert outcome.ok, outcome.status.describe()
    return train, copies


def test_auto_takes_copies_every_step_and_a_restart_restores_from_them(make_spec, tmp_path: Path) -> None:
    train, copies = _killed_and_restarted(make_spec, tmp_path, "auto")
    # node 0 holds rank 0's own copy and the peer copy of rank 1 (on the other node)
    assert {"rank-00000.by-00000.pt", "rank-00001.by-00000.pt"} <= set(copies)
    event = recovery_events(train.run.output_url)[-1]
    assert event.rung == "memory" and event.restored_step == HELD_AT, event
    first = tier_decisions(train.run.output_url)[0]
    assert first.fits and first.interval == 1 and first.step == 1
    assert first.need_bytes == 2 * 2 * first.state_bytes  # 2 kept steps x own + peer copy x 1 rank per node
    # each copy's stall is in the next step's record (goodput counts it as checkpoint_save, not "other")
    held = {r.step: r.memory_copy_before_s for r in RunOutput(train.run.output_url).metric_records(0)}
    assert held[1] is None and all(held[step] is not None and held[step] > 0 for step in (2, 3, 4)), held


def test_auto_keeps_the_tier_off_where_the_copies_do_not_fit_and_the_restart_reads_storage(
    make_spec, tmp_path: Path
) -> None:
    train, copies = _killed_and_restarted(make_spec, tmp_path, "tight", memory_budget_mib=0.05)
    assert copies == []
    event = recovery_events(train.run.output_url)[-1]
    assert event.rung == "storage" and event.restored_step == SAVED_AT, event
    decisions = tier_decisions(train.run.output_url)
    assert [d.fits for d in decisions] == [False, False]  # the first start and the restart
    assert "checkpoint.memory_budget_mib=0.05" in decisions[0].reason
