"""The folders a spec's local paths must stay in: the operator's TDEPLOY_ALLOWED_ROOTS, else the current folder.

A spec comes from people other than the operator (the Prefect UI, a file on shared storage), so where tdeploy
writes, deletes or reads data on this machine is bounded by the operator's environment, not by the spec. A path
is resolved as the filesystem would: `~` expanded, relative to the current folder, every symbolic link of its
existing part followed and `..` taken after it (os.path.realpath); it must then be a root or lie under one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from training.storage import is_local, local_path
from training.untrusted import escape_untrusted

ALLOWED_ROOTS_ENV = "TDEPLOY_ALLOWED_ROOTS"
"""os.pathsep-separated absolute folders the spec's local paths must lie under; unset = the current folder."""


class RootsError(ValueError):
    """TDEPLOY_ALLOWED_ROOTS names something that is not an absolute folder (the operator's setting, not a spec's)."""

    def __init__(self, value: str, entry: str) -> None:
        super().__init__(
            f"{ALLOWED_ROOTS_ENV}={value}: {entry!r} is not an absolute path; list absolute folders separated by "
            f"{os.pathsep!r} (e.g. {ALLOWED_ROOTS_ENV}={os.getcwd()}{os.pathsep}/shared/tdeploy), or unset it to "
            "allow the current folder"
        )
        self.value, self.entry = value, entry


@dataclass(frozen=True)
class AllowedRoots:
    """The resolved roots and where they came from (for messages)."""

    folders: tuple[Path, ...]
    from_env: bool

    def contain(self, resolved: Path) -> bool:
        """True when `resolved` (a realpath) is one of the roots or lies under one."""
        return any(resolved.is_relative_to(root) for root in self.folders)

    def describe(self) -> str:
        """The roots in words: 'a:b (TDEPLOY_ALLOWED_ROOTS)', or 'a (the current folder; ... unset)'."""
        listed = os.pathsep.join(str(root) for root in self.folders)
        source = ALLOWED_ROOTS_ENV if self.from_env else f"the current folder; {ALLOWED_ROOTS_ENV} unset"
        return f"{listed} ({source})"


def allowed_roots() -> AllowedRoots:
    """The operator's roots, resolved: TDEPLOY_ALLOWED_ROOTS, else the current folder. RootsError for a relative
    entry (it would move with the folder tdeploy runs in)."""
    value = os.environ.get(ALLOWED_ROOTS_ENV, "")
    entries = [entry for entry in value.split(os.pathsep) if entry.strip()]
    if not entries:
        return AllowedRoots((Path(os.path.realpath(os.getcwd())),), from_env=False)
    for entry in entries:
        if not os.path.isabs(os.path.expanduser(entry)):
            raise RootsError(value, entry)
    folders = tuple(dict.fromkeys(Path(os.path.realpath(os.path.expanduser(entry))) for entry in entries))
    return AllowedRoots(folders, from_env=True)


def resolve_local(url: str) -> Path:
    """Where the local path or file:// URL `url` leads on this machine: `~` expanded, made absolute against the
    current folder, symbolic links of its existing part followed, `..` applied after them."""
    return Path(os.path.realpath(os.path.expanduser(local_path(url))))


def confinement_problem(field: str, value: str, roots: AllowedRoots, target: str | None = None) -> str | None:
    """`field=value: why it is refused and the fix` when the local path `value` (or `target`, a file or link that
    it names: a glob's match, an entry of the folder) leads outside `roots`; None when it stays inside, or is no
    local path (an object-store URL is not confined by this)."""
    if not is_local(value):
        return None
    path = local_path(value) if target is None else target
    resolved = resolve_local(path)
    if roots.contain(resolved):
        return None
    given = Path(os.path.abspath(os.path.expanduser(path)))
    shown = escape_untrusted(str(resolved))  # a link's target comes from whoever wrote the storage
    where = f"leads to {shown}" if resolved != given else f"is {shown}"
    if target is not None:
        where = f"{escape_untrusted(target)} in it {where}"
    inside = " or ".join(str(root) for root in roots.folders)
    folder = resolved.parent if resolved.is_file() else resolved
    allow = os.pathsep.join([*(str(root) for root in roots.folders), escape_untrusted(str(folder))])
    return (
        f"{field}={value}: {where}, outside the folders tdeploy may use on this machine, {roots.describe()}; "
        f"use a path under {inside}, or have the operator allow that folder in tdeploy's environment (not the "
        f"spec): {ALLOWED_ROOTS_ENV}={allow}"
    )
