"""The tokenizer of adopted token ids (data.tokenizer_url): copied beside the adopted manifest, ids held against
its vocabulary, named by the run's model card, shipped by the export; refused where it cannot be the ids' own."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tasks.prepare.step import DataResult, training_config
from tasks.errors import UserError
from tasks.prepare.config import TokenizerConfig
from tasks.prepare.existing import CheckedDataset, check_dataset_url
from tasks.prepare.tokenizer import TextTokenizer, train_bpe
from tasks.spec import DeploymentSpec, SpecError
from tests.processes import run_group
from training.dataset import DatasetWriter, read_manifest
from training.indexed import encode_index
from training.run_output import RunOutput

pytestmark = pytest.mark.integration

MODEL_VOCAB = 320
TEXTS = [
    f"Record {n}: the {['quick', 'lazy', 'brown'][n % 3]} fox jumps over {n % 11} dogs; déjà vu {n * 7}."
    for n in range(120)
]


def _bpe(tmp_path: Path, vocab_size: int = 300, name: str = "tokenizer.json") -> tuple[Path, TextTokenizer]:
    tokenizer = train_bpe(TEXTS, TokenizerConfig(vocab_size=vocab_size, min_frequency=1))
    path = tmp_path / "tok" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tokenizer.json_text or "")
    return path, tokenizer


def _ids_dataset(tmp_path: Path, rows: list[list[int]]) -> str:
    """A Hugging Face dataset (save_to_disk) of token-id rows."""
    import datasets

    folder = tmp_path / "hf-ids"
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(folder))
    return str(folder)


def _megatron(prefix: Path, docs: list[np.ndarray]) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    (prefix.parent / (prefix.name + ".bin")).write_bytes(np.concatenate(docs).astype("uint16").tobytes())
    index = encode_index("uint16", np.array([d.size for d in docs]), np.arange(len(docs) + 1))
    (prefix.parent / (prefix.name + ".idx")).write_bytes(index)


def _spec(make_spec: Callable[..., DeploymentSpec], data: dict[str, Any], **model: Any) -> DeploymentSpec:
    return make_spec(
        {
            "model": {"vocab_size": MODEL_VOCAB, **model},
            "data": data,
            "run": {"steps": 4, "log_every_steps": 1},
            "checkpoint": {"save_every_steps": 100},
        }
    )


def _check(spec: DeploymentSpec, tmp_path: Path) -> CheckedDataset:
    return check_dataset_url(spec.data, spec.model.vocab_size, spec.storage, str(tmp_path / "reports"))


def test_adopted_ids_with_their_tokenizer_train_and_export_a_model_that_decodes_them(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    import transformers

    from tasks.export.step import export_checkpoint

    tok_path, tokenizer = _bpe(tmp_path)
    rows = [ids.tolist() for ids in tokenizer.encode_batch(TEXTS)]
    folder = _ids_dataset(tmp_path, rows)
    sha = hashlib.sha256(tok_path.read_bytes()).hexdigest()
    spec = _spec(
        make_spec,
        {"dataset_url": folder, "tokenizer_url": str(tok_path), "tokenizer_sha256": sha, "val_fraction": 0.1},
    )
    checked = _check(spec, tmp_path)
    assert checked.validation["success"] and checked.tokenizer_sha256 == sha
    manifest = read_manifest(checked.dataset_url)
    assert (manifest.tokenizer.kind, manifest.tokenizer.path, manifest.tokenizer.sha256) == (
        "bpe",
        "tokenizer.json",
        sha,
    )
    assert manifest.vocab_size == tokenizer.vocab_size == 300  # ids held against the tokenizer, not the model
    copied = Path(checked.dataset_url) / "tokenizer.json"
    assert copied.read_bytes() == tok_path.read_bytes()
    assert _check(spec, tmp_path).dataset_url == checked.dataset_url  # the same adoption is reused

    cfg = training_config(spec, DataResult.of_checked(checked))
    out = Path(cfg.run.output_url)
    out.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(out / "run.json")
    proc = run_group([sys.executable, "-m", "training.train", "--config", str(out / "run.json")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert RunOutput(out).result().steps == 4

    tok_path.unlink()  # the run's card names the adopted copy, not the user's file
    result = export_checkpoint(cfg, out=tmp_path / "hf")
    assert "tokenizer.json" in result.files
    loaded = transformers.AutoTokenizer.from_pretrained(result.model_dir)
    for text, ids in zip(TEXTS[:5], rows[:5], strict=True):
        assert loaded(text)["input_ids"] == ids
        assert loaded.decode(ids) == text


def test_a_tokenizer_larger_than_the_model_is_refused_naming_both(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    tok_path, _ = _bpe(tmp_path, vocab_size=300)
    folder = _ids_dataset(tmp_path, [[1, 2, 3]] * 10)
    spec = _spec(make_spec, {"dataset_url": folder, "tokenizer_url": str(tok_path)}, vocab_size=290)
    with pytest.raises(UserError, match=r"data\.tokenizer_url=.*tokenizer\.json: the tokenizer has 300 tokens, more "
                       r"than model\.vocab_size=290") as caught:  # fmt: skip
        _check(spec, tmp_path)
    assert "model.vocab_size >= 300" in caught.value.fix
    assert not list((tmp_path / "reports").rglob("manifest.json"))


def test_ids_beyond_the_tokenizers_vocabulary_are_refused_though_the_model_has_room(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    tok_path, _ = _bpe(tmp_path, vocab_size=300)
    rows = [[5, 6, 7, 8]] * 10 + [[5, 310, 7]]  # 310 < model.vocab_size=320, but no token of this tokenizer
    spec = _spec(make_spec, {"dataset_url": _ids_dataset(tmp_path, rows), "tokenizer_url": str(tok_path)})
    with pytest.raises(UserError, match=r"row 10 of split train holds token id 310, outside the vocabulary of "
                       r"data\.tokenizer_url \(300 tokens\)"):  # fmt: skip
        _check(spec, tmp_path)

    prefix = tmp_path / "mega" / "corpus"
    docs = [np.arange(5, 60) for _ in range(20)]
    docs[4][3] = 310
    _megatron(prefix, docs)
    spec = _spec(make_spec, {"dataset_url": str(prefix), "tokenizer_url": str(tok_path)})
    with pytest.raises(UserError, match=r"token id 310 at position \d+ of .*corpus\.bin >= .*300"):
        _check(spec, tmp_path)


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, r"no such file"), (b'{"not": "a tokenizer"}', r"not a tokenizers JSON file"), (b"\xff\xfe", r"not a tok")],
)
def test_a_tokenizer_url_that_is_not_a_tokenizer_is_refused(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path, content: bytes | None, expected: str
) -> None:
    path = tmp_path / "given.json"
    if content is not None:
        path.write_bytes(content)
    spec = _spec(make_spec, {"dataset_url": _ids_dataset(tmp_path, [[1, 2]] * 10), "tokenizer_url": str(path)})
    with pytest.raises(UserError, match=rf"data\.tokenizer_url={path}: {expected}") as caught:
        _check(spec, tmp_path)
    assert "tokenizer.json" in caught.value.fix


def test_a_tokenizer_url_where_the_data_has_its_own_tokenizer_is_refused(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    tok_path, tokenizer = _bpe(tmp_path)
    with pytest.raises(SpecError, match=r"data\.tokenizer_url=.*data\.prepare has its own"):
        _spec(
            make_spec,
            {
                "dataset_url": None,
                "prepare": {"output_url": str(tmp_path / "s"), "builtin_corpus": "python-docs"},
                "tokenizer_url": str(tok_path),
            },
        )

    ours = tmp_path / "ours"
    with DatasetWriter(str(ours), 257, TextTokenizer("bytes").info(), 256) as writer:
        for n in range(30):
            writer.add_document("val" if n % 10 == 0 else "train", np.arange(n % 200, n % 200 + 40))
    spec = _spec(make_spec, {"dataset_url": str(ours), "tokenizer_url": str(tok_path)})
    with pytest.raises(UserError, match=r"data\.dataset_url=.*ours is a dataset tdeploy made, which records its own"):
        _check(spec, tmp_path)

    prefix = tmp_path / "mega" / "corpus"
    _megatron(prefix, [np.arange(5, 60) for _ in range(20)])
    spec = _spec(make_spec, {"dataset_url": [str(ours), str(prefix)], "tokenizer_url": str(tok_path)})
    with pytest.raises(UserError, match=r"data\.blend\[0\]\.url=.*ours was made with another tokenizer \(bytes"):
        _check(spec, tmp_path)


def test_a_blend_of_our_datasets_of_one_bpe_tokenizer_carries_that_tokenizer(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    from training.checkpoint import ModelCard

    tok_path, tokenizer = _bpe(tmp_path)
    ids = tokenizer.encode_batch(TEXTS)
    for name in ("a", "b"):
        folder = tmp_path / name
        with DatasetWriter(str(folder), tokenizer.vocab_size, tokenizer.info(), 0) as writer:
            for n, doc in enumerate(ids):
                writer.add_document("val" if n % 10 == 0 else "train", doc)
        (folder / "tokenizer.json").write_bytes(tok_path.read_bytes())
    spec = _spec(make_spec, {"dataset_url": [str(tmp_path / "a"), str(tmp_path / "b")]})
    checked = _check(spec, tmp_path)
    manifest = read_manifest(checked.dataset_url, trusted=checked.sources)
    assert (manifest.tokenizer.kind, manifest.tokenizer.sha256) == ("bpe", tokenizer.sha256)
    card = ModelCard.of_run(training_config(spec, DataResult.of_checked(checked)), manifest)
    assert card.tokenizer.url is not None and Path(card.tokenizer.url).read_bytes() == tok_path.read_bytes()


def test_a_spec_that_serves_adopted_ids_without_their_tokenizer_is_refused_before_the_job(
    make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    from tasks.prepare.step import check_served_data

    folder = _ids_dataset(tmp_path, [[5, 6, 7, 8]] * 10)
    servable = {"d_model": 64, "n_heads": 2, "n_kv_heads": 1}
    spec = _spec(make_spec, {"dataset_url": folder}, **servable).model_copy(update={"serve": None})
    data = DataResult.of_checked(_check(spec, tmp_path))
    check_served_data(spec, data)  # no serving: adopted ids without a tokenizer train

    serving = make_spec(
        {"model": {"vocab_size": MODEL_VOCAB, **servable}, "data": {"dataset_url": folder}, "serve": {}}
    )
    with pytest.raises(UserError, match=r"serve: the data \(.*hf-ids, adopted as .*\) names no tokenizer") as caught:
        check_served_data(serving, data)
    assert "data.tokenizer_url" in caught.value.fix

    tok_path, _ = _bpe(tmp_path)
    with_tokenizer = make_spec(
        {
            "model": {"vocab_size": MODEL_VOCAB, **servable},
            "data": {"dataset_url": folder, "tokenizer_url": str(tok_path)},
            "serve": {},
        }
    )
    check_served_data(with_tokenizer, DataResult.of_checked(_check(with_tokenizer, tmp_path)))
