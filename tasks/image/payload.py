"""The training payload as a wheel: only `training/`, byte-for-byte reproducible, plus its pinned dependencies.

The wheel is written directly (it is a zip with three metadata files) instead of
through a build backend: entries sorted, fixed timestamps and permissions, no
build directory, so the same sources give the same bytes in milliseconds. That
keeps the image tag a pure function of the sources and the no-op check cheap.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import io
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

DIST_NAME = "tdeploy-training"
PACKAGE = "training"
PROJECT = "transformer-deploy"
# What the payload imports besides the standard library (checked by a unit test); PyTorch comes from the base image.
# safetensors: model.init_from's weights and Hugging Face distillation teachers (training/hf_load.py)
RUNTIME_DEPENDENCIES = ("torch", "numpy", "fsspec", "pydantic", "safetensors")
# Imported only where a feature is used, inside a guard; wheel extras. s3 is pinned into the image with S3 URLs.
OPTIONAL_DEPENDENCIES = {
    "s3": ("s3fs",), "telemetry": ("prometheus-client", "nvidia-ml-py"), "live_recovery": ("torchft",),
    "fp8": ("torchao",),  # precision.dtype fp8 (training/float8.py)
}  # fmt: skip
S3_DEPENDENCIES = OPTIONAL_DEPENDENCIES["s3"]
FROM_BASE_IMAGE = ("torch",)
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class PayloadWheel:
    """A built payload wheel: file name, bytes and sha256."""

    filename: str
    data: bytes
    sha256: str
    version: str

    def write(self, folder: Path) -> Path:
        """Write the wheel into `folder` and return its path."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / self.filename
        path.write_bytes(self.data)
        return path


def payload_source() -> Path:
    """The folder of the `training` package this process would import."""
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.origin is not None, "the training package is part of this project"
    return Path(spec.origin).parent


def project_version() -> str:
    """The project's version (the payload wheel carries the same)."""
    return importlib.metadata.version(PROJECT)


def _declared_specifiers() -> dict[str, str]:
    """Version ranges of the payload's dependencies as the project declares them (pyproject.toml)."""
    out: dict[str, str] = {}
    for line in importlib.metadata.requires(PROJECT) or []:
        req = Requirement(line)
        if req.marker is None:
            out[canonicalize_name(req.name)] = str(req.specifier)
    return out


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(source: Path | None = None, version: str | None = None) -> PayloadWheel:
    """A py3-none-any wheel of the `training` package at `source` (default: the one imported here)."""
    source = source or payload_source()
    version = version or project_version()
    declared = _declared_specifiers()
    requires = [f"{name}{declared.get(name, '')}" for name in RUNTIME_DEPENDENCIES]
    requires += [
        f'{name}{declared.get(name, "")}; extra == "{extra}"'
        for extra, names in OPTIONAL_DEPENDENCIES.items()
        for name in names
    ]
    metadata = "\n".join(
        [
            "Metadata-Version: 2.1",
            f"Name: {DIST_NAME}",
            f"Version: {version}",
            "Summary: transformer-deploy training payload (runs under torchrun on the cluster nodes)",
            "Requires-Python: >=3.10",
            *(f"Requires-Dist: {r}" for r in requires),
            *(f"Provides-Extra: {extra}" for extra in OPTIONAL_DEPENDENCIES),
            "",
        ]
    )
    wheel_meta = "Wheel-Version: 1.0\nGenerator: transformer-deploy\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files: dict[str, bytes] = {}
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if path.is_dir() or "__pycache__" in relative.parts or path.suffix in (".pyc", ".pyo"):
            continue
        files[f"{PACKAGE}/{relative.as_posix()}"] = path.read_bytes()
    assert f"{PACKAGE}/__init__.py" in files, f"{source} is not the training package"
    dist_info = f"{DIST_NAME.replace('-', '_')}-{version}.dist-info"
    files[f"{dist_info}/METADATA"] = metadata.encode()
    files[f"{dist_info}/WHEEL"] = wheel_meta.encode()
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=_ZIP_EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data, compresslevel=9)
    data = buffer.getvalue()
    filename = f"{DIST_NAME.replace('-', '_')}-{version}-py3-none-any.whl"
    return PayloadWheel(filename=filename, data=data, sha256=hashlib.sha256(data).hexdigest(), version=version)


def pinned_dependencies(with_s3: bool) -> list[str]:
    """The payload's dependencies and theirs, pinned to the versions installed here (PyTorch excluded)."""
    roots = [n for n in RUNTIME_DEPENDENCIES if n not in FROM_BASE_IMAGE] + (list(S3_DEPENDENCIES) if with_s3 else [])
    environment = {**default_environment(), "extra": ""}
    pins: dict[str, str] = {}
    pending = [canonicalize_name(n) for n in roots]
    while pending:
        name = pending.pop()
        if name in pins or name in FROM_BASE_IMAGE:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError as err:
            raise LookupError(f"{name} is not installed here, so it cannot be pinned") from err
        pins[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(environment):
                pending.append(canonicalize_name(req.name))
    return [f"{name}=={pins[name]}" for name in sorted(pins)]


def source_revision(source: Path) -> str:
    """The git commit that last changed `source` (+ '-dirty' with uncommitted changes), or 'unknown'."""
    git = ["git", "-C", str(source)]
    try:
        last = subprocess.run(
            [*git, "log", "-1", "--format=%H", "--", "."], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not last:
        return "unknown"
    return f"{last}-dirty" if dirty else last
