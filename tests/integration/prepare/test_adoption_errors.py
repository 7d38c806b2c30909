"""Bad data given by URL is refused by the data step, before any job starts, naming the file, value and fix."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tasks.errors import UserError
from tasks.prepare.existing import check_dataset_url
from tasks.spec import DeploymentSpec, SpecError
from training.dataset import DatasetError, TokenDataset, read_manifest
from training.indexed import encode_index, parse_index

pytestmark = pytest.mark.integration


def _megatron(prefix: Path, docs: list[np.ndarray], dtype: str = "uint16") -> None:
    """A Megatron indexed dataset written the way Megatron's builder writes it: one sequence per document."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    (prefix.parent / (prefix.name + ".bin")).write_bytes(np.concatenate(docs).astype(dtype).tobytes())
    index = encode_index(dtype, np.array([d.size for d in docs]), np.arange(len(docs) + 1))
    (prefix.parent / (prefix.name + ".idx")).write_bytes(index)


def _docs(n: int = 40, top: int = 200) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, top, size=int(rng.integers(40, 90))) for _ in range(n)]


def _check(spec: DeploymentSpec, tmp_path: Path) -> object:
    return check_dataset_url(spec.data, spec.model.vocab_size, spec.storage, str(tmp_path / "reports"))


def test_a_good_megatron_prefix_is_adopted_in_place_with_its_last_documents_held_out(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    prefix = tmp_path / "mega" / "corpus_text_document"
    docs = _docs()
    _megatron(prefix, docs)
    spec = make_spec({"data": {"dataset_url": str(prefix), "val_fraction": 0.1}})
    checked = _check(spec, tmp_path)
    assert checked.sources == [str(prefix)] and checked.validation["success"]
    manifest = read_manifest(checked.dataset_url, trusted=checked.sources)
    (train,), (val,) = manifest.splits["train"].shards, manifest.splits["val"].shards
    assert (train.docs, val.docs) == ((0, 36), (36, 40))
    assert val.n_tokens == sum(d.size for d in docs[36:]) and train.first_token == 0
    assert not list((tmp_path / "mega").glob("*.json"))  # nothing is written beside the user's files
    data = TokenDataset(checked.dataset_url, "val", 16, trusted=checked.sources)
    stream = np.concatenate(docs[36:])
    assert data.sample(0).tolist() == stream[:17].tolist()


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("truncate_bin", r"corpus\.idx counts \d+ tokens of uint16 \(\d+ bytes\), the \.bin has \d+ bytes, truncated"),
        ("idx_counts", r"corpus\.idx has \d+ bytes, its counts \(41 sequences, 40 documents\) need \d+, truncated"),
        ("idx_header", r"corpus\.idx starts with b'NOTMEGA.*not Megatron's"),
        ("no_idx", r"corpus\.bin is there but .*corpus\.idx is missing"),
    ],
)
def test_a_damaged_megatron_dataset_is_refused_before_training_naming_the_file(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path, damage: str, expected: str
) -> None:
    prefix = tmp_path / "mega" / "corpus"
    _megatron(prefix, _docs())
    bin_path, idx_path = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
    if damage == "truncate_bin":
        bin_path.write_bytes(bin_path.read_bytes()[:-10])
    elif damage == "idx_counts":  # the header claims one more sequence than the file holds
        raw = bytearray(idx_path.read_bytes())
        raw[18:26] = (41).to_bytes(8, "little")
        idx_path.write_bytes(bytes(raw))
    elif damage == "idx_header":
        idx_path.write_bytes(b"NOTMEGA\x00\x00" + idx_path.read_bytes()[9:])
    else:
        idx_path.unlink()
    spec = make_spec({"data": {"dataset_url": str(prefix)}})
    with pytest.raises(UserError, match=expected) as caught:
        _check(spec, tmp_path)
    assert f"data.dataset_url={prefix}" in str(caught.value)
    assert not (tmp_path / "reports" / "datasets").exists() or not list((tmp_path / "reports").rglob("manifest.json"))


def test_ids_beyond_the_models_vocabulary_are_refused_by_the_token_suite(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    prefix = tmp_path / "mega" / "wide"
    docs = _docs()
    docs[3][5] = 300  # model.vocab_size is 257
    _megatron(prefix, docs)
    spec = make_spec({"data": {"dataset_url": str(prefix)}})
    with pytest.raises(UserError, match=r"token id 300 at position \d+ of .*wide\.bin >= model\.vocab_size=257"):
        _check(spec, tmp_path)


def test_a_shard_whose_index_disagrees_with_its_tokens_is_refused_when_training_opens_it(tmp_path: Path) -> None:
    from training.dataset import DatasetWriter, TokenizerInfo

    url = tmp_path / "ds"
    with DatasetWriter(str(url), 257, TokenizerInfo(kind="bytes"), eos_id=256) as writer:
        for doc in _docs(20):
            writer.add_document("train", doc)
    idx = url / "train" / "tokens-00000.idx"
    index = parse_index(idx.read_bytes())
    lengths = index.sequence_lengths.copy()
    manifest = json.loads((url / "manifest.json").read_text())
    import hashlib

    lengths[2] += 5  # the index (its digest put in the manifest) counts more tokens than the .bin holds
    forged = encode_index("uint16", lengths, index.document_indices)
    idx.write_bytes(forged)
    manifest["splits"]["train"]["shards"][0]["index_sha256"] = hashlib.sha256(forged).hexdigest()
    (url / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=r"tokens-00000\.idx counts \d+ tokens of uint16 .* the \.bin has"):
        TokenDataset(str(url), "train", 16, cache_dir=tmp_path / "cache")


def test_a_blend_whose_weights_sum_to_zero_is_a_spec_error(make_spec: Callable[..., DeploymentSpec]) -> None:
    with pytest.raises(SpecError, match=r"data\.blend=\[0\.0, 0\.0\]: the weights sum to 0"):
        make_spec({"data": {"dataset_url": [0, "/data/a", 0, "/data/b"]}})
    with pytest.raises(SpecError, match=r"alternates weight and path; the last weight has no path"):
        make_spec({"data": {"dataset_url": [0.5, "/data/a", 0.5]}})


def test_a_dataset_of_the_old_format_is_refused_with_the_command_that_converts_it(tmp_path: Path) -> None:
    from flows.cli import app

    url = tmp_path / "old"
    (url / "train").mkdir(parents=True)
    docs = _docs(30)
    tokens = np.concatenate([np.append(d, 256) for d in docs]).astype("<u2")
    offsets = np.concatenate(([0], np.cumsum([d.size + 1 for d in docs]))).astype("<i8")
    (url / "train" / "tokens-00000.bin").write_bytes(tokens.tobytes())
    (url / "train" / "docs-00000.idx").write_bytes(offsets.tobytes())
    import hashlib

    shard = {
        "tokens": "train/tokens-00000.bin", "index": "train/docs-00000.idx", "n_tokens": int(tokens.size),
        "n_docs": len(docs), "tokens_sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
        "index_sha256": hashlib.sha256(offsets.tobytes()).hexdigest(),
    }  # fmt: skip
    split = {"n_tokens": int(tokens.size), "n_docs": len(docs), "shards": [shard]}
    old = {"format_version": 1, "vocab_size": 257, "dtype": "uint16", "eos_id": 256, "tokenizer": {"kind": "bytes"},
           "splits": {"train": split}, "meta": {}}  # fmt: skip
    (url / "manifest.json").write_text(json.dumps(old))
    with pytest.raises(DatasetError, match=rf"format_version=1 .* tdeploy convert-dataset {url}"):
        TokenDataset(str(url), "train", 16)

    result = CliRunner().invoke(app, ["convert-dataset", str(url)])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(str(url))
    assert manifest.format_version == 2 and manifest.splits["train"].shards[0].prefix == "train/tokens-00000"
    assert not (url / "train" / "docs-00000.idx").exists()
    assert (url / "train" / "tokens-00000.bin").read_bytes() == tokens.tobytes()  # the tokens stay as they were
    index = parse_index((url / "train" / "tokens-00000.idx").read_bytes())
    assert index.document_offsets().tolist() == offsets.tolist()
    data = TokenDataset(str(url), "train", 16, cache_dir=tmp_path / "cache")
    assert data.sample(1).tolist() == tokens[16:33].tolist()
