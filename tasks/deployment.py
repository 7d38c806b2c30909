"""How a deployment's steps connect: each step's inputs derived from the spec, and each step's typed result.

The CLI commands and the flows' steps both build their inputs here, so that `tdeploy X` and the flow's step X
cannot differ. Importing this module loads neither Prefect nor torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from tasks.capacity.memory import GIB
from training.storage import filesystem
from validation.plan_accuracy import PlannedFigures

if TYPE_CHECKING:
    from tasks.capacity.plan import CapacityPlan
    from tasks.image.build import ImageResult
    from tasks.image.config import ImageConfig
    from tasks.nodes.report import NodeReport
    from tasks.prepare.existing import CheckedDataset
    from tasks.prepare.pipeline import PrepareResult
    from tasks.spec import DeploymentSpec
    from training.config import TrainConfig

NODE_REPORT = "node-check.json"
IMAGE_DIR = "image"
EXPORT_DIR = "export"
SERVING_DIR = "serving"


class StepResult(BaseModel):
    """What one step did: small, typed, serialisable (Prefect persists and caches it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @property
    def verdict(self) -> Literal["passed", "skipped"]:
        """`skipped` for a step that did not do its work, else `passed`."""
        return "passed"

    def summary(self) -> str:
        """The step's key figures in one line."""
        raise NotImplementedError

    def artifact_problem(self, inputs: dict[str, Any]) -> str | None:
        """What is wrong with the files this result points at, for a cached copy of it (None: nothing).

        `inputs` are the step's call arguments (the storage to look with)."""
        return None


class CapacityResult(StepResult):
    """The capacity plan of the requested layout."""

    plan_url: str
    fits: bool
    layout: str
    peak_bytes: int
    usable_bytes: int
    step_seconds: float
    planned: PlannedFigures | None = None
    """The planner's own figures that acceptance holds the run to (uncalibrated)."""
    calibration: str = "none"
    """Where the plan's calibration came from: none, the calibration file, or the ledger's accepted runs."""

    @classmethod
    def of(cls, plan: CapacityPlan, plan_url: str) -> CapacityResult:
        """The result of a written plan."""
        ev = plan.requested
        return cls(
            plan_url=plan_url,
            fits=plan.fits,
            layout=ev.layout.describe(),
            peak_bytes=int(ev.memory.total),
            usable_bytes=int(ev.usable_bytes),
            step_seconds=ev.step_seconds,
            planned=plan.planned(),
            calibration=plan.calibration.source,
        )

    def artifact_problem(self, inputs: dict[str, Any]) -> str | None:
        """plan.json must be there and readable."""
        fs, path = filesystem(self.plan_url, inputs.get("storage"))
        if not fs.exists(path):
            return f"{self.plan_url} is missing"
        try:
            json.loads(fs.cat_file(path))
        except ValueError:
            return f"{self.plan_url} is not whole (not JSON)"
        return None

    def summary(self) -> str:
        """Fit, peak memory per device, step time and where the plan is."""
        return (
            f"fits: {self.fits}; peak {self.peak_bytes / GIB:.2f} GiB of {self.usable_bytes / GIB:.2f} GiB usable "
            f"per device ({self.layout}); step {self.step_seconds:.3g} s; plan `{self.plan_url}`"
        )


class NodesResult(StepResult):
    """The node checks' outcome (blocking findings fail the step instead)."""

    ok: bool
    hosts: list[str]
    warnings: int
    report_path: str
    elapsed_s: float

    @classmethod
    def of(cls, report: NodeReport, report_path: str) -> NodesResult:
        """The result of a written node report."""
        return cls(
            ok=report.ok,
            hosts=list(report.hosts),
            warnings=len(report.warnings),
            report_path=report_path,
            elapsed_s=round(report.elapsed_s, 3),
        )

    def summary(self) -> str:
        """Hosts, warnings and where the report is."""
        return f"{len(self.hosts)} host(s), {self.warnings} warning(s); `{self.report_path}`"


class ImageStepResult(StepResult):
    """The image step: built, cached or skipped, with image.json's content when an image was considered."""

    status: Literal["built", "cached", "skipped"]
    reason: str
    record: dict[str, Any] | None = None
    """The content of image.json (tasks.image.build.ImageResult.to_json); None for image: null."""

    @classmethod
    def of(cls, image: ImageResult) -> ImageStepResult:
        """The result of an image build (or its cache hit)."""
        return cls(status=image.status, reason=image.reason, record=image.to_json())

    @property
    def verdict(self) -> Literal["passed", "skipped"]:
        """`skipped` when nothing was built or found."""
        return "skipped" if self.status == "skipped" else "passed"

    @property
    def job_image(self) -> str | None:
        """The reference the job runs: the pushed image by digest; None (the nodes' environment) otherwise."""
        if self.record is None or not self.record.get("pushed"):
            return None
        return self.record.get("reference_by_digest")

    def artifact_problem(self, inputs: dict[str, Any]) -> str | None:
        """image.json must be there and name the same image; a pushed image must still be in its registry."""
        from tasks.image.build import IMAGE_JSON
        from tasks.image.registry import RegistryClient

        if self.record is None:
            return None
        path = Path(self.record["record_dir"]) / IMAGE_JSON
        try:
            written = json.loads(path.read_text())
        except FileNotFoundError:
            return f"{path} is missing"
        except ValueError:
            return f"{path} is not whole (not JSON)"
        if written.get("content_sha256") != self.record.get("content_sha256"):
            return f"{path} names another image ({written.get('tag')})"
        image = inputs.get("image")
        if self.record.get("pushed") and image is not None and image.registry_url:
            client = RegistryClient(image.registry_url, image.registry_insecure)
            if client.manifest(image.repository, self.record["tag"]) is None:
                return f"{self.record['reference']} is no longer in the registry"
        return None

    def summary(self) -> str:
        """Status, the image's reference and why."""
        record = self.record or {}
        reference = record.get("reference_by_digest") or record.get("reference") or "-"
        return f"{self.status}: `{reference}`; {self.reason}"


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

    def artifact_problem(self, inputs: dict[str, Any]) -> str | None:
        """The dataset's manifest must be there and every file it lists whole (sizes; digests are the job's)."""
        from training.dataset import DatasetError, verify_dataset

        try:
            problems = verify_dataset(self.dataset_url, inputs.get("storage"), self.sources, digests=False)
        except DatasetError as err:
            return str(err)
        return f"{self.dataset_url}: {'; '.join(problems)}" if problems else None

    def summary(self) -> str:
        """Where the dataset is, whether it was reused or given, its splits' sizes and its validation."""
        splits = ", ".join(f"{k} {v['tokens']:,} tokens / {v['docs']:,} docs" for k, v in self.splits.items())
        origin = "given" if self.given else ("reused" if self.reused else "prepared")
        checked = "passed" if self.validation.get("success") else "skipped"
        if self.cached_verdict:
            checked += " (cached verdict)"
        return f"`{self.dataset_url}` ({origin}): {splits}; validation {checked}"


class JobResult(StepResult):
    """The submitted training job and the state it was left in."""

    job: str
    state: str
    output_dir: str
    handle: dict[str, Any]

    def summary(self) -> str:
        """The job's reference, state and output folder."""
        return f"`{self.job}` {self.state}; output `{self.output_dir}`"


class AcceptanceResult(StepResult):
    """An acceptance (or drills) run: its verdict, its report and where its files are."""

    verdict_text: str
    files: dict[str, str | None]
    report: dict[str, Any]
    root: str
    latest: str | None = None

    def summary(self) -> str:
        """The verdict and each dimension's and drill's outcome."""
        verdicts = {True: "pass", False: "FAIL", None: "not measured"}
        rows = [f"{d['name']} {verdicts[d['passed']]}" for d in self.report.get("dimensions", [])]
        rows += [
            f"{d['name']} {'pass' if d['passed'] else ('n/a' if d['passed'] is None else 'FAIL')}"
            + (f" (recovery {d['recovery_s']:.1f} s)" if d.get("recovery_s") is not None else "")
            for d in self.report.get("drills", [])
        ]
        text = ", ".join(rows)
        plan = self.report.get("plan_accuracy")
        if plan:  # the capacity plan beside what the run measured
            text = f"{text}; {plan['line']}" if text else plan["line"]
        return f"{self.verdict_text}: {text}"


class ServingResult(StepResult):
    """The serving check: the served checkpoint, its latency, throughput, parity and quality figures."""

    verdict_text: str
    step: int
    model_dir: str
    p99_e2e_ms: float
    p99_ttft_ms: float
    output_tokens_per_s: float
    error_rate: float
    greedy_matched: int
    greedy_prompts: int
    rouge_l: float
    bleu4: float
    files: dict[str, str]
    failed: list[str] = []

    def summary(self) -> str:
        """Verdict, P99 latencies, throughput, errors, parity and quality, and where serving.json is."""
        return (
            f"{self.verdict_text}: step {self.step}; P99 e2e {self.p99_e2e_ms:.1f} ms, TTFT {self.p99_ttft_ms:.1f} ms; "
            f"{self.output_tokens_per_s:.0f} output tokens/s; errors {self.error_rate:.1%}; greedy parity "
            f"{self.greedy_matched}/{self.greedy_prompts}; ROUGE-L {self.rouge_l:.3f}, BLEU-4 {self.bleu4:.2f}; "
            f"`{self.files.get('json', '-')}`"
        )


class SkippedResult(StepResult):
    """A step the spec turns off (for example `serve: null`)."""

    reason: str

    @property
    def verdict(self) -> Literal["passed", "skipped"]:
        """Always skipped."""
        return "skipped"

    def summary(self) -> str:
        """Why it was skipped."""
        return f"skipped: {self.reason}"


class ExportResult(StepResult):
    """A checkpoint exported as a Hugging Face model folder."""

    model_dir: str
    step: int
    checkpoint_dir: str
    """The source checkpoint's step folder (a path, or a URL on an object store)."""
    n_params: int
    files: list[str]
    bytes: int
    """Bytes of every file written, EXPORT.json included."""
    architecture: str
    notes: list[str] = []
    """Where the exported model computes something other than the run (an MoE capacity factor, say)."""

    def summary(self) -> str:
        """Step, architecture, size and where the folder is."""
        notes = f"; {len(self.notes)} note(s) in EXPORT.json" if self.notes else ""
        return (
            f"step {self.step} as {self.architecture}: {self.n_params / 1e6:.2f}M params, {len(self.files)} files, "
            f"{self.bytes / 1e6:.1f} MB in `{self.model_dir}`{notes}"
        )


@dataclass(frozen=True)
class ImageInputs:
    """The image step's arguments, in the order `build_image` takes them."""

    image: ImageConfig | None
    record_dir: str
    with_s3: bool
    allow_skip: bool
    spec_digest: str | None

    def args(self) -> tuple[Any, ...]:
        """As positional arguments."""
        return (self.image, self.record_dir, self.with_s3, self.allow_skip, self.spec_digest)

    def ensure(self) -> ImageResult:
        """Build and push the image unless its tag exists (`ensure_image`); image: null is the caller's case."""
        from pathlib import Path

        from tasks.image.build import ensure_image

        assert self.image is not None, "callers handle image: null"
        return ensure_image(
            self.image,
            Path(self.record_dir),
            with_s3=self.with_s3,
            spec_digest=self.spec_digest,
            allow_skip=self.allow_skip,
        )


def plan_inputs(spec: DeploymentSpec) -> tuple[Any, ...]:
    """The capacity step's arguments (`plan_capacity`, `estimate_capacity`)."""
    return (spec.name, spec.capacity, spec.cluster, spec.model, spec.parallel, spec.precision, spec.run, spec.serve)


def calibration_inputs(spec: DeploymentSpec) -> tuple[str, Any]:
    """The capacity step's calibration source (`make_plan`, `estimate_capacity`): the ledger and its storage."""
    from tasks.ledger.registry import ledger_url

    return ledger_url(spec.acceptance, spec.run.output_url), spec.storage


def planned_figures(spec: DeploymentSpec) -> PlannedFigures:
    """The capacity plan's own (uncalibrated) figures for the spec's layout, that acceptance compares with a run."""
    from tasks.capacity.calibration import NONE
    from tasks.capacity.plan import plan_capacity

    return plan_capacity(*plan_inputs(spec), calibration=NONE).planned()


def plan_url(spec: DeploymentSpec, folder: str | None = None) -> str:
    """Where plan.json goes: in `folder`, else capacity.output_url (the deployment's reports folder by default)."""
    from tasks.capacity.plan import plan_location

    return plan_location(spec.name, spec.capacity, folder)


def node_report_path(spec: DeploymentSpec, folder: str | None = None) -> str:
    """Where node-check.json goes: in `folder`, else in the deployment's reports folder."""
    return f"{(folder or spec.reports_dir).rstrip('/')}/{NODE_REPORT}"


def serving_dir(spec: DeploymentSpec, folder: str | None = None) -> str:
    """Where the serving check writes serving.json, its logs and the manifests: `folder`, else <reports>/serving."""
    return folder or f"{spec.reports_dir.rstrip('/')}/{SERVING_DIR}"


def export_dir(spec: DeploymentSpec) -> str:
    """The folder exports go under, one step-<N>/ each: <deployment_dir>/export."""
    return f"{spec.reports_dir.rstrip('/')}/{EXPORT_DIR}"


def serving_inputs(spec: DeploymentSpec, train: TrainConfig, folder: str | None = None) -> tuple[Any, ...]:
    """The serving step's arguments (`check_serving`, `serving_check`): the serve section, the training config
    whose checkpoint is served, the accelerator, the served model's name, the report folder, the export root."""
    assert spec.serve is not None, "callers handle serve: null"
    return (spec.serve, train, spec.cluster.accelerator, spec.name, serving_dir(spec, folder), export_dir(spec))


def image_inputs(spec: DeploymentSpec, record_dir: str | None = None) -> ImageInputs:
    """The image step's arguments: image.json and the build context in `record_dir`, else <reports_dir>/image."""
    from tasks.image.build import uses_s3

    return ImageInputs(
        spec.image,
        record_dir or f"{spec.reports_dir}/{IMAGE_DIR}",
        uses_s3(spec),
        spec.cluster.scheduler in ("local", "ssh"),  # their agents run the hosts' Python, not an image
        spec.digest(),
    )


def dataset_check_inputs(spec: DeploymentSpec) -> tuple[Any, ...]:
    """The data step's arguments for data.dataset_url (`check_dataset_url`, `check_dataset`): the data section,
    the model's vocab_size, storage, and the reports folder that keeps the verdict."""
    assert spec.data.given, "a spec without data.prepare has data.dataset_url or data.blend"
    return (spec.data, spec.model.vocab_size, spec.storage, spec.reports_dir)


def existing_dataset(spec: DeploymentSpec) -> DataResult:
    """The data result of a spec that trains on an existing dataset (data.dataset_url): the token suite over
    the whole dataset first (or the cached verdict of an identical check); a bad dataset raises."""
    from tasks.prepare.existing import check_dataset_url

    return DataResult.of_checked(check_dataset_url(*dataset_check_inputs(spec)))


def check_served_data(spec: DeploymentSpec, data: DataResult) -> None:
    """Refuse, before the job, a spec that serves its model while the data has no tokenizer to ship with it.

    Adopted token ids (a Megatron prefix, a Hugging Face ids column) without data.tokenizer_url train fine, but
    the serving step exports the model, and an export needs the ids' tokenizer: better said now than after
    the training.
    """
    from tasks.errors import UserError
    from training.dataset import read_manifest

    if spec.serve is None or not data.given:
        return
    if read_manifest(data.dataset_url, spec.storage, data.sources).tokenizer.kind == "unknown":
        sources = ", ".join(s.url for s in spec.data.given)
        raise UserError(
            f"serve: the data ({sources}, adopted as {data.dataset_url}) names no tokenizer (data.tokenizer_url is "
            "unset), and the serving step exports the model with the tokenizer of its ids; nothing was trained",
            "set data.tokenizer_url to the tokenizer.json that made the ids, or set serve: null",
        )


def training_config(spec: DeploymentSpec, data: DataResult) -> TrainConfig:
    """The training job's config: the spec's training sections on the dataset of the data step."""
    if spec.data.prepare is None:  # the spec's own data, or its adoption: the spec's tokenizer pin stays
        return spec.training_config(data.dataset_url, spec.data.tokenizer_sha256, data.sources)
    return spec.training_config(data.dataset_url, data.tokenizer_sha256)
