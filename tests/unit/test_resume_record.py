"""At start-up the checkpoint manager records in the run output what it loaded and what it skipped, and why."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.unit.checkpoints import manager_at as _manager
from tests.unit.checkpoints import no_key_and_quiet_dcp  # noqa: F401 - autouse fixture
from tests.unit.checkpoints import saved_steps as _saved
from tests.unit.checkpoints import tiny_model as _model
from training.checkpoint import step_dir_name
from training.run_output import RunOutput, RunOutputWriter
from training.storage import StorageConfig


def _resume(ckpt: Path, out: Path) -> RunOutput:
    writer = RunOutputWriter(str(out), StorageConfig())
    _manager(ckpt).load_latest(*_model(), writer)
    writer.close()
    return RunOutput(out)


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
