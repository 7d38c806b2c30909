"""model.init_from under real torchrun (2 gloo ranks): a tiny Llama made by transformers (random init, saved as
safetensors) loaded under DDP, FSDP, TP2 and PP2 with its logits checked against transformers' before the first
step; a job whose logits differ refuses to start as a workload error; fine-tuning it passes acceptance's
correctness (the reference starts from the same weights) and the quality gate against the starting model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.acceptance.baselines import judge_quality
from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.suite import correctness_plan
from tasks.acceptance.workspace import Job, variant
from tasks.init_from import with_init_check
from tasks.launch.local import TrainingFailed, run_local
from training.failure import read_failure
from training.hf_load import InitCheck, read_init_check, tolerance, write_init_check
from training.run_output import RunOutput
from validation.acceptance import check_correctness

pytestmark = pytest.mark.integration

STEPS, REFERENCE_STEPS = 20, 6
TOLERANCE = 1e-4  # as tests/integration/acceptance/test_reference.py's pair
LAYOUTS = {
    "ddp": {"sharding": "ddp"},
    "fsdp": {"sharding": "fsdp"},
    "tp2": {"tensor_parallel": 2},
    "pp2": {"pipeline_parallel": 2, "pipeline_schedule": "1f1b", "grad_accum_steps": 2},
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Llama of the tiny spec's shape (GQA, untied, rope_theta 5000; the vocabulary of 257 byte ids padded
    to 258, which tensor parallelism divides) saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
        initializer_range=0.2,  # logits of a few units: the check's tolerance is then relative to them
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def _spec(make_spec, tiny_llama: str, name: str, parallel: dict, steps: int = 2):  # noqa: ANN202
    model = {"init_from": tiny_llama, "vocab_size": 258}  # the tiny spec's other architecture fields agree
    run = {"steps": steps, "eval_batches": 1}
    return make_spec({"model": model, "parallel": parallel, "run": run, "checkpoint": {"save_every_steps": None}},
                     name=name)  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_transformers_llama_loads_with_its_logits_under_every_layout(
    make_spec, tiny_llama: str, layout: str
) -> None:
    spec = _spec(make_spec, tiny_llama, layout, LAYOUTS[layout])
    assert spec.model.rope_theta == 5000.0, "filled from config.json"
    train = with_init_check(spec.training_config())
    check = read_init_check(train.init_check_url)
    assert check.logits.abs().max() > 1.0, "the check's logits must not be near zero"
    out = run_local(spec.cluster, train).output_dir

    ranks = RunOutput(out).ranks().ranks
    deviations = [r["init_check_deviation"] for r in ranks]
    assert all(d is not None and d <= tolerance(check.logits) for d in deviations), deviations
    evals = RunOutput(out).evals()
    assert evals[0]["step"] == 0, "the starting model's validation loss comes first"


def test_a_job_whose_logits_differ_from_transformers_refuses_to_start(
    make_spec, tiny_llama: str, tmp_path: Path
) -> None:
    spec = _spec(make_spec, tiny_llama, "mismatch", LAYOUTS["tp2"])
    train = with_init_check(spec.training_config())
    check = read_init_check(train.init_check_url)
    # What a wrong mapping looks like from the job's side: transformers' logits of other weights (two heads'
    # worth of rows of the output layer swapped).
    wrong = check.logits.clone()
    wrong[:, [3, 200]] = wrong[:, [200, 3]]
    write_init_check(train.init_check_url, InitCheck(check.source, check.prompt_ids, wrong, "test"))
    with pytest.raises(TrainingFailed):
        run_local(spec.cluster, train)
    failure = read_failure(train.run.output_url)
    assert failure is not None and failure.cause == "bad_model", failure
    assert "deviate from transformers'" in failure.error and "tolerance" in failure.error
    assert not (Path(train.run.output_url) / "metrics").exists() or not any(
        (Path(train.run.output_url) / "metrics").iterdir()
    ), "no step was trained"


def test_a_fine_tune_passes_correctness_against_a_reference_from_the_same_weights_and_the_quality_gate(
    make_spec, tiny_llama: str, tmp_path: Path
) -> None:
    spec = _spec(make_spec, tiny_llama, "accept", {"grad_accum_steps": 2}, steps=STEPS)
    train = with_init_check(spec.training_config())
    plan = correctness_plan(spec.cluster, train, tmp_path / "pair", STEPS, REFERENCE_STEPS)
    assert plan.distributed is None, "fp32 without dropout: the main run is the distributed side, as in acceptance"
    reference = Job(plan.reference_cluster, plan.reference, "reference", None, None).wait(300)
    run_train = variant(train, tmp_path, "main", run={"steps": STEPS})
    run = Job(spec.cluster, run_train, "main", None, None).wait(600)
    assert reference.ok and run.ok, (reference.status.describe(), run.status.describe())
    # The starting weights are the checkpoint's on both sides: the first step's loss is the pretrained model's
    # (well above ln 258 = 5.55 for this sharp random Llama), equal in both.
    first = run.metrics()[1].loss
    assert abs(first - reference.metrics()[1].loss) < 1e-4 * first
    correctness = check_correctness(run.metrics(), reference.metrics(), TOLERANCE)
    assert correctness.passed, correctness.message

    gate = judge_quality(AcceptanceConfig(steps=STEPS), train, run_train, spec.cluster.world_size, run.output_dir)
    quality = gate.result.measured
    assert gate.result.passed and quality["rule"] == "init_from", gate.result.message
    assert quality["val_loss"] < quality["start_val_loss"]
