"""The checkpoint folder as one process reads it: steps, commit records, model cards, pins, wholeness, model weights.

Nothing here is collective; `CheckpointManager` (manager.py) adds the collective save, verification and resume.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from training.checkpoint.card import ModelCard
from training.checkpoint.commit import check_commit, parse_json
from training.checkpoint.errors import CheckpointFormatError, first_line, leaves
from training.checkpoint.files import (
    COMMIT,
    DCP_METADATA,
    MODEL_CARD,
    MODEL_PREFIX,
    PIN,
    PINS_DIR,
    STEP_DIR,
    loader_files,
    step_dir_name,
)
from training.checkpoint.reader import CheckpointDigestError
from training.checkpoint.trust import (
    CheckpointKeyError,
    SafeFileSystemReader,
    SafeFsspecReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    checkpoint_key,
    untrusted_reason,
)
from training.config import CheckpointConfig, first_problem
from training.storage import (
    ControlFileError,
    StorageConfig,
    filesystem,
    is_local,
    join,
    local_path,
    read_control_file,
    sha256_file,
    write_bytes_atomic,
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
def single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process whenever no process group is up; that is the intent here."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class CheckpointStore:
    """The checkpoints under one URL, read by one process (no collectives)."""

    def __init__(self, cfg: CheckpointConfig, storage: StorageConfig) -> None:
        """The checkpoints under `cfg.url`; `storage` holds the credentials and options of that URL."""
        self.cfg, self.storage = cfg, storage
        self.fs, self.root = filesystem(cfg.url, storage)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.key = checkpoint_key()

    def _dir(self, step: int) -> str:
        return join(self.root, step_dir_name(step))

    def _reader(
        self,
        path: str,
        local: type[SafeFileSystemReader] = SafeFileSystemReader,
        remote: type[SafeFsspecReader] = SafeFsspecReader,
    ) -> SafeFileSystemReader | SafeFsspecReader:
        """DCP's reader for the step folder `path`: `local` on a local filesystem, else `remote` over fsspec."""
        if is_local(self.cfg.url):
            return local(local_path(path))
        return remote(path, **self.storage.fsspec_options(self.cfg.url))

    @property
    def checks_digests(self) -> bool:
        """Whether loads check the files' sha256: checkpoint.verify_checksums, or a signing key (a signed record's
        digests vouch for nothing unchecked)."""
        return self.cfg.verify_checksums or self.key is not None

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
            match = STEP_DIR.search(entry.rstrip("/"))
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def newest_committed_step(self) -> int | None:
        """The newest step whose folder has a COMMIT.json (names only: nothing is read or verified)."""
        committed = [s for s in self.steps_on_storage() if self.fs.exists(join(self._dir(s), COMMIT))]
        return max(committed, default=None)

    def read_commit(self, step: int) -> dict[str, Any] | None:
        """The COMMIT.json of `step`, or None while that checkpoint is unfinished (CheckpointFormatError if bad)."""
        full = join(self._dir(step), COMMIT)
        try:
            raw = self._read_small(full)
        except FileNotFoundError:
            return None
        return check_commit(parse_json(raw, self._url(full)), step, self._url(full))

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
        value = parse_json(raw, self._url(full))
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
        if not PIN.match(name):
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
        return {int(m.group(1)) for m in map(PIN.match, names) if m}

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

    def _commit_or_none(self, step: int) -> dict[str, Any] | None:
        try:
            return self.read_commit(step)
        except CheckpointFormatError:
            return {}  # committed, but unreadable: not partial, and not believed either

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
                problems.append(f"{DCP_METADATA} cannot be read: {first_line(err)}")
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
        with single_process_quiet():
            dcp_load(state, reader, planner)


def dcp_load(state: dict[str, Any], reader: Any, planner: SafeLoadPlanner) -> None:
    """dcp.load into `state`; a refusal of the trust checks, or a data file failing its sha256 check while read
    (reader.py), is raised as itself, not inside DCP's exception."""
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    try:
        with warnings.catch_warnings():
            if alone:  # one process (or a group of one): DCP's plan exchange would only pickle the plan to itself
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=alone)
    except (Exception, CheckpointException) as err:  # DCP's exception is a BaseException
        refusal = planner.refused or _leaf_in(err, UnsafeCheckpointError) or _leaf_in(err, CheckpointDigestError)
        if refusal is not None:
            raise refusal from err
        raise


def _leaf_in(err: BaseException, kind: type[Exception]) -> Exception | None:
    return next((leaf for _, leaf in leaves(err) if isinstance(leaf, kind)), None)
