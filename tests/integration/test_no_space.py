"""`tdeploy export` and `tdeploy prepare-data` on a real full disk (a small tmpfs): one user error that names the
folder, the space needed and free where known, and the fix, instead of a traceback or the bare OS message."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from tasks.errors import NoSpaceError, UserError
from tasks.export.step import export_checkpoint
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from training.checkpoint import CardTokenizer, CheckpointManager, ModelCard
from training.config import ModelConfig, TrainConfig
from training.model import Transformer
from training.storage import StorageConfig

pytestmark = pytest.mark.integration

MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 96, "vocab_size": 300}
SIZES = r"needs ~(\d+) kB, (\d+) kB free"


def _fill(disk: Path, leave_free_bytes: int) -> None:
    ballast = shutil.disk_usage(disk).free - leave_free_bytes
    assert ballast > 0, "the tmpfs is too small for this test"
    (disk / "ballast").write_bytes(b"\0" * ballast)


def _trained(tmp_path: Path) -> tuple[TrainConfig, int]:
    """A checkpoint of a tiny Llama-shaped model (step 2, off the small disk); the bytes of its tensors."""
    train = TrainConfig.model_validate(
        {
            "model": {**MODEL, "seq_len": 16},
            "parallel": {"micro_batch": 2},
            "optim": {"lr_peak": 1e-3},
            "data": {"dataset_url": str(tmp_path / "dataset")},
            "checkpoint": {"url": str(tmp_path / "checkpoints")},
            "run": {"steps": 10, "output_url": str(tmp_path / "output")},
        }
    )
    model = Transformer(train.model)
    card = ModelCard(model=ModelConfig(**MODEL, seq_len=16), vocab_size=257, eos_id=256, dataset_url="/d",
                     tokenizer=CardTokenizer(kind="bytes"))  # fmt: skip
    manager = CheckpointManager(train.checkpoint, train.storage, card=card.model_dump(mode="json"))
    manager.save(2, model, torch.optim.AdamW(model.parameters()), {"step": 2})
    return train, sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_an_export_that_cannot_fit_is_refused_before_writing_naming_the_folder_the_sizes_and_the_fix(
    small_disk: Path, tmp_path: Path
) -> None:
    train, tensor_bytes = _trained(tmp_path)
    _fill(small_disk, 64 << 10)
    out = small_disk / "hf"
    with pytest.raises(NoSpaceError) as failed:
        export_checkpoint(train, out=out)
    message = str(failed.value)
    found = re.search(rf"^no space left on {re.escape(str(out))}: the export {SIZES}; (.*)$", message)
    assert found is not None, message
    assert tensor_bytes / 1e3 < int(found.group(1)) < 2 * tensor_bytes / 1e3 and 60 <= int(found.group(2)) <= 70
    assert "export to another folder (--out)" in found.group(3)
    assert sorted(p.name for p in small_disk.iterdir()) == ["ballast"]


def test_a_disk_that_fills_up_during_the_export_is_the_same_user_error_and_leaves_nothing(
    small_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tasks.export.step as export_task

    train, _ = _trained(tmp_path)
    real = export_task.write_configs

    def neighbour_fills_the_disk(*args: object) -> list[str]:  # another writer takes the room once the check passed
        _fill(small_disk, 16 << 10)
        return real(*args)

    monkeypatch.setattr(export_task, "write_configs", neighbour_fills_the_disk)
    out = small_disk / "hf"
    with pytest.raises(NoSpaceError) as failed:
        export_checkpoint(train, out=out)
    assert isinstance(failed.value, UserError)
    assert re.match(rf"no space left on {re.escape(str(out))}: the export {SIZES}; free space", str(failed.value))
    assert sorted(p.name for p in small_disk.iterdir()) == ["ballast"]


def test_prepare_data_onto_a_full_disk_names_the_dataset_folder_and_the_free_space(small_disk: Path) -> None:
    _fill(small_disk, 64 << 10)
    cfg = PrepareConfig(output_url=str(small_disk / "datasets"), builtin_corpus="python-docs",
                        builtin_max_bytes=300_000, tokenizer={"kind": "bytes"}, workers=1)  # fmt: skip
    with pytest.raises(NoSpaceError) as failed:
        prepare_dataset(cfg, StorageConfig(), validate=False)
    message = str(failed.value)
    found = re.search(rf"^no space left on {re.escape(str(small_disk))}/datasets/(\w+): the dataset needs more than "
                      r"the (\d+) kB free there; (.*)$", message)  # fmt: skip
    assert found is not None, message
    assert 60 <= int(found.group(2)) <= 70 and "data.prepare.output_url" in found.group(3)
    assert sorted(p.name for p in (small_disk / "datasets").iterdir()) == []  # the unfinished dataset is gone


def test_documents_staged_on_a_full_temporary_disk_name_that_folder_and_tmpdir(
    small_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    _fill(small_disk, 64 << 10)
    monkeypatch.setattr(tempfile, "tempdir", str(small_disk))
    cfg = PrepareConfig(output_url=str(tmp_path / "datasets"), builtin_corpus="python-docs",
                        builtin_max_bytes=300_000, tokenizer={"kind": "bpe", "vocab_size": 512}, workers=1)  # fmt: skip
    with pytest.raises(NoSpaceError) as failed:
        prepare_dataset(cfg, StorageConfig(), validate=False)
    staged = rf"{re.escape(str(small_disk))}/tdeploy-prepare-\w+"
    what = r"the staging of the cleaned documents \(for the BPE training\)"
    message = str(failed.value)
    assert re.match(rf"no space left on {staged}: {what} needs more than the \d+ kB free there; .*TMPDIR", message)
    assert sorted(p.name for p in small_disk.iterdir()) == ["ballast"]
