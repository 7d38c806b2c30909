"""Checkpoint retention keeps what the ledger points at: a pinned step survives keep_last."""

from __future__ import annotations

from pathlib import Path

from tests.unit.checkpoints import no_key_and_quiet_dcp, tiny_model  # noqa: F401 - the fixture is autouse
from training.checkpoint import CheckpointManager
from training.config import CheckpointConfig
from training.storage import StorageConfig


def _save(root: Path, steps: list[int], pinned: int | None) -> CheckpointManager:
    model, optimizer = tiny_model()
    manager = CheckpointManager(CheckpointConfig(url=str(root), keep_last=1), StorageConfig())
    for step in steps:
        manager.save(step, model, optimizer, {"step": step})
        if step == pinned:
            manager.pin(step, "20260102T030405.123456Z-1a2b3c")
    return manager


def test_keep_last_never_deletes_a_pinned_checkpoint(tmp_path: Path) -> None:
    manager = _save(tmp_path / "ck", [1, 2, 3], pinned=1)
    assert manager.committed_steps() == [1, 3]
    assert manager.pinned_steps() == {1}
    assert manager.sound(1) is not None  # still whole and loadable


def test_without_a_pin_keep_last_prunes_as_before(tmp_path: Path) -> None:
    assert _save(tmp_path / "ck", [1, 2, 3], pinned=None).committed_steps() == [3]
