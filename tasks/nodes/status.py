"""The checks that judge each host on its own: reachability, GPU health, storage, names, rendezvous, clock, SSH."""

from __future__ import annotations

import statistics

from tasks.nodes.drift import gpus_in_play
from tasks.nodes.facts import Mount, NetworkFacts, SecurityFacts
from tasks.nodes.report import ABSENT, NO_RESULT, Finding, Observed, Row, flag, host_list
from tasks.nodes.unreachable import UNREACHABLE_FIXES, is_transient, ssh_reason, unreachable_cause

SSH_CONNECTIONS = ("ssh", "smart", "paramiko")


def reachability(seen: Observed) -> Row:
    """Every host answered and every role finished on it."""
    run, values = seen.run, {}
    unreachable, failed, missing = [], [], []
    for host in seen.order:
        report = seen.reports.get(host)
        if host in run.unreachable:
            values[host] = f"unreachable: {ssh_reason(run.unreachable[host])}"
            unreachable.append(host)
        elif host in run.failed:
            values[host] = f"check failed: {run.failed[host]}"
            failed.append(host)
        elif report is None or not report.complete:
            values[host] = f"no result (check run {run.status})"
            missing.append(host)
        else:
            values[host] = "ok"
    row = Row("reachable", values)
    if not (unreachable or failed or missing):
        return row
    parts, fixes = [], []
    if unreachable:
        parts.append(f"unreachable: {host_list(unreachable)}")
        by_cause: dict[str, list[str]] = {}
        for host in unreachable:
            by_cause.setdefault(unreachable_cause(run.unreachable[host]), []).append(host)
        fixes += [UNREACHABLE_FIXES[cause].format(hosts=host_list(hosts)) for cause, hosts in by_cause.items()]
    if failed:
        parts.append(f"a check failed on {host_list(failed)}")
        fixes.append(f"read the failed task's message for {host_list(failed)} and the check log beside the report")
    if missing:
        parts.append(f"no result from {host_list(missing)}")
        fixes.append("the run ended early (nodes.run_timeout_s); raise it or nodes.forks, then run again")
    named = {*unreachable, *failed, *missing}
    flag(row, Finding("blocking", [h for h in seen.order if h in named], "; ".join(parts), "; ".join(fixes)))
    row.transient = not failed and all(is_transient(run.unreachable[h]) for h in unreachable)
    return row


def node_count(seen: Observed) -> list[Row]:
    """A warning when fewer nodes were checked than the job runs on."""
    need = seen.plan.min_hosts
    if need is None or len(seen.order) >= need:
        return []
    finding = Finding(
        "warning",
        list(seen.order),
        f"{len(seen.order)} node(s) checked, the job needs cluster.nodes={need}",
        "list every node the job may run on under nodes.hosts (or in the inventory)",
    )
    return [flag(Row("node count", dict.fromkeys(seen.order, "checked")), finding)]


def gpu_health(seen: Observed) -> list[Row]:
    """GPUs nvidia-smi could not read or with uncorrected ECC errors block; disabled ECC warns."""
    if not gpus_in_play(seen):
        return []
    values, broken, ecc_off = {}, [], []
    for host, facts in seen.facts.items():
        gpus, error = facts.system.gpus, facts.system.gpu_error
        bad = [g for g in gpus if (g.ecc_uncorrected_errors or 0) > 0]
        if error:
            values[host] = str(error)
            broken.append(host)
        elif bad:
            values[host] = "uncorrected ECC errors on GPU " + ", ".join(str(g.index) for g in bad)
            broken.append(host)
        elif any(g.ecc_mode == "Disabled" for g in gpus):
            values[host] = "ok, ECC disabled"
            ecc_off.append(host)
        else:
            values[host] = "ok" if gpus else ABSENT
    row = Row("GPU health", values)
    if broken:
        return [
            flag(
                row,
                Finding(
                    "blocking",
                    broken,
                    f"unhealthy GPUs on {host_list(broken)}",
                    f"drain {host_list(broken)}; reset the GPUs (nvidia-smi -r) or have them replaced",
                ),
            )
        ]
    if ecc_off:
        return [
            flag(
                row,
                Finding(
                    "warning",
                    ecc_off,
                    f"ECC is disabled on {host_list(ecc_off)}",
                    f"enable ECC (nvidia-smi -e 1, then reboot) on {host_list(ecc_off)}",
                ),
            )
        ]
    return [row]


def storage(seen: Observed) -> list[Row]:
    """One row per storage path: it exists, takes a write and has the free space asked for, on every host."""
    mounts: dict[str, dict[str, Mount]] = {h: {m.path: m for m in seen.reports[h].storage or []} for h in seen.reached}
    rows = []
    for path in dict.fromkeys(p for by_path in mounts.values() for p in by_path):
        values, bad = {}, []
        for host in seen.reached:
            mount = mounts[host].get(path)
            if mount is None:
                values[host] = NO_RESULT
            elif mount.error:
                values[host] = mount.error
                bad.append(host)
            else:
                values[host] = f"ok, {(mount.free_bytes or 0) / 1e9:.1f} GB free"
        row = Row(f"storage {path}", values)
        if bad:
            need = mounts[bad[0]][path].min_free_gb
            problems = "; ".join(sorted({values[h] for h in bad}))
            fix = f"mount the shared storage at {path} on {host_list(bad)}, writable by the job user"
            fix += f", with at least {need:g} GB free" if need else ""
            flag(row, Finding("blocking", bad, f"{path} is not usable on {host_list(bad)}: {problems}", fix))
        rows.append(row)
    return rows


def _networks(seen: Observed) -> dict[str, NetworkFacts]:
    return {h: net for h in seen.reached if (net := seen.reports[h].network) is not None}


def name_resolution(seen: Observed) -> list[Row]:
    """Every node resolves the others, and to the same addresses."""
    values, bad, answers = {}, [], {}
    for host, net in _networks(seen).items():
        failed = sorted(net.resolve_errors)
        for name, addresses in net.resolved.items():
            if addresses:
                answers.setdefault(name, {})[host] = ", ".join(addresses)
        values[host] = f"cannot resolve {', '.join(failed)}" if failed else f"ok ({len(net.resolved)} names)"
        if failed:
            bad.append(host)
    row = Row("name resolution", values)
    if bad:
        finding = "; ".join(f"{h} {values[h]}" for h in bad[:10])
        return [
            flag(
                row, Finding("blocking", bad, finding, f"add the other nodes to DNS or /etc/hosts on {host_list(bad)}")
            )
        ]
    split = {name: by_host for name, by_host in answers.items() if len(set(by_host.values())) > 1}
    if split:
        name, by_host = next(iter(split.items()))
        example = "; ".join(
            f"{a} on {host_list([h for h in by_host if by_host[h] == a])}" for a in sorted(set(by_host.values()))
        )
        finding = Finding(
            "warning",
            sorted({h for b in split.values() for h in b}),
            f"{len(split)} name(s) resolve differently on different nodes, e.g. {name}: {example}",
            "make DNS or /etc/hosts agree on every node",
        )
        flag(row, finding)
    return [row]


def rendezvous(seen: Observed) -> list[Row]:
    """The first node can listen on the rendezvous port and every other node can connect to it."""
    port = seen.plan.rdzv_port
    if port is None:
        return []
    network = _networks(seen)
    server = next((n.rdzv_host for n in network.values() if n.rdzv_host), seen.order[0])
    target = next((n.rdzv_target for n in network.values() if n.rdzv_target), server)
    values: dict[str, str] = {h: "unreachable" for h in seen.order if h not in network and h != server}
    row = Row(f"rendezvous port {port}", values)
    if server not in network:
        values.update({h: "not checked (rendezvous host unreachable)" for h in network})
        values[server] = "unreachable"
        finding = Finding(
            "blocking",
            [server],
            f"the rendezvous host {server} is unreachable, so the port was not checked",
            f"make {server} reachable (see `reachable`), or list another node first",
        )
        flag(row, finding).transient = is_transient(seen.run.unreachable.get(server, ""))
        return [row]
    net = network[server]
    if net.rdzv_error or not net.listener.listening:
        why = net.rdzv_error or net.listener.error or "listener did not start"
        values[server] = why
        finding = Finding(
            "blocking",
            [server],
            f"no listener could be started on {server}:{port}: {why}",
            f"port {port} is taken on {server}: stop what holds it (`ss -ltnp 'sport = :{port}'`, often a "
            f"leftover torchrun) or choose another nodes.rdzv_port",
        )
        return [flag(row, finding)]
    values[server] = f"listening ({len(net.listener_stop.peers)} peers connected)"
    closed, reasons = [], set()
    for host, peer in network.items():
        if host == server:
            continue
        if peer.connect.connected:
            values[host] = f"connected in {peer.connect.seconds} s"
        else:
            values[host] = peer.connect.error or peer.rdzv_error or "not checked"
            closed.append(host)
            reasons.add(values[host])
    if closed:
        if any("resolve" in r for r in reasons):
            fix = f"make {target} resolvable on {host_list(closed)} (DNS or /etc/hosts)"
        else:
            fix = (
                f"open TCP port {port} on {server} to the other nodes (firewall / security group), e.g. "
                f"`iptables -I INPUT -p tcp --dport {port} -j ACCEPT` or `firewall-cmd --add-port={port}/tcp`"
            )
        finding = f"{host_list(closed)} cannot reach the rendezvous {target}:{port}: " + "; ".join(sorted(reasons))
        flag(row, Finding("blocking", closed, finding, fix))
    return [row]


def interface(seen: Observed) -> list[Row]:
    """Every node has the interface the job's traffic uses (cluster.network.interface), when one is set."""
    wanted = seen.plan.interface
    if wanted is None:
        return []
    values, missing, unknown = {}, [], []
    for host, net in _networks(seen).items():
        if net.interfaces is None:
            values[host] = f"could not list the interfaces: {net.interface_error or 'not checked'}"
            unknown.append(host)
        elif wanted in net.interfaces:
            values[host] = "ok"
        else:
            values[host] = f"missing (has {', '.join(net.interfaces) or 'none'})"
            missing.append(host)
    row = Row(f"network interface {wanted}", values)
    if missing:
        finding = f"{host_list(missing)} ha{'s' if len(missing) == 1 else 've'} no interface {wanted}: " + "; ".join(
            f"{h} {values[h]}" for h in missing[:10]
        )
        fix = (
            f"bring up {wanted} on {host_list(missing)}, or set cluster.network.interface to the interface every "
            "node has (`ip -br link` lists them)"
        )
        return [flag(row, Finding("blocking", missing, finding, fix))]
    if unknown:
        finding = f"could not list the network interfaces of {host_list(unknown)}, so {wanted} was not checked"
        fix = f"check that the Python Ansible runs on {host_list(unknown)} can list them (socket.if_nameindex)"
        return [flag(row, Finding("warning", unknown, finding, fix))]
    return [row]


def clock(seen: Observed) -> list[Row]:
    """Clock skew between the nodes, bounded by when the controller saw each reading taken."""
    bounds: dict[str, tuple[float, float]] = {}
    for host, facts in seen.facts.items():
        reading, window = facts.clock_epoch_s, seen.run.clock_windows.get(host)
        if reading is not None and window is not None:
            bounds[host] = (reading - window[1], reading - window[0])
    if not bounds:
        return []
    values = {h: f"{(lo + hi) / 2:+.2f} s ±{(hi - lo) / 2:.2f} vs controller" for h, (lo, hi) in bounds.items()}
    row = Row("clock", values)
    skew = max(0.0, max(lo for lo, _ in bounds.values()) - min(hi for _, hi in bounds.values()))
    threshold = seen.plan.max_clock_skew_s
    if skew > threshold:
        middle = statistics.median((lo + hi) / 2 for lo, hi in bounds.values())
        off = [h for h, (lo, hi) in bounds.items() if max(lo - middle, middle - hi) > threshold / 2]
        if not off:
            off = [max(bounds, key=lambda h: bounds[h][0]), min(bounds, key=lambda h: bounds[h][1])]
        hosts = [h for h in seen.order if h in off]
        finding = Finding(
            "blocking",
            hosts,
            f"clocks differ by at least {skew:.2f} s (nodes.max_clock_skew_s={threshold}); off: {host_list(hosts)}",
            f"synchronise the clocks with NTP (chrony) on {host_list(hosts)}; check `chronyc tracking`",
        )
        flag(row, finding)
    return [row]


def _password_login(sec: SecurityFacts) -> tuple[str, str | None]:
    """What one host's sshd says about password login, and whether that is `enabled` or `unknown`."""
    methods = sec.methods
    if sec.connection not in SSH_CONNECTIONS:
        return f"not applicable ({sec.connection} connection)", None
    if sec.probe_rc is None:
        return "not checked", None
    if sec.probe_rc == 0:
        return "login without key or password accepted", "enabled"
    if not methods:
        return f"could not ask: {sec.probe_error or 'no answer'}", "unknown"
    if {"password", "keyboard-interactive"} & set(methods):
        return f"enabled ({', '.join(methods)})", "enabled"
    return f"disabled ({', '.join(methods)})", None


def ssh_login(seen: Observed) -> list[Row]:
    """Password login must be off on every node; key login is how Ansible got in."""
    security = {h: seen.reports[h].security or SecurityFacts() for h in seen.reached}
    values, enabled, unknown = {}, [], []
    for host, sec in security.items():
        values[host], verdict = _password_login(sec)
        if verdict == "enabled":
            enabled.append(host)
        elif verdict == "unknown":
            unknown.append(host)
    row = Row("SSH password login", values)
    if enabled:
        flag(
            row,
            Finding(
                "blocking",
                enabled,
                f"password login is enabled on {host_list(enabled)}",
                f"set `PasswordAuthentication no` and `KbdInteractiveAuthentication no` in /etc/ssh/sshd_config on "
                f"{host_list(enabled)}, then reload sshd",
            ),
        )
    elif unknown:
        flag(
            row,
            Finding(
                "warning",
                unknown,
                f"could not ask sshd on {host_list(unknown)} which login methods it offers",
                "check that the controller reaches their sshd with the same options as Ansible",
            ),
        )
    keys = {
        h: "ok (BatchMode, no password)" if s.key_auth else f"not applicable ({s.connection})"
        for h, s in security.items()
    }
    return [row, Row("SSH key login", keys)]
