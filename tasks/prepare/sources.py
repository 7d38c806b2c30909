"""Reading raw documents from fsspec URLs (txt, jsonl, parquet; optionally compressed), Hugging Face datasets on
disk (tasks/prepare/hf.py) or a built-in corpus."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec

from tasks.errors import TransientError, UserError, is_connection_error
from tasks.prepare.config import PrepareConfig, SourceConfig
from tasks.prepare.corpus import stdlib_documents
from training.storage import StorageConfig, filesystem, is_local

_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4")
_FORMATS = {
    ".txt": "txt",
    ".text": "txt",
    ".md": "txt",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "hf",
}


_CHUNK_BYTES = 1 << 20
# The most bytes one character can take in a record: 4 in UTF-8, 12 as a JSON surrogate-pair escape.
_BYTES_PER_CHAR = 12
_RECORD_OVERHEAD_BYTES = 64 << 10


@dataclass
class RawDocument:
    """One document as read: its text (invalid UTF-8 replaced) and whether the bytes were valid UTF-8.

    `unread_bytes` is set (and `text` empty) for a record skipped without being read into memory
    because it is too large to hold a document of at most `cleaning.max_chars` characters.
    """

    text: str
    invalid_utf8: bool
    origin: str
    unread_bytes: int | None = None


def record_limit_bytes(max_chars: int) -> int:
    """Largest raw record (file, block or JSON line) that can hold a document of max_chars characters."""
    return _BYTES_PER_CHAR * max_chars + _RECORD_OVERHEAD_BYTES


@dataclass(frozen=True)
class SourceFile:
    """One file of a source, with what identifies its content for the dataset key."""

    url: str
    format: str
    source: SourceConfig
    fingerprint: str


def detect_format(path: str, source: SourceConfig) -> str:
    """The file's format from the source setting or its extension (before a compression suffix)."""
    if source.format != "auto":
        return source.format
    name = path.lower()
    for suffix in _COMPRESSION:
        name = name.removesuffix(suffix)
    for ext, kind in _FORMATS.items():
        if name.endswith(ext):
            return kind
    raise UserError(
        f"data.prepare.sources: cannot tell the format of {path}",
        f"name it .txt, .jsonl or .parquet (optionally + {'/'.join(_COMPRESSION)}) or .arrow, or set "
        "format: txt|jsonl|parquet|hf",
    )


def _protocol_url(fs: fsspec.AbstractFileSystem, path: str, like: str) -> str:
    return f"{like.split('://', 1)[0]}://{path}" if "://" in like and not like.startswith("file://") else path


def expand_sources(sources: list[SourceConfig], storage: StorageConfig) -> list[SourceFile]:
    """Every file the sources name, sorted per source (a Hugging Face dataset folder: its data files, split by
    split); a source matching nothing is an error."""
    from tasks.prepare.hf import is_hf_folder

    files: list[SourceFile] = []
    for number, source in enumerate(sources):
        try:
            fs, path = filesystem(source.url, storage)
            matches = sorted(fs.glob(path)) if any(c in path for c in "*?[") else ([path] if fs.exists(path) else [])
            entries: list[tuple[str, Any]] = []  # (path, checksum); a Hugging Face dataset folder has None
            for match in matches:
                if not fs.isdir(match):
                    entries.append((match, fs.checksum(match)))
                elif source.format in ("auto", "hf") and is_hf_folder(fs, match):
                    entries.append((match, None))
                elif source.format == "hf":
                    raise UserError(
                        f"data.prepare.sources[{number}].url={source.url}: {match} is a folder but not a Hugging "
                        "Face dataset (no dataset_info.json, state.json or dataset_dict.json)",
                        "point it at a folder datasets' save_to_disk wrote, or at .arrow files",
                    )
        except Exception as err:
            if is_connection_error(err):
                raise TransientError(
                    f"data.prepare.sources[{number}].url={source.url}: storage unreachable: {err}",
                    "check the endpoint (storage.s3_endpoint_url) and network; the step retries",
                ) from err
            raise
        if not entries:
            raise UserError(
                f"data.prepare.sources[{number}].url={source.url}: no such file (or the glob matches nothing)",
                "fix the path or glob; relative paths are relative to the directory tdeploy runs in",
            )
        for match, checksum in entries:
            url = _protocol_url(fs, match, source.url)
            kind = "hf" if checksum is None else detect_format(url, source)
            if kind == "hf":
                files.extend(_hf_files(number, source, url, checksum is None, storage))
            else:
                files.append(SourceFile(url, kind, source, f"{url}:{checksum}"))
    return files


def _hf_files(number: int, source: SourceConfig, url: str, folder: bool, storage: StorageConfig) -> list[SourceFile]:
    """The data files of a Hugging Face dataset (every split's: the step splits by hash itself), its text checked."""
    from tasks.prepare.hf import HfDataError, inspect_hf

    where = f"data.prepare.sources[{number}]"
    if not is_local(url):
        raise UserError(
            f"{where}.url={source.url}: {url} is a Hugging Face dataset (format: hf), which is read from this "
            "machine only",
            "copy it to a local folder (e.g. `aws s3 sync`) and point url there, or write it as parquet "
            "(Dataset.to_parquet) and use format: parquet",
        )
    if not folder and not url.lower().endswith(".arrow"):
        raise UserError(
            f"{where}.url={source.url}: {url} is neither a save_to_disk folder nor an .arrow file (format: hf)",
            "set format: auto (or txt|jsonl|parquet) for other files",
        )
    try:
        info = inspect_hf(url, storage)
    except HfDataError as err:
        raise UserError(f"{where}.url={source.url}: {err.message}", err.fix) from err
    column = info.columns.get(source.text_field)
    if column is None or column.kind != "text":
        has = ", ".join(f"{name} ({found.kind})" for name, found in info.columns.items())
        tokens = any(found.kind == "tokens" for found in info.columns.values())
        raise UserError(
            f"{where}.text_field={source.text_field!r}: {url} has no text column of that name (columns: {has})",
            "set text_field to its column of strings"
            + ("; a dataset of token ids is adopted as it is with data.dataset_url" if tokens else ""),
        )
    return [SourceFile(file.url, "hf", source, file.fingerprint) for file in info.files]


def _decode(raw: bytes) -> tuple[str, bool]:
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), True


def read_file(file: SourceFile, storage: StorageConfig, limit_bytes: int) -> Iterator[RawDocument]:
    """The documents of one file; a txt or jsonl record or an hf value over `limit_bytes` comes back unread."""
    opts = storage.fsspec_options(file.url)
    try:
        if file.format == "hf":
            yield from _hf(file, storage, limit_bytes)
            return
        with fsspec.open(file.url, "rb", compression="infer", **opts) as handle:
            if file.format == "parquet":
                yield from _parquet(handle, file)
            elif file.format == "jsonl":
                yield from _jsonl(handle, file, limit_bytes)
            elif file.source.txt_documents == "file":
                yield from _txt_file(handle, file, limit_bytes)
            else:
                yield from _txt_blocks(handle, file, limit_bytes)
    except (UserError, TransientError):
        raise
    except Exception as err:
        if is_connection_error(err):
            raise TransientError(f"{file.url}: storage unreachable while reading: {err}", "the step retries") from err
        if isinstance(err, (OSError, EOFError)):
            raise UserError(f"{file.url}: cannot be read: {err}", "check the file and its compression suffix") from err
        raise


def _lines(handle: Any, limit_bytes: int) -> Iterator[tuple[bytes | None, int]]:
    """(line, length) for each line without its newline; a line over limit_bytes is (None, length), never held."""
    pending = bytearray()
    over: int | None = None  # length so far of a line known to be too long
    while chunk := handle.read(_CHUNK_BYTES):
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if over is not None:
                over += len(piece)
            elif len(pending) + len(piece) > limit_bytes:
                over = len(pending) + len(piece)
                pending = bytearray()
            else:
                pending += piece
            if end < 0:
                break
            yield (bytes(pending), len(pending)) if over is None else (None, over)
            pending, over, start = bytearray(), None, end + 1
    if over is not None:
        yield None, over
    elif pending:
        yield bytes(pending), len(pending)


def _txt_file(handle: Any, file: SourceFile, limit_bytes: int) -> Iterator[RawDocument]:
    raw = handle.read(limit_bytes + 1)
    if len(raw) > limit_bytes:
        yield RawDocument("", False, file.url, unread_bytes=len(raw))
        return
    text, invalid = _decode(raw)
    yield RawDocument(text, invalid, file.url)


def _txt_blocks(handle: Any, file: SourceFile, limit_bytes: int) -> Iterator[RawDocument]:
    """Blocks separated by whitespace-only lines, read line by line; a block over the limit comes back unread."""
    block: list[bytes] = []
    size, over = 0, False

    def finish() -> RawDocument | None:
        if over:
            return RawDocument("", False, file.url, unread_bytes=size)
        if not block:
            return None
        text, invalid = _decode(b"\n".join(block))
        return RawDocument(text, invalid, file.url)

    for line, length in _lines(handle, limit_bytes):
        if line is not None and not line.strip():
            if (doc := finish()) is not None:
                yield doc
            block, size, over = [], 0, False
            continue
        size += length + 1
        if over or line is None or size > limit_bytes:
            block, over = [], True
        else:
            block.append(line)
    if (doc := finish()) is not None:
        yield doc


def _jsonl(handle: Any, file: SourceFile, limit_bytes: int) -> Iterator[RawDocument]:
    field = file.source.text_field
    for number, (raw, length) in enumerate(_lines(handle, limit_bytes), start=1):
        if raw is None:
            yield RawDocument("", False, f"{file.url}:{number}", unread_bytes=length)
            continue
        if not raw.strip():
            continue
        line, invalid = _decode(raw)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(
                f"{file.url}:{number}: not valid JSON ({err.msg})", "fix the line or drop the file"
            ) from err
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise UserError(
                f"{file.url}:{number}: no field {field!r} (found {keys})",
                "set data.prepare.sources[].text_field to the field that holds the text",
            )
        value = record[field]
        if not isinstance(value, str):
            raise UserError(
                f"{file.url}:{number}: field {field!r} is {type(value).__name__}, not text",
                "point text_field at a string field",
            )
        yield RawDocument(value, invalid, file.url)


def _parquet(handle: Any, file: SourceFile) -> Iterator[RawDocument]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(handle)
    field = file.source.text_field
    if field not in parquet.schema_arrow.names:
        raise UserError(
            f"{file.url}: no column {field!r} (columns: {parquet.schema_arrow.names})",
            "set data.prepare.sources[].text_field to the column that holds the text",
        )
    for batch in parquet.iter_batches(columns=[field]):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield RawDocument(value, False, file.url)


def _hf(file: SourceFile, storage: StorageConfig, limit_bytes: int) -> Iterator[RawDocument]:
    """The text column's values of one data file of a Hugging Face dataset; nulls are skipped (as in parquet)."""
    from tasks.prepare.hf import iter_texts

    for row, text, size in iter_texts(file.url, file.source.text_field, storage, limit_bytes):
        if text is None:
            yield RawDocument("", False, f"{file.url}[{row}]", unread_bytes=size)
        else:
            yield RawDocument(text, False, file.url)


def iter_documents(cfg: PrepareConfig, files: list[SourceFile], storage: StorageConfig) -> Iterator[RawDocument]:
    """The built-in corpus (if any), then every source file, in a fixed order."""
    if cfg.builtin_corpus == "python-docs":
        for text in stdlib_documents(cfg.builtin_max_bytes):
            yield RawDocument(text, False, "builtin:python-docs")
    limit = record_limit_bytes(cfg.cleaning.max_chars)
    for file in files:
        yield from read_file(file, storage, limit)
