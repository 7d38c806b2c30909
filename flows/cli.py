"""`tdeploy`: the command line of transformer-deploy."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer
from rich.console import Console

from tasks.data import ensure_dataset
from tasks.spec import SpecError, load_spec
from tasks.torchrun import TrainingFailed, run_local
from training.dataset import DatasetError
from training.storage import local_path

app = typer.Typer(
    help="Deploy Transformer training jobs: plan, check, build, prepare, submit, accept.", no_args_is_help=True
)
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def _load(spec: str):  # noqa: ANN202 - DeploymentSpec
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
    """Run the training job on this machine under torchrun (builds the bootstrap dataset if needed)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parsed = _load(spec)
    if parsed.cluster.scheduler != "local":
        err_console.print(
            f"cluster.scheduler={parsed.cluster.scheduler}: `tdeploy train` runs on this machine only; "
            "use scheduler: local here (cluster submission comes with `tdeploy submit`)",
            markup=False,
        )
        raise typer.Exit(2)
    try:
        manifest = ensure_dataset(parsed.data, parsed.storage)
    except DatasetError as err:
        err_console.print(str(err), markup=False)
        raise typer.Exit(2) from err
    console.print(
        f"dataset {parsed.data.dataset_url}: "
        + ", ".join(f"{name} {s.n_tokens:,} tokens / {s.n_docs:,} docs" for name, s in manifest.splits.items()),
        markup=False,
        highlight=False,
    )
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


def main() -> None:
    """Console-script entry point."""
    app()
