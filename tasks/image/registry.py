"""A small client of the OCI distribution API: does a tag exist, and what is its manifest digest.

Credentials, when the registry needs them, come from the environment
(`TDEPLOY_REGISTRY_USERNAME`, `TDEPLOY_REGISTRY_PASSWORD`), never from the spec.
Anonymous, Basic and Bearer-token (`WWW-Authenticate: Bearer realm=...`) registries are handled.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import NoReturn

from tasks.image.errors import RegistryRejected, RegistryUnavailable

USERNAME_ENV, PASSWORD_ENV = "TDEPLOY_REGISTRY_USERNAME", "TDEPLOY_REGISTRY_PASSWORD"
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_CREDENTIALS_FIX = f"set {USERNAME_ENV} and {PASSWORD_ENV} for a registry that needs a login"


@dataclass(frozen=True)
class RemoteManifest:
    """A tag's manifest as the registry serves it."""

    digest: str
    media_type: str
    config_digest: str | None
    size_bytes: int


def credentials() -> tuple[str, str] | None:
    """(username, password) from the environment, or None for anonymous access."""
    user, password = os.environ.get(USERNAME_ENV), os.environ.get(PASSWORD_ENV)
    return (user, password) if user and password is not None else None


class RegistryClient:
    """Read-only access to one registry (`host[:port][/namespace]`)."""

    def __init__(self, registry_url: str, insecure: bool = False, timeout_s: float = 30.0) -> None:
        self.registry_url = registry_url
        self.host, _, self.namespace = registry_url.partition("/")
        self.base = f"{'http' if insecure else 'https'}://{self.host}/v2"
        self.timeout_s = timeout_s
        self._authorization: str | None = None

    def repository_path(self, repository: str) -> str:
        """The repository's path on the registry (namespace included)."""
        return f"{self.namespace}/{repository}" if self.namespace else repository

    def reference(self, repository: str, tag: str) -> str:
        """`host[:port]/[namespace/]repository:tag`."""
        return f"{self.host}/{self.repository_path(repository)}:{tag}"

    def manifest(self, repository: str, tag: str) -> RemoteManifest | None:
        """The manifest of `repository:tag`, or None when the tag does not exist."""
        url = f"{self.base}/{self.repository_path(repository)}/manifests/{tag}"
        status, headers, body = self._get(url, {"Accept": ", ".join(MANIFEST_TYPES)})
        if status == 404:
            return None
        document = json.loads(body)
        digest = headers.get("Docker-Content-Digest") or "sha256:" + hashlib.sha256(body).hexdigest()
        config = document.get("config") or {}
        parts = [config] + list(document.get("layers") or document.get("manifests") or [])
        return RemoteManifest(
            digest=digest,
            media_type=document.get("mediaType") or headers.get("Content-Type", ""),
            config_digest=config.get("digest"),
            size_bytes=sum(int(p.get("size", 0)) for p in parts),
        )

    def _get(self, url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """GET with the registry's auth handshake; 404 is returned, other failures raise typed errors."""
        for attempt in range(2):
            request = urllib.request.Request(url, headers=dict(headers))
            if self._authorization:
                request.add_header("Authorization", self._authorization)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return response.status, dict(response.headers), response.read()
            except urllib.error.HTTPError as err:
                if err.code == 404:
                    return 404, dict(err.headers), b""
                if err.code == 401 and attempt == 0:
                    self._authorization = self._authorize(err.headers.get("WWW-Authenticate", ""))
                    continue
                self._raise_http(err)
            except (urllib.error.URLError, OSError) as err:
                self._raise_network(err)
        raise RegistryRejected(self.registry_url, f"{url}: still unauthorized after logging in", _CREDENTIALS_FIX)

    def _authorize(self, challenge: str) -> str:
        """The Authorization header answering a 401 challenge (Basic, or a Bearer token from the realm)."""
        creds = credentials()
        scheme, _, params_text = challenge.partition(" ")
        if scheme.lower() == "basic":
            if creds is None:
                raise RegistryRejected(self.registry_url, "it asks for a login", _CREDENTIALS_FIX)
            return "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
        if scheme.lower() != "bearer":
            raise RegistryRejected(self.registry_url, f"unsupported auth challenge {challenge!r}", _CREDENTIALS_FIX)
        params = dict(re.findall(r'(\w+)="([^"]*)"', params_text))
        realm = params.pop("realm", "")
        if not realm:
            raise RegistryRejected(self.registry_url, f"bearer challenge without realm: {challenge!r}", "")
        request = urllib.request.Request(f"{realm}?{urllib.parse.urlencode(params)}")
        if creds is not None:
            request.add_header("Authorization", "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode())
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            self._raise_http(err)
        except (urllib.error.URLError, OSError) as err:
            self._raise_network(err)
        token = answer.get("token") or answer.get("access_token")
        if not token:
            raise RegistryRejected(self.registry_url, f"token service {realm} returned no token", _CREDENTIALS_FIX)
        return f"Bearer {token}"

    def _raise_http(self, err: urllib.error.HTTPError) -> NoReturn:
        detail = f"HTTP {err.code} for {err.url}"
        if err.code >= 500 or err.code == 429:
            raise RegistryUnavailable(self.registry_url, detail) from err
        if err.code in (401, 403):
            raise RegistryRejected(self.registry_url, detail, _CREDENTIALS_FIX) from err
        raise RegistryRejected(self.registry_url, detail, "check image.registry_url and image.repository") from err

    def _raise_network(self, err: OSError) -> NoReturn:
        reason = getattr(err, "reason", err)
        if isinstance(reason, ssl.SSLError):
            raise RegistryRejected(
                self.registry_url,
                f"TLS failed: {reason}",
                "for a plain-HTTP test registry set image.registry_insecure: true; otherwise fix its certificate",
            ) from err
        if isinstance(reason, socket.gaierror):
            raise RegistryRejected(
                self.registry_url, f"host {self.host} does not resolve: {reason}", "check image.registry_url"
            ) from err
        raise RegistryUnavailable(self.registry_url, str(reason)) from err
