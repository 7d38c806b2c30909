"""The tokenized dataset format, both sides: `DatasetWriter` and `TokenDataset`.

Layout under a local folder or an object-store prefix::

    <dataset>/manifest.json             written last: a dataset without it is unfinished
    <dataset>/<split>/tokens-00000.bin  token ids, little-endian uint16 or uint32, documents
                                        concatenated with an EOS token after each one
    <dataset>/<split>/docs-00000.idx    int64 offsets of document starts, plus the shard length

`manifest.json` (`DatasetManifest`) records the format version, vocabulary size,
token dtype, EOS id, tokenizer identity, and per split and shard the token and
document counts and the sha256 of every file.

Samples are derived for a sequence length L: shard i holds
`(n_tokens_i - 1) // L` samples, sample j being tokens `[j*L, j*L + L + 1)`
(inputs are the first L, targets the last L). Samples never cross shards. The
global sample index runs over the shards in manifest order. Local shards are
memory-mapped; remote ones are read with ranged requests.

A dataset is untrusted input. `read_manifest` refuses any file name that is not
a plain relative path under the dataset root. `TokenDataset` checks every
file's size against the manifest each time it opens a split, and on the first
use of a split on a host also checks each file's sha256 and the largest token
id; a marker per verified file in a host-local cache (`default_cache_dir()`,
never inside the dataset) spares later runs that pass while the file's
identity (size, mtime, inode or ETag) is unchanged.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.config import first_problem
from training.storage import (
    StorageConfig,
    filesystem,
    is_local,
    join,
    local_path,
    sha256_file,
    write_bytes_atomic,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


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

    kind: Literal["bytes", "bpe"] = Field(description="bytes: id = byte value; bpe: a tokenizer.json.")
    sha256: str | None = Field(default=None, description="sha256 of tokenizer.json (bpe).")
    path: str | None = Field(default=None, description="Where tokenizer.json is stored, relative to the dataset.")


class ShardInfo(BaseModel):
    """One token file and its document index."""

    model_config = ConfigDict(extra="forbid")

    tokens: str = Field(description="Token file, relative to the dataset root.")
    index: str = Field(description="Document offsets file, relative to the dataset root.")
    n_tokens: int = Field(ge=0)
    n_docs: int = Field(ge=0)
    tokens_sha256: str
    index_sha256: str


class SplitInfo(BaseModel):
    """Totals and shards of one split."""

    model_config = ConfigDict(extra="forbid")

    n_tokens: int = Field(ge=0)
    n_docs: int = Field(ge=0)
    shards: list[ShardInfo]


class DatasetManifest(BaseModel):
    """The manifest: the dataset's table of contents and its commit marker."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    vocab_size: int = Field(ge=2)
    dtype: Literal["uint16", "uint32"]
    eos_id: int | None
    tokenizer: TokenizerInfo
    splits: dict[str, SplitInfo]
    meta: dict[str, Any] = Field(default_factory=dict, description="Producer's notes (source, settings).")


def token_dtype(vocab_size: int) -> Literal["uint16", "uint32"]:
    """Smallest supported dtype that holds every id below vocab_size."""
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise ValueError(f"vocab_size={vocab_size} does not fit uint32 token ids; use a vocabulary <= 2**32")


class DatasetWriter:
    """Streams documents into shards; `close()` writes the manifest, which commits the dataset.

    Use as a context manager: on an exception the manifest is not written, so the
    partial output is never taken for a finished dataset.
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
        dtype: Literal["uint16", "uint32"] | None = None,
    ) -> None:
        self.url, self.vocab_size, self.eos_id = url, vocab_size, eos_id
        self.dtype = dtype or token_dtype(vocab_size)
        if vocab_size > np.iinfo(self.dtype).max + 1:
            raise ValueError(f"vocab_size={vocab_size} does not fit {self.dtype} token ids; use uint32")
        self.tokenizer, self.shard_tokens, self.meta = tokenizer, shard_tokens, meta or {}
        self.fs, self.root = filesystem(url, storage)
        manifest = join(self.root, MANIFEST)
        if self.fs.exists(manifest):
            if not overwrite:
                raise DatasetError(url, "a finished dataset is already there", "choose another URL or overwrite=True")
            self.fs.rm(manifest)  # uncommit first: from now on the old dataset reads as unfinished
        self._open: dict[str, tuple[list[np.ndarray], list[int], int]] = {}
        self._done: dict[str, list[ShardInfo]] = {}

    def add_document(self, split: str, tokens: np.ndarray | list[int]) -> None:
        """Append one document (EOS is added when the tokenizer has one)."""
        self.add_documents(split, [np.asarray(tokens, dtype=np.int64)])

    def add_documents(self, split: str, docs: list[np.ndarray]) -> None:
        """Append documents in order; a shard closes at the first document end that reaches shard_tokens."""
        if not docs:
            return
        ids = np.concatenate([np.asarray(doc).ravel() for doc in docs])
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids.max() if ids.max() >= self.vocab_size else ids.min())
            raise ValueError(f"token id {bad} outside the vocabulary [0, {self.vocab_size})")
        eos = [np.array([self.eos_id], dtype=self.dtype)] if self.eos_id is not None else []
        flat = np.concatenate([piece for doc in docs for piece in (np.asarray(doc).astype(self.dtype), *eos)])
        ends = np.cumsum([np.asarray(doc).size + len(eos) for doc in docs])
        begin = 0
        while begin < len(docs):
            chunks, starts, length = self._open.get(split, ([], [], 0))
            offset = int(ends[begin - 1]) if begin else 0
            cut = begin + int(np.searchsorted(ends[begin:] - offset, self.shard_tokens - length, side="left"))
            last = min(cut, len(docs) - 1)
            chunks.append(flat[offset : int(ends[last])])
            starts.extend((length + np.concatenate(([offset], ends[begin:last])) - offset).tolist())
            self._open[split] = (chunks, starts, length + int(ends[last]) - offset)
            if cut < len(docs):
                self._flush(split)
            begin = last + 1

    def _flush(self, split: str) -> None:
        chunks, starts, length = self._open.pop(split, ([], [], 0))
        if not chunks:
            return
        shards = self._done.setdefault(split, [])
        number = len(shards)
        tokens_rel, index_rel = f"{split}/tokens-{number:05d}.bin", f"{split}/docs-{number:05d}.idx"
        tokens = np.concatenate(chunks).astype(np.dtype(self.dtype).newbyteorder("<"), copy=False).tobytes()
        index = np.asarray(starts + [length], dtype="<i8").tobytes()
        self.fs.makedirs(join(self.root, split), exist_ok=True)
        self.fs.pipe_file(join(self.root, tokens_rel), tokens)
        self.fs.pipe_file(join(self.root, index_rel), index)
        shards.append(
            ShardInfo(
                tokens=tokens_rel,
                index=index_rel,
                n_tokens=length,
                n_docs=len(starts),
                tokens_sha256=hashlib.sha256(tokens).hexdigest(),
                index_sha256=hashlib.sha256(index).hexdigest(),
            )
        )

    def close(self) -> DatasetManifest:
        """Flush the last shards and commit the manifest."""
        for split in list(self._open):
            self._flush(split)
        if not self._done:
            raise DatasetError(self.url, "no documents were written", "check the sources and the cleaning settings")
        splits = {
            name: SplitInfo(
                n_tokens=sum(s.n_tokens for s in shards), n_docs=sum(s.n_docs for s in shards), shards=shards
            )
            for name, shards in sorted(self._done.items())
        }
        manifest = DatasetManifest(
            vocab_size=self.vocab_size,
            dtype=self.dtype,
            eos_id=self.eos_id,
            tokenizer=self.tokenizer,
            splits=splits,
            meta=self.meta,
        )
        write_bytes_atomic(self.fs, join(self.root, MANIFEST), manifest.model_dump_json(indent=2).encode())
        return manifest

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()


def read_manifest(url: str, storage: StorageConfig | None = None) -> DatasetManifest:
    """The manifest of a finished dataset, or a DatasetError that says what is wrong."""
    fs, root = filesystem(url, storage)
    path = join(root, MANIFEST)
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError as err:
        state = "is unfinished (no manifest.json)" if fs.exists(root) else "does not exist"
        raise DatasetError(
            url, f"the dataset {state}", "build it first (tdeploy prepare-data / tdeploy train)"
        ) from err
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
    _check_manifest(url, manifest)
    return manifest


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


def _check_manifest(url: str, manifest: DatasetManifest) -> None:
    """Refuse file names that leave the dataset root and values no writer produces."""
    fields = [("tokenizer.path", manifest.tokenizer.path)] if manifest.tokenizer.path is not None else []
    for name, split in manifest.splits.items():
        for number, shard in enumerate(split.shards):
            where = f"splits.{name}.shards[{number}]"
            fields += [(f"{where}.tokens", shard.tokens), (f"{where}.index", shard.index)]
    for field, rel in fields:
        reason = _outside_reason(rel)
        if reason is not None:
            raise DatasetError(
                url,
                f"{MANIFEST} {field}={rel!r} {reason}",
                "a manifest may only name files inside its dataset's folder; rebuild the dataset or fix the manifest",
                file=MANIFEST,
            )
    if manifest.vocab_size > np.iinfo(manifest.dtype).max + 1:
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


def verify_dataset(url: str, storage: StorageConfig | None = None) -> list[str]:
    """Check every file's size and sha256 against the manifest; returns the problems found."""
    manifest = read_manifest(url, storage)
    fs, root = filesystem(url, storage)
    problems = []
    itemsize = np.dtype(manifest.dtype).itemsize
    for name, split in manifest.splits.items():
        for shard in split.shards:
            for rel, digest, size in (
                (shard.tokens, shard.tokens_sha256, shard.n_tokens * itemsize),
                (shard.index, shard.index_sha256, (shard.n_docs + 1) * 8),
            ):
                path = join(root, rel)
                if not fs.exists(path):
                    problems.append(f"{name}: {rel} is missing")
                elif fs.size(path) != size:
                    problems.append(f"{name}: {rel} has {fs.size(path)} bytes, manifest says {size}")
                elif sha256_file(fs, path) != digest:
                    problems.append(f"{name}: {rel} sha256 differs from the manifest")
    return problems


def default_cache_dir() -> Path:
    """Host-local folder of first-use verification markers: $TDEPLOY_CACHE_DIR, else the XDG cache."""
    if os.environ.get("TDEPLOY_CACHE_DIR"):
        return Path(os.environ["TDEPLOY_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tdeploy"


@dataclass(frozen=True)
class _File:
    """One dataset file as found on this host, after its size matched the manifest."""

    rel: str
    path: str
    sha256: str
    tokens: bool
    identity: tuple[Any, ...]
    """What changes when the file is rewritten or replaced (size, times, inode; or size and ETag)."""


_REMOTE_IDENTITY = ("ETag", "etag", "LastModified", "last_modified", "mtime", "generation", "md5Hash")


def _identity(url: str, rel: str, path: str, real_root: str, listing: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """(size, ...what changes when the file is rewritten), or None when it is missing; locally, refuse links out."""
    if listing is not None:
        info = listing.get(path)
        return None if info is None else (info["size"], *(str(info[k]) for k in _REMOTE_IDENTITY if k in info))
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


def _split_files(url: str, manifest: DatasetManifest, split: str, fs: Any, base: str, local: bool) -> list[_File]:
    """The split's token and index files, each present, inside the root and of the size the manifest says."""
    item = np.dtype(manifest.dtype).itemsize
    real_root = os.path.realpath(base) if local else base
    listing = None if local else fs.find(base, detail=True)  # one request for all sizes, not one per file
    files = []
    for shard in manifest.splits[split].shards:
        for rel, digest, tokens, size, what in (
            (shard.tokens, shard.tokens_sha256, True, shard.n_tokens * item, f"{shard.n_tokens} x {manifest.dtype}"),
            (shard.index, shard.index_sha256, False, (shard.n_docs + 1) * 8, f"{shard.n_docs + 1} x int64"),
        ):
            path = os.path.realpath(join(base, rel)) if local else join(base, rel)
            identity = _identity(url, rel, path, real_root, listing)
            if identity is None:
                raise DatasetError(url, f"{rel} is missing", "re-copy the dataset or rebuild it", file=rel)
            if identity[0] != size:
                cut = ", truncated" if identity[0] < size else ""
                raise DatasetError(
                    url,
                    f"{rel} has {identity[0]} bytes, the manifest says {size} ({what}){cut}",
                    "re-copy the dataset (a transfer cut short?) or rebuild it",
                    file=rel,
                )
            files.append(_File(rel, path, digest, tokens, identity))
    return files


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


def _verify_first_use(url: str, manifest: DatasetManifest, files: list[_File], fs: Any, cache: Path | None) -> None:
    """sha256 and id range of every file, unless this host's cache says this very file passed already.

    Each local rank starts at a different file, so the ranks of a node share the pass.
    """
    dtype = np.dtype(manifest.dtype).newbyteorder("<")
    start = int(os.environ.get("LOCAL_RANK", "0") or 0) % max(1, len(files))
    host = socket.gethostname()
    for f in files[start:] + files[:start]:
        key = hashlib.sha256(json.dumps([host, f.path, f.sha256, f.identity], default=str).encode()).hexdigest()
        with _marker(cache, key) as marker:
            record = json.loads(marker.read_text()) if marker is not None and marker.exists() else None
            if record is None:
                digest, top = _scan(fs, f.path, dtype if f.tokens else None)
                if digest != f.sha256:
                    raise DatasetError(
                        url,
                        f"{f.rel} has sha256 {digest}, the manifest says {f.sha256}",
                        "the file is corrupt or was replaced; re-copy the dataset or rebuild it",
                        file=f.rel,
                    )
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
    """Random access to one token file: a memmap locally, ranged reads remotely."""

    def __init__(self, fs: Any, path: str, dtype: str, n_tokens: int, local: bool) -> None:
        self.fs, self.path, self.n_tokens = fs, path, n_tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.memmap = np.memmap(path, dtype=self.dtype, mode="r", shape=(n_tokens,)) if local and n_tokens else None

    def read(self, start: int, count: int) -> np.ndarray:
        if self.memmap is not None:
            return np.asarray(self.memmap[start : start + count])
        item = self.dtype.itemsize
        raw = self.fs.cat_file(self.path, start=start * item, end=(start + count) * item)
        return np.frombuffer(raw, dtype=self.dtype)


class TokenDataset:
    """Fixed-length samples (L + 1 tokens) of one split, addressable by global sample index.

    Opening checks the split's files before anything is read: present, inside the dataset root and of
    the manifest's size (always); sha256 and token ids below the vocabulary (on first use on this host,
    remembered in `cache_dir`, default `default_cache_dir()`). `vocab_size` is the model's: a dataset
    with a larger vocabulary is refused. Every problem is a DatasetError naming the file.
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
    ) -> None:
        self.url, self.split, self.seq_len = url, split, seq_len
        self.manifest = read_manifest(url, storage)
        if split not in self.manifest.splits:
            raise DatasetError(url, f"no split {split!r}", f"available: {sorted(self.manifest.splits)}")
        if vocab_size is not None and self.manifest.vocab_size > vocab_size:
            raise DatasetError(
                url,
                f"dataset vocab_size={self.manifest.vocab_size} exceeds model.vocab_size={vocab_size}",
                f"set model.vocab_size >= {self.manifest.vocab_size} or use a dataset of this vocabulary",
            )
        fs, root = filesystem(url, storage)
        local = is_local(url)
        base = local_path(url) if local else root
        files = _split_files(url, self.manifest, split, fs, base, local)
        _verify_first_use(url, self.manifest, files, fs, _trust_cache(url, base, local, cache_dir))
        self._shards, counts = [], []
        token_files = [f for f in files if f.tokens]
        for info, file in zip(self.manifest.splits[split].shards, token_files, strict=True):
            self._shards.append(_Shard(fs, file.path, self.manifest.dtype, info.n_tokens, local))
            counts.append(max(0, (info.n_tokens - 1) // seq_len))
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
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
        shard = int(np.searchsorted(self._first, index, side="right")) - 1
        local = index - int(self._first[shard])
        return self._shards[shard].read(local * self.seq_len, self.seq_len + 1)

    def batch(self, indices: list[int] | np.ndarray) -> torch.Tensor:
        """A (len(indices), seq_len + 1) int64 tensor."""
        return torch.from_numpy(np.stack([self.sample(int(i)) for i in indices]).astype(np.int64))
