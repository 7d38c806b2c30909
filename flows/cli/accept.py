"""`tdeploy accept`, `drill` and `diagnose`: the acceptance and drill steps' plain functions with a table and
progress lines, and the diagnosis of a failed run."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table
from rich.text import Text

from flows.cli.common import EXIT_FAILED_CHECK, EXIT_USER_ERROR, SPEC_HELP, console, err_console, example, load
from flows.cli.data import training_config_prepared
from tasks.acceptance.mode import Mode

if TYPE_CHECKING:
    from tasks.acceptance.step import AcceptanceStepInputs
    from tasks.spec import DeploymentSpec
    from training.config import TrainConfig

app = typer.Typer()

_WORKSPACE_HELP = (
    "Folder under which each run gets a fresh workspace <out>/<run-id>/ with its jobs and reports (the report as "
    "JSON, junit.xml, loss_curve.png; drills in drills/), and latest -> the last one; default acceptance.work_url "
    "(runs/<name>/acceptance)."
)


@contextlib.contextmanager
def _progress_lines() -> Iterator[None]:
    """Plain progress lines on stdout while acceptance or the drills run (minutes without other output): each
    phase, and within one its count every 30 s. They replace the progress logger's lines of the phases."""
    from tasks.progress import PlainLines, listening

    logger = logging.getLogger("tasks.progress")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with listening(PlainLines(lambda text: console.print(text, markup=False, highlight=False))):
            yield
    finally:
        logger.setLevel(level)


def _print_acceptance(report, files: dict[str, str | None]) -> None:  # noqa: ANN001 - AcceptanceReport
    from tasks.acceptance.report import table_rows

    table = Table("check", "verdict", "measured", "threshold", "look first", show_lines=True)
    for row in table_rows(report):
        style = {"pass": "green", "n/a": "yellow", "not measured": "yellow"}.get(row["verdict"], "red")
        cells = (Text(row["check"]), Text(row["verdict"], style=style), Text(row["measured"]), Text(row["threshold"]),
                 Text(row["look first"]))  # fmt: skip
        table.add_row(*cells)
    console.print(table)
    if report.plan_accuracy is not None:
        console.print(report.plan_accuracy.line(), markup=False, highlight=False)
    written = [path for path in files.values() if path is not None]
    verdict = report.to_json()["verdict"]
    console.print(f"verdict: {verdict}; " + ", ".join(str(p) for p in written), markup=False, highlight=False)


class AcceptMode(StrEnum):
    """The modes `tdeploy accept` runs (a canary is `tdeploy rollout`'s)."""

    FULL = Mode.FULL.value
    SOAK = Mode.SOAK.value


def accept_inputs(
    parsed: DeploymentSpec, cfg: TrainConfig, mode: AcceptMode, drills: bool, image: str | None, out: Path | None
) -> AcceptanceStepInputs:
    """What `tdeploy accept` runs: the acceptance step's inputs of `cfg` in `mode`, in a fresh workspace
    <out>/<run-id>/ (default: under acceptance.work_url)."""
    from tasks.acceptance.step import AcceptanceStepInputs

    return AcceptanceStepInputs.of(
        parsed, cfg, image=image, mode=Mode(mode), with_drills=drills, work_url=str(out) if out else None
    )


@app.command(epilog=example("tdeploy accept examples/local.yaml --drills --out runs/local/acceptance",
                            "tdeploy accept examples/local.yaml --mode soak"))  # fmt: skip
def accept(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    drills: bool = typer.Option(False, "--drills", help="Also run every checkpoint-restore drill."),
    mode: AcceptMode = typer.Option(
        AcceptMode.FULL, "--mode",
        help="full: acceptance.steps; soak: acceptance.soak_steps for the distributed run (the stability soak).",
    ),  # fmt: skip
    image: str | None = typer.Option(None, "--image", help="Image reference the jobs run in."),
    out: Path | None = typer.Option(None, "--out", help=_WORKSPACE_HELP),
) -> None:
    """Accept the deployment by every dimension of the check table; exit 1 when any fails."""
    from tasks.acceptance.step import AcceptanceFailed, run

    parsed = load(spec)
    inputs = accept_inputs(parsed, training_config_prepared(parsed), mode, drills, image, out)
    try:
        with _progress_lines():
            run(inputs, _print_acceptance)
    except AcceptanceFailed:  # the table said which check failed
        raise typer.Exit(EXIT_FAILED_CHECK) from None


@app.command(epilog=example("tdeploy drill examples/local.yaml --only rank_kill --out runs/local/acceptance"))
def drill(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    only: list[str] | None = typer.Option(None, "--only", help="Run just this drill (repeatable)."),
    image: str | None = typer.Option(None, "--image", help="Image reference the jobs run in."),
    out: Path | None = typer.Option(None, "--out", help=_WORKSPACE_HELP),
) -> None:
    """Run the checkpoint-restore drills; exit 1 when one fails."""
    from tasks.acceptance.config import DRILLS
    from tasks.acceptance.step import AcceptanceFailed, DrillsInputs, run_drills

    parsed = load(spec)
    unknown = sorted(set(only or []) - set(DRILLS))
    if unknown:
        err_console.print(f"--only {unknown[0]}: no such drill; use one of {list(DRILLS)}", markup=False)
        raise typer.Exit(EXIT_USER_ERROR)
    cfg = training_config_prepared(parsed)
    inputs = DrillsInputs.of(parsed, cfg, image=image, only=only, work_url=str(out) if out else None)
    try:
        with _progress_lines():
            run_drills(inputs, _print_acceptance)
    except AcceptanceFailed:  # the table said which drill failed
        raise typer.Exit(EXIT_FAILED_CHECK) from None


@app.command(
    epilog=example(
        "tdeploy diagnose runs/local/output", "tdeploy diagnose runs/local/output --spec examples/local.yaml"
    )
)
def diagnose(
    run_dir: Path = typer.Argument(..., help="A run's output folder (train.log, metrics/), or an acceptance run's."),
    spec: str | None = typer.Option(
        None, "--spec", help="The deployment's spec: its plan.json and node-check.json are read too."
    ),
) -> None:
    """Classify a failed run against the known causes, with the evidence and the fix."""
    from tasks.diagnose import diagnose_run
    from tasks.paths import DeploymentPaths

    if not run_dir.is_dir():
        err_console.print(f"{run_dir}: no such folder; pass a run's output folder", markup=False)
        raise typer.Exit(EXIT_USER_ERROR)
    plan_url = node_report = None
    if spec is not None:  # the deployment's own reports; none is looked for around the run folder
        paths = DeploymentPaths.of(load(spec))
        plan_url, node_report = paths.plan_url(), paths.node_report()
    result = diagnose_run(run_dir, "", plan_url, node_report)
    if console.is_terminal:
        from rich.markdown import Markdown

        console.print(Markdown(result.markdown()))
    else:  # a file or a pipe: the Markdown text itself, as the flow publishes it
        console.print(result.markdown(), markup=False, highlight=False, soft_wrap=True)
    if result.findings:
        raise typer.Exit(EXIT_FAILED_CHECK)
