"""Acceptance reads an image dataset through the workload: the data-consistency check's sampling, the quality
baseline's curve key and the ledger's dataset key work on a prepared image dataset as on a token dataset, and a
token dataset's keys stay those recorded before."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tasks.acceptance.baselines import baseline_key, curve_identity
from tasks.ledger.registry import dataset_key
from training.config import TrainConfig
from training.dataset import DatasetWriter, TokenizerInfo, read_manifest
from training.image_dataset import write_image_dataset
from training.workload import workload_of
from validation.data_consistency import Sampling

SIDE, CLASSES = 8, 3


def _images(url: Path, n_train: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.integers(0, 256, (n, SIDE, SIDE, 3), dtype=np.uint8), np.arange(n, dtype=np.int32) % CLASSES

    write_image_dataset(str(url), None, {"train": split(n_train), "val": split(6)}, kind="labels",
                        source_fingerprint="test", num_classes=CLASSES)  # fmt: skip
    return str(url)


def _vit(dataset: str) -> TrainConfig:
    root = Path(dataset).parent
    return TrainConfig.model_validate({
        "model": {"kind": "vit", "vision": {"image_size": SIDE, "patch_size": 4, "n_layers": 1, "d_model": 16,
                                            "n_heads": 1, "ffn_hidden": 32, "num_classes": CLASSES}},
        "parallel": {"micro_batch": 2, "grad_accum_steps": 1},
        "optim": {"lr_peak": 1e-3, "lr_min": 1e-4, "warmup_steps": 1},
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(root / "checkpoints")},
        "run": {"steps": 10, "output_url": str(root / "output")},
    })  # fmt: skip


def test_the_sampling_of_a_vit_run_counts_the_image_datasets_training_images(tmp_path: Path) -> None:
    sampling = Sampling.of(_vit(_images(tmp_path / "images", 21)), 2)
    assert (sampling.n_samples, sampling.global_batch, sampling.steps_per_epoch) == (21, 4, 5)
    assert sampling.blend is None


def test_an_image_datasets_curve_and_dataset_keys_follow_its_content(tmp_path: Path) -> None:
    one, same, other = (_vit(_images(tmp_path / name, 12, seed)) for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    manifests = [workload_of(train).manifest() for train in (one, same, other)]
    curves = [baseline_key(curve_identity(train, 2, m)) for train, m in zip((one, same, other), manifests, strict=True)]
    datasets = [dataset_key(m) for m in manifests]
    assert curves[0] == curves[1] != curves[2] and datasets[0] == datasets[1] != datasets[2]
    identity = curve_identity(one, 2, manifests[0])["data"]
    assert identity["kind"] == "labels" and identity["num_classes"] == CLASSES and identity["train"]["count"] == 12


def test_a_token_datasets_keys_are_the_ones_recorded_before_the_workload_read_them(tmp_path: Path) -> None:
    url = str(tmp_path / "tokens")
    with DatasetWriter(url, 257, TokenizerInfo(kind="bytes"), eos_id=256, shard_tokens=500) as writer:
        for i in range(20):
            writer.add_document("train", [(i * 7 + j) % 256 for j in range(60)])
        writer.add_document("val", list(range(100)))
    manifest = read_manifest(url)
    # the data part of the curve identity and the dataset key as tasks/acceptance and tasks/ledger spelled them
    split = {name: {"n_tokens": info.n_tokens, "n_docs": info.n_docs,
                    "shards": [[s.n_tokens, s.n_docs, s.tokens_sha256, s.index_sha256] for s in info.shards]}
             for name, info in manifest.splits.items()}  # fmt: skip
    assert manifest.curve_identity("train", "val") == {
        "vocab_size": 257, "dtype": manifest.dtype, "eos_id": 256,
        "tokenizer": {"kind": "bytes", "sha256": manifest.tokenizer.sha256}, "train": split["train"], "val": split["val"],
    }  # fmt: skip
    assert manifest.checksums() == {
        "tokenizer": manifest.tokenizer.sha256,
        "splits": {name: [[s.tokens_sha256, s.index_sha256] for s in info.shards]
                   for name, info in sorted(manifest.splits.items())},
    }  # fmt: skip
