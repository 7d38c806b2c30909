"""Small control files on shared storage (LEASE.json, COMMIT.json, ...) are read with a bound and only when they
are regular files: a link to /dev/zero, a FIFO or a huge file in their place is refused at once, naming the file.

Before the fix a link to /dev/zero grew the reader without bound and a FIFO blocked it forever, so each read runs
in a child process under a memory limit and a timeout: the old behaviour shows as a failure, not as a hang or an
exhausted machine.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tests.conftest import REPO
from training.checkpoint import COMMIT, step_dir_name
from training.lease import LEASE_FILE
from training.storage import CONTROL_FILE_MAX_BYTES, ControlFileError, read_control_file

CHILD_MEMORY_BYTES = 3 << 30
"""Address space of the child: torch imports in it; a reader filling memory from /dev/zero stops here."""
CHILD_TIMEOUT_S = 60
"""A hang guard only (a FIFO blocked the old reader forever); the refusal itself is one open and one fstat."""
LEASE_READ = """
from training.lease import Lease
Lease(root, job_id="second").acquire()
"""
COMMIT_READ = """
from training.checkpoint import CheckpointManager
from training.config import CheckpointConfig
from training.storage import StorageConfig
CheckpointManager(CheckpointConfig(url=root), StorageConfig()).read_commit(10)
"""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, resource.RLIM_INFINITY))


def _refusals(code: str, roots: list[Path]) -> list[str]:
    """What one child that runs `code` on each of `roots` in turn raised each time: `ClassName: message`."""
    script = "\n".join(
        [
            "import sys",
            f"for root in {[str(root) for root in roots]!r}:",
            "    try:",
            textwrap.indent(code.strip(), "        "),
            "    except Exception as err:",
            "        print(f'{type(err).__name__}: {err}', flush=True)",
            "    else:",
            "        sys.exit(f'{root}: read without an error')",
        ]
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
            preexec_fn=_limit_memory, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"a read did not return within {CHILD_TIMEOUT_S} s (blocked on the file); printed: {err.stdout!r}")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


def _plant(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        with path.open("wb") as handle:  # sparse: no disk used
            handle.truncate(CONTROL_FILE_MAX_BYTES + 1)


KINDS = {
    "dev-zero": "is a symbolic link (to /dev/zero), not a file",
    "fifo": "is a FIFO, not a regular file",
    "huge": f"holds {CONTROL_FILE_MAX_BYTES + 1} bytes, more than the {CONTROL_FILE_MAX_BYTES}",
}


@pytest.mark.timeout(2 * CHILD_TIMEOUT_S)
def test_a_lease_file_that_is_no_small_regular_file_is_refused_naming_it(tmp_path: Path) -> None:
    roots = [tmp_path / kind for kind in KINDS]
    for root, kind in zip(roots, KINDS, strict=True):
        _plant(root / LEASE_FILE, kind)
    refusals = _refusals(LEASE_READ, roots)
    for root, kind, refusal in zip(roots, KINDS, refusals, strict=True):
        assert refusal.startswith(f"ControlFileError: {root / LEASE_FILE}: {KINDS[kind]}"), refusal
        assert "remove it" in refusal


@pytest.mark.timeout(2 * CHILD_TIMEOUT_S)
def test_a_commit_record_that_is_no_small_regular_file_is_refused_naming_it(tmp_path: Path) -> None:
    roots = [tmp_path / kind for kind in KINDS]
    for root, kind in zip(roots, KINDS, strict=True):
        _plant(root / step_dir_name(10) / COMMIT, kind)
    refusals = _refusals(COMMIT_READ, roots)
    for root, kind, refusal in zip(roots, KINDS, refusals, strict=True):
        assert refusal.startswith(f"CheckpointFormatError: {root / step_dir_name(10) / COMMIT} {KINDS[kind]}"), refusal


class _CountingMemoryFileSystem(MemoryFileSystem):
    """An in-memory object store that counts the bytes handed out by reads."""

    read_bytes = 0

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        data = super().cat_file(path, start=start, end=end, **kwargs)
        type(self).read_bytes += len(data)
        return data


def test_an_oversized_control_file_on_an_object_store_is_refused_before_it_is_read() -> None:
    fs = _CountingMemoryFileSystem(skip_instance_cache=True)
    fs.pipe_file("/bucket/run/LEASE.json", b"{}")
    fs.pipe_file("/bucket/ckpt/COMMIT.json", b" " * (CONTROL_FILE_MAX_BYTES + 1))
    assert read_control_file(fs, "/bucket/run/LEASE.json") == b"{}"
    with pytest.raises(ControlFileError, match=r"^/bucket/ckpt/COMMIT.json: holds 4194305 bytes, more than"):
        read_control_file(fs, "/bucket/ckpt/COMMIT.json")
    assert _CountingMemoryFileSystem.read_bytes == 2
