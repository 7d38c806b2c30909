"""Real test nodes on this machine: one key-only sshd per node, each with its own view of a few files.

Every node runs `/usr/sbin/sshd -D` under `unshare --mount --uts` so that it has its own host name,
its own /etc/hosts and its own folder bound over a shared path (`view`): the same path holds a
different job Python or no scratch folder on different nodes. The network is either

- `loopback`: sshd listens on 127.0.0.2, 127.0.0.3, ... (one port for all), or
- `netns`: every node lives in its own network namespace on a bridge (10.x.y.2, 10.x.y.3, ... port 22),
  so one node can firewall a port with its own iptables rules.

Only the processes started here are stopped, by process group (tests/processes, which also stops them at the
end of the test session), plus what is left inside the namespaces created here.
Needs root, openssh-server, iproute2 and util-linux (iptables for `block_port`).
"""

from __future__ import annotations

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

SSHD = "/usr/sbin/sshd"
REPO = Path(__file__).resolve().parents[3]
_CLUSTERS = itertools.count()


def missing_prerequisites(network: str = "loopback") -> list[str]:
    """What this machine lacks to start test nodes (empty when all is there)."""
    missing = [] if os.geteuid() == 0 else ["root (for mount and network namespaces)"]
    tools = [SSHD, "ssh", "ssh-keygen", "unshare", "mount"] + (["ip", "iptables"] if network == "netns" else [])
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

    def freeze(self) -> None:
        """Stop sshd with SIGSTOP: connections are accepted by the kernel but never answered."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def stop(self) -> None:
        """Stop sshd's process group (SIGCONT first, in case it was frozen) and wait for it."""
        stop_group(self.process)

    def block_port(self, port: int) -> None:
        """Drop TCP packets to `port` arriving from other machines (this node's own firewall; netns only)."""
        assert self.netns is not None, "block_port needs network='netns'"
        subprocess.run(
            ["ip", "netns", "exec", self.netns, "iptables", "-A", "INPUT", "-p", "tcp", "--dport", str(port)]
            + ["!", "-i", "lo", "-j", "DROP"],
            check=True,
        )


@dataclass
class SshdCluster:
    """Key-only sshd test nodes, the client key and known_hosts to reach them, and the shared paths."""

    workdir: Path
    network: Literal["loopback", "netns"]
    hosts: list[SshdHost] = field(default_factory=list)
    bridge: str | None = None

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

    def close(self) -> None:
        """Stop every sshd started here, kill what is left inside our namespaces, remove the namespaces."""
        for host in self.hosts:
            host.stop()
        for host in self.hosts:
            if host.netns is None:
                continue
            pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True)


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


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
    tag = f"{os.getpid() % 100000}{next(_CLUSTERS) % 10}"
    if network == "netns":
        subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        cluster.bridge = f"tdb{tag}"
        _run("ip", "link", "add", cluster.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", cluster.bridge)
        _run("ip", "link", "set", cluster.bridge, "up")
        addresses = [f"{subnet}.{i + 2}" for i in range(len(specs))]
        port = 22
    else:
        addresses = [f"127.0.0.{i + 2}" for i in range(len(specs))]
        port = _free_port("127.0.0.2")
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
                prefix = ["ip", "netns", "exec", netns]
            script = (
                'hostname "$0" && mount --bind "$1" /etc/hosts && mount --bind "$2" "$3" && exec "$4" -D -e -f "$5"'
            )
            argv = prefix + ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script]
            argv += [spec.name, str(folder / "hosts"), str(folder / "view"), str(cluster.view), SSHD, str(config)]
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
