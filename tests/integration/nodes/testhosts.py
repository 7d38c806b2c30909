"""Real test nodes on this machine: one key-only sshd per node, each with its own view of a few files.

Every node runs `/usr/sbin/sshd -D` under `unshare --mount --uts` so that it has its own host name,
its own /etc/hosts and its own folder bound over a shared path (`view`): the same path holds a
different job Python or no scratch folder on different nodes. The network is either

- `loopback`: sshd listens on 127.0.0.2, 127.0.0.3, ... (one port for all), or
- `netns`: every node lives in its own network namespace on a bridge (10.x.y.2, 10.x.y.3, ... port 22;
  the bridge itself is 10.x.y.1), so one node can firewall a port with its own iptables rules, lose its
  link (`cut_link`) or get a slow one (`delay_link`). Its /sys is its own (/sys/class/net lists its eth0)
  with this machine's cgroup mounts moved onto it, as daemons such as slurmd need them.

Every node's /etc/hosts names every other node (except those its spec lists as `unresolvable`), and every
node sees the cluster's `shared` folder bind-mounted at the same path, the way NFS appears on a real cluster:
job output and checkpoints go there. (A mount namespace starts as a copy of this machine's mounts, so the
folder would be visible anyway; the explicit bind mount makes it a mount point of its own on every node.)
`SshdHost.enter(argv)` runs a command inside a node's namespaces (network, host name, mounts) as its sshd
sees them, for daemons that a real node would run (slurmd). `SshdCluster.start_s3()` starts an
S3-compatible endpoint on the bridge address, reachable from every node.

Only the processes started here are stopped, by process group (tests/processes, which also stops them at the
end of the test session), plus what is left inside the namespaces created here.
Needs root, openssh-server, iproute2 and util-linux (iptables for `block_port`, the kernel's sch_netem for
`delay_link(delay_ms=...)`, the cgroup v1 cpu controller at /sys/fs/cgroup/cpu for `limit_cpu`).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tests.processes import start_group, stop_group
from training.network import listen_port

SSHD = "/usr/sbin/sshd"
CPU_CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
REPO = Path(__file__).resolve().parents[3]
_CLUSTERS = itertools.count()


def missing_prerequisites(network: str = "loopback") -> list[str]:
    """What this machine lacks to start test nodes (empty when all is there)."""
    missing = [] if os.geteuid() == 0 else ["root (for mount and network namespaces)"]
    tools = [SSHD, "ssh", "ssh-keygen", "unshare", "nsenter", "mount"]
    tools += ["ip", "iptables", "tc"] if network == "netns" else []
    missing += [t for t in tools if shutil.which(t) is None]
    return missing


@dataclass
class HostSpec:
    """How one test node differs from the others."""

    name: str
    python: str = str(REPO / ".venv" / "bin" / "python")
    has_scratch: bool = True
    password_auth: bool = False
    unresolvable: tuple[str, ...] = ()


@dataclass
class SshdHost:
    """A running test node."""

    spec: HostSpec
    address: str
    port: int
    folder: Path
    process: subprocess.Popen
    netns: str | None = None
    veth: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log_path(self) -> Path:
        """sshd's log: every connection, login and session (LogLevel VERBOSE)."""
        return self.folder / "sshd.log"

    def freeze(self) -> None:
        """Stop sshd with SIGSTOP: connections are accepted by the kernel but never answered."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def stop(self) -> None:
        """Stop sshd's process group (SIGCONT first, in case it was frozen) and wait for it."""
        stop_group(self.process)

    @property
    def sshd_pid(self) -> int:
        """The PID of sshd, which holds the node's namespaces (`nsenter`, `unshare` and `sh` all exec)."""
        return self.process.pid

    def enter(self, argv: list[str], cwd: str | Path | None = None) -> list[str]:
        """`argv` run inside this node's network, UTS and mount namespaces (needs sshd running), in `cwd`
        (default: this process's working directory; entering a mount namespace would otherwise go to /)."""
        wd = f"--wd={cwd if cwd is not None else os.getcwd()}"
        return ["nsenter", "-t", str(self.sshd_pid), "-n", "-u", "-m", wd, "--", *argv]

    def _in_netns(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        assert self.netns is not None, "link and firewall faults need network='netns'"
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], check=check, capture_output=True, text=True)

    def _drop_rule(self, port: int) -> list[str]:
        return ["INPUT", "-p", "tcp", "--dport", str(port), "!", "-i", "lo", "-j", "DROP"]

    def block_port(self, port: int) -> None:
        """Drop TCP packets to `port` arriving from other machines (this node's own firewall; netns only)."""
        self._in_netns("iptables", "-A", *self._drop_rule(port))

    def unblock_port(self, port: int) -> None:
        """Undo `block_port(port)`."""
        self._in_netns("iptables", "-D", *self._drop_rule(port))

    def cut_link(self) -> None:
        """Take the node's network link down: every other node and the bridge lose it (a pulled cable)."""
        self._in_netns("ip", "link", "set", "eth0", "down")

    def restore_link(self) -> None:
        """Bring the link back up after `cut_link`."""
        self._in_netns("ip", "link", "set", "eth0", "up")

    def delay_link(self, delay_ms: float | None = None, rate_mbit: float | None = None) -> None:
        """Make the node's outgoing traffic slow: `delay_ms` added to every packet (netem), or the bandwidth
        capped at `rate_mbit` (tbf, or netem's rate together with a delay)."""
        if delay_ms is None and rate_mbit is None:
            raise ValueError("delay_link needs delay_ms, rate_mbit or both")
        if delay_ms is None:
            burst_kbit = max(32, int(rate_mbit * 1000 / 250))  # at least one timer tick's worth of bytes
            qdisc = ["tbf", "rate", f"{rate_mbit}mbit", "burst", f"{burst_kbit}kbit", "latency", "1s"]
        else:
            qdisc = ["netem", "delay", f"{delay_ms}ms"] + ([] if rate_mbit is None else ["rate", f"{rate_mbit}mbit"])
        proc = self._in_netns("tc", "qdisc", "replace", "dev", "eth0", "root", *qdisc, check=False)
        if proc.returncode != 0:
            raise LinkFaultUnsupported(qdisc[0], proc.stderr.strip())

    def clear_link(self) -> None:
        """Remove what `delay_link` set (the link's default queue comes back)."""
        self._in_netns("tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    def link_qdisc(self) -> str:
        """What `tc qdisc show dev eth0` says inside the node (to check a fault is in place)."""
        return self._in_netns("tc", "qdisc", "show", "dev", "eth0").stdout

    @property
    def cpu_cgroup(self) -> Path:
        """The cgroup v1 cpu folder `limit_cpu` puts this node's sshd (and so every later session) in."""
        return CPU_CGROUP_ROOT / f"tdeploy-test-{os.getpid()}-{self.name}"

    def limit_cpu(self, share: float) -> None:
        """A CPU quota on the node: its sshd and every process a later SSH session starts get `share` of one CPU
        (cfs quota per 100 ms period): a slowed node. Its wall time slows, not its CPU time per operation."""
        self.cpu_cgroup.mkdir(exist_ok=True)
        (self.cpu_cgroup / "cpu.cfs_period_us").write_text("100000")
        (self.cpu_cgroup / "cpu.cfs_quota_us").write_text(str(max(1000, int(share * 100000))))
        (self.cpu_cgroup / "cgroup.procs").write_text(str(self.sshd_pid))

    def clear_cpu_limit(self) -> None:
        """Undo `limit_cpu`: every process of its cgroup back to the root cgroup, the cgroup removed."""
        if not self.cpu_cgroup.exists():
            return
        for pid in (self.cpu_cgroup / "cgroup.procs").read_text().split():
            try:
                (CPU_CGROUP_ROOT / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # exited meanwhile
        self.cpu_cgroup.rmdir()

    def fill_disk(self, path: str, size_kb: int = 1024) -> None:
        """A full disk on the node: a `size_kb` tmpfs mounted over `path` in its mount namespace, filled up."""
        script = 'mount -t tmpfs -o size="$1"k tmpfs "$2" && { dd if=/dev/zero of="$2/fill" bs=64k 2>/dev/null; true; }'
        subprocess.run(self.enter(["sh", "-c", script, "sh", str(size_kb), path], cwd="/"), check=True)

    def free_disk(self, path: str) -> None:
        """Undo `fill_disk`."""
        subprocess.run(self.enter(["umount", path], cwd="/"), check=False, capture_output=True)


class LinkFaultUnsupported(RuntimeError):
    """The kernel lacks the queueing discipline a link fault needs (e.g. sch_netem for a delay)."""

    def __init__(self, qdisc: str, message: str) -> None:
        super().__init__(f"tc qdisc {qdisc}: {message}; load the kernel's sch_{qdisc} module or use another fault")
        self.qdisc = qdisc


@dataclass
class SshdCluster:
    """Key-only sshd test nodes, the client key and known_hosts to reach them, and the shared paths."""

    workdir: Path
    network: Literal["loopback", "netns"]
    hosts: list[SshdHost] = field(default_factory=list)
    bridge: str | None = None
    bridge_address: str | None = None
    _s3: Any = field(default=None, repr=False)

    @property
    def key_path(self) -> Path:
        return self.workdir / "client_key"

    @property
    def known_hosts_path(self) -> Path:
        return self.workdir / "known_hosts"

    @property
    def view(self) -> Path:
        """The shared path each node sees its own folder at."""
        return self.workdir / "view"

    @property
    def shared(self) -> Path:
        """The folder every node sees at this same path (its own bind mount on every node, like NFS)."""
        return self.workdir / "shared"

    @property
    def job_python(self) -> str:
        return str(self.view / "python")

    @property
    def scratch(self) -> str:
        return str(self.view / "scratch")

    def host(self, name: str) -> SshdHost:
        return next(h for h in self.hosts if h.name == name)

    def nodes_section(self, **overrides: Any) -> dict[str, Any]:
        """The spec's `nodes:` section for these hosts (first host = rendezvous host)."""
        section: dict[str, Any] = {
            "hosts": [{"name": h.name, "address": h.address, "port": h.port} for h in self.hosts],
            "ssh_user": "root",
            "ssh_key_path": str(self.key_path),
            "known_hosts_path": str(self.known_hosts_path),
            "python": self.job_python,
            "ansible_python": sys.executable,
            "storage": [{"path": self.scratch, "min_free_gb": 0.001}],
            "connect_timeout_s": 5,
            "rdzv_connect_timeout_s": 3,
            "run_timeout_s": 240,
        }
        section.update(overrides)
        return section

    def start_s3(self) -> str:
        """Start an S3-compatible endpoint (moto) that every node reaches; its URL. close() stops it."""
        from moto.server import ThreadedMotoServer

        if self._s3 is None:
            self._s3 = ThreadedMotoServer(ip_address=self.bridge_address or "127.0.0.1", port=0, verbose=False)
            self._s3.start()
        host, port = self._s3.get_host_and_port()
        return f"http://{host}:{port}"

    def close(self) -> None:
        """Stop every sshd started here and the S3 endpoint, kill what is left inside our namespaces, remove
        the namespaces, veths and bridge."""
        for host in self.hosts:
            host.stop()
        if self._s3 is not None:
            self._s3.stop()
            self._s3 = None
        netns = [h.netns for h in self.hosts if h.netns is not None]
        remove_network(netns, [h.veth for h in self.hosts if h.veth is not None], self.bridge)


def remove_network(netns: list[str], veths: list[str], bridge: str | None) -> None:
    """Kill what is left inside these network namespaces (created here), delete them, their veths and the bridge."""
    for name in netns:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for veth in veths:
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
    if bridge:
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


# Two pytest workers (or a dev cluster beside a test run) may set up bridges at the same moment: the route
# check and the address assignment happen under one machine-wide lock, or both can pick the same subnet and
# the root namespace then routes one cluster's replies onto the other's bridge.
SUBNET_LOCK = Path("/run/tdeploy-test-subnets.lock")


def _add_bridge(bridge: str) -> str:
    """Create `bridge` with the .1 address of a 10.x.y.0/24 that no interface routes yet; the subnet's prefix."""
    with open(SUBNET_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True, check=True).stdout
        base = os.getpid() + 7 * next(_CLUSTERS)
        for offset in range(250):
            n = base + offset
            subnet = f"10.{200 + n // 250 % 50}.{n % 250}"
            if f"{subnet}.0/24" not in routes:
                break
        else:
            raise RuntimeError("no free 10.x.y.0/24 subnet for a test cluster")
        _run("ip", "link", "add", bridge, "type", "bridge")
        try:
            _run("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
            _run("ip", "link", "set", bridge, "up")
        except subprocess.CalledProcessError:
            remove_network([], [], bridge)
            raise
        return subnet


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True)


def _wait_listening(address: str, port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sshd for {address}:{port} exited: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"sshd for {address}:{port} did not listen within 20 s: {log.read_text()[-2000:]}")


def _sshd_config(folder: Path, spec: HostSpec, listen: str, authorized_keys: Path) -> Path:
    config = folder / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"ListenAddress {listen}",
                f"HostKey {folder / 'host_key'}",
                f"PidFile {folder / 'sshd.pid'}",
                f"AuthorizedKeysFile {authorized_keys}",
                f"PasswordAuthentication {'yes' if spec.password_auth else 'no'}",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "PermitRootLogin prohibit-password",
                # Every login and every session started is logged: tests count what a check costs a node.
                "LogLevel VERBOSE",
                "MaxStartups 200",
                "MaxSessions 50",
                "Subsystem sftp internal-sftp",
                "",
            ]
        )
    )
    return config


def start_cluster(
    workdir: Path, specs: list[HostSpec], network: Literal["loopback", "netns"] = "loopback"
) -> SshdCluster:
    """Start one sshd per spec and return the running cluster; the caller must call close()."""
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = SshdCluster(workdir=workdir, network=network)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tdeploy-test", "-f", str(cluster.key_path))
    authorized_keys = workdir / "authorized_keys"
    shutil.copy(f"{cluster.key_path}.pub", authorized_keys)
    cluster.view.mkdir()
    cluster.shared.mkdir()
    tag = f"{os.getpid() % 100000}{next(_CLUSTERS) % 10}"
    if network == "netns":
        cluster.bridge = f"tdb{tag}"
        subnet = _add_bridge(cluster.bridge)
        cluster.bridge_address = f"{subnet}.1"
        addresses = [f"{subnet}.{i + 2}" for i in range(len(specs))]
        port = 22
    else:
        addresses = [f"127.0.0.{i + 2}" for i in range(len(specs))]
        port = listen_port("127.0.0.2")
    hosts_lines = {spec.name: f"{address} {spec.name}" for spec, address in zip(specs, addresses, strict=True)}
    known_hosts = []
    try:
        for i, (spec, address) in enumerate(zip(specs, addresses, strict=True)):
            folder = workdir / "hosts" / spec.name
            (folder / "view").mkdir(parents=True)
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "host_key"))
            known = address if port == 22 else f"[{address}]:{port}"
            known_hosts.append(f"{known} {(folder / 'host_key.pub').read_text().strip()}")
            wrapper = folder / "view" / "python"
            wrapper.write_text(f'#!/bin/sh\nexec {spec.python} "$@"\n')
            wrapper.chmod(0o755)
            if spec.has_scratch:
                (folder / "view" / "scratch").mkdir()
            names = [line for name, line in hosts_lines.items() if name not in spec.unresolvable]
            (folder / "hosts").write_text("\n".join(["127.0.0.1 localhost", *names, ""]))
            listen = f"0.0.0.0:{port}" if network == "netns" else f"{address}:{port}"
            config = _sshd_config(folder, spec, listen, authorized_keys)
            prefix: list[str] = []
            netns = veth = None
            if network == "netns":
                netns, veth = f"td{tag}-{spec.name}", f"tdv{tag}x{i}"
                _run("ip", "netns", "add", netns)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
                _run("ip", "link", "set", veth, "master", cluster.bridge, "up")
                _run("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
                _run("ip", "-n", netns, "link", "set", "eth0", "up")
                _run("ip", "-n", netns, "link", "set", "lo", "up")
                # nsenter, not `ip netns exec` (which mounts a fresh /sys that hides the cgroup mounts daemons
                # such as slurmd need); the script below mounts the namespace's own sysfs and moves the cgroup
                # mounts onto it. nsenter, unshare and sh all exec: sshd keeps the PID that Popen returns.
                prefix = ["nsenter", f"--net=/run/netns/{netns}", "--"]
            script = 'hostname "$0" && mount --bind "$1" /etc/hosts && mount --bind "$2" "$3" && mount --bind "$6" "$6"'
            if network == "netns":  # /sys/class/net then lists this node's interfaces, as on a real machine
                (folder / "cgroup").mkdir()
                script += ' && mount --rbind /sys/fs/cgroup "$7" && mount -t sysfs sysfs /sys'
                script += ' && mount --move "$7" /sys/fs/cgroup'
            script += ' && exec "$4" -D -e -f "$5"'
            argv = prefix + ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script]
            argv += [spec.name, str(folder / "hosts"), str(folder / "view"), str(cluster.view), SSHD, str(config)]
            argv += [str(cluster.shared), str(folder / "cgroup")]
            log = folder / "sshd.log"
            with log.open("w") as log_file:
                process = start_group(argv, stdout=log_file, stderr=subprocess.STDOUT)
            host = SshdHost(spec, address, port, folder, process, netns, veth)
            cluster.hosts.append(host)
            _wait_listening(address, port, process, log)
        cluster.known_hosts_path.write_text("\n".join(known_hosts) + "\n")
    except BaseException:
        cluster.close()
        raise
    return cluster
