"""`tdeploy soak`: the soak step's plain `run` with its settings from the spec's soak section and the options."""

from __future__ import annotations

from pathlib import Path

import typer

from flows.cli.common import EXIT_FAILED_CHECK, EXIT_USER_ERROR, SPEC_HELP, console, err_console, example, load
from flows.cli.data import training_config_prepared

app = typer.Typer()


@app.command(
    epilog=example(
        "tdeploy soak examples/local.yaml --hours 0.05 --failure-every 0.5",
        "tdeploy soak examples/local.yaml --hours 24 --failure-every 30 --storage-only",
    )
)
def soak(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    hours: float | None = typer.Option(None, "--hours", help="How long to train (default: soak.hours of the spec)."),
    failure_every: float | None = typer.Option(
        None, "--failure-every", help="Mean minutes between injected failures (default: soak.failure_every_min)."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the failure schedule (default: soak.seed)."),
    storage_only: bool = typer.Option(
        False, "--storage-only", help="Recover from storage only (no in-memory copies): today's path, for comparison."
    ),
    image: str | None = typer.Option(None, "--image", help="Image reference the job runs in."),
    out: Path | None = typer.Option(
        None, "--out", help="Folder under which the soak gets <out>/soak/<run-id>/ (default: acceptance.work_url)."
    ),
) -> None:
    """Train under randomly injected failures; exit 1 unless every one was recovered by its expected rung and no
    process leaked memory."""
    from pydantic import ValidationError

    from tasks.soak.config import SoakConfig
    from tasks.soak.step import SoakFailed, SoakInputs, run

    parsed = load(spec)
    fields = parsed.soak.model_dump() if parsed.soak is not None else {}
    overrides = {"hours": hours, "failure_every_min": failure_every, "seed": seed}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if storage_only:
        fields["memory_every_steps"] = None
    try:
        config = SoakConfig.model_validate(fields)
    except ValidationError as err:
        options = {"hours": "--hours", "failure_every_min": "--failure-every"}
        for problem in err.errors():
            field = str(problem["loc"][0]) if problem["loc"] else "soak"
            what = "not set" if problem["type"] == "missing" else f"={problem.get('input')!r}: {problem['msg']}"
            err_console.print(f"{options.get(field, field)}{' ' if what == 'not set' else ''}{what}; set it on the "
                              "command line or in the spec's soak section", markup=False)  # fmt: skip
        raise typer.Exit(EXIT_USER_ERROR) from err
    inputs = SoakInputs.of(parsed, training_config_prepared(parsed), config, image=image,
                           work_url=str(out) if out else None)  # fmt: skip
    try:
        result = run(inputs)
    except SoakFailed as err:
        err_console.print(f"soak failed: {err}", markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED_CHECK) from None
    console.print(result.summary(), markup=False, highlight=False)
    console.print(f"report: {result.files['markdown']}", markup=False, highlight=False)
