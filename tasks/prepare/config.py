"""The `data` section of the spec: an existing dataset, or how to prepare one."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, GetJsonSchemaHandler, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from training.config import DataConfig, Problem, StrictModel, raise_problems
from training.storage import StorageUrl
from validation.data import DataExpectations
from validation.image_data import ImageExpectations

BUILTIN_CORPORA = ("python-docs",)
MAX_DOC_CHARS = 100_000_000


def _url_or(schema: JsonSchemaValue) -> JsonSchemaValue:
    """A model's JSON Schema that also takes a plain URL string in its place."""
    return {"anyOf": [{"type": "string", "description": "The URL alone."}, schema]}


class SourceConfig(StrictModel):
    """Raw text: files (one fsspec URL or glob) or a Hugging Face dataset on disk."""

    url: StorageUrl = Field(description="Local path, fsspec URL or glob (s3://bucket/raw/*.jsonl.gz).")
    format: Literal["auto", "txt", "jsonl", "parquet", "hf"] = Field(
        default="auto",
        description=(
            "auto: from the extension (.txt, .jsonl/.json, .parquet, before .gz/.bz2/.xz/.zst; .arrow is hf), and hf "
            "for a folder holding dataset_info.json/state.json or dataset_dict.json. hf: a Hugging Face dataset on "
            "this machine, a folder datasets' save_to_disk wrote (Dataset or DatasetDict) or its .arrow files; "
            "every split's rows are read (the step holds out its own validation split by hash)."
        ),
    )
    text_field: str = Field(
        default="text", min_length=1, description="jsonl/parquet/hf: the field (column) holding the text."
    )
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

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """The editors' schema says what _plain_url takes: the mapping, or its URL alone."""
        return _url_or(handler(core_schema))


NEAR_DUP_MAX_NUM_PERM = 1024
NEAR_DUP_LSH_WEIGHTS = (0.1, 0.9)
"""(false positive, false negative) weights of datasketch's LSH tuning: each candidate is confirmed by its
estimated similarity, so a false positive costs one comparison while a false negative keeps a near-duplicate."""


class NearDupConfig(StrictModel):
    """Near-duplicate removal: MinHash LSH (datasketch) over each document's word shingles."""

    threshold: float = Field(
        default=0.8,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description=(
            "Jaccard similarity of two documents' shingle sets, as MinHash estimates it, at or above which the "
            "later document is dropped as near_duplicate (the first one read is kept). Lower values make more "
            "candidates to compare (slower); values near 1 need a larger num_perm."
        ),
    )
    shingle_words: int = Field(
        default=5,
        ge=1,
        le=64,
        description=(
            "Words per shingle: a shingle is a run of this many consecutive words (words are separated by "
            "whitespace, case kept), a document is the set of its shingles; one with fewer words is one shingle."
        ),
    )
    num_perm: int = Field(
        default=128,
        ge=16,
        le=NEAR_DUP_MAX_NUM_PERM,
        description=(
            "MinHash permutations per document: the similarity estimate's error falls as 1/sqrt(num_perm); time "
            "and the index's memory (about 5 KB per kept document at 128) grow with it."
        ),
    )

    @model_validator(mode="after")
    def _lsh_can_be_tuned(self) -> NearDupConfig:
        if not _lsh_tunable(self.threshold, self.num_perm):
            larger = [2**k for k in range(5, NEAR_DUP_MAX_NUM_PERM.bit_length()) if 2**k > self.num_perm]
            enough = next((n for n in larger if _lsh_tunable(self.threshold, n)), None)
            fix = f"set num_perm to {enough} or lower the threshold" if enough else "lower the threshold"
            message = (
                f"MinHash LSH cannot be tuned this close to 1 with num_perm={self.num_perm} (it would get fewer "
                f"than 2 bands); {fix}"
            )
            raise_problems("NearDupConfig", [(("threshold",), self.threshold, message)])
        return self

    def lsh_index(self) -> Any:
        """An empty datasketch MinHashLSH tuned for these settings."""
        return _lsh(self.threshold, self.num_perm)


def _lsh(threshold: float, num_perm: int) -> Any:
    from datasketch import MinHashLSH  # imported only where near_dup is set: the import takes a third of a second

    return MinHashLSH(threshold=threshold, num_perm=num_perm, weights=NEAR_DUP_LSH_WEIGHTS)


def _lsh_tunable(threshold: float, num_perm: int) -> bool:
    try:
        _lsh(threshold, num_perm)
    except ValueError:  # within the field bounds, datasketch's only refusal is "fewer than 2 bands"
        return False
    return True


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
    near_dup: NearDupConfig | None = Field(
        default=None,
        description=(
            "Drop near-duplicates (after exact duplicates: an exact copy counts as duplicate) across the whole "
            "corpus, before the split; None = off."
        ),
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


IMAGE_KINDS = ("imagefolder", "hf", "webdataset")
_COLUMN = r"^[A-Za-z0-9_.-]{1,128}$"


class ImagePrepareConfig(ImageExpectations):
    """An image dataset to prepare: where the images are, how they become fixed-size shards, and (the inherited
    thresholds) what the image suite refuses."""

    kind: Literal["imagefolder", "hf", "webdataset"] = Field(
        description=(
            "imagefolder: a folder of class subfolders (<class>/<image>), or train/ and val/ folders of them (the "
            "split kept as given); hf: a Hugging Face dataset saved with save_to_disk (every split's rows are "
            "read); webdataset: tar shards (a .tar file, a folder of them or a glob) of <key>.png/.jpg/.jpeg/.webp "
            "with <key>.cls (class id) or <key>.txt (caption)."
        )
    )
    path: StorageUrl = Field(description="The folder, dataset folder, tar file or glob (local path or fsspec URL).")
    image_column: str = Field(
        default="image", pattern=_COLUMN, description="hf: the column of images (an Image feature or encoded bytes)."
    )
    label_column: str | None = Field(
        default=None,
        pattern=_COLUMN,
        description="hf: the column of class ids (label); webdataset: the extension of the class id file (cls). "
        "Set this or caption_column (imagefolder: labels come from the folders).",
    )
    caption_column: str | None = Field(
        default=None,
        pattern=_COLUMN,
        description="hf: the column of captions; webdataset: the extension of the caption file (txt). Captions are "
        "tokenized with data.prepare.tokenizer.",
    )
    class_names: list[str] | None = Field(
        default=None,
        min_length=1,
        max_length=100_000,
        description="The classes in id order. imagefolder: a class folder not named here is refused (None = every "
        "folder, sorted); hf/webdataset: the names of ids 0.. (None = the label feature's names, or the ids).",
    )
    num_classes: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="hf/webdataset labels: ids must lie in [0, num_classes); None = len(class_names), or the label "
        "feature's classes.",
    )
    image_size: int = Field(ge=8, le=1024, description="Side of the stored square images, px (center crop, resize).")
    val_fraction: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="Share of images held out: per class for labels (stratified), over all images for captions.",
    )
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description="Seed of the split.")
    max_caption_tokens: int = Field(
        default=32, ge=1, le=8192, description="captions: longest caption in tokens (EOS not counted); longer ones "
        "are refused. Stored captions are max_caption_tokens + 1 ids (EOS appended, then padding).",
    )  # fmt: skip
    shard_images: int = Field(default=4096, ge=1, le=1 << 24, description="Images per shard file.")

    @model_validator(mode="after")
    def _targets(self) -> ImagePrepareConfig:
        problems: list[Problem] = []
        if self.kind == "imagefolder":
            for name in ("label_column", "caption_column"):
                if getattr(self, name) is not None:
                    problems.append(((name,), getattr(self, name),
                                     "imagefolder takes its labels from the class folders; leave it out"))  # fmt: skip
            if self.num_classes is not None:
                problems.append((("num_classes",), self.num_classes,
                                 "imagefolder counts its class folders (or class_names); leave it out"))  # fmt: skip
        elif (self.label_column is None) == (self.caption_column is None):
            example = "label" if self.kind == "hf" else "cls"
            problems.append(((("label_column",)), self.label_column,
                             f"set exactly one of label_column (e.g. {example}) and caption_column"))  # fmt: skip
        if self.class_names is not None:
            if len(set(self.class_names)) != len(self.class_names):
                problems.append((("class_names",), self.class_names, "names a class twice; list each class once"))
            bad = [n for n in self.class_names if not n or "/" in n or n in (".", "..") or not n.isprintable()]
            if bad:
                problems.append((("class_names",), bad, "a class name is a folder name: no '/', '.' or '..'"))
            if self.num_classes is not None and self.num_classes != len(self.class_names):
                problems.append((("num_classes",), self.num_classes,
                                 f"class_names lists {len(self.class_names)} classes; make them agree"))  # fmt: skip
        raise_problems("ImagePrepareConfig", problems)
        return self

    @property
    def target_kind(self) -> Literal["labels", "captions"]:
        """What the dataset stores per image: a class id, or caption token ids."""
        return "captions" if self.caption_column is not None else "labels"


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
    token_dtype: Literal["uint16", "int32"] | None = Field(
        default=None,
        description="Token id dtype on disk, one Megatron's format has; None = uint16 when the vocabulary fits, "
        "else int32 (as Megatron picks).",
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
    images: ImagePrepareConfig | None = Field(
        default=None,
        description="An image dataset to prepare instead of a text corpus (model.kind vit or vlm); its captions, if "
        "any, use `tokenizer`. None = text: sources or builtin_corpus.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> PrepareConfig:
        problems: list[Problem] = []
        if self.images is not None:
            for name in ("sources", "builtin_corpus"):
                if getattr(self, name):
                    message = "data.prepare.images prepares images; text sources are not read: leave it out"
                    problems.append(((name,), getattr(self, name), message))
        elif not self.sources and self.builtin_corpus is None:
            problems.append(
                (("sources",), [], f"give at least one source, or set builtin_corpus to one of {BUILTIN_CORPORA}")
            )
        if self.token_dtype == "uint16" and (self.vocab_size or 0) > 2**16:
            problems.append(
                (
                    ("token_dtype",),
                    self.token_dtype,
                    f"uint16 holds ids below 65536 but tokenizer.vocab_size={self.vocab_size}; use int32 or null",
                )
            )
        raise_problems("PrepareConfig", problems)
        return self

    @property
    def vocab_size(self) -> int | None:
        """Vocabulary size the prepared dataset will have; None while it depends on a tokenizer file, and for
        images with labels (no token ids)."""
        if self.images is not None and self.images.target_kind == "labels":
            return None
        if self.tokenizer.kind == "bytes":
            return 257
        return None if self.tokenizer.path else self.tokenizer.vocab_size


class DatasetSource(StrictModel):
    """One dataset to train on as it is: a tdeploy dataset folder, a Megatron prefix or a Hugging Face dataset."""

    url: StorageUrl = Field(
        description="A dataset folder with manifest.json; a Megatron indexed dataset's path prefix (P for P.bin and "
        "P.idx); or a Hugging Face dataset on disk (a save_to_disk folder, .arrow or .parquet files)."
    )
    weight: float = Field(
        default=1.0, ge=0, le=1e9, allow_inf_nan=False, description="Sampling weight in a blend (normalised)."
    )
    column: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,128}$",
        description="Hugging Face datasets: the column of token ids; None = input_ids, or the only one of ids.",
    )

    @model_validator(mode="before")
    @classmethod
    def _plain_url(cls, data: Any) -> Any:
        return {"url": data} if isinstance(data, str) else data

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """The editors' schema says what _plain_url takes: the mapping, or its URL alone."""
        return _url_or(handler(core_schema))


def _blend_weight(value: Any) -> float | None:
    """A Megatron blend weight: a number, or a string that reads as one (megatron-core's get_blend_from_list takes
    `["30", A, "70", B]` by float()); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _pasted_blend(value: str) -> list[str] | None:
    """Megatron's `--data-path 0.3 A 0.7 B` pasted as one string: its words, when the first one is a weight (a
    path may hold spaces, but never starts with a number followed by one); None otherwise."""
    words = value.split()
    return words if len(words) > 1 and _blend_weight(words[0]) is not None else None


def _blend_entries(value: list[Any]) -> list[Any]:
    """Megatron's `[0.3, A, 0.7, B]` (weights as numbers or strings) as `[{url: A, weight: 0.3}, ...]`; a list of
    URLs or mappings as it is."""
    if (
        value
        and all(_blend_weight(v) is not None for v in value[0::2])
        and all(isinstance(v, str) for v in value[1::2])
    ):
        if len(value) % 2:
            raise ValueError(
                f"{value!r}: a Megatron-style blend alternates weight and path; the last weight has no path"
            )
        return [
            {"url": url.strip(), "weight": _blend_weight(weight)}
            for weight, url in zip(value[0::2], value[1::2], strict=True)
        ]
    if all(isinstance(v, (str, dict)) for v in value):
        return value
    raise ValueError(
        f"{value!r} is not a blend; write `[0.3, /data/a_text_document, 0.7, /data/b_text_document]` or "
        "`[{url: /data/a, weight: 0.3}, {url: /data/b, weight: 0.7}]`"
    )


class DataSpec(StrictModel):
    """Train on existing data (`dataset_url`, or a `blend` of sources), or prepare a dataset (`prepare`)."""

    dataset_url: StorageUrl | None = Field(
        default=None,
        description="Existing data: a dataset `tdeploy prepare-data` made (a folder with manifest.json), a Megatron "
        "indexed dataset's path prefix, or a Hugging Face dataset on disk with a token-ids column (adopted "
        "without tokenizing). A list (Megatron's `[0.3, A, 0.7, B]`, weights as numbers or strings, or URLs/mappings) "
        "is a blend, and so is Megatron's `--data-path` pasted as one string (`0.3 A 0.7 B`).",
        # the editors' schema: _list_is_a_blend takes a list here too
        json_schema_extra={"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}, {"type": "null"}]},
    )
    blend: list[DatasetSource] | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Several existing datasets sampled with weights per epoch from (seed, epoch); None = off.",
    )
    val_fraction: float = Field(
        default=0.05,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="Adopted data without a held-out split (a Megatron prefix, a Hugging Face dataset without a "
        "validation split): the share of its last documents held out for evaluation.",
    )
    adopted_url: StorageUrl | None = Field(
        default=None,
        description="Folder or prefix for the manifests (and copied token ids of Hugging Face datasets) of adopted "
        "data, one folder per adoption; must be readable by every node; None = <deployment_dir>/datasets.",
    )
    tokenizer_sha256: str | None = Field(
        default=None, description="With dataset_url: the tokenizer the dataset must have been made with; None = any."
    )
    tokenizer_url: StorageUrl | None = Field(
        default=None,
        description="Adopted token ids (a Megatron prefix, a Hugging Face ids column): the tokenizer.json that made "
        "them. It is copied beside the adopted manifest, ids are held against its vocabulary, and the run's "
        "model card names it, so export and serving ship it; None = unknown (the run trains, but exporting it "
        "needs `tdeploy export --tokenizer`).",
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

    @model_validator(mode="before")
    @classmethod
    def _list_is_a_blend(cls, data: Any) -> Any:
        """`dataset_url: [0.3, A, 0.7, B]` (or a list of URLs or mappings, or Megatron's `0.3 A 0.7 B` pasted as
        one string) is `blend:`; `blend:` takes Megatron's forms too."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        url = data.get("dataset_url")
        if isinstance(url, str) and _pasted_blend(url) is not None:
            url = _pasted_blend(url)
        if isinstance(url, list):
            data.pop("dataset_url")
            data["blend"] = _blend_entries(url)
        blend = data.get("blend")
        if isinstance(blend, str) and _pasted_blend(blend) is not None:
            blend = _pasted_blend(blend)
        if isinstance(blend, list):
            data["blend"] = _blend_entries(blend)
        return data

    @model_validator(mode="after")
    def _one_way(self) -> DataSpec:
        problems: list[Problem] = []
        given = [name for name in ("dataset_url", "blend", "prepare") if getattr(self, name) is not None]
        if len(given) != 1:
            problems.append(
                (("dataset_url",), self.dataset_url,
                 f"set exactly one of data.dataset_url, data.blend and data.prepare (given: {given or 'none'})")
            )  # fmt: skip
        if self.tokenizer_url is not None and self.prepare is not None:
            problems.append(
                (("tokenizer_url",), self.tokenizer_url,
                 "names the tokenizer of adopted data; data.prepare has its own (data.prepare.tokenizer.path): "
                 "leave data.tokenizer_url out")
            )  # fmt: skip
        if self.blend is not None and not sum(source.weight for source in self.blend) > 0:
            problems.append(
                (("blend",), [s.weight for s in self.blend],
                 "the weights sum to 0; give at least one source a positive weight")
            )  # fmt: skip
        raise_problems("DataSpec", problems)
        return self

    @property
    def given(self) -> list[DatasetSource]:
        """The existing data the spec names: its blend, or data.dataset_url as one source ([] when preparing)."""
        if self.blend is not None:
            return self.blend
        return [DatasetSource(url=self.dataset_url)] if self.dataset_url is not None else []

    def training(self, dataset_url: str, tokenizer_sha256: str | None, sources: list[str] | None = None) -> DataConfig:
        """The training payload's data section for a concrete dataset (`sources`: the adopted data it names)."""
        return DataConfig(
            dataset_url=dataset_url,
            sources=sources or [],
            tokenizer_sha256=tokenizer_sha256,
            train_split=self.train_split,
            val_split=self.val_split,
            drop_last=self.drop_last,
        )
