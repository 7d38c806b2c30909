"""The tokenized dataset format, both sides: `DatasetWriter` and `TokenDataset`.

Token files are Megatron indexed datasets (training/indexed.py), what Megatron-Core and NeMo read and write,
with our manifest beside them. Layout under a local folder or an object-store prefix::

    <dataset>/manifest.json              written last: a dataset without it is unfinished
    <dataset>/<split>/tokens-00000.bin   token ids (uint16 below 65536 ids, else int32), documents back to back,
                                         an EOS token ending each one
    <dataset>/<split>/tokens-00000.idx   Megatron's index: one sequence per document, document indices

Each shard is a Megatron path prefix (`<dataset>/train/tokens-00000`) that Megatron's own
`IndexedDataset` opens. `manifest.json` (`DatasetManifest`) records the format version, vocabulary size,
token dtype, EOS id, tokenizer identity, the blend of sources with their weights, and per split and shard
the token and document counts, the byte size and sha256 of both files.

A shard may also be a document range of another dataset's prefix (`docs`): that is how a Megatron dataset
made elsewhere is adopted without copying (its train and validation splits are ranges of one prefix). Such a
manifest names files outside its folder; they are opened only where the run's spec named them
(`trusted`, from data.dataset_url), never because a manifest says so.

Samples are derived for a sequence length L: a shard of n tokens holds `(n - 1) // L` samples, sample j
being its tokens `[j*L, j*L + L + 1)` (inputs are the first L, targets the last L). Samples never cross
shards. The global sample index runs over the shards in manifest order, which groups them by source.
Local shards are memory-mapped; remote ones are read with ranged requests.

A dataset is untrusted input. `read_manifest` refuses any file name that is not a plain relative path under
the dataset root (or under a trusted source). `TokenDataset` checks every file's size against the manifest
each time it opens a split, and on the first use of a split on a host also checks each file's sha256, the
index against its token file, and the largest token id; a marker per verified file in a host-local cache
(`default_cache_dir()`, never inside the dataset) spares later runs that pass while the file's identity
(size, mtime, inode or ETag) is unchanged. Datasets of the earlier format (version 1, an index of raw int64
offsets) are refused with the command that converts them in place (`convert_legacy`).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.config import first_problem
from training.indexed import WRITE_DTYPES, IndexFormatError, check_bin_size, encode_index, parse_index
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

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
LEGACY_VERSION = 1
"""The format before Megatron's index: `docs-NNNNN.idx` of raw int64 offsets, uint16 or uint32 ids."""
MANIFEST = "manifest.json"
MANIFEST_MAX_BYTES = 64 << 20
"""Largest manifest read (about 180,000 shards); anything larger, or no regular file, is refused naming it."""
TokenDtype = Literal["uint8", "uint16", "int16", "int32", "int64"]


_CHUNK_BYTES = 8 << 20
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


class DatasetError(ValueError):
    """The dataset is missing, unfinished, inconsistent, corrupt or incompatible with the run.

    `file` names the dataset file at fault (relative to the dataset root) when there is one.
    """

    def __init__(self, url: str, problem: str, fix: str, file: str | None = None) -> None:
        super().__init__(f"{url}: {problem}; {fix}")
        self.url, self.problem, self.fix, self.file = url, problem, fix, file


class TokenizerInfo(BaseModel):
    """Identity of the tokenizer that produced the ids."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["bytes", "bpe", "unknown"] = Field(
        description="bytes: id = byte value; bpe: a tokenizer.json; unknown: an adopted dataset's ids, tokenizer "
        "not given."
    )
    sha256: str | None = Field(default=None, description="sha256 of tokenizer.json (bpe).")
    path: str | None = Field(default=None, description="Where tokenizer.json is stored, relative to the dataset.")


class ShardInfo(BaseModel):
    """One Megatron prefix (`.bin` + `.idx`), or a document range of one."""

    model_config = ConfigDict(extra="forbid")

    prefix: str = Field(
        description="Megatron path prefix: relative to the dataset root, or an adopted source's URL prefix."
    )
    n_tokens: int = Field(ge=0, description="Tokens of this shard's documents.")
    n_docs: int = Field(ge=0, description="Documents of this shard.")
    tokens_sha256: str
    index_sha256: str
    tokens_bytes: int = Field(ge=0, description="Size of the whole .bin.")
    index_bytes: int = Field(ge=0, description="Size of the whole .idx.")
    docs: tuple[int, int] | None = Field(
        default=None, description="Documents [first, end) of the prefix this shard is; None = all of them."
    )
    first_token: int = Field(default=0, ge=0, description="Offset of the first document's first token in the .bin.")
    source: int = Field(default=0, ge=0, description="Which entry of the manifest's blend the shard belongs to.")

    @property
    def tokens(self) -> str:
        """The token file (.bin)."""
        return self.prefix + ".bin"

    @property
    def index(self) -> str:
        """The index file (.idx)."""
        return self.prefix + ".idx"


class SplitInfo(BaseModel):
    """Totals and shards of one split."""

    model_config = ConfigDict(extra="forbid")

    n_tokens: int = Field(ge=0)
    n_docs: int = Field(ge=0)
    shards: list[ShardInfo]


class BlendSource(BaseModel):
    """One source of a blend: where it came from and its sampling weight."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="A label for reports.")
    weight: float = Field(gt=0, allow_inf_nan=False, description="Sampling weight (normalised over the blend).")
    url: str | None = Field(default=None, description="Where the source came from (data.dataset_url).")
    kind: str = Field(default="tdeploy", description="tdeploy, megatron or hf.")


class DatasetManifest(BaseModel):
    """The manifest: the dataset's table of contents and its commit marker."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    vocab_size: int = Field(ge=2)
    dtype: TokenDtype
    eos_id: int | None
    tokenizer: TokenizerInfo
    splits: dict[str, SplitInfo]
    blend: list[BlendSource] | None = Field(
        default=None, description="Weighted sources (each shard names its entry); None = one source, no weights."
    )
    meta: dict[str, Any] = Field(default_factory=dict, description="Producer's notes (source, settings).")

    @property
    def n_sources(self) -> int:
        """Sources of the blend (1 when it is not one)."""
        return len(self.blend) if self.blend else 1

    def curve_identity(self, train_split: str, val_split: str) -> dict[str, Any]:
        """What of this dataset determines a run's loss curve: the vocabulary, ids, tokenizer and both splits'
        shards (the quality baseline's key, tasks/acceptance/baselines.py)."""
        return {
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
            "eos_id": self.eos_id,
            "tokenizer": {"kind": self.tokenizer.kind, "sha256": self.tokenizer.sha256},
            "train": self._split_identity(train_split),
            "val": self._split_identity(val_split),
        }

    def _split_identity(self, split: str) -> dict[str, Any] | None:
        info = self.splits.get(split)
        if info is None:
            return None
        shards = [[s.n_tokens, s.n_docs, s.tokens_sha256, s.index_sha256] for s in info.shards]
        return {"n_tokens": info.n_tokens, "n_docs": info.n_docs, "shards": shards}

    def checksums(self) -> dict[str, Any]:
        """The dataset's content by its checksums: every split's shards and the tokenizer (the ledger's dataset
        key)."""
        splits = {name: [[s.tokens_sha256, s.index_sha256] for s in info.shards]
                  for name, info in sorted(self.splits.items())}  # fmt: skip
        return {"tokenizer": self.tokenizer.sha256, "splits": splits}


def token_dtype(vocab_size: int) -> Literal["uint16", "int32"]:
    """The dtype Megatron picks for a vocabulary: uint16 when every id fits, else int32."""
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**31:
        return "int32"
    raise ValueError(f"vocab_size={vocab_size} does not fit int32 token ids; use a vocabulary <= 2**31")


def _id_limit(dtype: str) -> int:
    """One more than the largest id the dtype holds."""
    return int(np.iinfo(dtype).max) + 1


class DatasetWriter:
    """Streams documents into Megatron shards; `close()` writes the manifest, which commits the dataset.

    Use as a context manager: on an exception the manifest is not written, so the
    partial output is never taken for a finished dataset. Documents of a blend name their `source`
    (an index into `blend`); each shard holds one split of one source.
    """

    def __init__(
        self,
        url: str,
        vocab_size: int,
        tokenizer: TokenizerInfo,
        eos_id: int | None,
        shard_tokens: int = 1 << 24,
        storage: StorageConfig | None = None,
        overwrite: bool = False,
        meta: dict[str, Any] | None = None,
        dtype: str | None = None,
        blend: list[BlendSource] | None = None,
    ) -> None:
        self.url, self.vocab_size, self.eos_id = url, vocab_size, eos_id
        self.dtype = dtype or token_dtype(vocab_size)
        if self.dtype not in WRITE_DTYPES:
            raise ValueError(f"dtype={self.dtype}: Megatron's format stores token ids as one of {WRITE_DTYPES}")
        if vocab_size > _id_limit(self.dtype):
            raise ValueError(f"vocab_size={vocab_size} does not fit {self.dtype} token ids; use int32")
        self.tokenizer, self.shard_tokens, self.meta, self.blend = tokenizer, shard_tokens, meta or {}, blend
        self.fs, self.root = filesystem(url, storage)
        manifest = join(self.root, MANIFEST)
        if self.fs.exists(manifest):
            if not overwrite:
                raise DatasetError(url, "a finished dataset is already there", "choose another URL or overwrite=True")
            self.fs.rm(manifest)  # uncommit first: from now on the old dataset reads as unfinished
        self._open: dict[tuple[str, int], tuple[list[np.ndarray], list[int], int]] = {}
        self._done: dict[str, list[ShardInfo]] = {}

    def add_document(self, split: str, tokens: np.ndarray | list[int], source: int = 0) -> None:
        """Append one document (EOS is added when the tokenizer has one)."""
        self.add_documents(split, [np.asarray(tokens, dtype=np.int64)], source)

    def add_documents(self, split: str, docs: list[np.ndarray], source: int = 0) -> None:
        """Append documents in order; a shard closes at the first document end that reaches shard_tokens."""
        if not docs:
            return
        if not 0 <= source < (len(self.blend) if self.blend else 1):
            raise ValueError(f"source {source} is not an entry of the blend")
        ids = np.concatenate([np.asarray(doc).ravel() for doc in docs])
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids.max() if ids.max() >= self.vocab_size else ids.min())
            raise ValueError(f"token id {bad} outside the vocabulary [0, {self.vocab_size})")
        eos = [np.array([self.eos_id], dtype=self.dtype)] if self.eos_id is not None else []
        flat = np.concatenate([piece for doc in docs for piece in (np.asarray(doc).astype(self.dtype), *eos)])
        ends = np.cumsum([np.asarray(doc).size + len(eos) for doc in docs])
        key = (split, source)
        begin = 0
        while begin < len(docs):
            chunks, lengths, length = self._open.get(key, ([], [], 0))
            offset = int(ends[begin - 1]) if begin else 0
            cut = begin + int(np.searchsorted(ends[begin:] - offset, self.shard_tokens - length, side="left"))
            last = min(cut, len(docs) - 1)
            chunks.append(flat[offset : int(ends[last])])
            lengths.extend(np.diff(np.concatenate(([offset], ends[begin : last + 1]))).tolist())
            self._open[key] = (chunks, lengths, length + int(ends[last]) - offset)
            if cut < len(docs):
                self._flush(key)
            begin = last + 1

    def _flush(self, key: tuple[str, int]) -> None:
        chunks, lengths, length = self._open.pop(key, ([], [], 0))
        if not chunks:
            return
        split, source = key
        shards = self._done.setdefault(split, [])
        prefix = f"{split}/tokens-{len(shards):05d}"
        tokens = np.concatenate(chunks).astype(np.dtype(self.dtype).newbyteorder("<"), copy=False).tobytes()
        index = encode_index(self.dtype, np.asarray(lengths), np.arange(len(lengths) + 1))
        self.fs.makedirs(join(self.root, split), exist_ok=True)
        self.fs.pipe_file(join(self.root, prefix + ".bin"), tokens)
        self.fs.pipe_file(join(self.root, prefix + ".idx"), index)
        shards.append(
            ShardInfo(
                prefix=prefix,
                n_tokens=length,
                n_docs=len(lengths),
                tokens_sha256=hashlib.sha256(tokens).hexdigest(),
                index_sha256=hashlib.sha256(index).hexdigest(),
                tokens_bytes=len(tokens),
                index_bytes=len(index),
                source=source,
            )
        )

    def close(self) -> DatasetManifest:
        """Flush the last shards and commit the manifest."""
        for key in sorted(self._open):
            self._flush(key)
        if not self._done:
            raise DatasetError(self.url, "no documents were written", "check the sources and the cleaning settings")
        splits = {
            name: split_info(sorted(shards, key=lambda s: s.source))  # samples group by source
            for name, shards in sorted(self._done.items())
        }
        manifest = DatasetManifest(
            vocab_size=self.vocab_size,
            dtype=self.dtype,
            eos_id=self.eos_id,
            tokenizer=self.tokenizer,
            splits=splits,
            blend=self.blend,
            meta=self.meta,
        )
        write_manifest(self.url, manifest, self.fs, self.root)
        return manifest

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()


def split_info(shards: list[ShardInfo]) -> SplitInfo:
    """A split of these shards, with its totals."""
    return SplitInfo(n_tokens=sum(s.n_tokens for s in shards), n_docs=sum(s.n_docs for s in shards), shards=shards)


def write_manifest(url: str, manifest: DatasetManifest, fs: Any = None, root: str | None = None,
                   storage: StorageConfig | None = None) -> None:  # fmt: skip
    """Commit `manifest` at `url` (atomically: the dataset is finished once it is there)."""
    if fs is None or root is None:
        fs, root = filesystem(url, storage)
    write_bytes_atomic(fs, join(root, MANIFEST), manifest.model_dump_json(indent=2).encode())


def read_manifest(url: str, storage: StorageConfig | None = None, trusted: Sequence[str] = ()) -> DatasetManifest:
    """The manifest of a finished dataset, or a DatasetError that says what is wrong.

    `trusted`: the adopted sources' URLs the run's spec named; a shard outside the dataset's folder must lie
    under one of them.
    """
    raw = _manifest_bytes(url, storage)
    version = _version_of(raw)
    if version == LEGACY_VERSION:
        raise DatasetError(
            url,
            f"{MANIFEST} has format_version=1 (an index of raw offsets, which Megatron's readers cannot open)",
            f"convert it in place to Megatron's indexed format (the token files stay): tdeploy convert-dataset "
            f"{shlex.quote(url)}",
            file=MANIFEST,
        )
    try:
        manifest = DatasetManifest.model_validate_json(raw)
    except ValidationError as err:
        raise DatasetError(
            url,
            f"{MANIFEST} is not a valid manifest ({first_problem(err, '<root>')})",
            "rebuild the dataset (tdeploy prepare-data)",
            file=MANIFEST,
        ) from err
    if manifest.format_version != FORMAT_VERSION:
        raise DatasetError(
            url, f"format_version={manifest.format_version}", f"this payload reads version {FORMAT_VERSION}; rebuild it"
        )
    _check_manifest(url, manifest, trusted)
    return manifest


def _manifest_bytes(url: str, storage: StorageConfig | None) -> bytes:
    fs, root = filesystem(url, storage)
    try:
        return read_control_file(fs, join(root, MANIFEST), MANIFEST_MAX_BYTES)
    except ControlFileError as err:
        raise DatasetError(url, f"{MANIFEST} {err.problem}", "rebuild the dataset (tdeploy prepare-data)",
                           file=MANIFEST) from err  # fmt: skip
    except FileNotFoundError as err:
        state = "is unfinished (no manifest.json)" if fs.exists(root) else "does not exist"
        raise DatasetError(
            url, f"the dataset {state}", "build it first (tdeploy prepare-data / tdeploy train)"
        ) from err


def _version_of(raw: bytes) -> Any:
    try:
        return json.loads(raw).get("format_version")
    except (ValueError, AttributeError, RecursionError):
        return None


def _outside_reason(rel: str) -> str | None:
    """Why `rel` is not a plain relative path under the dataset root, or None when it is one."""
    if _CONTROL.search(rel):
        return "contains a control character"
    if rel.startswith(("/", "\\")):
        return "is an absolute path"
    if _SCHEME.match(rel):
        return "is a URL or a drive path, not a path relative to the dataset root"
    if "\\" in rel:
        return "contains a backslash"
    parts = rel.split("/")
    if ".." in parts:
        return "climbs out of the dataset root ('..')"
    if any(part in ("", ".") for part in parts):
        return "has an empty or '.' path component"
    return None


def trusted_source(prefix: str, trusted: Sequence[str]) -> str | None:
    """The entry of `trusted` that `prefix` is (a Megatron prefix) or lies under (a dataset folder), or None."""
    for source in trusted:
        base = source.rstrip("/")
        if prefix == base:
            return source
        if prefix.startswith(base + "/") and _outside_reason(prefix[len(base) + 1 :]) is None:
            return source
    return None


def _check_manifest(url: str, manifest: DatasetManifest, trusted: Sequence[str] = ()) -> None:
    """Refuse file names that leave the dataset root (or a trusted source) and values no writer produces."""
    fields = [("tokenizer.path", manifest.tokenizer.path)] if manifest.tokenizer.path is not None else []
    problems = []
    for field, rel in fields:
        reason = _outside_reason(rel)
        if reason is not None:
            problems.append(f"{MANIFEST} {field}={rel!r} {reason}")
    for name, split in manifest.splits.items():
        for number, shard in enumerate(split.shards):
            where = f"splits.{name}.shards[{number}].prefix={shard.prefix!r}"
            reason = _outside_reason(shard.prefix)
            if reason is not None and trusted_source(shard.prefix, trusted) is None:
                named = f" (the run trusts {list(trusted)})" if trusted else ""
                problems.append(f"{MANIFEST} {where} {reason}{named}")
            elif shard.source >= manifest.n_sources:
                problems.append(f"{MANIFEST} {where}: source={shard.source}, the blend has {manifest.n_sources}")
            elif shard.docs is not None and not 0 <= shard.docs[0] <= shard.docs[1]:
                problems.append(f"{MANIFEST} {where}: docs={list(shard.docs)} is not a range")
            elif shard.first_token + shard.n_tokens > shard.tokens_bytes // np.dtype(manifest.dtype).itemsize:
                problems.append(f"{MANIFEST} {where}: its tokens end past its .bin of {shard.tokens_bytes} bytes")
    if problems:
        raise DatasetError(
            url,
            problems[0],
            "a manifest may only name files inside its dataset's folder, or under a source data.dataset_url "
            "names; rebuild the dataset or fix the manifest",
            file=MANIFEST,
        )
    if manifest.vocab_size > _id_limit(manifest.dtype):
        raise DatasetError(
            url,
            f"{MANIFEST} vocab_size={manifest.vocab_size} does not fit dtype={manifest.dtype}",
            "rebuild the dataset (tdeploy prepare-data)",
            file=MANIFEST,
        )
    if manifest.eos_id is not None and not 0 <= manifest.eos_id < manifest.vocab_size:
        raise DatasetError(
            url,
            f"{MANIFEST} eos_id={manifest.eos_id} is outside the vocabulary [0, {manifest.vocab_size})",
            "rebuild the dataset (tdeploy prepare-data)",
            file=MANIFEST,
        )


def shard_url(root: str, prefix: str) -> str:
    """Where a shard's prefix is: under the dataset root, or (an adopted source) the prefix itself."""
    return join(root, prefix) if _outside_reason(prefix) is None else prefix


def verify_dataset(
    url: str, storage: StorageConfig | None = None, trusted: Sequence[str] = (), digests: bool = True
) -> list[str]:
    """Check every file's size and (with `digests`) sha256 against the manifest; returns the problems found."""
    manifest = read_manifest(url, storage, trusted)
    _, root = filesystem(url, storage)
    problems = []
    for name, split in manifest.splits.items():
        for shard in split.shards:
            base = shard_url(root, shard.prefix)
            fs, _ = filesystem(base, storage)
            for rel, ext, digest, size in (
                (shard.tokens, ".bin", shard.tokens_sha256, shard.tokens_bytes),
                (shard.index, ".idx", shard.index_sha256, shard.index_bytes),
            ):
                path = _fs_path(base + ext, storage)
                if not fs.exists(path):
                    problems.append(f"{name}: {rel} is missing")
                elif fs.size(path) != size:
                    problems.append(f"{name}: {rel} has {fs.size(path)} bytes, manifest says {size}")
                elif digests and sha256_file(fs, path) != digest:
                    problems.append(f"{name}: {rel} sha256 differs from the manifest")
    return problems


def _fs_path(url: str, storage: StorageConfig | None) -> str:
    return filesystem(url, storage)[1]


def convert_legacy(url: str, storage: StorageConfig | None = None) -> DatasetManifest:
    """Convert a dataset of format version 1 in place: a Megatron `.idx` beside each token file, then the new
    manifest (the commit), then the old offsets files are removed. Token files are kept byte for byte (uint32
    ids, all below 2**31 as the vocabulary says, are the same bytes as int32)."""
    fs, root = filesystem(url, storage)
    raw = _manifest_bytes(url, storage)
    if _version_of(raw) != LEGACY_VERSION:
        raise DatasetError(url, f"{MANIFEST} is not of format_version=1", "only version-1 datasets are converted")
    old = json.loads(raw)
    dtype = {"uint16": "uint16", "uint32": "int32"}.get(old.get("dtype"))
    if dtype is None or old.get("vocab_size", 2**32) > _id_limit(dtype):
        raise DatasetError(
            url,
            f"dtype={old.get('dtype')} with vocab_size={old.get('vocab_size')} has no Megatron equivalent",
            "re-prepare the dataset from its sources",
            file=MANIFEST,
        )
    splits, stale = {}, []
    for name, split in old["splits"].items():
        shards = []
        for shard in split["shards"]:
            for rel in (shard["tokens"], shard["index"]):
                reason = _outside_reason(rel)
                if reason is not None:
                    raise DatasetError(url, f"{MANIFEST} names {rel!r}, which {reason}", "rebuild it", file=MANIFEST)
            offsets = np.frombuffer(fs.cat_file(join(root, shard["index"])), dtype="<i8")
            tokens_path = join(root, shard["tokens"])
            if offsets.size != shard["n_docs"] + 1 or int(offsets[-1]) != shard["n_tokens"]:
                problem = f"{shard['index']} disagrees with the manifest"
                raise DatasetError(url, problem, "rebuild it", file=shard["index"])
            if sha256_file(fs, tokens_path) != shard["tokens_sha256"]:
                raise DatasetError(url, f"{shard['tokens']} sha256 differs from the manifest", "re-copy or rebuild it",
                                   file=shard["tokens"])  # fmt: skip
            prefix = shard["tokens"].removesuffix(".bin")
            index = encode_index(dtype, np.diff(offsets), np.arange(offsets.size))
            fs.pipe_file(join(root, prefix + ".idx"), index)
            stale.append(join(root, shard["index"]))
            shards.append(
                ShardInfo(
                    prefix=prefix,
                    n_tokens=shard["n_tokens"],
                    n_docs=shard["n_docs"],
                    tokens_sha256=shard["tokens_sha256"],
                    index_sha256=hashlib.sha256(index).hexdigest(),
                    tokens_bytes=shard["n_tokens"] * np.dtype(dtype).itemsize,
                    index_bytes=len(index),
                )
            )
        splits[name] = split_info(shards)
    manifest = DatasetManifest(
        vocab_size=old["vocab_size"],
        dtype=dtype,
        eos_id=old.get("eos_id"),
        tokenizer=TokenizerInfo.model_validate(old["tokenizer"]),
        splits=splits,
        meta={**old.get("meta", {}), "converted_from_format_version": LEGACY_VERSION},
    )
    _check_manifest(url, manifest)
    write_manifest(url, manifest, fs, root)
    for path in stale:
        if path != join(root, MANIFEST) and not path.endswith(".bin"):
            fs.rm(path)
    return manifest


def default_cache_dir() -> Path:
    """Host-local folder of first-use verification markers: $TDEPLOY_CACHE_DIR, else the XDG cache."""
    if os.environ.get("TDEPLOY_CACHE_DIR"):
        return Path(os.environ["TDEPLOY_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tdeploy"


@dataclass(frozen=True)
class _File:
    """One dataset file as found on this host, after its size matched the manifest."""

    rel: str
    """As the manifest names it (relative to the dataset root, or an adopted source's URL)."""
    path: str
    fs: Any
    local: bool
    shard: ShardInfo
    tokens: bool
    identity: tuple[Any, ...]
    """What changes when the file is rewritten or replaced (size, times, inode; or size and ETag)."""

    @property
    def sha256(self) -> str:
        """The digest the manifest records."""
        return self.shard.tokens_sha256 if self.tokens else self.shard.index_sha256


_REMOTE_IDENTITY = ("ETag", "etag", "LastModified", "last_modified", "mtime", "generation", "md5Hash")


def _remote_identity(info: dict[str, Any] | None) -> tuple[Any, ...] | None:
    return None if info is None else (info["size"], *(str(info[k]) for k in _REMOTE_IDENTITY if k in info))


def _local_identity(url: str, rel: str, path: str, real_root: str) -> tuple[Any, ...] | None:
    """(size, times, inode), or None when the file is missing; refuse a file that resolves outside its root."""
    if not path.startswith(real_root.rstrip(os.sep) + os.sep):
        raise DatasetError(
            url,
            f"{rel} resolves to {path}, outside the dataset root {real_root} (a symbolic link?)",
            "copy the file into the dataset's folder instead of linking to it",
            file=rel,
        )
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev


class ShardLocator:
    """Finds a shard's files: under the dataset root, or (adopted sources) at the prefix's own URL."""

    def __init__(self, url: str, storage: StorageConfig | None) -> None:
        self.url, self.storage = url, storage
        self.fs, self.root = filesystem(url, storage)
        self.local = is_local(url)
        self.base = local_path(url) if self.local else self.root
        self._listing: dict[str, Any] | None = None

    def files(self, shard: ShardInfo) -> list[tuple[str, str, Any, bool, tuple[Any, ...] | None]]:
        """(name, path, filesystem, local, identity or None when missing) of the shard's .bin and .idx."""
        inside = _outside_reason(shard.prefix) is None
        if inside:
            fs, local = self.fs, self.local
            real_root = os.path.realpath(self.base) if local else self.base
        else:
            fs, _ = filesystem(shard.prefix, self.storage)
            local = is_local(shard.prefix)
            real_root = os.path.realpath(os.path.dirname(local_path(shard.prefix))) if local else ""
        found = []
        for rel in (shard.tokens, shard.index):
            if local:
                path = os.path.realpath(join(self.base, rel) if inside else local_path(rel))
                identity = _local_identity(self.url, rel, path, real_root)
            elif inside:
                if self._listing is None:  # one request for all sizes, not one per file
                    self._listing = self.fs.find(self.base, detail=True)
                path = join(self.base, rel)
                identity = _remote_identity(self._listing.get(path))
            else:
                path = _fs_path(rel, self.storage)
                try:
                    identity = _remote_identity(fs.info(path))
                except FileNotFoundError:
                    identity = None
            found.append((rel, path, fs, local, identity))
        return found


def _split_files(url: str, manifest: DatasetManifest, split: str, locator: ShardLocator) -> list[_File]:
    """The split's token and index files, each present, inside its root and of the size the manifest says."""
    files = []
    for shard in manifest.splits[split].shards:
        for (rel, path, fs, local, identity), tokens in zip(locator.files(shard), (True, False), strict=True):
            size = shard.tokens_bytes if tokens else shard.index_bytes
            if identity is None:
                raise DatasetError(url, f"{rel} is missing", "re-copy the dataset or rebuild it", file=rel)
            if identity[0] != size:
                cut = ", truncated" if identity[0] < size else ""
                raise DatasetError(
                    url,
                    f"{rel} has {identity[0]} bytes, the manifest says {size}{cut}",
                    "re-copy the dataset (a transfer cut short?) or rebuild it",
                    file=rel,
                )
            files.append(_File(rel, path, fs, local, shard, tokens, identity))
    return files


def index_problem(index_raw: bytes, shard: ShardInfo, dtype: str) -> str | None:
    """What is wrong with a shard's `.idx` against its `.bin` and the manifest's entry, or None."""
    try:
        index = parse_index(index_raw)
        check_bin_size(index, shard.tokens_bytes)
    except IndexFormatError as err:
        return err.problem
    if index.dtype != dtype:
        return f"holds {index.dtype} ids, the manifest says {dtype}"
    first, end = shard.docs if shard.docs is not None else (0, index.n_documents)
    if end > index.n_documents:
        return f"has {index.n_documents} documents, the manifest's range ends at document {end}"
    offsets = index.document_offsets()
    counted = (int(offsets[first]), end - first, int(offsets[end] - offsets[first]))
    if counted != (shard.first_token, shard.n_docs, shard.n_tokens):
        return (
            f"gives documents [{first}, {end}) {counted[1]} documents of {counted[2]} tokens from token {counted[0]}; "
            f"the manifest says {shard.n_docs} of {shard.n_tokens} from token {shard.first_token}"
        )
    return None


def _trust_cache(url: str, base: str, local: bool, cache_dir: str | Path | None) -> Path | None:
    """The marker folder, or None (verify every time) when it cannot be made or lies inside the dataset."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = folder / "verified"
    if local:
        root = os.path.realpath(base)
        if os.path.realpath(folder) == root or os.path.realpath(folder).startswith(root.rstrip(os.sep) + os.sep):
            log.warning("%s: the verification cache %s lies inside the dataset; verifying without it", url, folder)
            return None
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as err:
        log.warning("%s: cannot use the verification cache %s (%s); verifying without it", url, folder, err)
        return None
    return folder


@contextlib.contextmanager
def _marker(cache: Path | None, key: str) -> Iterator[Path | None]:
    """The marker path for `key`, held under an exclusive lock so one process per host does the work."""
    if cache is None:
        yield None
        return
    with open(cache / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield cache / f"{key}.json"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _scan(fs: Any, path: str, dtype: np.dtype | None) -> tuple[str, int]:
    """sha256 of the file and, for token files, its largest id (-1 when empty), in one streaming pass."""
    digest, top, rest = hashlib.sha256(), -1, b""
    with fs.open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
            if dtype is not None:
                chunk = rest + chunk
                whole = len(chunk) - len(chunk) % dtype.itemsize
                if whole:
                    top = max(top, int(np.frombuffer(chunk[:whole], dtype=dtype).max()))
                rest = chunk[whole:]
    return digest.hexdigest(), top


def _verify_first_use(url: str, manifest: DatasetManifest, files: list[_File], cache: Path | None) -> None:
    """sha256 and id range of every file and the index against its token file, unless this host's cache says
    this very file (and, for an index, this very range of it) passed already.

    Each local rank starts at a different file, so the ranks of a node share the pass.
    """
    dtype = np.dtype(manifest.dtype).newbyteorder("<")
    start = int(os.environ.get("LOCAL_RANK", "0") or 0) % max(1, len(files))
    host = socket.gethostname()
    for f in files[start:] + files[:start]:
        material = [host, f.path, f.sha256, f.identity]
        if not f.tokens:
            material.append([f.shard.docs, f.shard.first_token, f.shard.n_docs, f.shard.n_tokens, f.shard.tokens_bytes])
        key = hashlib.sha256(json.dumps(material, default=str).encode()).hexdigest()
        with _marker(cache, key) as marker:
            record = json.loads(marker.read_text()) if marker is not None and marker.exists() else None
            if record is None:
                if f.tokens:
                    digest, top = _scan(f.fs, f.path, dtype)
                else:
                    raw = f.fs.cat_file(f.path)
                    digest, top = hashlib.sha256(raw).hexdigest(), -1
                if digest != f.sha256:
                    raise DatasetError(
                        url,
                        f"{f.rel} has sha256 {digest}, the manifest says {f.sha256}",
                        "the file is corrupt or was replaced; re-copy the dataset or rebuild it",
                        file=f.rel,
                    )
                problem = None if f.tokens else index_problem(raw, f.shard, manifest.dtype)
                if problem is not None:
                    raise DatasetError(url, f"{f.rel} {problem}", "rebuild the dataset or re-adopt it", file=f.rel)
                record = {"file": f.rel, "sha256": digest, "max_id": top}
                if marker is not None:
                    tmp = marker.with_suffix(f".tmp-{os.getpid()}")
                    tmp.write_text(json.dumps(record))
                    os.replace(tmp, marker)
        if f.tokens and record["max_id"] >= manifest.vocab_size:
            raise DatasetError(
                url,
                f"{f.rel} holds token id {record['max_id']}, outside the vocabulary [0, {manifest.vocab_size})",
                "the ids do not come from the tokenizer the manifest names; rebuild the dataset",
                file=f.rel,
            )


class _Shard:
    """Random access to one shard's tokens: a memmap locally, ranged reads remotely."""

    def __init__(self, f: _File, dtype: str) -> None:
        self.fs, self.path, self.first = f.fs, f.path, f.shard.first_token
        self.dtype = np.dtype(dtype).newbyteorder("<")
        n = f.shard.n_tokens
        # a plain ndarray over the mapping: slicing a np.memmap costs microseconds a sample (its subclass hooks)
        self.memmap = (
            np.asarray(
                np.memmap(f.path, dtype=self.dtype, mode="r", offset=self.first * self.dtype.itemsize, shape=(n,))
            )
            if f.local and n
            else None
        )

    def read(self, start: int, count: int) -> np.ndarray:
        if self.memmap is not None:
            return self.memmap[start : start + count]
        item, begin = self.dtype.itemsize, self.first + start
        raw = self.fs.cat_file(self.path, start=begin * item, end=(begin + count) * item)
        return np.frombuffer(raw, dtype=self.dtype)


class TokenDataset:
    """Fixed-length samples (L + 1 tokens) of one split, addressable by global sample index.

    Opening checks the split's files before anything is read: present, inside the dataset root (or a trusted
    source) and of the manifest's size (always); sha256, the index against its token file and token ids below
    the vocabulary (on first use on this host, remembered in `cache_dir`, default `default_cache_dir()`).
    `vocab_size` is the model's: a dataset with a larger vocabulary is refused. Every problem is a DatasetError
    naming the file. `source_samples` counts the samples of each source of a blend, in index order.
    """

    def __init__(
        self,
        url: str,
        split: str,
        seq_len: int,
        storage: StorageConfig | None = None,
        *,
        vocab_size: int | None = None,
        cache_dir: str | Path | None = None,
        trusted: Sequence[str] = (),
    ) -> None:
        self.url, self.split, self.seq_len = url, split, seq_len
        self.manifest = read_manifest(url, storage, trusted)
        if split not in self.manifest.splits:
            raise DatasetError(url, f"no split {split!r}", f"available: {sorted(self.manifest.splits)}")
        if vocab_size is not None and self.manifest.vocab_size > vocab_size:
            raise DatasetError(
                url,
                f"dataset vocab_size={self.manifest.vocab_size} exceeds model.vocab_size={vocab_size}",
                f"set model.vocab_size >= {self.manifest.vocab_size} or use a dataset of this vocabulary",
            )
        locator = ShardLocator(url, storage)
        files = _split_files(url, self.manifest, split, locator)
        _verify_first_use(url, self.manifest, files, _trust_cache(url, locator.base, locator.local, cache_dir))
        shards = self.manifest.splits[split].shards
        if [s.source for s in shards] != sorted(s.source for s in shards):
            raise DatasetError(url, f"split {split!r}: shards not grouped by source", "rebuild the dataset", MANIFEST)
        counts = [max(0, (info.n_tokens - 1) // seq_len) for info in shards]
        self._shards = [_Shard(f, self.manifest.dtype) for f in files if f.tokens]
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._starts = self._first.tolist()
        self.source_samples = [0] * self.manifest.n_sources
        for info, count in zip(shards, counts, strict=True):
            self.source_samples[info.source] += count
        if len(self) == 0:
            raise DatasetError(
                url,
                f"split {split!r} has no sample of seq_len={seq_len} tokens",
                "use a smaller model.seq_len or a larger corpus",
            )

    def __len__(self) -> int:
        return int(self._first[-1])

    def sample(self, index: int) -> np.ndarray:
        """Tokens of sample `index` (length seq_len + 1)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range [0, {len(self)})")
        shard = bisect.bisect_right(self._starts, index) - 1
        local = index - self._starts[shard]
        return self._shards[shard].read(local * self.seq_len, self.seq_len + 1)

    def batch(self, indices: list[int] | np.ndarray) -> torch.Tensor:
        """A (len(indices), seq_len + 1) int64 tensor."""
        return torch.from_numpy(np.stack([self.sample(int(i)) for i in indices]).astype(np.int64))
