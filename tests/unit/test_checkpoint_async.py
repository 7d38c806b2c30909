"""Background saves and checksums taken while writing: an async save keeps the state of its call and commits a
verified checkpoint; its failure reaches the next save; files are hashed as written (never read back) and
verified several at a time on load, a corrupt one found; a commit of the earlier (read-back) kind still loads."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.unit.checkpoints import (
    manager_at,
    no_key_and_quiet_dcp,  # noqa: F401 - autouse fixture
    saved_steps,
    tiny_model,
)
from training import storage
from training.checkpoint import space, store
from training.checkpoint import COMMIT, CheckpointManager, CheckpointSaveError, step_dir_name
from training.config import CheckpointConfig
from training.storage import StorageConfig


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _held_back(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Background saves start writing only once the returned event is set."""
    release = threading.Event()
    run = CheckpointManager._run

    def held(self: CheckpointManager, job: object) -> int:
        assert release.wait(30), "the test never released the save"
        return run(self, job)

    monkeypatch.setattr(CheckpointManager, "_run", held)
    return release


def test_an_async_save_keeps_the_state_of_its_call_and_commits_a_verified_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = tiny_model()
    at_call = _params(model)
    moments = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
    manager = manager_at(tmp_path)
    release = _held_back(monkeypatch)

    assert manager.save_async(3, model, optimizer, {"step": 3}) is None  # returned before anything is written
    assert manager.files(3) == []
    with torch.no_grad():  # training goes on meanwhile
        for p in model.parameters():
            p.add_(1.0)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    release.set()
    saved = manager.wait()

    assert saved is not None and saved.step == 3 and saved.nbytes > 0 and 0 < saved.stall_s <= saved.seconds
    assert manager.wait() is None
    assert manager.wholeness(3) == [] and manager.sound(3) is not None
    fresh, fresh_optimizer = tiny_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    restored = manager_at(tmp_path).load_latest(fresh, fresh_optimizer)
    assert restored is not None and restored.step == 3
    for name, p in fresh.named_parameters():
        assert torch.equal(p, at_call[name]), name
    for key, exp_avg in fresh_optimizer.state_dict()["state"].items():
        assert torch.equal(exp_avg["exp_avg"], moments[key])


class _DownWriter(dcp.FileSystemWriter):
    def write_data(self, plan, planner):  # noqa: ANN001, ANN201
        (Path(self.path) / "__0_0.distcp").write_bytes(b"half a shard")
        raise ConnectionResetError("connection reset by peer")


def test_a_failed_background_save_is_raised_by_the_next_save_and_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = CheckpointConfig(url=str(tmp_path), save_retries=1, save_retry_backoff_s=0)
    manager = CheckpointManager(cfg, StorageConfig())
    monkeypatch.setattr(CheckpointManager, "_writer", lambda self, path, *_: _DownWriter(path))
    model, optimizer = tiny_model()

    manager.save_async(1, model, optimizer, {"step": 1})
    with pytest.raises(CheckpointSaveError, match="failed after 2 attempt") as failed:
        manager.save_async(2, model, optimizer, {"step": 2})
    assert failed.value.step == 1
    assert manager.wait() is None  # the save of step 2 never started
    assert not (tmp_path / step_dir_name(1)).exists() and not (tmp_path / step_dir_name(2)).exists()


def test_a_bug_in_a_background_save_is_raised_as_itself_and_nothing_is_committed(tmp_path: Path) -> None:
    manager = manager_at(tmp_path)
    manager.save_async(1, *tiny_model(), {"step": 1, "oops": object()})
    with pytest.raises(TypeError, match="not JSON serializable"):
        manager.wait()
    assert manager.committed_steps() == []


def test_checksums_are_taken_as_the_files_are_written_and_nothing_is_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_back: list[str] = []

    def spy(fs: object, path: str, chunk_bytes: int = 0) -> str:
        read_back.append(path)
        return "0" * 64

    monkeypatch.setattr(storage, "sha256_file", spy)
    monkeypatch.setattr(store, "sha256_file", spy)
    manager = saved_steps(tmp_path, 1)
    assert read_back == []

    folder = tmp_path / step_dir_name(1)
    commit = json.loads((folder / COMMIT).read_text())
    assert sorted(commit["files"]) == [f for f in manager.files(1) if f != COMMIT]
    for rel, entry in commit["files"].items():
        data = (folder / rel).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}, rel


def _wide_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_large_state_is_written_as_several_files_and_a_corrupt_one_among_them_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(space, "_BYTES_PER_WRITE_THREAD", 1024)  # this small model counts as large
    model, optimizer = _wide_model()
    manager = manager_at(tmp_path)
    manager.save(1, model, optimizer, {"step": 1})
    manager.save_async(2, model, optimizer, {"step": 2})
    manager.wait()
    shards = sorted((tmp_path / step_dir_name(2)).glob("*.distcp"))
    assert len(shards) == space.MAX_IO_THREADS
    assert manager.sound(2) is not None

    data = bytearray(shards[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[-1].write_bytes(bytes(data))
    skipped: list = []
    found = manager_at(tmp_path).latest_sound(skipped)
    assert found is not None and found[0] == 1
    assert [(s.step, s.reason, s.detail) for s in skipped] == [
        (2, "corrupt", f"{shards[-1].name} fails its sha256 check")
    ]
    restored = manager_at(tmp_path).load_latest(*_wide_model())
    assert restored is not None and restored.step == 1


def test_a_checkpoint_whose_commit_was_taken_by_reading_the_files_back_still_loads(tmp_path: Path) -> None:
    model, optimizer = tiny_model()
    manager = saved_steps(tmp_path, 4)
    folder = tmp_path / step_dir_name(4)
    # COMMIT.json as the earlier save wrote it: the folder listed, every file read back and hashed.
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != COMMIT)
    record = {
        "step": 4,
        "world_size": 1,
        "layout": "",
        "contents": ["model", "optim"],
        "created_unix_s": 0.0,
        "files": {
            rel: {
                "sha256": hashlib.sha256((folder / rel).read_bytes()).hexdigest(),
                "bytes": (folder / rel).stat().st_size,
            }
            for rel in files
        },
    }
    (folder / COMMIT).write_text(json.dumps(record, indent=2))

    fresh, fresh_optimizer = tiny_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    restored = manager.load_latest(fresh, fresh_optimizer)
    assert restored is not None and restored.step == 4
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
