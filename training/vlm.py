"""Vision-language model (LLaVA-shaped): a SigLIP-shaped vision encoder, a projector, and the language model.

The image's patch tokens (training/vision.py, pooling mean: no class token) go through LLaVA's projector
(linear_1, exact GELU, linear_2) into the language model's width and are put in front of the caption's token
embeddings (training/model.py `Transformer.forward(idx, prefix)`): the sequence is [image tokens] + [caption
tokens], one causal language model over both, rotary positions counted from the first image token. The loss is
next-token cross-entropy on the caption only: the last image token predicts the caption's first token, and padding
after the caption's EOS counts for nothing.

The encoder has no final LayerNorm: LLaVA feeds the projector `hidden_states[vision_feature_layer]` of the vision
tower, which for SigLIP (vision_feature_layer -1) is the last block's output before `post_layernorm`
(transformers' LlavaModel.get_image_features; vLLM's transformers backend runs the same code), so a final norm here
would be an operation the exported model cannot run. Module names are fixed for the export (tasks/export/vlm.py):
`vision.*` SigLIP's vision tower, `projector.linear_1/linear_2` LLaVA's multi_modal_projector, `lm.*` the language
model under training/hf_names.py's Llama names.

`VlmWorkload` is model.kind vlm's seam to the trainer (training/workload.py), registered when this module is
imported.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from training.checkpoint.card import CardTokenizer, ModelCard
from training.config import ModelConfig
from training.image_dataset import MANIFEST, ImageDataset, ImageDatasetError, read_image_manifest
from training.model import Transformer
from training.storage import join
from training.vision import VisionTransformer
from training.workload import Dataset, EvalPart, LossInputs, Workload, register


class Projector(nn.Module):
    """LLaVA's multi-modal projector: linear_2(gelu(linear_1 x)), biases, the exact (erf) GELU."""

    def __init__(self, d_vision: int, hidden: int, d_model: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(d_vision, hidden, bias=True)
        self.linear_2 = nn.Linear(hidden, d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class VisionLanguageModel(nn.Module):
    """Image captioning: `vision` (encoder, no head, no final norm), `projector`, `lm` (training.model.Transformer).

    `forward(pixels, ids)` returns the logits over [image tokens] + [ids] (B, P + T, vocab) and the aux loss;
    `caption_loss` the captioning loss on a batch of images and padded captions."""

    def __init__(self, cfg: ModelConfig, recompute: str = "none") -> None:
        super().__init__()
        if cfg.kind != "vlm" or cfg.vision is None:
            raise ValueError(f"model.kind={cfg.kind}: VisionLanguageModel needs kind vlm with a vision section")
        vision = cfg.vision
        self.cfg = cfg
        self.num_image_tokens = vision.num_patches
        self.vision = VisionTransformer(vision, None, recompute, dropout=cfg.dropout, init_std=cfg.init_std)
        self.vision.norm = nn.Identity()  # see the module docstring: LLaVA reads the encoder before its final norm
        self.projector = Projector(vision.d_model, vision.projector_hidden or cfg.d_model, cfg.d_model)
        self.lm = Transformer(cfg, recompute)
        self._init_projector()

    def _init_projector(self) -> None:
        std = self.cfg.init_std
        nn.init.normal_(self.projector.linear_1.weight, mean=0.0, std=std)
        nn.init.normal_(self.projector.linear_2.weight, mean=0.0, std=std / math.sqrt(2))
        nn.init.zeros_(self.projector.linear_1.bias)
        nn.init.zeros_(self.projector.linear_2.bias)

    def image_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) uint8 pixels to the language model's input embeddings of the image (B, P, d_model)."""
        return self.projector(self.vision.features(pixels))

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits over [image tokens] + [ids]: (B, P + T, vocab), and the language model's aux loss."""
        return self.lm(ids, prefix=self.image_tokens(pixels))

    def caption_loss(
        self, pixels: torch.Tensor, captions: torch.Tensor, eos_id: int | None, pad_id: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean next-token cross-entropy per caption token of a batch (plus the aux loss), and how many tokens it
        averaged (`caption_token_mean`; the trainer calls the forward, which a parallel wrapper sees, and trains on
        `caption_loss`)."""
        logits, aux = self(pixels, captions[:, :-1])
        targets = caption_targets(captions, eos_id, pad_id)
        return caption_token_mean(logits, targets, self.num_image_tokens) + aux, (targets != IGNORE).sum()

    def num_params(self) -> int:
        """Parameters, counting tied weights once."""
        return sum(p.numel() for p in self.parameters())


IGNORE = -100
"""The target of a position that is not trained on (F.cross_entropy's ignore_index)."""


def caption_targets(captions: torch.Tensor, eos_id: int | None, pad_id: int | None) -> torch.Tensor:
    """The captions as next-token targets: IGNORE where `caption_mask` is 0."""
    return captions.masked_fill(caption_mask(captions, eos_id, pad_id) == 0, IGNORE)


def caption_loss(logits: torch.Tensor, targets: torch.Tensor, num_image_tokens: int) -> torch.Tensor:
    """The training objective: the summed cross-entropy of the trained caption positions of `logits` (B, P + L - 1,
    vocab) against `targets` (B, L, IGNORE where not trained on), divided by the batch's caption positions B x L.

    Captions differ in length, so a per-token mean of each micro-batch would weigh a token by how many others share
    its micro-batch, and the mean of those means (over accumulation steps and data-parallel ranks) would change with
    the layout: a run resumed on another number of ranks would train other mathematics. A fixed denominator per
    micro-batch makes the step's objective the global sum over B x L x micro-batches whatever the split. The last image
    token's position predicts the first caption token. A DTensor sharded on the vocabulary under tensor parallelism's
    loss_parallel works as a plain tensor. `caption_token_mean` is the per-token figure evaluation reports."""
    return _caption_sum(logits, targets, num_image_tokens) / targets.numel()


def caption_token_mean(logits: torch.Tensor, targets: torch.Tensor, num_image_tokens: int) -> torch.Tensor:
    """Mean cross-entropy per trained caption token (what the validation loss and perplexity are)."""
    return _caption_sum(logits, targets, num_image_tokens) / (targets != IGNORE).sum().clamp(min=1)


def _caption_sum(logits: torch.Tensor, targets: torch.Tensor, num_image_tokens: int) -> torch.Tensor:
    predicting = logits[:, num_image_tokens - 1 :]
    return F.cross_entropy(
        predicting.float().flatten(0, 1), targets.flatten(0, 1), ignore_index=IGNORE, reduction="sum"
    )


def caption_mask(captions: torch.Tensor, eos_id: int | None, pad_id: int | None) -> torch.Tensor:
    """Which caption positions are trained on (float, (B, L)): every token up to and including the first EOS;
    none after it, and no `pad_id` token (when the dataset pads with an id other than EOS)."""
    mask = torch.ones_like(captions, dtype=torch.bool)
    if eos_id is not None:
        is_eos = captions == eos_id
        mask &= (is_eos.cumsum(dim=1) - is_eos.long()) == 0  # no EOS strictly before
    if pad_id is not None and pad_id != eos_id:
        mask &= captions != pad_id
    return mask.float()


def sequence_len(cfg: ModelConfig, caption_len: int) -> int:
    """Tokens the language model runs on for captions of `caption_len` tokens: the image's, then all but the last
    caption token (ValueError when model.seq_len, which sizes the rotary tables, is shorter)."""
    assert cfg.vision is not None
    needed = cfg.vision.num_patches + caption_len - 1
    if needed > cfg.seq_len:
        raise ValueError(
            f"model.seq_len={cfg.seq_len}: the image's {cfg.vision.num_patches} patch tokens and captions of "
            f"{caption_len} tokens need {needed}; set model.seq_len to at least {needed} or prepare shorter captions"
        )
    return needed


class VlmWorkload(Workload):
    """model.kind vlm: the VisionLanguageModel on an image-caption dataset; captioning loss on the caption tokens; a
    sample counts its image tokens and its caption's (the language model's sequence)."""

    kind = "vlm"

    def open_datasets(self) -> tuple[ImageDataset, ImageDataset]:
        cfg, model = self.cfg, self.cfg.model
        assert model.vision is not None  # ModelConfig requires it for kind vlm
        train, val = (
            ImageDataset(cfg.data.dataset_url, split, cfg.storage, expect_kind="captions")
            for split in (cfg.data.train_split, cfg.data.val_split)
        )
        manifest = train.manifest
        problems = [
            (f"{name}={have}", f"model.vision.{name}={want}", f"set model.vision.{name}: {have}, or prepare the "
             f"dataset with {name} {want}")
            for name, have, want in (("image_size", manifest.image_size, model.vision.image_size),
                                     ("channels", manifest.channels, model.vision.channels))
            if have != want
        ]  # fmt: skip
        vocab = int(manifest.vocab_size or 0)
        if vocab >= model.vocab_size:
            problems.append((f"vocab_size={vocab}", f"model.vocab_size={model.vocab_size}", f"set model.vocab_size "
                             f"to at least {vocab + 1}: the exported LLaVA model needs one id past the tokenizer's for "
                             "its <image> placeholder"))  # fmt: skip
        try:
            sequence_len(model, int(manifest.caption_len or 0))
        except ValueError as err:
            problems.append((f"caption_len={manifest.caption_len}", "model.seq_len", str(err)))
        if problems:
            have, want, fix = problems[0]
            raise ImageDatasetError(cfg.data.dataset_url, f"{MANIFEST} {have}, {want}", fix, file=MANIFEST)
        self._manifest = manifest
        return train, val

    def _caption_ids(self) -> tuple[int | None, int | None, int]:
        """EOS, padding id and caption length of the dataset (read once)."""
        manifest = getattr(self, "_manifest", None)
        if manifest is None:
            manifest = self._manifest = read_image_manifest(self.cfg.data.dataset_url, self.cfg.storage)
        return manifest.eos_id, manifest.pad_id, int(manifest.caption_len or 0)

    def build_model(self, recompute: str) -> nn.Module:
        return VisionLanguageModel(self.cfg.model, recompute)

    @property
    def units_per_sample(self) -> int:
        return sequence_len(self.cfg.model, self._caption_ids()[2])

    def card(self, train: Dataset) -> ModelCard:
        assert isinstance(train, ImageDataset)
        manifest, url = train.manifest, self.cfg.data.dataset_url
        tok = manifest.tokenizer
        assert tok is not None and manifest.vocab_size is not None  # a captions manifest has them
        return ModelCard(
            model=self.cfg.model, vocab_size=manifest.vocab_size, eos_id=manifest.eos_id, dataset_url=url,
            tokenizer=CardTokenizer(kind=tok.kind, url=join(url, tok.path) if tok.path is not None else None,
                                    sha256=tok.sha256 or self.cfg.data.tokenizer_sha256),
        )  # fmt: skip

    def loss(
        self, model: nn.Module, batch: Any, inputs: LossInputs, distilled: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        eos_id, pad_id, _ = self._caption_ids()
        captions = batch.targets.to(inputs.device)
        with inputs.autocast():
            logits, aux = model(batch.images.to(inputs.device), captions[:, :-1])  # the wrapper's forward
        targets = caption_targets(captions, eos_id, pad_id)
        return caption_loss(logits, targets, self.cfg.model.vision.num_patches), aux, None

    def eval_batch(self, model: nn.Module, batch: Any, inputs: LossInputs) -> EvalPart:
        eos_id, pad_id, _ = self._caption_ids()
        captions = batch.targets.to(inputs.device)
        with inputs.autocast():
            logits, _ = model(batch.images.to(inputs.device), captions[:, :-1])
        loss = caption_token_mean(logits, caption_targets(captions, eos_id, pad_id), self.cfg.model.vision.num_patches)
        return EvalPart(loss.full_tensor() if hasattr(loss, "full_tensor") else loss, self.eval_units(batch))

    def eval_units(self, batch: Any) -> int:
        eos_id, pad_id, _ = self._caption_ids()
        return int(caption_mask(batch.targets, eos_id, pad_id).sum())


register("vlm", VlmWorkload)
