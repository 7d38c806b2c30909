"""Coverage by definition on real 2-rank runs (gloo, the tiny model) over a dataset whose epoch is 12 steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tasks.acceptance.workspace import Job, variant
from tasks.prepare.corpus import stdlib_documents
from tasks.spec import DeploymentSpec
from tests.faults.job import injected
from training.config import TrainConfig
from training.dataset import DatasetWriter, TokenDataset, TokenizerInfo
from training.run_output import RunOutput
from validation.data_consistency import Sampling, check_data_consistency

pytestmark = pytest.mark.integration

SAMPLES = 100  # training samples of seq_len 32: 12 steps of 4 x 2 ranks per epoch, 4 dropped
STEPS_PER_EPOCH = 12


@pytest.fixture(scope="module")
def tiny_epoch_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Bytes of standard-library documentation: a training split of exactly 100 samples of 32 + 1 tokens."""
    text = "\n".join(stdlib_documents(20_000)).encode()
    train_bytes = SAMPLES * 32  # one document and its EOS: 3201 tokens make (3201 - 1) // 32 = 100 samples
    url = str(tmp_path_factory.mktemp("tiny-epoch"))
    with DatasetWriter(url, 257, TokenizerInfo(kind="bytes"), eos_id=256) as writer:
        writer.add_document("train", list(text[:train_bytes]))
        writer.add_document("val", list(text[train_bytes : train_bytes + 2000]))
    assert len(TokenDataset(url, "train", 32)) == SAMPLES
    return url


def _run(spec: DeploymentSpec, root: Path, steps: int, faults: dict | None = None) -> tuple[TrainConfig, Path]:
    """The 2-rank tiny job for `steps` (no checkpoints); its config and output folder."""
    train = variant(
        spec.training_config(), root, "run", run={"steps": steps},
        checkpoint={"save_every_steps": None, "save_at_end": False},
    )  # fmt: skip
    outcome = Job(spec.cluster, train, "coverage", injected(**faults) if faults else None, None).wait(300)
    assert outcome.ok, outcome.status.describe()
    return train, outcome.output_dir


def test_a_clean_run_over_a_whole_epoch_passes_and_checks_its_coverage(
    make_spec: Callable[..., DeploymentSpec], tiny_epoch_dataset: str, tmp_path: Path
) -> None:
    spec = make_spec({"data": {"dataset_url": tiny_epoch_dataset}})
    train, output_dir = _run(spec, tmp_path, STEPS_PER_EPOCH + 3)
    result = check_data_consistency(output_dir, Sampling.of(train, spec.cluster.world_size))
    assert result.passed, result.message
    assert result.measured["epochs_complete_checked"] == [0]
    assert result.measured["epochs"][0] == {
        "steps": 12, "expected_steps": 12, "ended": True, "seen": 96, "dropped": 4, "padded": 0,
    }  # fmt: skip
    (end,) = RunOutput(output_dir).epochs()
    assert end.step == STEPS_PER_EPOCH and len(end.dropped) == SAMPLES % 8


def test_a_sampler_that_skips_one_sample_fails_coverage_on_a_real_run(
    make_spec: Callable[..., DeploymentSpec], tiny_epoch_dataset: str, tmp_path: Path
) -> None:
    spec = make_spec({"data": {"dataset_url": tiny_epoch_dataset}})
    train, output_dir = _run(spec, tmp_path, STEPS_PER_EPOCH, {"sampler_skip_index": 42})
    result = check_data_consistency(output_dir, Sampling.of(train, spec.cluster.world_size))
    assert not result.passed
    assert "epoch 0: 1 of the 100 training samples never seen and not in the recorded remainder: samples 42" in (
        result.message
    )
