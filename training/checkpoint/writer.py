"""The writing side of a save below the manager: the job a save writes, DCP's filesystem hashing each file as it
is written, and the drill's phase points around the DCP write."""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from training import drill_points
from training.storage import DigestingWriter


@dataclass(frozen=True)
class SavedCheckpoint:
    """A committed save: its step, the bytes its COMMIT.json lists, the seconds from the save call to the commit,
    and the seconds of those the caller was held (all of them for `save`; for `save_async` the wait for the
    previous save, the copy of the state to host memory, and the caller's `wait` for this save to commit)."""

    step: int
    nbytes: int
    seconds: float
    stall_s: float


@dataclass
class SaveJob:
    """One save as its writing side sees it: the state and files taken at the save call, and where ranks meet."""

    step: int
    state: dict[str, Any]  # for DCP: the live tensors (blocking save) or a staged copy (background save)
    files: dict[str, bytes]  # this rank's other files by relative path: its RNG file; rank 0 train_state.json, card
    problem: Exception | None  # a bug met while taking them, raised inside the save where every rank learns of it
    group: dist.ProcessGroup | None  # the collectives' group (None: the default one)
    started: float  # time.perf_counter() at the save call


class Digests:
    """sha256 and size of each file one rank wrote in one save attempt, by path relative to the step folder."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # DCP's writer threads add theirs concurrently
        self._files: dict[str, tuple[str, int]] = {}

    def add(self, rel: str, sha256: str, nbytes: int) -> None:
        """Record one written file."""
        with self._lock:
            self._files[rel] = (sha256, nbytes)

    def rename(self, rel: str, new_rel: str) -> None:
        """A written file was renamed (DCP writes .metadata under a temporary name)."""
        with self._lock:
            if rel in self._files:
                self._files[new_rel] = self._files.pop(rel)

    def files(self) -> dict[str, tuple[str, int]]:
        """What was recorded so far."""
        with self._lock:
            return dict(self._files)


class DigestingFileSystem:
    """A DCP writer's filesystem whose written files are hashed as they are written, into `digests`."""

    def __init__(self, inner: Any, digests: Digests) -> None:
        self.inner, self.digests = inner, digests

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        """The inner stream; one opened for writing passes through a DigestingWriter."""
        with self.inner.create_stream(path, mode) as stream:
            if "r" in mode:
                yield stream
                return
            writer = DigestingWriter(stream)
            yield writer
        self.digests.add(posixpath.basename(os.fspath(path)), writer.hexdigest(), writer.nbytes)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        """Rename, and carry the digest along."""
        self.inner.rename(path, new_path)
        self.digests.rename(posixpath.basename(os.fspath(path)), posixpath.basename(os.fspath(new_path)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class PhaseWriter(StorageWriter):
    """A DCP writer with the "writing_dcp" drill point (training/drill_points.py) around this rank's file write (only
    in a drill's job)."""

    def __init__(self, inner: StorageWriter, step: int) -> None:
        self.inner, self.save_step = inner, step

    @property
    def checkpoint_id(self) -> Any:
        """The inner writer's (DCP's logger reads it)."""
        return getattr(self.inner, "checkpoint_id", None)

    def reset(self, checkpoint_id: Any = None) -> None:
        """Delegated."""
        self.inner.reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Delegated (with the rank and use_collectives DCP passes)."""
        self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def storage_meta(self) -> Any:
        """Delegated."""
        return self.inner.storage_meta()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Delegated."""
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Delegated."""
        return self.inner.prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's DCP files, with the phase point before and after writing them."""
        drill_points.at_save_phase("writing_dcp", self.save_step, shard_written=False)
        written = self.inner.write_data(plan, planner)
        written.wait()
        drill_points.at_save_phase("writing_dcp", self.save_step, shard_written=True)
        return written

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """Delegated."""
        self.inner.finish(metadata, results)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never chosen by DCP itself: always given as the storage writer."""
        return False


def fsync_path(path: str) -> None:
    """fsync a local file or folder by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
