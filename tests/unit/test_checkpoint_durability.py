"""A commit is durable and checked: every file of a save and its folders are fsynced before COMMIT.json takes its
name, whatever DCP's writer was told about syncing; and the writer reads its commit back, so a record that does
not list what was written is a failed save, not a checkpoint a later resume stumbles on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

from tests.unit.checkpoints import manager_at, no_key_and_quiet_dcp, tiny_model  # noqa: F401 - autouse fixture
from training.checkpoint import COMMIT, CheckpointCommitError, CheckpointManager, step_dir_name
from training.checkpoint.writer import Digests


class _SyscallLog:
    """os.fsync and os.replace/os.rename as a save calls them, in order, by real path."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []
        fsync, replace, rename = os.fsync, os.replace, os.rename

        def logged_fsync(fd: int) -> None:
            self.calls.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
            fsync(fd)

        def logged_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self.calls.append(("rename", os.path.realpath(os.fspath(dst))))
            replace(src, dst, *args, **kwargs)

        def logged_rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self.calls.append(("rename", os.path.realpath(os.fspath(dst))))
            rename(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", logged_fsync)
        monkeypatch.setattr(os, "replace", logged_replace)
        monkeypatch.setattr(os, "rename", logged_rename)

    @staticmethod
    def _tmp(path: str, real: str) -> tuple[str, ...]:
        """`path` when it is `real` under a temporary name (written there, then renamed)."""
        return (path,) if path.startswith(real + ".tmp") else ()

    def index(self, kind: str, path: Path) -> int:
        """Where the first `kind` call on `path` (or on it under a temporary name, `<path>.tmp...`, before its
        rename) happened; a failure naming it when it never did."""
        real = os.path.realpath(path)
        found = [k for k, (what, p) in enumerate(self.calls) if what == kind and p in (real, *self._tmp(p, real))]
        assert found, f"no {kind} of {path} in the save: {self.calls}"
        return found[0]


def _without_file_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP's writer with its file sync off, as a background save or another writer may have it."""
    original = dcp.FileSystemWriter

    def unsynced(*args: Any, **kwargs: Any) -> dcp.FileSystemWriter:
        return original(*args, **{**kwargs, "sync_files": False})

    monkeypatch.setattr(dcp, "FileSystemWriter", unsynced)


@pytest.mark.parametrize("writer_sync", [True, False], ids=["writer-syncs", "writer-sync-off"])
def test_every_file_and_folder_of_a_save_is_fsynced_before_its_commit_takes_its_name(
    writer_sync: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not writer_sync:
        _without_file_sync(monkeypatch)
    model, optimizer = tiny_model()
    manager = manager_at(tmp_path / "ckpt")
    syscalls = _SyscallLog(monkeypatch)
    manager.save(4, model, optimizer, {"step": 4})

    folder = tmp_path / "ckpt" / step_dir_name(4)
    commit = syscalls.index("rename", folder / COMMIT)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != COMMIT)
    assert any(p.suffix == ".distcp" for p in files) and (folder / ".metadata") in files
    late = [str(p.relative_to(folder)) for p in files if syscalls.index("fsync", p) > commit]
    assert late == [], f"fsynced only after {COMMIT} was renamed into place: {late}"
    folders = [folder, *(p for p in folder.rglob("*") if p.is_dir()), folder.parent]
    late = [str(p) for p in folders if syscalls.index("fsync", p) > commit]
    assert late == [], f"folders fsynced only after the commit: {late}"
    # and the commit's own name is flushed after it is in place
    assert any(c == ("fsync", os.path.realpath(folder)) for c in syscalls.calls[commit + 1 :])


def test_a_commit_that_lists_no_files_is_withdrawn_and_the_save_fails_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit = CheckpointManager._commit

    def commit_first(self: CheckpointManager, job: Any, path: str, digests: Any, disk_full: Any) -> int:
        """The broken order: COMMIT.json written as if before any file (the folder listed empty, nothing known)."""
        self._listing = lambda p: {}  # type: ignore[method-assign]
        try:
            return commit(self, job, path, Digests(), disk_full)
        finally:
            del self._listing

    monkeypatch.setattr(CheckpointManager, "_commit", commit_first)
    model, optimizer = tiny_model()
    manager = manager_at(tmp_path / "ckpt")
    with pytest.raises(CheckpointCommitError) as caught:
        manager.save(4, model, optimizer, {"step": 4})

    message = str(caught.value)
    assert caught.value.step == 4 and step_dir_name(4) in message
    assert "COMMIT.json lists no files" in message, message
    assert not (tmp_path / "ckpt" / step_dir_name(4) / COMMIT).exists()  # withdrawn: a partial checkpoint now
    assert manager.committed_steps() == []


def test_a_commit_that_leaves_out_a_written_file_fails_the_save_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = CheckpointManager._listing

    def without_train_state(self: CheckpointManager, path: str) -> dict[str, int]:
        return {rel: n for rel, n in listing(self, path).items() if rel != "train_state.json"}

    commit = CheckpointManager._commit

    def forgetful_commit(self: CheckpointManager, job: Any, path: str, digests: Any, disk_full: Any) -> int:
        """A commit whose listing misses train_state.json (and whose writer forgot it had written it)."""
        known = Digests()
        for rel, (sha, n) in digests.files().items():
            if rel != "train_state.json":
                known.add(rel, sha, n)
        self._listing = lambda p: without_train_state(self, p)  # type: ignore[method-assign]
        try:
            return commit(self, job, path, known, disk_full)
        finally:
            del self._listing

    monkeypatch.setattr(CheckpointManager, "_commit", forgetful_commit)
    model, optimizer = tiny_model()
    manager = manager_at(tmp_path / "ckpt")
    with pytest.raises(CheckpointCommitError, match="train_state.json was written but COMMIT.json does not list it"):
        manager.save(4, model, optimizer, {"step": 4})
    assert manager.committed_steps() == []


def test_a_sound_save_passes_its_own_commit_check(tmp_path: Path) -> None:
    model, optimizer = tiny_model()
    manager = manager_at(tmp_path / "ckpt")
    saved = manager.save(4, model, optimizer, {"step": 4})
    assert saved.step == 4 and manager.wholeness(4) == []
