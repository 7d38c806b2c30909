"""Distributed checkpoints with torch.distributed.checkpoint on any fsspec URL.

Layout of one checkpoint::

    <url>/step-00000040/.metadata, __<rank>_<n>.distcp   model + optimizer (DCP, sharded)
    <url>/step-00000040/train_state.json                 step, sampler position, LR scheduler, loss scaler
    <url>/step-00000040/rng/rank-00000.json              per-rank python/numpy/torch RNG states
    <url>/step-00000040/COMMIT.json                      written last: file list with sha256

A checkpoint exists only once COMMIT.json is there. Loading takes the newest
committed checkpoint whose files all match their checksums; a partial or
corrupt one is skipped with a warning that names it. Model and optimizer state
load under another world size (DCP reshards); per-rank RNG states then cannot
apply and are re-seeded, which the loader says.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from training import faults
from training.config import CheckpointConfig
from training.storage import StorageConfig, filesystem, is_local, join, local_path, sha256_file, write_bytes_atomic

log = logging.getLogger(__name__)

COMMIT = "COMMIT.json"
TRAIN_STATE = "train_state.json"
_STEP_DIR = re.compile(r"step-(\d{8})$")


class CheckpointSaveError(RuntimeError):
    """A save failed after every retry; the previous complete checkpoint is still intact."""

    def __init__(self, path: str, attempts: int, cause: BaseException) -> None:
        super().__init__(f"checkpoint save to {path} failed after {attempts} attempt(s): {cause}")
        self.path, self.attempts = path, attempts


@dataclass
class Restored:
    """What a load brought back."""

    step: int
    path: str
    train_state: dict[str, Any]
    saved_world_size: int
    rng_restored: bool


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint taken after `step` optimizer steps."""
    return f"step-{step:08d}"


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as JSON-safe data."""
    np_state = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


class CheckpointManager:
    """Saves, finds, verifies, loads and prunes checkpoints. `save` and `load_latest` are collective."""

    def __init__(self, cfg: CheckpointConfig, storage: StorageConfig) -> None:
        self.cfg, self.storage = cfg, storage
        self.fs, self.root = filesystem(cfg.url, storage)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def _dir(self, step: int) -> str:
        return join(self.root, step_dir_name(step))

    def _writer(self, path: str) -> dcp.StorageWriter:
        if is_local(self.cfg.url):
            return dcp.FileSystemWriter(local_path(path))
        return FsspecWriter(path, **self.storage.fsspec_options(self.cfg.url))

    def _reader(self, path: str) -> dcp.StorageReader:
        if is_local(self.cfg.url):
            return dcp.FileSystemReader(local_path(path))
        return FsspecReader(path, **self.storage.fsspec_options(self.cfg.url))

    def _url(self, path: str) -> str:
        """Full URL of a protocol-less path (for fsspec readers/writers and messages)."""
        if is_local(self.cfg.url):
            return path
        return f"{self.cfg.url.split('://', 1)[0]}://{path}"

    def steps_on_storage(self) -> list[int]:
        """Every step that has a checkpoint folder, committed or not, ascending."""
        if not self.fs.exists(self.root):
            return []
        steps = []
        for entry in self.fs.ls(self.root, detail=False):
            match = _STEP_DIR.search(entry.rstrip("/"))
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def read_commit(self, step: int) -> dict[str, Any] | None:
        """The COMMIT.json of `step`, or None while that checkpoint is unfinished."""
        try:
            return json.loads(self.fs.cat_file(join(self._dir(step), COMMIT)))
        except FileNotFoundError:
            return None

    # ---- save -------------------------------------------------------------------------------

    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]
    ) -> float:
        """Write and commit the checkpoint of `step` (collective); returns the bytes written.

        A storage failure on any rank fails the attempt on every rank together (no rank is left
        waiting in a collective); the attempt is retried with backoff, then CheckpointSaveError.
        """
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if faults.active().checkpoint_without_optimizer:
            del state["optim"]
        path = self._dir(step)
        delay = self.cfg.save_retry_backoff_s
        for attempt in range(1, self.cfg.save_retries + 2):
            try:
                return self._save_once(step, state, train_state, path)
            except _StorageFailure as err:
                if attempt > self.cfg.save_retries:
                    raise CheckpointSaveError(self._url(path), attempt, err) from err
                if self.rank == 0:
                    log.warning(
                        "checkpoint save to %s failed (attempt %d): %s; retrying in %.1fs", path, attempt, err, delay
                    )
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _save_once(self, step: int, state: dict[str, Any], train_state: dict[str, Any], path: str) -> int:
        def clear() -> None:
            if self.rank == 0 and self.fs.exists(path):
                self.fs.rm(path, recursive=True)  # leftovers of an attempt that never committed

        _agree(clear)
        _agree(lambda: dcp.save(state, storage_writer=self._writer(self._url(path))))

        def extras() -> None:
            rng = json.dumps(capture_rng()).encode()
            write_bytes_atomic(self.fs, join(path, "rng", f"rank-{self.rank:05d}.json"), rng)
            if self.rank == 0:
                write_bytes_atomic(self.fs, join(path, TRAIN_STATE), json.dumps(train_state, indent=2).encode())

        _agree(extras)
        files = _agree(lambda: sorted(self._relative_files(path)))
        mine = _agree(lambda: {rel: sha256_file(self.fs, join(path, rel)) for rel in files[self.rank :: self.world]})
        hashes = _all_gather(mine)
        faults.maybe_kill_during_save(step)

        def commit() -> int:
            if self.rank != 0:
                return 0
            checksums = {rel: digest for part in hashes for rel, digest in part.items()}
            sizes = {rel: self.fs.size(join(path, rel)) for rel in checksums}
            record = {
                "step": step,
                "world_size": self.world,
                "contents": sorted(state),
                "created_unix_s": time.time(),
                "files": {rel: {"sha256": checksums[rel], "bytes": sizes[rel]} for rel in sorted(checksums)},
            }
            write_bytes_atomic(self.fs, join(path, COMMIT), json.dumps(record, indent=2).encode())
            return sum(sizes.values())

        nbytes = _agree(commit)
        if self.rank == 0:
            try:
                self._prune()
            except Exception as err:  # noqa: BLE001 - pruning is housekeeping: the checkpoint is committed
                log.warning("could not prune old checkpoints under %s: %s", self.cfg.url, err)
        _barrier()
        return nbytes

    def _relative_files(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        found = self.fs.find(path)
        return [
            f[len(prefix) :] for f in (p.rstrip("/") for p in found) if f.startswith(prefix) and not f.endswith(COMMIT)
        ]

    def _prune(self) -> None:
        steps = self.steps_on_storage()
        committed = [s for s in steps if self.read_commit(s) is not None]
        keep = set(committed[-self.cfg.keep_last :])
        newest = committed[-1] if committed else -1
        for step in steps:
            # Old committed ones beyond keep_last go; so do unfinished ones older than the newest commit.
            if step not in keep and step <= newest:
                self.fs.rm(self._dir(step), recursive=True)

    # ---- load -------------------------------------------------------------------------------

    def verify(self, step: int, commit: dict[str, Any]) -> str | None:
        """Why checkpoint `step` cannot be used (None when it is sound). Every rank checks a share of the files."""
        path = self._dir(step)
        names = sorted(commit["files"])
        problem = None
        for rel in names[self.rank :: self.world]:
            expected = commit["files"][rel]
            full = join(path, rel)
            if not self.fs.exists(full):
                problem = f"{rel} is missing"
            elif self.fs.size(full) != expected["bytes"]:
                problem = f"{rel} has {self.fs.size(full)} bytes, COMMIT.json says {expected['bytes']}"
            elif self.cfg.verify_checksums and sha256_file(self.fs, full) != expected["sha256"]:
                problem = f"{rel} fails its sha256 check"
            if problem:
                break
        problems = [p for p in _all_gather(problem) if p]
        return problems[0] if problems else None

    def latest_sound(self) -> tuple[int, dict[str, Any]] | None:
        """Newest committed, verified checkpoint; partial and corrupt ones are skipped with a warning."""
        steps = _broadcast_from_rank0(self.steps_on_storage() if self.rank == 0 else None)
        for step in reversed(steps):
            commit = _broadcast_from_rank0(self.read_commit(step) if self.rank == 0 else None)
            name = self._url(self._dir(step))
            if commit is None:
                if self.rank == 0:
                    log.warning("skipping partial checkpoint %s: no %s (the save never finished)", name, COMMIT)
                continue
            problem = self.verify(step, commit)
            if problem:
                if self.rank == 0:
                    log.warning("skipping corrupt checkpoint %s: %s", name, problem)
                continue
            return step, commit
        return None

    def load_latest(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Restored | None:
        """Restore model, optimizer and per-rank RNG from the newest sound checkpoint (None: start fresh)."""
        found = self.latest_sound()
        if found is None:
            return None
        step, commit = found
        path = self._dir(step)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        contents = commit.get("contents", ["model", "optim"])
        if "optim" not in contents:
            del state["optim"]
            if self.rank == 0:
                log.warning("checkpoint %s has no optimizer state: the optimizer starts afresh", self._url(path))
        dcp.load(state, storage_reader=self._reader(self._url(path)))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state.get("optim", optim_sd))
        train_state = json.loads(self.fs.cat_file(join(path, TRAIN_STATE)))
        saved_world = int(commit["world_size"])
        rng_restored = saved_world == self.world
        if rng_restored:
            restore_rng(json.loads(self.fs.cat_file(join(path, "rng", f"rank-{self.rank:05d}.json"))))
        elif self.rank == 0:
            log.warning(
                "checkpoint %s was saved by %d ranks and is loaded by %d: model and optimizer resharded, "
                "per-rank RNG states re-seeded",
                self._url(path),
                saved_world,
                self.world,
            )
        return Restored(step, self._url(path), train_state, saved_world, rng_restored)


class _StorageFailure(RuntimeError):
    """A storage operation failed on some rank during a save."""


def _agree(operation: Any) -> Any:
    """Run a rank-local storage operation; if it fails on any rank, raise _StorageFailure on every rank."""
    try:
        result, error = operation(), None
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's exception is a BaseException
        result, error = None, f"rank {dist.get_rank() if dist.is_initialized() else 0}: {type(err).__name__}: {err}"
    errors = [e for e in _all_gather(error) if e]
    if errors:
        raise _StorageFailure(errors[0])
    return result


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast_from_rank0(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
