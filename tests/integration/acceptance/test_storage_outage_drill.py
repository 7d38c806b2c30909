"""The storage_outage drill on the local launcher (CPU, gloo, 2 ranks, the tiny model, an S3 endpoint of its own):
the save during the outage fails loudly, the one after it commits, and the job stops drills.relaunch_steps past
that save instead of training the acceptance run's whole length, every step matching the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext, drill_storage_outage
from training.run_output import RunOutput

pytestmark = pytest.mark.integration

LOOSE = {"scaling_efficiency_min": 0.01, "comm_share_max": 1.0}
ACCEPTANCE = AcceptanceConfig.model_validate({"thresholds": LOOSE, "steps": 20, "save_every_steps": 3})


def test_the_outage_fails_one_save_and_the_job_stops_past_the_save_after_it(make_spec, tmp_path: Path) -> None:
    spec = make_spec()
    result = drill_storage_outage(DrillContext(spec.cluster, spec.training_config(), tmp_path, ACCEPTANCE))
    assert result.passed and result.state_matched, (result.message, result.evidence)
    every = ACCEPTANCE.save_every_steps
    assert result.evidence["failed_save_step"] == 2 * every  # the save the drill's holds put inside the outage
    assert result.evidence["error"], "the lost save is recorded with its error"
    last = 3 * every + 3  # the save after the outage, then drills.relaunch_steps
    assert result.evidence["steps_trained"] == last < ACCEPTANCE.steps
    assert RunOutput(tmp_path / "drill-storage-outage" / "output").last_step() == last
