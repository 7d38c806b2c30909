"""The reshard drill with dropout: per-rank dropout streams cannot be replayed on one rank, so the resharded
run is judged against a same-layout resume of the same checkpoint, both without dropout."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext, drill_reshard

pytestmark = pytest.mark.integration


def test_a_model_with_dropout_reshards_to_one_rank_matching_a_same_layout_resume(make_spec, tmp_path: Path) -> None:
    spec = make_spec({"model": {"dropout": 0.1}})
    acceptance = AcceptanceConfig(steps=40, save_every_steps=10)
    result = drill_reshard(DrillContext(spec.cluster, spec.training_config(), tmp_path, acceptance))
    assert result.passed, (result.message, result.evidence)
    assert result.evidence["compared_with"].startswith("same-layout resume")
    assert result.evidence["to_world_size"] == 1 and result.evidence["reshard_reported"]
