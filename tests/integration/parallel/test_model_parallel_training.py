"""Model-parallel layouts under the real trainer (torchrun, gloo, 4 processes of a tiny model): loss parity with
the independent single-process reference, bit-exact resume after a killed rank, and resharding across layouts.

Every layout keeps the global batch at 8 sequences (micro_batch x grad_accum_steps x data-parallel degree), so
one reference run per model serves all of them: the reference sees the same sample order whatever the split.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tasks.acceptance.suite import correctness_plan
from tasks.acceptance.workspace import Job, RunOutcome
from tasks.launch.base import JobState
from tasks.launch.local import run_local, start_local
from tasks.spec import DeploymentSpec, parse_spec
from tests.conftest import TINY_SPEC, deep_merge, metrics_by_step
from tests.faults.job import injected
from training.checkpoint import step_dir_name
from training.layout import data_parallel_degree
from training.run_output import RunOutput
from validation.acceptance import check_correctness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS, REFERENCE_STEPS = 40, 10
TOLERANCE = 1e-4  # the bound; clean runs measure about 1e-7

DENSE = {"n_layers": 4, "vocab_size": 258}  # vocab divisible by TP 2, 4 layers for 2 x 2 interleaved chunks
UNEVEN = {"n_layers": 3, "vocab_size": 258}
MOE = {"n_layers": 2, "vocab_size": 258, "moe": {"n_experts": 4, "top_k": 2}}

# name: (model overrides, parallel overrides); global batch 8 in each.
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tp2xdp2": (DENSE, {"tensor_parallel": 2, "micro_batch": 2, "grad_accum_steps": 2}),
    "tp2xdp2-sp": (DENSE, {"tensor_parallel": 2, "sequence_parallel": True, "micro_batch": 2, "grad_accum_steps": 2}),
    "fsdp2xtp2": (DENSE, {"sharding": "fsdp", "tensor_parallel": 2, "micro_batch": 2, "grad_accum_steps": 2}),
    "pp2xdp2-1f1b": (DENSE, {"pipeline_parallel": 2, "pipeline_schedule": "1f1b", "micro_batch": 2,
                             "grad_accum_steps": 2}),
    "pp2-interleaved": (DENSE, {"pipeline_parallel": 2, "pipeline_schedule": "interleaved-1f1b", "virtual_stages": 2,
                                "micro_batch": 4, "grad_accum_steps": 2}),
    "tp2xpp2": (DENSE, {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batch": 4, "grad_accum_steps": 2}),
    "pp2-uneven": (UNEVEN, {"pipeline_parallel": 2, "pipeline_split": [1, 2], "micro_batch": 4,
                            "grad_accum_steps": 2}),
    "ep2": (MOE, {"expert_parallel": 2, "micro_batch": 2, "grad_accum_steps": 2}),
}  # fmt: skip
PROCS = {"pp2-interleaved": 2, "pp2-uneven": 2, "ep2": 2}


def _spec(root: Path, dataset: str, model: dict[str, Any], parallel: dict[str, Any], procs: int = 4,
          **sections: Any) -> DeploymentSpec:  # fmt: skip
    overrides = deep_merge(
        {
            "cluster": {"procs_per_node": procs},
            "model": model,
            "parallel": parallel,
            "data": {"dataset_url": dataset},
            "checkpoint": {"url": str(root / "checkpoints"), "save_every_steps": None},
            "run": {"output_url": str(root / "output"), "steps": STEPS, "log_every_steps": 5},
        },
        sections,
    )
    return parse_spec(deep_merge(TINY_SPEC, overrides), f"tiny:{root.name}")


def _reference(spec: DeploymentSpec, root: Path) -> RunOutcome:
    """The independent single-process reference of `spec`'s job (its data-parallel global batch)."""
    plan = correctness_plan(spec.cluster, spec.training_config(), root, STEPS, REFERENCE_STEPS)
    outcome = Job(plan.reference_cluster, plan.reference, "reference", None, None).wait(600)
    assert outcome.ok, outcome.status.describe()
    return outcome


@pytest.fixture(scope="module")
def references() -> dict[Any, RunOutcome]:
    """References run once per model: the correctness plan of the first layout that needs one (the reference's
    global batch is the layout's; a MoE reference also balances load per micro-batch, so it keys on that)."""
    return {}


def _reference_for(spec: DeploymentSpec, cache: dict[Any, RunOutcome], root: Path) -> RunOutcome:
    model = spec.model
    key = (model.n_layers, model.moe is not None, spec.parallel.micro_batch if model.moe else None)
    if key not in cache:
        cache[key] = _reference(spec, root)
    return cache[key]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_matches_the_single_process_reference(
    layout: str, references: dict[Any, RunOutcome], tiny_dataset: str, tmp_path: Path
) -> None:
    model, parallel = LAYOUTS[layout]
    spec = _spec(tmp_path, tiny_dataset, model, parallel, procs=PROCS.get(layout, 4))
    plan = correctness_plan(spec.cluster, spec.training_config(), tmp_path / "pair", STEPS, REFERENCE_STEPS)
    assert plan.distributed is None  # fp32 without dropout: the run itself is the distributed side
    ref = _reference_for(spec, references, tmp_path / "reference")
    assert ref.metrics()[1].loss > 0
    job = run_local(spec.cluster, spec.training_config().model_copy(
        update={"run": spec.run.model_copy(update={"stop_after_steps": REFERENCE_STEPS})}))  # fmt: skip
    out = RunOutput(job.output_dir)
    ranks = out.ranks().ranks
    assert all(r["mesh"] is not None for r in ranks)
    dp = data_parallel_degree(spec.parallel, spec.cluster.world_size)
    assert {r["mesh"]["dims"]["dp"] for r in ranks} == {dp}
    result = check_correctness(out.metrics(0), ref.metrics(), TOLERANCE)
    assert result.passed, (result.message, result.measured, result.evidence)
    worst = max(abs(out.metrics(0)[s].loss - ref.metrics()[s].loss) / ref.metrics()[s].loss
                for s in range(1, REFERENCE_STEPS + 1))  # fmt: skip
    assert worst < TOLERANCE, worst
    # The measurement step (the launch's second) counts and times each mesh dimension's collectives.
    measured = out.metrics(0)[2]
    used = {dim for dim, key in (("tp", "tensor_parallel"), ("pp", "pipeline_parallel"), ("ep", "expert_parallel"))
            if getattr(spec.parallel, key) > 1} | ({"dp"} if dp > 1 else set())  # fmt: skip
    assert used <= {d for d, sent in measured.comm_bytes.items() if sent > 0}, measured.comm_bytes
    assert used <= set(measured.comm_s_per_dim), measured.comm_s_per_dim
    assert out.metrics(0)[3].comm_bytes is None
    # Samples are recorded once per data-parallel rank, under its data-parallel rank.
    assert out.sample_ranks() == list(range(dp))


def _kill_rank(output_dir: str, rank: int) -> None:
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415

    pid = next(r["pid"] for r in RunOutput(output_dir).ranks().ranks if r["rank"] == rank)
    os.kill(pid, signal.SIGKILL)


def _wait_for_step(output_dir: str, rank: int, step: int, timeout_s: float = 300.0) -> None:
    import time  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    run = RunOutput(output_dir)
    while step not in run.metrics(rank):
        assert time.monotonic() < deadline, f"step {step} never reached"
        time.sleep(0.2)


def test_a_tensor_parallel_rank_killed_and_resumed_continues_bit_identically(tiny_dataset: str, tmp_path: Path) -> None:
    model, parallel = DENSE | {"dropout": 0.1}, {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batch": 4,
                                                 "grad_accum_steps": 2}  # fmt: skip
    steps = {"run": {"steps": 12}, "checkpoint": {"save_every_steps": 6}}
    clean = _spec(tmp_path / "clean", tiny_dataset, model, parallel, **steps)
    run_local(clean.cluster, clean.training_config())

    killed = _spec(tmp_path / "killed", tiny_dataset, model, parallel, **steps)
    job = start_local(killed.cluster, killed.training_config(), environment=injected(pause_after_step=9))
    _wait_for_step(killed.run.output_url, 1, 9)
    _kill_rank(killed.run.output_url, 1)  # tensor-parallel coordinate 1 of the first stage
    assert job.wait(timeout_s=120).state is JobState.FAILED
    run_local(killed.cluster, killed.training_config())
    assert RunOutput(killed.run.output_url).ranks().ranks[0]["resumed_from_step"] == 6
    a, b = metrics_by_step(clean.run.output_url), metrics_by_step(killed.run.output_url)
    for step in range(7, 13):
        assert (a[step].loss, a[step].grad_norm) == (b[step].loss, b[step].grad_norm), step


@pytest.fixture(scope="module")
def tp_checkpoint(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    """A TP2 x DP2 job's folder as it was after its step-6 checkpoint, and the job's uninterrupted metrics,
    shared by the reshard targets: one uninterrupted job whose later checkpoint is left out of the copy."""
    source = {"tensor_parallel": 2, "micro_batch": 2, "grad_accum_steps": 2}
    root = tmp_path_factory.mktemp("tp-whole")
    whole = _spec(root, tiny_dataset, DENSE, source, run={"steps": 12}, checkpoint={"save_every_steps": 6})
    run_local(whole.cluster, whole.training_config())
    saved = tmp_path_factory.mktemp("tp-saved")
    shutil.copytree(root / "checkpoints" / step_dir_name(6), saved / "checkpoints" / step_dir_name(6))
    return saved, metrics_by_step(whole.run.output_url)


@pytest.mark.parametrize(
    "target",
    [
        {"tensor_parallel": None, "micro_batch": 2, "grad_accum_steps": 1},  # DP4, plain DDP
        {"tensor_parallel": None, "pipeline_parallel": 2, "micro_batch": 2, "grad_accum_steps": 2},  # PP2 x DP2
    ],
    ids=["dp4", "pp2xdp2"],
)
def test_a_tp2xdp2_checkpoint_resumes_on_another_layout(
    target: dict[str, Any], tp_checkpoint: tuple[Path, dict[int, Any]], tiny_dataset: str, tmp_path: Path
) -> None:
    saved, whole = tp_checkpoint
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    moved = _spec(tmp_path, tiny_dataset, DENSE, target, run={"steps": 12})
    run_local(moved.cluster, moved.training_config())
    out = RunOutput(moved.run.output_url)
    assert out.ranks().ranks[0]["resumed_from_step"] == 6
    resume = out.resume()
    assert resume is not None and resume.resharded, resume  # same world size, another layout
    resumed = metrics_by_step(moved.run.output_url)
    for step in range(7, 13):
        assert abs(whole[step].loss - resumed[step].loss) / whole[step].loss < TOLERANCE, step
