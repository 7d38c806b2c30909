"""The data-preparation step leaves nothing behind in the temp folder, and nothing half-written in the output."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tasks.prepare import pipeline
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import DataValidationError, prepare_dataset
from training.storage import StorageConfig

pytestmark = pytest.mark.integration


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp folder of this test's own, so that anything left in it was left by the step."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _config(tmp_path: Path, **overrides: object) -> PrepareConfig:
    source = tmp_path / "corpus.jsonl"
    source.write_text(
        "".join(json.dumps({"text": f"document number {i} with enough text to keep " * 4}) + "\n" for i in range(300))
    )
    return PrepareConfig(
        output_url=str(tmp_path / "datasets"),
        sources=[{"url": str(source)}],
        tokenizer={"kind": "bytes"},
        val_fraction=0.2,
        shard_tokens=1024,
        **overrides,
    )


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_run_and_a_rerun_leave_no_data_docs_staging_in_the_temp_folder(tmp_path: Path, private_tmp: Path) -> None:
    cfg = _config(tmp_path)
    first = prepare_dataset(cfg, StorageConfig())
    assert Path(first.dataset_url, "validation", "data_docs", "index.html").exists()
    assert _leftovers(private_tmp) == []
    again = prepare_dataset(cfg, StorageConfig())
    assert again.reused and _leftovers(private_tmp) == []


def test_a_step_failing_while_writing_leaves_no_staging_and_no_unfinished_dataset(
    tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = pipeline._write_tokens

    def write_then_fail(*args: object) -> None:
        real(*args)  # shards are on disk, the manifest is not
        raise RuntimeError("injected failure after the shards were written")

    monkeypatch.setattr(pipeline, "_write_tokens", write_then_fail)
    cfg = _config(tmp_path)
    with pytest.raises(RuntimeError, match="injected failure"):
        prepare_dataset(cfg, StorageConfig())
    assert _leftovers(private_tmp) == []
    assert not any((tmp_path / "datasets").rglob("*.bin"))

    monkeypatch.setattr(pipeline, "_write_tokens", real)
    assert not prepare_dataset(cfg, StorageConfig()).reused  # and the next run builds it from scratch


def test_a_failed_document_suite_leaves_nothing_in_the_temp_folder(tmp_path: Path, private_tmp: Path) -> None:
    cfg = _config(tmp_path, expectations={"min_documents": 10_000})
    with pytest.raises(DataValidationError, match="documents"):
        prepare_dataset(cfg, StorageConfig())
    assert _leftovers(private_tmp) == []
