"""The content address of a prepared dataset covers every setting (and code version) that changes a token,
and nothing that does not."""

from __future__ import annotations

import copy
import importlib.metadata
import unicodedata
from typing import Any

import pytest
from pydantic import BaseModel

from tasks.prepare import pipeline
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import NOT_TOKEN_SETTINGS, dataset_key
from tasks.prepare.sources import SourceFile

BASE = {
    "output_url": "/tmp/datasets",
    "sources": [{"url": "/data/a.jsonl"}],
    "builtin_corpus": "python-docs",
}

# Every leaf setting of data.prepare, with another valid value: one list per kind, so that a new setting
# fails test_every_setting_is_classified until someone decides whether it changes the tokens.
CHANGES_TOKENS: dict[str, Any] = {
    "sources.0.url": "/data/b.jsonl",
    "sources.0.format": "txt",
    "sources.0.text_field": "body",
    "sources.0.txt_documents": "blank_line",
    "builtin_corpus": None,
    "builtin_max_bytes": 2_000_000,
    "cleaning.unicode_normalization": "NFKC",
    "cleaning.min_chars": 10,
    "cleaning.max_chars": 500_000,
    "cleaning.dedup": False,
    "cleaning.invalid_utf8": "replace",
    "cleaning.near_dup": {"threshold": 0.9},
    "val_fraction": 0.1,
    "tokenizer.kind": "bytes",
    "tokenizer.path": "/tokenizers/tokenizer.json",
    "tokenizer.vocab_size": 8192,
    "tokenizer.min_frequency": 3,
    "tokenizer.eos_token": "</s>",
    "token_dtype": "int32",
    "shard_tokens": 1 << 20,
}
NO_TOKEN_CHANGE: dict[str, Any] = {
    "output_url": "/elsewhere/datasets",
    "workers": 4,
    "batch_documents": 64,
    "expectations.max_duplicate_fraction": 0.1,
    "expectations.max_near_duplicate_fraction": 0.1,
    "expectations.max_invalid_utf8_fraction": 0.5,
    "expectations.max_dropped_fraction": 0.2,
    "expectations.min_documents": 99,
    "expectations.min_val_documents": 7,
}


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field (a list of models counts as its first item: `sources.0.url`)."""
    out = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = info.annotation
        item = getattr(annotation, "__args__", (None,))[0] if getattr(annotation, "__origin__", None) is list else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += _leaves(annotation, f"{path}.")
        elif isinstance(item, type) and issubclass(item, BaseModel):
            out += _leaves(item, f"{path}.0.")
        else:
            out.append(path)
    return out


def _with(path: str, value: Any) -> PrepareConfig:
    data = copy.deepcopy(PrepareConfig.model_validate(BASE).model_dump())
    node: Any = data
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node[part]
    node[parts[-1]] = value
    return PrepareConfig.model_validate(data)


def _files(cfg: PrepareConfig, fingerprint: str = "/data/a.jsonl:size=10:mtime=1") -> list[SourceFile]:
    return [SourceFile("/data/a.jsonl", "jsonl", cfg.sources[0], fingerprint)]


def _key(cfg: PrepareConfig) -> str:
    return dataset_key(cfg, _files(cfg), None)


# data.prepare.images makes an image dataset, keyed by tasks/prepare/images.py over every image setting
# (tests/unit/prepare/test_image_prepare.py); a text configuration refuses it beside its sources.
OTHER_DATASET_KIND = {"images"}


def test_every_setting_is_classified_as_changing_the_tokens_or_not() -> None:
    leaves = set(_leaves(PrepareConfig)) - OTHER_DATASET_KIND
    assert leaves == set(CHANGES_TOKENS) | set(NO_TOKEN_CHANGE), sorted(
        leaves ^ (set(CHANGES_TOKENS) | set(NO_TOKEN_CHANGE))
    )
    assert {path.split(".")[0] for path in NO_TOKEN_CHANGE} == NOT_TOKEN_SETTINGS


@pytest.mark.parametrize(("path", "value"), sorted(CHANGES_TOKENS.items()))
def test_each_setting_that_changes_the_tokens_changes_the_key(path: str, value: Any) -> None:
    base = PrepareConfig.model_validate(BASE)
    assert _with(path, value) != base
    assert _key(_with(path, value)) != _key(base), path


@pytest.mark.parametrize(("path", "value"), sorted(NO_TOKEN_CHANGE.items()))
def test_a_setting_that_cannot_change_a_token_leaves_the_key_alone(path: str, value: Any) -> None:
    base = PrepareConfig.model_validate(BASE)
    assert _with(path, value) != base
    assert _key(_with(path, value)) == _key(base), path


def test_an_input_files_content_and_a_given_tokenizer_file_change_the_key() -> None:
    cfg = PrepareConfig.model_validate(BASE)
    assert dataset_key(cfg, _files(cfg, "/data/a.jsonl:size=11:mtime=2"), None) != _key(cfg)
    assert dataset_key(cfg, _files(cfg), "a" * 64) != dataset_key(cfg, _files(cfg), "b" * 64)


def test_a_new_tokenizers_library_changes_the_key_of_a_bpe_dataset_only(monkeypatch: pytest.MonkeyPatch) -> None:
    bpe, raw = PrepareConfig.model_validate(BASE), _with("tokenizer.kind", "bytes")
    before = _key(bpe), _key(raw)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0" if name == "tokenizers" else real(name))
    assert _key(bpe) != before[0]  # BPE training and encoding may differ between releases
    assert _key(raw) == before[1]  # bytes need no tokenizer library


def test_other_unicode_tables_change_the_key_while_normalization_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    normalized, plain = PrepareConfig.model_validate(BASE), _with("cleaning.unicode_normalization", None)
    before = _key(normalized), _key(plain)
    monkeypatch.setattr(unicodedata, "unidata_version", "1.0.0")
    assert _key(normalized) != before[0] and _key(plain) == before[1]


def test_a_new_pipeline_version_changes_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = PrepareConfig.model_validate(BASE)
    before = _key(cfg)
    monkeypatch.setattr(pipeline, "PIPELINE_VERSION", pipeline.PIPELINE_VERSION + 1)
    assert _key(cfg) != before
