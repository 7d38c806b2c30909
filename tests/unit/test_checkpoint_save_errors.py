"""A checkpoint save retries storage and network errors only: a bug inside it is raised at once, as itself."""

from __future__ import annotations

import errno
import logging
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from training.checkpoint import KEY_ENV, CheckpointManager, CheckpointSaveError, is_storage_error, step_dir_name
from training.config import CheckpointConfig
from training.storage import StorageConfig


@pytest.fixture(autouse=True)
def _no_key_and_quiet_dcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(8, 8)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _manager(root: Path) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(url=str(root), save_retries=2, save_retry_backoff_s=0), StorageConfig())


def _dcp_failure(exc: BaseException) -> CheckpointException:
    return CheckpointException("write_data", {1: (exc, traceback.StackSummary())})


class EndpointConnectionError(Exception):
    """botocore's, by name."""


@pytest.mark.parametrize(
    ("error", "storage"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (ConnectionResetError("reset by peer"), True),
        (TimeoutError("read timed out"), True),
        (EndpointConnectionError("Could not connect to the endpoint URL"), True),
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), True),
        (_dcp_failure(FileNotFoundError("gone")), True),
        (_dcp_failure(ValueError("bad plan")), False),
        (ValueError("a bug"), False),
        (TypeError("Object of type object is not JSON serializable"), False),
        (KeyError("optim"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_storage_and_network_errors_are_told_apart_from_bugs(error: BaseException, storage: bool) -> None:
    assert is_storage_error(error) is storage


def test_a_bug_in_the_save_is_raised_at_once_as_itself(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager = _manager(tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        with pytest.raises(TypeError, match="not JSON serializable"):
            manager.save(1, *_model(), {"step": 1, "oops": object()})
    assert "retrying" not in caplog.text


def test_a_bug_inside_dcp_is_unwrapped_and_raised_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    writes = []

    class BuggyWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # noqa: ANN001, ANN202
            writes.append(1)
            raise ValueError("a bug in the storage writer")

    monkeypatch.setattr(CheckpointManager, "_writer", lambda self, path, *_: BuggyWriter(path))
    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        with pytest.raises(ValueError, match="a bug in the storage writer") as raised:
            _manager(tmp_path / "ckpt").save(1, *_model(), {"step": 1})
    assert isinstance(raised.value.__cause__, CheckpointException)
    assert writes == [1] and "retrying" not in caplog.text


def test_storage_failures_still_end_in_checkpoint_save_error_and_leave_no_partial_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class DownWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # noqa: ANN001, ANN202
            (Path(self.path) / "__0_0.distcp").write_bytes(b"half a shard")
            raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(CheckpointManager, "_writer", lambda self, path, *_: DownWriter(path))
    with pytest.raises(CheckpointSaveError, match="failed after 3 attempt"):
        _manager(tmp_path / "ckpt").save(1, *_model(), {"step": 1})
    assert not (tmp_path / "ckpt" / step_dir_name(1)).exists()
