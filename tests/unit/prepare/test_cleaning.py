"""Cleaning rules, their counts, and the formats sources are read from."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.errors import UserError
from tasks.prepare.clean import CleaningStats, clean_documents
from tasks.prepare.config import CleaningConfig, PrepareConfig, SourceConfig
from tasks.prepare.sources import RawDocument, expand_sources, iter_documents
from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.storage import StorageConfig


def _docs(*texts: str, invalid: tuple[int, ...] = ()) -> list[RawDocument]:
    return [RawDocument(t, i in invalid, "test") for i, t in enumerate(texts)]


def test_each_rule_removes_and_counts_its_documents() -> None:
    long_text = "x" * 50
    docs = _docs(
        "  a perfectly fine document of some length  ",
        "",
        "   \n\t ",
        "short",
        long_text,
        "a perfectly fine document of some length",  # duplicate after trimming
        "bad \ufffd bytes in a long enough document",
        invalid=(6,),
    )
    stats = CleaningStats()
    kept = list(clean_documents(docs, CleaningConfig(min_chars=10, max_chars=45), stats))
    assert kept == ["a perfectly fine document of some length"]
    assert stats.read == 7 and stats.kept == 1 and stats.invalid_utf8_seen == 1
    removed = {"invalid_utf8": 1, "empty": 2, "too_short": 1, "too_long": 1, "duplicate": 1, "near_duplicate": 0}
    assert stats.removed == removed
    assert sum(row[4] for row in stats.rows) == 1 and sum(row[2] for row in stats.rows) == 1


def test_unicode_is_normalised_before_deduplication() -> None:
    composed, decomposed = "caf\u00e9 au lait, the same text twice", "cafe\u0301 au lait, the same text twice"
    stats = CleaningStats()
    kept = list(clean_documents(_docs(composed, decomposed), CleaningConfig(min_chars=5), stats))
    assert kept == [composed] and stats.removed["duplicate"] == 1


def test_invalid_utf8_can_be_kept_with_replacements() -> None:
    stats = CleaningStats()
    kept = list(
        clean_documents(
            _docs("bad \ufffd bytes, still long enough", invalid=(0,)),
            CleaningConfig(min_chars=5, invalid_utf8="replace"),
            stats,
        )
    )
    assert kept and stats.invalid_utf8_seen == 1 and stats.removed["invalid_utf8"] == 0


def test_txt_jsonl_gz_and_parquet_sources_are_read(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"first block of text\n\nsecond block\n\n\nthird \xff block")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as handle:
        for text in ("json one", "json two"):
            handle.write(json.dumps({"body": text, "id": 1}) + "\n")
    pq.write_table(pa.table({"content": ["parquet one", None, "parquet two"]}), tmp_path / "c.parquet")
    cfg = PrepareConfig(
        output_url=str(tmp_path / "out"),
        sources=[
            SourceConfig(url=str(tmp_path / "*.txt"), txt_documents="blank_line"),
            SourceConfig(url=str(tmp_path / "b.jsonl.gz"), text_field="body"),
            SourceConfig(url=str(tmp_path / "c.parquet"), text_field="content"),
        ],
    )
    storage = StorageConfig()
    docs = list(iter_documents(cfg, expand_sources(cfg.sources, storage), storage))
    assert [d.text.strip() for d in docs] == [
        "first block of text",
        "second block",
        "third \ufffd block",
        "json one",
        "json two",
        "parquet one",
        "parquet two",
    ]
    assert [d.invalid_utf8 for d in docs[:3]] == [False, False, True]


def test_a_source_that_matches_nothing_names_the_url(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"sources\[0\]\.url=.*nothing\.jsonl: no such file"):
        expand_sources([SourceConfig(url=str(tmp_path / "nothing.jsonl"))], StorageConfig())


def test_a_wrong_text_field_names_file_line_and_the_fields_found(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    cfg = PrepareConfig(output_url=str(tmp_path), sources=[SourceConfig(url=str(tmp_path / "d.jsonl"))])
    files = expand_sources(cfg.sources, StorageConfig())
    with pytest.raises(UserError, match=r"d\.jsonl:1: no field 'text' \(found \['content'\]\); set data\.prepare"):
        list(iter_documents(cfg, files, StorageConfig()))


def test_an_unreadable_compressed_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "broken.jsonl.gz").write_bytes(b"this is not gzip data")
    cfg = PrepareConfig(output_url=str(tmp_path), sources=[SourceConfig(url=str(tmp_path / "broken.jsonl.gz"))])
    files = expand_sources(cfg.sources, StorageConfig())
    with pytest.raises(UserError, match=r"broken\.jsonl\.gz: cannot be read"):
        list(iter_documents(cfg, files, StorageConfig()))


def test_spec_refuses_a_vocabulary_too_large_for_the_token_dtype_or_the_model() -> None:
    base = deep_merge(TINY_SPEC, {"checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}})
    prepare = {"output_url": "/tmp/d", "builtin_corpus": "python-docs"}
    with pytest.raises(SpecError) as caught:
        parse_spec(
            deep_merge(
                base,
                {
                    "data": {
                        "dataset_url": None,
                        "prepare": {**prepare, "token_dtype": "uint16", "tokenizer": {"vocab_size": 70000}},
                    }
                },
            )
        )
    assert any(
        p.startswith("data.prepare.token_dtype=uint16: uint16 holds ids below 65536 but tokenizer.vocab_size=70000")
        for p in caught.value.problems
    )
    with pytest.raises(SpecError) as caught:
        parse_spec(
            deep_merge(base, {"data": {"dataset_url": None, "prepare": {**prepare, "tokenizer": {"vocab_size": 4096}}}})
        )
    assert (
        "model.vocab_size=257: must be >= the dataset's vocabulary (4096, data.prepare.tokenizer); set it to 4096"
        in (caught.value.problems)
    )
    one_way = "set exactly one of data.dataset_url, data.blend and data.prepare (given: ['dataset_url', 'prepare'])"
    with pytest.raises(SpecError, match=re.escape(one_way)):
        parse_spec(deep_merge(base, {"data": {"dataset_url": "/tmp/x", "prepare": prepare}}))
