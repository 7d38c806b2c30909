"""What every command module of `tdeploy` shares: the consoles, the exit codes, the help texts and loading a spec.

Only typer and rich load here: the pipeline modules (the spec model among them) load inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich.console import Console

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

EXIT_USER_ERROR = 2  # fix the input
EXIT_TRANSIENT = 1  # it may pass: run again
EXIT_FAILED_CHECK = 1  # a check ran and found a problem (commands raise typer.Exit(EXIT_FAILED_CHECK))
# Interrupted runs exit 128 + the signal (130 for Ctrl-C, 143 for SIGTERM): `tdeploy run`'s InterruptGuard.

SPEC_HELP = "Path or fsspec URL of a deployment spec (YAML)."
CHECK_PATHS_HELP = (
    "Also check every path and URL of the spec as the commands that use them do (inputs exist, outputs are "
    "writable, object stores answer); needs the cluster's storage."
)
PATHS_NOT_CHECKED = (
    "paths and storage not checked (the commands that use them check them before any work); "
    "run with --check-paths to check them now"
)


def example(*lines: str) -> str:
    """A help epilog with example invocations."""
    return ("Example:" if len(lines) == 1 else "Examples:") + "\n\n" + "\n\n".join(f"  {line}" for line in lines)


def load(spec: str, check_paths: bool = True) -> DeploymentSpec:
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
        raise typer.Exit(EXIT_TRANSIENT) from err
    except SpecError as err:
        err_console.print(f"[red]{err.source}: invalid deployment spec[/red]")
        for problem in err.problems:
            err_console.print(f"  - {problem}", markup=False, highlight=False)
        raise typer.Exit(EXIT_USER_ERROR) from err
