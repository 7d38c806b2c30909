"""The data-preparation step end to end, on local disk and on a real S3-compatible endpoint,
and the Great Expectations suites catching seeded defects."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.errors import TransientError, UserError
from tasks.launch.torchrun import free_port
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import DataValidationError, prepare_dataset
from tests.processes import run_group
from training.dataset import DatasetWriter, TokenDataset, TokenizerInfo, read_manifest
from training.indexed import parse_index
from training.sampler import GlobalBatchSampler
from training.storage import StorageConfig, filesystem
from validation.data import DataExpectations, SuiteRunner, run_dataset_suite

pytestmark = pytest.mark.integration

SMALL = {"builtin_corpus": "python-docs", "builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}}


@pytest.fixture(scope="module")
def runner() -> SuiteRunner:
    """One Great Expectations context for the module (importing GE takes seconds)."""
    return SuiteRunner()


def _jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def test_embedded_corpus_is_prepared_validated_and_read_by_the_trainer(tmp_path: Path) -> None:
    cfg = PrepareConfig(output_url=str(tmp_path / "datasets"), **SMALL)
    result = prepare_dataset(cfg, StorageConfig())
    root = Path(result.dataset_url)
    assert not result.reused and result.validation["success"] and result.validation["evaluated_expectations"] >= 14
    assert (root / "validation" / "data_docs" / "index.html").exists()
    manifest = read_manifest(result.dataset_url)
    assert manifest.vocab_size == 512 and manifest.dtype == "uint16"
    assert manifest.tokenizer.kind == "bpe" and (root / "tokenizer.json").exists()
    import hashlib

    assert manifest.tokenizer.sha256 == hashlib.sha256((root / "tokenizer.json").read_bytes()).hexdigest()
    counts = result.cleaning
    assert counts["read"] == counts["kept"] + sum(counts["removed"].values())
    assert result.splits["train"]["docs"] + result.splits["val"]["docs"] == counts["kept"]

    # the training side reads it, and one epoch of the sampler visits every sample exactly once
    data = TokenDataset(result.dataset_url, "train", seq_len=32)
    sampler = GlobalBatchSampler(len(data), micro_batch=1, grad_accum_steps=1, world_size=1, rank=0, seed=3)
    seen = [int(sampler.next_step()[1][0][0]) for _ in range(len(data))]
    assert sorted(seen) == list(range(len(data)))
    assert data.batch(seen[:4]).max() < 512


def test_rerun_reuses_the_dataset_and_any_change_makes_a_new_one(tmp_path: Path) -> None:
    source = tmp_path / "corpus.jsonl"
    _jsonl(source, [f"document number {i} with enough text to keep" for i in range(60)])
    cfg = PrepareConfig(
        output_url=str(tmp_path / "datasets"),
        sources=[{"url": str(source)}],
        tokenizer={"kind": "bytes"},
        val_fraction=0.2,
        workers=1,
    )
    first = prepare_dataset(cfg, StorageConfig())
    manifest_mtime = (Path(first.dataset_url) / "manifest.json").stat().st_mtime_ns
    again = prepare_dataset(cfg, StorageConfig())
    assert again.reused and again.dataset_url == first.dataset_url
    assert (Path(first.dataset_url) / "manifest.json").stat().st_mtime_ns == manifest_mtime

    changed_setting = prepare_dataset(cfg.model_copy(update={"val_fraction": 0.3}), StorageConfig())
    assert not changed_setting.reused and changed_setting.key != first.key

    _jsonl(source, [f"document number {i} with enough text to keep" for i in range(61)])
    os.utime(source, ns=(manifest_mtime + 10**9, manifest_mtime + 10**9))
    changed_input = prepare_dataset(cfg, StorageConfig())
    assert not changed_input.reused and changed_input.key not in (first.key, changed_setting.key)
    # the split is by document hash: the 60 old documents keep their split
    old, new = _docs_by_split(first.dataset_url), _docs_by_split(changed_input.dataset_url)
    assert all(new[text] == split for text, split in old.items())


def _docs_by_split(url: str) -> dict[bytes, str]:
    manifest = read_manifest(url)
    out = {}
    for split, info in manifest.splits.items():
        for shard in info.shards:
            tokens = np.fromfile(Path(url) / shard.tokens, dtype="<u2")
            starts = parse_index((Path(url) / shard.index).read_bytes()).document_offsets()
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                out[tokens[a:b].tobytes()] = split
    return out


def test_documents_suite_stops_a_corpus_full_of_duplicates(tmp_path: Path) -> None:
    source = tmp_path / "dups.jsonl"
    _jsonl(
        source,
        ["the very same document, again and again"] * 30
        + [f"unique document {i} with enough text to keep " * 3 for i in range(20)],
    )
    cfg = PrepareConfig(
        output_url=str(tmp_path / "datasets"),
        sources=[{"url": str(source)}],
        tokenizer={"kind": "bytes"},
        val_fraction=0.3,
        shard_tokens=1024,  # train's first shard is written before the suite has seen every document
        expectations={"max_duplicate_fraction": 0.2},
    )
    with pytest.raises(DataValidationError) as caught:
        prepare_dataset(cfg, StorageConfig())
    assert [f.expectation for f in caught.value.failed] == ["expect_column_mean_to_be_between"]
    assert caught.value.failed[0].column == "is_duplicate" and caught.value.failed[0].observed == pytest.approx(0.58)
    assert "data validation failed: documents: expect_column_mean_to_be_between(is_duplicate)" in str(caught.value)
    assert not list((tmp_path / "datasets").glob("*/manifest.json"))  # nothing looks finished
    assert not list((tmp_path / "datasets").rglob("*.bin"))  # and the shards written in the same pass are gone


def test_empty_corpus_after_cleaning_reports_each_rule(tmp_path: Path) -> None:
    source = tmp_path / "short.jsonl"
    _jsonl(source, ["tiny", "", "also tiny"])
    cfg = PrepareConfig(output_url=str(tmp_path / "d"), sources=[{"url": str(source)}], tokenizer={"kind": "bytes"})
    with pytest.raises(UserError, match=r"empty after cleaning \(3 read, removed: .*'empty': 1, 'too_short': 2"):
        prepare_dataset(cfg, StorageConfig())
    assert not list((tmp_path / "d").glob("*/manifest.json"))


def test_non_utf8_bytes_are_counted_not_fatal(tmp_path: Path) -> None:
    source = tmp_path / "mixed.txt"
    source.write_bytes(
        b"\n\n".join([f"good document number {i} here".encode() for i in range(40)] + [b"bad \xff\xfe doc"])
    )
    cfg = PrepareConfig(
        output_url=str(tmp_path / "d"),
        sources=[{"url": str(source), "txt_documents": "blank_line"}],
        tokenizer={"kind": "bytes"},
        val_fraction=0.2,
        cleaning={"min_chars": 5},
        expectations={"max_invalid_utf8_fraction": 0.1},
    )
    result = prepare_dataset(cfg, StorageConfig())
    assert result.cleaning["invalid_utf8_seen"] == 1 and result.cleaning["removed"]["invalid_utf8"] == 1


def _seeded_dataset(tmp_path: Path, defect: str) -> str:
    url = str(tmp_path / defect)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 200, size=int(rng.integers(5, 40))) for _ in range(40)]
    with DatasetWriter(url, 257, TokenizerInfo(kind="bytes"), eos_id=256, shard_tokens=300) as writer:
        for i, doc in enumerate(docs):
            writer.add_document("val" if i % 5 == 0 else "train", doc)
        if defect == "empty_doc":
            writer.add_document("train", [])
        if defect == "overlap":
            writer.add_document("train", docs[0])  # docs[0] is in val
    if defect == "out_of_vocabulary":
        manifest = json.loads((Path(url) / "manifest.json").read_text())
        manifest["vocab_size"] = 100  # ids up to 256 are now outside the declared vocabulary
        manifest["eos_id"] = None  # (an EOS outside the vocabulary is refused with the manifest itself)
        (Path(url) / "manifest.json").write_text(json.dumps(manifest))
    if defect == "corrupt_shard":
        shard = Path(url) / "train" / "tokens-00000.bin"
        data = bytearray(shard.read_bytes())
        data[10] ^= 0x01
        shard.write_bytes(bytes(data))
    return url


@pytest.mark.parametrize(
    ("defect", "expectation", "column"),
    [
        ("clean", None, None),
        ("out_of_vocabulary", "expect_column_values_to_be_between", "max_id"),
        ("empty_doc", "expect_column_values_to_be_between", "n_tokens"),
        ("corrupt_shard", "expect_column_values_to_be_in_set", "tokens_sha256_match"),
        ("overlap", "expect_column_values_to_be_in_set", "in_several_splits"),
    ],
)
def test_dataset_suite_fails_naming_the_expectation_for_each_seeded_defect(
    tmp_path: Path, runner: SuiteRunner, defect: str, expectation: str | None, column: str | None
) -> None:
    url = _seeded_dataset(tmp_path, defect)
    result = run_dataset_suite(runner, url, DataExpectations(), shard_tokens=300)
    assert result.evaluated == 12
    assert [(f.expectation, f.column) for f in result.failed] == (
        [] if expectation is None else [(expectation, column)]
    )


def test_a_corrupted_finished_dataset_is_rejected_on_reuse(tmp_path: Path) -> None:
    cfg = PrepareConfig(output_url=str(tmp_path / "datasets"), **{**SMALL, "tokenizer": {"kind": "bytes"}})
    first = prepare_dataset(cfg, StorageConfig())
    shard = next((Path(first.dataset_url) / "train").glob("tokens-*.bin"))
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataValidationError, match="tokens_sha256_match"):
        prepare_dataset(cfg, StorageConfig())
    assert not (Path(first.dataset_url) / "manifest.json").exists()
    assert (Path(first.dataset_url) / "manifest.rejected.json").exists()
    assert json.loads((Path(first.dataset_url) / "validation" / "validation.json").read_text())["success"] is False


def test_prepare_on_s3_gives_the_same_dataset_as_on_disk(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    storage = StorageConfig(s3_endpoint_url=s3_endpoint)
    fs, _ = filesystem(f"s3://{s3_bucket}", storage)
    source = tmp_path / "corpus.jsonl.gz"
    import gzip

    with gzip.open(source, "wt") as handle:
        for i in range(80):
            handle.write(json.dumps({"text": f"remote document {i} " * 3}) + "\n")
    fs.put_file(str(source), f"{s3_bucket}/raw/corpus.jsonl.gz")
    settings = {"tokenizer": {"vocab_size": 300, "min_frequency": 1}, "val_fraction": 0.2, "workers": 2}
    remote = PrepareConfig(
        output_url=f"s3://{s3_bucket}/datasets", sources=[{"url": f"s3://{s3_bucket}/raw/*.jsonl.gz"}], **settings
    )
    result = prepare_dataset(remote, storage)
    assert result.dataset_url.startswith(f"s3://{s3_bucket}/datasets/") and result.validation["success"]
    assert fs.exists(f"{result.dataset_url}/validation/data_docs/index.html")
    local = prepare_dataset(
        PrepareConfig(output_url=str(tmp_path / "datasets"), sources=[{"url": str(source)}], **settings), storage
    )
    assert result.splits == local.splits and result.tokenizer_sha256 == local.tokenizer_sha256
    remote_data = TokenDataset(result.dataset_url, "train", 16, storage)
    local_data = TokenDataset(local.dataset_url, "train", 16)
    assert len(remote_data) == len(local_data) and np.array_equal(remote_data.sample(3), local_data.sample(3))
    assert prepare_dataset(remote, storage).reused


def test_unreachable_storage_is_a_transient_error(tmp_path: Path) -> None:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    dead = StorageConfig(
        s3_endpoint_url=f"http://127.0.0.1:{free_port()}", options={"config_kwargs": {"retries": {"max_attempts": 1}}}
    )
    cfg = PrepareConfig(output_url="s3://nowhere-bucket/datasets", sources=[{"url": "s3://nowhere-bucket/raw/*.jsonl"}])
    with pytest.raises(
        TransientError, match=r"sources\[0\]\.url=s3://nowhere-bucket/raw/\*\.jsonl: storage unreachable"
    ):
        prepare_dataset(cfg, dead)


def test_trainer_refuses_a_dataset_made_with_another_tokenizer(make_spec, tmp_path: Path) -> None:
    spec = make_spec({"cluster": {"procs_per_node": 1}, "data": {"tokenizer_sha256": "0" * 64}, "run": {"steps": 2}})
    cfg = spec.training_config()
    cfg.to_json_file(tmp_path / "run.json")
    proc = run_group([sys.executable, "-m", "training.train", "--config", str(tmp_path / "run.json")], timeout=120)
    assert proc.returncode != 0
    assert f"the spec expects sha256={'0' * 64}; prepare the dataset with the spec's tokenizer" in proc.stderr
