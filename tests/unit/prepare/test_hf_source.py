"""Hugging Face datasets on disk: text sources of the data step (`format: hf`) and token ids for adoption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.errors import UserError
from tasks.prepare.config import CleaningConfig, PrepareConfig, SourceConfig
from tasks.prepare.hf import (
    HfColumn,
    HfColumnError,
    HfFormatError,
    HfRowError,
    inspect_hf,
    iter_token_documents,
    token_column,
)
from tasks.prepare.pipeline import dataset_key
from tasks.prepare.sources import expand_sources, iter_documents
from training.storage import StorageConfig

STORAGE = StorageConfig()
TRAIN = {"text": ["first train text", None, "second train text"], "input_ids": [[1, 2, 3], [4], []]}
VALIDATION = {"text": ["held out text", "another held out"], "input_ids": [[7, 8], [9]]}


def _save(path: Path, columns: dict[str, list[Any]]) -> Path:
    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return path


def _save_dict(path: Path) -> Path:
    splits = {"train": datasets.Dataset.from_dict(TRAIN), "validation": datasets.Dataset.from_dict(VALIDATION)}
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


def _texts(tmp_path: Path, *sources: SourceConfig, **cleaning: Any) -> list[tuple[str, int | None]]:
    cfg = PrepareConfig(output_url=str(tmp_path / "out"), sources=list(sources), cleaning=CleaningConfig(**cleaning))
    return [(doc.text, doc.unread_bytes) for doc in iter_documents(cfg, expand_sources(cfg.sources, STORAGE), STORAGE)]


def _tokens(url: Path | str, split: str = "train", column: str = "input_ids", batch_rows: int = 2) -> list[list[int]]:
    found = list(iter_token_documents(str(url), split, column, STORAGE, batch_rows=batch_rows))
    assert all(ids.dtype == np.int64 for ids in found)
    return [ids.tolist() for ids in found]


def _cut(file: Path) -> None:
    raw = file.read_bytes()
    file.write_bytes(raw[: len(raw) * 2 // 3])


# --- text sources of the data step ---


def test_a_dataset_dict_folder_is_detected_and_every_splits_text_read_in_order(tmp_path: Path) -> None:
    folder = _save_dict(tmp_path / "dd")
    files = expand_sources([SourceConfig(url=str(folder))], STORAGE)
    assert [(Path(f.url).relative_to(folder).parts[0], f.format) for f in files] == [
        ("train", "hf"),
        ("validation", "hf"),
    ]
    assert _texts(tmp_path, SourceConfig(url=str(folder))) == [
        ("first train text", None),
        ("second train text", None),
        ("held out text", None),
        ("another held out", None),
    ]


def test_format_hf_reads_a_plain_dataset_by_text_field_and_arrow_files_by_glob(tmp_path: Path) -> None:
    folder = _save(tmp_path / "plain", {"content": ["a document about cats", "a document about dogs"], "n": [1, 2]})
    assert _texts(tmp_path, SourceConfig(url=str(folder), format="hf", text_field="content")) == [
        ("a document about cats", None),
        ("a document about dogs", None),
    ]
    _save_dict(tmp_path / "dd")
    assert _texts(tmp_path, SourceConfig(url=str(tmp_path / "dd" / "*" / "*.arrow"))) == [
        ("first train text", None),
        ("second train text", None),
        ("held out text", None),
        ("another held out", None),
    ]


def test_each_arrow_file_is_fingerprinted_by_its_checksum_and_new_data_changes_the_key(tmp_path: Path) -> None:
    folder = _save(tmp_path / "ds", {"text": ["one text that is long enough to keep around"]})
    cfg = PrepareConfig(output_url=str(tmp_path / "out"), sources=[SourceConfig(url=str(folder))])
    files = expand_sources(cfg.sources, STORAGE)
    fs = fsspec.filesystem("file")
    assert [f.fingerprint for f in files] == [f"{f.url}:{fs.checksum(f.url)}" for f in files]
    assert [f.fingerprint for f in files] == inspect_hf(str(folder), STORAGE).fingerprint
    before = dataset_key(cfg, files, None)
    _save(folder, {"text": ["another text, also long enough to keep around, and longer"]})
    after = expand_sources(cfg.sources, STORAGE)
    assert [f.url for f in after] == [f.url for f in files]
    assert dataset_key(cfg, after, None) != before


def test_an_hf_value_over_the_record_limit_comes_back_unread(tmp_path: Path) -> None:
    huge = "x" * 70_000  # over record_limit_bytes(100) = 12 * 100 + 64 KiB
    folder = _save(tmp_path / "ds", {"text": ["short enough to be read in whole", huge, "read after the huge one"]})
    assert _texts(tmp_path, SourceConfig(url=str(folder), format="hf"), max_chars=100) == [
        ("short enough to be read in whole", None),
        ("", 70_000),
        ("read after the huge one", None),
    ]


def test_a_source_without_the_text_column_names_text_field_and_the_columns(tmp_path: Path) -> None:
    folder = _save(tmp_path / "ids", {"input_ids": [[1, 2]], "body": [3]})
    with pytest.raises(UserError) as caught:
        expand_sources([SourceConfig(url=str(folder), format="hf")], STORAGE)
    assert caught.value.message == (
        f"data.prepare.sources[0].text_field='text': {folder} has no text column of that name "
        "(columns: input_ids (tokens), body (other))"
    )
    assert "adopted as it is with data.dataset_url" in str(caught.value.fix)


def test_a_remote_hf_source_is_refused_naming_the_field_and_the_fix(tmp_path: Path) -> None:
    memory = fsspec.filesystem("memory")
    memory.pipe("/hf-remote/data.arrow", b"not read: refused before")
    try:
        with pytest.raises(UserError) as caught:
            expand_sources([SourceConfig(url="memory://hf-remote/*.arrow")], STORAGE)
    finally:
        memory.rm("/hf-remote", recursive=True)
    assert caught.value.message.startswith("data.prepare.sources[0].url=memory://hf-remote/*.arrow: ")
    assert "read from this machine only" in caught.value.message
    assert "copy it to a local folder" in str(caught.value.fix) and "format: parquet" in str(caught.value.fix)


def test_format_hf_on_a_folder_or_file_that_is_no_dataset_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("plain text")
    with pytest.raises(UserError, match=r"sources\[0\]\.url=.*notes: .*notes is a folder but not a Hugging Face"):
        expand_sources([SourceConfig(url=str(tmp_path / "notes"), format="hf")], STORAGE)
    with pytest.raises(UserError, match=r"a\.txt is neither a save_to_disk folder nor an \.arrow file"):
        expand_sources([SourceConfig(url=str(tmp_path / "notes" / "a.txt"), format="hf")], STORAGE)
    assert _texts(tmp_path, SourceConfig(url=str(tmp_path / "notes" / "*"))) == [("plain text", None)]


def test_a_truncated_arrow_file_in_a_source_names_the_field_and_the_file(tmp_path: Path) -> None:
    folder = _save_dict(tmp_path / "dd")
    arrow = next((folder / "validation").glob("*.arrow"))
    _cut(arrow)
    with pytest.raises(UserError) as caught:
        expand_sources([SourceConfig(url=str(folder))], STORAGE)
    assert caught.value.message.startswith(f"data.prepare.sources[0].url={folder}: {arrow}: cannot be read")
    assert "save_to_disk" in str(caught.value.fix)


# --- inspecting and adopting token ids ---


def test_inspect_reports_splits_rows_column_kinds_and_files(tmp_path: Path) -> None:
    folder = _save_dict(tmp_path / "dd")
    info = inspect_hf(str(folder), STORAGE)
    assert info.splits == {"train": 3, "validation": 2}
    assert info.columns == {
        "text": HfColumn("text", "string"),
        "input_ids": HfColumn("tokens", "list<item: int32>"),  # datasets infers int32 for small ints
    }
    assert [(f.split, Path(f.url).parent.name) for f in info.files] == [
        ("train", "train"),
        ("validation", "validation"),
    ]
    assert all(Path(f.url).suffix == ".arrow" and f.checksum for f in info.files)


def test_a_plain_dataset_and_a_lone_arrow_file_are_one_split_named_train(tmp_path: Path) -> None:
    folder = _save(tmp_path / "ds", {"ids": [[5, 6], [7]], "score": [0.5, 1.5], "nested": [[[1]], [[2]]]})
    info = inspect_hf(str(folder), STORAGE)
    assert info.splits == {"train": 2}
    assert {name: c.kind for name, c in info.columns.items()} == {"ids": "tokens", "score": "other", "nested": "other"}
    arrow = str(next(folder.glob("*.arrow")))
    lone = inspect_hf(arrow, STORAGE)
    assert lone.splits == {"train": 2} and [f.url for f in lone.files] == [arrow]
    assert _tokens(arrow, column="ids") == [[5, 6], [7]]


def test_token_column_is_the_given_one_else_input_ids_else_the_only_list_of_integers() -> None:
    def info(**kinds: str) -> Any:
        from tasks.prepare.hf import HfDataset

        columns = {name: HfColumn(kind, "t") for name, kind in kinds.items()}  # type: ignore[arg-type]
        return HfDataset("/d", {"train": 1}, columns, ())

    assert token_column(info(text="text", input_ids="tokens", labels="tokens"), None) == "input_ids"
    assert token_column(info(text="text", ids="tokens"), None) == "ids"
    assert token_column(info(input_ids="tokens", labels="tokens"), "labels") == "labels"


@pytest.mark.parametrize(
    ("columns", "column", "message", "fix"),
    [
        ({"input_ids": [[1]]}, "ids", "column='ids': {url} has no such column (columns: input_ids",
         "one of ['input_ids']"),
        ({"text": ["t"], "ids": [[0.5]]}, "ids", "column='ids': {url} holds list<item: double> there, not lists",
         "data.dataset_url or data.blend"),
        ({"text": ["t"]}, None, "column=None: {url} has no column of token ids (columns: text (text: string))",
         "put it under data.prepare.sources with format: hf to tokenize it"),
        ({"text": ["t"]}, "text", "column='text': {url} holds string there", "with format: hf to tokenize it"),
        ({"a": [[1]], "b": [[2]]}, None, "column=None: {url} has several columns of token ids ['a', 'b']",
         "column: NAME"),
        ({"input_ids": ["t"], "b": [[2]]}, None, "column='input_ids': {url} holds string there", "to tokenize it"),
    ],
)  # fmt: skip
def test_token_column_errors_name_the_column_the_value_and_the_fix(
    tmp_path: Path, columns: dict[str, list[Any]], column: str | None, message: str, fix: str
) -> None:
    folder = _save(tmp_path / "ds", columns)
    with pytest.raises(HfColumnError) as caught:
        token_column(inspect_hf(str(folder), STORAGE), column)
    named = column or ("input_ids" if "input_ids" in columns else None)
    assert isinstance(caught.value, UserError) and caught.value.column == named
    assert caught.value.message.startswith(message.format(url=folder))
    assert fix in str(caught.value.fix)


def test_token_documents_are_each_rows_ids_as_int64_across_batches_and_splits(tmp_path: Path) -> None:
    folder = _save_dict(tmp_path / "dd")
    assert _tokens(folder, "train") == [[1, 2, 3], [4], []]
    assert _tokens(folder, "validation", batch_rows=1) == [[7, 8], [9]]
    features = datasets.Features({"ids": datasets.Sequence(datasets.Value("uint16"))})
    rows = [[65535, 0], [], [1, 2, 3], [4], [5, 6]]
    datasets.Dataset.from_dict({"ids": rows}, features=features).save_to_disk(str(tmp_path / "u16"))
    assert _tokens(tmp_path / "u16", column="ids", batch_rows=2) == rows
    fixed = datasets.Features({"ids": datasets.Sequence(datasets.Value("int32"), length=2)})
    datasets.Dataset.from_dict({"ids": [[1, 2], [3, 4], [5, 6]]}, features=fixed).save_to_disk(str(tmp_path / "fx"))
    assert inspect_hf(str(tmp_path / "fx"), STORAGE).columns["ids"].kind == "tokens"
    assert _tokens(tmp_path / "fx", column="ids") == [[1, 2], [3, 4], [5, 6]]


def test_a_parquet_file_of_token_ids_is_read_like_a_dataset(tmp_path: Path) -> None:
    pq.write_table(pa.table({"input_ids": [[3, 1], [2], [9, 9, 9]], "text": ["a", "b", "c"]}), tmp_path / "t.parquet")
    info = inspect_hf(str(tmp_path / "t.parquet"), STORAGE)
    assert info.splits == {"train": 3} and token_column(info, None) == "input_ids"
    assert _tokens(tmp_path / "t.parquet") == [[3, 1], [2], [9, 9, 9]]


@pytest.mark.parametrize(
    ("rows", "row", "problem"),
    [
        ([[1], [2], [3, -4]], 2, "holds token id -4, below 0"),
        ([[1], None, [3]], 1, "is null, not a list of token ids"),
        ([[1], [2], [3], [4, None]], 3, "holds a null among its token ids"),
    ],
)
def test_a_bad_row_is_an_error_naming_split_row_and_column(
    tmp_path: Path, rows: list[Any], row: int, problem: str
) -> None:
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64"))})
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": rows}, features=features).save_to_disk(str(folder))
    with pytest.raises(HfRowError) as caught:
        _tokens(folder, batch_rows=2)
    assert (caught.value.split, caught.value.row) == ("train", row)
    assert caught.value.message == f"{folder}: split 'train' row {row}: column 'input_ids' {problem}"


def test_a_truncated_arrow_file_is_named_with_the_fix_not_a_pyarrow_traceback(tmp_path: Path) -> None:
    folder = _save_dict(tmp_path / "dd")
    arrow = next((folder / "train").glob("*.arrow"))
    _cut(arrow)
    with pytest.raises(HfFormatError) as caught:
        inspect_hf(str(folder), STORAGE)
    assert caught.value.path == str(arrow)
    assert caught.value.message.startswith(f"{arrow}: cannot be read as an Arrow stream file (of the dataset {folder})")
    assert caught.value.fix == "copy it again (a transfer cut short?) or write it anew with datasets' save_to_disk"
    with pytest.raises(HfFormatError, match=f"^{arrow}: cannot be read as an Arrow stream file: ArrowInvalid"):
        list(iter_token_documents(str(arrow), "train", "input_ids", STORAGE))


@pytest.mark.parametrize(
    ("make", "message", "fix"),
    [
        (lambda p: p.mkdir(), "{p}: not a Hugging Face dataset folder (none of dataset_info.json", "save_to_disk"),
        (lambda p: None, "{p}: no such file or folder", "fix the path"),
        (lambda p: (p.mkdir(), (p / "state.json").write_text("{"), (p / "dataset_info.json").write_text("{}")),
         "{p}: cannot be read as a Hugging Face dataset: JSONDecodeError", "save_to_disk"),
        (lambda p: p.write_bytes(b"not arrow"), "{p}: cannot be read as an Arrow stream file", "save_to_disk"),
    ],
)  # fmt: skip
def test_a_path_that_is_no_readable_dataset_names_the_path_and_the_fix(
    tmp_path: Path, make: Any, message: str, fix: str
) -> None:
    path = tmp_path / "bad"
    make(path)
    with pytest.raises(HfFormatError) as caught:
        inspect_hf(str(path), STORAGE)
    assert caught.value.message.startswith(message.format(p=path)) and caught.value.path == str(path)
    assert fix in str(caught.value.fix)


def test_a_missing_split_or_column_is_named(tmp_path: Path) -> None:
    folder = _save_dict(tmp_path / "dd")
    with pytest.raises(HfFormatError, match=r"no split 'test' \(splits: \['train', 'validation'\]\)"):
        _tokens(folder, "test")
    with pytest.raises(HfColumnError, match=r"column 'ids' \(columns: \['text', 'input_ids'\]\)"):
        _tokens(folder, "train", column="ids")
    with pytest.raises(HfColumnError, match=r"column 'text' holds string, not lists of integer token ids"):
        _tokens(folder, "train", column="text")
