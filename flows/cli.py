"""`tdeploy`: the command line of transformer-deploy."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from tasks.capacity.plan import plan_capacity, write_plan
from tasks.capacity.report import format_self_check, rich_report
from tasks.errors import DeployError, TransientError
from tasks.prepare.pipeline import PrepareResult, prepare_dataset
from tasks.spec import DeploymentSpec, SpecError, load_spec
from tasks.torchrun import TrainingFailed, run_local
from training.storage import local_path

app = typer.Typer(
    help="Deploy Transformer training jobs: plan, check, build, prepare, submit, accept.", no_args_is_help=True
)
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def _load(spec: str) -> DeploymentSpec:
    try:
        return load_spec(spec)
    except SpecError as err:
        err_console.print(f"[red]{err.source}: invalid deployment spec[/red]")
        for problem in err.problems:
            err_console.print(f"  - {problem}", markup=False, highlight=False)
        raise typer.Exit(2) from err


@app.command("validate-spec")
def validate_spec(spec: str = typer.Argument(..., help="Path or fsspec URL of a deployment spec (YAML).")) -> None:
    """Check a spec; print 'ok' and a summary, or every problem at once."""
    parsed = _load(spec)
    console.print("ok", style="green")
    console.print(parsed.summary(), markup=False, highlight=False)


@app.command()
def train(spec: str = typer.Argument(..., help="Path or fsspec URL of a deployment spec (YAML).")) -> None:
    """Prepare the data if the spec says how, then run the training job on this machine under torchrun."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    parsed = _load(spec)
    if parsed.cluster.scheduler != "local":
        err_console.print(
            f"cluster.scheduler={parsed.cluster.scheduler}: `tdeploy train` runs on this machine only; "
            "use scheduler: local here (cluster submission comes with `tdeploy submit`)",
            markup=False,
        )
        raise typer.Exit(2)
    if parsed.data.prepare is not None:
        prepared = _prepare_with_progress(parsed)
        cfg = parsed.training_config(prepared.dataset_url, prepared.tokenizer_sha256)
    else:
        cfg = parsed.training_config()
    try:
        job = run_local(parsed.cluster, cfg, on_line=lambda line: console.print(line, markup=False, highlight=False))
    except TrainingFailed as err:
        err_console.print(f"training failed (exit code {err.returncode}); full log: {err.log_path}", markup=False)
        raise typer.Exit(1) from err
    result = json.loads((Path(local_path(cfg.run.output_url)) / "result.json").read_text())
    console.print(
        f"trained to step {result['steps']} (resumed from {result['resumed_from_step']}); "
        f"loss {result['first_loss']} -> {result['final_loss']}; val_loss {result['val_loss']:.4f}; "
        f"outputs in {job.output_dir}",
        markup=False,
        highlight=False,
    )


def _prepare_with_progress(spec: DeploymentSpec) -> PrepareResult:
    """Run the data-preparation step with a progress bar; exits 2 on a user error, 1 on anything transient."""
    assert spec.data.prepare is not None
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def progress(stage: str, done: int, total: int | None) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        try:
            result = prepare_dataset(spec.data.prepare, spec.storage, progress)
        except DeployError as err:
            err_console.print(f"prepare-data failed: {err}", markup=False)
            raise typer.Exit(2 if not isinstance(err, TransientError) else 1) from err
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


@app.command("prepare-data")
def prepare_data(spec: str = typer.Argument(..., help="Path or fsspec URL of a deployment spec (YAML).")) -> None:
    """Clean, tokenize, shard and validate the corpus of data.prepare (reuses a finished identical dataset)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    parsed = _load(spec)
    if parsed.data.prepare is None:
        err_console.print("data.prepare is not set: this spec trains on an existing dataset (data.dataset_url)")
        raise typer.Exit(2)
    _prepare_with_progress(parsed)


@app.command("plan")
def plan(
    spec: str = typer.Argument(..., help="Path or fsspec URL of a deployment spec (YAML)."),
    as_json: bool = typer.Option(False, "--json", help="Print plan.json to stdout instead of the table."),
    out: str | None = typer.Option(
        None, "--out", help="Folder for plan.json; default capacity.output_url, else runs/<name>."
    ),
    self_check: bool = typer.Option(
        False, "--self-check", help="Also measure one training step of the model on this machine and compare."
    ),
) -> None:
    """Estimate memory, time and communication, search the layouts; exit 1 if the requested one does not fit."""
    parsed = _load(spec)
    result = plan_capacity(
        parsed.name, parsed.capacity, parsed.cluster, parsed.model, parsed.parallel, parsed.precision, parsed.run
    )
    if self_check:
        from tasks.capacity.measure import run_self_check  # imports torch: only when asked

        result.self_check = [run_self_check(parsed.model, parsed.parallel, parsed.precision, parsed.cluster)]
    url = write_plan(result, out)
    if as_json:
        console.print_json(data=result.to_json())
    else:
        console.print(rich_report(result))
        for check in result.self_check:
            console.print(format_self_check(check), markup=False, highlight=False)
        console.print(f"plan {url}", markup=False, highlight=False)
    if not result.fits:
        err = result.error()
        err_console.print(f"{err.message}\n{err.fix}", style="red", markup=False, highlight=False)
        raise typer.Exit(1)


def main() -> None:
    """Console-script entry point."""
    app()
