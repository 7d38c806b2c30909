"""A fake Kubernetes API server on 127.0.0.1: the endpoints KubernetesLauncher calls, nothing more.

No kube-apiserver with etcd can be installed on the CI machine (Debian packages only etcd-server and kubectl,
PyPI and npm no apiserver), so the launcher's calls go through the real `kubernetes` client to this server:
objects are kept as created (the test plays the controllers by setting their status and adding pods), pod logs
are what the test sets, and a pod exec runs its command on this machine (the "pod" is here), answered over the
websocket channel protocol (v4.channel.k8s.io) that the client's stream() speaks.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
import subprocess
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_CUSTOM = re.compile(r"/apis/([^/]+)/([^/]+)(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+))?")
_CORE = re.compile(r"/api/v1/namespaces/([^/]+)/(configmaps|pods)(?:/([^/]+))?(?:/(log|exec))?")


class FakeKube:
    """The server's state: objects by (plural, namespace, name), pod logs, and every exec's argv."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.logs: dict[tuple[str, str], str] = {}
        self.execs: list[dict[str, Any]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """The server's address."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig whose current context is this server (no credentials)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }))  # fmt: skip
        return path

    def add_pod(self, namespace: str, name: str, labels: dict[str, str], container: str, **status: Any) -> None:
        """A pod as the controllers would create it, with one container and `status` (containerStatuses, ...)."""
        self.objects[("pods", namespace, name)] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, "creationTimestamp": _now()},
            "spec": {"containers": [{"name": container, "image": "img"}], "hostname": status.pop("hostname", name)},
            "status": status,
        }  # fmt: skip

    def __enter__(self) -> FakeKube:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _handler(kube: FakeKube) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class names it
            pass

        def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _status(self, code: int, reason: str) -> None:
            self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                              "code": code})  # fmt: skip

        def _route(self) -> tuple[str, str, str | None, str | None, dict[str, list[str]]]:
            """(plural, namespace, name, subresource, query); 404 when no route matches."""
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            core = _CORE.fullmatch(url.path)
            if core:
                return core[2], core[1], core[3], core[4], query
            custom = _CUSTOM.fullmatch(url.path)
            if custom:
                return custom[4], custom[3] or "", custom[5], None, query
            raise LookupError(url.path)

        def do_POST(self) -> None:
            plural, namespace, _, _, _ = self._route()
            obj = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            key = (plural, namespace, obj["metadata"]["name"])
            if key in kube.objects:
                self._status(409, "AlreadyExists")
                return
            obj["metadata"].update(creationTimestamp=_now(), uid=f"uid-{len(kube.objects)}")
            kube.objects[key] = obj
            self._send(201, obj)

        def do_GET(self) -> None:
            plural, namespace, name, sub, query = self._route()
            if sub == "exec":
                self._exec(namespace, name or "", query)
            elif sub == "log":
                if ("pods", namespace, name) not in kube.objects:
                    self._status(404, "NotFound")
                else:
                    self._send(200, kube.logs.get((namespace, name or ""), ""), "text/plain")
            elif name is None:  # a list, narrowed by labelSelector a=b,c=d
                wanted = dict(kv.split("=", 1) for kv in query.get("labelSelector", [""])[0].split(",") if kv)
                items = [obj for (p, ns, _), obj in kube.objects.items() if p == plural and ns == namespace
                         and wanted.items() <= obj["metadata"].get("labels", {}).items()]  # fmt: skip
                self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
            elif (plural, namespace, name) in kube.objects:
                self._send(200, kube.objects[(plural, namespace, name)])
            else:
                self._status(404, "NotFound")

        def do_DELETE(self) -> None:
            plural, namespace, name, _, _ = self._route()
            if kube.objects.pop((plural, namespace, name or ""), None) is None:
                self._status(404, "NotFound")
            else:
                self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

        def _exec(self, namespace: str, pod: str, query: dict[str, list[str]]) -> None:
            """Run the exec's command here and answer over the websocket channels: 1 stdout, 2 stderr, 3 the status."""
            argv, container = query.get("command", []), query.get("container", [""])[0]
            kube.execs.append({"namespace": namespace, "pod": pod, "container": container, "argv": argv})
            done = subprocess.run(argv, capture_output=True, check=False)
            status: dict[str, Any] = {"metadata": {}, "status": "Success"}
            if done.returncode:
                status = {"metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
                          "details": {"causes": [{"reason": "ExitCode", "message": str(done.returncode)}]}}  # fmt: skip
            key = self.headers["Sec-WebSocket-Key"]
            accept = base64.b64encode(hashlib.sha1((key + _WS_GUID).encode()).digest()).decode()  # noqa: S324
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept)
            self.send_header("Sec-WebSocket-Protocol", "v4.channel.k8s.io")
            self.end_headers()
            for channel, data in ((1, done.stdout), (2, done.stderr), (3, json.dumps(status).encode())):
                self.wfile.write(_frame(0x2, bytes([channel]) + data))
            self.wfile.write(_frame(0x8, struct.pack("!H", 1000)))
            self.wfile.flush()
            self.close_connection = True

    return Handler


def _frame(opcode: int, payload: bytes) -> bytes:
    """One final, unmasked websocket frame (a server's)."""
    head = bytes([0x80 | opcode])
    if len(payload) < 126:
        return head + bytes([len(payload)]) + payload
    return head + bytes([126]) + struct.pack("!H", len(payload)) + payload
