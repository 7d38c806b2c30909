"""cluster.network: validated at the spec, rendered into every launcher's environment and torchrun's arguments,
checked on the nodes, and read back on the training side."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta
from typing import Any

import pytest

from tasks.launch.cluster import ClusterConfig
from tasks.launch.kubernetes import render_manifests, validate_pytorchjob
from tasks.launch.network import ALLOWED_ENV_VAR, NetworkConfig, network_env
from tasks.launch.slurm import SlurmLauncher
from tasks.launch.torchrun import job_env, torchrun_args
from tasks.nodes.check import build_report
from tasks.nodes.config import NodesConfig
from tasks.nodes.inventory import plan_checks
from tasks.nodes.runner import PlaybookRun
from tasks.spec import DeploymentSpec, SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from tests.unit.nodes.conftest import CLOCK, host
from training.network import COLLECTIVE_TIMEOUT_ENV, collective_timeout, network_record

BASE = deep_merge(
    TINY_SPEC, {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}}
)
NETWORK = {
    "interface": "eth0",
    "rdzv_timeout_s": 90,
    "collective_timeout_s": 1800,
    "nccl": {"ib_disable": True, "debug": "INFO", "proto": ["LL", "Simple"], "ib_hca": "mlx5_0:1,mlx5_1:1"},
}
NETWORK_ENV = {
    "NCCL_SOCKET_IFNAME": "eth0",
    "GLOO_SOCKET_IFNAME": "eth0",
    "NCCL_IB_DISABLE": "1",
    "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1",
    "NCCL_DEBUG": "INFO",
    "NCCL_PROTO": "LL,Simple",
    COLLECTIVE_TIMEOUT_ENV: "1800",
}


def spec_with(cluster: dict[str, Any]) -> DeploymentSpec:
    """The tiny spec with these cluster settings merged in."""
    return parse_spec(deep_merge(BASE, {"cluster": cluster}), "network")


GOOD = [
    ({}, {}),
    ({"interface": "ib0"}, {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}),
    (
        {"interface": "eth0", "nccl": {"socket_ifname": "^docker,lo"}, "gloo": {"socket_ifname": "eth0,eth1"}},
        {"NCCL_SOCKET_IFNAME": "^docker,lo", "GLOO_SOCKET_IFNAME": "eth0,eth1"},
    ),
    ({"nccl": {"socket_ifname": "=enp1s0f0.100"}}, {"NCCL_SOCKET_IFNAME": "=enp1s0f0.100"}),
    ({"nccl": {"ib_disable": False, "debug": "VERSION"}}, {"NCCL_IB_DISABLE": "0", "NCCL_DEBUG": "VERSION"}),
    ({"nccl": {"proto": ["LL128"]}}, {"NCCL_PROTO": "LL128"}),
    ({"rdzv_timeout_s": 900}, {}),
    (NETWORK, NETWORK_ENV),
]


@pytest.mark.parametrize(("network", "expected"), GOOD, ids=[json.dumps(n) for n, _ in GOOD])
def test_good_network_sections_render_exactly_their_variables(network: dict, expected: dict) -> None:
    assert network_env(spec_with({"network": network}).cluster.network) == expected


BAD = [
    (
        {"interface": "eth0;id"},
        "cluster.network.interface=eth0;id: 'eth0;id' is not a network interface name; use 1 to 15 letters, "
        "digits and _ . : - (e.g. eth0, ib0)",
    ),
    ({"interface": "$(reboot)"}, "cluster.network.interface=$(reboot): '$(reboot)' is not a network interface name"),
    ({"interface": "a" * 16}, f"cluster.network.interface={'a' * 16}: '{'a' * 16}' is not a network interface name"),
    ({"interface": "eth0\n"}, "is not a network interface name; use 1 to 15 letters"),
    ({"interface": ""}, "cluster.network.interface=: '' is not a network interface name"),
    (
        {"nccl": {"socket_ifname": "eth0 lo"}},
        "cluster.network.nccl.socket_ifname=eth0 lo: 'eth0 lo' is not an NCCL_SOCKET_IFNAME list; use interface "
        "names (1 to 15 letters, digits and _ . : -) separated by commas, optionally after ^ (exclude) or = (exact)",
    ),
    ({"nccl": {"socket_ifname": "^"}}, "cluster.network.nccl.socket_ifname=^: '^' is not an NCCL_SOCKET_IFNAME list"),
    (
        {"nccl": {"ib_hca": "mlx5_0:1;rm -rf /"}},
        "cluster.network.nccl.ib_hca=mlx5_0:1;rm -rf /: 'mlx5_0:1;rm -rf /' is not an NCCL_IB_HCA list; use HCA names",
    ),
    (
        {"nccl": {"debug": "LOUD"}},
        "cluster.network.nccl.debug=LOUD: must be one of 'VERSION', 'WARN', 'INFO' or 'TRACE'",
    ),
    (
        {"nccl": {"proto": ["LL", "FAST"]}},
        "cluster.network.nccl.proto.1=FAST: must be one of 'LL', 'LL128' or 'Simple'",
    ),
    ({"nccl": {"proto": "LL,Simple"}}, "cluster.network.nccl.proto=LL,Simple: Input should be a valid list"),
    ({"nccl": {"proto": []}}, "cluster.network.nccl.proto=[]: List should have at least 1 item"),
    (
        {"nccl": {"ib_disable": "maybe"}},
        "cluster.network.nccl.ib_disable=maybe: 'maybe' is not true or false; write true (sockets only) or false",
    ),
    (
        {"gloo": {"socket_ifname": "^eth0"}},
        "cluster.network.gloo.socket_ifname=^eth0: '^eth0' is not a GLOO_SOCKET_IFNAME list; use interface names",
    ),
    ({"rdzv_timeout_s": 0}, "cluster.network.rdzv_timeout_s=0: must be >= 1"),
    ({"rdzv_timeout_s": 10**9}, "cluster.network.rdzv_timeout_s=1000000000: must be <= 86400"),
    ({"collective_timeout_s": 0}, "cluster.network.collective_timeout_s=0: must be >= 1"),
    ({"rdzv_port": 29400}, "cluster.network.rdzv_port=29400: is not a known field; remove it"),
]


@pytest.mark.parametrize(("network", "expected"), BAD, ids=[e for _, e in BAD])
def test_bad_network_values_are_refused_naming_field_value_and_fix(network: dict, expected: str) -> None:
    with pytest.raises(SpecError) as err:
        spec_with({"network": network})
    assert any(expected in problem for problem in err.value.problems), err.value.problems


CONFLICTS = [
    (
        {"env": {"NCCL_DEBUG": "INFO"}, "network": {"nccl": {"debug": "WARN"}}},
        "cluster.env.NCCL_DEBUG=NCCL_DEBUG: is set by cluster.network.nccl.debug as well; set it in one place: "
        "remove cluster.env.NCCL_DEBUG or cluster.network.nccl.debug",
    ),
    (
        {"env": {"GLOO_SOCKET_IFNAME": "eth1"}, "network": {"interface": "eth0"}},
        "cluster.env.GLOO_SOCKET_IFNAME=GLOO_SOCKET_IFNAME: is set by cluster.network.interface as well",
    ),
    (
        {"env": {"NCCL_SOCKET_IFNAME": "eth1"}, "network": {"interface": "eth0", "nccl": {"socket_ifname": "ib"}}},
        "remove cluster.env.NCCL_SOCKET_IFNAME or cluster.network.nccl.socket_ifname",
    ),
    ({"env": {COLLECTIVE_TIMEOUT_ENV: "5"}}, f"cluster.env={COLLECTIVE_TIMEOUT_ENV}: is reserved"),
]


@pytest.mark.parametrize(("cluster", "expected"), CONFLICTS, ids=[e for _, e in CONFLICTS])
def test_a_variable_set_in_cluster_env_and_the_network_section_is_refused_naming_both(
    cluster: dict, expected: str
) -> None:
    with pytest.raises(SpecError) as err:
        spec_with(cluster)
    assert any(expected in problem for problem in err.value.problems), err.value.problems


def test_without_a_network_section_the_environment_and_torchrun_arguments_are_unchanged() -> None:
    cluster = ClusterConfig(procs_per_node=2, env={"NCCL_DEBUG": "WARN"})
    assert cluster.network == NetworkConfig()
    assert job_env(cluster) == {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", "NCCL_DEBUG": "WARN",
        "TDEPLOY_WORKER_START": "fork",  # a CPU job's workers fork from their agent (training/worker_start.py)
    }  # fmt: skip
    assert not [a for a in torchrun_args(cluster, "127.0.0.1:29500", "job", "/run.json") if "rdzv-conf" in a]


def test_the_local_launchers_environment_and_torchrun_arguments_carry_the_network_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ALLOWED_ENV_VAR, "JOB_NOTE")  # no library's variable: the operator allows it
    cluster = spec_with({"network": NETWORK, "env": {"JOB_NOTE": "x"}}).cluster
    env = job_env(cluster, inherited={"NCCL_DEBUG": "TRACE", "HOME": "/root"})
    assert NETWORK_ENV.items() <= env.items(), "the spec's network wins over what the launcher inherited"
    assert env["JOB_NOTE"] == "x" and env["HOME"] == "/root"
    args = torchrun_args(cluster, "127.0.0.1:29500", "job", "/run.json")
    assert "--rdzv-conf=join_timeout=90" in args
    assert args.index("--rdzv-conf=join_timeout=90") < args.index("-m"), "an agent argument, not the payload's"


def test_the_sbatch_script_exports_the_network_variables_quoted_and_passes_the_rdzv_timeout(tmp_path) -> None:
    network = {**NETWORK, "nccl": {**NETWORK["nccl"], "socket_ifname": "^docker,lo"}}
    cluster = spec_with({"scheduler": "slurm", "nodes": 2, "network": network}).cluster
    script = SlurmLauncher().render(cluster, "/shared/run.json", "tiny", "/shared/out", None)
    assert "export NCCL_SOCKET_IFNAME='^docker,lo'\n" in script
    assert f"export {COLLECTIVE_TIMEOUT_ENV}=1800\n" in script and "export NCCL_PROTO=LL,Simple\n" in script
    assert "--rdzv-conf=join_timeout=90" in script
    # The exports give the values back exactly when bash runs them.
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    shown = subprocess.run(
        ["bash", "-c", exports + "\nenv -0"], capture_output=True, text=True, check=True, env={}
    ).stdout
    env = dict(item.split("=", 1) for item in shown.split("\0") if "=" in item)
    assert {**NETWORK_ENV, "NCCL_SOCKET_IFNAME": "^docker,lo"}.items() <= env.items()


def test_the_pytorchjob_carries_the_network_variables_and_the_static_rendezvous_timeout() -> None:
    spec = spec_with({"scheduler": "kubernetes", "kubernetes": {"api": "pytorchjob"}, "nodes": 2, "network": NETWORK})
    _, job = render_manifests(spec.cluster, spec.training_config(), "tiny", "img:1")
    validate_pytorchjob(job)
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert NETWORK_ENV.items() <= env.items()
    assert "--rdzv-conf=timeout=90" in container["command"], container["command"]
    assert container["command"].index("--rdzv-conf=timeout=90") < container["command"].index("-m", 3)


@pytest.mark.parametrize("scheduler", ["local", "slurm", "kubernetes"])
def test_a_hostile_interface_is_refused_by_the_spec_before_any_launcher_renders(scheduler: str) -> None:
    with pytest.raises(SpecError) as err:
        spec_with({"scheduler": scheduler, "network": {"interface": "eth0'; touch /tmp/pwned; '"}})
    assert any("cluster.network.interface=" in p and "is not a network interface name" in p for p in err.value.problems)


# ---- node checks ------------------------------------------------------------------------------


def _run(interfaces: dict[str, list[str] | None], errors: dict[str, str] | None = None) -> PlaybookRun:
    names = list(interfaces)
    results = {
        n: host(
            n, names, {"network": {"interface": "eth0", "interfaces": ifs, "interface_error": (errors or {}).get(n)}}
        ).model_dump()
        for n, ifs in interfaces.items()
    }
    window = (CLOCK - 0.1, CLOCK + 0.1)
    return PlaybookRun(names, results, {}, {}, dict.fromkeys(names, window), "successful", 0, 1.0)


def _plan(names: list[str], network: dict[str, Any]) -> Any:
    cluster = ClusterConfig(scheduler="slurm", nodes=len(names), procs_per_node=1, network=network)
    return plan_checks(NodesConfig(hosts=[{"name": n} for n in names], python="/opt/venv/bin/python"), cluster)


def test_the_node_check_plan_passes_the_interface_to_the_role_only_when_set() -> None:
    assert _plan(["node-a", "node-b"], {"interface": "ib0"}).extravars["node_network_interface"] == "ib0"
    plan = _plan(["node-a", "node-b"], {})
    assert plan.extravars["node_network_interface"] is None and plan.interface is None


def test_the_rendezvous_port_check_tests_the_port_the_job_uses_on_each_scheduler() -> None:
    hosts = NodesConfig(hosts=[{"name": "node-a"}, {"name": "node-b"}])
    slurm = ClusterConfig(scheduler="slurm", nodes=2, procs_per_node=1, slurm={"rdzv_port": 29611})
    assert plan_checks(hosts, slurm).extravars["node_network_rdzv_port"] == 29611
    ssh = ClusterConfig(scheduler="ssh", nodes=2, procs_per_node=1, rdzv_port=29612)
    assert plan_checks(hosts, ssh).extravars["node_network_rdzv_port"] == 29612
    override = NodesConfig(hosts=[{"name": "node-a"}, {"name": "node-b"}], rdzv_port=29613)
    assert plan_checks(override, slurm).rdzv_port == 29613, "nodes.rdzv_port still wins"


def test_a_node_without_the_interface_blocks_naming_the_host_and_the_interfaces_it_has() -> None:
    names = ["node-a", "node-b", "node-c"]
    report = build_report(
        _run({"node-a": ["eth0", "lo"], "node-b": ["ens5", "lo"], "node-c": ["eth0"]}),
        _plan(names, {"interface": "eth0"}),
    )
    row = report.row("network interface eth0")
    assert row.severity == "blocking" and row.hosts == ["node-b"] and report.blocking_hosts == ["node-b"]
    assert row.values == {"node-a": "ok", "node-b": "missing (has ens5, lo)", "node-c": "ok"}
    assert row.finding == "node-b has no interface eth0: node-b missing (has ens5, lo)"
    assert "bring up eth0 on node-b, or set cluster.network.interface" in (row.remediation or "")


def test_nodes_that_could_not_list_their_interfaces_warn_and_all_present_pass() -> None:
    plan = _plan(["node-a", "node-b"], {"interface": "eth0"})
    report = build_report(_run({"node-a": ["eth0"], "node-b": None}, {"node-b": "No such file"}), plan)
    row = report.row("network interface eth0")
    assert row.severity == "warning" and row.hosts == ["node-b"]
    assert row.values["node-b"] == "could not list the interfaces: No such file"
    assert (
        build_report(_run({"node-a": ["eth0"], "node-b": ["eth0", "lo"]}), plan).row("network interface eth0").severity
        == "ok"
    )


def test_without_an_interface_the_node_report_has_no_interface_row() -> None:
    report = build_report(_run({"node-a": ["lo"], "node-b": ["lo"]}), _plan(["node-a", "node-b"], {}))
    assert not [r for r in report.rows if r.check.startswith("network interface")]


# ---- training side ----------------------------------------------------------------------------


def test_training_reads_the_collective_timeout_and_records_the_distributed_variables(monkeypatch) -> None:
    monkeypatch.delenv(COLLECTIVE_TIMEOUT_ENV, raising=False)
    assert collective_timeout() is None
    assert network_record("gloo")["collective_timeout_from"] == "torch default"
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "1800")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-recorded")
    assert collective_timeout() == timedelta(seconds=1800)
    record = network_record("gloo")
    assert record["collective_timeout_s"] == 1800.0
    assert record["collective_timeout_from"] == "cluster.network.collective_timeout_s"
    assert record["env"]["NCCL_DEBUG"] == "INFO" and record["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
    assert all(k.startswith(("NCCL_", "GLOO_", "TORCH_")) for k in record["env"]), record["env"]


@pytest.mark.parametrize("raw", ["soon", "0", "-5", "nan"])
def test_a_bad_collective_timeout_variable_is_an_error_naming_it(monkeypatch, raw: str) -> None:
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=COLLECTIVE_TIMEOUT_ENV):
        collective_timeout()
