"""Device figures read every N steps (run.metrics_sync_every_steps, the GPU default) write the same per-step records
as reading them every step: every step, every rank, the same losses, so the acceptance suite reads what it did."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.launch.local import run_local
from tests.conftest import metrics_by_step
from training.run_output import RunOutput
from validation.acceptance import AcceptanceThresholds, check_correctness, check_stability

pytestmark = pytest.mark.integration

DEVICE_FIGURES = ("loss", "rank_loss", "grad_norm")


def test_records_read_every_four_steps_equal_records_read_every_step(make_spec) -> None:
    common = {
        "run": {"steps": 14, "log_every_steps": 5, "eval_every_steps": 6},
        "checkpoint": {"save_every_steps": 7},
    }
    outputs = {}
    for name, every in (("every-step", 1), ("every-4", 4)):
        spec = make_spec({**common, "run": {**common["run"], "metrics_sync_every_steps": every}}, name=name)
        outputs[name] = Path(run_local(spec.cluster, spec.training_config()).output_dir)

    for rank in (0, 1):
        eager, deferred = (metrics_by_step(outputs[n], rank) for n in ("every-step", "every-4"))
        assert sorted(deferred) == list(range(1, 15))  # every step's record, windows of 4 cut by saves and evals
        for step in range(1, 15):
            for field in (*DEVICE_FIGURES, "lr", "epoch"):
                assert getattr(deferred[step], field) == getattr(eager[step], field), (rank, step, field)
            assert deferred[step].loss == deferred[step].loss  # a number, not None
    # What acceptance reads of a run: correctness against another run's losses, stability of the run.
    verdict = check_correctness(metrics_by_step(outputs["every-4"]), metrics_by_step(outputs["every-step"]), 1e-12)
    assert verdict.passed, verdict.message
    deferred_run = RunOutput(outputs["every-4"])
    assert deferred_run.result() is not None and deferred_run.result().steps == 14
    stability = check_stability(metrics_by_step(outputs["every-4"]), AcceptanceThresholds(), True, "succeeded")
    assert stability.passed, stability.message
