"""Pipeline-level tasks: load the spec, diagnose a failed step, publish the run's summary page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.diagnose import diagnose, diagnose_run
from tasks.spec import DeploymentSpec, load_spec

STEPS = ("capacity", "nodes", "image", "data", "job", "acceptance", "drills")
STEP_TITLES = {
    "capacity": "capacity estimation",
    "nodes": "node environment checks",
    "image": "image build",
    "data": "data preprocessing and validation",
    "job": "job submission",
    "acceptance": "acceptance tests",
    "drills": "checkpoint-restore drills",
}
ARTIFACTS = {
    "capacity": "capacity-plan",
    "nodes": "node-checks",
    "image": "image-build",
    "data": "prepare-data",
    "job": "submit-job",
    "acceptance": "acceptance",
    "drills": "drills",
}


@task(name="load_spec", retries=2, retry_delay_seconds=5)
def load_deployment_spec(spec: DeploymentSpec | str) -> DeploymentSpec:
    """The spec itself, or the one at a path/URL (validated; a bad spec fails here, before any work)."""
    return spec if isinstance(spec, DeploymentSpec) else load_spec(spec)


@task(name="diagnose_failure")
def diagnose_failure(
    step: str, error: str, run_dir: str | None, plan_url: str | None, nodes_report: str | None
) -> dict:
    """Classify a failed step against the known causes; publish the findings."""
    logger = get_run_logger()
    plan = json.loads(Path(plan_url).read_text()) if plan_url and Path(plan_url).exists() else None
    nodes = json.loads(Path(nodes_report).read_text()) if nodes_report and Path(nodes_report).exists() else None
    if run_dir and Path(run_dir).exists():
        result = diagnose_run(Path(run_dir), error)
        if plan or nodes:
            extra = diagnose(error, "", None, plan, nodes)
            known = {f.cause for f in result.findings}
            result.findings += [f for f in extra.findings if f.cause not in known]
    else:
        result = diagnose(error, "", None, plan, nodes)
    for finding in result.findings:
        logger.error("diagnosis: %s", finding.describe())
    create_markdown_artifact(key="diagnosis", markdown=result.markdown(), description=f"why {step} failed")
    return result.to_json()


def _figures(step: str, result: dict[str, Any]) -> str:
    if step == "capacity":
        mem = result.get("memory", {})
        return f"fits: {result.get('fits')}; plan `{result.get('plan_url')}`; peak {mem.get('total_gib', '?')} GiB"
    if step == "nodes":
        hosts, warnings = len(result.get("hosts", [])), result.get("warnings", 0)
        return f"{hosts} host(s), {warnings} warning(s); `{result.get('report_path')}`"
    if step == "image":
        return (
            f"{result.get('status')}: `{result.get('reference_by_digest') or result.get('reference') or '-'}`; "
            + str(result.get("reason", ""))
        )
    if step == "data":
        splits = ", ".join(
            f"{k} {v['tokens']:,} tokens / {v['docs']:,} docs" for k, v in result.get("splits", {}).items()
        )
        return f"`{result.get('dataset_url')}` ({'reused' if result.get('reused') else 'prepared'}): {splits}"
    if step == "job":
        return f"`{result.get('job')}` {result.get('state')}; output `{result.get('output_dir')}`"
    if step in ("acceptance", "drills"):
        report = result.get("report", {})
        rows = [f"{d['name']} {'pass' if d['passed'] else 'FAIL'}" for d in report.get("dimensions", [])]
        rows += [
            f"{d['name']} {'pass' if d['passed'] else ('n/a' if d['passed'] is None else 'FAIL')}"
            + (f" (recovery {d['recovery_s']:.1f} s)" if d.get("recovery_s") is not None else "")
            for d in report.get("drills", [])
        ]
        return f"{result.get('verdict')}: " + ", ".join(rows)
    return ""


@task(name="publish_summary")
def publish_summary(
    name: str, results: dict[str, Any], failed_step: str | None, error: str | None, diagnosis: dict | None
) -> str:
    """One markdown page with every step's verdict, key figures and the detailed artifacts' keys."""
    verdict = "failed" if failed_step else "succeeded"
    lines = [f"# Deployment `{name}`: {verdict}", "", "| step | verdict | key figures | details |", "|---|---|---|---|"]
    for step in STEPS:
        if step in results:
            status, figures = "passed", _figures(step, results[step])
        elif step == failed_step:
            status, figures = "**FAILED**", (error or "").splitlines()[0][:300] if error else ""
        else:
            status, figures = "not run", ""
        figures = figures.replace("|", "\\|")
        lines.append(f"| {STEP_TITLES[step]} | {status} | {figures} | artifact `{ARTIFACTS[step]}` |")
    if diagnosis and diagnosis.get("findings"):
        lines += ["", "## Diagnosis", ""]
        lines += [f"- **{f['cause']}**: {f['fix']}" for f in diagnosis["findings"]]
    markdown = "\n".join(lines) + "\n"
    create_markdown_artifact(key="deployment-summary", markdown=markdown, description=f"{name}: {verdict}")
    return markdown
