"""A dataset is untrusted input: its manifest cannot point outside the dataset, and its files are checked
(size always, sha256 and token ids on first use) before a trainer reads a sample."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

import training.dataset as dataset
from training.dataset import DatasetError, DatasetWriter, TokenDataset, TokenizerInfo, read_manifest, verify_dataset

SHARD = "train/tokens-00000.bin"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TDEPLOY_CACHE_DIR", str(cache))
    return cache


def _write(url: str, vocab: int = 100) -> None:
    with DatasetWriter(url, vocab, TokenizerInfo(kind="bytes"), eos_id=vocab - 1, shard_tokens=64) as writer:
        for i in range(6):
            writer.add_document("train", list(range(i, i + 30)))


def _edit_manifest(root: Path, edit: dict) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0].update(edit)
    (root / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "a" / "b" / "ds"
    _write(str(path))
    return path


def _count_scans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files verified: token files are scanned (sha256, largest id), indexes checked against their .bin."""
    scanned: list[str] = []
    real_scan, real_index_problem = dataset._scan, dataset.index_problem

    def spy(fs: object, path: str, dtype: object) -> tuple[str, int]:
        scanned.append(path)
        return real_scan(fs, path, dtype)

    def index_spy(raw: bytes, shard: dataset.ShardInfo, dtype: str) -> str | None:
        scanned.append(shard.index)
        return real_index_problem(raw, shard, dtype)

    monkeypatch.setattr(dataset, "_scan", spy)
    monkeypatch.setattr(dataset, "index_problem", index_spy)
    return scanned


def test_a_shard_path_climbing_out_of_the_dataset_is_refused_before_any_file_is_opened(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (root.parent.parent / "etc").mkdir()
    (root.parent.parent / "etc" / "passwd.bin").write_bytes(b"\0" * 4096)  # where ../../etc/passwd leads
    _edit_manifest(root, {"prefix": "../../etc/passwd"})
    opened: list[str] = []
    monkeypatch.setattr(dataset.np, "memmap", lambda path, **kw: opened.append(path))
    with pytest.raises(DatasetError, match=r"splits\.train\.shards\[0\]\.prefix='\.\./\.\./etc/passwd' climbs out"):
        TokenDataset(str(root), "train", seq_len=8)
    with pytest.raises(DatasetError, match=r"\.\./\.\./etc/passwd"):
        verify_dataset(str(root))
    assert opened == []


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("/etc/passwd", "is an absolute path"),
        ("s3://elsewhere/tokens", "is a URL"),
        ("file:///etc/passwd", "is a URL"),
        ("train\\..\\..\\x", "contains a backslash"),
        ("train//tokens", "has an empty or '.' path component"),
        ("train/tokens\x00", "contains a control character"),
    ],
)
def test_a_shard_path_that_is_not_a_plain_relative_path_is_refused_naming_the_field(
    root: Path, value: str, reason: str
) -> None:
    _edit_manifest(root, {"prefix": value})
    with pytest.raises(DatasetError) as caught:
        read_manifest(str(root))
    assert f"splits.train.shards[0].prefix={value!r} {reason}" in str(caught.value)
    assert caught.value.file == "manifest.json"


def test_a_shard_linked_to_a_file_outside_the_dataset_is_refused(root: Path) -> None:
    outside = root.parent / "elsewhere.bin"
    (root / SHARD).rename(outside)
    (root / SHARD).symlink_to(outside)
    with pytest.raises(DatasetError, match=rf"{SHARD} resolves to .*elsewhere\.bin, outside the dataset root"):
        TokenDataset(str(root), "train", seq_len=8)


def test_a_truncated_shard_is_named_before_it_is_mapped(root: Path) -> None:
    data = (root / SHARD).read_bytes()
    (root / SHARD).write_bytes(data[:-10])
    with pytest.raises(DatasetError) as caught:
        TokenDataset(str(root), "train", seq_len=8)
    assert caught.value.file == SHARD
    assert f"{SHARD} has {len(data) - 10} bytes, the manifest says {len(data)}" in str(caught.value)
    assert "truncated" in str(caught.value)


def test_a_shard_that_is_not_a_whole_number_of_ids_is_named(root: Path) -> None:
    size = (root / SHARD).stat().st_size
    with open(root / SHARD, "ab") as handle:
        handle.write(b"\x01")
    with pytest.raises(DatasetError, match=rf"{SHARD} has {size + 1} bytes, the manifest says {size};"):
        TokenDataset(str(root), "train", seq_len=8)


def test_a_missing_shard_is_named(root: Path) -> None:
    (root / SHARD).unlink()
    with pytest.raises(DatasetError, match=rf"{SHARD} is missing"):
        TokenDataset(str(root), "train", seq_len=8)


def test_a_corrupted_shard_of_the_right_size_is_named_on_first_use(root: Path) -> None:
    data = bytearray((root / SHARD).read_bytes())
    data[3] ^= 0x01
    (root / SHARD).write_bytes(bytes(data))
    with pytest.raises(DatasetError) as caught:
        TokenDataset(str(root), "train", seq_len=8)
    assert caught.value.file == SHARD
    assert f"{SHARD} has sha256 {hashlib.sha256(bytes(data)).hexdigest()}, the manifest says" in str(caught.value)


def test_a_verified_dataset_is_not_hashed_again_on_this_host(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scanned = _count_scans(monkeypatch)
    TokenDataset(str(root), "train", seq_len=8)
    n_files = 2 * len(read_manifest(str(root)).splits["train"].shards)
    assert len(scanned) == n_files
    TokenDataset(str(root), "train", seq_len=8)
    assert len(scanned) == n_files


def test_a_shard_rewritten_after_its_first_use_is_verified_again(root: Path) -> None:
    TokenDataset(str(root), "train", seq_len=8)
    data = bytearray((root / SHARD).read_bytes())
    data[5] ^= 0x01
    os.replace(_sibling(root / SHARD, bytes(data)), root / SHARD)  # same size, new file
    with pytest.raises(DatasetError, match=rf"{SHARD} has sha256"):
        TokenDataset(str(root), "train", seq_len=8)


def _sibling(path: Path, data: bytes) -> Path:
    other = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
    other.write_bytes(data)
    return other


def test_a_token_id_outside_the_vocabulary_is_named_with_its_shard(root: Path) -> None:
    ids = np.frombuffer((root / SHARD).read_bytes(), dtype="<u2").copy()
    ids[7] = 4242
    (root / SHARD).write_bytes(ids.tobytes())
    _edit_manifest(root, {"tokens_sha256": hashlib.sha256(ids.tobytes()).hexdigest()})  # a consistent forgery
    with pytest.raises(DatasetError) as caught:
        TokenDataset(str(root), "train", seq_len=8)
    assert caught.value.file == SHARD
    assert f"{SHARD} holds token id 4242, outside the vocabulary [0, 100)" in str(caught.value)


def test_the_id_range_is_checked_again_when_the_check_was_cached(root: Path, tmp_path: Path) -> None:
    ids = np.frombuffer((root / SHARD).read_bytes(), dtype="<u2").copy()
    ids[0] = 150
    (root / SHARD).write_bytes(ids.tobytes())
    _edit_manifest(root, {"tokens_sha256": hashlib.sha256(ids.tobytes()).hexdigest()})
    for _ in range(2):
        with pytest.raises(DatasetError, match="holds token id 150"):
            TokenDataset(str(root), "train", seq_len=8)


def test_a_dataset_with_a_larger_vocabulary_than_the_model_is_refused(root: Path) -> None:
    with pytest.raises(DatasetError, match=r"dataset vocab_size=100 exceeds model.vocab_size=64"):
        TokenDataset(str(root), "train", seq_len=8, vocab_size=64)
    assert len(TokenDataset(str(root), "train", seq_len=8, vocab_size=100)) > 0


def test_a_manifest_whose_eos_id_is_outside_its_vocabulary_is_refused(root: Path) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["eos_id"] = 100
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=r"eos_id=100 is outside the vocabulary \[0, 100\)"):
        read_manifest(str(root))


def test_a_malformed_manifest_is_a_dataset_error_naming_the_field(root: Path) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["n_tokens"] = -5
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DatasetError, match=r"manifest.json is not a valid manifest .*splits\.train\.shards\.0\.n_tokens"
    ):
        read_manifest(str(root))


def test_a_verification_cache_inside_the_dataset_is_not_trusted(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scanned = _count_scans(monkeypatch)
    for _ in range(2):
        TokenDataset(str(root), "train", seq_len=8, cache_dir=root / "cache")
    assert not (root / "cache").exists()
    assert len(scanned) == 2 * 2 * len(read_manifest(str(root)).splits["train"].shards)


def test_a_remote_dataset_is_checked_from_one_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"memory://untrusted-{uuid.uuid4().hex}"
    _write(url)
    fs = fsspec.filesystem("memory")
    path = f"{url.removeprefix('memory://')}/{SHARD}"
    assert len(TokenDataset(url, "train", seq_len=8)) > 0
    fs.pipe_file(path, fs.cat_file(path)[:-2])
    with pytest.raises(DatasetError, match=rf"{SHARD} has \d+ bytes, the manifest says \d+, truncated"):
        TokenDataset(url, "train", seq_len=8)
