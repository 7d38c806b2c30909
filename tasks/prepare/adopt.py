"""Adopting data that already exists: Megatron indexed datasets, Hugging Face datasets, tdeploy datasets, blends.

`adopt_given` turns what data.dataset_url (or data.blend) names into one dataset of our format without
tokenizing anything, under `<adopted_url>/<key>/` where the key hashes every source's URL, weight, column,
kind and file identities (size and modification time or ETag), data.val_fraction, the split names and the
model's vocabulary:

- a Megatron prefix P (P.bin + P.idx) is referenced where it is, never copied: its index is parsed and held
  against P.bin, both files are hashed, and its documents are split in two ranges, the last val_fraction of
  them held out (as Megatron's `--split` cuts contiguous ranges);
- a tdeploy dataset folder is referenced where it is, split for split;
- a Hugging Face dataset's token-ids column is copied into Megatron shards of our own (`hf-<n>/` in the
  adopted folder): its train split for training, its validation split (validation, val or test) for
  evaluation, or the last val_fraction of its rows when it has none;
- several sources are a blend: the manifest records each one's weight, and each shard its source;
- the tokenizer that made the ids (data.tokenizer_url, or the one tokenizer of the tdeploy sources) is copied
  beside the manifest as tokenizer.json, and ids are held against its vocabulary: the run's model card names it,
  so the run can be exported and served. Without one the tokenizer is `unknown`.

The manifest is written last; the data step then runs the token suite over the adopted dataset like over any
dataset given by URL. The training job is told the sources' URLs (DataConfig.sources): the only places
outside its folder that the adopted manifest may name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from dataclasses import dataclass
from typing import Any, Literal

from tasks.errors import UserError
from tasks.prepare.config import DatasetSource, DataSpec
from tasks.prepare.tokenizer import TOKENIZER_FILE, TextTokenizer, read_tokenizer
from training.dataset import (
    FORMAT_VERSION,
    MANIFEST,
    BlendSource,
    DatasetError,
    DatasetManifest,
    DatasetWriter,
    ShardInfo,
    TokenizerInfo,
    read_manifest,
    split_info,
    token_dtype,
    write_manifest,
)
from training.indexed import IndexFormatError, check_bin_size, parse_index
from training.storage import StorageConfig, filesystem, join, sha256_file

log = logging.getLogger(__name__)

ADOPT_VERSION = 2
"""Bump when adoption changes what it writes: every adoption gets a new key."""
Kind = Literal["tdeploy", "megatron", "hf"]
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_HF_FILES = (".arrow", ".parquet")
_IDENTITY_KEYS = ("mtime", "created", "ino", "ETag", "etag", "LastModified", "last_modified", "generation")


class AdoptionError(UserError):
    """Data named by the spec cannot be adopted; says which field, the value and the fix."""


@dataclass
class Adoption:
    """The adopted dataset: its folder, the sources its manifest may name outside it, and whether it existed."""

    dataset_url: str
    sources: list[str]
    key: str
    reused: bool
    kinds: list[str]


def _field(data: DataSpec, number: int) -> str:
    return f"data.blend[{number}].url" if data.blend is not None else "data.dataset_url"


def detect_kind(url: str, storage: StorageConfig, where: str) -> Kind:
    """What `url` holds: a tdeploy dataset folder, a Megatron prefix, or a Hugging Face dataset on disk."""
    fs, path = filesystem(url, storage)
    if fs.exists(join(path, MANIFEST)):
        return "tdeploy"
    if fs.exists(path + ".bin") and fs.exists(path + ".idx"):
        return "megatron"
    if path.endswith(_HF_FILES) and fs.exists(path):
        return "hf"
    if fs.isdir(path) and any(fs.exists(join(path, name)) for name in _HF_MARKERS):
        return "hf"
    if fs.exists(path + ".bin") or fs.exists(path + ".idx"):
        have, lack = (".bin", ".idx") if fs.exists(path + ".bin") else (".idx", ".bin")
        raise AdoptionError(
            f"{where}={url}: {url}{have} is there but {url}{lack} is missing",
            f"a Megatron indexed dataset is a .bin and a .idx of one prefix; copy {url}{lack} beside it",
        )
    raise AdoptionError(
        f"{where}={url}: no dataset there (no {MANIFEST}, no {url}.bin/.idx, no Hugging Face dataset)",
        "point it at a folder `tdeploy prepare-data` wrote, a Megatron prefix (without .bin/.idx), or a folder "
        "that datasets' save_to_disk wrote",
    )


def _identities(url: str, kind: Kind, storage: StorageConfig) -> list[Any]:
    """What changes when the source's files change: size and modification time (or ETag) of each."""
    fs, path = filesystem(url, storage)
    if kind == "megatron":
        paths = [path + ".bin", path + ".idx"]
    elif kind == "tdeploy":
        paths = [join(path, MANIFEST)]
    else:
        paths = sorted(fs.find(path)) if fs.isdir(path) else [path]
    found = []
    for item in paths:
        info = fs.info(item)
        found.append([posixpath.basename(item), info.get("size"), *(str(info[k]) for k in _IDENTITY_KEYS if k in info)])
    if kind == "tdeploy":  # the manifest's bytes hold every file's checksum
        found.append(hashlib.sha256(fs.cat_file(paths[0])).hexdigest())
    return found


def adoption_key(
    data: DataSpec, kinds: list[Kind], vocab_size: int, storage: StorageConfig, tokenizer_sha256: str | None = None
) -> str:
    """The adopted dataset's content address (see the module docstring)."""
    material = {
        "adopt": ADOPT_VERSION,
        "format": FORMAT_VERSION,
        "sources": [
            [s.url, s.weight, s.column, kind, _identities(s.url, kind, storage)]
            for s, kind in zip(data.given, kinds, strict=True)
        ],
        "val_fraction": data.val_fraction,
        "splits": [data.train_split, data.val_split],
        "vocab_size": vocab_size,
        "tokenizer_sha256": tokenizer_sha256,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class _Member:
    """One source as the adopted manifest will hold it."""

    splits: dict[str, list[ShardInfo]]
    dtype: str
    eos_id: int | None
    tokenizer: TokenizerInfo
    trusted: str | None
    """The URL the manifest names outside its folder (None: copied inside)."""
    tokenizer_file: str | None = None
    """URL of the source's own tokenizer.json (a tdeploy dataset's), which the adopted dataset copies."""


@dataclass(frozen=True)
class _Vocab:
    """The bound every adopted id must stay below, and what sets it (for the messages)."""

    size: int
    name: str


def _given_tokenizer(data: DataSpec, vocab_size: int, storage: StorageConfig) -> TextTokenizer | None:
    """data.tokenizer_url parsed and held against the model's vocabulary and data.tokenizer_sha256; None if unset."""
    url = data.tokenizer_url
    if url is None:
        return None
    tokenizer = read_tokenizer(url, storage, "data.tokenizer_url")
    if tokenizer.vocab_size > vocab_size:
        raise AdoptionError(
            f"data.tokenizer_url={url}: the tokenizer has {tokenizer.vocab_size} tokens, more than "
            f"model.vocab_size={vocab_size}",
            f"set model.vocab_size >= {tokenizer.vocab_size}, or name the tokenizer that made these ids",
        )
    if data.tokenizer_sha256 is not None and tokenizer.sha256 != data.tokenizer_sha256:
        raise AdoptionError(
            f"data.tokenizer_url={url}: has sha256 {tokenizer.sha256}, data.tokenizer_sha256 asks for "
            f"{data.tokenizer_sha256}",
            "name the tokenizer the spec pins, or change data.tokenizer_sha256",
        )
    return tokenizer


def adopt_given(data: DataSpec, vocab_size: int, storage: StorageConfig, adopted_root: str) -> Adoption:
    """Adopt what data.dataset_url or data.blend names (or reuse the identical adoption); see the module."""
    given = data.given
    kinds = [detect_kind(s.url, storage, _field(data, n)) for n, s in enumerate(given)]
    tokenizer = _given_tokenizer(data, vocab_size, storage)
    key = adoption_key(data, kinds, vocab_size, storage, tokenizer.sha256 if tokenizer else None)
    url = join(adopted_root, key)
    trusted = [s.url for s, kind in zip(given, kinds, strict=True) if kind != "hf"]
    try:
        read_manifest(url, storage, trusted)
        log.info("%s: adopted before (key %s); reusing it", url, key)
        return Adoption(url, trusted, key, True, list(kinds))
    except DatasetError:
        pass
    vocab = (
        _Vocab(tokenizer.vocab_size, f"the vocabulary of data.tokenizer_url ({tokenizer.vocab_size} tokens)")
        if tokenizer is not None
        else _Vocab(vocab_size, f"model.vocab_size={vocab_size}")
    )
    members = [
        _member(data, n, source, kind, vocab, storage, url)
        for n, (source, kind) in enumerate(zip(given, kinds, strict=True))
    ]
    dtypes = sorted({m.dtype for m in members})
    if len(dtypes) > 1:
        raise AdoptionError(
            f"data.blend: the sources store token ids as {dtypes}",
            "blend sources of one tokenizer stored alike (rewrite one with Megatron's tools in the other's dtype)",
        )
    known = {m.tokenizer.sha256 for m in members if m.tokenizer.kind != "unknown"}
    if len(known) > 1:
        raise AdoptionError(
            f"data.blend: the sources were made with different tokenizers (sha256 {sorted(map(str, known))})",
            "blend only data of one tokenizer: the model reads every id the same way",
        )
    splits = {}
    for name in (data.train_split, data.val_split):
        splits[name] = split_info([shard for m in members for shard in m.splits[name]])
    adopted_tokenizer = _adopted_tokenizer(data, members, tokenizer, storage, url)
    eos = {m.eos_id for m in members}
    blend = None
    if len(given) > 1:
        blend = [
            BlendSource(name=_name(s.url), weight=s.weight, url=s.url, kind=kind)
            for s, kind in zip(given, kinds, strict=True)
        ]
    manifest = DatasetManifest(
        vocab_size=vocab.size,  # ids are held against the tokenizer's vocabulary, else the model's
        dtype=dtypes[0],
        eos_id=eos.pop() if len(eos) == 1 else None,
        tokenizer=adopted_tokenizer,
        splits=splits,
        blend=blend,
        meta={"adopted": [{"url": s.url, "kind": kind} for s, kind in zip(given, kinds, strict=True)]},
    )
    write_manifest(url, manifest, storage=storage)
    return Adoption(url, trusted, key, False, list(kinds))


def _adopted_tokenizer(
    data: DataSpec, members: list[_Member], given: TextTokenizer | None, storage: StorageConfig, url: str
) -> TokenizerInfo:
    """The adopted dataset's tokenizer: data.tokenizer_url's, else the sources' one tokenizer, else unknown.

    A tokenizer file (data.tokenizer_url, or the tokenizer.json of tdeploy sources) is copied into the adopted
    folder, so that the manifest names no file outside it but the sources' shards.
    """
    if given is not None:
        for n, member in enumerate(members):
            have = member.tokenizer
            if have.kind != "unknown" and (have.kind, have.sha256) != ("bpe", given.sha256):
                raise AdoptionError(
                    f"data.tokenizer_url={data.tokenizer_url}: {_field(data, n)}={data.given[n].url} was made with "
                    f"another tokenizer ({have.kind}, sha256 {have.sha256}; data.tokenizer_url has {given.sha256})",
                    "name the tokenizer that made every source's ids, or leave data.tokenizer_url out",
                )
        text = given.json_text
    else:
        tokenizers = [m.tokenizer for m in members]
        if not all(t == tokenizers[0] for t in tokenizers):
            return TokenizerInfo(kind="unknown")
        files = [m.tokenizer_file for m in members if m.tokenizer_file is not None]
        if tokenizers[0].kind != "bpe" or not files:
            return tokenizers[0]
        fs, path = filesystem(files[0], storage)
        raw = fs.cat_file(path)
        if hashlib.sha256(raw).hexdigest() != tokenizers[0].sha256:
            raise AdoptionError(
                f"{files[0]}: its sha256 is not the one its dataset's manifest records (the file was replaced)",
                "restore the dataset's own tokenizer.json, or rebuild that dataset",
            )
        text = raw.decode("utf-8")
    assert text is not None
    fs, root = filesystem(url, storage)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(join(root, TOKENIZER_FILE), text.encode("utf-8"))
    return TokenizerInfo(kind="bpe", sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(), path=TOKENIZER_FILE)


def _name(url: str) -> str:
    return posixpath.basename(url.rstrip("/")) or url


def _member(
    data: DataSpec, number: int, source: DatasetSource, kind: Kind, vocab: _Vocab, storage: StorageConfig, url: str
) -> _Member:
    where = _field(data, number)
    if kind == "megatron":
        return _megatron(data, number, source.url, where, storage)
    if kind == "tdeploy":
        return _tdeploy(data, number, source.url, where, vocab, storage)
    return _hugging_face(data, number, source, where, vocab, storage, url)


def _megatron(data: DataSpec, number: int, prefix: str, where: str, storage: StorageConfig) -> _Member:
    """A Megatron prefix as two document ranges of itself: train, then the last val_fraction held out."""
    fs, path = filesystem(prefix, storage)
    raw = fs.cat_file(path + ".idx")
    bin_bytes = fs.size(path + ".bin")
    try:
        index = parse_index(raw)
        check_bin_size(index, bin_bytes)
    except IndexFormatError as err:
        raise AdoptionError(
            f"{where}={prefix}: {prefix}.idx {err.problem}",
            "re-copy the dataset (a transfer cut short?) or rebuild it with Megatron's preprocess_data.py",
        ) from err
    n = index.n_documents
    if n < 2:
        raise AdoptionError(
            f"{where}={prefix}: {n} document(s); one is needed for training and one held out",
            "adopt a larger dataset",
        )
    held = min(n - 1, max(1, round(n * data.val_fraction)))
    cut = n - held
    offsets = index.document_offsets()
    tokens_sha = sha256_file(fs, path + ".bin")
    common = {
        "prefix": prefix,
        "tokens_sha256": tokens_sha,
        "index_sha256": hashlib.sha256(raw).hexdigest(),
        "tokens_bytes": bin_bytes,
        "index_bytes": len(raw),
        "source": number if data.blend is not None else 0,
    }
    train = ShardInfo(**common, docs=(0, cut), first_token=0, n_tokens=int(offsets[cut]), n_docs=cut)
    val = ShardInfo(
        **common, docs=(cut, n), first_token=int(offsets[cut]), n_tokens=int(offsets[n] - offsets[cut]), n_docs=held
    )
    return _Member({data.train_split: [train], data.val_split: [val]}, index.dtype, None, TokenizerInfo(kind="unknown"),
                   prefix)  # fmt: skip


def _tdeploy(data: DataSpec, number: int, folder: str, where: str, vocab: _Vocab, storage: StorageConfig) -> _Member:
    """A dataset of ours, referenced split for split where it is."""
    try:
        manifest = read_manifest(folder, storage)
    except DatasetError as err:
        raise AdoptionError(f"{where}={folder}: {err.problem}", err.fix) from err
    missing = [name for name in (data.train_split, data.val_split) if name not in manifest.splits]
    if missing:
        raise AdoptionError(
            f"{where}={folder}: no split {missing} (it has {sorted(manifest.splits)})",
            "set data.train_split and data.val_split to splits every source has",
        )
    if manifest.vocab_size > vocab.size:
        raise AdoptionError(
            f"{where}={folder}: dataset vocab_size={manifest.vocab_size} exceeds {vocab.name}",
            f"set model.vocab_size >= {manifest.vocab_size} or use a dataset of this vocabulary",
        )
    tokenizer, tokenizer_file = manifest.tokenizer, None
    if tokenizer.path is not None:  # copied into the adopted folder (_adopted_tokenizer), never named there
        tokenizer_file = join(folder, tokenizer.path)
        tokenizer = tokenizer.model_copy(update={"path": None})
    splits = {
        name: [
            shard.model_copy(update={"prefix": join(folder, shard.prefix), "source": number if data.blend else 0})
            for shard in manifest.splits[name].shards
        ]
        for name in (data.train_split, data.val_split)
    }
    return _Member(splits, manifest.dtype, manifest.eos_id, tokenizer, folder, tokenizer_file)


def _hugging_face(
    data: DataSpec,
    number: int,
    source: DatasetSource,
    where: str,
    vocab: _Vocab,
    storage: StorageConfig,
    url: str,
) -> _Member:
    """A Hugging Face dataset's token ids, copied (not tokenized) into Megatron shards of our own."""
    from tasks.prepare.hf import HfDataError, inspect_hf, iter_token_documents, token_column

    try:
        info = inspect_hf(source.url, storage)
        column = token_column(info, source.column)
    except HfDataError as err:
        raise AdoptionError(f"{where}={source.url}: {err.message}", err.fix) from err
    names = list(info.splits)
    train = data.train_split if data.train_split in names else ("train" if "train" in names else names[0])
    val = next((n for n in (data.val_split, "validation", "val", "test") if n in names and n != train), None)
    sub = join(url, f"hf-{number}")
    source_index = number if data.blend is not None else 0
    rel = f"hf-{number}"
    with DatasetWriter(sub, vocab.size, TokenizerInfo(kind="unknown"), None, storage=storage, overwrite=True,
                       dtype=token_dtype(vocab.size)) as writer:  # fmt: skip
        if val is not None:
            plan = [(train, data.train_split, None), (val, data.val_split, None)]
        else:
            rows = info.splits[train]
            if rows < 2:
                raise AdoptionError(f"{where}={source.url}: {rows} row(s)", "adopt a dataset of 2 rows or more")
            held = min(rows - 1, max(1, round(rows * data.val_fraction)))
            plan = [(train, data.train_split, (0, rows - held)), (train, data.val_split, (rows - held, rows))]
        try:
            for hf_split, ours, rows_range in plan:
                for row, ids in enumerate(iter_token_documents(source.url, hf_split, column, storage)):
                    if rows_range is not None and not rows_range[0] <= row < rows_range[1]:
                        continue
                    if ids.size and int(ids.max()) >= vocab.size:
                        raise AdoptionError(
                            f"{where}={source.url}: row {row} of split {hf_split} holds token id {int(ids.max())}, "
                            f"outside {vocab.name}",
                            "use data tokenized for this model's vocabulary, or set model.vocab_size to the "
                            "tokenizer's vocabulary",
                        )
                    if ids.size:
                        writer.add_document(ours, ids)
        except HfDataError as err:
            raise AdoptionError(f"{where}={source.url}: {err.message}", err.fix) from err
    written = read_manifest(sub, storage)
    splits = {
        name: [
            shard.model_copy(update={"prefix": f"{rel}/{shard.prefix}", "source": source_index})
            for shard in written.splits.get(name, split_info([])).shards
        ]
        for name in (data.train_split, data.val_split)
    }
    return _Member(splits, written.dtype, None, TokenizerInfo(kind="unknown"), None)
