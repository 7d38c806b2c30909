"""The ViT classifier's export mapping: config.json and preprocessor_config.json from the model and the dataset's
class names, one name table both ways, and what ViTForImageClassification cannot express refused with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.export import vit
from tasks.export.hf import ExportError
from tasks.export.step import export_checkpoint
from training.checkpoint import KEY_ENV, CardTokenizer, CheckpointManager, ModelCard
from training.config import ModelConfig, TrainConfig
from training.image_dataset import write_image_dataset
from training.vision import VisionTransformer

VISION = {"image_size": 32, "patch_size": 8, "n_layers": 3, "d_model": 48, "n_heads": 3, "ffn_hidden": 96,
          "norm_eps": 1e-5, "num_classes": 4}  # fmt: skip
CLASSES = ["apple", "pear", "plum", "fig"]


def _vit(**vision: object) -> ModelConfig:
    return ModelConfig.model_validate({"kind": "vit", "vision": {**VISION, **vision}})


def test_config_json_maps_the_encoder_and_labels_the_classes_with_the_datasets_names() -> None:
    config = vit.vit_config(_vit(), CLASSES, "bfloat16")
    assert config["architectures"] == ["ViTForImageClassification"] and config["model_type"] == "vit"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (48, 3, 3)
    assert (config["intermediate_size"], config["layer_norm_eps"]) == (96, 1e-5)
    assert (config["image_size"], config["patch_size"], config["num_channels"]) == (32, 8, 3)
    assert config["hidden_act"] == "gelu" and config["qkv_bias"] is True
    assert config["hidden_dropout_prob"] == 0.0 and config["attention_probs_dropout_prob"] == 0.0
    assert config["id2label"] == {"0": "apple", "1": "pear", "2": "plum", "3": "fig"}
    assert config["label2id"] == {"apple": 0, "pear": 1, "plum": 2, "fig": 3}
    assert config["torch_dtype"] == "bfloat16"
    transformers = pytest.importorskip("transformers")
    read = transformers.ViTConfig.from_dict(config)  # transformers reads every field as written
    assert read.num_labels == 4 and read.id2label[2] == "plum" and read.layer_norm_eps == 1e-5


def test_preprocessor_config_is_the_models_own_pixel_normalisation() -> None:
    processor = vit.preprocessor_config(_vit().vision)  # type: ignore[arg-type]
    assert processor["image_processor_type"] == "ViTImageProcessor"
    assert processor["size"] == {"height": 32, "width": 32} and processor["resample"] == 2  # PIL bilinear
    assert processor["do_rescale"] and processor["rescale_factor"] == 1 / 255
    assert processor["do_normalize"] and processor["image_mean"] == processor["image_std"] == [0.5, 0.5, 0.5]


def test_every_parameter_maps_to_a_vit_name_and_back() -> None:
    model = VisionTransformer(_vit().vision, 4)  # type: ignore[arg-type]
    names = [name for name, _ in model.named_parameters()]
    theirs = [vit.hf_name(name) for name in names]
    assert len(set(theirs)) == len(names) and [vit.our_name(name) for name in theirs] == names
    assert vit.hf_name("blocks.2.attn.wk.bias") == "vit.encoder.layer.2.attention.attention.key.bias"
    assert vit.hf_name("blocks.0.attn.wo.weight") == "vit.encoder.layer.0.attention.output.dense.weight"
    assert vit.hf_name("blocks.1.mlp.w2.weight") == "vit.encoder.layer.1.output.dense.weight"
    assert vit.hf_name("patch_embed.bias") == "vit.embeddings.patch_embeddings.projection.bias"
    assert vit.hf_name("cls_token") == "vit.embeddings.cls_token" and vit.hf_name("head.weight") == "classifier.weight"
    with pytest.raises(ExportError, match=r"tensor=tok_emb.weight: is not a parameter of training/vision.py"):
        vit.hf_name("tok_emb.weight")
    with pytest.raises(ValueError, match="model.embed_tokens.weight: not a ViTForImageClassification tensor"):
        vit.our_name("model.embed_tokens.weight")


def test_a_language_model_is_refused_naming_the_kind_and_the_exporter_to_use() -> None:
    lm = ModelConfig(n_layers=2, d_model=32, n_heads=2, ffn_hidden=64, vocab_size=300, seq_len=16)
    with pytest.raises(ExportError) as caught:
        vit.vit_config(lm, CLASSES)
    message = str(caught.value)
    assert message.startswith("model.kind=lm: is not a ViT classifier") and "export_checkpoint" in message


def test_what_vit_for_image_classification_cannot_express_is_refused_with_the_fix() -> None:
    mean = _vit(pooling="mean")
    with pytest.raises(ExportError, match=r"model.vision.pooling=mean: .* train the classifier with model.vision."
                       r"pooling: cls"):  # fmt: skip
        vit.vit_config(mean, CLASSES)
    with pytest.raises(ExportError, match=r"model.vision.num_classes=4: the dataset names 3 classes \(apple, pear, plum"):
        vit.vit_config(_vit(), CLASSES[:3])
    with pytest.raises(ExportError, match="holds a name twice"):
        vit.vit_config(_vit(), ["a", "b", "a", "c"])


def test_export_refuses_a_dataset_of_another_class_count_before_writing(tmp_path: Path, monkeypatch) -> None:
    import numpy as np

    monkeypatch.delenv(KEY_ENV, raising=False)
    dataset = str(tmp_path / "images")
    images = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    write_image_dataset(dataset, None, {"train": (images, np.array([0, 1], dtype=np.int32))}, kind="labels",
                        source_fingerprint="t", num_classes=2, class_names=["a", "b"])  # fmt: skip
    train = TrainConfig.model_validate({
        "model": _vit().model_dump(), "parallel": {"micro_batch": 2}, "optim": {"lr_peak": 1e-3},
        "data": {"dataset_url": dataset}, "checkpoint": {"url": str(tmp_path / "ck")},
        "run": {"steps": 10, "output_url": str(tmp_path / "out")},
    })  # fmt: skip
    model = VisionTransformer(train.model.vision, 4)  # type: ignore[arg-type]
    card = ModelCard(model=train.model, vocab_size=4, eos_id=None, dataset_url=dataset,
                     tokenizer=CardTokenizer(kind="unknown"))  # fmt: skip
    manager = CheckpointManager(train.checkpoint, train.storage, card=card.model_dump(mode="json"))
    manager.save(1, model, torch.optim.SGD(model.parameters(), lr=0.1), {"step": 1})
    with pytest.raises(ExportError, match=r"is a labels dataset of 2 classes; the classifier has 4"):
        export_checkpoint(train, out=tmp_path / "export" / "hf")
    assert not (tmp_path / "export").exists()
