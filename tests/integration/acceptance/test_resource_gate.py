"""The resource gate an idle data loader trips (validation/resources.py), on real one-process CPU runs: a run whose
data loader sleeps 50 ms per batch (the slow_data_s fault; the tiny model computes a step in a few ms) fails the
performance dimension on its compute share, and the same run without the fault passes it. The margins are wide on
purpose (no timing thresholds): the sleep is many times the step's compute."""

from __future__ import annotations

import pytest

from tasks.launch.local import run_local
from tests.faults.job import injected
from training.run_output import RunOutput
from validation.acceptance import AcceptanceThresholds, check_performance

pytestmark = pytest.mark.integration

LIMITS = AcceptanceThresholds(scaling_efficiency_min=0.01, comm_share_max=1.0)  # compute_share_min 0.7
SHORT = {"cluster": {"procs_per_node": 1}, "run": {"steps": 8},
         "checkpoint": {"save_every_steps": None, "save_at_end": False}}  # fmt: skip


def _judged(make_spec, name: str, faults: dict):  # noqa: ANN001, ANN202
    spec = make_spec(SHORT, name=name)
    job = run_local(spec.cluster, spec.training_config(), environment=injected(**faults) if faults else None)
    metrics = RunOutput(job.output_dir).all_metrics()
    return check_performance(metrics, metrics[0], 1, LIMITS, sharding=spec.parallel.sharding)


def test_a_sleeping_data_loader_fails_the_compute_share_gate_and_a_clean_run_passes(make_spec) -> None:
    starved = _judged(make_spec, "starved", {"slow_data_s": 0.05})
    gate = starved.measured["resources"]
    assert gate["basis"] == "cpu" and not starved.passed
    assert "compute share" in starved.message and "data-loader wait" in starved.look_first, starved.message
    clean = _judged(make_spec, "clean", {})
    assert clean.measured["resources"]["failures"] == [], clean.measured["resources"]
    print(f"compute share: starved {gate['share_per_rank']}, clean {clean.measured['resources']['share_per_rank']}")
