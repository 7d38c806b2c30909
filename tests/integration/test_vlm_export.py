"""A vision-language checkpoint exported as a LLaVA folder: transformers' processor and
LlavaForConditionalGeneration, given PIL images, give our model's logits and greedy captions; a folder with one
vision tensor perturbed is refused naming it, and nothing is published."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from tasks.export.parity import ExportParityError
from tasks.export.step import EXPORT_RECORD, export_checkpoint
from tests.integration.vlm_setup import PATCHES, VOCAB, save_vlm
from training.checkpoint import KEY_ENV
from training.image_dataset import ImageDataset
from training.vlm import VisionLanguageModel

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    return save_vlm(tmp_path_factory.mktemp("vlm-export"))


def _our_greedy(model: VisionLanguageModel, pixels: torch.Tensor, tokens: int) -> list[int]:
    ids = torch.zeros((1, 0), dtype=torch.long)
    with torch.no_grad():
        for _ in range(tokens):
            logits, _ = model(pixels, ids)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0].tolist()


def test_exported_llava_gives_our_logits_and_captions_under_transformers(saved, tmp_path: Path) -> None:
    train, ours = saved
    result = export_checkpoint(train, out=tmp_path / "hf")
    folder = tmp_path / "hf"
    assert result.architecture == "LlavaForConditionalGeneration" and result.step == 3
    assert result.n_params == sum(p.numel() for p in ours.parameters())
    assert result.parity is not None and result.parity.inputs == "images" and result.parity.passed
    assert result.parity.max_abs_logit_diff <= 1e-5, result.parity
    assert result.parity.prompts_from == f"split 'val' of {train.data.dataset_url}"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "processor_config.json", "chat_template.jinja", "tokenizer.json",
            "model.safetensors", EXPORT_RECORD} <= names  # fmt: skip
    config = json.loads((folder / "config.json").read_text())
    assert config["image_token_index"] == VOCAB and config["image_seq_length"] == PATCHES
    readme = (folder / "README.md").read_text()
    assert "pipeline_tag: image-text-to-text" in readme and "--model-impl transformers" in readme

    # as a user runs it: the processor on PIL images with the prompt "<image>", then greedy generation
    from PIL import Image

    images = ImageDataset(train.data.dataset_url, "val").batch(range(8)).images
    processor = transformers.AutoProcessor.from_pretrained(str(folder))
    model = transformers.LlavaForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    captions = set()
    for image in images[::2]:
        inputs = processor(images=Image.fromarray(image.permute(1, 2, 0).numpy()), text="<image>", return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == [VOCAB] * PATCHES
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        theirs = out[0, PATCHES:].tolist()
        assert theirs == _our_greedy(ours, image[None], 6)
        captions.add(tuple(theirs))
    assert len(captions) > 1  # the image decides the caption: not a test a model ignoring its image passes


def test_an_export_with_one_vision_tensor_perturbed_is_refused_naming_it(saved, tmp_path: Path, monkeypatch) -> None:
    train, _ = saved
    import safetensors.torch

    original = safetensors.torch.save_file
    planted = "vision_tower.encoder.layers.1.mlp.fc1.weight"

    def perturbed(tensors: dict[str, torch.Tensor], *args, **kwargs) -> None:
        if planted in tensors:
            tensors = {**tensors, planted: tensors[planted] + 0.01}
        original(tensors, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", perturbed)
    with pytest.raises(ExportParityError) as caught:
        export_checkpoint(train, out=tmp_path / "out" / "hf")
    message = str(caught.value)
    assert f"largest-deviating tensor {planted} (ours vision.blocks.1.mlp.w1.weight): max |diff| 0.01" in message
    assert "tasks/export/vlm.py" in message
    parity = caught.value.parity
    assert parity.max_abs_logit_diff > 10 * parity.tolerance and parity.config_mismatches == []
    assert list((tmp_path / "out").iterdir()) == []
