"""Pipeline-level tasks: load the spec, diagnose a failed step, publish the run's summary page."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from prefect import Flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks import tables
from tasks.diagnose import diagnose, diagnose_run, node_report_if_written, plan_if_written
from tasks.errors import retry_on_transient
from tasks.preflight import preflight
from tasks.results import Figure, StepResult
from tasks.spec import DeploymentSpec, SpecError, credential_problems, load_spec, parse_spec
from tasks.steps import DEPLOY, DIAGNOSIS_ARTIFACT, Step
from training.checkpoint import KEY_ENV as CHECKPOINT_KEY_ENV
from training.secrets import redact

# The Prefect Secret block that holds the checkpoint signing key (used when TDEPLOY_CHECKPOINT_KEY is unset).
CHECKPOINT_KEY_BLOCK = "tdeploy-checkpoint-key"

Results = dict[str, StepResult]
"""The steps' results so far, by step name (tasks/steps.py)."""

SpecSource = DeploymentSpec | dict[str, Any] | str
"""What a flow receives: a validated spec, raw spec data (a deployment's JSON parameter), or a path/URL."""


P = ParamSpec("P")
R = TypeVar("R")


class RedactedParametersFlow(Flow[P, R]):
    """A flow whose run parameters reach Prefect with every credential redacted (training/secrets.py `redact`).

    Prefect writes a run's parameters when it creates the run, before any of its tasks: redacting them afterwards
    leaves the secret in SQLite's write-ahead log (and in freed database pages). The flow's code still receives
    what it was given, so that load_spec refuses the credential by its field.
    """

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """Prefect's serialised parameters, redacted."""
        return redact(super().serialize_parameters(parameters))


def spec_flow(name: str, description: str) -> Callable[[Callable[P, R]], RedactedParametersFlow[P, R]]:
    """`@flow(name=..., description=...)` for a flow that takes a spec: its stored parameters are redacted."""

    def decorate(fn: Callable[P, R]) -> RedactedParametersFlow[P, R]:
        return RedactedParametersFlow(fn, name=name, description=description)

    return decorate


def spec_label(spec: SpecSource) -> str:
    """A name for the summary page of a spec that may not have been validated."""
    if isinstance(spec, DeploymentSpec):
        return spec.name
    if isinstance(spec, dict):
        name = spec.get("name")
        return name if isinstance(name, str) and name.isprintable() and len(name) <= 63 else "<spec parameter>"
    return str(redact(spec))


@task(name="load_spec", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_on_transient)
def load_deployment_spec(spec: SpecSource) -> DeploymentSpec:
    """The validated spec: as given, from raw data, or read from a path/URL (storage hiccups are retried).

    A bad spec fails here at once, before any work. A flow made with `spec_flow` never stored the credential;
    a run created by the server (a deployment run from the UI or the API) had its parameters stored as sent, so
    they are redacted here, as early as the flow can.
    """
    if isinstance(spec, DeploymentSpec):
        parsed = spec
    elif isinstance(spec, str):
        parsed = load_spec(spec)
    else:
        try:
            parsed = parse_spec(spec, "<spec parameter>")
        except SpecError:
            if credential_problems(spec):
                _redact_flow_run_parameters()
            raise
    preflight(parsed)
    if checkpoint_key_from_secret_block():
        get_run_logger().info("checkpoint signing key taken from the Prefect Secret block %r", CHECKPOINT_KEY_BLOCK)
    return parsed


def checkpoint_key_from_secret_block() -> bool:
    """Put the checkpoint signing key of the Secret block into this process's environment, which every job
    started from here inherits; only when TDEPLOY_CHECKPOINT_KEY is unset and the block exists."""
    if os.environ.get(CHECKPOINT_KEY_ENV):
        return False
    from prefect.blocks.system import Secret

    try:
        secret = Secret.load(CHECKPOINT_KEY_BLOCK)
    except ValueError:  # no such block: checkpoints stay unsigned unless the variable is set
        return False
    os.environ[CHECKPOINT_KEY_ENV] = secret.get()
    return True


def _redact_flow_run_parameters() -> None:
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    with get_client(sync_client=True) as client:
        stored = client.read_flow_run(flow_run.id).parameters
        if redact(stored) == stored:  # stored redacted already (spec_flow)
            return
        client.update_flow_run(flow_run.id, parameters=redact(stored))
    get_run_logger().warning("the spec parameter held a credential: redacted in the flow run's stored parameters")


@task(name="diagnose_failure")
def diagnose_failure(
    step: str, error: str, run_dir: str | None, plan_url: str | None, nodes_report: str | None
) -> dict:
    """Classify a failed step against the known causes; publish the findings."""
    logger = get_run_logger()
    if run_dir and Path(run_dir).exists():
        result = diagnose_run(Path(run_dir), error, plan_url, nodes_report)
    else:
        result = diagnose(error, "", None, plan_if_written(plan_url), node_report_if_written(nodes_report))
    for finding in result.findings:
        logger.error("diagnosis: %s", finding.describe())
    create_markdown_artifact(key=DIAGNOSIS_ARTIFACT, markdown=result.markdown(), description=f"why {step} failed")
    return result.to_json()


def _failure(error: str | None) -> str:
    """The error's first line, and the problems a SpecError lists under it."""
    lines = (error or "").splitlines()
    if not lines:
        return ""
    problems = [line.strip().removeprefix("- ") for line in lines[1:] if line.strip().startswith("- ")]
    return (lines[0][:300] + (" " + "; ".join(problems) if problems else ""))[:2000]


VERDICTS = ("passed", "skipped", "FAILED", "not run")
SUMMARY_JSON, SUMMARY_MD = "summary.json", "summary.md"  # in the reports folder
FIGURES_SHOWN = 12
"""Key figures a summary row shows (summary.json has them all)."""


@dataclass
class StepRow:
    """One step of the summary: its verdict, its key figures (numbers, each name with its unit), a note (why it
    failed or was skipped, in full) and where its details are."""

    step: str
    title: str
    verdict: str
    figures: dict[str, Figure]
    details: str
    note: str = ""

    def text(self) -> str:
        """The figures as people read them (`name=value unit`, tasks/tables.py), after the note."""
        shown = tables.text(self.figures, limit=FIGURES_SHOWN) if self.figures else ""
        return "; ".join(part for part in (self.note, shown) if part)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepRow:
        """A row as summary.json holds it; a summary from before the figures were numbers has them as one display
        string, read as the note (its figures: none)."""
        if isinstance(data.get("figures"), str):
            data = {**data, "figures": {}, "note": data["figures"]}
        return cls(**data)


@dataclass
class RunSummary:
    """What a deploy-training run did: one row per step, and the diagnosis of a failed one."""

    name: str
    failed_step: str | None
    steps: list[StepRow]
    error: str | None = None
    diagnosis: dict[str, Any] | None = None

    @property
    def findings(self) -> list[dict[str, Any]]:
        """The diagnosis's findings (cause, evidence, fix), most likely first."""
        return list((self.diagnosis or {}).get("findings") or [])

    def to_json(self) -> dict[str, Any]:
        """As a dict (summary.json)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSummary:
        """Inverse of to_json."""
        return cls(**{**data, "steps": [StepRow.from_json(row) for row in data["steps"]]})

    def markdown(self) -> str:
        """The summary page: one row per step with its verdict, key figures and the detailed artifact's key."""
        verdict = "failed" if self.failed_step else "succeeded"
        lines = [
            f"# Deployment `{self.name}`: {verdict}",
            "",
            "| step | verdict | key figures | details |",
            "|---|---|---|---|",
        ]
        for row in self.steps:
            status = "**FAILED**" if row.verdict == "FAILED" else row.verdict
            lines.append(f"| {row.title} | {status} | {row.text().replace('|', chr(92) + '|')} | {row.details} |")
        if self.findings:
            lines += ["", "## Diagnosis", ""]
            lines += [f"- **{f['cause']}**: {f['fix']}" for f in self.findings]
        return "\n".join(lines) + "\n"

    def write(self, folder: str | Path) -> Path:
        """summary.json (for programs) and summary.md (for people) in `folder`; the JSON's path."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        (out / SUMMARY_MD).write_text(self.markdown())
        path = out / SUMMARY_JSON
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2, default=str))
        tmp.replace(path)  # a reader never sees half a file
        return path

    @classmethod
    def read(cls, folder: str | Path, since_unix_s: float = 0.0) -> RunSummary | None:
        """The summary a run wrote into `folder` (at or after `since_unix_s`), if any."""
        path = Path(folder) / SUMMARY_JSON
        try:
            if path.stat().st_mtime < since_unix_s:
                return None  # an earlier run's
            return cls.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return None


def summarize(
    name: str,
    results: Results,
    failed_step: str | None,
    error: str | None,
    diagnosis: dict | None,
    steps: tuple[Step, ...] = DEPLOY,
) -> RunSummary:
    """The run's summary from the steps' results, the failed step and its error, and the diagnosis: one row per
    step of the flow's list (tasks/steps.py)."""
    rows = []
    for step in steps:
        figures, note = {}, ""
        if step.name in results:
            result = results[step.name]
            verdict, figures, note = result.verdict, result.figures(), result.note()
        elif step.name == failed_step:
            verdict, note = "FAILED", _failure(error)
        elif step.name == "spec":
            verdict = "passed"
        else:
            verdict = "not run"
        details = f"artifact `{step.artifact}`" if step.name != "spec" or step.name == failed_step else "-"
        rows.append(StepRow(step.name, step.title, verdict, figures, details, note))
    return RunSummary(name, failed_step, rows, error, diagnosis)


def summary_markdown(
    name: str, results: Results, failed_step: str | None, error: str | None, diagnosis: dict | None
) -> str:
    """The summary page: one row per step with its verdict, key figures and the detailed artifact's key."""
    return summarize(name, results, failed_step, error, diagnosis).markdown()


@task(name="publish_summary")
def publish_summary(
    name: str,
    results: Results,
    failed_step: str | None,
    error: str | None,
    diagnosis: dict | None,
    reports_dir: str | None = None,
    steps: tuple[Step, ...] = DEPLOY,
) -> str:
    """One markdown page with every step's verdict, key figures and the detailed artifacts' keys (one row per step
    of the flow's list `steps`); with `reports_dir`, also summary.json and summary.md there (what `tdeploy run`
    prints at the end)."""
    summary = summarize(name, results, failed_step, error, diagnosis, steps)
    markdown = summary.markdown()
    verdict = "failed" if failed_step else "succeeded"
    create_markdown_artifact(key="deployment-summary", markdown=markdown, description=f"{name}: {verdict}")
    if reports_dir is not None:
        get_run_logger().info("summary: %s", summary.write(reports_dir))
    return markdown


def published_markdown(flow_run_id: str, key: str) -> str | None:
    """The markdown a flow run published under artifact `key` (its latest), if any."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    artifacts = ArtifactFilter(
        key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
    )
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=artifacts, sort=ArtifactSort.CREATED_DESC, limit=1)
    return str(found[0].data) if found else None
