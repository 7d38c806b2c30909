"""Diagnosis: classify a failed deployment step or training run against the known causes.

Reads what a run left behind (the job log, per-rank metrics, the capacity plan,
the node-check report, the step's error) and returns findings, each with the
evidence that matched and the fix the deployment guide gives.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.acceptance.record import ACCEPTANCE_JSON, AcceptanceReport, UnreadableReport
from tasks.capacity.record import PlanRecord, read_plan
from tasks.nodes.report import NodeReport
from training.failure import FailureFileError, read_failure
from training.run_output import RunOutput, StepRecord
from training.watchdog import hang_records, stack_dumps

_RENDEZVOUS = re.compile(
    r"RendezvousTimeoutError|RendezvousConnectionError|DistNetworkError|TCPStore|Address already in use|"
    r"failed to listen on any local network address|Connection refused|NCCL.*[Tt]imeout|"
    r"Watchdog caught collective operation timeout|rendezvous.*timed out|Name or service not known|gai error",
)
# Where a rendezvous/store connection went: "connect to (10.0.0.2, 29500)", "to host 10.0.0.2:29500",
# "addresses of (host-a, 29500) cannot be retrieved (gai error: ...)".
_UNREACHED = re.compile(r"(?:connect to \(|connect/validate to host )(?P<host>[\w.:-]+?)(?:, |:)(?P<port>\d+)\)?")
_UNRESOLVED = re.compile(
    r"addresses of \((?P<host>[\w.-]+), (?P<port>\d+)\) cannot be retrieved.*(?:gai error|Name or service not known)"
)
# The launcher's reason: "torchrun exited with 1 on host-b (node 1); node 0 (host-a): exit 1".
_FAILED_NODE = re.compile(r"on (?P<host>\S+) \(node (?P<node>\d+)\)|node (?P<node2>\d+) \((?P<host2>[^)]+)\): exit")
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory|Cannot allocate memory|exitcode\s*:\s*-9")
_SPEC = re.compile(r"invalid deployment spec")
_CHECKPOINT = re.compile(
    r"CheckpointSaveError|checkpoint save to .* failed|checkpoint of step \d+ lost|Permission denied|"
    r"No space left on device|no space left on|Read-only file system|Not a directory"
)
_UNTRUSTED = re.compile(
    r"UnsafeCheckpointError|CheckpointKeyError|CheckpointFormatError|refusing to load .*\.metadata|"
    r"untrusted checkpoint|TDEPLOY_CHECKPOINT_KEY|DatasetError|climbs out of the dataset|outside the vocabulary"
)
# A dataset or checkpoint that is not there at all: a step that never ran or a folder removed, not tampering.
_MISSING = re.compile(
    r"DatasetError: .*(?:: the dataset does not exist|is unfinished \(no manifest\.json\)|: \S+ is missing)"
)
_LEASE = re.compile(r"LeaseHeld|LeaseRefused|LeaseLost|: held by pid \d+")
# An acceptance step's error names its report: "acceptance failed: regression; see <its run workspace>/<the file>"
_ACCEPTANCE_REPORT = re.compile(r"see (?P<path>\S+/" + re.escape(ACCEPTANCE_JSON) + r")")
_FIGURE_SEPARATOR = re.compile(r"; (?![^(]*\))")


@dataclass
class Finding:
    """One known cause that the evidence points to."""

    cause: str
    evidence: list[str]
    fix: str

    def describe(self) -> str:
        """`cause: fix (evidence)` in one paragraph."""
        return f"{self.cause}: {self.fix} (evidence: {'; '.join(self.evidence[:3])})"


@dataclass
class Diagnosis:
    """Every finding for a run, most likely first."""

    findings: list[Finding] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """As a dict."""
        return {"findings": [asdict(f) for f in self.findings], "inputs": self.inputs}

    def markdown(self) -> str:
        """A short page for people."""
        if not self.findings:
            return "# Diagnosis\n\nNo known cause matched; read the step's log first.\n"
        lines = ["# Diagnosis", ""]
        for n, f in enumerate(self.findings, 1):
            lines += [f"{n}. **{f.cause}**: {f.fix}", *(f"   - `{e}`" for e in f.evidence[:5]), ""]
        return "\n".join(lines)


def _matching_lines(text: str, pattern: re.Pattern[str], limit: int = 5) -> list[str]:
    return [line.strip()[:300] for line in text.splitlines() if pattern.search(line)][:limit]


def _metrics(run: RunOutput) -> dict[int, list[StepRecord]]:
    return {rank: run.metric_records(rank) for rank in run.metric_ranks()}


def diagnose(
    error: str = "",
    log_text: str = "",
    output_dir: Path | None = None,
    plan: PlanRecord | None = None,
    node_report: NodeReport | None = None,
    acceptance: AcceptanceReport | None = None,
) -> Diagnosis:
    """Findings for a failure, from the error message, the job log, the run's metrics and the reports (an
    acceptance report: `acceptance`, else the one the error names)."""
    text = f"{error}\n{log_text}"
    acceptance = acceptance if acceptance is not None else _report_named_in(error)
    diagnosis = Diagnosis(inputs=[k for k, v in {"error": error, "log": log_text, "plan": plan,
                                                  "node_report": node_report, "acceptance": acceptance}.items()
                                  if v])  # fmt: skip
    if _SPEC.search(error):
        problems = [line.strip().removeprefix("- ") for line in error.splitlines() if line.strip().startswith("- ")]
        diagnosis.findings.append(
            Finding(
                "invalid deployment spec",
                problems or [error.strip()[:300]],
                "nothing was started: fix every field as its line says (field=value: what is wrong and the fix), "
                "check the file with `tdeploy validate-spec SPEC`, then run again",
            )
        )
        return diagnosis
    rendezvous = _matching_lines(text, _RENDEZVOUS)
    node_findings = _node_findings(node_report)
    if rendezvous or node_findings:
        named = _rendezvous_fix(error, log_text)
        diagnosis.findings.append(
            Finding(
                "rendezvous / communication timeout at start",
                rendezvous + node_findings,
                named
                or "open the rendezvous port between the nodes (firewall, security group), make every node resolve "
                "every other node's hostname, and check the node-check findings"
                + (f": {node_findings[0]}" if node_findings else "; a port already in use means another job holds it"),
            )
        )
    oom = _matching_lines(text, _OOM)
    plan_findings = _plan_findings(plan)
    if oom or plan_findings:
        diagnosis.findings.append(
            Finding(
                "out of memory",
                oom + plan_findings,
                "use a smaller micro-batch with more gradient accumulation (same global batch), activation "
                "recompute, or more sharding (FSDP/ZeRO-3)"
                + (f"; layouts that fit: {plan_findings[-1]}" if plan_findings and "fit" in plan_findings[-1] else ""),
            )
        )
    checkpoint = _matching_lines(text, _CHECKPOINT)
    if checkpoint:
        diagnosis.findings.append(
            Finding(
                "checkpoint save failure",
                checkpoint,
                "make the checkpoint location writable by the job user and check free space (and the object "
                "store's reachability and credentials for s3://)",
            )
        )
    lease = _matching_lines(text, _LEASE)
    if lease:
        diagnosis.findings.append(
            Finding(
                "run folder in use by another job",
                lease,
                "another job holds this run's output or checkpoint folder: wait for it, `tdeploy cancel` it, "
                "or give this deployment its own run.output_url and checkpoint.url",
            )
        )
    missing = _matching_lines(text, _MISSING)
    if missing:
        diagnosis.findings.append(
            Finding(
                "dataset or checkpoint missing",
                missing,
                "the files the job was given are not there: the step that writes them did not run here, or their "
                "folder was removed or is not mounted on the nodes; run the deployment again (tdeploy run rebuilds "
                "the dataset), or point data.dataset_url / checkpoint.url at where the files are",
            )
        )
    untrusted = [line for line in _matching_lines(text, _UNTRUSTED, limit=20) if not _MISSING.search(line)][:5]
    if untrusted:
        diagnosis.findings.append(
            Finding(
                "untrusted checkpoint or dataset refused",
                untrusted,
                "a file on shared storage was not what this project writes (planted, tampered with, truncated or "
                "signed with another key): find out who wrote it, remove it, and check TDEPLOY_CHECKPOINT_KEY "
                "(or the tdeploy-checkpoint-key Secret block) matches the key the checkpoints were signed with",
            )
        )
    regression = _regression_finding(acceptance)
    if regression is not None:
        diagnosis.findings.append(regression)
    if output_dir is not None:
        workload = _workload_finding(output_dir)
        if workload is not None:  # the trainer's own verdict on its failure comes first
            diagnosis.findings.insert(0, workload)
        hang = _hang_finding(output_dir)
        if hang is not None:
            diagnosis.findings.append(hang)
        diagnosis.findings += _metric_findings(_metrics(RunOutput(output_dir)))
    return diagnosis


def _workload_finding(output_dir: Path) -> Finding | None:
    """The workload error the trainer recorded (training/failure.py failure.json): not retried, with its fix."""
    try:
        failure = read_failure(str(output_dir))
    except FailureFileError as err:
        return Finding("unreadable failure record", [str(err)], "remove failure.json; the trainer writes it")
    if failure is None:
        return None
    return Finding(f"workload error ({failure.cause}): not retried", [failure.describe()], failure.fix)


def _report_named_in(error: str) -> AcceptanceReport | None:
    """The acceptance report an acceptance step's error points at, where it can be read."""
    match = _ACCEPTANCE_REPORT.search(error)
    if match is None:
        return None
    try:
        return AcceptanceReport.read(Path(match["path"]))
    except UnreadableReport:
        return None


def _regression_finding(report: AcceptanceReport | None) -> Finding | None:
    """The regression gate's failure (tasks/ledger/gate.py): each figure that regressed with both values and the
    limit, the baseline entry, and what to do."""
    dimensions = report.dimensions if report is not None else []
    failed = next((d for d in dimensions if d.name == "regression" and d.passed is False), None)
    if failed is None:
        return None
    # One line per figure: the gate joins them with "; ", which also sits inside each one's parentheses
    evidence = [part.strip() for part in _FIGURE_SEPARATOR.split(failed.message) if part.strip()]
    baseline = failed.evidence.get("baseline_entry")
    if baseline:
        evidence.append(f"baseline: ledger entry {baseline} (created {failed.evidence.get('baseline_created_at')})")
    return Finding(
        "regression against the baseline",
        evidence or ["the regression dimension failed"],
        "`tdeploy baseline SPEC --run <this acceptance workspace>` shows every figure against the baseline; if "
        "nothing changed since it, run acceptance again before rolling back (other load on the machines slows a run)"
        + (f"; else look at {failed.look_first}" if failed.look_first else ""),
    )


def _failed_hosts(error: str) -> dict[int, str]:
    """The failed agents' hosts by node, from the launcher's reason."""
    found = {}
    for match in _FAILED_NODE.finditer(error):
        node, host = (match["node"], match["host"]) if match["node"] else (match["node2"], match["host2"])
        found[int(node)] = host
    return dict(sorted(found.items()))


def _rendezvous_fix(error: str, log_text: str) -> str:
    """The fix naming hosts and port, where torchrun's lines say where a connection went ("" when they do not)."""
    text = f"{error}\n{log_text}"
    unresolved = _UNRESOLVED.search(text)
    unreached = _UNREACHED.search(text)
    if not (unresolved or unreached):
        return ""
    failed = _failed_hosts(error)
    target = (unresolved or unreached)["host"]
    port = (unresolved or unreached)["port"]
    # Node 0 hosts the rendezvous store: the agents that could not reach it run on the other failed nodes.
    owner = failed.get(0)
    reaching = [host for node, host in failed.items() if node != 0] or ["a node other than the rendezvous host"]
    who = ", ".join(reaching)
    if unresolved:
        return (
            f"{who} cannot resolve {target!r} (port {port}; torchrun hands the rank-0 host's name to the workers as "
            f"MASTER_ADDR): make {who} resolve {target}'s name (/etc/hosts or DNS), then run again"
        )
    named = f"{target}" + (f" ({owner})" if owner and owner != target else "")
    return (
        f"{who} could not connect to the rendezvous at {target}:{port}: open port {port} on {named} to {who} "
        f"(firewall, security group) or set cluster.rdzv_port to a port that is open, then run again"
    )


def _node_findings(report: NodeReport | None) -> list[str]:
    if report is None:
        return []
    found = []
    for row in report.blocking:
        if any(word in row.check for word in ("port", "resolv", "hostname", "reach", "network", "ssh")):
            found.append(f"node check {row.check}: {row.finding or ''} {row.remediation or ''}".strip())
    return found


def _plan_findings(plan: PlanRecord | None) -> list[str]:
    if plan is None or plan.fits:
        return []
    requested = plan.requested
    need, usable = requested.peak_bytes / 2**30, requested.usable_bytes / 2**30
    found = [f"capacity plan: {requested.name} needs {need:.1f} GiB per device, {usable:.1f} GiB usable"]
    fitting = plan.fitting()
    if fitting:
        found.append(f"layouts that fit: {', '.join(fitting[:3])}")
    return found


def _hang_finding(output_dir: Path) -> Finding | None:
    """The watchdog's hang (training/watchdog.py) of the latest attempt that had one: the phase and step, the
    rank(s) that did not arrive, and every rank's stack dump."""
    records = hang_records(output_dir)
    if not records:
        return None
    attempt = records[-1].attempt
    ours = [r for r in records if r.attempt == attempt]
    first = next((r for r in ours if r.detected_by == "timeout"), ours[0])
    late = ", ".join(str(r) for r in first.late_ranks) or "none named"
    evidence = [
        f"attempt {attempt}: {first.phase} at step {first.step} ran {first.elapsed_s:.1f}s > {first.timeout_s:.1f}s "
        f"({first.timeout_rule}) on rank {first.rank}",
        first.message,
        *(f"stacks of rank {rank}: {path}" for rank, path in sorted(stack_dumps(output_dir, attempt).items())),
    ]
    reached = {r.rank: r.last_collective_seq for r in ours if r.last_collective_seq is not None}
    if reached:  # the flight recorder's view: a rank behind the others never issued the collective they wait in
        evidence.append("last collective issued (flight recorder): "
                        + ", ".join(f"rank {rank} #{seq}" for rank, seq in sorted(reached.items())))  # fmt: skip
    if len({r.attempt for r in records}) > 1:
        evidence.append(f"hangs in attempts {sorted({r.attempt for r in records})}: it came back after a restart")
    return Finding(
        f"hang in phase {first.phase} (rank(s) {late} did not arrive)",
        evidence,
        "read the stack dump of the rank that did not arrive first: where it stopped (data loading, storage, a "
        "collective the others never reached, a deadlock) is the cause; the waiting ranks' stacks only show the "
        "collective they wait in. If the same rank or host hangs again, check that host's network and devices; a "
        "phase that is only slow needs a longer watchdog timeout (watchdog.*_timeout_s)",
    )


def _metric_findings(metrics: dict[int, list[StepRecord]]) -> list[Finding]:
    findings = []
    rank0 = metrics.get(0, [])
    if len(rank0) >= 4:
        shares = [r.data_wait_s / r.step_time_s for r in rank0[2:] if r.step_time_s and r.data_wait_s is not None]
        if shares and statistics.median(shares) > 0.3:
            findings.append(
                Finding(
                    "input pipeline starves the accelerators (utilisation swings)",
                    [f"median data-wait share {statistics.median(shares):.0%} of the step time on rank 0"],
                    "use more data-loader workers and prefetching, and larger record files",
                )
            )
        losses = [r.loss for r in rank0]
        first = statistics.mean(losses[: max(1, len(losses) // 10)])
        last = statistics.mean(losses[-max(1, len(losses) // 10) :])
        bad = [r.step for r in rank0 if r.loss != r.loss or r.loss in (float("inf"), float("-inf"))]
        if bad or last >= first:
            evidence = (
                [f"loss NaN/Inf from step {bad[0]}"]
                if bad
                else [f"loss {first:.3f} at the start, {last:.3f} at the end"]
            )
            findings.append(
                Finding(
                    "loss not decreasing or diverging",
                    evidence,
                    "lower the learning rate (it must scale with the global batch), check warmup, the data order "
                    "(shuffling, duplicates) and that targets are the inputs shifted by one",
                )
            )
    return findings


def diagnose_run(
    path: Path, error: str = "", plan_url: str | None = None, node_report: str | None = None
) -> Diagnosis:
    """Diagnose a run folder: its job log (train.log or slurm-*.out) and metrics, with the deployment's plan.json
    and node-check.json where given (tasks.paths.DeploymentPaths says where they are)."""
    train_log = RunOutput(path).train_log
    logs = ([train_log] if train_log.exists() else []) + sorted(path.glob("slurm-*.out"))
    log_text = "\n".join(p.read_text(errors="replace") for p in logs)
    plan = plan_if_written(plan_url)
    nodes = node_report_if_written(node_report)
    in_workspace = AcceptanceReport.path_in(path).is_file()  # an acceptance run's workspace
    acceptance = AcceptanceReport.read(path) if in_workspace else None
    return diagnose(error, log_text, path, plan, nodes, acceptance)


def plan_if_written(url: str | None) -> PlanRecord | None:
    """The deployment's plan.json: None where no URL is given or no file is there (the capacity step did not run)."""
    if url is None or not Path(url).is_file():
        return None
    return read_plan(url)


def node_report_if_written(path: str | None) -> NodeReport | None:
    """The deployment's node-check.json: None where no path is given or no file is there (the node checks did not
    run)."""
    if path is None or not Path(path).is_file():
        return None
    return NodeReport.read(path)
