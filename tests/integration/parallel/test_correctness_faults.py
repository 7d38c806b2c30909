"""Subtle model-parallel bugs fail the correctness dimension by a wide margin, and clean runs pass it by one.

Each bug is applied to the distributed job only, through the test harness (tests/faults/harness/sitecustomize.py and
model_parallel_faults.py): sequence-parallel norm weights whose gradients are not reduced over the TP group, expert
gradients divided by the wrong factor, and clipping by a norm without the other expert-parallel ranks' experts.
The runs are judged as `tdeploy accept` judges them (tasks/acceptance/checks.py `correctness_of`): losses and
gradient norms per step and the parameters after the reference steps against the independent reference, with
tolerances derived from the reference's noise twin, and the replica check. Each test prints its margins: the
fault's deviation in tolerances, and the clean run's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.checks import correctness_of
from tasks.acceptance.suite import correctness_plan
from tasks.acceptance.workspace import Job, RunOutcome
from tasks.spec import DeploymentSpec, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from tests.integration.parallel.model_parallel_faults import patched
from training.run_output import RunOutput
from validation.acceptance import DimensionResult

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS, REFERENCE_STEPS = 40, 10
ACCEPTANCE = AcceptanceConfig.model_validate({"reference_steps": REFERENCE_STEPS})
GOAL = 10.0  # the fault's deviation in tolerances

SP = ({"n_layers": 2, "vocab_size": 258},
      {"tensor_parallel": 2, "sequence_parallel": True, "micro_batch": 2, "grad_accum_steps": 2}, 4)  # fmt: skip
DDP = ({"n_layers": 2, "vocab_size": 258, "tie_embeddings": False}, {"sharding": "ddp", "micro_batch": 2}, 2)
EP = ({"n_layers": 2, "vocab_size": 258, "moe": {"n_experts": 4, "top_k": 2}},
      {"expert_parallel": 2, "micro_batch": 2, "grad_accum_steps": 2}, 2)  # fmt: skip


def _spec(root: Path, dataset: str, layout: tuple[dict[str, Any], dict[str, Any], int]) -> DeploymentSpec:
    model, parallel, procs = layout
    overrides = {
        "cluster": {"procs_per_node": procs},
        "model": model,
        "parallel": parallel,
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(root / "checkpoints"), "save_every_steps": None},
        "run": {"output_url": str(root / "output"), "steps": STEPS, "log_every_steps": 5},
    }
    return parse_spec(deep_merge(TINY_SPEC, overrides), f"tiny:{root.name}")


class Layout:
    """One layout's reference and clean distributed run (the correctness side: the first REFERENCE_STEPS)."""

    def __init__(self, layout: tuple[dict[str, Any], dict[str, Any], int], dataset: str, root: Path) -> None:
        self.spec = _spec(root / "spec", dataset, layout)
        self.root = root
        plan = correctness_plan(self.spec.cluster, self.spec.training_config(), root, STEPS, REFERENCE_STEPS)
        assert plan.distributed is None  # fp32 without dropout: the run itself is the distributed side
        self.reference = Job(plan.reference_cluster, plan.reference, "reference", None, None).wait(600)
        assert self.reference.ok, self.reference.status.describe()
        self.clean = self.run("clean")

    def run(self, name: str, patch: dict[str, str] | None = None) -> RunOutcome:
        """The distributed job for the reference steps, with the `patch` variables in its environment."""
        train = self.spec.training_config()
        train = train.model_copy(update={
            "run": train.run.model_copy(update={"output_url": str(self.root / name / "output"),
                                                "stop_after_steps": REFERENCE_STEPS}),
            "checkpoint": train.checkpoint.model_copy(update={"url": str(self.root / name / "checkpoints")}),
        })  # fmt: skip
        # set past the spec, which reserves PYTHONPATH: the harness's variables reach this test's job only
        cluster = self.spec.cluster.model_copy(update={"env": {**self.spec.cluster.env, **(patch or {})}})
        outcome = Job(cluster, train, name, None, None).wait(600)
        assert outcome.ok, outcome.status.describe()
        return outcome

    def judge(self, run: RunOutcome) -> DimensionResult:
        """The correctness dimension of `run`, as acceptance computes it."""
        return correctness_of(run, run, self.reference, ACCEPTANCE, self.spec.cluster.world_size)


@pytest.fixture(scope="module")
def sp(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Layout:
    """TP2 x DP2 with sequence parallelism: reference and clean run."""
    return Layout(SP, tiny_dataset, tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def ep(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Layout:
    """EP2 over a 4-expert MoE: reference and clean run."""
    return Layout(EP, tiny_dataset, tmp_path_factory.mktemp("ep"))


def test_a_clean_data_parallel_run_compares_every_parameter_with_the_reference(
    tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The default layout wraps the model in DDP, whose parameter names carry `module.`: the records still name
    the bare model's parameters, so every one is compared (a name the reference lacks read as an infinite
    deviation and failed the README's main job)."""
    ddp = Layout(DDP, tiny_dataset, tmp_path_factory.mktemp("ddp"))
    clean = ddp.judge(ddp.clean)
    _assert_clean(clean)
    names = {p.name for r in RunOutput(ddp.clean.output_dir).params().values() for p in r.pieces}
    assert "lm_head.weight" in names and not any(n.startswith("module.") for n in names), sorted(names)


def _margins(name: str, fault: DimensionResult, clean: DimensionResult) -> float:
    """Print every figure's deviation in tolerances for the fault and the clean run; the fault's largest."""
    print(f"\n{name}: tolerance source {fault.threshold['source']}, noise factor {fault.threshold['noise_factor']}")
    for figure, f in fault.measured["figures"].items():
        c = clean.measured["figures"][figure]
        print(f"  {figure:28s} fault {f['max_rel_deviation']:.3g} = {f['margin']:.3g}x tolerance {f['tolerance']:.3g}"
              f" | clean {c['max_rel_deviation']:.3g} = {c['margin']:.3g}x (noise {c['clean_noise']:.3g})")  # fmt: skip
    for label, r in fault.measured["replicas"].items():
        c = clean.measured["replicas"][label]
        print(f"  replicas ({label}): fault {r['mismatched']} of {r['pieces_checked']} pieces differ (norms up to "
              f"{r['max_rel_difference']:.3g} apart) | clean {c['mismatched']} of {c['pieces_checked']} differ"
              " (tolerance: bit-identical)")  # fmt: skip
    return max(f["margin"] for f in fault.measured["figures"].values())


def _assert_clean(clean: DimensionResult) -> None:
    assert clean.passed, clean.message
    assert clean.threshold["source"] == "measured noise"
    assert clean.evidence["parameters"] == "compared"
    assert all(f["margin"] < 1 for f in clean.measured["figures"].values()), clean.measured["figures"]
    assert all(r["pieces_checked"] > 0 and r["mismatched"] == 0 for r in clean.measured["replicas"].values())


def test_sequence_parallel_norm_grads_not_reduced_over_tp_fail_the_replica_check(sp: Layout) -> None:
    clean, fault = sp.judge(sp.clean), sp.judge(sp.run("sp-norm", patched("sp_norm_grads_not_reduced")))
    margin = _margins("SP norm grads not reduced over TP", fault, clean)
    _assert_clean(clean)
    assert not fault.passed
    replicas = fault.measured["replicas"]["distributed"]
    assert replicas["mismatched"] > 0, replicas
    first = replicas["first_mismatched"][0]
    assert "norm.weight" in first["parameter"] and first["differs_over"] == ["tp"], first
    assert "replicas differ at the end of the run" in fault.message and "differ over tp" in fault.message
    assert margin >= GOAL, fault.measured["figures"]


def test_a_clean_expert_parallel_run_passes_correctness(ep: Layout) -> None:
    _assert_clean(ep.judge(ep.clean))
    # ... with the clip threshold active: most steps' norms exceed it, and the parameters still match
    clip = ep.spec.training_config().optim.grad_clip_norm
    norms = [m.grad_norm for m in RunOutput(ep.clean.output_dir).metrics(0).values()]
    assert clip is not None and sum(n > clip for n in norms) > len(norms) // 2, (clip, norms)


def test_expert_gradients_divided_by_the_wrong_factor_fail_on_the_gradient_norm(ep: Layout) -> None:
    clean, fault = ep.judge(ep.clean), ep.judge(ep.run("ep-divide", patched("ep_gradient_divide_factor_ignored")))
    margin = _margins("EP gradient divide factor ignored", fault, clean)
    assert not fault.passed and "gradient norm deviates from the reference" in fault.message, fault.message
    assert fault.measured["figures"]["gradient norm"]["first_failing"] == 1
    assert margin >= GOAL and math.isfinite(margin), fault.measured["figures"]


def test_clipping_by_a_norm_without_the_other_ranks_experts_fails_the_replica_check(ep: Layout) -> None:
    clean, fault = ep.judge(ep.clean), ep.judge(ep.run("ep-clip", patched("clip_norm_without_other_experts")))
    _margins("clipping without the other EP ranks' experts", fault, clean)
    assert clean.measured["replicas"]["distributed"]["mismatched"] == 0
    replicas = fault.measured["replicas"]["distributed"]
    assert not fault.passed and replicas["mismatched"] > 0, replicas
    # each EP rank clipped by its own norm: the data-parallel replicas of the dense weights drift apart
    assert replicas["first_mismatched"][0]["differs_over"] == ["dp_replicate"], replicas
    assert "replicas differ at the end of the run" in fault.message
