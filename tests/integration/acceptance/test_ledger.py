"""The ledger and the regression gate on real acceptance runs (CPU, gloo, 2 ranks of the tiny model, the local
launcher), and a rollback that resumes from the previous entry's checkpoint.

One module-scoped pair of accepted runs serves every test: the first records the ledger's first entry (no
baseline yet), the second is compared with it, passes, and becomes the current baseline. Thresholds are loose on
purpose (no timing thresholds in tests): the injected slow rank computes 20x as long as it would (a busy loop, so
its CPU time grows: CPU runs are judged by CPU time, which a busy host does not stretch), far more than the 80% drop
of tokens per CPU-second the test allows. The slowed run is a canary: acceptance without the recovery drill (a
third whole acceptance would add its drill jobs). The signing key is set for the whole module: entries, marks and
checkpoints are signed and checked as a deployment with a key has them.
"""

from __future__ import annotations

import re

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.record import AcceptanceReport
from tasks.acceptance.suite import AcceptanceInputs, run_acceptance
from tasks.capacity.step import CapacityInputs
from tasks.ledger.registry import Ledger, Provenance, cluster_key_of
from tasks.ledger.rollback import roll_back
from tasks.paths import ledger_url
from tasks.rollout.canary import CanaryInputs, RolloutStopped, roll_out, run_canary
from tasks.spec import DeploymentSpec, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from tests.faults.job import injected
from training.checkpoint import KEY_ENV, SIGNATURE_FIELD
from training.run_output import RunOutput

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ACCEPT = AcceptanceConfig.model_validate(
    {
        "thresholds": {"scaling_efficiency_min": 0.001, "comm_share_max": 1.0, "straggler_ratio_max": 100.0,
                       "plan_max_rel_error": 0.001, "plan_finding_runs": 2},
        "steps": 20,
        "save_every_steps": 10,
        "reference_steps": 5,
        "regression": {"tokens_per_s_drop_max": 0.8, "step_time_rise_max": 4.0, "checkpoint_save_rise_max": None,
                       "busbw_drop_max": None, "noise_floor_s": 0.0,
                       "throughput_min_interval_s": 0.0},
    }
)  # fmt: skip
SLOW = injected(slow_rank=1, slow_factor=20.0)


def _dims(report: AcceptanceReport) -> dict:
    return {d.name: d for d in report.dimensions}


@pytest.fixture(scope="module", autouse=True)
def _signing_key() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEY_ENV, "ledger-integration-key-0123456789")
        yield


@pytest.fixture(scope="module")
def accepted(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str) -> tuple[DeploymentSpec, list]:
    """The spec and two accepted acceptance runs in a row (their reports)."""
    root = tmp_path_factory.mktemp("ledger")
    overrides = {
        "data": {"dataset_url": tiny_dataset},
        "checkpoint": {"url": str(root / "checkpoints")},
        "run": {"output_url": str(root / "output")},
    }
    spec = parse_spec(deep_merge(TINY_SPEC, overrides), "tiny:ledger")
    train, provenance = spec.training_config(), Provenance.of(spec, image_ref=None)
    inputs = AcceptanceInputs(
        cluster=spec.cluster, train=train, acceptance=ACCEPT, provenance=provenance, planned=CapacityInputs.of(spec).planned()
    )
    reports = [run_acceptance(inputs, root / f"ws{i}") for i in range(2)]
    return spec, reports


def _ledger(spec: DeploymentSpec) -> Ledger:
    return Ledger(ledger_url(ACCEPT, spec.run.output_url))


def test_the_first_accepted_run_records_an_entry_and_the_second_is_compared_with_it(accepted) -> None:
    spec, (first, second) = accepted
    for report in (first, second):
        assert report.passed, {d.name: d.message for d in report.dimensions if d.passed is not True}
    assert _dims(first)["regression"].message == "no baseline; this run becomes it when accepted"
    regression = _dims(second)["regression"]
    assert regression.evidence["baseline_entry"] == first.ledger_entry
    assert regression.measured["loss_curve"]["verdict"] == "pass"  # same seed, deterministic CPU: the same curve
    assert regression.measured["tokens_per_cpu_s"]["verdict"] == "pass"
    assert regression.measured["tokens_per_s"]["verdict"] == "not judged"  # a CPU run: judged by CPU time
    entries = _ledger(spec).entries()
    assert [e.entry_id for e in entries] == [first.ledger_entry, second.ledger_entry]
    entry = entries[0]
    assert entry.spec_name == spec.name and entry.spec_digest == spec.digest()
    assert entry.checkpoint is not None and entry.checkpoint.step == ACCEPT.steps
    assert entry.figures.tokens_per_s and entry.figures.step_time_s and entry.figures.checkpoint_save_s
    assert entry.figures.tokens_per_cpu_s and entry.figures.step_cpu_s and entry.figures.cpu_timed_s
    assert entry.figures.loss_curve[ACCEPT.steps] == entry.figures.final_loss
    assert _ledger(spec).current(spec.name, cluster_key_of(spec.cluster)) == entries[1]


def test_a_canary_passes_against_the_baseline_and_one_with_a_slow_rank_stops_the_rollout(accepted) -> None:
    spec, (_, second) = accepted
    train, before = spec.training_config(), _ledger(spec).entries()
    deployment = spec.model_copy(update={"acceptance": ACCEPT})
    passed = run_canary(CanaryInputs.of(deployment, train, image="registry.local/tdeploy:new"))
    assert passed.baseline_entry == second.ledger_entry
    assert "recovery" not in {d.name for d in passed.report.dimensions}  # a canary runs no drill
    # the whole rollout of a slower version stops at its canary: no acceptance of the whole deployment, no job
    with pytest.raises(RolloutStopped) as stopped:
        roll_out(deployment, train, "registry.local/tdeploy:slow", environment=SLOW)
    message = str(stopped.value)
    assert "rollout of registry.local/tdeploy:slow stopped at the canary" in message
    assert "regression: tokens per CPU-second" in message
    # allowed: the limit (80%), or more where the baseline's own runs spread wider (a loaded machine)
    allowed = re.search(rf"\(entry {re.escape(second.ledger_entry)}; allowed (\d+)%", message)
    assert allowed is not None and int(allowed.group(1)) >= 80, message
    assert _ledger(spec).entries() == before  # neither canary is recorded: the current version stays
    assert not (Path(spec.run.output_url) / "job.json").exists()  # the new version's job was never submitted


def test_rollback_resumes_from_the_previous_entrys_checkpoint_and_makes_it_the_baseline(accepted) -> None:
    spec, (first, second) = accepted
    ledger = _ledger(spec)
    train = spec.training_config().model_copy(deep=True)
    train = train.model_validate(train.model_dump() | {"run": {**train.run.model_dump(), "steps": ACCEPT.steps + 3}})
    outcome = roll_back(ledger, spec.name, spec.cluster, train, spec.image, None, "finished", 600)
    assert outcome.state == "succeeded", outcome
    assert outcome.plan.target.entry_id == first.ledger_entry and outcome.plan.authenticated
    written = json.loads((Path(ledger.root) / "entries" / f"{first.ledger_entry}.json").read_text())
    assert isinstance(written[SIGNATURE_FIELD], str)
    resume = RunOutput(outcome.output_dir).resume()
    assert resume is not None and resume.loaded_step == ACCEPT.steps
    assert RunOutput(outcome.output_dir).last_step() == ACCEPT.steps + 3
    assert outcome.marked == [second.ledger_entry]
    assert ledger.current(spec.name, cluster_key_of(spec.cluster)).entry_id == first.ledger_entry


def test_each_accepted_run_records_its_measured_memory_and_step_time_beside_the_plan(accepted) -> None:
    spec, (first, second) = accepted
    planned = CapacityInputs.of(spec).planned()
    for report in (first, second):
        accuracy = report.plan_accuracy
        assert accuracy is not None and accuracy.layout == planned.layout
        assert accuracy.planned_step_s == planned.step_seconds and accuracy.measured_step_s > 0
        assert [m.rank for m in accuracy.memory] == [0, 1]  # every rank, against its stage's planned peak
        assert all(m.planned_bytes == planned.stage_peak_bytes[0] and m.measured_bytes > 0 for m in accuracy.memory)
        assert accuracy.memory_measure.startswith("peak resident set")  # CPU: the runtime's share taken off
        data = report.to_json()["plan_accuracy"]
        assert data["step_time_error"] == accuracy.step_time_error and set(data["memory_errors"]) == {0, 1}
    entries = _ledger(spec).entries()
    assert [e.plan_accuracy for e in entries] == [first.plan_accuracy, second.plan_accuracy]


def test_an_error_beyond_the_tolerance_in_consecutive_runs_is_a_planner_finding(accepted) -> None:
    _, (first, second) = accepted
    # plan_max_rel_error 0.1% and 2 runs: the first run has no history, the second repeats the first's errors
    assert first.plan_accuracy.finding is None and first.plan_accuracy.beyond()
    assert second.plan_accuracy.finding is not None
    assert "in the last 2 accepted runs on cpu" in second.plan_accuracy.finding
    assert "Planner finding" in second.plan_accuracy.line()


def test_the_next_plan_is_calibrated_from_the_ledgers_accepted_runs(accepted) -> None:
    spec, (first, second) = accepted
    inputs = CapacityInputs.of(spec)
    plain = inputs.model_copy(update={"ledger": None}).make()
    calibrated = inputs.model_copy(update={"ledger": _ledger(spec).url}).make()
    assert plain.calibration.source == "none" and calibrated.calibration.source == "ledger"
    assert calibrated.calibration.runs == 2
    ratios = [r.plan_accuracy.ratios()["step_time"] for r in (first, second)]
    assert calibrated.calibration.step_time_scale == pytest.approx(sum(ratios) / 2)  # the median of two
    raw, scaled = plain.requested.time, calibrated.requested.time
    assert scaled.matmul == pytest.approx(raw.matmul * calibrated.calibration.step_time_scale)
    assert calibrated.planned() == plain.planned()  # acceptance keeps holding runs to the planner's own figures
    assert calibrated.to_json()["calibration"]["source"] == "ledger"
