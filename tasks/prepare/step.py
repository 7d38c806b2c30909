"""The data step: its inputs from the spec, its plain `run`, its result and the constants its tasks use; and
`data_and_training`, the one way every flow and the CLI get the dataset and the training config on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from tasks.errors import UserError
from tasks.init_from import with_init_check
from tasks.prepare.config import DataSpec, PrepareConfig
from tasks.prepare.existing import CheckedDataset, check_dataset_url
from tasks.prepare.images import prepare_images
from tasks.prepare.pipeline import PrepareResult, Progress, prepare_dataset
from tasks.results import Figure, StepResult
from training.dataset import DatasetError, read_manifest, verify_dataset
from training.image_dataset import verify_image_dataset
from training.storage import StorageConfig

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec
    from training.config import TrainConfig

TITLE = "data preprocessing and validation"
ARTIFACT = "prepare-data"
VALIDATION_ARTIFACT = "prepare-data-validation"


class DataInputs(BaseModel):
    """What the data step reads: data.prepare (a corpus to prepare) or the spec's own dataset (data.dataset_url,
    data.blend) with the model's vocab_size to check its token ids against; storage; the reports folder that keeps
    the verdict of a checked dataset."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    data: DataSpec
    vocab_size: int
    storage: StorageConfig
    reports_dir: str
    validate_data: bool = True
    """False: find the prepared (or reused) dataset without running the data suite over it again, for a command
    that reads what a verified checkpoint was trained on (`tdeploy export`) rather than training on it."""

    @property
    def prepare(self) -> PrepareConfig | None:
        """data.prepare: the corpus to prepare (None: the spec's own dataset, checked)."""
        return self.data.prepare

    @classmethod
    def of(cls, spec: DeploymentSpec, validate_data: bool = True) -> DataInputs:
        """The data step of `spec`."""
        return cls(data=spec.data, vocab_size=spec.model.vocab_size, storage=spec.storage, reports_dir=spec.reports_dir,
                   validate_data=validate_data)  # fmt: skip


class DataResult(StepResult):
    """The dataset the job trains on: prepared (or reused) by the data step, or the spec's own (validated)."""

    dataset_url: str
    reused: bool
    given: bool = False
    """The spec's own dataset (data.dataset_url), checked by the data step's token suite."""
    cached_verdict: bool = False
    """The token suite's verdict of an earlier check of this very dataset was reused (nothing rescanned)."""
    splits: dict[str, dict[str, int]] = {}
    sources: list[str] = []
    """Adopted sources the dataset's manifest names outside its folder (the job's DataConfig.sources)."""
    tokenizer_sha256: str | None = None
    vocab_size: int | None = None
    cleaning: dict[str, Any] = {}
    validation: dict[str, Any] = {}
    validation_url: str | None = None
    data_docs_url: str | None = None

    @classmethod
    def of(cls, prepared: PrepareResult) -> DataResult:
        """The result of a data preparation."""
        fields = ("dataset_url", "reused", "splits", "tokenizer_sha256", "vocab_size", "cleaning", "validation")
        values = {name: getattr(prepared, name) for name in fields}
        return cls(**values, validation_url=prepared.validation_url, data_docs_url=prepared.data_docs_url)

    @classmethod
    def of_checked(cls, checked: CheckedDataset) -> DataResult:
        """The result of the token suite over a dataset given by URL."""
        fields = ("dataset_url", "sources", "splits", "tokenizer_sha256", "vocab_size", "validation", "validation_url")
        values = {name: getattr(checked, name) for name in fields}
        return cls(
            **values, reused=True, given=True, cached_verdict=checked.cached, data_docs_url=checked.data_docs_url
        )

    def artifact_problem(self, inputs: Any) -> str | None:
        """The dataset's manifest must be there and every file it lists whole (sizes; digests are the job's)."""
        storage = getattr(inputs, "storage", None)
        if any("images" in counts for counts in self.splits.values()):
            problems = verify_image_dataset(self.dataset_url, storage)
            return "; ".join(problems) if problems else None
        try:
            problems = verify_dataset(self.dataset_url, storage, self.sources, digests=False)
        except DatasetError as err:
            return str(err)
        return f"{self.dataset_url}: {'; '.join(problems)}" if problems else None

    def figures(self) -> dict[str, Figure]:
        """Where the dataset is, its origin, each split's tokens and documents, and its validation."""
        splits = {f"{k}_{n}": v[n] for k, v in self.splits.items() for n in ("tokens", "docs", "images") if n in v}
        origin = "given" if self.given else ("reused" if self.reused else "prepared")
        passed = bool(self.validation.get("success"))
        return {"dataset_url": self.dataset_url, "origin": origin, **splits, "validation_passed": passed,
                "cached_verdict": self.cached_verdict}  # fmt: skip

    def split_sizes(self) -> str:
        """Each split's size in words: `train 1,234 tokens / 56 docs` (text) or `train 360 images` (images)."""
        return ", ".join(
            f"{k} {v['images']:,} images" if "images" in v else f"{k} {v['tokens']:,} tokens / {v['docs']:,} docs"
            for k, v in self.splits.items()
        )

    def summary(self) -> str:
        """Where the dataset is, whether it was reused or given, its splits' sizes and its validation."""
        splits = self.split_sizes()
        origin = "given" if self.given else ("reused" if self.reused else "prepared")
        checked = "passed" if self.validation.get("success") else "skipped"
        if self.cached_verdict:
            checked += " (cached verdict)"
        return f"`{self.dataset_url}` ({origin}): {splits}; validation {checked}"


def run(
    inputs: DataInputs, publish: Callable[[DataResult], None] | None = None, progress: Progress | None = None
) -> DataResult:
    """Prepare data.prepare's corpus (or reuse the finished dataset), else run the token suite over the spec's own
    dataset (or reuse the verdict of an identical check); hand the result to `publish`. A bad dataset raises."""
    if inputs.prepare is not None and inputs.prepare.images is not None:
        result = DataResult.of(prepare_images(inputs.prepare, inputs.storage, progress, inputs.validate_data))
    elif inputs.prepare is not None:
        result = DataResult.of(prepare_dataset(inputs.prepare, inputs.storage, progress, inputs.validate_data))
    else:
        assert inputs.data.given, "a spec without data.prepare has data.dataset_url or data.blend"
        checked = check_dataset_url(inputs.data, inputs.vocab_size, inputs.storage, inputs.reports_dir)
        result = DataResult.of_checked(checked)
    if publish is not None:
        publish(result)
    return result


def training_config(spec: DeploymentSpec, data: DataResult) -> TrainConfig:
    """The training job's config: the spec's training sections on the dataset of the data step."""
    if spec.data.prepare is None:  # the spec's own data, or its adoption: the spec's tokenizer pin stays
        train = spec.training_config(data.dataset_url, spec.data.tokenizer_sha256, data.sources)
    else:
        train = spec.training_config(data.dataset_url, data.tokenizer_sha256)
    return with_init_check(train)  # model.init_from: transformers' logits for the job's load check


def data_and_training(
    spec: DeploymentSpec, step: Callable[[DataInputs], DataResult] = run, validate_data: bool = True
) -> tuple[DataResult, TrainConfig]:
    """The data step's result (by `step`: the flows pass their Prefect task, the CLI `run` with a progress bar)
    and the training config on its dataset: what every flow and CLI command that trains or accepts starts with."""
    data = step(DataInputs.of(spec, validate_data))
    return data, training_config(spec, data)


def check_served_data(spec: DeploymentSpec, data: DataResult) -> None:
    """Refuse, before the job, a spec that serves its model while the data has no tokenizer to ship with it.

    Adopted token ids (a Megatron prefix, a Hugging Face ids column) without data.tokenizer_url train fine, but
    the serving step exports the model, and an export needs the ids' tokenizer: better said now than after
    the training.
    """
    if spec.serve is None or not data.given:
        return
    if read_manifest(data.dataset_url, spec.storage, data.sources).tokenizer.kind == "unknown":
        sources = ", ".join(s.url for s in spec.data.given)
        raise UserError(
            f"serve: the data ({sources}, adopted as {data.dataset_url}) names no tokenizer (data.tokenizer_url is "
            "unset), and the serving step exports the model with the tokenizer of its ids; nothing was trained",
            "set data.tokenizer_url to the tokenizer.json that made the ids, or set serve: null",
        )
