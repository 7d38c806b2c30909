"""Registry look-ups through skopeo: does a tag exist, and what is its manifest digest.

skopeo reads the logins users already have, in the order of containers-auth.json(5):
`${REGISTRY_AUTH_FILE}`, `${XDG_RUNTIME_DIR}/containers/auth.json`, `~/.config/containers/auth.json`
(what `buildah login`/`podman login` write), then `~/.docker/config.json` (and Docker credential helpers).
`TDEPLOY_REGISTRY_USERNAME`/`TDEPLOY_REGISTRY_PASSWORD`, when set, take precedence (written to a private
auth file for the call). Anonymous, Basic and Bearer-token registries are skopeo's business.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from tasks.errors import UserError
from tasks.image.errors import RegistryRejected, RegistryUnavailable

USERNAME_ENV, PASSWORD_ENV = "TDEPLOY_REGISTRY_USERNAME", "TDEPLOY_REGISTRY_PASSWORD"
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_CREDENTIALS_FIX = (
    "log in with `buildah login HOST` (or `podman login`, `docker login`; REGISTRY_AUTH_FILE names another auth "
    f"file), or set {USERNAME_ENV} and {PASSWORD_ENV}"
)
_MISSING_TAG = re.compile(r"manifest unknown|name unknown|\b404\b", re.IGNORECASE)
_TLS = re.compile(r"server gave HTTP response to HTTPS client|x509:|tls:|certificate", re.IGNORECASE)
_AUTH = re.compile(r"unauthorized|denied|authentication required|\b40[13]\b", re.IGNORECASE)
# Failures that may pass on their own (server errors, timeouts, resets, a registry not up yet).
_TRANSIENT = re.compile(
    r"timeout|timed out|deadline exceeded|connection reset|connection refused|broken pipe|EOF|too many requests|"
    r"\b50[0-4]\b|service unavailable|bad gateway|temporarily",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class RemoteManifest:
    """A tag's manifest as the registry serves it."""

    digest: str
    media_type: str
    config_digest: str | None
    size_bytes: int


def credentials() -> tuple[str, str] | None:
    """(username, password) from the environment, or None to use the user's registry logins."""
    user, password = os.environ.get(USERNAME_ENV), os.environ.get(PASSWORD_ENV)
    return (user, password) if user and password is not None else None


@contextmanager
def environment_authfile(registry: str) -> Iterator[Path | None]:
    """A private (0600) auth.json holding the TDEPLOY_REGISTRY_* login for `registry`, or None when unset."""
    creds = credentials()
    if creds is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="tdeploy-auth-") as tmp:
        authfile = Path(tmp) / "auth.json"
        token = base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
        authfile.touch(mode=0o600)
        authfile.write_text(json.dumps({"auths": {registry: {"auth": token}}}))
        yield authfile


class RegistryClient:
    """Read-only access to one registry (`host[:port][/namespace]`) through `skopeo inspect`."""

    def __init__(self, registry_url: str, insecure: bool = False, timeout_s: float = 30.0) -> None:
        self.registry_url = registry_url
        self.host, _, self.namespace = registry_url.partition("/")
        self.insecure = insecure
        self.timeout_s = timeout_s

    def repository_path(self, repository: str) -> str:
        """The repository's path on the registry (namespace included)."""
        return f"{self.namespace}/{repository}" if self.namespace else repository

    def reference(self, repository: str, tag: str) -> str:
        """`host[:port]/[namespace/]repository:tag`."""
        return f"{self.host}/{self.repository_path(repository)}:{tag}"

    def manifest(self, repository: str, tag: str) -> RemoteManifest | None:
        """The manifest of `repository:tag`, or None when the tag does not exist."""
        body = self._raw_manifest(self.reference(repository, tag))
        if body is None:
            return None
        document = json.loads(body)
        config = document.get("config") or {}
        parts = [config] + list(document.get("layers") or document.get("manifests") or [])
        return RemoteManifest(
            # `--raw` gives the manifest's exact bytes: their sha256 is the digest the registry serves it under.
            digest="sha256:" + hashlib.sha256(body).hexdigest(),
            media_type=document.get("mediaType") or _media_type(document),
            config_digest=config.get("digest"),
            size_bytes=sum(int(p.get("size", 0)) for p in parts),
        )

    def _raw_manifest(self, reference: str) -> bytes | None:
        """`skopeo inspect --raw`'s output, None for a missing tag; other failures raise typed errors."""
        skopeo = shutil.which("skopeo")
        if skopeo is None:
            raise UserError(
                f"image.registry_url={self.registry_url}: skopeo is not installed (it reads the registry)",
                "install it: `apt-get install skopeo` (Debian/Ubuntu) or `dnf install skopeo`",
            )
        cmd = [skopeo, "--command-timeout", f"{self.timeout_s:.0f}s", "inspect", "--raw", "--retry-times", "0"]
        if self.insecure:
            cmd.append("--tls-verify=false")
        with environment_authfile(self.host) as authfile:
            if authfile is not None:
                cmd += ["--authfile", str(authfile)]
            try:
                proc = subprocess.run(
                    [*cmd, f"docker://{reference}"], capture_output=True, timeout=self.timeout_s + 10
                )
            except subprocess.TimeoutExpired as err:
                raise RegistryUnavailable(self.registry_url, f"no answer within {self.timeout_s:.0f} s") from err
        if proc.returncode == 0:
            return proc.stdout
        detail = _message(proc.stderr.decode(errors="replace")) or f"skopeo exit code {proc.returncode}"
        if _MISSING_TAG.search(detail):
            return None
        self._raise(detail)

    def _raise(self, detail: str) -> NoReturn:
        if _TLS.search(detail):
            raise RegistryRejected(
                self.registry_url,
                f"TLS failed: {detail}",
                "for a plain-HTTP test registry set image.registry_insecure: true; otherwise fix its certificate",
            )
        if "no such host" in detail:
            raise RegistryRejected(
                self.registry_url, f"host {self.host} does not resolve: {detail}", "check image.registry_url"
            )
        if _AUTH.search(detail):
            raise RegistryRejected(self.registry_url, detail, _CREDENTIALS_FIX)
        if _TRANSIENT.search(detail):
            raise RegistryUnavailable(self.registry_url, detail)
        raise RegistryRejected(self.registry_url, detail, "check image.registry_url and image.repository")


def _message(stderr: str) -> str:
    """skopeo's error without its log prefix (`time=... level=fatal msg="..."`)."""
    found = re.findall(r'msg="((?:[^"\\]|\\.)*)"', stderr)
    text = found[-1].replace('\\"', '"') if found else stderr.strip()
    return text.removeprefix("Error parsing image name ")


def _media_type(document: dict[str, object]) -> str:
    """The media type of a manifest that does not name its own (OCI allows leaving it out)."""
    return MANIFEST_TYPES[2] if "manifests" in document else MANIFEST_TYPES[0]
