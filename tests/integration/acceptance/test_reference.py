"""The correctness pair on CPU with gloo: 2 DDP ranks with gradient accumulation 2 against the independent reference.

The reference (training/reference.py) runs once per module: it is deterministic and no test fault reaches it.
Each test runs the distributed side of the pair (10 steps of a 40-step schedule, dropout off although the
spec has it on) with or without a test fault and judges it with the default tolerance.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tasks.acceptance.suite import CorrectnessPlan, correctness_plan
from tasks.acceptance.workspace import Job, RunOutcome, single_process, variant
from tasks.spec import DeploymentSpec, parse_spec
from tests.conftest import TINY_SPEC, deep_merge, metrics_by_step
from tests.faults.job import injected
from training.checkpoint import step_dir_name
from training.run_output import RunOutput
from validation.acceptance import CLEAN_REL_DEVIATION, DimensionResult, check_correctness

pytestmark = pytest.mark.integration

STEPS, REFERENCE_STEPS = 40, 10
TOLERANCE = 1e-4  # the fixed tolerance these faults were sized against (the default now comes from the noise)


@pytest.fixture(scope="module")
def spec(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> DeploymentSpec:
    """The tiny spec with gradient accumulation 2 and dropout on (so the pair needs a distributed run of its own)."""
    root = tmp_path_factory.mktemp("pair-spec")
    overrides = {
        "model": {"dropout": 0.1},
        "parallel": {"grad_accum_steps": 2},
        "data": {"dataset_url": tiny_dataset},
        "checkpoint": {"url": str(root / "checkpoints")},
        "run": {"output_url": str(root / "output")},
    }
    return parse_spec(deep_merge(TINY_SPEC, overrides), "tiny:pair")


@pytest.fixture(scope="module")
def reference(spec: DeploymentSpec, tmp_path_factory: pytest.TempPathFactory) -> RunOutcome:
    """The independent reference of the spec's 2-rank job, run once."""
    plan = _plan(spec, tmp_path_factory.mktemp("reference"))
    outcome = Job(plan.reference_cluster, plan.reference, "reference", None, None).wait(300)
    assert outcome.ok, outcome.status.describe()
    return outcome


def _plan(spec: DeploymentSpec, root: Path) -> CorrectnessPlan:
    return correctness_plan(spec.cluster, spec.training_config(), root, STEPS, REFERENCE_STEPS)


def _distributed(spec: DeploymentSpec, root: Path, faults: dict[str, Any] | None = None) -> RunOutcome:
    plan = _plan(spec, root)
    assert plan.distributed is not None
    env = injected(**faults) if faults else None
    outcome = Job(spec.cluster, plan.distributed, "correctness", env, None).wait(300)
    assert outcome.ok, outcome.status.describe()
    return outcome


def _judged(distributed: RunOutcome, reference: RunOutcome) -> DimensionResult:
    return check_correctness(distributed.metrics(), reference.metrics(), TOLERANCE)


def test_the_reference_writes_a_finished_run_of_the_distributed_jobs_global_batch(reference: RunOutcome) -> None:
    run = reference.run
    result, ranks = run.result(), run.ranks()
    assert result is not None and result.steps == REFERENCE_STEPS and result.world_size == 1
    assert ranks is not None and ranks.world_size == 1 and ranks.ranks[0]["reference_of_world_size"] == 2
    metrics = reference.metrics()
    assert sorted(metrics) == list(range(1, REFERENCE_STEPS + 1))
    assert all(m.tokens_per_s > 0 and m.step_time_s > 0 for m in metrics.values())
    assert len(run.samples()[1]["indices"]) == 4 * 2 * 2  # micro_batch x grad_accum_steps x world
    assert metrics[REFERENCE_STEPS].loss < metrics[1].loss


def test_an_accumulation_bug_in_the_trainer_fails_against_the_independent_reference_only(
    spec: DeploymentSpec, reference: RunOutcome, tmp_path: Path
) -> None:
    faulty = {"accum_bug": True}
    buggy = _distributed(spec, tmp_path / "buggy", faulty)
    correctness = _judged(buggy, reference)
    assert not correctness.passed and correctness.measured["max_rel_deviation"] > TOLERANCE
    assert "gradient accumulation" in correctness.look_first

    # The old reference, the same trainer as one process, has the bug too and agrees with the buggy run.
    one, sections = single_process(spec.cluster, spec.training_config())
    sections = {
        **sections,
        "run": {**sections["run"], "steps": STEPS, "stop_after_steps": REFERENCE_STEPS},
        "model": {"dropout": 0.0},
        "checkpoint": {"save_every_steps": None, "save_at_end": False},
    }
    old = variant(spec.training_config(), tmp_path, "old-reference", **sections)
    trainer_reference = Job(one, old, "old-reference", injected(**faulty), None).wait(300)
    shared = check_correctness(buggy.metrics(), metrics_by_step(trainer_reference.output_dir), TOLERANCE)
    assert shared.passed, shared.measured


def test_a_rank_initialised_and_shuffled_with_another_seed_fails(
    spec: DeploymentSpec, reference: RunOutcome, tmp_path: Path
) -> None:
    correctness = _judged(_distributed(spec, tmp_path / "seeded", {"seed_offset_rank": 1}), reference)
    assert not correctness.passed and correctness.measured["max_rel_deviation"] > TOLERANCE
    assert correctness.evidence["first_failing_step"] <= 3


def test_ranks_that_never_synchronise_gradients_fail(
    spec: DeploymentSpec, reference: RunOutcome, tmp_path: Path
) -> None:
    correctness = _judged(_distributed(spec, tmp_path / "unsynced", {"skip_grad_sync": True}), reference)
    assert not correctness.passed and correctness.measured["max_rel_deviation"] > TOLERANCE
    assert correctness.evidence["deviation_per_step"][1] < TOLERANCE  # step 1 starts from the same weights


def test_a_run_with_dropout_resumes_bit_exactly_on_every_rank(
    spec: DeploymentSpec, reference: RunOutcome, tmp_path: Path
) -> None:
    train = spec.training_config()
    whole = variant(train, tmp_path, "whole", run={"steps": 8}, checkpoint={"save_every_steps": 4})
    assert Job(spec.cluster, whole, "whole", None, None).wait(300).ok
    first, plain = RunOutput(whole.run.output_url).metrics()[1].loss, reference.metrics()[1].loss
    assert abs(first - plain) / plain > 100 * CLEAN_REL_DEVIATION  # dropout is on: not the dropout-free loss
    resumed = variant(train, tmp_path, "resumed", run={"steps": 8})
    Path(resumed.checkpoint.url).mkdir(parents=True)
    shutil.copytree(Path(whole.checkpoint.url) / step_dir_name(4), Path(resumed.checkpoint.url) / step_dir_name(4))
    outcome = Job(spec.cluster, resumed, "resumed", None, None).wait(300)
    assert outcome.ok and outcome.ranks().ranks[0]["resumed_from_step"] == 4
    for rank in (0, 1):  # each rank's dropout masks continue from its own restored RNG stream
        before, after = RunOutput(whole.run.output_url).metrics(rank), outcome.metrics(rank)
        assert [after[s].rank_loss for s in range(5, 9)] == [before[s].rank_loss for s in range(5, 9)]


def test_a_moe_model_agrees_with_the_reference_which_balances_load_per_micro_batch(
    spec: DeploymentSpec, tmp_path: Path
) -> None:
    moe = parse_spec(deep_merge(spec.model_dump(), {"model": {"moe": {"n_experts": 4, "top_k": 2}}}), "tiny:moe")
    plan = _plan(moe, tmp_path)
    reference = Job(plan.reference_cluster, plan.reference, "reference", None, None).wait(300)
    correctness = _judged(_distributed(moe, tmp_path), reference)
    print(f"MoE: max relative deviation from the reference {correctness.measured['max_rel_deviation']:.3g}")
    assert correctness.passed, correctness.measured
    assert reference.metrics()[1].aux_loss > 0
