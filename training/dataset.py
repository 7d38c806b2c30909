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
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

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


class DatasetError(Exception):
    """The dataset is missing, unfinished, inconsistent or incompatible with the run."""

    def __init__(self, url: str, problem: str, fix: str) -> None:
        super().__init__(f"{url}: {problem}; {fix}")
        self.url, self.problem, self.fix = url, problem, fix


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
    manifest = DatasetManifest.model_validate_json(raw)
    if manifest.format_version != FORMAT_VERSION:
        raise DatasetError(
            url, f"format_version={manifest.format_version}", f"this payload reads version {FORMAT_VERSION}; rebuild it"
        )
    return manifest


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


class _Shard:
    """Random access to one token file: a memmap locally, ranged reads remotely."""

    def __init__(self, fs: Any, path: str, dtype: str, n_tokens: int, local: bool) -> None:
        self.fs, self.path, self.n_tokens = fs, path, n_tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.memmap = np.memmap(path, dtype=self.dtype, mode="r", shape=(n_tokens,)) if local else None

    def read(self, start: int, count: int) -> np.ndarray:
        if self.memmap is not None:
            return np.asarray(self.memmap[start : start + count])
        item = self.dtype.itemsize
        raw = self.fs.cat_file(self.path, start=start * item, end=(start + count) * item)
        return np.frombuffer(raw, dtype=self.dtype)


class TokenDataset:
    """Fixed-length samples (L + 1 tokens) of one split, addressable by global sample index."""

    def __init__(self, url: str, split: str, seq_len: int, storage: StorageConfig | None = None) -> None:
        self.url, self.split, self.seq_len = url, split, seq_len
        self.manifest = read_manifest(url, storage)
        if split not in self.manifest.splits:
            raise DatasetError(url, f"no split {split!r}", f"available: {sorted(self.manifest.splits)}")
        fs, root = filesystem(url, storage)
        local = is_local(url)
        self._shards, counts = [], []
        for info in self.manifest.splits[split].shards:
            path = join(local_path(url) if local else root, info.tokens)
            self._shards.append(_Shard(fs, path, self.manifest.dtype, info.n_tokens, local))
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
