"""The reading side of a load: DCP's reader checking each data file's sha256 in the same pass that reads it.

A rank reads every DCP data file its load plan touches whole, once (several files at a time: file reads and
hashlib release the GIL), hashes each on the pool while this thread finds the tensors' bytes in it, and keeps the
bytes in memory. Before any of them reach the state, the ranks compare notes: a file whose sha256 or size differs
from the commit record fails the load on every rank with CheckpointDigestError, and nothing has been copied into
the model or optimizer. Data files that no rank's plan touches are hashed by a share of the ranks in the same
step, so a load vouches for every data file the commit lists, as the separate pass before it did. Only then is
each tensor copied from the held bytes straight into its target (DCP would torch.load it into a new tensor
first); bytes entries and anything unusual go through DCP's own reader, served from memory.

The rank holds the files it reads in host memory until their tensors are copied: about what a `torch.load` of
the same state holds. Without `expect` (checkpoint.verify_checksums off, no key) nothing is hashed.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pickle
import sys
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import _weights_only_unpickler
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from training.checkpoint.collective import all_gather
from training.checkpoint.files import COMMIT
from training.checkpoint.space import MAX_IO_THREADS
from training.checkpoint.trust import SafeFileSystemReader, SafeFsspecReader

DATA_SUFFIX = ".distcp"  # DCP's data files (torch.distributed.checkpoint.filesystem DEFAULT_SUFFIX)
_CHUNK_BYTES = 8 << 20
_UNREADABLE = ""  # sorts before every file name: a rank's read failure is reported first


class CheckpointDigestError(RuntimeError):
    """A checkpoint data file failed its sha256 (or size) check while a load read it; raised on every rank before
    any of the checkpoint's tensors were copied into the state: the checkpoint is corrupt, skip it."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}; the checkpoint is corrupt (skipped in favour of the previous one)")
        self.path, self.problem = path, problem

    def __reduce__(self) -> tuple[Any, ...]:  # crosses ranks inside DCP's CheckpointException
        return (type(self), (self.path, self.problem))


def share(files: dict[str, dict[str, Any]], rank: int, world: int) -> list[str]:
    """The files of a commit record that `rank` verifies: the largest first, each to the rank with the fewest
    bytes so far (every rank computes the same split)."""
    load = [0] * world
    shares: list[list[str]] = [[] for _ in range(world)]
    for rel in sorted(files, key=lambda r: (-files[r]["bytes"], r)):
        least = load.index(min(load))
        shares[least].append(rel)
        load[least] += files[rel]["bytes"]
    return sorted(shares[rank])


class _Served:
    """DCP's filesystem with the files already read served from memory (seekable, as DCP's file views need)."""

    def __init__(self, inner: Any, held: dict[str, bytes]) -> None:
        self.inner, self.held = inner, held

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        """The held bytes of `path` (released once its items are read), else the inner stream."""
        data = self.held.pop(os.fspath(path), None)
        if data is None or "r" not in mode:
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        yield io.BytesIO(data)  # shares the bytes object's buffer: no copy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _DigestCheckingRead:
    """`read_data` that checks every data file of the commit record while reading it (mixed into the readers)."""

    expected: dict[str, dict[str, Any]] | None = None  # data file -> {"sha256", "bytes"}; None: nothing checked
    where = ""  # the step folder, for messages
    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, unpickled once per reader (the manager reads it before dcp.load, which reads it
        again), with this load's id. DCP looks for `kwargs` in this signature."""
        if args or kwargs:
            return super().read_metadata(*args, **kwargs)  # type: ignore[misc]
        if self._metadata is None:
            self._metadata = super().read_metadata()  # type: ignore[misc]
        self._metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined,union-attr]
        return self._metadata

    def expect(self, files: dict[str, dict[str, Any]], where: str) -> None:
        """Check the data files among `files` (a commit record's "files") as they are read; `where` names them."""
        self.expected = {rel: entry for rel, entry in files.items() if rel.endswith(DATA_SUFFIX)}
        self.where = where

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read (and, after `expect`, hash) this rank's files, agree with every rank that all data files match the
        commit record (CheckpointDigestError on every rank otherwise), then copy the items from memory."""
        storage = self.storage_data  # type: ignore[attr-defined]
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(storage[item.storage_index].relative_path, []).append(item)
        held, ready, rest, problems = self._take(by_file)
        if self.expected is not None:
            self._agree(sorted(by_file), problems)  # raises on every rank alike, before anything is copied
        rest = self._copy(ready, planner) + self._load_bytes_entries(rest, held, planner)
        inner = self.fs  # type: ignore[attr-defined]
        self.fs = _Served(inner, held)  # what is left (transformed or unusual items): DCP's own way
        try:
            return super().read_data(LoadPlan(rest, plan.storage_data), planner)  # type: ignore[misc]
        finally:
            self.fs, held = inner, {}

    def _take(
        self, by_file: dict[str, list[ReadItem]]
    ) -> tuple[dict[str, bytes], list[tuple[ReadItem, torch.Tensor, torch.Tensor]], list[ReadItem], dict[str, str]]:
        """Read each file whole, several at a time; hash each (after `expect`) on the pool while this thread finds
        its tensors' bytes. The held bytes by path, the tensor items found, the items left for DCP, and the
        problems by file."""
        held: dict[str, bytes] = {}
        ready: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        rest: list[ReadItem] = []
        problems: dict[str, str] = {}
        layouts: dict[bytes, _Layout | None] = {}  # what each distinct tensor pickle says, for every file
        workers = max(1, min(MAX_IO_THREADS, len(by_file)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="load-read") as pool:
            reads = [(rel, pool.submit(self._read_whole, rel)) for rel in sorted(by_file)]
            digests = []
            try:
                for rel, read in reads:
                    data = read.result()
                    held[self._key(rel)] = data
                    if self.expected is not None:
                        digests.append((rel, len(data), pool.submit(_sha256, data)))
                    found, left = self._parse(by_file[rel], data, layouts)  # meanwhile the pool reads and hashes
                    ready += found
                    rest += left
                for rel, nbytes, digest in digests:
                    problem = self._check(rel, nbytes, digest.result())
                    if problem:
                        problems[rel] = problem
            except OSError as err:  # judged with the other ranks' findings: every rank raises alike
                problems[_UNREADABLE] = f"could not read a data file of {self.where}: {err}"
        return held, ready, rest, problems

    def _agree(self, wanted: list[str], problems: dict[str, str]) -> None:
        """Compare notes with every rank: hash the data files no rank read (a share each), then raise the first
        problem any rank found on every rank (CheckpointDigestError; OSError for a storage failure)."""
        first = (min(problems), problems[min(problems)]) if problems else None
        notes = all_gather((first, wanted))
        read_somewhere = {rel for _, files in notes for rel in files}
        unread = {rel: e for rel, e in (self.expected or {}).items() if rel not in read_somewhere}
        if unread and not any(found for found, _ in notes):
            rank, world = _rank_and_world()
            try:
                for rel in share(unread, rank, world):
                    nbytes, digest = self._hash_streamed(rel)
                    problem = self._check(rel, nbytes, digest)
                    if problem:
                        problems[rel] = problem
            except OSError as err:  # as above
                problems[_UNREADABLE] = f"could not read a data file of {self.where}: {err}"
            first = (min(problems), problems[min(problems)]) if problems else None
            notes = [(found, []) for found in all_gather(first)]
        found = sorted(f for f, _ in notes if f is not None)
        if found:
            if found[0][0] == _UNREADABLE:  # a storage failure, not a finding about the checkpoint: the load fails
                raise OSError(errno.EIO, found[0][1])
            raise CheckpointDigestError(self.where, found[0][1])

    def _parse(
        self, reqs: list[ReadItem], data: bytes, layouts: dict[bytes, _Layout | None]
    ) -> tuple[list[tuple[ReadItem, torch.Tensor, torch.Tensor]], list[ReadItem]]:
        """Each tensor item of one held file as a view of its bytes (nothing copied), and the items left for DCP.
        This runs before the file's digest is known: an item that does not parse is left to DCP, which reads it
        only after the file passed its check."""
        found: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        rest: list[ReadItem] = []
        with warnings.catch_warnings():  # the views are of read-only bytes; they are only read from
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for req in reqs:
                info = self.storage_data[req.storage_index]  # type: ignore[attr-defined]
                saved = None
                if req.type == LoadItemType.TENSOR and not info.transform_descriptors:
                    try:
                        saved = _saved_tensor(data, info.offset, info.length, layouts)
                    except Exception:  # noqa: BLE001 - bytes not verified yet: DCP reads the item after the check
                        saved = None
                if saved is None:
                    rest.append(req)
                else:
                    found.append((req, *saved))
        return found, rest

    def _copy(self, ready: list[tuple[ReadItem, torch.Tensor, torch.Tensor]], planner: LoadPlanner) -> list[ReadItem]:
        """Copy each tensor item straight from the held file bytes into its target (DCP would torch.load it into
        a new tensor first, then copy that); the items left for DCP."""
        rest: list[ReadItem] = []
        for req, tensor, raw in ready:
            narrowed = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != narrowed.size():
                raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {narrowed.size()}")
            if _whole_and_dense(narrowed, raw, target):  # byte for byte: no alignment needed
                target.reshape(-1).view(torch.uint8).copy_(raw)
            elif raw.data_ptr() % tensor.element_size() == 0:
                target.copy_(narrowed)
            else:  # a strided slice of bytes misaligned for its dtype: torch.load copies it aligned
                rest.append(req)
                continue
            planner.commit_tensor(req, target)
        return rest

    def _load_bytes_entries(self, reqs: list[ReadItem], held: dict[str, bytes], planner: LoadPlanner) -> list[ReadItem]:
        """Hand each plain bytes entry (an optimizer hyper-parameter) to the planner straight from its held file, as
        DCP's reader would from a file view; the items left for DCP."""
        rest: list[ReadItem] = []
        files: dict[str, bytes | None] = {}
        for req in reqs:
            info = self.storage_data[req.storage_index]  # type: ignore[attr-defined]
            if info.relative_path not in files:
                files[info.relative_path] = held.get(self._key(info.relative_path))
            data = files[info.relative_path]
            if req.type != LoadItemType.BYTE_IO or info.transform_descriptors or data is None:
                rest.append(req)
                continue
            planner.load_bytes(req, io.BytesIO(data[info.offset : info.offset + info.length]))
        return rest

    def _key(self, rel: str) -> str:
        return os.fspath(self.fs.concat_path(self.path, rel))  # type: ignore[attr-defined]

    def _read_whole(self, rel: str) -> bytes:
        with self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb") as stream:  # type: ignore[attr-defined]
            return stream.read()

    def _hash_streamed(self, rel: str) -> tuple[int, str]:
        digest, nbytes = hashlib.sha256(), 0
        with self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb") as stream:  # type: ignore[attr-defined]
            while chunk := stream.read(_CHUNK_BYTES):
                digest.update(chunk)
                nbytes += len(chunk)
        return nbytes, digest.hexdigest()

    def _check(self, rel: str, nbytes: int, digest: str) -> str | None:
        entry = (self.expected or {}).get(rel)
        if entry is None:
            return f"{rel} is read by the load but not listed in {COMMIT}, so nothing verifies it"
        if nbytes != entry["bytes"]:
            return f"{rel} has {nbytes} bytes, {COMMIT} says {entry['bytes']}"
        if digest != entry["sha256"]:
            return f"{rel} fails its sha256 check"
        return None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()  # releases the GIL: the pool reads and this thread parses meanwhile


@dataclass(frozen=True)
class _Layout:
    """What the pickle of a tensor saved alone by torch.save says: its one storage's record, dtype and byte count, and
    the tensor's view of it."""

    key: str
    dtype: torch.dtype
    nbytes: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


def _saved_tensor(
    data: bytes, offset: int, length: int, layouts: dict[bytes, _Layout | None]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tensor DCP wrote with torch.save at `offset` of a file held as `data`, viewing its bytes in place, and
    those bytes as uint8 (None where that cannot be done: the caller reads it with torch.load). Its pickle is read
    with torch's weights-only unpickler, as torch.load would, once per distinct pickle: `layouts` keeps what each
    said (tensors of one shape and dtype pickle alike), and a tensor whose pickle was read before is rebuilt from
    that. The tensor's data may be misaligned for its dtype: only its shape is used then, and its bytes copied as
    bytes."""
    view = _create_file_view(io.BytesIO(data), offset, length)
    archive = torch._C.PyTorchFileReader(view)
    if not archive.has_record("byteorder") or archive.get_record("byteorder") != sys.byteorder.encode():
        return None
    pickled = archive.get_record("data.pkl")
    if pickled not in layouts:
        layouts[pickled] = _unpickled_layout(pickled)
    layout = layouts[pickled]
    if layout is None:
        return None
    start = offset + archive.get_record_offset(f"data/{layout.key}")
    raw = torch.frombuffer(data, dtype=torch.uint8, count=layout.nbytes, offset=start)
    tensor = torch.empty(0, dtype=layout.dtype).set_(
        raw.untyped_storage(), layout.storage_offset, layout.size, layout.stride
    )
    return tensor, raw


def _unpickled_layout(pickled: bytes) -> _Layout | None:
    """The layout a tensor's data.pkl describes, read with torch's weights-only unpickler over an empty stand-in
    storage (None: not one plain tensor of one storage)."""
    keys: list[tuple[str, torch.dtype, int]] = []

    def storage(saved_id: tuple[Any, ...]) -> torch.TypedStorage:
        typename, storage_type, key, _, numel = saved_id
        if _as_str(typename) != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {typename!r}")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        keys.append((_as_str(key), dtype, numel * dtype.itemsize))
        return torch.TypedStorage(wrap_storage=torch.UntypedStorage(numel * dtype.itemsize, device="meta"),
                                  dtype=dtype, _internal=True)  # fmt: skip

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = storage  # type: ignore[method-assign]
    tensor = unpickler.load()
    if type(tensor) is not torch.Tensor or len(keys) != 1 or tensor.is_quantized or tensor.dtype != keys[0][1]:
        return None
    key, dtype, nbytes = keys[0]
    return _Layout(key, dtype, nbytes, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())


def _whole_and_dense(source: torch.Tensor, raw: torch.Tensor, target: torch.Tensor) -> bool:
    """`source` is all of its storage's bytes `raw`, in order, and `target` holds the same dtype densely."""
    return (
        source.dtype == target.dtype
        and source.storage_offset() == 0
        and source.is_contiguous()
        and target.is_contiguous()
        and source.numel() * source.element_size() == raw.numel()
    )


def _as_str(value: Any) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def _rank_and_world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


class VerifyingFileSystemReader(_DigestCheckingRead, SafeFileSystemReader):
    """The local reader (restricted metadata unpickling) checking each data file's sha256 as it reads it."""


class VerifyingFsspecReader(_DigestCheckingRead, SafeFsspecReader):
    """The fsspec reader (restricted metadata unpickling) checking each data file's sha256 as it reads it."""
