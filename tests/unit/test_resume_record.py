"""At start-up the checkpoint manager records in the run output what it loaded and what it skipped, and why."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

from training.checkpoint import CheckpointManager, step_dir_name
from training.checkpoint_trust import KEY_ENV
from training.config import CheckpointConfig
from training.run_output import RunOutput, RunOutputWriter
from training.storage import StorageConfig


@pytest.fixture(autouse=True)
def _no_key_and_quiet_dcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def _manager(root: Path) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(url=str(root), keep_last=5), StorageConfig())


def _resume(ckpt: Path, out: Path) -> RunOutput:
    writer = RunOutputWriter(str(out), StorageConfig())
    _manager(ckpt).load_latest(*_model(), writer)
    writer.close()
    return RunOutput(out)


def _saved(ckpt: Path, *steps: int) -> None:
    model, optimizer = _model()
    manager = _manager(ckpt)
    for step in steps:
        manager.save(step, model, optimizer, {"step": step})


def test_a_corrupt_checkpoint_is_recorded_as_skipped_with_its_reason(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _saved(ckpt, 1, 2)
    shard = sorted((ckpt / step_dir_name(2)).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    record = _resume(ckpt, tmp_path / "out").resume()

    assert record is not None and record.loaded_step == 1 and record.storage_url == str(ckpt)
    assert record.loaded_url == str(ckpt / step_dir_name(1)) and not record.resharded
    skipped = record.skipped_step(2)
    assert skipped is not None and skipped.reason == "corrupt" and skipped.url == str(ckpt / step_dir_name(2))
    assert "fails its sha256 check" in skipped.detail and [s.step for s in record.skipped] == [2]


def test_a_partial_checkpoint_is_recorded_as_skipped_because_its_save_never_finished(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _saved(ckpt, 1, 2)
    (ckpt / step_dir_name(2) / "COMMIT.json").unlink()

    record = _resume(ckpt, tmp_path / "out").resume()

    assert record is not None and record.loaded_step == 1
    skipped = record.skipped_step(2)
    assert skipped is not None and skipped.reason == "partial" and "COMMIT.json" in skipped.detail


def test_a_start_without_a_usable_checkpoint_records_a_fresh_start(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _saved(ckpt, 1)
    shutil.rmtree(ckpt / step_dir_name(1) / "rng", ignore_errors=True)
    (ckpt / step_dir_name(1) / "COMMIT.json").unlink()

    record = _resume(ckpt, tmp_path / "out").resume()

    assert record is not None and record.loaded_step is None and record.loaded_url is None
    assert [(s.step, s.reason) for s in record.skipped] == [(1, "partial")]
