"""The schedulers tdeploy can launch on: one line each, mapping `cluster.scheduler` to its launcher.

Everything that depends on the scheduler asks through here: the spec's `cluster.scheduler` check, the launcher a
job is submitted through (and found again by its handle), and the launcher's `Capabilities`. A new scheduler is
a launcher class (with its capabilities), optionally a settings model for `cluster.settings`, and one `register`
call; nothing outside its own module changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tasks.errors import UserError
from tasks.launch.base import Capabilities, Launcher
from tasks.launch.kubernetes import KubernetesLauncher
from tasks.launch.local import LocalLauncher
from tasks.launch.slurm import SlurmLauncher
from tasks.launch.ssh import SshLauncher
from training.config import StrictModel


@dataclass(frozen=True)
class Scheduler:
    """A registered scheduler: its launcher class and the model of its `cluster.settings` (None: it takes none;
    the built-in schedulers have sections of their own: cluster.ssh, cluster.slurm, cluster.kubernetes)."""

    launcher: type[Launcher]
    settings: type[StrictModel] | None = None

    @property
    def name(self) -> str:
        """The `cluster.scheduler` value that picks it."""
        return self.launcher.scheduler


_SCHEDULERS: dict[str, Scheduler] = {}


def register(launcher: type[Launcher], settings: type[StrictModel] | None = None) -> Scheduler:
    """Make `launcher.scheduler` a valid `cluster.scheduler`, launched by `launcher` (replacing an earlier one of
    that name); `settings` checks `cluster.settings` for it."""
    entry = Scheduler(launcher, settings)
    _SCHEDULERS[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Forget a scheduler registered at run time (a test's stub)."""
    _SCHEDULERS.pop(name, None)


register(LocalLauncher)
register(SshLauncher)
register(SlurmLauncher)
register(KubernetesLauncher)


def names() -> list[str]:
    """Every registered scheduler, in registration order."""
    return list(_SCHEDULERS)


def choices(quoted: bool = True) -> str:
    """The registered names as a message lists them: 'local', 'ssh', 'slurm' or 'kubernetes' (unquoted: local,
    ssh, slurm or kubernetes)."""
    shown = [repr(name) if quoted else name for name in _SCHEDULERS]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def find(name: str) -> Scheduler | None:
    """The registered scheduler `name`, or None."""
    return _SCHEDULERS.get(name)


def scheduler(name: str) -> Scheduler:
    """The registered scheduler `name` (UserError naming the registered ones when there is none)."""
    entry = _SCHEDULERS.get(name)
    if entry is None:
        raise UserError(f"cluster.scheduler={name}: unknown", f"use {choices(quoted=False)}")
    return entry


def launcher_class(name: str) -> type[Launcher]:
    """The launcher class of scheduler `name`: its class methods answer from the cluster section alone."""
    return scheduler(name).launcher


def capabilities(name: str) -> Capabilities:
    """What the launcher of scheduler `name` can do (no scheduler tools needed)."""
    return scheduler(name).launcher.capabilities


def launcher_for(name: str, env: Mapping[str, str] | None = None) -> Launcher:
    """A launcher of scheduler `name`; `env` is added to the environment its tools and local processes start from
    (a Kubernetes pod does not start from it)."""
    return scheduler(name).launcher(env)  # type: ignore[call-arg]  # every launcher takes `env`
