"""What a user sees while a long command runs and at its end: plain progress lines where the output is a file or
a pipe (CI logs, tee), and a Prefect UI hint that runs as typed, whatever the console's width."""

from __future__ import annotations

import io
import logging
import os
import shlex
import sys
from pathlib import Path

import pytest
from rich.console import Console

from flows import runner
from flows.cli import accept
from tasks.nodes.step import NodesResult
from tasks.pipeline import summarize
from tasks.progress import PlainLines, ProgressEvent, report

NODES = NodesResult(ok=True, hosts=["localhost"], warnings=0, report_path="runs/x/node-check.json", elapsed_s=1.0)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_write_each_new_phase_at_once_and_a_moving_count_at_most_every_interval() -> None:
    clock, written = Clock(), []
    lines = PlainLines(written.append, every_s=30, clock=clock)
    lines(ProgressEvent("acceptance", "distributed run", 0, 200))
    clock.now += 10
    lines(ProgressEvent("acceptance", "distributed run", 40, 200))  # within the interval: not written
    clock.now += 25
    lines(ProgressEvent("acceptance", "distributed run", 90, 200))
    clock.now += 1
    lines(ProgressEvent("acceptance", "recovery: rank_kill drill"))  # a new phase: written at once
    assert written == [
        "progress 0:00:00 acceptance: distributed run (0/200)",
        "progress 0:00:35 acceptance: distributed run (90/200)",
        "progress 0:00:36 acceptance: recovery: rank_kill drill",
    ]


def test_tdeploy_run_prints_plain_progress_lines_when_stdout_is_not_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(runner, "console", Console(file=out, width=200))
    assert not runner.console.is_terminal
    with runner._drawing_progress():
        report("acceptance", "distributed run", 40, 200, quiet=True)
    assert "progress 0:00:00 [7/10 acceptance] acceptance: distributed run (40/200)" in out.getvalue()


def test_accept_and_drill_print_progress_lines_in_place_of_the_progress_loggers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(accept, "console", Console(file=out, width=200))
    progress_logger = logging.getLogger("tasks.progress")
    level = progress_logger.level
    with accept._progress_lines():
        assert not progress_logger.isEnabledFor(logging.INFO)  # the phase is said once, by the line
        report("drills", "drill rank_kill", 1, 6)
    assert progress_logger.level == level
    assert "progress 0:00:00 drills: drill rank_kill (1/6)" in out.getvalue()


def _hint_command(text: str) -> list[str]:
    line = next(line for line in text.splitlines() if "server start" in line)
    return shlex.split(line)


def test_the_prefect_ui_hint_names_this_environments_prefect_so_it_runs_as_typed(tmp_path: Path) -> None:
    hint = runner.ui_hint("1234-abcd", ephemeral=True)
    assignment, program, *args = _hint_command(hint)
    assert assignment.startswith("PREFECT_HOME=") and args == ["server", "start"]
    assert program == str(Path(sys.executable).parent / "prefect")
    assert Path(program).is_file() and os.access(program, os.X_OK)  # no PATH needed
    assert "http://127.0.0.1:4200/runs/flow-run/1234-abcd" in hint


@pytest.mark.parametrize("width", [40, 80, 200])
def test_the_ui_hint_is_never_wrapped_inside_its_command_whatever_the_console_width(
    width: int, tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_HOME, temporary_settings

    home = tmp_path / ("a-long-folder-name-" * 8)  # as a test session's private PREFECT_HOME can be
    out = Console(record=True, width=width, color_system=None)
    with temporary_settings(updates={PREFECT_HOME: home}):
        runner.print_summary(summarize("x", {"nodes": NODES}, None, None, None), "runs/x", "1234-abcd", True, out)
    text = out.export_text()
    assert _hint_command(text) == [f"PREFECT_HOME={home}", *shlex.split(runner.prefect_command()), "server", "start"]
