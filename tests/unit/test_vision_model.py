"""The ViT (training/vision.py), its spec (model.kind vit, model.vision) and its workload (training/workload.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from training.config import ModelConfig, TrainConfig, VisionConfig, format_validation_error
from training.image_dataset import ImageDatasetError, write_image_dataset
from training.vision import VisionTransformer, normalise_pixels
from training.workload import LossInputs, TextWorkload, VitWorkload, workload_of

VISION = {"image_size": 16, "patch_size": 4, "n_layers": 2, "d_model": 32, "n_heads": 4, "ffn_hidden": 64}


def _vision(**overrides: Any) -> VisionConfig:
    return VisionConfig(**{**VISION, "num_classes": 5, **overrides})


def _pixels(batch: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _problems(**model: Any) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        ModelConfig(**model)
    return format_validation_error(caught.value)


def test_logits_and_features_have_the_documented_shapes() -> None:
    model = VisionTransformer(_vision(), 5)
    assert model(_pixels()).shape == (3, 5)
    assert model.features(_pixels()).shape == (3, 17, 32)  # the class token and 16 patches
    mean = VisionTransformer(_vision(pooling="mean", num_classes=None), None)
    assert mean.features(_pixels()).shape == (3, 16, 32)
    assert mean.cls_token is None and mean.head is None and mean.pos_emb.shape == (1, 16, 32)
    with pytest.raises(ValueError, match="no classifier head"):
        mean(_pixels())


def test_parameter_names_are_the_ones_the_export_maps() -> None:
    names = set(dict(VisionTransformer(_vision(), 5).named_parameters()))
    block = {f"blocks.0.{n}" for n in ("attn_norm.weight", "attn_norm.bias", "attn.wq.weight", "attn.wq.bias",
                                       "attn.wk.bias", "attn.wv.bias", "attn.wo.weight", "attn.wo.bias",
                                       "mlp_norm.weight", "mlp.w1.weight", "mlp.w1.bias", "mlp.w2.bias")}  # fmt: skip
    top = {"patch_embed.weight", "patch_embed.bias", "cls_token", "pos_emb", "norm.weight", "norm.bias",
           "head.weight", "head.bias"}  # fmt: skip
    assert block | top <= names and not any(n.startswith("blocks.2") for n in names)


def test_uint8_pixels_are_normalised_to_minus_one_one_inside_the_model() -> None:
    pixels = torch.tensor([0, 255, 51], dtype=torch.uint8).reshape(1, 3, 1, 1)
    torch.testing.assert_close(normalise_pixels(pixels, torch.float32).flatten(), torch.tensor([-1.0, 1.0, -0.6]))
    model = VisionTransformer(_vision(), 5).eval()
    uint8 = _pixels()
    torch.testing.assert_close(model(uint8), model((uint8.float() / 255 - 0.5) / 0.5))
    assert not torch.allclose(model(uint8), model(uint8.float()))  # floats are taken as normalised already


def test_cls_pooling_reads_the_class_token_and_mean_pooling_the_patches_mean() -> None:
    torch.manual_seed(0)
    cls = VisionTransformer(_vision(), 5).eval()
    x = _pixels()
    torch.testing.assert_close(cls(x), cls.head(cls.features(x)[:, 0]))
    torch.manual_seed(0)
    mean = VisionTransformer(_vision(pooling="mean"), 5).eval()
    torch.testing.assert_close(mean(x), mean.head(mean.features(x).mean(dim=1)))


def test_the_encoder_is_bidirectional() -> None:
    """Changing the last patch changes the class token's state (no causal mask)."""
    model = VisionTransformer(_vision(), 5).eval()
    x = _pixels(1)
    y = x.clone()
    y[..., 12:, 12:] = 255 - y[..., 12:, 12:]
    assert not torch.allclose(model.features(x)[:, 0], model.features(y)[:, 0])


def test_selective_and_full_recompute_give_the_same_gradients() -> None:
    x, target = _pixels(2), torch.tensor([1, 3])
    grads = []
    for recompute in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = VisionTransformer(_vision(), 5, recompute=recompute)
        F.cross_entropy(model(x), target).backward()
        grads.append(model.blocks["0"].attn.wq.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[0], grads[2])


def test_a_vit_spec_fills_its_text_fields_from_the_encoder() -> None:
    model = ModelConfig(kind="vit", vision=_vision())
    assert (model.n_layers, model.d_model, model.n_heads, model.ffn_hidden) == (2, 32, 4, 64)
    assert model.vocab_size == 5 and model.seq_len == 17
    assert ModelConfig.model_validate_json(model.model_dump_json()) == model  # run.json round trip
    assert ModelConfig(kind="vit", vision=_vision(pooling="mean")).seq_len == 16


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"kind": "vit"}, "vision=null: is required for kind vit"),
        ({"kind": "vit", "vision": {**VISION, "patch_size": 5, "num_classes": 5}},
         "vision.patch_size=5: must divide image_size=16; use one of"),
        ({"kind": "vit", "vision": {**VISION, "n_heads": 5, "num_classes": 5}},
         "vision.n_heads=5: must divide d_model=32"),
        ({"kind": "vit", "vision": VISION}, "vision.num_classes=null: is required for kind vit"),
        ({"kind": "vit", "vision": {**VISION, "num_classes": 5}, "d_model": 64},
         "d_model=64: for kind vit it is vision.d_model=32; remove it"),
        ({"kind": "vit", "vision": {**VISION, "num_classes": 5}, "n_kv_heads": 2},
         "n_kv_heads=2: does not apply to kind vit"),
        ({"kind": "vit", "vision": {**VISION, "num_classes": 5}, "moe": {"n_experts": 2}}, "moe={...}: does not apply"),
        ({"kind": "vit", "vision": {**VISION, "num_classes": 5}, "init_from": "/tmp/hf"},
         "init_from=/tmp/hf: does not apply to kind vit"),
        ({"kind": "vit", "vision": {**VISION, "num_classes": 5, "projector_hidden": 8}},
         "vision.projector_hidden=8: only applies to kind vlm"),
        ({"n_layers": 1, "d_model": 8, "n_heads": 2, "ffn_hidden": 8, "vocab_size": 10, "seq_len": 8,
          "vision": {**VISION, "num_classes": 5}}, "vision={...}: only applies to kind vit or vlm"),
        ({"kind": "vlm", "n_layers": 1, "d_model": 8, "n_heads": 2, "ffn_hidden": 8, "vocab_size": 10, "seq_len": 8,
          "vision": {**VISION, "pooling": "mean"}}, "seq_len=8: must exceed the image's 16 patch tokens"),
        ({"kind": "vlm", "n_layers": 1, "d_model": 8, "n_heads": 2, "ffn_hidden": 8, "vocab_size": 10, "seq_len": 32,
          "vision": VISION}, "vision.pooling=cls: a vlm's encoder is SigLIP-shaped"),
    ],
)  # fmt: skip
def test_model_specs_that_cannot_work_are_refused_naming_the_field_and_fix(
    model: dict[str, Any], expected: str
) -> None:
    problems = _problems(**model)
    assert any(line.startswith(expected) for line in problems), problems
    assert len(problems) == 1, problems  # one mistake, one message (no follow-on errors of the filled-in fields)


def _train_cfg(tmp_path: Path, parallel: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "model": {"kind": "vit", "vision": {**VISION, "num_classes": 4}},
        "parallel": {"micro_batch": 2, **parallel},
        "optim": {"lr_peak": 1e-3},
        "data": {"dataset_url": str(tmp_path / "data")},
        "checkpoint": {"url": str(tmp_path / "ckpt")},
        "run": {"steps": 4, "output_url": str(tmp_path / "out")},
        **extra,
    }


@pytest.mark.parametrize(
    ("parallel", "extra", "expected"),
    [
        ({"pipeline_parallel": 2}, {}, "parallel.pipeline_parallel=2: is not supported with model.kind=vit"),
        ({"sequence_parallel": True, "tensor_parallel": 2}, {},
         "parallel.sequence_parallel=true: is not supported with model.kind=vit"),
        ({"tensor_parallel": 8}, {}, "parallel.tensor_parallel=8: must divide model.n_heads=4"),
        ({}, {"distill": {"teacher_url": "/tmp/teacher"}}, "distill={...}: distillation is not supported with"),
    ],
)  # fmt: skip
def test_layouts_a_vit_does_not_run_are_refused(
    tmp_path: Path, parallel: dict[str, Any], extra: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        TrainConfig.model_validate(_train_cfg(tmp_path, parallel, **extra))
    problems = format_validation_error(caught.value)
    assert any(line.startswith(expected) for line in problems), problems


def test_tensor_parallel_does_not_ask_a_vit_for_a_divisible_vocabulary(tmp_path: Path) -> None:
    cfg = TrainConfig.model_validate(_train_cfg(tmp_path, {"tensor_parallel": 4, "sharding": "fsdp"}))
    assert cfg.model.vocab_size == 4 and cfg.parallel.tensor_parallel == 4
    odd = _train_cfg(tmp_path, {"tensor_parallel": 2})
    odd["model"]["vision"]["num_classes"] = 5  # 5 classes over 2 ranks: the head is replicated, not split
    assert TrainConfig.model_validate(odd).model.vocab_size == 5


def _dataset(url: Path, num_classes: int = 4, side: int = 16) -> None:
    rng = np.random.default_rng(0)
    splits = {s: (rng.integers(0, 256, (6, side, side, 3), dtype=np.uint8), rng.integers(0, num_classes, 6))
              for s in ("train", "val")}  # fmt: skip
    write_image_dataset(str(url), None, splits, kind="labels", source_fingerprint="t", num_classes=num_classes)


def test_the_vit_workload_trains_on_labelled_images_and_counts_image_tokens(tmp_path: Path) -> None:
    _dataset(tmp_path / "data")
    cfg = TrainConfig.model_validate(_train_cfg(tmp_path, {}))
    workload = workload_of(cfg)
    assert isinstance(workload, VitWorkload) and workload.units_per_sample == 17
    train, val = workload.open_datasets()
    assert len(train) == len(val) == 6
    torch.manual_seed(0)
    model = workload.build_model("none")
    batch = train.batch([0, 1, 2])
    inputs = LossInputs(torch.device("cpu"), None, False)
    loss, aux, kl = workload.loss(model, batch, inputs)
    torch.testing.assert_close(loss, F.cross_entropy(model(batch.images), batch.targets))
    assert aux.item() == 0 and kl is None
    part = workload.eval_batch(model, batch, inputs)
    assert part.units == 3 and part.counts is not None and part.counts.sum().item() == 3
    figures = workload.eval_metrics(part.counts)
    predicted = model(batch.images).argmax(-1)
    assert figures["val_accuracy"] == pytest.approx((predicted == batch.targets).float().mean().item())
    assert figures["val_images"] == 3 and 0 <= figures["val_macro_f1"] <= 1
    card = workload.card(train)
    assert card.model.kind == "vit" and card.vocab_size == 4


@pytest.mark.parametrize(("classes", "side", "field"), [(3, 16, "num_classes"), (4, 8, "image_size")])
def test_a_dataset_that_does_not_fit_the_vit_is_refused_naming_both_values(
    tmp_path: Path, classes: int, side: int, field: str
) -> None:
    _dataset(tmp_path / "data", num_classes=classes, side=side)
    with pytest.raises(ImageDatasetError, match=f"{field}=.*model.vision.{field}=") as caught:
        workload_of(TrainConfig.model_validate(_train_cfg(tmp_path, {}))).open_datasets()
    assert caught.value.file == "IMAGES.json"


def test_the_text_workload_is_the_default() -> None:
    model = ModelConfig(n_layers=1, d_model=8, n_heads=2, ffn_hidden=8, vocab_size=10, seq_len=8)
    assert model.kind == "lm" and model.vision is None
    cfg = TrainConfig.model_construct(model=model)
    assert isinstance(workload_of(cfg), TextWorkload) and workload_of(cfg).units_per_sample == 8


def test_an_image_dataset_that_does_not_fit_is_a_workload_failure_not_retried() -> None:
    from training.failure import classify

    err = ImageDatasetError("/data", "IMAGES.json num_classes=3, model.vision.num_classes=4", "set it to 3")
    found = classify(err, None, 0)
    assert found is not None and found.cause == "bad_data" and found.fix.startswith("set it to 3")
