"""The consistency report: one row per check with the value on each host, severities and remediation.

Drift is judged against the reference value (the one most hosts have; on a tie, the first host's).
Blocking: the job cannot start or will hang (different torch/CUDA/NCCL/driver major version, missing
GPU, closed rendezvous port, unreachable host, ...). Warning: worth fixing, the job still runs
(kernel patch level, OS point release, ...).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from tasks.nodes.inventory import CheckPlan
from tasks.nodes.runner import PlaybookRun

Severity = Literal["ok", "warning", "blocking"]
RANK = {"ok": 0, "warning": 1, "blocking": 2}
ABSENT = "absent"
NO_RESULT = "-"


@dataclass
class Row:
    """One check across the hosts: each host's value, and what is wrong and how to fix it, if anything."""

    check: str
    values: dict[str, str]
    severity: Severity = "ok"
    finding: str | None = None
    remediation: str | None = None
    hosts: list[str] = field(default_factory=list)
    transient: bool = False


@dataclass
class NodeReport:
    """The result of one node check."""

    hosts: list[str]
    rows: list[Row]
    elapsed_s: float
    run_status: str
    log: str = ""

    @property
    def blocking(self) -> list[Row]:
        return [r for r in self.rows if r.severity == "blocking"]

    @property
    def warnings(self) -> list[Row]:
        return [r for r in self.rows if r.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.blocking

    @property
    def blocking_hosts(self) -> list[str]:
        named = {h for r in self.blocking for h in r.hosts}
        return [h for h in self.hosts if h in named]

    def row(self, check: str) -> Row:
        """The row of a check, by name."""
        return next(r for r in self.rows if r.check == check)

    def summary(self) -> str:
        """One line for logs and the artifact description."""
        verdict = "ready" if self.ok else f"NOT ready (blocking on {', '.join(self.blocking_hosts) or 'all'})"
        return (
            f"{len(self.hosts)} node(s) {verdict}: {len(self.blocking)} blocking, {len(self.warnings)} warning(s); "
            f"checked in {self.elapsed_s:.1f} s"
        )

    def to_json(self) -> dict[str, Any]:
        """The machine-readable report."""
        return {
            "ok": self.ok,
            "summary": self.summary(),
            "hosts": self.hosts,
            "blocking_hosts": self.blocking_hosts,
            "elapsed_s": round(self.elapsed_s, 3),
            "run_status": self.run_status,
            "rows": [asdict(r) for r in self.rows],
        }

    def table(self, max_chars: int = 400) -> list[dict[str, str]]:
        """Rows for a table artifact: values grouped as `value (hosts)` so that it stays readable at 1,000 nodes."""
        return [
            {
                "check": r.check,
                "severity": r.severity,
                "values": grouped_values(r.values, max_chars),
                "finding": r.finding or "",
                "remediation": r.remediation or "",
            }
            for r in self.rows
        ]


def grouped_values(values: dict[str, str], max_chars: int = 400) -> str:
    """`2.13.0 (node-a, node-b); absent (node-c)`, most common value first, cut at max_chars."""
    groups: dict[str, list[str]] = {}
    for host, value in values.items():
        groups.setdefault(value, []).append(host)
    parts = []
    for value, hosts in sorted(groups.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(hosts[:5]) + (f" and {len(hosts) - 5} more" if len(hosts) > 5 else "")
        parts.append(f"{value} ({shown})" if len(groups) > 1 or len(values) <= 5 else f"{value} (all {len(hosts)})")
    text = "; ".join(parts)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _hosts(hosts: list[str]) -> str:
    return ", ".join(hosts[:10]) + (f" and {len(hosts) - 10} more" if len(hosts) > 10 else "")


def _numbers(version: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", version.split("+")[0])]


def version_severity(blocking_parts: int, absent: Severity = "blocking") -> Callable[[str, str], Severity]:
    """Blocking when the first `blocking_parts` numbers differ (or one side is absent); else a warning."""

    def judge(reference: str, other: str) -> Severity:
        if ABSENT in (reference, other):
            return absent
        return "blocking" if _numbers(reference)[:blocking_parts] != _numbers(other)[:blocking_parts] else "warning"

    return judge


def always(severity: Severity) -> Callable[[str, str], Severity]:
    """Any difference has this severity."""
    return lambda reference, other: severity


def compare(
    check: str,
    values: dict[str, str],
    judge: Callable[[str, str], Severity],
    fix: Callable[[str, list[str]], str],
    order: list[str],
) -> Row:
    """A drift row: hosts that differ from the reference value, with the worst severity among them."""
    row = Row(check, dict(values))
    if len(set(values.values())) <= 1:
        return row
    counts: dict[str, int] = {}
    for value in values.values():
        counts[value] = counts.get(value, 0) + 1
    first = next((values[h] for h in order if h in values), None)
    reference = max(counts, key=lambda v: (counts[v], v == first))
    others = {v for v in counts if v != reference}
    row.severity = max((judge(reference, v) for v in others), key=RANK.__getitem__)
    row.hosts = [h for h in order if h in values and values[h] != reference]
    by_value = "; ".join(f"{v} on {_hosts([h for h in order if values.get(h) == v])}" for v in [reference, *others])
    row.finding = f"{check} differs: {by_value}"
    row.remediation = fix(reference, row.hosts)
    return row


def _gib(n_bytes: int | None) -> str:
    return ABSENT if n_bytes is None else f"{n_bytes / 2**30:.0f} GiB"


def _get(data: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


class _Builder:
    """Builds the rows of one report from one playbook run and its plan."""

    def __init__(self, run: PlaybookRun, plan: CheckPlan) -> None:
        self.run, self.plan = run, plan
        self.order = run.hosts
        self.reached = [h for h in self.order if _get(run.results, h, "facts") is not None]
        self.rows: list[Row] = []

    def facts(self, *path: str) -> dict[str, Any]:
        return {h: _get(self.run.results[h], "facts", *path) for h in self.reached}

    def add(self, row: Row) -> None:
        row.values = {h: row.values[h] for h in self.order if h in row.values}
        self.rows.append(row)

    def build(self) -> list[Row]:
        self.reachability()
        self.host_count()
        if self.reached:
            self.os_rows()
            self.python_rows()
            self.accelerator_rows()
            self.storage_rows()
            self.network_rows()
            self.clock_row()
            self.security_rows()
        return self.rows

    def reachability(self) -> None:
        values, unreachable, failed, missing = {}, [], [], []
        for host in self.order:
            if host in self.run.unreachable:
                values[host] = f"unreachable: {ssh_reason(self.run.unreachable[host])}"
                unreachable.append(host)
            elif host in self.run.failed:
                values[host] = f"check failed: {self.run.failed[host]}"
                failed.append(host)
            elif not all(_get(self.run.results, host, s) is not None for s in ("facts", "storage", "network")):
                values[host] = f"no result (check run {self.run.status})"
                missing.append(host)
            else:
                values[host] = "ok"
        row = Row("reachable", values)
        if unreachable or failed or missing:
            row.severity, row.hosts = "blocking", [h for h in self.order if h in {*unreachable, *failed, *missing}]
            parts, fixes = [], []
            if unreachable:
                parts.append(f"unreachable: {_hosts(unreachable)}")
                by_cause: dict[str, list[str]] = {}
                for host in unreachable:
                    by_cause.setdefault(_unreachable_cause(self.run.unreachable[host]), []).append(host)
                fixes += [UNREACHABLE_FIXES[cause].format(hosts=_hosts(hosts)) for cause, hosts in by_cause.items()]
            if failed:
                parts.append(f"a check failed on {_hosts(failed)}")
                fixes.append(f"read the failed task's message for {_hosts(failed)} and the check log beside the report")
            if missing:
                parts.append(f"no result from {_hosts(missing)}")
                fixes.append("the run ended early (nodes.run_timeout_s); raise it or nodes.forks, then run again")
            row.finding = "; ".join(parts)
            row.remediation = "; ".join(fixes)
            row.transient = not failed and all(
                _unreachable_cause(self.run.unreachable[h]) in TRANSIENT_CAUSES for h in unreachable
            )
        self.add(row)

    def host_count(self) -> None:
        if self.plan.min_hosts is not None and len(self.order) < self.plan.min_hosts:
            self.add(
                Row(
                    "node count",
                    {h: "checked" for h in self.order},
                    "warning",
                    f"{len(self.order)} node(s) checked, the job needs cluster.nodes={self.plan.min_hosts}",
                    "list every node the job may run on under nodes.hosts (or in the inventory)",
                    list(self.order),
                )
            )

    def os_rows(self) -> None:
        order = self.order
        self.add(
            compare(
                "OS",
                self.facts("os"),
                always("warning"),
                lambda ref, hosts: f"rebuild {_hosts(hosts)} from the same OS image as the others ({ref})",
                order,
            )
        )
        self.add(
            compare(
                "kernel",
                self.facts("kernel"),
                always("warning"),
                lambda ref, hosts: f"boot kernel {ref} on {_hosts(hosts)} (or reimage them like the others)",
                order,
            )
        )
        self.add(
            compare(
                "CPU architecture",
                self.facts("arch"),
                always("blocking"),
                lambda ref, hosts: f"use {ref} nodes only: {_hosts(hosts)} cannot run the same image",
                order,
            )
        )
        self.add(
            compare(
                "CPUs",
                {h: str(v) for h, v in self.facts("system", "cpu_count").items()},
                always("warning"),
                lambda ref, hosts: f"{_hosts(hosts)} are a different node type; data loading runs at the slowest node",
                order,
            )
        )
        self.add(
            compare(
                "memory",
                {h: _gib(v) for h, v in self.facts("system", "memory_bytes").items()},
                always("warning"),
                lambda ref, hosts: (
                    f"{_hosts(hosts)} have another amount of memory ({ref} elsewhere); check for "
                    "failed DIMMs or a different node type"
                ),
                order,
            )
        )
        runtimes = {
            h: ", ".join(f"{name} {_short_version(v)}" for name, v in sorted((r or {}).items())) or ABSENT
            for h, r in self.facts("system", "container_runtimes").items()
        }
        self.add(
            compare(
                "container runtime",
                runtimes,
                always("warning"),
                lambda ref, hosts: f"install the same container runtime ({ref}) on {_hosts(hosts)}",
                order,
            )
        )

    def python_rows(self) -> None:
        python = self.plan.job_python
        versions = {h: _get(v, "version") or ABSENT for h, v in self.facts("python").items()}
        row = compare(
            "Python",
            versions,
            version_severity(2),
            lambda ref, hosts: f"give the job Python {ref} at {python} on {_hosts(hosts)} (nodes.python)",
            self.order,
        )
        errors = {h: e for h, e in self.facts("python_error").items() if e}
        if errors and row.finding:
            row.finding += "; " + "; ".join(f"{h}: {e}" for h, e in list(errors.items())[:3])
        if set(versions.values()) == {ABSENT}:
            row.severity, row.hosts = "blocking", list(errors)
            row.finding = f"the job's Python {python} does not run on any node: {next(iter(errors.values()), '')}"
            row.remediation = "install Python on the nodes or point nodes.python at the job's interpreter"
        self.add(row)
        torch = {h: _get(v, "torch", "version") or ABSENT for h, v in self.facts("python").items()}
        row = compare(
            "torch",
            torch,
            version_severity(2),
            lambda ref, hosts: (
                f"install torch {ref} in {python} on {_hosts(hosts)} (pip install 'torch=={ref}'), "
                "or rebuild them from the same image as the others"
            ),
            self.order,
        )
        if set(torch.values()) == {ABSENT} and set(versions.values()) != {ABSENT}:
            row.severity, row.hosts = "warning", list(torch)
            row.finding = f"torch is not installed in {python} on any node"
            row.remediation = "fine when the job runs in a container image; else install torch in nodes.python"
        self.add(row)
        # Hosts without torch are already blocking in the torch row.
        cuda = {
            h: _get(v, "torch", "cuda") or "cpu-only"
            for h, v in self.facts("python").items()
            if _get(v, "torch", "version")
        }
        row = compare(
            "torch CUDA build",
            cuda,
            _cuda_build_severity,
            lambda ref, hosts: (
                f"install the same torch build as the others ({_torch_build_name(ref)}) on {_hosts(hosts)}"
            ),
            self.order,
        )
        if self.plan.expected_gpus and any(v == "cpu-only" for v in cuda.values()):
            cpu_only = [h for h in self.order if cuda.get(h) == "cpu-only"]
            row.severity, row.hosts = "blocking", cpu_only
            row.finding = f"torch is a CPU-only build on {_hosts(cpu_only)}, the job needs GPUs"
            row.remediation = f"install a CUDA build of torch in {python} on {_hosts(cpu_only)}"
        self.add(row)
        absent_nccl: Severity = "blocking" if self.plan.expected_gpus else "warning"
        self.add(
            compare(
                "NCCL (torch wheel)",
                {h: _get(v, "nccl_wheel") or ABSENT for h, v in self.facts("python").items()},
                version_severity(1, absent_nccl),
                lambda ref, hosts: f"install nvidia-nccl {ref} in {python} on {_hosts(hosts)}",
                self.order,
            )
        )

    def accelerator_rows(self) -> None:
        expected = self.plan.expected_gpus
        absent: Severity = "blocking" if expected else "warning"
        self.add(
            compare(
                "NCCL (system)",
                {h: v or ABSENT for h, v in self.facts("system", "nccl_system").items()},
                version_severity(1, absent),
                lambda ref, hosts: f"install NCCL {ref} (libnccl2) on {_hosts(hosts)}",
                self.order,
            )
        )
        self.add(
            compare(
                "NVIDIA driver",
                {h: v or ABSENT for h, v in self.facts("system", "driver_version").items()},
                version_severity(1, absent),
                lambda ref, hosts: f"install NVIDIA driver {ref} on {_hosts(hosts)} (the same branch everywhere)",
                self.order,
            )
        )
        self.add(
            compare(
                "CUDA (driver)",
                {h: v or ABSENT for h, v in self.facts("system", "cuda_version").items()},
                version_severity(1, absent),
                lambda ref, hosts: f"install a driver supporting CUDA {ref} on {_hosts(hosts)}",
                self.order,
            )
        )
        gpus = {h: v or [] for h, v in self.facts("system", "gpus").items()}
        counts = {h: str(len(v)) for h, v in gpus.items()}
        row = compare(
            "GPUs",
            counts,
            always("blocking" if expected else "warning"),
            lambda ref, hosts: (
                f"{_hosts(hosts)} show another GPU count than the others ({ref}): check `nvidia-smi -L` "
                "and `dmesg | grep -i xid`, or take them out of the job"
            ),
            self.order,
        )
        if expected:
            short = [h for h in self.order if h in counts and int(counts[h]) < expected]
            if short:
                row.severity, row.hosts = "blocking", short
                row.finding = f"missing GPUs: {_hosts(short)} have fewer than {expected} (cluster.procs_per_node)"
                row.remediation = (
                    f"check `nvidia-smi -L` and `dmesg | grep -i xid` on {_hosts(short)}, or drain them "
                    f"and use nodes with {expected} GPUs"
                )
        self.add(row)
        if not expected and not any(gpus.values()):
            return
        models = {
            h: ", ".join(sorted({f"{g.get('name')} {g.get('memory_mib')} MiB" for g in v})) or ABSENT
            for h, v in gpus.items()
        }
        self.add(
            compare(
                "GPU model",
                models,
                always("blocking" if expected else "warning"),
                lambda ref, hosts: f"use nodes with {ref} only; {_hosts(hosts)} have other GPUs",
                self.order,
            )
        )
        self.gpu_health(gpus)

    def gpu_health(self, gpus: dict[str, list[dict[str, Any]]]) -> None:
        values, broken, ecc_off = {}, [], []
        errors = self.facts("system", "gpu_error")
        for host in self.reached:
            bad = [g for g in gpus.get(host, []) if (g.get("ecc_uncorrected_errors") or 0) > 0]
            if errors.get(host):
                values[host] = str(errors[host])
                broken.append(host)
            elif bad:
                values[host] = "uncorrected ECC errors on GPU " + ", ".join(str(g.get("index")) for g in bad)
                broken.append(host)
            elif any(g.get("ecc_mode") == "Disabled" for g in gpus.get(host, [])):
                values[host] = "ok, ECC disabled"
                ecc_off.append(host)
            else:
                values[host] = "ok" if gpus.get(host) else ABSENT
        row = Row("GPU health", values)
        if broken:
            row.severity, row.hosts = "blocking", broken
            row.finding = f"unhealthy GPUs on {_hosts(broken)}"
            row.remediation = f"drain {_hosts(broken)}; reset the GPUs (nvidia-smi -r) or have them replaced"
        elif ecc_off:
            row.severity, row.hosts = "warning", ecc_off
            row.finding = f"ECC is disabled on {_hosts(ecc_off)}"
            row.remediation = f"enable ECC (nvidia-smi -e 1, then reboot) on {_hosts(ecc_off)}"
        self.add(row)

    def storage_rows(self) -> None:
        results = {h: {m["path"]: m for m in self.run.results[h].get("storage") or []} for h in self.reached}
        paths = list(dict.fromkeys(p for by_path in results.values() for p in by_path))
        for path in paths:
            values, bad = {}, []
            for host in self.reached:
                mount = results[host].get(path)
                if mount is None:
                    values[host] = NO_RESULT
                elif mount.get("error"):
                    values[host] = mount["error"]
                    bad.append(host)
                else:
                    values[host] = f"ok, {mount['free_bytes'] / 1e9:.1f} GB free"
            row = Row(f"storage {path}", values)
            if bad:
                need = results[bad[0]][path].get("min_free_gb")
                row.severity, row.hosts = "blocking", bad
                row.finding = f"{path} is not usable on {_hosts(bad)}: " + "; ".join(sorted({values[h] for h in bad}))
                row.remediation = f"mount the shared storage at {path} on {_hosts(bad)}, writable by the job user" + (
                    f", with at least {need:g} GB free" if need else ""
                )
            self.add(row)

    def network_rows(self) -> None:
        network = {h: self.run.results[h]["network"] for h in self.reached if self.run.results[h].get("network")}
        values, bad, answers = {}, [], {}
        for host, net in network.items():
            failed = sorted((net.get("resolve_errors") or {}).keys())
            resolved = net.get("resolved") or {}
            for name, addresses in resolved.items():
                if addresses:
                    answers.setdefault(name, {})[host] = ", ".join(addresses)
            values[host] = f"cannot resolve {', '.join(failed)}" if failed else f"ok ({len(resolved)} names)"
            if failed:
                bad.append(host)
        row = Row("name resolution", values)
        if bad:
            row.severity, row.hosts = "blocking", bad
            row.finding = "; ".join(f"{h} {values[h]}" for h in bad[:10])
            row.remediation = f"add the other nodes to DNS or /etc/hosts on {_hosts(bad)}"
        else:
            split = {name: by_host for name, by_host in answers.items() if len(set(by_host.values())) > 1}
            if split:
                name, by_host = next(iter(split.items()))
                row.severity, row.hosts = "warning", sorted({h for b in split.values() for h in b})
                row.finding = f"{len(split)} name(s) resolve differently on different nodes, e.g. {name}: " + "; ".join(
                    f"{a} on {_hosts([h for h in by_host if by_host[h] == a])}" for a in sorted(set(by_host.values()))
                )
                row.remediation = "make DNS or /etc/hosts agree on every node"
        self.add(row)
        self.rdzv_row(network)

    def rdzv_row(self, network: dict[str, dict[str, Any]]) -> None:
        port = self.plan.rdzv_port
        if port is None:
            return
        server = next((n.get("rdzv_host") for n in network.values() if n.get("rdzv_host")), self.order[0])
        target = next((n.get("rdzv_target") for n in network.values() if n.get("rdzv_target")), server)
        values: dict[str, str] = {h: "unreachable" for h in self.order if h not in network and h != server}
        row = Row(f"rendezvous port {port}", values)
        if server not in network:
            values.update({h: "not checked (rendezvous host unreachable)" for h in network})
            values[server] = "unreachable"
            row.severity, row.hosts = "blocking", [server]
            row.finding = f"the rendezvous host {server} is unreachable, so the port was not checked"
            row.remediation = f"make {server} reachable (see `reachable`), or list another node first"
            row.transient = _unreachable_cause(self.run.unreachable.get(server, "")) in TRANSIENT_CAUSES
            self.add(row)
            return
        net = network[server]
        listener = net.get("listener") or {}
        if net.get("rdzv_error") or not listener.get("listening"):
            why = net.get("rdzv_error") or listener.get("error") or "listener did not start"
            values[server] = why
            row.severity, row.hosts = "blocking", [server]
            row.finding = f"no listener could be started on {server}:{port}: {why}"
            row.remediation = (
                f"port {port} is taken on {server}: stop what holds it (`ss -ltnp 'sport = :{port}'`, often a "
                f"leftover torchrun) or choose another nodes.rdzv_port"
            )
            self.add(row)
            return
        values[server] = f"listening ({len((net.get('listener_stop') or {}).get('peers') or [])} peers connected)"
        closed, reasons = [], set()
        for host, peer in network.items():
            if host == server:
                continue
            connect = peer.get("connect") or {}
            if connect.get("connected"):
                values[host] = f"connected in {connect.get('seconds')} s"
            else:
                values[host] = connect.get("error") or peer.get("rdzv_error") or "not checked"
                closed.append(host)
                reasons.add(values[host])
        if closed:
            row.severity, row.hosts = "blocking", closed
            row.finding = f"{_hosts(closed)} cannot reach the rendezvous {target}:{port}: " + "; ".join(sorted(reasons))
            if any("resolve" in r for r in reasons):
                row.remediation = f"make {target} resolvable on {_hosts(closed)} (DNS or /etc/hosts)"
            else:
                row.remediation = (
                    f"open TCP port {port} on {server} to the other nodes (firewall / security group), e.g. "
                    f"`iptables -I INPUT -p tcp --dport {port} -j ACCEPT` or `firewall-cmd --add-port={port}/tcp`"
                )
        self.add(row)

    def clock_row(self) -> None:
        bounds: dict[str, tuple[float, float]] = {}
        for host in self.reached:
            reading, window = self.facts("clock_epoch_s").get(host), self.run.clock_windows.get(host)
            if reading is not None and window is not None:
                bounds[host] = (float(reading) - window[1], float(reading) - window[0])
        if not bounds:
            return
        values = {h: f"{(lo + hi) / 2:+.2f} s ±{(hi - lo) / 2:.2f} vs controller" for h, (lo, hi) in bounds.items()}
        row = Row("clock", values)
        skew = max(0.0, max(lo for lo, _ in bounds.values()) - min(hi for _, hi in bounds.values()))
        threshold = self.plan.max_clock_skew_s
        if skew > threshold:
            middle = statistics.median((lo + hi) / 2 for lo, hi in bounds.values())
            off = [h for h, (lo, hi) in bounds.items() if max(lo - middle, middle - hi) > threshold / 2]
            if not off:
                off = [max(bounds, key=lambda h: bounds[h][0]), min(bounds, key=lambda h: bounds[h][1])]
            row.severity, row.hosts = "blocking", [h for h in self.order if h in off]
            row.finding = (
                f"clocks differ by at least {skew:.2f} s (nodes.max_clock_skew_s={threshold}); off: {_hosts(row.hosts)}"
            )
            row.remediation = (
                f"synchronise the clocks with NTP (chrony) on {_hosts(row.hosts)}; check `chronyc tracking`"
            )
        self.add(row)

    def security_rows(self) -> None:
        security = {h: self.run.results[h].get("security") or {} for h in self.reached}
        values, enabled, unknown = {}, [], []
        for host, sec in security.items():
            methods = sec.get("methods") or []
            if sec.get("connection") not in ("ssh", "smart", "paramiko"):
                values[host] = f"not applicable ({sec.get('connection')} connection)"
            elif sec.get("probe_rc") is None:
                values[host] = "not checked"
            elif sec.get("probe_rc") == 0:
                values[host] = "login without key or password accepted"
                enabled.append(host)
            elif not methods:
                values[host] = f"could not ask: {sec.get('probe_error') or 'no answer'}"
                unknown.append(host)
            elif {"password", "keyboard-interactive"} & set(methods):
                values[host] = f"enabled ({', '.join(methods)})"
                enabled.append(host)
            else:
                values[host] = f"disabled ({', '.join(methods)})"
        row = Row("SSH password login", values)
        if enabled:
            row.severity, row.hosts = "blocking", enabled
            row.finding = f"password login is enabled on {_hosts(enabled)}"
            row.remediation = (
                f"set `PasswordAuthentication no` and `KbdInteractiveAuthentication no` in /etc/ssh/sshd_config on "
                f"{_hosts(enabled)}, then reload sshd"
            )
        elif unknown:
            row.severity, row.hosts = "warning", unknown
            row.finding = f"could not ask sshd on {_hosts(unknown)} which login methods it offers"
            row.remediation = "check that the controller reaches their sshd with the same options as Ansible"
        self.add(row)
        keys = {
            h: "ok (BatchMode, no password)" if s.get("key_auth") else f"not applicable ({s.get('connection')})"
            for h, s in security.items()
        }
        self.add(Row("SSH key login", keys))


def _short_version(text: str) -> str:
    match = re.search(r"\d+(?:\.\d+)+", text or "")
    return match.group(0) if match else (text or "unknown")


def _torch_build_name(cuda: str) -> str:
    return "the CPU-only wheel" if cuda == "cpu-only" else f"the +cu{cuda.replace('.', '')} wheel for CUDA {cuda}"


def _cuda_build_severity(reference: str, other: str) -> Severity:
    if "cpu-only" in (reference, other):
        return "blocking"
    return version_severity(1)(reference, other)


def ssh_reason(message: str) -> str:
    """The ssh client's own words from Ansible's unreachable message."""
    reason = message.split("reached over ssh:", 1)[-1].strip()
    return re.sub(r"^(Task failed: )?(ssh: )?", "", reason)


# What ssh said, in the order they are tested, and what to do about it. Only a timeout or a dropped
# connection may pass by itself; a refused port, a missing route or an unknown name stays until someone acts.
_CAUSES = [
    ("auth", ("permission denied",)),
    ("host key", ("host key verification failed", "identification has changed")),
    (
        "name",
        (
            "could not resolve",
            "name or service not known",
            "temporary failure in name resolution",
            "nodename nor servname",
            "no address associated with hostname",
        ),
    ),
    ("no route", ("no route to host", "network is unreachable")),
    ("refused", ("connection refused",)),
    ("reset", ("connection reset", "connection closed", "broken pipe", "kex_exchange_identification")),
]
TRANSIENT_CAUSES = {"timeout", "reset"}
UNREACHABLE_FIXES = {
    "auth": "authorise the controller's key (nodes.ssh_key_path) for nodes.ssh_user on {hosts} "
    "(~/.ssh/authorized_keys); passwords are never used",
    "host key": "add the verified host keys of {hosts} to nodes.known_hosts_path "
    "(`ssh-keyscan -p PORT HOST`, compared against the node's own keys)",
    "name": "fix the address of {hosts} in nodes.hosts, or DNS on the controller",
    "no route": "no network route from the controller to {hosts}: check their address in nodes.hosts, "
    "that they are up, and the routes and firewalls in between",
    "refused": "start sshd on {hosts} (or fix their port in nodes.hosts)",
    "reset": "{hosts} dropped the SSH connection: check that sshd there is not restarting or overloaded "
    "(MaxStartups, load)",
    "timeout": "{hosts} did not answer within nodes.connect_timeout_s: check that they are up and not hung "
    "(load, memory, a stuck sshd) and that their SSH port is open to the controller",
}


def _unreachable_cause(message: str) -> str:
    text = message.lower()
    return next((cause for cause, needles in _CAUSES if any(n in text for n in needles)), "timeout")


def build_report(run: PlaybookRun, plan: CheckPlan) -> NodeReport:
    """The consistency report of one playbook run."""
    rows = _Builder(run, plan).build()
    return NodeReport(hosts=run.hosts, rows=rows, elapsed_s=run.elapsed_s, run_status=run.status, log=run.stdout)
