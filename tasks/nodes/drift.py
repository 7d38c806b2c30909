"""The drift table: what must be the same on every node, how bad a difference is, and how to fix it.

Each check reads one value per host from its facts; hosts that differ from the reference value (the one
most hosts have; on a tie, the first host's) are flagged. Severity is either fixed or follows versions
(Versions): blocking when the leading numbers differ (or one side is missing), a warning otherwise.
An `exception` replaces the plain drift finding where a check knows more (no Python at all, fewer GPUs
than the job needs, ...).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from tasks.nodes.facts import NodeFacts
from tasks.nodes.inventory import CheckPlan
from tasks.nodes.report import ABSENT, RANK, Finding, Observed, Row, Severity, flag, host_list

# A fixed severity, or one that depends on the plan (gpu_job).
SeverityRule = Severity | Callable[[CheckPlan], Severity]
# A row's exception rule: (the row's values, the plain drift finding, the run) -> the finding to report.
Override = Callable[[dict[str, str], Finding | None, Observed], Finding | None]
CPU_ONLY = "cpu-only"


def gpu_job(plan: CheckPlan) -> Severity:
    """Blocking when the job needs GPUs, else a warning."""
    return "blocking" if plan.expected_gpus else "warning"


def gpus_in_play(seen: Observed) -> bool:
    """The job needs GPUs or some node has them: the GPU rows are worth showing."""
    return bool(seen.plan.expected_gpus) or any(f.system.gpus for f in seen.facts.values())


@dataclass(frozen=True)
class Versions:
    """Severity by version: blocking when the first `parts` numbers differ, a warning when only later ones do.

    A host whose value is `missing` (no such software, a CPU-only build) differs with severity `absent`.
    """

    parts: int
    absent: SeverityRule = "blocking"
    missing: str = ABSENT

    def judge(self, plan: CheckPlan, reference: str, other: str) -> Severity:
        """How bad `other` is where most hosts have `reference`."""
        if self.missing in (reference, other):
            return _severity(self.absent, plan)
        same = _numbers(reference)[: self.parts] == _numbers(other)[: self.parts]
        return "warning" if same else "blocking"


def _severity(rule: SeverityRule, plan: CheckPlan) -> Severity:
    return rule(plan) if callable(rule) else rule


# Python and torch: 3.11 against 3.12 blocks, 3.11.2 against 3.11.7 warns; missing blocks.
MINOR = Versions(2)
# The GPU software stack: the major version must match; missing blocks only a job that needs GPUs.
MAJOR_ON_GPU_JOB = Versions(1, absent=gpu_job)


@dataclass(frozen=True)
class DriftCheck:
    """One row of the drift table.

    `fix` is a template over `{ref}` (the reference value, through `ref_text`), `{hosts}` (those that differ)
    and `{python}` (the job's Python). A value of None leaves the host out of the row. `severity` is that of
    any difference, or a Versions rule.
    """

    name: str
    value: Callable[[NodeFacts], str | None]
    fix: str
    severity: SeverityRule | Versions = "warning"
    ref_text: Callable[[str], str] = str
    exception: Override | None = None
    applies: Callable[[Observed], bool] | None = None

    def judge(self, plan: CheckPlan, reference: str, other: str) -> Severity:
        """How bad it is that a host has `other` where most have `reference`."""
        if isinstance(self.severity, Versions):
            return self.severity.judge(plan, reference, other)
        return _severity(self.severity, plan)

    def remediation(self, plan: CheckPlan, reference: str, hosts: list[str]) -> str:
        """The fix for the hosts that differ."""
        return self.fix.format(ref=self.ref_text(reference), hosts=host_list(hosts), python=plan.job_python)


def _numbers(version: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", version.split("+")[0])]


def compare(check: DriftCheck, values: dict[str, str], plan: CheckPlan) -> Finding | None:
    """The drift finding of one check: hosts that differ from the reference value, with the worst severity."""
    if len(set(values.values())) <= 1:
        return None
    counts = Counter(values.values())
    first = next(iter(values.values()))
    reference = max(counts, key=lambda v: (counts[v], v == first))
    others = [v for v in counts if v != reference]
    severity = max((check.judge(plan, reference, v) for v in others), key=RANK.__getitem__)
    hosts = [h for h, v in values.items() if v != reference]
    by_value = "; ".join(f"{v} on {host_list([h for h in values if values[h] == v])}" for v in [reference, *others])
    return Finding(severity, hosts, f"{check.name} differs: {by_value}", check.remediation(plan, reference, hosts))


def drift_rows(seen: Observed) -> list[Row]:
    """One row per check of DRIFT_CHECKS that applies, over the hosts that reported their facts."""
    rows = []
    for check in DRIFT_CHECKS:
        if check.applies is not None and not check.applies(seen):
            continue
        values = {h: v for h, facts in seen.facts.items() if (v := check.value(facts)) is not None}
        finding = compare(check, values, seen.plan)
        if check.exception is not None:
            finding = check.exception(values, finding, seen)
        rows.append(flag(Row(check.name, values), finding))
    return rows


def _python_does_not_run(values: dict[str, str], drift: Finding | None, seen: Observed) -> Finding | None:
    errors = {h: f.python_error for h, f in seen.facts.items() if f.python_error}
    if set(values.values()) == {ABSENT}:
        return Finding(
            "blocking",
            list(errors),
            f"the job's Python {seen.plan.job_python} does not run on any node: {next(iter(errors.values()), '')}",
            "install Python on the nodes or point nodes.python at the job's interpreter",
        )
    if errors and drift is not None:
        said = "; ".join(f"{h}: {e}" for h, e in list(errors.items())[:3])
        return replace(drift, finding=f"{drift.finding}; {said}")
    return drift


def _torch_not_installed(values: dict[str, str], drift: Finding | None, seen: Observed) -> Finding | None:
    python_runs = any(f.python.version for f in seen.facts.values())
    if set(values.values()) == {ABSENT} and python_runs:
        return Finding(
            "warning",
            list(values),
            f"torch is not installed in {seen.plan.job_python} on any node",
            "fine when the job runs in a container image; else install torch in nodes.python",
        )
    return drift


def _cpu_only_torch(values: dict[str, str], drift: Finding | None, seen: Observed) -> Finding | None:
    cpu_only = [h for h, v in values.items() if v == CPU_ONLY]
    if seen.plan.expected_gpus and cpu_only:
        return Finding(
            "blocking",
            cpu_only,
            f"torch is a CPU-only build on {host_list(cpu_only)}, the job needs GPUs",
            f"install a CUDA build of torch in {seen.plan.job_python} on {host_list(cpu_only)}",
        )
    return drift


def _missing_gpus(values: dict[str, str], drift: Finding | None, seen: Observed) -> Finding | None:
    expected = seen.plan.expected_gpus
    short = [h for h, count in values.items() if expected and int(count) < expected]
    if short:
        return Finding(
            "blocking",
            short,
            f"missing GPUs: {host_list(short)} have fewer than {expected} (cluster.procs_per_node)",
            f"check `nvidia-smi -L` and `dmesg | grep -i xid` on {host_list(short)}, or drain them "
            f"and use nodes with {expected} GPUs",
        )
    return drift


def _gib(n_bytes: int | None) -> str:
    return ABSENT if n_bytes is None else f"{n_bytes / 2**30:.0f} GiB"


def _short_version(text: str | None) -> str:
    match = re.search(r"\d+(?:\.\d+)+", text or "")
    return match.group(0) if match else (text or "unknown")


def _runtimes(facts: NodeFacts) -> str:
    found = sorted((facts.system.container_runtimes or {}).items())
    return ", ".join(f"{name} {_short_version(version)}" for name, version in found) or ABSENT


def _torch_build(facts: NodeFacts) -> str | None:
    # Hosts without torch are already blocking in the torch row.
    torch = facts.python.torch
    return (torch.cuda or CPU_ONLY) if torch.version else None


def _torch_build_name(cuda: str) -> str:
    return "the CPU-only wheel" if cuda == CPU_ONLY else f"the +cu{cuda.replace('.', '')} wheel for CUDA {cuda}"


def _gpu_models(facts: NodeFacts) -> str:
    return ", ".join(sorted({f"{g.name} {g.memory_mib} MiB" for g in facts.system.gpus})) or ABSENT


DRIFT_CHECKS: list[DriftCheck] = [
    DriftCheck("OS", lambda f: f.os, "rebuild {hosts} from the same OS image as the others ({ref})"),
    DriftCheck("kernel", lambda f: f.kernel, "boot kernel {ref} on {hosts} (or reimage them like the others)"),
    DriftCheck(
        "CPU architecture",
        lambda f: f.arch,
        "use {ref} nodes only: {hosts} cannot run the same image",
        severity="blocking",
    ),
    DriftCheck(
        "CPUs",
        lambda f: str(f.system.cpu_count),
        "{hosts} are a different node type; data loading runs at the slowest node",
    ),
    DriftCheck(
        "memory",
        lambda f: _gib(f.system.memory_bytes),
        "{hosts} have another amount of memory ({ref} elsewhere); check for failed DIMMs or a different node type",
    ),
    DriftCheck("container runtime", _runtimes, "install the same container runtime ({ref}) on {hosts}"),
    DriftCheck(
        "Python",
        lambda f: f.python.version or ABSENT,
        "give the job Python {ref} at {python} on {hosts} (nodes.python)",
        severity=MINOR,
        exception=_python_does_not_run,
    ),
    DriftCheck(
        "torch",
        lambda f: f.python.torch.version or ABSENT,
        "install torch {ref} in {python} on {hosts} (pip install 'torch=={ref}'), "
        "or rebuild them from the same image as the others",
        severity=MINOR,
        exception=_torch_not_installed,
    ),
    DriftCheck(
        "torch CUDA build",
        _torch_build,
        "install the same torch build as the others ({ref}) on {hosts}",
        severity=Versions(1, missing=CPU_ONLY),
        ref_text=_torch_build_name,
        exception=_cpu_only_torch,
    ),
    DriftCheck(
        "NCCL (torch wheel)",
        lambda f: f.python.nccl_wheel or ABSENT,
        "install nvidia-nccl {ref} in {python} on {hosts}",
        severity=MAJOR_ON_GPU_JOB,
    ),
    DriftCheck(
        "NCCL (system)",
        lambda f: f.system.nccl_system or ABSENT,
        "install NCCL {ref} (libnccl2) on {hosts}",
        severity=MAJOR_ON_GPU_JOB,
    ),
    DriftCheck(
        "NVIDIA driver",
        lambda f: f.system.driver_version or ABSENT,
        "install NVIDIA driver {ref} on {hosts} (the same branch everywhere)",
        severity=MAJOR_ON_GPU_JOB,
    ),
    DriftCheck(
        "CUDA (driver)",
        lambda f: f.system.cuda_version or ABSENT,
        "install a driver supporting CUDA {ref} on {hosts}",
        severity=MAJOR_ON_GPU_JOB,
    ),
    DriftCheck(
        "GPUs",
        lambda f: str(len(f.system.gpus)),
        "{hosts} show another GPU count than the others ({ref}): check `nvidia-smi -L` "
        "and `dmesg | grep -i xid`, or take them out of the job",
        severity=gpu_job,
        exception=_missing_gpus,
    ),
    DriftCheck(
        "GPU model",
        _gpu_models,
        "use nodes with {ref} only; {hosts} have other GPUs",
        severity=gpu_job,
        applies=gpus_in_play,
    ),
]
