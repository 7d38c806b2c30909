"""The dataset suite's tables come from one streaming pass per shard, and every defect is named with its file,
its value and the fix: ids outside the vocabulary, checksums, sizes, the document index, split totals, the
tokenizer."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import validation.data
from training.dataset import DatasetWriter, TokenizerInfo, read_manifest
from training.indexed import IndexFormatError, encode_index, parse_index
from validation.data import (
    DataExpectations,
    DataProblem,
    TokenizerExpectation,
    dataset_tables,
    table_problems,
    tokenizer_problems,
)
from validation.data_report import INDEX, ReportContext, render_pages

SHARD = "train/tokens-00000.bin"


def _dataset(root: Path, n_docs: int = 30, doc_tokens: int = 40) -> str:
    url = str(root / "ds")
    with DatasetWriter(url, 257, TokenizerInfo(kind="bytes"), eos_id=256, shard_tokens=1 << 20) as writer:
        for i in range(n_docs):
            writer.add_document("val" if i % 10 == 0 else "train", [(i + j) % 200 for j in range(doc_tokens)])
    return url


def _manifest(url: str) -> dict:
    return json.loads((Path(url) / "manifest.json").read_text())


def _rewrite(url: str, rel: str, data: bytes, fix_checksum: bool) -> None:
    """Replace a dataset file; with fix_checksum the manifest's checksum and size are made to agree (only other
    checks can see it)."""
    (Path(url) / rel).write_bytes(data)
    if fix_checksum:
        manifest = _manifest(url)
        for split in manifest["splits"].values():
            for shard in split["shards"]:
                for suffix, what in ((".bin", "tokens"), (".idx", "index")):
                    if shard["prefix"] + suffix == rel:
                        shard[f"{what}_sha256"] = hashlib.sha256(data).hexdigest()
                        shard[f"{what}_bytes"] = len(data)
        (Path(url) / "manifest.json").write_text(json.dumps(manifest))


def _poke(url: str, position: int, value: int, fix_checksum: bool = True) -> None:
    ids = np.fromfile(Path(url) / SHARD, dtype="<u2")
    ids[position] = value
    _rewrite(url, SHARD, ids.tobytes(), fix_checksum)


def _problems(url: str, vocab_size: int | None = 257) -> list[DataProblem]:
    return table_problems(dataset_tables(url, vocab_size=vocab_size, documents=False), DataExpectations())


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 7 bytes: token ids and offsets straddle chunk ends."""
    monkeypatch.setattr(validation.data, "_CHUNK_BYTES", 7)


def test_a_clean_dataset_has_no_problem_and_its_tables_agree_with_the_manifest(tmp_path: Path, small_chunks) -> None:
    url = _dataset(tmp_path)
    tables = dataset_tables(url, vocab_size=257, documents=False)
    assert table_problems(tables, DataExpectations()) == []
    rows = tables.shards.to_dict("records")
    assert all(r["bytes_match"] and r["tokens_sha256_match"] and r["index_sha256_match"] for r in rows)
    assert all(r["index_valid"] for r in rows) and max(r["max_id"] for r in rows) == 256  # the EOS id
    manifest = read_manifest(url)
    for row in tables.splits.to_dict("records"):
        assert row["counted_tokens"] == manifest.splits[row["split"]].n_tokens == row["manifest_tokens"]
        assert row["counted_docs"] == manifest.splits[row["split"]].n_docs


def test_the_first_token_outside_the_model_vocabulary_is_named_with_its_position_and_file(
    tmp_path: Path, small_chunks
) -> None:
    url = _dataset(tmp_path)
    _poke(url, 123, 300)
    _poke(url, 500, 400)  # a later one: the message names the first
    problems = _problems(url)
    assert [(p.file, p.problem) for p in problems] == [
        (SHARD, f"token id 300 at position 123 of {SHARD} >= model.vocab_size=257 (outside the vocabulary)")
    ]
    assert "model.vocab_size" in problems[0].fix


def test_the_smaller_of_the_model_and_manifest_vocabularies_is_the_limit(tmp_path: Path) -> None:
    url = _dataset(tmp_path)  # the first train document is ids 1..40, then EOS 256 at position 40
    problem = next(p for p in _problems(url, vocab_size=150) if p.file == SHARD)  # val's shard has one too
    assert problem.problem == f"token id 256 at position 40 of {SHARD} >= model.vocab_size=150 (outside the vocabulary)"
    manifest = _manifest(url)
    manifest["vocab_size"], manifest["eos_id"] = 30, None
    (Path(url) / "manifest.json").write_text(json.dumps(manifest))
    problem = next(p for p in _problems(url, vocab_size=257) if p.file == SHARD)
    assert (
        problem.problem
        == f"token id 30 at position 29 of {SHARD} >= the manifest's vocab_size=30 (outside the vocabulary)"
    )


def test_a_corrupted_shard_fails_its_checksum_and_nothing_else(tmp_path: Path) -> None:
    url = _dataset(tmp_path)
    _poke(url, 10, 99, fix_checksum=False)  # was 11: same size, other bytes
    [problem] = _problems(url)
    want = hashlib.sha256((Path(url) / SHARD).read_bytes()).hexdigest()
    assert problem.file == SHARD and problem.problem.startswith(f"{SHARD} has sha256 {want}, the manifest says ")
    assert "corrupt or was replaced" in problem.fix


def test_a_truncated_shard_and_a_missing_index_are_named(tmp_path: Path) -> None:
    url = _dataset(tmp_path)
    raw = (Path(url) / SHARD).read_bytes()
    (Path(url) / SHARD).write_bytes(raw[:-3])
    (Path(url) / "val/tokens-00000.idx").unlink()
    found = {p.file: p.problem for p in _problems(url)}
    assert (
        found[SHARD]
        == f"{SHARD} has {len(raw) - 3} bytes, the manifest says {len(raw)} (token ids of uint16), truncated"
    )
    assert found["val/tokens-00000.idx"] == "val/tokens-00000.idx is missing"
    tables = dataset_tables(url, vocab_size=257)  # the document table leaves the shards it cannot cut out
    assert table_problems(tables, DataExpectations()) == _problems(url) and tables.documents.empty


def test_an_index_that_goes_backwards_or_ends_early_is_named(tmp_path: Path, small_chunks) -> None:
    url = _dataset(tmp_path)
    rel = "train/tokens-00000.idx"
    index = parse_index((Path(url) / rel).read_bytes())
    lengths, docs, n_seq = index.sequence_lengths, index.document_indices, index.n_sequences
    backwards = docs.copy()
    backwards[5], backwards[6] = docs[6], docs[5]
    _rewrite(url, rel, encode_index("uint16", lengths, backwards), fix_checksum=True)
    [problem] = _problems(url)
    assert problem.problem == f"{rel} document index 6 ({docs[5]}) is below the one before it"
    early = docs.copy()
    early[-1] -= 1
    _rewrite(url, rel, encode_index("uint16", lengths, early), fix_checksum=True)
    [problem] = _problems(url)
    assert problem.problem == f"{rel} its last document index is {n_seq - 1}, not the sequence count {n_seq}"
    short = lengths.copy()
    short[-1] -= 1
    _rewrite(url, rel, encode_index("uint16", short, docs), fix_checksum=True)
    [problem] = _problems(url)
    n = index.n_tokens
    assert problem.problem == f"{rel} counts {n - 1} tokens of uint16 ({2 * n - 2} bytes), the .bin has {2 * n} bytes"
    legacy = index.document_offsets().astype("<i8").tobytes()  # the raw offsets of format 1
    _rewrite(url, rel, legacy, fix_checksum=True)
    [problem] = _problems(url)
    assert problem.problem.startswith(f"{rel} starts with {legacy[:9]!r}, not Megatron's ")


def test_split_totals_that_disagree_with_the_shard_files_are_named(tmp_path: Path) -> None:
    url = _dataset(tmp_path)
    manifest = _manifest(url)
    real = manifest["splits"]["train"]["n_tokens"]
    manifest["splits"]["train"]["n_tokens"] = real + 5
    (Path(url) / "manifest.json").write_text(json.dumps(manifest))
    assert [p.problem for p in _problems(url)] == [
        f"split train: the manifest says n_tokens={real + 5}, its shard files hold {real}"
    ]


def test_a_symbolic_link_out_of_the_dataset_is_not_followed(tmp_path: Path) -> None:
    url = _dataset(tmp_path)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes((Path(url) / SHARD).read_bytes())
    (Path(url) / SHARD).unlink()
    (Path(url) / SHARD).symlink_to(outside)
    [problem] = _problems(url)
    assert problem.file == SHARD and "outside the dataset root" in problem.problem


def test_the_scan_streams_a_shard_in_bounded_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "big")
    with DatasetWriter(url, 257, TokenizerInfo(kind="bytes"), eos_id=256, shard_tokens=1 << 23) as writer:
        for i in range(8):
            writer.add_document("train", np.full(1 << 19, i, dtype=np.int64))  # 8 MiB of uint16 in one shard
        writer.add_document("val", [1, 2, 3])
    monkeypatch.setattr(validation.data, "_CHUNK_BYTES", 1 << 20)
    tracemalloc.start()
    try:
        tables = dataset_tables(url, vocab_size=257, documents=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert table_problems(tables, DataExpectations()) == []
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB held to scan an 8 MiB shard"


def _bpe_dataset(root: Path) -> str:
    url = str(root / "bpe")
    text = '{"model": {"type": "BPE"}, "note": "stand-in tokenizer file"}'
    sha = hashlib.sha256(text.encode()).hexdigest()
    info = TokenizerInfo(kind="bpe", sha256=sha, path="tokenizer.json")
    with DatasetWriter(url, 300, info, eos_id=0) as writer:
        writer.add_document("train", [5, 6, 7])
        writer.add_document("val", [8, 9])
    (Path(url) / "tokenizer.json").write_text(text)
    return url


def test_a_tokenizer_file_swapped_after_the_manifest_was_written_is_refused(tmp_path: Path) -> None:
    url = _bpe_dataset(tmp_path)
    manifest = read_manifest(url)
    asked = TokenizerExpectation("data.tokenizer_sha256", sha256=manifest.tokenizer.sha256)
    assert tokenizer_problems(url, manifest, asked) == []
    (Path(url) / "tokenizer.json").write_text('{"model": {"type": "BPE"}, "note": "another tokenizer"}')
    [problem] = tokenizer_problems(url, manifest, asked)
    assert problem.file == "tokenizer.json" and "the manifest says" in problem.problem and "replaced" in problem.problem


def test_a_manifest_tokenizer_other_than_the_spec_asks_for_is_refused_field_by_field(tmp_path: Path) -> None:
    url = _bpe_dataset(tmp_path)
    manifest = read_manifest(url)
    asked = TokenizerExpectation("data.prepare.tokenizer", kind="bytes", vocab_size=257, sha256="0" * 64, eos_id=256)
    found = [p.problem for p in tokenizer_problems(url, manifest, asked)]
    assert found == [
        "manifest.json tokenizer.kind=bpe, data.prepare.tokenizer asks for bytes",
        "manifest.json vocab_size=300, data.prepare.tokenizer asks for 257",
        "manifest.json eos_id=0, data.prepare.tokenizer asks for 256",
        f"manifest.json tokenizer.sha256={manifest.tokenizer.sha256}, data.prepare.tokenizer asks for {'0' * 64}",
    ]


def test_the_report_lists_each_problem_escaped() -> None:
    hostile = "train/<script>alert(1)</script>.bin"
    context = ReportContext("/data/ds", {"train": {"docs": 1, "tokens": 2}}, "2026-01-01T00:00:00+00:00")
    context.problems = [DataProblem(hostile, f"token id 9 at position 1 of {hostile} >= model.vocab_size=8", "fix")]
    page = render_pages([], context)[INDEX]
    assert "<script>" not in page and "Problems found" in page
    assert "token id 9 at position 1 of train/&lt;script&gt;" in page


def _documents_one_by_one(url: str) -> list[tuple[str, int, str]]:
    """(split, n_tokens, sha256) per document as a plain loop slices them: walk the index's sequences, cut at its
    document indices, less a trailing EOS. A shard whose index does not parse has no documents to list."""
    manifest = read_manifest(url)
    rows = []
    for split, info in manifest.splits.items():
        for shard in info.shards:
            ids = np.fromfile(Path(url) / shard.tokens, dtype="<u2")
            try:
                index = parse_index((Path(url) / shard.index).read_bytes())
            except IndexFormatError:
                continue
            starts = [0]
            for length in index.sequence_lengths:
                starts.append(starts[-1] + int(length))
            docs = index.document_indices.tolist()
            for first, end in zip(docs[:-1], docs[1:], strict=True):
                body = ids[starts[first] : starts[end]]
                if manifest.eos_id is not None and body.size and body[-1] == manifest.eos_id:
                    body = body[:-1]
                rows.append((split, int(body.size), hashlib.sha256(body.tobytes()).hexdigest()))
    return rows


def test_the_document_table_slices_documents_as_a_plain_loop_does_even_from_a_broken_index(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    with DatasetWriter(url, 257, TokenizerInfo(kind="bytes"), eos_id=256) as writer:
        for i in range(30):
            writer.add_document("val" if i % 10 == 0 else "train", [(i + j) % 200 for j in range(12)])
        writer.add_document("train", list(range(12)))  # the same tokens as val's first document
        writer.add_document("train", [])
    rel = "train/tokens-00000.idx"
    index = parse_index((Path(url) / rel).read_bytes())
    lengths, docs = index.sequence_lengths, index.document_indices
    assert dataset_tables(url, vocab_size=257).documents["in_several_splits"].sum() == 2  # both copies
    halves = np.stack((lengths // 2, lengths - lengths // 2), axis=1).ravel()  # Megatron's sentences
    for raw, valid in (
        (encode_index("uint16", lengths, docs), True),
        (encode_index("uint16", halves, docs * 2), True),  # two sequences per document
        (encode_index("uint16", lengths, np.concatenate(([0, 5, 3], docs[3:]))), False),  # backwards
        (encode_index("uint16", lengths, np.concatenate((docs[:-1], [docs[-1] + 50]))), False),  # past the end
        (encode_index("uint16", lengths, docs[:1]), False),  # no document
        (index.document_offsets().astype("<i8").tobytes(), False),  # format 1's raw offsets, not Megatron's
    ):
        _rewrite(url, rel, raw, fix_checksum=True)
        tables = dataset_tables(url, vocab_size=257)
        table = tables.documents
        rows = list(zip(table["split"], table["n_tokens"], table["doc_hash"], strict=True))
        assert rows == _documents_one_by_one(url)
        assert (table["split"] == "train").sum() == (index.n_documents if valid else 0)
        several = table.groupby("doc_hash")["split"].transform("nunique") > 1
        assert table["in_several_splits"].tolist() == several.tolist()
        assert [p.file for p in table_problems(tables, DataExpectations())] == ([] if valid else [rel])
