"""model.json: the model card a checkpoint carries (architecture, tokenizer, dataset)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from training.config import ModelConfig, StrictModel
from training.storage import join

if TYPE_CHECKING:
    from training.config import TrainConfig
    from training.dataset import DatasetManifest

CARD_VERSION = 1


class CardTokenizer(StrictModel):
    """Which tokenizer produced the ids the model was trained on (the dataset's, training/dataset.py)."""

    kind: Literal["bytes", "bpe", "unknown"] = Field(
        description="bytes: id = UTF-8 byte value, EOS 256; bpe: a tokenizer.json; unknown: an adopted dataset's ids, "
        "tokenizer not given."
    )
    url: str | None = Field(default=None, description="Path or fsspec URL of the dataset's tokenizer.json (bpe).")
    sha256: str | None = Field(default=None, description="sha256 of that tokenizer.json (bpe).")


class ModelCard(StrictModel):
    """model.json: what a checkpoint holds, for whoever turns it into something else (tasks/export)."""

    format_version: int = Field(default=CARD_VERSION, description="Version of this record's layout.")
    model: ModelConfig = Field(description="The architecture the weights belong to.")
    vocab_size: int = Field(ge=2, description="The tokenizer's (dataset's) vocabulary; model.vocab_size may be more.")
    eos_id: int | None = Field(description="End-of-text id of the dataset (None: documents carry no EOS).")
    dataset_url: str = Field(description="The dataset the run trained on.")
    tokenizer: CardTokenizer
    expert_capacity_factor: float | None = Field(
        default=None, description="MoE: parallel.expert_capacity_factor of the run (tokens over capacity dropped)."
    )

    @classmethod
    def of_run(cls, cfg: TrainConfig, manifest: DatasetManifest) -> ModelCard:
        """The card of a run of `cfg` on the dataset whose manifest is `manifest`."""
        tok = manifest.tokenizer
        url = join(cfg.data.dataset_url, tok.path) if tok.path is not None else None
        return cls(
            model=cfg.model,
            vocab_size=manifest.vocab_size,
            eos_id=manifest.eos_id,
            dataset_url=cfg.data.dataset_url,
            tokenizer=CardTokenizer(kind=tok.kind, url=url, sha256=tok.sha256 or cfg.data.tokenizer_sha256),
            expert_capacity_factor=cfg.parallel.expert_capacity_factor if cfg.model.moe else None,
        )
