"""serving.json, a JUnit file, the latency histogram and the serving manifests of a serving check, of every model
kind (a language model's, the classifier's, the vision-language model's report: each gives its checks, its
latencies as a `LatencyPlot` and its MODEL_KIND)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from xml.etree import ElementTree as ET

from tasks import tables
from tasks.serve.check import HISTOGRAM, JUNIT, SERVING_JSON, LatencyPlot
from tasks.serve.config import ServeConfig

if TYPE_CHECKING:
    from tasks.serve.captioning import CaptioningReport
    from tasks.serve.check import ServingReport
    from tasks.serve.classifier import ClassifierReport

Report = TypeVar("Report", "ServingReport", "ClassifierReport", "CaptioningReport")

VERDICTS = {True: "pass", False: "FAIL", None: "not gated"}


def write_junit(report: Report, path: Path) -> Path:
    """One test case per judged figure (an ungated one as skipped), so CI systems show each."""
    suite = ET.Element(
        "testsuite",
        name="tdeploy-serving",
        tests=str(len(report.checks)),
        failures=str(sum(1 for c in report.checks if c.passed is False)),
        skipped=str(sum(1 for c in report.checks if c.passed is None)),
    )
    for check in report.checks:
        case = ET.SubElement(suite, "testcase", classname="serving", name=check.name)
        ET.SubElement(case, "system-out").text = json.dumps(
            {"measured": check.measured, "threshold": check.threshold}, default=str
        )
        if check.passed is False:
            ET.SubElement(case, "failure", message=check.message).text = check.message
        elif check.passed is None:
            ET.SubElement(case, "skipped", message=check.message)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)
    return path


def plot_latency(plot: LatencyPlot, path: Path) -> Path:
    """A histogram of the load test's per-request latency with P50/P95/P99 and the threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(plot.per_request_ms, bins=min(30, max(5, len(plot.per_request_ms) // 2)), color="#4c72b0")
    latency = plot.figures
    for label, value, style in (("P50", latency.p50, ":"), ("P95", latency.p95, "--"), ("P99", latency.p99, "-")):
        ax.axvline(value, color="black", linestyle=style, label=f"{label} {value:.1f} ms")
    if plot.threshold_ms is not None:
        ax.axvline(plot.threshold_ms, color="red", label=f"P99 threshold {plot.threshold_ms:.0f} ms")
    ax.set_xlabel(plot.xlabel)
    ax.set_ylabel("requests")
    ax.set_title(plot.title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def table_rows(report: Report) -> list[dict[str, Any]]:
    """The artifact's table: one row per judged figure, its value and threshold in its unit or scale
    (tasks/tables.py: latencies in ms, shares in percent, ROUGE-L F1 0-1, BLEU-4 0-100)."""
    return [
        {
            "check": tables.label(c.name),
            "verdict": VERDICTS[c.passed],
            "measured": tables.value(c.name, c.measured),
            "threshold": tables.value(c.name, c.threshold),
            "message": c.message,
        }
        for c in report.checks
    ]


def write_reports(
    report: Report, serve: ServeConfig, name: str, out_dir: Path, pod_memory_bytes: float | None = None
) -> Report:
    """Write serving.json (last, so that its presence means the rest is there), junit.xml, the latency histogram
    and the Kubernetes and Slurm serving manifests of the report's model kind (report.MODEL_KIND); the report
    with their paths added to its files. The one writer of a serving check's files, whatever the kind."""
    from tasks.serve.manifests import PodResources, write_manifests

    files = {**report.files, "junit": str(write_junit(report, out_dir / JUNIT))}
    plot = report.latency_plot()
    if plot.per_request_ms:
        files["histogram"] = str(plot_latency(plot, out_dir / HISTOGRAM))
    resources = PodResources.of(serve, pod_memory_bytes)  # the serving plan's pod memory: requests and limits
    for path in write_manifests(serve, name, report.model_dir, out_dir, None, report.accelerator, resources,
                                report.MODEL_KIND):  # fmt: skip
        files[path.name] = str(path)
    files["json"] = str(out_dir / SERVING_JSON)
    report = dataclasses.replace(report, files=files)
    tmp = out_dir / f".{SERVING_JSON}.partial"
    tmp.write_text(json.dumps(report.to_json(), indent=2, default=str))
    tmp.replace(out_dir / SERVING_JSON)
    return report
