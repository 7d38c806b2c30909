"""kill_during_save against a broken commit protocol: the drill fails and names what the checkpoint lacks.

CPU with gloo, 2 ranks, the tiny model: the second save (step 6) is stopped. That a correct save killed at
every phase of the protocol resumes from a whole checkpoint is proven on the embedded default by
tests/e2e/test_pipeline.py, whose `tdeploy run` runs the drill at every phase twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig, DrillConfig
from tasks.acceptance.drills import DrillContext, drill_kill_during_save
from tests.faults.job import injected
from training.checkpoint import TRAIN_STATE, rng_file

pytestmark = pytest.mark.integration

SHORT = AcceptanceConfig(steps=10, save_every_steps=3)


def test_a_commit_marker_written_before_the_extras_fails_the_drill_naming_the_missing_files(
    make_spec, tmp_path: Path
) -> None:
    spec = make_spec()
    faults = injected(commit_before_extras=True)
    drills = DrillConfig(save_phases=["after_dcp"])
    ctx = DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT, drills, environment=faults)
    result = drill_kill_during_save(ctx)
    assert not result.passed
    (phase,) = result.evidence["phases"]
    assert phase["phase"] == "after_dcp" and not phase["passed"] and not phase["whole"]
    # The writer reads its own commit back: the first save (step 3) already fails, naming what the early
    # COMMIT.json left out, so the job ends before the drill's save of step 6 (no broken commit is left behind)
    assert "the ranks never all stopped at after_dcp of the save of step 6: the job failed" in result.message
    for missing in (TRAIN_STATE, rng_file(0), rng_file(1)):
        assert f"{missing} was written but COMMIT.json does not list it" in result.message, result.message
