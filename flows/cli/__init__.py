"""`tdeploy`: the command line of transformer-deploy, one module per concern over the steps' plain functions.

`data` (validate-spec, prepare-data, convert-dataset), `files` (render, schema), `job` (plan, check-nodes, build-image, train, submit,
status, cancel, run), `accept` (accept, drill, diagnose), `ledger` (history, baseline, rollback, rollout), `serve`
(export, serve, check-serving), `quantize` (quantize), `alerts` (the `tdeploy alerts` group) and `nodes` (the
`tdeploy nodes` group: the node quarantine); `common` holds what they share. This module joins them into one app, and is the one place
that sets up logging and turns the known failures into an exit code and one line.

Only typer and rich load at import: `tdeploy --help` must answer at once, so every command imports the
pipeline modules it needs (torch, Prefect, Great Expectations and the spec model among them) in its body.
"""

from __future__ import annotations

import logging
import sys

import click
import typer
from typer.core import TyperGroup

from flows.cli import accept, alerts, data, files, job, ledger, nodes, quantize, serve, soak
from flows.cli.common import EXIT_TRANSIENT, EXIT_USER_ERROR, console, err_console, example

# Failures that a command reports as one line (exit 2: fix the input; exit 1: it may pass, run again), never as
# a traceback: the pipeline's typed errors, storage errors, and the payload's refusals of untrusted input.
# Named by (module, class) so that the CLI need not import torch to know them: an exception of one of these
# classes can only exist once its module is loaded, so the handler looks them up in sys.modules.
_USER_FAILURES: tuple[tuple[str, str], ...] = (
    ("tasks.errors", "DeployError"), ("training.dataset", "DatasetError"),
    ("training.checkpoint.errors", "CheckpointFormatError"), ("training.lease", "LeaseHeld"),
    ("training.checkpoint.trust", "UnsafeCheckpointError"), ("training.signing", "CheckpointKeyError"),
)  # fmt: skip

# The log level of each command's library loggers (the rest: WARNING); set once, in _root.
_LOG_LEVELS = {"train": logging.INFO, "accept": logging.INFO, "drill": logging.INFO, "soak": logging.INFO}


def _loaded_user_failures() -> tuple[type[BaseException], ...]:
    """The classes of _USER_FAILURES whose modules are loaded (the others cannot have been raised)."""
    return tuple(getattr(sys.modules[module], name) for module, name in _USER_FAILURES if module in sys.modules)


def _is_transient(err: BaseException) -> bool:
    errors = sys.modules.get("tasks.errors")
    return errors is not None and isinstance(err, errors.TransientError)


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


def _print_version(value: bool) -> None:
    if not value:
        return
    import importlib.metadata  # about 0.1 s of imports (email, zipfile): only when asked

    try:
        version = importlib.metadata.version("transformer-deploy")
    except importlib.metadata.PackageNotFoundError as err:
        err_console.print("transformer-deploy is not installed; install it with `pip install -e .`", markup=False)
        raise typer.Exit(EXIT_USER_ERROR) from err
    console.print(f"tdeploy {version}", markup=False, highlight=False)
    raise typer.Exit()


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


app = typer.Typer(
    cls=_Commands,
    no_args_is_help=True,
    callback=_root,
    epilog=example("tdeploy validate-spec examples/local.yaml", "tdeploy run examples/local.yaml"),
)
# their commands at the top level, listed in this order
for _concern in (data, files, job, accept, soak, ledger, serve, quantize):
    app.add_typer(_concern.app)
app.add_typer(alerts.app, name="alerts")
app.add_typer(nodes.app, name="nodes")


def main() -> None:
    """Console-script entry point."""
    app()
