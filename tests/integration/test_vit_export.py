"""A ViT classifier checkpoint exported as a Hugging Face folder: transformers' ViTImageProcessor and
ViTForImageClassification, given PIL images, give exactly our model's logits on the raw pixels; a folder with one
tensor perturbed is refused naming it, and nothing is published."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.export.parity import ExportParityError
from tasks.export.step import EXPORT_RECORD, export_checkpoint
from training.checkpoint import KEY_ENV, CardTokenizer, CheckpointManager, ModelCard
from training.config import TrainConfig
from training.image_dataset import ImageDataset, write_image_dataset
from training.vision import VisionTransformer

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

SIZE = 16
CLASSES = ["cat", "dog", "bird"]
# head_dim 16, 16 patches + the class token
VISION = {"image_size": SIZE, "patch_size": 4, "n_layers": 2, "d_model": 32, "n_heads": 2, "ffn_hidden": 64,
          "num_classes": len(CLASSES)}  # fmt: skip
FILES = {"config.json", "preprocessor_config.json", "model.safetensors", "README.md", EXPORT_RECORD}


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)  # unsigned test checkpoints
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    transformers.utils.logging.disable_progress_bar()


def _dataset(root: Path) -> str:
    rng = np.random.default_rng(0)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.integers(0, 256, (n, SIZE, SIZE, 3), dtype=np.uint8), rng.integers(0, 3, (n,)).astype(np.int32)

    url = str(root / "images")
    write_image_dataset(url, None, {"train": split(12), "val": split(6)}, kind="labels", source_fingerprint="test",
                        num_classes=len(CLASSES), class_names=CLASSES)  # fmt: skip
    return url


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, VisionTransformer]:
    """A ViT classifier with random weights (norms and biases too, so a misplaced one shows) saved as step 3
    through our checkpoint format with its model card, and its training config."""
    root = tmp_path_factory.mktemp("vit-export")
    dataset = _dataset(root)
    train = TrainConfig.model_validate({
        "model": {"kind": "vit", "vision": VISION}, "parallel": {"micro_batch": 2}, "optim": {"lr_peak": 1e-3},
        "data": {"dataset_url": dataset}, "checkpoint": {"url": str(root / "checkpoints")},
        "run": {"steps": 10, "output_url": str(root / "output")},
    })  # fmt: skip
    assert train.model.vision is not None
    torch.manual_seed(0)
    model = VisionTransformer(train.model.vision, len(CLASSES), init_std=0.2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    card = ModelCard(model=train.model, vocab_size=len(CLASSES), eos_id=None, dataset_url=dataset,
                     tokenizer=CardTokenizer(kind="unknown"))  # fmt: skip
    with pytest.MonkeyPatch.context() as env:  # unsigned: a module fixture runs before the autouse one
        env.delenv(KEY_ENV, raising=False)
        manager = CheckpointManager(train.checkpoint, train.storage, card=card.model_dump(mode="json"))
        manager.save(3, model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"step": 3})
    return train, model.eval()


def test_exported_vit_gives_our_logits_exactly_under_transformers_on_pil_images(saved, tmp_path: Path) -> None:
    train, ours = saved
    result = export_checkpoint(train, out=tmp_path / "hf")
    folder = tmp_path / "hf"
    assert result.architecture == "ViTForImageClassification" and result.step == 3
    assert result.n_params == sum(p.numel() for p in ours.parameters())
    assert {p.name for p in folder.iterdir()} == FILES
    assert result.parity is not None and result.parity.inputs == "images"
    assert result.parity.max_abs_logit_diff == 0.0 and result.parity.prompt_tokens == 17
    assert result.parity.prompts_from == f"split 'val' of {train.data.dataset_url}"
    record = json.loads((folder / EXPORT_RECORD).read_text())
    assert record["architecture"] == "ViTForImageClassification" and record["parity"]["inputs"] == "images"
    readme = (folder / "README.md").read_text()
    assert "pipeline_tag: image-classification" in readme and "3 classes: cat, dog, bird" in readme

    # as a user runs it: the processor on PIL images (held-out ones), then the classifier
    from PIL import Image

    images = ImageDataset(train.data.dataset_url, "val").batch(range(6)).images  # uint8 (B, 3, H, W)
    pil = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in images]
    processor = transformers.ViTImageProcessorPil.from_pretrained(str(folder))
    model = transformers.ViTForImageClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert model.config.id2label == dict(enumerate(CLASSES)) and model.config.label2id == {"cat": 0, "dog": 1, "bird": 2}
    with torch.no_grad():
        theirs = model(**processor(images=pil, return_tensors="pt")).logits
        expected = ours(images)
    assert torch.equal(theirs, expected), (theirs - expected).abs().max().item()


def test_an_export_with_one_tensor_perturbed_is_refused_naming_it(saved, tmp_path: Path, monkeypatch) -> None:
    train, _ = saved
    import safetensors.torch

    original = safetensors.torch.save_file
    planted = "vit.encoder.layer.1.intermediate.dense.weight"

    def perturbed(tensors: dict[str, torch.Tensor], *args, **kwargs) -> None:
        if planted in tensors:
            tensors = {**tensors, planted: tensors[planted] + 0.01}
        original(tensors, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", perturbed)
    with pytest.raises(ExportParityError) as caught:
        export_checkpoint(train, out=tmp_path / "out" / "hf")
    message = str(caught.value)
    assert f"largest-deviating tensor {planted} (ours blocks.1.mlp.w1.weight): max |diff| 0.01" in message, message
    assert "6 images of 17 tokens" in message and "tasks/export/vit.py" in message
    parity = caught.value.parity
    assert parity.max_abs_logit_diff > 100 * parity.tolerance and parity.config_mismatches == []
    assert list((tmp_path / "out").iterdir()) == []  # neither the folder nor a partial one
