"""Checkpoints on a real full disk (a small tmpfs): the error says so with the sizes, no partial folder
is left to fill the disk again, and old checkpoints make room before a save that would not fit."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from training.checkpoint import CheckpointManager, CheckpointSaveError, step_dir_name
from training.config import CheckpointConfig
from training.storage import StorageConfig

pytestmark = pytest.mark.integration


def _model(n_tensors: int = 1, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(n_tensors)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def _manager(root: Path, keep_last: int = 3) -> CheckpointManager:
    cfg = CheckpointConfig(url=str(root), keep_last=keep_last, save_retries=1, save_retry_backoff_s=0)
    return CheckpointManager(cfg, StorageConfig())


def _fill(disk: Path, leave_free_bytes: int) -> None:
    ballast = shutil.disk_usage(disk).free - leave_free_bytes
    assert ballast > 0, "the tmpfs is too small for this test"
    (disk / "ballast").write_bytes(b"\0" * ballast)


def test_a_checkpoint_larger_than_the_free_space_fails_saying_no_space_left_with_the_sizes(small_disk: Path) -> None:
    _fill(small_disk, 64 << 10)
    with pytest.raises(CheckpointSaveError) as failed:
        _manager(small_disk / "ckpt").save(1, *_model(width=128), {"step": 1})
    folder = small_disk / "ckpt" / step_dir_name(1)
    found = re.search(
        rf"no space left on {re.escape(str(folder))}: checkpoint needs ~(\d+) kB, (\d+) kB free", str(failed.value)
    )
    assert found is not None, failed.value
    needed_kb, free_kb = map(int, found.groups())
    assert 200 < needed_kb < 500 and 60 <= free_kb <= 70
    assert failed.value.no_space
    assert not (small_disk / "ckpt" / step_dir_name(1)).exists()


def test_a_disk_that_fills_up_during_the_save_says_no_space_left_and_the_partial_folder_is_removed(
    small_disk: Path,
) -> None:
    # Many small tensors: the data alone fits, DCP's per-tensor framing does not.
    model, optimizer = _model(n_tensors=40, width=8)
    tensor_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    _fill(small_disk, tensor_bytes + (8 << 10))
    with pytest.raises(CheckpointSaveError) as failed:
        _manager(small_disk / "ckpt").save(1, model, optimizer, {"step": 1})
    assert f"no space left on {small_disk / 'ckpt' / step_dir_name(1)}: checkpoint needs ~" in str(failed.value)
    assert not (small_disk / "ckpt" / step_dir_name(1)).exists()


def test_old_checkpoints_make_room_before_a_save_that_would_not_fit(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = _model()
    manager = _manager(small_disk / "ckpt", keep_last=3)
    manager.save(1, model, optimizer, {"step": 1})
    one_checkpoint = shutil.disk_usage(small_disk).used
    manager.save(2, model, optimizer, {"step": 2})
    _fill(small_disk, one_checkpoint // 3)

    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        manager.save(3, model, optimizer, {"step": 3})
    assert sorted(p.name for p in (small_disk / "ckpt").iterdir()) == [step_dir_name(2), step_dir_name(3)]
    assert f"removing the checkpoint (keep_last=3) {small_disk / 'ckpt' / step_dir_name(1)} early" in caplog.text
    assert manager.read_commit(3) is not None
