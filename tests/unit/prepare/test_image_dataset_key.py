"""The content address of a prepared image dataset (tasks/prepare/images.py image_key) covers every image setting,
the validation thresholds too (a refused dataset's report lives under its key, so a looser bound must validate
again rather than reuse it), the tokenizer for captions, and none of the text corpus's settings."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tasks.prepare.config import ImagePrepareConfig, PrepareConfig
from tasks.prepare.images import Source, image_key

LABELS = {"output_url": "/tmp/datasets",
          "images": {"kind": "hf", "path": "/data/pets", "label_column": "label", "image_size": 32}}  # fmt: skip
CAPTIONS = {"output_url": "/tmp/datasets", "tokenizer": {"kind": "bytes"},
            "images": {"kind": "hf", "path": "/data/pets", "caption_column": "caption", "image_size": 32}}  # fmt: skip

# Every leaf of ImagePrepareConfig with another valid value (several paths where one change needs another), so
# that a new image setting fails test_every_image_setting_is_classified until someone puts it here.
CHANGES_IMAGES: dict[str, dict[str, Any]] = {
    "kind": {"images.kind": "webdataset", "images.label_column": "cls"},
    "path": {"images.path": "/data/other"},
    "image_column": {"images.image_column": "img"},
    "label_column": {"images.label_column": "class_id"},
    "caption_column": {"images.label_column": None, "images.caption_column": "text"},
    "class_names": {"images.class_names": ["cat", "dog"]},
    "num_classes": {"images.num_classes": 2},
    "image_size": {"images.image_size": 64},
    "val_fraction": {"images.val_fraction": 0.2},
    "seed": {"images.seed": 1},
    "max_caption_tokens": {"images.max_caption_tokens": 16},
    "shard_images": {"images.shard_images": 128},
    "min_side_px": {"images.min_side_px": 8},
    "near_dup_max_distance": {"images.near_dup_max_distance": None},
    "min_class_ratio": {"images.min_class_ratio": 0.5},
    "max_converted_fraction": {"images.max_converted_fraction": 0.5},
    "max_duplicate_fraction": {"images.max_duplicate_fraction": 0.1},
    "min_images": {"images.min_images": 99},
    "min_val_images": {"images.min_val_images": 7},
}
# Settings of the text path or of the run that cannot change an image or a label.
NO_IMAGE_CHANGE: dict[str, Any] = {
    "output_url": "/elsewhere/datasets",
    "workers": 4,
    "val_fraction": 0.3,
    "tokenizer.kind": "bytes",
    "token_dtype": "int32",
    "shard_tokens": 1 << 20,
    "cleaning.min_chars": 10,
    "expectations.min_documents": 99,
}
# Captions are token ids: the tokenizer's settings change them.
CHANGES_CAPTIONS: dict[str, Any] = {"tokenizer.kind": "bpe", "tokenizer.eos_token": "</s>"}


def _with(base: dict[str, Any], changes: dict[str, Any]) -> PrepareConfig:
    data = copy.deepcopy(base)
    for path, value in changes.items():
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return PrepareConfig.model_validate(data)


def _key(cfg: PrepareConfig, fingerprint: str = "/data/pets:size=10:mtime=1") -> str:
    return image_key(cfg, Source(images=[], class_names=None, num_classes=None, fingerprint=[fingerprint]), None)


def test_every_image_setting_is_classified() -> None:
    assert set(ImagePrepareConfig.model_fields) == set(CHANGES_IMAGES)


@pytest.mark.parametrize(("name", "changes"), sorted(CHANGES_IMAGES.items()))
def test_each_image_setting_changes_the_key(name: str, changes: dict[str, Any]) -> None:
    base = CAPTIONS if name == "max_caption_tokens" else LABELS
    changed = _with(base, changes)
    assert changed != PrepareConfig.model_validate(base)
    assert _key(changed) != _key(PrepareConfig.model_validate(base)), name


@pytest.mark.parametrize(("path", "value"), sorted(NO_IMAGE_CHANGE.items()))
def test_a_text_or_run_setting_leaves_a_labelled_datasets_key_alone(path: str, value: Any) -> None:
    changed = _with(LABELS, {path: value})
    assert changed != PrepareConfig.model_validate(LABELS)
    assert _key(changed) == _key(PrepareConfig.model_validate(LABELS)), path


@pytest.mark.parametrize(("path", "value"), sorted(CHANGES_CAPTIONS.items()))
def test_the_tokenizer_changes_a_caption_datasets_key(path: str, value: Any) -> None:
    assert _key(_with(CAPTIONS, {path: value})) != _key(PrepareConfig.model_validate(CAPTIONS)), path


def test_other_input_files_change_the_key() -> None:
    cfg = PrepareConfig.model_validate(LABELS)
    assert _key(cfg, "/data/pets:size=11:mtime=1") != _key(cfg)
