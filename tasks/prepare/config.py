"""The `data` section of the spec: an existing dataset, or how to prepare one."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from training.config import DataConfig, Problem, StrictModel, raise_problems
from training.storage import StorageUrl
from validation.data import DataExpectations

BUILTIN_CORPORA = ("python-docs",)
MAX_DOC_CHARS = 100_000_000


class SourceConfig(StrictModel):
    """Raw text files: one fsspec URL or glob."""

    url: StorageUrl = Field(description="Local path, fsspec URL or glob (s3://bucket/raw/*.jsonl.gz).")
    format: Literal["auto", "txt", "jsonl", "parquet"] = Field(
        default="auto", description="auto: from the extension (.txt, .jsonl/.json, .parquet; before .gz/.bz2/.xz/.zst)."
    )
    text_field: str = Field(default="text", min_length=1, description="jsonl/parquet: the field holding the text.")
    txt_documents: Literal["file", "blank_line"] = Field(
        default="file", description="txt: one document per file, or per blank-line-separated block."
    )

    @model_validator(mode="before")
    @classmethod
    def _plain_url(cls, data: Any) -> Any:
        """A plain string is the source's URL (`sources: [data/*.txt]`); other non-mappings show the form."""
        if isinstance(data, str):
            return {"url": data}
        if not isinstance(data, (dict, SourceConfig)):
            raise ValueError(
                f"a source is a URL string or a mapping, not {type(data).__name__}; write "
                "`- data/*.txt` or `- {url: data/*.jsonl, format: jsonl, text_field: text}`"
            )
        return data


class CleaningConfig(StrictModel):
    """Rules applied to every document, each one's removals counted."""

    unicode_normalization: Literal["NFC", "NFKC"] | None = Field(default="NFC", description="None = off.")
    min_chars: int = Field(
        default=32, ge=1, le=MAX_DOC_CHARS, description="Shorter documents (after trimming) are dropped."
    )
    max_chars: int = Field(
        default=1_000_000,
        ge=1,
        le=MAX_DOC_CHARS,
        description=(
            "Longer documents (characters, after trimming) are dropped as too_long; a raw record (txt file or "
            "block, JSON line) too large to hold that many is skipped without being read into memory."
        ),
    )
    dedup: bool = Field(default=True, description="Drop exact duplicates (sha256 of the cleaned text).")
    invalid_utf8: Literal["drop", "replace"] = Field(
        default="drop", description="Documents with invalid UTF-8: dropped, or kept with U+FFFD replacements."
    )

    @model_validator(mode="after")
    def _bounds_in_order(self) -> CleaningConfig:
        if self.min_chars > self.max_chars:
            raise_problems(
                "CleaningConfig",
                [(("min_chars",), self.min_chars, f"must be <= max_chars={self.max_chars}; nothing would be kept")],
            )
        return self


class TokenizerConfig(StrictModel):
    """Which tokenizer turns text into ids."""

    kind: Literal["bpe", "bytes"] = Field(
        default="bpe", description="bpe: byte-level BPE (HF tokenizers); bytes: id = byte value, EOS = 256."
    )
    path: StorageUrl | None = Field(
        default=None, description="bpe: URL of an existing tokenizer.json; None = train one on the training split."
    )
    vocab_size: int = Field(default=4096, ge=260, le=2**32, description="bpe training: target vocabulary size.")
    min_frequency: int = Field(
        default=2, ge=1, le=10**9, description="bpe training: minimum pair frequency of a merge."
    )
    eos_token: str = Field(default="<|endoftext|>", min_length=1, description="bpe: the end-of-document token.")


class PrepareConfig(StrictModel):
    """Clean, split, tokenize, shard and validate a corpus into the dataset format."""

    output_url: StorageUrl = Field(
        description="Folder or prefix for prepared datasets; each goes under <output_url>/<key>/."
    )
    sources: list[SourceConfig] = Field(default_factory=list, description="Raw text sources.")
    builtin_corpus: Literal["python-docs"] | None = Field(
        default=None, description="python-docs: the standard library's documentation and docstrings (offline)."
    )
    builtin_max_bytes: int = Field(
        default=1_000_000, ge=1_000, le=10**9, description="Size cap of the built-in corpus."
    )
    cleaning: CleaningConfig = Field(default_factory=CleaningConfig)
    val_fraction: float = Field(
        default=0.05, gt=0, lt=1, allow_inf_nan=False, description="Share of documents held out (by hash)."
    )
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    token_dtype: Literal["uint16", "uint32"] | None = Field(
        default=None, description="Token id dtype on disk; None = the smallest that holds the vocabulary."
    )
    shard_tokens: int = Field(
        default=1 << 24, ge=1024, le=1 << 32, description="Tokens per shard file (documents are whole)."
    )
    workers: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description=(
            "Threads that encode at once, each running the tokenizer single-threaded on whole batches while the "
            "step reads and writes on its own thread (tasks/prepare/encoding.py); None = the CPU cores this "
            "process may use."
        ),
    )
    batch_documents: int = Field(default=512, ge=1, le=1_000_000, description="Documents per encode batch.")
    expectations: DataExpectations = Field(default_factory=DataExpectations)

    @model_validator(mode="after")
    def _consistent(self) -> PrepareConfig:
        problems: list[Problem] = []
        if not self.sources and self.builtin_corpus is None:
            problems.append(
                (("sources",), [], f"give at least one source, or set builtin_corpus to one of {BUILTIN_CORPORA}")
            )
        if self.token_dtype == "uint16" and (self.vocab_size or 0) > 2**16:
            problems.append(
                (
                    ("token_dtype",),
                    self.token_dtype,
                    f"uint16 holds ids below 65536 but tokenizer.vocab_size={self.vocab_size}; use uint32 or null",
                )
            )
        raise_problems("PrepareConfig", problems)
        return self

    @property
    def vocab_size(self) -> int | None:
        """Vocabulary size the prepared dataset will have; None while it depends on a tokenizer file."""
        if self.tokenizer.kind == "bytes":
            return 257
        return None if self.tokenizer.path else self.tokenizer.vocab_size


class DataSpec(StrictModel):
    """Train on an existing dataset (`dataset_url`), or prepare one (`prepare`)."""

    dataset_url: StorageUrl | None = Field(
        default=None, description="An already prepared dataset (format: training/dataset.py)."
    )
    tokenizer_sha256: str | None = Field(
        default=None, description="With dataset_url: the tokenizer the dataset must have been made with; None = any."
    )
    prepare: PrepareConfig | None = Field(
        default=None, description="How to prepare the dataset; None = use dataset_url."
    )
    train_split: str = Field(
        default="train",
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="Split used for training (a name: letters, digits, _ -).",
    )
    val_split: str = Field(
        default="val", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Held-out split used for evaluation (a name)."
    )
    drop_last: bool = Field(
        default=True, description="Leave each epoch's last partial global batch out (false: pad it; DataConfig)."
    )

    @model_validator(mode="after")
    def _one_way(self) -> DataSpec:
        problems: list[Problem] = []
        if (self.dataset_url is None) == (self.prepare is None):
            problems.append(
                (("dataset_url",), self.dataset_url, "set exactly one of data.dataset_url and data.prepare")
            )
        raise_problems("DataSpec", problems)
        return self

    def training(self, dataset_url: str, tokenizer_sha256: str | None) -> DataConfig:
        """The training payload's data section for a concrete dataset."""
        return DataConfig(
            dataset_url=dataset_url,
            tokenizer_sha256=tokenizer_sha256,
            train_split=self.train_split,
            val_split=self.val_split,
            drop_last=self.drop_last,
        )
