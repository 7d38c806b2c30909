"""The independent reference's written-out contracts (schedule, data order), its entry, and the model's dropout."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.acceptance.suite import correctness_plan
from tasks.launch.cluster import ClusterConfig
from tasks.spec import DeploymentSpec, SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.checkpoint import capture_rng, restore_rng
from training.config import ModelConfig, OptimConfig, ReferenceConfig, TrainConfig
from training.model import Transformer
from training.reference import ReferenceSetupError, batch_indices, learning_rate, run_reference
from training.run_output import StepRecord
from training.sampler import GlobalBatchSampler
from training.train import lr_lambda
from validation.acceptance import CLEAN_REL_DEVIATION, check_correctness

BASE = deep_merge(
    TINY_SPEC, {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}}
)
SMALL = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=97, seq_len=16)


@pytest.mark.parametrize(
    "optim",
    [
        {"lr_peak": 3e-3, "lr_min": 3e-4, "warmup_steps": 2, "schedule": "cosine"},
        {"lr_peak": 1e-2, "lr_min": 0.0, "warmup_steps": 0, "schedule": "cosine"},
        {"lr_peak": 1e-3, "lr_min": 1e-4, "warmup_steps": 5, "schedule": "linear"},
        {"lr_peak": 2e-3, "warmup_steps": 3, "schedule": "constant"},
        {"lr_peak": 5e-4, "lr_min": 5e-4, "warmup_steps": 20, "schedule": "linear"},
    ],
)
@pytest.mark.parametrize("total_steps", [20, 47])
def test_the_written_out_schedule_equals_the_trainers(optim: dict, total_steps: int) -> None:
    cfg = OptimConfig.model_validate(optim)
    factor = lr_lambda(cfg, total_steps)
    for step in range(total_steps + 5):  # and past the end, where both hold lr_min
        assert learning_rate(cfg, total_steps, step) == pytest.approx(cfg.lr_peak * factor(step), rel=1e-12, abs=0)


@pytest.mark.parametrize(("n", "micro", "accum", "world"), [(50, 2, 2, 3), (64, 4, 2, 2), (37, 3, 1, 4)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_the_written_out_data_order_is_what_the_ranks_get_across_epochs(
    n: int, micro: int, accum: int, world: int, drop_last: bool
) -> None:
    samplers = [GlobalBatchSampler(n, micro, accum, world, r, seed=11, drop_last=drop_last) for r in range(world)]
    global_batch = micro * accum * world
    for step in range(3 * (n // global_batch) + 2):  # three epoch boundaries
        epoch, indices = batch_indices(n, global_batch, 11, step, drop_last)
        handed = [sampler.next_step() for sampler in samplers]
        assert {e for e, _ in handed} == {epoch}
        every_rank = np.concatenate([np.concatenate(micro_batches) for _, micro_batches in handed])
        assert sorted(every_rank.tolist()) == sorted(indices.tolist()), step


def test_a_deployment_spec_cannot_switch_the_trainer_to_the_reference() -> None:
    assert "reference" not in DeploymentSpec.model_fields
    with pytest.raises(SpecError) as caught:
        parse_spec(deep_merge(BASE, {"reference": {"world_size": 2}}))
    assert any(p.startswith("reference=") and "not a known field" in p for p in caught.value.problems)
    assert parse_spec(BASE).training_config().reference is None


def test_the_correctness_plan_runs_the_reference_for_the_distributed_world_in_fp32_without_dropout(
    tmp_path: Path,
) -> None:
    spec = parse_spec(deep_merge(BASE, {"model": {"dropout": 0.1}, "parallel": {"grad_accum_steps": 2}}))
    plan = correctness_plan(spec.cluster, spec.training_config(), tmp_path, steps=40, reference_steps=10)
    ref, dist = plan.reference, plan.distributed
    assert plan.reference_cluster.world_size == 1 and ref.reference == ReferenceConfig(world_size=2)
    assert ref.parallel.grad_accum_steps == 2 and ref.parallel.micro_batch == 4  # the spec's batch, untouched
    assert dist is not None and dist.reference is None and dist.parallel.grad_accum_steps == 2
    for cfg in (ref, dist):
        assert cfg.model.dropout == 0 and cfg.precision.dtype == "fp32"
        assert (cfg.run.steps, cfg.run.stop_after_steps) == (40, 10)  # 10 steps of the 40-step schedule
    assert Path(ref.run.output_url).parent != Path(dist.run.output_url).parent


def test_a_spec_in_fp32_without_dropout_lets_the_main_run_stand_in_for_the_distributed_side(tmp_path: Path) -> None:
    spec = parse_spec(BASE)
    assert correctness_plan(spec.cluster, spec.training_config(), tmp_path, 40, 10).distributed is None
    bf16 = parse_spec(deep_merge(BASE, {"precision": {"dtype": "bf16"}}))
    assert correctness_plan(bf16.cluster, bf16.training_config(), tmp_path, 40, 10).distributed is not None


def test_the_reference_refuses_to_run_as_more_than_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_spec(BASE).training_config()
    with pytest.raises(ReferenceSetupError, match="no reference section"):
        run_reference(cfg)
    monkeypatch.setitem(os.environ, "WORLD_SIZE", "2")
    with pytest.raises(ReferenceSetupError, match="runs as one process, 2 were started"):
        run_reference(TrainConfig.model_validate({**cfg.model_dump(), "reference": {"world_size": 2}}))


def test_dropout_draws_from_torchs_rng_in_training_only() -> None:
    torch.manual_seed(0)
    model = Transformer(SMALL.model_copy(update={"dropout": 0.1}))
    tokens = torch.randint(0, 97, (2, 16))
    state = capture_rng()
    first, _ = model(tokens)
    second, _ = model(tokens)
    assert not torch.equal(first, second)  # another mask each call
    restore_rng(state)
    again, _ = model(tokens)
    assert torch.equal(first, again)  # the same RNG state, the same masks: what a checkpoint restores
    model.eval()
    before = torch.get_rng_state()
    assert torch.equal(model(tokens)[0], model(tokens)[0]) and torch.equal(before, torch.get_rng_state())


def test_zero_dropout_leaves_the_model_and_the_rng_as_without_it() -> None:
    torch.manual_seed(0)
    plain = Transformer(SMALL)
    torch.manual_seed(0)
    with_field = Transformer(SMALL.model_copy(update={"dropout": 0.0}))
    tokens = torch.randint(0, 97, (2, 16))
    before = torch.get_rng_state()
    assert torch.equal(plain(tokens)[0], with_field(tokens)[0])
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("dropout", [-0.1, 1.0])
def test_a_dropout_outside_zero_to_one_is_refused(dropout: float) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(deep_merge(BASE, {"model": {"dropout": dropout}}))
    assert any(p.startswith(f"model.dropout={dropout}") for p in caught.value.problems)


def test_the_reference_cluster_is_one_process_without_restarts(tmp_path: Path) -> None:
    cluster = ClusterConfig(nodes=2, procs_per_node=4, max_restarts=3)
    spec = parse_spec(deep_merge(BASE, {"cluster": {"nodes": 2, "procs_per_node": 4, "max_restarts": 3}}))
    plan = correctness_plan(cluster, spec.training_config(), tmp_path, 40, 10)
    assert (plan.reference_cluster.nodes, plan.reference_cluster.procs_per_node) == (1, 1)
    assert plan.reference_cluster.max_restarts == 0 and plan.reference.reference == ReferenceConfig(world_size=8)


def test_correctness_reports_the_deviation_the_tolerance_and_the_measured_clean_noise() -> None:
    reference = {s: StepRecord(step=s, loss=5.0 - 0.1 * s) for s in range(1, 6)}
    close = {s: StepRecord(step=s, loss=m.loss * (1 + 1e-7)) for s, m in reference.items()}
    off = {**close, 4: StepRecord(step=4, loss=reference[4].loss * (1 + 1e-3))}
    passed, failed = check_correctness(close, reference, 1e-4), check_correctness(off, reference, 1e-4)
    assert passed.passed and passed.measured["max_rel_deviation"] == pytest.approx(1e-7, rel=1e-3)
    assert passed.threshold["max_rel_deviation"] == 1e-4  # the override, over the noise these records lack
    assert passed.threshold["clean_rel_deviation_measured"] == CLEAN_REL_DEVIATION
    assert not failed.passed and failed.evidence["first_failing_step"] == 4 and failed.measured["worst_step"] == 4
    assert sorted(failed.evidence["deviation_per_step"]) == [1, 2, 3, 4, 5]
