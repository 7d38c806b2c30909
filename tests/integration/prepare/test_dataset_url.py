"""Data validation on every path: a dataset given by URL runs the token suite over the whole dataset before any
job starts (a verdict that passed is cached), and a dataset reused from the store must have the spec's
tokenizer."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

import validation.data
from flows.cli import app
from tasks.prepare.step import DataInputs, DataResult, run
from tasks.prepare.config import DataSpec, PrepareConfig
from tasks.paths import DATA_VALIDATION_DIR
from tasks.prepare.existing import VERDICT_FILE, check_dataset_url, verdict_key
from tasks.prepare.pipeline import DataValidationError, prepare_dataset
from tests.conftest import TINY_SPEC, deep_merge
from training.dataset import read_manifest
from training.storage import StorageConfig, filesystem

pytestmark = pytest.mark.integration

SHARD = "train/tokens-00000.bin"
VOCAB = TINY_SPEC["model"]["vocab_size"]


def _copy(tiny_dataset: str, tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(tiny_dataset, root)
    return root


def _poke(root: Path, position: int, value: int, fix_checksum: bool) -> None:
    """Set one token id of the first train shard; with fix_checksum the manifest's sha256 is made to agree."""
    ids = np.fromfile(root / SHARD, dtype="<u2")
    ids[position] = value
    (root / SHARD).write_bytes(ids.tobytes())
    if fix_checksum:
        manifest = json.loads((root / "manifest.json").read_text())
        shard = manifest["splits"]["train"]["shards"][0]
        assert shard["prefix"] + ".bin" == SHARD
        shard["tokens_sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
        (root / "manifest.json").write_text(json.dumps(manifest))


def _spec_file(tmp_path: Path, dataset: Path, name: str) -> tuple[Path, Path]:
    """A tiny spec on `dataset` in its own deployment folder; returns the spec file and that folder."""
    folder = tmp_path / name
    data = deep_merge(TINY_SPEC, {"name": name, "deployment_dir": str(folder), "data": {"dataset_url": str(dataset)}})
    for section in ("checkpoint", "run"):
        data[section] = {k: v for k, v in data[section].items() if k not in ("url", "output_url")}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, folder


def test_a_token_outside_the_vocabulary_is_refused_naming_file_position_and_value(
    tiny_dataset: str, tmp_path: Path
) -> None:
    root = _copy(tiny_dataset, tmp_path, "bad-token")
    position = len(np.fromfile(root / SHARD, dtype="<u2")) - 7  # deep in the shard: after any acceptance run
    _poke(root, position, 5000, fix_checksum=True)  # the checksums agree: only the vocabulary check can see it
    reports = tmp_path / "reports"
    with pytest.raises(DataValidationError) as caught:
        check_dataset_url(DataSpec(dataset_url=str(root)), VOCAB, StorageConfig(), str(reports))
    err = caught.value
    message = str(err)
    assert f"data.dataset_url={root}" in message
    assert f"token id 5000 at position {position} of {SHARD} >= model.vocab_size={VOCAB}" in message
    assert [p.file for p in err.problems] == [SHARD] and "set model.vocab_size" in message
    assert err.report_url and json.loads(Path(err.report_url).read_text())["success"] is False
    assert err.docs_url and "token id 5000" in Path(err.docs_url).read_text()  # the report lists the problem
    assert Path(err.report_url).is_relative_to(reports / DATA_VALIDATION_DIR)  # never inside the dataset
    assert not list(reports.rglob(VERDICT_FILE))  # a refusal is never cached
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in Path(tiny_dataset).iterdir())


def test_tdeploy_train_refuses_a_corrupted_shard_before_any_training_job(tiny_dataset: str, tmp_path: Path) -> None:
    root = _copy(tiny_dataset, tmp_path, "corrupt")
    _poke(root, 3, 200, fix_checksum=False)  # same size, other bytes
    spec, folder = _spec_file(tmp_path, root, "corrupt")
    result = CliRunner().invoke(app, ["train", str(spec)], terminal_width=400)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"data.dataset_url={root}: data validation failed: {SHARD} has sha256 " in text, text
    assert "the manifest says" in text and "nothing was trained" in text
    assert not (folder / "output").exists() and not (folder / "checkpoints").exists()  # no job ever started
    assert list((folder / DATA_VALIDATION_DIR).glob("*/validation/validation.json"))


def test_a_clean_dataset_passes_and_a_rerun_reuses_the_verdict_without_rescanning(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_spec
) -> None:
    root = _copy(tiny_dataset, tmp_path, "clean")
    spec = make_spec({"deployment_dir": str(tmp_path / "deploy"), "data": {"dataset_url": str(root)}})
    first = run(DataInputs.of(spec))  # the data step's logic, as the CLI and the flow call it
    assert first.given and not first.cached_verdict and first.validation["success"]
    assert first.validation["evaluated_expectations"] == 10 and first.validation["problems"] == []
    assert first.splits == {
        n: {"docs": s.n_docs, "tokens": s.n_tokens} for n, s in read_manifest(str(root)).splits.items()
    }
    assert Path(first.data_docs_url).is_file() and "validation passed" in first.summary()

    def no_rescan(*args: object, **kwargs: object) -> None:
        raise AssertionError("the dataset was rescanned")

    monkeypatch.setattr(validation.data, "scan_shard", no_rescan)
    again = run(DataInputs.of(spec))
    assert again.cached_verdict and again.validation == first.validation and "(cached verdict)" in again.summary()
    assert DataResult.model_validate_json(again.model_dump_json()) == again

    # the verdict is keyed by the dataset's content and identity and by the model: a change means a rescan
    inputs = (spec.data, VOCAB, spec.storage)
    key = verdict_key(spec.data, str(root), VOCAB, read_manifest(str(root)), spec.storage)
    assert verdict_key(spec.data, str(root), VOCAB + 1, read_manifest(str(root)), spec.storage) != key
    (root / SHARD).write_bytes((root / SHARD).read_bytes())  # rewritten in place: same bytes, new identity
    assert verdict_key(*inputs[:1], str(root), VOCAB, read_manifest(str(root)), spec.storage) != key


def test_a_dataset_of_another_tokenizer_or_vocabulary_is_refused_from_its_manifest_alone(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validation.data, "scan_shard", None)  # refused before any shard is read
    data = DataSpec(dataset_url=tiny_dataset, tokenizer_sha256="ab" * 32)
    with pytest.raises(DataValidationError, match=r"tokenizer.sha256=None, data.tokenizer_sha256 asks for (ab)+"):
        check_dataset_url(data, VOCAB, StorageConfig(), str(tmp_path))
    with pytest.raises(DataValidationError, match=r"dataset vocab_size=257 exceeds model.vocab_size=200; set model"):
        check_dataset_url(DataSpec(dataset_url=tiny_dataset), 200, StorageConfig(), str(tmp_path))
    with pytest.raises(DataValidationError, match=r"no split 'heldout' \(data.val_split\); the dataset has"):
        check_dataset_url(DataSpec(dataset_url=tiny_dataset, val_split="heldout"), VOCAB, StorageConfig(), "x")


def _bpe_config(tmp_path: Path) -> PrepareConfig:
    return PrepareConfig(
        output_url=str(tmp_path / "store"),
        builtin_corpus="python-docs",
        builtin_max_bytes=60_000,
        tokenizer={"vocab_size": 300, "min_frequency": 1},
    )


def test_a_store_dataset_whose_tokenizer_file_was_swapped_is_refused_on_reuse(tmp_path: Path) -> None:
    cfg = _bpe_config(tmp_path)
    first = prepare_dataset(cfg, StorageConfig(), validate=False)
    assert prepare_dataset(cfg, StorageConfig(), validate=False).reused  # unchanged: reused as before
    tokenizer = Path(first.dataset_url) / "tokenizer.json"
    other = json.loads(tokenizer.read_text())
    other["model"]["vocab"] = dict(reversed(list(other["model"]["vocab"].items())))  # same size, other ids
    tokenizer.write_text(json.dumps(other))
    with pytest.raises(DataValidationError) as caught:
        prepare_dataset(cfg, StorageConfig(), validate=False)
    message = str(caught.value)
    assert f"dataset {first.dataset_url} (reused from the store)" in message
    assert "tokenizer.json has sha256 " in message and "(the file was replaced)" in message
    assert not (Path(first.dataset_url) / "manifest.json").exists()  # uncommitted: the next run rebuilds it
    assert not prepare_dataset(cfg, StorageConfig(), validate=False).reused


def test_the_settings_left_out_of_the_key_do_not_change_a_token(tmp_path: Path) -> None:
    settings = {"builtin_corpus": "python-docs", "builtin_max_bytes": 80_000, "tokenizer": {"kind": "bytes"}}
    one = PrepareConfig(output_url=str(tmp_path / "a"), workers=1, batch_documents=1, shard_tokens=4096, **settings)
    other = PrepareConfig(output_url=str(tmp_path / "b"), workers=2, batch_documents=7, shard_tokens=4096, **settings)
    a, b = (prepare_dataset(cfg, StorageConfig(), validate=False) for cfg in (one, other))
    assert a.key == b.key
    assert read_manifest(a.dataset_url).splits == read_manifest(b.dataset_url).splits  # every shard's sha256


def test_a_dataset_on_s3_is_checked_its_verdict_reused_and_a_replaced_shard_rescanned_and_refused(
    tiny_dataset: str, tmp_path: Path, s3_endpoint: str, s3_bucket: str
) -> None:
    storage = StorageConfig(s3_endpoint_url=s3_endpoint)
    fs, _ = filesystem(f"s3://{s3_bucket}", storage)
    fs.put(f"{tiny_dataset}/", f"{s3_bucket}/ds", recursive=True)
    data, reports = DataSpec(dataset_url=f"s3://{s3_bucket}/ds"), str(tmp_path / "reports")
    first = check_dataset_url(data, VOCAB, storage, reports)
    assert first.validation["success"] and not first.cached
    assert check_dataset_url(data, VOCAB, storage, reports).cached

    bad = _copy(tiny_dataset, tmp_path, "bad")
    _poke(bad, 11, 4000, fix_checksum=True)
    for rel in (SHARD, "manifest.json"):
        fs.put_file(str(bad / rel), f"{s3_bucket}/ds/{rel}")
    with pytest.raises(DataValidationError, match=f"token id 4000 at position 11 of {SHARD} >= model.vocab_size"):
        check_dataset_url(data, VOCAB, storage, reports)
