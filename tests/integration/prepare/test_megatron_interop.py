"""Interoperability with Megatron-Core's own reader and builder, and with Hugging Face datasets of token ids.

Our shards are opened by Megatron-Core's `IndexedDataset` (what we wrote is what it reads), a dataset Megatron's
`IndexedDatasetBuilder` wrote is adopted by the data step and trained on (what we train on is what Megatron
reads), a Megatron-style weight list becomes one blended manifest, and a Hugging Face dataset's ids column is
adopted by copying the ids.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tasks.prepare.step import DataResult, training_config
from tasks.errors import UserError
from tasks.prepare.config import PrepareConfig
from tasks.prepare.existing import CheckedDataset, check_dataset_url
from tasks.prepare.pipeline import prepare_dataset
from tasks.spec import DeploymentSpec
from tests.processes import run_group
from training.config import TrainConfig
from training.dataset import DatasetWriter, TokenDataset, TokenizerInfo, read_manifest
from training.run_output import RunOutput
from training.storage import StorageConfig

pytestmark = pytest.mark.integration

SEQ = 32
VOCAB = 257
STEPS = 4


def _indexed() -> Any:
    """Megatron-Core's indexed_dataset module (imported on first use: importing megatron.core takes seconds).

    megatron.core imports torch's cpp_extension, which imports setuptools; setuptools' distutils shim refuses to
    load (an AssertionError) when an earlier test of this pytest worker already loaded the standard library's
    distutils. The shim is told to use that one, for this import only.
    """
    previous = os.environ.get("SETUPTOOLS_USE_DISTUTILS")
    os.environ["SETUPTOOLS_USE_DISTUTILS"] = "stdlib"
    try:
        from megatron.core.datasets import indexed_dataset
    finally:
        if previous is None:
            os.environ.pop("SETUPTOOLS_USE_DISTUTILS", None)
        else:
            os.environ["SETUPTOOLS_USE_DISTUTILS"] = previous
    return indexed_dataset


def _megatron_documents(prefix: str | Path) -> tuple[list[np.ndarray], np.dtype]:
    """Every document of a prefix as Megatron-Core reads it (its sequences joined), and the dtype it reads."""
    ds = _indexed().IndexedDataset(str(prefix))
    bounds = ds.document_indices
    docs = [np.concatenate([ds[s] for s in range(int(bounds[d]), int(bounds[d + 1]))]) for d in range(len(bounds) - 1)]
    return docs, ds[0].dtype


def _build_megatron(prefix: Path, docs: list[list[np.ndarray]], dtype: type = np.uint16) -> None:
    """A prefix written by Megatron-Core's builder; each document is one or more sequences (sentence splitting)."""
    import torch

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = _indexed().IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for sequences in docs:
        for ids in sequences:
            builder.add_item(torch.tensor(ids))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


def _random_documents(n: int, low: int, high: int, seed: int) -> list[list[np.ndarray]]:
    """`n` documents of ids in [low, high); every third one split in two sequences as preprocess_data.py's
    --split-sentences writes them."""
    rng = np.random.default_rng(seed)
    docs = []
    for d in range(n):
        ids = rng.integers(low, high, size=int(rng.integers(20, 150)))
        docs.append([ids[:7], ids[7:]] if d % 3 == 0 else [ids])
    return docs


def _check(spec: DeploymentSpec, tmp_path: Path) -> CheckedDataset:
    checked = check_dataset_url(spec.data, spec.model.vocab_size, spec.storage, str(tmp_path / "reports"))
    assert checked.validation["success"] and checked.validation["evaluated_expectations"] > 0, checked.validation
    return checked


def _train(cfg: TrainConfig) -> RunOutput:
    """Run the trainer as one plain process on `cfg` (the data step's dataset); returns its output."""
    out = Path(cfg.run.output_url)
    out.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(out / "run.json")
    proc = run_group([sys.executable, "-m", "training.train", "--config", str(out / "run.json")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return RunOutput(out)


def _assert_trained(output: RunOutput) -> None:
    result = output.result()
    assert result is not None and result.steps == STEPS
    losses = [output.metrics(0)[step].loss for step in range(1, STEPS + 1)]
    assert all(np.isfinite(losses)) and np.isfinite(result.val_loss)


def _short(overrides: dict[str, Any]) -> dict[str, Any]:
    return {"run": {"steps": STEPS, "log_every_steps": 1}, "checkpoint": {"save_every_steps": 100}, **overrides}


@pytest.mark.parametrize(("vocab_size", "dtype"), [(VOCAB, "uint16"), (70_000, "int32")])
def test_megatron_core_reads_our_shards_document_for_document(tmp_path: Path, vocab_size: int, dtype: str) -> None:
    rng = np.random.default_rng(vocab_size)
    eos = vocab_size - 1
    written: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    with DatasetWriter(str(tmp_path / "ds"), vocab_size, TokenizerInfo(kind="unknown"), eos, shard_tokens=8192) as w:
        for d in range(300):
            split = "val" if d % 10 == 0 else "train"
            ids = rng.integers(0, vocab_size - 1, size=int(rng.integers(1, 120)))
            w.add_document(split, ids)
            written[split].append(np.append(ids, eos))
    manifest = read_manifest(str(tmp_path / "ds"))
    assert manifest.dtype == dtype and len(manifest.splits["train"].shards) > 1
    for split, expected in written.items():
        read: list[np.ndarray] = []
        for shard in manifest.splits[split].shards:
            docs, read_dtype = _megatron_documents(tmp_path / "ds" / shard.prefix)
            assert len(docs) == shard.n_docs and read_dtype == np.dtype(dtype)
            read += docs
        assert len(read) == len(expected)
        for ours, theirs in zip(expected, read, strict=True):
            assert theirs.tolist() == ours.tolist()


def test_megatron_core_reads_a_dataset_of_the_preparation_step(tmp_path: Path) -> None:
    texts = [f"Document {n}: " + " ".join(f"word{(n * 7 + k) % 53}" for k in range(5 + n % 40)) for n in range(80)]
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = PrepareConfig(
        output_url=str(tmp_path / "store"),
        sources=[{"url": str(source)}],
        tokenizer={"kind": "bytes"},
        shard_tokens=2048,
        workers=1,
    )
    result = prepare_dataset(cfg, StorageConfig(), validate=False)
    manifest = read_manifest(result.dataset_url)
    assert result.cleaning["kept"] == len(texts) and len(manifest.splits["train"].shards) > 1
    decoded = []
    for split in manifest.splits.values():
        for shard in split.shards:
            docs, dtype = _megatron_documents(Path(result.dataset_url) / shard.prefix)
            assert dtype == np.uint16 and len(docs) == shard.n_docs
            assert sum(d.size for d in docs) == shard.n_tokens
            assert all(d[-1] == manifest.eos_id and manifest.eos_id not in d[:-1] for d in docs)
            decoded += [bytes(d[:-1].astype(np.uint8)).decode() for d in docs]
    assert sorted(decoded) == sorted(texts)


def test_a_prefix_megatron_core_wrote_is_adopted_and_trained_on_as_megatron_reads_it(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    prefix = tmp_path / "megatron" / "corpus_text_document"
    _build_megatron(prefix, _random_documents(120, 0, VOCAB, seed=1))
    spec = make_spec(_short({"data": {"dataset_url": str(prefix), "val_fraction": 0.1}}))
    checked = _check(spec, tmp_path)
    assert checked.sources == [str(prefix)]
    manifest = read_manifest(checked.dataset_url, trusted=checked.sources)
    (train,), (val,) = manifest.splits["train"].shards, manifest.splits["val"].shards
    assert (train.prefix, train.docs, val.docs) == (str(prefix), (0, 108), (108, 120))
    assert not list(prefix.parent.glob("*.json"))  # nothing written beside the user's files

    docs, _ = _megatron_documents(prefix)
    for split, (first, end) in (("train", (0, 108)), ("val", (108, 120))):
        stream = np.concatenate(docs[first:end])
        data = TokenDataset(checked.dataset_url, split, SEQ, trusted=checked.sources)
        assert len(data) == (stream.size - 1) // SEQ
        ours = np.concatenate([data.sample(j)[:SEQ] for j in range(len(data))])
        assert ours.tolist() == stream[: len(data) * SEQ].tolist()

    cfg = training_config(spec, DataResult.of_checked(checked))
    assert (cfg.data.dataset_url, cfg.data.sources) == (checked.dataset_url, [str(prefix)])
    output = _train(cfg)
    _assert_trained(output)
    data = TokenDataset(checked.dataset_url, "train", SEQ, trusted=checked.sources)
    stream = np.concatenate(docs[:108])
    fed = [j for record in output.samples(0).values() for j in record["indices"]]
    assert len(fed) == STEPS * spec.parallel.micro_batch
    for j in fed:  # what the trainer was fed is Megatron's documents 0..108
        assert data.sample(j).tolist() == stream[j * SEQ : j * SEQ + SEQ + 1].tolist()


def test_a_megatron_style_weight_list_of_two_prefixes_is_adopted_as_one_blend(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    a, b = tmp_path / "a" / "web_text_document", tmp_path / "b" / "code_text_document"
    _build_megatron(a, _random_documents(60, 97, 107, seed=2))
    _build_megatron(b, _random_documents(40, 65, 75, seed=3))
    spec = make_spec({"data": {"dataset_url": [0.3, str(a), 0.7, str(b)], "val_fraction": 0.1}})
    checked = _check(spec, tmp_path)
    assert checked.sources == [str(a), str(b)]
    manifest = read_manifest(checked.dataset_url, trusted=checked.sources)
    assert [(s.url, s.weight, s.kind) for s in manifest.blend] == [(str(a), 0.3, "megatron"), (str(b), 0.7, "megatron")]
    shards = {n: [(s.prefix, s.docs, s.source) for s in split.shards] for n, split in manifest.splits.items()}
    assert shards == {
        "train": [(str(a), (0, 54), 0), (str(b), (0, 36), 1)],
        "val": [(str(a), (54, 60), 0), (str(b), (36, 40), 1)],
    }
    data = TokenDataset(checked.dataset_url, "train", SEQ, trusted=checked.sources)
    expected = [(sum(d.size for d in _megatron_documents(p)[0][:cut]) - 1) // SEQ for p, cut in ((a, 54), (b, 36))]
    assert data.source_samples == expected
    assert int(data.sample(0).min()) >= 97 and int(data.sample(len(data) - 1).max()) < 75


def _save_hf(folder: Path, splits: dict[str, dict[str, list[Any]]]) -> str:
    """A Hugging Face dataset saved with save_to_disk: a Dataset for one split named train, else a DatasetDict."""
    import datasets

    made = {name: datasets.Dataset.from_dict(columns) for name, columns in splits.items()}
    (made["train"] if list(made) == ["train"] else datasets.DatasetDict(made)).save_to_disk(str(folder))
    return str(folder)


def _token_rows(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(10, 120))).tolist() for _ in range(n)]


def _adopted_rows(checked: CheckedDataset, split: str) -> list[list[int]]:
    """Every document of a split of the adopted dataset, as Megatron-Core reads its shards."""
    manifest = read_manifest(checked.dataset_url, trusted=checked.sources)
    return [
        doc.tolist()
        for shard in manifest.splits[split].shards
        for doc in _megatron_documents(Path(checked.dataset_url) / shard.prefix)[0]
    ]


def test_a_hugging_face_dataset_of_token_ids_is_adopted_by_copying_its_ids_and_trained_on(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    rows = _token_rows(100, seed=4)
    folder = _save_hf(tmp_path / "hf-ids", {"train": {"input_ids": rows, "label": list(range(100))}})
    spec = make_spec(_short({"data": {"dataset_url": folder, "val_fraction": 0.1}}))
    checked = _check(spec, tmp_path)
    assert checked.sources == []  # copied into the adopted folder: nothing outside it is named
    manifest = read_manifest(checked.dataset_url)
    assert (manifest.tokenizer.kind, manifest.eos_id, manifest.dtype) == ("unknown", None, "uint16")
    assert manifest.blend is None and manifest.meta["adopted"] == [{"url": folder, "kind": "hf"}]
    assert _adopted_rows(checked, "train") == rows[:90]  # the rows' ids exactly: no tokenizer, no EOS added
    assert _adopted_rows(checked, "val") == rows[90:]

    output = _train(training_config(spec, DataResult.of_checked(checked)))
    _assert_trained(output)


def test_a_hugging_face_dataset_dict_gives_its_validation_split_for_evaluation(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    train, validation = _token_rows(40, seed=5), _token_rows(7, seed=6)
    folder = _save_hf(tmp_path / "hf-dict", {"train": {"input_ids": train}, "validation": {"input_ids": validation}})
    checked = _check(make_spec({"data": {"dataset_url": folder, "val_fraction": 0.5}}), tmp_path)
    assert _adopted_rows(checked, "train") == train  # none of the train rows held out
    assert _adopted_rows(checked, "val") == validation


def test_a_hugging_face_dataset_of_text_given_as_dataset_url_is_refused_naming_the_prepare_route(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    folder = _save_hf(tmp_path / "hf-text", {"train": {"text": ["a document of text to tokenize"] * 4}})
    with pytest.raises(UserError) as caught:
        check_dataset_url(make_spec({"data": {"dataset_url": folder}}).data, VOCAB, StorageConfig(), str(tmp_path))
    message = str(caught.value)
    assert f"data.dataset_url={folder}: " in message and "no column of token ids" in message
    assert "data.prepare.sources with format: hf" in message
    assert not (tmp_path / "datasets").exists() or not list((tmp_path / "datasets").rglob("manifest.json"))


def test_a_hugging_face_dataset_of_text_is_prepared_from_data_prepare_sources_and_trained_on(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    texts = [f"Text {n}: " + " ".join(f"token{(n * 11 + k) % 31}" for k in range(8 + n % 30)) for n in range(60)]
    folder = _save_hf(tmp_path / "hf-corpus", {"train": {"text": texts, "id": list(range(60))}})
    prepare = {"output_url": str(tmp_path / "store"), "sources": [{"url": folder, "format": "hf"}],
               "tokenizer": {"kind": "bytes"}, "workers": 1}  # fmt: skip
    spec = make_spec(_short({"data": {"dataset_url": None, "prepare": prepare}}))
    result = prepare_dataset(spec.data.prepare, spec.storage, validate=False)
    assert result.cleaning["kept"] == len(texts)
    manifest = read_manifest(result.dataset_url)
    decoded = [
        bytes(doc[:-1].astype(np.uint8)).decode()
        for split in manifest.splits.values()
        for shard in split.shards
        for doc in _megatron_documents(Path(result.dataset_url) / shard.prefix)[0]
    ]
    assert sorted(decoded) == sorted(texts)
    _assert_trained(_train(spec.training_config(result.dataset_url, result.tokenizer_sha256)))
