"""copy_step copies a committed checkpoint step by the commit protocol: only what COMMIT.json lists, every file
checked on the way and on the copy, COMMIT.json last; a source that is not committed or not what its commit
says is refused naming the file, and a copy that fails leaves nothing that looks committed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from tests.unit.checkpoints import manager_at, no_key_and_quiet_dcp, saved_steps  # noqa: F401 - autouse fixture
from training.checkpoint import COMMIT, CheckpointCopyError, commit_digest, copy_step, step_dir_name
from training.checkpoint import commit as commit_module
from training.storage import StorageConfig

STORAGE = StorageConfig()


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_committed_step_is_copied_whole_with_the_same_commit_digest_and_loads_as_sound(tmp_path: Path) -> None:
    saved_steps(tmp_path / "src", 4)
    src = tmp_path / "src" / step_dir_name(4)

    copied = copy_step(str(src), str(tmp_path / "dst"), STORAGE)

    assert copied == str(tmp_path / "dst" / step_dir_name(4))
    assert _files(Path(copied)) == _files(src)
    assert commit_digest(copied, STORAGE) == commit_digest(str(src), STORAGE)
    assert commit_digest(copied, STORAGE) == hashlib.sha256((src / COMMIT).read_bytes()).hexdigest()
    assert manager_at(tmp_path / "dst").sound(4) is not None


def test_a_source_without_commit_json_is_refused_naming_it_and_nothing_is_written(tmp_path: Path) -> None:
    saved_steps(tmp_path / "src", 4)
    src = tmp_path / "src" / step_dir_name(4)
    (src / COMMIT).unlink()

    with pytest.raises(CheckpointCopyError) as caught:
        copy_step(str(src), str(tmp_path / "dst"), STORAGE)

    assert caught.value.path == str(src / COMMIT)
    assert "not committed" in str(caught.value) and "copy a committed step" in str(caught.value)
    assert not (tmp_path / "dst" / step_dir_name(4)).exists()
    with pytest.raises(FileNotFoundError):
        commit_digest(str(src), STORAGE)


def test_a_corrupt_source_file_is_refused_naming_it_and_the_copy_is_not_committed(tmp_path: Path) -> None:
    saved_steps(tmp_path / "src", 4)
    src = tmp_path / "src" / step_dir_name(4)
    shard = sorted(src.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    with pytest.raises(CheckpointCopyError) as caught:
        copy_step(str(src), str(tmp_path / "dst"), STORAGE)

    assert caught.value.path == str(shard) and "fails its sha256 check" in str(caught.value)
    assert not (tmp_path / "dst" / step_dir_name(4) / COMMIT).exists()
    assert manager_at(tmp_path / "dst").committed_steps() == []


def test_a_truncated_source_file_is_refused_naming_its_size(tmp_path: Path) -> None:
    saved_steps(tmp_path / "src", 4)
    src = tmp_path / "src" / step_dir_name(4)
    train_state = src / "train_state.json"
    whole = train_state.read_bytes()
    train_state.write_bytes(whole[:-3])

    with pytest.raises(CheckpointCopyError) as caught:
        copy_step(str(src), str(tmp_path / "dst"), STORAGE)

    assert caught.value.path == str(train_state)
    assert f"holds {len(whole) - 3} bytes, {COMMIT} says {len(whole)}" in str(caught.value)


def test_a_commit_that_is_not_the_recorded_one_is_refused(tmp_path: Path) -> None:
    saved_steps(tmp_path / "src", 4)
    src = tmp_path / "src" / step_dir_name(4)

    with pytest.raises(CheckpointCopyError, match="not the 0{64} recorded for it"):
        copy_step(str(src), str(tmp_path / "dst"), STORAGE, expect_commit_sha256="0" * 64)
    assert not (tmp_path / "dst" / step_dir_name(4)).exists()


def test_a_destination_that_has_the_step_already_is_refused_and_left_alone(tmp_path: Path) -> None:
    saved_steps(tmp_path / "src", 4)
    src = tmp_path / "src" / step_dir_name(4)
    taken = tmp_path / "dst" / step_dir_name(4)
    taken.mkdir(parents=True)
    (taken / "mine").write_text("not the copy's")

    with pytest.raises(CheckpointCopyError, match="exists already"):
        copy_step(str(src), str(tmp_path / "dst"), STORAGE)
    assert _files(taken) == {"mine": b"not the copy's"}


def _failing_on(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy of the file `name` fails with an I/O error after the files before it were copied."""
    copy_file = commit_module._copy_file

    def failing(src_fs: Any, src: str, dst_fs: Any, dst: str, limit: int, local: bool) -> tuple[str, int]:
        if src.endswith("/" + name):
            raise OSError(5, "Input/output error", src)
        return copy_file(src_fs, src, dst_fs, dst, limit, local)

    monkeypatch.setattr(commit_module, "_copy_file", failing)


def test_a_copy_that_fails_midway_is_removed_and_raises_the_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_steps(tmp_path / "src", 4)
    _failing_on("train_state.json", monkeypatch)

    with pytest.raises(OSError, match="Input/output error"):
        copy_step(str(tmp_path / "src" / step_dir_name(4)), str(tmp_path / "dst"), STORAGE)
    assert not (tmp_path / "dst" / step_dir_name(4)).exists()


def test_a_copy_cut_short_before_its_cleanup_has_no_commit_json_and_loads_as_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_steps(tmp_path / "src", 4)
    _failing_on("train_state.json", monkeypatch)  # sorted last but one: the other files are copied first
    monkeypatch.setattr(commit_module, "_remove_copy", lambda fs, path, url: None)  # as if the process died

    with pytest.raises(OSError):
        copy_step(str(tmp_path / "src" / step_dir_name(4)), str(tmp_path / "dst"), STORAGE)

    left = _files(tmp_path / "dst" / step_dir_name(4))
    assert left and COMMIT not in left  # files were copied, the commit was not
    dst = manager_at(tmp_path / "dst")
    assert dst.committed_steps() == [] and dst.latest_sound() is None
