"""Preflight: every path and URL of a spec checked for existence or writability before any work starts.

The checks go through the storage layer the job uses (`training.storage`, fsspec). Nothing is created:
a local output is writable when it is a writable folder, or when its nearest existing ancestor is one;
an object-store output is writable when a probe object can be written to and deleted from it.

First, every local path the spec names or implies (outputs, the deployment folder, data inputs) must resolve
under the operator's roots (`tasks.roots`: TDEPLOY_ALLOWED_ROOTS, else the current folder); so must the symbolic
links directly inside an output folder. The node files (inventory, SSH key, known_hosts) are read by Ansible and
ssh on this machine, never written, copied or shown, and usually live in ~/.ssh: they are not confined.
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import TransientError, is_connection_error
from tasks.roots import AllowedRoots, RootsError, allowed_roots, confinement_problem
from tasks.paths import derived_paths
from tasks.spec import DeploymentSpec, SpecError
from training.storage import StorageConfig, filesystem, is_local, join, local_path

log = logging.getLogger(__name__)

PROBE_PREFIX = ".tdeploy-preflight-"
_GLOB = "*?["
UNCONFINED = frozenset({"nodes.inventory_path", "nodes.ssh_key_path", "nodes.known_hosts_path"})
"""Fields read by Ansible and ssh only (credentials and host lists, usually in ~/.ssh): not held to the roots."""
_LINKS_CHECKED = 1000
"""Entries of an output folder looked at for symbolic links leading out of the roots (its own, a few dozen)."""


@dataclass(frozen=True)
class PathCheck:
    """One path-like field of the spec: its dotted name, its value, and whether the job reads or writes it."""

    field: str
    value: str
    mode: str  # "write": an output folder; "read": an input that must exist; "file": an input file
    local_only: bool = False


class _Unreachable(Exception):
    """Storage did not answer while checking a field."""


def spec_paths(spec: DeploymentSpec) -> list[PathCheck]:
    """Every path and URL of the spec with what the job does with it (None fields are off)."""
    prepare = spec.data.prepare
    nodes = spec.nodes
    image = spec.image
    candidates: list[tuple[str, str | None, str, bool]] = [
        ("deployment_dir", _reports_dir(spec), "write", True),
        ("run.output_url", spec.run.output_url, "write", False),
        ("checkpoint.url", spec.checkpoint.url, "write", False),
        ("data.prepare.output_url", prepare.output_url if prepare else None, "write", False),
        ("capacity.output_url", getattr(spec.capacity, "output_url", None), "write", False),
        ("acceptance.work_url", getattr(spec.acceptance, "work_url", None), "write", True),
        ("acceptance.ledger_url", getattr(spec.acceptance, "ledger_url", None), "write", False),
        ("image.storage_dir", image.storage_dir if image else None, "write", True),
        ("data.dataset_url", spec.data.dataset_url, "read", False),
        ("capacity.calibration_url", getattr(spec.capacity, "calibration_url", None), "file", False),
        ("data.prepare.tokenizer.path", prepare.tokenizer.path if prepare else None, "file", False),
        ("data.tokenizer_url", spec.data.tokenizer_url, "file", False),
        ("nodes.inventory_path", nodes.inventory_path, "file", True),
        ("nodes.ssh_key_path", nodes.ssh_key_path, "file", True),
        ("nodes.known_hosts_path", nodes.known_hosts_path, "file", True),
    ]
    for number, given in enumerate(spec.data.blend or []):
        candidates.append((f"data.blend[{number}].url", given.url, "read", False))
    candidates.append(("data.adopted_url", spec.data.adopted_url, "write", False))
    for number, source in enumerate(prepare.sources if prepare else []):
        candidates.append((f"data.prepare.sources[{number}].url", source.url, "read", False))
    if prepare is not None and prepare.images is not None:
        candidates.append(("data.prepare.images.path", prepare.images.path, "read", False))
    return [PathCheck(field, value, mode, local) for field, value, mode, local in candidates if value]


def _reports_dir(spec: DeploymentSpec) -> str | None:
    for name in ("deployment_dir", "reports_dir"):
        value = getattr(spec, name, None)
        if value:
            return str(value)
    return None


def preflight(spec: DeploymentSpec) -> None:
    """Raise SpecError naming every path or URL of `spec` that cannot be read or written, with the fix; first,
    every local path that leads outside the operator's roots (`confinement_problems`).

    TransientError when only unreachable storage kept a check from finishing (retrying may help).
    """
    outside = confinement_problems(spec)
    if outside:
        raise SpecError(spec.name, outside)  # nothing outside the roots is looked at, not even probed
    problems: list[str] = []
    unreachable: list[str] = []
    for check in spec_paths(spec):
        try:
            problem = _check(check, spec.storage)
        except _Unreachable as err:
            unreachable.append(f"{check.field}={check.value}: storage did not answer ({err})")
            continue
        if problem:
            problems.append(f"{check.field}={check.value}: {problem}")
    if problems:
        raise SpecError(spec.name, problems + [f"{u}; check it again once storage answers" for u in unreachable])
    if unreachable:
        raise TransientError(
            "preflight could not check every path: " + "; ".join(unreachable),
            "check storage.s3_endpoint_url and the network; run the command again once storage answers",
        )
    log.debug("preflight: every path of %s is usable", spec.name)


def confinement_problems(spec: DeploymentSpec) -> list[str]:
    """`field=value: ...` for every local path of `spec` that leads outside the operator's roots (`tasks.roots`),
    and for every symbolic link directly inside one of its output folders that does; [] when all stay inside.

    A folder that deployment_dir implies (run.output_url: <deployment_dir>/output, ...) is not named again when
    deployment_dir itself is refused."""
    try:
        roots = allowed_roots()
    except RootsError as err:
        return [str(err)]
    derived = _derived_defaults(spec)
    problems: list[str] = []
    for check in spec_paths(spec):
        if check.field in UNCONFINED or not is_local(check.value):
            continue
        if problems and problems[0].startswith("deployment_dir=") and derived.get(check.field) == check.value:
            continue
        problem = _outside(check, roots)
        if problem:
            problems.append(problem)
    return problems


def _derived_defaults(spec: DeploymentSpec) -> dict[str, str]:
    """The folders deployment_dir implies, by field name (what `derived_paths` fills in for omitted fields)."""
    filled = derived_paths({"deployment_dir": _reports_dir(spec), "run": {}, "checkpoint": {}, "data": {"prepare": {}}})
    return {
        "run.output_url": filled["run"]["output_url"],
        "checkpoint.url": filled["checkpoint"]["url"],
        "capacity.output_url": filled["capacity"]["output_url"],
        "acceptance.work_url": filled["acceptance"]["work_url"],
        "data.prepare.output_url": filled["data"]["prepare"]["output_url"],
    }


def _outside(check: PathCheck, roots: AllowedRoots) -> str | None:
    """Why `check`'s local path leaves the roots: the path itself; for an input also each file a glob matches and
    a Megatron prefix's .bin and .idx; for an output the symbolic links directly inside the folder."""
    problem = confinement_problem(check.field, check.value, roots)
    if problem:
        return problem
    path = os.path.expanduser(local_path(check.value))
    if check.mode == "write":
        try:
            with os.scandir(path) as entries:
                inside = [entry.path for entry in itertools.islice(entries, _LINKS_CHECKED) if entry.is_symlink()]
        except (NotADirectoryError, FileNotFoundError, PermissionError):
            return None  # not there yet, or a file: the writability check says what is wrong
    elif any(c in path for c in _GLOB):
        inside = glob.glob(path, recursive=True)
    else:
        inside = [p for p in (path + ".bin", path + ".idx") if os.path.lexists(p)]
    for entry in inside:
        problem = confinement_problem(check.field, check.value, roots, target=entry)
        if problem:
            return problem
    return None


def path_problem(spec: DeploymentSpec, field: str) -> str | None:
    """`field=value: what is wrong and the fix` for the one path `field` of `spec` (a PathCheck's field name);
    None when it is usable or unset. For a command that uses only that path (`tdeploy plan` writes plan.json)."""
    try:
        roots = allowed_roots()
    except RootsError as err:
        return str(err)
    for check in spec_paths(spec):
        if check.field == field:
            if check.field not in UNCONFINED and is_local(check.value):
                outside = _outside(check, roots)
                if outside:
                    return outside
            try:
                problem = _check(check, spec.storage)
            except _Unreachable as err:
                problem = f"storage did not answer ({err})"
            return f"{check.field}={check.value}: {problem}" if problem else None
    return None


def _check(check: PathCheck, storage: StorageConfig) -> str | None:
    if is_local(check.value):
        path = os.path.expanduser(local_path(check.value))
        if check.mode == "write":
            return _local_writable(path)
        return _local_readable(path, check.mode == "file")
    if check.local_only:
        return "must be a folder on this machine; use a local path such as runs/<name>/..."
    try:
        if check.mode == "write":
            return _remote_writable(check.value, storage)
        return _remote_readable(check.value, storage, check.mode == "file")
    except _Unreachable:
        raise
    except Exception as err:
        if is_connection_error(err):
            raise _Unreachable(f"{type(err).__name__}: {err}") from err
        return f"cannot be checked ({type(err).__name__}: {err}); check the URL and the credentials in the environment"


def _nearest_existing(path: Path) -> Path:
    current = path.absolute()
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _local_writable(path: str) -> str | None:
    target = Path(path)
    if target.exists():
        if not target.is_dir():
            return "is a file, not a folder; point it at a folder (or a path that does not exist yet)"
        where, what = target, "the folder"
    else:
        where = _nearest_existing(target)
        if not where.is_dir():
            return f"cannot be created: {where} is a file, not a folder; use a path under a folder you can write"
        what = f"its nearest existing folder {where}"
    if _read_only_mount(where):
        return f"{what} is on a read-only filesystem; use a path on a writable disk"
    if not os.access(where, os.W_OK | os.X_OK):
        return f"{what} is not writable by this user; use a folder you can write, or fix its permissions"
    return None


def _local_readable(path: str, must_be_file: bool) -> str | None:
    if any(c in path for c in _GLOB):
        matches = [m for m in glob.glob(path, recursive=True) if os.path.isfile(m)]
        if not matches:
            return "the glob matches no file; fix the pattern (relative paths start in the folder tdeploy runs in)"
        return None
    target = Path(path)
    if not target.exists() and Path(path + ".bin").exists():  # a Megatron prefix: P.bin and P.idx
        target = Path(path + ".bin")
    if not target.exists():
        return "does not exist; fix the path (relative paths start in the folder tdeploy runs in)"
    if must_be_file and not target.is_file():
        return "is not a file; give the path of the file itself"
    if not os.access(target, os.R_OK):
        return "is not readable by this user; fix its permissions"
    return None


def _call(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except Exception as err:
        if is_connection_error(err):
            raise _Unreachable(f"{type(err).__name__}: {err}") from err
        raise


def _bucket_problem(fs: object, path: str) -> str | None:
    bucket = path.split("/", 1)[0]
    try:
        # info(), not exists(): s3fs's exists() answers False when the endpoint is down
        _call(lambda: fs.info(bucket))  # type: ignore[attr-defined]
    except FileNotFoundError:
        return f"the bucket {bucket} does not exist (or these credentials cannot see it); create it or fix the URL"
    except PermissionError as err:
        return f"the bucket {bucket} is not accessible with these credentials ({err}); grant access or fix the URL"
    return None


def _remote_writable(url: str, storage: StorageConfig) -> str | None:
    fs, path = filesystem(url, storage)
    problem = _bucket_problem(fs, path)
    if problem:
        return problem
    probe = join(path, f"{PROBE_PREFIX}{uuid.uuid4().hex}")
    try:
        _call(lambda: fs.pipe_file(probe, b""))
    except _Unreachable:
        raise
    except PermissionError as err:
        return f"cannot be written ({err}); grant these credentials write access or use another prefix"
    except OSError as err:
        return f"cannot be written ({type(err).__name__}: {err}); check the URL and the credentials"
    _call(lambda: fs.rm_file(probe))
    return None


def _remote_readable(url: str, storage: StorageConfig, must_be_file: bool) -> str | None:
    fs, path = filesystem(url, storage)
    problem = _bucket_problem(fs, path)
    if problem:
        return problem
    if any(c in path for c in _GLOB):
        matches: Iterator[str] = iter(_call(lambda: fs.glob(path)))  # type: ignore[arg-type]
        if next(matches, None) is None:
            return "the glob matches no object; fix the pattern"
        return None
    if not _call(lambda: fs.exists(path)) and not _call(lambda: fs.exists(path + ".bin")):  # or a Megatron prefix
        return "does not exist; fix the URL"
    if must_be_file and _call(lambda: fs.isdir(path)):
        return "is a folder (prefix), not a file; give the URL of the file itself"
    return None
