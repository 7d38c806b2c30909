"""The ViT classifier under the real trainer (torchrun, gloo, 2 processes): DDP, FSDP and tensor parallelism each
match the independent single-process reference (training/reference.py) step by step within the LM layouts'
tolerance, the evaluation records accuracy and macro F1, and a run stopped and resumed from its checkpoint goes
on bit-identically.

Every layout keeps the global batch at 8 images (micro_batch x grad_accum_steps x data-parallel degree), so one
reference run serves them all.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tasks.launch.torchrun import free_port
from tests.processes import run_group
from training.config import ReferenceConfig, TrainConfig
from training.image_dataset import write_image_dataset
from training.run_output import RunOutput
from validation.acceptance import check_correctness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[3]
STEPS = 5
TOLERANCE = 1e-4  # the LM layouts' bound (tests/integration/parallel/test_model_parallel_training.py)
CLASSES = 4

# name: parallel section; global batch 8 in each.
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"sharding": "ddp", "micro_batch": 2, "grad_accum_steps": 2},
    "fsdp": {"sharding": "fsdp", "micro_batch": 4, "grad_accum_steps": 1},
    "tp2": {"tensor_parallel": 2, "micro_batch": 4, "grad_accum_steps": 2},
}


def _images(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Noisy images of one of CLASSES colours: something a tiny ViT learns in a few steps."""
    labels = rng.integers(0, CLASSES, n)
    colours = np.array([[200, 30, 30], [30, 200, 30], [30, 30, 200], [200, 200, 30]], dtype=np.int64)[labels]
    pixels = colours[:, None, None, :] + rng.integers(-60, 60, (n, 16, 16, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8), labels


@pytest.fixture(scope="module")
def image_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("images"))
    rng = np.random.default_rng(0)
    write_image_dataset(url, None, {"train": _images(rng, 96), "val": _images(rng, 16)}, kind="labels",
                        source_fingerprint="test", num_classes=CLASSES, shard_images=40)  # fmt: skip
    return url


def _config(root: Path, dataset: str, parallel: dict[str, Any], **run: Any) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"kind": "vit", "vision": {"image_size": 16, "patch_size": 4, "n_layers": 2, "d_model": 32,
                                            "n_heads": 4, "ffn_hidden": 64, "num_classes": CLASSES}},
        "parallel": parallel,
        "optim": {"lr_peak": 3e-3, "lr_min": 3e-4, "warmup_steps": 2},
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(root / "checkpoints"), "save_every_steps": None, "save_at_end": False,
                       "memory_every_steps": 0},
        "run": {"steps": STEPS, "seed": 5, "output_url": str(root / "output"), "threads_per_rank": 1,
                "log_every_steps": 1, **run},
        "watchdog": {"enabled": False},
    })  # fmt: skip


def _train(cfg: TrainConfig, procs: int) -> RunOutput:
    """torchrun with `procs` processes on `cfg`; its run output."""
    out = Path(cfg.run.output_url)
    out.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(out / "run.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "training.train", "--config", str(out / "run.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = run_group(cmd, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return RunOutput(out)


@pytest.fixture(scope="module")
def reference(image_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> RunOutput:
    """The independent reference of a 2-rank job with the global batch of 8 images."""
    root = tmp_path_factory.mktemp("reference")
    cfg = _config(root, image_dataset, LAYOUTS["ddp"])
    return _train(cfg.model_copy(update={"reference": ReferenceConfig(world_size=2)}), 1)


@pytest.fixture(scope="module")
def runs() -> dict[str, RunOutput]:
    """The layouts' runs, kept for the resume test."""
    return {}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_matches_the_single_process_reference(
    layout: str, reference: RunOutput, runs: dict[str, RunOutput], image_dataset: str, tmp_path: Path
) -> None:
    out = runs[layout] = _train(_config(tmp_path, image_dataset, LAYOUTS[layout], eval_every_steps=STEPS), 2)
    got, ref = out.metrics(0), reference.metrics()
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    assert ref[STEPS].loss < ref[1].loss  # it learns: the comparison is not of constants
    result = check_correctness(got, ref, TOLERANCE)
    assert result.passed, (result.message, result.measured, result.evidence)
    # The parameters as acceptance compares them: within the noise the reference's twin measured. (A fixed bound
    # does not hold for the key bias: its gradient is zero but for rounding, softmax being shift-invariant, and
    # AdamW scales that rounding noise up to full-sized steps.)
    params = check_correctness(got, ref, params=out.params(), reference_params=reference.params()[0])
    assert params.passed and params.evidence["parameters"] == "compared", (params.message, params.evidence)
    # tokens: the image tokens of the global batch (16 patches and the class token per image)
    assert {r.tokens for r in got.values()} == {8 * 17}
    last = out.evals()[-1]
    dp = 2 // LAYOUTS[layout].get("tensor_parallel", 1)
    # run.eval_batches (4) x micro_batch x data-parallel ranks: tensor-parallel peers' counts are not summed twice
    assert last["step"] == STEPS and last["val_images"] == 4 * LAYOUTS[layout]["micro_batch"] * dp
    assert 0 <= last["val_macro_f1"] <= 1 and 0 <= last["val_accuracy"] <= 1
    if layout == "tp2":  # the tensor-parallel ranks hold halves of each block's projections
        piece = next(p for p in out.params()[0].pieces if p.name == "blocks.0.attn.wq.weight")
        assert piece.shape == [16, 32] and piece.full_shape == [32, 32]


def test_a_stopped_vit_run_resumes_bit_identically(
    runs: dict[str, RunOutput], image_dataset: str, tmp_path: Path
) -> None:
    cfg = _config(tmp_path / "split", image_dataset, LAYOUTS["fsdp"], eval_every_steps=STEPS)
    if "fsdp" not in runs:  # the same job in one launch (the parity test's, when it ran first)
        runs["fsdp"] = _train(_config(tmp_path / "whole", image_dataset, LAYOUTS["fsdp"], eval_every_steps=STEPS), 2)
    whole = runs["fsdp"].metrics(0)
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"save_at_end": True})})
    _train(cfg.model_copy(update={"run": cfg.run.model_copy(update={"stop_after_steps": 3})}), 2)
    resumed = _train(cfg, 2)
    assert resumed.result().resumed_from_step == 3
    again = resumed.metrics(0)
    assert [again[s].loss for s in range(4, STEPS + 1)] == [whole[s].loss for s in range(4, STEPS + 1)]
    assert [again[s].grad_norm for s in range(4, STEPS + 1)] == [whole[s].grad_norm for s in range(4, STEPS + 1)]
