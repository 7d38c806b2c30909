"""What a spec may pass to the job's scheduler and environment is an allow-list, checked at the spec boundary.

Issue 39 items 2 and 4: before, `cluster.slurm.extra_args` took any option (`--export=ALL,LD_PRELOAD=/x.so` became an
`#SBATCH` line, and so did `--chdir=` and `--output=/etc/cron.d/x`), and `cluster.env` took any name a deny-list did
not know, among them the ones that make NCCL, CUDA, glibc, Triton or torch load code from a path.
"""

from __future__ import annotations

from typing import Any

import pytest

from tasks.launch.network import ALLOWED_ENV_VAR
from tasks.launch.slurm import SlurmLauncher
from tasks.spec import DeploymentSpec, SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge

BASE = deep_merge(
    TINY_SPEC, {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}}
)


def spec_with(cluster: dict[str, Any]) -> DeploymentSpec:
    """The tiny spec on Slurm with these cluster settings merged in."""
    return parse_spec(deep_merge(BASE, {"cluster": {"scheduler": "slurm", **cluster}}), "allow-lists")


def problems_of(cluster: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        spec_with(cluster)
    return caught.value.problems


HOSTILE_SBATCH = [
    ("--export=ALL,LD_PRELOAD=/x.so", "--export is refused: it sets the job's environment around cluster.env's"),
    ("--export=ALL,BASH_ENV=/tmp/x", "set allowed variables in cluster.env instead"),
    ("--export=PATH=/tmp/evil:/usr/bin", "--export is refused"),
    ("--exp=ALL,LD_PRELOAD=/x.so", "--exp is not among the sbatch options a spec may pass (--exclusive, --constraint"),
    ("--export-file=/tmp/env", "--export-file is refused"),
    ("--get-user-env", "--get-user-env is refused: it loads a user's login environment"),
    ("--chdir=/etc", "--chdir is refused: it moves the job out of the folder tdeploy runs it in; remove it"),
    ("--output=/etc/cron.d/x", "--output is refused: it moves the job's log away from run.output_url/slurm-%j.out"),
    ("--error=/tmp/errors", "--error is refused"),
    ("--uid=0", "--uid is refused: it runs the job as another user; remove it"),
    ("--gid=0", "--gid is refused"),
    ("-D=/etc", "short options are not accepted; write the long form"),
    ("--nodelist=/etc/hosts", "'/etc/hosts' is not a value of --nodelist; write a host list without /"),
    ("--exclusive=everyone", "'everyone' is not a value of --exclusive"),
    ("--partition=gpu", "--partition is set from cluster.slurm.partition; set it there and remove --partition"),
    ("--time=99-00:00:00", "--time is set from cluster.slurm.time_limit"),
    ("--contiguous=yes", "--contiguous takes no value; write --contiguous"),
]


@pytest.mark.parametrize(("option", "expected"), HOSTILE_SBATCH, ids=[o for o, _ in HOSTILE_SBATCH])
def test_an_sbatch_option_off_the_allow_list_is_refused_naming_field_value_and_fix(option: str, expected: str) -> None:
    problems = problems_of({"slurm": {"extra_args": ["--exclusive", option]}})
    assert any(p.startswith(f"cluster.slurm.extra_args.1={option}: ") and expected in p for p in problems), problems


def test_allowed_sbatch_options_in_their_value_forms_reach_the_script_as_directives() -> None:
    options = [
        "--exclusive",
        "--constraint=a100&ib",
        "--gres=gpu:a100:8,nvme:1",
        "--reservation=maint",
        "--nodelist=node[01-04,07],gpu-7",
        "--exclude=node[05-06]",
        "--comment=x;touch&y|z",
        "--tmp=100G",
        "--hint=nomultithread",
        "--switches=1@01:00:00",
    ]
    spec = spec_with({"slurm": {"extra_args": options}})
    script = SlurmLauncher().render(spec.cluster, "/r/run.json", "tiny", "/r", None).splitlines()
    directives = [line for line in script if line.startswith("#SBATCH ")]
    assert all(any(option in line for line in directives) for option in options), directives


CODE_LOADING_ENV = [
    "NCCL_NET_PLUGIN",
    "NCCL_TUNER_PLUGIN",
    "NCCL_PROFILER_PLUGIN",
    "CUDA_INJECTION64_PATH",
    "GCONV_PATH",
    "GLIBC_TUNABLES",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "TORCH_EXTENSIONS_DIR",
    "NCCL_TOPO_FILE",
    "NCCL_DEBUG_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "NCCL_ENV_PLUGIN",
    "JOB_NOTE",
]


@pytest.mark.parametrize("name", CODE_LOADING_ENV)
def test_an_environment_name_off_the_allow_list_is_refused_naming_it_and_how_the_operator_extends_the_list(
    name: str,
) -> None:
    problems = problems_of({"env": {"NCCL_DEBUG": "WARN", name: "/shared/x.so"}})
    (problem,) = [p for p in problems if p.startswith(f"cluster.env={name}: ")]
    assert "is not on the allow-list of variables a spec may set" in problem
    assert f"the operator allows it by adding it to {ALLOWED_ENV_VAR} in tdeploy's environment" in problem
    assert f"{ALLOWED_ENV_VAR}={name}" in problem and "/shared/x.so" not in problem


def test_documented_tuning_variables_stay_allowed() -> None:
    env = {
        "NCCL_DEBUG": "WARN",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_IB_HCA": "mlx5",
        "NCCL_SOCKET_NTHREADS": "4",
        "NCCL_ALGO": "Ring",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "GLOO_SOCKET_IFNAME": "eth0",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "OMP_NUM_THREADS": "4",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }
    assert spec_with({"env": env}).cluster.env == env


def test_the_operator_extends_the_allow_list_by_name_and_prefix_but_never_with_reserved_or_loading_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ALLOWED_ENV_VAR, " UCX_TLS, FI_*,LD_PRELOAD")
    env = {"UCX_TLS": "rc,sm", "FI_PROVIDER": "efa"}
    assert spec_with({"env": env}).cluster.env == env
    problems = problems_of({"env": {**env, "FI_PROVIDER_PATH": "/x", "LD_PRELOAD": "/x.so"}})
    assert any(p.startswith("cluster.env=FI_PROVIDER_PATH: is not on the allow-list") for p in problems), problems
    assert any(p.startswith("cluster.env=LD_PRELOAD: is reserved") for p in problems), problems


def test_a_malformed_operator_list_is_reported_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOWED_ENV_VAR, "UCX_TLS,A B")
    problems = problems_of({"env": {"NCCL_DEBUG": "WARN"}})
    assert any(
        f"{ALLOWED_ENV_VAR}='UCX_TLS,A B' (the operator's environment): ['A B'] are not variable names" in p
        for p in problems
    ), problems
