"""A tiny vision-language checkpoint for the export and serving tests: a caption dataset (bytes tokenizer) and a
VisionLanguageModel with random weights saved through our checkpoint format with its model card."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from training.checkpoint import KEY_ENV, CardTokenizer, CheckpointManager, ModelCard
from training.config import TrainConfig
from training.dataset import TokenizerInfo
from training.image_dataset import write_image_dataset
from training.vlm import VisionLanguageModel

SIZE = 32
PATCHES = 16  # (32 / 8)^2
CAPTION_LEN = 8
EOS = 256
VOCAB = 257  # the bytes tokenizer; the model has one more id, for <image>
# head_dim 32 on both sides: vLLM's CPU attention takes no smaller
VISION = {"image_size": SIZE, "patch_size": 8, "n_layers": 2, "d_model": 32, "n_heads": 1, "ffn_hidden": 64,
          "pooling": "mean"}  # fmt: skip
MODEL = {"kind": "vlm", "vision": VISION, "n_layers": 2, "d_model": 64, "n_heads": 2, "ffn_hidden": 128,
         "vocab_size": VOCAB + 1, "seq_len": PATCHES + CAPTION_LEN}  # fmt: skip
WORDS = ["red", "blue", "dark", "light", "sky", "sea"]


def caption_ids(text: str) -> list[int]:
    """A caption as the dataset stores it: its bytes, EOS, EOS padding to CAPTION_LEN."""
    ids = [*text.encode()[: CAPTION_LEN - 1], EOS]
    return ids + [EOS] * (CAPTION_LEN - len(ids))


def caption_dataset(root: Path) -> str:
    """Images of flat colours with noise and short captions, train and val splits."""
    rng = np.random.default_rng(0)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        images = rng.integers(0, 256, (n, SIZE, SIZE, 3), dtype=np.uint8)
        images[: n // 2] //= 4  # dark and light halves: images the model tells apart
        captions = [caption_ids(f"{WORDS[i % len(WORDS)]}") for i in range(n)]
        return images, np.asarray(captions, dtype=np.int32)

    url = str(root / "captions")
    write_image_dataset(url, None, {"train": split(8), "val": split(8)}, kind="captions", source_fingerprint="test",
                        vocab_size=VOCAB, eos_id=EOS, pad_id=EOS, tokenizer=TokenizerInfo(kind="bytes"))  # fmt: skip
    return url


def save_vlm(root: Path, init_std: float = 0.2) -> tuple[TrainConfig, VisionLanguageModel]:
    """The training config and a random-weight model (norms and biases too, so a misplaced one shows) saved as
    step 3 with its model card."""
    dataset = caption_dataset(root)
    train = TrainConfig.model_validate({
        "model": MODEL, "parallel": {"micro_batch": 2}, "optim": {"lr_peak": 1e-3},
        "data": {"dataset_url": dataset}, "checkpoint": {"url": str(root / "checkpoints")},
        "run": {"steps": 10, "output_url": str(root / "output")},
    })  # fmt: skip
    torch.manual_seed(0)
    model = VisionLanguageModel(train.model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, init_std)
    card = ModelCard(model=train.model, vocab_size=VOCAB, eos_id=EOS, dataset_url=dataset,
                     tokenizer=CardTokenizer(kind="bytes"))  # fmt: skip
    with pytest.MonkeyPatch.context() as env:  # unsigned test checkpoints
        env.delenv(KEY_ENV, raising=False)
        manager = CheckpointManager(train.checkpoint, train.storage, card=card.model_dump(mode="json"))
        manager.save(3, model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"step": 3})
    return train, model.eval()
