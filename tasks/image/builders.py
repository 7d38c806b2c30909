"""Image builders: a Docker engine through the Python SDK, podman, or buildah; detection and a common interface.

buildah and podman build with `--timestamp 0` (creation time and every file's
mtime fixed), so the same inputs give the same image ID. Docker's API builder
has no such option: with it the tag still names the content, but the image ID
changes from build to build.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from tasks.errors import TransientError, UserError
from tasks.image.config import ImageConfig
from tasks.image.containerfile import CONTAINERFILE
from tasks.image.errors import (
    BaseImageMissing,
    BuilderNotFound,
    BuildFailed,
    RegistryRejected,
    RegistryUnavailable,
)
from tasks.image.registry import credentials, environment_authfile

logger = logging.getLogger(__name__)

AUTO_ORDER = ("docker", "podman", "buildah")
_STORE_FIX = "check image.storage_dir and that the builder's store is readable (`buildah images` lists it)"
# Failures of a pull or push that may pass on their own (server errors, timeouts, resets).
_TRANSIENT = re.compile(
    r"timeout|timed out|connection reset|connection refused|broken pipe|EOF|TLS handshake|too many requests|"
    r"\b50[0-4]\b|service unavailable|bad gateway|temporarily",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class LocalImage:
    """An image in the builder's local store."""

    image_id: str
    digest: str | None
    size_bytes: int
    labels: dict[str, str]


@dataclass(frozen=True)
class BuildOutput:
    """What a build did: the image ID and how many steps came from the layer cache."""

    image_id: str
    steps: int
    cached_steps: int
    seconds: float


class Builder(ABC):
    """One way to build, inspect and push images."""

    name: str

    @abstractmethod
    def version(self) -> str:
        """`name version` of the builder."""

    @abstractmethod
    def local_reference(self, repository: str, tag: str) -> str:
        """How an unpushed image is named in this builder's store."""

    @abstractmethod
    def inspect(self, reference: str) -> LocalImage | None:
        """The local image `reference`, or None when the store does not have it."""

    @abstractmethod
    def pull(self, reference: str, timeout_s: float) -> None:
        """Pull `reference` into the local store (BaseImageMissing or TransientError on failure)."""

    @abstractmethod
    def build(self, context: Path, reference: str, log_path: Path, timeout_s: float) -> BuildOutput:
        """Build `context/Containerfile` as `reference`, writing the builder's output to `log_path`."""

    @abstractmethod
    def push(self, reference: str, insecure: bool, timeout_s: float) -> str:
        """Push `reference` to its registry; returns the manifest digest the builder wrote."""


def _tail(lines: deque[str] | list[str], n: int = 30) -> str:
    return "\n".join(list(lines)[-n:])


class CliBuilder(Builder):
    """buildah or podman: the same build engine behind two command lines, daemonless."""

    build_command = "bud"

    def __init__(self, executable: str, cfg: ImageConfig) -> None:
        self.executable = executable
        self.isolation = cfg.isolation
        self.global_args: list[str] = []
        if cfg.storage_dir:
            store = Path(cfg.storage_dir).absolute()
            self.global_args = [
                "--storage-driver",
                "vfs",
                "--root",
                str(store / "storage"),
                "--runroot",
                str(store / "run"),
            ]

    def _run(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.executable, *self.global_args, *args], capture_output=True, text=True, timeout=timeout_s
        )

    def version(self) -> str:
        out = self._run("--version").stdout.strip()
        return out.replace(" version", "").split(" (")[0] or self.name

    def local_reference(self, repository: str, tag: str) -> str:
        return f"localhost/{repository}:{tag}"

    def inspect(self, reference: str) -> LocalImage | None:
        proc = self._run("inspect", "--type", "image", reference)
        if proc.returncode != 0:
            if "image not known" in proc.stderr or "not found" in proc.stderr:
                return None
            raise UserError(f"{self.name} inspect {reference} failed: {proc.stderr.strip()}", _STORE_FIX)
        data = json.loads(proc.stdout)
        manifest = json.loads(data.get("Manifest") or "{}")
        size = sum(int(layer.get("size", 0)) for layer in manifest.get("layers", []))
        config = (data.get("OCIv1") or {}).get("config") or {}
        return LocalImage(
            image_id="sha256:" + data["FromImageID"],
            digest=data.get("FromImageDigest") or None,
            size_bytes=size,
            labels=dict(config.get("Labels") or {}),
        )

    def pull(self, reference: str, timeout_s: float) -> None:
        try:
            proc = self._run("pull", "--quiet", reference, timeout_s=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise TransientError(f"pulling {reference} took over {timeout_s:.0f} s", "retrying") from err
        if proc.returncode == 0:
            return
        detail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}"
        if _TRANSIENT.search(detail) and "no such host" not in detail:
            raise TransientError(f"pulling {reference} failed: {detail}", "retrying")
        raise BaseImageMissing(
            reference,
            self.name,
            f"pull failed: {detail}",
            f"on an offline machine load it first (`{self.name} pull oci-archive:FILE` or "
            f"`{self.name} pull docker-archive:FILE`) and set image.pull_policy: never; "
            "otherwise check the name and the registry login",
        )

    def _build_args(self, context: Path, reference: str, iidfile: Path) -> list[str]:
        return [
            self.build_command,
            "--file",
            str(context / CONTAINERFILE),
            "--tag",
            reference,
            "--layers",
            "--pull=never",
            "--timestamp",
            "0",
            "--isolation",
            self.isolation,
            "--format",
            "oci",
            "--iidfile",
            str(iidfile),
            str(context),
        ]

    def build(self, context: Path, reference: str, log_path: Path, timeout_s: float) -> BuildOutput:
        started = time.monotonic()
        iidfile = context.parent / "image-id"
        iidfile.unlink(missing_ok=True)
        cmd = [self.executable, *self.global_args, *self._build_args(context, reference, iidfile)]
        logger.info("building %s: %s", reference, " ".join(cmd))
        steps = cached = 0
        last: deque[str] = deque(maxlen=60)
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            timed_out = threading.Event()
            watchdog = threading.Timer(timeout_s, lambda: (timed_out.set(), proc.kill()))
            watchdog.start()
            try:
                for line in proc.stdout:
                    log.write(line)
                    last.append(line.rstrip("\n"))
                    if line.startswith("STEP "):
                        steps += 1
                    elif line.startswith("--> Using cache"):
                        cached += 1
                returncode = proc.wait()
            finally:
                watchdog.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if timed_out.is_set():
            raise BuildFailed(
                self.name, str(context), f"{_tail(last, 10)}\nkilled after image.build_timeout_s={timeout_s:g}"
            )
        if returncode != 0:
            raise BuildFailed(self.name, str(context), _tail(last))
        return BuildOutput(
            image_id="sha256:" + iidfile.read_text().strip().removeprefix("sha256:"),
            steps=steps,
            cached_steps=cached,
            seconds=time.monotonic() - started,
        )

    def push(self, reference: str, insecure: bool, timeout_s: float) -> str:
        registry = reference.split("/", 1)[0]
        with tempfile.TemporaryDirectory(prefix="tdeploy-push-") as tmp:
            digestfile = Path(tmp) / "digest"
            args = ["push", "--quiet", "--digestfile", str(digestfile)]
            if insecure:
                args.append("--tls-verify=false")
            # Without TDEPLOY_REGISTRY_* the builder uses the user's own login (auth.json, ~/.docker/config.json);
            # with them, an auth file (mode 0600) keeps the password off the process list.
            with environment_authfile(registry) as authfile:
                if authfile is not None:
                    args += ["--authfile", str(authfile)]
                try:
                    proc = self._run(*args, reference, f"docker://{reference}", timeout_s=timeout_s)
                except subprocess.TimeoutExpired as err:
                    raise RegistryUnavailable(registry, f"push took over {timeout_s:.0f} s") from err
            if proc.returncode != 0:
                _raise_push_error(registry, proc.stderr.strip() or f"exit code {proc.returncode}")
            return digestfile.read_text().strip()


def _raise_push_error(registry: str, detail: str) -> NoReturn:
    last = detail.splitlines()[-1]
    if "http: server gave HTTP response to HTTPS client" in detail:
        raise RegistryRejected(registry, last, "for a plain-HTTP test registry set image.registry_insecure: true")
    if re.search(r"unauthorized|denied|authentication required|403|401", detail, re.IGNORECASE):
        raise RegistryRejected(registry, last, f"log in (`buildah login {registry}`) or set TDEPLOY_REGISTRY_*")
    if _TRANSIENT.search(detail):
        raise RegistryUnavailable(registry, last)
    raise RegistryRejected(registry, last, "check image.registry_url and image.repository")


class BuildahBuilder(CliBuilder):
    """buildah: daemonless, works unprivileged (vfs storage, chroot isolation)."""

    name = "buildah"


class PodmanBuilder(CliBuilder):
    """podman: buildah's engine behind podman's command line."""

    name = "podman"
    build_command = "build"

    def inspect(self, reference: str) -> LocalImage | None:
        if self._run("image", "exists", reference).returncode != 0:
            return None
        proc = self._run("image", "inspect", reference)
        if proc.returncode != 0:
            raise UserError(f"podman image inspect {reference} failed: {proc.stderr.strip()}", _STORE_FIX)
        data = json.loads(proc.stdout)[0]
        return LocalImage(
            image_id="sha256:" + data["Id"].removeprefix("sha256:"),
            digest=data.get("Digest") or None,
            size_bytes=int(data.get("Size") or 0),
            labels=dict(data.get("Labels") or {}),
        )


class DockerBuilder(Builder):
    """A Docker engine through the Python SDK (the engine's classic builder: image IDs are not reproducible)."""

    name = "docker"

    def __init__(self, client: Any) -> None:
        self.client = client

    def version(self) -> str:
        return f"docker {self.client.version().get('Version', '?')}"

    def local_reference(self, repository: str, tag: str) -> str:
        return f"{repository}:{tag}"

    def inspect(self, reference: str) -> LocalImage | None:
        import docker.errors

        try:
            image = self.client.images.get(reference)
        except docker.errors.ImageNotFound:
            return None
        digests = image.attrs.get("RepoDigests") or []
        return LocalImage(
            image_id=image.id,
            digest=digests[0].split("@", 1)[1] if digests else None,
            size_bytes=int(image.attrs.get("Size") or 0),
            labels=dict(image.labels or {}),
        )

    def pull(self, reference: str, timeout_s: float) -> None:
        import docker.errors

        try:
            self.client.images.pull(reference)
        except docker.errors.APIError as err:
            if err.is_server_error() or _TRANSIENT.search(str(err)):
                raise TransientError(f"pulling {reference} failed: {err}", "retrying") from err
            raise BaseImageMissing(
                reference,
                self.name,
                f"pull failed: {err.explanation or err}",
                "on an offline machine `docker load` it first and set image.pull_policy: never",
            ) from err

    def build(self, context: Path, reference: str, log_path: Path, timeout_s: float) -> BuildOutput:
        started = time.monotonic()
        steps = cached = 0
        image_id = ""
        last: deque[str] = deque(maxlen=60)
        with log_path.open("w") as log:
            stream = self.client.api.build(
                path=str(context),
                dockerfile=CONTAINERFILE,
                tag=reference,
                rm=True,
                pull=False,
                decode=True,
                timeout=int(timeout_s),
            )
            for chunk in stream:
                if "error" in chunk:
                    last.append(str(chunk["error"]))
                    log.write(f"{chunk['error']}\n")
                    raise BuildFailed(self.name, str(context), _tail(last))
                text = chunk.get("stream", "")
                if text:
                    log.write(text)
                    for line in text.splitlines():
                        last.append(line)
                        steps += line.startswith("Step ")
                        cached += "Using cache" in line
                image_id = (chunk.get("aux") or {}).get("ID", image_id)
        image_id = image_id or self.client.images.get(reference).id
        return BuildOutput(image_id=image_id, steps=steps, cached_steps=cached, seconds=time.monotonic() - started)

    def push(self, reference: str, insecure: bool, timeout_s: float) -> str:
        # registry_insecure cannot be set per push here: list the registry in the engine's insecure-registries.
        registry = reference.split("/", 1)[0]
        repository, _, tag = reference.rpartition(":")
        creds = credentials()
        auth = {"username": creds[0], "password": creds[1]} if creds else None
        digest = ""
        try:
            for chunk in self.client.api.push(repository, tag=tag, stream=True, decode=True, auth_config=auth):
                if "error" in chunk:
                    _raise_push_error(registry, str(chunk["error"]))
                digest = (chunk.get("aux") or {}).get("Digest", digest)
        except OSError as err:
            raise RegistryUnavailable(registry, str(err)) from err
        return digest


def _probe_docker() -> tuple[Builder | None, str]:
    try:
        import docker
    except ImportError:
        return None, "docker: the Python docker SDK is not installed"
    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as err:  # noqa: BLE001 - any failure to reach the engine means "not usable here"
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        return None, f"docker: no engine answers at {where} ({type(err).__name__})"
    return DockerBuilder(client), ""


def _probe_cli(name: str, cfg: ImageConfig) -> tuple[Builder | None, str]:
    executable = shutil.which(name)
    if executable is None:
        return None, f"{name}: not on PATH"
    builder: CliBuilder = BuildahBuilder(executable, cfg) if name == "buildah" else PodmanBuilder(executable, cfg)
    try:
        probe = builder._run("info", timeout_s=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"{name}: `{name} info` failed: {err}"
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines()
        return None, f"{name}: `{name} info` failed: {lines[-1] if lines else probe.returncode}"
    return builder, ""


def select_builder(cfg: ImageConfig) -> Builder:
    """The builder the spec forces, or the first usable one of docker, podman, buildah; BuilderNotFound if none."""
    candidates = AUTO_ORDER if cfg.builder == "auto" else (cfg.builder,)
    reasons: list[str] = []
    for name in candidates:
        builder, reason = _probe_docker() if name == "docker" else _probe_cli(name, cfg)
        if builder is not None:
            return builder
        reasons.append(reason)
    raise BuilderNotFound(cfg.builder, reasons)
