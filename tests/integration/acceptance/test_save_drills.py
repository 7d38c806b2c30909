"""kill_during_save against a broken commit protocol: the drill fails and names what the checkpoint lacks.

CPU with gloo, 2 ranks, the tiny model: the second save (step 6) is stopped. That a correct save killed at
every phase of the protocol resumes from a whole checkpoint is proven on the embedded default by
tests/e2e/test_pipeline.py, whose `tdeploy run` runs the drill at every phase twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig, DrillConfig
from tasks.acceptance.drills import DrillContext, drill_kill_during_save
from training.checkpoint import TRAIN_STATE, rng_file
from training.faults import ENV_VAR

pytestmark = pytest.mark.integration

SHORT = AcceptanceConfig(steps=10, save_every_steps=3)


def test_a_commit_marker_written_before_the_extras_fails_the_drill_naming_the_missing_files(
    make_spec, tmp_path: Path
) -> None:
    spec = make_spec()
    faults = {ENV_VAR: json.dumps({"commit_before_extras": True})}
    drills = DrillConfig(save_phases=["after_dcp"])
    ctx = DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT, drills, faults=faults)
    result = drill_kill_during_save(ctx)
    assert not result.passed
    (phase,) = result.evidence["phases"]
    assert phase["phase"] == "after_dcp" and not phase["passed"] and not phase["whole"]
    assert "the newest committed checkpoint is step 6, expected step 3" in result.message
    assert "step-00000006 is not whole: " in result.message
    for missing in (TRAIN_STATE, rng_file(0), rng_file(1)):
        assert f"{missing} is missing (the loader needs it)" in result.message
    # the relaunch's loader passes over commits that do not list what it needs (step 3's neither, under this
    # mutation), so it resumes from nothing instead of from the checkpoint before the killed save
    assert "did not resume from a checkpoint" in result.message, result.message
