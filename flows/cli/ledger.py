"""`tdeploy history`, `baseline`, `rollback` and `rollout`: the deployment's ledger of accepted runs, the
regression gate against its baseline, and moving between versions."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table
from rich.text import Text

from flows.cli.common import EXIT_FAILED_CHECK, EXIT_USER_ERROR, SPEC_HELP, console, err_console, example, load
from flows.cli.data import training_config_prepared

if TYPE_CHECKING:
    from tasks.ledger.registry import Ledger
    from tasks.spec import DeploymentSpec

app = typer.Typer()


def _ledger_of(parsed: DeploymentSpec) -> Ledger:
    """The deployment's ledger of accepted runs."""
    from tasks.ledger.registry import Ledger
    from tasks.paths import DeploymentPaths

    return Ledger(DeploymentPaths.of(parsed).ledger_url, parsed.storage)


@app.command(epilog=example("tdeploy history examples/local.yaml"))
def history(spec: str = typer.Argument(..., help=SPEC_HELP)) -> None:
    """List the deployment's ledger entries (accepted runs), oldest first: the current baseline and rolled-back
    ones marked."""
    from tasks.ledger.registry import cluster_key_of

    parsed = load(spec, check_paths=False)  # reads the ledger only: the other paths are not its inputs
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
    epilog=example(
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
    from tasks.acceptance.ledger_entry import figures_of_workspace
    from tasks.ledger.gate import baseline_runs, compare
    from tasks.ledger.registry import cluster_key_of
    from tasks.run_id import RUN_ID

    parsed = load(spec, check_paths=False)  # as history: the ledger is all it reads
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
    epilog=example(
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

    parsed = load(spec)
    cfg = training_config_prepared(parsed)
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


@app.command(epilog=example("tdeploy rollout examples/local.yaml --image registry.local/tdeploy:2026-02"))
def rollout(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    image: str = typer.Option(..., "--image", help="The new version's image reference."),
    wait: bool = typer.Option(False, "--wait", help="Wait until the whole deployment's job ends."),
) -> None:
    """Roll a new image out: a short canary on acceptance.canary.nodes held to the baseline, then acceptance on
    the whole deployment, then its job; a failing step stops the rollout, leaving the current version in place."""
    from tasks.rollout.canary import roll_out

    parsed = load(spec)
    cfg = training_config_prepared(parsed)
    outcome = roll_out(parsed, cfg, image, "finished" if wait else "running")
    console.print(
        f"canary passed against entry {outcome.canary.baseline_entry or '-'} ({outcome.canary.root}); whole "
        f"deployment accepted as entry {outcome.acceptance.ledger_entry or '-'}; job {outcome.job} {outcome.state}",
        markup=False,
        highlight=False,
    )
    if wait and outcome.state != "succeeded":
        raise typer.Exit(EXIT_FAILED_CHECK)
