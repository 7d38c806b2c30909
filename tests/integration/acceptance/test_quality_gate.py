"""The quality gate on real 2-rank CPU runs of the tiny model: the first accepted run becomes the baseline, a
run that converges worse (test-only fault lr_scale) fails against it with both figures.

That a clean rerun passes against the baseline, reproducing it exactly and leaving it in place, is proven on
the embedded default by tests/e2e/test_pipeline.py (its second `tdeploy run`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.acceptance.baselines import judge_quality
from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.workspace import Job, variant
from tests.faults.job import injected

pytestmark = pytest.mark.integration

STEPS = 30


def test_a_worse_converging_run_fails_against_the_first_accepted_run_and_a_clean_rerun_passes(
    make_spec, tmp_path: Path
) -> None:
    spec = make_spec()
    train, acceptance = spec.training_config(), AcceptanceConfig(steps=STEPS)

    def gate(name: str, faults: dict | None = None):  # noqa: ANN202 - a QualityGate
        run_train = variant(train, tmp_path, name, run={"steps": STEPS})
        environment = injected(**faults) if faults else None
        run = Job(spec.cluster, run_train, name, environment, None).wait(600)
        assert run.ok, run.status.describe()
        return judge_quality(acceptance, train, run_train, spec.cluster.world_size, run.output_dir)

    first = gate("first")
    assert first.result.passed and first.result.measured["rule"] == "sanity", first.result.message
    assert first.record(tmp_path / "ws-first", tmp_path / "first" / "output")

    worse = gate("worse", {"lr_scale": 0.1})
    quality = worse.result.measured
    assert worse.result.passed is False and quality["rule"] == "baseline"
    assert quality["val_loss"] > quality["baseline_val_loss"] * (1 + acceptance.thresholds.quality_max_rel_worse)
    assert f"{quality['val_loss']:.4f}" in worse.result.message
    assert f"{quality['baseline_val_loss']:.4f}" in worse.result.message
    assert worse.result.evidence["baseline_run_id"] == "ws-first"
