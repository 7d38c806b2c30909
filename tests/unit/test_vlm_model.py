"""The vision-language model (training/vlm.py): shapes, the caption-only loss, and the language model's prefix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training.config import ModelConfig
from training.model import Transformer
from training.vlm import VisionLanguageModel, caption_mask, sequence_len

EOS = 256


def tiny(seq_len: int = 24) -> ModelConfig:
    """A 16-patch 32 px encoder and a 2-layer, d=64 language model over the bytes vocabulary plus one."""
    return ModelConfig(
        kind="vlm", n_layers=2, d_model=64, n_heads=2, ffn_hidden=128, vocab_size=258, seq_len=seq_len,
        vision={"image_size": 32, "patch_size": 8, "n_layers": 2, "d_model": 32, "n_heads": 1, "ffn_hidden": 64,
                "pooling": "mean", "projector_hidden": 48},
    )  # fmt: skip


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=gen)
    captions = torch.tensor([[104, 105, EOS, EOS, EOS, EOS], [97, 98, 99, 100, 101, EOS]])
    return pixels, captions


def test_logits_cover_image_and_caption_tokens() -> None:
    model = VisionLanguageModel(tiny())
    pixels, captions = batch()
    logits, aux = model(pixels, captions)
    assert model.num_image_tokens == 16
    assert logits.shape == (2, 16 + 6, 258)
    assert model.image_tokens(pixels).shape == (2, 16, 64)
    assert float(aux) == 0.0
    names = {name for name, _ in model.named_parameters()}
    assert "projector.linear_1.weight" in names and "lm.tok_emb.weight" in names
    assert not any(name.startswith("vision.norm") for name in names)  # LLaVA reads the encoder before a final norm
    assert "vision.cls_token" not in names and "vision.head.weight" not in names


def test_loss_counts_only_caption_tokens_up_to_the_first_eos() -> None:
    torch.manual_seed(0)
    model = VisionLanguageModel(tiny()).eval()
    pixels, captions = batch()
    loss, count = model.caption_loss(pixels, captions, EOS, EOS)
    assert int(count) == 3 + 6  # "hi" + EOS; "abcde" + EOS
    # the definition: cross-entropy of the caption tokens, the last image position predicting the first one
    logits, _ = model(pixels, captions[:, :-1])
    expected = []
    for row, length in ((0, 3), (1, 6)):
        predicting = logits[row, 15 : 15 + length]
        expected.append(F.cross_entropy(predicting, captions[row, :length], reduction="none"))
    assert torch.allclose(loss, torch.cat(expected).mean(), atol=1e-6)


def test_padding_after_eos_gets_no_gradient_and_images_do() -> None:
    torch.manual_seed(0)
    model = VisionLanguageModel(tiny())
    pixels, captions = batch()
    changed = captions.clone()
    changed[0, 3:] = 7  # padding after the first EOS, changed: the loss must not see it
    loss_a, _ = model.caption_loss(pixels, captions, EOS, EOS)
    loss_b, _ = model.caption_loss(pixels, changed, EOS, 7)
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    loss_a.backward()
    assert model.vision.patch_embed.weight.grad is not None and model.vision.patch_embed.weight.grad.abs().sum() > 0
    assert model.projector.linear_1.weight.grad.abs().sum() > 0


def test_caption_mask_with_a_pad_id_other_than_eos() -> None:
    captions = torch.tensor([[5, 6, 2, 0, 0], [5, 2, 9, 2, 0]])
    assert caption_mask(captions, eos_id=2, pad_id=0).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert caption_mask(captions, eos_id=None, pad_id=0).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]


def test_prefix_leaves_the_language_models_logits_unchanged_without_one() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=2, ffn_hidden=128, vocab_size=258, seq_len=24)
    lm = Transformer(cfg).eval()
    ids = torch.randint(0, 258, (2, 10))
    plain, _ = lm(ids)
    embedded = lm.tok_emb(ids[:, :4])
    prefixed, _ = lm(ids[:, 4:], prefix=embedded)
    assert torch.equal(lm(ids, prefix=None)[0], plain)
    assert torch.allclose(prefixed, plain, atol=1e-5)  # a prefix of the tokens' own embeddings is the same sequence


def test_sequence_len_refuses_a_seq_len_the_rotary_tables_do_not_cover() -> None:
    assert sequence_len(tiny(seq_len=24), caption_len=9) == 24
    with pytest.raises(ValueError, match="model.seq_len=24.*at least 25"):
        sequence_len(tiny(seq_len=24), caption_len=10)


def _captions_dataset(root, vocab: int = 257) -> str:
    import numpy as np

    from training.dataset import TokenizerInfo
    from training.image_dataset import write_image_dataset

    rng = np.random.default_rng(0)
    captions = np.asarray([[104, 105, EOS, EOS, EOS, EOS, EOS, EOS]] * 4, dtype=np.int32)
    split = (rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8), captions)
    url = str(root / "captions")
    write_image_dataset(url, None, {"train": split, "val": split}, kind="captions", source_fingerprint="t",
                        vocab_size=vocab, eos_id=EOS, pad_id=EOS, tokenizer=TokenizerInfo(kind="bytes"))  # fmt: skip
    return url


def _train_config(root, dataset: str, **model: object):
    from training.config import TrainConfig

    return TrainConfig.model_validate({
        "model": {**tiny().model_dump(exclude_none=True), **model}, "parallel": {"micro_batch": 2},
        "optim": {"lr_peak": 1e-3},
        "data": {"dataset_url": dataset}, "checkpoint": {"url": str(root / "ckpt")},
        "run": {"steps": 2, "output_url": str(root / "out")},
    })  # fmt: skip


def test_vlm_workload_trains_on_captions_through_the_models_forward(tmp_path) -> None:
    from training.workload import LossInputs, workload_of

    cfg = _train_config(tmp_path, _captions_dataset(tmp_path))
    workload = workload_of(cfg)
    assert workload.kind == "vlm"
    train, _ = workload.open_datasets()
    assert workload.units_per_sample == 16 + 8 - 1
    card = workload.card(train)
    assert card.eos_id == EOS and card.vocab_size == 257 and card.tokenizer.kind == "bytes"
    torch.manual_seed(0)
    model = workload.build_model("none")
    batch = train.batch([0, 1])
    inputs = LossInputs(device=torch.device("cpu"), autocast_dtype=None, sharded_logits=False)
    loss, aux, kl = workload.loss(model, batch, inputs)
    per_token, count = model.caption_loss(batch.images, batch.targets, EOS, EOS)
    # trained on the token sum over the batch's caption positions (2 x 8), evaluated per caption token
    assert torch.allclose(loss + aux, per_token * count / batch.targets.numel()) and kl is None
    assert workload.eval_units(batch) == int(count) == 2 * 3
    part = workload.eval_batch(model, batch, inputs)
    assert torch.allclose(part.loss, per_token) and part.units == int(count)


def test_vlm_workload_refuses_a_vocabulary_without_room_for_the_image_token(tmp_path) -> None:
    from training.image_dataset import ImageDatasetError
    from training.workload import workload_of

    cfg = _train_config(tmp_path, _captions_dataset(tmp_path, vocab=258))
    with pytest.raises(ImageDatasetError, match="vocab_size=258.*at least 259"):
        workload_of(cfg).open_datasets()
