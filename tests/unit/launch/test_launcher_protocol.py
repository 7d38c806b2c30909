"""One Launcher protocol for every scheduler; the job's environment is cluster.env, its JobEnvironment travels apart."""

from __future__ import annotations

import inspect
import json
import shlex

import pytest
from pydantic import ValidationError

from tasks.errors import UserError
from tasks.launch.base import Launcher
from tasks.launch.environment import JobEnvironment
from tasks.launch.kubernetes import KubernetesLauncher, render_manifests, validate_pytorchjob
from tasks.launch.local import LocalLauncher
from tasks.launch.network import ALLOWED_ENV_VAR
from tasks.launch.registry import launcher_for
from tasks.launch.slurm import SlurmLauncher
from tests.faults.bugs import ENV_VAR
from tests.faults.job import injected

LAUNCHERS = [LocalLauncher, SlurmLauncher, KubernetesLauncher]
# What each launcher must write itself; `wait` (and `hopeless`) they share from the protocol.
OWN_METHODS = ["submit", "status", "logs", "cancel"]
SHARED_METHODS = ["wait"]
SPEC_ENV = {"JOB_NOTE": "from the spec $HOME", "NCCL_DEBUG": "WARN"}
FAULTS = injected(pause_after_step=2)


@pytest.fixture(autouse=True)
def operator_allows_job_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """JOB_NOTE is no library's variable, so not on cluster.env's allow-list: the operator allows it here."""
    monkeypatch.setenv(ALLOWED_ENV_VAR, "JOB_NOTE")


def _parameters(function: object) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("method", OWN_METHODS + SHARED_METHODS)
@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda cls: cls.__name__)
def test_every_launcher_implements_every_method_of_the_protocol_with_its_signature(launcher: type, method: str) -> None:
    assert Launcher in launcher.__mro__, "launchers subclass the protocol to share its wait"
    protocol = getattr(Launcher, method)
    implementation = getattr(launcher, method)
    if method in OWN_METHODS:
        assert implementation is not protocol, f"{launcher.__name__}.{method} is the protocol's empty stub"
    expected = _parameters(protocol)
    actual = _parameters(implementation)
    assert actual[: len(expected)] == expected, f"{launcher.__name__}.{method} differs from Launcher.{method}"
    extra = inspect.signature(implementation).parameters.values()
    assert all(p.default is not inspect.Parameter.empty for p in list(extra)[len(expected) :])


def test_launcher_for_picks_a_launcher_of_the_protocol_for_each_scheduler_and_names_the_valid_ones() -> None:
    from tasks.launch.ssh import SshLauncher

    for scheduler, kind in (("local", LocalLauncher), ("ssh", SshLauncher), ("slurm", SlurmLauncher)):
        launcher = launcher_for(scheduler)
        assert type(launcher) is kind and launcher.scheduler == scheduler and Launcher in kind.__mro__
    with pytest.raises(UserError, match=r"cluster\.scheduler=pbs: unknown; use local, ssh, slurm or kubernetes"):
        launcher_for("pbs")


def test_a_job_environment_takes_only_plugin_variables_and_names_the_fix() -> None:
    assert FAULTS.variables()[ENV_VAR] == FAULTS.plugin_env[ENV_VAR] and JobEnvironment().variables() == {}
    with pytest.raises(ValidationError) as refused:
        JobEnvironment(plugin_env={**FAULTS.plugin_env, "JOB_NOTE": "x"})
    message = str(refused.value)
    assert "plugin_env=['JOB_NOTE']: not plugin variables" in message
    assert "name them TDEPLOY_TEST_* or put the job's own variables in cluster.env" in message


def test_a_drill_adds_its_points_to_the_job_environment_and_keeps_the_rest() -> None:
    pause = {"phase": "after_dcp", "step": 4, "marker_dir": "/tmp/m"}
    held = FAULTS.with_drill_points(pause_in_save=pause)
    assert held.plugin_env == FAULTS.plugin_env and held.python_path == FAULTS.python_path
    points = json.loads(held.variables()["TDEPLOY_DRILL_POINTS"])
    assert points == {"pause_in_save": pause} and "TDEPLOY_DRILL_POINTS" not in FAULTS.variables()
    with pytest.raises(ValidationError, match="pause_in_save"):
        FAULTS.with_drill_points(pause_in_save={**pause, "phase": "somewhere"})


def _exports(script: str) -> dict[str, str]:
    found = {}
    for line in script.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            (found[key],) = shlex.split(value)
    return found


def test_the_sbatch_script_exports_cluster_env_and_the_faults_only_when_given(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "env": SPEC_ENV}})
    plain = _exports(SlurmLauncher().render(spec.cluster, "/r/run.json", "tiny", "/r", None))
    assert SPEC_ENV.items() <= plain.items() and ENV_VAR not in plain
    faulty = _exports(SlurmLauncher().render(spec.cluster, "/r/run.json", "tiny", "/r", None, FAULTS))
    assert {**plain, **FAULTS.variables()} == faulty


def _pod_env(job: dict) -> dict[str, str]:
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_the_pytorchjob_carries_cluster_env_and_the_faults_only_when_given(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "kubernetes": {"api": "pytorchjob"}, "env": SPEC_ENV}})
    _, plain = render_manifests(spec.cluster, spec.training_config(), "tiny", "img:1")
    validate_pytorchjob(plain)
    literal = {key: value.replace("$", "$$") for key, value in SPEC_ENV.items()}
    assert literal.items() <= _pod_env(plain).items() and ENV_VAR not in _pod_env(plain)
    config_map, faulty = render_manifests(spec.cluster, spec.training_config(), "tiny", "img:1", FAULTS)
    validate_pytorchjob(faulty)
    assert _pod_env(faulty)[ENV_VAR] == FAULTS.plugin_env[ENV_VAR].replace("$", "$$")
    assert ENV_VAR not in json.dumps(config_map), "the faults are the pods' environment, not the run config"
