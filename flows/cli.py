"""`tdeploy`: the command line of transformer-deploy.

Only typer and rich load at import: `tdeploy --help` must answer at once, so every command imports the
pipeline modules it needs (torch, Prefect, Great Expectations and the spec model among them) in its body.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import click
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from tasks.acceptance.mode import Mode

if TYPE_CHECKING:
    from tasks.acceptance.step import AcceptanceStepInputs
    from tasks.prepare.step import DataInputs, DataResult
    from tasks.spec import DeploymentSpec
    from training.config import TrainConfig

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

# Failures that a command reports as one line (exit 2: fix the input; exit 1: it may pass, run again), never as
# a traceback: the pipeline's typed errors, storage errors, and the payload's refusals of untrusted input.
# Named by (module, class) so that the CLI need not import torch to know them: an exception of one of these
# classes can only exist once its module is loaded, so the handler looks them up in sys.modules.
_USER_FAILURES: tuple[tuple[str, str], ...] = (
    ("tasks.errors", "DeployError"), ("training.dataset", "DatasetError"),
    ("training.checkpoint", "CheckpointFormatError"), ("training.lease", "LeaseHeld"),
    ("training.checkpoint", "UnsafeCheckpointError"), ("training.checkpoint", "CheckpointKeyError"),
)  # fmt: skip

SPEC_HELP = "Path or fsspec URL of a deployment spec (YAML)."


def _loaded_user_failures() -> tuple[type[BaseException], ...]:
    """The classes of _USER_FAILURES whose modules are loaded (the others cannot have been raised)."""
    return tuple(getattr(sys.modules[module], name) for module, name in _USER_FAILURES if module in sys.modules)


def _is_transient(err: BaseException) -> bool:
    errors = sys.modules.get("tasks.errors")
    return errors is not None and isinstance(err, errors.TransientError)


EXIT_USER_ERROR = 2  # fix the input
EXIT_TRANSIENT = 1  # it may pass: run again
EXIT_FAILED_CHECK = 1  # a check ran and found a problem (commands raise typer.Exit(EXIT_FAILED_CHECK))
# Interrupted runs exit 128 + the signal (130 for Ctrl-C, 143 for SIGTERM): `tdeploy run`'s InterruptGuard.

# The log level of each command's library loggers (the rest: WARNING); set once, in _root.
_LOG_LEVELS = {"train": logging.INFO, "accept": logging.INFO, "drill": logging.INFO}


class _Commands(TyperGroup):
    """The command group: every command's known failures end as one message and an exit code."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except Exception as err:
            if isinstance(err, _loaded_user_failures()):
                err_console.print(f"{ctx.invoked_subcommand} failed: {err}", markup=False, highlight=False)
                raise typer.Exit(EXIT_TRANSIENT if _is_transient(err) else EXIT_USER_ERROR) from err
            if isinstance(err, OSError):
                where = f" {err.filename}" if getattr(err, "filename", None) else ""
                err_console.print(
                    f"error:{where} {err.strerror or err}; check the path and its permissions", markup=False
                )
                raise typer.Exit(EXIT_TRANSIENT) from err
            raise


def _example(*lines: str) -> str:
    """A help epilog with example invocations."""
    return ("Example:" if len(lines) == 1 else "Examples:") + "\n\n" + "\n\n".join(f"  {line}" for line in lines)


app = typer.Typer(cls=_Commands, no_args_is_help=True)


def _print_version(value: bool) -> None:
    if not value:
        return
    import importlib.metadata  # about 0.1 s of imports (email, zipfile): only when asked

    try:
        version = importlib.metadata.version("transformer-deploy")
    except importlib.metadata.PackageNotFoundError as err:
        err_console.print("transformer-deploy is not installed; install it with `pip install -e .`", markup=False)
        raise typer.Exit(2) from err
    console.print(f"tdeploy {version}", markup=False, highlight=False)
    raise typer.Exit()


@app.callback(epilog=_example("tdeploy validate-spec examples/local.yaml", "tdeploy run examples/local.yaml"))
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the installed version and exit."
    ),
) -> None:
    """Deploy Transformer training jobs: plan, check, build, prepare, submit, accept."""
    level = _LOG_LEVELS.get(ctx.invoked_subcommand or "", logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)


CHECK_PATHS_HELP = (
    "Also check every path and URL of the spec as the commands that use them do (inputs exist, outputs are "
    "writable, object stores answer); needs the cluster's storage."
)
PATHS_NOT_CHECKED = (
    "paths and storage not checked (the commands that use them check them before any work); "
    "run with --check-paths to check them now"
)


def _load(spec: str, check_paths: bool = True) -> DeploymentSpec:
    """The validated spec; with `check_paths`, every path and URL in it checked too (`tasks.preflight`)."""
    from tasks.errors import TransientError
    from tasks.preflight import preflight
    from tasks.spec import SpecError, load_spec

    try:
        parsed = load_spec(spec)
        if check_paths:
            preflight(parsed)
        return parsed
    except TransientError as err:
        err_console.print(f"{spec}: {err}", markup=False, highlight=False)
        raise typer.Exit(1) from err
    except SpecError as err:
        err_console.print(f"[red]{err.source}: invalid deployment spec[/red]")
        for problem in err.problems:
            err_console.print(f"  - {problem}", markup=False, highlight=False)
        raise typer.Exit(2) from err


@app.command("validate-spec", epilog=_example("tdeploy validate-spec examples/local.yaml"))
def validate_spec(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    check_paths: bool = typer.Option(False, "--check-paths", help=CHECK_PATHS_HELP),
) -> None:
    """Check a spec (offline); print 'ok' and a summary, or every problem at once."""
    parsed = _load(spec, check_paths)
    console.print("ok", style="green")
    console.print(parsed.summary(), markup=False, highlight=False)
    console.print("every path and URL checked" if check_paths else PATHS_NOT_CHECKED, markup=False, highlight=False)


@app.command(epilog=_example("tdeploy train examples/local.yaml"))
def train(spec: str = typer.Argument(..., help=SPEC_HELP)) -> None:
    """Prepare the data if the spec says how, then run the training job on this machine under torchrun."""
    from tasks.launch.local import TrainingFailed, run_local
    from tasks.launch.registry import capabilities
    from training.run_output import RunOutput

    parsed = _load(spec)
    if not capabilities(parsed.cluster.scheduler).runs_on_this_machine_only:
        err_console.print(
            f"cluster.scheduler={parsed.cluster.scheduler}: `tdeploy train` runs on this machine only; "
            "use scheduler: local here (cluster submission comes with `tdeploy submit`)",
            markup=False,
        )
        raise typer.Exit(2)
    cfg = _training_config_prepared(parsed)
    try:
        job = run_local(parsed.cluster, cfg, on_line=lambda line: console.print(line, markup=False, highlight=False))
    except TrainingFailed as err:
        err_console.print(f"training {err.status.describe()}; full log: {err.log_path}", markup=False)
        raise typer.Exit(1) from err
    result = RunOutput(job.output_dir).result()
    assert result is not None, "a job that ended well has written result.json"
    console.print(
        f"trained to step {result.steps} (resumed from {result.resumed_from_step}); "
        f"loss {result.first_loss} -> {result.final_loss}; val_loss {result.val_loss:.4f}; "
        f"outputs in {job.output_dir}",
        markup=False,
        highlight=False,
    )


def _data_step(inputs: DataInputs) -> DataResult:
    """Run the data step: a preparation with a progress bar and its counts printed; a given dataset's check."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    from tasks.prepare.step import run

    if inputs.prepare is None:
        return run(inputs)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def progress(stage: str, done: int, total: int | None) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        result = run(inputs, progress=progress)
    verb = "reused" if result.reused else "prepared"
    removed = ", ".join(f"{rule} {n}" for rule, n in result.cleaning["removed"].items() if n)
    console.print(
        f"{verb} dataset {result.dataset_url}: "
        + ", ".join(f"{name} {c['tokens']:,} tokens / {c['docs']:,} docs" for name, c in result.splits.items())
        + f"; vocab {result.vocab_size}; read {result.cleaning['read']}, kept {result.cleaning['kept']}"
        + (f" (removed: {removed})" if removed else "")
        + f"; validation {'passed' if result.validation.get('success') else 'skipped'}"
        + (f"; Data Docs {result.data_docs_url}" if result.data_docs_url else ""),
        markup=False,
        highlight=False,
    )
    return result


@app.command("prepare-data", epilog=_example("tdeploy prepare-data examples/local.yaml"))
def prepare_data(spec: str = typer.Argument(..., help=SPEC_HELP)) -> None:
    """Clean, tokenize, shard and validate the corpus of data.prepare (reuses a finished identical dataset)."""
    from tasks.prepare.step import DataInputs

    parsed = _load(spec)
    if parsed.data.prepare is None:
        err_console.print("data.prepare is not set: this spec trains on an existing dataset (data.dataset_url)")
        raise typer.Exit(2)
    _data_step(DataInputs.of(parsed))


@app.command(
    "convert-dataset",
    epilog=_example("tdeploy convert-dataset /shared/datasets/fineweb-edu-32k", "tdeploy convert-dataset s3://ml/ds"),
)
def convert_dataset(
    url: str = typer.Argument(..., help="Local path or fsspec URL of a dataset of format version 1."),
) -> None:
    """Convert a dataset of the earlier format (version 1) in place to Megatron's indexed format.

    Each shard gets Megatron's .idx beside its token file (kept as it is), then the new manifest is written (the
    commit), then the old offsets files are removed. A dataset half converted still reads as version 1.
    """
    from training.dataset import convert_legacy
    from training.storage import check_storage_url

    try:
        check_storage_url(url)
    except ValueError as err:
        err_console.print(f"convert-dataset: URL {url!r} {err}", markup=False, highlight=False)
        raise typer.Exit(EXIT_USER_ERROR) from err
    manifest = convert_legacy(url)
    counts = ", ".join(f"{name} {s.n_docs:,} docs / {s.n_tokens:,} tokens" for name, s in manifest.splits.items())
    console.print(f"converted {url} to Megatron's indexed format: {counts}", markup=False, highlight=False)


@app.command("build-image", epilog=_example("tdeploy build-image examples/local.yaml --out runs/local/image"))
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

    parsed = _load(spec)
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


@app.command("check-nodes", epilog=_example("tdeploy check-nodes examples/local.yaml --out runs/local"))
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

    parsed = _load(spec)
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


@app.command(epilog=_example("tdeploy submit examples/local.yaml --wait"))
def submit(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    wait: bool = typer.Option(False, "--wait", help="Stream the job's log and wait until it ends."),
    image: str | None = typer.Option(None, "--image", help="Image reference to run (default: none, bare metal)."),
) -> None:
    """Submit the training job to the spec's scheduler (local, slurm, kubernetes); prints the job reference.

    The job runs on its own: stopping this command (also with --wait) leaves it running; `tdeploy cancel` stops it.
    """
    from tasks.launch.base import JobState
    from tasks.launch.submit import submit as submit_job

    parsed = _load(spec)
    cfg = _training_config_prepared(parsed)
    launcher, handle = submit_job(parsed.cluster, cfg, parsed.name, image, supervised=False)
    console.print(f"submitted {handle.ref} (output {handle.output_dir})", markup=False, highlight=False)
    if not wait:
        return
    status = launcher.wait(handle, on_line=lambda line: console.print(line, markup=False, highlight=False))
    console.print(f"{handle.ref}: {status.describe()}", markup=False, highlight=False)
    if status.state is not JobState.SUCCEEDED:
        raise typer.Exit(1)


@app.command(epilog=_example("tdeploy status slurm:1234", "tdeploy status runs/local/output"))
def status(job: str = typer.Argument(..., help="Job reference (scheduler:id) or the run's output folder.")) -> None:
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


@app.command(epilog=_example("tdeploy cancel slurm:1234"))
def cancel(job: str = typer.Argument(..., help="Job reference (scheduler:id) or the run's output folder.")) -> None:
    """Cancel a submitted job and every process it started."""
    from tasks.launch.base import find_job
    from tasks.launch.registry import launcher_for

    handle = find_job(job)
    launcher_for(handle.scheduler).cancel(handle)
    console.print(f"{handle.ref}: cancel requested", markup=False, highlight=False)


@app.command(
    "plan",
    epilog=_example(
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

    parsed = _load(spec, check_paths)
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
            raise typer.Exit(1)
        if not result.fits:
            err_console.print(
                f"the requested layout {result.requested.layout.describe()} does not fit; "
                "printed the fastest that does",
                style="yellow", markup=False, highlight=False,
            )  # fmt: skip
        sys.stdout.write(result.emit_parallel())
        return
    if as_json:
        console.print_json(data=result.to_json())
    else:
        console.print(rich_report(result))
        for check in result.self_check:
            console.print(format_self_check(check), markup=False, highlight=False)
        if url:
            console.print(f"plan {url}", markup=False, highlight=False)
        if not check_paths:
            console.print(PATHS_NOT_CHECKED, markup=False, highlight=False)
    if not result.fits:
        err = result.error()
        err_console.print(f"{err.message}\n{err.fix}", style="red", markup=False, highlight=False)
        raise typer.Exit(1)


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


def _training_config_prepared(parsed: DeploymentSpec) -> TrainConfig:
    """The training config on the spec's dataset, prepared first (with a progress bar) if the spec says how."""
    from tasks.prepare.step import data_and_training

    return data_and_training(parsed, _data_step)[1]


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

    table = Table("check", "verdict", "measured", "look first", show_lines=True)
    for row in table_rows(report):
        style = {"pass": "green", "n/a": "yellow", "not measured": "yellow"}.get(row["verdict"], "red")
        cells = (Text(row["check"]), Text(row["verdict"], style=style), Text(row["measured"]), Text(row["look first"]))
        table.add_row(*cells)
    console.print(table)
    if report.plan_accuracy is not None:
        console.print(report.plan_accuracy.line(), markup=False, highlight=False)
    written = [path for path in files.values() if path is not None]
    verdict = report.to_json()["verdict"]
    console.print(f"verdict: {verdict}; " + ", ".join(str(p) for p in written), markup=False, highlight=False)


_WORKSPACE_HELP = (
    "Folder under which each run gets a fresh workspace <out>/<run-id>/ with its jobs and reports (the report as "
    "JSON, junit.xml, loss_curve.png; drills in drills/), and latest -> the last one; default acceptance.work_url "
    "(runs/<name>/acceptance)."
)


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


@app.command(epilog=_example("tdeploy accept examples/local.yaml --drills --out runs/local/acceptance",
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

    parsed = _load(spec)
    inputs = accept_inputs(parsed, _training_config_prepared(parsed), mode, drills, image, out)
    try:
        with _progress_lines():
            run(inputs, _print_acceptance)
    except AcceptanceFailed:  # the table said which check failed
        raise typer.Exit(EXIT_FAILED_CHECK) from None


@app.command(epilog=_example("tdeploy drill examples/local.yaml --only rank_kill --out runs/local/acceptance"))
def drill(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    only: list[str] | None = typer.Option(None, "--only", help="Run just this drill (repeatable)."),
    image: str | None = typer.Option(None, "--image", help="Image reference the jobs run in."),
    out: Path | None = typer.Option(None, "--out", help=_WORKSPACE_HELP),
) -> None:
    """Run the checkpoint-restore drills; exit 1 when one fails."""
    from tasks.acceptance.config import DRILLS
    from tasks.acceptance.step import AcceptanceFailed, DrillsInputs, run_drills

    parsed = _load(spec)
    unknown = sorted(set(only or []) - set(DRILLS))
    if unknown:
        err_console.print(f"--only {unknown[0]}: no such drill; use one of {list(DRILLS)}", markup=False)
        raise typer.Exit(2)
    cfg = _training_config_prepared(parsed)
    inputs = DrillsInputs.of(parsed, cfg, image=image, only=only, work_url=str(out) if out else None)
    try:
        with _progress_lines():
            run_drills(inputs, _print_acceptance)
    except AcceptanceFailed:  # the table said which drill failed
        raise typer.Exit(EXIT_FAILED_CHECK) from None


@app.command(
    epilog=_example(
        "tdeploy export examples/local.yaml", "tdeploy export examples/local.yaml --step 20 --out runs/local/hf"
    )
)
def export(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    step: int | None = typer.Option(
        None, "--step", min=0, help="Checkpoint step to export; default the newest sound one."
    ),
    out: str | None = typer.Option(
        None,
        "--out",
        help="Model folder to write (a local folder or an fsspec URL); default <deployment_dir>/export/step-<N>.",
    ),
    tokenizer: str | None = typer.Option(
        None,
        "--tokenizer",
        help="tokenizer.json (path or fsspec URL) for a run trained on adopted token ids without one "
        "(data.tokenizer_url unset); other runs ship their dataset's tokenizer.",
    ),
) -> None:
    """Export a checkpoint as a Hugging Face model folder (config, safetensors, tokenizer) for transformers or vLLM."""
    from tasks.export.step import ExportInputs, run

    parsed = _load(spec)
    cfg = _training_config_prepared(parsed)
    result = run(ExportInputs.of(parsed, cfg, step, out, tokenizer))
    console.print(f"exported {result.summary()}", markup=False, highlight=False)
    console.print(f"from {result.checkpoint_dir}", markup=False, highlight=False)
    for name in result.files:
        console.print(f"  {name}", markup=False, highlight=False)
    for note in result.notes:
        err_console.print(f"note: {note}", style="yellow", markup=False, highlight=False)


@app.command(epilog=_example("tdeploy run examples/local.yaml"))
def run(spec: str = typer.Argument(..., help=SPEC_HELP)) -> None:
    """Run the whole deploy-training flow on this machine (ephemeral Prefect; no server needed)."""
    from flows.runner import run_deployment

    parsed = _load(spec)  # a bad spec fails here, before Prefect starts
    code = run_deployment(parsed)
    if code:
        raise typer.Exit(code)


@app.command(
    epilog=_example(
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
        raise typer.Exit(2)
    plan_url = node_report = None
    if spec is not None:  # the deployment's own reports; none is looked for around the run folder
        paths = DeploymentPaths.of(_load(spec))
        plan_url, node_report = paths.plan_url(), paths.node_report()
    result = diagnose_run(run_dir, "", plan_url, node_report)
    if console.is_terminal:
        from rich.markdown import Markdown

        console.print(Markdown(result.markdown()))
    else:  # a file or a pipe: the Markdown text itself, as the flow publishes it
        console.print(result.markdown(), markup=False, highlight=False, soft_wrap=True)
    if result.findings:
        raise typer.Exit(1)


@app.command(
    epilog=_example(
        "tdeploy serve examples/local.yaml",
        "tdeploy serve examples/local.yaml --step 20",
        "tdeploy serve examples/local.yaml --model-dir runs/local/export/step-20",
    )
)
def serve(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    step: int | None = typer.Option(
        None, "--step", min=0, help="Checkpoint step to export and serve; default the newest sound one."
    ),
    model_dir: Path | None = typer.Option(
        None, "--model-dir", help="Serve this Hugging Face model folder as it is, without exporting a checkpoint."
    ),
) -> None:
    """Export a checkpoint and serve it with vLLM's OpenAI-compatible server until Ctrl-C or SIGTERM."""
    import signal

    from tasks.paths import DeploymentPaths
    from tasks.serve.server import SERVER_LOG, log_tail, start_server
    from training.storage import is_local, local_path

    parsed = _load(spec)  # a model the serve section cannot serve is refused here, with the fix
    if parsed.serve is None:
        err_console.print("the spec has no serve section: serving is off; add `serve: {}` to serve", markup=False)
        raise typer.Exit(EXIT_USER_ERROR)
    if step is not None and model_dir is not None:
        err_console.print("--step exports a checkpoint, --model-dir serves a folder as it is: give one", markup=False)
        raise typer.Exit(EXIT_USER_ERROR)
    if model_dir is None:
        from tasks.export.step import ExportInputs
        from tasks.export.step import run as export_step

        result = export_step(ExportInputs.of(parsed, _training_config_prepared(parsed), step))
        console.print(f"exported {result.summary()}", markup=False, highlight=False)
        if not is_local(result.model_dir):
            err_console.print(f"{result.model_dir}: vLLM serves a local folder; export to one", markup=False)
            raise typer.Exit(EXIT_USER_ERROR)
        model_dir = Path(local_path(result.model_dir))

    stopped_by = [signal.SIGINT]  # a KeyboardInterrupt before the handlers below are in place is a Ctrl-C

    def stop_on_signal(signum: int, frame: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):  # one stop at a time: Server.stop escalates by itself
            signal.signal(sig, signal.SIG_IGN)
        stopped_by[0] = signal.Signals(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # the serving check's folder and log name too
    log_path = Path(DeploymentPaths.of(parsed).serving_dir()) / SERVER_LOG
    max_model_len = parsed.serve.max_model_len or parsed.model.seq_len
    console.print(
        f"starting vLLM on {model_dir} (log {log_path}; ready within serve.startup_timeout_s="
        f"{parsed.serve.startup_timeout_s:g})",
        markup=False,
        highlight=False,
    )
    previous = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = None
    try:
        server = start_server(
            model_dir, parsed.serve, parsed.name, max_model_len, log_path, parsed.cluster.accelerator,
            on_wait=lambda waited: console.print(f"waiting for the vLLM server's /health ({waited:.0f} s)"),
        )  # fmt: skip
        with server:
            console.print(
                f"serving {parsed.name} at {server.url} (pid {server.pid}); Ctrl-C stops it\n"
                f"  completions  {server.url}/v1/completions (model {parsed.name!r})\n"
                f"  metrics      {server.url}/metrics",
                markup=False,
                highlight=False,
            )
            code = server.wait()
        err_console.print(
            f"the vLLM server (pid {server.pid}) exited with {code}; the last lines of {log_path}:\n"
            f"{log_tail(log_path)}",
            markup=False,
            highlight=False,
        )
        raise typer.Exit(EXIT_FAILED_CHECK)
    except KeyboardInterrupt:
        what = f"stopped the vLLM server (pid {server.pid})" if server else "stopped the vLLM server before it served"
        console.print(f"{what} on {stopped_by[0].name}", markup=False, highlight=False)
        raise typer.Exit(128 + stopped_by[0]) from None  # as `tdeploy run`: 130 for Ctrl-C, 143 for SIGTERM
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@app.command(
    "check-serving",
    epilog=_example(
        "tdeploy check-serving examples/local.yaml", "tdeploy check-serving examples/local.yaml --step 150"
    ),
)
def check_serving(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    step: int | None = typer.Option(
        None, "--step", min=0, help="Checkpoint step to export and check; default the newest sound one."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Folder for serving.json and the rest; default runs/<name>/serving."
    ),
) -> None:
    """The pipeline's serving check: export, serve with vLLM, load-test, greedy parity, quality; exit 1 on a miss."""
    from tasks.serve.step import ServingCheckFailed, ServingInputs, run

    parsed = _load(spec)
    if parsed.serve is None:
        err_console.print("the spec has no serve section: serving is off; add `serve: {}` to check it", markup=False)
        raise typer.Exit(EXIT_USER_ERROR)
    inputs = ServingInputs.of(parsed, _training_config_prepared(parsed), str(out) if out else None, step)
    try:
        run(inputs, _print_serving)
    except ServingCheckFailed:  # the table said which figure missed
        raise typer.Exit(EXIT_FAILED_CHECK) from None


def _print_serving(report) -> None:  # noqa: ANN001 - tasks.serve.check.ServingReport
    from tasks.serve.report import table_rows

    for row in table_rows(report):
        console.print(f"{row['check']}: {row['verdict']} ({row['message']})", markup=False, highlight=False)
    load = report.load
    console.print(
        f"step {report.step} served from {report.model_dir}: {load.requests} requests at concurrency "
        f"{load.max_concurrency}, {load.output_tokens_per_s:.0f} output tokens/s, P50/P95/P99 end-to-end "
        f"{load.e2e_ms.p50:.1f}/{load.e2e_ms.p95:.1f}/{load.e2e_ms.p99:.1f} ms; greedy parity "
        f"{report.parity.matched}/{report.parity.prompts}; ROUGE-L {report.quality.rouge_l:.3f}, BLEU-4 "
        f"{report.quality.bleu4:.2f}\nreport {report.files['json']}",
        markup=False,
        highlight=False,
    )


def _ledger_of(parsed: DeploymentSpec):  # noqa: ANN202 - a tasks.ledger.registry.Ledger
    from tasks.ledger.registry import Ledger
    from tasks.paths import DeploymentPaths

    return Ledger(DeploymentPaths.of(parsed).ledger_url, parsed.storage)


@app.command(epilog=_example("tdeploy history examples/local.yaml"))
def history(spec: str = typer.Argument(..., help=SPEC_HELP)) -> None:
    """List the deployment's ledger entries (accepted runs), oldest first: the current baseline and rolled-back
    ones marked."""
    from tasks.ledger.registry import cluster_key_of

    parsed = _load(spec)
    ledger = _ledger_of(parsed)
    entries = [e for e in ledger.entries() if e.spec_name in (parsed.name, "")]
    if not entries:
        console.print(f"no entries in {ledger.url}: no accepted run yet", markup=False, highlight=False)
        return
    gone = ledger.rolled_back()
    current = ledger.current(parsed.name, cluster_key_of(parsed.cluster))
    for entry in entries:
        if entry.entry_id in gone:
            mark = f"  [rolled back to {gone[entry.entry_id].restored_entry}]"
        elif current is not None and entry.entry_id == current.entry_id:
            mark = "  [current baseline]"
        else:
            mark = ""
        console.print(entry.line() + mark, markup=False, highlight=False)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


@app.command(
    epilog=_example(
        "tdeploy baseline examples/local.yaml",
        "tdeploy baseline examples/local.yaml --run runs/local/acceptance/latest",
    )
)
def baseline(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    run: str | None = typer.Option(
        None, "--run", help="An acceptance run workspace (runs/<name>/acceptance/<run-id>) or a ledger entry id."
    ),
) -> None:
    """Show the current baseline (the newest accepted ledger entry not rolled back) and, with --run, each figure
    of that run against it; exit 1 when a figure regressed beyond acceptance.regression."""
    from tasks.run_id import RUN_ID
    from tasks.ledger.gate import baseline_runs, compare
    from tasks.acceptance.ledger_entry import figures_of_workspace
    from tasks.ledger.registry import cluster_key_of

    parsed = _load(spec)
    ledger = _ledger_of(parsed)
    cluster_key = cluster_key_of(parsed.cluster)
    figures, curve_key = None, None
    if run is not None and RUN_ID.match(run) and not Path(run).exists():
        other = ledger.entry(run)
        figures, curve_key = other.figures, other.curve_key
    elif run is not None:
        if not Path(run).is_dir():
            err_console.print(f"--run {run}: no such folder or ledger entry; pass a run workspace or an entry id",
                              markup=False)  # fmt: skip
            raise typer.Exit(EXIT_USER_ERROR)
        figures, curve_key = figures_of_workspace(Path(run))
    current = ledger.current(parsed.name, cluster_key, curve_key)
    if current is None:
        console.print(f"no baseline in {ledger.url}: the next accepted run becomes it", markup=False, highlight=False)
        return
    ref = current.checkpoint
    console.print(
        f"current baseline: {current.line()}\n  spec digest {current.spec_digest or '-'}, image digest "
        f"{current.image_digest or '-'}, dataset {current.dataset_key[:16]}, checkpoint "
        f"{f'{ref.url} step {ref.step}' if ref else '-'}",
        markup=False,
        highlight=False,
    )
    if figures is None:
        return
    same_curve = curve_key is None or curve_key == current.curve_key
    regression = parsed.acceptance.regression
    history = baseline_runs(ledger, current, regression)
    diffs = compare(current, figures, same_curve, regression, parsed.acceptance.thresholds, history)
    table = Table("figure", "baseline", "run", "change", "verdict", show_lines=False)
    for d in diffs:
        style = {"pass": "green", "FAIL": "red"}.get(d.verdict, "yellow")
        change = "-" if d.change is None else f"{d.change:+.1%}"
        table.add_row(d.figure, _fmt(d.baseline), _fmt(d.run), change, Text(d.verdict, style=style))
    console.print(table)
    for d in diffs:
        if d.message and d.verdict == "FAIL":
            console.print(d.message, markup=False, highlight=False)
    if any(d.verdict == "FAIL" for d in diffs):
        raise typer.Exit(EXIT_FAILED_CHECK)


@app.command(
    epilog=_example(
        "tdeploy rollback examples/local.yaml",
        "tdeploy rollback examples/local.yaml --to 20260102T030405.123456Z-1a2b3c",
    )
)
def rollback(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    to: str | None = typer.Option(
        None, "--to", help="The ledger entry to restore (`tdeploy history`); default the one before the current."
    ),
    wait: bool = typer.Option(False, "--wait", help="Stream the resumed job's log and wait until it ends."),
) -> None:
    """Resubmit an earlier accepted entry's image, resumed from its accepted checkpoint; the entries after it are
    marked rolled back, so it is the current baseline again."""
    from tasks.ledger.rollback import roll_back

    parsed = _load(spec)
    cfg = _training_config_prepared(parsed)
    ledger = _ledger_of(parsed)
    outcome = roll_back(
        ledger,
        parsed.name,
        parsed.cluster,
        cfg,
        parsed.image,
        to,
        "finished" if wait else "running",
        on_line=(lambda line: console.print(line, markup=False, highlight=False)) if wait else None,
        on_plan=lambda line: console.print(line, markup=False, highlight=False),
    )
    console.print(
        f"resumed from {outcome.checkpoint_dir}: job {outcome.job} {outcome.state} (output {outcome.output_dir})",
        markup=False,
        highlight=False,
    )
    if wait and outcome.state != "succeeded":
        raise typer.Exit(EXIT_FAILED_CHECK)


from flows.alerts_cli import alerts as _alerts  # noqa: E402 - a command group in its own module, added last

app.add_typer(_alerts, name="alerts")


@app.command(epilog=_example("tdeploy rollout examples/local.yaml --image registry.local/tdeploy:2026-02"))
def rollout(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    image: str = typer.Option(..., "--image", help="The new version's image reference."),
    wait: bool = typer.Option(False, "--wait", help="Wait until the whole deployment's job ends."),
) -> None:
    """Roll a new image out: a short canary on acceptance.canary.nodes held to the baseline, then acceptance on
    the whole deployment, then its job; a failing step stops the rollout, leaving the current version in place."""
    from tasks.rollout.canary import roll_out

    parsed = _load(spec)
    cfg = _training_config_prepared(parsed)
    outcome = roll_out(parsed, cfg, image, "finished" if wait else "running")
    console.print(
        f"canary passed against entry {outcome.canary.baseline_entry or '-'} ({outcome.canary.root}); whole "
        f"deployment accepted as entry {outcome.acceptance.ledger_entry or '-'}; job {outcome.job} {outcome.state}",
        markup=False,
        highlight=False,
    )
    if wait and outcome.state != "succeeded":
        raise typer.Exit(EXIT_FAILED_CHECK)


def main() -> None:
    """Console-script entry point."""
    app()
