"""The planner over a ViT classifier: its parameters are the payload VisionTransformer's, its FLOPs those of
image tokens (the patch embedding on every patch, the classifier once per image)."""

from __future__ import annotations

import pytest
import torch

from tasks.capacity.compute import flops_per_token
from tasks.capacity.memory import MemoryModel, Precision
from tasks.capacity.params import Architecture, count_params
from training.config import ModelConfig
from training.layout import Layout
from training.vision import VisionTransformer

VISION = {"image_size": 32, "patch_size": 4, "n_layers": 3, "d_model": 48, "n_heads": 3, "ffn_hidden": 160,
          "num_classes": 7}  # fmt: skip


def _vit(**vision: object) -> ModelConfig:
    return ModelConfig.model_validate({"kind": "vit", "vision": {**VISION, **vision}})


@pytest.mark.parametrize("overrides", [{}, {"pooling": "mean"}, {"channels": 1, "patch_size": 8, "n_layers": 1}],
                         ids=["cls", "mean", "one-channel"])  # fmt: skip
def test_count_is_the_payload_vits_own_parameter_count(overrides: dict) -> None:
    cfg = _vit(**overrides)
    assert cfg.vision is not None
    with torch.device("meta"):
        model = VisionTransformer(cfg.vision, cfg.vision.num_classes)
    pc = count_params(Architecture.from_model_config(cfg))
    assert pc.total == sum(p.numel() for p in model.parameters())
    patch = cfg.vision.channels * cfg.vision.patch_size**2 * 48 + 48
    assert pc.embedding == patch + (48 if cfg.vision.pooling == "cls" else 0)  # the Conv2d and the class token
    assert pc.positions == cfg.vision.n_tokens * 48 and pc.head == 48 * 7 + 7


def test_flops_count_image_tokens_the_patch_embedding_and_one_classifier_row_per_image() -> None:
    cfg = _vit()
    arch = Architecture.from_model_config(cfg)
    h, f, layers, classes = 48, 160, 3, 7
    patches, tokens = (32 // 4) ** 2, (32 // 4) ** 2 + 1
    assert arch.seq_len == tokens and arch.patches == patches
    # one image's forward from the definition: 2 FLOPs per multiply-add (and per bias add)
    block = 2 * (4 * h * h + 4 * h + 2 * h * f + f + h) + 4 * tokens * h  # projections, MLP; QK^T and AV
    image = 2 * 3 * 16 * h * patches + tokens * layers * block + 2 * (h * classes + classes)
    assert flops_per_token(arch).forward * tokens == pytest.approx(image, rel=1e-12)
    assert flops_per_token(arch).model == 3 * flops_per_token(arch).forward


def test_a_vit_keeps_one_row_of_logits_per_image_not_per_token() -> None:
    def stored(classes: int) -> float:
        arch = Architecture.from_model_config(_vit(num_classes=classes))
        return MemoryModel(arch, Precision.of("fp32")).estimate(Layout(dp=1, micro_batch=8)).activations_stored

    # 8 images of 65 tokens: 8 rows of fp32 logits more for 990 more classes (a language model would keep 8 x 65)
    assert stored(1000) - stored(10) == 8 * 990 * 4


def test_vit_b_16_has_its_published_86_6m_parameters_and_17_6_giga_multiply_adds_per_image() -> None:
    # google/vit-base-patch16-224 (ViTForImageClassification, 1000 classes): 86,567,656 parameters; Dosovitskiy et
    # al. 2020 / timm: 17.6 GMACs per 224 px image
    cfg = ModelConfig.model_validate({"kind": "vit", "vision": {
        "image_size": 224, "patch_size": 16, "n_layers": 12, "d_model": 768, "n_heads": 12, "ffn_hidden": 3072,
        "num_classes": 1000}})  # fmt: skip
    arch = Architecture.from_model_config(cfg)
    assert count_params(arch).total == 86_567_656
    assert round(flops_per_token(arch).forward * arch.seq_len / 2 / 1e9, 1) == 17.6


def test_the_optimizers_shape_inventory_of_a_vit_adds_up_to_its_parameters() -> None:
    from math import prod

    from tasks.capacity.memory import param_shapes

    arch = Architecture.from_model_config(_vit())
    assert sum(prod(shape) * n for shape, n in param_shapes(arch)) == count_params(arch).total


def _vlm() -> ModelConfig:
    vision = {"image_size": 32, "patch_size": 8, "n_layers": 2, "d_model": 48, "n_heads": 3, "ffn_hidden": 96,
              "pooling": "mean", "projector_hidden": 80}  # fmt: skip
    return ModelConfig.model_validate({"kind": "vlm", "vision": vision, "n_layers": 2, "d_model": 64, "n_heads": 4,
                                       "ffn_hidden": 172, "vocab_size": 257, "seq_len": 16 + 12})  # fmt: skip


def test_a_vlms_count_is_the_payload_models_encoder_projector_and_language_model() -> None:
    from math import prod

    from tasks.capacity.memory import param_shapes
    from training.vlm import VisionLanguageModel

    cfg = _vlm()
    with torch.device("meta"):
        model = VisionLanguageModel(cfg)
    arch = Architecture.from_model_config(cfg)
    pc = count_params(arch)
    assert pc.total == model.num_params()
    assert pc.encoder == sum(p.numel() for p in [*model.vision.parameters(), *model.projector.parameters()])
    assert sum(prod(shape) * n for shape, n in param_shapes(arch)) == pc.total


def test_a_vlms_flops_add_the_encoder_and_projector_once_per_image() -> None:
    cfg = _vlm()
    arch = Architecture.from_model_config(cfg)
    lm = Architecture.from_model_config(cfg.model_copy(update={"kind": "lm", "vision": None}))
    h, f, patches = 48, 96, 16  # 32 px in 8 px patches, no class token
    block = 2 * (4 * h * h + 4 * h + 2 * h * f + f + h) + 4 * patches * h
    image = patches * 2 * block + 2 * 3 * 64 * h * patches + 2 * (h * 80 + 80 + 80 * 64 + 64) * patches
    extra = (flops_per_token(arch).forward - flops_per_token(lm).forward) * arch.seq_len
    assert extra == pytest.approx(image, rel=1e-12)
