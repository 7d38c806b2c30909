"""The dataset step of the foundation: find the tokenized dataset, or bootstrap a byte-level one.

Until the data-preparation step (cleaning, BPE, validation) exists, the
embedded default builds a small byte-level dataset from the standard
library's docstrings on the same writer that the real pipeline will use.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import Field

from tasks.corpus import split_of, stdlib_documents
from training.config import DataConfig, StrictModel
from training.dataset import DatasetError, DatasetManifest, DatasetWriter, TokenizerInfo, read_manifest
from training.storage import StorageConfig, filesystem, join

log = logging.getLogger(__name__)

BYTE_EOS = 256
BYTE_VOCAB = 257


class BootstrapConfig(StrictModel):
    """Build a byte-level dataset when none exists at data.dataset_url (local default)."""

    corpus: Literal["stdlib-docstrings"] = Field(
        default="stdlib-docstrings", description="Built-in corpus: the standard library's documentation and docstrings."
    )
    max_bytes: int = Field(default=1_000_000, ge=1_000, description="Corpus size cap in UTF-8 bytes.")
    min_doc_chars: int = Field(default=32, ge=1, description="Shorter docstrings are dropped.")
    val_fraction: float = Field(default=0.05, gt=0, lt=1, description="Share of documents held out (by hash).")
    shard_tokens: int = Field(default=1 << 20, ge=1024, description="Tokens per shard file.")


class DataSpec(DataConfig):
    """Where the tokenized dataset lives, and whether to bootstrap one."""

    bootstrap: BootstrapConfig | None = Field(
        default=None, description="Build a byte-level dataset from a built-in corpus if none exists; None = off."
    )

    def training(self) -> DataConfig:
        """The training payload's part of this section."""
        return DataConfig(**self.model_dump(include=set(DataConfig.model_fields)))


def build_byte_dataset(url: str, cfg: BootstrapConfig, storage: StorageConfig) -> DatasetManifest:
    """Byte-level tokens (id = byte, EOS = 256) of the built-in corpus, split by document hash."""
    meta = {"source": cfg.corpus, "max_bytes": cfg.max_bytes, "val_fraction": cfg.val_fraction}
    with DatasetWriter(
        url, BYTE_VOCAB, TokenizerInfo(kind="bytes"), BYTE_EOS, cfg.shard_tokens, storage, meta=meta
    ) as writer:
        for doc in stdlib_documents(cfg.max_bytes, cfg.min_doc_chars):
            writer.add_document(split_of(doc, cfg.val_fraction), list(doc.encode("utf-8")))
    manifest = read_manifest(url, storage)
    for split in ("train", "val"):
        if split not in manifest.splits:
            raise DatasetError(url, f"the corpus produced no {split!r} documents", "raise bootstrap.max_bytes")
    return manifest


def ensure_dataset(data: DataSpec, storage: StorageConfig) -> DatasetManifest:
    """The dataset's manifest, bootstrapping the dataset first when the spec allows it."""
    fs, root = filesystem(data.dataset_url, storage)
    if fs.exists(join(root, "manifest.json")):
        return read_manifest(data.dataset_url, storage)
    if data.bootstrap is None:
        raise DatasetError(
            data.dataset_url,
            "no finished dataset (manifest.json) there",
            "run the data preparation step first, or set data.bootstrap to build a byte-level one",
        )
    log.info("building a byte-level %s dataset at %s", data.bootstrap.corpus, data.dataset_url)
    return build_byte_dataset(data.dataset_url, data.bootstrap, storage)
