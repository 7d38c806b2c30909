"""`tdeploy nodes`: the deployment's node quarantine: list the hosts the restart policy remembers, quarantine one by
hand, clear one that was repaired.

The node memory lives in the deployment's ledger folder (tasks/recovery/quarantine.py); a quarantined host is left
out of every later job of the deployment until it is cleared here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from flows.cli.common import SPEC_HELP, console, example, load

if TYPE_CHECKING:
    from tasks.recovery.quarantine import NodeMemory

QUARANTINE_EXAMPLE = "tdeploy nodes quarantine node-3 --spec examples/ssh.yaml --reason 'ECC errors'"
CLEAR_EXAMPLE = "tdeploy nodes clear node-3 --spec examples/ssh.yaml"
LIST_EXAMPLE = "tdeploy nodes list --spec examples/ssh.yaml"

app = typer.Typer(
    no_args_is_help=True,
    help="The deployment's node quarantine: hosts that failed repeatedly are left out of its jobs until cleared.",
    epilog=example(LIST_EXAMPLE, QUARANTINE_EXAMPLE, CLEAR_EXAMPLE),
)


def _memory(spec: str) -> NodeMemory:
    """The node memory of the deployment `spec` describes (its paths are not checked: only the ledger is used)."""
    from tasks.paths import DeploymentPaths
    from tasks.recovery.quarantine import NodeMemory

    parsed = load(spec, check_paths=False)
    return NodeMemory(DeploymentPaths.of(parsed).node_memory_url, parsed.recovery, parsed.storage)


@app.command("quarantine", epilog=example(QUARANTINE_EXAMPLE))
def quarantine(
    host: str = typer.Argument(..., help="The host's name, as the job's ranks record it (ranks.json)."),
    spec: str = typer.Option(..., "--spec", help=SPEC_HELP),
    reason: str = typer.Option("", "--reason", help="Why (kept with the quarantine)."),
) -> None:
    """Quarantine HOST: the deployment's later jobs run without it until `tdeploy nodes clear`."""
    state = _memory(spec).quarantine(host, reason)
    console.print(state.describe(), markup=False, highlight=False)


@app.command("clear", epilog=example(CLEAR_EXAMPLE))
def clear(
    host: str = typer.Argument(..., help="The host's name."),
    spec: str = typer.Option(..., "--spec", help=SPEC_HELP),
    reason: str = typer.Option("", "--reason", help="Why it is back in service (e.g. the repair)."),
) -> None:
    """Clear HOST: back in service, its earlier failures no longer count towards a quarantine."""
    state = _memory(spec).clear(host, reason)
    console.print(state.describe(), markup=False, highlight=False)


@app.command("list", epilog=example(LIST_EXAMPLE))
def list_hosts(spec: str = typer.Option(..., "--spec", help=SPEC_HELP)) -> None:
    """List the hosts the restart policy remembers: quarantined or in service, with their failures since the last
    clear."""
    memory = _memory(spec)
    states = memory.states()
    if not states:
        console.print(f"no host failures recorded in {memory.url}", markup=False, highlight=False)
        return
    for state in states.values():
        console.print(state.describe(), markup=False, highlight=False)
