"""Hang detection on a real 2-rank torchrun job (local launcher, gloo, the tiny model) and the hang drill.

Rank 1 stops before the loss all-reduce of a step (the HangPoint drill point) while rank 0 blocks in it: the
watchdog must find the hang in phase step, name rank 1 from the heartbeats, dump both ranks' stacks, exit with
HANG_EXIT_CODE, and torchrun's restart must resume the job and finish it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext
from tasks.acceptance.ladder.hang import drill_hang
from tasks.acceptance.workspace import Job, variant
from tasks.launch.environment import JobEnvironment
from training.drill_points import HANG_MARKER_PREFIX, paused_ranks
from training.watchdog import hang_records, stack_dumps

pytestmark = pytest.mark.integration

LOOSE = {"scaling_efficiency_min": 0.01, "comm_share_max": 1.0, "correctness_max_rel_deviation": 1e-4}
SHORT = AcceptanceConfig.model_validate({"thresholds": LOOSE, "steps": 10, "save_every_steps": 3})


def test_a_rank_stopped_before_a_collective_is_named_and_the_restarted_job_finishes(
    make_spec, tmp_path: Path
) -> None:
    spec = make_spec({"cluster": {"max_restarts": 1}, "checkpoint": {"save_every_steps": 3}, "run": {"steps": 10}})
    train = variant(spec.training_config(), tmp_path, "hang", watchdog={"step_timeout_floor_s": 5.0})
    markers = tmp_path / "markers"
    environment = JobEnvironment().with_drill_points(hang_in_step={"step": 5, "rank": 1, "marker_dir": str(markers)})
    outcome = Job(spec.cluster, train, "hang", environment, None).wait(600)

    assert outcome.ok, outcome.status.describe()
    records = hang_records(outcome.output_dir)
    found = [r for r in records if r.detected_by == "timeout"]
    assert found, records
    first = found[0]
    assert (first.attempt, first.phase, first.step, first.late_ranks) == (0, "step", 5, [1]), first
    assert first.message.startswith("rank 1 did not arrive: last seen in phase step at step 5 (start)"), first.message
    assert "rank 0 waits in phase step at step 5 (loss_sync)" in first.message
    assert first.elapsed_s > first.timeout_s >= 5.0
    stacks = stack_dumps(outcome.output_dir, 0)
    assert set(stacks) == {0, 1}
    assert "before_collective" in stacks[1].read_text()  # the stalled rank's stack shows where it stopped
    assert "_train_step" in stacks[0].read_text()  # the waiting rank's, inside the step
    assert [m.rank for m in paused_ranks(str(markers), HANG_MARKER_PREFIX)] == [1]
    # torch's collective flight recorder (gloo) agrees: rank 1 never issued the collective rank 0 waits in
    reached = {r.rank: r.last_collective_seq for r in records if r.attempt == 0}
    assert reached[1] is not None and reached[0] == reached[1] + 1, reached
    ranks = outcome.ranks().ranks
    assert ranks[0]["restart_count"] == 1 and ranks[0]["resumed_from_step"] == 3
    assert outcome.run.result().steps == 10
    assert not [r for r in records if r.attempt > 0]  # the restarted attempt ran clean


def test_the_hang_drill_passes_on_the_local_launcher(make_spec, tmp_path: Path) -> None:
    spec = make_spec()
    result = drill_hang(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    assert result.passed, result
    assert result.evidence["hang"]["late_ranks"] == [1] and result.evidence["hang"]["phase"] == "step"
    assert set(result.evidence["stacks"]) == {"0", "1"}
    assert result.detection_s is not None and result.detection_s > 0
    assert result.steps_lost == 1 and result.state_matched
    assert result.evidence["restart"]["rung"] == "storage"  # the drills' base job keeps no host-memory copies
    assert result.recovery_s is not None
