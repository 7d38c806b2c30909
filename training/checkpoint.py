"""Distributed checkpoints with torch.distributed.checkpoint on any fsspec URL.

Layout of one checkpoint::

    <url>/step-00000040/.metadata, __<rank>_<n>.distcp   model + optimizer (DCP, sharded)
    <url>/step-00000040/train_state.json                 step, sampler position, LR scheduler, loss scaler
    <url>/step-00000040/rng/rank-00000.json              per-rank python/numpy/torch RNG states
    <url>/step-00000040/model.json                       the model card: architecture, tokenizer, dataset (ModelCard)
    <url>/step-00000040/COMMIT.json                      written last: file list with sha256 (+ hmac_sha256)

A checkpoint exists only once COMMIT.json is there. On local disks every file of
the save and its folders are fsynced before COMMIT.json is written (and its name
after), so a commit never names data still in the page cache; the writer then
reads COMMIT.json back, and a record that does not list every file written (with
its size and sha256) is withdrawn and the save fails (CheckpointCommitError).
Loading takes the newest
committed checkpoint whose files all match their checksums; a partial or
corrupt one is skipped with a warning that names it. Model and optimizer state
load under another world size (DCP reshards); per-rank RNG states then cannot
apply and are re-seeded, which the loader says.

Checksums are taken as the files are written (each writer thread hashes its own
file on the way to storage, so nothing is read back), and verified before a load
by every rank for its share of the files, several files at a time.

`save` returns once the checkpoint is committed. `save_async` returns once the
state is copied to host memory (DCP's stager: pinned buffers on GPUs, kept for
the next save) and writes, checksums and commits it in a background thread, on a
gloo process group of its own so that training's collectives go on meanwhile;
`wait` returns it, or raises its failure. The protocol is the same: until its
COMMIT.json is written the checkpoint is partial, so a process that dies in the
middle leaves the previous one the newest. A save (of either kind) waits for a
background one still in flight before it starts.

Trust (training/checkpoint_trust.py): DCP's pickles are read with an allow-list,
so a planted file cannot run code; with TDEPLOY_CHECKPOINT_KEY set, COMMIT.json
is signed (`hmac_sha256`) and only checkpoints signed with that key are loaded.
train_state.json and the RNG files are checked before anything is applied; one
that is not what this module writes raises CheckpointFormatError naming it.

Save failures: only storage and network errors (OSError, ENOSPC included, and
connection errors by name) are retried; any other exception inside a save is a
bug and is raised at once, on every rank (CheckpointAbortedError on the ranks
where it did not happen). When a local disk is short of the checkpoint's
estimated size, partial and old committed checkpoints are removed first (the
newest committed one is kept); a save that still cannot fit fails with
"no space left on <path>: checkpoint needs ~X MB, Y MB free", and the partial
folder of the last failed attempt is removed.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import posixpath
import random
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import Field, ValidationError
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from training import faults
from training.checkpoint_trust import (
    CheckpointKeyError,
    SafeFileSystemReader,
    SafeFsspecReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    checkpoint_key,
    sign_commit,
    untrusted_reason,
)
from training.config import CheckpointConfig, ModelConfig, StrictModel, first_problem
from training.run_output import ResumeRecord, RunOutputWriter, SkippedCheckpoint
from training.storage import (
    ControlFileError,
    DigestingWriter,
    StorageConfig,
    filesystem,
    format_bytes,
    free_bytes,
    is_local,
    is_no_space,
    join,
    local_path,
    no_space_message,
    read_control_file,
    sha256_file,
    sha256_files,
    write_bytes_atomic,
)

if TYPE_CHECKING:
    from training.config import TrainConfig
    from training.dataset import DatasetManifest

log = logging.getLogger(__name__)

COMMIT = "COMMIT.json"
TRAIN_STATE = "train_state.json"
MODEL_CARD = "model.json"
CARD_VERSION = 1
MODEL_PREFIX = "model."  # DCP's flattened key of a model tensor: "model." + the module's parameter name
DCP_METADATA = ".metadata"  # DCP's own name (torch.distributed.checkpoint.filesystem)
_STEP_DIR = re.compile(r"step-(\d{8})$")
SAVE_HELD_WARN_AFTER_S = 5.0
"""A caller held this long by a save (a synchronous one, or `wait` on a background one) hears it in a warning that
names the storage, and again every SAVE_HELD_WARN_EVERY_S."""
SAVE_HELD_WARN_EVERY_S = 30.0
PINS_DIR = "pins"
"""Beside the step folders: `pins/step-<N>.<holder>`, one file per holder (a ledger entry) that needs checkpoint N
kept. Retention (keep_last, and making room on a full disk) never deletes a pinned step."""
_PIN = re.compile(r"^step-(\d{8})\.([A-Za-z0-9][A-Za-z0-9._-]{0,127})$")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Bytes a checkpoint needs beyond its tensor data: DCP's per-entry zip framing (~1.4 kB seen), the
# metadata, RNG files (~20 kB per rank) and train_state.json. Only for the pre-save space check.
_ENTRY_OVERHEAD_BYTES = 2048
_RANK_OVERHEAD_BYTES = 32 << 10
_FIXED_OVERHEAD_BYTES = 64 << 10
# A rank writes its DCP data as one file per this many bytes, up to _MAX_IO_THREADS files written (and hashed as they
# are written) by as many threads; loads verify a rank's share of the files as many at a time.
_BYTES_PER_WRITE_THREAD = 64 << 20
_MAX_IO_THREADS = 4
# torch's zip writer reports a short write (the disk took fewer bytes than given) only as this.
_SHORT_WRITE = "unexpected pos"
# botocore / aiohttp / urllib3 / requests network failures, matched by name so none is a hard dependency
_NETWORK_ERRORS = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "ClientConnectorError",
        "ClientConnectionError",
        "ClientOSError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ProtocolError",
        "NewConnectionError",
        "MaxRetryError",
    }
)
_RETRYABLE_S3_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling"})


class CheckpointSaveError(RuntimeError):
    """A save failed with storage errors after every retry; the previous complete checkpoint is still intact."""

    def __init__(
        self, path: str, attempts: int, cause: BaseException, no_space: bool = False, step: int | None = None
    ) -> None:
        super().__init__(f"checkpoint save to {path} failed after {attempts} attempt(s): {cause}")
        self.path, self.attempts, self.no_space, self.step = path, attempts, no_space, step


class CheckpointCommitError(CheckpointSaveError):
    """The save's own check after its commit: COMMIT.json does not list every file the ranks wrote, or a file it
    lists is not on storage as written. The commit is withdrawn (the checkpoint is partial), not retried: the
    same save would write the same record."""

    def __init__(self, path: str, step: int, problems: list[str]) -> None:
        cause = RuntimeError(f"the commit record does not match what was written: {'; '.join(problems)}")
        super().__init__(path, 1, cause, step=step)
        self.problems = problems


class CheckpointAbortedError(RuntimeError):
    """Another rank raised a non-storage error (a bug) inside the save; this rank stops with it."""

    def __init__(self, rank: int, error: str) -> None:
        super().__init__(f"checkpoint save aborted: rank {rank} raised {error} (not a storage error, so not retried)")
        self.rank, self.error = rank, error


class CheckpointFormatError(ValueError):
    """A checkpoint file is not what this module writes (train_state.json, an RNG file, COMMIT.json)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(
            f"{path} {problem}; the checkpoint was not written by this trainer or was altered: "
            "inspect it, and move the step folder away to resume from an older one"
        )
        self.path, self.problem = path, problem

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.problem))


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
class Restored:
    """What a load brought back."""

    step: int
    path: str
    train_state: dict[str, Any]
    saved_world_size: int
    rng_restored: bool


class CardTokenizer(StrictModel):
    """Which tokenizer produced the ids the model was trained on (the dataset's, training/dataset.py)."""

    kind: Literal["bytes", "bpe", "unknown"] = Field(
        description="bytes: id = UTF-8 byte value, EOS 256; bpe: a tokenizer.json; unknown: an adopted dataset's ids, "
        "tokenizer not given."
    )
    url: str | None = Field(default=None, description="Path or fsspec URL of the dataset's tokenizer.json (bpe).")
    sha256: str | None = Field(default=None, description="sha256 of that tokenizer.json (bpe).")


class ModelCard(StrictModel):
    """model.json: what a checkpoint holds, for whoever turns it into something else (tasks/export)."""

    format_version: int = Field(default=CARD_VERSION, description="Version of this record's layout.")
    model: ModelConfig = Field(description="The architecture the weights belong to.")
    vocab_size: int = Field(ge=2, description="The tokenizer's (dataset's) vocabulary; model.vocab_size may be more.")
    eos_id: int | None = Field(description="End-of-text id of the dataset (None: documents carry no EOS).")
    dataset_url: str = Field(description="The dataset the run trained on.")
    tokenizer: CardTokenizer
    expert_capacity_factor: float | None = Field(
        default=None, description="MoE: parallel.expert_capacity_factor of the run (tokens over capacity dropped)."
    )

    @classmethod
    def of_run(cls, cfg: TrainConfig, manifest: DatasetManifest) -> ModelCard:
        """The card of a run of `cfg` on the dataset whose manifest is `manifest`."""
        tok = manifest.tokenizer
        url = join(cfg.data.dataset_url, tok.path) if tok.path is not None else None
        return cls(
            model=cfg.model,
            vocab_size=manifest.vocab_size,
            eos_id=manifest.eos_id,
            dataset_url=cfg.data.dataset_url,
            tokenizer=CardTokenizer(kind=tok.kind, url=url, sha256=tok.sha256 or cfg.data.tokenizer_sha256),
            expert_capacity_factor=cfg.parallel.expert_capacity_factor if cfg.model.moe else None,
        )


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one model tensor in a checkpoint (from DCP's .metadata, nothing read)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return math.prod(self.shape) * self.dtype.itemsize


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process whenever no process group is up; that is the intent here."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint taken after `step` optimizer steps."""
    return f"step-{step:08d}"


def rng_file(rank: int) -> str:
    """The RNG file of `rank`, relative to a step folder."""
    return f"rng/rank-{rank:05d}.json"


def loader_files(world_size: int) -> list[str]:
    """The small files every resume reads (besides the DCP shards .metadata names): what a commit must list."""
    return [DCP_METADATA, TRAIN_STATE, *(rng_file(rank) for rank in range(world_size))]


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


def _rng_tensor(encoded: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(encoded, validate=True)), dtype=torch.uint8)


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_rng_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_rng_tensor(state["cuda"]))


def check_rng(state: Any, where: str) -> dict[str, Any]:
    """`state` if `restore_rng` can apply it (tried on scratch generators), else CheckpointFormatError."""
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= state.keys():
        raise CheckpointFormatError(where, "is not an RNG state: expected a JSON object with python, numpy and torch")
    try:
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.RandomState().set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.Generator().set_state(_rng_tensor(state["torch"]))
        if "cuda" in state:
            _rng_tensor(state["cuda"])
    except (TypeError, ValueError, LookupError, OverflowError, RuntimeError, binascii.Error) as err:
        problem = f"is not an RNG state this trainer saved: {type(err).__name__}: {err}"
        raise CheckpointFormatError(where, problem) from err
    return state


def is_storage_error(exc: BaseException) -> bool:
    """True for storage and network failures (worth a retry); False for anything else, which is a bug.

    DCP's CheckpointException is judged by the per-rank failures it wraps: all of them must be storage errors.
    """
    return all(_is_storage_leaf(leaf) for _, leaf in _leaves(exc))


def _leaves(exc: BaseException, rank: int | None = None) -> list[tuple[int | None, BaseException]]:
    """The underlying exceptions with the rank they came from; DCP's CheckpointException unwrapped."""
    if isinstance(exc, CheckpointException) and exc.failures:
        out: list[tuple[int | None, BaseException]] = []
        for failed_rank, failure in exc.failures.items():
            inner = failure[0] if isinstance(failure, tuple) else failure
            out.extend(_leaves(inner, failed_rank) if isinstance(inner, BaseException) else [(failed_rank, exc)])
        return out
    return [(rank, exc)]


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and what it was raised from (explicit causes only: a bug inside an `except` block stays a bug)."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 16:
        chain.append(chain[-1].__cause__)
    return chain


def _is_storage_leaf(exc: BaseException) -> bool:
    for err in _causes(exc):
        if isinstance(err, OSError):  # incl. ConnectionError, TimeoutError, FileNotFoundError, ENOSPC
            return True
        if {cls.__name__ for cls in type(err).__mro__} & _NETWORK_ERRORS:
            return True
        if isinstance(err, RuntimeError) and _SHORT_WRITE in str(err):
            return True
        response = getattr(err, "response", None)  # botocore ClientError: a 5xx or throttling answer
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if code in _RETRYABLE_S3_CODES or int(status) >= 500:
                return True
    return False


def _says_no_space(exc: BaseException) -> bool:
    return any(is_no_space(leaf) for _, leaf in _leaves(exc))  # torch's short write hides the OSError in its context


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


_size = format_bytes


@dataclass
class _Space:
    """The pre-save space estimate of one checkpoint."""

    tensor_bytes: int  # tensor data alone: a checkpoint can never be smaller
    needed_bytes: int  # with DCP's framing and the small files: what to make room for
    free_bytes: int | None = None  # on the local disk when the attempt started (None: not a local path)


def _estimate(state: dict[str, Any], world: int) -> _Space:
    """Bytes one copy of `state` takes (DCP writes a replicated tensor once, a DTensor at its global size)."""
    tensor_bytes, entries, todo = 0, 0, [state]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in value):
            todo.extend(value)
        else:
            entries += 1
            if isinstance(value, torch.Tensor):  # a DTensor counts at its global size
                tensor_bytes += value.numel() * value.element_size()
    overhead = entries * _ENTRY_OVERHEAD_BYTES + world * _RANK_OVERHEAD_BYTES + _FIXED_OVERHEAD_BYTES
    return _Space(tensor_bytes, tensor_bytes + overhead)


def _write_threads(space: _Space, world: int) -> int:
    """Files (and writer threads) per rank for a checkpoint of `space`: one per _BYTES_PER_WRITE_THREAD of a
    rank's share, at least one, at most _MAX_IO_THREADS."""
    return max(1, min(_MAX_IO_THREADS, space.tensor_bytes // world // _BYTES_PER_WRITE_THREAD))


@dataclass
class _SaveJob:
    """One save as its writing side sees it: the state and files taken at the save call, and where ranks meet."""

    step: int
    state: dict[str, Any]  # for DCP: the live tensors (blocking save) or a staged copy (background save)
    files: dict[str, bytes]  # this rank's other files by relative path: its RNG file; rank 0 train_state.json, card
    problem: Exception | None  # a bug met while taking them, raised inside the save where every rank learns of it
    group: dist.ProcessGroup | None  # the collectives' group (None: the default one)
    started: float  # time.perf_counter() at the save call


class _Digests:
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


class _DigestingFileSystem:
    """A DCP writer's filesystem whose written files are hashed as they are written, into `digests`."""

    def __init__(self, inner: Any, digests: _Digests) -> None:
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


class _PhaseWriter(StorageWriter):
    """A DCP writer with the "writing_dcp" phase point around this rank's file write (only in a drill's job)."""

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
        faults.at_save_phase("writing_dcp", self.save_step, shard_written=False)
        written = self.inner.write_data(plan, planner)
        written.wait()
        faults.at_save_phase("writing_dcp", self.save_step, shard_written=True)
        return written

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """Delegated."""
        self.inner.finish(metadata, results)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never chosen by DCP itself: always given as the storage writer."""
        return False


# Optimizer state keyed by parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): pipeline stages and
# expert-parallel ranks hold different parameters, so their param_groups lists would collide under one DCP key.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# Checkpoints of earlier versions keep torch's list-keyed layout ("optim.param_groups.0.lr"); they still load.
_LIST_KEYED = StateDictOptions()
_LIST_KEYED_OPTIMIZER = "optim.param_groups.0.lr"  # by name it would be optim.param_groups.<fqn>.lr


class CheckpointManager:
    """Saves, finds, verifies, loads and prunes checkpoints. `save` and `load_latest` are collective."""

    def __init__(
        self, cfg: CheckpointConfig, storage: StorageConfig, layout: str = "", card: dict[str, Any] | None = None
    ) -> None:
        """`layout` names the model-parallel layout ("" for pure data parallelism, which reshards freely): a
        checkpoint loaded under another layout or world size is resharded and its per-rank RNG states unused.
        `card` (a ModelCard's JSON data) is written into every checkpoint as model.json, before its commit."""
        self.cfg, self.storage, self.layout = cfg, storage, layout
        self.card = None if card is None else ModelCard.model_validate(card).model_dump(mode="json")
        self.fs, self.root = filesystem(cfg.url, storage)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.key = checkpoint_key()
        self._group: dist.ProcessGroup | None = None  # background saves' collectives (made by the first one)
        self._stager: DefaultStager | None = None  # keeps its host buffers from one background save to the next
        self._pending: concurrent.futures.Future[SavedCheckpoint] | None = None
        self._pending_step, self._pending_started = 0, 0.0
        if self.key is not None and not cfg.verify_checksums and self.rank == 0:
            log.warning("checkpoint.verify_checksums=false is overridden: with TDEPLOY_CHECKPOINT_KEY set every "
                        "checksum is verified, since the signature covers the files only through them")  # fmt: skip

    def _dir(self, step: int) -> str:
        return join(self.root, step_dir_name(step))

    def _writer(self, path: str, digests: _Digests, threads: int = 1) -> dcp.StorageWriter:
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
        writer.fs = _DigestingFileSystem(writer.fs, digests)
        return writer

    def _reader(self, path: str) -> SafeFileSystemReader | SafeFsspecReader:
        if is_local(self.cfg.url):
            return SafeFileSystemReader(local_path(path))
        return SafeFsspecReader(path, **self.storage.fsspec_options(self.cfg.url))

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
        """The COMMIT.json of `step`, or None while that checkpoint is unfinished (CheckpointFormatError if bad)."""
        full = join(self._dir(step), COMMIT)
        try:
            raw = self._read_small(full)
        except FileNotFoundError:
            return None
        return _check_commit(_parse_json(raw, self._url(full)), step, self._url(full))

    def read_card(self, step: int, commit: dict[str, Any] | None = None) -> ModelCard | None:
        """The model card (model.json) of `step`; None for a checkpoint saved without one. CheckpointFormatError
        if it is not a card, or, given the step's `commit` record (from `sound`, which verified the files it
        lists), if that record does not list it: a card added after the commit is not believed."""
        full = join(self._dir(step), MODEL_CARD)
        try:
            raw = self._read_small(full)
        except FileNotFoundError:
            return None
        if commit is not None and MODEL_CARD not in commit["files"]:
            raise CheckpointFormatError(self._url(full), f"is not listed in {COMMIT}, so nothing verifies it")
        value = _parse_json(raw, self._url(full))
        try:
            return ModelCard.model_validate(value)
        except ValidationError as err:
            problem = f"is not a model card this trainer writes ({first_problem(err, '<card>')})"
            raise CheckpointFormatError(self._url(full), problem) from err

    def _read_small(self, path: str) -> bytes:
        """A small JSON file of a checkpoint (COMMIT.json, a card, train_state.json, an RNG file), read before
        anything vouches for it: a regular file of at most a few MiB, or CheckpointFormatError naming it."""
        try:
            return read_control_file(self.fs, path)
        except ControlFileError as err:
            raise CheckpointFormatError(self._url(path), err.problem) from err

    def committed_steps(self) -> list[int]:
        """Steps whose checkpoint has a COMMIT.json (well-formed or not; not verified), ascending."""
        return [s for s in self.steps_on_storage() if self._commit_or_none(s) is not None]

    def step_url(self, step: int) -> str:
        """The URL (a path for local storage) of the folder of checkpoint `step`."""
        return self._url(self._dir(step))

    def _believed(self, step: int) -> bool:
        """Committed, well-formed and (with a key) signed by it: a checkpoint that counts for keep_last."""
        try:
            commit = self.read_commit(step)
        except CheckpointFormatError:
            return False
        if commit is None:
            return False
        return self.key is None or untrusted_reason(commit, self.key, self._url(self._dir(step))) is None

    def pin(self, step: int, holder: str) -> str:
        """Keep checkpoint `step` from retention while `holder` (a ledger entry id) needs it; the pin's URL."""
        name = f"{step_dir_name(step)}.{holder}"
        if not _PIN.match(name):
            raise ValueError(f"pin holder {holder!r}: use letters, digits, '.', '_' or '-' (at most 128)")
        path = join(self.root, PINS_DIR, name)
        write_bytes_atomic(self.fs, path, json.dumps({"step": step, "holder": holder}).encode())
        return self._url(path)

    def pinned_steps(self) -> set[int]:
        """The steps some holder pinned (see PINS_DIR)."""
        folder = join(self.root, PINS_DIR)
        if not self.fs.exists(folder):
            return set()
        names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(folder, detail=False))
        return {int(m.group(1)) for m in map(_PIN.match, names) if m}

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
        with self._warn_while_held(step, started):
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

    def _run_in_background(self, job: _SaveJob, stall_s: float) -> SavedCheckpoint:
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
    ) -> _SaveJob:
        """What a save of `step` writes, taken now: the DCP state (`stage`: copied into host buffers that are kept
        for the next save, so that training may change the model meanwhile), this rank's RNG state, and on
        rank 0 train_state.json and the model card."""
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if faults.active().checkpoint_without_optimizer:
            del state["optim"]
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
        return _SaveJob(step, state, files, problem, group, started)

    def _run(self, job: _SaveJob) -> int:
        """The save of `job` with its retries; the bytes committed."""
        path = self._dir(job.step)
        space = _estimate(job.state, self.world)
        delay = self.cfg.save_retry_backoff_s
        for attempt in range(1, self.cfg.save_retries + 2):
            try:
                return self._save_once(job, path, space)
            except _StorageFailure as err:
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

    def _save_once(self, job: _SaveJob, path: str, space: _Space) -> int:
        def prepare() -> int | None:
            if self.rank != 0:
                return None
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)  # leftovers of an attempt that never committed
            return self._make_room(job.step, space)

        space.free_bytes = _broadcast_from_rank0(_agree(prepare, group=job.group), job.group)
        if space.free_bytes is not None and space.free_bytes < space.tensor_bytes:
            raise _StorageFailure(self._no_space(path, space), no_space=True)  # same on every rank: broadcast value

        def disk_full() -> bool:
            free = self._free_bytes()
            return free is not None and free < space.needed_bytes

        try:
            nbytes = self._write(job, path, disk_full, _write_threads(space, self.world))
        except _StorageFailure as err:
            if err.no_space:
                raise _StorageFailure(f"{self._no_space(path, space)} ({err})", no_space=True) from err
            raise
        if self.rank == 0:
            try:
                self._prune()
            except Exception as err:  # noqa: BLE001 - pruning is housekeeping: the checkpoint is committed
                log.warning("could not prune old checkpoints under %s: %s", self.cfg.url, err)
        _barrier(job.group)
        return nbytes

    def _write(self, job: _SaveJob, path: str, disk_full: Callable[[], bool], threads: int) -> int:
        """The data, the small files, then COMMIT.json with the checksums taken while writing; the bytes committed.

        Each phase point (faults.at_save_phase) is where the kill_during_save drill stops every rank.
        """
        step, group = job.step, job.group
        digests = _Digests()

        def write_dcp() -> None:
            writer = self._writer(self._url(path), digests, threads)
            if faults.active().pause_in_save is not None:  # a drill's job: it may stop this save mid-DCP
                writer = _PhaseWriter(writer, step)
            dcp.save(job.state, storage_writer=writer, process_group=group)

        _agree(write_dcp, disk_full, group)
        early = faults.active().commit_before_extras  # test-only: the broken order the drill must catch
        nbytes = self._commit(job, path, digests, disk_full) if early else 0
        faults.at_save_phase("after_dcp", step)

        def extras() -> None:
            faults.maybe_break_save(step)
            if job.problem is not None:
                raise job.problem
            for rel, data in job.files.items():
                write_bytes_atomic(self.fs, join(path, rel), data)
                digests.add(rel, hashlib.sha256(data).hexdigest(), len(data))
            self._flush(path, digests.files())  # this rank's files reach the disk before anyone commits

        _agree(extras, disk_full, group)
        faults.at_save_phase("after_extras", step)
        if not early:
            nbytes = self._commit(job, path, digests, disk_full)
        faults.at_save_phase("after_commit", step)
        self._check_committed(job, path, digests, disk_full)
        return nbytes

    def _flush(self, path: str, written: dict[str, tuple[str, int]]) -> None:
        """fsync each file this rank wrote into the local step folder `path` (DCP's writer may have been told not
        to), so that the commit never names data that a power loss or node crash would lose from the page cache.
        Object stores hold a file once its upload returns: nothing to do."""
        if not is_local(self.cfg.url):
            return
        for rel in sorted(written):
            _fsync_path(os.path.join(local_path(path), rel))

    def _flush_folders(self, path: str) -> None:
        """fsync the local step folder `path`, every folder inside it and the checkpoint folder that holds it:
        the files' names (DCP's renames included) are as durable as their data."""
        if not is_local(self.cfg.url):
            return
        top = local_path(path)
        inner = sorted(os.path.join(d, sub) for d, subs, _ in os.walk(top) for sub in subs)
        for folder in [*reversed(inner), top, os.path.dirname(top.rstrip("/")) or "."]:
            _fsync_path(folder)

    def _check_committed(self, job: _SaveJob, path: str, digests: _Digests, disk_full: Callable[[], bool]) -> None:
        """After the commit, rank 0 reads COMMIT.json back: it must list every file any rank wrote in this save,
        with the writer's sha256 and size, and each must be on storage with that size. Otherwise the commit is
        withdrawn (COMMIT.json removed) and every rank raises CheckpointCommitError (recorded by the trainer as a
        failed save, not left for a later resume to stumble on)."""
        written = _all_gather(digests.files(), job.group)

        def check() -> list[str]:
            if self.rank != 0:
                return []
            problems = self._commit_problems(job.step, path, {r: e for part in written for r, e in part.items()})
            if problems:
                self.fs.rm(join(path, COMMIT))
                log.error("checkpoint %s withdrawn: %s", self._url(path), "; ".join(problems))
            return problems

        problems = _broadcast_from_rank0(_agree(check, disk_full, job.group), job.group)
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

    def _commit(self, job: _SaveJob, path: str, digests: _Digests, disk_full: Callable[[], bool]) -> int:
        """Rank 0 lists the step folder and writes COMMIT.json naming every file in it with the sha256 and size
        its writer took (a file no writer accounts for is hashed here); the bytes listed."""
        written = _all_gather(digests.files(), job.group)
        faults.maybe_kill_during_save(job.step)

        def commit() -> int:
            if self.rank != 0:
                return 0
            known = {rel: entry for part in written for rel, entry in part.items()}
            sizes = self._listing(path)
            lost = sorted(set(known) - set(sizes))
            if lost:  # written, then gone: the storage lost it (retried)
                raise FileNotFoundError(errno.ENOENT, f"written but not found in {self._url(path)}", lost[0])
            unknown = sorted(set(sizes) - set(known))
            read = sha256_files(self.fs, [join(path, rel) for rel in unknown], _MAX_IO_THREADS)
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

        return _agree(commit, disk_full, job.group)

    def _listing(self, path: str) -> dict[str, int]:
        """Size of every file under the folder `path` but COMMIT.json, by path relative to it (one listing)."""
        self.fs.invalidate_cache(path)  # DCP wrote through another filesystem instance: a cached listing is stale
        prefix = path.rstrip("/") + "/"
        found = self.fs.find(path, detail=True)
        return {
            name[len(prefix) :]: int(info["size"])
            for name, info in ((n.rstrip("/"), i) for n, i in found.items())
            if name.startswith(prefix) and name[len(prefix) :] != COMMIT and info.get("type") != "directory"
        }

    def _no_space(self, path: str, space: _Space) -> str:
        return no_space_message(self._url(path), "checkpoint", space.needed_bytes, space.free_bytes)

    def _free_bytes(self) -> int | None:
        """Free bytes on the local disk of the checkpoint folder (None for object stores)."""
        return free_bytes(self.root) if is_local(self.cfg.url) else None

    def _make_room(self, step: int, space: _Space) -> int | None:
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
                _size(free), self._url(self.root), step, _size(space.needed_bytes), kind, self._url(self._dir(victim)),
            )  # fmt: skip
            self.fs.rm(self._dir(victim), recursive=True)
            free = self._free_bytes() or 0
            if free >= space.needed_bytes:
                break
        return free

    def _commit_or_none(self, step: int) -> dict[str, Any] | None:
        try:
            return self.read_commit(step)
        except CheckpointFormatError:
            return {}  # committed, but unreadable: not partial, and not believed either

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

    # ---- wholeness (one process: for drills and operators) ----------------------------------

    def files(self, step: int) -> list[str]:
        """Every file in the folder of `step`, relative to it (COMMIT.json included), sorted; [] when absent."""
        path = self._dir(step)
        if not self.fs.exists(path):
            return []
        prefix = path.rstrip("/") + "/"
        return sorted(f[len(prefix) :] for f in (p.rstrip("/") for p in self.fs.find(path)) if f.startswith(prefix))

    def wholeness(self, step: int) -> list[str]:
        """What keeps checkpoint `step` from being whole, one line each ([] when it is whole); not collective.

        Whole: COMMIT.json is there and well-formed (and signed with the key, when one is set); every file it
        lists exists with its size and sha256; and every file the loader needs exists and is listed (so it was
        verified): DCP's .metadata, each file it references (up to the last byte it reads), train_state.json
        and one RNG file per saved rank.
        """
        path = self._dir(step)
        try:
            commit = self.read_commit(step)
        except CheckpointFormatError as err:
            return [f"{COMMIT} {err.problem}"]
        if commit is None:
            return [f"{COMMIT} is missing"]
        problems = []
        if self.key is not None:
            try:
                reason = untrusted_reason(commit, self.key, self._url(path))
            except CheckpointKeyError as err:
                reason = err.problem
            if reason:
                problems.append(f"{COMMIT}: {reason}")
        listed = commit["files"]
        for rel, expected in sorted(listed.items()):
            full = join(path, rel)
            if not self.fs.exists(full):
                problems.append(f"{rel} is missing (COMMIT.json lists it)")
            elif (size := self.fs.size(full)) != expected["bytes"]:
                problems.append(f"{rel} has {size} bytes, COMMIT.json says {expected['bytes']}")
            elif sha256_file(self.fs, full) != expected["sha256"]:
                problems.append(f"{rel} fails its sha256 check")
        needed: dict[str, int] = dict.fromkeys(loader_files(commit["world_size"]), 0)
        if self.fs.exists(join(path, DCP_METADATA)):
            try:
                metadata = self._reader(self._url(path)).read_metadata()
            except Exception as err:  # noqa: BLE001 - any failure to read it is the finding
                problems.append(f"{DCP_METADATA} cannot be read: {_first_line(err)}")
            else:
                for info in (metadata.storage_data or {}).values():
                    needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for rel, end in sorted(needed.items()):
            full = join(path, rel)
            if not self.fs.exists(full):
                if rel not in listed:  # a listed one is reported above
                    problems.append(f"{rel} is missing (the loader needs it)")
            elif rel not in listed:
                problems.append(f"{rel} is not listed in COMMIT.json, so nothing verifies it")
            elif (size := self.fs.size(full)) < end:
                problems.append(f"{rel} has {size} bytes, {DCP_METADATA} reads up to byte {end}")
        return problems

    # ---- load -------------------------------------------------------------------------------

    def verify(self, step: int, commit: dict[str, Any]) -> str | None:
        """Why checkpoint `step` cannot be used (None when it is sound). Every rank checks a share of the files,
        several at a time."""
        path = self._dir(step)
        mine = {rel: commit["files"][rel] for rel in _share(commit["files"], self.rank, self.world)}
        checksums = self.cfg.verify_checksums or self.key is not None
        found = self._listing(path) if mine else {}
        problems: dict[str, str] = {}
        for rel, expected in mine.items():
            if rel not in found:
                problems[rel] = f"{rel} is missing"
            elif found[rel] != expected["bytes"]:
                problems[rel] = f"{rel} has {found[rel]} bytes, COMMIT.json says {expected['bytes']}"
        to_hash = {join(path, rel): rel for rel in mine if checksums and rel not in problems}
        for full, digest in sha256_files(self.fs, to_hash, _MAX_IO_THREADS).items():
            if digest != mine[to_hash[full]]["sha256"]:
                problems[to_hash[full]] = f"{to_hash[full]} fails its sha256 check"
        problem = problems[min(problems)] if problems else None
        gathered = [p for p in _all_gather(problem) if p]
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
        steps = _broadcast_from_rank0(self.steps_on_storage() if self.rank == 0 else None)
        for step in reversed(steps):
            commit = self.sound(step, skipped)
            if commit is not None:
                return step, commit
        return None

    def sound(self, step: int, skipped: list[SkippedCheckpoint] | None = None) -> dict[str, Any] | None:
        """The commit record of checkpoint `step` if it is committed, trusted and verified (collective), else None
        with the reason appended to `skipped` (when given) and logged. A missing folder counts as partial."""
        passed_over = skipped if skipped is not None else []
        kind, detail = _broadcast_from_rank0(self._inspect(step) if self.rank == 0 else None)
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
        problem = self.verify(step, detail)
        if problem:
            if self.rank == 0:
                log.warning("skipping corrupt checkpoint %s: %s", name, problem)
            passed_over.append(SkippedCheckpoint(step, name, "corrupt", problem))
            return None
        return detail

    # ---- model weights alone (one process: export, evaluation) -------------------------------

    def model_tensors(self, step: int) -> dict[str, TensorInfo]:
        """Every model tensor of checkpoint `step` by parameter name ("blocks.0.attn.wq.weight"), from its
        .metadata (read with the allow-list); no tensor data is read. Check the step with `sound` first."""
        metadata = self._reader(self.step_url(step)).read_metadata()
        return {
            key.removeprefix(MODEL_PREFIX): TensorInfo(tuple(entry.size), entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
        }

    def load_model_tensors(self, step: int, wanted: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
        """The model tensors named in `wanted` (as `model_tensors` gives them), read from checkpoint `step` and
        nothing else: DCP reads only their byte ranges, so a caller can go through a large model part by part."""
        state = {"model": {name: torch.empty(info.shape, dtype=info.dtype) for name, info in wanted.items()}}
        self._load(step, state)
        return state["model"]

    def load_model(self, step: int, model: torch.nn.Module) -> None:
        """Load only the model weights of checkpoint `step` into `model` (any world size; no optimizer, no RNG)."""
        state = {"model": get_model_state_dict(model)}
        self._load(step, state)
        set_model_state_dict(model, state["model"])

    def _load(self, step: int, state: dict[str, Any]) -> None:
        url = self.step_url(step)
        reader, planner = self._reader(url), SafeLoadPlanner(url)
        reader.read_metadata()  # raises UnsafeCheckpointError as itself (inside dcp.load it would be generic)
        with _single_process_quiet():
            _dcp_load(state, reader, planner)

    def _read_small_files(self, step: int, rng_needed: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """train_state.json and this rank's RNG file, checked on every rank before anything is applied."""
        path = self._dir(step)
        train_state: dict[str, Any] = {}
        rng = None
        problem = None
        try:
            where = self._url(join(path, TRAIN_STATE))
            train_state = _check_train_state(_parse_json(self._read_small(join(path, TRAIN_STATE)), where), step, where)
            if rng_needed:
                rel = join(path, "rng", f"rank-{self.rank:05d}.json")
                rng = check_rng(_parse_json(self._read_small(rel), self._url(rel)), self._url(rel))
        except CheckpointFormatError as err:
            problem = (err.path, err.problem)
        problems = [p for p in _all_gather(problem) if p]
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
        found = self.latest_sound(skipped)
        if found is None:
            self._record_resume(out, ResumeRecord(self.cfg.url, world_size=self.world, skipped=skipped))
            return None
        step, commit = found
        path = self._dir(step)
        url = self._url(path)
        saved_world, saved_layout = int(commit["world_size"]), commit.get("layout", "")
        rng_restored = saved_world == self.world and saved_layout == self.layout
        train_state, rng = self._read_small_files(step, rng_restored)
        reader, planner = self._reader(url), SafeLoadPlanner(url)
        refused, options = None, _OPTIONS
        try:
            metadata = reader.read_metadata()
            if _LIST_KEYED_OPTIMIZER in metadata.state_dict_metadata:
                options = _LIST_KEYED  # written before optimizer state was keyed by name: read it as written
        except UnsafeCheckpointError as err:
            refused = err
        except Exception:  # noqa: BLE001, S110 - any other failure is dcp.load's to raise, on every rank alike
            pass
        refusals = [r for r in _all_gather(refused) if r is not None]
        if refusals:
            raise refusals[0]
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        if "optim" not in commit.get("contents", ["model", "optim"]):
            del state["optim"]
            if self.rank == 0:
                log.warning("checkpoint %s has no optimizer state: the optimizer starts afresh", url)
        _dcp_load(state, reader, planner)
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

    def _record_resume(self, out: RunOutputWriter | None, record: ResumeRecord) -> None:
        if out is not None and self.rank == 0:
            out.write_resume(record)


def _share(files: dict[str, dict[str, Any]], rank: int, world: int) -> list[str]:
    """The files of a commit record that `rank` verifies: the largest first, each to the rank with the fewest
    bytes so far (every rank computes the same split)."""
    load = [0] * world
    shares: list[list[str]] = [[] for _ in range(world)]
    for rel in sorted(files, key=lambda r: (-files[r]["bytes"], r)):
        least = load.index(min(load))
        shares[least].append(rel)
        load[least] += files[rel]["bytes"]
    return sorted(shares[rank])


def _parse_json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointFormatError(where, f"is not valid JSON: {err}") from err
    except (ValueError, RecursionError) as err:  # a 5,000-digit integer, nesting deeper than the stack
        raise CheckpointFormatError(where, f"is not JSON this trainer writes: {type(err).__name__}") from err


def _check_train_state(value: Any, step: int, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointFormatError(where, f"holds a JSON {type(value).__name__}, not the object of training state")
    if "step" in value and value["step"] != step:
        raise CheckpointFormatError(where, f"says step {value['step']!r}, but it sits in {step_dir_name(step)}")
    return value


def _safe_relative(rel: Any) -> bool:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def _check_commit(value: Any, step: int, where: str) -> dict[str, Any]:
    """A COMMIT.json record as `commit()` writes it, or CheckpointFormatError saying what is off."""
    if not isinstance(value, dict):
        raise CheckpointFormatError(where, f"holds a JSON {type(value).__name__}, not a commit record")
    if value.get("step") != step:
        raise CheckpointFormatError(where, f"says step {value.get('step')!r}, but it sits in {step_dir_name(step)}")
    world = value.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointFormatError(where, f"has world_size={world!r}; expected a positive integer")
    layout = value.get("layout", "")
    if not isinstance(layout, str) or len(layout) > 200:
        raise CheckpointFormatError(where, f"has layout={layout!r}; expected a short string")
    contents = value.get("contents", ["model", "optim"])
    if not isinstance(contents, list) or not set(contents) <= {"model", "optim"} or "model" not in contents:
        raise CheckpointFormatError(where, f"has contents={contents!r}; expected ['model'] or ['model', 'optim']")
    files = value.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointFormatError(where, "lists no files")
    for rel, entry in files.items():
        if not _safe_relative(rel):
            raise CheckpointFormatError(where, f"lists the file {rel!r}, which is not a path inside the step folder")
        ok = isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if not ok or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CheckpointFormatError(where, f"has the entry {rel!r}: {entry!r}; expected sha256 and bytes")
    return value


def _dcp_load(state: dict[str, Any], reader: Any, planner: SafeLoadPlanner) -> None:
    """dcp.load into `state`; a refusal of the trust checks is raised as itself, not inside DCP's exception."""
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except (Exception, CheckpointException) as err:  # DCP's exception is a BaseException
        refusal = planner.refused or _refusal_in(err)
        if refusal is not None:
            raise refusal from err
        raise


def _refusal_in(err: BaseException) -> UnsafeCheckpointError | None:
    return next((leaf for _, leaf in _leaves(err) if isinstance(leaf, UnsafeCheckpointError)), None)


class _StorageFailure(RuntimeError):
    """A storage operation failed on some rank during a save (every rank raises it together)."""

    def __init__(self, message: str, no_space: bool = False) -> None:
        super().__init__(message)
        self.no_space = no_space


@dataclass(frozen=True)
class _Outcome:
    """How one rank's operation failed, in a form every rank can judge alike."""

    rank: int
    retryable: bool
    no_space: bool
    message: str


def _outcome(err: BaseException, rank: int, disk_full: Callable[[], bool]) -> _Outcome:
    retryable = is_storage_error(err)
    no_space = retryable and (_says_no_space(err) or (_SHORT_WRITE in str(err) and disk_full()))
    leaves = _leaves(err, rank)
    culprit = next(((r, e) for r, e in leaves if not _is_storage_leaf(e)), leaves[0])
    return _Outcome(rank if culprit[0] is None else culprit[0], retryable, no_space, _first_line(culprit[1]))


def _agree(
    operation: Callable[[], Any],
    disk_full: Callable[[], bool] = lambda: False,
    group: dist.ProcessGroup | None = None,
) -> Any:
    """Run a rank-local part of a save so that every rank takes the same decision about its failure.

    Storage errors on any rank raise _StorageFailure on every rank (the save is retried); any other
    error is a bug: the rank that has it raises it as itself, the others CheckpointAbortedError.
    The ranks compare notes over `group` (None: the default group).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        result, error = operation(), None
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's exception is a BaseException
        result, error = None, err
    mine = None if error is None else _outcome(error, rank, disk_full)
    failed = [o for o in _all_gather(mine, group) if o is not None]
    if not failed:
        return result
    bug = next((o for o in failed if not o.retryable), None)
    if bug is not None:
        if error is not None and mine is not None and not mine.retryable:
            if isinstance(error, CheckpointException):
                raise next(e for _, e in _leaves(error) if not _is_storage_leaf(e)) from error
            raise error
        raise CheckpointAbortedError(bug.rank, bug.message)
    first = failed[0]
    raise _StorageFailure(f"rank {first.rank}: {first.message}", no_space=any(o.no_space for o in failed))


def _fsync_path(path: str) -> None:
    """fsync a local file or folder by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _all_gather(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast_from_rank0(obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
