"""Loading a checkpoint trusts nothing it did not sign: planted pickles are refused before they run,
COMMIT.json is authenticated with TDEPLOY_CHECKPOINT_KEY, and the JSON files are checked before use."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from tests.unit.checkpoints import manager_at as _manager
from tests.unit.checkpoints import no_key_and_quiet_dcp  # noqa: F401 - autouse fixture
from tests.unit.checkpoints import saved_steps as _saved
from tests.unit.checkpoints import tiny_model as _model
from training.checkpoint import KEY_ENV, CheckpointFormatError, CheckpointKeyError, UnsafeCheckpointError, step_dir_name

KEY = "k" * 32


def _recommit(folder: Path) -> None:
    """What an attacker with write access to the storage does: recompute every checksum in COMMIT.json."""
    commit_file = folder / "COMMIT.json"
    record = json.loads(commit_file.read_text())
    for rel, entry in record["files"].items():
        data = (folder / rel).read_bytes()
        entry.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    commit_file.write_text(json.dumps(record))


class _TouchViaExec:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


class _TouchViaAllowedClass:
    """Reaches `PosixPath.touch` through `pathlib.PosixPath`, which real metadata does name."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self.marker).touch, (self.marker,))


@pytest.mark.parametrize("payload", [_TouchViaExec, _TouchViaAllowedClass], ids=["exec", "posixpath-touch"])
def test_a_planted_metadata_that_would_create_a_file_is_refused_and_creates_nothing(
    tmp_path: Path, payload: type
) -> None:
    manager = _saved(tmp_path / "ckpt", 1)
    folder = tmp_path / "ckpt" / step_dir_name(1)
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(payload(marker), protocol=4))
    _recommit(folder)

    model, optimizer = _model()
    with pytest.raises(UnsafeCheckpointError) as refused:
        manager.load_latest(model, optimizer)
    assert not marker.exists()
    assert str(folder / ".metadata") in str(refused.value)
    assert refused.value.global_name in ("builtins.exec", "pathlib.Path.touch")


def test_a_planted_optimizer_entry_that_would_create_a_file_is_refused_and_creates_nothing(tmp_path: Path) -> None:
    manager = _saved(tmp_path / "ckpt", 1)
    folder = tmp_path / "ckpt" / step_dir_name(1)
    marker = tmp_path / "pwned"
    model, optimizer = _model()
    # The manager keys optimizer state by parameter name (flattened): plant into the learning rate of "weight".
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    optim_sd["param_groups.weight.lr"] = _TouchViaExec(marker)  # DCP stores it as a pickled bytes entry
    for stale in folder.glob("*.distcp"):
        stale.unlink()
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(str(folder)))
    _recommit(folder)

    with pytest.raises(UnsafeCheckpointError) as refused:
        manager.load_latest(*_model())
    assert not marker.exists()
    assert "optim.param_groups.weight.lr" in str(refused.value)


def test_a_signed_checkpoint_whose_files_were_replaced_is_skipped_as_untrusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    manager = _saved(tmp_path / "ckpt", 1, 2)
    newest = tmp_path / "ckpt" / step_dir_name(2)
    assert "hmac_sha256" in json.loads((newest / "COMMIT.json").read_text())
    (newest / "train_state.json").write_text(json.dumps({"step": 2, "planted": True}))
    _recommit(newest)

    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        restored = manager.load_latest(*_model())
    assert restored is not None and restored.step == 1
    assert f"skipping untrusted checkpoint {newest}: its COMMIT.json signature does not match" in caplog.text


def test_a_signed_checkpoint_without_the_key_set_fails_saying_which_variable_to_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    _saved(tmp_path / "ckpt", 1)
    monkeypatch.delenv(KEY_ENV)

    with pytest.raises(CheckpointKeyError, match=f"signed .* but {KEY_ENV} is not set; set {KEY_ENV}"):
        _manager(tmp_path / "ckpt").load_latest(*_model())


def test_an_unsigned_checkpoint_is_skipped_while_a_key_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _saved(tmp_path / "ckpt", 1)
    monkeypatch.setenv(KEY_ENV, KEY)

    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        assert _manager(tmp_path / "ckpt").load_latest(*_model()) is None
    unsigned = tmp_path / "ckpt" / step_dir_name(1)
    assert f"skipping untrusted checkpoint {unsigned}: its COMMIT.json is not signed while {KEY_ENV} is set" in (
        caplog.text
    )


def test_a_key_too_short_to_be_a_secret_is_refused_before_anything_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(CheckpointKeyError, match=f"{KEY_ENV}: is set but has 5 characters; use at least 16"):
        _manager(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_a_train_state_that_is_not_an_object_is_refused_naming_the_file(tmp_path: Path) -> None:
    manager = _saved(tmp_path / "ckpt", 1)
    train_state = tmp_path / "ckpt" / step_dir_name(1) / "train_state.json"
    train_state.write_text("[1, 2, 3]")
    _recommit(train_state.parent)

    with pytest.raises(CheckpointFormatError, match=f"{train_state} holds a JSON list, not the object"):
        manager.load_latest(*_model())


def test_a_malformed_rng_file_is_refused_naming_the_file_before_the_model_changes(tmp_path: Path) -> None:
    manager = _saved(tmp_path / "ckpt", 1)
    rng = tmp_path / "ckpt" / step_dir_name(1) / "rng" / "rank-00000.json"
    state = json.loads(rng.read_text())
    state["numpy"][1] = state["numpy"][1][:10]  # a truncated Mersenne Twister key
    rng.write_text(json.dumps(state))
    _recommit(rng.parent.parent)

    model, optimizer = _model()
    with torch.no_grad():
        model.weight.zero_()
    with pytest.raises(CheckpointFormatError, match=f"{rng} is not an RNG state this trainer saved"):
        manager.load_latest(model, optimizer)
    assert model.weight.abs().sum() == 0


def test_a_commit_that_lists_a_file_outside_its_step_folder_is_skipped_as_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = _saved(tmp_path / "ckpt", 1, 2)
    newest = tmp_path / "ckpt" / step_dir_name(2)
    record = json.loads((newest / "COMMIT.json").read_text())
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("not part of any checkpoint")
    record["files"]["../../elsewhere.txt"] = {
        "sha256": hashlib.sha256(outside.read_bytes()).hexdigest(),
        "bytes": outside.stat().st_size,
    }
    (newest / "COMMIT.json").write_text(json.dumps(record))

    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        restored = manager.load_latest(*_model())
    assert restored is not None and restored.step == 1
    assert "lists the file '../../elsewhere.txt', which is not a path inside the step folder" in caplog.text
