"""`tdeploy validate-spec`, `prepare-data` and `convert-dataset`: the spec and the data step; and the data step
with a progress bar that every command which trains starts with."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from flows.cli.common import (
    CHECK_PATHS_HELP,
    EXIT_USER_ERROR,
    PATHS_NOT_CHECKED,
    SPEC_HELP,
    console,
    err_console,
    example,
    load,
)

if TYPE_CHECKING:
    from tasks.export.readme import AcceptanceFigures
    from tasks.prepare.step import DataInputs, DataResult
    from tasks.spec import DeploymentSpec
    from training.config import TrainConfig

app = typer.Typer()


@app.command("validate-spec", epilog=example("tdeploy validate-spec examples/local.yaml"))
def validate_spec(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    check_paths: bool = typer.Option(False, "--check-paths", help=CHECK_PATHS_HELP),
) -> None:
    """Check a spec (offline); print 'ok' and a summary, or every problem at once."""
    parsed = load(spec, check_paths)
    console.print("ok", style="green")
    console.print(parsed.summary(), markup=False, highlight=False)
    console.print("every path and URL checked" if check_paths else PATHS_NOT_CHECKED, markup=False, highlight=False)


def data_step(inputs: DataInputs) -> DataResult:
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
        + result.split_sizes()
        + f"; vocab {result.vocab_size}; read {result.cleaning['read']}, kept {result.cleaning['kept']}"
        + (f" (removed: {removed})" if removed else "")
        + f"; validation {'passed' if result.validation.get('success') else 'skipped'}"
        + (f"; Data Docs {result.data_docs_url}" if result.data_docs_url else ""),
        markup=False,
        highlight=False,
    )
    return result


def training_config_prepared(parsed: DeploymentSpec, validate_data: bool = True) -> TrainConfig:
    """The training config on the spec's dataset, prepared first (with a progress bar) if the spec says how;
    without `validate_data`, a finished dataset is found but not validated again (its checkpoints vouch for it)."""
    from tasks.prepare.step import data_and_training

    return data_and_training(parsed, data_step, validate_data)[1]


def model_card_figures(parsed: DeploymentSpec) -> AcceptanceFigures | None:
    """The deployment's latest acceptance figures, for the model card of what the command exports."""
    from tasks.acceptance.record import latest_card
    from tasks.paths import DeploymentPaths

    return latest_card(DeploymentPaths.of(parsed).acceptance_workspaces)


@app.command("prepare-data", epilog=example("tdeploy prepare-data examples/local.yaml"))
def prepare_data(spec: str = typer.Argument(..., help=SPEC_HELP)) -> None:
    """Clean, tokenize, shard and validate the corpus of data.prepare (reuses a finished identical dataset)."""
    from tasks.prepare.step import DataInputs

    parsed = load(spec)
    if parsed.data.prepare is None:
        err_console.print("data.prepare is not set: this spec trains on an existing dataset (data.dataset_url)")
        raise typer.Exit(EXIT_USER_ERROR)
    data_step(DataInputs.of(parsed))


@app.command(
    "convert-dataset",
    epilog=example("tdeploy convert-dataset /shared/datasets/fineweb-edu-32k", "tdeploy convert-dataset s3://ml/ds"),
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
