"""kill_during_save stops a save at each point of the protocol, kills every rank there and checks the relaunch.

CPU with gloo, 2 ranks, the tiny model: the second save (step 6) is stopped; the launch after each kill is
stopped at the next phase, the last one trains 3 steps past its resume point.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig, DrillConfig
from tasks.acceptance.drills import DrillContext, drill_kill_during_save
from training.checkpoint import COMMIT, DCP_METADATA, TRAIN_STATE, rng_file
from training.faults import ENV_VAR, SAVE_PHASES

pytestmark = pytest.mark.integration

SHORT = AcceptanceConfig(steps=10, save_every_steps=3)


def test_a_save_killed_at_every_phase_resumes_from_a_whole_checkpoint(make_spec, tmp_path: Path) -> None:
    spec = make_spec()
    ctx = DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT)
    result = drill_kill_during_save(ctx)
    assert result.passed, (result.message, result.evidence)
    phases = {p["phase"]: p for p in result.evidence["phases"]}
    assert list(phases) == list(SAVE_PHASES) and result.evidence["save_step"] == 6
    for phase in phases.values():
        assert phase["passed"] and phase["whole"] and phase["problems"] == [] and phase["state_matched"], phase
    for name in ("writing_dcp", "after_dcp", "after_extras"):
        assert phases[name]["resumed_from"] == 3 and phases[name]["partial_skipped_with_warning"], phases[name]
    after_commit = phases["after_commit"]
    assert after_commit["resumed_from"] == 6 and after_commit["partial_skipped_with_warning"] is None
    # each kill left what its phase names: part of the DCP data, all of it, the small files, the commit
    at_kill = {name: set(p["files_at_kill"]) for name, p in phases.items()}
    assert DCP_METADATA not in at_kill["writing_dcp"] and any(f.endswith(".distcp") for f in at_kill["writing_dcp"])
    assert DCP_METADATA in at_kill["after_dcp"] and TRAIN_STATE not in at_kill["after_dcp"]
    assert {TRAIN_STATE, rng_file(0), rng_file(1)} <= at_kill["after_extras"] and COMMIT not in at_kill["after_extras"]
    assert COMMIT in at_kill["after_commit"]
    assert result.state_matched and result.recovery_s is not None and result.recovery_s >= 0


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
