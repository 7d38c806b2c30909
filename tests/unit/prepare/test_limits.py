"""Bounds on what data preparation accepts: document length (enforced while reading), counts, floats, URLs."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.prepare import sources
from tasks.prepare.clean import CleaningStats, clean_documents
from tasks.prepare.config import CleaningConfig, DataSpec, PrepareConfig, SourceConfig
from tasks.prepare.sources import expand_sources, iter_documents
from training.config import format_validation_error
from training.storage import StorageConfig

NORMAL = "a perfectly ordinary document that is long enough to keep"


def _clean(cfg: PrepareConfig) -> tuple[list[str], CleaningStats]:
    storage = StorageConfig()
    stats = CleaningStats()
    kept = list(
        clean_documents(iter_documents(cfg, expand_sources(cfg.sources, storage), storage), cfg.cleaning, stats)
    )
    return kept, stats


def _problems(**fields: object) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        PrepareConfig(output_url="/tmp/out", builtin_corpus="python-docs", **fields)
    return format_validation_error(caught.value)


def test_documents_have_a_default_maximum_length_of_a_million_characters() -> None:
    cfg = CleaningConfig()
    assert cfg.max_chars == 1_000_000
    stats = CleaningStats()
    docs = [sources.RawDocument(text, False, "test") for text in ("y" * 1_000_000, "z" * 1_000_001)]
    assert [len(t) for t in clean_documents(docs, cfg, stats)] == [1_000_000]
    assert stats.removed["too_long"] == 1


def test_a_100_mb_single_line_document_is_dropped_counted_and_never_held_in_memory(tmp_path: Path) -> None:
    source = tmp_path / "huge.jsonl"
    with open(source, "w") as handle:
        handle.write(json.dumps({"text": NORMAL}) + "\n")
        handle.write('{"text": "')
        for _ in range(100):
            handle.write("x" * (1 << 20))
        handle.write('"}\n')
        handle.write(json.dumps({"text": NORMAL + " too"}) + "\n")
    cfg = PrepareConfig(output_url=str(tmp_path / "out"), sources=[SourceConfig(url=str(source))])
    tracemalloc.start()
    try:
        kept, stats = _clean(cfg)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept == [NORMAL, NORMAL + " too"]
    assert stats.read == 3 and stats.removed["too_long"] == 1
    assert peak < 40 << 20, f"peak {peak >> 20} MiB: the 100 MiB line was held in memory"


def test_a_txt_file_too_large_for_the_limit_is_skipped_unread(tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_text("w" * 200_000)
    (tmp_path / "small.txt").write_text(NORMAL)
    cfg = PrepareConfig(
        output_url=str(tmp_path / "out"),
        sources=[SourceConfig(url=str(tmp_path / "*.txt"))],
        cleaning={"max_chars": 1_000},
    )
    docs = list(iter_documents(cfg, expand_sources(cfg.sources, StorageConfig()), StorageConfig()))
    assert [d.unread_bytes is not None for d in docs] == [True, False]
    kept, stats = _clean(cfg)
    assert kept == [NORMAL] and stats.removed["too_long"] == 1


def test_a_txt_block_too_large_for_the_limit_is_skipped_and_its_neighbours_kept(tmp_path: Path) -> None:
    huge_block = "\n".join("v" * 999 for _ in range(200))  # 200 kB over many lines
    (tmp_path / "blocks.txt").write_text(f"{NORMAL} one\n\n{huge_block}\n \n{NORMAL} two\n\n\n{NORMAL}\nthree")
    cfg = PrepareConfig(
        output_url=str(tmp_path / "out"),
        sources=[SourceConfig(url=str(tmp_path / "blocks.txt"), txt_documents="blank_line")],
        cleaning={"max_chars": 1_000},
    )
    kept, stats = _clean(cfg)
    assert kept == [f"{NORMAL} one", f"{NORMAL} two", f"{NORMAL}\nthree"]
    assert stats.removed["too_long"] == 1


def test_lines_are_split_correctly_across_read_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "_CHUNK_BYTES", 7)
    data = b"first line\n\nsecond\n" + b"L" * 40 + b"\nlast without newline"
    got = list(sources._lines(io.BytesIO(data), limit_bytes=30))
    assert got == [(b"first line", 10), (b"", 0), (b"second", 6), (None, 40), (b"last without newline", 20)]


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"workers": 10**30}, f"workers={10**30}: must be <= 256"),
        ({"batch_documents": 10**30}, f"batch_documents={10**30}: must be <= 1000000"),
        ({"shard_tokens": 10**30}, f"shard_tokens={10**30}: must be <= {1 << 32}"),
        ({"builtin_max_bytes": 10**30}, f"builtin_max_bytes={10**30}: must be <= 1000000000"),
        ({"tokenizer": {"min_frequency": 10**30}}, f"tokenizer.min_frequency={10**30}: must be <= 1000000000"),
        ({"cleaning": {"max_chars": 10**30}}, f"cleaning.max_chars={10**30}: must be <= 100000000"),
        ({"expectations": {"min_documents": 10**30}}, f"expectations.min_documents={10**30}: must be <= {10**12}"),
    ],
)
def test_a_count_beyond_its_limit_is_refused_naming_value_and_limit(fields: dict, problem: str) -> None:
    assert problem in _problems(**fields)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("field", ["val_fraction", "expectations.max_duplicate_fraction"])
def test_a_fraction_that_is_not_a_finite_number_is_refused(field: str, value: float) -> None:
    fields: dict = (
        {"val_fraction": value} if field == "val_fraction" else {"expectations": {field.split(".")[1]: value}}
    )
    assert any(p.startswith(f"{field}=") for p in _problems(**fields))


def test_min_chars_above_max_chars_is_refused() -> None:
    assert "cleaning.min_chars=500: must be <= max_chars=100; nothing would be kept" in _problems(
        cleaning={"min_chars": 500, "max_chars": 100}
    )


@pytest.mark.parametrize("url", ["data/raw/*.jsonl", "s3://bucket/raw/part-[0-9]*.jsonl.gz", "/corpora/a?.txt"])
def test_source_globs_are_accepted_as_storage_urls(url: str) -> None:
    assert SourceConfig(url=url).url == url


@pytest.mark.parametrize("url", ["data/raw\n.jsonl", "ftp://host/raw.jsonl", "data/\x00raw"])
def test_storage_urls_with_control_characters_or_unknown_schemes_are_refused(url: str) -> None:
    with pytest.raises(ValidationError):
        SourceConfig(url=url)
    with pytest.raises(ValidationError):
        PrepareConfig(output_url=url, builtin_corpus="python-docs")
    with pytest.raises(ValidationError):
        DataSpec(dataset_url=url)
