"""`tdeploy run`: the deploy-training flow on this machine, with a temporary Prefect server.

Ctrl-C (or SIGTERM) cancels the run: its jobs stop, Prefect records it Cancelled, and the
command exits with 130 (143); a second Ctrl-C exits at once. The end of a run prints each
step's verdict, the reports folder, how to open the run in the Prefect UI, and for a failed
run its diagnosis.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tasks.progress import ProgressEvent
from tasks.spec import DeploymentSpec

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

FIGURES_CHARS = 90  # longer key figures are cut in the table; summary.json keeps them all
UI_PORT = 4200  # where `prefect server start` serves the UI by default


def run_deployment(spec: DeploymentSpec) -> int:
    """Run the whole deploy-training flow for a validated spec; the command's exit code."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    from tasks.launch.interrupt import InterruptGuard, PrefectServer
    from tasks.logs import install_user_error_filter

    install_user_error_filter()
    server: PrefectServer | None = None

    def on_second(signum: int) -> None:
        err_console.print("interrupted again: jobs killed, exiting now", markup=False)
        if server is not None:
            server.stop(grace_s=0.5)

    with InterruptGuard(on_second) as guard:
        try:
            if get_current_settings().api.url:  # a server the user runs (or a test harness): use it
                return _run(spec, guard, None)
            server = PrefectServer()
            server.start(float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))
            with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
                return _run(spec, guard, server)
        except KeyboardInterrupt:  # before the flow started, or after it ended
            err_console.print(f"tdeploy run interrupted by {guard.signal_name}", markup=False)
            guard.wait_for_jobs()
            return guard.exit_code
        finally:
            if server is not None:
                server.stop()


def _run(spec: DeploymentSpec, guard: Any, server: Any) -> int:
    import signal

    from prefect import tags
    from prefect.exceptions import TerminationSignal

    from flows.deploy import deploy_training
    from tasks.launch.orphans import Supervisor, cancel_flow_runs, crash_orphaned_flow_runs, flow_runs_of
    from tasks.pipeline import RunSummary, published_markdown

    supervisor = Supervisor.current()
    # An earlier `tdeploy run` killed outright could not end its flow run: say so in Prefect now.
    for crashed in crash_orphaned_flow_runs():
        err_console.print(crashed.describe(), markup=False, highlight=False)
    started = time.time()
    state = None
    try:
        with tags(supervisor.tag()), _drawing_progress():  # the tag: how a later run recognises this one if killed
            state = deploy_training(spec, return_state=True)
    except TerminationSignal as err:  # Prefect's own SIGTERM handler, while the flow ran
        guard.interrupted(err.signal)
    except KeyboardInterrupt:
        guard.interrupted(signal.SIGINT)
    runs = flow_runs_of(supervisor)
    flow_run_id = str(runs[0].id) if runs else None
    if guard.signum is not None:
        guard.wait_for_jobs()
        cancelled = cancel_flow_runs(supervisor, f"tdeploy run was interrupted by {guard.signal_name}")
        _drain_prefect_logs()
        names = ", ".join(f"{c.flow_run_name} ({c.flow_run_id})" for c in cancelled) or flow_run_id or "-"
        err_console.print(
            f"deploy-training cancelled by {guard.signal_name}: its jobs are stopped; flow run {names} is Cancelled",
            markup=False,
            highlight=False,
        )
        return guard.exit_code
    _drain_prefect_logs()
    summary = RunSummary.read(spec.reports_dir, since_unix_s=started)
    if summary is None and state is not None and state.is_completed():
        from tasks.pipeline import summarize

        result = state.result()
        summary = summarize(spec.name, result if isinstance(result, dict) else {}, None, None, None)
    if summary is None:  # no summary.json: print what the flow published in Prefect
        message = state.message if state is not None else "no state"
        err_console.print(f"deploy-training {getattr(state, 'name', 'ended')}: {message}", markup=False)
        for key in ("deployment-summary", "diagnosis"):
            page = published_markdown(flow_run_id, key) if flow_run_id else None
            if page:
                err_console.print(page, markup=False, highlight=False)
        err_console.print(f"reports: {Path(spec.reports_dir).resolve()}", markup=False, highlight=False)
        err_console.print(ui_hint(flow_run_id, server is not None), markup=False, highlight=False)
    else:
        print_summary(summary, spec.reports_dir, flow_run_id, server is not None)
    return 0 if state is not None and state.is_completed() else 1


def _drain_prefect_logs() -> None:
    """Send the run's last log lines and events while the server still runs."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)


def _short(text: str, limit: int = FIGURES_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


_VERDICT_STYLE = {"passed": "green", "skipped": "yellow", "FAILED": "bold red", "not run": "dim"}


def summary_table(summary: Any) -> Table:
    """One row per step: verdict and key figures (cut to FIGURES_CHARS; summary.json keeps them all)."""
    verdict = "failed" if summary.failed_step else "succeeded"
    table = Table(title=f"deploy-training {summary.name}: {verdict}", title_justify="left")
    for column in ("step", "verdict", "key figures", "details"):
        table.add_column(column, overflow="fold")
    for row in summary.steps:
        table.add_row(
            row.title, f"[{_VERDICT_STYLE.get(row.verdict, '')}]{row.verdict}[/]", _short(row.text()), row.details
        )
    return table


def ui_hint(flow_run_id: str | None, ephemeral: bool) -> str:
    """How to open the run in the Prefect UI."""
    if flow_run_id is None:
        return "Prefect UI: no flow run was recorded"
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if not ephemeral:
        base = (settings.ui_url or str(settings.api.url).removesuffix("/api")).rstrip("/")
        return f"Prefect UI: {base}/runs/flow-run/{flow_run_id}"
    home = shlex.quote(str(settings.home))
    return (
        f"Prefect UI: flow run {flow_run_id}; the temporary server's records are kept in PREFECT_HOME={home}; "
        f"to see them, run\n  PREFECT_HOME={home} {prefect_command()} server start\n"
        f"and open http://127.0.0.1:{UI_PORT}/runs/flow-run/{flow_run_id}"
    )


def prefect_command() -> str:
    """This environment's `prefect` as a shell runs it: the script beside this Python (a virtual environment's
    bin folder is seldom on PATH), else `python -m prefect`."""
    script = Path(sys.executable).parent / "prefect"
    if script.is_file() and os.access(script, os.X_OK):
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m prefect"


def print_summary(
    summary: Any, reports_dir: str, flow_run_id: str | None, ephemeral: bool, out: Console | None = None
) -> None:
    """The end of a run: the steps' table, a failed run's error and diagnosis, the reports folder, the UI."""
    out = out or console
    out.print(summary_table(summary))
    if summary.failed_step:
        row = next(r for r in summary.steps if r.step == summary.failed_step)
        out.print(f"{row.title} failed: {row.text()}", markup=False, highlight=False)
        if summary.findings:
            out.print("Diagnosis:", style="bold")
            for n, finding in enumerate(summary.findings, 1):
                out.print(f"{n}. {finding['cause']}: {finding['fix']}", markup=False, highlight=False)
                for evidence in finding.get("evidence", [])[:5]:
                    out.print(f"   evidence: {evidence}", markup=False, highlight=False)
        else:
            out.print("Diagnosis: no known cause matched; read the step's log first.", markup=False)
    out.print(f"reports: {Path(reports_dir).resolve()} (summary.json, summary.md)", markup=False, highlight=False)
    # soft_wrap: never break a path or the command inside the hint, whatever the console's width
    out.print(ui_hint(flow_run_id, ephemeral), markup=False, highlight=False, soft_wrap=True)


class ProgressDrawing:
    """Draws the progress events of the steps: step k of n, its phase, the count where there is one, elapsed."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task_id = progress.add_task("starting", total=None)

    def __call__(self, event: ProgressEvent) -> None:
        """Show `event`."""
        total = event.total if event.done is not None and event.total else None
        self.progress.update(self.task_id, description=progress_label(event), completed=event.done or 0, total=total)


def progress_label(event: ProgressEvent) -> str:
    """`[7/9 acceptance] acceptance: distributed run (40/200)`: the pipeline step's place, then the event."""
    from tasks.steps import DEPLOY

    names = [step.name for step in DEPLOY]
    k = f"{names.index(event.step) + 1}/{len(names)} " if event.step in names else ""
    return f"[{k}{event.step}] {event.describe()}"


@contextlib.contextmanager
def _drawing_progress() -> Iterator[None]:
    """A rich progress line under the log while the flow runs (Prefect's log lines print above it); plain
    progress lines when stdout is not a terminal."""
    from prefect.logging.handlers import PrefectConsoleHandler

    from tasks.progress import PlainLines, listening

    if not console.is_terminal:  # a file or a pipe (CI logs, tee): a live line draws nothing there
        lines = PlainLines(lambda text: console.print(text, markup=False, highlight=False), label=progress_label)
        with listening(lines):
            yield
        return
    # Drawn through the console Prefect's log handler prints with, so that its lines go above the live line.
    handler = next((h for h in _all_handlers() if isinstance(h, PrefectConsoleHandler)), None)
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        TimeElapsedColumn(),
        console=handler.console if handler else err_console,
        transient=True,
    )
    with progress, listening(ProgressDrawing(progress)):
        yield


def _all_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    return [h for lg in loggers for h in getattr(lg, "handlers", [])]
