"""What the trainer trains, chosen by `model.kind`: the seam between the training loop (training/train.py) and a
model family.

A `Workload` builds the model, opens and checks the train and validation splits, computes the loss of a batch,
evaluates a validation batch and reads the evaluation's metrics, counts the units a sample stands for in the
throughput records, and writes the model card. The loop, its parallel layouts, checkpoints, sampler, drills and
records do not know which family runs:

- lm (`TextWorkload`): the decoder-only Transformer (training/model.py) on token datasets (training/dataset.py);
  next-token cross-entropy; a sample is seq_len tokens.
- vit (`VitWorkload`): the VisionTransformer classifier (training/vision.py) on a labelled image dataset
  (training/image_dataset.py); cross-entropy on the class; a sample counts its image tokens (patches plus the
  class token, model.seq_len); the evaluation adds accuracy and macro F1 (training/classification.py).
- vlm: training/vlm.py defines its workload and `register`s it (PLUGINS).

A batch is whatever the workload's dataset's `batch(indices)` returns (a token tensor, an ImageBatch); the
loop only passes it on.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from training.checkpoint.card import CardTokenizer, ModelCard
from training.classification import confusion, confusion_accuracy, confusion_macro_f1
from training.config import TrainConfig
from training.dataset import DatasetError, DatasetManifest, TokenDataset, read_manifest
from training.image_dataset import MANIFEST, ImageBatch, ImageDataset, ImageDatasetError
from training.model import Transformer
from training.sampler import Blend, blend_of
from training.tensor_parallel import lm_loss
from training.vision import VisionTransformer


class DataManifest(Protocol):
    """A prepared dataset's manifest (training/dataset.py's or training/image_dataset.py's) as acceptance reads it."""

    def curve_identity(self, train_split: str, val_split: str) -> dict[str, Any]:
        """What of the dataset determines a run's loss curve."""
        ...

    def checksums(self) -> dict[str, Any]:
        """The dataset's content by its checksums."""
        ...


class Dataset(Protocol):
    """A split the sampler draws indices of and the loop reads batches from."""

    url: str
    manifest: Any

    def __len__(self) -> int: ...

    def batch(self, indices: Any) -> Any: ...


@dataclass(frozen=True)
class LossInputs:
    """What a loss needs from the trainer besides the model and the batch."""

    device: torch.device
    autocast_dtype: torch.dtype | None
    sharded_logits: bool
    """Model-parallel layouts: the LM's logits are sharded on the vocabulary (compute the loss in loss_context)."""
    teacher: Any = None
    """distill: the frozen teacher (training/distill.py), lm only."""

    def autocast(self) -> Any:
        """The forward's autocast context (off in fp32)."""
        enabled = self.autocast_dtype is not None
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=enabled)


@dataclass(frozen=True)
class EvalPart:
    """One validation batch: its mean loss, the units it is averaged over, and the counts (a tensor the ranks sum,
    None: none) the workload's metrics are read from."""

    loss: torch.Tensor
    units: int
    counts: torch.Tensor | None = None


class Workload(ABC):
    """The model family the trainer runs: one subclass per model.kind (WORKLOADS)."""

    kind: ClassVar[str]

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def open_datasets(self) -> tuple[Dataset, Dataset]:
        """The train and validation splits, checked against the spec (DatasetError, ImageDatasetError)."""

    def train_split(self) -> Dataset:
        """The training split alone, as the sampler sees it (acceptance's data-consistency check opens it)."""
        return self.open_datasets()[0]

    def manifest(self) -> DataManifest:
        """The prepared dataset's manifest (acceptance's quality baseline and ledger keys read it)."""
        return self.train_split().manifest

    def blend(self, train: Dataset, seed: int) -> Blend | None:
        """The weighted blend of the training split's sources (None: none; the sampler draws samples directly)."""
        return None

    @abstractmethod
    def build_model(self, recompute: str) -> nn.Module:
        """The model with its initial weights (torch seeded by the caller), on the CPU."""

    @property
    @abstractmethod
    def units_per_sample(self) -> int:
        """Tokens one sample stands for in the step records' `tokens` and tokens/s."""

    @abstractmethod
    def card(self, train: Dataset) -> ModelCard:
        """model.json of this run's checkpoints."""

    @abstractmethod
    def loss(
        self, model: nn.Module, batch: Any, inputs: LossInputs, distilled: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The training loss of `batch` (a DTensor under loss_parallel), the MoE aux loss (a 0-d tensor, zero when
        none) and, `distilled`, the KL to the teacher (None without one)."""

    def eval_batch(self, model: nn.Module, batch: Any, inputs: LossInputs) -> EvalPart:
        """The validation loss of `batch` (a plain tensor) and the units it averages over."""
        loss = self.loss(model, batch, inputs)[0]
        return EvalPart(loss.full_tensor() if hasattr(loss, "full_tensor") else loss, self.eval_units(batch))

    @abstractmethod
    def eval_units(self, batch: Any) -> int:
        """The units a validation batch's mean loss averages over (the weights of the evaluation's mean)."""

    def eval_metrics(self, counts: torch.Tensor) -> dict[str, Any]:
        """The evaluation record's extra figures from the ranks' summed `counts` (workloads that return some)."""
        return {}


class TextWorkload(Workload):
    """model.kind lm: the decoder-only Transformer on a token dataset."""

    kind = "lm"

    def open_datasets(self) -> tuple[TokenDataset, TokenDataset]:
        cfg, model_cfg = self.cfg, self.cfg.model
        train, val = (
            TokenDataset(cfg.data.dataset_url, split, model_cfg.seq_len, cfg.storage, vocab_size=model_cfg.vocab_size,
                         trusted=cfg.data.sources)
            for split in (cfg.data.train_split, cfg.data.val_split)
        )  # fmt: skip
        data_vocab, data_tokenizer = train.manifest.vocab_size, train.manifest.tokenizer
        if cfg.data.tokenizer_sha256 and data_tokenizer.sha256 != cfg.data.tokenizer_sha256:
            raise DatasetError(
                cfg.data.dataset_url,
                f"made with tokenizer {data_tokenizer.kind} sha256={data_tokenizer.sha256}, "
                f"the spec expects sha256={cfg.data.tokenizer_sha256}",
                "prepare the dataset with the spec's tokenizer or point the spec at the right dataset",
            )
        if data_vocab > model_cfg.vocab_size:
            raise DatasetError(
                cfg.data.dataset_url,
                f"dataset vocab_size={data_vocab} exceeds model.vocab_size={model_cfg.vocab_size}",
                f"set model.vocab_size >= {data_vocab} or use a dataset of this vocabulary",
            )
        return train, val

    def train_split(self) -> TokenDataset:
        data, model_cfg = self.cfg.data, self.cfg.model
        return TokenDataset(data.dataset_url, data.train_split, model_cfg.seq_len, self.cfg.storage,
                            trusted=data.sources)  # fmt: skip

    def manifest(self) -> DatasetManifest:
        return read_manifest(self.cfg.data.dataset_url, self.cfg.storage, self.cfg.data.sources)

    def blend(self, train: Dataset, seed: int) -> Blend | None:
        return blend_of(train, seed)

    def build_model(self, recompute: str) -> nn.Module:
        return Transformer(self.cfg.model, recompute=recompute)

    @property
    def units_per_sample(self) -> int:
        return self.cfg.model.seq_len

    def card(self, train: Dataset) -> ModelCard:
        assert isinstance(train, TokenDataset)
        return ModelCard.of_run(self.cfg, train.manifest)

    def loss(
        self, model: nn.Module, batch: Any, inputs: LossInputs, distilled: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        tokens_in, targets = batch[:, :-1].to(inputs.device), batch[:, 1:].to(inputs.device)
        with inputs.autocast():
            logits, aux = model(tokens_in)
            if distilled and inputs.teacher is not None:
                parts = inputs.teacher.loss(logits, tokens_in, targets)
                return parts.total, aux, parts.kl
        if inputs.sharded_logits:  # vocabulary-sharded logits under tensor parallelism (loss_context)
            return lm_loss(logits, targets), aux, None
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return loss, aux, None

    def eval_units(self, batch: Any) -> int:
        return batch[:, 1:].numel()


class VitWorkload(Workload):
    """model.kind vit: the VisionTransformer classifier on a labelled image dataset (uint8 pixels in, the model
    normalises them)."""

    kind = "vit"

    def open_datasets(self) -> tuple[ImageDataset, ImageDataset]:
        cfg, vision = self.cfg, self.cfg.model.vision
        assert vision is not None  # ModelConfig requires it for kind vit
        train, val = (
            ImageDataset(cfg.data.dataset_url, split, cfg.storage, expect_kind="labels")
            for split in (cfg.data.train_split, cfg.data.val_split)
        )
        manifest = train.manifest
        for name, have, want in (("num_classes", manifest.num_classes, vision.num_classes),
                                 ("image_size", manifest.image_size, vision.image_size),
                                 ("channels", manifest.channels, vision.channels)):  # fmt: skip
            if have != want:
                raise ImageDatasetError(
                    cfg.data.dataset_url,
                    f"{MANIFEST} {name}={have}, model.vision.{name}={want}",
                    f"set model.vision.{name}: {have}, or prepare the dataset with {name} {want}",
                    file=MANIFEST,
                )
        return train, val

    def build_model(self, recompute: str) -> nn.Module:
        model = self.cfg.model
        assert model.vision is not None
        return VisionTransformer(model.vision, model.vision.num_classes, recompute, model.dropout, model.init_std)

    @property
    def units_per_sample(self) -> int:
        assert self.cfg.model.vision is not None
        return self.cfg.model.vision.n_tokens

    def card(self, train: Dataset) -> ModelCard:
        assert isinstance(train, ImageDataset) and self.cfg.model.vision is not None
        # A classifier's "vocabulary" is its classes; the class names are the dataset manifest's (dataset_url).
        return ModelCard(
            model=self.cfg.model, vocab_size=self.cfg.model.vocab_size, eos_id=None,
            dataset_url=self.cfg.data.dataset_url, tokenizer=CardTokenizer(kind="unknown"),
        )  # fmt: skip

    def _logits(self, model: nn.Module, batch: ImageBatch, inputs: LossInputs) -> torch.Tensor:
        with inputs.autocast():
            return model(batch.images.to(inputs.device))

    def loss(
        self, model: nn.Module, batch: Any, inputs: LossInputs, distilled: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        logits = self._logits(model, batch, inputs)
        loss = F.cross_entropy(logits.float(), batch.targets.to(inputs.device))
        return loss, torch.zeros((), device=inputs.device), None

    def eval_batch(self, model: nn.Module, batch: Any, inputs: LossInputs) -> EvalPart:
        logits = self._logits(model, batch, inputs).float()
        targets = batch.targets.to(inputs.device)
        classes = logits.shape[-1]
        counts = confusion(logits.argmax(dim=-1).cpu(), targets.cpu(), classes).to(inputs.device, torch.float64)
        return EvalPart(F.cross_entropy(logits, targets), self.eval_units(batch), counts)

    def eval_units(self, batch: Any) -> int:
        return batch.targets.numel()

    def eval_metrics(self, counts: torch.Tensor) -> dict[str, Any]:
        counts = counts.round().long().cpu()
        return {"val_accuracy": confusion_accuracy(counts), "val_macro_f1": confusion_macro_f1(counts),
                "val_images": int(counts.sum())}  # fmt: skip


WORKLOADS: dict[str, Callable[[TrainConfig], Workload]] = {"lm": TextWorkload, "vit": VitWorkload}
"""model.kind -> its workload; the kinds of PLUGINS add themselves (`register`) when their module is imported."""

PLUGINS = {"vlm": "training.vlm"}
"""model.kind -> the module that defines and registers its workload (it imports this module for the base class)."""


def register(kind: str, factory: Callable[[TrainConfig], Workload]) -> None:
    """Make `factory` the workload of model.kind `kind` (called by a PLUGINS module when it is imported)."""
    WORKLOADS[kind] = factory


def workload_of(cfg: TrainConfig) -> Workload:
    """The workload of `cfg.model.kind`."""
    kind = cfg.model.kind
    if kind not in WORKLOADS and kind in PLUGINS:
        importlib.import_module(PLUGINS[kind])
    if kind not in WORKLOADS:
        raise ValueError(f"model.kind={kind} has no workload (known: {sorted(WORKLOADS)}); {PLUGINS.get(kind)} "
                         "does not register one")  # fmt: skip
    return WORKLOADS[kind](cfg)
