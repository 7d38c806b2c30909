"""The soak's files: soak.json (the typed result) and soak.md (the human table)."""

from __future__ import annotations

from pathlib import Path

from tasks.soak.result import SoakResult

JSON_FILE = "soak.json"
MARKDOWN_FILE = "soak.md"


def markdown(result: SoakResult) -> str:
    """The soak as a markdown page: the verdict, each failure, each process's memory."""
    lines = [f"# Soak: {'passed' if result.passed else 'FAILED'}", "", result.summary(), ""]
    lines += [f"- problem: {p}" for p in result.problems]
    lines += [f"- left out: {kind}: {why}" for kind, why in result.left_out.items()]
    lines += ["", "| # | failure | at (s) | target | step | expected | rung | steps lost | recovery (s) | problem |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for k, f in enumerate(result.failures, 1):
        rung = f"{f.rung}{' (requeued)' if f.requeued else ''}" if f.rung else "-"
        recovery = "-" if f.recovery_s is None else f"{f.recovery_s:.1f}"
        lines.append(f"| {k} | {f.kind} | {f.injected_at_s:.0f} | {f.target} | {f.at_step} | "
                     f"{' or '.join(f.expected)} | {rung} | {f.steps_lost if f.steps_lost is not None else '-'} | "
                     f"{recovery} | {f.problem or ''} |")  # fmt: skip
    lines += ["", "| process | verdict | samples | first RSS (MiB) | last RSS (MiB) | growth (MiB) | tolerance (MiB) |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in result.processes:
        growth = "-" if p.growth_bytes is None else f"{p.growth_bytes / 2**20:+.1f}"
        tolerance = "-" if p.tolerance_bytes is None else f"{p.tolerance_bytes / 2**20:.1f}"
        lines.append(f"| {p.role} (pid {p.pid}) | {p.verdict} | {p.samples} | {p.first_rss_bytes / 2**20:.0f} | "
                     f"{p.last_rss_bytes / 2**20:.0f} | {growth} | {tolerance} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def write_report(result: SoakResult, folder: Path) -> SoakResult:
    """Write soak.json and soak.md into `folder`; the result with their paths (as soak.json holds it)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"json": str(folder / JSON_FILE), "markdown": str(folder / MARKDOWN_FILE)}
    result = result.model_copy(update={"files": files})
    (folder / JSON_FILE).write_text(result.model_dump_json(indent=2))
    (folder / MARKDOWN_FILE).write_text(markdown(result))
    return result


def read_report(folder: Path) -> SoakResult:
    """The soak.json in `folder`."""
    return SoakResult.model_validate_json((folder / JSON_FILE).read_text())
