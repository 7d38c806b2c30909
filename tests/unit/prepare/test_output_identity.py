"""The data step writes the same bytes whatever its speed-ups: the datasets of a small corpus that exercises every
cleaning rule hash to what the implementation before them wrote (recorded below; the index and manifest since
format 2), and a BPE dataset equals one written document by document by a plain reference implementation in this
file."""

from __future__ import annotations

import hashlib
import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.prepare.sources import expand_sources, iter_documents
from training.dataset import DatasetWriter, TokenizerInfo, read_manifest
from training.indexed import parse_index
from training.storage import StorageConfig

CLEANING = {"min_chars": 8, "max_chars": 2000}

# Per case: the settings, the file count, then two digests. The first was recorded with the data step as it was
# before issue 21 (spawned worker processes, staging for every tokenizer, format 1) over its token files and its
# document offsets (`docs-NNNNN.idx`, raw int64); `_previous_files` derives those from today's dataset, so the tokens
# and where documents start are unchanged. The second covers every file as written since format 2, whose index is
# Megatron's (`tokens-NNNNN.idx`) and whose manifest changed with it; it was recorded when the format changed.
RECORDED = {
    "bytes": (
        {"tokenizer": {"kind": "bytes"}, "shard_tokens": 4096, "val_fraction": 0.2, "cleaning": CLEANING},
        60,
        "9a31a8875cb3793e91a9d324b76dd1effcd00d001879f0bbfe6e87932753085f",
        "aaeab14ef98af69e646e4c021ec5400f42ea08f09cf6b4fd67b700aa474b3e25",
    ),
    # Recorded as uint32, which format 2 replaced by int32: the same bytes for ids below 2**31.
    "bytes_int32_nfkc_replace_no_dedup_3_workers": (
        {
            "tokenizer": {"kind": "bytes"},
            "shard_tokens": 1024,
            "val_fraction": 0.3,
            "token_dtype": "int32",
            "workers": 3,
            "batch_documents": 7,
            "cleaning": {**CLEANING, "unicode_normalization": "NFKC", "dedup": False, "invalid_utf8": "replace"},
        },
        210,
        "6560c2348c4fa23899c832ff82ebf6e1105ff46cee5aff1d41a30f0e69c87fc9",
        "04eb5d8a77ee641865e365e19ed2315a2fb8b82925d12e507d5ddfbb9362f9dc",
    ),
}


def _write_corpus(folder: Path) -> list[dict[str, str]]:
    """A jsonl source and a blank-line txt source: NFC/NFKC forms, line endings, duplicates, short, empty,
    too long and invalid UTF-8 documents."""
    texts: list[str] = []
    for i in range(400):
        body = f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 53}" for j in range(5 + (i * 13) % 90))
        if i % 17 == 0:
            body = f"  cafe\u0301 r\u00e9sum\u00e9 \ufb01le {i}\r\nsecond line\r third line  "
        if i % 23 == 0 and i:
            body = texts[i // 2]
        if i % 29 == 0:
            body = "short"
        if i % 31 == 0:
            body = "   \n\t "
        if i % 37 == 0:
            body = "x" * 3000
        texts.append(body)
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    blocks = [f"Block {i} \u4e2d\u6587 text with some length {'z' * (i % 40)}".encode() for i in range(120)]
    blocks[5] = b"invalid \xff\xfe bytes in a block long enough"
    blocks[50] = b"more invalid \xc3\x28 bytes in a block long enough"
    blocks[70] = blocks[3]
    (folder / "b.txt").write_bytes(b"\n\n".join(blocks) + b"\n")
    return [{"url": str(folder / "a.jsonl")}, {"url": str(folder / "b.txt"), "txt_documents": "blank_line"}]


def _files(url: str) -> dict[str, bytes]:
    """Every file of a dataset but its validation reports; the manifest without `meta` (it names the inputs'
    paths and the key, which hashes their modification times)."""
    root = Path(url)
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("validation/"):
            continue
        data = path.read_bytes()
        if rel == "manifest.json":
            manifest = json.loads(data)
            manifest.pop("meta")
            data = json.dumps(manifest, sort_keys=True).encode()
        out[rel] = data
    return out


def _previous_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """The token files as they are and, for each Megatron index, the format-1 index the previous implementation
    wrote in its place: the token offset of each document's start, then the shard's token count, as int64."""
    out = {rel: data for rel, data in files.items() if rel.endswith(".bin")}
    for rel, data in files.items():
        if rel.endswith(".idx"):
            offsets = parse_index(data).document_offsets().astype("<i8").tobytes()
            out[rel.replace("/tokens-", "/docs-")] = offsets
    return out


def _tree_sha256(files: dict[str, bytes]) -> str:
    listing = "".join(f"{rel} {hashlib.sha256(data).hexdigest()}\n" for rel, data in sorted(files.items()))
    return hashlib.sha256(listing.encode()).hexdigest()


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_the_dataset_is_byte_identical_to_the_one_the_previous_implementation_wrote(tmp_path: Path, case: str) -> None:
    settings, n_files, previous, recorded = RECORDED[case]
    cfg = PrepareConfig(output_url=str(tmp_path / "out"), sources=_write_corpus(tmp_path), **settings)
    result = prepare_dataset(cfg, StorageConfig(), validate=False)
    files = _files(result.dataset_url)
    assert len(files) == n_files
    assert _tree_sha256(_previous_files(files)) == previous
    assert _tree_sha256(files) == recorded


def _reference_dataset(cfg: PrepareConfig, url: str, tokenizer_json: Path) -> None:
    """The data step written plainly: clean, de-duplicate and split each document, encode it alone, write it."""
    from tokenizers import Tokenizer

    storage = StorageConfig()
    hf = Tokenizer.from_file(str(tokenizer_json))
    rules = cfg.cleaning
    seen: set[bytes] = set()
    splits: dict[str, list[list[int]]] = {}
    for doc in iter_documents(cfg, expand_sources(cfg.sources, storage), storage):
        if doc.unread_bytes is not None or (doc.invalid_utf8 and rules.invalid_utf8 == "drop"):
            continue
        text = doc.text
        if rules.unicode_normalization:
            text = unicodedata.normalize(rules.unicode_normalization, text)
        text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
        if not text or not rules.min_chars <= len(text) <= rules.max_chars:
            continue
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        if rules.dedup and digest in seen:
            continue
        seen.add(digest)
        split = "val" if int.from_bytes(digest[:8], "big") / 2**64 < cfg.val_fraction else "train"
        splits.setdefault(split, []).append(hf.encode(text, add_special_tokens=False).ids)
    info = TokenizerInfo(
        kind="bpe", sha256=hashlib.sha256(tokenizer_json.read_bytes()).hexdigest(), path="tokenizer.json"
    )
    eos = hf.token_to_id(cfg.tokenizer.eos_token)
    with DatasetWriter(url, hf.get_vocab_size(), info, eos, cfg.shard_tokens, dtype=cfg.token_dtype) as writer:
        for split in sorted(splits):
            for ids in splits[split]:
                writer.add_document(split, ids)
    Path(url, "tokenizer.json").write_bytes(tokenizer_json.read_bytes())


@pytest.mark.parametrize("workers", [1, 3])
def test_a_bpe_dataset_equals_the_one_written_document_by_document(tmp_path: Path, workers: int) -> None:
    settings: dict[str, Any] = {"val_fraction": 0.2, "cleaning": CLEANING, "shard_tokens": 2048, "workers": workers}
    sources = _write_corpus(tmp_path)
    trained = PrepareConfig(
        output_url=str(tmp_path / "trained"),
        sources=sources,
        tokenizer={"vocab_size": 300, "min_frequency": 1},
        batch_documents=5,
        **settings,
    )
    first = prepare_dataset(trained, StorageConfig(), validate=False)  # staged: the BPE is trained on the data
    tokenizer_json = Path(first.dataset_url, "tokenizer.json")
    given = PrepareConfig(
        output_url=str(tmp_path / "given"),
        sources=sources,
        tokenizer={"path": str(tokenizer_json), "vocab_size": 300},
        **settings,
    )
    second = prepare_dataset(given, StorageConfig(), validate=False)  # one pass: the tokenizer is a file
    reference = str(tmp_path / "reference")
    _reference_dataset(given, reference, tokenizer_json)
    expected = _files(reference)
    assert len(read_manifest(reference).splits["train"].shards) > 1
    ours = {rel: data for rel, data in _files(first.dataset_url).items() if rel != "prepare.json"}
    assert ours == expected
    assert _files(second.dataset_url) == _files(first.dataset_url)
