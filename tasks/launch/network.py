"""The job's environment and network: which variables a spec may set (`cluster.env`) and `cluster.network`."""

from __future__ import annotations

import os
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from tasks.launch.config import matching
from training.config import Problem, StrictModel
from training.network import COLLECTIVE_TIMEOUT_ENV
from training.untrusted import escape_untrusted

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Variables that decide how the job script's shell, the dynamic loader, Python, Slurm or torchrun start the
# job. The spec may be written by anyone allowed to start a deployment, so these stay with the operator.
RESERVED_ENV = frozenset(
    {"PATH", "IFS", "ENV", "BASH_ENV", "SHELLOPTS", "BASHOPTS", "CDPATH", "PS4", "PROMPT_COMMAND", "HOME"}
    | {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONINSPECT", "PYTHONEXECUTABLE"}
)
RESERVED_ENV_PREFIXES = ("LD_", "SLURM_", "SBATCH_", "SRUN_", "PET_", "TDEPLOY_")
# What a spec may set in cluster.env: tuning variables of NCCL, gloo, torch.distributed, OpenMP and the CUDA
# runtime. An allow-list, because libraries keep adding variables that load code (NCCL_NET_PLUGIN,
# CUDA_INJECTION64_PATH, GCONV_PATH, TRITON_CACHE_DIR, ...), which a deny-list only learns of too late.
ALLOWED_ENV = frozenset(
    {"GLOO_SOCKET_IFNAME", "GLOO_DEVICE_TRANSPORT", "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL"}
    | {"TORCH_SHOW_CPP_STACKTRACES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM"}
    | {"CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF"}
    | {"NVIDIA_TF32_OVERRIDE"}
)
ALLOWED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")
# Words of a variable name that point a library at a file, folder or shared object to read or load: never
# allowed through a prefix (NCCL_NET_PLUGIN, NCCL_TOPO_FILE, TORCH_NCCL_DEBUG_INFO_TEMP_FILE, ...).
LOADING_WORDS = frozenset({"PLUGIN", "PATH", "DIR", "FILE", "LIB", "LIBRARY", "LIBRARIES", "SO", "MODULE"})
ALLOWED_ENV_VAR = "TDEPLOY_ALLOWED_ENV"
"""The operator's extension of the allow-list: comma-separated names or PREFIX_* (read from tdeploy's environment)."""
_OPERATOR_ENTRY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")


def _loads_code(name: str) -> bool:
    return any(word in LOADING_WORDS for word in name.split("_"))


def operator_allowed_env() -> tuple[frozenset[str], tuple[str, ...]]:
    """The names and prefixes the operator adds in TDEPLOY_ALLOWED_ENV; ValueError for an entry that is neither."""
    entries = [e.strip() for e in os.environ.get(ALLOWED_ENV_VAR, "").split(",") if e.strip()]
    bad = [e for e in entries if not _OPERATOR_ENTRY.fullmatch(e)]
    if bad:
        raise ValueError(
            f"{ALLOWED_ENV_VAR}={os.environ[ALLOWED_ENV_VAR]!r} (the operator's environment): {bad} are not variable "
            "names or PREFIX_*; write comma-separated names, e.g. UCX_TLS,FI_PROVIDER or UCX_*"
        )
    return frozenset(e for e in entries if not e.endswith("*")), tuple(e[:-1] for e in entries if e.endswith("*"))


def env_allowed(name: str, names: frozenset[str], prefixes: tuple[str, ...]) -> bool:
    """Whether a spec may set `name`: listed by name (ours or the operator's), or under an allowed prefix without a
    word that makes a library load something."""
    if name in ALLOWED_ENV or name in names:
        return True
    return name.startswith(ALLOWED_ENV_PREFIXES + prefixes) and not _loads_code(name)


def env_problems(env: dict[str, str], field: str = "env") -> list[Problem]:
    """What is wrong with the names (and NULs in the values) of a job environment; values are never echoed."""
    problems: list[Problem] = []
    try:
        names, prefixes = operator_allowed_env()
    except ValueError as err:
        return [((field,), "{...}", str(err))] if env else []
    for name, value in env.items():
        if not ENV_NAME.fullmatch(name):
            problems.append(
                (
                    (field,),
                    name,
                    f"'{escape_untrusted(name, 64)}' is not an environment variable name; use letters, digits and _, "
                    "not starting with a digit (e.g. NCCL_DEBUG)",
                )
            )
        elif name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES):
            problems.append(
                (
                    (field,),
                    name,
                    "is reserved: it changes how the shell, the dynamic loader, Python, Slurm or torchrun start "
                    "the job (PATH, IFS, BASH_ENV, LD_*, PYTHONPATH, SLURM_*, PET_*, ...); the operator sets such "
                    "variables on the nodes or in the base image",
                )
            )
        elif not env_allowed(name, names, prefixes):
            problems.append(
                (
                    (field,),
                    name,
                    "is not on the allow-list of variables a spec may set (NCCL_* and TORCH_NCCL_* without "
                    "PLUGIN, PATH, DIR, FILE, LIB, SO or MODULE in the name; GLOO_SOCKET_IFNAME, "
                    "TORCH_DISTRIBUTED_DEBUG, OMP_NUM_THREADS, PYTORCH_CUDA_ALLOC_CONF and the others the README's "
                    "Security section lists), as it may make a library load code; if it is safe on your nodes, "
                    f"the operator allows it by adding it to {ALLOWED_ENV_VAR} in tdeploy's environment "
                    f"(comma-separated, e.g. {ALLOWED_ENV_VAR}={escape_untrusted(name, 64)}), or sets it on the "
                    "nodes or in the image",
                )
            )
        elif "\0" in value:
            problems.append(((field, name), "<value with NUL>", "contains a NUL character, which no variable can hold"))
    return problems


_IFNAME = r"[A-Za-z0-9_.:-]{1,15}"
# NCCL_SOCKET_IFNAME: interface names or prefixes, comma-separated; ^ excludes them, = asks for exact names.
_NCCL_IFNAMES = re.compile(rf"[\^=]?{_IFNAME}(,{_IFNAME})*")
_GLOO_IFNAMES = re.compile(rf"{_IFNAME}(,{_IFNAME})*")
# NCCL_IB_HCA: HCA names with an optional :port, comma-separated; ^ excludes them, = asks for exact names.
_HCA = r"[A-Za-z0-9_.-]{1,64}(:[0-9]{1,3})?"
_NCCL_IB_HCA = re.compile(rf"[\^=]?{_HCA}(,{_HCA})*")


def _network_value(pattern: re.Pattern[str], what: str) -> AfterValidator:
    """A network setting: matches `pattern` in full and has at most 255 characters."""
    return matching(pattern, what, max_length=255)


InterfaceName = Annotated[
    str,
    _network_value(
        re.compile(_IFNAME), "a network interface name; use 1 to 15 letters, digits and _ . : - (e.g. eth0, ib0)"
    ),
]
NcclInterfaces = Annotated[
    str,
    _network_value(
        _NCCL_IFNAMES,
        "an NCCL_SOCKET_IFNAME list; use interface names (1 to 15 letters, digits and _ . : -) separated by commas, "
        "optionally after ^ (exclude) or = (exact), e.g. eth0, ib0,ib1 or ^docker,lo",
    ),
]
GlooInterfaces = Annotated[
    str,
    _network_value(
        _GLOO_IFNAMES,
        "a GLOO_SOCKET_IFNAME list; use interface names (1 to 15 letters, digits and _ . : -) separated by commas, "
        "e.g. eth0 or eth0,eth1",
    ),
]
NcclHcas = Annotated[
    str,
    _network_value(
        _NCCL_IB_HCA,
        "an NCCL_IB_HCA list; use HCA names (letters, digits and _ . -) with an optional :port, separated by "
        "commas, optionally after ^ (exclude) or = (exact), e.g. mlx5_0:1,mlx5_1:1",
    ),
]


class NcclConfig(StrictModel):
    """NCCL's network settings (GPU jobs); each one set becomes its NCCL_* variable, None leaves NCCL's default."""

    socket_ifname: NcclInterfaces | None = Field(
        default=None,
        description="NCCL_SOCKET_IFNAME: the interfaces NCCL's sockets use (bootstrap, and traffic without "
        "InfiniBand); None = network.interface when set.",
    )
    ib_disable: bool | None = Field(
        default=None, description="NCCL_IB_DISABLE: true = no InfiniBand/RoCE, sockets instead; None = NCCL's default."
    )
    ib_hca: NcclHcas | None = Field(default=None, description="NCCL_IB_HCA: the InfiniBand HCAs (and ports) to use.")
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = Field(
        default=None, description="NCCL_DEBUG: how much NCCL logs (INFO shows the interfaces and transports chosen)."
    )
    proto: list[Literal["LL", "LL128", "Simple"]] | None = Field(
        default=None, min_length=1, description="NCCL_PROTO: the protocols NCCL may use; None = all it supports."
    )

    @field_validator("ib_disable", mode="before")
    @classmethod
    def _true_or_false(cls, value: object) -> object:
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{value!r} is not true or false; write true (sockets only) or false (use InfiniBand)")
        return value


class GlooConfig(StrictModel):
    """gloo's network settings (CPU jobs)."""

    socket_ifname: GlooInterfaces | None = Field(
        default=None, description="GLOO_SOCKET_IFNAME: the interfaces gloo uses; None = network.interface when set."
    )


class NetworkConfig(StrictModel):
    """The job's network: its interface, rendezvous and collective timeouts, NCCL and gloo settings.

    The rendezvous port stays `cluster.rdzv_port` (`cluster.slurm.rdzv_port` under Slurm). rdzv_timeout_s is a
    torchrun argument; every other field set here reaches the training processes as an environment variable
    (`network_env`). None leaves the default.
    """

    interface: InterfaceName | None = Field(
        default=None,
        description="The network interface the job's traffic uses on every node, e.g. eth0 or ib0: the default of "
        "nccl.socket_ifname and gloo.socket_ifname, and checked on every node by the node checks; None = "
        "whatever NCCL and gloo pick.",
    )
    rdzv_timeout_s: int | None = Field(
        default=None,
        ge=1,
        le=86_400,
        description="Seconds the torchrun agents wait for every node to join the rendezvous (torchrun "
        "--rdzv-conf join_timeout, or timeout for the static rendezvous); None = torchrun's 600.",
    )
    collective_timeout_s: int | None = Field(
        default=None,
        ge=1,
        le=7 * 86_400,
        description="Seconds a collective may wait before the process group gives up (init_process_group "
        "timeout); None = torch's default (10 minutes for NCCL, 30 for gloo).",
    )
    nccl: NcclConfig = Field(default_factory=NcclConfig, description="NCCL settings (GPU jobs).")
    gloo: GlooConfig = Field(default_factory=GlooConfig, description="gloo settings (CPU jobs).")


def network_variables(network: NetworkConfig) -> dict[str, tuple[str, str]]:
    """Each variable the network section sets: name -> (the field it comes from, its value)."""
    nccl, gloo, interface = network.nccl, network.gloo, network.interface
    found: dict[str, tuple[str, str | None]] = {
        "NCCL_SOCKET_IFNAME": ("network.nccl.socket_ifname", nccl.socket_ifname)
        if nccl.socket_ifname is not None
        else ("network.interface", interface),
        "GLOO_SOCKET_IFNAME": ("network.gloo.socket_ifname", gloo.socket_ifname)
        if gloo.socket_ifname is not None
        else ("network.interface", interface),
        "NCCL_IB_DISABLE": ("network.nccl.ib_disable", None if nccl.ib_disable is None else str(int(nccl.ib_disable))),
        "NCCL_IB_HCA": ("network.nccl.ib_hca", nccl.ib_hca),
        "NCCL_DEBUG": ("network.nccl.debug", nccl.debug),
        "NCCL_PROTO": ("network.nccl.proto", ",".join(nccl.proto) if nccl.proto else None),
        COLLECTIVE_TIMEOUT_ENV: (
            "network.collective_timeout_s",
            None if network.collective_timeout_s is None else str(network.collective_timeout_s),
        ),
    }
    return {name: (field, value) for name, (field, value) in found.items() if value is not None}


def network_env(network: NetworkConfig) -> dict[str, str]:
    """The environment variables the network section gives every training process (empty when nothing is set)."""
    return {name: value for name, (_, value) in network_variables(network).items()}


def network_problems(network: NetworkConfig, env: dict[str, str]) -> list[Problem]:
    """Variables that both cluster.env and the network section set: one place has to go."""
    return [
        (
            ("env", name),
            name,
            f"is set by cluster.{field} as well; set it in one place: remove cluster.env.{name} or cluster.{field}",
        )
        for name, (field, _) in network_variables(network).items()
        if name in env
    ]
