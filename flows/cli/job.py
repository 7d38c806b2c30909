"""`tdeploy plan`, `check-nodes`, `build-image`, `train`, `submit`, `status`, `cancel` and `run`: the training job,
from the plan and the nodes it needs to the job itself and the whole flow."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table
from rich.text import Text

from flows.cli.common import (
    CHECK_PATHS_HELP,
    EXIT_FAILED_CHECK,
    EXIT_USER_ERROR,
    PATHS_NOT_CHECKED,
    SPEC_HELP,
    console,
    err_console,
    example,
    load,
)
from flows.cli.data import training_config_prepared

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

app = typer.Typer()

JOB_HELP = "Job reference (scheduler:id) or the run's output folder."


@app.command(
    "plan",
    epilog=example(
        "tdeploy plan examples/local.yaml",
        "tdeploy plan examples/local.yaml --json",
        "tdeploy plan examples/local.yaml --emit-parallel",
    ),
)
def plan(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print plan.json to stdout instead of the table."),
    out: str | None = typer.Option(
        None,
        "--out",
        help="Folder for plan.json; default capacity.output_url (deployment_dir unless set).",
    ),
    self_check: bool = typer.Option(
        False,
        "--self-check",
        help="Also measure one training step of the model on this machine and compare; a tensor/pipeline/expert "
        "layout also runs a tiny model in its shape on up to 4 gloo processes and compares its traffic.",
    ),
    emit_parallel: bool = typer.Option(
        False,
        "--emit-parallel",
        help="Print only the `parallel:` section of the fastest fitting layout the payload runs (YAML to paste "
        "into the spec); exit 1 if no layout fits.",
    ),
    check_paths: bool = typer.Option(False, "--check-paths", help=CHECK_PATHS_HELP),
) -> None:
    """Estimate memory, time and communication, search the layouts (offline); exit 1 if the requested one does
    not fit."""
    from tasks.capacity.report import format_self_check, rich_report
    from tasks.capacity.step import CapacityInputs

    parsed = load(spec, check_paths)
    result = CapacityInputs.of(parsed).make()
    if self_check:
        from tasks.capacity.measure import run_self_check  # imports torch: only when asked

        result.self_check = [run_self_check(parsed.model, parsed.parallel, parsed.precision, parsed.cluster)]
        if parsed.parallel.model_parallel:  # the layout's traffic too, from a tiny model in its shape on gloo
            from tasks.layout_check import run_parallel_self_check

            checked = run_parallel_self_check(parsed.model, parsed.parallel, parsed.precision, parsed.cluster)
            result.self_check.append(checked)
    url = _write_plan(result, parsed, out)
    if emit_parallel:
        if result.chosen() is None:
            err = result.error()
            err_console.print(f"{err.message}\n{err.fix}", style="red", markup=False, highlight=False)
            raise typer.Exit(EXIT_FAILED_CHECK)
        if not result.fits:
            err_console.print(
                f"the requested layout {result.requested.layout.describe()} does not fit; "
                "printed the fastest that does",
                style="yellow", markup=False, highlight=False,
            )  # fmt: skip
        sys.stdout.write(result.emit_parallel())
        return
    intervals = result.checkpoint_interval
    if as_json:
        console.print_json(data=result.to_json())
    else:
        console.print(rich_report(result))
        for line in intervals.lines() if intervals is not None else ():
            console.print(line, markup=False, highlight=False)
        for check in result.self_check:
            console.print(format_self_check(check), markup=False, highlight=False)
        if url:
            console.print(f"plan {url}", markup=False, highlight=False)
        if not check_paths:
            console.print(PATHS_NOT_CHECKED, markup=False, highlight=False)
    if not result.fits:
        err = result.error()
        err_console.print(f"{err.message}\n{err.fix}", style="red", markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED_CHECK)


def _write_plan(result, parsed: DeploymentSpec, out: str | None) -> str | None:  # noqa: ANN001 - CapacityPlan
    """Write plan.json into --out, else into capacity.output_url when this machine can write there: its URL.

    A spec made for a cluster names a folder of the cluster (`/shared/...`): planning it elsewhere prints the plan
    and says why plan.json was not written (None) instead of failing.
    """
    from tasks.capacity.plan import write_plan
    from tasks.preflight import path_problem

    if out is None:
        problem = path_problem(parsed, "capacity.output_url")
        if problem:
            err_console.print(
                f"plan.json not written: {problem}; or pass --out DIR", style="yellow", markup=False, highlight=False
            )
            return None
    return write_plan(result, out)


@app.command("check-nodes", epilog=example("tdeploy check-nodes examples/local.yaml --out runs/local"))
def check_nodes(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Folder for node-check.json and the playbook log (node-check.log); default deployment_dir (runs/<name>).",
    ),
) -> None:
    """Check that the nodes are consistent, reachable and ready; exit 1 on any blocking finding."""
    from tasks.nodes.check import NodeCheckFailed, NodesUnreachable
    from tasks.nodes.step import NodesInputs, run

    parsed = load(spec)
    try:
        run(NodesInputs.of(parsed, str(out) if out else None), _print_nodes)
    except (NodeCheckFailed, NodesUnreachable):  # the table said which and the fix
        raise typer.Exit(EXIT_FAILED_CHECK) from None


def _print_nodes(result, path: Path) -> None:  # noqa: ANN001 - tasks.nodes.report.NodeReport
    table = Table("check", "severity", "values", "finding / fix", show_lines=True)
    style = {"ok": "green", "warning": "yellow", "blocking": "red"}
    for row in result.table():
        fix = f"{row['finding']}\nfix: {row['remediation']}" if row["finding"] else ""
        severity = Text(row["severity"], style=style[row["severity"]])
        table.add_row(Text(row["check"]), severity, Text(row["values"]), Text(fix))
    console.print(table)
    console.print(result.summary(), style="green" if result.ok else "red", markup=False, highlight=False)
    console.print(f"report {path}", markup=False, highlight=False)


@app.command("build-image", epilog=example("tdeploy build-image examples/local.yaml --out runs/local/image"))
def build_image(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Folder for image.json, build.log and the build context; default <deployment_dir>/image.",
    ),
) -> None:
    """Build and push the training image unless its content-addressed tag exists; write image.json."""
    from tasks.image.step import ImageInputs, run

    parsed = load(spec)
    if parsed.image is None:
        console.print("image: null in the spec: no image to build", markup=False)
        return
    run(ImageInputs.of(parsed, str(out) if out else None), _print_image)


def _print_image(result) -> None:  # noqa: ANN001 - tasks.image.build.ImageResult (never None: image is set)
    from tasks.image.build import IMAGE_JSON

    style = {"built": "green", "cached": "green", "skipped": "yellow"}[result.status]
    console.print(f"{result.status}: {result.reason}", style=style, markup=False, highlight=False)
    if result.reference and result.status != "skipped":
        console.print(f"image {result.reference}", markup=False, highlight=False)
    if result.digest:
        console.print(f"digest {result.reference_by_digest or result.digest}", markup=False, highlight=False)
    console.print(f"record {Path(result.record_dir) / IMAGE_JSON}", markup=False, highlight=False)


@app.command(epilog=example("tdeploy train examples/local.yaml"))
def train(spec: str = typer.Argument(..., help=SPEC_HELP)) -> None:
    """Prepare the data if the spec says how, then run the training job on this machine under torchrun."""
    from tasks.launch.local import TrainingFailed, run_local
    from tasks.launch.registry import capabilities
    from training.run_output import RunOutput

    parsed = load(spec)
    if not capabilities(parsed.cluster.scheduler).runs_on_this_machine_only:
        err_console.print(
            f"cluster.scheduler={parsed.cluster.scheduler}: `tdeploy train` runs on this machine only; "
            "use scheduler: local here (cluster submission comes with `tdeploy submit`)",
            markup=False,
        )
        raise typer.Exit(EXIT_USER_ERROR)
    cfg = training_config_prepared(parsed)
    try:
        job = run_local(parsed.cluster, cfg, on_line=lambda line: console.print(line, markup=False, highlight=False))
    except TrainingFailed as err:
        err_console.print(f"training {err.status.describe()}; full log: {err.log_path}", markup=False)
        raise typer.Exit(EXIT_FAILED_CHECK) from err
    result = RunOutput(job.output_dir).result()
    assert result is not None, "a job that ended well has written result.json"
    console.print(
        f"trained to step {result.steps} (resumed from {result.resumed_from_step}); "
        f"loss {result.first_loss} -> {result.final_loss}; val_loss {result.val_loss:.4f}; "
        f"outputs in {job.output_dir}",
        markup=False,
        highlight=False,
    )


@app.command(epilog=example("tdeploy submit examples/local.yaml --wait"))
def submit(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    wait: bool = typer.Option(False, "--wait", help="Stream the job's log and wait until it ends."),
    image: str | None = typer.Option(None, "--image", help="Image reference to run (default: none, bare metal)."),
) -> None:
    """Submit the training job to the spec's scheduler (local, slurm, kubernetes); prints the job reference.

    The job runs on its own: stopping this command (also with --wait) leaves it running; `tdeploy cancel` stops it.
    """
    from tasks.launch.base import JobHandle, JobState, JobStatus
    from tasks.launch.step import JobInputs, JobPreempted, run
    from tasks.launch.submit import JobFailed

    parsed = load(spec)
    inputs = JobInputs.of(parsed, training_config_prepared(parsed), image, "finished" if wait else "submitted",
                          detached=True)  # fmt: skip

    def publish(handle: JobHandle, status: JobStatus, lost: object) -> None:
        if not wait:  # the job's log is not streamed: its reference and where its output goes
            console.print(f"submitted {handle.ref} (output {handle.output_dir})", markup=False, highlight=False)
        if wait or (status.state.terminal and status.state is not JobState.SUCCEEDED):
            console.print(f"{handle.ref}: {status.describe()}", markup=False, highlight=False)

    on_line = (lambda line: console.print(line, markup=False, highlight=False)) if wait else None
    try:
        run(inputs, publish, on_line=on_line)
    except (JobFailed, JobPreempted):  # the line above said how it ended
        raise typer.Exit(EXIT_FAILED_CHECK) from None


@app.command(epilog=example("tdeploy status slurm:1234", "tdeploy status runs/local/output"))
def status(job: str = typer.Argument(..., help=JOB_HELP)) -> None:
    """Show a submitted job's state, with the scheduler's own state and reason, and its history: when it ran,
    where it was preempted (step, signal), what it waits for, from which step it ran again."""
    from tasks.launch.base import find_job
    from tasks.launch.history import job_history
    from tasks.launch.registry import launcher_for

    handle = find_job(job)
    history = job_history(handle, launcher_for(handle.scheduler))
    assert history.status is not None  # job_history always asks the scheduler
    console.print(f"{handle.ref}: {history.status.describe()}", markup=False, highlight=False)
    for line in history.lines():
        console.print(line, markup=False, highlight=False)


@app.command(epilog=example("tdeploy cancel slurm:1234"))
def cancel(job: str = typer.Argument(..., help=JOB_HELP)) -> None:
    """Cancel a submitted job and every process it started."""
    from tasks.launch.base import find_job
    from tasks.launch.registry import launcher_for

    handle = find_job(job)
    launcher_for(handle.scheduler).cancel(handle)
    console.print(f"{handle.ref}: cancel requested", markup=False, highlight=False)


@app.command(epilog=example("tdeploy run examples/local.yaml"))
def run(spec: str = typer.Argument(..., help=SPEC_HELP)) -> None:
    """Run the whole deploy-training flow on this machine (ephemeral Prefect; no server needed)."""
    from flows.runner import run_deployment

    parsed = load(spec)  # a bad spec fails here, before Prefect starts
    code = run_deployment(parsed)
    if code:
        raise typer.Exit(code)
