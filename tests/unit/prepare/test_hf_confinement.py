"""An adopted Hugging Face dataset is read from its own folder only.

`datasets.load_from_disk` follows a split name in dataset_dict.json and a data-file name in a split's state.json
wherever they point, so a dataset on shared storage could hand over another dataset's tokens. Both are checked
(plain names, no link leading out of the folder, regular files) before anything is loaded, and the error names the
file, the value and the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import datasets
import pytest

from tasks.prepare.hf import HfFormatError, inspect_hf, iter_token_documents
from training.storage import StorageConfig

STORAGE = StorageConfig()
ARROW = "data-00000-of-00001.arrow"
FIX = "save the dataset again with datasets' save_to_disk"


def _save(path: Path, ids: list[list[int]]) -> Path:
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": ids})}).save_to_disk(str(path))
    return path


def _set_splits(adopted: Path, splits: object) -> str:
    (adopted / "dataset_dict.json").write_text(json.dumps({"splits": splits}))
    return "dataset_dict.json"


def _set_data_file(adopted: Path, name: str) -> str:
    state = adopted / "train" / "state.json"
    record = json.loads(state.read_text())
    record["_data_files"] = [{"filename": name}]
    state.write_text(json.dumps(record))
    return "train/state.json"


def _link_split(adopted: Path, outside: Path) -> str:
    for entry in (adopted / "train").iterdir():
        entry.unlink()
    (adopted / "train").rmdir()
    (adopted / "train").symlink_to(outside / "train")
    return "dataset_dict.json"


def _link_data_file(adopted: Path, outside: Path) -> str:
    (adopted / "train" / ARROW).unlink()
    (adopted / "train" / ARROW).symlink_to(outside / "train" / ARROW)
    return "train/state.json"


_HELD_OPEN: list[int] = []
"""Descriptors the test holds on FIFOs: with one open for writing, a reader's open does not block, so a reader
that does not check fails instead of hanging."""


def _fifo_data_file(adopted: Path, outside: Path) -> str:
    (adopted / "train" / ARROW).unlink()
    os.mkfifo(adopted / "train" / ARROW)
    _HELD_OPEN.append(os.open(adopted / "train" / ARROW, os.O_RDWR | os.O_NONBLOCK))
    return "train/state.json"


@pytest.fixture(autouse=True)
def _close_held() -> Iterator[None]:
    yield
    while _HELD_OPEN:
        os.close(_HELD_OPEN.pop())


# (case, tamper the adopted folder given the outside one -> the tampered file, what the error says of the value)
TAMPERED: list[tuple[str, Callable[[Path, Path], str], str]] = [
    ("split-parent", lambda a, o: _set_splits(a, ["../outside/train"]),
     'split name "../outside/train" holds a path separator'),
    ("split-deep-parent", lambda a, o: _set_splits(a, ["train", "../../x/outside/train"]),
     'split name "../../x/outside/train" holds a path separator'),
    ("split-absolute", lambda a, o: _set_splits(a, [str(o / "train")]),
     f'split name "{{o}}/train" is an absolute path'),
    ("split-dot-dot", lambda a, o: _set_splits(a, [".."]), 'split name ".." is empty'),
    ("split-newline", lambda a, o: _set_splits(a, ["train\n\x1b[2J"]),
     'split name "train\\n\\x1b[2J" holds a control character'),
    ("split-not-a-list", lambda a, o: _set_splits(a, "train"), "splits is not a list of split names"),
    ("split-link", _link_split, 'split name "train" is a link to {o}/train, outside the dataset'),
    ("file-parent", lambda a, o: _set_data_file(a, f"../../outside/train/{ARROW}"),
     f'_data_files filename "../../outside/train/{ARROW}" holds a path separator'),
    ("file-absolute", lambda a, o: _set_data_file(a, str(o / "train" / ARROW)),
     f'_data_files filename "{{o}}/train/{ARROW}" is an absolute path'),
    ("file-link", _link_data_file, f'_data_files filename "{ARROW}" is a link to {{o}}/train/{ARROW}, outside'),
    ("file-fifo", _fifo_data_file, f'_data_files filename "{ARROW}" is not a regular file'),
]  # fmt: skip


@pytest.mark.parametrize(("case", "tamper", "said"), TAMPERED, ids=[case for case, _, _ in TAMPERED])
def test_a_dataset_naming_files_outside_its_folder_is_refused_before_loading(
    tmp_path: Path, case: str, tamper: Callable[[Path, Path], str], said: str
) -> None:
    outside = _save(tmp_path / "outside", [[666, 666, 666]])
    adopted = _save(tmp_path / "adopted", [[1, 2, 3], [4, 5]])
    tampered = adopted / tamper(adopted, outside)
    for read in (lambda: inspect_hf(str(adopted), STORAGE),
                 lambda: list(iter_token_documents(str(adopted), "train", "input_ids", STORAGE))):  # fmt: skip
        with pytest.raises(HfFormatError) as refused:
            read()
        assert refused.value.message.startswith(f"{tampered}: {said.format(o=outside)}"), refused.value.message
        assert refused.value.path == str(tampered) and FIX in refused.value.fix


def test_an_untampered_dataset_and_a_link_inside_its_split_still_read(tmp_path: Path) -> None:
    adopted = _save(tmp_path / "adopted", [[1, 2, 3], [4, 5]])
    (adopted / "train" / ARROW).rename(adopted / "train" / "real.arrow")
    (adopted / "train" / ARROW).symlink_to("real.arrow")
    found = [ids.tolist() for ids in iter_token_documents(str(adopted), "train", "input_ids", STORAGE)]
    assert found == [[1, 2, 3], [4, 5]]
