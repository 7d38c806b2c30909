"""Reading Hugging Face datasets on disk: what one holds (`inspect_hf`), its text (`iter_texts`) and token ids
(`iter_token_documents`).

A dataset is a folder `datasets`' `save_to_disk` wrote (a Dataset: dataset_info.json, state.json and Arrow stream
files; a DatasetDict: dataset_dict.json and a folder per split), one `.arrow` file (an Arrow stream, as datasets
writes them) or one `.parquet` file; a plain Dataset or a lone file is one split named "train". Folders and .arrow
files are memory-mapped through `datasets` and must be on this machine; a .parquet file is streamed from any URL.
Every failure to read one is an `HfDataError` (a UserError) naming the path and the fix, never pyarrow's or
datasets' own exception.

The data step reads a text column of every split (tasks/prepare/sources.py, `format: hf`); adoption copies a
column of token ids without tokenizing (tasks/prepare/adopt.py).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.errors import DeployError, TransientError, UserError, is_connection_error
from training.storage import ControlFileError, StorageConfig, filesystem, is_local, read_control_file
from training.untrusted import escape_untrusted

MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files that make a folder a saved dataset: state.json and dataset_info.json (a Dataset), dataset_dict.json (a
DatasetDict)."""
ColumnKind = Literal["text", "tokens", "other"]
BATCH_ROWS = 4096
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, pa.ArrowException)
"""What datasets and pyarrow raise on a missing, cut-short or foreign file (ArrowInvalid and JSONDecodeError are
ValueErrors, a state.json without its keys a KeyError or TypeError)."""
_RESAVE = "copy it again (a transfer cut short?) or write it anew with datasets' save_to_disk"
_TEXT_FIX = "put it under data.prepare.sources with format: hf to tokenize it"
_NAME_FIX = "name the column of token ids: `{url: ..., column: NAME}` in data.dataset_url or data.blend"
_INSIDE_FIX = (
    "save the dataset again with datasets' save_to_disk (its split names and data files are plain names inside "
    "its folder); a dataset that names files elsewhere was altered: do not adopt it"
)


class HfDataError(UserError):
    """A Hugging Face dataset on disk cannot be read as asked; `path` is the folder or file at fault."""

    def __init__(self, message: str, fix: str, path: str) -> None:
        super().__init__(message, fix)
        self.path = path


class HfFormatError(HfDataError):
    """Not a Hugging Face dataset, one that cannot be read (cut short, remote), or no such split."""


class HfColumnError(HfDataError):
    """A column is missing or does not hold what is asked of it (text, or lists of integer token ids)."""

    def __init__(self, message: str, fix: str, path: str, column: str | None) -> None:
        super().__init__(message, fix, path)
        self.column = column


class HfRowError(HfDataError):
    """One row's value cannot be used: a null, or a token id below 0 or beyond int64."""

    def __init__(self, message: str, fix: str, path: str, split: str, row: int) -> None:
        super().__init__(message, fix, path)
        self.split, self.row = split, row


@dataclass(frozen=True)
class HfFile:
    """One data file of a split, with fsspec's checksum of it (from its size and modification time or ETag)."""

    split: str
    url: str
    checksum: str

    @property
    def fingerprint(self) -> str:
        """What identifies the file's content in a cache key (the form of SourceFile.fingerprint)."""
        return f"{self.url}:{self.checksum}"


@dataclass(frozen=True)
class HfColumn:
    """A column's kind (text: strings; tokens: lists of integers; other) and its Arrow type."""

    kind: ColumnKind
    arrow_type: str


@dataclass(frozen=True)
class HfDataset:
    """What a Hugging Face dataset on disk holds: rows per split, the columns every split has, its data files."""

    url: str
    splits: dict[str, int]
    columns: dict[str, HfColumn]
    files: tuple[HfFile, ...]

    @property
    def fingerprint(self) -> list[str]:
        """Every data file's identity, in reading order: the material of a cache key."""
        return [file.fingerprint for file in self.files]


def is_hf_folder(fs: Any, path: str) -> bool:
    """True when the folder holds a file save_to_disk writes (dataset_info.json, state.json, dataset_dict.json)."""
    return any(fs.isfile(f"{path.rstrip('/')}/{name}") for name in MARKERS)


def column_kind(arrow_type: pa.DataType) -> ColumnKind:
    """text for strings, tokens for (large, fixed-size) lists of integers, other for the rest."""
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "text"
    listed = pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)
    if (listed or pa.types.is_fixed_size_list(arrow_type)) and pa.types.is_integer(arrow_type.value_type):
        return "tokens"
    return "other"


def inspect_hf(url: str, storage: StorageConfig) -> HfDataset:
    """The splits (rows each), columns (kind each) and data files of the dataset at `url`."""
    fs, path = filesystem(url, storage)
    if path.endswith(".parquet"):
        rows, schema = _parquet_shape(url, storage)
        schemas = {"train": schema}
        splits = {"train": rows}
        files = [HfFile("train", url, str(_checksum(fs, path, url)))]
    else:
        loaded = _load(url, path)
        schemas = {name: ds.data.schema for name, ds in loaded.items()}
        splits = {name: ds.num_rows for name, ds in loaded.items()}
        files = [
            HfFile(name, cache["filename"], str(_checksum(fs, cache["filename"], url)))
            for name, ds in loaded.items()
            for cache in ds.cache_files
        ]
    first = next(iter(schemas.values()))
    columns = {}
    for field in first:  # a column counts when every split has it; its kind when all agree
        if all(field.name in s.names for s in schemas.values()):
            kinds = {column_kind(s.field(field.name).type) for s in schemas.values()}
            columns[field.name] = HfColumn(kinds.pop() if len(kinds) == 1 else "other", str(field.type))
    return HfDataset(url, splits, columns, tuple(files))


def token_column(info: HfDataset, column: str | None) -> str:
    """The column of token ids to read: `column` when it holds them, else input_ids, else the only one that does."""
    tokens = [name for name, found in info.columns.items() if found.kind == "tokens"]
    has = ", ".join(f"{name} ({found.kind}: {found.arrow_type})" for name, found in info.columns.items()) or "none"
    texts_only = not tokens and any(found.kind == "text" for found in info.columns.values())
    if column is None and "input_ids" in info.columns:
        column = "input_ids"
    if column is not None:
        found = info.columns.get(column)
        if found is None:
            fix = _TEXT_FIX if texts_only else (f"set column to one of {tokens}" if tokens else _NAME_FIX)
            raise HfColumnError(f"column={column!r}: {info.url} has no such column (columns: {has})", fix, info.url,
                                column)  # fmt: skip
        if found.kind != "tokens":
            fix = _TEXT_FIX if found.kind == "text" else (f"set column to one of {tokens}" if tokens else _NAME_FIX)
            raise HfColumnError(
                f"column={column!r}: {info.url} holds {found.arrow_type} there, not lists of integer token ids",
                fix,
                info.url,
                column,
            )
        return column
    if len(tokens) == 1:
        return tokens[0]
    if tokens:
        raise HfColumnError(f"column=None: {info.url} has several columns of token ids {tokens} and no input_ids",
                            _NAME_FIX, info.url, None)  # fmt: skip
    fix = _TEXT_FIX if texts_only else "adopt a dataset with a column of token ids (lists of integers)"
    raise HfColumnError(f"column=None: {info.url} has no column of token ids (columns: {has})", fix, info.url, None)


def iter_token_documents(
    url: str, split: str, column: str, storage: StorageConfig, batch_rows: int = BATCH_ROWS
) -> Iterator[np.ndarray]:
    """Each row's token ids of `column` in `split`, in order, as int64 arrays, read `batch_rows` rows at a time."""
    info = inspect_hf(url, storage)
    if split not in info.splits:
        raise HfFormatError(f"{url}: no split {split!r} (splits: {list(info.splits)})", "name one of its splits", url)
    row = 0
    for file in info.files:
        if file.split != split:
            continue
        for array in _column_batches(file.url, column, "tokens", storage, batch_rows):
            yield from _token_rows(array, url, split, column, row)
            row += len(array)


def iter_texts(
    url: str, column: str, storage: StorageConfig, limit_bytes: int, batch_rows: int = BATCH_ROWS
) -> Iterator[tuple[int, str | None, int]]:
    """(row, text, UTF-8 bytes) for each non-null value of a text column of one data file (one of `files`);
    text is None for a value over `limit_bytes`, which is never turned into a Python string."""
    row = 0
    for array in _column_batches(url, column, "text", storage, batch_rows):
        sizes = pc.fill_null(pc.binary_length(array), -1).to_numpy()
        values = array.to_pylist() if sizes.max(initial=-1) <= limit_bytes else None
        for index, size in enumerate(sizes.tolist()):
            if 0 <= size <= limit_bytes:
                yield row + index, values[index] if values is not None else array[index].as_py(), size
            elif size > limit_bytes:
                yield row + index, None, size
        row += len(array)


def _token_rows(array: pa.Array, url: str, split: str, column: str, start: int) -> Iterator[np.ndarray]:
    """A batch of list values as int64 arrays, row by row: one flatten and one copy per batch, none per token."""

    def fail(index: int, problem: str, fix: str) -> HfRowError:
        row = start + index
        return HfRowError(f"{url}: split {split!r} row {row}: column {column!r} {problem}", fix, url, split, row)

    if array.null_count:
        raise fail(_first(array.is_null()), "is null, not a list of token ids",
                   "drop the rows without ids (Dataset.filter) and save the dataset again")  # fmt: skip
    offsets = np.zeros(len(array) + 1, dtype=np.int64)
    np.cumsum(pc.list_value_length(array).to_numpy(), out=offsets[1:])
    values = array.flatten()
    if values.null_count:
        raise fail(_row_of(offsets, _first(values.is_null())), "holds a null among its token ids",
                   "fix the rows (every id an integer) and save the dataset again")  # fmt: skip
    raw = values.to_numpy()
    if raw.dtype == np.uint64 and raw.size and int(raw.max()) > np.iinfo(np.int64).max:
        at = int(np.argmax(raw > np.iinfo(np.int64).max))
        raise fail(_row_of(offsets, at), f"holds token id {int(raw[at])}, beyond int64",
                   "use data tokenized for this model's vocabulary")  # fmt: skip
    ids = raw.astype(np.int64)  # a copy: writable, and independent of the memory-mapped file
    if ids.size and int(ids.min()) < 0:
        at = int(np.argmax(ids < 0))
        raise fail(_row_of(offsets, at), f"holds token id {int(ids[at])}, below 0",
                   "token ids are 0 or more: fix the tokenization that made the column")  # fmt: skip
    for index in range(len(array)):
        yield ids[offsets[index] : offsets[index + 1]]


def _first(mask: pa.Array) -> int:
    return int(np.argmax(mask.to_numpy(zero_copy_only=False)))


def _row_of(offsets: np.ndarray, value_index: int) -> int:
    return int(np.searchsorted(offsets, value_index, side="right")) - 1


def _column_batches(
    url: str, column: str, kind: ColumnKind, storage: StorageConfig, batch_rows: int
) -> Iterator[pa.Array]:
    """`column` of one data file in arrays of `batch_rows` rows, after checking it holds `kind`."""
    if url.endswith(".parquet"):
        import pyarrow.parquet as pq

        fs, path = filesystem(url, storage)
        try:
            with fs.open(path, "rb") as handle:
                parquet = pq.ParquetFile(handle)
                _check_column(parquet.schema_arrow, url, column, kind)
                for batch in parquet.iter_batches(batch_size=batch_rows, columns=[column]):
                    yield batch.column(0)
        except _READ_ERRORS as err:
            raise _read_failure(err, url, "a parquet file") from err
        return
    dataset = _load(url, filesystem(url, storage)[1])["train"]
    _check_column(dataset.data.schema, url, column, kind)
    for table in dataset.with_format("arrow", columns=[column]).iter(batch_size=batch_rows):
        yield table.column(0).combine_chunks()


def _check_column(schema: pa.Schema, url: str, column: str, kind: ColumnKind) -> None:
    if column not in schema.names:
        raise HfColumnError(f"{url}: no column {column!r} (columns: {schema.names})",
                            "name a column every split of the dataset has", url, column)  # fmt: skip
    found = schema.field(column).type
    if column_kind(found) != kind:
        wanted = "text (strings)" if kind == "text" else "lists of integer token ids"
        fix = _TEXT_FIX if column_kind(found) == "text" else f"name a column of {wanted}"
        raise HfColumnError(f"{url}: column {column!r} holds {found}, not {wanted}", fix, url, column)


def _load(url: str, path: str) -> dict[str, Any]:
    """The splits of a local save_to_disk folder or .arrow file as memory-mapped datasets.Dataset objects."""
    if not is_local(url):
        raise HfFormatError(
            f"{url}: a Hugging Face dataset folder or .arrow file is read from this machine only",
            "copy it to a local folder (e.g. `aws s3 sync`) and point there, or write it as parquet "
            "(Dataset.to_parquet) and name the .parquet file",
            url,
        )
    import datasets

    local = Path(path)
    if local.is_file():
        try:
            return {"train": datasets.Dataset.from_file(str(local))}
        except _READ_ERRORS as err:
            raise _read_failure(err, str(local), "an Arrow stream file") from err
    if not local.is_dir():
        raise HfFormatError(f"{url}: no such file or folder", "fix the path to the dataset", url)
    if not any((local / name).is_file() for name in MARKERS):
        raise HfFormatError(
            f"{url}: not a Hugging Face dataset folder (none of {', '.join(MARKERS)} in it)",
            "point at a folder datasets' save_to_disk wrote, or at its .arrow files",
            url,
        )
    _check_inside(local, url)
    try:
        loaded = datasets.load_from_disk(str(local))
    except _READ_ERRORS as err:
        culprit = _culprit(local)
        what = f"an Arrow stream file (of the dataset {url})" if culprit else "a Hugging Face dataset"
        raise _read_failure(err, culprit or url, what) from err
    splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    if not splits:
        raise HfFormatError(f"{url}: a DatasetDict without splits", "save a dataset that has rows", url)
    return splits


def _check_inside(folder: Path, url: str) -> None:
    """Refuse a save_to_disk folder that makes `datasets` read outside it, before anything is loaded: a split name
    in dataset_dict.json (`../../other/train`) or a data-file name in a state.json (`../x.arrow`, `/x.arrow`) that
    is not a plain name, or a split folder or data file that is a link leading out of its folder."""
    root = folder.resolve()
    if os.path.lexists(folder / "state.json"):
        _check_split_files(folder, url)
    if not os.path.lexists(folder / "dataset_dict.json"):
        return
    record = folder / "dataset_dict.json"
    splits = _json_field(record, "splits", url)
    if not isinstance(splits, list) or not all(isinstance(name, str) for name in splits):
        raise HfFormatError(f"{record}: splits is not a list of split names", _INSIDE_FIX, str(record))
    for name in splits:
        problem = _plain_name_problem(name)
        if problem is None and not (folder / name).resolve().is_relative_to(root):
            problem = f"is a link to {escape_untrusted(str((folder / name).resolve()))}, outside the dataset"
        if problem is not None:
            raise HfFormatError(f'{record}: split name "{escape_untrusted(name)}" {problem}', _INSIDE_FIX, str(record))
        _check_split_files(folder / name, url)


def _check_split_files(split: Path, url: str) -> None:
    """Every data file a split's state.json names is a plain name of a regular file inside the split's folder
    (dataset_info.json, state.json itself: regular files of bounded size)."""
    record = split / "state.json"
    if os.path.lexists(split / "dataset_info.json"):
        _json_field(split / "dataset_info.json", None, url)
    files = _json_field(record, "_data_files", url)
    named = isinstance(files, list) and all(isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files)
    if not named:
        raise HfFormatError(f"{record}: _data_files is not a list of {{filename: NAME}}", _INSIDE_FIX, str(record))
    inside = split.resolve()
    for entry in files:
        name = entry["filename"]
        problem = _plain_name_problem(name)
        if problem is None and os.path.lexists(split / name):
            mode = os.lstat(split / name).st_mode
            target = (split / name).resolve()
            if stat.S_ISLNK(mode) and (target.parent != inside):
                problem = f"is a link to {escape_untrusted(str(target))}, outside the split's folder"
            elif not (split / name).is_file():
                problem = "is not a regular file"
        if problem is not None:
            raise HfFormatError(
                f'{record}: _data_files filename "{escape_untrusted(name)}" {problem}', _INSIDE_FIX, str(record)
            )


def _plain_name_problem(name: str) -> str | None:
    """Why `name` is not one plain file or folder name (None when it is)."""
    if name in ("", ".", ".."):
        return "is empty, '.' or '..', not a name"
    if name.startswith("/"):
        return "is an absolute path, not a name inside the dataset's folder"
    if "/" in name or "\\" in name:
        return "holds a path separator, not a plain name inside the dataset's folder"
    if not name.isprintable():
        return "holds a control character"
    return None


def _json_field(path: Path, field: str | None, url: str) -> Any:
    """`field` of a small JSON object file of the dataset at `url` (None: just check that it reads as one)."""
    try:
        value = json.loads(read_control_file(filesystem(str(path))[0], str(path)))
    except ControlFileError as err:
        raise HfFormatError(f"{path}: {err.problem}", _INSIDE_FIX, str(path)) from err
    except (OSError, ValueError, RecursionError) as err:  # missing, not UTF-8, not JSON, nested past the stack
        raise _read_failure(err, url, "a Hugging Face dataset") from err
    if not isinstance(value, dict):
        raise HfFormatError(f"{path}: is not a JSON object", _RESAVE, str(path))
    return value.get(field) if field is not None else value


def _culprit(folder: Path) -> str | None:
    """The first data file under a folder that does not read as an Arrow stream (to name it in the error)."""
    for file in sorted(folder.rglob("*.arrow")):
        try:
            with pa.memory_map(str(file)) as source:
                pa.ipc.open_stream(source).read_all()
        except _READ_ERRORS:
            return str(file)
    return None


def _read_failure(err: Exception, path: str, what: str) -> DeployError:
    if is_connection_error(err):
        return TransientError(f"{path}: storage unreachable while reading: {err}", "the step retries")
    return HfFormatError(f"{path}: cannot be read as {what}: {type(err).__name__}: {err}", _RESAVE, path)


def _parquet_shape(url: str, storage: StorageConfig) -> tuple[int, pa.Schema]:
    import pyarrow.parquet as pq

    fs, path = filesystem(url, storage)
    try:
        with fs.open(path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            return parquet.metadata.num_rows, parquet.schema_arrow
    except _READ_ERRORS as err:
        raise _read_failure(err, url, "a parquet file") from err


def _checksum(fs: Any, path: str, url: str) -> Any:
    try:
        return fs.checksum(path)
    except _READ_ERRORS as err:
        raise _read_failure(err, url, "a Hugging Face dataset") from err
