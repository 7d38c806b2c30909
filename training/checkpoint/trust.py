"""What a checkpoint loader may believe: DCP files unpickled with an allow-list, commit records signed.

DCP (torch 2.13) reads `.metadata` with `pickle.load` and the bytes entries of a
state dict (the optimizer's hyper-parameters) with `torch.load(weights_only=False)`,
so a planted file runs whatever code it names when training resumes. The readers
and the planner here unpickle `.metadata` with an allow-list of the classes DCP
metadata consists of and load bytes entries with `weights_only=True`; anything
else raises UnsafeCheckpointError naming the global and the file. Tensor data is
already read with `weights_only=True` by DCP.

COMMIT.json lists every file with its sha256, and whoever can replace a file can
rewrite those as easily. With the environment variable TDEPLOY_CHECKPOINT_KEY set
(at least 16 characters, from a secret store: never in the checkpoint storage or
the spec), saves add `hmac_sha256`, an HMAC-SHA256 of the record's canonical JSON,
and loads believe a record only when that signature matches:

    key set,   signed, signature matches  -> loaded (every checksum verified: they carry the signature to the files)
    key set,   signed, signature differs  -> skipped as untrusted, with the reason
    key set,   unsigned                   -> skipped as untrusted (saved without a key, or its signature stripped)
    key unset, signed                     -> CheckpointKeyError: set TDEPLOY_CHECKPOINT_KEY to the key it was saved with
    key unset, unsigned                   -> loaded (checksums catch accidents, not tampering)
"""

from __future__ import annotations

import copy
import io
import pickle
import posixpath
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from training.signing import (
    KEY_ENV,
    MIN_KEY_CHARS,
    SIGNATURE_FIELD,
    CheckpointKeyError,
    checkpoint_key,
    sign_commit,
    untrusted_reason,
)

__all__ = [  # the signing names live in training/signing.py (no torch) and are re-exported here
    "KEY_ENV", "MIN_KEY_CHARS", "SIGNATURE_FIELD", "CheckpointKeyError", "SafeFileSystemReader", "SafeFsspecReader",
    "SafeLoadPlanner", "UnsafeCheckpointError", "checkpoint_key", "load_metadata", "sign_commit", "untrusted_reason",
]


# Every global a torch 2.13 DCP `.metadata` names (found by unpickling real DDP and FSDP2 checkpoints);
# matched exactly, so `PosixPath.touch` and the like stay out. torch dtypes are allowed by type below.
_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }
)


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file names a global (a class or function) that a DCP checkpoint never contains."""

    def __init__(self, path: str, global_name: str, reason: str) -> None:
        super().__init__(
            f"refusing to load {path}: {reason} ({global_name}); the file was not written by "
            "torch.distributed.checkpoint as this trainer saves it (planted or tampered with?): inspect the "
            "checkpoint folder and delete it, or set TDEPLOY_CHECKPOINT_KEY so that unsigned checkpoints are skipped"
        )
        self.path, self.global_name, self.reason = path, global_name, reason

    def __reduce__(self) -> tuple[Any, ...]:  # crosses ranks inside DCP's CheckpointException
        return (type(self), (self.path, self.global_name, self.reason))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any global outside the allow-list raises UnsafeCheckpointError."""

    def __init__(self, stream: IO[bytes], where: str) -> None:
        super().__init__(stream)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(self.where, f"{module}.{name}", "DCP metadata never names this global")


def load_metadata(stream: IO[bytes], where: str) -> Metadata:
    """Unpickle a DCP `.metadata` with the allow-list; refuse what is not DCP metadata."""
    try:
        metadata = _MetadataUnpickler(stream, where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any other unpickling failure means the file is not metadata
        raise UnsafeCheckpointError(where, type(err).__name__, f"not a DCP metadata pickle: {err}") from err
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(where, type(metadata).__name__, "the pickle holds no DCP Metadata")
    for info in (metadata.storage_data or {}).values():
        # DCP opens storage_data paths relative to the checkpoint folder: nothing may point outside it.
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or "/" in rel or "\\" in rel or rel in ("", ".", "..") or posixpath.isabs(rel):
            raise UnsafeCheckpointError(where, repr(rel), "a storage entry points outside the checkpoint folder")
    return metadata


class _SafeMetadataReader:
    """`read_metadata` through the restricted unpickler (mixed into DCP's readers, torch 2.13)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's read_metadata with the allow-list unpickler. DCP looks for `kwargs` in this signature.

        Inside `dcp.load` a refusal turns into a fallback to per-rank metadata and a generic error:
        call this once before `dcp.load` to raise it as what it is.
        """
        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as stream:  # type: ignore[attr-defined]
            metadata = load_metadata(stream, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return metadata


class SafeFileSystemReader(_SafeMetadataReader, FileSystemReader):
    """DCP's local reader with restricted metadata unpickling."""


class SafeFsspecReader(_SafeMetadataReader, FsspecReader):
    """DCP's fsspec reader with restricted metadata unpickling."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading bytes entries with `weights_only=True`."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.refused: UnsafeCheckpointError | None = None
        # Optimizer state keyed by parameter name repeats each hyper-parameter once per parameter: the same bytes,
        # unpickled once (torch.load of a small entry costs about a millisecond), then copied.
        self._unpickled: dict[bytes, Any] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickle one non-tensor entry (an optimizer hyper-parameter) with torch's weights-only unpickler."""
        fqn = read_item.dest_index.fqn
        raw = value.getvalue()
        if raw in self._unpickled:
            obj = copy.deepcopy(self._unpickled[raw])
        else:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                self.refused = UnsafeCheckpointError(self.where, fqn, f"entry {fqn!r} is not plain data: {err}")
                raise self.refused from err
            self._unpickled[raw] = copy.deepcopy(obj)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
