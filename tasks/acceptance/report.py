"""The acceptance report for people and CI: a JUnit XML file, the loss-curve plot and table rows (the report's
own file is tasks/acceptance/record.py's)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from tasks import tables
from tasks.acceptance.record import AcceptanceReport
from training.run_output import RunOutput

VERDICTS = {True: "pass", False: "FAIL", None: "not measured"}
"""A dimension's verdict in the tables (None: it could not be measured)."""
DRILL_VERDICTS = {True: "pass", False: "FAIL", None: "n/a"}
"""A drill's verdict in the tables (None: it does not apply to the spec)."""


def write_files(report: AcceptanceReport, root: Path) -> dict[str, str | None]:
    """Write the report's files into `root`: the report itself (record.py's writer), junit.xml and, where it
    names runs, the loss plot; their paths by kind (json, junit, plot). The flows' steps and the CLI both call it."""
    return {
        "json": str(report.write(root)),
        "junit": str(write_junit(report, root / "junit.xml")),
        "plot": str(plot_losses(report, root / "loss_curve.png")) if report.runs else None,
    }


def write_junit(report: AcceptanceReport, path: Path) -> Path:
    """One test case per dimension and per drill, so CI systems show each (one not measured, or a drill that does
    not apply, as skipped)."""
    cases: list[tuple[str, str, bool | None, str, dict[str, Any]]] = [
        ("acceptance", d.name, d.passed, d.message, {"measured": d.measured, "threshold": d.threshold})
        for d in report.dimensions
    ]
    cases += [
        ("drills", d.name, d.passed, d.message, {"recovery_s": d.recovery_s, "steps_lost": d.steps_lost})
        for d in report.drills
    ]
    failures = sum(1 for c in cases if c[2] is False)
    skipped = sum(1 for c in cases if c[2] is None)
    suite = ET.Element(
        "testsuite", name="tdeploy-acceptance", tests=str(len(cases)), failures=str(failures), skipped=str(skipped)
    )
    for classname, name, passed, message, details in cases:
        case = ET.SubElement(suite, "testcase", classname=classname, name=name)
        ET.SubElement(case, "system-out").text = json.dumps(details, default=str)
        if passed is False:
            ET.SubElement(case, "failure", message=message or "failed").text = message
        elif passed is None:
            ET.SubElement(case, "skipped", message=message)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)
    return path


def plot_losses(report: AcceptanceReport, path: Path) -> Path:
    """The distributed run's loss against the single-process reference, resumption points marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    curves = 0
    for label, key, style in (("distributed", "distributed", "-"), ("single-process reference", "reference", "--")):
        folder = report.runs.get(key)
        if not folder:
            continue
        metrics = RunOutput(folder).metrics()
        steps = sorted(s for s in metrics if math.isfinite(metrics[s].loss))
        if steps:
            ax.plot(steps, [metrics[s].loss for s in steps], style, label=label)
            curves += 1
    for drill in report.drills:
        resumed = drill.evidence.get("resumed_from_step")
        if resumed is not None:
            ax.axvline(resumed, color="tab:red", alpha=0.4, linestyle=":")
            ax.annotate(f"{drill.name} resumed", (resumed, ax.get_ylim()[1]), rotation=90, va="top", fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Acceptance: distributed vs single-process reference")
    if curves:
        ax.legend()
    else:  # a job that never started training (the start finding) leaves no curve to draw
        ax.text(0.5, 0.5, "no run recorded a training step", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def table_rows(report: AcceptanceReport) -> list[dict[str, Any]]:
    """Rows for a Prefect table artifact or a terminal table: each check's measured figures and its threshold as
    `name=value unit` text (tasks/tables.py), the verdict and what to look at first."""
    rows = [
        {
            "check": d.name,
            "verdict": VERDICTS[d.passed],
            "measured": tables.text(d.measured),
            "threshold": tables.text(d.threshold),
            "look first": d.look_first or d.message,
        }
        for d in report.dimensions
    ]
    rows += [
        {
            "check": f"drill: {d.name}",
            "verdict": DRILL_VERDICTS[d.passed],
            "measured": tables.text(
                {"recovery_s": d.recovery_s, "steps_lost": d.steps_lost, "state_matched": d.state_matched}
            ),
            "threshold": "resume from last complete checkpoint",
            "look first": d.message,
        }
        for d in report.drills
    ]
    return rows
