"""The vision-language model in the parallel layouts' terms: the blocks they wrap, the layouts refused, and the
independent reference's caption loss against the trainer's (training/vlm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from training.config import ModelConfig, TrainConfig, format_validation_error
from training.image_dataset import ImageBatch
from training.model import Transformer, blocks_of
from training.reference import _caption_sum, _Captions, _mean_loss, _trained
from training.vision import VisionTransformer
from training.vlm import VisionLanguageModel, caption_loss, caption_mask, caption_targets, caption_token_mean

VISION = {"image_size": 32, "patch_size": 8, "n_layers": 2, "d_model": 32, "n_heads": 2, "ffn_hidden": 64,
          "pooling": "mean"}  # fmt: skip
MODEL = {"kind": "vlm", "vision": VISION, "n_layers": 3, "d_model": 64, "n_heads": 2, "ffn_hidden": 128,
         "vocab_size": 258, "seq_len": 24}  # fmt: skip
EOS = 256


def test_blocks_of_yields_the_encoders_then_the_language_models_blocks_once_each() -> None:
    model = VisionLanguageModel(ModelConfig.model_validate(MODEL))
    blocks = list(blocks_of(model))
    assert blocks == [*model.vision.blocks.values(), *model.lm.blocks.values()]
    lm = Transformer(ModelConfig.model_validate({**MODEL, "kind": "lm", "vision": None}))
    assert list(blocks_of(lm)) == list(lm.blocks.values())
    vit = VisionTransformer(ModelConfig.model_validate(MODEL).vision, 4)  # type: ignore[arg-type]
    assert list(blocks_of(vit)) == list(vit.blocks.values())


def test_sequence_parallelism_is_refused_for_a_vlm(tmp_path: Path) -> None:
    spec = {
        "model": MODEL, "parallel": {"micro_batch": 2, "tensor_parallel": 2, "sequence_parallel": True},
        "optim": {"lr_peak": 1e-3}, "data": {"dataset_url": str(tmp_path / "data")},
        "checkpoint": {"url": str(tmp_path / "ckpt")}, "run": {"steps": 4, "output_url": str(tmp_path / "out")},
    }  # fmt: skip
    with pytest.raises(ValidationError) as caught:
        TrainConfig.model_validate(spec)
    problems = format_validation_error(caught.value)
    assert any(p.startswith("parallel.sequence_parallel=true: is not supported with model.kind=vlm") for p in problems)


@pytest.mark.parametrize("pad_id", [EOS, 0])
def test_the_references_caption_loss_equals_the_trainers_on_captions_of_different_lengths(pad_id: int) -> None:
    torch.manual_seed(0)
    model = VisionLanguageModel(ModelConfig.model_validate(MODEL))
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8, generator=g)
    captions = torch.randint(1, 200, (3, 8), generator=g)
    captions[0, 2], captions[1, 5:] = EOS, pad_id  # a short caption, one padded after its EOS, one with no EOS
    captions[1, 5] = EOS
    spec = _Captions(EOS, pad_id, 16)
    assert torch.equal(_trained(captions, spec).float(), caption_mask(captions, EOS, pad_id))
    logits, _ = model(images, captions[:, :-1])
    targets = caption_targets(captions, EOS, pad_id)
    total, trained = _caption_sum(model, ImageBatch(images, captions), spec)
    torch.testing.assert_close(total / captions.numel(), caption_loss(logits, targets, 16), rtol=1e-6, atol=0)
    torch.testing.assert_close(total / trained, caption_token_mean(logits, targets, 16), rtol=1e-6, atol=0)


def test_the_caption_objective_does_not_depend_on_how_the_batch_is_split() -> None:
    """Captions of different lengths: the mean of the micro-batches' objectives (what accumulation and data-parallel
    averaging give) equals the whole batch's, so a run resharded onto another number of ranks trains the same
    mathematics (a per-token mean per micro-batch would not)."""
    torch.manual_seed(0)
    model = VisionLanguageModel(ModelConfig.model_validate(MODEL))
    g = torch.Generator().manual_seed(2)
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=g)
    captions = torch.randint(1, 200, (4, 8), generator=g)
    captions[0, 1], captions[2, 6] = EOS, EOS  # 2 and 7 trained tokens beside two of 8
    targets = caption_targets(captions, EOS, EOS)
    logits, _ = model(images, captions[:, :-1])
    whole = caption_loss(logits, targets, 16)
    halves = [caption_loss(logits[i : i + 2], targets[i : i + 2], 16) for i in (0, 2)]
    torch.testing.assert_close(torch.stack(halves).mean(), whole, rtol=1e-6, atol=0)
    per_token_halves = [caption_token_mean(logits[i : i + 2], targets[i : i + 2], 16) for i in (0, 2)]
    assert abs(float(torch.stack(per_token_halves).mean()) - float(caption_token_mean(logits, targets, 16))) > 1e-3
    reference, _, _ = _mean_loss(model, ImageBatch(images, captions), None, captions=_Captions(EOS, EOS, 16))
    torch.testing.assert_close(reference, whole, rtol=1e-6, atol=0)
