"""The collective side of checkpoints: save (blocking or in the background), verify, resume, retention."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import gc
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from training import drill_points
from training.checkpoint.card import ModelCard
from training.checkpoint.collective import StorageFailure, agree, all_gather, barrier, broadcast_from_rank0
from training.checkpoint.commit import check_train_state, parse_json
from training.checkpoint.errors import CheckpointCommitError, CheckpointFormatError, CheckpointSaveError
from training.checkpoint.files import COMMIT, MODEL_CARD, TRAIN_STATE, loader_files, rng_file
from training.checkpoint.optim_state import make_state_to_load
from training.checkpoint.reader import (
    DATA_SUFFIX,
    CheckpointDigestError,
    VerifyingFileSystemReader,
    VerifyingFsspecReader,
    share,
)
from training.checkpoint.rng import capture_rng, check_rng, restore_rng
from training.checkpoint.space import MAX_IO_THREADS, Space, estimate, write_threads
from training.checkpoint.store import CheckpointStore, dcp_load
from training.checkpoint.trust import (
    CheckpointKeyError,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    sign_commit,
    untrusted_reason,
)
from training.checkpoint.writer import (
    Digests,
    DigestingFileSystem,
    PhaseWriter,
    SavedCheckpoint,
    SaveJob,
    fsync_path,
)
from training.config import CheckpointConfig
from training.run_output import ResumeRecord, RunOutputWriter, SkippedCheckpoint
from training.storage import (
    StorageConfig,
    format_bytes,
    free_bytes,
    is_local,
    join,
    local_path,
    no_space_message,
    sha256_files,
    write_bytes_atomic,
)

log = logging.getLogger(__name__)

SAVE_HELD_WARN_AFTER_S = 5.0
"""A caller held this long by a save (a synchronous one, or `wait` on a background one) hears it in a warning that
names the storage, and again every SAVE_HELD_WARN_EVERY_S."""
SAVE_HELD_WARN_EVERY_S = 30.0


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was before, after it), for a load or a blocking
    save. Each allocates tens of thousands of objects that live on until it returns (DCP's metadata, plans, read
    and write items), every few hundred of which would start a collection, and a full one walks the trainer's whole
    heap: about a fifth of a resume's load on the CPU, a tenth of a save. Neither makes reference cycles worth
    collecting before it returns; the next collection after it finds what there is."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass
class Restored:
    """What a load brought back."""

    step: int
    path: str
    train_state: dict[str, Any]
    saved_world_size: int
    rng_restored: bool


# Optimizer state keyed by parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): pipeline stages and
# expert-parallel ranks hold different parameters, so their param_groups lists would collide under one DCP key.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# Checkpoints of earlier versions keep torch's list-keyed layout ("optim.param_groups.0.lr"); they still load.
_LIST_KEYED = StateDictOptions()
_LIST_KEYED_OPTIMIZER = "optim.param_groups.0.lr"  # by name it would be optim.param_groups.<fqn>.lr


class CheckpointManager(CheckpointStore):
    """Saves, finds, verifies, loads and prunes checkpoints. `save` and `load_latest` are collective."""

    def __init__(
        self, cfg: CheckpointConfig, storage: StorageConfig, layout: str = "", card: dict[str, Any] | None = None
    ) -> None:
        """`layout` names the model-parallel layout ("" for pure data parallelism, which reshards freely): a
        checkpoint loaded under another layout or world size is resharded and its per-rank RNG states unused.
        `card` (a ModelCard's JSON data) is written into every checkpoint as model.json, before its commit."""
        super().__init__(cfg, storage)
        self.layout = layout
        self.card = None if card is None else ModelCard.model_validate(card).model_dump(mode="json")
        self._group: dist.ProcessGroup | None = None  # background saves' collectives (made by the first one)
        self._stager: DefaultStager | None = None  # keeps its host buffers from one background save to the next
        self._pending: concurrent.futures.Future[SavedCheckpoint] | None = None
        self._pending_step, self._pending_started = 0, 0.0
        if self.key is not None and not cfg.verify_checksums and self.rank == 0:
            log.warning("checkpoint.verify_checksums=false is overridden: with TDEPLOY_CHECKPOINT_KEY set every "
                        "checksum is verified, since the signature covers the files only through them")  # fmt: skip

    def _writer(self, path: str, digests: Digests, threads: int = 1) -> dcp.StorageWriter:
        """DCP's writer for `path` (`threads` files, each hashed into `digests` as written). Local files are
        fsynced before the commit; an object store has a file once its upload returns."""
        writer: dcp.FileSystemWriter
        if is_local(self.cfg.url):
            # DCP's own fsync of each file; `_flush` syncs them (and the folders) again before the commit, so a
            # writer with its sync off cannot commit data that is still in the page cache.
            writer = dcp.FileSystemWriter(local_path(path), sync_files=True, thread_count=threads)
        else:
            writer = FsspecWriter(
                path, sync_files=False, thread_count=threads, **self.storage.fsspec_options(self.cfg.url)
            )
        writer.fs = DigestingFileSystem(writer.fs, digests)
        return writer

    # ---- save -------------------------------------------------------------------------------

    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]
    ) -> SavedCheckpoint:
        """Write and commit the checkpoint of `step` (collective) before returning.

        A background save still in flight is awaited first (call `wait` before to have its record).
        A storage failure on any rank fails the attempt on every rank together (no rank is left
        waiting in a collective); the attempt is retried with backoff, then CheckpointSaveError.
        Any other exception is a bug: raised at once on every rank.
        """
        started = time.perf_counter()
        self.wait()
        with self._warn_while_held(step, started), _gc_paused():  # the caller is held anyway: no collection meanwhile
            nbytes = self._run(self._job(step, model, optimizer, train_state, started, group=None, stage=False))
        seconds = time.perf_counter() - started
        return SavedCheckpoint(step, nbytes, seconds, seconds)

    def save_async(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]
    ) -> None:
        """Start the checkpoint of `step` (collective) and return once its state is copied to host memory.

        The files, their checksums and COMMIT.json are written in the background while the caller trains on;
        `wait` returns the committed record, or raises what `save` would have raised. A background save still
        in flight is awaited first, as by `save`. Until it commits, the checkpoint is as invisible as a partial
        one: a process that dies meanwhile leaves the previous checkpoint the newest.
        """
        started = time.perf_counter()
        self.wait()
        if self._group is None and dist.is_initialized():
            # The save's collectives run while training's run on the default group: a group of their own (gloo:
            # a CPU backend, which DCP needs for the staged copy, also beside NCCL).
            self._group = dist.new_group(backend="gloo")
        job = self._job(step, model, optimizer, train_state, started, group=self._group, stage=True)
        pending: concurrent.futures.Future[SavedCheckpoint] = concurrent.futures.Future()
        stall_s = time.perf_counter() - started

        def run() -> None:
            pending.set_running_or_notify_cancel()
            try:
                pending.set_result(self._run_in_background(job, stall_s))
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits, as `save` would raise it
                pending.set_exception(err)

        # A daemon thread: a process that fails or is stopped mid-save exits without waiting for it (a save
        # whose peer died would hold it in a collective until the group's timeout); its checkpoint never
        # commits, so it is invisible, as after a kill.
        threading.Thread(target=run, name=f"checkpoint-save-{job.step}", daemon=True).start()
        self._pending = pending
        self._pending_step, self._pending_started = step, started

    def wait(self) -> SavedCheckpoint | None:
        """Block until the background save, if any, is committed; its record (None when there was none), whose
        `stall_s` counts this wait too. Its failure is raised here: CheckpointSaveError after the retries, a bug
        as itself."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        started = time.perf_counter()
        with self._warn_while_held(self._pending_step, started):
            saved = pending.result()
        committed = self._pending_started + saved.seconds  # held until then, not until this thread woke up
        waited = max(0.0, min(time.perf_counter(), committed) - started)
        return dataclasses.replace(saved, stall_s=saved.stall_s + waited)

    @contextmanager
    def _warn_while_held(self, step: int, since: float) -> Iterator[None]:
        """Rank 0 warns while its caller is held by the save of `step`: SAVE_HELD_WARN_AFTER_S after `since`, then
        every SAVE_HELD_WARN_EVERY_S, naming the storage and the time held so far (storage that stops answering
        holds a save until its client's timeouts and the save's retries run out)."""
        if self.rank != 0:
            yield
            return
        done = threading.Event()
        endpoint = None if is_local(self.cfg.url) else self.storage.s3_endpoint_url
        where = self._url(self._dir(step)) + (f" (endpoint {endpoint})" if endpoint else "")

        def watch() -> None:
            delay = max(0.0, SAVE_HELD_WARN_AFTER_S - (time.perf_counter() - since))
            while not done.wait(delay):
                log.warning(
                    "training has been held %.0fs by the checkpoint save of step %d to %s: the storage is slow or "
                    "not answering; the save goes on (checkpoint.save_retries=%d, then it fails)",
                    time.perf_counter() - since, step, where, self.cfg.save_retries,
                )  # fmt: skip
                delay = SAVE_HELD_WARN_EVERY_S

        watcher = threading.Thread(target=watch, name=f"checkpoint-held-{step}", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()

    def _run_in_background(self, job: SaveJob, stall_s: float) -> SavedCheckpoint:
        nbytes = self._run(job)
        return SavedCheckpoint(job.step, nbytes, time.perf_counter() - job.started, stall_s)

    def _job(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: dict[str, Any],
        started: float,
        group: dist.ProcessGroup | None,
        stage: bool,
    ) -> SaveJob:
        """What a save of `step` writes, taken now: the DCP state (`stage`: copied into host buffers that are kept
        for the next save, so that training may change the model meanwhile), this rank's RNG state, and on
        rank 0 train_state.json and the model card."""
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if stage:
            if self._stager is None:
                gpu = torch.cuda.is_available()  # pinned host buffers and copies that overlap, on GPUs
                self._stager = DefaultStager(StagingOptions(gpu, False, False, gpu))
            state = self._stager.stage(state)
        files = {rng_file(self.rank): json.dumps(capture_rng()).encode()}
        problem = None
        if self.rank == 0:
            try:
                files[TRAIN_STATE] = json.dumps(train_state, indent=2).encode()
            except Exception as err:  # noqa: BLE001 - a bug, raised inside the save where every rank learns of it
                problem = err
            if self.card is not None:
                files[MODEL_CARD] = json.dumps(self.card, indent=2).encode()
        return SaveJob(step, state, files, problem, group, started)

    def _run(self, job: SaveJob) -> int:
        """The save of `job` with its retries; the bytes committed."""
        path = self._dir(job.step)
        space = estimate(job.state, self.world)
        delay = self.cfg.save_retry_backoff_s
        for attempt in range(1, self.cfg.save_retries + 2):
            try:
                return self._save_once(job, path, space)
            except StorageFailure as err:
                if attempt > self.cfg.save_retries:
                    self._remove_partial(path)
                    raise CheckpointSaveError(self._url(path), attempt, err, err.no_space, job.step) from err
                if self.rank == 0:
                    log.warning(
                        "checkpoint save to %s failed (attempt %d): %s; retrying in %.1fs", path, attempt, err, delay
                    )
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _save_once(self, job: SaveJob, path: str, space: Space) -> int:
        def prepare() -> int | None:
            if self.rank != 0:
                return None
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)  # leftovers of an attempt that never committed
            return self._make_room(job.step, space)

        space.free_bytes = broadcast_from_rank0(agree(prepare, group=job.group), job.group)
        if space.free_bytes is not None and space.free_bytes < space.tensor_bytes:
            raise StorageFailure(self._no_space(path, space), no_space=True)  # same on every rank: broadcast value

        def disk_full() -> bool:
            free = self._free_bytes()
            return free is not None and free < space.needed_bytes

        try:
            nbytes = self._write(job, path, disk_full, write_threads(space, self.world))
        except StorageFailure as err:
            if err.no_space:
                raise StorageFailure(f"{self._no_space(path, space)} ({err})", no_space=True) from err
            raise
        if self.rank == 0:
            try:
                self._prune()
            except Exception as err:  # noqa: BLE001 - pruning is housekeeping: the checkpoint is committed
                log.warning("could not prune old checkpoints under %s: %s", self.cfg.url, err)
        barrier(job.group)
        return nbytes

    def _write(self, job: SaveJob, path: str, disk_full: Callable[[], bool], threads: int) -> int:
        """The data, the small files, then COMMIT.json with the checksums taken while writing; the bytes committed.

        Each drill point (training/drill_points.py `at_save_phase`) is where the kill_during_save drill stops every
        rank.
        """
        step, group = job.step, job.group
        digests = Digests()
        synced_by_writer: set[str] = set()  # DCP's writer fsynced each of these as it closed it

        def write_dcp() -> None:
            writer = self._writer(self._url(path), digests, threads)
            synced = bool(getattr(writer, "sync_files", False))
            if drill_points.pauses_a_save():  # a drill's job: it may stop this save mid-DCP
                writer = PhaseWriter(writer, step)
            dcp.save(job.state, storage_writer=writer, process_group=group)
            if synced:
                synced_by_writer.update(digests.files())

        agree(write_dcp, disk_full, group)
        drill_points.at_save_phase("after_dcp", step)

        def extras() -> None:
            if job.problem is not None:
                raise job.problem
            for rel, data in job.files.items():
                write_bytes_atomic(self.fs, join(path, rel), data)  # fsynced before its rename
                digests.add(rel, hashlib.sha256(data).hexdigest(), len(data))
            # this rank's files reach the disk before anyone commits: each is fsynced once, here or by its writer
            done = synced_by_writer | set(job.files)
            self._flush(path, {rel: entry for rel, entry in digests.files().items() if rel not in done})

        agree(extras, disk_full, group)
        drill_points.at_save_phase("after_extras", step)
        nbytes = self._commit(job, path, digests, disk_full)
        drill_points.at_save_phase("after_commit", step)
        self._check_committed(job, path, digests, disk_full)
        return nbytes

    def _flush(self, path: str, written: dict[str, tuple[str, int]]) -> None:
        """fsync each file this rank wrote into the local step folder `path` (DCP's writer may have been told not
        to), so that the commit never names data that a power loss or node crash would lose from the page cache.
        Object stores hold a file once its upload returns: nothing to do."""
        if not is_local(self.cfg.url):
            return
        for rel in sorted(written):
            fsync_path(os.path.join(local_path(path), rel))

    def _flush_folders(self, path: str) -> None:
        """fsync the local step folder `path`, every folder inside it and the checkpoint folder that holds it:
        the files' names (DCP's renames included) are as durable as their data."""
        if not is_local(self.cfg.url):
            return
        top = local_path(path)
        inner = sorted(os.path.join(d, sub) for d, subs, _ in os.walk(top) for sub in subs)
        for folder in [*reversed(inner), top, os.path.dirname(top.rstrip("/")) or "."]:
            fsync_path(folder)

    def _check_committed(self, job: SaveJob, path: str, digests: Digests, disk_full: Callable[[], bool]) -> None:
        """After the commit, rank 0 reads COMMIT.json back: it must list every file any rank wrote in this save,
        with the writer's sha256 and size, and each must be on storage with that size. Otherwise the commit is
        withdrawn (COMMIT.json removed) and every rank raises CheckpointCommitError (recorded by the trainer as a
        failed save, not left for a later resume to stumble on)."""
        written = all_gather(digests.files(), job.group)

        def check() -> list[str]:
            if self.rank != 0:
                return []
            problems = self._commit_problems(job.step, path, {r: e for part in written for r, e in part.items()})
            if problems:
                self.fs.rm(join(path, COMMIT))
                log.error("checkpoint %s withdrawn: %s", self._url(path), "; ".join(problems))
            return problems

        problems = broadcast_from_rank0(agree(check, disk_full, job.group), job.group)
        if problems:
            raise CheckpointCommitError(self._url(path), job.step, problems)

    def _commit_problems(self, step: int, path: str, written: dict[str, tuple[str, int]]) -> list[str]:
        """What COMMIT.json of `step` gets wrong about the files `written` (relative path -> sha256, bytes)."""
        try:
            commit = self.read_commit(step)
        except CheckpointFormatError as err:
            return [f"{COMMIT} {err.problem}"]
        if commit is None:
            return [f"{COMMIT} is missing after the commit"]
        listed, found = commit["files"], self._listing(path)
        problems = [f"{rel} was written but {COMMIT} does not list it" for rel in sorted(set(written) - set(listed))]
        for rel, entry in sorted(listed.items()):
            if rel in written and (entry["sha256"], entry["bytes"]) != written[rel]:
                problems.append(f"{rel}: {COMMIT} records {entry['bytes']} bytes, its writer wrote {written[rel][1]}"
                                if entry["bytes"] != written[rel][1] else f"{rel}: {COMMIT} records another sha256"
                                " than its writer took")  # fmt: skip
            if rel not in found:
                problems.append(f"{rel} is listed in {COMMIT} but not on storage")
            elif found[rel] != entry["bytes"]:
                problems.append(f"{rel} has {found[rel]} bytes on storage, {COMMIT} says {entry['bytes']}")
        return problems

    def _commit(self, job: SaveJob, path: str, digests: Digests, disk_full: Callable[[], bool]) -> int:
        """Rank 0 lists the step folder and writes COMMIT.json naming every file in it with the sha256 and size
        its writer took (a file no writer accounts for is hashed here); the bytes listed."""
        written = all_gather(digests.files(), job.group)

        def commit() -> int:
            if self.rank != 0:
                return 0
            known = {rel: entry for part in written for rel, entry in part.items()}
            sizes = self._listing(path)
            lost = sorted(set(known) - set(sizes))
            if lost:  # written, then gone: the storage lost it (retried)
                raise FileNotFoundError(errno.ENOENT, f"written but not found in {self._url(path)}", lost[0])
            unknown = sorted(set(sizes) - set(known))
            read = sha256_files(self.fs, [join(path, rel) for rel in unknown], MAX_IO_THREADS)
            files: dict[str, dict[str, Any]] = {}
            for rel, size in sorted(sizes.items()):
                digest, nbytes = known.get(rel) or (read[join(path, rel)], size)
                if nbytes != size:
                    raise OSError(errno.EIO, f"{rel} holds {size} bytes in {self._url(path)}; {nbytes} were written")
                files[rel] = {"sha256": digest, "bytes": size}
            record: dict[str, Any] = {
                "step": job.step,
                "world_size": self.world,
                "layout": self.layout,
                "contents": sorted(job.state),
                "created_unix_s": time.time(),
                "files": files,
            }
            if self.key is not None:
                record = sign_commit(record, self.key)
            self._flush_folders(path)  # every rank flushed its files (extras); now their names
            write_bytes_atomic(self.fs, join(path, COMMIT), json.dumps(record, indent=2).encode())
            self._flush_folders(path)  # COMMIT.json's own name: the commit itself is durable
            return sum(sizes.values())

        return agree(commit, disk_full, job.group)

    def _no_space(self, path: str, space: Space) -> str:
        return no_space_message(self._url(path), "checkpoint", space.needed_bytes, space.free_bytes)

    def _free_bytes(self) -> int | None:
        """Free bytes on the local disk of the checkpoint folder (None for object stores)."""
        return free_bytes(self.root) if is_local(self.cfg.url) else None

    def _make_room(self, step: int, space: Space) -> int | None:
        """Rank 0: remove partial, then the oldest committed checkpoints until `space` fits; returns free bytes.

        The newest committed checkpoint older than `step` stays (it is what a failed save falls back on);
        newer ones (from a run resumed further back) and untrusted ones are left alone.
        """
        free = self._free_bytes()
        if free is None or free >= space.needed_bytes:
            return free
        pinned = self.pinned_steps()  # a ledger entry's checkpoint stays, even on a full disk
        steps = [s for s in self.steps_on_storage() if s != step and s not in pinned]
        partial = [s for s in steps if self._commit_or_none(s) is None]
        older = [s for s in steps if s < step and s not in partial and self._believed(s)]
        for victim in partial + older[:-1]:
            kind = "partial checkpoint" if victim in partial else f"checkpoint (keep_last={self.cfg.keep_last})"
            log.warning(
                "only %s free on %s and the checkpoint of step %d needs ~%s: removing the %s %s early",
                format_bytes(free), self._url(self.root), step, format_bytes(space.needed_bytes), kind,
                self._url(self._dir(victim)),
            )  # fmt: skip
            self.fs.rm(self._dir(victim), recursive=True)
            free = self._free_bytes() or 0
            if free >= space.needed_bytes:
                break
        return free

    def _remove_partial(self, path: str) -> None:
        """Rank 0: remove what the last failed attempt left (a full disk would stay full for the rerun)."""
        if self.rank != 0:
            return
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except Exception as err:  # noqa: BLE001 - the save already failed; this is cleanup on broken storage
            log.warning("could not remove the partial checkpoint %s: %s", self._url(path), err)

    def _prune(self) -> None:
        steps = self.steps_on_storage()
        partial = [s for s in steps if self._commit_or_none(s) is None]
        committed = [s for s in steps if s not in partial and self._believed(s)]
        keep = set(committed[-self.cfg.keep_last :]) | self.pinned_steps()  # pinned: a ledger entry points at it
        newest = committed[-1] if committed else -1
        for step in steps:
            # Old committed ones beyond keep_last go; so do unfinished ones older than the newest commit.
            # Untrusted ones (unsigned, or signed with another key) are not this run's to delete.
            if step <= newest and step not in keep and (step in partial or step in committed):
                self.fs.rm(self._dir(step), recursive=True)

    # ---- load -------------------------------------------------------------------------------

    def verify(self, step: int, commit: dict[str, Any], digests_on_read: bool = False) -> str | None:
        """Why checkpoint `step` cannot be used (None when it is sound). Every rank checks a share of the files,
        several at a time. `digests_on_read`: the DCP data files' sha256 are left to the load that reads them
        (reader.py); their sizes are still checked here."""
        path = self._dir(step)
        mine = {rel: commit["files"][rel] for rel in share(commit["files"], self.rank, self.world)}
        checksums = self.checks_digests
        found = self._listing(path) if mine else {}
        problems: dict[str, str] = {}
        for rel, expected in mine.items():
            if rel not in found:
                problems[rel] = f"{rel} is missing"
            elif found[rel] != expected["bytes"]:
                problems[rel] = f"{rel} has {found[rel]} bytes, COMMIT.json says {expected['bytes']}"
        deferred = digests_on_read and checksums
        to_hash = {
            join(path, rel): rel
            for rel in mine
            if checksums and rel not in problems and not (deferred and rel.endswith(DATA_SUFFIX))
        }
        for full, digest in sha256_files(self.fs, to_hash, MAX_IO_THREADS).items():
            if digest != mine[to_hash[full]]["sha256"]:
                problems[to_hash[full]] = f"{to_hash[full]} fails its sha256 check"
        problem = problems[min(problems)] if problems else None
        gathered = [p for p in all_gather(problem) if p]
        return gathered[0] if gathered else None

    def _inspect(self, step: int) -> tuple[str, Any]:
        """Rank 0's verdict on `step`'s commit record: ("ok", commit) or (kind, reason) for every rank to act on."""
        name = self._url(self._dir(step))
        try:
            commit = self.read_commit(step)
        except CheckpointFormatError as err:
            return "corrupt", err.problem
        if commit is None:
            return "partial", None
        try:
            reason = untrusted_reason(commit, self.key, name)
        except CheckpointKeyError as err:
            return "key", err.problem
        if reason:
            return "untrusted", reason
        unlisted = sorted(set(loader_files(commit["world_size"])) - set(commit["files"]))
        if unlisted:  # what the commit does not list, nothing verifies: a save that committed too early
            return "corrupt", f"{COMMIT} does not list {', '.join(unlisted)}, which the loader needs"
        return "ok", commit

    def latest_sound(self, skipped: list[SkippedCheckpoint] | None = None) -> tuple[int, dict[str, Any]] | None:
        """Newest committed, trusted, verified checkpoint; partial, untrusted and corrupt ones are skipped.

        Each skipped checkpoint is appended to `skipped` (when given) with its reason.
        """
        for step in reversed(self._steps_everywhere()):
            commit = self.sound(step, skipped)
            if commit is not None:
                return step, commit
        return None

    def _steps_everywhere(self) -> list[int]:
        return broadcast_from_rank0(self.steps_on_storage() if self.rank == 0 else None)

    def sound(
        self, step: int, skipped: list[SkippedCheckpoint] | None = None, digests_on_read: bool = False
    ) -> dict[str, Any] | None:
        """The commit record of checkpoint `step` if it is committed, trusted and verified (collective), else None
        with the reason appended to `skipped` (when given) and logged. A missing folder counts as partial.
        `digests_on_read`: the data files' sha256 are left to the caller's load (see `verify`)."""
        passed_over = skipped if skipped is not None else []
        kind, detail = broadcast_from_rank0(self._inspect(step) if self.rank == 0 else None)
        name = self._url(self._dir(step))
        if kind == "key":
            raise CheckpointKeyError(name, detail)
        if kind == "partial":
            if self.rank == 0:
                log.warning("skipping partial checkpoint %s: no %s (the save never finished)", name, COMMIT)
            passed_over.append(SkippedCheckpoint(step, name, "partial", f"no {COMMIT} (the save never finished)"))
            return None
        if kind in ("untrusted", "corrupt"):
            if self.rank == 0:
                log.warning("skipping %s checkpoint %s: %s", kind, name, detail)
            passed_over.append(SkippedCheckpoint(step, name, kind, str(detail)))
            return None
        problem = self.verify(step, detail, digests_on_read)
        if problem:
            if self.rank == 0:
                log.warning("skipping corrupt checkpoint %s: %s", name, problem)
            passed_over.append(SkippedCheckpoint(step, name, "corrupt", problem))
            return None
        return detail

    def _read_small_files(self, step: int, rng_needed: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """train_state.json and this rank's RNG file, checked on every rank before anything is applied."""
        path = self._dir(step)
        train_state: dict[str, Any] = {}
        rng = None
        problem = None
        try:
            where = self._url(join(path, TRAIN_STATE))
            train_state = check_train_state(parse_json(self._read_small(join(path, TRAIN_STATE)), where), step, where)
            if rng_needed:
                rel = join(path, "rng", f"rank-{self.rank:05d}.json")
                rng = check_rng(parse_json(self._read_small(rel), self._url(rel)), self._url(rel))
        except CheckpointFormatError as err:
            problem = (err.path, err.problem)
        problems = [p for p in all_gather(problem) if p]
        if problems:
            raise CheckpointFormatError(*problems[0])
        return train_state, rng

    def load_latest(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: RunOutputWriter | None = None
    ) -> Restored | None:
        """Restore model, optimizer and per-rank RNG from the newest sound checkpoint (None: start fresh).

        Rank 0 records what it loaded and what it skipped, and why, in `out` (resume.json).
        """
        skipped: list[SkippedCheckpoint] = []
        checksums = self.checks_digests
        fresh_optimizer = not optimizer.state
        for step in reversed(self._steps_everywhere()):
            # The commit record and its signature first, then sizes and the small files; the data files' sha256
            # are checked in the pass that reads them, before any of their bytes reach the state.
            commit = self.sound(step, skipped, digests_on_read=True)
            if commit is None:
                continue
            try:
                with _gc_paused():
                    return self._load_step(step, commit, model, optimizer, out, skipped, checksums)
            except Exception as err:
                if fresh_optimizer:  # it was given state to load into (unfilled, see optim_state.py): fresh again
                    optimizer.state.clear()
                if not isinstance(err, CheckpointDigestError):
                    raise
                name = self._url(self._dir(step))
                if self.rank == 0:
                    log.warning("skipping corrupt checkpoint %s: %s", name, err.problem)
                skipped.append(SkippedCheckpoint(step, name, "corrupt", err.problem))
        self._record_resume(out, ResumeRecord(self.cfg.url, world_size=self.world, skipped=skipped))
        return None

    def _load_step(
        self,
        step: int,
        commit: dict[str, Any],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        out: RunOutputWriter | None,
        skipped: list[SkippedCheckpoint],
        checksums: bool,
    ) -> Restored:
        """Load checkpoint `step` (its commit record and small files checked); CheckpointDigestError on every rank,
        with nothing loaded, when a data file fails its check while being read."""
        path = self._dir(step)
        url = self._url(path)
        saved_world, saved_layout = int(commit["world_size"]), commit.get("layout", "")
        rng_restored = saved_world == self.world and saved_layout == self.layout
        train_state, rng = self._read_small_files(step, rng_restored)
        reader, planner = self._verifying_reader(url, commit if checksums else None), SafeLoadPlanner(url)
        refused, options = None, _OPTIONS
        try:
            metadata = reader.read_metadata()
            if _LIST_KEYED_OPTIMIZER in metadata.state_dict_metadata:
                options = _LIST_KEYED  # written before optimizer state was keyed by name: read it as written
        except UnsafeCheckpointError as err:
            refused = err
        except Exception:  # noqa: BLE001, S110 - any other failure is dcp.load's to raise, on every rank alike
            pass
        refusals = [r for r in all_gather(refused) if r is not None]
        if refusals:
            raise refusals[0]
        with_optim = "optim" in commit.get("contents", ["model", "optim"])
        if with_optim:
            make_state_to_load(optimizer)  # else DCP's get_state_dict makes it with a zero-lr step
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        if not with_optim:
            del state["optim"]
            if self.rank == 0:
                log.warning("checkpoint %s has no optimizer state: the optimizer starts afresh", url)
        dcp_load(state, reader, planner)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", optim_sd),
            options=options,
        )
        if rng is not None:
            restore_rng(rng)
        elif self.rank == 0:
            layouts = (
                ""
                if saved_layout == self.layout
                else f" (layout {saved_layout or 'data parallel'} -> {self.layout or 'data parallel'})"
            )
            log.warning(
                "checkpoint %s was saved by %d ranks and is loaded by %d%s: model and optimizer resharded, "
                "per-rank RNG states re-seeded",
                url,
                saved_world,
                self.world,
                layouts,
            )
        self._record_resume(
            out,
            ResumeRecord(self.cfg.url, step, url, saved_world, self.world, resharded=not rng_restored, skipped=skipped),
        )
        return Restored(step, url, train_state, saved_world, rng_restored)

    def _verifying_reader(
        self, url: str, commit: dict[str, Any] | None
    ) -> VerifyingFileSystemReader | VerifyingFsspecReader:
        """DCP's reader for the step folder `url`, checking the data files against `commit` (None: unchecked)."""
        reader = self._reader(url, VerifyingFileSystemReader, VerifyingFsspecReader)
        assert isinstance(reader, (VerifyingFileSystemReader, VerifyingFsspecReader))
        if commit is not None:
            reader.expect(commit["files"], url)
        return reader

    def _record_resume(self, out: RunOutputWriter | None, record: ResumeRecord) -> None:
        if out is not None and self.rank == 0:
            out.write_resume(record)

